# The neuron device's memory: storages from the native caching allocator (_native/device_alloc.c), freed when they die.
"""Device memory of the ``neuron`` device.

Every neuron tensor's storage is a block of the native caching allocator
(``tn_dev_alloc`` in ``_native/device_alloc.c``): 64-byte aligned, rounded
to a size class (four per power of two), kept on a free list when released
and reused by the next allocation of its class. This memory is the software
NeuronCore's HBM: programs bind it by pointer.

The storage object is built with ``torch._C._construct_storage_from_data_pointer``
and a weak reference with a callback returns the block to the allocator
exactly when the storage dies (the last tensor or view using it).
"""
from __future__ import annotations

import weakref

import torch

from .. import config
from ..errors import TnError

__all__ = ["DEVICE", "DeviceMemoryError", "alloc_storage", "new_tensor", "cpu_alias", "stats",
           "memory_allocated", "max_memory_allocated", "memory_reserved", "reset_peak_memory_stats",
           "empty_cache", "set_memory_limit"]

#: The one device tn models (a single NeuronCore).
DEVICE = torch.device("neuron", 0)
_CPU = torch.device("cpu")


class DeviceMemoryError(TnError):
    """The neuron device is out of memory (or over the limit set with ``TN_DEVICE_MEMORY``)."""


def _native():
    from .._native import _kernels

    lib = _kernels.lib
    if not hasattr(lib, "tn_dev_alloc"):
        raise TnError("the native module tn._native._kernels has no device allocator (tn_dev_alloc): it was built "
                      "before _native/device_alloc.c existed; rebuild with `python setup.py build_ext --inplace`")
    return lib, _kernels.ffi


_lib, _ffi = _native()
_construct = torch._C._construct_storage_from_data_pointer
_set_storage = torch.ops.aten.set_.source_Storage_storage_offset
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_create_empty = torch._C._acc.create_empty_tensor
_set_handle = _set_storage._handle.redispatch_boxed
_LIVE: dict = {}
_alloc = _lib.tn_dev_alloc_addr
_free = _lib.tn_dev_free_addr
_weakref = weakref.ref


def _limit_from_env() -> None:
    n = config.get("device_memory")
    if n:
        _lib.tn_dev_set_limit(n)


_limit_from_env()


#: weak reference id -> (weak reference, block address); the callback frees the block when the storage dies
def _release(ref) -> None:
    entry = _LIVE.pop(id(ref), None)
    if entry is not None:
        _free(entry[1])


def alloc_storage(nbytes: int) -> torch.UntypedStorage:
    """A new neuron ``UntypedStorage`` of ``nbytes`` bytes from the caching allocator (contents undefined)."""
    addr = _alloc(nbytes)
    if not addr:
        s = stats()
        raise DeviceMemoryError(
            f"neuron device: cannot allocate {nbytes} bytes ({s['allocated']} in use, {s['reserved']} reserved, "
            f"limit {s['limit'] or 'none'}); free tensors, call torch.neuron.empty_cache(), or raise "
            f"TN_DEVICE_MEMORY")
    st = _construct(addr, DEVICE, nbytes)
    ref = _weakref(st, _release)
    _LIVE[id(ref)] = (ref, addr)
    return st


def live_blocks() -> int:
    """Number of device blocks owned by live storages."""
    return len(_LIVE)


def storage_nbytes(size, stride, itemsize: int) -> int:
    """Bytes a tensor of this size/stride (offset 0) spans."""
    n = 1
    for s, st in zip(size, stride):
        if s == 0:
            return 0
        n += (s - 1) * st
    return n * itemsize


def new_tensor(size, stride, dtype: torch.dtype) -> torch.Tensor:
    """A new neuron tensor of ``size``/``stride``/``dtype`` on fresh device memory (contents undefined)."""
    st = alloc_storage(storage_nbytes(size, stride, dtype.itemsize))
    t = _create_empty([0], dtype)
    _set_handle(_CPU_KEYS, t, st, 0, size, stride)
    return t


def contiguous_strides(size) -> tuple:
    """Row-major strides of ``size``."""
    st = []
    acc = 1
    for s in reversed(size):
        st.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(st))


#: Called with a neuron tensor before the host reads or writes its memory (tn.device.windows fills it: queued
#: ops that touch that memory run first).
BEFORE_HOST_ACCESS: list = [None]


def cpu_alias(t: torch.Tensor, sync: bool = True) -> torch.Tensor:
    """A CPU tensor on the same memory as neuron tensor ``t`` (same size, stride, offset; no copy).

    The alias does not own the memory: keep ``t`` (or its storage) alive while the alias is used. With
    ``sync`` (the default) ops still queued in an adaptive eager window that touch the memory run first;
    ``sync=False`` is for metadata-only uses (views) that never read the values.
    """
    hook = BEFORE_HOST_ACCESS[0]
    if sync and hook is not None:
        hook(t)
    st = t.untyped_storage()
    cst = _construct(st.data_ptr(), _CPU, st.nbytes())
    return torch.empty(0, dtype=t.dtype).set_(cst, t.storage_offset(), t.size(), t.stride())


#: Called with each tensor ``torch.empty`` made on the device (tn.device.windows fills it: memory a window may
#: write before anything reads it).
ON_EMPTY: list = [None]

#: Called before the counters are read (tn.device.windows fills it: queued ops run, so memory they still hold
#: is counted as op-by-op eager would count it).
BEFORE_STATS: list = [None]


def stats() -> dict:
    """Allocator counters: allocated, peak, reserved, requested (bytes), allocs, frees, cache_hits, limit."""
    if BEFORE_STATS[0] is not None:
        BEFORE_STATS[0]()
    out = _ffi.new("int64_t[8]")
    _lib.tn_dev_stats(out)
    keys = ("allocated", "peak", "reserved", "requested", "allocs", "frees", "cache_hits", "limit")
    return dict(zip(keys, (int(v) for v in out)))


def memory_allocated(device=None) -> int:
    """Bytes held by live neuron tensors (size-class rounded, like CUDA's counter)."""
    return stats()["allocated"]


def max_memory_allocated(device=None) -> int:
    """Peak of :func:`memory_allocated` since start or the last :func:`reset_peak_memory_stats`."""
    return stats()["peak"]


def memory_reserved(device=None) -> int:
    """Bytes the allocator holds: live blocks plus cached free blocks."""
    return stats()["reserved"]


def reset_peak_memory_stats(device=None) -> None:
    """Restart the peak counter at the current allocation."""
    _lib.tn_dev_reset_peak()


def empty_cache() -> None:
    """Return every cached free block to the host (live tensors are untouched)."""
    _lib.tn_dev_empty_cache()


def set_memory_limit(nbytes: int) -> None:
    """Cap the device memory (bytes, 0 = no cap); also settable with ``TN_DEVICE_MEMORY=16g``."""
    _lib.tn_dev_set_limit(int(nbytes))
