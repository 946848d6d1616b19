# Fused attention: S = Q K^T, elementwise/row-reduction chain (scale, mask, softmax), O = P V, with Q/K/V/O read and written through views.
"""Attention as one lowering: ``O = softmax(mask(Q K^T * scale)) V`` per batch (head).

Traced attention is a batched matmul, a chain of elementwise ops and row
reductions (scale, ``where`` mask, ``amax``/``sub``/``exp``/``sum``/``div``,
casts), a second batched matmul, and around them the head split and merge:
``slice``/``reshape``/``permute`` of the projections. Lowered one equation
at a time, every one of those is an HBM round trip (the scores of all heads
twice) and every head split is a copy.

:func:`plan` recognises the pattern by dataflow:

* ``S = matmul(q, kt)`` whose operands are *view chains* (reshape, permute,
  slice) of values computed elsewhere (the fused ``qkv`` projection), which
  may hold elementwise prologue ops: float ``convert`` and multiply/divide by
  a number (BERT's fp32 casts and ``d**-0.25`` scales under autocast), applied
  on chip to each loaded block, so q, k and v are read once in their own dtype,
* then equations over S's shape (elementwise, keepdim reductions over the last
  axis) with outside operands broadcast to it (the causal mask, ``-inf``),
* ``O = matmul(p, v)`` with ``p`` the chain's result and ``v`` a view chain,
* optionally a chain of reshapes/permutes of ``O`` (the head merge), which may
  hold one narrowing ``convert`` of an fp32 ``O`` (applied as O leaves PSUM),

all in one run of consecutive equations whose intermediates are used only
there. A view's batch may be two strided levels (``[batch, heads]`` of a head
split or merge at batch > 1: :class:`_Heads`; head groups are then cut at each
batch's heads); a view chain starting before the run, or one that is not such
a view, is cut: its earlier part stays its own lowering and the value it makes
is the base. ``full`` values (``_safe_softmax``'s zeros, between the
matmuls or shared from an earlier layer) are constants filled on chip; one
made inside the run and read after it is also written as a group output.
:class:`AttentionGroup` then lowers it per batch with every value in
SBUF: Q, K and V are loaded for a group of heads with one DMA each through
their views (no head-split copies), ``Q^T``/``K^T`` come from TensorE
transposes (a K^T that lies in HBM keys-contiguous, as an elementwise group
leaves BERT's scaled key, is loaded as it lies: 4-byte DMA runs otherwise),
the scores stay in PSUM/SBUF (rows = queries on the partitions,
the softmax reductions along the free axis; ``exp`` and its row sum are one
ScalarE instruction), ``P^T`` is a TensorE transpose and ``P V`` accumulates
over key blocks in PSUM; O is written straight into the merged layout of the
group's output. Rounding follows torch (each equation's result is rounded to
its dtype). The emission is software-pipelined: the scores and softmax of the
next block of heads, and the loads and ``Q^T``/``K^T`` transposes of the next
group of heads, come before the previous block's ``P^T``/``P V`` (engines run
in order); with Q/K/V in HBM the heads are split into about four groups so
that loads and stores overlap compute. Copies and row ops go to whichever
engine would finish them first by the work the group gave each
(:meth:`_Emitter._least`); q's and k's cast-and-scale prologue is applied as
their transposes leave PSUM (:meth:`_Emitter._late_ops`); ``_safe_softmax``'s
zeroing of all ``-inf`` rows is folded into the division
(:meth:`_Emitter._safe_rows`).

Limits (else equations are lowered one by one): head size <= 128, keys per row
<= 512 (one PSUM bank of scores), float dtypes.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from ..ir import IR, Eqn, Literal, Var
from ..neuron import isa
from ..neuron.program import HbmTensor, HbmView
from .base import (
    NEURON_DTYPES,
    CannotLower,
    HandoffError,
    Ring,
    TileScope,
    dataflow,
    handoff_shape,
    resident_view,
)
from .elementwise import ACT_FUNC_OF
from .fusion import Group, _broadcastable, _is_map, _row_reduce_r, _space_strides

__all__ = ["AttentionGroup", "plan"]

_P = 128
_NB = 512
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_VIEW_OPS = ("reshape", "permute", "slice")
#: q/k/v/O views whose batch is two strided levels (``[batch, heads]`` of a head split at batch > 1) are read
#: in place (:class:`_Heads`); False cuts them as one-level views only (their head splits become copies)
TWO_LEVEL_BATCH = True
#: copies and tensor_scalar/tensor_reduce go to the engine that would finish them first by the work each was given
#: (:meth:`_Emitter._least`); False: copies alternate VectorE / ScalarE and the rest weighs VectorE's share twice
BALANCE_ENGINES = True
#: q's and k's cast-and-scale prologue is applied as their transposes leave PSUM, the blocks transposed as loaded
#: (:meth:`_Emitter._late_ops`); False: applied to each loaded block before its transpose
LATE_PROLOGUE = True
#: _safe_softmax's zeroing of all -inf rows folded into the division (:meth:`_Emitter._safe_rows`); False: a select
SAFE_ROWS = True
_F32_MAX = float(torch.finfo(torch.float32).max)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _c3(shape) -> Optional[Tuple[int, int, int]]:
    """``(batch, rows, cols)`` of a score-shaped value (all leading axes are batch), None below rank 2."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        return None
    b = 1
    for s in shape[:-2]:
        b *= s
    return (b, shape[-2], shape[-1])


def _alias3(e: Eqn) -> bool:
    """A reshape that only regroups the batch axes (the per-batch tiles are the same)."""
    return e.op.name == "reshape" and isinstance(e.inputs[0], Var) and \
        e.inputs[0].dtype == e.outputs[0].dtype and _c3(e.inputs[0].shape) == _c3(e.outputs[0].shape) and \
        _c3(e.outputs[0].shape) is not None


# --------------------------------------------------------------------------- view chains

def _apply_view(view: Any, e: Eqn) -> Any:
    """``view`` (an HbmView with the shape of ``e``'s input) transformed by view equation ``e``."""
    name = e.op.name
    if name == "reshape":
        return view.reshape(*[int(s) for s in (e.outputs[0].shape or (1,))])
    if name == "permute":
        return view.permute(*[int(d) for d in e.attrs["dims"]])
    if name == "slice":
        dim, start, end, step = (int(e.attrs[k]) for k in ("dim", "start", "end", "step"))
        idx = [slice(None)] * len(view.shape)
        idx[dim] = slice(start, end, step)
        return view[tuple(idx)]
    raise CannotLower(f"{name} is not a view op")


def _invert_view(view: Any, e: Eqn) -> Any:
    """``view`` (shaped like ``e``'s output) seen with the shape of ``e``'s input (reshape/permute; a
    ``convert`` of the output chain keeps the view: it is applied when O leaves PSUM)."""
    name = e.op.name
    if name == "convert":
        return view
    if name == "reshape":
        return view.reshape(*[int(s) for s in (e.inputs[0].shape or (1,))])
    if name == "permute":
        dims = [int(d) for d in e.attrs["dims"]]
        inv = [0] * len(dims)
        for i, d in enumerate(dims):
            inv[d] = i
        return view.permute(*inv)
    raise CannotLower(f"{name} cannot be inverted as a view")


def _regroups_batch(e: Eqn) -> bool:
    """A reshape that only regroups the leading (batch) axes: the last two axes stay as they are."""
    if e.op.name != "reshape" or not isinstance(e.inputs[0], Var):
        return False
    a, b = tuple(e.inputs[0].shape), tuple(e.outputs[0].shape)
    return len(a) >= 2 and len(b) >= 2 and a[-2:] == b[-2:]


def _view_of(base_hbm: Any, chain: List[Eqn]) -> Any:
    """The HBM view of an operand: ``base_hbm`` through the chain's view ops (its elementwise prologue ops,
    which commute with them, are applied on chip after the load). A reshape merging batch axes that are not one
    strided axis (the heads of a head split at batch > 1) is kept as the axes it would merge when only prologue
    ops or more such reshapes follow it: the result is then ``[*batch axes, rows, cols]``
    (:func:`_batched` reads it as the two-level batch it is)."""
    v = base_hbm.view()
    kept = False
    for e in chain:
        if e.op.name not in _VIEW_OPS:
            continue
        if kept and not _regroups_batch(e):
            raise CannotLower(f"attention: {e.op.name} after a kept batch regroup")
        try:
            v = _apply_view(v, e)
        except Exception:
            if not _regroups_batch(e):
                raise
            kept = True
    return v


