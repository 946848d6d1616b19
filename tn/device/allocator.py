# The neuron device's memory: storages from the native caching allocator (_native/device_alloc.c), freed when they die.
"""Device memory of the ``neuron`` devices.

Every neuron tensor's storage is a block of the native caching allocator
(``tn_dev_alloc_on`` in ``_native/device_alloc.c``): one arena per device
index, 64-byte aligned, rounded to a size class (four per power of two), kept
on its device's free list when released and reused by the next allocation of
its class on that device. Each arena has its own counters (:func:`stats`) and
limit (``TN_DEVICE_MEMORY`` applies to every device). This memory is the
software NeuronCore's HBM: programs bind it by pointer.

The *current device* (``torch.neuron.set_device``, ``torch.neuron.device(i)``)
is thread-local, as on CUDA, and is the chip model's current core
(:func:`tn.neuron.timeline.current_core`): allocations without an index land
there, and each eager op makes its inputs' device current while it runs
(:func:`on_device`), so results land with their inputs.

The storage object is built with ``torch._C._construct_storage_from_data_pointer``
and a weak reference with a callback returns the block to the allocator
exactly when the storage dies (the last tensor or view using it).
"""
from __future__ import annotations

import ctypes
import os as _os
import weakref
from typing import Tuple

import torch

from .. import config
from .._native import _kernels
from ..errors import ArgumentValueError, DeviceError, MissingDependencyError, OutOfMemoryError
from ..neuron.machine import MAX_DEVICES, machine
from ..neuron.timeline import current_core as _current_core
from ..neuron.timeline import set_current_core as _set_current_core
from ..shapes import contiguous_strides  # noqa: F401  (re-exported: the device's ops use allocator.contiguous_strides)
from . import name as _name  # noqa: F401  (PrivateUse1 is named "neuron" before DEVICES below is built)

__all__ = ["DEVICE", "DEVICES", "DeviceMemoryError", "DeviceIndexError", "alloc_storage", "new_tensor", "cpu_alias",
           "stats", "memory_allocated", "max_memory_allocated", "memory_reserved", "reset_peak_memory_stats",
           "empty_cache", "set_memory_limit", "resize_storage", "current_index", "set_current_index", "on_device",
           "device_index",
           "check_index", "device_count", "initialized", "reinit_after_fork"]

#: Device 0 (every process has it).
DEVICE = torch.device("neuron", 0)
#: ``DEVICES[i]`` is ``torch.device("neuron", i)`` for every index the allocator has an arena for.
DEVICES = tuple(torch.device("neuron", i) for i in range(MAX_DEVICES))
_CPU = torch.device("cpu")


class DeviceMemoryError(OutOfMemoryError):
    """A neuron device is out of memory (or over the limit set with ``TN_DEVICE_MEMORY``): a
    ``torch.OutOfMemoryError``, as CUDA raises."""


class DeviceIndexError(DeviceError):
    """A neuron device index that the modelled machine does not have (a RuntimeError, as torch raises)."""


def device_count() -> int:
    """Devices this process sees: the logical cores of the modelled instance (:func:`tn.neuron.machine.machine`),
    or those ``TN_VISIBLE_CORES`` names."""
    return machine().process_device_count


def check_index(index: int) -> int:
    """``index`` if the machine has that device, else :class:`DeviceIndexError` naming the count."""
    if type(index) is not int:
        index = int(index)
    if index == 0:
        return 0
    m = machine()
    n = m.process_device_count
    if not 0 <= index < n:
        seen = f" of which this process sees {n} (TN_VISIBLE_CORES)" if m.visible is not None else ""
        raise DeviceIndexError(
            f"device neuron:{index} does not exist: the modelled {m.describe()}{seen} has {n} neuron "
            f"device(s) (torch.neuron.device_count() == {n}); use neuron:0 .. neuron:{n - 1}"
            f", or pick a bigger machine with TN_INSTANCE / TN_LNC")
    return index


