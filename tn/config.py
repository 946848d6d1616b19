# tn's settings in one place: every TN_* environment variable, its type, default and meaning, and Python overrides.
"""Every setting tn reads, in one table.

A setting has a name (``"strict"``), an environment variable (``TN_STRICT``),
a kind that fixes how its text is parsed, a default and a one-line meaning.
:func:`get` returns the value in force: a Python override
(:func:`set` / :func:`override`) if there is one, else the environment
variable, else the default. The environment is read at each call, so a test
that sets ``TN_STRICT`` with ``monkeypatch.setenv`` sees it at once; modules on
hot paths read a setting once at import and say so in its meaning.

Flags share one rule: ``1 true yes on`` are true, ``0 false no off`` and the
empty string are false, anything else is a :class:`ConfigError` naming the
variable. Sizes take bytes or a number with ``k``/``m``/``g`` (``16g``).

>>> import tn.config as cfg
>>> cfg.get("strict")
False
>>> with cfg.override(strict=True):
...     cfg.get("strict")
True
>>> print(cfg.describe().splitlines()[0])
| variable | default | meaning |

``python -m tn.config`` prints the table (the README carries the same).
"""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from .errors import TnError

__all__ = ["Setting", "SETTINGS", "ConfigError", "get", "set", "override", "unset", "describe", "parse_flag",
           "parse_size", "log_enabled"]


class ConfigError(TnError, ValueError):
    """A setting's value cannot be parsed (names the variable and what it accepts)."""


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def parse_flag(text: str, env: str = "setting") -> bool:
    """``text`` as a flag: ``1/true/yes/on`` -> True, ``0/false/no/off/''`` -> False, else :class:`ConfigError`."""
    v = text.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ConfigError(f"{env}={text!r} is not a flag: use 1/true/yes/on or 0/false/no/off")


def parse_size(text: str, env: str = "setting") -> int:
    """``text`` as bytes: an integer, or a number with a ``k``/``m``/``g`` suffix (binary units)."""
    v = text.strip()
    if not v:
        return 0
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(v[-1].lower(), 1)
    try:
        return int(float(v[:-1] if mult != 1 else v) * mult)
    except ValueError:
        raise ConfigError(f"{env}={text!r} is not a size; use bytes or a number with k/m/g (e.g. 16g)") from None


