# tn._native: the NeuronCore's native engines, C kernels via cffi and the Cython instruction-stream runner.
"""Native code of the software NeuronCore.

``tn._native._kernels`` is the cffi (API mode) module with the C math kernels;
``tn._native.engine`` is the Cython module that runs encoded instruction streams.
Each links its own copy of the C kernels.

Two settings choose which CPU code runs, so every path a machine can run can
be tested on it (issue 14):

* ``TN_NATIVE_ISA`` (build time, read by ``setup.py``): the clones of the hot
  elementwise kernels (auto, avx2, portable);
* ``TN_MATMUL_ISA`` (run time, applied here when the package loads): the matmul
  kernels' path (auto, generic, avx2, avx512, amx), in both modules.

:func:`build_info` reports both.
"""
from typing import Dict, Tuple

from .. import config as _config
from . import _kernels, engine

__all__ = ["build_info", "matmul_isas", "set_matmul_isa"]

#: Matmul code paths by name, widest last ("auto" picks the widest the CPU and OS allow).
MATMUL_ISAS: Tuple[str, ...] = ("generic", "avx2", "avx512", "amx")


def _matmul_isa() -> str:
    return _kernels.ffi.string(_kernels.lib.tn_matmul_isa()).decode()


def matmul_isas() -> Tuple[str, ...]:
    """The matmul code paths this CPU and OS can run (always ``generic``), narrowest first."""
    now = _matmul_isa()
    have = tuple(name for name in MATMUL_ISAS if _kernels.lib.tn_matmul_set_isa(name.encode()) == 0)
    _kernels.lib.tn_matmul_set_isa(now.encode())
    return have


def set_matmul_isa(name: str) -> str:
    """Make both native modules' matmul kernels take path ``name`` (auto, generic, avx2, avx512 or amx).

    Returns the path now in force (``auto`` resolves to one). A name this CPU cannot run is a
    :class:`tn.config.ConfigError` naming the paths it has; nothing changes then.
    """
    name = _config.SETTINGS["matmul_isa"].check(str(name).strip().lower())
    if _kernels.lib.tn_matmul_set_isa(name.encode()) != 0:
        raise _config.ConfigError(f"TN_MATMUL_ISA={name!r}: this CPU/OS has no {name} matmul path; it has "
                                  f"{', '.join(matmul_isas())} (or auto)")
    if not engine.set_matmul_isa(name):  # same C code and CPU: cannot differ from the cffi module
        raise _config.ConfigError(f"TN_MATMUL_ISA={name!r}: the engine cannot take the {name} matmul path")
    return _matmul_isa()


def build_info() -> Dict[str, object]:
    """What the native build compiled and what runs now.

    ``native_isa``: the build setting TN_NATIVE_ISA it used; ``clones``: the target clones of the hot elementwise
    kernels (empty: portable code only); ``clone``: the clone the loader picks on this CPU; ``matmul_isa`` and
    ``engine_matmul_isa``: the matmul path in force in the cffi module and in the engine.

    >>> sorted(build_info())
    ['clone', 'clones', 'engine_matmul_isa', 'matmul_isa', 'native_isa']
    """
    lib, ffi = _kernels.lib, _kernels.ffi
    return {
        "native_isa": ffi.string(lib.tn_native_isa()).decode(),
        "clones": tuple(ffi.string(lib.tn_native_clones()).decode().split()),
        "clone": ffi.string(lib.tn_native_clone()).decode(),
        "matmul_isa": _matmul_isa(),
        "engine_matmul_isa": engine.matmul_isa(),
    }


set_matmul_isa(_config.get("matmul_isa"))
