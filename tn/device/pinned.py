# Pinned host memory with the neuron device registered: pin_memory(), is_pinned(), DataLoader(pin_memory=True).
"""``tensor.pin_memory()`` / ``is_pinned()`` once ``neuron`` is torch's accelerator.

With a PrivateUse1 device registered, torch asks *that* device's C++ hooks
for the pinned-memory allocator (``getPinnedMemoryAllocator``); a backend
registered from Python cannot provide one, so without this module
``torch.randn(3).pin_memory()`` and ``DataLoader(..., pin_memory=True)``
raise ``NotImplementedError`` in any program that imported tn.

:func:`register` gives the CPU dispatch key kernels for ``aten::_pin_memory``
(what ``Tensor.pin_memory()`` runs) and ``aten::is_pinned``. Pinning has no
work to do here: the device memory is host memory and copies to and from
it are synchronous memcpys. So a pinned tensor is a CPU copy in a buffer
this module tracks, and ``is_pinned()`` is True exactly for tensors on such
a buffer (freed, like any CPU storage, when its last tensor dies).

Not covered: factory functions with ``pin_memory=True``
(``torch.empty(..., pin_memory=True)``) still reach torch's C++ check and
raise; use ``torch.empty(...).pin_memory()``.
"""
from __future__ import annotations

import threading
import weakref

import torch

from ..errors import DeviceError
from .allocator import storage_nbytes
from .registry import install_kernels

__all__ = ["register", "pinned_bytes"]

_CPU = torch.device("cpu")
_construct = torch._C._construct_storage_from_data_pointer
_lock = threading.Lock()
#: id(weak reference to the pinned storage) -> (weak reference, backing buffer, data pointer)
_LIVE: dict = {}
#: data pointers of live pinned storages
_PTRS: set = set()
_LIBS: list = []


def _release(ref) -> None:
    with _lock:
        entry = _LIVE.pop(id(ref), None)
        if entry is not None:
            _PTRS.discard(entry[2])


def _pinned_storage(nbytes: int) -> torch.UntypedStorage:
    buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    ptr = buf.data_ptr()
    st = _construct(ptr, _CPU, nbytes)
    ref = weakref.ref(st, _release)
    with _lock:
        _LIVE[id(ref)] = (ref, buf, ptr)
        _PTRS.add(ptr)
    return st


def _check(device) -> None:
    if device is not None and torch.device(device).type not in ("neuron", "cpu"):
        raise DeviceError(f"pin_memory(device={device}): with tn the accelerator is the neuron device; pin for it "
                      f"(device=None or 'neuron')")


def _pin_memory(self, device=None):
    _check(device)

    if self.untyped_storage().data_ptr() in _PTRS:
        return self
    st = _pinned_storage(storage_nbytes(self.shape, self.stride(), self.element_size()))
    out = torch.empty(0, dtype=self.dtype).set_(st, 0, self.shape, self.stride())
    out.copy_(self)
    return out


def _is_pinned(self, device=None):
    _check(device)
    return self.untyped_storage().data_ptr() in _PTRS


def pinned_bytes() -> int:
    """Bytes held by live pinned tensors."""
    with _lock:
        return sum(e[1].numel() for e in _LIVE.values())


def register() -> None:
    """Install the CPU kernels of ``_pin_memory`` and ``is_pinned`` (idempotent)."""
    if _LIBS:
        return

    install_kernels(_LIBS, {"_pin_memory": _pin_memory, "is_pinned": _is_pinned}, "CPU")
