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

``argmax``/``argmin`` carry (value, index) pairs: a chunk's index is the
smallest index holding its extreme value (``is_equal`` against the
broadcast extreme, indices from ``iota``, ``min`` reduce); chunks replace
the running pair only when strictly better, so the first occurrence wins as
in torch (NaN is not treated specially).

``cumsum`` runs on TensorE: the scanned axis goes on the partitions and each
128-block of the result is ``U^T x_I + 1^T carry`` with ``U`` the
upper-triangular ones matrix (built with ``affine_select``) and ``carry`` the
column sums of the earlier blocks (a ones-vector matmul per block), all
accumulated in fp32 PSUM: any length, three matmuls per block.

``sort``/``topk`` rank every element of a line by comparisons against the
line broadcast to all partitions (ties broken by index: a stable sort), then
output slot ``r`` selects the element of rank ``r``; O(n^2) VectorE work per
line of n, lines up to ~8K elements.

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

__all__ = ["REDUCE_ALU", "reduce_lowering"]

#: core op -> VectorE reduce/ALU op.
REDUCE_ALU = {"sum": "add", "prod": "multiply", "amax": "max", "amin": "min", "any": "logical_or"}
_IDENTITY = {"add": 0.0, "multiply": 1.0, "max": -math.inf, "min": math.inf, "logical_or": 0.0}
_BIG = float(1 << 24)
_EXACT = 1 << 24


class _Ax(NamedTuple):
    """One (merged) axis: extent, input stride, output stride, index step (argmax), reduced or kept."""
    n: int
    xs: int
    os: int
    im: int
    red: bool


def _row_strides(shape):
    st, s = [], 1
    for n in reversed(shape):
        st.append(s)
        s *= n
    return list(reversed(st))


def _axes(shape, reduced, flat_index: bool) -> List[_Ax]:
    """The input's axes in order, merged where contiguous in input, output and index."""
    xs = _row_strides(shape)
    kept_shape = [n for i, n in enumerate(shape) if i not in reduced]
    ks = _row_strides(kept_shape)
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


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= int(x)
    return p


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


