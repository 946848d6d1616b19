# The neuron device's autograd hook for 16-bit gradients: tn.ops.low_precision's float32 gradient rules at AutogradPrivateUse1.
"""16-bit gradients on the ``neuron`` device.

torch's autograd formulas run op by op on the device in the tensors' dtype;
for the ops of :data:`tn.ops.low_precision.FP32_GRADIENTS` (``linalg_vector_norm``,
``div`` by a tensor that needs a gradient) a bf16/fp16 call that needs a
gradient is evaluated in float32 and rounded once instead, so its gradient is
float32 rounded once (the module docstring of :mod:`tn.ops.low_precision` has
the ``F.normalize`` case this fixes). Every other call reaches torch's own
autograd kernel unchanged. ``tn.jit`` and ``torch.compile(backend="neuron")``
on device tensors meet the same kernels while they trace.
"""
from __future__ import annotations

from ..ops import low_precision

__all__ = ["register"]

_LIBS: list = []


def register() -> None:
    """Install the float32 gradient rules at ``AutogradPrivateUse1`` (idempotent)."""
    if _LIBS:
        return
    _LIBS.append(low_precision.install("AutogradPrivateUse1"))
