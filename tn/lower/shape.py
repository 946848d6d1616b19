# Lowerings of the shape ops (reshape, permute, expand, slice, cat, pad, flip, as_strided ...) and the creation ops (full, iota) as DMA programs.
"""Data movement lowerings: shape ops as DMA access patterns, creation ops on GpSimd.

Every shape op is a copy whose source and destination are *access patterns*
over HBM: a permute is a DMA whose source strides are permuted, an expand a
DMA with stride-0 source axes, a flip one with negative strides, a slice one
with an offset and a step, a cat one DMA per input into a slice of the
output. The copies go HBM -> HBM directly (the ISA allows it), split only
where the pattern needs more axes than one DMA encodes (a partition axis and
four free axes) or more elements than one DMA moves.

``full`` and ``iota`` write an SBUF tile on GpSimd (``memset`` / ``iota``)
and DMA it out; int64 results are written as int32 word pairs (low word the
value, high word its sign), since no engine computes on int64.

Helpers shared with :mod:`tn.lower.reduce` and :mod:`tn.lower.index`:
:func:`hview`, :func:`as_i32_pairs`, :func:`copy_view`, :func:`fill_view`,
:func:`split_rows`, :func:`store_int`.
"""
from __future__ import annotations

import itertools
from typing import Any, List, Sequence, Tuple


from ..neuron import isa
from ..neuron.program import HbmTensor, HbmView
from .base import CannotLower, lowering
from ..shapes import numel

__all__ = ["hview", "as_i32_pairs", "copy_view", "fill_view", "split_rows", "store_int", "load_checked_int",
           "cast_copy", "FREE_BUDGET_BYTES", "LIM_NUM"]

#: Largest size of one DMA axis / one DMA's free size (elements), as the engine checks it.
LIM_NUM = 1 << 24
#: Bytes per partition a lowering's working tile may take (leaves room for double buffering and other tiles).
FREE_BUDGET_BYTES = 32 * 1024

Dims = List[Tuple[int, int]]


# --------------------------------------------------------------------------- views


def _row_major(shape: Sequence[int]) -> Dims:
    dims, s = [], 1
    for n in reversed(tuple(shape)):
        dims.append((int(n), s))
        s *= int(n)
    return list(reversed(dims))


def hview(t: Any, offset: int = 0, dims: Dims = None, dtype: str = None) -> HbmView:
    """An :class:`HbmView` of ``t`` (HbmTensor or HbmView) with an explicit element ``offset`` and
    ``(num, stride)`` dims (negative and zero strides allowed); ``dtype`` reinterprets the element type
    (offsets and strides are then in units of the new dtype)."""
    tensor = t.tensor if isinstance(t, HbmView) else t
    if dims is None:
        if isinstance(t, HbmView):
            offset, dims = t.offset, t.dims
        else:
            dims = _row_major(t.shape)
    v = HbmView(tensor, offset, dims)
    if dtype is not None:
        v._dt = isa.dtype_code(dtype)
    return v


def as_i32_pairs(v: Any) -> HbmView:
    """An int64 HBM view reinterpreted as int32 word pairs: shape ``v.shape + (2,)`` (little-endian: the low
    word first)."""
    if isinstance(v, HbmTensor):
        v = v.view()
    if v.dtype != "int64":
        raise CannotLower(f"as_i32_pairs needs an int64 view, got {v.dtype}")
    return hview(v.tensor, 2 * v.offset, [(n, 2 * s) for n, s in v.dims] + [(2, 1)], dtype="int32")


def _merge_joint(dims: List[Tuple[int, ...]]) -> List[Tuple[int, ...]]:
    """Drop size-1 axes and merge neighbours that are contiguous in every operand: dims are (n, s0, s1, ...)."""
    out: List[Tuple[int, ...]] = []
    for d in dims:
        if d[0] == 1:
            continue
        if out and all(po == d[0] * so for po, so in zip(out[-1][1:], d[1:])):
            out[-1] = (out[-1][0] * d[0],) + tuple(d[1:])
        else:
            out.append(tuple(d))
    return out


