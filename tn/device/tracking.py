# Op tracking of the neuron device: which aten ops ran as NeuronCore programs and which fell back to the host.
"""Counters of eager ops on the ``neuron`` device (like TorchNeuron's op tracking).

* :func:`executed_ops`: every aten op dispatched to the device, by name
  (``"aten::add.Tensor"``), with how many times it ran;
* :func:`device_time_ns`: their modelled NeuronCore time, back to back;
* :func:`fallback_ops`: the subset that ran (wholly or partly) on the host
  because the NeuronCore has no lowering for it (or it is a random op, whose
  numbers come from torch's CPU generator), with the reason in
  :func:`fallback_reasons`.

Both are also functions of ``torch.neuron`` and ``tn.neuron``.
"""
from __future__ import annotations

import threading
from typing import Dict

__all__ = ["executed_ops", "fallback_ops", "fallback_reasons", "reset_op_counts", "device_time_ns"]

_lock = threading.Lock()
_executed: Dict[str, int] = {}
_fallback: Dict[str, int] = {}
_reasons: Dict[str, str] = {}
_device_ns = [0.0]


def add_device_ns(ns: float) -> None:
    """Charge ``ns`` of modelled NeuronCore time to the eager ops."""
    _device_ns[0] += ns


def device_time_ns() -> float:
    """Modelled NeuronCore time (ns) of every eager device op since start or the last reset, back to back."""
    return _device_ns[0]


def count(name: str) -> None:
    """Record one execution of ``name`` on the device."""
    _executed[name] = _executed.get(name, 0) + 1


def count_fallback(name: str, reason: str) -> None:
    """Record one execution of ``name`` that ran (wholly or partly) on the host, and why."""
    with _lock:
        _fallback[name] = _fallback.get(name, 0) + 1
        _reasons.setdefault(name, reason)


def executed_ops() -> Dict[str, int]:
    """``{aten op: times run}`` for every op dispatched to the neuron device since start or the last reset."""
    return dict(_executed)


def fallback_ops() -> Dict[str, int]:
    """``{aten op: times run}`` for the ops that ran on the host instead of as NeuronCore programs."""
    return dict(_fallback)


def fallback_reasons() -> Dict[str, str]:
    """``{aten op: why it ran on the host}`` (first reason seen)."""
    return dict(_reasons)


def reset_op_counts() -> None:
    """Clear :func:`executed_ops`, :func:`fallback_ops` and the reasons."""
    with _lock:
        _executed.clear()
        _fallback.clear()
        _reasons.clear()
        _device_ns[0] = 0.0
