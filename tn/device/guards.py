# Guards for torch entry points that assume a C++ backend: storages/torch.load, tensor printing, torch.accelerator.
"""Make torch entry points that assume a C++ backend right for the ``neuron`` device.

torch has no C++ allocator for PrivateUse1 devices registered from Python,
so ``torch.UntypedStorage(n, device="neuron")`` (which ``torch.load(...,
map_location="neuron")`` and ``storage.to("neuron")`` use) would crash the
process. :func:`install` wraps ``torch.UntypedStorage.__new__`` so that a
neuron storage comes from tn's allocator instead, and
``UntypedStorage.resize_`` (which for PrivateUse1 needs a C++ hook; FSDP2
frees and re-allocates its unsharded parameters with it) so that a neuron
storage is resized in place by :func:`tn.device.allocator.resize_storage`.

Printing (``repr``/``str`` of a neuron tensor): torch formats a tensor with
tensor ops (``masked_select``, ``abs``, ``max``, ``ne`` ... to pick the number
format), which on the device would be eager programs and host fallbacks,
counted in the op tracking and refused under ``TN_STRICT=1``. Formatting is a
read on the host, so :func:`install` wraps ``torch._tensor_str._tensor_str``
to format a CPU view of the device memory instead (no copy, no device op; the
``device='neuron:0'`` and ``grad_fn`` suffixes are unchanged), as torch does
for XLA/lazy tensors.

``torch.accelerator`` (torch's device-generic API; ``neuron`` is the current
accelerator once tn is imported): ``synchronize``, the device index and stream
functions and the memory functions reach C++ hooks (torch 2.13's Python
device guard always answers device 0 and the default stream, a
``c10::DeviceAllocator``) that a Python backend cannot register.
:func:`install` points them at :mod:`tn.device.backend` while the accelerator
is ``neuron``: ``current_device_index``, ``set_device_index``,
``device_index`` (the context manager), ``current_stream``, ``set_stream``,
``synchronize``, ``empty_cache``, ``memory_stats`` (torch's
flat key names for what the allocator counts), ``memory_allocated``,
``max_memory_allocated``, ``memory_reserved``, ``reset_peak_memory_stats``,
``get_memory_info``; ``max_memory_reserved`` and
``reset_accumulated_memory_stats`` raise a clear error (the allocator keeps
no peak of reserved memory and no accumulated counters).
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch._tensor_str as ts
from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

from ..errors import ArgumentTypeError, UnsupportedOpError
from . import backend
from .allocator import alloc_storage, cpu_alias, resize_storage
from .aten import check_device

__all__ = ["install"]

_INSTALLED = []


def _is_neuron(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return False
    try:
        return torch.device(device).type == "neuron"
    except (RuntimeError, TypeError):
        return False


def install() -> None:
    """Wrap ``torch.UntypedStorage.__new__``, tensor printing and ``torch.accelerator`` (idempotent)."""
    if _INSTALLED:
        return
    cls = torch.UntypedStorage
    orig_new = cls.__new__

    def __new__(klass, *args, device=None, **kwargs):
        if _is_neuron(device):
            index = check_device(device)
            if kwargs or len(args) > 1 or (args and not isinstance(args[0], int)):
                raise ArgumentTypeError("torch.UntypedStorage(..., device='neuron') takes only a size in bytes; build the "
                              "storage on the CPU and move it with .to('neuron')")
            st = alloc_storage(int(args[0]) if args else 0, index)
            if klass is not cls:
                raise UnsupportedOpError(f"{klass.__name__}(device='neuron') is not supported; use torch.UntypedStorage")
            return st
        if device is not None:
            kwargs["device"] = device
        return orig_new(klass, *args, **kwargs)

    cls.__new__ = __new__
    orig_resize = cls.resize_

    def resize_(self, size):
        """``UntypedStorage.resize_``; a neuron storage is resized by tn's allocator (same storage object)."""
        if self.device.type == "neuron":
            resize_storage(self, size)
            return self
        return orig_resize(self, size)

    cls.resize_ = resize_
    _INSTALLED.append(orig_new)
    _wrap_tensor_str()
    _wrap_accelerator()