def copy_view(ctx: Any, dst: Any, src: Any) -> None:
    """DMA ``src`` into ``dst`` (HBM views or tensors of the same shape and dtype), element for element.

    The joint access pattern is merged and split into as few DMAs as the encoding allows.
    """
    prog = ctx.prog
    dst = dst.view() if isinstance(dst, HbmTensor) else dst
    src = src.view() if isinstance(src, HbmTensor) else src
    if tuple(dst.shape) != tuple(src.shape):
        raise CannotLower(f"internal: copy of shape {tuple(src.shape)} into {tuple(dst.shape)}")
    if dst.dtype != src.dtype:
        raise CannotLower(f"internal: copy from {src.dtype} into {dst.dtype}")
    dims = _merge_joint([(n, sd, ss) for (n, sd), (_, ss) in zip(dst.dims, src.dims)])
    if not dims:
        dims = [(1, 1, 1)]

    def emit(dd, od, os_):
        """DMAs for joint dims ``dd`` at element offsets ``od`` (dst) and ``os_`` (src)."""
        rest = dd[1:]
        if len(dd) <= 4 and numel(n for n, _, _ in dd) <= LIM_NUM:
            prog.dma_copy(hview(dst, od, [(1, 0)] + [(n, a) for n, a, _ in dd]),
                          hview(src, os_, [(1, 0)] + [(n, b) for n, _, b in dd]))
            return
        if len(dd) == 1:  # one huge axis: rows of 1M elements on the partition axis (long runs), then the rest
            n0, a0, b0 = dd[0]
            C = 1 << 20
            q = n0 // C
            prog.dma_copy(hview(dst, od, [(q, C * a0), (C, a0)]), hview(src, os_, [(q, C * b0), (C, b0)]))
            if n0 - q * C:
                emit([(n0 - q * C, a0, b0)], od + q * C * a0, os_ + q * C * b0)
            return
        if len(rest) <= 4 and numel(n for n, _, _ in rest) <= LIM_NUM:
            n0, a0, b0 = dd[0]
            for c in range(0, n0, LIM_NUM):
                k = min(LIM_NUM, n0 - c)
                prog.dma_copy(hview(dst, od + c * a0, [(k, a0)] + [(n, a) for n, a, _ in rest]),
                              hview(src, os_ + c * b0, [(k, b0)] + [(n, b) for n, _, b in rest]))
            return
        n0, a0, b0 = dd[0]
        if len(dd) == 1:  # one huge contiguous-or-strided axis: chunk it
            for c in range(0, n0, LIM_NUM):
                emit([(min(LIM_NUM, n0 - c), a0, b0)], od + c * a0, os_ + c * b0)
            return
        for i in range(n0):
            emit(rest, od + i * a0, os_ + i * b0)

    emit(dims, dst.offset, src.offset)


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
        suffix = numel(n for n, _ in free[idx + 1:])
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


def split_rows(total: int, parts: int = 128) -> List[Tuple[int, int, int]]:
    """Split ``total`` contiguous elements into ``[(offset, rows, cols)]`` blocks of ``rows <= parts`` rows."""
    out = []
    cols = total // parts
    if cols:
        out.append((0, parts, cols))
    rem = total - parts * cols
    if rem:
        out.append((parts * cols, 1, rem))
    return out


def _split_i64_value(value: int) -> Tuple[int, int]:
    v = int(value) & 0xFFFFFFFFFFFFFFFF
    lo, hi = v & 0xFFFFFFFF, v >> 32
    return (lo - (1 << 32) if lo >= 1 << 31 else lo), (hi - (1 << 32) if hi >= 1 << 31 else hi)