def _plan(free: List[_Ax], fb: int):
    """(split index, chunk): axes before the split are looped, the split axis chunked, the rest in the tile."""
    for idx in range(len(free)):
        suffix = _prod(a.n for a in free[idx + 1:])
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
                    out_int: bool = False, int_bound: float = None) -> None:
    """Emit a reduction of ``x_t`` (contiguous, ``shape``) over the axes ``reduced`` into ``out_t``.

    ``alu``: VectorE reduce op (add, multiply, max, min, logical_or); ``mode``: ``"reduce"``, ``"argmax"``
    or ``"argmin"`` (then ``reduced`` is every axis for a flat index, or one axis); ``out_int``: write
    through :func:`tn.lower.shape.store_int` (int64 outputs); ``int_bound``: integer inputs (int32, or int64 by
    their low words) are range-checked against it (:func:`tn.lower.shape.load_checked_int`).
    """
    prog = ctx.prog
    arg = mode != "reduce"
    flat = arg and len(reduced) == len(shape) and len(shape) > 1
    axes = _axes(tuple(shape), set(reduced), flat)
    if arg and _prod(shape[i] for i in reduced) >= _EXACT:
        raise CannotLower(f"{mode} over {_prod(shape[i] for i in reduced)} elements: indices beyond 2^24 are "
                          f"not exact on the fp32 engines")
    case, parts = _parts(axes)
    esize = 4 if x_dt in ("float32", "int32") else (2 if x_dt in ("bfloat16", "float16") else 1)
    fb = max(1, min(FREE_BUDGET_BYTES // max(esize, 4), 8192))
    if int_bound is not None:
        fb = max(1, fb // 2)  # the range check needs three more tiles of the same shape
    idx, c = _plan(parts[0][3], fb)
    kept_loops = _loops(parts[0][3], idx, c, red=False)
    pax0 = parts[0][2]
    if case == "K":
        kept_loops = [[(p0 * pax0.xs, p0 * pax0.os, 0, ("P", min(128, pax0.n - p0)))
                       for p0 in range(0, pax0.n, 128)]] + kept_loops
    pacc = 128 if case == "K" else max(p[2].n for p in parts)
    pacc = min(pacc, pax0.n) if case == "K" else pacc
    tile_ax = parts[0][3][idx:]
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
        acc = prog.sbuf((pacc if case == "R" else pc, *kshape), "float32")
        prog.memset(acc, _IDENTITY[alu] if not arg else (-math.inf if mode == "argmax" else math.inf),
                    engine="vector")
        acc_i = None
        if arg:
            acc_i = prog.sbuf((acc.shape[0], *kshape), "float32")
            prog.memset(acc_i, 0.0, engine="vector")
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
                part = prog.sbuf((ppc, *kshape), "float32")
                prog.tensor_reduce(part.reshape(ppc, *[t[0] for t in tdims if not t[3]]) if kax else part,
                                   view, "max" if mode == "argmax" else ("min" if mode == "argmin" else alu),
                                   axis=raxes)
                a_slice = acc[:ppc]
                if not arg:
                    prog.tensor_tensor(a_slice, a_slice, part, alu)
                else:
                    _arg_chunk(prog, mode, tile, view, tdims, kax, rax, part, a_slice, acc_i[:ppc],
                               base=ioff + di_r + (0 if case == "K" else 0), cm=(pax.im if case == "R" else 0),
                               ppc=ppc, kshape=kshape)
                for t in lag:          # free the previous chunk's buffers now: the next load uses other memory
                    prog.free(t)
                lag = [part, tile]
        # finalize
        if case == "K":
            dst = hview(out_t, do_k, [(pc, pax0.os)] + (kept_tile or [(1, 1)]))
            res = acc_i if arg else acc
        else:
            dst = hview(out_t, do_k, [(1, 0)] + (kept_tile or [(1, 1)]))
            res = prog.sbuf((1, *kshape), "float32")
            if not arg:
                prog.partition_reduce(res, acc, alu)
            else:
                g = prog.sbuf(acc.shape, "float32")
                prog.partition_reduce(g, acc, "max" if mode == "argmax" else "min")
                prog.tensor_tensor(g, acc, g, "is_equal")
                prog.tensor_scalar(g, g, "subtract", 1.0, "multiply", -_BIG)
                prog.tensor_tensor(g, g, acc_i, "add")
                prog.partition_reduce(res, g, "min")
                prog.free(g)
        if out_int:
            store_int(ctx, dst, res, nonneg=arg)
        else:
            ctx.store(dst, res)
        if res is not acc and res is not acc_i:
            prog.free(res)
        if acc_i is not None:
            prog.free(acc_i)
        prog.free(acc)
    for t in lag:
        prog.free(t)


def _arg_chunk(prog, mode, tile, view, tdims, kax, rax, m, acc_v, acc_i, base, cm, ppc, kshape):
    """Fold one chunk's (extreme value ``m``, first index) into the running (acc_v, acc_i) pair."""
    tshape = [t[0] for t in tdims]
    ids = prog.sbuf((ppc, *tshape), "float32")
    prog.iota(ids, base=base, channel_multiplier=cm, pattern=[t[2] if t[3] else 0 for t in tdims])
    idv = ids.permute(0, *kax, *rax)
    eq = prog.sbuf((ppc, *[tshape[a - 1] for a in kax], *[tshape[a - 1] for a in rax]), "float32")
    kept_n = [tshape[a - 1] for a in kax]
    red_n = [tshape[a - 1] for a in rax]
    mview = m.reshape(ppc, *kept_n, *[1] * len(red_n)) if kept_n else m.reshape(ppc, *[1] * len(red_n))
    mb = mview.broadcast_to((ppc, *kept_n, *red_n))
    prog.tensor_tensor(eq, view, mb, "is_equal")
    prog.tensor_scalar(eq, eq, "subtract", 1.0, "multiply", -_BIG)   # 0 where equal, BIG elsewhere
    prog.tensor_tensor(eq, eq, idv, "add")
    ci = prog.sbuf((ppc, *kshape), "float32")
    raxes = tuple(range(1 + len(kax), 1 + len(kax) + len(rax)))
    prog.tensor_reduce(ci.reshape(ppc, *kept_n) if kept_n else ci, eq, "min", axis=raxes)
    upd = prog.sbuf((ppc, *kshape), "float32")
    prog.tensor_tensor(upd, m, acc_v, "is_gt" if mode == "argmax" else "is_lt")
    prog.tensor_tensor(acc_v, acc_v, m, "max" if mode == "argmax" else "min")
    prog.select(acc_i, upd, ci, acc_i)
    prog.free(upd)
    prog.free(ci)
    prog.free(eq)
    prog.free(ids)


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
    count = _prod(shape[d] for d in dims)
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
    reduce_lowering(ctx, ins[0], x_dt, shape, dims, outs[0], REDUCE_ALU[name],
                    out_int=(out_dt == "int64"), int_bound=bound)


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
    st = _row_strides(shape)
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
        nfree = _prod(tshape)
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
    """Sort every line of ``x_t`` along axis ``d`` (stable), writing the first ``k`` values and indices.

    Per line: the line is broadcast to all partitions; each element's rank (elements before it in the
    order, ties broken by index) comes from one compare + one masked compare + a reduce per 128 elements;
    the ranks go through HBM scratch to be broadcast in turn, and output slot ``r`` selects the element
    whose rank is ``r`` (``select`` + ``add`` reduce, exact for any value but NaN).
    """
    prog = ctx.prog
    n = shape[d]
    st = _row_strides(shape)
    sd = st[d]
    others = [i for i in range(len(shape)) if i != d]
    ost = _row_strides(tuple(k if i == d else shape[i] for i in range(len(shape))))
    if 5 * n * 4 > ctx.arch.sbuf_partition_bytes - 24 * 1024:
        raise CannotLower(f"sort/topk of lines of {n} elements: five [128, {n}] fp32 tiles do not fit in SBUF")
    if n >= _EXACT:
        raise CannotLower("sort/topk: ranks beyond 2**24 are not exact on the fp32 engines")
    row = prog.sbuf((128, n), x_dt)
    rf = prog.sbuf((128, n), "float32")
    ids = prog.sbuf((128, n), "float32")
    prog.iota(ids, pattern=[1])
    zero = prog.sbuf((128, 1), "float32")
    prog.memset(zero, 0.0, engine="vector")
    ranks = ctx.scratch((n,), "float32")
    rk = prog.sbuf((128, n), "float32")
    cmp_op = "is_gt" if descending else "is_lt"
    for li in itertools.product(*[range(shape[i]) for i in others]):
        xoff = sum(i * st[a] for i, a in zip(li, others))
        ooff = sum(i * ost[a] for i, a in zip(li, others))
        prog.dma_copy(row, hview(x_t, xoff, [(128, 0), (n, sd)]))
        prog.tensor_copy(rf, row)
        for c0 in range(0, n, 128):
            pc = min(128, n - c0)
            xc = prog.sbuf((pc, 1), x_dt)       # x[c0 + p] on partition p
            prog.dma_copy(xc, hview(x_t, xoff + c0 * sd, [(pc, sd), (1, 1)]))
            xcf = prog.sbuf((pc, 1), "float32")
            prog.tensor_copy(xcf, xc)
            lt = prog.sbuf((pc, n), "float32")
            eq = prog.sbuf((pc, n), "float32")
            prog.tensor_scalar(lt, rf[:pc], cmp_op, xcf)
            prog.tensor_scalar(eq, rf[:pc], "is_equal", xcf)
            prog.affine_select(eq, eq, cmp="is_gt", base=c0, channel_multiplier=1, pattern=[-1], fill=0.0)
            prog.tensor_tensor(lt, lt, eq, "add")
            r = prog.sbuf((pc, 1), "float32")
            prog.tensor_reduce(r, lt, "add")
            prog.dma_copy(hview(ranks, c0, [(pc, 1), (1, 1)]), r)
            for t in (r, eq, lt, xcf, xc):
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
            ctx.store(hview(out_v, ooff + r0 * ost[d], [(pc, ost[d]), (1, 1)]), v)
            prog.select(sel, m, ids[:pc], zb)
            ix = prog.sbuf((pc, 1), "float32")
            prog.tensor_reduce(ix, sel, "add")
            store_int(ctx, hview(out_i, ooff + r0 * ost[d], [(pc, ost[d]), (1, 1)]), ix, nonneg=True)
            for t in (ix, v, sel, m, want):
                prog.free(t)
    for t in (rk, zero, ids, rf, row):
        prog.free(t)


def _sortable(ctx, eqn) -> str:
    x_dt = _in_dtype(ctx, eqn)
    if x_dt not in ("float32", "bfloat16", "float16"):
        raise CannotLower(f"{eqn.op.name} of {x_dt}: the comparison sort runs on float values")
    if ctx.neuron_dtype(eqn.outputs[1].dtype) != "int64":
        raise CannotLower(f"{eqn.op.name} with {eqn.outputs[1].dtype} indices")
    return x_dt


@lowering("sort")
def _sort(ctx, eqn, ins, outs):
    """Stable sort along ``dim`` (values and int64 indices) by per-element ranks (NaN not ordered)."""
    x_dt = _sortable(ctx, eqn)
    xv = eqn.inputs[0]
    shape = tuple(xv.shape) or (1,)
    d = eqn.attrs.get("dim", -1) if xv.shape else 0
    d = d % len(shape)
    _sort_lines(ctx, eqn, ins[0], x_dt, shape, d, bool(eqn.attrs.get("descending", False)), shape[d],
                outs[0], outs[1])


@lowering("topk")
def _topk(ctx, eqn, ins, outs):
    """The ``k`` largest (smallest) elements along ``dim`` in sorted order, with their int64 indices."""
    x_dt = _sortable(ctx, eqn)
    xv = eqn.inputs[0]
    shape = tuple(xv.shape) or (1,)
    d = eqn.attrs.get("dim", -1) if xv.shape else 0
    d = d % len(shape)
    k = int(eqn.attrs["k"])
    if k == 0:
        return
    if not eqn.attrs.get("sorted", True):
        raise CannotLower("topk with sorted=False (torch's order of the unsorted result is not specified)")
    _sort_lines(ctx, eqn, ins[0], x_dt, shape, d, bool(eqn.attrs.get("largest", True)), k, outs[0], outs[1])
