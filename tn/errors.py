# The exceptions tn raises: every failure a user can cause is one of these, with a message that says what to do.
"""tn's exception types.

All derive from :class:`TnError`, so ``except tn.TnError`` catches anything tn
raises on purpose. Messages name what was wrong (the op, the argument, the
instruction, the limit) and what to do about it.
"""
from __future__ import annotations

__all__ = ["TnError", "TracingError", "UnsupportedOpError", "NeuronError"]


class TnError(Exception):
    """Base class of every error tn raises on purpose."""


class TracingError(TnError):
    """The traced program did something tracing cannot capture.

    Typical cause: Python control flow on a traced value (``if x.sum() > 0``,
    ``.item()``, ``bool(t)``, ``int(t)``). The message names the user's file
    and line and suggests ``static_argnums``, eager execution or ``tn.adaptive``.
    """


class UnsupportedOpError(TnError):
    """An operator tn cannot trace, lower or run, named with its input shapes."""


class NeuronError(TnError):
    """A NeuronCore instruction broke a rule of the chip.

    The message names the instruction, the operand and the limit it broke
    (partition count, SBUF/PSUM bounds, PSUM bank ownership, dtype rules).
    """
