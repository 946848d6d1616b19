# Builds tn's native extensions: the cffi kernels module and the Cython engine (metadata lives in pyproject.toml).
import importlib.util
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

# _native/build_cffi.py by path: importing it as part of the _native package would run tn._native's __init__,
# which needs an installed tn.
_spec = importlib.util.spec_from_file_location(
    "tn_build_cffi", os.path.join(os.path.dirname(os.path.abspath(__file__)), "_native", "build_cffi.py"))
build_cffi = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_cffi)
COMPILE_ARGS = build_cffi.COMPILE_ARGS

C_SOURCES = build_cffi.c_sources()
# No CPU-specific flags: -fno-math-errno and -fno-trapping-math only let GCC vectorise sqrt and if-convert
# float selects (results are unchanged; tn never reads errno or FP exception flags); -ffp-contract=off keeps
# multiply-adds unfused in the AVX-512/AVX2 clones of the kernels (same rounding as the portable code).
# COMPILE_ARGS and the TN_NATIVE_ISA macro (which clones the kernels get) come from _native/build_cffi.py, shared
# by both extensions.

engine = Extension(
    "tn._native.engine",
    sources=["_native/engine.pyx"] + C_SOURCES,
    include_dirs=["_native", numpy.get_include()],
    extra_compile_args=COMPILE_ARGS,
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")] + build_cffi.native_macros(),
)

setup(
    ext_modules=cythonize([engine], compiler_directives={"language_level": "3"}),
    cffi_modules=["_native/build_cffi.py:ffibuilder"],
)