def _parse_int(text: str, env: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ConfigError(f"{env}={text!r} is not an integer") from None


def _parse_str(text: str, env: str) -> str:
    return text.strip()


def _parse_words(text: str, env: str) -> frozenset:
    return frozenset(text.replace(",", " ").lower().split())


_PARSERS: Dict[str, Callable[[str, str], Any]] = {
    "flag": parse_flag, "size": parse_size, "int": _parse_int, "str": _parse_str, "words": _parse_words,
}


@dataclass(frozen=True)
class Setting:
    """One setting: ``name`` (Python), ``env`` (variable), ``kind`` (flag/size/int/str/words), default, meaning.

    ``choices`` (for ``str``) lists the accepted values; ``None`` as a default means "not set" (the code that
    reads it derives the value, e.g. the architecture from the instance type).
    """

    name: str
    env: str
    kind: str
    default: Any
    doc: str
    choices: Optional[Tuple[str, ...]] = None

    def parse(self, text: str) -> Any:
        """The value of ``text`` (the variable's content) for this setting."""
        value = _PARSERS[self.kind](text, self.env)
        if self.kind == "str" and self.choices and value and value not in self.choices:
            raise ConfigError(f"{self.env}={text!r}: expected one of {', '.join(self.choices)}")
        if self.kind == "str" and not value:
            return self.default
        return value

    def check(self, value: Any) -> Any:
        """``value`` given from Python, converted like the variable's text would be (strings are parsed; None
        for a setting whose default is None means "derive it", as when the variable is unset)."""
        if value is None and self.default is None:
            return None
        if isinstance(value, str) and self.kind != "str":
            return self.parse(value)
        if self.kind == "flag":
            return bool(value)
        if self.kind in ("size", "int"):
            return int(value)
        if self.kind == "words":
            return frozenset(w.lower() for w in value)
        if self.kind == "str" and value is not None and self.choices and value not in self.choices:
            raise ConfigError(f"{self.name}={value!r}: expected one of {', '.join(self.choices)}")
        return value


def _settings(*items: Setting) -> Dict[str, Setting]:
    return {s.name: s for s in items}


#: Every setting tn reads, by Python name.
SETTINGS: Dict[str, Setting] = _settings(
    Setting("backend", "TN_BACKEND", "str", None,
            "default backend of tn.jit and tn.adaptive (neuron, reference, or one registered with "
            "tn.jit.register_backend)"),
    Setting("strict", "TN_STRICT", "flag", False,
            "a host fallback (an op with no NeuronCore lowering) raises tn.UnsupportedOpError instead of running "
            "on the host"),
    Setting("log", "TN_LOG", "words", frozenset(),
            "what to log to the 'tn' logger: recompiles (tn.jit cache misses), splits (tn.jit functions run split "
            "at value reads), adaptive (tn.adaptive decisions), windows (adaptive eager windows of the neuron "
            "device), all"),
    Setting("verify", "TN_VERIFY", "flag", False,
            "tn.passes.optimize verifies the IR after every pass and names the pass that broke it (read at import)"),
    Setting("no_warmup", "TN_NO_WARMUP", "flag", False,
            "import tn skips paying torch's one-time tracing imports (~1 s) up front"),
    Setting("arch", "TN_ARCH", "str", None,
            "NeuronCore architecture modelled: trn1 (NeuronCore-v2) or trn2 (NeuronCore-v3); unset, it follows "
            "TN_INSTANCE (default trn2)", ("trn1", "trn2")),
    Setting("instance", "TN_INSTANCE", "str", None,
            "the instance type modelled: trn1.2xlarge, trn1.32xlarge, trn1n.32xlarge, trn2.3xlarge, "
            "trn2.48xlarge; torch.neuron.device_count() is its logical cores; unset, the one-chip instance of "
            "TN_ARCH (trn2.3xlarge: 4 devices)"),
    Setting("lnc", "TN_LNC", "int", None,
            "logical NeuronCore size: 1 or 2 physical cores per torch device (unset: 2 on trn2, 1 on trn1)"),
    Setting("instances", "TN_INSTANCES", "int", 1,
            "instances (nodes) of TN_INSTANCE the modelled job spans; a process sees the devices of one instance, "
            "the collective model the rest"),
    Setting("visible_cores", "TN_VISIBLE_CORES", "str", None,
            "the logical cores of the instance this process sees as its devices, like NEURON_RT_VISIBLE_CORES "
            "('3', '0-3', '0,2'): neuron:0 is the first; unset, every core of the instance"),
    Setting("device_memory", "TN_DEVICE_MEMORY", "size", 0,
            "cap on the neuron device's memory per device (bytes or 16g; 0: no cap; read when the device "
            "starts)"),
    Setting("device_fastpath", "TN_DEVICE_FASTPATH", "flag", True,
            "small eager ops on the neuron device run through native kernels instead of one-op programs"),
    Setting("device_fast_numel", "TN_DEVICE_FAST_NUMEL", "int", 65536,
            "largest tensor (elements) the device's small-op fast path takes (read at import)"),
    Setting("device_cache", "TN_DEVICE_CACHE", "int", 4096,
            "eager one-op programs the neuron device keeps compiled (LRU entries; read at import)"),
    Setting("eager_mode", "TN_EAGER_MODE", "str", "op",
            "eager ops on the neuron device: op (each op its own program, run at once) or adaptive (ops queued "
            "into windows compiled as one program each, run when a value is needed; torch.neuron.set_eager_mode)",
            ("op", "adaptive")),
    Setting("jit_split", "TN_JIT_SPLIT", "flag", True,
            "tn.jit on the neuron backend runs a function that reads tensor values (.item(), nonzero, `if t:`) as "
            "device windows split at the reads; 0 refuses it with the TracingError (as tn.jit(fn, fullgraph=True))"),
    Setting("dynamo_capture", "TN_DYNAMO_CAPTURE", "flag", True,
            "torch.compile(backend='neuron') turns on Dynamo's capture_scalar_outputs and "
            "capture_dynamic_output_shape_ops (process-wide) so value reads reach tn; 0 leaves torch's settings alone"),
    Setting("window_ops", "TN_WINDOW_OPS", "int", 1024,
            "adaptive eager: most ops one window gathers before it is run (the buffer limit)"),
    Setting("dist_check", "TN_DIST_CHECK", "flag", True,
            "each collective of the neuron torch.distributed backend first all-gathers a small metadata record "
            "(operation, dtype, shape, root, splits) so ranks that disagree raise CollectiveMismatchError instead "
            "of hanging or mixing bytes (one extra small all-gather per collective; 0 skips it)"),
    Setting("engine_host_times", "TN_ENGINE_HOST_TIMES", "flag", False,
            "profiles also record the host time each native engine call took (read at import)"),
    Setting("native_isa", "TN_NATIVE_ISA", "str", "auto",
            "build-time (read by setup.py when pip builds tn, not at run time): the CPU code the hot elementwise "
            "kernels are compiled for: auto (AVX-512, AVX2 and portable clones, the loader picks), avx2 (AVX2 and "
            "portable), portable (no clones); tn._native.build_info() reports what the build used",
            ("auto", "avx2", "portable")),
    Setting("matmul_isa", "TN_MATMUL_ISA", "str", "auto",
            "the TensorE matmul kernels' code path: auto (the widest this CPU has), generic (portable C), avx2, "
            "avx512 or amx; a path the CPU lacks is a ConfigError naming the ones it has (read when tn._native "
            "loads; tn._native.set_matmul_isa changes it)", ("auto", "generic", "avx2", "avx512", "amx")),
    Setting("test_backends", "TN_TEST_BACKENDS", "str", None,
            "tn's test suite only: the tn.jit backends the backend-parametrized tests run on, comma-separated "
            "(unset: reference,neuron; read by tests/conftest.py)"),
)

_OVERRIDES: Dict[str, Any] = {}
_LOCK = threading.Lock()


def _setting(name: str) -> Setting:
    try:
        return SETTINGS[name]
    except KeyError:
        raise ConfigError(f"unknown tn setting {name!r}; known: {', '.join(sorted(SETTINGS))}") from None


def get(name: str) -> Any:
    """The value in force for setting ``name``: Python override, else ``TN_*`` variable, else the default."""
    s = _setting(name)
    if name in _OVERRIDES:
        return _OVERRIDES[name]
    text = os.environ.get(s.env)
    if text is None:
        return s.default
    return s.parse(text)


def set(**values: Any) -> None:
    """Override settings from Python (``tn.config.set(strict=True, arch="trn1")``); wins over the environment."""
    checked = {k: _setting(k).check(v) for k, v in values.items()}
    with _LOCK:
        _OVERRIDES.update(checked)


def unset(*names: str) -> None:
    """Drop the Python overrides of ``names`` (the environment and defaults apply again)."""
    with _LOCK:
        for n in names:
            _setting(n)
            _OVERRIDES.pop(n, None)


_MISSING = object()


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Context manager: the settings hold ``values`` inside the block, and what they were after it."""
    checked = {k: _setting(k).check(v) for k, v in values.items()}
    with _LOCK:
        saved = {k: _OVERRIDES.get(k, _MISSING) for k in checked}
        _OVERRIDES.update(checked)
    try:
        yield
    finally:
        with _LOCK:
            for k, v in saved.items():
                if v is _MISSING:
                    _OVERRIDES.pop(k, None)
                else:
                    _OVERRIDES[k] = v


def log_enabled(what: str) -> bool:
    """True when ``TN_LOG`` (setting ``log``) names ``what`` or ``all``."""
    flags = get("log")
    return bool(flags) and (what in flags or "all" in flags)


def _default_text(s: Setting) -> str:
    if s.default is None:
        return "(derived)"
    if s.kind == "flag":
        return "1" if s.default else "0"
    if s.kind == "words":
        return "(none)" if not s.default else ",".join(sorted(s.default))
    return str(s.default)


def describe() -> str:
    """A Markdown table of every setting: variable, default, meaning."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for s in SETTINGS.values():
        rows.append(f"| `{s.env}` | `{_default_text(s)}` | {s.doc} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(describe())
