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
