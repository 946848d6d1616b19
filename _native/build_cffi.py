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
    extra_compile_args=["-O3", "-std=gnu11", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"],  # same as setup.py
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