def _wrap_tensor_str() -> None:
    orig = ts._tensor_str

    def _tensor_str(self, indent):
        if self.device.type == "neuron":
            self = cpu_alias(self)
        return orig(self, indent)

    _tensor_str.__wrapped__ = orig
    ts._tensor_str = _tensor_str


def _neuron_is_accelerator() -> bool:
    acc = torch._C._accelerator_getAccelerator()
    return acc is not None and acc.type == "neuron"


def _accelerator_impls() -> dict:
    def memory_stats(device_index=None, /):
        s = backend.memory_stats(device_index)
        return OrderedDict(sorted({
            "allocated_bytes.all.current": s["allocated"], "allocated_bytes.all.peak": s["peak"],
            "reserved_bytes.all.current": s["reserved"], "requested_bytes.all.current": s["requested"],
            "allocation.all.allocated": s["allocs"], "allocation.all.freed": s["frees"],
            "allocation.all.current": s["allocs"] - s["frees"], "num_cache_hits": s["cache_hits"]}.items()))

    def untracked(what):
        def fn(device_index=None, /):
            raise UnsupportedOpError(f"torch.accelerator.{what}: the neuron device's allocator does not track this; use "
                          f"torch.neuron.memory_stats() (allocated, peak allocated, reserved, requested, counts)")

        fn.__name__ = what
        return fn

    def device_index(device, /):
        return backend.device(device)

    return {
        "current_device_index": lambda: backend.current_device(),
        "current_device_idx": lambda: backend.current_device(),
        "set_device_index": lambda device, /: backend.set_device(device),
        "set_device_idx": lambda device, /: backend.set_device(device),
        "device_index": device_index,
        "current_stream": lambda device=None, /: backend.current_stream(device),
        "set_stream": lambda stream, /: backend.set_stream(stream),
        "synchronize": lambda device=None, /: backend.synchronize(device),
        "empty_cache": lambda: backend.empty_cache(),
        "memory_stats": memory_stats,
        "memory_allocated": lambda device_index=None, /: backend.memory_allocated(device_index),
        "max_memory_allocated": lambda device_index=None, /: backend.max_memory_allocated(device_index),
        "memory_reserved": lambda device_index=None, /: backend.memory_reserved(device_index),
        "reset_peak_memory_stats": lambda device_index=None, /: backend.reset_peak_memory_stats(device_index),
        "get_memory_info": lambda device_index=None, /: backend.mem_get_info(device_index),
        "max_memory_reserved": untracked("max_memory_reserved"),
        "reset_accumulated_memory_stats": untracked("reset_accumulated_memory_stats"),
    }


def _skip_frame(code) -> None:
    """Tell Dynamo never to compile frames running ``code`` nor the frames it calls (tn's own device code)."""
    set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))


def _wrap_accelerator() -> None:
    acc = getattr(torch, "accelerator", None)
    if acc is None:
        return
    mem = getattr(acc, "memory", None)
    for name, impl in _accelerator_impls().items():
        for mod in (acc, mem):
            orig = getattr(mod, name, None) if mod is not None else None
            if orig is None or getattr(orig, "_tn_neuron", False):
                continue

            def wrapper(*args, _orig=orig, _impl=impl, **kwargs):
                if _neuron_is_accelerator():
                    return _impl(*args, **kwargs)
                return _orig(*args, **kwargs)

            # Dynamo must not compile the wrapper as a frame of its own: its guards and stream tracking call
            # torch.accelerator.current_stream at run time, and a frame traced there is a graph break in the user's
            # count. Calls from traced user code still reach Dynamo's handlers, which look the wrapper up by identity.
            _skip_frame(wrapper.__code__)
            wrapper.__name__ = name
            wrapper.__doc__ = orig.__doc__
            wrapper.__wrapped__ = orig
            wrapper._tn_neuron = True
            setattr(mod, name, wrapper)
