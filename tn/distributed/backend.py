# The `neuron` torch.distributed process group: collectives on neuron tensors, bytes over an inner gloo group, timed.
"""``ProcessGroupNeuron``: the Python process group behind ``init_process_group(backend="neuron")``.

PyTorch's way for an out-of-tree backend written in Python is a subclass of
``torch.distributed.ProcessGroup`` (C++ callers such as DDP's reducer and the
``_c10d_functional`` ops reach its methods through pybind's trampoline) made
by a creator registered with ``Backend.register_backend(name, creator,
extended_api=True, devices=["neuron"])``. :func:`create` is that creator.

How a collective runs (every method below follows it):

1. **checks**: every tensor is a neuron tensor of this rank's device (else
   :class:`WrongDeviceError`; CPU tensors are taken only when the job was
   started with ``"cpu:gloo,neuron:neuron"``), the group is not destroyed
   (:class:`ProcessGroupDestroyedError`), and, with ``TN_DIST_CHECK`` on (the
   default), the ranks agree on the call: a metadata record (operation,
   dtype, shape, root, splits; ``16 + 2 * world`` int64) is all-gathered over
   gloo first and any disagreement raises :class:`CollectiveMismatchError`
   on every rank, naming each rank's view (cost: one small extra all-gather
   per collective, ~0.1 ms on loopback);
2. **bytes**: the neuron tensors are host memory, so gloo works on CPU
   aliases of them (:func:`tn.device.allocator.cpu_alias`: same memory, no
   copy); a non-contiguous tensor goes through a contiguous copy that is
   written back into the original view (strides and offset kept). The inner
   gloo group runs on loopback with the group's timeout (``init_process_group``'s
   ``timeout``; ``new_group(timeout=...)`` for other groups, whose default is torch's 30 min);
   AVG is SUM then a division on the host (gloo has no AVG), PREMUL_SUM (FSDP2's
   divide factor) SUM then a product;
3. **time**: :class:`tn.distributed.timing.CollectiveClock` places it on the
   rank's core (``"collectives"`` resource), records it in ``tn.profile()``
   and counts it (:func:`tn.distributed.collective_stats`).

The bytes move synchronously when the collective is issued; the returned
:class:`NeuronWork` is complete (``is_completed()`` True, ``get_future()``
done with the result tensors). What is asynchronous is the *modelled* time:
``wait()`` makes the current stream wait for the collective's modelled end,
so compute issued before ``wait()`` overlaps it. A future taken inside a
backward pass (DDP's reducer) makes the stream wait at the end of that
backward; taken elsewhere, at once. A rank that dies or never joins makes
gloo fail within the timeout; that becomes :class:`CollectiveError` on every
surviving rank. Errors are raised by the call that hits them and the group
stays usable only for the mismatch case (every rank raised before moving
bytes).
"""
from __future__ import annotations

import datetime
import os
import warnings
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    PrefixStore,
    ProcessGroupGloo,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

from .. import config
from ..config import ConfigError
from ..device import allocator
from ..device.allocator import cpu_alias
from ..errors import ArgumentTypeError, TnError
from ..neuron.machine import machine
from . import timing

__all__ = ["ProcessGroupNeuron", "NeuronWork", "CollectiveError", "CollectiveMismatchError", "WrongDeviceError",
           "ProcessGroupDestroyedError", "create", "BACKEND_NAME"]

#: The name ``init_process_group(backend=...)`` takes.
BACKEND_NAME = "neuron"


class CollectiveError(TnError, RuntimeError):
    """A collective of the neuron backend failed (a rank died or did not join within the timeout, gloo failed)."""


class CollectiveMismatchError(CollectiveError):
    """The ranks of a group called a collective with different operations, dtypes, shapes, roots or splits."""


class WrongDeviceError(CollectiveError):
    """A tensor given to the neuron process group is not on this rank's neuron device."""


class ProcessGroupDestroyedError(CollectiveError):
    """A neuron process group was used after ``destroy_process_group``."""


_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)
_OPS = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced", "reduce_scatter", "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced", "broadcast", "all_to_all", "all_to_all_single", "barrier", "reduce",
        "gather", "scatter")
_MAX_DIMS = 8


