# cython: language_level=3, boundscheck=False, wraparound=False
# The Cython engine of the software NeuronCore: runs encoded instruction streams over the C kernels.
"""Cython side of the native NeuronCore (grown by the NeuronCore issue)."""

cdef extern from "kernels.h":
    int tn_abi_version()


def abi_version():
    """The C kernels' ABI version, as seen from the Cython engine (must match the cffi module's)."""
    return tn_abi_version()
