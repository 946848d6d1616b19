# The `torch.neuron` module: device queries, synchronisation, memory statistics and op tracking of the neuron device.
"""What ``torch.neuron`` holds once ``import tn`` has registered the device.

One device (``neuron:0``, a single software NeuronCore); ops run
synchronously, so :func:`synchronize` returns at once. Random numbers come
from torch's CPU generator (``torch.manual_seed`` seeds them).
"""
from __future__ import annotations

import torch

from .allocator import (empty_cache, max_memory_allocated, memory_allocated, memory_reserved,  # noqa: F401
                        reset_peak_memory_stats, set_memory_limit, stats)
from .tracking import (device_time_ns, executed_ops, fallback_ops, fallback_reasons, fastpath_ops,  # noqa: F401
                       reset_op_counts)

__all__ = ["is_available", "is_initialized", "device_count", "current_device", "set_device", "synchronize",
           "manual_seed", "manual_seed_all", "seed", "initial_seed", "get_rng_state", "set_rng_state",
           "memory_allocated", "max_memory_allocated", "memory_reserved", "reset_peak_memory_stats",
           "empty_cache", "memory_stats", "set_memory_limit", "executed_ops", "fallback_ops", "fallback_reasons",
           "fastpath_ops", "reset_op_counts",
           "device_time_ns", "set_eager_mode", "get_eager_mode", "eager_mode", "window_stats", "reset_window_stats",
           "get_device_name", "device", "get_amp_supported_dtype", "is_bf16_supported",
           "mem_get_info", "reset_max_memory_allocated", "get_device_properties"]


def is_available() -> bool:
    """True: the software NeuronCore is always there."""
    return True


def is_initialized() -> bool:
    """True: the device needs no lazy initialisation."""
    return True


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    """1: tn models one NeuronCore."""
    return 1


def current_device() -> int:
    """0, the only device index."""
    return 0


def set_device(device) -> None:
    """Accept only device 0 (raises a clear error for any other index)."""
    from .aten import check_device

    check_device(torch.device("neuron", device) if isinstance(device, int) else device)


def get_device_name(device=None) -> str:
    """Name of the modelled core."""
    return "tn software NeuronCore (trn2)"


def get_amp_supported_dtype() -> list:
    """Dtypes ``torch.autocast("neuron", dtype=...)`` accepts (torch asks the device module for them)."""
    return [torch.bfloat16, torch.float16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """True: the NeuronCore computes in bfloat16 natively."""
    return True


def synchronize(device=None) -> None:
    """Wait for the device: runs the ops queued in adaptive eager windows (op mode has nothing to wait for)."""
    from . import windows

    windows.flush("synchronize")


def set_eager_mode(mode: str) -> None:
    """How eager ops run on the device: ``"op"`` (each op its own program, at once; the default, also
    ``TN_EAGER_MODE``) or ``"adaptive"`` (ops queued into windows, each compiled as one fused program and
    run when a value is needed; see :mod:`tn.device.windows`)."""
    from . import windows

    windows.set_mode(mode)


def get_eager_mode() -> str:
    """The device's eager mode: ``"op"`` or ``"adaptive"`` (see :func:`set_eager_mode`)."""
    from . import windows

    return windows.mode()


def eager_mode(mode: str):
    """Context manager: eager ops run in ``mode`` (``"op"`` or ``"adaptive"``) inside the block."""
    from . import windows

    return windows.eager_mode(mode)


def window_stats() -> dict:
    """Adaptive eager counters: windows, ops, ops per window, cache hits and hit rate, compiles, flush reasons."""
    from . import windows

    return windows.stats()


def reset_window_stats() -> None:
    """Zero :func:`window_stats`."""
    from . import windows

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
    import os

    s = stats()
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
    """``name`` and ``total_memory`` (see :func:`mem_get_info`) of the device, like ``torch.cuda``'s."""
    set_device(0 if device is None else device)
    return _DeviceProperties(get_device_name(), mem_get_info()[1])


def memory_stats(device=None) -> dict:
    """Allocator counters (see :func:`tn.device.allocator.stats`)."""
    return stats()


class device:
    """Context manager selecting a neuron device (only index 0 exists; any other raises a clear error)."""

    def __init__(self, device):
        from .aten import check_device

        if isinstance(device, int):
            device = torch.device("neuron", device)
        check_device(device)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
