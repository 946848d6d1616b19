# Lowerings of the reductions (sum, prod, amax, amin, any, argmax, argmin), the scan (cumsum) and sort/topk onto VectorE/GpSimd/TensorE.
"""Reductions and scans on the NeuronCore.

Layout. The input's axes (merged where contiguous) are split into *kept*
and *reduced* axes. One axis goes on the 128 partitions:

* a kept axis (case K): every partition owns output rows; the reduced axes
  lie along the free axis, reduced by ``tensor_reduce`` on VectorE after the
  tile's view is permuted so they are innermost (no data moves: the DMA
  brought them in their natural order);
* a reduced axis (case R), split as ``(128, n // 128)`` (plus a remainder
  block) when there is no good kept axis (full reductions, reductions over
  leading axes): each partition reduces its share, partials are combined
  elementwise, and a GpSimd ``partition_reduce`` folds the 128 partitions at
  the end (two stages).

Free extents larger than a tile are chunked; partial results are combined
elementwise (``tensor_tensor``) in an fp32 accumulator per output block. The
result goes out through ``ctx.store`` (so the compiler can fuse an
epilogue) or, for int64 results, as int32 word pairs.

``amax``/``amin`` propagate NaN as torch does: ``tensor_reduce`` and
``partition_reduce`` do, and partial results are combined by a
``tensor_reduce`` over (running, new) pairs (the ALU's ``max``/``min`` would
drop a NaN on its first operand).

``argmax``/``argmin`` carry (value, index) pairs with torch's NaN rule (the
first NaN wins, as NaN is the extreme). A chunk's extreme ``m`` comes from a
NaN-propagating ``max``/``min`` reduce; from it, per line, ``s0`` (``m`` with
NaN as -inf, +inf for argmin) and ``s1 = (m >= -inf)`` (0 on a line holding
a NaN). An element is a candidate when ``(x >= s0) == s1``: on a NaN-free line
the elements equal to the extreme, on a NaN line exactly the NaNs (``x >=
-inf`` holds for every number, never for NaN). The chunk's index is the
smallest candidate index (``select`` of indices from ``iota`` or a big
constant, ``min`` reduce). With one line per partition ``s0``/``s1`` are
per-partition scalars and the candidate test is one two-op ``tensor_scalar``;
with several lines per partition (reductions over leading axes) it is one
``is_ge`` against the broadcast ``s0``, and one ``select`` into keys
``index - 2**24`` / ``2**24 - index`` whose ``min`` and ``max`` reduces give the
first element that passes / fails it (``s1`` picks). Chunks replace the
running pair only when strictly better, or with a NaN over a number, so the
first occurrence wins as in torch.

``cumsum`` runs on TensorE: the scanned axis goes on the partitions and each
128-block of the result is ``U^T x_I + 1^T carry`` with ``U`` the
upper-triangular ones matrix (built with ``affine_select``) and ``carry`` the
column sums of the earlier blocks (a ones-vector matmul per block), all
accumulated in fp32 PSUM: any length, three matmuls per block.

``sort``/``topk`` rank every element of a line by comparisons against the
line broadcast to all partitions (ties broken by index: a stable sort; NaN
after every number ascending, before them descending, in index order as in
torch), then output slot ``r`` selects the element of rank ``r``; O(n^2)
VectorE work per line of n, lines up to ~8K elements. int32/int64 lines
(e.g. MoE routing sorting expert ids) are compared in fp32, range-checked
below 2**24.

Integer arithmetic happens in fp32 on the engines: int32/int64 inputs are
range-checked on chip (values, and for sums ``count * max|v|``, below 2**24;
int64 values must fit int32) through ``ctx.range_check``, so a call whose data
is out of range reruns on the host; integer products raise
:class:`CannotLower` (host fallback).
"""
from __future__ import annotations

import itertools
import math
from typing import Any, List, NamedTuple

from .base import CannotLower, lowering
from .shape import FREE_BUDGET_BYTES, hview, load_checked_int, store_int
from ..shapes import contiguous_strides, numel

__all__ = ["reduce_lowering"]

_BIG = float(1 << 24)
_EXACT = 1 << 24


class _Ax(NamedTuple):
    """One (merged) axis: extent, input stride, output stride, index step (argmax), reduced or kept."""
    n: int
    xs: int
    os: int
    im: int
    red: bool


def _axes(shape, reduced, flat_index: bool) -> List[_Ax]:
    """The input's axes in order, merged where contiguous in input, output and index."""
    xs = contiguous_strides(shape)
    kept_shape = [n for i, n in enumerate(shape) if i not in reduced]
    ks = contiguous_strides(kept_shape)
    out: List[_Ax] = []
    k = 0
    for i, n in enumerate(shape):
        if i in reduced:
            a = _Ax(n, xs[i], 0, xs[i] if flat_index else 1, True)
        else:
            a = _Ax(n, xs[i], ks[k], 0, False)
            k += 1
        if n == 1:
            continue
        if out and out[-1].red == a.red and out[-1].xs == a.n * a.xs and out[-1].os == a.n * a.os \
                and out[-1].im == a.n * a.im:
            p = out[-1]
            out[-1] = _Ax(p.n * a.n, a.xs, a.os, a.im, a.red)
        else:
            out.append(a)
    if not any(a.red for a in out):
        out.append(_Ax(1, 0, 0, 0, True))
    return out