class _Heads:
    """An HBM view ``[B, rows, cols]`` whose batch axis is up to two strided levels ``[B // block, block]`` (the
    heads of a head split at batch > 1: ``[batch, heads]`` of one projection's output). Indexing a run of batches
    inside one block (``[b0:b0+n, ...]``, or one batch) gives an :class:`HbmView`; ``permute(0, 2, 1)`` swaps
    rows and cols. One level (``block == B``) is the plain strided view."""

    def __init__(self, tensor: Any, offset: int, levels: List[Tuple[int, int]], rc: List[Tuple[int, int]]):
        self.tensor, self.offset = tensor, int(offset)
        self.levels, self.rc = list(levels), list(rc)
        self.B = 1
        for n, _ in self.levels:
            self.B *= n
        self.block = self.levels[-1][0] if self.levels else 1

    @property
    def dims(self) -> List[Tuple[int, int]]:
        """The batch axis (its inner level) and the rows' and cols' ``(num, stride)``."""
        inner = self.levels[-1] if self.levels else (1, 0)
        return [(self.B, inner[1])] + self.rc

    @property
    def shape(self) -> Tuple[int, int, int]:
        return (self.B, self.rc[0][0], self.rc[1][0])

    def permute(self, *axes) -> "_Heads":
        """Rows and cols swapped (``permute(0, 2, 1)``; the batch axis stays first)."""
        if tuple(axes) == (0, 1, 2):
            return self
        if tuple(axes) != (0, 2, 1):
            raise CannotLower(f"attention: permute{axes} of a batched view")
        return _Heads(self.tensor, self.offset, self.levels, self.rc[::-1])

    def __getitem__(self, idx) -> Any:
        idx = idx if isinstance(idx, tuple) else (idx,)
        b, rest = idx[0], idx[1:]
        if isinstance(b, slice):
            b0, b1, step = b.indices(self.B)
            if step != 1 or b1 <= b0:
                raise CannotLower(f"attention: batch slice {b}")
        else:
            b0 = int(b)
            b1 = b0 + 1
        o, i0 = divmod(b0, self.block)
        if (b1 - 1) // self.block != o:
            raise CannotLower(f"attention: batches {b0}..{b1} cross a block of {self.block}")
        off = self.offset
        if len(self.levels) == 2:
            off += o * self.levels[0][1]
        st = self.levels[-1][1] if self.levels else 0
        view = HbmView(self.tensor, off + i0 * st, [(b1 - b0, st)] + self.rc)
        return view[(slice(None),) + rest] if isinstance(b, slice) else view[(0,) + rest]


