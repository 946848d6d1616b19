# The `torch.neuron` module: device queries, synchronisation, memory statistics and op tracking of the neuron device.
"""What ``torch.neuron`` holds once ``import tn`` has registered the device.

Devices ``neuron:0 .. neuron:N-1``, N = :func:`device_count`, the logical
cores of the modelled instance (:func:`tn.neuron.machine.machine`: ``TN_INSTANCE``,
``TN_LNC``; default one trn2 chip at LNC=2, 4 devices). The current device is
thread-local (:func:`set_device`, :class:`device`, :func:`current_device`), as
on CUDA; ``torch.device("neuron")`` and factories without an index land on
it. Each device has its own memory arena (:func:`memory_stats` and friends
take a device) and streams (:mod:`tn.device.streams`: :class:`Stream`,
:class:`Event`, :func:`stream`, :func:`current_stream`, ...). Ops run
synchronously on the host; streams and :func:`synchronize` act on the
modelled timeline. Random numbers come from torch's CPU generator
(``torch.manual_seed`` seeds them). Forking after the device was used makes
every device call in the child raise (:func:`_is_in_bad_fork`), as with CUDA.
"""
from __future__ import annotations

import os

import torch

from ..neuron.machine import machine as _machine
from . import allocator as _alloc
from . import windows
from .allocator import (  # noqa: F401
    empty_cache,
    max_memory_allocated,
    memory_allocated,
    memory_reserved,
    reset_peak_memory_stats,
    set_memory_limit,
    stats,
)
from .streams import (  # noqa: F401
    Event,
    Stream,
    StreamContext,
    current_stream,
    default_stream,
    reset_transfer_stats,
    set_stream,
    stream,
    transfer_stats,
)
from .streams import synchronize as _synchronize
from .tracking import device_time_ns, executed_ops, fallback_ops, fallback_reasons, fastpath_ops, reset_op_counts  # noqa: F401

__all__ = ["is_available", "is_initialized", "device_count", "current_device", "set_device", "synchronize",
           "manual_seed", "manual_seed_all", "seed", "initial_seed", "get_rng_state", "set_rng_state",
           "memory_allocated", "max_memory_allocated", "memory_reserved", "reset_peak_memory_stats",
           "empty_cache", "memory_stats", "set_memory_limit", "executed_ops", "fallback_ops", "fallback_reasons",
           "fastpath_ops", "reset_op_counts",
           "device_time_ns", "set_eager_mode", "get_eager_mode", "eager_mode", "window_stats", "reset_window_stats",
           "get_device_name", "device", "get_amp_supported_dtype", "is_bf16_supported",
           "mem_get_info", "reset_max_memory_allocated", "get_device_properties", "Stream", "Event",
           "StreamContext", "stream", "current_stream", "default_stream", "set_stream", "transfer_stats",
           "reset_transfer_stats", "machine"]


def is_available() -> bool:
    """True: the software NeuronCore is always there."""
    return True


def is_initialized() -> bool:
    """True once this process used the device (allocated memory or selected a device), as ``torch.cuda``'s, and
    False in a child forked after that."""
    return _alloc.initialized() and not _is_in_bad_fork()


def _is_in_bad_fork() -> bool:
    """True in a process forked after its parent used the neuron device (device calls there raise)."""
    return _alloc._STATE["bad_fork"]


def _lazy_init() -> None:
    if _alloc._STATE["bad_fork"]:
        raise _alloc._bad_fork_error()


def init() -> None:
    """Initialise the device (as ``torch.cuda.init``): marks it used; raises in a bad fork."""
    _alloc._mark_initialized()


def machine():
    """The modelled :class:`tn.neuron.machine.Machine` (instance, LNC, topology)."""
    return _machine()


def device_count() -> int:
    """Logical NeuronCores of the modelled instance (``TN_INSTANCE`` / ``TN_LNC``; default 4: one trn2 chip at
    LNC=2)."""
    return _alloc.device_count()


def current_device() -> int:
    """This thread's current device index (default 0)."""
    _lazy_init()
    return _alloc.current_index()


def set_device(device) -> None:
    """Make ``device`` (an index, ``"neuron:1"``, a torch.device) this thread's current device; a RuntimeError
    naming the device count for one that does not exist. A negative index is ignored, as on CUDA."""
    if isinstance(device, int) and device < 0:
        return
    _alloc.set_current_index(_alloc.device_index(device))


def get_device_name(device=None) -> str:
    """Name of the modelled core (``"tn software NeuronCore (trn2.3xlarge, LNC=2)"``)."""
    m = machine()
    return f"tn software NeuronCore ({m.name}, LNC={m.lnc})"


