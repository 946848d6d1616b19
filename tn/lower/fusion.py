# The fusion planner: which equations run as fused map/row groups and matmul/reduction epilogues in SBUF.
"""The fusion planner: fused groups and epilogues of an IR.

:func:`plan` chooses :class:`Group`\\ s (runs of elementwise equations and
trailing-axes reductions, emitted by the tile engine :mod:`tn.lower.tile`)
and :class:`~tn.lower.epilogue.EpilogueGroup`\\ s (elementwise equations
applied in a matmul/conv/reduction/pool's stores, :mod:`tn.lower.epilogue`).
The schedule (:mod:`tn.lower.schedule`) merges them with the other planners;
the compiler emits them, and when a group cannot be emitted the schedule is
planned again without it (a veto), so the planner proposes no group it knows
cannot be emitted: a row group whose whole rows would not fit its SBUF budget
(checked with the same byte count :func:`tn.lower.tile.lower_map` uses) starts
at the earliest equation from which it fits, the equations before it forming
a group of their own. Fused equations are counted in ``stats["fused_eqns"]``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from ..ir import IR, Eqn, Var
from ..neuron import get_arch
from . import elementwise  # noqa: F401  (registers the ops' tile rules)
from .base import NEURON_DTYPES, CannotLower, dataflow
from .epilogue import EpilogueGroup, is_regroup
from .tile import _broadcastable, _lstrip1, _row_reduce_r, _space_strides, is_alias_reshape, lower_map, row_fits

__all__ = ["plan", "Group", "EpilogueGroup", "EPILOGUE_HEADS"]

#: Op categories whose lowerings write outputs through ctx.store (epilogue heads).
EPILOGUE_HEADS = ("matmul", "conv", "reduction", "pool")


class Group:
    """Equations lowered together with every intermediate in SBUF (a map group or a row group).

    Attributes: ``eqns``; ``inputs`` (external Vars, loaded from HBM);
    ``outputs`` (Vars used after the group, stored to HBM); ``space`` (the
    iteration shape); ``r`` (trailing axes reduced by the row reductions, 0
    for a map group); ``rowvars`` (keepdim=False reduction results and values
    computed from them only).
    """

    def __init__(self, eqns: List[Eqn], inputs: List[Var], outputs: List[Var], space: Tuple[int, ...] = None,
                 r: int = 0, rowvars: Optional[Set[Var]] = None):
        self.eqns = eqns
        self.inputs = inputs
        self.outputs = outputs
        self.space = space
        self.r = r
        self.rowvars = rowvars or set()

    def lower(self, ctx: Any, ins: List[Any], outs: List[Any]) -> None:
        """Emit the group into ``ctx.prog``; ``ins``/``outs`` are the HbmTensors of inputs/outputs."""
        lower_map(ctx, self.eqns, self.inputs, ins, self.outputs, outs, space=self.space, r=self.r,
                  rowvars=self.rowvars)

    def __repr__(self) -> str:
        return f"<Group {[e.op.name for e in self.eqns]} space={self.space} r={self.r}>"


def _is_map(eqn: Eqn) -> bool:
    if is_alias_reshape(eqn):
        return eqn.outputs[0].dtype in NEURON_DTYPES and eqn.outputs[0].dtype != torch.int64
    if eqn.op.category != "elementwise" or eqn.op.tile_rule is None:
        return False
    for a in list(eqn.inputs) + list(eqn.outputs):
        if isinstance(a, Var) and (a.dtype not in NEURON_DTYPES or a.dtype == torch.int64):
            return False
    pre = getattr(eqn.op.tile_rule, "precheck", None)
    if pre is not None:
        try:
            pre(eqn)
        except CannotLower:
            return False
    return True


def _group_io(ir_eqns: List[Eqn], users: Dict[Var, List[int]], outset: Set[Var], end: int,
              exclude: Set[Var] = frozenset()) -> Tuple[List[Var], List[Var]]:
    made: Set[Var] = set()
    inputs: List[Var] = []
    for ee in ir_eqns:
        for a in ee.inputs:
            if isinstance(a, Var) and a not in made and a not in inputs and a not in exclude:
                inputs.append(a)
        made.update(ee.outputs)
    outputs = [v for ee in ir_eqns for v in ee.outputs
               if v in outset or any(u >= end for u in users.get(v, ()))]
    return inputs, outputs


def _grow(ir: IR, k: int, host: Dict[int, str], stop: Optional[int] = None) -> Tuple[int, Tuple[int, ...], int, Set[Var]]:
    """Longest run from ``k`` (ending at ``stop`` at the latest) forming one group: returns (end, space, r, rowvars)."""
    n = len(ir.eqns) if stop is None else stop
    space: Optional[Tuple[int, ...]] = None
    r = 0
    rowvars: Set[Var] = set()
    end = k
    while end < n and end not in host:
        e = ir.eqns[end]
        rr = _row_reduce_r(e)
        if rr is not None:
            xs = e.inputs[0].shape
            if e.inputs[0] in rowvars:
                break
            if space is None:
                space = xs
            elif xs != space:
                if r or not _broadcastable(space, xs):
                    break
                space = xs
            if r and rr != r:
                break
            r = rr
            if not e.attrs.get("keepdim", False):
                rowvars.add(e.outputs[0])
            end += 1
            continue
        if not _is_map(e):
            break
        vin = [a for a in e.inputs if isinstance(a, Var)]
        if any(a in rowvars for a in vin):
            if not all(a in rowvars or a.numel == 1 for a in vin):
                break
            rowvars.update(e.outputs)
            end += 1
            continue
        so = e.outputs[0].shape
        if space is None:
            space = so
        elif not _broadcastable(so, space):
            if r or not _broadcastable(space, so):
                break
            space = so
        end += 1
    return end, space, r, rowvars


def _epilogue_takes(e: Eqn, hv: Var, made: Set[Var]) -> bool:
    """Whether equation ``e`` joins the epilogue of the head making ``hv`` (``made``: ``hv`` and the chain's
    values so far): an elementwise equation of the head's shape whose operands broadcast to it, or, in a
    head's leading axes regrouped (:func:`tn.lower.epilogue.is_regroup`, e.g. a Linear's ``[B * S, F]``
    result viewed as ``[B, S, F]``), that regrouping reshape and elementwise equations of the regrouped shape
    whose operands are chain values, numbers or vectors along the last axis (which broadcast the same over
    either shape)."""
    if _is_map(e) and _lstrip1(e.outputs[0].shape) == _lstrip1(hv.shape) and \
            all(not isinstance(a, Var) or _broadcastable(a.shape, hv.shape) for a in e.inputs):
        return True
    if is_regroup(e, hv, made):
        return True
    out = e.outputs[0] if len(e.outputs) == 1 else None
    if out is None or not _is_map(e) or not hv.shape or not out.shape or out.numel != hv.numel or \
            out.shape[-1] != hv.shape[-1]:
        return False
    return all(not isinstance(a, Var) or a in made or _lstrip1(a.shape) in ((), (1,), (hv.shape[-1],))
               for a in e.inputs)


def plan(ir: IR, host: Dict[int, str], nofuse: Set[int] = frozenset()) -> Dict[int, Any]:
    """Fused groups of ``ir``: first equation index -> :class:`Group` or :class:`EpilogueGroup`.

    Runs of consecutive elementwise equations and trailing-axes reductions
    (2+ equations) become :class:`Group`\\ s; a matmul/conv/reduction followed
    by elementwise equations of its output's shape that use it becomes an
    :class:`EpilogueGroup`. Equations forced to the host and indices in
    ``nofuse`` never start a group.
    """
    n = len(ir.eqns)
    _, users, outset = dataflow(ir)
    host = dict(host)
    for k, e in enumerate(ir.eqns):
        if any(isinstance(a, Var) and a.numel == 0 for a in list(e.inputs) + list(e.outputs)):
            host[k] = "zero-size"   # never fused (the compiler folds or runs these on the host)
    groups: Dict[int, Any] = {}
    parts = get_arch(None).partitions
    # reductions from which no row group fits the SBUF budget (they are lowered on their own)
    norow: Set[int] = set()
    k = 0
    while k < n:
        e = ir.eqns[k]
        if k in host or k in nofuse:
            k += 1
            continue
        can_head = e.op.category in EPILOGUE_HEADS and len(e.outputs) == 1 and e.op.lowering is not None
        is_head = can_head
        if is_head and _row_reduce_r(e) is not None and k not in norow and _grow(ir, k, host)[0] - k >= 2:
            is_head = False  # the reduction joins a row group instead
        if is_head:
            hv = e.outputs[0]
            end = k + 1
            made = {hv}
            while end < n and end not in host and end not in nofuse and _epilogue_takes(ir.eqns[end], hv, made):
                made.update(ir.eqns[end].outputs)
                end += 1
            if end > k + 1 and any(a is hv for a in ir.eqns[k + 1].inputs):
                chain = ir.eqns[k + 1:end]
                inputs, outputs = _group_io(chain, users, outset, end, exclude={hv})
                if hv in outset or any(u >= end for u in users.get(hv, ())):
                    outputs = [hv] + outputs
                groups[k] = EpilogueGroup(e, list(chain), inputs, outputs)
                k = end
                continue
            k += 1
            continue
        end, space, r, rowvars = _run(ir, k, host, users, outset)
        if r and end - k >= 2:
            inputs, outputs = _group_io(ir.eqns[k:end], users, outset, end)
            if not row_fits(ir.eqns[k:end], inputs, outputs, space, r, parts):
                # the rows do not fit with every equation of the run (emitting it would fail and the compiler
                # would rebuild once per leading equation): the equations before the largest fitting row
                # group form a group of their own
                j0, s0 = _row_start(ir, k, end, users, outset, parts)
                if s0 is None:
                    norow.add(j0)
                    s0 = j0
                if s0 == k:
                    # k is a reduction no row group can start from: an epilogue head or a plain equation
                    k += 0 if can_head else 1
                    continue
                end, space, r, rowvars = _run(ir, k, host, users, outset, stop=s0)
        if end - k >= 2:
            eqns = ir.eqns[k:end]
            inputs, outputs = _group_io(eqns, users, outset, end)
            groups[k] = Group(list(eqns), inputs, outputs, space, r, rowvars)
            k = end
        else:
            k += 1
    return groups


def _grow_prefix(ir: IR, k: int, end: int) -> Tuple[int, Tuple[int, ...], int, Set[Var]]:
    """Re-derive the space of the run ``k:end`` (after shrinking it)."""
    return _grow(ir, k, {}, stop=end)


def _run(ir: IR, k: int, host: Dict[int, str], users: Dict[Var, List[int]], outset: Set[Var],
         stop: Optional[int] = None) -> Tuple[int, Tuple[int, ...], int, Set[Var]]:
    """The group starting at ``k`` (not past ``stop``): the longest run, shrunk until every value it
    stores has the group's full (or row) shape. Returns (end, space, r, rowvars)."""
    end, space, r, rowvars = _grow(ir, k, host, stop)
    while end - k >= 2:
        eqns = ir.eqns[k:end]
        inputs, outputs = _group_io(eqns, users, outset, end)
        ok = True
        for v in outputs:
            if v in rowvars:
                continue
            st = _space_strides(v.shape, space) if _broadcastable(v.shape, space) else None
            lead = st[:len(space) - r] if (st is not None and r) else st
            if st is None or any(s == 0 and nn != 1 for s, nn in zip(lead, space)):
                ok = False
                break
        if ok:
            break
        end -= 1
        if r and not any(_row_reduce_r(ee) for ee in ir.eqns[k:end]):
            end2, space, r, rowvars = _grow_prefix(ir, k, end)
            end = end2
    return end, space, r, rowvars


