# The exceptions tn raises: every failure a user can cause is one of these, with a message that says what to do.
"""tn's exception types.

All derive from :class:`TnError`, so ``except tn.TnError`` catches anything tn
raises on purpose. Each also derives from the Python or PyTorch type that code
written for PyTorch already catches:

==========================  ==========================  ==============================================
tn type                     also a                      raised for
==========================  ==========================  ==============================================
``TracingError``            ``RuntimeError``            what tracing cannot capture (branch on a value)
``UnsupportedOpError``      ``RuntimeError``            an op tn cannot trace, lower or run
``CompileError``            ``RuntimeError``            a program tn could not build (a bug of tn)
``ExecutionError``          ``RuntimeError``            an equation that failed when run on the host
``NeuronError``             ``RuntimeError``            an instruction that breaks a rule of the chip
``DeviceError``             ``RuntimeError``            device misuse (mixed devices, bad index, copy)
``OutOfMemoryError``        ``torch.OutOfMemoryError``  device memory (HBM) exhausted
``OnChipMemoryError``       ``torch.OutOfMemoryError``  SBUF or PSUM full (also a ``NeuronError``)
``ArgumentTypeError``       ``TypeError``               an argument of a type tn does not take
``ArgumentValueError``      ``ValueError``              an argument whose value tn does not take
``MissingDependencyError``  ``ImportError``             a missing optional package or native build
==========================  ==========================  ==============================================

``torch.OutOfMemoryError`` is itself a ``RuntimeError``; batch-size finders
(HF Accelerate's ``find_executable_batch_size``) catch it. Messages name what
was wrong (the op, the argument, the instruction, the limit) and what to do.
"""
from __future__ import annotations

import torch

__all__ = ["TnError", "TracingError", "UnsupportedOpError", "CompileError", "ExecutionError", "NeuronError",
           "DeviceError", "OutOfMemoryError", "OnChipMemoryError", "ArgumentTypeError", "ArgumentValueError",
           "MissingDependencyError"]


class TnError(Exception):
    """Base class of every error tn raises on purpose."""


class TracingError(TnError, RuntimeError):
    """The traced program did something tracing cannot capture.

    Typical cause: Python control flow on a traced value (``if x.sum() > 0``,
    ``.item()``, ``bool(t)``, ``int(t)``). The message names the user's file
    and line and suggests ``static_argnums``, eager execution or ``tn.adaptive``.
    """


class UnsupportedOpError(TnError, RuntimeError):
    """An operator tn cannot trace, lower or run, named with its input shapes."""


class CompileError(TnError, RuntimeError):
    """tn could not build a program it should have built (the message names the program or equation)."""


class ExecutionError(TnError, RuntimeError):
    """An equation failed when its reference implementation ran on the host (the message names it)."""


class NeuronError(TnError, RuntimeError):
    """A NeuronCore instruction broke a rule of the chip.

    The message names the instruction, the operand and the limit it broke
    (partition count, SBUF/PSUM bounds, PSUM bank ownership, dtype rules).
    """


class DeviceError(TnError, RuntimeError):
    """The neuron device was used in a way PyTorch also refuses with a RuntimeError (mixed devices, bad index)."""


class OutOfMemoryError(TnError, torch.OutOfMemoryError):
    """Device memory is exhausted (a ``torch.OutOfMemoryError``, as CUDA raises)."""


class OnChipMemoryError(NeuronError, OutOfMemoryError):
    """A program's SBUF or PSUM tiles do not fit in the on-chip memory."""


class ArgumentTypeError(TnError, TypeError):
    """An argument to a tn function has a type it does not take."""


class ArgumentValueError(TnError, ValueError):
    """An argument to a tn function has a value it does not take."""


class MissingDependencyError(TnError, ImportError):
    """A feature needs an optional package, or a native build, that is missing (the message says what to do)."""
