# Lowerings of the index ops (gather, index/embedding, index_put, scatter, scatter_add, scatter_reduce) with indirect DMA and masked reductions.
"""Indexing on the NeuronCore.

Reads (``gather``, ``index``: embedding lookups, ``x[idx]``, ``x[:, idx]``,
``x[i, j]`` ...) are *row gathers* with the indirect DMA ``dma_gather``: the
input is viewed as a table of rows (the contiguous block after the last
indexed axis; one element for ``gather``), and every output row's table row
is computed on chip: ``row = base + sum_j idx_j * w_j`` where ``base`` comes
from ``iota`` over the output grid (the non-indexed axes) and the index
tensors are DMAed in with the output grid's access pattern (stride 0 where
they broadcast). Row numbers are relative to each tile's first row (the
table view starts there), so they stay exact in fp32 for tables of any size.
Negative indices wrap (``index``); a point whose index lies outside its axis
gets row -1, so the DMA engine's bounds check raises. int64 indices are read
through their low int32 words.

Writes use the indirect-write DMA ``dma_scatter`` when the NeuronCore has it
(``index_put``; ``scatter`` and ``scatter_add`` element by element: replace
with the last write winning, or add in fp32). Without it they are computed,
not scattered (and ``scatter_reduce`` always is):

* ``index_put`` (rows of ``x`` replaced or accumulated): ``out = x + onehot^T
  @ values`` on TensorE, the one-hot ``[E, rows]`` blocks built with one
  ``tensor_scalar(is_equal)`` against an iota; for replacement ``out = x *
  (1 - hit) + onehot^T @ values``, and duplicate targets keep the last write
  (as torch's CPU kernel does): earlier duplicates are masked out first.
* ``scatter``, ``scatter_add``, ``scatter_reduce`` (element-wise along one
  axis): each line (fixed other coordinates) is a masked reduction on
  VectorE: ``out[j] = reduce_e (idx[e] == j ? src[e] : identity)``, lines on
  the partitions.
"""
from __future__ import annotations

from typing import Any, List, Tuple

from .. import ops
from ..neuron import isa
from ..shapes import contiguous_strides, numel
from .base import CannotLower, lowering
from .shape import FREE_BUDGET_BYTES, _merge, _parts, _tiles, copy_view, hview, split_rows

__all__ = ["row_gather"]

_EXACT = 1 << 24


def _idx_view(t, dt, offset, dims):
    """HBM view of an index tensor with an explicit pattern; int64 tensors are read by their low words."""
    if dt == "int64":
        return hview(t, 2 * offset, [(n, 2 * s) for n, s in dims], dtype="int32")
    return hview(t, offset, dims)


def _index_dtype(ctx, v) -> str:
    dt = ctx.neuron_dtype(v.dtype)
    if dt not in ("int32", "int64"):
        raise CannotLower(f"index tensors of dtype {dt} (use int64/int32 indices; boolean masks are decomposed "
                          f"by the tracer)")
    return dt


def _row_index_tile(ctx, pc, tshape, cm, base, wpat, idxs, idx_offs, pstr, tstr):
    """int32 tile of table rows: ``base + cm*p + sum pattern`` plus ``sum_j wrap(idx_j) * w_j``; a point whose
    index lies outside its axis gets row -1 (the gather's bounds check then raises)."""
    prog = ctx.prog
    flat = prog.sbuf((pc, *tshape), "int32")
    prog.iota(flat, base=base, channel_multiplier=cm, pattern=wpat)
    bad = prog.sbuf((pc, *tshape), "float32")
    prog.memset(bad, 0.0, engine="vector")
    for j, (t, dt, w, n, wrap) in enumerate(idxs):
        v = prog.sbuf((pc, *tshape), "int32")
        prog.dma_copy(v, _idx_view(t, dt, idx_offs[j], [(pc, pstr[j])] + [(m, s[j]) for m, s in tstr]))
        tmp = prog.sbuf((pc, *tshape), "float32")
        if wrap:
            prog.tensor_scalar(tmp, v, "is_lt", 0.0, "multiply", float(n))
            prog.tensor_tensor(v, v, tmp, "add")
        prog.tensor_scalar(tmp, v, "is_ge", float(n))
        prog.tensor_tensor(bad, bad, tmp, "max")
        prog.tensor_scalar(tmp, v, "is_lt", 0.0)
        prog.tensor_tensor(bad, bad, tmp, "max")
        prog.tensor_scalar(v, v, "multiply", float(w))
        prog.tensor_tensor(flat, flat, v, "add")
        prog.free(tmp)
        prog.free(v)
    keep = prog.sbuf((pc, *tshape), "float32")
    prog.tensor_scalar(keep, bad, "multiply", -1.0, "add", 1.0)
    prog.tensor_tensor(flat, flat, keep, "multiply")      # bad points: 0 ...
    prog.tensor_tensor(flat, flat, bad, "subtract")       # ... then -1
    prog.free(keep)
    prog.free(bad)
    return flat


