# Builds tn's native extensions: the cffi kernels module and the Cython engine (metadata lives in pyproject.toml).
import os
import sys

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _native.build_cffi import c_sources  # noqa: E402

C_SOURCES = c_sources()
# No CPU-specific flags: -fno-math-errno and -fno-trapping-math only let GCC vectorise sqrt and if-convert
# float selects (results are unchanged; tn never reads errno or FP exception flags); -ffp-contract=off keeps
# multiply-adds unfused in the AVX-512/AVX2 clones of the kernels (same rounding as the portable code).
COMPILE_ARGS = ["-O3", "-std=gnu11", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]

engine = Extension(
    "tn._native.engine",
    sources=["_native/engine.pyx"] + C_SOURCES,
    include_dirs=["_native", numpy.get_include()],
    extra_compile_args=COMPILE_ARGS,
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
)

setup(
    ext_modules=cythonize([engine], compiler_directives={"language_level": "3"}),
    cffi_modules=["_native/build_cffi.py:ffibuilder"],
)
