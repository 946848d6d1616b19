# The collective ops of the op table: functional collectives (torch's _c10d_functional ops) as IR ops.
"""Collectives as core ops of :mod:`tn.ops` (category ``collective``).

``torch.compile`` graphs and :func:`tn.jit` programs that use
``torch.distributed._functional_collectives`` (or DTensor, which uses them)
contain torch's ``_c10d_functional`` aten ops. The tracer records them as
these ops:

===============  ==================================================================================
op               meaning (the group is a process-group name, as torch's functional collectives take)
===============  ==================================================================================
all_reduce       ``all_reduce[reduce_op group]``: every rank gets the reduction over ranks
all_gather       ``all_gather[group_size group]``: ranks' inputs concatenated along dim 0
reduce_scatter   ``reduce_scatter[reduce_op group_size group]``: reduction, rank ``r`` keeps chunk ``r`` of dim 0
all_to_all       ``all_to_all[output_split_sizes input_split_sizes group]``: ``all_to_all_single``
broadcast        ``broadcast[src group]``: every rank gets rank ``src``'s value
wait             ``wait``: the point where the program needs a collective's result (``wait_tensor``)
===============  ==================================================================================

Every op declares ``effectful`` (:attr:`tn.ops.Op.effectful`): passes never
merge, fold, drop or duplicate one, since every rank must issue the same
collectives in the same order. In-place, ``out=`` and coalesced variants are
decomposed into these (one collective per tensor).

Running one: :func:`issue` starts collective ``name`` on a tensor and returns
a :class:`Pending` whose ``result`` already holds the value (the bytes moved
across the ranks over the group's transport) and whose ``wait()`` is the
modelled wait for it. How a group is reached and timed is not known here:
the door that owns process groups installs it with :func:`set_group_access`
(:mod:`tn.distributed.compiled`: the ``neuron`` backend's groups, timed on the
core's collective engine, and any other group's functional collectives).
Without one, the collective is torch's functional collective on the tensor as
given, untimed. The reference implementations are ``issue(...)`` then
``wait()``; the compiler (:mod:`tn.lower.collective`) issues at the
collective and waits at the ``wait`` equation, so compute in between
overlaps the collective on the modelled timeline.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers the Meta kernels)
from torch.distributed import distributed_c10d as c10d

from ..errors import ArgumentTypeError, ArgumentValueError
from .table import Op, decomposition, from_aten, register

__all__ = ["COLLECTIVE_OPS", "Pending", "CollectiveRun", "issue", "call_functional", "collective_nbytes",
           "set_group_access", "group_name_of", "functional_ops"]

Tensor = torch.Tensor

#: Names of the collective ops (the ``wait`` op included).
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "wait")

#: ``resolver(group_name) -> access or None``, installed by :func:`set_group_access`.
_ACCESS: List[Optional[Callable[[str], Any]]] = [None]


def functional_ops() -> Any:
    """``torch.ops._c10d_functional`` with torch's meta kernels of the functional collectives registered (they
    live in ``torch.distributed._functional_collectives``)."""
    return torch.ops._c10d_functional


def group_name_of(group: Any) -> str:
    """The process-group name a functional collective received (a name, or a ProcessGroup object)."""
    if isinstance(group, str):
        return group
    name = getattr(group, "group_name", None)
    if isinstance(name, str):
        return name
    raise ArgumentTypeError(f"tn: a functional collective's group must be a process-group name or a ProcessGroup, "
                            f"got {type(group).__name__}")


def _group_size(group: str) -> int:
    """Ranks of process group ``group``."""
    return c10d._resolve_process_group(group).size()


class CollectiveRun:
    """What one collective did, without its tensors: ``name`` (the op), ``nbytes`` (as costed), ``core`` (the
    timeline's core), ``start_ns``/``end_ns`` (modelled; ``None`` when untimed), ``cores`` (global cores of the
    group's ranks)."""

    __slots__ = ("name", "nbytes", "core", "start_ns", "end_ns", "cores")

    def __init__(self, name: str, nbytes: int, core: Optional[int] = None, start_ns: Optional[float] = None,
                 end_ns: Optional[float] = None, cores: Tuple[int, ...] = ()):
        self.name = name
        self.nbytes = int(nbytes)
        self.core = core
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.cores = tuple(cores)

    @property
    def ns(self) -> float:
        """Modelled duration (0 when untimed)."""
        return 0.0 if self.start_ns is None else self.end_ns - self.start_ns

    def __repr__(self) -> str:
        when = "untimed" if self.start_ns is None else f"{self.start_ns:.0f}..{self.end_ns:.0f} ns"
        return f"CollectiveRun({self.name}, {self.nbytes} B over {len(self.cores)} cores, {when})"


class Pending:
    """A collective issued by :func:`issue`: ``result`` (a CPU tensor, final: the bytes have moved), ``run`` (its
    :class:`CollectiveRun`) and :meth:`wait`, the modelled wait (the current stream waits for its end)."""

    __slots__ = ("result", "run", "_wait")

    def __init__(self, result: Tensor, run: CollectiveRun, wait: Optional[Callable[[], None]] = None):
        self.result = result
        self.run = run
        self._wait = wait

    def wait(self) -> Tensor:
        """Make the current stream wait for the collective's modelled end (once); returns ``result``."""
        if self._wait is not None:
            w, self._wait = self._wait, None
            w()
        return self.result


def set_group_access(resolver: Optional[Callable[[str], Any]]) -> None:
    """Install ``resolver(group_name) -> access`` (``None`` removes it). ``access.issue(name, x, attrs, timed)``
    runs collective op ``name`` on CPU tensor ``x`` over the group and returns a :class:`Pending`; a resolver
    returning ``None`` leaves that group to the plain path (torch's functional collective, untimed)."""
    _ACCESS[0] = resolver


def call_functional(name: str, x: Tensor, attrs: Dict[str, Any]) -> Tensor:
    """torch's functional collective of op ``name`` on ``x`` (not waited for: pass the result to
    ``wait_tensor``)."""
    c = functional_ops()
    g = attrs["group"]
    if name == "all_reduce":
        return c.all_reduce(x, attrs["reduce_op"], g)
    if name == "all_gather":
        return c.all_gather_into_tensor(x, attrs["group_size"], g)
    if name == "reduce_scatter":
        return c.reduce_scatter_tensor(x, attrs["reduce_op"], attrs["group_size"], g)
    if name == "all_to_all":
        return c.all_to_all_single(x, list(attrs["output_split_sizes"]), list(attrs["input_split_sizes"]), g)
    if name == "broadcast":
        return c.broadcast(x, attrs["src"], g)
    raise ArgumentValueError(f"tn: {name!r} is not a collective op; use one of {COLLECTIVE_OPS[:-1]}")


def collective_nbytes(name: str, x: Any, out: Any) -> int:
    """Bytes per rank collective ``name`` moves as the timing model counts them (``x``/``out``: anything with
    ``shape`` and ``dtype``): all-reduce, broadcast and reduce-scatter their input, all-gather its gathered
    output, all-to-all the larger of input and output."""
    def size(v):
        n = 1
        for d in v.shape:
            n *= int(d)
        return n * v.dtype.itemsize

    if name == "all_gather":
        return size(out)
    if name == "all_to_all":
        return max(size(x), size(out))
    return size(x)


def issue(name: str, x: Tensor, attrs: Dict[str, Any], timed: bool = True) -> Pending:
    """Run collective op ``name`` (``all_reduce`` ... ``broadcast``) on ``x`` over ``attrs["group"]``: the result is
    final when this returns; with ``timed`` it is also placed on the modelled timeline (the group's access
    decides how, see :func:`set_group_access`) and :meth:`Pending.wait` is its modelled wait."""
    resolver = _ACCESS[0]
    access = resolver(attrs["group"]) if resolver is not None else None
    if access is not None:
        return access.issue(name, x, attrs, timed)
    out = functional_ops().wait_tensor(call_functional(name, x, attrs))
    return Pending(out, CollectiveRun(name, collective_nbytes(name, x, out)))


def _same(x, **attrs) -> List[Tuple[Tuple[int, ...], torch.dtype]]:
    return [(tuple(x.shape), x.dtype)]


# --------------------------------------------------------------------------- the ops


@register("all_reduce", "collective", effectful=True, shape_rule=_same)
def all_reduce(x: Tensor, *, reduce_op: str, group: str) -> Tensor:
    """All-reduce over the ranks of ``group`` (reduce_op: sum avg product min max ...), through the group's
    transport (torch's functional all_reduce)."""
    return issue("all_reduce", x, {"reduce_op": reduce_op, "group": group}, timed=False).wait()


def _all_gather_shape(x, *, group_size, group):
    if not x.shape:
        raise ArgumentValueError("tn all_gather: the input must have at least one dimension")
    return [((x.shape[0] * group_size,) + tuple(x.shape[1:]), x.dtype)]


@register("all_gather", "collective", effectful=True, shape_rule=_all_gather_shape)
def all_gather(x: Tensor, *, group_size: int, group: str) -> Tensor:
    """All-gather along dim 0 over the ``group_size`` ranks of ``group`` (all_gather_into_tensor)."""
    return issue("all_gather", x, {"group_size": group_size, "group": group}, timed=False).wait()


def _reduce_scatter_shape(x, *, reduce_op, group_size, group):
    if not x.shape or x.shape[0] % group_size:
        raise ArgumentValueError(f"tn reduce_scatter: dim 0 of the input ({tuple(x.shape)}) must be a multiple of "
                                 f"the group size {group_size}")
    return [((x.shape[0] // group_size,) + tuple(x.shape[1:]), x.dtype)]


@register("reduce_scatter", "collective", effectful=True, shape_rule=_reduce_scatter_shape)
def reduce_scatter(x: Tensor, *, reduce_op: str, group_size: int, group: str) -> Tensor:
    """Reduce-scatter along dim 0 over the ``group_size`` ranks of ``group`` (reduce_scatter_tensor)."""
    return issue("reduce_scatter", x, {"reduce_op": reduce_op, "group_size": group_size, "group": group},
                 timed=False).wait()


def _all_to_all_shape(x, *, output_split_sizes, input_split_sizes, group):
    if not x.shape or sum(input_split_sizes) != x.shape[0]:
        raise ArgumentValueError(f"tn all_to_all: input split sizes {input_split_sizes} do not add up to dim 0 of "
                                 f"the input ({tuple(x.shape)})")
    return [((sum(output_split_sizes),) + tuple(x.shape[1:]), x.dtype)]


@register("all_to_all", "collective", effectful=True, shape_rule=_all_to_all_shape)
def all_to_all(x: Tensor, *, output_split_sizes: Tuple[int, ...], input_split_sizes: Tuple[int, ...],
               group: str) -> Tensor:
    """all_to_all_single along dim 0 with the given split sizes (rows sent to / received from each rank; the
    tracer writes equal splits out)."""
    return issue("all_to_all", x, {"output_split_sizes": output_split_sizes, "input_split_sizes": input_split_sizes,
                                   "group": group}, timed=False).wait()


@register("broadcast", "collective", effectful=True, shape_rule=_same)
def broadcast(x: Tensor, *, src: int, group: str) -> Tensor:
    """Broadcast of group rank ``src``'s value over ``group``."""
    return issue("broadcast", x, {"src": src, "group": group}, timed=False).wait()


@register("wait", "collective", effectful=True, shape_rule=_same)
def wait(x: Tensor) -> Tensor:
    """Where the program needs the result of a collective (wait_tensor); the value is its input (the collective
    ops' references already waited)."""
    return x


# --------------------------------------------------------------------------- aten -> ops

def _converters() -> None:
    """Map the ``_c10d_functional`` overloads onto the ops (when torch has torch.distributed)."""
    if not torch.distributed.is_available():
        return
    c10d = torch.ops._c10d_functional

    def converter(op: Op, overload: Any):
        """``from_aten(op, overload)`` whose converter first makes sure torch's meta kernels are registered."""
        def deco(conv):
            def wrapped(*args, **kwargs):
                functional_ops()
                return conv(*args, **kwargs)
            return from_aten(op, overload)(wrapped)
        return deco

    @converter(all_reduce, c10d.all_reduce.default)
    def _all_reduce_conv(x, reduce_op, group_name):
        return [x], {"reduce_op": str(reduce_op).lower(), "group": group_name_of(group_name)}

    @converter(all_gather, c10d.all_gather_into_tensor.default)
    def _all_gather_conv(x, group_size, group_name):
        return [x], {"group_size": int(group_size), "group": group_name_of(group_name)}

    @converter(reduce_scatter, c10d.reduce_scatter_tensor.default)
    def _reduce_scatter_conv(x, reduce_op, group_size, group_name):
        return [x], {"reduce_op": str(reduce_op).lower(), "group_size": int(group_size),
                     "group": group_name_of(group_name)}

    @converter(all_to_all, c10d.all_to_all_single.default)
    def _all_to_all_conv(x, output_split_sizes, input_split_sizes, group_name):
        group = group_name_of(group_name)
        out_splits = tuple(int(s) for s in output_split_sizes or ())
        in_splits = tuple(int(s) for s in input_split_sizes or ())
        if not out_splits or not in_splits:       # equal splits, written out (gloo wants them explicit)
            n = _group_size(group)
            equal = (x.shape[0] // n,) * n
            out_splits, in_splits = out_splits or equal, in_splits or equal
        return [x], {"output_split_sizes": out_splits, "input_split_sizes": in_splits, "group": group}

    @converter(broadcast, c10d.broadcast.default)
    def _broadcast_conv(x, src, group_name):
        return [x], {"src": int(src), "group": group_name_of(group_name)}

    @converter(wait, c10d.wait_tensor.default)
    def _wait_conv(x):
        return [x], {}

    functional_ops()
    if hasattr(c10d, "_wrap_tensor_autograd"):
        # torch's functional collectives wrap results in an AsyncCollectiveTensor (waited on first use) unless
        # torch itself is tracing: for tn's tracer that wrapper is the wait
        converter(wait, c10d._wrap_tensor_autograd.default)(_wait_conv)

    # in-place, out= and coalesced forms: the functional ops above, one collective per tensor

    @decomposition(c10d.all_reduce_.default)
    def _all_reduce_inplace(x, reduce_op, group_name):
        return x.copy_(c10d.wait_tensor(c10d.all_reduce(x, reduce_op, group_name)))

    @decomposition(c10d.broadcast_.default)
    def _broadcast_inplace(x, src, group_name):
        return x.copy_(c10d.wait_tensor(c10d.broadcast(x, src, group_name)))

    @decomposition(c10d.all_reduce_coalesced.default)
    def _all_reduce_coalesced(xs, reduce_op, group_name):
        return [c10d.all_reduce(x, reduce_op, group_name) for x in xs]

    @decomposition(c10d.all_reduce_coalesced_.default)
    def _all_reduce_coalesced_inplace(xs, reduce_op, group_name):
        return [x.copy_(c10d.wait_tensor(c10d.all_reduce(x, reduce_op, group_name))) for x in xs]

    @decomposition(c10d.all_gather_into_tensor_coalesced.default)
    def _all_gather_coalesced(xs, group_size, group_name):
        return [c10d.all_gather_into_tensor(x, group_size, group_name) for x in xs]

    @decomposition(c10d.reduce_scatter_tensor_coalesced.default)
    def _reduce_scatter_coalesced(xs, reduce_op, group_size, group_name):
        return [c10d.reduce_scatter_tensor(x, reduce_op, group_size, group_name) for x in xs]

    @decomposition(c10d.all_gather_into_tensor_out.default)
    def _all_gather_out(x, group_size, group_name, *, out):
        return out.copy_(c10d.wait_tensor(c10d.all_gather_into_tensor(x, group_size, group_name)))

    @decomposition(c10d.reduce_scatter_tensor_out.default)
    def _reduce_scatter_out(x, reduce_op, group_size, group_name, *, out):
        return out.copy_(c10d.wait_tensor(c10d.reduce_scatter_tensor(x, reduce_op, group_size, group_name)))


_converters()
