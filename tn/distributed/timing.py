# Modelled time of the neuron backend's collectives: the group's cores, its collectives queue, profile records, counters.
"""How a collective of the ``neuron`` process group is timed on the modelled machine.

Each process group owns a :class:`CollectiveClock`: the global cores of its
ranks (exchanged when the group is made) and one queue on the rank's core of
:mod:`tn.neuron.timeline` (NCCL's internal stream, in CUDA terms). A
collective issued now

1. is costed by :func:`tn.neuron.collectives.collective_ns` over the group's
   cores (topology-aware ring: ranks in :meth:`Machine.ring_order`, each step
   as slow as the slowest link between ring neighbours; all-reduce is
   reduce-scatter + all-gather, ``2 (n - 1)`` steps, see that module);
2. starts when the issuing stream's queued work is done (its data is ready)
   and the core's ``"collectives"`` resource is free; it uses that resource,
   not ``"compute"``, so programs queued after it overlap it;
3. ends at ``end_ns``; whoever waits for the collective (``Work.wait()``, a
   synchronous call, functional ``wait_tensor``, DDP at the end of backward)
   makes its current stream wait until ``end_ns``;
4. is added to every active ``tn.profile()`` (``track="collectives"``, with
   bytes, ranks and the modelled algorithm) and to the process's counters
   (:func:`collective_stats`).

Algorithm choice (the only one modelled): a ring in torus snake order for
every collective. NCCL also has tree all-reduce for latency-bound sizes; on a
4x4 torus the ring's ``2 (n - 1)`` latency terms dominate only below ~64 KiB
(an assumption; the model says ring everywhere). Which bytes count:
all-reduce and broadcast the tensor; all-gather the gathered output;
reduce-scatter the input being scattered; all-to-all the larger of input and
output; reduce as all-reduce, gather/scatter as all-gather (upper bounds);
send/recv the tensor over the one link between the two cores; barrier an
all-reduce of 4 bytes (latency only).
"""
from __future__ import annotations

import threading
import time
from typing import Dict, Optional, Sequence, Tuple

from .. import profile as _profile
from ..neuron import collectives as _model
from ..neuron import timeline as _tl

__all__ = ["CollectiveClock", "collective_stats", "reset_collective_stats"]

#: Which timing-model collective stands for each backend operation (see the module docstring).
MODEL_OF = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "reduce": "all_reduce",
    "barrier": "all_reduce", "all_gather": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "gather": "all_gather", "scatter": "all_gather",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "broadcast": "broadcast", "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all", "send": "send_recv", "recv": "send_recv",
}

_STATS: Dict[str, Dict[str, float]] = {}
_LOCK = threading.Lock()


def _count(name: str, nbytes: int, modelled_ns: float, host_ns: float) -> None:
    with _LOCK:
        s = _STATS.setdefault(name, {"calls": 0, "bytes": 0, "modelled_ns": 0.0, "host_ns": 0.0})
        s["calls"] += 1
        s["bytes"] += int(nbytes)
        s["modelled_ns"] += modelled_ns
        s["host_ns"] += host_ns


def collective_stats() -> Dict[str, Dict[str, float]]:
    """Counters of this process's collectives on neuron tensors since the last reset, per operation
    (``"all_reduce"``, ``"all_gather_into_tensor"``, ...): ``calls``, ``bytes`` (as costed, see the module
    docstring), ``modelled_ns`` (sum of modelled durations) and ``host_ns`` (wall time the bytes took over gloo,
    checks included). Also ``torch.neuron.collective_stats()``."""
    with _LOCK:
        return {k: dict(v) for k, v in _STATS.items()}


def reset_collective_stats() -> None:
    """Zero the counters of :func:`collective_stats`."""
    with _LOCK:
        _STATS.clear()


class CollectiveClock:
    """Places one process group's collectives on the rank's core of the modelled timeline.

    ``machine`` is the modelled :class:`tn.neuron.machine.Machine`, ``cores[r]`` the global core of group rank
    ``r``, ``rank`` this process's group rank and ``device_index`` its neuron device (the timeline core)."""

    def __init__(self, machine, cores: Sequence[int], rank: int, device_index: int, group_name: str = ""):
        self.machine = machine
        self.cores = list(cores)
        self.rank = rank
        self.device_index = device_index
        self.group_name = group_name
        self.queue = _tl.new_queue(device_index)
        #: ``(start_ns, end_ns)`` of the latest collective placed (compiled programs' collective steps read it)
        self.last_span: Optional[Tuple[float, float]] = None

    def modelled_ns(self, op: str, nbytes: int, peer: Optional[int] = None) -> float:
        """Modelled ns of backend operation ``op`` moving ``nbytes`` (``peer``: the other group rank of send/recv)."""
        name = MODEL_OF[op]
        if name == "send_recv":
            return _model.collective_ns(name, self.machine, nbytes, [self.cores[self.rank], self.cores[peer]])
        return _model.collective_ns(name, self.machine, nbytes, self.cores)

    def place(self, op: str, nbytes: int, host_ns: float = 0.0, peer: Optional[int] = None) -> float:
        """Time ``op`` of ``nbytes`` issued now from the current stream: start after that stream's queued work on
        the core's collectives resource, record it in active profiles and the counters; returns its end (ns)."""
        ns = self.modelled_ns(op, nbytes, peer)
        issuing = _tl.current_queue(self.device_index)
        _tl.wait_until(self.queue, issuing.ready_ns)
        start, end = _tl.advance(ns, queue=self.queue, resource="collectives")
        self.last_span = (start, end)

        args = {"ranks": len(self.cores), "algorithm": "ring" if MODEL_OF[op] != "send_recv" else "p2p",
                "model": MODEL_OF[op], "group": self.group_name}
        if peer is not None:
            args["peer"] = peer
        _profile.add_record(self.device_index, op, start, end, nbytes, track="collectives", args=args)
        _count(op, nbytes, ns, host_ns)
        return end

    def wait(self, end_ns: float) -> None:
        """The current stream of the rank's core waits until ``end_ns`` (a collective it needs has ended)."""
        _tl.wait_until(_tl.current_queue(self.device_index), end_ns)


def host_clock() -> int:
    """Host wall clock in ns (what ``host_ns`` counts)."""
    return time.perf_counter_ns()
