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
from .tracking import device_time_ns, executed_ops, fallback_ops, fallback_reasons, reset_op_counts  # noqa: F401

__all__ = ["is_available", "is_initialized", "device_count", "current_device", "set_device", "synchronize",
           "manual_seed", "manual_seed_all", "seed", "initial_seed", "get_rng_state", "set_rng_state",
           "memory_allocated", "max_memory_allocated", "memory_reserved", "reset_peak_memory_stats",
           "empty_cache", "memory_stats", "set_memory_limit", "executed_ops", "fallback_ops", "fallback_reasons", "reset_op_counts",
           "device_time_ns", "get_device_name", "device"]


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


def synchronize(device=None) -> None:
    """Wait for the device: eager ops run synchronously, so there is nothing to wait for."""


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
