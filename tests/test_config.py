# Tests of tn.config: one parsing rule per kind, overrides over the environment, the README lists every setting.
import pathlib

import pytest

import tn
import tn.config as cfg
from tn.neuron.arch import default_arch_name, get_arch


@pytest.mark.parametrize("text,expected", [("1", True), ("yes", True), ("ON", True), ("true", True), ("0", False),
                                           ("", False), ("off", False), ("No", False)])
def test_flags_share_one_rule(text, expected, monkeypatch):
    monkeypatch.setenv("TN_STRICT", text)
    assert cfg.get("strict") is expected


def test_a_flag_that_is_not_one_names_the_variable(monkeypatch):
    monkeypatch.setenv("TN_STRICT", "maybe")
    with pytest.raises(cfg.ConfigError, match="TN_STRICT='maybe'"):
        cfg.get("strict")
    assert issubclass(cfg.ConfigError, tn.TnError) and issubclass(cfg.ConfigError, ValueError)


@pytest.mark.parametrize("text,expected", [("4096", 4096), ("16k", 16 << 10), ("1.5m", 3 << 19), ("2G", 2 << 30)])
def test_sizes(text, expected, monkeypatch):
    monkeypatch.setenv("TN_DEVICE_MEMORY", text)
    assert cfg.get("device_memory") == expected


def test_bad_size_and_int(monkeypatch):
    monkeypatch.setenv("TN_DEVICE_MEMORY", "lots")
    with pytest.raises(cfg.ConfigError, match="TN_DEVICE_MEMORY"):
        cfg.get("device_memory")
    monkeypatch.setenv("TN_DEVICE_CACHE", "x")
    with pytest.raises(cfg.ConfigError, match="not an integer"):
        cfg.get("device_cache")


def test_log_words(monkeypatch):
    monkeypatch.setenv("TN_LOG", "recompiles, adaptive")
    assert cfg.log_enabled("adaptive") and cfg.log_enabled("recompiles") and not cfg.log_enabled("windows")
    monkeypatch.setenv("TN_LOG", "all")
    assert cfg.log_enabled("windows")
    monkeypatch.delenv("TN_LOG")
    assert not cfg.log_enabled("adaptive")


def test_override_wins_over_environment_and_is_restored(monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")
    with cfg.override(strict=False):
        assert cfg.get("strict") is False
        with cfg.override(strict="yes"):
            assert cfg.get("strict") is True
        assert cfg.get("strict") is False
    assert cfg.get("strict") is True
    cfg.set(strict=False)
    try:
        assert cfg.get("strict") is False
    finally:
        cfg.unset("strict")
    assert cfg.get("strict") is True


def test_unknown_setting_and_bad_choice(monkeypatch):
    with pytest.raises(cfg.ConfigError, match="unknown tn setting 'nope'"):
        cfg.get("nope")
    with pytest.raises(cfg.ConfigError, match="trn1, trn2"):
        cfg.set(arch="trn3")
    monkeypatch.setenv("TN_ARCH", "trn9")
    with pytest.raises(cfg.ConfigError, match="TN_ARCH='trn9'"):
        cfg.get("arch")


def test_architecture_follows_arch_then_instance(monkeypatch):
    monkeypatch.delenv("TN_ARCH", raising=False)
    monkeypatch.delenv("TN_INSTANCE", raising=False)
    assert default_arch_name() == "trn2" and get_arch() is get_arch("trn2")
    monkeypatch.setenv("TN_INSTANCE", "trn1.32xlarge")
    assert get_arch().name == "trn1"
    with cfg.override(arch="trn2"):
        assert get_arch().name == "trn2"
    monkeypatch.setenv("TN_ARCH", "trn2")
    assert get_arch().name == "trn2"


def test_strict_setting_reaches_the_doors(monkeypatch):
    from tn.device import eager
    from tn.lower.compiler import strict_default

    monkeypatch.setenv("TN_STRICT", "1")
    assert strict_default() and eager.strict()
    monkeypatch.setenv("TN_STRICT", "0")
    assert not strict_default() and not eager.strict()


def test_no_module_reads_tn_variables_itself():
    root = pathlib.Path(tn.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "config.py":
            continue
        text = path.read_text()
        if "environ" in text and '"TN_' in text:
            offenders.append(str(path.relative_to(root)))
    assert not offenders, f"these modules read TN_* variables themselves instead of tn.config: {offenders}"


def test_readme_lists_every_setting():
    readme = (pathlib.Path(tn.__file__).parent.parent / "README.md").read_text()
    missing = [s.env for s in cfg.SETTINGS.values() if f"`{s.env}`" not in readme]
    assert not missing, f"README.md does not list {missing}"
