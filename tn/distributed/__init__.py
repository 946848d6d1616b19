# tn.distributed: the `neuron` torch.distributed backend (registered at `import tn`) and its collective counters.
"""torch.distributed on the neuron device.

``import tn`` registers the process-group backend ``"neuron"`` the way
PyTorch intends for out-of-tree devices::

    torch.distributed.Backend.register_backend("neuron", tn.distributed.backend.create,
                                               extended_api=True, devices=["neuron"])

so ``init_process_group(backend="neuron")`` works under ``torchrun`` and
``torch.multiprocessing`` spawn, ``backend=None`` picks it (``neuron`` is
torch's accelerator once tn is imported) and ``"cpu:gloo,neuron:neuron"``
names it for neuron tensors. One process per (logical) core: the first
multi-rank group of a process whose ``TN_VISIBLE_CORES`` is unset makes the
rank's local core (torchrun's ``LOCAL_RANK``, else ``rank % devices``) its
only device, ``neuron:0``, as TorchNeuron does.

The bytes move over an inner gloo group on loopback; each collective is
timed on the modelled machine and recorded in ``tn.profile()`` (see
:mod:`tn.distributed.backend` and :mod:`tn.distributed.timing`).

>>> import torch.distributed as dist
>>> "neuron" in dist.Backend.backend_list
True
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .backend import (BACKEND_NAME, CollectiveError, CollectiveMismatchError, NeuronWork,  # noqa: F401
                      ProcessGroupDestroyedError, ProcessGroupNeuron, WrongDeviceError, create)
from .timing import collective_stats, reset_collective_stats  # noqa: F401
from . import spawn  # noqa: F401,E402  (run_ranks: spawned ranks with a hard timeout, for tests and benches)
from . import compiled  # noqa: E402  (collectives of compiled programs: tn.ops.collective's group access)

__all__ = ["ProcessGroupNeuron", "NeuronWork", "CollectiveError", "CollectiveMismatchError", "WrongDeviceError",
           "ProcessGroupDestroyedError", "collective_stats", "reset_collective_stats", "register", "BACKEND_NAME"]


def register() -> None:
    """Register the ``neuron`` backend with torch.distributed (idempotent; ``import tn`` calls it), put the
    collective counters on ``torch.neuron`` and let compiled programs' collectives reach process groups
    (:func:`tn.distributed.compiled.install`)."""
    compiled.install()
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=["neuron"])
    mod = getattr(torch, "neuron", None)
    if mod is not None:
        mod.collective_stats = collective_stats
        mod.reset_collective_stats = reset_collective_stats


if dist.is_available():
    register()
