# Histograms (torch.histogram, torch.histogramdd) of float32 data as static programs: the edges from the data's range in the program, torch's bin search, a scatter_add.
"""``aten.histogram`` and the ``aten._histogramdd_*`` ops as decompositions.

Their result shapes are static (``bins`` or the given edges), so one program
computes them, as torch's CPU kernel does (``aten/src/ATen/native/Histogram.cpp``):

- the outer edges are ``range`` or each coordinate's minimum and maximum (``amin``/``amax`` in the program;
  ``(0, 1)`` for no data), an empty range widened by 0.5 each side; the equal-width edges are torch's
  ``linspace`` (``start + step * i`` up to half way, ``end - step * (steps - 1 - i)`` after, in float32);
- an element counts when every coordinate lies in ``[first edge, last edge]`` (NaN never does); its bin is
  ``upper_bound(edges, v) - 1`` (the last edge belongs to the last bin), the binary search unrolled to its
  ``log2`` steps so unsorted given edges bin as on the CPU; weights (or ones) are summed per bin by
  ``scatter_add``; with ``density`` divided by the total and by each bin's widths.

Data whose range is not finite makes torch raise; here the edges are then not finite and no element is
counted (tn.jit has no value read to raise from). Only float32 (data, weights, edges) decomposes; other
dtypes are refused as before.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from .table import decomposition

aten = torch.ops.aten
Tensor = torch.Tensor


def _f32(*ts: Any) -> bool:
    return all(t is None or (isinstance(t, Tensor) and t.dtype == torch.float32) for t in ts)


def _rows(x: Tensor) -> Tensor:
    """``x`` as ``[M, N]``: its last dim the coordinates (a 1-d or 0-d histogram input is one coordinate)."""
    return aten.reshape.default(x, [-1, int(x.shape[-1])]) if x.dim() >= 2 else aten.reshape.default(x, [-1, 1])


def _upper_bound(edges: Tensor, v: Tensor) -> Tensor:
    """``std::upper_bound(edges, edges + E, v) - edges`` per element of ``v`` (int64), as torch's histogram
    kernel searches (also on edges that are not sorted): the binary search
    unrolled to ``floor(log2 E) + 1`` steps, each element carrying its own ``first`` and ``count``."""
    e_n = int(edges.shape[0])
    first = aten.full.default(list(v.shape), 0, dtype=torch.int64)
    count = aten.full.default(list(v.shape), e_n, dtype=torch.int64)
    for _ in range(e_n.bit_length()):
        step = aten.div.Tensor_mode(count, 2, rounding_mode="floor")
        it = aten.add.Tensor(first, step)
        e = aten.index.Tensor(edges, [aten.clamp.default(it, 0, e_n - 1)])
        live = aten.gt.Scalar(count, 0)
        right = aten.logical_and.default(live, aten.logical_not.default(aten.lt.Tensor(v, e)))
        first = aten.where.self(right, aten.add.Tensor(it, 1), first)
        count = aten.where.self(live, aten.where.self(right, aten.sub.Tensor(aten.sub.Tensor(count, step), 1), step),
                                count)
    return first


def histogram_counts(x2: Tensor, edges: Sequence[Tensor], weight: Optional[Tensor], density: bool) -> Tensor:
    """torch's CPU histogram of the rows of ``x2`` ``[M, N]`` over the N edge sequences: elements outside
    ``[first edge, last edge]`` (and NaN) are skipped, the bin is ``upper_bound(edges, v) - 1`` (the last
    edge belongs to the last bin), weights (or ones) summed per bin; with ``density``, divided by the total
    and by each bin's widths. Also the device's padded histogram program (tn/device/data_dependent.py)."""
    m, n = int(x2.shape[0]), int(x2.shape[1])
    bins = [int(e.shape[0]) - 1 for e in edges]
    total = 1
    for b in bins:
        total *= b
    if m == 0:
        hist = aten.zeros.default(bins, dtype=x2.dtype)
        return aten.div.Tensor(hist, aten.sum.default(hist)) if density else hist
    keep = aten.full.default([m], True, dtype=torch.bool)
    flat = aten.full.default([m], 0, dtype=torch.int64)
    stride = total
    for d in range(n):
        e, e_n = edges[d], bins[d] + 1
        v = aten.select.int(x2, 1, d)
        inside = aten.logical_and.default(aten.ge.Tensor(v, aten.select.int(e, 0, 0)),
                                          aten.le.Tensor(v, aten.select.int(e, 0, e_n - 1)))
        keep = aten.logical_and.default(keep, inside)
        pos = aten.sub.Tensor(_upper_bound(e, v), 1)
        pos = aten.where.self(aten.eq.Scalar(pos, e_n - 1), aten.sub.Tensor(pos, 1), pos)
        stride //= bins[d]
        flat = aten.add.Tensor(flat, aten.mul.Tensor(aten.clamp.default(pos, 0, bins[d] - 1), stride))
    w = aten.reshape.default(weight, [m]) if weight is not None else aten.full.default([m], 1, dtype=x2.dtype)
    slot = aten.where.self(keep, flat, aten.full.default([], total, dtype=torch.int64))
    hist = aten.scatter_add.default(aten.zeros.default([total + 1], dtype=x2.dtype), 0, slot,
                                    aten.where.self(keep, w, aten.zeros.default([], dtype=x2.dtype)))
    hist = aten.view.default(aten.slice.Tensor(hist, 0, 0, total), bins)
    if density:
        hist = aten.div.Tensor(hist, aten.sum.default(hist))
        for d in range(n):
            widths = aten.sub.Tensor(aten.slice.Tensor(edges[d], 0, 1, bins[d] + 1),
                                     aten.slice.Tensor(edges[d], 0, 0, bins[d]))
            shape = [1] * n
            shape[d] = bins[d]
            hist = aten.div.Tensor(hist, aten.view.default(widths, shape))
    return hist


def _linspace(lo: Tensor, hi: Tensor, steps: int) -> Tensor:
    """torch's CPU ``linspace(lo, hi, steps)`` in float32 with 0-d tensor ends."""
    if steps == 1:
        return aten.view.default(lo, [1])
    step = aten.div.Tensor(aten.sub.Tensor(hi, lo), float(steps - 1))
    i = aten.arange.start_step(0, steps, 1, dtype=torch.float32)
    up = aten.add.Tensor(lo, aten.mul.Tensor(step, i))
    down = aten.sub.Tensor(hi, aten.mul.Tensor(step, aten.rsub.Scalar(i, float(steps - 1))))
    return aten.where.self(aten.lt.Scalar(i, float(steps // 2)), up, down)


def _equal_width_edges(x2: Tensor, bins: Sequence[int], rng: Optional[Sequence[float]]) -> Optional[List[Tensor]]:
    """torch's ``select_outer_bin_edges`` and ``linspace`` per coordinate; None for a malformed ``range``."""
    n = int(x2.shape[1])
    if rng is not None:
        if len(rng) != 2 * n:
            return None
        los, his = [], []
        for d in range(n):
            lo, hi = float(rng[2 * d]), float(rng[2 * d + 1])
            if lo == hi:
                lo, hi = lo - 0.5, hi + 0.5
            los.append(aten.full.default([], lo, dtype=torch.float32))
            his.append(aten.full.default([], hi, dtype=torch.float32))
    elif int(x2.shape[0]) > 0:
        mn, mx = aten.amin.default(x2, [0]), aten.amax.default(x2, [0])
        same = aten.eq.Tensor(mn, mx)
        mn = aten.where.self(same, aten.sub.Tensor(mn, 0.5), mn)
        mx = aten.where.self(same, aten.add.Tensor(mx, 0.5), mx)
        los = [aten.select.int(mn, 0, d) for d in range(n)]
        his = [aten.select.int(mx, 0, d) for d in range(n)]
    else:
        los = [aten.full.default([], 0.0, dtype=torch.float32)] * n
        his = [aten.full.default([], 1.0, dtype=torch.float32)] * n
    return [_linspace(lo, hi, int(b) + 1) for lo, hi, b in zip(los, his, bins)]


def _bins_ok(bins: Sequence[int]) -> bool:
    return all(int(b) > 0 for b in bins)


@decomposition(aten.histogram.bin_ct)
def _histogram_bin_ct(x, bins=100, *, range=None, weight=None, density=False):
    """``(hist, bin_edges)`` over ``bins`` equal-width bins of ``range`` or the data's range."""
    if not _f32(x, weight) or not _bins_ok([bins]):
        return NotImplemented
    x2 = aten.reshape.default(x, [-1, 1])
    edges = _equal_width_edges(x2, [bins], range)
    if edges is None:
        return NotImplemented
    return histogram_counts(x2, edges, weight, density), edges[0]


@decomposition(aten.histogram.bins_tensor)
def _histogram_bins_tensor(x, bins, *, weight=None, density=False):
    """``(hist, bin_edges)`` over the given edges."""
    if not _f32(x, weight, bins) or bins.dim() != 1 or int(bins.shape[0]) < 2:
        return NotImplemented
    return histogram_counts(aten.reshape.default(x, [-1, 1]), [bins], weight, density), aten.clone.default(bins)


@decomposition(aten._histogramdd_bin_edges.default)
def _histogramdd_bin_edges(x, bins, *, range=None, weight=None, density=False):
    """The equal-width edges of each coordinate."""
    if not _f32(x, weight) or x.dim() < 2 or not _bins_ok(bins) or len(bins) != int(x.shape[-1]):
        return NotImplemented
    edges = _equal_width_edges(_rows(x), bins, range)
    return NotImplemented if edges is None else edges


@decomposition(aten._histogramdd_from_bin_cts.default)
def _histogramdd_from_bin_cts(x, bins, *, range=None, weight=None, density=False):
    """The histogram over the equal-width edges of each coordinate."""
    if not _f32(x, weight) or x.dim() < 2 or not _bins_ok(bins) or len(bins) != int(x.shape[-1]):
        return NotImplemented
    x2 = _rows(x)
    edges = _equal_width_edges(x2, bins, range)
    return NotImplemented if edges is None else histogram_counts(x2, edges, weight, density)


@decomposition(aten._histogramdd_from_bin_tensors.default)
def _histogramdd_from_bin_tensors(x, bins, *, weight=None, density=False):
    """The histogram over the given edges of each coordinate."""
    if (not _f32(x, weight, *bins) or x.dim() < 2 or len(bins) != int(x.shape[-1])
            or any(b.dim() != 1 or int(b.shape[0]) < 2 for b in bins)):
        return NotImplemented
    return histogram_counts(_rows(x), list(bins), weight, density)
