# tn._native: the NeuronCore's native engines, C kernels via cffi and the Cython instruction-stream runner.
"""Native code of the software NeuronCore.

``tn._native._kernels`` is the cffi (API mode) module with the C math kernels;
``tn._native.engine`` is the Cython module that runs encoded instruction streams.
"""