def _dtype_code(dtype) -> int:
    try:
        return _DTYPES.index(dtype)
    except ValueError:
        return 100 + abs(hash(str(dtype))) % 1000


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class NeuronWork(dist.Work):
    """The handle of one collective: already done on the host; ``wait()`` is the modelled wait (see the module
    docstring). ``result()`` / ``get_future()`` give the result tensors."""

    def __init__(self, result: List[torch.Tensor], clock: Optional[timing.CollectiveClock], end_ns: float):
        super().__init__()
        self._result = list(result)
        self._clock = clock
        self._end_ns = end_ns
        self._future = None

    def wait(self, timeout: datetime.timedelta = None) -> bool:
        """The current stream waits for the collective's modelled end; True (the bytes already moved)."""
        if self._clock is not None:
            self._clock.wait(self._end_ns)
        return True

    def is_completed(self) -> bool:
        """True: the bytes moved when the collective was issued."""
        return True

    def is_success(self) -> bool:
        """True (a failed collective raises when issued, it never returns a Work)."""
        return True

    def exception(self):
        """None (a failed collective raises when issued)."""
        return None

    def result(self) -> List[torch.Tensor]:
        """The tensors the collective wrote (as torch's Work.result())."""
        return self._result

    def synchronize(self) -> None:
        """Same as :meth:`wait`."""
        self.wait()

    def get_future(self) -> torch.futures.Future:
        """A completed future holding :meth:`result`. Taken inside a backward pass (DDP's comm hooks), the current
        stream waits for the modelled end when that backward ends; elsewhere at once."""
        if self._future is None:
            # No devices=: a device-aware future asks the device guard for streams (then() needs a stream pool),
            # which tn's Python device guard cannot give; the bytes are already in place anyway.
            fut = torch.futures.Future()
            fut.set_result(self._result)
            self._future = fut
            if self._clock is not None:
                clock, end = self._clock, self._end_ns
                try:
                    torch.autograd.Variable._execution_engine.queue_callback(lambda: clock.wait(end))
                except RuntimeError:   # not inside a backward pass
                    clock.wait(end)
        return self._future


class _Staged:
    """A tensor as gloo sees it: a contiguous CPU tensor on the same memory (or a contiguous copy written back)."""

    __slots__ = ("orig", "alias", "host", "neuron")

    def __init__(self, t: torch.Tensor):
        self.orig = t
        self.neuron = t.device.type == "neuron"
        if self.neuron:
            self.alias = cpu_alias(t)
        else:
            self.alias = t
        self.host = self.alias if self.alias.is_contiguous() else self.alias.contiguous()

    def write_back(self) -> None:
        """Make the original tensor hold what gloo wrote (copy back if staged, bump the version counter)."""
        if self.host is not self.alias:
            self.alias.copy_(self.host)
        if self.neuron:
            torch.autograd.graph.increment_version(self.orig)


def _reduce_op(opts) -> tuple:
    """``(gloo op, post)`` for the options' reduce op; ``post(host_tensor)`` finishes the result in place or is
    None. gloo has neither AVG (SUM, then divide by the group size) nor PREMUL_SUM (SUM, then times the factor:
    ``sum(f * x_r) = f * sum(x_r)``; FSDP2 uses it with a gradient divide factor)."""
    op = opts.reduceOp
    if op == ReduceOp.AVG:
        return ReduceOp.SUM, "avg"
    if op == ReduceOp.PREMUL_SUM:
        factor = op.factor
        if isinstance(factor, torch.Tensor):
            factor = factor.detach().to("cpu")
        return ReduceOp.SUM, factor
    return op, None


def _post(post, host: torch.Tensor, size: int) -> None:
    """Apply the post step of :func:`_reduce_op` to a reduced host tensor."""
    if post is None:
        return
    if not (host.is_floating_point() or host.is_complex()):
        raise CollectiveError(f"tn: ReduceOp.AVG / PREMUL_SUM need a floating tensor, got {host.dtype}")
    if isinstance(post, str):
        host.div_(size)
    else:
        host.mul_(post)


