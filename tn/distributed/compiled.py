# How collectives inside compiled programs (tn.jit, torch.compile) reach their process group and get their time.
"""The group access of :mod:`tn.ops.collective`: collectives of compiled programs, over real process groups.

A compiled program's collective step (:mod:`tn.lower.collective`) hands a
CPU tensor (the program's value in modelled HBM) to
:func:`tn.ops.collective.issue`, which asks the resolver installed here
(:func:`install`, at ``import tn``) how to reach the group:

* a group of the ``neuron`` backend (:class:`~tn.distributed.backend.ProcessGroupNeuron`,
  also as the neuron backend of a ``"cpu:gloo,neuron:neuron"`` group): the
  value is put in a neuron tensor of the rank's device (a host copy, no
  device op) and the group's own method runs on it, in place (all-reduce,
  broadcast) or into a neuron output: the backend checks the ranks agree,
  moves the bytes over its gloo group and places the collective on the
  core's ``"collectives"`` resource with its clock, as for an eager call
  (profile record, :func:`tn.distributed.collective_stats`). The wait is the
  returned ``Work``'s modelled wait;
* any other group (gloo on CPU tensors): torch's functional collective moves
  the bytes; when timed, a :class:`~tn.distributed.timing.CollectiveClock`
  of that group on the current core places it (the same model and records).
  The group's ranks sit on global cores = their global ranks (one process
  per core on one instance) unless :func:`set_group_cores` says otherwise.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllreduceOptions,
    AllToAllOptions,
    BroadcastOptions,
    ReduceOp,
    ReduceScatterOptions,
)
from torch.distributed import distributed_c10d as c10d

from ..device.allocator import cpu_alias
from ..errors import ArgumentValueError
from ..neuron import timeline
from ..neuron.machine import machine
from ..ops import collective as collective_ops
from ..ops.collective import CollectiveRun, Pending, call_functional, collective_nbytes
from . import timing
from .backend import ProcessGroupNeuron

__all__ = ["install", "resolve", "set_group_cores", "NeuronGroupAccess", "FunctionalGroupAccess"]

#: The backend operation (as :class:`~tn.distributed.timing.CollectiveClock` and the eager backend name it) of
#: each collective op.
BACKEND_OP = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
              "reduce_scatter": "reduce_scatter_tensor", "all_to_all": "all_to_all_single",
              "broadcast": "broadcast"}

_CORES: list = [None]
_CLOCKS: Dict[Tuple[str, int], timing.CollectiveClock] = {}
_LOCK = threading.Lock()


def _reduce_op(name: str) -> ReduceOp:
    """torch's ``ReduceOp`` of a functional collective's reduce-op string (``"sum"``, ``"avg"``, ...)."""
    op = getattr(ReduceOp, str(name).upper(), None)
    if not isinstance(op, ReduceOp.RedOpType):
        raise ArgumentValueError(f"tn: unknown reduce op {name!r} of a functional collective; use sum, avg, "
                                 f"product, min, max, band, bor or bxor")
    return op


def _neuron_group(pg: Any) -> Optional[ProcessGroupNeuron]:
    """The neuron process group behind ``pg`` (the group itself, or its backend for neuron tensors)."""
    if isinstance(pg, ProcessGroupNeuron):
        return pg
    try:
        backend = pg._get_backend(torch.device("neuron"))
    except Exception:   # no backend for neuron tensors in this group
        return None
    return backend if isinstance(backend, ProcessGroupNeuron) else None


class NeuronGroupAccess:
    """Runs collective ops on a :class:`ProcessGroupNeuron` (see the module docstring)."""

    def __init__(self, pg: ProcessGroupNeuron):
        self.pg = pg

    def issue(self, name: str, x: torch.Tensor, attrs: Dict[str, Any], timed: bool = True) -> Pending:
        """Run op ``name`` on CPU tensor ``x`` over the group (the neuron backend always times it)."""
        pg = self.pg
        dev = torch.empty(tuple(x.shape), dtype=x.dtype, device=pg.device)
        cpu_alias(dev).copy_(x)
        if name == "all_reduce":
            o = AllreduceOptions()
            o.reduceOp = _reduce_op(attrs["reduce_op"])
            out, work = dev, pg.allreduce([dev], o)
        elif name == "broadcast":
            o = BroadcastOptions()
            o.rootRank, o.rootTensor = int(attrs["src"]), 0
            out, work = dev, pg.broadcast([dev], o)
        elif name == "all_gather":
            out = torch.empty((x.shape[0] * pg.size(),) + tuple(x.shape[1:]), dtype=x.dtype, device=pg.device)
            work = pg.all_gather_single(out, dev)
        elif name == "reduce_scatter":
            o = ReduceScatterOptions()
            o.reduceOp = _reduce_op(attrs["reduce_op"])
            out = torch.empty((x.shape[0] // pg.size(),) + tuple(x.shape[1:]), dtype=x.dtype, device=pg.device)
            work = pg.reduce_scatter_single(out, dev, o)
        elif name == "all_to_all":
            outs = list(attrs["output_split_sizes"])
            out = torch.empty((sum(outs),) + tuple(x.shape[1:]), dtype=x.dtype, device=pg.device)
            work = pg.all_to_all_single(out, dev, outs, list(attrs["input_split_sizes"]), AllToAllOptions())
        else:
            raise ArgumentValueError(f"tn: {name!r} is not a collective op")
        result = cpu_alias(out).clone()
        start, end = pg.clock.last_span
        run = CollectiveRun(name, collective_nbytes(name, x, result), pg.clock.device_index, start, end, pg.cores)
        return Pending(result, run, work.wait)


class FunctionalGroupAccess:
    """Runs collective ops on any other process group through torch's functional collectives (CPU tensors), timed
    by a :class:`~tn.distributed.timing.CollectiveClock` of the group on the current core."""

    def __init__(self, pg: Any, group_name: str):
        self.pg = pg
        self.group_name = group_name

    def cores(self) -> list:
        """Global modelled cores of the group's ranks (:func:`set_group_cores`, else their global ranks)."""
        fn = _CORES[0]
        cores = fn(self.group_name) if fn is not None else None
        if cores is None:
            try:
                cores = dist.get_process_group_ranks(self.pg)
            except Exception:      # a group the default world does not list: ranks 0 .. size-1
                cores = range(self.pg.size())
        return [int(c) for c in cores]

    def clock(self) -> timing.CollectiveClock:
        """The group's clock on the current core (made on first use)."""
        core = timeline.current_core()
        key = (self.group_name, core)
        with _LOCK:
            c = _CLOCKS.get(key)
            if c is None or c.cores != self.cores():
                c = _CLOCKS[key] = timing.CollectiveClock(machine(), self.cores(), self.pg.rank(), core,
                                                          self.group_name)
        return c

    def issue(self, name: str, x: torch.Tensor, attrs: Dict[str, Any], timed: bool = True) -> Pending:
        """Run op ``name`` on CPU tensor ``x`` over the group; with ``timed``, place it on the group's clock."""
        result = collective_ops.functional_ops().wait_tensor(call_functional(name, x, attrs))
        nbytes = collective_nbytes(name, x, result)
        if not timed:
            return Pending(result, CollectiveRun(name, nbytes))
        clock = self.clock()
        end = clock.place(BACKEND_OP[name], nbytes)
        start, _ = clock.last_span
        run = CollectiveRun(name, nbytes, clock.device_index, start, end, clock.cores)
        return Pending(result, run, lambda: clock.wait(end))


def resolve(group_name: str) -> Any:
    """The access of process group ``group_name`` (:class:`NeuronGroupAccess` or :class:`FunctionalGroupAccess`)."""
    pg = c10d._resolve_process_group(group_name)
    neuron = _neuron_group(pg)
    if neuron is not None:
        return NeuronGroupAccess(neuron)
    return FunctionalGroupAccess(pg, group_name)


def set_group_cores(resolver: Optional[Callable[[str], Optional[Sequence[int]]]]) -> None:
    """Install ``resolver(group_name) -> global cores of the group's ranks (group-rank order) or None`` for groups
    of other backends than ``neuron`` (whose ranks say their cores themselves); ``None`` removes it."""
    _CORES[0] = resolver


def install() -> None:
    """Make :func:`tn.ops.collective.issue` reach process groups through :func:`resolve` (``import tn`` does)."""
    collective_ops.set_group_access(resolve)