def _parts(axes: List[_Ax]):
    """Choose the partition axis: returns (case, [(x_offset, index_offset, partition_axis, free_axes)])."""
    first = axes[0]
    reds = [i for i, a in enumerate(axes) if a.red]
    big_red = max(reds, key=lambda i: axes[i].n)
    if not first.red and (first.n >= 32 or axes[big_red].n < 512):
        return "K", [(0, 0, first, axes[1:])]
    j = 0 if first.red else big_red
    e = axes[j]
    rest_a, rest_b = axes[:j], axes[j + 1:]
    if e.n <= 128:
        return "R", [(0, 0, e, rest_a + [_Ax(1, e.xs, 0, e.im, True)] + rest_b)]
    q, r = divmod(e.n, 128)
    parts = [(0, 0, _Ax(128, q * e.xs, 0, q * e.im, True), rest_a + [_Ax(q, e.xs, 0, e.im, True)] + rest_b)]
    if r:
        parts.append((128 * q * e.xs, 128 * q * e.im, _Ax(r, e.xs, 0, e.im, True),
                      rest_a + [_Ax(1, e.xs, 0, e.im, True)] + rest_b))
    return "R", parts


def _arg_plan(free: List[_Ax], fb: int, esize: int, idx: int, c: int):
    """The tiling plan of an arg reduction, shrunk until its SBUF working set fits: per chunk the tile and two
    fp32 key tiles, plus seven fp32 per-line tiles (running pair, extremes, keys, index, flags)."""
    while True:
        tile = [c if i == 0 else a.n for i, a in enumerate(free[idx:])]
        kept = numel(n for n, a in zip(tile, free[idx:]) if not a.red)
        if (2 * 4 + max(esize, 4)) * numel(tile) + 7 * 4 * kept <= 160 * 1024 or fb == 1:
            return idx, c
        fb = max(1, fb // 2)
        idx, c = _plan(free, fb)


def _plan(free: List[_Ax], fb: int):
    """(split index, chunk): axes before the split are looped, the split axis chunked, the rest in the tile."""
    for idx in range(len(free)):
        suffix = numel(a.n for a in free[idx + 1:])
        if len(free) - idx <= 4 and suffix <= fb:
            return idx, max(1, min(free[idx].n, fb // suffix))
    raise CannotLower("internal: no tiling plan")


def _loops(free: List[_Ax], idx: int, c: int, red: bool):
    """Option lists (dx, do, di, chunk-or-None) for the looped axes of one kind."""
    out = []
    for a in free[:idx]:
        if a.red == red:
            out.append([(i * a.xs, i * a.os, i * a.im, None) for i in range(a.n)])
    a = free[idx]
    if a.red == red:
        out.append([(c0 * a.xs, c0 * a.os, c0 * a.im, min(c, a.n - c0)) for c0 in range(0, a.n, c)])
    return out


def _sum_opts(combo):
    dx = sum(o[0] for o in combo)
    do = sum(o[1] for o in combo)
    di = sum(o[2] for o in combo)
    ch = [o[3] for o in combo if o[3] is not None]
    return dx, do, di, (ch[0] if ch else None)


def reduce_lowering(ctx: Any, x_t: Any, x_dt: str, shape, reduced, out_t: Any, alu: str, mode: str = "reduce",
                    out_int: bool = False, int_bound: float = None, identity: float = None) -> None:
    """Emit a reduction of ``x_t`` (contiguous, ``shape``) over the axes ``reduced`` into ``out_t``.

    ``alu``: VectorE reduce op (add, multiply, max, min, logical_or; a reduction op's
    :attr:`tn.ops.Op.reduce_alu`) and ``identity`` the value it leaves unchanged (the op's
    ``reduce_identity``; max and min need none); ``mode``: ``"reduce"``, ``"argmax"``
    or ``"argmin"`` (then ``reduced`` is every axis for a flat index, or one axis); ``out_int``: write
    through :func:`tn.lower.shape.store_int` (int64 outputs); ``int_bound``: integer inputs (int32, or int64 by
    their low words) are range-checked against it (:func:`tn.lower.shape.load_checked_int`).
    """
    prog = ctx.prog
    arg = mode != "reduce"
    flat = arg and len(reduced) == len(shape) and len(shape) > 1
    axes = _axes(tuple(shape), set(reduced), flat)
    if arg and numel(shape[i] for i in reduced) >= _EXACT:
        raise CannotLower(f"{mode} over {numel(shape[i] for i in reduced)} elements: indices beyond 2^24 are "
                          f"not exact on the fp32 engines")
    case, parts = _parts(axes)
    esize = 4 if x_dt in ("float32", "int32") else (2 if x_dt in ("bfloat16", "float16") else 1)
    fb = max(1, min(FREE_BUDGET_BYTES // max(esize, 4), 8192))
    if int_bound is not None:
        fb = max(1, fb // 2)  # the range check needs three more tiles of the same shape
    idx, c = _plan(parts[0][3], fb)
    if arg:
        idx, c = _arg_plan(parts[0][3], fb, esize, idx, c)
    kept_loops = _loops(parts[0][3], idx, c, red=False)
    pax0 = parts[0][2]
    if case == "K":
        kept_loops = [[(p0 * pax0.xs, p0 * pax0.os, 0, ("P", min(128, pax0.n - p0)))
                       for p0 in range(0, pax0.n, 128)]] + kept_loops
    pacc = 128 if case == "K" else max(p[2].n for p in parts)
    pacc = min(pacc, pax0.n) if case == "K" else pacc
    tile_ax = parts[0][3][idx:]
    # max/min (and the arg reductions) write the first chunk's result straight into the accumulator; later
    # chunks are folded in NaN-propagating (see the module docstring)
    extreme = arg or alu in ("max", "min")
    big = None
    if arg:
        big = prog.sbuf((128, 1), "float32")
        prog.memset(big, _BIG, engine="gpsimd")
    lag: List[Any] = []
    for kcombo in itertools.product(*kept_loops):
        pc = pacc
        k_ch = None
        dx_k = do_k = 0
        for o in kcombo:
            dx_k += o[0]
            do_k += o[1]
            if isinstance(o[3], tuple):
                pc = o[3][1]
            elif o[3] is not None:
                k_ch = o[3]
        kept_tile = [(k_ch if (i == 0 and k_ch is not None) else a.n, a.os)
                     for i, a in enumerate(tile_ax) if not a.red]
        kshape = [n for n, _ in kept_tile] or [1]
        pa = pacc if case == "R" else pc
        pair = None
        if extreme and not arg:   # (running, new) pairs, folded by a NaN-propagating tensor_reduce
            pair = prog.sbuf((pa, *kshape, 2), "float32")
            acc = pair[(slice(None),) * (1 + len(kshape)) + (0,)]
        else:
            acc = prog.sbuf((pa, *kshape), "float32")
        if not extreme:
            if identity is None:
                raise CannotLower(f"reduce with {alu}: no identity given to start the accumulator from")
            prog.memset(acc, float(identity), engine="vector")
        acc_i = prog.sbuf((pa, *kshape), "float32") if arg else None
        first = True
        for xoff, ioff, pax, free in parts:
            rloops = _loops(free, idx, c, red=True)
            ppc = pc if case == "K" else pax.n
            for rcombo in itertools.product(*rloops):
                dx_r, _, di_r, r_ch = _sum_opts(rcombo)
                ch = k_ch if k_ch is not None else r_ch
                tdims = [(ch if (i == 0 and ch is not None) else a.n, a.xs, a.im, a.red)
                         for i, a in enumerate(free[idx:])]
                tshape = [n for n, _, _, _ in tdims]
                tile = prog.sbuf((ppc, *tshape), "int32" if x_dt == "int64" else x_dt)
                src = hview(x_t, xoff + dx_k + dx_r, [(ppc, pax.xs)] + [(n, s) for n, s, _, _ in tdims])
                if int_bound is not None:
                    load_checked_int(ctx, tile, src, int_bound)
                else:
                    prog.dma_copy(tile, src)
                kax = [1 + i for i, t in enumerate(tdims) if not t[3]]
                rax = [1 + i for i, t in enumerate(tdims) if t[3]]
                view = tile.permute(0, *kax, *rax)
                raxes = tuple(range(1 + len(kax), 1 + len(kax) + len(rax)))
                a_slice = acc[:ppc]
                if extreme and first:
                    part = a_slice      # the first chunk's extreme goes straight into the accumulator
                elif pair is not None:
                    part = pair[(slice(0, ppc),) + (slice(None),) * len(kshape) + (1,)]
                else:
                    part = prog.sbuf((ppc, *kshape), "float32")
                part_view = part.reshape(ppc, *[t[0] for t in tdims if not t[3]]) if kax else part
                if rax:
                    prog.tensor_reduce(part_view, view,
                                       "max" if mode == "argmax" else ("min" if mode == "argmin" else alu), axis=raxes)
                else:
                    # the reduced axes lie across the partitions only (the tile plan looped their size-1 stand-in):
                    # the chunk is its own partial result (for an arg reduction each element is its line's extreme,
                    # its partition's index the index), folded below and over the partitions at the end
                    prog.tensor_copy(part_view, view)
                if not arg:
                    if pair is not None and not first:   # NaN-propagating fold of (running, new)
                        prog.tensor_reduce(a_slice, pair[:ppc], alu, axis=-1)
                    elif not extreme:
                        prog.tensor_tensor(a_slice, a_slice, part, alu)
                else:
                    _arg_chunk(prog, mode, tile, view, tdims, kax, rax, part, a_slice, acc_i[:ppc], big,
                               base=ioff + di_r, cm=(pax.im if case == "R" else 0),
                               ppc=ppc, kshape=kshape, first=first)
                first = False
                for t in lag:          # free the previous chunk's buffers now: the next load uses other memory
                    prog.free(t)
                lag = ([] if arg else [tile]) + ([part] if part is not a_slice and pair is None else [])
        # finalize
        if case == "K":
            dst = hview(out_t, do_k, [(pc, pax0.os)] + (kept_tile or [(1, 1)]))
            res = acc_i if arg else acc
        else:
            dst = hview(out_t, do_k, [(1, 0)] + (kept_tile or [(1, 1)]))
            res = prog.sbuf((1, *kshape), "float32")
            if not arg:
                prog.partition_reduce(res, acc, alu)
            else:   # the extreme over the partitions (NaN first), then the smallest index holding it
                g = prog.sbuf(acc.shape, "float32")
                prog.partition_reduce(g, acc, "max" if mode == "argmax" else "min")
                nc = _noncandidates(prog, mode, acc, g, acc.shape)
                flat2 = (acc.shape[0], numel(acc.shape[1:]))     # big broadcasts along one free axis
                prog.select(nc.reshape(*flat2), nc.reshape(*flat2), big[:acc.shape[0]].broadcast_to(flat2),
                            acc_i.reshape(*flat2))
                prog.partition_reduce(res, nc, "min")
                prog.free(nc)
                prog.free(g)
        if out_int:
            store_int(ctx, dst, res, nonneg=arg)
        else:
            ctx.store(dst, res)
        if res is not acc and res is not acc_i:
            prog.free(res)
        if acc_i is not None:
            prog.free(acc_i)
        prog.free(pair if pair is not None else acc)
    for t in lag:
        prog.free(t)
    if big is not None:
        prog.free(big)


def _line_keys(prog, mode, m, shape):
    """``(s0, s1)`` of the extremes ``m``: ``m`` with NaN as -inf (argmax; +inf for argmin), and 1 where ``m``
    is a number, 0 where it is NaN (the candidate test is ``(x >= s0) == s1``, ``<=`` for argmin)."""
    s0 = prog.sbuf(shape, "float32")
    s1 = prog.sbuf(shape, "float32")
    if mode == "argmax":
        prog.tensor_scalar(s0, m, "max", -math.inf)      # ALU max keeps its second operand for a NaN first
    else:
        prog.tensor_scalar(s0, m, "min", math.inf)
    prog.tensor_scalar(s1, m, "is_ge", -math.inf, engine="gpsimd")
    return s0, s1


def _noncandidates(prog, mode, x, m, shape):
    """A new fp32 tile of ``shape``: 1 where ``x`` (same shape as the extremes ``m``) is not its line's
    extreme (the first NaN rule: on a line with a NaN only NaNs are candidates), else 0."""
    s0, s1 = _line_keys(prog, mode, m, shape)
    nc = prog.sbuf(shape, "float32")
    prog.tensor_tensor(nc, x, s0, "is_ge" if mode == "argmax" else "is_le")
    prog.tensor_tensor(nc, nc, s1, "not_equal")
    prog.free(s1)
    prog.free(s0)
    return nc


def _arg_chunk(prog, mode, tile, view, tdims, kax, rax, m, acc_v, acc_i, big, base, cm, ppc, kshape, first):
    """Fold one chunk's (extreme value ``m``, first index) into the running (acc_v, acc_i) pair.

    ``view`` is the chunk's ``tile`` with kept axes first (the tile is freed once read: the next chunk's load
    may reuse it); ``m`` its NaN-propagating extremes per line (``acc_v`` itself for the ``first`` chunk,
    whose index then goes straight to ``acc_i``); ``big``: a ``[128, 1]`` tile of 2**24. Candidates and keys
    as in the module docstring.
    """
    tshape = [t[0] for t in tdims]
    kept_n = [tshape[a - 1] for a in kax]
    red_n = [tshape[a - 1] for a in rax]
    vshape = (ppc, *kept_n, *red_n)
    pattern = [t[2] if t[3] else 0 for t in tdims]
    raxes = tuple(range(1 + len(kax), 1 + len(kax) + len(rax)))
    cmp = "is_ge" if mode == "argmax" else "is_le"
    u = None
    if not first:
        # where the chunk replaces the running pair: strictly better, or a NaN over a number (on GpSimd,
        # in parallel with the chunk's VectorE work)
        u = prog.sbuf((ppc, *kshape), "float32")
        nn = prog.sbuf((ppc, *kshape), "float32")
        prog.tensor_scalar(nn, acc_v, "is_ge", -math.inf, engine="gpsimd")       # 1: the running value is a number
        prog.tensor_tensor(u, m, acc_v, "is_le" if mode == "argmax" else "is_ge", engine="gpsimd")  # 1: no better
        prog.tensor_tensor(u, u, nn, "is_lt", engine="gpsimd")
        prog.free(nn)
    ci = acc_i if first else prog.sbuf((ppc, *kshape), "float32")
    ci_v = ci.reshape(ppc, *kept_n) if kept_n else ci
    if numel(red_n) == 1:
        # one element per line (e.g. the remainder block of a split axis): it is the extreme, its index the index
        prog.iota(ci.reshape(ppc, *tshape), base=base, channel_multiplier=cm, pattern=pattern)
        prog.free(tile)
    elif not kept_n:
        # one line per partition: s0/s1 are per-partition scalars, the test one two-op tensor_scalar
        s0, s1 = _line_keys(prog, mode, m, (ppc, *kshape))
        ids = prog.sbuf((ppc, *tshape), "float32")
        prog.iota(ids, base=base, channel_multiplier=cm, pattern=pattern)
        nc = prog.sbuf(vshape, "float32")
        prog.tensor_scalar(nc, view, cmp, s0, "not_equal", s1)
        prog.free(tile)
        prog.select(nc, nc, big[:ppc].broadcast_to(vshape), ids.permute(0, *kax, *rax))
        prog.tensor_reduce(ci_v, nc, "min", axis=raxes)
        for t in (nc, ids, s1, s0):
            prog.free(t)
    else:
        # several lines per partition: keys index - BIG where the test holds, BIG - index where it fails;
        # their min (max) is the first element passing (failing) it, s1 says which one is wanted
        s0, s1 = _line_keys(prog, mode, m, (ppc, *kshape))
        lo = prog.sbuf((ppc, *tshape), "float32")
        hi = prog.sbuf((ppc, *tshape), "float32")
        prog.iota(lo, base=base - _BIG, channel_multiplier=cm, pattern=pattern)
        prog.iota(hi, base=_BIG - base, channel_multiplier=-cm, pattern=[-q for q in pattern])
        bshape = (ppc, *kept_n, *[1] * len(red_n))
        c = view if tile.dtype == "float32" else prog.sbuf(vshape, "float32")   # the test in place if fp32
        prog.tensor_tensor(c, view, s0.reshape(*bshape).broadcast_to(vshape), cmp)
        prog.free(s0)
        if c is not view:
            prog.free(tile)
        prog.select(c, c, lo.permute(0, *kax, *rax), hi.permute(0, *kax, *rax))
        prog.free(hi)
        prog.free(lo)
        b = prog.sbuf((ppc, *kshape), "float32")
        prog.tensor_reduce(ci_v, c, "min", axis=raxes)
        prog.tensor_reduce(b.reshape(ppc, *kept_n), c, "max", axis=raxes)
        prog.select(ci, s1, ci, b)                    # index - BIG < 0, or BIG - index > 0:
        prog.tensor_scalar(ci, ci, "abs_max", 0.0, "subtract", _BIG, reverse1=True)   # index = BIG - |key|
        for t in (b, tile if c is view else c, s1):
            prog.free(t)
    if not first:
        prog.select(acc_v, u, m, acc_v)
        prog.select(acc_i, u, ci, acc_i)
        prog.free(u)
        prog.free(ci)


def _in_dtype(ctx, eqn) -> str:
    v = eqn.inputs[0]
    if not hasattr(v, "shape") or hasattr(v, "value"):
        raise CannotLower("reduction of a literal")
    return ctx.neuron_dtype(v.dtype)


@lowering("sum", "prod", "amax", "amin", "any")
def _reduce(ctx, eqn, ins, outs):
    """sum/prod/amax/amin/any over ``dims`` (fp32 accumulation; see the module docstring)."""
    name = eqn.op.name
    x_dt = _in_dtype(ctx, eqn)
    xv, ov = eqn.inputs[0], eqn.outputs[0]
    out_dt = ctx.neuron_dtype(ov.dtype)
    shape = tuple(xv.shape) or (1,)
    dims = tuple(eqn.attrs.get("dims", ())) if xv.shape else (0,)
    if not dims and tuple(ov.shape) != tuple(xv.shape):  # aten: an empty dim list reduces every axis
        dims = tuple(range(len(shape)))
    count = numel(shape[d] for d in dims)
    is_int = x_dt in ("int32", "int64")
    if name == "prod" and (is_int or x_dt in ("bool", "uint8")) and out_dt not in ("float32", "bfloat16", "float16"):
        raise CannotLower(f"integer prod of {x_dt}: products overflow the exact fp32 range")
    if name == "sum" and x_dt in ("bool", "uint8") and count * 255 >= _EXACT:
        raise CannotLower(f"sum of {count} {x_dt} values may not be exact on the fp32 engines")
    bound = None
    if is_int:  # exact in fp32 only below 2**24: range-checked, a flagged call reruns on the host
        bound = float(_EXACT // max(1, count)) if name == "sum" else float(_EXACT)
        if bound < 1:
            raise CannotLower(f"sum over {count} integers cannot stay below 2**24")
    reduce_lowering(ctx, ins[0], x_dt, shape, dims, outs[0], eqn.op.reduce_alu,
                    out_int=(out_dt == "int64"), int_bound=bound, identity=eqn.op.reduce_identity)


@lowering("argmax", "argmin")
def _argreduce(ctx, eqn, ins, outs):
    """Index of the first max/min along ``dim`` (or of the flattened input), as int64."""
    x_dt = _in_dtype(ctx, eqn)
    xv = eqn.inputs[0]
    shape = tuple(xv.shape) or (1,)
    dim = eqn.attrs.get("dim")
    dims = tuple(range(len(shape))) if (dim is None or not xv.shape) else (dim,)
    reduce_lowering(ctx, ins[0], x_dt, shape, dims, outs[0], "max", mode=eqn.op.name,
                    out_int=ctx.neuron_dtype(eqn.outputs[0].dtype) == "int64",
                    int_bound=float(_EXACT) if x_dt in ("int32", "int64") else None)


@lowering("cumsum")
def _cumsum(ctx, eqn, ins, outs):
    """Inclusive prefix sum on TensorE: triangular-ones matmuls accumulated in fp32 PSUM."""
    prog = ctx.prog
    xv, ov = eqn.inputs[0], eqn.outputs[0]
    x_dt = _in_dtype(ctx, eqn)
    out_dt = ctx.neuron_dtype(ov.dtype)
    shape = tuple(xv.shape) or (1,)
    d = eqn.attrs["dim"] if xv.shape else 0
    n = shape[d]
    if x_dt in ("bool", "uint8") and n * 255 >= _EXACT:
        raise CannotLower(f"cumsum of {n} {x_dt} values may not be exact on the fp32 engines")
    bound = float(_EXACT // n) if x_dt in ("int32", "int64") else None  # range-checked; flagged calls rerun on host
    if out_dt not in ("float32", "bfloat16", "float16", "int64", "int32"):
        raise CannotLower(f"cumsum into {out_dt}")
    nblk = -(-n // 128)
    mm_dt = x_dt if x_dt in ("float32", "bfloat16", "float16") else "float32"
    st = contiguous_strides(shape)
    others = [_Ax(shape[i], st[i], st[i], 0, False) for i in range(len(shape)) if i != d and shape[i] > 1]
    merged: List[_Ax] = []
    for a in others:
        if merged and merged[-1].xs == a.n * a.xs:
            merged[-1] = _Ax(merged[-1].n * a.n, a.xs, a.xs, 0, False)
        else:
            merged.append(a)
    if not merged:
        merged = [_Ax(1, 0, 0, 0, False)]
    idx, c = _plan(merged, 512)
    loops = _loops(merged, idx, c, red=False)
    ones = prog.sbuf((128, 128), mm_dt)
    prog.memset(ones, 1.0)
    tri = prog.sbuf((128, 128), mm_dt)
    prog.affine_select(tri, ones, cmp="is_ge", channel_multiplier=-1, pattern=[1], fill=0.0)
    ones32 = prog.sbuf((1, 128), "float32")
    prog.memset(ones32, 1.0)
    sd = st[d]
    for combo in itertools.product(*loops):
        dx, _, _, ch = _sum_opts(combo)
        tdims = [(ch if (i == 0 and ch is not None) else a.n, a.xs) for i, a in enumerate(merged[idx:])]
        tshape = [t[0] for t in tdims]
        nfree = numel(tshape)
        carry = None          # fp32 [1, nfree]: the sums of all earlier 128-blocks
        for b in range(nblk):
            pb = min(128, n - 128 * b)
            raw = prog.sbuf((pb, *tshape), "int32" if x_dt == "int64" else x_dt)
            src = hview(ins[0], dx + 128 * b * sd, [(pb, sd)] + tdims)
            if bound is not None:
                load_checked_int(ctx, raw, src, bound)
            else:
                prog.dma_copy(raw, src)
            if x_dt != mm_dt:
                mov = prog.sbuf((pb, nfree), mm_dt)
                prog.tensor_copy(mov, raw.reshape(pb, nfree))
                prog.free(raw)
                raw = mov
            else:
                mov = raw.reshape(pb, nfree)
            # block b of the result: U^T x_b (+ 1^T carry, a K=1 matmul adding the carry to every row)
            ps = prog.psum((pb, nfree), "float32")
            prog.matmul(ps, tri[:pb, :pb], mov, accumulate=False, stop=carry is None)
            if carry is not None:
                prog.matmul(ps, ones32[:, :pb], carry, accumulate=True, stop=True)
            dst = hview(outs[0], dx + 128 * b * sd, [(pb, sd)] + tdims)
            if out_dt == "int64":
                store_int(ctx, dst, ps.reshape(pb, *tshape))
            else:
                ctx.store(dst, ps.reshape(pb, *tshape))
            prog.free(ps)
            if b + 1 < nblk:   # carry += column sums of block b
                cs = prog.psum((1, nfree), "float32")
                prog.matmul(cs, ones[:pb, :1], mov, accumulate=False, stop=True)
                if carry is None:
                    carry = prog.sbuf((1, nfree), "float32")
                    prog.tensor_copy(carry, cs)
                else:
                    prog.tensor_tensor(carry, carry, cs, "add")
                prog.free(cs)
            prog.free(raw)
        if carry is not None:
            prog.free(carry)
    prog.free(ones32)
    prog.free(tri)
    prog.free(ones)


# --------------------------------------------------------------------------- sort / topk (ranks by comparison)


def _sort_lines(ctx, eqn, x_t, x_dt, shape, d, descending, k, out_v, out_i):
    """Sort every line of ``x_t`` along axis ``d`` (stable, NaN last; first when ``descending``), writing the
    first ``k`` values and indices.

    Per line: the line is broadcast to all partitions. Element ``i`` (on a partition) counts the elements
    before it: ``A`` over ``j < i`` and ``B`` over ``j > i`` (``affine_select`` masks on GpSimd), one
    ``tensor_scalar`` each, both summed by one reduce. Ascending, for a number ``x_i``: ``A = x_j <= x_i``,
    ``B = x_j < x_i`` (a NaN ``x_j`` counts in neither); for a NaN: ``A = (x_j <= +inf) xor 1`` (the NaNs
    before it), ``B = x_j < -inf`` (none), plus the count of numbers on the line. Descending mirrors it with
    ``>=``/``>``, NaN as -inf/+inf, and numbers add the line's NaN count. The ranks go through HBM scratch to
    be broadcast in turn, and output slot ``r`` selects the element whose rank is ``r`` (``select`` + ``add``
    reduce, exact for any value: a NaN or an infinity plus zeros is itself).
    """
    prog = ctx.prog
    n = shape[d]
    st = contiguous_strides(shape)
    sd = st[d]
    others = [i for i in range(len(shape)) if i != d]
    ost = contiguous_strides(tuple(k if i == d else shape[i] for i in range(len(shape))))
    if 5 * n * 4 > ctx.arch.sbuf_partition_bytes - 24 * 1024:
        raise CannotLower(f"sort/topk of lines of {n} elements: five [128, {n}] fp32 tiles do not fit in SBUF")
    if n >= _EXACT:
        raise CannotLower("sort/topk: ranks beyond 2**24 are not exact on the fp32 engines")
    f32 = x_dt == "float32"
    integer = x_dt in ("int32", "int64")      # compared in fp32: range-checked below 2**24 (else a host rerun)
    row = None if f32 or integer else prog.sbuf((128, n), x_dt)
    rf = prog.sbuf((128, n), "float32")
    ids = prog.sbuf((128, n), "float32")
    prog.iota(ids, pattern=[1])
    zero = prog.sbuf((128, 1), "float32")
    prog.memset(zero, 0.0, engine="vector")
    cnt = prog.sbuf((128, 1), "float32")
    ranks = ctx.scratch((n,), "float32")
    rk = prog.sbuf((128, n), "float32")
    inf = math.inf
    # (A's compare, A's NaN threshold, B's compare, B's NaN threshold); a NaN x_i: A = NaN-ness of x_j
    a_cmp, a_nan, b_cmp, b_nan = ("is_ge", -inf, "is_gt", inf) if descending else ("is_le", inf, "is_lt", -inf)
    for li in itertools.product(*[range(shape[i]) for i in others]):
        xoff = sum(i * st[a] for i, a in zip(li, others))
        ooff = sum(i * ost[a] for i, a in zip(li, others))
        if integer:
            _load_int_as_f32(ctx, rf, hview(x_t, xoff, [(128, 0), (n, sd)]))
        elif f32:
            prog.dma_copy(rf, hview(x_t, xoff, [(128, 0), (n, sd)]))
        else:
            prog.dma_copy(row, hview(x_t, xoff, [(128, 0), (n, sd)]))
            prog.tensor_copy(rf, row)
        for c0 in range(0, n, 128):
            pc = min(128, n - c0)
            xcf = prog.sbuf((pc, 1), "float32")       # x[c0 + p] on partition p
            src = hview(x_t, xoff + c0 * sd, [(pc, sd), (1, 1)])
            if integer:
                _load_int_as_f32(ctx, xcf, src)
            elif f32:
                prog.dma_copy(xcf, src)
            else:
                xc = prog.sbuf((pc, 1), x_dt)
                prog.dma_copy(xc, src)
                prog.tensor_copy(xcf, xc, engine="gpsimd")
                prog.free(xc)
            ta = prog.sbuf((pc, 1), "float32")
            tb = prog.sbuf((pc, 1), "float32")
            fl = prog.sbuf((pc, 1), "float32")
            # thresholds with NaN replaced (ALU min/max keep their second operand for a NaN first), and the
            # flag: ascending 1 for a NaN x_i (A is xor-ed with it), descending 1 for a number (A is
            # compared equal to it)
            prog.tensor_scalar(tb, xcf, "min" if b_nan > 0 else "max", b_nan)
            prog.tensor_scalar(ta, xcf, "min" if a_nan > 0 else "max", a_nan, engine="gpsimd")
            if descending:
                prog.tensor_scalar(fl, xcf, "is_ge", -inf, engine="gpsimd")
            else:
                prog.tensor_scalar(fl, xcf, "is_ge", -inf, "is_equal", 0.0, engine="gpsimd")
            ab = prog.sbuf((pc, 2, n), "float32")
            prog.tensor_scalar(ab[:, 1, :], rf[:pc], b_cmp, tb)
            prog.affine_select(ab[:, 1, :], ab[:, 1, :], cmp="is_gt", base=-c0, channel_multiplier=-1,
                               pattern=[1], fill=0.0)                 # j > i
            prog.tensor_scalar(ab[:, 0, :], rf[:pc], a_cmp, ta, "is_equal" if descending else "not_equal", fl)
            prog.affine_select(ab[:, 0, :], ab[:, 0, :], cmp="is_gt", base=c0, channel_multiplier=1, pattern=[-1],
                               fill=0.0)                              # j < i
            if c0 == 0:
                _line_count(prog, rf, rk, cnt, descending)
            r = prog.sbuf((pc, 1), "float32")
            prog.tensor_reduce(r, ab, "add", axis=(1, 2))
            prog.tensor_scalar(r, fl, "multiply", cnt[:pc], "add", r, engine="gpsimd")
            prog.dma_copy(hview(ranks, c0, [(pc, 1), (1, 1)]), r)
            for t in (r, ab, fl, tb, ta, xcf):
                prog.free(t)
        prog.dma_copy(rk, hview(ranks, 0, [(128, 0), (n, 1)]))
        for r0 in range(0, k, 128):
            pc = min(128, k - r0)
            want = prog.sbuf((pc, 1), "float32")
            prog.iota(want, base=r0, channel_multiplier=1)
            m = prog.sbuf((pc, n), "float32")
            sel = prog.sbuf((pc, n), "float32")
            prog.tensor_scalar(m, rk[:pc], "is_equal", want)
            zb = zero[:pc].broadcast_to((pc, n))
            prog.select(sel, m, rf[:pc], zb)
            v = prog.sbuf((pc, 1), "float32")
            prog.tensor_reduce(v, sel, "add")
            if integer:
                store_int(ctx, hview(out_v, ooff + r0 * ost[d], [(pc, ost[d]), (1, 1)]), v)
            else:
                ctx.store(hview(out_v, ooff + r0 * ost[d], [(pc, ost[d]), (1, 1)]), v)
            prog.select(sel, m, ids[:pc], zb)
            ix = prog.sbuf((pc, 1), "float32")
            prog.tensor_reduce(ix, sel, "add")
            store_int(ctx, hview(out_i, ooff + r0 * ost[d], [(pc, ost[d]), (1, 1)]), ix, nonneg=True)
            for t in (ix, v, sel, m, want):
                prog.free(t)
    for t in (rk, cnt, zero, ids, rf) + ((row,) if row is not None else ()):
        prog.free(t)


def _load_int_as_f32(ctx, dst, src):
    """DMA the int32/int64 values of ``src`` into the fp32 SBUF tile ``dst``, flagging (``ctx.range_check``) any
    value the fp32 compare would not hold exactly (``|v| >= 2**24``)."""
    if src.dtype == "int64":
        load_checked_int(ctx, dst, src, _EXACT)
        return
    words = ctx.prog.sbuf(tuple(dst.shape), "int32")
    load_checked_int(ctx, words, src, _EXACT)
    ctx.prog.tensor_copy(dst, words)
    ctx.prog.free(words)


def _line_count(prog, rf, tmp, cnt, descending):
    """``cnt[p] =`` the count of numbers (ascending: a NaN's rank adds it) or of NaNs (descending: a
    number's) on the line ``rf`` (broadcast on every partition); GpSimd, ``tmp`` a scratch tile like ``rf``."""
    if descending:
        prog.tensor_scalar(tmp, rf, "is_ge", -math.inf, "is_equal", 0.0, engine="gpsimd")
    else:
        prog.tensor_scalar(tmp, rf, "is_ge", -math.inf, engine="gpsimd")
    prog.tensor_reduce(cnt, tmp, "add", engine="gpsimd")


def _sortable(ctx, eqn) -> str:
    x_dt = _in_dtype(ctx, eqn)
    if x_dt not in ("float32", "bfloat16", "float16", "int32", "int64"):
        raise CannotLower(f"{eqn.op.name} of {x_dt}: the comparison sort runs on float values (and int32/int64 "
                          f"values below 2**24)")
    if ctx.neuron_dtype(eqn.outputs[1].dtype) != "int64":
        raise CannotLower(f"{eqn.op.name} with {eqn.outputs[1].dtype} indices")
    return x_dt


@lowering("sort")
def _sort(ctx, eqn, ins, outs):
    """Stable sort along ``dim`` (values and int64 indices) by per-element ranks (NaN last; first descending)."""
    x_dt = _sortable(ctx, eqn)
    xv = eqn.inputs[0]
    shape = tuple(xv.shape) or (1,)
    d = eqn.attrs.get("dim", -1) if xv.shape else 0
    d = d % len(shape)
    _sort_lines(ctx, eqn, ins[0], x_dt, shape, d, bool(eqn.attrs.get("descending", False)), shape[d],
                outs[0], outs[1])


@lowering("topk")
def _topk(ctx, eqn, ins, outs):
    """The ``k`` largest (smallest) elements along ``dim`` in sorted order, with their int64 indices (NaN is
    larger than every number, as in torch). ``sorted=False`` lowers where torch's result is sorted too: k <= 2
    (MoE routers' top-1/top-2) or 64k <= n."""
    x_dt = _sortable(ctx, eqn)
    xv = eqn.inputs[0]
    shape = tuple(xv.shape) or (1,)
    d = eqn.attrs.get("dim", -1) if xv.shape else 0
    d = d % len(shape)
    k = int(eqn.attrs["k"])
    if k == 0:
        return
    if not eqn.attrs.get("sorted", True) and 2 < k and 64 * k > shape[d]:
        # torch's CPU kernel partial-sorts when 64k <= n, else takes nth_element at k - 1, which leaves the first
        # k - 1 in an unspecified order (sorted only for k <= 2); in the sorted cases this result is torch's
        raise CannotLower(f"topk with sorted=False, k={k} of {shape[d]}: torch's order of the unsorted result is "
                          f"not specified for 2 < k < n/64")
    _sort_lines(ctx, eqn, ins[0], x_dt, shape, d, bool(eqn.attrs.get("largest", True)), k, outs[0], outs[1])