class ProcessGroupNeuron(dist.ProcessGroup):
    """The ``neuron`` process group of one rank (see the module docstring). Made by :func:`create`."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta,
                 global_ranks: Optional[Sequence[int]] = None, group_name: str = ""):
        super().__init__(rank, size)
        self._rank = rank
        self._size = size
        self._timeout = timeout
        self._destroyed = False
        self._seq = 0
        self._tn_group_name = group_name
        self._accept_cpu = None
        opts = ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        self._gloo = ProcessGroupGloo(PrefixStore("tn-neuron-gloo/", store), rank, size, opts)
        global_ranks = list(global_ranks) if global_ranks else list(range(size))
        self._device_index = _pick_device(rank, size, global_ranks)
        self._device = torch.device("neuron", self._device_index)

        m = machine()
        mine = torch.tensor([_global_core(m, global_ranks[rank], self._device_index)], dtype=torch.int64)
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        self._gloo_call("exchanging cores", self._gloo.allgather, [gathered], [mine], AllgatherOptions())
        cores = [int(c.item()) for c in gathered]
        if len(set(cores)) != len(cores):
            warnings.warn(f"tn: ranks of the neuron process group sit on the same modelled cores {cores} "
                          "(TN_VISIBLE_CORES the same in several processes?); timing uses cores 0..n-1 instead")
            cores = list(range(size))
        self.clock = timing.CollectiveClock(m, cores, rank, self._device_index, group_name)

    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:
        """``"neuron"``."""
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        """``"neuron"``."""
        return BACKEND_NAME

    def size(self) -> int:
        """Ranks in the group."""
        return self._size

    def rank(self) -> int:
        """This process's rank in the group."""
        return self._rank

    def _set_group_name(self, name: str) -> None:
        self._tn_group_name = name
        self.clock.group_name = name

    def getGroupName(self) -> str:
        """The group's registered name (C++ callers: functional collectives resolve groups by it)."""
        return self._tn_group_name

    @property
    def group_name(self) -> str:
        """The group's registered name."""
        return self._tn_group_name

    def _set_group_desc(self, desc: str) -> None:
        self._tn_group_desc = desc

    def getGroupDesc(self) -> str:
        """The group's description (``"default_pg"``, ``"undefined"``...)."""
        return getattr(self, "_tn_group_desc", "")

    @property
    def group_desc(self) -> str:
        """The group's description."""
        return self.getGroupDesc()

    @property
    def _device_types(self):
        cpu = self._takes_cpu()
        return [torch.device("cpu"), torch.device("neuron")] if cpu else [torch.device("neuron")]

    @property
    def device(self) -> torch.device:
        """The neuron device this rank's collectives take (``neuron:0`` in the one-process-per-core layout)."""
        return self._device

    @property
    def cores(self) -> List[int]:
        """Global modelled core of each group rank (what the timing model rings over)."""
        return list(self.clock.cores)

    def __repr__(self):
        return f"ProcessGroupNeuron(rank={self._rank}, size={self._size}, device={self._device}, cores={self.cores})"

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Called by ``destroy_process_group``: later use raises :class:`ProcessGroupDestroyedError`."""
        if not self._destroyed:
            self._destroyed = True
            try:
                self._gloo.shutdown()
            except Exception:   # gloo already torn down by a dead peer
                pass
            # Drop the inner group now, so its destructor joins gloo's worker and transport threads here, on
            # the caller's thread, and not at interpreter exit, where a still-running gloo thread can abort
            # the process ("terminate called without an active exception", seen once under load in CI).
            self._gloo = None

    def abort(self) -> None:
        """Same as :meth:`shutdown`."""
        self.shutdown()

    # ------------------------------------------------------------------ helpers
    def _takes_cpu(self) -> bool:
        if self._accept_cpu is None:
            conf = dist.distributed_c10d._world.pg_backend_config.get(self)
            if conf is None:
                return False
            self._accept_cpu = any(part.split(":")[0].strip() == "cpu" for part in str(conf).split(",")
                                   if ":" in part)
        return self._accept_cpu

    def _alive(self, what: str) -> None:
        if self._destroyed:
            raise ProcessGroupDestroyedError(
                f"tn: {what} on a neuron process group after destroy_process_group(); make a new group with "
                f"init_process_group / new_group")

    def _stage(self, what: str, tensors: Sequence[torch.Tensor]) -> List[_Staged]:
        """Check every tensor's device and stage it for gloo."""
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise ArgumentTypeError(f"tn: {what} takes tensors, got {type(t).__name__}")
            dev = t.device
            if dev.type == "neuron":
                if dev.index != self._device_index:
                    raise WrongDeviceError(
                        f"tn: {what} got a tensor on {dev}, but this rank's neuron process group runs on "
                        f"{self._device} (one process per core: the rank's core is its neuron:0); move it with "
                        f".to({str(self._device)!r})")
            elif dev.type == "cpu":
                if not self._takes_cpu():
                    raise WrongDeviceError(
                        f"tn: {what} got a CPU tensor, but this process group is neuron-only "
                        f"(backend='neuron'); move it to {self._device}, or start the job with "
                        f"init_process_group(backend='cpu:gloo,neuron:neuron') to also reduce CPU tensors")
            else:
                raise WrongDeviceError(f"tn: {what} got a tensor on {dev}; the neuron process group takes tensors "
                                       f"on {self._device}")
        return [_Staged(t) for t in tensors]

    def _gloo_call(self, what: str, fn, *args):
        try:
            work = fn(*args)
            work.wait()
            return work
        except CollectiveError:
            raise
        except Exception as e:   # gloo's RuntimeError/DistBackendError: a dead peer, a timeout, closed connections
            raise CollectiveError(
                f"tn: {what} failed on rank {self._rank} of {self._size}: a rank of the group died, left or did "
                f"not join within the group's timeout ({self._timeout.total_seconds():g} s: init_process_group's, or "
                f"new_group's timeout=). "
                f"gloo said: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from e

    def _check(self, op: str, dtype=None, shape=(), extra: Sequence[int] = (), splits=None) -> None:
        """All-gather the call's metadata and raise CollectiveMismatchError on every rank when ranks disagree."""
        self._seq += 1
        if not config.get("dist_check") or self._size == 1:
            return
        n = self._size
        rec = torch.zeros(16 + 2 * n, dtype=torch.int64)
        shape = tuple(shape)
        rec[0] = _OPS.index(op)
        rec[1] = -1 if dtype is None else _dtype_code(dtype)
        rec[2] = len(shape)
        for i, d in enumerate(shape[:_MAX_DIMS]):
            rec[3 + i] = d
        for i, x in enumerate(list(extra)[:5]):
            rec[11 + i] = x
        if splits is not None:
            ins, outs = splits
            rec[16:16 + n] = torch.tensor(ins, dtype=torch.int64)
            rec[16 + n:16 + 2 * n] = torch.tensor(outs, dtype=torch.int64)
        got = [torch.zeros_like(rec) for _ in range(n)]
        self._gloo_call(f"{op} (metadata check)", self._gloo.allgather, [got], [rec], AllgatherOptions())
        bad = None
        if any(int(g[0]) != int(rec[0]) for g in got):
            bad = "operation"
        elif splits is None:
            if any(not torch.equal(g[:16], got[0][:16]) for g in got):
                bad = "dtype/shape/root"
        else:
            if any(not torch.equal(g[:16], got[0][:16]) for g in got):
                bad = "dtype/trailing shape"
            else:
                for r in range(n):
                    for j in range(n):
                        if int(got[r][16 + j]) != int(got[j][16 + n + r]):
                            bad = "split sizes"
        if bad is None:
            return

        def view(g):
            code = int(g[1])
            dt = _DTYPES[code] if 0 <= code < len(_DTYPES) else ("-" if code == -1 else "?")
            nd = int(g[2])
            dims = [int(x) for x in g[3:3 + min(nd, _MAX_DIMS)]]
            s = f"{_OPS[int(g[0])]}({dt}, {list(dims)}"
            if any(int(x) for x in g[11:16]):
                s += f", args={[int(x) for x in g[11:16]]}"
            if splits is not None:
                s += f", in_splits={[int(x) for x in g[16:16 + n]]}, out_splits={[int(x) for x in g[16 + n:]]}"
            return s + ")"

        ranks = "; ".join(f"rank {r}: {view(g)}" for r, g in enumerate(got))
        raise CollectiveMismatchError(
            f"tn: the ranks of the neuron process group disagree on the {bad} of collective #{self._seq} "
            f"({ranks}). Every rank must call the same collectives in the same order with matching tensors "
            f"(TN_DIST_CHECK=0 turns this check off)")

    def _finish(self, op: str, staged: Sequence[_Staged], result: Sequence[torch.Tensor], nbytes: int,
                t0: int, peer: Optional[int] = None, on_chip: Optional[bool] = None) -> NeuronWork:
        """Write ``staged`` back, time the collective (unless only CPU tensors took part) and make its Work."""
        for s in staged:
            s.write_back()
        host_ns = timing.host_clock() - t0
        if on_chip is None:
            on_chip = any(s.neuron for s in staged)
        if not on_chip:   # CPU tensors of a 'cpu:gloo,neuron:neuron' job: a host collective, not timed on the chip
            return NeuronWork(result, None, 0.0)
        end = self.clock.place(op, nbytes, host_ns, peer)
        return NeuronWork(result, self.clock, end)

    # ------------------------------------------------------------------ all-reduce
    def allreduce(self, tensors, opts=None):
        """All-reduce each tensor of ``tensors`` in place (SUM, AVG, MAX, MIN, PRODUCT, BAND/BOR/BXOR)."""
        if isinstance(opts, (ReduceOp, ReduceOp.RedOpType)):
            o = AllreduceOptions()
            o.reduceOp = opts
            opts = o
        opts = opts or AllreduceOptions()
        self._alive("all_reduce")
        t0 = timing.host_clock()
        staged = self._stage("all_reduce", tensors)
        op, post = _reduce_op(opts)
        t = tensors[0]
        self._check("all_reduce", t.dtype, t.shape, [len(tensors), int(opts.reduceOp.op)])
        if post is not None and not (t.is_floating_point() or t.is_complex()):
            raise CollectiveError(f"tn: ReduceOp.AVG / PREMUL_SUM need a floating tensor, got {t.dtype}")
        o = AllreduceOptions()
        o.reduceOp = op
        self._gloo_call("all_reduce", self._gloo.allreduce, [s.host for s in staged], o)
        for s in staged:
            _post(post, s.host, self._size)
        return self._finish("all_reduce", staged, list(tensors), sum(_nbytes(x) for x in tensors), t0)

    def allreduce_coalesced(self, tensors, opts=None):
        """All-reduce several tensors as one collective (flattened per dtype; timed as one all-reduce)."""
        opts = opts or AllreduceCoalescedOptions()
        self._alive("all_reduce_coalesced")
        t0 = timing.host_clock()
        staged = self._stage("all_reduce_coalesced", tensors)
        op, post = _reduce_op(opts)
        total = sum(x.numel() for x in tensors)
        self._check("all_reduce_coalesced", None, [total], [len(tensors), int(opts.reduceOp.op)])
        by_dtype = {}
        for s in staged:
            by_dtype.setdefault(s.host.dtype, []).append(s)
        o = AllreduceOptions()
        o.reduceOp = op
        for dtype, group in by_dtype.items():
            flat = torch.cat([s.host.reshape(-1) for s in group])
            self._gloo_call("all_reduce_coalesced", self._gloo.allreduce, [flat], o)
            _post(post, flat, self._size)
            off = 0
            for s in group:
                n = s.host.numel()
                s.host.copy_(flat[off:off + n].view_as(s.host))
                off += n
        return self._finish("all_reduce_coalesced", staged, list(tensors), sum(_nbytes(x) for x in tensors), t0)

    # ------------------------------------------------------------------ all-gather
    def allgather(self, output_tensors, input_tensors, opts=None):
        """``output_tensors[0][r]`` = rank r's ``input_tensors[0]`` (``dist.all_gather``)."""
        opts = opts or AllgatherOptions()
        self._alive("all_gather")
        t0 = timing.host_clock()
        outs = list(output_tensors[0])
        inp = input_tensors[0]
        staged_in = self._stage("all_gather", [inp])
        staged_out = self._stage("all_gather", outs)
        self._check("all_gather", inp.dtype, inp.shape, [len(outs)])
        if len(outs) != self._size or any(o.numel() != inp.numel() for o in outs):
            raise CollectiveMismatchError(f"tn: all_gather needs {self._size} output tensors of "
                                          f"{inp.numel()} elements, got {[o.numel() for o in outs]}")
        self._gloo_call("all_gather", self._gloo.allgather, [[s.host for s in staged_out]], [staged_in[0].host],
                        AllgatherOptions())
        return self._finish("all_gather", staged_out, outs, sum(_nbytes(o) for o in outs), t0)

    def all_gather_single(self, output, input, opts=None):
        """``output`` = the inputs of every rank concatenated along dim 0 (``dist.all_gather_into_tensor``)."""
        self._alive("all_gather_into_tensor")
        t0 = timing.host_clock()
        staged = self._stage("all_gather_into_tensor", [output, input])
        self._check("all_gather_into_tensor", input.dtype, input.shape, [output.numel()])
        if output.numel() != input.numel() * self._size or output.dtype != input.dtype:
            raise CollectiveMismatchError(
                f"tn: all_gather_into_tensor needs an output of {self._size} x {input.numel()} elements of "
                f"{input.dtype}, got {output.numel()} of {output.dtype}")
        self._gloo_call("all_gather_into_tensor", self._gloo._allgather_base, staged[0].host.view(-1),
                        staged[1].host.view(-1), AllgatherOptions())
        return self._finish("all_gather_into_tensor", staged[:1], [output], _nbytes(output), t0)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        """``all_gather_single`` of each (output, input) pair, timed as one all-gather of all the bytes."""
        self._alive("all_gather_into_tensor_coalesced")
        t0 = timing.host_clock()
        staged = self._stage("all_gather_into_tensor_coalesced", list(outputs) + list(inputs))
        self._check("all_gather_into_tensor_coalesced", None, [sum(i.numel() for i in inputs)], [len(inputs)])
        n = len(outputs)
        for k in range(n):
            o, i = outputs[k], inputs[k]
            if o.numel() != i.numel() * self._size:
                raise CollectiveMismatchError(f"tn: all_gather_into_tensor_coalesced pair {k}: output has "
                                              f"{o.numel()} elements, need {self._size} x {i.numel()}")
            self._gloo_call("all_gather_into_tensor_coalesced", self._gloo._allgather_base,
                            staged[k].host.view(-1), staged[n + k].host.view(-1), AllgatherOptions())
        return self._finish("all_gather_into_tensor_coalesced", staged[:n], list(outputs),
                            sum(_nbytes(o) for o in outputs), t0)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        """``allgather`` of each input into its output list."""
        work = None
        for outs, inp in zip(output_lists, inputs):
            work = self.allgather([outs], [inp], opts)
        return work if work is not None else NeuronWork([], None, 0.0)

    # ------------------------------------------------------------------ reduce-scatter
    def _reduce_scatter_flat(self, what: str, out_host: torch.Tensor, in_host: torch.Tensor, opts) -> None:
        op, post = _reduce_op(opts)
        if post is not None and not (in_host.is_floating_point() or in_host.is_complex()):
            raise CollectiveError(f"tn: ReduceOp.AVG / PREMUL_SUM need a floating tensor, got {in_host.dtype}")
        o = ReduceScatterOptions()
        o.reduceOp = op
        self._gloo_call(what, self._gloo._reduce_scatter_base, out_host.view(-1), in_host.view(-1), o)
        _post(post, out_host, self._size)

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        """``output_tensors[0]`` = reduction over ranks of their ``input_lists[0][rank]`` (``dist.reduce_scatter``)."""
        opts = opts or ReduceScatterOptions()
        self._alive("reduce_scatter")
        t0 = timing.host_clock()
        out = output_tensors[0]
        ins = list(input_lists[0])
        staged = self._stage("reduce_scatter", [out] + ins)
        self._check("reduce_scatter", out.dtype, out.shape, [len(ins), int(opts.reduceOp.op)])
        if len(ins) != self._size or any(i.numel() != out.numel() for i in ins):
            raise CollectiveMismatchError(f"tn: reduce_scatter needs {self._size} inputs of {out.numel()} "
                                          f"elements, got {[i.numel() for i in ins]}")
        flat = torch.cat([s.host.reshape(-1) for s in staged[1:]])
        self._reduce_scatter_flat("reduce_scatter", staged[0].host, flat, opts)
        return self._finish("reduce_scatter", staged[:1], [out], sum(_nbytes(i) for i in ins), t0)

    def reduce_scatter_single(self, output, input, opts=None):
        """``output`` = this rank's dim-0 chunk of the reduction of every rank's ``input``
        (``dist.reduce_scatter_tensor``)."""
        opts = opts or ReduceScatterOptions()
        self._alive("reduce_scatter_tensor")
        t0 = timing.host_clock()
        staged = self._stage("reduce_scatter_tensor", [output, input])
        self._check("reduce_scatter_tensor", input.dtype, input.shape, [output.numel(), int(opts.reduceOp.op)])
        if input.numel() != output.numel() * self._size or output.dtype != input.dtype:
            raise CollectiveMismatchError(
                f"tn: reduce_scatter_tensor needs an input of {self._size} x {output.numel()} elements of "
                f"{output.dtype}, got {input.numel()} of {input.dtype}")
        self._reduce_scatter_flat("reduce_scatter_tensor", staged[0].host, staged[1].host, opts)
        return self._finish("reduce_scatter_tensor", staged[:1], [output], _nbytes(input), t0)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        """``reduce_scatter_single`` of each pair, timed as one reduce-scatter of all the bytes."""
        opts = opts or ReduceScatterOptions()
        self._alive("reduce_scatter_tensor_coalesced")
        t0 = timing.host_clock()
        n = len(outputs)
        staged = self._stage("reduce_scatter_tensor_coalesced", list(outputs) + list(inputs))
        self._check("reduce_scatter_tensor_coalesced", None, [sum(i.numel() for i in inputs)],
                    [n, int(opts.reduceOp.op)])
        for k in range(n):
            if inputs[k].numel() != outputs[k].numel() * self._size:
                raise CollectiveMismatchError(f"tn: reduce_scatter_tensor_coalesced pair {k}: input has "
                                              f"{inputs[k].numel()} elements, need {self._size} x "
                                              f"{outputs[k].numel()}")
            self._reduce_scatter_flat("reduce_scatter_tensor_coalesced", staged[k].host, staged[n + k].host, opts)
        return self._finish("reduce_scatter_tensor_coalesced", staged[:n], list(outputs),
                            sum(_nbytes(i) for i in inputs), t0)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ------------------------------------------------------------------ broadcast, reduce, gather, scatter
    def broadcast(self, tensors, opts=None):
        """Every rank's ``tensors`` = those of ``opts.rootRank`` (in place)."""
        opts = opts or BroadcastOptions()
        self._alive("broadcast")
        t0 = timing.host_clock()
        staged = self._stage("broadcast", tensors)
        t = tensors[0]
        self._check("broadcast", t.dtype, t.shape, [len(tensors), opts.rootRank + 1, opts.rootTensor])
        o = BroadcastOptions()
        o.rootRank, o.rootTensor = opts.rootRank, opts.rootTensor
        self._gloo_call("broadcast", self._gloo.broadcast, [s.host for s in staged], o)
        return self._finish("broadcast", staged, list(tensors), sum(_nbytes(x) for x in tensors), t0)

    def reduce(self, tensors, opts=None):
        """``tensors`` of ``opts.rootRank`` = the reduction over ranks (others unchanged as far as torch promises)."""
        opts = opts or ReduceOptions()
        self._alive("reduce")
        t0 = timing.host_clock()
        staged = self._stage("reduce", tensors)
        op, post = _reduce_op(opts)
        t = tensors[0]
        self._check("reduce", t.dtype, t.shape, [opts.rootRank + 1, int(opts.reduceOp.op)])
        o = ReduceOptions()
        o.reduceOp, o.rootRank, o.rootTensor = op, opts.rootRank, opts.rootTensor
        self._gloo_call("reduce", self._gloo.reduce, [s.host for s in staged], o)
        if self._rank == opts.rootRank:
            for s in staged:
                _post(post, s.host, self._size)
        return self._finish("reduce", staged, list(tensors), sum(_nbytes(x) for x in tensors), t0)

    def gather(self, output_lists, inputs, opts=None):
        """On ``opts.rootRank``: ``output_lists[0][r]`` = rank r's ``inputs[0]``."""
        opts = opts or GatherOptions()
        self._alive("gather")
        t0 = timing.host_clock()
        inp = inputs[0]
        outs = list(output_lists[0]) if output_lists else []
        staged_in = self._stage("gather", [inp])
        staged_out = self._stage("gather", outs)
        self._check("gather", inp.dtype, inp.shape, [opts.rootRank + 1])
        o = GatherOptions()
        o.rootRank = opts.rootRank
        self._gloo_call("gather", self._gloo.gather, [[s.host for s in staged_out]] if outs else [],
                        [staged_in[0].host], o)
        return self._finish("gather", staged_out + staged_in, outs, _nbytes(inp) * self._size, t0)

    def scatter(self, outputs, input_lists, opts=None):
        """``outputs[0]`` = ``input_lists[0][rank]`` of ``opts.rootRank``."""
        opts = opts or ScatterOptions()
        self._alive("scatter")
        t0 = timing.host_clock()
        out = outputs[0]
        ins = list(input_lists[0]) if input_lists else []
        staged_out = self._stage("scatter", [out])
        staged_in = self._stage("scatter", ins)
        self._check("scatter", out.dtype, out.shape, [opts.rootRank + 1])
        o = ScatterOptions()
        o.rootRank = opts.rootRank
        self._gloo_call("scatter", self._gloo.scatter, [staged_out[0].host],
                        [[s.host for s in staged_in]] if ins else [], o)
        return self._finish("scatter", staged_out, [out], _nbytes(out) * self._size, t0)

    # ------------------------------------------------------------------ all-to-all
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """``dist.all_to_all_single``: dim-0 chunks of ``input`` to every rank (even, or by the split sizes)."""
        self._alive("all_to_all_single")
        t0 = timing.host_clock()
        staged = self._stage("all_to_all_single", [output, input])
        n = self._size
        ins = list(input_split_sizes or [])
        outs = list(output_split_sizes or [])
        rows_in = input.shape[0] if input.dim() else 1
        rows_out = output.shape[0] if output.dim() else 1
        even_in = [rows_in // n] * n if not ins else ins
        even_out = [rows_out // n] * n if not outs else outs
        if len(even_in) != n or len(even_out) != n or sum(even_in) != rows_in or sum(even_out) != rows_out:
            raise CollectiveMismatchError(
                f"tn: all_to_all_single needs {n} split sizes summing to the tensors' first dimensions "
                f"(input {rows_in}, output {rows_out}); got input_split_sizes={ins or 'even'}, "
                f"output_split_sizes={outs or 'even'}")
        self._check("all_to_all_single", input.dtype, list(input.shape[1:]), [], splits=(even_in, even_out))
        self._gloo_call("all_to_all_single", self._gloo.alltoall_base, staged[0].host, staged[1].host, outs, ins,
                        AllToAllOptions())
        return self._finish("all_to_all_single", staged[:1], [output], max(_nbytes(input), _nbytes(output)), t0)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """``dist.all_to_all``: ``output_tensors[r]`` = rank r's ``input_tensors[rank]`` (any shapes)."""
        self._alive("all_to_all")
        t0 = timing.host_clock()
        n = self._size
        outs, ins = list(output_tensors), list(input_tensors)
        if len(outs) != n or len(ins) != n:
            raise CollectiveMismatchError(f"tn: all_to_all needs {n} input and {n} output tensors, got "
                                          f"{len(ins)} and {len(outs)}")
        staged_out = self._stage("all_to_all", outs)
        staged_in = self._stage("all_to_all", ins)
        dtype = ins[0].dtype
        self._check("all_to_all", dtype, [], [], splits=([i.numel() for i in ins], [o.numel() for o in outs]))
        flat_in = torch.cat([s.host.reshape(-1) for s in staged_in])
        flat_out = torch.empty(sum(o.numel() for o in outs), dtype=dtype)
        self._gloo_call("all_to_all", self._gloo.alltoall_base, flat_out, flat_in, [o.numel() for o in outs],
                        [i.numel() for i in ins], AllToAllOptions())
        off = 0
        for s in staged_out:
            k = s.host.numel()
            s.host.copy_(flat_out[off:off + k].view_as(s.host))
            off += k
        nbytes = max(sum(_nbytes(i) for i in ins), sum(_nbytes(o) for o in outs))
        return self._finish("all_to_all", staged_out, outs, nbytes, t0)

    # ------------------------------------------------------------------ barrier, point to point
    def barrier(self, opts=None):
        """Every rank reaches this point (a metadata check, then gloo's barrier)."""
        self._alive("barrier")
        t0 = timing.host_clock()
        self._check("barrier")
        self._gloo_call("barrier", self._gloo.barrier, BarrierOptions())
        return self._finish("barrier", [], [], 4, t0, on_chip=True)

    def send(self, tensors, dst: int, tag: int = 0):
        """Send ``tensors`` to group rank ``dst`` (no metadata check: only the two ranks take part)."""
        self._alive("send")
        t0 = timing.host_clock()
        staged = self._stage("send", tensors)
        self._seq += 1
        self._gloo_call(f"send to rank {dst}", self._gloo.send, [s.host for s in staged], dst, tag)
        return self._finish("send", [], list(tensors), sum(_nbytes(x) for x in tensors), t0, peer=dst,
                            on_chip=any(s.neuron for s in staged))

    def recv(self, tensors, src: int, tag: int = 0):
        """Receive into ``tensors`` from group rank ``src``."""
        self._alive("recv")
        t0 = timing.host_clock()
        staged = self._stage("recv", tensors)
        self._seq += 1
        self._gloo_call(f"recv from rank {src}", self._gloo.recv, [s.host for s in staged], src, tag)
        return self._finish("recv", staged, list(tensors), sum(_nbytes(x) for x in tensors), t0, peer=src)


def _local_rank(rank: int, world: int, per_instance: int) -> int:
    env = os.environ.get("LOCAL_RANK")
    return int(env) if env is not None else rank % per_instance


def _pick_device(rank: int, size: int, global_ranks: Sequence[int]) -> int:
    """This rank's neuron device index. The first multi-rank group of a process whose TN_VISIBLE_CORES is unset
    makes the rank's local core its only device (as TorchNeuron's launcher does: one process per core, the core
    is ``neuron:0``); then the group's device is neuron:0, else the current device."""
    m = machine()
    if size > 1 and not config.get("visible_cores"):
        world = dist.get_world_size() if dist.is_initialized() else size
        g = global_ranks[rank]
        local = _local_rank(g, world, m.device_count)
        if local >= m.device_count:
            raise ConfigError(f"tn: local rank {local} has no core: the modelled {m.describe()} has {m.device_count} "
                          f"devices per instance; use fewer processes per node or a bigger TN_INSTANCE / TN_LNC=1")
        config.set(visible_cores=str(local))
        allocator.set_current_index(0)
        return 0
    return allocator.current_index()


def _global_core(m, global_rank: int, device_index: int) -> int:
    """The global modelled core of a rank: its instance (torchrun's GROUP_RANK, else rank // devices per
    instance) times the devices per instance, plus the instance core behind its device."""
    node = os.environ.get("GROUP_RANK")
    inst = int(node) if node is not None else global_rank // m.device_count
    if inst >= m.instances:
        raise ConfigError(f"tn: rank {global_rank} would sit on instance {inst}, but the modelled job has "
                      f"{m.instances} instance(s) of {m.name}; set TN_INSTANCES to at least {inst + 1}")
    return inst * m.device_count + m.devices[device_index]


def create(dist_opts, backend_opts=None) -> ProcessGroupNeuron:
    """The creator registered for backend ``"neuron"`` (``extended_api=True``: gets torch's
    ``_DistributedBackendOptions`` with store, group rank/size, timeout, group id and global ranks)."""
    return ProcessGroupNeuron(dist_opts.store, dist_opts.group_rank, dist_opts.group_size, dist_opts.timeout,
                              list(dist_opts.global_ranks_in_group or []), str(dist_opts.group_id or ""))