def get_amp_supported_dtype() -> list:
    """Dtypes ``torch.autocast("neuron", dtype=...)`` accepts (torch asks the device module for them)."""
    return [torch.bfloat16, torch.float16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """True: the NeuronCore computes in bfloat16 natively."""
    return True


def synchronize(device=None) -> None:
    """Wait for the device (default: the current one): runs the ops queued in adaptive eager windows; on the
    modelled timeline, work queued later starts after everything queued so far on the device's streams."""
    _lazy_init()
    windows.flush("synchronize")
    _synchronize(device)


def set_eager_mode(mode: str) -> None:
    """How eager ops run on the device: ``"op"`` (each op its own program, at once; the default, also
    ``TN_EAGER_MODE``) or ``"adaptive"`` (ops queued into windows, each compiled as one fused program and
    run when a value is needed; see :mod:`tn.device.windows`)."""
    windows.set_mode(mode)


def get_eager_mode() -> str:
    """The device's eager mode: ``"op"`` or ``"adaptive"`` (see :func:`set_eager_mode`)."""
    return windows.mode()


def eager_mode(mode: str):
    """Context manager: eager ops run in ``mode`` (``"op"`` or ``"adaptive"``) inside the block."""
    return windows.eager_mode(mode)


def window_stats() -> dict:
    """Adaptive eager counters: windows, ops, ops per window, cache hits and hit rate, compiles, flush reasons."""
    return windows.stats()


def reset_window_stats() -> None:
    """Zero :func:`window_stats`."""
    windows.reset_stats()


def manual_seed(seed: int) -> None:
    """Seed the device's random numbers (they come from torch's CPU generator)."""
    torch.manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    """Nothing to do: torch.manual_seed (which calls this) already seeded the CPU generator the device draws from."""


def seed() -> None:
    """Seed randomly (the CPU generator)."""
    torch.seed()


def initial_seed() -> int:
    """The CPU generator's initial seed."""
    return torch.initial_seed()


def get_rng_state(device=None) -> torch.Tensor:
    """The CPU generator's state (the device draws from it)."""
    return torch.get_rng_state()


def set_rng_state(state, device=None) -> None:
    """Set the CPU generator's state."""
    torch.set_rng_state(state)


def mem_get_info(device=None) -> tuple:
    """``(free, total)`` bytes of device memory: total is the limit set with ``TN_DEVICE_MEMORY`` /
    ``set_memory_limit``, or the host's physical memory when there is none (device memory is host memory);
    free is total minus what the allocator holds (:func:`memory_reserved`)."""
    s = stats(device)
    total = s["limit"]
    if not total:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 0
    return max(total - s["reserved"], 0), total


def reset_max_memory_allocated(device=None) -> None:
    """Same as :func:`reset_peak_memory_stats` (CUDA's older name)."""
    reset_peak_memory_stats(device)


class _DeviceProperties:
    def __init__(self, name: str, total_memory: int):
        self.name = name
        self.total_memory = total_memory
        self.type = "neuron"

    def __repr__(self):
        return f"_NeuronDeviceProperties(name='{self.name}', total_memory={self.total_memory >> 20}MB)"


def get_device_properties(device=None) -> _DeviceProperties:
    """``name`` and ``total_memory`` (see :func:`mem_get_info`) of the device, like ``torch.cuda``'s; also
    ``hbm_bytes`` (the modelled logical core's HBM) and ``index``."""
    index = _alloc.device_index(device)
    props = _DeviceProperties(get_device_name(), mem_get_info(index)[1])
    props.hbm_bytes = machine().hbm_bytes_per_device
    props.index = index
    return props


def memory_stats(device=None) -> dict:
    """Allocator counters of a device (see :func:`tn.device.allocator.stats`)."""
    return stats(device)


class device:
    """Context manager: ``device`` (index, ``"neuron:1"``, torch.device; None or -1: no change) is this thread's
    current device inside the block, as ``torch.cuda.device``."""

    def __init__(self, device):
        self.idx = -1 if device is None or (isinstance(device, int) and device < 0) else _alloc.device_index(device)
        self.prev_idx = -1

    def __enter__(self):
        if self.idx >= 0:
            self.prev_idx = _alloc.set_current_index(self.idx)
        return self

    def __exit__(self, *exc):
        if self.idx >= 0:
            _alloc.set_current_index(self.prev_idx)
        return False


class device_of(device):
    """Context manager: the device of tensor ``obj`` is current inside the block (no change for a CPU tensor)."""

    def __init__(self, obj):
        super().__init__(obj.get_device() if obj.device.type == "neuron" else -1)
