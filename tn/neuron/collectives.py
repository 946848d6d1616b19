# tn.neuron.collectives: timing model of collectives (ring all-reduce etc.) on the modelled machine (chip layer).
"""Modelled time of collectives over cores of a :class:`tn.neuron.machine.Machine`.

Pure functions of the machine, the participating cores and the bytes; no torch.distributed import.
Ring algorithms (the cores in :meth:`Machine.ring_order`): each step every core sends one chunk of
``nbytes / n`` to its ring neighbour, so a step costs the slowest link's latency plus chunk / bandwidth:

- all-gather, reduce-scatter: ``n - 1`` steps;
- all-reduce = reduce-scatter + all-gather: ``2 (n - 1)`` steps;
- broadcast: pipelined ring of ``n - 1`` steps of chunks ``nbytes / n`` plus ``n - 1`` fill steps
  (``2 (n - 1)`` steps, the same shape as all-reduce without the reduction);
- all-to-all: ``n - 1`` pairwise exchanges of ``nbytes / n`` each over the slowest link;
- send/recv: one transfer of ``nbytes`` over the link between the two cores.

Bus bandwidth follows NCCL tests: ``algbw = nbytes / time``; all-reduce ``busbw = algbw * 2 (n-1) / n``,
all-gather / reduce-scatter / all-to-all ``algbw * (n-1) / n``, broadcast and send/recv ``algbw``.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..errors import ArgumentValueError

#: Ring steps per collective as a function of ranks n.
_STEPS = {
    "all_reduce": lambda n: 2 * (n - 1),
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: n - 1,
    "broadcast": lambda n: 2 * (n - 1),
    "all_to_all": lambda n: n - 1,
}
#: NCCL tests' bus-bandwidth factor per collective.
_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
}


def collective_names():
    """Names accepted by :func:`collective_ns` and :func:`bus_bandwidth`."""
    return sorted(_BUS_FACTOR)


def ring_step(machine, cores: Sequence[int]):
    """``(latency_ns, bytes_per_s)`` of one ring step over ``cores``: the slowest link between ring neighbours
    (highest latency, lowest bandwidth)."""
    ring = machine.ring_order(cores)
    links = [machine.link(ring[i], ring[(i + 1) % len(ring)]) for i in range(len(ring))]
    return max(link.latency_ns for link in links), min(link.bytes_per_s for link in links)


def collective_ns(name: str, machine, nbytes: int, cores: Optional[Sequence[int]] = None) -> float:
    """Modelled ns of collective ``name`` moving ``nbytes`` (the full tensor per rank) over ``cores``
    (default: every core of the machine; for ``send_recv`` the two cores)."""
    if name not in _BUS_FACTOR:
        raise ArgumentValueError(f"tn: unknown collective {name!r}; known: {collective_names()}")
    if nbytes < 0:
        raise ArgumentValueError(f"tn: nbytes must be >= 0, got {nbytes}")
    cores = list(range(machine.world_size)) if cores is None else list(cores)
    n = len(cores)
    if name == "send_recv":
        if n != 2:
            raise ArgumentValueError(f"tn: send_recv needs 2 cores, got {n}")
        link = machine.link(cores[0], cores[1])
        return link.latency_ns + nbytes / link.bytes_per_s * 1e9
    if n <= 1:
        return 0.0
    latency_ns, bw = ring_step(machine, cores)
    chunk = nbytes / n
    return _STEPS[name](n) * (latency_ns + chunk / bw * 1e9)


def bus_bandwidth(name: str, nbytes: int, ns: float, n: int) -> float:
    """Bus bandwidth in bytes/s as NCCL tests define it, from bytes, modelled ns and ranks ``n``."""
    if ns <= 0:
        return 0.0
    return nbytes / (ns * 1e-9) * _BUS_FACTOR[name](n)
