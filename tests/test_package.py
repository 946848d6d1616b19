# Package-level checks: tn imports, exposes one top-level name, and both native modules load and agree.
import importlib

import tn


def test_native_modules_load_and_agree():
    from tn._native import _kernels, engine

    assert _kernels.lib.tn_abi_version() == engine.abi_version()


def test_subpackages_map_into_tn():
    assert importlib.import_module("tn.adaptive").__name__ == "tn.adaptive"
    assert importlib.import_module("tn._native").__name__ == "tn._native"


def test_errors_share_a_base():
    for err in (tn.TracingError, tn.UnsupportedOpError, tn.NeuronError):
        assert issubclass(err, tn.TnError)


def test_every_subpackage_is_installed_by_a_plain_pip_install():
    """pyproject lists packages explicitly (_native/ is mapped): a new tn/ subpackage must be listed."""
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        "tn" + "".join("." + part for part in init.parent.relative_to(root / "tn").parts)
        for init in (root / "tn").rglob("__init__.py")
    }
    missing = on_disk - listed
    assert not missing, f"add {sorted(missing)} to [tool.setuptools] packages in pyproject.toml"