def _partition_axis_first(axes: List[Tuple[int, tuple]]) -> List[Tuple[int, tuple]]:
    """The grid axes with the one that needs the fewest ``dma_gather`` (``dma_scatter``) instructions moved
    first (the partition axis): one instruction moves one row per partition, so a grid ``[2, 3, 1320]`` (a 2-batch
    3-channel sampling grid) gathered over partitions of its first axis took 1320 * 3 instructions of 2 rows
    each; over its last, 66 of up to 128. Unchanged unless another axis strictly needs fewer."""
    if len(axes) < 2:
        return axes
    total = numel([n for n, _ in axes])

    def cost(j):
        n = axes[j][0]
        return -(-n // 128) * (total // n)

    best = min(range(len(axes)), key=lambda j: (cost(j), j))
    if cost(best) >= cost(0):
        return axes
    return [axes[best]] + axes[:best] + axes[best + 1:]


def row_gather(ctx: Any, x_t: Any, x_dt: str, x_numel: int, rin: int, out_t: Any, grid: List[Tuple[int, tuple]],
               idxs: List[tuple], publish: Any = None) -> None:
    """Gather rows of ``rin`` elements from ``x_t`` into ``out_t`` (the grid's rows, row-major).

    ``grid``: output axes ``(n, (out_row_stride, base_weight, idx_stride_0, ...))``; ``idxs``: ``(tensor,
    dtype, weight, axis_size, wrap_negative)`` per index tensor. Row of grid point g:
    ``sum_k g_k * base_weight_k + sum_j wrap(idx_j[g]) * weight_j``.
    ``publish``: the output Var the compiler asked to leave in SBUF (``ctx.wants``): when every output row
    is one partition of a single tile (<= 128 rows, one grid point per partition, whole rows in the free
    budget) the rows are gathered into that tile and handed off (``ctx.publish``), not stored.
    """
    prog = ctx.prog
    nrows = x_numel // rin
    nstr = 2 + len(idxs)
    idx_span = sum((n - 1) * w for _, _, w, n, _ in idxs)
    axes = _merge(grid)
    esize = 8 if x_dt == "int64" else (4 if x_dt in ("float32", "int32") else (2 if x_dt in ("bfloat16", "float16")
                                                                              else 1))
    rch = min(rin, max(1, FREE_BUDGET_BYTES // esize))
    fb = max(1, min(512, FREE_BUDGET_BYTES // (esize * rch)))
    axes = _partition_axis_first(axes)
    parts = _parts(axes, nstr)

    def reach(pc, ps, free):
        """Rows one part can touch (conservative)."""
        return (pc - 1) * ps[1] + sum((n - 1) * st[1] for n, st in free) + idx_span + 1

    if any(reach(pc, ps, free) >= _EXACT for _, (pc, ps), free in parts) and axes:
        # whole-axis partition splits reach too far: 128 consecutive grid points per part instead
        n0, s0 = axes[0]
        parts = [(tuple(p0 * st for st in s0), (min(128, n0 - p0), s0), axes[1:]) for p0 in range(0, n0, 128)]
    if publish is not None and len(parts) == 1 and rch == rin:
        _, (pc, ps), free = parts[0]
        if not (pc == numel([n for n, _ in grid]) and ps[0] == 1 and not free and pc <= 128):
            publish = None
    else:
        publish = None
    for poff, (pc, ps), free in parts:
        for toff, tax in _tiles(free, fb, nstr):
            off = tuple(a + b for a, b in zip(poff, toff))
            tshape = [n for n, _ in tax]
            F = numel(tshape)
            # row numbers relative to this tile's first row: small enough to be exact in fp32 for any table
            b0 = off[1]
            span = (pc - 1) * ps[1] + sum((n - 1) * s[1] for n, s in tax) + idx_span + 1
            if span >= _EXACT:
                raise CannotLower(f"gather: one tile reaches over {span} rows; row numbers beyond 2^24 are not "
                                  f"exact on the fp32 engines")
            flat = _row_index_tile(ctx, pc, tshape, ps[1], 0, [s[1] for _, s in tax], idxs, off[2:],
                                   ps[2:], [(n, s[2:]) for n, s in tax])
            flat2 = flat.reshape(pc, F)
            for r0 in range(0, rin, rch):
                rc = min(rch, rin - r0)
                ot = prog.sbuf((pc, F, rc), x_dt)
                table = hview(x_t, b0 * rin + r0, [(min(nrows - b0, span), rin), (rc, 1)])
                for f in range(F):
                    prog.dma_gather(ot[:, f, :], table, flat2[:, f:f + 1])
                if publish is not None:       # the one tile holds every row: hand it off, no store
                    ctx.publish(publish, ot.reshape(pc, rc))
                    continue
                dst = hview(out_t, off[0] * rin + r0, [(pc, ps[0] * rin)] + [(n, s[0] * rin) for n, s in tax]
                            + [(rc, 1)])
                prog.dma_copy(dst, ot.reshape(pc, *tshape, rc))
                prog.free(ot)
            prog.free(flat)


def _vars_ok(ctx, eqn):
    for v in eqn.inputs:
        if hasattr(v, "value"):
            raise CannotLower(f"{eqn.op.name} with a literal operand")
    return ctx.neuron_dtype(eqn.inputs[0].dtype)


@lowering("gather")
def _gather(ctx, eqn, ins, outs):
    """``out[g] = x[g with axis dim replaced by index[g]]``: element gathers with computed flat offsets."""
    x_dt = _vars_ok(ctx, eqn)
    xv, iv = eqn.inputs[0], eqn.inputs[1]
    i_dt = _index_dtype(ctx, iv)
    X = tuple(xv.shape) or (1,)
    I = tuple(iv.shape) or (1,)
    d = eqn.attrs["dim"] if xv.shape else 0
    if numel(I) == 0:
        return
    xs = contiguous_strides(X)
    ist = contiguous_strides(I)
    grid = [(n, (ist[k], 0 if k == d else xs[k], ist[k])) for k, n in enumerate(I)]
    row_gather(ctx, ins[0], x_dt, numel(X), 1, outs[0], grid, [(ins[1], i_dt, xs[d], X[d], False)])


def _bcast_strides(shape, target):
    """Row-major strides of ``shape`` broadcast (right-aligned) to ``target`` (0 where broadcast)."""
    st = contiguous_strides(shape)
    lead = len(target) - len(shape)
    out = [0] * lead
    for n, s, m in zip(shape, st, target[lead:]):
        out.append(s if n == m else 0)
    return out


def _index_layout(X, dims, idx_shapes):
    """(B, grid shape, pre axes, rin, adjacent) of advanced indexing ``x[..idx..]`` on axes ``dims``."""
    B = ()
    for s in idx_shapes:
        B = _broadcast_shapes(B, tuple(s))
    last = max(dims)
    rin = numel(X[last + 1:])
    adjacent = list(dims) == list(range(dims[0], dims[0] + len(dims)))
    pre = [k for k in range(last) if k not in dims]
    return B, pre, rin, adjacent


def _broadcast_shapes(a, b):
    n = max(len(a), len(b))
    a = (1,) * (n - len(a)) + a
    b = (1,) * (n - len(b)) + b
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            raise CannotLower(f"index tensors of shapes {a} and {b} do not broadcast")
        out.append(max(x, y))
    return tuple(out)


def _index_grid(X, dims, idx_shapes):
    """Grid axes ``(n, (out_row_stride, base_weight, idx strides...))`` and weights of advanced indexing."""
    B, pre, rin, adjacent = _index_layout(X, dims, idx_shapes)
    xs = contiguous_strides(X)
    bstr = [_bcast_strides(tuple(s), B) for s in idx_shapes]
    axes = []  # (n, base_weight_rows, [idx strides])
    pre_ax = [(X[k], xs[k] // rin, [0] * len(idx_shapes)) for k in pre]
    b_ax = [(n, 0, [bs[i] for bs in bstr]) for i, n in enumerate(B)]
    axes = (pre_ax + b_ax) if adjacent else (b_ax + pre_ax)
    gshape = [n for n, _, _ in axes]
    gst = contiguous_strides(gshape)
    grid = [(n, (gst[i], w, *st)) for i, (n, w, st) in enumerate(axes)]
    weights = [xs[d] // rin for d in dims]
    return grid, weights, rin, gshape


@lowering("index")
def _index(ctx, eqn, ins, outs):
    """Advanced indexing (embedding lookups, ``x[:, idx]``, ``x[i, j]``): row gathers by indirect DMA."""
    x_dt = _vars_ok(ctx, eqn)
    xv = eqn.inputs[0]
    dims = tuple(eqn.attrs["dims"])
    if not xv.shape or not dims:
        raise CannotLower("index of a 0-d tensor or without index tensors")
    X = tuple(xv.shape)
    ivs = eqn.inputs[1:]
    idts = [_index_dtype(ctx, v) for v in ivs]
    if numel(eqn.outputs[0].shape) == 0:
        return
    grid, weights, rin, _ = _index_grid(X, dims, [tuple(v.shape) for v in ivs])
    idxs = [(t, dt, w, X[d], True) for t, dt, w, d in zip(ins[1:], idts, weights, dims)]
    out = eqn.outputs[0]
    row_gather(ctx, ins[0], x_dt, numel(X), rin, outs[0], grid, idxs, publish=out if ctx.wants(out) else None)


# --------------------------------------------------------------------------- index_put (one-hot matmul)

_MM_DTYPES = ("float32", "bfloat16", "float16")


@lowering("index_put")
def _index_put(ctx, eqn, ins, outs):
    """``out = x`` with rows ``x[idx...]`` replaced (last write wins) or accumulated: one-hot matmuls on TensorE."""
    prog = ctx.prog
    x_dt = _vars_ok(ctx, eqn)
    xv, vv = eqn.inputs[0], eqn.inputs[1]
    if ctx.neuron_dtype(vv.dtype) != x_dt:
        raise CannotLower("index_put with values of another dtype than x")
    dims = tuple(eqn.attrs["dims"])
    accumulate = bool(eqn.attrs.get("accumulate", False))
    if len(eqn.inputs) == 3 and dims == (0,) and xv.shape and \
            ctx.neuron_dtype(eqn.inputs[2].dtype) in ("bool", "uint8"):
        _index_put_mask(ctx, eqn, ins, outs, accumulate)
        return
    scatter_dma = hasattr(prog, "dma_scatter") and (x_dt in _MM_DTYPES or not accumulate)
    if x_dt not in _MM_DTYPES and not scatter_dma:
        raise CannotLower(f"index_put on {x_dt}: the one-hot matmul runs on fp32/bf16/fp16 only")
    if not xv.shape or not dims:
        raise CannotLower("index_put on a 0-d tensor or without index tensors")
    X = tuple(xv.shape)
    ivs = eqn.inputs[2:]
    idts = [_index_dtype(ctx, v) for v in ivs]
    grid, weights, rin, gshape = _index_grid(X, dims, [tuple(v.shape) for v in ivs])
    nrows = numel(X) // rin
    E = numel(gshape)
    if nrows >= _EXACT:
        raise CannotLower(f"index_put into {nrows} rows: row numbers beyond 2^24 are not exact on fp32 engines")
    # values broadcast to the indexed shape (grid + inner)
    vshape = tuple(vv.shape)
    target = tuple(gshape) + tuple(X[max(dims) + 1:])
    try:
        _broadcast_shapes(vshape, target)
    except CannotLower:
        raise CannotLower(f"index_put values of shape {vshape} do not broadcast to {target}") from None
    vst = _bcast_strides(vshape, target) if len(vshape) <= len(target) else None
    if vst is None:
        raise CannotLower(f"index_put values of shape {vshape} have more axes than {target}")
    vg, vin = vst[:len(gshape)], vst[len(gshape):]
    inner_m = _merge([(n, (s,)) for n, s in zip(X[max(dims) + 1:], vin)])
    if len(inner_m) > 1 or (inner_m and inner_m[0][1][0] not in (0, 1)):
        raise CannotLower("index_put values broadcast inside a row in a pattern the matmul cannot read")
    v_in_stride = inner_m[0][1][0] if inner_m else 1
    grid_v = [(n, st + (vg_k,)) for (n, st), vg_k in zip(grid, vg)]
    idxs = [(t, dt, w, X[d], True) for t, dt, w, d in zip(ins[2:], idts, weights, dims)]
    nstr = 3 + len(idxs)
    # K-chunks of grid points (one point per partition)
    chunks = []
    for poff, (pc, ps), free in _parts(_merge(grid_v), nstr):
        for toff, tax in _tiles(free, 1, nstr):
            chunks.append((pc, ps, tuple(a + b for a, b in zip(poff, toff))))
    nk = len(chunks)
    if scatter_dma:
        _index_put_scatter(ctx, ins, outs, X, x_dt, rin, nrows, chunks, idxs, v_in_stride, accumulate)
        return
    nrb = -(-nrows // 128)
    esize = 4 if x_dt == "float32" else 2
    rc_max = max(1, min(512, (64 * 1024) // (nk * esize)))
    nrc = -(-rin // rc_max)
    if nk * nrb * nrc > 16384 or E > 16384:
        raise CannotLower(f"index_put of {E} rows into {nrows} rows needs too many one-hot matmuls")
    # row numbers (fp32, [pc, 1]) and keep masks per chunk
    trows, keeps = [], []
    tscr = None if accumulate else ctx.scratch((E,), "float32")
    for k, (pc, ps, off) in enumerate(chunks):
        flat = _row_index_tile(ctx, pc, [1], ps[1], off[1], [0], idxs, off[2:2 + len(idxs)], ps[2:2 + len(idxs)],
                               [(1, (0,) * len(idxs))])
        # the dma_gather bounds check of out-of-axis indices: gather one element per point (discarded)
        probe = prog.sbuf((pc, 1), x_dt)
        prog.dma_gather(probe, hview(ins[0], 0, [(nrows, rin), (1, 1)]), flat)
        prog.free(probe)
        tf = prog.sbuf((pc, 1), "float32")
        prog.tensor_copy(tf, flat)
        prog.free(flat)
        trows.append(tf)
        if tscr is not None:
            prog.dma_copy(hview(tscr, off[0], [(pc, ps[0]), (1, 1)]), tf)
    if not accumulate:
        if E > 8192:
            raise CannotLower("index_put (replace) with more than 8192 index points")
        for k, (pc, ps, off) in enumerate(chunks):
            allt = prog.sbuf((pc, E), "float32")
            prog.dma_copy(allt, hview(tscr, 0, [(pc, 0), (E, 1)]))
            prog.tensor_tensor(allt, allt, trows[k].broadcast_to((pc, E)), "is_equal")
            # later grid points only: g' > off[0] + p
            prog.affine_select(allt, allt, cmp="is_gt", base=-off[0], channel_multiplier=-ps[0] if pc > 1 else 0,
                               pattern=[1], fill=0.0)
            kp = prog.sbuf((pc, 1), "float32")
            prog.tensor_reduce(kp, allt, "max")
            prog.tensor_scalar(kp, kp, "multiply", -1.0, "add", 1.0)
            prog.free(allt)
            keeps.append(kp)
    ones = prog.sbuf((128, 1), x_dt)
    prog.memset(ones, 1.0)
    for r0 in range(0, rin, rc_max):
        rc = min(rc_max, rin - r0)
        vt = []
        for pc, ps, off in chunks:
            t = prog.sbuf((pc, rc), x_dt)
            prog.dma_copy(t, hview(ins[1], off[-1] + r0 * v_in_stride,
                                   [(pc, ps[-1]), (rc, v_in_stride)]))
            vt.append(t)
        for rb in range(nrb):
            mb = min(128, nrows - 128 * rb)
            rows = prog.sbuf((128, mb), "float32")
            prog.iota(rows, base=128 * rb, pattern=[1])
            ps_acc = prog.psum((mb, rc), "float32")
            hit = prog.psum((mb, 1), "float32") if not accumulate else None
            for k, (pc, _, _) in enumerate(chunks):
                oh = prog.sbuf((pc, mb), x_dt)
                if accumulate:
                    prog.tensor_scalar(oh, rows[:pc], "is_equal", trows[k])
                else:
                    prog.tensor_scalar(oh, rows[:pc], "is_equal", trows[k], "multiply", keeps[k])
                prog.matmul(ps_acc, oh, vt[k], accumulate=k > 0, stop=k == nk - 1)
                if hit is not None:
                    prog.matmul(hit, oh, ones[:pc], accumulate=k > 0, stop=k == nk - 1)
                prog.free(oh)
            xt = prog.sbuf((mb, rc), x_dt)
            prog.dma_copy(xt, hview(ins[0], 128 * rb * rin + r0, [(mb, rin), (rc, 1)]))
            res = prog.sbuf((mb, rc), "float32")
            if accumulate:
                prog.tensor_tensor(res, ps_acc, xt, "add")
            else:
                pred = prog.sbuf((mb, 1), "float32")
                prog.tensor_scalar(pred, hit, "is_gt", 0.5)
                prog.tensor_copy(res, xt)
                prog.select(res, pred.broadcast_to((mb, rc)), ps_acc, res)
                prog.free(pred)
            ctx.store(hview(outs[0], 128 * rb * rin + r0, [(mb, rin), (rc, 1)]), res)
            prog.free(res)
            prog.free(xt)
            if hit is not None:
                prog.free(hit)
            prog.free(ps_acc)
            prog.free(rows)
        for t in vt:
            prog.free(t)
    prog.free(ones)
    for t in trows + keeps:
        prog.free(t)


# --------------------------------------------------------------------------- scatter family (masked reductions)

#: scatter_reduce's ``reduce`` modes -> the reduction op combining a row's values (a mean is a sum, then divided);
#: the op's ``reduce_alu``/``reduce_identity`` are the VectorE op and the accumulator's start value
_SCATTER_REDUCTION = {"sum": ops.get("sum"), "mean": ops.get("sum"), "prod": ops.get("prod"), "amax": ops.get("amax"),
                      "amin": ops.get("amin")}
_LINE_BUDGET = 4096


def _scatter_by_dma(ctx, eqn, ins, outs, mode, include_self, x_dt) -> bool:
    """scatter / scatter_add by the indirect-write DMA (``Program.dma_scatter``) when the NeuronCore has it:
    ``out = x``, then element ``e`` of ``src`` goes to the flat position ``base(e) + index[e] * stride(dim)``
    (replaced, or added in fp32). Returns False (nothing emitted) when this path does not apply."""
    prog = ctx.prog
    xv, iv, sv = eqn.inputs[0], eqn.inputs[1], eqn.inputs[2]
    scalar_src = hasattr(sv, "value")
    if not hasattr(prog, "dma_scatter") or not (mode == "set" or (mode == "sum" and include_self)):
        return False
    if mode == "sum" and x_dt not in _MM_DTYPES:
        return False
    if scalar_src and x_dt == "int64":
        return False
    if not scalar_src and ctx.neuron_dtype(sv.dtype) != x_dt:
        return False
    X = tuple(xv.shape) or (1,)
    I = tuple(iv.shape) or (1,)
    total = numel(X)
    if total >= _EXACT or numel(I) == 0:
        return False
    i_dt = _index_dtype(ctx, iv)
    d = eqn.attrs["dim"] if xv.shape else 0
    xs, ist = contiguous_strides(X), contiguous_strides(I)
    sst = contiguous_strides(tuple(sv.shape) or (1,)) if not scalar_src else [0] * len(I)
    copy_view(ctx, hview(outs[0], 0, [(total, 1)]), hview(ins[0], 0, [(total, 1)]))
    # grid over the index tensor: (n, (unused, base weight, index stride, src stride))
    grid = [(nk, (0, 0 if k == d else xs[k], ist[k], sst[k])) for k, nk in enumerate(I)]
    idxs = [(ins[1], i_dt, xs[d], X[d], False)]
    table = hview(outs[0], 0, [(total, 1), (1, 1)])
    cval = None
    if scalar_src:
        cval = prog.sbuf((128, 1), x_dt)
        prog.memset(cval, float(sv.value), engine="vector")
    axes = _merge(grid)
    if mode == "sum":   # (replacing keeps its order: which duplicate wins must not change)
        axes = _partition_axis_first(axes)
    for poff, (pc, ps), free in _parts(axes, 4):
        for toff, tax in _tiles(free, 512, 4):
            off = tuple(a + b for a, b in zip(poff, toff))
            tshape = [k for k, _ in tax]
            F = numel(tshape)
            flat = _row_index_tile(ctx, pc, tshape, ps[1], off[1], [st[1] for _, st in tax], idxs, off[2:3],
                                   ps[2:3], [(k, st[2:3]) for k, st in tax])
            flat2 = flat.reshape(pc, F)
            if scalar_src:
                src2 = None
            else:
                st_ = prog.sbuf((pc, *tshape), x_dt)
                prog.dma_copy(st_, hview(ins[2], off[3], [(pc, ps[3])] + [(k, st[3]) for k, st in tax]))
                src2 = st_.reshape(pc, F)
            for f in range(F):
                prog.dma_scatter(table, cval[:pc] if scalar_src else src2[:, f:f + 1], flat2[:, f:f + 1],
                                 accumulate=(mode == "sum"))
            if not scalar_src:
                prog.free(st_)
            prog.free(flat)
    if cval is not None:
        prog.free(cval)
    return True


def _scatter_common(ctx, eqn, ins, outs, mode, include_self=True):
    """out = x, then every line (fixed coordinates off the scatter axis) recomputed as a masked reduction.

    ``mode``: ``"set"`` (scatter: the last matching source wins) or a reduce mode of :data:`_SCATTER_REDUCTION`.
    """
    prog = ctx.prog
    xv, iv, sv = eqn.inputs[0], eqn.inputs[1], eqn.inputs[2]
    if hasattr(xv, "value") or hasattr(iv, "value"):
        raise CannotLower(f"{eqn.op.name} with a literal input or index")
    x_dt = ctx.neuron_dtype(xv.dtype)
    if _scatter_by_dma(ctx, eqn, ins, outs, mode, include_self, x_dt):
        return
    if x_dt not in ("float32", "bfloat16", "float16"):
        raise CannotLower(f"{eqn.op.name} on {x_dt}: the masked reductions compute in fp32 (float dtypes only)")
    i_dt = _index_dtype(ctx, iv)
    scalar_src = hasattr(sv, "value")
    if not scalar_src and ctx.neuron_dtype(sv.dtype) != x_dt:
        raise CannotLower(f"{eqn.op.name} with src of another dtype than x")
    X = tuple(xv.shape) or (1,)
    I = tuple(iv.shape) or (1,)
    d = eqn.attrs["dim"] if xv.shape else 0
    n, m = X[d], I[d]
    # out = x everywhere first; the lines below overwrite their region
    total = numel(X)
    copy_view(ctx, hview(outs[0], 0, [(total, 1)]), hview(ins[0], 0, [(total, 1)]))
    if numel(I) == 0:
        return
    if m > _LINE_BUDGET // 2:
        raise CannotLower(f"{eqn.op.name} with {m} sources per line")
    if n >= _EXACT or m >= _EXACT:
        raise CannotLower(f"{eqn.op.name}: axis too long for exact fp32 positions")
    jc = max(1, min(n, _LINE_BUDGET // m))
    xs = contiguous_strides(X)
    ist = contiguous_strides(I)
    S = (tuple(sv.shape) or (1,)) if not scalar_src else None
    sst = contiguous_strides(S) if S is not None else [0] * len(I)
    lines = [(I[k], (xs[k], ist[k], sst[k])) for k in range(len(I)) if k != d]
    axes = _merge(lines)
    fb = max(1, _LINE_BUDGET // (jc * m))
    # the bounds probe: row 0 of a one-row table where every index is in range, row 1 (outside it: the DMA's
    # index check fails the call) where one is not; a table of all x's rows would pass the DMA's 2^24 row limit
    chk_table = hview(ins[0], 0, [(1, 1), (1, 1)])
    for poff, (pc, ps), free in _parts(axes, 3):
        for toff, tax in _tiles(free, fb, 3):
            if len(tax) > 2:
                raise CannotLower(f"{eqn.op.name}: line grid needs more than 2 free axes")
            off = tuple(a + b for a, b in zip(poff, toff))
            T = [k for k, _ in tax]
            L = numel(T)
            # indices [pc, T, m] (fp32) and their bounds check (one gather per tile; out-of-range -> error)
            it = prog.sbuf((pc, *T, m), "int32")
            prog.dma_copy(it, _idx_view(ins[1], i_dt, off[1], [(pc, ps[1])] + [(k, s[1]) for k, s in tax]
                                        + [(m, ist[d])]))
            idx = prog.sbuf((pc, L, m), "float32")
            prog.tensor_copy(idx, it.reshape(pc, L, m))
            prog.free(it)
            bad = prog.sbuf((pc, L, m), "float32")
            prog.tensor_scalar(bad, idx, "is_ge", float(n))
            t2 = prog.sbuf((pc, L, m), "float32")
            prog.tensor_scalar(t2, idx, "is_lt", 0.0)
            prog.tensor_tensor(bad, bad, t2, "max")
            prog.free(t2)
            flag = prog.sbuf((pc, 1), "float32")
            prog.tensor_reduce(flag, bad.reshape(pc, L * m), "max")
            prog.free(bad)
            fi = prog.sbuf((pc, 1), "int32")
            prog.tensor_copy(fi, flag)
            probe = prog.sbuf((pc, 1), x_dt)
            prog.dma_gather(probe, chk_table, fi)
            prog.free(probe)
            prog.free(fi)
            prog.free(flag)
            # sources [pc, L, m]
            src = None
            if not scalar_src:
                src = prog.sbuf((pc, *T, m), x_dt)
                prog.dma_copy(src, hview(ins[2], off[2], [(pc, ps[2])] + [(k, s[2]) for k, s in tax]
                                         + [(m, sst[d])]))
                srcv = src.reshape(pc, L, 1, m)
            else:
                src = prog.sbuf((pc, 1), "float32")
                prog.memset(src, float(sv.value), engine="vector")
                srcv = src.reshape(pc, 1, 1, 1)
            for j0 in range(0, n, jc):
                jn = min(jc, n - j0)
                shp = (pc, L, jn, m)
                srcb = srcv.broadcast_to(shp)
                mask = prog.sbuf(shp, "float32")
                prog.iota(mask, base=j0, pattern=[0, 1, 0])
                prog.tensor_tensor(mask, mask, idx.reshape(pc, L, 1, m).broadcast_to(shp), "is_equal")
                xt = prog.sbuf((pc, *T, jn), x_dt)
                xdims = [(pc, ps[0])] + [(k, s[0]) for k, s in tax] + [(jn, xs[d])]
                prog.dma_copy(xt, hview(ins[0], off[0] + j0 * xs[d], xdims))
                xf = xt.reshape(pc, L, jn)
                res = prog.sbuf((pc, L, jn), "float32")
                cnt = None
                if mode == "set" or not include_self or mode == "mean":
                    cnt = prog.sbuf((pc, L, jn), "float32")
                    prog.tensor_reduce(cnt, mask, "add")
                val = prog.sbuf(shp, "float32")
                if mode == "set":
                    # last matching source: e* = max_e (mask ? e : -1); value = sum_e (e == e*) * src
                    prog.iota(val, base=1, pattern=[0, 0, 1])
                    prog.tensor_tensor(val, val, mask, "multiply")            # e+1 where matching, else 0
                    last = prog.sbuf((pc, L, jn), "float32")
                    prog.tensor_reduce(last, val, "max")
                    prog.iota(val, base=1, pattern=[0, 0, 1])
                    prog.tensor_tensor(val, val, last.reshape(pc, L, jn, 1).broadcast_to(shp), "is_equal")
                    prog.tensor_tensor(val, val, mask, "multiply")
                    prog.tensor_tensor(mask, val, srcb, "multiply")
                    prog.tensor_reduce(res, mask, "add")
                    prog.free(last)
                else:
                    fill = prog.sbuf((pc, 1), "float32")
                    prog.memset(fill, _SCATTER_REDUCTION[mode].reduce_identity, engine="vector")
                    prog.select(val, mask, srcb, fill.reshape(pc, 1, 1, 1).broadcast_to(shp))
                    prog.free(fill)
                    prog.tensor_reduce(res, val, _SCATTER_REDUCTION[mode].reduce_alu)
                    if mode == "mean":
                        if include_self:
                            prog.tensor_tensor(res, res, xf, "add")
                            prog.tensor_scalar(cnt, cnt, "add", 1.0)
                        else:
                            prog.tensor_scalar(cnt, cnt, "max", 1.0)  # divide by max(count, 1)
                        prog.tensor_tensor(res, res, cnt, "divide")
                        if not include_self:
                            prog.tensor_reduce(cnt, mask, "add")
                    elif include_self:
                        prog.tensor_tensor(res, res, xf, _SCATTER_REDUCTION[mode].reduce_alu)
                prog.free(val)
                if cnt is not None and (mode == "set" or not include_self):
                    pred = prog.sbuf((pc, L, jn), "float32")
                    prog.tensor_scalar(pred, cnt, "is_gt", 0.5)
                    keep = prog.sbuf((pc, L, jn), "float32")
                    prog.tensor_copy(keep, xf)
                    prog.select(res, pred, res, keep)
                    prog.free(keep)
                    prog.free(pred)
                if cnt is not None:
                    prog.free(cnt)
                ctx.store(hview(outs[0], off[0] + j0 * xs[d], xdims), res.reshape(pc, *T, jn))
                prog.free(res)
                prog.free(xt)
                prog.free(mask)
            prog.free(src)
            prog.free(idx)


@lowering("scatter")
def _scatter(ctx, eqn, ins, outs):
    """``out = x`` with ``src`` written at ``index`` along ``dim`` (duplicates: the last source wins)."""
    _scatter_common(ctx, eqn, ins, outs, "set")


@lowering("scatter_add")
def _scatter_add(ctx, eqn, ins, outs):
    """``out = x`` plus ``src`` summed into ``index`` along ``dim``."""
    _scatter_common(ctx, eqn, ins, outs, "sum")


@lowering("scatter_reduce")
def _scatter_reduce(ctx, eqn, ins, outs):
    """``src`` reduced (sum/prod/mean/amax/amin) into ``index`` along ``dim``, with or without ``x``."""
    reduce = eqn.attrs["reduce"]
    if reduce not in _SCATTER_REDUCTION:
        raise CannotLower(f"scatter_reduce with reduce={reduce!r}")
    _scatter_common(ctx, eqn, ins, outs, reduce, include_self=bool(eqn.attrs.get("include_self", True)))


def _index_put_scatter(ctx, ins, outs, X, x_dt, rin, nrows, chunks, idxs, v_in_stride, accumulate):
    """index_put by the indirect-write DMA: ``out = x``, then every chunk of (row number, values row) pairs is
    written (or added, in fp32) with ``dma_scatter``; program order and partition order make the last
    write win for duplicate rows, as torch's sequential CPU kernel does."""
    prog = ctx.prog
    total = numel(X)
    copy_view(ctx, hview(outs[0], 0, [(total, 1)]), hview(ins[0], 0, [(total, 1)]))
    esize = isa_size(x_dt)
    rch = min(rin, max(1, FREE_BUDGET_BYTES // esize))
    for pc, ps, off in chunks:
        flat = _row_index_tile(ctx, pc, [1], ps[1], off[1], [0], idxs, off[2:2 + len(idxs)], ps[2:2 + len(idxs)],
                               [(1, (0,) * len(idxs))])
        for r0 in range(0, rin, rch):
            rc = min(rch, rin - r0)
            vt = prog.sbuf((pc, rc), x_dt)
            prog.dma_copy(vt, hview(ins[1], off[-1] + r0 * v_in_stride, [(pc, ps[-1]), (rc, v_in_stride)]))
            prog.dma_scatter(hview(outs[0], r0, [(nrows, rin), (rc, 1)]), vt, flat.reshape(pc, 1),
                             accumulate=accumulate)
            prog.free(vt)
        prog.free(flat)


def isa_size(dt: str) -> int:
    """Bytes per element of a NeuronCore dtype name."""
    return isa.DTYPE_SIZES[isa.dtype_code(dt)]


def _index_put_mask(ctx, eqn, ins, outs, accumulate):
    """``x[mask] = v`` / ``x[mask] += v`` with a boolean mask over the leading axes and ``v`` broadcast over the
    selected rows: ``select(mask, v, x)`` (or ``x + mask * v``) on VectorE, no data-dependent shapes."""
    prog = ctx.prog
    xv, vv, mv = eqn.inputs[0], eqn.inputs[1], eqn.inputs[2]
    X = tuple(xv.shape)
    M = tuple(mv.shape)
    if X[:len(M)] != M:
        raise CannotLower(f"index_put with a boolean mask of shape {M} on x of shape {X}")
    inner = X[len(M):]
    vshape = tuple(vv.shape)
    while vshape and vshape[0] == 1 and len(vshape) > len(inner):
        vshape = vshape[1:]
    if len(vshape) > len(inner):
        raise CannotLower("index_put with a boolean mask and per-row values (the row count depends on the data)")
    try:
        _broadcast_shapes(vshape, inner)
    except CannotLower:
        raise CannotLower(f"index_put values of shape {tuple(vv.shape)} do not broadcast to rows {inner}") from None
    x_dt = ctx.neuron_dtype(xv.dtype)
    m_dt = ctx.neuron_dtype(mv.dtype)
    if x_dt == "int64" or (accumulate and x_dt not in _MM_DTYPES):
        raise CannotLower(f"masked index_put on {x_dt}")
    R, C = numel(M), numel(inner)
    vst = _bcast_strides(vshape, inner) if inner else []
    vdims = _merge([(n, (s,)) for n, s in zip(inner, vst)]) or [(1, (0,))]
    if len(vdims) > 3:
        raise CannotLower("masked index_put values with a complicated broadcast pattern")
    vt = prog.sbuf((128, C), x_dt)
    prog.dma_copy(vt.reshape(128, *[n for n, _ in vdims]) if C > 1 else vt,
                  hview(ins[1], 0, [(128, 0)] + [(n, s[0]) for n, s in vdims]))
    fb = max(1, (FREE_BUDGET_BYTES // 4) // max(1, C))
    for off, rows, cols in split_rows(R):
        for c0 in range(0, cols, fb):
            qc = min(fb, cols - c0)
            r0 = off + c0
            mt = prog.sbuf((rows, qc), m_dt)
            prog.dma_copy(mt, hview(ins[2], r0, [(rows, cols), (qc, 1)]))
            mf = prog.sbuf((rows, qc, 1), "float32")
            prog.tensor_scalar(mf.reshape(rows, qc), mt, "not_equal", 0.0)
            xt = prog.sbuf((rows, qc, C), x_dt)
            xview = [(rows, cols * C), (qc * C, 1)]
            prog.dma_copy(xt.reshape(rows, qc * C), hview(ins[0], r0 * C, xview))
            res = prog.sbuf((rows, qc, C), "float32")
            vb = vt[:rows].reshape(rows, 1, C).broadcast_to((rows, qc, C))
            mb = mf.broadcast_to((rows, qc, C))
            if accumulate:
                prog.tensor_tensor(res, vb, mb, "multiply")
                prog.tensor_tensor(res, res, xt, "add")
            else:
                prog.tensor_copy(res, xt)
                prog.select(res, mb, vb, res)
            ctx.store(hview(outs[0], r0 * C, xview), res.reshape(rows, qc * C))
            prog.free(res)
            prog.free(xt)
            prog.free(mf)
            prog.free(mt)
    prog.free(vt)