def _segments(B: int, bg: int, blocks: List[int]) -> List[Tuple[int, int]]:
    """``[(b0, n), ...]``: batches ``0 .. B`` in runs of at most ``bg``, none crossing a multiple of a block."""
    out, b0 = [], 0
    while b0 < B:
        end = min([B, b0 + bg] + [(b0 // k + 1) * k for k in blocks if k > 0])
        out.append((b0, end - b0))
        b0 = end
    return out


def _batched(view: Any, shape3) -> _Heads:
    """``view`` (an HbmView ``[*batch, rows, cols]``) as a :class:`_Heads` ``[B, rows, cols]`` (``shape3``): its
    batch axes merged where their strides allow; more than two levels left raise :class:`CannotLower`."""
    B, R, C = (int(s) for s in shape3)
    dims = list(view.dims)
    n = 1
    for m, _ in dims[:-2]:
        n *= m
    if len(dims) < 2 or (dims[-2][0], dims[-1][0]) != (R, C) or n != B:
        raise CannotLower(f"attention: view {[m for m, _ in dims]} is not [{B}, {R}, {C}]")
    levels = []
    for m, s in dims[:-2]:
        if m == 1:
            continue
        if levels and levels[-1][1] == m * s:
            levels[-1] = (levels[-1][0] * m, s)
        else:
            levels.append((m, s))
    if len(levels) > (2 if TWO_LEVEL_BATCH else 1):
        raise CannotLower(f"attention: batch axes {levels} are more than {1 + TWO_LEVEL_BATCH} strided levels")
    return _Heads(view.tensor, view.offset, levels, dims[-2:])


def _prologue_op(e: Eqn) -> bool:
    """An elementwise op of one operand that a q/k/v chain may apply on chip after loading: a float ``convert``
    or a multiply/divide by a number (BERT's fp32 cast and ``1/sqrt(sqrt(d))`` scale under autocast)."""
    x = e.inputs[0] if e.inputs else None
    if not isinstance(x, Var) or x.dtype not in _FLOATS or e.outputs[0].dtype not in _FLOATS:
        return False
    if e.op.name == "convert":
        return len(e.inputs) == 1
    if e.op.name in ("mul", "div") and len(e.inputs) == 2 and e.attrs.get("rounding_mode") is None:
        c = e.inputs[1]
        return isinstance(c, Literal) and isinstance(c.value, (int, float)) and not isinstance(c.value, bool) \
            and x.dtype == e.outputs[0].dtype
    return False


def _prologue_ops(chain: List[Eqn]) -> List[Eqn]:
    """The elementwise ops of a q/k/v chain, in order."""
    return [e for e in chain if e.op.name not in _VIEW_OPS]


def _dummy(var: Var) -> Any:
    return HbmTensor(0, "_plan", tuple(var.shape) or (1,), NEURON_DTYPES[var.dtype], "scratch")


# --------------------------------------------------------------------------- the group

class AttentionGroup(Group):
    """Equations ``k0 .. k0+len-1`` forming one attention (see the module docstring)."""

    def __init__(self, eqns, inputs, outputs, s_eqn, o_eqn, q_chain, k_chain, v_chain, out_chain, body):
        super().__init__(eqns, inputs, outputs)
        self.s_eqn, self.o_eqn = s_eqn, o_eqn
        self.q_chain, self.k_chain, self.v_chain, self.out_chain = q_chain, k_chain, v_chain, out_chain
        self.body = body          # the equations between the matmuls, in order

    def lower(self, ctx: Any, ins: List[Any], outs: List[Any]) -> None:
        """Emit the attention into ``ctx.prog`` (``ins``/``outs``: HbmTensors of ``inputs``/``outputs``)."""
        _Emitter(ctx, self, dict(zip(self.inputs, ins)), dict(zip(self.outputs, outs))).run()

    def __repr__(self) -> str:
        return f"<AttentionGroup S={self.s_eqn.outputs[0].aval} O={self.o_eqn.outputs[0].aval}>"


def plan(ir: IR, host: Dict[int, str], nofuse: Set[int] = frozenset()) -> Dict[int, AttentionGroup]:
    """Attention groups of ``ir``: first equation index -> :class:`AttentionGroup`."""
    producer, users, outset = dataflow(ir)
    groups: Dict[int, AttentionGroup] = {}
    taken: Set[int] = set()
    for ks, e in enumerate(ir.eqns):
        if e.op.name != "matmul" or ks in host or ks in taken:
            continue
        g = _match(ir, ks, producer, users, outset, host, nofuse)
        if g is not None:
            k0 = min(g[0])
            groups[k0] = g[1]
            taken.update(g[0])
    return groups


def _back(ir, v, producer, users):
    """View chain ending in ``v``: (base Var, [eqn indices base->v]) with single-use intermediates (``v`` read
    elsewhere too is its own base); the chain may hold elementwise prologue ops (:func:`_prologue_op`)."""
    idxs = []
    if len(users.get(v, ())) != 1:
        return v, idxs
    while True:
        k = producer.get(v)
        if k is None:
            break
        e = ir.eqns[k]
        if not ((e.op.name in _VIEW_OPS and isinstance(e.inputs[0], Var)) or _prologue_op(e)):
            break
        idxs.append(k)
        x = e.inputs[0]
        if len(users.get(x, ())) != 1:
            v = x
            break
        v = x
    return v, list(reversed(idxs))


def _fill_value(e: Eqn) -> Optional[float]:
    """The value of a ``full`` equation (a constant tensor of one float/int/bool value), else None."""
    if e.op.name != "full" or e.inputs:
        return None
    value = e.attrs.get("value")
    if isinstance(value, bool):
        return float(value)
    return float(value) if isinstance(value, (int, float)) else None


def _trim(eqns, base, chain, lo):
    """A view chain ``(base, eqn indices)`` cut to the equations at ``lo`` and after: the value read before
    the first kept equation becomes the base."""
    kept = [j for j in chain if j >= lo]
    if len(kept) == len(chain):
        return base, chain
    if not kept:
        return eqns[chain[-1]].outputs[0], []
    return eqns[kept[0]].inputs[0], kept


def _expressible_suffix(eqns, base, chain, shape3):
    """The longest tail of view chain ``(base, eqn indices)`` whose view of its base, seen as ``shape3``
    (batch, rows, cols), is one strided view: ``(base, kept indices)``."""
    chain = list(chain)
    while True:
        try:
            _batched(_view_of(_dummy(base), [eqns[j] for j in chain]), shape3)
            return base, chain
        except Exception:
            if not chain:
                return base, chain
            base = eqns[chain.pop(0)].outputs[0]


def _inverts(eqns, chain, shape3) -> bool:
    """Whether the output ``O`` of a head merge ``chain`` (reshapes/permutes) is a strided view ``shape3`` of its
    result."""
    if not chain:
        return True
    try:
        _out_view(_dummy(eqns[chain[-1]].outputs[0]), [eqns[j] for j in chain], shape3)
        return True
    except Exception:
        return False


def _out_view(out_hbm: Any, chain: List[Eqn], shape3) -> "_Heads":
    """The output ``O`` ``[B, rows, cols]`` (``shape3``) as a view of ``out_hbm``, the result of head merge
    ``chain``, its equations inverted last first. A reshape regrouping the batch axes that no strided view can
    invert (the heads of a merge at batch > 1) keeps the axes when only converts or more such reshapes remain
    to invert; the view is then read as a two-level batch (:func:`_batched`)."""
    w = out_hbm.view()
    kept = False
    for e in reversed(chain):
        if kept and e.op.name != "convert" and not _regroups_batch(e):
            raise CannotLower(f"attention: {e.op.name} before a kept batch regroup of the output")
        if _regroups_batch(e):
            try:
                w = w.reshape(*[int(s) for s in (e.inputs[0].shape or (1,))])
            except Exception:
                kept = True
            continue
        w = _invert_view(w, e)
    return _batched(w, shape3)


def _match(ir, ks, producer, users, outset, host, nofuse):
    eqns = ir.eqns
    S = eqns[ks]
    q, kt = S.inputs
    if not all(isinstance(a, Var) and a.dtype in _FLOATS for a in (q, kt)) or q.dtype != kt.dtype:
        return None
    if q.ndim < 3 or S.outputs[0].dtype != q.dtype:
        return None
    sv = S.outputs[0]
    T, d = int(q.shape[-2]), int(q.shape[-1])
    Tk = int(kt.shape[-1])
    if d > _P or Tk > _NB or Tk < 2 or T < 1:
        return None
    qb, qc = _back(ir, q, producer, users)
    kb, kc = _back(ir, kt, producer, users)
    canon = _c3(sv.shape)
    row = canon[:-1] + (1,)
    # the body: equations over S's shape reachable from S, until the second matmul
    vals: Set[Var] = {sv}
    body: List[int] = []
    made: List[int] = []          # ``full`` equations between the matmuls (constants: filled on chip)
    o_idx = None
    k = ks + 1
    pending_v: List[int] = []
    n = len(eqns)
    while k < n:
        if k in host:
            return None
        e = eqns[k]
        ins = [a for a in e.inputs if isinstance(a, Var)]
        if e.op.name == "matmul" and isinstance(e.inputs[0], Var) and e.inputs[0] in vals:
            o_idx = k
            break
        if _fill_value(e) is not None:
            made.append(k)
            k += 1
            continue
        if any(a in vals for a in ins):
            shp = _c3(e.outputs[0].shape)
            if _alias3(e) or (_is_map(e) and not e.op.name == "reshape"):
                if shp != canon and shp != row:
                    return None
            elif _row_reduce_r(e) == 1 and e.attrs.get("keepdim", False):
                if shp != row:
                    return None
            else:
                return None
            for a in ins:
                if a not in vals and not _broadcastable(a.shape, e.outputs[0].shape):
                    return None
                if a in vals and _c3(a.shape) not in (canon, row):
                    return None
            body.append(k)
            vals.update(e.outputs)
        elif e.op.name in _VIEW_OPS or _prologue_op(e):
            pending_v.append(k)         # maybe part of V's chain (checked below)
        else:
            return None
        k += 1
    if o_idx is None:
        return None
    O = eqns[o_idx]
    p, v = O.inputs
    ov = O.outputs[0]
    if not isinstance(v, Var) or v.dtype != p.dtype or p.dtype != q.dtype or ov.dtype != q.dtype:
        return None
    if tuple(p.shape[:-2]) != tuple(v.shape[:-2]) or int(v.shape[-2]) != Tk or int(v.shape[-1]) > _P:
        return None
    if _c3(p.shape) != canon or tuple(q.shape[:-2]) != tuple(p.shape[:-2]) or \
            tuple(kt.shape[:-2]) != tuple(q.shape[:-2]):
        return None
    vb, vc = _back(ir, v, producer, users)
    # the output chain: reshapes/permutes of O with single users, and one narrowing convert of an fp32 O (the
    # fp32 result in PSUM rounded once to the convert's dtype, as torch rounds it)
    oc = []
    cur = ov
    while cur not in outset and len(users.get(cur, ())) == 1:
        j = users[cur][0]
        e = eqns[j]
        narrowing = e.op.name == "convert" and ov.dtype == torch.float32 and e.outputs[0].dtype in _FLOATS and \
            not any(eqns[i].op.name == "convert" for i in oc)
        if (e.op.name not in ("reshape", "permute") and not narrowing) or j != (oc[-1] if oc else o_idx) + 1:
            break
        oc.append(j)
        cur = e.outputs[0]
    # views must be expressible without copies: a chain whose view is not (a reshape merging axes a permute
    # split) starts later, an output chain ends earlier (the rest of it stays its own lowering)
    B = canon[0]
    dv = int(v.shape[-1])
    qb, qc = _expressible_suffix(eqns, qb, qc, (B, T, d))
    kb, kc = _expressible_suffix(eqns, kb, kc, (B, d, Tk))
    vb, vc = _expressible_suffix(eqns, vb, vc, (B, Tk, dv))
    while oc and not _inverts(eqns, oc, (B, T, dv)):
        oc.pop()
    out_var = eqns[oc[-1]].outputs[0] if oc else ov
    # the group is one run of consecutive equations: the view chains of q, k and v keep only their part that
    # adjoins the run (an earlier head split stays its own lowering; its result is the chain's base)
    core = set([ks, o_idx] + body + made + oc)
    lo = min(core)
    chained = set(qc + kc + vc)
    while lo - 1 in chained:
        lo -= 1
    (qb, qc), (kb, kc), (vb, vc) = (_trim(eqns, b, c, lo) for b, c in ((qb, qc), (kb, kc), (vb, vc)))
    members = core | set(qc + kc + vc)
    k0, k1 = min(members), max(members)
    if any(j not in members for j in range(k0, k1 + 1)) or any(j in host or (j in nofuse and j != k0)
                                                                 for j in range(k0, k1 + 1)):
        return None
    if k0 in nofuse:
        return None
    # intermediates used only inside (a constant made inside and read after the group is an output too)
    made_vars = [eqns[j].outputs[0] for j in made]
    extra_out = []
    for j in members:
        for w in eqns[j].outputs:
            if w is out_var:
                continue
            if w in outset or any(u not in members for u in users.get(w, ())):
                if w not in made_vars:
                    return None
                extra_out.append(w)
    # the softmax result feeds O only through alias reshapes; S feeds only the body
    if p not in vals:
        return None
    if not _inverts(eqns, oc, (B, T, dv)):
        return None
    # prologue multiplies/divides round to the operand's dtype (converts between them are applied as copies)
    for chain, final in ((qc, q), (kc, kt), (vc, v)):
        if any(eqns[j].op.name != "convert" and eqns[j].outputs[0].dtype != final.dtype
               for j in chain if eqns[j].op.name not in _VIEW_OPS):
            return None
    # values made by ``full`` (inside the run or anywhere before it) are constants: filled on chip, never loaded
    fills: Dict[Var, float] = {}
    for x in made_vars + [a for j in body for a in eqns[j].inputs if isinstance(a, Var)]:
        value = _fill_value(eqns[producer[x]]) if x in producer else None
        if value is not None:
            fills[x] = value
    inputs: List[Var] = []
    for x in [qb, kb, vb] + [a for j in body for a in eqns[j].inputs
                             if isinstance(a, Var) and a not in vals and a not in fills]:
        if x not in inputs:
            inputs.append(x)
    if any(x in vals or x is ov for x in inputs):
        return None
    grp = AttentionGroup([eqns[j] for j in range(k0, k1 + 1)], inputs, [out_var] + extra_out, S, O,
                         [eqns[j] for j in qc], [eqns[j] for j in kc], [eqns[j] for j in vc],
                         [eqns[j] for j in oc], [eqns[j] for j in body])
    grp.bases = (qb, kb, vb)
    grp.fills = fills
    consts = {v: t for v, t in ir.consts}
    grp.consts = {x: consts[x] for x in inputs if x in consts}
    return members, grp


# --------------------------------------------------------------------------- emission

class _Emitter:
    #: the score evacuation adds an outside operand of the scores' shape (an additive mask) as it reads PSUM
    mask_in_evacuation = True

    def __init__(self, ctx, g: AttentionGroup, env_in, env_out):
        self.ctx, self.prog, self.g = ctx, ctx.prog, g
        self.env_in, self.env_out = env_in, env_out
        q, kt = g.s_eqn.inputs
        self.dt = NEURON_DTYPES[q.dtype]
        self.isz = isa.DTYPE_SIZES[isa.dtype_code(self.dt)]
        self.B = 1
        for s in q.shape[:-2]:
            self.B *= int(s)
        self.T, self.d = int(q.shape[-2]), int(q.shape[-1])
        self.Tk = int(kt.shape[-1])
        self.dv = int(g.o_eqn.inputs[1].shape[-1])
        # work given to each engine so far, in ns (:meth:`_pick`, :meth:`copy`, :meth:`_note`)
        self._load = {"vector": 0.0, "scalar": 0.0, "gpsimd": 0.0}

    def run(self) -> None:
        g, prog = self.g, self.prog
        B, T, d, Tk, dv = self.B, self.T, self.d, self.Tk, self.dv
        qb, kb, vb = g.bases
        # [B, T, d], [B, Tk, d] (K rows), [B, Tk, dv], O [B, T, dv] as views of the HBM tensors
        qv = _batched(_view_of(self.env_in[qb], g.q_chain), (B, T, d))
        ktv = _batched(_view_of(self.env_in[kb], g.k_chain), (B, d, Tk))
        kv = ktv.permute(0, 2, 1)
        vv = _batched(_view_of(self.env_in[vb], g.v_chain), (B, Tk, dv))
        # elementwise prologue ops of q, k, v (applied on chip to each loaded block), by the view they follow
        self.ops = {id(qv): _prologue_ops(g.q_chain), id(kv): _prologue_ops(g.k_chain),
                    id(vv): _prologue_ops(g.v_chain)}
        # q's and k's prologue applied as their transposes leave PSUM (:meth:`_late_ops`): the blocks are
        # transposed as loaded (a bf16 transpose is a quarter of an fp32 one) and the cast and scale cost nothing
        self.late = {id(v): self._late_ops(self.ops[id(v)], b) for v, b in ((qv, qb), (kv, kb))}
        raw_dt = [NEURON_DTYPES[b.dtype] for b in (qb, kb, vb)]
        raw_isz = [torch.empty((), dtype=b.dtype).element_size() for b in (qb, kb, vb)]
        out_var = g.outputs[0]
        ov = _out_view(self.env_out[out_var], g.out_chain, (B, T, dv))
        KB = _cdiv(Tk, _P)
        isz = self.isz
        # heads per group: Q, K, V and O of a group stay in SBUF (double buffered)
        per = (d + KB * d + KB * dv + dv) * isz + (Tk + _P) * isz
        # ... and the blocks of q, k, v as loaded, before their prologue ops
        per += sum(n * z for n, z, c in zip((d, KB * d, KB * dv), raw_isz, (g.q_chain, g.k_chain, g.v_chain))
                   if _prologue_ops(c))
        bg = max(1, min(B, (64 * 1024) // (2 * per)))
        # heads per 128-partition chunk of Q^T / K^T (transposed together when the head size divides 128)
        # (operands of an instruction start at partition 0/32/64/96: head sizes that are multiples of 32)
        self.hpc = _P // d if _P % d == 0 and d % 32 == 0 else 1
        res = self.ctx.resident
        if not all(b in res for b in g.bases) and B >= 4 and bg * 4 > B:
            # Q, K and V come from HBM: about four head groups, so that the loads of the next group and the store
            # of the previous one overlap a group's compute (the loop below is software-pipelined across groups)
            bg = min(bg, max(self.hpc, _cdiv(B, 4)))
        # head groups never cross a block of a two-level view (the batch of a head split at batch > 1)
        self.segs = _segments(B, bg, [v.block for v in (qv, ktv, vv, ov)])
        bg = max(n for _, n in self.segs)
        with TileScope(prog) as scope:
            self.scope = scope
            G = max(1, min(prog.arch.psum_bank_bytes // (_P * isz), 8))
            self.G = G
            self.tp_ring = Ring(scope.psum((_P, G, _P), self.dt, f"at_tp{i}") for i in range(2))
            self.tp_slot = 0
            # PSUM: scores of several heads per bank, outputs of several heads per bank (two banks each)
            self.spb = max(1, _NB // Tk)
            self.HB = min(4, self.spb) if self.spb > 1 else 1
            self.s_ring = Ring(scope.psum((_P, _NB), "float32", f"at_s{i}") for i in range(2 if self.spb > 1 else 3))
            self.o_ring = Ring(scope.psum((_P, _NB), "float32", f"at_o{i}") for i in range(2))
            self.opb = max(1, _NB // dv)
            self.s_slot = self.o_slot = 0
            self.consts: Dict[Any, Any] = {}
            # V is read until a group's last P V: with three groups or more, a third buffer lets the loads of
            # the next group start before then
            nbuf = 3 if B > 2 * bg and 3 * bg * per <= 64 * 1024 else 2
            q_ring = Ring(scope.sbuf((_P, bg, d), self.dt, f"at_q{i}") for i in range(nbuf))
            k_ring = Ring(scope.sbuf((_P, KB, bg, d), self.dt, f"at_k{i}") for i in range(nbuf))
            v_ring = Ring(scope.sbuf((_P, KB, bg, dv), self.dt, f"at_v{i}") for i in range(nbuf))
            os_ring = Ring(scope.sbuf((_P, bg, dv), NEURON_DTYPES[out_var.dtype], f"at_os{i}")
                           for i in range(nbuf))
            self.rings: Dict[Any, Any] = {}
            self._compile_body()
            nch = _cdiv(bg, self.hpc)
            qT_ring = Ring(scope.sbuf((_P, nch, _P), self.dt, f"at_qT{i}") for i in range(2))
            kT_ring = Ring(scope.sbuf((_P, nch, Tk), self.dt, f"at_kT{i}") for i in range(2))
            self.pt_ring = Ring(scope.sbuf((_P, KB, _P), self.dt, f"at_pt{i}") for i in range(self.HB + 1))
            # SBUF hand-off: q/k/v sources left in SBUF by the previous lowering are read in place (when every
            # view of them is a row block), the output is left in SBUF when the next lowerings want it
            views = self._resident_views(qv, kv, vv)
            # K^T materialised in HBM (keys contiguous): loaded as it is, the layout the scores' matmul reads
            # (heads' d rows on the partitions), instead of K rows read element by element and transposed
            direct_kt = views is None and ktv.dims[-1][1] == 1 and kv.dims[-1][1] != 1 and not self.ops[id(kv)]
            qr_ring, kr_ring, vr_ring = (
                Ring(scope.sbuf(shape, dt, f"at_raw{i}") for i in range(nbuf)) if self.ops[id(view)] else None
                for shape, dt, view in zip(((_P, bg, d), (_P, KB, bg, d), (_P, KB, bg, dv)), raw_dt, (qv, kv, vv)))
            pub = None
            if self.ctx.wants(out_var):
                rows, cols = handoff_shape(out_var)
                pub = (prog.sbuf((rows, cols), NEURON_DTYPES[out_var.dtype], name="at_out"), cols)
            # software pipelining across blocks of heads and across head groups: the scores and softmax of
            # the next block (and the loads and Q/K transposes of the next head group) are emitted before the
            # previous block's P^T and P V (each engine runs in order, so TensorE would otherwise wait for
            # every block's softmax before it starts the next block)
            HB = self.HB
            pend = None          # (first head, P tiles, V blocks, O tile, tq, store or None) awaiting its back

            def back(pend):
                p0, ps, vbs, ot, tq, store = pend
                self._back([(pt, [vbs[j][:, p0 + i, :] for j in range(KB)], ot[:tq, p0 + i, :])
                            for i, pt in enumerate(ps)], tq)
                if store is not None:
                    store()
            for b0, nb in self.segs:
                kt_ = k_ring.take()
                vt_ = v_ring.take()
                kr_ = kr_ring.take() if kr_ring else None
                vr_ = vr_ring.take() if vr_ring else None
                kb_, vb_ = [], []
                kT = kT_ring.take()
                if direct_kt:
                    self._load_kT(ktv, kT, b0, nb)
                else:
                    for j in range(KB):
                        r0 = j * _P
                        rp = min(_P, Tk - r0)
                        kb_.append(self._rows_in(views, kv, kt_[:rp, j, :nb, :], b0, nb, r0, rp,
                                                 kr_[:rp, j, :nb, :] if kr_ else None))
                    for j in range(KB):
                        r0 = j * _P
                        rp = min(_P, Tk - r0)
                        self._heads_T(kb_[j], rp, nb, lambda c, w, r0=r0, rp=rp: kT[:w, c, r0:r0 + rp],
                                      self.late[id(kv)])
                for t0 in range(0, T, _P):
                    tq = min(_P, T - t0)
                    qt_ = q_ring.take()
                    qr_ = qr_ring.take()[:tq, :nb, :] if qr_ring else None
                    q_rows = self._rows_in(views, qv, qt_[:tq, :nb, :], b0, nb, t0, tq, qr_)
                    if t0 == 0:
                        for j in range(KB):
                            r0 = j * _P
                            rp = min(_P, Tk - r0)
                            vb_.append(self._rows_in(views, vv, vt_[:rp, j, :nb, :], b0, nb, r0, rp,
                                                     vr_[:rp, j, :nb, :] if vr_ else None))
                    qT = qT_ring.take()
                    self._heads_T(q_rows, tq, nb, lambda c, w, tq=tq: qT[:w, c, :tq], self.late[id(qv)])
                    ot = os_ring.take()[:, :nb, :]
                    if pub is not None:
                        ot = resident_view(pub[0], pub[1], ov[b0:b0 + nb, t0:t0 + tq, :].permute(1, 0, 2))
                        if ot is None:
                            prog.free(pub[0])
                            raise HandoffError(out_var, "attention: the output is not a row block of its SBUF tile")
                    for h0 in range(0, nb, HB):
                        heads = []
                        for bi in range(h0, min(nb, h0 + HB)):
                            c, po = divmod(bi, self.hpc)
                            po *= d
                            heads.append((b0 + bi, qT[po:po + d, c, :tq], kT[po:po + d, c, :Tk]))
                        ps = self._front(heads, t0, tq)
                        if pend is not None:
                            back(pend)
                        store = None
                        if h0 + HB >= nb and pub is None:
                            store = (lambda b0=b0, nb=nb, t0=t0, tq=tq, ot=ot:
                                     prog.dma_copy(ov[b0:b0 + nb, t0:t0 + tq, :].permute(1, 0, 2), ot[:tq, :nb, :]))
                        pend = (h0, ps, vb_, ot, tq, store)
            if pend is not None:
                back(pend)
            if pub is not None:
                self.ctx.publish(out_var, pub[0])
            self._store_fills()

    def _resident_views(self, qv, kv, vv):
        """``{id(view): fn(hbm region) -> SBUF view}`` when q, k and v's sources are all left in SBUF and every
        region read is a row block of them (then they are taken), else None (loaded from HBM)."""
        ctx, g = self.ctx, self.g
        res = ctx.resident
        bases = dict(zip((id(qv), id(kv), id(vv)), g.bases))
        if not all(b in res for b in g.bases):
            return None
        fns = {}
        for vid, base in bases.items():
            fns[vid] = (lambda src, t=res[base], cols=handoff_shape(base)[1]: resident_view(t, cols, src))
        # every region the loops read must map (checked with the same slicing as the loops)
        T, Tk = self.T, self.Tk
        for b0, nb in self.segs:
            for r0 in range(0, Tk, _P):
                rp = min(_P, Tk - r0)
                for view in (kv, vv):
                    if fns[id(view)](view[b0:b0 + nb, r0:r0 + rp, :].permute(1, 0, 2)) is None:
                        return None
            for t0 in range(0, T, _P):
                if fns[id(qv)](qv[b0:b0 + nb, t0:t0 + min(_P, T - t0), :].permute(1, 0, 2)) is None:
                    return None
        for base in set(g.bases):
            ctx.take(base)
        return fns

    def _load_kT(self, ktv, kT, b0, nb) -> None:
        """DMA K^T of heads ``b0 .. b0+nb`` (``ktv``: HBM view ``[B, d, Tk]``, keys contiguous) into ``kT``
        ``[128, chunks, Tk]`` (head ``h`` at partitions ``(h % hpc) * d`` of chunk ``h // hpc``, as
        :meth:`_heads_T` leaves it): one DMA for all chunks when the heads' rows merge, else one per chunk, else
        one per head."""
        d, hpc, Tk, prog = self.d, self.hpc, self.Tk, self.prog
        nch = _cdiv(nb, hpc)
        if nb == nch * hpc:
            try:
                src = ktv[b0:b0 + nb].reshape(nch, hpc * d, Tk).permute(1, 0, 2)
            except Exception:
                src = None
            if src is not None:
                prog.dma_copy(kT[:hpc * d, :nch, :Tk], src)
                return
        for c in range(nch):
            h0, h1 = c * hpc, min(nb, c * hpc + hpc)
            try:
                src = ktv[b0 + h0:b0 + h1].reshape((h1 - h0) * d, Tk)
            except Exception:
                src = None
            if src is not None:
                prog.dma_copy(kT[:(h1 - h0) * d, c, :Tk], src)
                continue
            for h in range(h0, h1):
                po = (h - h0) * d
                prog.dma_copy(kT[po:po + d, c, :Tk], ktv[b0 + h])

    def _rows_in(self, views, hv, dst, b0, nb, r0, rp, raw=None):
        """Rows ``r0 .. r0+rp`` of batches ``b0 .. b0+nb`` of ``hv`` (the HBM view ``[B, rows, cols]`` of q, k or
        v) as an SBUF view ``[rp, nb, cols]``: read in place when the sources stay in SBUF (``views``, see
        :meth:`_resident_views`), else DMA'd into ``dst``. With prologue ops the block is loaded into ``raw``
        (the base's dtype) and the ops write ``dst``."""
        src = hv[b0:b0 + nb, r0:r0 + rp, :].permute(1, 0, 2)
        ops = self.ops.get(id(hv))
        if self.late.get(id(hv)) is not None:
            # the ops are applied after the transpose (:meth:`_late_ops`): the block as it lies
            if views:
                return views[id(hv)](src)
            self.prog.dma_copy(raw, src)
            return raw
        if views:
            src = views[id(hv)](src)
            if not ops:
                return src
        elif not ops:
            self.prog.dma_copy(dst, src)
            return dst
        else:
            self.prog.dma_copy(raw, src)
            src = raw
        self._apply_ops(ops, dst, src)
        return dst

    def _apply_ops(self, ops: List[Eqn], dst, src) -> None:
        """``dst = ops(src)`` (an operand's prologue ops, in order), each op's result rounded to its dtype as
        torch rounds it; a widening convert before another op is not applied (the op reads the narrower value
        exactly)."""
        prog = self.prog
        cur = src
        n = int(dst.shape[-1]) * int(dst.shape[-2]) if len(dst.shape) > 2 else int(dst.shape[-1])
        for i, e in enumerate(ops):
            last = i == len(ops) - 1
            if e.op.name == "convert":
                a, r = e.inputs[0].dtype, e.outputs[0].dtype
                if not last and torch.finfo(r).bits > torch.finfo(a).bits:
                    continue
                self.copy(dst, cur)
            else:
                alu = "multiply" if e.op.name == "mul" else "divide"
                prog.tensor_scalar(dst, cur, alu, float(e.inputs[1].value), engine=self._pick(n))
            cur = dst
        if cur is src:
            self.copy(dst, src)

    # ---------------------------------------------------------------- one head
    def _late_ops(self, ops: List[Eqn], base: Var) -> Optional[List[Tuple[str, float]]]:
        """``[(alu, number), ...]`` when a q/k prologue can be applied as the transposed block leaves PSUM instead
        of to the loaded block: a widening float convert of the base to the group's dtype, then multiplies or
        divides by numbers in that dtype (BERT's fp32 cast and ``d**-0.25`` scale under autocast). The convert is
        exact and transposing moves values unchanged, so each op rounds the same values as torch's; else None."""
        if not LATE_PROLOGUE or not ops or ops[0].op.name != "convert" or \
                base.dtype not in (torch.bfloat16, torch.float16):
            return None
        dt = ops[0].outputs[0].dtype
        if NEURON_DTYPES.get(dt) != self.dt or torch.finfo(dt).bits <= torch.finfo(base.dtype).bits:
            return None
        out = []
        for e in ops[1:]:
            if e.op.name not in ("mul", "div") or e.outputs[0].dtype != dt:
                return None
            out.append(("multiply" if e.op.name == "mul" else "divide", float(e.inputs[1].value)))
        return out if len(out) <= 2 else None

    def _transpose(self, dst, src, rows, cols, ops=None):
        """``dst[:cols, :rows] = src[:rows, :cols]^T`` through PSUM (the next of the PSUM banks' 128-column
        slots: consecutive transposes do not wait for each other's evacuation); ``ops`` (:meth:`_late_ops`)
        applied as the result leaves PSUM."""
        i = self.tp_slot
        self.tp_slot += 1
        tp = self.tp_ring.tiles[(i // self.G) % len(self.tp_ring.tiles)]
        j = i % self.G
        self.prog.transpose(tp[:cols, j, :rows], src)
        if not ops:
            self.copy(dst, tp[:cols, j, :rows])
        elif len(ops) == 1 and ops[0][0] == "multiply" and self._least(("vector", "scalar"), rows) == "scalar":
            self.prog.activation(dst, tp[:cols, j, :rows], "identity", scale=ops[0][1])
        else:
            if not (len(ops) == 1 and ops[0][0] == "multiply"):
                self._note("vector", rows)
            (a0, v0), (a1, v1) = ops[0], (ops[1] if len(ops) > 1 else (None, None))
            self.prog.tensor_scalar(dst, tp[:cols, j, :rows], a0, v0, a1, v1, engine="vector")

    def _tile(self, v: Var, full: bool, tq: int, dtype: Optional[str] = None):
        """The next of two SBUF buffers of value ``v`` (consecutive heads overlap across engines)."""
        dt = dtype or NEURON_DTYPES[v.dtype]
        key = (v, dt)
        ring = self.rings.get(key)
        if ring is None:
            ring = self.rings[key] = Ring(self.scope.sbuf((_P, self.Tk if full else 1), dt, "at_val")
                                          for _ in range(2 * self.HB + 1))
        return ring.take()[:tq]

    def _heads_T(self, rows, r, nb, dst, ops=None) -> None:
        """Transpose the per-head row tiles ``rows`` ``[r, nb, d]`` into ``dst(chunk, width)`` ``[width, r]``:
        ``self.hpc`` heads per transpose (head ``h`` at partitions ``(h % hpc) * d`` of chunk ``h // hpc``)."""
        d, hpc = self.d, self.hpc
        for c in range(_cdiv(nb, hpc)):
            h0 = c * hpc
            h1 = min(nb, h0 + hpc)
            w = (h1 - h0) * d
            self._transpose(dst(c, w), rows[:, h0:h1, :].reshape(r, w), r, w, ops)

    def _front(self, heads, t0, tq):
        """Scores and body of a block of heads ``[(b, qT [d, tq], kT [d, Tk]), ...]``, stage by stage (every
        engine runs in order: each stage of a head finds the previous stage done, while the other heads' work
        fills the engines). Returns the SBUF tiles of P."""
        prog, g = self.prog, self.g
        Tk = self.Tk
        envs = []
        for b, qT, kT in heads:
            i = self.s_slot
            self.s_slot += 1
            bank = self.s_ring.tiles[(i // self.spb) % len(self.s_ring.tiles)]
            j = (i % self.spb) * Tk
            prog.matmul(bank[:tq, j:j + Tk], qT, kT, accumulate=False, stop=True)
            envs.append(({"psum": bank[:tq, j:j + Tk]}, b))
        for step in self.steps:
            for env, b in envs:
                step(env, b, t0, tq)
        return [env[g.o_eqn.inputs[0]] for env, _ in envs]

    def _back(self, items, tq):
        """P^T and O = P V for a block of heads ``[(P tile, V blocks, O destination), ...]``, stage by stage."""
        prog = self.prog
        Tk, dv = self.Tk, self.dv
        pts = []
        for p_tile, v_blocks, _ in items:
            pT = self.pt_ring.take()
            for j in range(len(v_blocks)):
                r0 = j * _P
                rp = min(_P, Tk - r0)
                self._transpose(pT[:rp, j, :tq], p_tile[:tq, r0:r0 + rp], tq, rp)
            pts.append(pT)
        outs = []
        for (p_tile, v_blocks, o_dst), pT in zip(items, pts):
            i = self.o_slot
            self.o_slot += 1
            bank = self.o_ring.tiles[(i // self.opb) % len(self.o_ring.tiles)]
            c = (i % self.opb) * dv
            KB = len(v_blocks)
            for j in range(KB):
                rp = min(_P, Tk - j * _P)
                prog.matmul(bank[:tq, c:c + dv], pT[:rp, j, :tq], v_blocks[j], accumulate=j > 0, stop=j == KB - 1)
            outs.append((o_dst, bank[:tq, c:c + dv]))
        for o_dst, o_ps in outs:
            self.copy(o_dst, o_ps)

    # ---------------------------------------------------------------- the body, compiled once
    def _compile_body(self) -> None:
        """``self.steps``: closures computing the body for one head (``env`` maps Vars to tiles).

        Peepholes (each exact under torch's rounding): the score evacuation absorbs a following multiply
        by a power of two; ``x - rowvalue`` feeding a ScalarE function becomes that function's bias (and a
        following row sum its fused reduce); an op feeding only a cast writes the cast's dtype (narrowing
        from fp32, or widening a value it only moves); ``where`` with a constant triangular mask is a
        GpSimd ``affine_select``. Row reductions, the negated row max and the division by a row value go to
        VectorE or GpSimd, whichever is less loaded (:meth:`_pick`).
        """
        g, prog = self.g, self.prog
        sv = g.s_eqn.outputs[0]
        canon = _c3(sv.shape)
        body = list(g.body)
        uses: Dict[Var, int] = {}
        for e in body + [g.o_eqn]:
            for a in e.inputs:
                if isinstance(a, Var):
                    uses[a] = uses.get(a, 0) + 1
        alias: Dict[Var, Var] = {}
        for e in body:
            if _alias3(e):
                alias[e.outputs[0]] = alias.get(e.inputs[0], e.inputs[0])

        def root(v):
            return alias.get(v, v)

        def only_user(v) -> Optional[Eqn]:
            """The single body equation reading ``v`` (through alias reshapes), or None."""
            found = None
            for e in body + [g.o_eqn]:
                if _alias3(e):
                    continue
                if any(isinstance(a, Var) and root(a) is v for a in e.inputs):
                    if found is not None:
                        return None
                    found = e
            aliased = [e for e in body if _alias3(e) and root(e.inputs[0]) is v]
            if any(uses.get(e.outputs[0], 0) > 1 for e in aliased) or uses.get(v, 0) > 1:
                return None
            return found

        def full_of(v):
            return _c3(v.shape) == canon

        steps = []
        done: Set[int] = set()
        out_dt: Dict[Var, str] = {}          # dtype overrides (cast folding)

        def dt_of(v):
            return out_dt.get(v, NEURON_DTYPES[v.dtype])

        # score evacuation (+ a multiply by a power of two)
        first = next((j for j, e in enumerate(body) if not _alias3(e)), None)
        scale = 1.0
        if first is not None:
            e = body[first]
            c = e.inputs[1] if len(e.inputs) == 2 else None
            if e.op.name == "mul" and root(e.inputs[0]) is sv and isinstance(c, Literal) and \
                    isinstance(c.value, (int, float)) and not isinstance(c.value, bool) and c.value != 0 and \
                    math.frexp(abs(float(c.value)))[0] == 0.5 and only_user(sv) is e and \
                    e.outputs[0].dtype == sv.dtype:
                scale = float(c.value)
                done.add(first)
                alias[e.outputs[0]] = sv
        # ... or + an outside operand of the scores' shape (BERT's additive mask): one VectorE add reading PSUM,
        # the same fp32 sum torch rounds once, instead of a copy out of PSUM and an add of two SBUF operands
        masked = None
        if first is not None and scale == 1.0 and sv.dtype == torch.float32 and self.mask_in_evacuation:
            e = body[first]
            if e.op.name == "add" and len(e.inputs) == 2 and only_user(sv) is e and \
                    e.outputs[0].dtype == torch.float32 and full_of(e.outputs[0]):
                a, m = e.inputs
                if isinstance(m, Var) and root(m) is sv:
                    a, m = m, a
                if isinstance(a, Var) and root(a) is sv and isinstance(m, Var) and root(m) is not sv and \
                        m not in g.fills and m.dtype in _FLOATS and m not in {x.outputs[0] for x in body}:
                    masked = (e, m)
                    done.add(first)

        def evac(env, b, t0, tq, scale=scale, masked=masked):
            if masked is not None:
                e, m = masked
                t = self._tile(e.outputs[0], True, tq)
                prog.tensor_tensor(t, env["psum"], self._arg(env, m, tq, True, b, t0, e), "add")
                self._note("vector", self.Tk)
                env[e.outputs[0]] = t
                return
            t = self._tile(sv, True, tq)
            if scale == 1.0:
                self.copy(t, env["psum"])
            else:
                prog.activation(t, env["psum"], "identity", scale=scale)
                self._note("scalar", self.Tk)
            env[sv] = t
        steps.append(evac)
        # cast folding
        for j, e in enumerate(body):
            if j in done or _alias3(e) or e.op.name == "convert":
                continue
            v = e.outputs[0]
            u = only_user(v)
            if u is None or u.op.name != "convert" or v not in uses:
                continue
            w = u.outputs[0]
            moves = e.op.name in ("where",)
            if (v.dtype == torch.float32 and w.dtype in _FLOATS) or (moves and w.dtype == torch.float32):
                out_dt[v] = NEURON_DTYPES[w.dtype]
                done.add(body.index(u))
                alias[w] = v
        safe = self._safe_rows(body, done, only_user, root, full_of) if SAFE_ROWS else None
        clamp, clamped = set(), []
        if safe is not None:
            w, d, sub, c = safe
            clamp.add(id(sub))
            done.add(body.index(d))

            def safe_div(env, b, t0, tq, w=w, d=d, c=c):
                # p = e / (s + masked): 0 / 1 in an all -inf row (its exp's bias clamped finite), e / s elsewhere
                out = self._tile(w.outputs[0], True, tq, dt_of(w.outputs[0]))
                env[w.outputs[0]] = out
                x = self._arg(env, d.inputs[0], tq, True, b, t0, d)
                r = self._arg(env, d.inputs[1], tq, False, b, t0, d)
                s2 = self._tile(c, False, tq, "float32")
                prog.tensor_tensor(s2, r, self._arg(env, c, tq, False, b, t0, w), "add", engine=self._pick(1))
                prog.tensor_scalar(out, x, "divide", s2, engine=self._pick(self.Tk))
        for j, e in enumerate(body):
            if j in done or _alias3(e):
                continue
            v = e.outputs[0]
            full = full_of(v)
            if safe is not None and e is safe[0]:
                steps.append(safe_div)
                continue
            # x - r (r a row value) feeding only a ScalarE function: that function's bias
            if e.op.name == "sub" and isinstance(e.inputs[1], Var) and not full_of(e.inputs[1]) and full and \
                    v.dtype == torch.float32:
                u = only_user(v)
                if u is not None and u.op.name in ACT_FUNC_OF and len(u.inputs) == 1 and \
                        u.outputs[0].dtype == torch.float32:
                    ju = body.index(u)
                    nxt = body[ju + 1] if ju + 1 < len(body) else None
                    red = nxt is not None and nxt.op.name == "sum" and nxt.inputs[0] is u.outputs[0] and \
                        _row_reduce_r(nxt) == 1 and nxt.outputs[0].dtype == torch.float32
                    done.update({ju} | ({ju + 1} if red else set()))
                    if id(e) in clamp:
                        clamped.append(e)

                    def act_bias(env, b, t0, tq, e=e, u=u, nxt=nxt, red=red):
                        x = self._arg(env, e.inputs[0], tq, True, b, t0, e)
                        r = self._arg(env, e.inputs[1], tq, False, b, t0, e)
                        neg = self._tile(e.inputs[1], False, tq, "float32")
                        if id(e) in clamp:
                            # -(-inf) of an all -inf row clamped to the largest float: exp(-inf + big) = 0
                            prog.tensor_scalar(neg, r, "multiply", -1.0, "min", _F32_MAX, engine=self._pick(1))
                        else:
                            prog.tensor_scalar(neg, r, "multiply", -1.0, engine=self._pick(1))
                        out = self._tile(u.outputs[0], True, tq, dt_of(u.outputs[0]))
                        env[u.outputs[0]] = out
                        if red:
                            rs = self._tile(nxt.outputs[0], False, tq, dt_of(nxt.outputs[0]))
                            env[nxt.outputs[0]] = rs
                            prog.activation(out, x, ACT_FUNC_OF[u.op.name], bias=neg, reduce_op="add", reduce_out=rs)
                        else:
                            prog.activation(out, x, ACT_FUNC_OF[u.op.name], bias=neg)
                        self._note("scalar", self.Tk + (64 if red else 0))
                    steps.append(act_bias)
                    continue
            # an ScalarE function with its row sum
            nxt = body[j + 1] if j + 1 < len(body) else None
            if e.op.name in ACT_FUNC_OF and len(e.inputs) == 1 and v.dtype == torch.float32 and nxt is not None \
                    and nxt.op.name == "sum" and nxt.inputs[0] is v and nxt.outputs[0].dtype == torch.float32 \
                    and _row_reduce_r(nxt) == 1 and j + 1 not in done:
                done.add(j + 1)

                def act_red(env, b, t0, tq, e=e, nxt=nxt):
                    out = self._tile(e.outputs[0], True, tq, dt_of(e.outputs[0]))
                    rs = self._tile(nxt.outputs[0], False, tq, dt_of(nxt.outputs[0]))
                    env[e.outputs[0]], env[nxt.outputs[0]] = out, rs
                    prog.activation(out, self._arg(env, e.inputs[0], tq, True, b, t0, e), ACT_FUNC_OF[e.op.name],
                                    reduce_op="add", reduce_out=rs)
                    self._note("scalar", self.Tk + 64)
                steps.append(act_red)
                continue
            if _row_reduce_r(e) == 1:
                def reduce(env, b, t0, tq, e=e):
                    out = self._tile(e.outputs[0], False, tq, dt_of(e.outputs[0]))
                    env[e.outputs[0]] = out
                    prog.tensor_reduce(out, self._arg(env, e.inputs[0], tq, True, b, t0, e), e.op.reduce_alu,
                                       axis=-1, engine=self._pick(self.Tk))
                steps.append(reduce)
                continue
            if e.op.name == "div" and e.attrs.get("rounding_mode") is None and full and \
                    all(isinstance(a, Var) for a in e.inputs) and full_of(e.inputs[0]) and \
                    _c3(e.inputs[1].shape) == canon[:-1] + (1,):
                def div_row(env, b, t0, tq, e=e):
                    out = self._tile(e.outputs[0], True, tq, dt_of(e.outputs[0]))
                    env[e.outputs[0]] = out
                    x = self._arg(env, e.inputs[0], tq, True, b, t0, e)
                    r = self._arg(env, e.inputs[1], tq, False, b, t0, e)
                    prog.tensor_scalar(out, x, "divide", r, engine=self._pick(self.Tk))
                steps.append(div_row)
                continue
            mask = self._causal(e) if e.op.name == "where" else None
            if mask is not None:
                src, fill, base, pattern = mask

                def affsel(env, b, t0, tq, e=e, src=src, fill=fill, base=base):
                    out = self._tile(e.outputs[0], True, tq, dt_of(e.outputs[0]))
                    env[e.outputs[0]] = out
                    prog.affine_select(out, self._arg(env, src, tq, True, b, t0, e), cmp="is_ge", base=base + t0,
                                       channel_multiplier=1, pattern=[-1], fill=fill)
                    self._note("gpsimd", 150 + self.Tk)
                steps.append(affsel)
                continue

            def generic(env, b, t0, tq, e=e, full=full):
                out = self._tile(e.outputs[0], full, tq, dt_of(e.outputs[0]))
                env[e.outputs[0]] = out
                args = [a.value if isinstance(a, Literal) else self._arg(env, a, tq, full, b, t0, e) for a in e.inputs]
                e.op.tile_rule(self.ctx, e, out, args)
                # (tile rules run on VectorE; where is a select, 2N)
                self._note("vector", self.Tk if full else 1, 2.0 if e.op.name == "where" else 1.0)
            steps.append(generic)
        self.alias = alias
        if safe is not None and not clamped:
            raise CannotLower("attention: the safe softmax's exp is not biased by its row max on ScalarE")

        def finish(env, b, t0, tq):
            for w in alias:
                v = w
                while v not in env and v in alias:
                    v = alias[v]
                if v in env:
                    env[w] = env[v]
        steps.append(finish)
        self.steps = steps

    _CLOCK = {"vector": "dve", "scalar": "act", "gpsimd": "pool"}

    def _safe_rows(self, body, done, only_user, root, full_of):
        """``(where, div, sub, masked)`` when the body ends its softmax as ``_safe_softmax`` does (torch's
        scaled_dot_product_attention with a mask): ``where(masked, 0, div(exp(x - m), sum))`` with ``masked =
        logical_not(ne(m, -inf))`` (:func:`tn.lower.schedule.row_any_from_max`) and ``m`` the row max the ``exp``
        is biased by; else None. Such a body is computed as ``exp(x + min(-m, FLT_MAX)) / (sum + masked)``: in a
        row of ``-inf`` (the only rows ``masked`` marks) every term is ``exp(-inf) = 0`` and the division
        ``0 / 1``, the ``where``'s zero; elsewhere the bias is ``-m`` and the divisor ``sum + 0 = sum`` (at least 1:
        the maximum's own term), bit for bit the unmasked softmax. Two instructions on ``[rows, 1]`` instead of a
        select over the scores."""
        g = self.g
        made = {id(o): e for e in body for o in e.outputs}
        for w in body:
            if w.op.name != "where" or body.index(w) in done or len(w.inputs) != 3:
                continue
            c, x, y = w.inputs
            if not all(isinstance(a, Var) for a in (c, x, y)) or g.fills.get(x) != 0.0 or not full_of(w.outputs[0]):
                continue
            d = made.get(id(y))
            if d is None or d.op.name != "div" or only_user(y) is not w or not full_of(y) or \
                    y.dtype != torch.float32 or not all(isinstance(a, Var) for a in d.inputs):
                continue
            ex, sm = d.inputs
            s_e, x_e = made.get(id(sm)), made.get(id(ex))
            if s_e is None or x_e is None or s_e.op.name != "sum" or s_e.inputs[0] is not ex or \
                    x_e.op.name != "exp" or full_of(sm):
                continue
            sub = made.get(id(x_e.inputs[0]))
            if sub is None or sub.op.name != "sub" or not isinstance(sub.inputs[1], Var):
                continue
            m = root(sub.inputs[1])
            ln = made.get(id(c))
            ne = made.get(id(ln.inputs[0])) if ln is not None and ln.op.name == "logical_not" else None
            if ne is None or ne.op.name != "ne" or len(ne.inputs) != 2 or not isinstance(ne.inputs[0], Var) or \
                    root(ne.inputs[0]) is not m or not (isinstance(ne.inputs[1], Literal) and
                                                         ne.inputs[1].value == float("-inf")):
                continue
            if only_user(c) is not w:
                continue
            return w, d, sub, c
        return None

    def _cost(self, engine: str, n: int, factor: float = 1.0) -> float:
        """Estimated ns ``engine`` is busy with an elementwise instruction of ``n`` elements per partition (the
        ``max(64, N)`` rule of :func:`tn.neuron.isa.cost_cycles`, ``factor`` x for the 2N ones, plus the access
        start) at its clock: a balance between engines, not the model's timing."""
        return (max(64.0, factor * n) + self.prog.arch.access_cycles) / self.prog.arch.clock_hz[self._CLOCK[engine]]

    def _note(self, engine: str, n: int, factor: float = 1.0) -> None:
        """Count an instruction emitted on a fixed engine in the balance."""
        self._load[engine] += self._cost(engine, n, factor)

    def _least(self, engines, n: int) -> str:
        """The engine of ``engines`` that would finish an instruction of ``n`` elements first by the work given to
        each so far; the work is counted."""
        load = self._load
        eng = min(engines, key=lambda k: load[k] + self._cost(k, n))
        load[eng] += self._cost(eng, n)
        return eng

    def _pick(self, n: int) -> str:
        """``"vector"`` or ``"gpsimd"`` for a ``tensor_scalar``/``tensor_reduce`` of ``n`` elements per partition
        (SBUF operands): the engine that would finish it first (:meth:`_least`). Both engines compute these ops
        alike, in fp32, so the choice never changes a result."""
        if not BALANCE_ENGINES:
            load = self.__dict__.setdefault("_pick_load", {"vector": 0.0, "gpsimd": 0.0})
            cost = {"vector": 2 * self._cost("vector", n), "gpsimd": self._cost("gpsimd", n)}
            eng = min(("vector", "gpsimd"), key=lambda k: load[k] + cost[k])
            load[eng] += cost[eng]
            return eng
        return self._least(("vector", "gpsimd"), n)

    def copy(self, out, src) -> None:
        """``tensor_copy(out, src)`` (a PSUM evacuation or an SBUF cast) on the engine that would finish it
        first: VectorE or ScalarE, GpSimd too when neither operand is in PSUM (it has no PSUM port). Every engine
        converts alike (round to nearest even), so the choice never changes a result."""
        n = 1
        for x in src.shape[1:]:
            n *= int(x)
        if not BALANCE_ENGINES:
            self._copies = getattr(self, "_copies", 0) + 1
            self.prog.tensor_copy(out, src, engine="vector" if self._copies % 2 else "scalar")
            return
        engines = ("vector", "scalar") if isa.MEM_PSUM in (src.mem, out.mem) else ("vector", "scalar", "gpsimd")
        self.prog.tensor_copy(out, src, engine=self._least(engines, n))

    def _causal(self, e: Eqn):
        """``(tensor operand, fill, base, pattern)`` when ``where(c, x, y)`` has a constant triangular mask ``c``
        over (query, key) and one scalar constant side: an ``affine_select`` keeping ``base + q - k >= 0``."""
        c, x, y = e.inputs
        consts = self.g.consts
        cv = consts.get(c) if isinstance(c, Var) else None
        if cv is None or cv.dtype != torch.bool:
            return None
        m = cv.reshape(cv.shape[-2:]) if cv.dim() >= 2 and cv.numel() == cv.shape[-1] * cv.shape[-2] else None
        if m is None or tuple(m.shape) != (self.T, self.Tk):
            return None

        def scalar(a):
            if isinstance(a, Literal) and isinstance(a.value, (int, float)):
                return float(a.value)
            t = consts.get(a) if isinstance(a, Var) else None
            return float(t.reshape(-1)[0]) if t is not None and t.numel() == 1 else None

        ones = torch.ones(self.T, self.Tk, dtype=torch.bool)
        for k in range(-self.T, self.Tk + 1):
            if torch.equal(m, ones.tril(k)):       # c true where key <= query + k
                fill = scalar(y)
                if fill is not None and isinstance(x, Var):
                    return x, fill, k, [-1]
            if torch.equal(m, ones.triu(k)):       # c true where key >= query + k: keep y where key < query + k
                fill = scalar(x)
                if fill is not None and isinstance(y, Var):
                    return y, fill, k - 1, [-1]
        return None

    def _arg(self, env, a: Var, tq: int, full: bool, b: int = 0, t0: int = 0, e: Optional[Eqn] = None):
        """A body operand as a tile of the equation's shape ``[tq, Tk or 1]``."""
        Tk = self.Tk
        shape = (tq, Tk if full else 1)
        while a not in env and a in self.alias:
            a = self.alias[a]
        if a in env:
            t = env[a]
            return t if tuple(t.shape) == shape else t.broadcast_to(shape)
        if a in self.g.fills:
            t = self._filled(a, shape[1])[:tq]
            return t if tuple(t.shape) == shape else t.broadcast_to(shape)
        return self._external(a, b, t0, tq, shape, e.outputs[0].shape)

    def _filled(self, a: Var, cols: int):
        """An SBUF tile ``[128, cols]`` holding constant ``a`` (a ``full`` value), set once."""
        key = ("fill", a, cols)
        t = self.consts.get(key)
        if t is None:
            t = self.consts[key] = self.scope.sbuf((_P, cols), NEURON_DTYPES[a.dtype], "at_fill")
            self.prog.memset(t, self.g.fills[a], engine="gpsimd")
        return t

    def _store_fills(self) -> None:
        """Write the constants made inside the group and read after it (their outputs) with their value."""
        for var in self.g.outputs[1:]:
            rows, cols = handoff_shape(var)
            if self.ctx.wants(var):
                t = self.prog.sbuf((rows, cols), NEURON_DTYPES[var.dtype], name="at_fill_out")
                self.prog.memset(t, self.g.fills[var], engine="gpsimd")
                self.ctx.publish(var, t)
                continue
            dst = self.env_out[var].view().reshape(rows, cols)
            src = self._filled(var, cols)
            for r0 in range(0, rows, _P):
                rp = min(_P, rows - r0)
                self.prog.dma_copy(dst[r0:r0 + rp, :], src[:rp])

    def _external(self, a: Var, b: int, t0: int, tq: int, shape, space):
        """An outside operand (mask, scalar, bias) for batch ``b``, loaded once per distinct region."""
        space = tuple(int(x) for x in space)
        st = _space_strides(a.shape, space)
        bst = st[:-2]
        off = 0
        rem = b
        for n, s in reversed(list(zip(space[:-2], bst))):
            off += (rem % n) * s
            rem //= n
        sr, sc = st[-2], st[-1]
        off += t0 * sr
        key = (a, off, tq)
        t = self.consts.get(key)
        if t is None:
            cols = self.Tk if sc != 0 else 1
            if len(self.consts) > 32:
                raise CannotLower("attention: too many distinct outside operand regions to keep in SBUF")
            t = self.scope.sbuf((_P, cols), NEURON_DTYPES[a.dtype], "at_ext")
            self.prog.dma_copy(t[:tq], HbmView(self.env_in[a], off, [(tq, sr), (cols, sc)]))
            self.consts[key] = t
        t = t[:tq]
        return t if tuple(t.shape) == shape else t.broadcast_to(shape)