def _fits_from(ir: IR, s: int, end: int, users: Dict[Var, List[int]], outset: Set[Var], parts: int) -> bool:
    """Whether the row group of the run ``s:end`` keeps its rows whole within the SBUF budget."""
    e2, space, r, _ = _grow(ir, s, {}, stop=end)
    if not r or e2 - s < 2:
        return True
    inputs, outputs = _group_io(ir.eqns[s:e2], users, outset, e2)
    return row_fits(ir.eqns[s:e2], inputs, outputs, space, r, parts)


def _row_start(ir: IR, k: int, end: int, users: Dict[Var, List[int]], outset: Set[Var],
               parts: int) -> Tuple[int, Optional[int]]:
    """For a row group ``k:end`` whose rows do not fit: ``(j0, s)``, ``j0`` its first reduction and ``s``
    the earliest start in ``k+1 .. j0`` from which the row group fits (None if none does).

    Fewer leading equations mean fewer values in SBUF, so the search is a bisection.
    """
    j0 = next(j for j in range(k, end) if _row_reduce_r(ir.eqns[j]) is not None)
    if j0 == k or not _fits_from(ir, j0, end, users, outset, parts):
        return j0, None
    lo, hi = k + 1, j0          # hi fits
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits_from(ir, mid, end, users, outset, parts):
            hi = mid
        else:
            lo = mid + 1
    return j0, hi
