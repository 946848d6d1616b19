# cffi (API mode) build script for tn._native._kernels: compiles every C file in _native/ into one module.
"""Build description of the cffi module ``tn._native._kernels``.

setuptools runs this through ``cffi_modules`` in ``setup.py``. The C
declarations exposed to Python are read from ``kernels.h`` (preprocessor lines
stripped), so a kernel is declared in exactly one place.
"""
import glob
import os
import re

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))


def _cdefs_from_header(path: str) -> str:
    """The header's declarations without preprocessor lines and comments (cffi's cdef cannot parse them)."""
    with open(path) as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


#: Values of the build setting TN_NATIVE_ISA (tn.config's ``native_isa`` lists the same), each with the value of the
#: C macro TN_NATIVE_ISA that kernels.c's TN_HOT follows: auto = AVX-512 (x86-64-v4), AVX2 and portable clones picked
#: by the loader; avx2 = AVX2 and portable clones only; portable = no clones (the code any x86-64 CPU runs).
NATIVE_ISAS = {"auto": 2, "avx2": 1, "portable": 0}

#: Compiler flags of both extensions (see setup.py for why each is there; none is CPU-specific).
COMPILE_ARGS = ["-O3", "-std=gnu11", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]


def native_isa() -> str:
    """The build setting ``TN_NATIVE_ISA`` (auto, avx2 or portable; unset or empty: auto); anything else raises.

    tn/config.py lists it with the other settings (and the README's table), but the build reads it here, for
    setup.py and this script alike: it runs before tn can be imported. ``tn._native.build_info()`` reports what the
    installed build used.
    """
    text = os.environ.get("TN_NATIVE_ISA", "").strip() or "auto"
    if text not in NATIVE_ISAS:
        raise ValueError(f"TN_NATIVE_ISA={text!r}: expected one of {', '.join(NATIVE_ISAS)}")
    return text


def native_macros() -> list:
    """The -D macros of the C sources for the build setting: ``[("TN_NATIVE_ISA", "2")]`` for auto, etc."""
    return [("TN_NATIVE_ISA", str(NATIVE_ISAS[native_isa()]))]


# Files in _native/ that Cython and cffi generate: never inputs of the build.
GENERATED_C = {"engine.c", "_kernels.c"}


def c_sources() -> list:
    """Every hand-written C source of the native kernels, relative to the project root."""
    return sorted(
        os.path.relpath(p, os.path.dirname(HERE))
        for p in glob.glob(os.path.join(HERE, "*.c"))
        if os.path.basename(p) not in GENERATED_C
    )


ffibuilder = FFI()
ffibuilder.cdef(_cdefs_from_header(os.path.join(HERE, "kernels.h")))
ffibuilder.set_source(
    "tn._native._kernels",
    '#include "kernels.h"',
    sources=c_sources(),
    include_dirs=["_native"],
    define_macros=native_macros(),
    extra_compile_args=COMPILE_ARGS,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