def device_index(device=None) -> int:
    """The neuron device index of ``device`` (an int, ``"neuron:1"``, a torch.device; None or no index: the current
    device), checked against the machine."""
    if device is None:
        return current_index()
    if isinstance(device, int):
        return check_index(device)
    d = device if isinstance(device, torch.device) else torch.device(device)
    if d.type != "neuron":
        raise ArgumentValueError(f"{d} is not a neuron device")
    return current_index() if d.index is None else check_index(d.index)


#: ``_STATE[0]``: the device was used (memory allocated or a device selected); a fork after it is a bad fork
_STATE = {"initialized": False, "bad_fork": False}


def initialized() -> bool:
    """True once this process allocated device memory or selected a device."""
    return _STATE["initialized"]


def _bad_fork_error() -> DeviceError:
    return DeviceError("Cannot re-initialize the neuron device in a forked subprocess: the parent process had already "
                   "used it (device memory, current device and streams do not survive fork). To use the neuron "
                   "device with multiprocessing, use the 'spawn' start method "
                   "(torch.multiprocessing.set_start_method('spawn') or mp.get_context('spawn'))")


def _after_fork_in_child() -> None:
    if _STATE["initialized"]:
        _STATE["bad_fork"] = True


_os.register_at_fork(after_in_child=_after_fork_in_child)


def reinit_after_fork() -> None:
    """In a child forked after the device was used: use the device anyway (no bad-fork error from now on).

    CUDA has no such escape; tn's device memory is host memory, which a forked child owns a copy of, so a child
    that knows it (a crash-isolating worker pool such as ``bench/coverage.py``) may re-initialise: the
    allocator's lock is made fresh; the inherited tensors and caches are the child's copy."""
    _lib.tn_dev_reinit_after_fork()
    _STATE["bad_fork"] = False
    _STATE["initialized"] = True


def _mark_initialized() -> None:
    if _STATE["bad_fork"]:
        raise _bad_fork_error()
    _STATE["initialized"] = True


def current_index() -> int:
    """This thread's current neuron device index (default 0)."""
    return _current_core()


def set_current_index(index: int) -> int:
    """Make device ``index`` current for this thread (checked); returns the previous one."""
    index = check_index(index)
    _mark_initialized()
    return _set_current_core(index)


class on_device:
    """Context manager: device ``index`` (unchecked: an existing tensor's) is current inside the block."""

    __slots__ = ("index", "prev")

    def __init__(self, index: int):
        self.index = index

    def __enter__(self):
        self.prev = _set_current_core(self.index)
        return self

    def __exit__(self, *exc):
        _set_current_core(self.prev)
        return False


