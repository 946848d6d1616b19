# Lowerings of the index ops (gather, index/embedding, index_put, scatter, scatter_add, scatter_reduce) with indirect DMA and masked reductions.
"""Indexing on the NeuronCore.

Reads (``gather``, ``index``: embedding lookups, ``x[idx]``, ``x[:, idx]``,
``x[i, j]`` ...) are *row gathers* with the indirect DMA ``dma_gather``: the
input is viewed as a table of rows (the contiguous block after the last
indexed axis; one element for ``gather``), and every output row's table row
is computed on chip: ``row = base + sum_j idx_j * w_j`` where ``base`` comes
from ``iota`` over the output grid (the non-indexed axes) and the index
tensors are DMAed in with the output grid's access pattern (stride 0 where
they broadcast). Negative indices wrap (``index``); an index out of its axis
is pushed outside the table so the DMA engine's bounds check raises. int64
indices are read through their low int32 words.

Writes without an indirect-write DMA are computed, not scattered:

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

import itertools
from typing import Any, List, Tuple

from .base import CannotLower, lowering
from .shape import FREE_BUDGET_BYTES, copy_view, hview

__all__ = ["row_gather"]

_EXACT = 1 << 24


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= int(x)
    return p


def _row_strides(shape):
    st, s = [], 1
    for n in reversed(shape):
        st.append(s)
        s *= n
    return list(reversed(st))


def _merge(axes):
    """Merge neighbouring axes ``(n, strides)`` that are contiguous in every stride; drop size-1 axes."""
    out = []
    for n, st in axes:
        if n == 1:
            continue
        if out and all(p == n * s for p, s in zip(out[-1][1], st)):
            out[-1] = (out[-1][0] * n, tuple(st))
        else:
            out.append((n, tuple(st)))
    return out


def _parts(axes, nstr):
    """Split the grid into parts ``(offsets, partition axis, free axes)`` with <= 128 partitions."""
    if not axes:
        axes = [(1, (0,) * nstr)]
    n0, s0 = axes[0]
    rest = axes[1:]
    if n0 <= 128:
        return [((0,) * nstr, axes[0], rest)]
    if rest:
        return [(tuple(p0 * s for s in s0), (min(128, n0 - p0), s0), rest) for p0 in range(0, n0, 128)]
    q, r = divmod(n0, 128)
    parts = [((0,) * nstr, (128, tuple(q * s for s in s0)), [(q, s0)])]
    if r:
        parts.append((tuple(128 * q * s for s in s0), (r, s0), []))
    return parts


def _tiles(free, fb, nstr):
    """Yield (offsets, tile axes) covering the free axes in tiles of <= fb elements and <= 4 axes."""
    if not free:
        yield (0,) * nstr, [(1, (0,) * nstr)]
        return
    for idx in range(len(free)):
        suffix = _prod(n for n, _ in free[idx + 1:])
        if len(free) - idx <= 4 and suffix <= fb:
            break
    c = max(1, min(free[idx][0], fb // suffix))
    loops = [[tuple(i * s for s in st) for i in range(n)] for n, st in free[:idx]]
    n, st = free[idx]
    for combo in itertools.product(*loops):
        base = tuple(sum(v) for v in zip(*combo)) if combo else (0,) * nstr
        for c0 in range(0, n, c):
            off = tuple(b + c0 * s for b, s in zip(base, st))
            yield off, [(min(c, n - c0), st)] + free[idx + 1:]


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


def _row_index_tile(ctx, pc, tshape, cm, base, wpat, idxs, idx_offs, pstr, tstr, nrows):
    """int32 tile of table rows: ``base + cm*p + sum pattern`` plus ``sum_j wrap(idx_j) * w_j``; indices
    outside their axis are pushed outside the table (the gather's bounds check then raises)."""
    prog = ctx.prog
    flat = prog.sbuf((pc, *tshape), "int32")
    prog.iota(flat, base=base, channel_multiplier=cm, pattern=wpat)
    for j, (t, dt, w, n, wrap) in enumerate(idxs):
        v = prog.sbuf((pc, *tshape), "int32")
        prog.dma_copy(v, _idx_view(t, dt, idx_offs[j], [(pc, pstr[j])] + [(m, s[j]) for m, s in tstr]))
        tmp = prog.sbuf((pc, *tshape), "int32")
        if wrap:
            prog.tensor_scalar(tmp, v, "is_lt", 0.0, "multiply", float(n))
            prog.tensor_tensor(v, v, tmp, "add")
        prog.tensor_scalar(tmp, v, "is_ge", float(n), "multiply", float(2 * nrows))
        prog.tensor_tensor(flat, flat, tmp, "add")
        prog.tensor_scalar(tmp, v, "is_lt", 0.0, "multiply", float(2 * nrows))
        prog.tensor_tensor(flat, flat, tmp, "add")
        prog.tensor_scalar(v, v, "multiply", float(w))
        prog.tensor_tensor(flat, flat, v, "add")
        prog.free(tmp)
        prog.free(v)
    return flat


def row_gather(ctx: Any, x_t: Any, x_dt: str, x_numel: int, rin: int, out_t: Any, grid: List[Tuple[int, tuple]],
               idxs: List[tuple]) -> None:
    """Gather rows of ``rin`` elements from ``x_t`` into ``out_t`` (the grid's rows, row-major).

    ``grid``: output axes ``(n, (out_row_stride, base_weight, idx_stride_0, ...))``; ``idxs``: ``(tensor,
    dtype, weight, axis_size, wrap_negative)`` per index tensor. Row of grid point g:
    ``sum_k g_k * base_weight_k + sum_j wrap(idx_j[g]) * weight_j``.
    """
    prog = ctx.prog
    nrows = x_numel // rin
    if 3 * nrows >= _EXACT:
        raise CannotLower(f"gather from a table of {nrows} rows: row numbers beyond 2^24/3 are not exact on the "
                          f"fp32 engines")
    nstr = 2 + len(idxs)
    axes = _merge(grid)
    esize = 8 if x_dt == "int64" else (4 if x_dt in ("float32", "int32") else (2 if x_dt in ("bfloat16", "float16")
                                                                              else 1))
    rch = min(rin, max(1, FREE_BUDGET_BYTES // esize))
    fb = max(1, min(512, FREE_BUDGET_BYTES // (esize * rch)))
    for poff, (pc, ps), free in _parts(axes, nstr):
        for toff, tax in _tiles(free, fb, nstr):
            off = tuple(a + b for a, b in zip(poff, toff))
            tshape = [n for n, _ in tax]
            F = _prod(tshape)
            flat = _row_index_tile(ctx, pc, tshape, ps[1], off[1], [s[1] for _, s in tax], idxs, off[2:],
                                   ps[2:], [(n, s[2:]) for n, s in tax], nrows)
            flat2 = flat.reshape(pc, F)
            for r0 in range(0, rin, rch):
                rc = min(rch, rin - r0)
                ot = prog.sbuf((pc, F, rc), x_dt)
                table = hview(x_t, r0, [(nrows, rin), (rc, 1)])
                for f in range(F):
                    prog.dma_gather(ot[:, f, :], table, flat2[:, f:f + 1])
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
    if _prod(I) == 0:
        return
    xs = _row_strides(X)
    ist = _row_strides(I)
    grid = [(n, (ist[k], 0 if k == d else xs[k], ist[k])) for k, n in enumerate(I)]
    row_gather(ctx, ins[0], x_dt, _prod(X), 1, outs[0], grid, [(ins[1], i_dt, xs[d], X[d], False)])


def _bcast_strides(shape, target):
    """Row-major strides of ``shape`` broadcast (right-aligned) to ``target`` (0 where broadcast)."""
    st = _row_strides(shape)
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
    rin = _prod(X[last + 1:])
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
    xs = _row_strides(X)
    bstr = [_bcast_strides(tuple(s), B) for s in idx_shapes]
    axes = []  # (n, base_weight_rows, [idx strides])
    pre_ax = [(X[k], xs[k] // rin, [0] * len(idx_shapes)) for k in pre]
    b_ax = [(n, 0, [bs[i] for bs in bstr]) for i, n in enumerate(B)]
    axes = (pre_ax + b_ax) if adjacent else (b_ax + pre_ax)
    gshape = [n for n, _, _ in axes]
    gst = _row_strides(gshape)
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
    if _prod(eqn.outputs[0].shape) == 0:
        return
    grid, weights, rin, _ = _index_grid(X, dims, [tuple(v.shape) for v in ivs])
    idxs = [(t, dt, w, X[d], True) for t, dt, w, d in zip(ins[1:], idts, weights, dims)]
    row_gather(ctx, ins[0], x_dt, _prod(X), rin, outs[0], grid, idxs)

