# Op tracking of the neuron device: which aten ops ran as NeuronCore programs and which fell back to the host.
"""Counters of eager ops on the ``neuron`` device (like TorchNeuron's op tracking).

* :func:`executed_ops`: every aten op dispatched to the device, by name
  (``"aten::add.Tensor"``), with how many times it ran;
* :func:`device_time_ns`: their modelled NeuronCore time, back to back;
* :func:`fallback_ops`: the subset that ran (wholly or partly) on the host
  because the NeuronCore has no lowering for it (or it is a random op, whose
  numbers come from torch's CPU generator), with the reason in
  :func:`fallback_reasons`; these also show in every active
  :func:`tn.profile` (``prof.host_ops``, the last line of ``prof.table()``);
* :func:`fastpath_ops`: the subset served by :mod:`tn.device.fastpath`:
  small add/sub/mul whose one-op program had already been compiled and run
  on the NeuronCore model once; the result was computed on the host by a
  native kernel with the program's arithmetic, and the program's modelled
  time (recorded on that first run) was charged to :func:`device_time_ns`.
  Inside a :func:`tn.profile` block the fast path is off, so a profile only
  ever contains real program runs.

All are also functions of ``torch.neuron`` and ``tn.neuron``.
"""
from __future__ import annotations

import threading
from typing import Dict

import torch

from ..neuron.timeline import current_core as _current_core
from ..profile import note_host_op as _note_host_op

__all__ = ["executed_ops", "fallback_ops", "fallback_reasons", "fastpath_ops", "reset_op_counts", "device_time_ns"]

_lock = threading.Lock()
_executed: Dict[str, int] = {}
_fallback: Dict[str, int] = {}
_reasons: Dict[str, str] = {}
_fast: Dict[str, int] = {}
_device_ns = [0.0]
_per_device: Dict[int, float] = {}


def add_device_ns(ns: float, index: int = None) -> None:
    """Charge ``ns`` of modelled NeuronCore time to the eager ops of device ``index`` (default: the current one)."""
    _device_ns[0] += ns
    if index is None:
        index = _current_core()
    _per_device[index] = _per_device.get(index, 0.0) + ns


def device_time_ns(device=None) -> float:
    """Modelled NeuronCore time (ns) of the eager device ops since start or the last reset, back to back: of
    every device (default), or of ``device`` (an index or ``"neuron:1"``)."""
    if device is None:
        return _device_ns[0]
    index = device if isinstance(device, int) else torch.device(device).index or 0
    return _per_device.get(index, 0.0)


def count(name: str) -> None:
    """Record one execution of ``name`` on the device."""
    _executed[name] = _executed.get(name, 0) + 1


def count_fast(name: str) -> None:
    """Record one execution of ``name`` by the fast path (host kernel, cached modelled time)."""
    _executed[name] = _executed.get(name, 0) + 1
    _fast[name] = _fast.get(name, 0) + 1


def count_fallback(name: str, reason: str, profile: bool = True) -> None:
    """Record one execution of ``name`` that ran (wholly or partly) on the host, and why; with ``profile``
    (the whole op ran on the host) active :func:`tn.profile` blocks count it too (a program that left part of
    itself on the host reports that part to the profiles itself)."""
    with _lock:
        _fallback[name] = _fallback.get(name, 0) + 1
        _reasons.setdefault(name, reason)
    if profile:
        _note_host_op(name)  # counted by every active tn.profile() (none: nothing to do)


def executed_ops() -> Dict[str, int]:
    """``{aten op: times run}`` for every op dispatched to the neuron device since start or the last reset."""
    return dict(_executed)


def fallback_ops() -> Dict[str, int]:
    """``{aten op: times run}`` for the ops that ran on the host instead of as NeuronCore programs."""
    return dict(_fallback)


def fallback_reasons() -> Dict[str, str]:
    """``{aten op: why it ran on the host}`` (first reason seen)."""
    return dict(_reasons)


def fastpath_ops() -> Dict[str, int]:
    """``{aten op: times run}`` for the ops the fast path served: computed on the host with the arithmetic of
    their (already compiled and once run) NeuronCore program, charged that program's modelled time."""
    return dict(_fast)


def reset_op_counts() -> None:
    """Clear :func:`executed_ops`, :func:`fallback_ops`, :func:`fastpath_ops`, the reasons and the time."""
    with _lock:
        _executed.clear()
        _fallback.clear()
        _reasons.clear()
        _fast.clear()
        _device_ns[0] = 0.0
        _per_device.clear()