def _native():
    lib = _kernels.lib
    if not hasattr(lib, "tn_dev_alloc"):
        raise MissingDependencyError("the native module tn._native._kernels has no device allocator (tn_dev_alloc): it was built "
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
_DEVICE0 = DEVICES[0]


def _limit_from_env() -> None:
    if _lib.tn_dev_max_devices() != MAX_DEVICES:
        raise MissingDependencyError(f"the native device allocator has {_lib.tn_dev_max_devices()} arenas but tn.neuron.machine "
                      f"expects {MAX_DEVICES}: rebuild with `python setup.py build_ext --inplace`")
    n = config.get("device_memory")
    if n:
        _lib.tn_dev_set_limit(-1, n)


_limit_from_env()


#: weak reference id -> (weak reference, block address); the callback frees the block when the storage dies
def _release(ref) -> None:
    entry = _LIVE.pop(id(ref), None)
    if entry is not None and entry[1]:
        _free(entry[1])


def alloc_storage(nbytes: int, index: int = None) -> torch.UntypedStorage:
    """A new neuron ``UntypedStorage`` of ``nbytes`` bytes on device ``index`` (default: the current device; the
    caller checked it) from the caching allocator (contents undefined)."""
    if index is None:
        index = _current_core()
    if not _STATE["initialized"] or _STATE["bad_fork"]:
        _mark_initialized()
    addr = _alloc(index, nbytes)
    if not addr:
        s = stats(index)
        raise DeviceMemoryError(
            f"neuron:{index}: cannot allocate {nbytes} bytes ({s['allocated']} in use, {s['reserved']} reserved, "
            f"limit {s['limit'] or 'none'}); free tensors, call torch.neuron.empty_cache(), or raise "
            f"TN_DEVICE_MEMORY")
    st = _construct(addr, DEVICES[index], nbytes)
    ref = _weakref(st, _release)
    _LIVE[id(ref)] = (ref, addr)
    return st


def new_dense(shape: tuple, dtype: torch.dtype, nbytes: int, index: int) -> Tuple[torch.Tensor, torch.UntypedStorage]:
    """``(tensor, its storage)``: a new contiguous neuron tensor of ``shape`` on fresh memory of ``nbytes`` bytes
    (``numel * itemsize``; contents undefined) of device ``index`` (the caller checked it).

    The cheap way to make an op's result: on device 0 with every size > 0, ``create_empty_tensor`` already gives
    the tensor its shape and contiguous strides, and the block goes into its (empty) storage by swapping data
    pointers (~1 us), where :func:`alloc_storage` + ``set_`` (a boxed redispatch: ~5 us) would parse the
    arguments again. The storage is tracked as :func:`alloc_storage`'s are: the block returns to the cache when
    the storage dies. Other devices and empty shapes take that general way."""
    addr = 0
    if index == 0 and nbytes:
        if not _STATE["initialized"] or _STATE["bad_fork"]:
            _mark_initialized()
        addr = _alloc(0, nbytes)
    if not addr:    # (out of memory: alloc_storage raises the error)
        st = alloc_storage(nbytes, index)
        t = blank(dtype, index)
        _set_handle(_CPU_KEYS, t, st, 0, shape, contiguous_strides(shape))
        return t, st
    t = _create_empty(shape, dtype)
    st = t.untyped_storage()
    st._swap_data_ptr_(_construct(addr, _DEVICE0, nbytes))
    ref = _weakref(st, _release)
    _LIVE[id(ref)] = (ref, addr)
    return t, st


def live_blocks() -> int:
    """Number of device blocks owned by live storages."""
    return sum(1 for entry in _LIVE.values() if entry[1])


def _live_key(st: torch.UntypedStorage):
    """The key of ``st``'s entry in ``_LIVE`` (None for a storage the allocator did not make)."""
    for ref in weakref.getweakrefs(st):
        if id(ref) in _LIVE and _LIVE[id(ref)][0] is ref:
            return id(ref)
    return None


def host_tensor(addr: int, nbytes: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A contiguous CPU tensor of ``shape`` at host address ``addr`` of a block of ``nbytes`` (no copy; the
    caller keeps the memory alive while the tensor is used)."""
    return torch.empty(0, dtype=dtype).set_(_construct(addr, _CPU, nbytes), 0, shape, contiguous_strides(shape))


def resize_storage(st: torch.UntypedStorage, nbytes: int) -> None:
    """Resize neuron storage ``st`` in place to ``nbytes`` (``UntypedStorage.resize_`` on the device).

    Every tensor and view on ``st`` sees the new memory (the storage object is kept; its data pointer is swapped
    for a new block of the caching allocator holding the first ``min(old, new)`` bytes). ``resize_(0)`` returns
    the block at once. FSDP2 frees and re-allocates its unsharded parameters this way around each all-gather."""
    nbytes = int(nbytes)
    if nbytes < 0:
        raise ArgumentValueError(f"UntypedStorage.resize_: size must be >= 0, got {nbytes}")
    old = st.nbytes()
    if nbytes == old:
        return
    index = st.device.index
    hook = BEFORE_HOST_ACCESS[0]
    if hook is not None and old:   # queued ops that read or write this memory run before it moves
        view = blank(torch.uint8, index)
        _set_handle(_CPU_KEYS, view, st, 0, (old,), (1,))
        hook(view)
    addr = 0
    if nbytes:
        addr = _alloc(index, nbytes)
        if not addr:
            s = stats(index)
            raise DeviceMemoryError(
                f"neuron:{index}: cannot resize a storage to {nbytes} bytes ({s['allocated']} in use, "
                f"{s['reserved']} reserved, limit {s['limit'] or 'none'}); free tensors, call "
                f"torch.neuron.empty_cache(), or raise TN_DEVICE_MEMORY")
        keep = min(old, nbytes)
        if keep:
            host_tensor(addr, keep, torch.uint8, (keep,)).copy_(host_tensor(st.data_ptr(), keep, torch.uint8, (keep,)))
    fresh = _construct(addr, DEVICES[index], nbytes)
    if old and nbytes:   # swapping needs one side empty: old -> empty, then empty <-> new
        empty = _construct(0, DEVICES[index], 0)
        st._swap_data_ptr_(empty)
        st._swap_data_ptr_(fresh)
        old_addr = empty.data_ptr()
    else:
        st._swap_data_ptr_(fresh)
        old_addr = fresh.data_ptr()
    key = _live_key(st)
    if key is None:
        ref = _weakref(st, _release)
        _LIVE[id(ref)] = (ref, addr)
    else:
        _LIVE[key] = (_LIVE[key][0], addr)
        if old_addr:
            _free(old_addr)


def storage_nbytes(size, stride, itemsize: int) -> int:
    """Bytes a tensor of this size/stride (offset 0) spans."""
    n = 1
    for s, st in zip(size, stride):
        if s == 0:
            return 0
        n += (s - 1) * st
    return n * itemsize


def new_tensor(size, stride, dtype: torch.dtype, index: int = None) -> torch.Tensor:
    """A new neuron tensor of ``size``/``stride``/``dtype`` on fresh memory of device ``index`` (default: the
    current device) (contents undefined)."""
    if index is None:
        index = _current_core()
    nbytes = storage_nbytes(size, stride, dtype.itemsize)
    if index == 0 and nbytes and tuple(stride) == contiguous_strides(size):
        return new_dense(tuple(size), dtype, nbytes, 0)[0]
    st = alloc_storage(nbytes, index)
    t = _create_empty([0], dtype) if index == 0 else _alias(_CPU_KEYS, _template(index, dtype))
    _set_handle(_CPU_KEYS, t, st, 0, size, stride)
    return t


def blank(dtype: torch.dtype, index: int) -> torch.Tensor:
    """A tensor of device ``index`` and ``dtype`` with no memory yet (give it a storage with ``set_``)."""
    return _create_empty([0], dtype) if index == 0 else _alias(_CPU_KEYS, _template(index, dtype))


_TEMPLATES: dict = {}
_alias = torch.ops.aten.alias.default.redispatch
_view_dtype = torch.ops.aten.view.dtype.redispatch
_DL_EXT_DEV = 12   # DLPack's kDLExtDev: torch maps it to PrivateUse1


def _template(index: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor on ``neuron:index`` of ``dtype`` whose aliases become new tensors of that device.

    torch 2.13 gives a Python backend one way to make a tensor of its device, ``torch._C._acc.create_empty_tensor``,
    and it always says device 0; a tensor's storage can only be replaced by one of the same device. DLPack can
    name any PrivateUse1 index: an empty CPU tensor exported with its device rewritten to ``(kDLExtDev, index)``
    imports as an empty ``neuron:index`` tensor (no memory of ours). Each new tensor is an alias of it (a fresh
    TensorImpl, not an autograd view: torch's CPU kernel, reached below ADInplaceOrView) given its own storage."""
    t = _TEMPLATES.get((index, dtype))
    if t is None:
        cap = torch.utils.dlpack.to_dlpack(torch.empty(0, dtype=torch.uint8))
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype = ctypes.c_void_p
        get.argtypes = [ctypes.py_object, ctypes.c_char_p]
        # DLManagedTensor starts with DLTensor {void *data; DLDevice {int32 device_type; int32 device_id}; ...}
        dev = (ctypes.c_int32 * 2).from_address(get(cap, b"dltensor") + ctypes.sizeof(ctypes.c_void_p))
        dev[0], dev[1] = _DL_EXT_DEV, index
        base = torch.utils.dlpack.from_dlpack(cap)
        if base.device != DEVICES[index]:
            raise DeviceError(f"cannot make tensors on neuron:{index}: DLPack import gave {base.device}")
        t = base if dtype == torch.uint8 else _view_dtype(_CPU_KEYS, base, dtype)
        _TEMPLATES[(index, dtype)] = t
    return t


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


def deterministic_fill() -> bool:
    """True when memory torch makes uninitialised must be filled (``torch.use_deterministic_algorithms(True)``
    with ``torch.utils.deterministic.fill_uninitialized_memory``, as torch's CPU and CUDA kernels do)."""
    return torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory


def fill_uninitialized(flat: torch.Tensor) -> None:
    """Fill host-visible memory as torch's deterministic mode does: NaN for floating and complex dtypes, the
    dtype's largest value for integers (``True`` for bool)."""
    if flat.numel() == 0:
        return
    if flat.is_floating_point() or flat.is_complex():
        flat.fill_(float("nan"))
    elif flat.dtype == torch.bool:
        flat.fill_(True)
    else:
        flat.fill_(torch.iinfo(flat.dtype).max)


def resize_tensor(self: torch.Tensor, size) -> torch.Tensor:
    """``self.resize_(size)`` for a neuron tensor (contiguous strides; a larger storage is allocated and the old
    bytes copied when it must grow, after queued writes land)."""
    if BEFORE_HOST_ACCESS[0] is not None:   # growing copies the bytes: queued writes land first
        BEFORE_HOST_ACCESS[0](self)
    size = tuple(int(s) for s in size)
    stride = contiguous_strides(size)
    item = self.element_size()
    need = storage_nbytes(size, stride, item) + self.storage_offset() * item
    st = self.untyped_storage()
    if need > st.nbytes():
        new = alloc_storage(need, self.device.index)
        old = st.nbytes()
        if old:
            host_tensor(new.data_ptr(), need, torch.uint8, (old,)).copy_(
                host_tensor(st.data_ptr(), old, torch.uint8, (old,)))
        if deterministic_fill():   # the grown part, as torch's resize_ fills it (whole elements past the old bytes)
            fill_uninitialized(host_tensor(new.data_ptr(), need, self.dtype, (need // item,))[-(-old // item):])
        st = new
    torch.ops.aten.set_.source_Storage_storage_offset.redispatch(_CPU_KEYS, self, st, self.storage_offset(), size,
                                                               stride)
    return self


def stats(device=None) -> dict:
    """Allocator counters of one device (default: the current one): allocated, peak, reserved, requested
    (bytes), allocs, frees, cache_hits, limit."""
    if BEFORE_STATS[0] is not None:
        BEFORE_STATS[0]()
    out = _ffi.new("int64_t[8]")
    _lib.tn_dev_stats(device_index(device), out)
    keys = ("allocated", "peak", "reserved", "requested", "allocs", "frees", "cache_hits", "limit")
    return dict(zip(keys, (int(v) for v in out)))


def memory_allocated(device=None) -> int:
    """Bytes held by live tensors of the device (size-class rounded, like CUDA's counter)."""
    return stats(device)["allocated"]


def max_memory_allocated(device=None) -> int:
    """Peak of :func:`memory_allocated` since start or the last :func:`reset_peak_memory_stats`."""
    return stats(device)["peak"]


def memory_reserved(device=None) -> int:
    """Bytes the device's arena holds: live blocks plus cached free blocks."""
    return stats(device)["reserved"]


def reset_peak_memory_stats(device=None) -> None:
    """Restart the device's peak counter at its current allocation."""
    _lib.tn_dev_reset_peak(device_index(device))


def empty_cache() -> None:
    """Return every device's cached free blocks to the host (live tensors are untouched)."""
    _lib.tn_dev_empty_cache(-1)


def set_memory_limit(nbytes: int, device=None) -> None:
    """Cap a device's memory (bytes, 0 = no cap; default: every device); also settable with
    ``TN_DEVICE_MEMORY=16g``."""
    _lib.tn_dev_set_limit(-1 if device is None else device_index(device), int(nbytes))
