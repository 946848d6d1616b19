# tn.device: the `neuron` torch device (PrivateUse1 renamed), its memory, eager op dispatch and op tracking.
"""The ``neuron`` device: ``model.to("neuron")`` on the software NeuronCore.

``import tn`` calls :func:`register`, which renames PrivateUse1 to ``neuron``,
generates ``Tensor.neuron()`` / ``is_neuron``, installs ``torch.neuron``
(:mod:`tn.device.backend`), the aten kernels of :mod:`tn.device.aten` and the
eager fallback of :mod:`tn.device.eager`, the small-op fast path
(:mod:`tn.device.fastpath`), ``torch.autocast("neuron")``
(:mod:`tn.device.autocast`), pinned host memory (:mod:`tn.device.pinned`),
the fused LSTM/GRU cells torch's RNNs call (:mod:`tn.device.rnn`), fused
``scaled_dot_product_attention`` (:mod:`tn.device.attention`), float32 gradients of 16-bit norms and
divisions (:mod:`tn.device.low_precision_autograd`) and the
wrappers of :mod:`tn.device.guards`, and the streams and events of
:mod:`tn.device.streams`. Tensors on ``neuron:0 .. neuron:N-1`` (N the
logical cores of the modelled instance, :mod:`tn.neuron.machine`) are real
``torch.Tensor``s whose storage is native device memory
(:mod:`tn.device.allocator`, one arena per device), the model's HBM.

Limits: random numbers come from torch's CPU
generator (same numbers as on the CPU for the same seed;
``torch.Generator(device="neuron")`` does not exist, torch needs C++ hooks
for it); ``torch.UntypedStorage(n, device="neuron")`` and ``torch.load(...,
map_location="neuron")`` go through tn's allocator (:mod:`tn.device.guards`)
rather than torch's C++ allocator, which the device does not have; factory
calls with ``pin_memory=True`` raise (``.pin_memory()`` works).
"""
from __future__ import annotations

import torch
import torch.utils.backend_registration as br

from .. import neuron as _chip
from . import (aten, attention, autocast, backend, fastpath, guards, low_precision_autograd, pinned, rnn,
               streams, tracking)
from .name import rename
from .tracking import executed_ops, fallback_ops

__all__ = ["register", "registered", "backend", "executed_ops", "fallback_ops"]

_DONE = []


def registered() -> bool:
    """True once :func:`register` has run."""
    return bool(_DONE)


def register() -> None:
    """Register PrivateUse1 as ``neuron`` with its kernels (idempotent; ``import tn`` does it)."""
    if _DONE:
        return
    rename()   # done when tn.device.name loaded (idempotent)
    if not hasattr(torch, "neuron"):
        torch._register_device_module("neuron", backend)
        torch._C._acc.register_python_privateuseone_hook(br._DummyPrivateUse1Hook())
        torch._C._acc.register_python_privateuseone_device_guard(br._DummyDeviceGuard())

    # the kernel groups, installed in this order
    aten.register()
    fastpath.register()
    autocast.register()
    pinned.register()
    rnn.register()
    attention.register()
    streams.register()
    low_precision_autograd.register()
    guards.install()
    # op tracking, also reachable as tn.neuron.fallback_ops() / executed_ops()
    for fn in (tracking.executed_ops, tracking.fallback_ops, tracking.fallback_reasons, tracking.fastpath_ops,
               tracking.reset_op_counts):
        setattr(_chip, fn.__name__, fn)
    _DONE.append(True)


register()
