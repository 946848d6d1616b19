# tn.neuron: the software NeuronCore (architecture numbers, checked ISA, runtime and timing), knows nothing of tracing.
"""The software NeuronCore: architecture configurations, instruction set, program builder, runtime and timing model.

Start with :class:`Program` (build), :func:`run` (execute and time) and
:func:`get_arch` (the numbers). :mod:`tn.neuron.isa` documents the
instructions and their rules. :mod:`tn.neuron.machine` is the machine
around the cores: instance types, logical cores (LNC), chips and links.
"""
from . import machine  # noqa: F401  (tn.neuron.machine.machine(): the modelled instance)
from .arch import TRN1, TRN2, Arch, get_arch
from .program import Encoded, HbmTensor, HbmView, Program, Tile
from .runtime import RunResult, from_bf16, run, simulate_timing, to_bf16

__all__ = [
    "Arch", "TRN1", "TRN2", "get_arch", "Program", "Tile", "HbmTensor", "HbmView", "Encoded", "RunResult", "run",
    "simulate_timing", "to_bf16", "from_bf16",
]
