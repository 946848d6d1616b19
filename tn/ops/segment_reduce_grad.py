# The gradient of segment_reduce (aten._segment_reduce_backward: sum, mean, max, min, prod over lengths or offsets) in core ops, as torch's CPU kernel defines it.
"""``aten._segment_reduce_backward`` as a decomposition.

Every row of ``data`` along the reduced axis belongs to the segment whose
range holds it (the segment index is the number of segment ends at or before
the row, as :func:`tn.ops.decompositions._segment_reduce` computes it for the
forward); the segment's output and incoming gradient are gathered onto its
rows, and each reduction's rule is applied elementwise, as torch's CPU kernel
(``aten/src/ATen/native/SegmentReduce.cpp``) does it per element:

- ``sum``: the segment's gradient; ``mean``: that gradient divided by the
  segment's length;
- ``max``/``min``: the gradient on the rows equal to the result (or NaN); when
  two or more rows are, a positive gradient is divided by their count (the
  kernel's own rule, kept as it is);
- ``prod``: ``grad * out / x``, and for a zero or NaN ``x`` the gradient times
  the product of the segment's other rows (and ``initial``).

Rows outside every segment and empty segments get 0.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .table import decomposition

aten = torch.ops.aten
Tensor = torch.Tensor

#: at most this many elements in prod's [rows, rows, inner] matrix of exclusive products (else a host op)
MAX_PROD_PAIRS = 1 << 22


def _rows_to_segments(data: Tensor, lengths: Optional[Tensor], offsets: Optional[Tensor]):
    """``(axis, seg, seg_len)``: the reduced axis, each row's segment ``[B..., R]`` (``nseg`` for rows past
    the last segment) and each segment's length ``[B..., nseg]``."""
    if lengths is not None:
        ends = aten.cumsum.default(lengths, -1)
        seg_len = lengths
    else:
        ends = aten.slice.Tensor(offsets, -1, 1, offsets.shape[-1])
        seg_len = aten.sub.Tensor(ends, aten.slice.Tensor(offsets, -1, 0, offsets.shape[-1] - 1))
    axis = ends.dim() - 1
    rows = int(data.shape[axis])
    r = aten.view.default(aten.arange.start_step(0, rows, 1, dtype=ends.dtype), [rows, 1])
    seg = aten.sum.dim_IntList(aten.le.Tensor(aten.unsqueeze.default(ends, -2), r), [-1], False, dtype=torch.int64)
    return axis, seg, seg_len


def _on_rows(v: Tensor, axis: int, idx: Tensor, fill: Any) -> Tensor:
    """``v`` ``[B..., nseg, inner...]`` gathered onto the rows (``idx`` shaped like the data), ``fill`` on
    rows past the last segment."""
    pad = list(v.shape)
    pad[axis] = 1
    ext = aten.cat.default([v, aten.full.default(pad, fill, dtype=v.dtype)], axis)
    return aten.gather.default(ext, axis, idx)


@decomposition(aten._segment_reduce_backward.default)
def _segment_reduce_backward(grad: Tensor, output: Tensor, data: Tensor, reduce: str, *,
                             lengths: Optional[Tensor] = None, offsets: Optional[Tensor] = None, axis: int = 0,
                             initial: Any = None) -> Tensor:
    """Gradient of ``segment_reduce`` with respect to ``data`` (see the module docstring)."""
    if lengths is None and offsets is None or reduce not in ("sum", "mean", "max", "min", "prod"):
        return NotImplemented
    if not data.dtype.is_floating_point:
        return NotImplemented
    ax, seg, seg_len = _rows_to_segments(data, lengths, offsets)
    rest = list(data.shape[ax + 1:])
    idx = aten.expand.default(aten.view.default(seg, list(seg.shape) + [1] * len(rest)), list(data.shape))
    g = _on_rows(grad, ax, idx, 0)
    n_len = aten.view.default(seg_len, list(seg_len.shape) + [1] * len(rest))
    n_len = aten.expand.default(n_len, list(seg_len.shape) + rest)
    count = _on_rows(n_len, ax, idx, 0)                               # the row's segment's length
    inside = aten.gt.Scalar(count, 0)                                 # rows of a (non-empty) segment
    zero = aten.zeros_like.default(data)
    if reduce == "sum":
        res = g
    elif reduce == "mean":
        res = aten.div.Tensor(g, aten._to_copy.default(count, dtype=data.dtype))
    elif reduce in ("max", "min"):
        out = _on_rows(output, ax, idx, 0)
        hit = aten.logical_or.default(aten.isnan.default(data), aten.eq.Tensor(data, out))
        res = aten.where.self(hit, g, zero)
        # rows hitting the result per segment, back on the rows
        hits = aten.scatter_add.default(
            aten.full.default(list(output.shape[:ax]) + [int(output.shape[ax]) + 1] + rest, 0, dtype=data.dtype),
            ax, idx, aten._to_copy.default(hit, dtype=data.dtype))
        n = aten.gather.default(hits, ax, idx)
        share = aten.logical_and.default(aten.ge.Scalar(n, 2), aten.gt.Scalar(res, 0))
        res = aten.where.self(share, aten.div.Tensor(res, n), res)
    else:
        rows = int(data.shape[ax])
        inner = 1
        for d in rest:
            inner *= int(d)
        outer = data.numel() // max(rows * inner, 1)
        if outer * rows * rows * inner > MAX_PROD_PAIRS:
            return NotImplemented
        out = _on_rows(output, ax, idx, 0)
        plain = aten.div.Tensor(aten.mul.Tensor(g, out), data)
        # exclusive products: for row j, the product of the rows k != j of its segment
        xk = aten.unsqueeze.default(data, ax)                         # [B..., 1(j), R(k), inner...]
        sj = aten.view.default(seg, list(seg.shape) + [1])            # [B..., R(j), 1]
        sk = aten.unsqueeze.default(seg, -2)                          # [B..., 1, R(k)]
        jj = aten.view.default(aten.arange.start_step(0, rows, 1, dtype=torch.int64), [rows, 1])
        kk = aten.view.default(aten.arange.start_step(0, rows, 1, dtype=torch.int64), [1, rows])
        other = aten.logical_and.default(aten.eq.Tensor(sj, sk), aten.ne.Tensor(jj, kk))     # [B..., R, R]
        other = aten.view.default(other, list(other.shape) + [1] * len(rest))
        factors = aten.where.self(other, xk, aten.ones_like.default(xk))                    # [B..., R, R, inner]
        excl = aten.prod.dim_int(factors, ax + 1)
        if initial is not None:
            excl = aten.mul.Tensor(excl, initial)
        special = aten.logical_or.default(aten.isnan.default(data), aten.eq.Scalar(data, 0))
        res = aten.where.self(special, aten.mul.Tensor(g, excl), plain)
    return aten.where.self(inside, res, zero)