def fill_view(ctx: Any, dst: Any, value: Any) -> None:
    """Write the constant ``value`` into every element of the HBM view ``dst`` (a memset tile + DMAs)."""
    prog = ctx.prog
    dst = dst.view() if isinstance(dst, HbmTensor) else dst
    dt = dst.dtype
    is64 = dt == "int64"
    dims = _merge_joint([(n, s) for n, s in dst.dims]) or [(1, 1)]
    # blocks: (offset, [(pcount, pstride), free dims...]) with pcount <= 128
    blocks = []
    if dims[-1][1] == 1:
        inner, outer = dims[-1][0], dims[:-1]
    else:
        inner, outer = 1, dims
    if not outer:
        for off, rows, cols in split_rows(inner):
            blocks.append((dst.offset + off, [(rows, cols), (cols, 1)]))
    else:
        loops, (pn, ps) = outer[:-1], outer[-1]
        for idx in itertools.product(*[range(n) for n, _ in loops]):
            base = dst.offset + sum(i * s for i, (_, s) in zip(idx, loops))
            for p0 in range(0, pn, 128):
                blocks.append((base + p0 * ps, [(min(128, pn - p0), ps), (inner, 1)]))
    esize = 8 if is64 else isa.DTYPE_SIZES[isa.dtype_code(dt)]
    fb = max(1, FREE_BUDGET_BYTES // esize)
    maxp = max(d[0][0] for _, d in blocks)
    maxf = min(fb, max(d[1][0] for _, d in blocks))
    if is64:
        lo, hi = _split_i64_value(value)
        tile = prog.sbuf((maxp, maxf, 2), "int32")
        prog.memset(tile[:, :, 0], lo)
        prog.memset(tile[:, :, 1], hi)
    else:
        tile = prog.sbuf((maxp, maxf), dt)
        prog.memset(tile, value)
    for off, ((pc, ps), (nf, _)) in blocks:
        for f0 in range(0, nf, maxf):
            f = min(maxf, nf - f0)
            if is64:
                d = hview(dst.tensor, 2 * (off + f0), [(pc, 2 * ps), (2 * f, 1)], dtype="int32")
                prog.dma_copy(d, tile[:pc, :f, :])
            else:
                prog.dma_copy(hview(dst.tensor, off + f0, [(pc, ps), (f, 1)]), tile[:pc, :f])
    prog.free(tile)


def store_int(ctx: Any, dst: Any, tile: Any, nonneg: bool = False) -> None:
    """Write a tile of integral values (any engine dtype) to the HBM view ``dst`` of dtype int64/int32/...

    For an int64 ``dst`` the values are written as int32 word pairs (high word = sign), so they must fit
    in int32. ``nonneg`` skips the sign computation.
    """
    prog = ctx.prog
    dst = dst.view() if isinstance(dst, HbmTensor) else dst
    if dst.dtype != "int64":
        ctx.store(dst, tile)
        return
    shape = tuple(tile.shape)
    pair = prog.sbuf(shape + (2,), "int32")
    lo = pair[(slice(None),) * len(shape) + (0,)]
    hi = pair[(slice(None),) * len(shape) + (1,)]
    prog.tensor_copy(lo, tile)
    if nonneg:
        prog.memset(hi, 0, engine="vector")
    else:
        prog.tensor_scalar(hi, lo, "is_lt", 0.0, "multiply", -1.0)
    d = as_i32_pairs(dst)
    prog.dma_copy(d, pair)
    prog.free(pair)


def load_checked_int(ctx: Any, tile: Any, src: HbmView, bound: float) -> None:
    """DMA integer values into the int32/fp32 SBUF ``tile`` and flag (``ctx.range_check``) any value the fp32
    engines would not compute exactly: ``|v| >= bound`` (at most 2**24), or, for an int64 ``src``, a value
    outside int32 (its high word is not the low word's sign). int64 values are read by their low words."""
    prog = ctx.prog
    if src.dtype == "int64" and len(_merge_joint([(n, 2 * st) for n, st in src.dims[1:]] + [(2, 1)])) > 4:
        # too many axes for one DMA with the word axis: load the words with two strided DMAs
        words = [(n, 2 * st) for n, st in src.dims]
        lo = prog.sbuf(tuple(tile.shape), "int32")
        hi = prog.sbuf(tuple(tile.shape), "int32")
        prog.dma_copy(lo, hview(src.tensor, 2 * src.offset, words, dtype="int32"))
        prog.dma_copy(hi, hview(src.tensor, 2 * src.offset + 1, words, dtype="int32"))
        sign = prog.sbuf(tuple(tile.shape), "float32")
        prog.tensor_scalar(sign, lo, "is_lt", 0.0, "multiply", -1.0)
        prog.tensor_tensor(sign, hi, sign, "not_equal")
        ctx.range_check(sign)
        prog.tensor_copy(tile, lo)
        for t in (sign, hi, lo):
            prog.free(t)
    elif src.dtype == "int64":
        shape = tuple(tile.shape)
        ax = (slice(None),) * len(shape)
        pair = prog.sbuf(shape + (2,), "int32")       # both words in one contiguous DMA, split on chip
        prog.dma_copy(pair, as_i32_pairs(src))
        lo, hi = pair[ax + (0,)], pair[ax + (1,)]
        sign = prog.sbuf(shape, "float32")
        prog.tensor_scalar(sign, lo, "is_lt", 0.0, "multiply", -1.0)
        prog.tensor_tensor(sign, hi, sign, "not_equal")
        ctx.range_check(sign)
        prog.free(sign)
        prog.tensor_copy(tile, lo)
        prog.free(pair)
    else:
        prog.dma_copy(tile, src)
    big = prog.sbuf(tuple(tile.shape), "float32")
    prog.tensor_scalar(big, tile, "abs_max", 0.0, "is_ge", float(min(bound, 1 << 24)))
    ctx.range_check(big)
    prog.free(big)


def _dt(ctx: Any, var: Any) -> str:
    return ctx.neuron_dtype(var.dtype)


def _check_vars(ctx: Any, eqn: Any) -> None:
    for v in list(eqn.inputs) + list(eqn.outputs):
        if hasattr(v, "shape") and hasattr(v, "dtype") and not hasattr(v, "value"):
            ctx.neuron_dtype(v.dtype)


# --------------------------------------------------------------------------- shape ops


@lowering("reshape")
def _reshape(ctx, eqn, ins, outs):
    """Same bytes, new shape: one contiguous DMA."""
    _check_vars(ctx, eqn)
    x, out = ins[0], outs[0]
    n = numel(out.shape)
    copy_view(ctx, hview(out, 0, [(n, 1)]), hview(x, 0, [(n, 1)]))


@lowering("permute")
def _permute(ctx, eqn, ins, outs):
    """Axes reordered by the source access pattern of one DMA (split when it needs more than 5 axes)."""
    _check_vars(ctx, eqn)
    x, out = ins[0], outs[0]
    dims = tuple(eqn.attrs["dims"])
    if len(eqn.inputs[0].shape) == 0:
        copy_view(ctx, out, x)
        return
    src = x.view().permute(*dims)
    if not _transpose_permute(ctx, out.view(), src):
        copy_view(ctx, out.view(), src)


_TE_DTYPES = ("float32", "bfloat16", "float16")


def _transpose_permute(ctx: Any, dst: HbmView, src: HbmView) -> bool:
    """A permute that moves the source's contiguous axis away from the end, as batched 2-D transposes on
    TensorE (128x128 blocks through PSUM), so both DMA sides move contiguous runs. Returns False (nothing
    emitted) when the plain DMA pattern is as good (the inner axis stays inner) or the dtype has no TensorE path.
    """
    if dst.dtype not in _TE_DTYPES:
        return False
    dims = _merge_joint([(n, sd, ss) for (n, sd), (_, ss) in zip(dst.dims, src.dims)])
    if len(dims) < 2 or dims[-1][1] != 1 or dims[-1][2] == 1:
        return False
    ia = [i for i, d in enumerate(dims) if d[2] == 1]
    if not ia:
        return False
    A, B = dims[ia[0]], dims[-1]          # A: contiguous in the source; B: contiguous in the output
    if A[0] < 16 or B[0] < 16:
        return False
    batch = [d for i, d in enumerate(dims) if i not in (ia[0], len(dims) - 1)]
    if numel(n for n, _, _ in batch) * -(-A[0] // 128) * -(-B[0] // 128) > 512:
        return False  # thousands of tiny transposes: one strided DMA is cheaper to emit and about as fast
    prog = ctx.prog
    dt = dst.dtype
    na, ta = A[0], A[1]                   # A's stride in the output
    nb, sb = B[0], B[2]                   # B's stride in the source
    esize = isa.DTYPE_SIZES[isa.dtype_code(dt)]
    ACH = 4096 // esize                   # a-columns per source row load: 4 KiB runs
    OBC = 4096 // esize                   # b-columns per output row store: 4 KiB runs
    BANK = 2048 // esize                  # b-columns per PSUM bank (transposes keep the input dtype)
    lag_in, lag_o, lag_ps = [], [], []   # frees delayed by one block: consecutive blocks use other buffers

    def rotate(lag, new):
        """Free the buffers held in ``lag`` and hold ``new`` instead."""
        for t in lag:
            prog.free(t)
        lag[:] = new

    for bidx in itertools.product(*[range(n) for n, _, _ in batch]):
        od = dst.offset + sum(i * d[1] for i, d in zip(bidx, batch))
        os_ = src.offset + sum(i * d[2] for i, d in zip(bidx, batch))
        for b0 in range(0, nb, OBC):
            nbg = min(OBC, nb - b0)
            for a0 in range(0, na, ACH):
                nac = min(ACH, na - a0)
                tiles = []
                for k0 in range(0, nbg, 128):
                    pb = min(128, nbg - k0)
                    t = prog.sbuf((pb, nac), dt)
                    prog.dma_copy(t, hview(src, os_ + (b0 + k0) * sb + a0, [(pb, sb), (nac, 1)]))
                    tiles.append((k0, pb, t))
                rotate(lag_in, [t for _, _, t in tiles])
                for j0 in range(0, nac, 128):
                    pa = min(128, nac - j0)
                    o = prog.sbuf((pa, nbg), dt)
                    for c0 in range(0, nbg, BANK):
                        nc = min(BANK, nbg - c0)
                        ps = prog.psum((pa, nc), dt)
                        for k0, pb, t in tiles:
                            if c0 <= k0 < c0 + nc:
                                prog.transpose(ps[:, k0 - c0:k0 - c0 + pb], t[:, j0:j0 + pa])
                        prog.tensor_copy(o[:, c0:c0 + nc], ps, engine="scalar" if (c0 // BANK) % 2 else "vector")
                        rotate(lag_ps, [ps])
                    prog.dma_copy(hview(dst, od + (a0 + j0) * ta + b0, [(pa, ta), (nbg, 1)]), o)
                    rotate(lag_o, [o])
    for lag in (lag_in, lag_o, lag_ps):
        rotate(lag, [])
    return True


@lowering("expand")
def _expand(ctx, eqn, ins, outs):
    """Broadcast with stride-0 source axes."""
    _check_vars(ctx, eqn)
    x, out = ins[0], outs[0]
    shape = tuple(out.shape) if eqn.outputs[0].shape else (1,)
    xshape = tuple(eqn.inputs[0].shape)
    xd = _row_major(xshape)
    lead = len(eqn.outputs[0].shape) - len(xshape)
    dims = [(n, 0) for n in shape[:lead]]
    for (m, s), n in zip(xd, shape[lead:]):
        dims.append((n, s if m == n else 0))
    if not eqn.outputs[0].shape:
        dims = [(1, 0)]
    src = hview(x, 0, dims)
    if not _expand_inner(ctx, out.view(), src):
        copy_view(ctx, out.view(), src)


def _expand_inner(ctx: Any, dst: HbmView, src: HbmView) -> bool:
    """A broadcast along the innermost axis (``[N, 1] -> [N, D]``): load the source once, widen it with a
    stride-0 ``tensor_copy`` on VectorE, store contiguous runs (instead of a DMA with one-element runs).
    Returns False (nothing emitted) when the plain DMA pattern is fine or the dtype is int32/int64."""
    if dst.dtype not in ("float32", "bfloat16", "float16", "bool", "uint8"):
        return False
    dims = _merge_joint([(n, sd, ss) for (n, sd), (_, ss) in zip(dst.dims, src.dims)])
    if not dims or dims[-1][1] != 1 or dims[-1][2] != 0 or dims[-1][0] < 8:
        return False
    ni = dims[-1][0]
    if ni > 8192:
        return False
    prog = ctx.prog
    outer = _merge([(n, (sd, ss)) for n, sd, ss in dims[:-1]])
    esize = isa.DTYPE_SIZES[isa.dtype_code(dst.dtype)]
    fb = max(1, (FREE_BUDGET_BYTES // esize) // ni)
    for poff, (pc, ps), free in _parts(outer, 2):
        for toff, tax in _tiles(free, fb, 2):
            if len(tax) > 3:
                return False
            od, os_ = dst.offset + poff[0] + toff[0], src.offset + poff[1] + toff[1]
            tshape = [n for n, _ in tax]
            st = prog.sbuf((pc, *tshape), dst.dtype)
            prog.dma_copy(st, hview(src, os_, [(pc, ps[1])] + [(n, s[1]) for n, s in tax]))
            ot = prog.sbuf((pc, *tshape, ni), dst.dtype)
            prog.tensor_copy(ot, st.reshape(pc, *tshape, 1).broadcast_to((pc, *tshape, ni)))
            prog.dma_copy(hview(dst, od, [(pc, ps[0])] + [(n, s[0]) for n, s in tax] + [(ni, 1)]), ot)
            prog.free(ot)
            prog.free(st)
    return True


def _vshape(var: Any) -> tuple:
    return tuple(var.shape)


def _real_view(t: Any, var: Any) -> HbmView:
    """Row-major view of HbmTensor ``t`` with the Var's true shape (0-d Vars: no axes at all -> (1,))."""
    shape = _vshape(var) or (1,)
    return hview(t, 0, _row_major(shape))


@lowering("slice")
def _slice(ctx, eqn, ins, outs):
    """``x[..., start:end:step, ...]``: offset and stride in the source pattern."""
    _check_vars(ctx, eqn)
    a = eqn.attrs
    dim, start, end, step = a["dim"], a["start"], a["end"], a.get("step", 1)
    x = _real_view(ins[0], eqn.inputs[0])
    n = len(range(start, end, step))
    if n == 0:
        return
    copy_view(ctx, _real_view(outs[0], eqn.outputs[0]), _slab(x, dim, start, n, step))


def _slab(view: HbmView, dim: int, start: int, n: int, step: int = 1) -> HbmView:
    """``n`` entries of ``view`` along axis ``dim`` from ``start`` every ``step``."""
    dims = list(view.dims)
    s = dims[dim][1]
    dims[dim] = (n, s * step)
    return hview(view, view.offset + start * s, dims)


@lowering("slice_scatter")
def _slice_scatter(ctx, eqn, ins, outs):
    """Copy of ``x`` with a slice replaced: the complement of the slice from ``x``, the slice from ``src``."""
    _check_vars(ctx, eqn)
    a = eqn.attrs
    dim, start, end, step = a["dim"], a["start"], a["end"], a.get("step", 1)
    x = _real_view(ins[0], eqn.inputs[0])
    out = _real_view(outs[0], eqn.outputs[0])
    src = _real_view(ins[1], eqn.inputs[1])
    size = x.dims[dim][0]
    n = len(range(start, end, step))
    if n == 0:
        copy_view(ctx, out, x)
        return
    if step == 1:
        if start > 0:
            copy_view(ctx, _slab(out, dim, 0, start), _slab(x, dim, 0, start))
        if start + n < size:
            copy_view(ctx, _slab(out, dim, start + n, size - start - n), _slab(x, dim, start + n, size - start - n))
    else:
        copy_view(ctx, out, x)  # the slice is overwritten below (the write-after-write dependency orders it)
    copy_view(ctx, _slab(out, dim, start, n, step), src)


@lowering("cat")
def _cat(ctx, eqn, ins, outs):
    """One DMA per input into its slab of the output."""
    _check_vars(ctx, eqn)
    dim = eqn.attrs["dim"]
    out = _real_view(outs[0], eqn.outputs[0])
    odt = ctx.neuron_dtype(eqn.outputs[0].dtype)
    for t, v in zip(ins, eqn.inputs):
        if not isinstance(t, HbmTensor):
            raise CannotLower("cat of a literal input")
        idt = ctx.neuron_dtype(v.dtype)
        if idt != odt and "int64" in (idt, odt):
            raise CannotLower(f"cat promoting {idt} to {odt}: no engine converts int64")
    pos = 0
    for t, v in zip(ins, eqn.inputs):
        if len(v.shape) == len(eqn.outputs[0].shape):
            k = v.shape[dim]
            if k:
                if ctx.neuron_dtype(v.dtype) != odt:
                    cast_copy(ctx, _slab(out, dim, pos, k), _real_view(t, v))
                else:
                    copy_view(ctx, _slab(out, dim, pos, k), _real_view(t, v))
            pos += k


def cast_copy(ctx: Any, dst: HbmView, src: HbmView) -> None:
    """Copy ``src`` into ``dst`` (same shape, different dtypes, neither int64) through SBUF with a
    ``tensor_copy`` cast on VectorE."""
    prog = ctx.prog
    axes = _merge([(n, (sd, ss)) for (n, sd), (_, ss) in zip(dst.dims, src.dims)])
    fb = max(1, FREE_BUDGET_BYTES // 4)
    for poff, (pc, ps), free in _parts(axes, 2):
        for toff, tax in _tiles(free, fb, 2):
            tshape = [n for n, _ in tax]
            a = prog.sbuf((pc, *tshape), src.dtype)
            prog.dma_copy(a, hview(src, src.offset + poff[1] + toff[1], [(pc, ps[1])] + [(n, st[1]) for n, st in tax]))
            b = prog.sbuf((pc, *tshape), dst.dtype)
            prog.tensor_copy(b, a)
            prog.dma_copy(hview(dst, dst.offset + poff[0] + toff[0], [(pc, ps[0])] + [(n, st[0]) for n, st in tax]), b)
            prog.free(b)
            prog.free(a)


@lowering("pad")
def _pad(ctx, eqn, ins, outs):
    """Constant padding: memset the borders, DMA the (possibly cropped) input into the interior."""
    _check_vars(ctx, eqn)
    pad = list(eqn.attrs["pad"])
    value = eqn.attrs.get("value", 0.0)
    x = _real_view(ins[0], eqn.inputs[0])
    out = _real_view(outs[0], eqn.outputs[0])
    nd = len(eqn.inputs[0].shape)
    if nd == 0:
        raise CannotLower("pad of a 0-d tensor")
    xs, os_ = list(x.dims), list(out.dims)
    src_off, dst_off = x.offset, out.offset
    src_dims, dst_dims = list(xs), list(os_)
    empty = False
    for k in range(len(pad) // 2):
        d = nd - 1 - k
        lo, hi = int(pad[2 * k]), int(pad[2 * k + 1])
        n_in = xs[d][0]
        # interior: input rows [max(0,-lo), n_in - max(0,-hi)), output rows from max(0, lo)
        a = max(0, -lo)
        b = n_in - max(0, -hi)
        cnt = b - a
        if cnt <= 0:
            empty = True
            continue
        src_off += a * xs[d][1]
        dst_off += max(0, lo) * os_[d][1]
        src_dims[d] = (cnt, xs[d][1])
        dst_dims[d] = (cnt, os_[d][1])
    # borders
    for k in range(len(pad) // 2):
        d = nd - 1 - k
        lo, hi = int(pad[2 * k]), int(pad[2 * k + 1])
        n_out = os_[d][0]
        if lo > 0:
            fill_view(ctx, _slab(out, d, 0, min(lo, n_out)), value)
        if hi > 0:
            h = min(hi, n_out)
            fill_view(ctx, _slab(out, d, n_out - h, h), value)
    if empty:
        fill_view(ctx, out, value)
        return
    copy_view(ctx, hview(out, dst_off, dst_dims), hview(x, src_off, src_dims))


@lowering("flip")
def _flip(ctx, eqn, ins, outs):
    """Reversed axes as negative strides of the source pattern."""
    _check_vars(ctx, eqn)
    x = _real_view(ins[0], eqn.inputs[0])
    dims = list(x.dims)
    off = 0
    for d in eqn.attrs["dims"]:
        n, s = dims[d]
        off += (n - 1) * s
        dims[d] = (n, -s)
    copy_view(ctx, _real_view(outs[0], eqn.outputs[0]), hview(x, off, dims))


def _strided_src(ctx, eqn, x_t, xvar):
    size, stride, offset = eqn.attrs["size"], eqn.attrs["stride"], eqn.attrs.get("offset", 0) or 0
    total = numel(xvar.shape)
    hi = offset + sum((n - 1) * s for n, s in zip(size, stride) if s > 0)
    lo = offset + sum((n - 1) * s for n, s in zip(size, stride) if s < 0)
    if numel(size) and (lo < 0 or hi >= total):
        raise CannotLower(f"as_strided window (size {tuple(size)}, stride {tuple(stride)}, offset {offset}) reaches "
                          f"outside the {total} elements of the input")
    dims = [(int(n), int(s)) for n, s in zip(size, stride)] or [(1, 0)]
    return hview(x_t, int(offset), dims)


@lowering("as_strided")
def _as_strided(ctx, eqn, ins, outs):
    """The window ``size``/``stride``/``offset`` of the input's row-major layout, as a source pattern."""
    _check_vars(ctx, eqn)
    if numel(eqn.attrs["size"]) == 0:
        return
    src = _strided_src(ctx, eqn, ins[0], eqn.inputs[0])
    dst = hview(outs[0], 0, _row_major(tuple(eqn.attrs["size"])) or [(1, 1)])
    copy_view(ctx, dst, src)


@lowering("as_strided_scatter")
def _as_strided_scatter(ctx, eqn, ins, outs):
    """Copy the input, then DMA ``src`` into the strided window of the copy."""
    _check_vars(ctx, eqn)
    x, src = ins[0], ins[1]
    n = numel(eqn.inputs[0].shape)
    copy_view(ctx, hview(outs[0], 0, [(n, 1)]), hview(x, 0, [(n, 1)]))
    if numel(eqn.attrs["size"]) == 0:
        return
    win = _strided_src(ctx, eqn, outs[0], eqn.inputs[0])
    copy_view(ctx, win, hview(src, 0, _row_major(tuple(eqn.attrs["size"])) or [(1, 1)]))


# --------------------------------------------------------------------------- creation


@lowering("full")
def _full(ctx, eqn, ins, outs):
    """A constant: GpSimd memset of one tile, DMAed over the output."""
    dt = _dt(ctx, eqn.outputs[0])
    value = eqn.attrs["value"]
    if isinstance(value, complex):
        raise CannotLower("complex fill value")
    if dt == "bool":
        value = 1.0 if value else 0.0
    elif dt in ("int32", "uint8", "int64"):
        if value != int(value):
            raise CannotLower(f"non-integral fill value {value!r} for {dt}")
        value = int(value)
        if dt == "int32" and not -(1 << 31) <= value < (1 << 31):
            raise CannotLower(f"fill value {value} does not fit int32")
    else:
        value = float(value)
    fill_view(ctx, outs[0], value)


@lowering("iota")
def _iota(ctx, eqn, ins, outs):
    """``start + step * i`` computed on GpSimd (exact integers; floats computed in double, rounded once)."""
    a = eqn.attrs
    dt = _dt(ctx, eqn.outputs[0])
    length, start, step = int(a["length"]), a["start"], a["step"]
    if length == 0:
        return
    prog = ctx.prog
    integral = dt in ("int32", "int64", "uint8", "bool")
    if integral:
        if start != int(start) or step != int(step):
            raise CannotLower("iota with fractional start/step into an integer dtype")
        last = int(start) + int(step) * (length - 1)
        if not (-(1 << 31) <= int(start) < (1 << 31) and -(1 << 31) <= last < (1 << 31)):
            raise CannotLower("iota values do not fit in int32 words")
    if dt == "bool":
        raise CannotLower("iota into bool")
    tdt = "int32" if dt == "int64" else dt
    for off, rows, cols in split_rows(length):
        f0 = 0
        fb = max(1, FREE_BUDGET_BYTES // 8)
        while f0 < cols:
            f = min(fb, cols - f0)
            t = prog.sbuf((rows, f), tdt)
            prog.iota(t, base=start + step * (off + f0), channel_multiplier=step * cols, pattern=[step])
            dst = hview(outs[0], off + f0, [(rows, cols), (f, 1)])
            if dt == "int64":
                store_int(ctx, dst, t, nonneg=(int(start) >= 0 and int(start) + int(step) * (length - 1) >= 0))
            else:
                prog.dma_copy(dst, t)
            prog.free(t)
            f0 += f
