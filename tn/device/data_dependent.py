# Data-dependent ops of the neuron device (nonzero, masked_select, unique, equal, masks, histograms) as device programs.
"""Ops whose result size depends on the values, run on the NeuronCore.

A one-op program cannot have a result whose shape depends on the data: the
compiler sizes every buffer ahead of time. The device door runs eagerly,
though, so it can do what CUDA and torch_xla do: run the computation as a
program that makes a *padded* result (as large as it can ever be) plus the
count of valid entries, read back only that count (one scalar, through
``.item()``: a counted device-to-host read), and return the padded result
narrowed to the count (shrunk in place: the leading rows of a contiguous
tensor are exactly the narrowed result, so no copy is made; ``nonzero``
copies its rows into torch's column-major layout, strides ``(1, k)``).

The padded computations are ops of the ``tn_device`` namespace with
CompositeImplicitAutograd kernels written in aten ops that have no
data-dependent shapes (prefix sums place the selected elements, a scatter
writes them); :func:`tn.device.eager.run_op` traces each as one cached
device program like any other op (and an adaptive eager window queues it).
Results, dtypes and element order are torch's (indices int64, row-major
order, unique values sorted as torch's CPU kernel always sorts them).

Covered, for real and integer tensors (complex and other corner cases go to
the counted host fallback, which words torch's own errors):

* ``nonzero`` (and through it ``argwhere``, ``nonzero(as_tuple=True)``),
* ``masked_select`` (broadcasting mask; its gradient is torch's
  ``masked_scatter``, which the device already runs),
* ``equal``: one program reducing to a bool, read back (``cov`` and
  ``corrcoef`` call it),
* ``_unique2`` (``torch.unique``), ``_unique``, ``unique_dim``, ``unique_consecutive``
  (flat and along a dim: the slices are compared pairwise, so a dim of up to
  :data:`PAIRWISE_MAX` slices; bool tensors flat only, sorted as 0/1),
* ``_index_put_impl_`` (``index_put``, ``x[idx] = v``, ``x[idx] += v`` with
  ``accumulate``) and ``index.Tensor_out`` (``x[mask]``, the gradient of
  ``index_put``): boolean indices become integer ones through the device
  ``nonzero`` (as torch does), then ``index_put_`` / ``index`` is one device
  program. CPU index tensors are moved to the device, as CUDA accepts them.
  Accumulating into fp16/bf16 stays on the host (torch adds repeated
  indices one by one in that dtype; the device's sums round differently).
* ``histogram`` (bin count or edges) and ``histogramdd``
  (``_histogramdd_bin_edges``, ``_histogramdd_from_bin_cts``,
  ``_histogramdd_from_bin_tensors``), float32: their shapes are known, but
  the equal-width edges come from the data's range, which one program
  computes and the host reads back (2 scalars a dimension, as torch's CPU
  kernel reads them) to make the edges with the device ``linspace``; the
  counting is one program: torch's ``upper_bound`` bin search unrolled to
  ``log2`` steps (so unsorted edges bin as on the CPU), a ``scatter_add`` of
  the weights, the density normalisation.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..ops.histogram import histogram_counts
from . import eager
from .allocator import resize_tensor

__all__ = ["kernels", "define_ops", "PAIRWISE_MAX"]

aten = torch.ops.aten
_NS = "tn_device"
_LIBS: list = []

#: Largest number of slices ``unique(dim=...)`` / ``unique_consecutive(dim=...)`` compares pairwise on the
#: device (an L x L x M comparison); longer dims run on the host.
PAIRWISE_MAX = 1024

_SCHEMAS = {
    "nonzero_padded": "nonzero_padded(Tensor self) -> (Tensor, Tensor)",
    "masked_select_padded": "masked_select_padded(Tensor self, Tensor mask) -> (Tensor, Tensor)",
    "equal_all": "equal_all(Tensor self, Tensor other) -> Tensor",
    "unique_padded": "unique_padded(Tensor self) -> (Tensor, Tensor, Tensor, Tensor)",
    "unique_consecutive_padded": "unique_consecutive_padded(Tensor self) -> (Tensor, Tensor, Tensor, Tensor)",
    "unique_dim_padded":
        "unique_dim_padded(Tensor self, int dim, bool consecutive) -> (Tensor, Tensor, Tensor, Tensor)",
    "histogramdd_counts": "histogramdd_counts(Tensor self, Tensor[] edges, Tensor? weight, bool density) -> Tensor",
    "aminmax_columns": "aminmax_columns(Tensor self) -> Tensor",
}


# --------------------------------------------------------------------------- padded computations (traced)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _i64(v: int) -> torch.Tensor:
    return aten.full.default([], v, dtype=torch.int64)


def _place(keep: torch.Tensor, rank: torch.Tensor, values: torch.Tensor, n: int, fill: Any) -> torch.Tensor:
    """The 1-d ``values`` where ``keep``, moved to their ``rank`` (a prefix count), then ``fill``: ``n`` long.
    The others are written to a spare slot past the end, dropped."""
    slot = aten.where.self(keep, rank, _i64(n))
    buf = aten.full.default([n + 1], fill, dtype=values.dtype)
    return aten.slice.Tensor(aten.scatter.src(buf, 0, slot, values), 0, 0, n)


def _nonzero_padded(x):
    """``nonzero_static(x, size=numel)`` (rows past the count are -1) and the count of non-zeros."""
    n = x.numel()
    count = aten.sum.dim_IntList(aten.view.default(aten.ne.Scalar(x, 0), [-1]), [0], False, dtype=torch.int64)
    return aten.nonzero_static.default(x, size=n, fill_value=-1), count


def _masked_select_padded(x, mask):
    """The elements of ``x`` where ``mask`` (both broadcast), in row-major order, then zeros; and their count."""
    shape = list(torch.broadcast_shapes(tuple(x.shape), tuple(mask.shape)))
    n = _numel(shape)
    m = aten.reshape.default(aten.expand.default(mask, shape), [-1])
    v = aten.reshape.default(aten.expand.default(x, shape), [-1])
    rank = aten.sub.Tensor(aten.cumsum.default(m, 0, dtype=torch.int64), 1)
    count = aten.sum.dim_IntList(m, [0], False, dtype=torch.int64)
    return _place(m, rank, v, n, 0), count


def _equal_all(a, b):
    """Whether every element of ``a`` equals ``b``'s (same shapes; NaN is unequal, as in torch.equal)."""
    return aten.all.default(aten.eq.Tensor(a, b))


def _runs(new: torch.Tensor, n: int):
    """For flags ``new`` (an element starts a new group): each element's group index, the group count and the
    size of each group (padded to ``n``)."""
    rank = aten.sub.Tensor(aten.cumsum.default(new, 0, dtype=torch.int64), 1)
    count = aten.sum.dim_IntList(new, [0], False, dtype=torch.int64)
    # where each group starts (then n): a group's size is the next start minus its own
    starts = _place(new, rank, aten.arange.start_step(0, n, 1, dtype=torch.int64), n, n)
    nxt = aten.cat.default([aten.slice.Tensor(starts, 0, 1, n), aten.full.default([1], n, dtype=torch.int64)])
    return rank, count, aten.sub.Tensor(nxt, starts)


def _starts(flat: torch.Tensor, n: int) -> torch.Tensor:
    """True where an element differs from the one before it (and for the first)."""
    if n == 1:
        return aten.full.default([1], True, dtype=torch.bool)
    diff = aten.ne.Tensor(aten.slice.Tensor(flat, 0, 1, n), aten.slice.Tensor(flat, 0, 0, n - 1))
    return aten.cat.default([aten.full.default([1], True, dtype=torch.bool), diff])


def _unique_padded(x):
    """``torch.unique(x, sorted=True)`` padded: the sorted distinct values, each element's index among them
    (shaped as ``x``), each value's count, and the number of distinct values."""
    n = x.numel()
    flat = aten.reshape.default(x, [-1])
    if x.dtype == torch.bool:   # the device sorts numbers: False/True as 0/1
        flat = aten._to_copy.default(flat, dtype=torch.int32)
    s, perm = aten.sort.stable(flat, stable=True, dim=0)
    new = _starts(s, n)
    rank, count, counts = _runs(new, n)
    values = _place(new, rank, s, n, 0)
    if x.dtype == torch.bool:
        values = aten._to_copy.default(values, dtype=torch.bool)
    inverse = aten.scatter.src(aten.full.default([n], 0, dtype=torch.int64), 0, perm, rank)
    return values, aten.view.default(inverse, list(x.shape)), counts, count


def _unique_consecutive_padded(x):
    """``torch.unique_consecutive(x)`` padded (flattened): as :func:`_unique_padded` without the sort."""
    n = x.numel()
    flat = aten.reshape.default(x, [-1])
    if x.dtype == torch.bool:
        flat = aten._to_copy.default(flat, dtype=torch.int32)
    new = _starts(flat, n)
    rank, count, counts = _runs(new, n)
    values = _place(new, rank, flat, n, 0)
    if x.dtype == torch.bool:
        values = aten._to_copy.default(values, dtype=torch.bool)
    return values, aten.view.default(rank, list(x.shape)), counts, count


def _unique_dim_padded(x, dim, consecutive):
    """Distinct slices of ``x`` along ``dim`` (sorted lexicographically unless ``consecutive``), padded: the
    slices with ``dim`` moved to the front (row-major, as torch lays its result out), each slice's group index,
    each group's size, and the number of groups. Slices are compared pairwise (``L x L x M``)."""
    moved = aten.movedim.int(x, dim, 0)
    L = int(moved.shape[0])
    rest = [int(s) for s in moved.shape[1:]]
    y = aten.reshape.default(moved, [L, -1])
    if consecutive:
        if L == 1:
            new = aten.full.default([1], True, dtype=torch.bool)
        else:
            d = aten.any.dim(aten.ne.Tensor(aten.slice.Tensor(y, 0, 1, L), aten.slice.Tensor(y, 0, 0, L - 1)), 1)
            new = aten.cat.default([aten.full.default([1], True, dtype=torch.bool), d])
        rank, count, counts = _runs(new, L)
    else:
        a = aten.unsqueeze.default(y, 1)   # row i
        b = aten.unsqueeze.default(y, 0)   # row j
        diff = aten.ne.Tensor(a, b)                                        # [i, j, c]
        seen = aten.cumsum.default(diff, 2, dtype=torch.int64)
        first_diff = aten.logical_and.default(diff, aten.eq.Scalar(aten.sub.Tensor(seen, diff.to(torch.int64)), 0))
        # row j sorts before row i: at their first differing column, j's element is the smaller
        less = aten.any.dim(aten.logical_and.default(first_diff, aten.lt.Tensor(b, a)), 2)
        same = aten.logical_not.default(aten.any.dim(diff, 2))
        earlier = aten.tril.default(aten.full.default([L, L], True, dtype=torch.bool), -1)   # j < i
        first = aten.logical_not.default(aten.any.dim(aten.logical_and.default(same, earlier), 1))
        rank = aten.sum.dim_IntList(aten.logical_and.default(less, aten.unsqueeze.default(first, 0)), [1], False,
                                    dtype=torch.int64)
        count = aten.sum.dim_IntList(first, [0], False, dtype=torch.int64)
        slots = aten.arange.start_step(0, L, 1, dtype=torch.int64)
        member = aten.eq.Tensor(aten.unsqueeze.default(slots, 1), aten.unsqueeze.default(rank, 0))   # [u, i]
        counts = aten.sum.dim_IntList(member, [1], False, dtype=torch.int64)
        new = first
    # the row of each group: the group's first member (sorted: its row with first[j] and rank[j] == u)
    pick = aten.logical_and.default(aten.eq.Tensor(aten.unsqueeze.default(aten.arange.start_step(
        0, L, 1, dtype=torch.int64), 1), aten.unsqueeze.default(rank, 0)), aten.unsqueeze.default(new, 0))
    src = aten.sum.dim_IntList(aten.mul.Tensor(pick.to(torch.int64), aten.unsqueeze.default(
        aten.arange.start_step(0, L, 1, dtype=torch.int64), 0)), [1], False)
    values = aten.reshape.default(aten.index_select.default(y, 0, src), [L] + rest)
    return values, rank, counts, count


def _aminmax_columns(x):
    """The minimum and maximum of each column of ``x`` (M, N), stacked (2, N)."""
    return aten.stack.default([aten.amin.default(x, [0]), aten.amax.default(x, [0])])


_IMPLS = {"histogramdd_counts": histogram_counts, "aminmax_columns": _aminmax_columns,
          "nonzero_padded": _nonzero_padded, "masked_select_padded": _masked_select_padded,
          "equal_all": _equal_all, "unique_padded": _unique_padded,
          "unique_consecutive_padded": _unique_consecutive_padded, "unique_dim_padded": _unique_dim_padded}


def define_ops() -> None:
    """Define the ``tn_device`` padded ops (idempotent)."""
    if _LIBS:
        return
    lib = torch.library.Library(_NS, "DEF")
    for name, schema in _SCHEMAS.items():
        lib.define(schema)
        lib.impl(name, _IMPLS[name], "CompositeImplicitAutograd")
    _LIBS.append(lib)


def _op(name: str):
    return getattr(getattr(torch.ops, _NS), name).default


# --------------------------------------------------------------------------- device kernels


def _count(t: torch.Tensor) -> int:
    """The count a padded program computed: one scalar read back (``.item()``, counted like any)."""
    return int(t.item())


def _shrink(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """A fresh contiguous padded result narrowed in place to ``shape`` (its leading elements)."""
    return resize_tensor(t, shape) if tuple(t.shape) != tuple(shape) else t


def _native_dtype(*ts: torch.Tensor) -> bool:
    """Real tensors the device computes with: integers, bool and fp32/fp16/bf16 (not complex, not float64)."""
    return all(t.dtype in _NATIVE for t in ts)


_NATIVE = frozenset((torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
                     torch.uint8, torch.bool))


def _on_device(*ts: Any) -> bool:
    return all(type(t) is torch.Tensor and t.device.type == "neuron" for t in ts)


def _empty(shape: Sequence[int], dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device=like.device)


def _nonzero(self):
    """aten::nonzero on the device: a padded program, then the count read back."""
    if not (_on_device(self) and _native_dtype(self)):
        return eager.fallback(aten.nonzero.default, self)
    if self.numel() == 0:
        return torch.empty_strided((0, self.dim()), (1, 0), dtype=torch.int64, device=self.device)
    padded, count = eager.run_op(_op("nonzero_padded"), (self,), {})
    k = _count(count)
    # torch's layout (CPU and CUDA): column-major, strides (1, k)
    out = torch.empty_strided((k, self.dim()), (1, k), dtype=torch.int64, device=self.device)
    if out.numel():
        out.copy_(_shrink(padded, (k, self.dim())))
    return out


def _masked_select(self, mask):
    """aten::masked_select on the device (mask broadcast with the input)."""
    if not (_on_device(self, mask) and mask.dtype == torch.bool and _native_dtype(self)):
        return eager.fallback(aten.masked_select.default, self, mask)
    try:
        shape = torch.broadcast_shapes(tuple(self.shape), tuple(mask.shape))
    except RuntimeError:
        return eager.fallback(aten.masked_select.default, self, mask)   # torch's own error
    if _numel(shape) == 0:
        return _empty((0,), self.dtype, self)
    padded, count = eager.run_op(_op("masked_select_padded"), (self, mask), {})
    return _shrink(padded, (_count(count),))


def _equal(self, other):
    """aten::equal on the device: one program reducing to a bool, read back."""
    if not (_on_device(self, other) and _native_dtype(self, other)):
        return eager.fallback(aten.equal.default, self, other)
    if tuple(self.shape) != tuple(other.shape):
        return False
    if self.numel() == 0:
        return True
    return bool(eager.run_op(_op("equal_all"), (self, other), {}).item())


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _empty_int(like: torch.Tensor) -> torch.Tensor:
    return _empty((0,), torch.int64, like)


def _unique2(self, sorted=True, return_inverse=False, return_counts=False):
    """aten::_unique2 (``torch.unique`` without ``dim``): sorted, as torch's CPU kernel always returns it."""
    if not (_on_device(self) and _native_dtype(self)):
        return eager.fallback(aten._unique2.default, self, sorted, return_inverse, return_counts)
    if self.numel() == 0:
        return (_empty((0,), self.dtype, self), _empty(self.shape if return_inverse else (0,), torch.int64, self),
                _empty_int(self))
    values, inverse, counts, count = eager.run_op(_op("unique_padded"), (self,), {})
    k = _count(count)
    return (_shrink(values, (k,)), inverse if return_inverse else _empty_int(self),
            _shrink(counts, (k,)) if return_counts else _empty_int(self))


def _unique(self, sorted=True, return_inverse=False):
    """aten::_unique (the older form, without counts; index_fill's gradient calls it)."""
    if not (_on_device(self) and _native_dtype(self)):
        return eager.fallback(aten._unique.default, self, sorted, return_inverse)
    values, inverse, _ = _unique2(self, sorted, return_inverse, False)
    return values, inverse


def _unique_dim_common(op, self, dim: int, consecutive: bool, return_inverse: bool, return_counts: bool,
                       host_args: tuple):
    nd = self.dim()
    if nd == 0 or not -nd <= dim < nd:
        return eager.fallback(op, *host_args)   # torch's error
    d = dim % nd
    L = int(self.shape[d])
    if self.numel() == 0 or L > PAIRWISE_MAX:
        # empty slices: torch refuses unless the selected dim is the empty one (the host words it)
        if L == 0 and self.numel() == 0:
            return (_empty(self.shape, self.dtype, self), _empty_int(self), _empty_int(self))
        return eager.fallback(op, *host_args)
    values, inverse, counts, count = eager.run_op(_op("unique_dim_padded"), (self, d, bool(consecutive)), {})
    k = _count(count)
    shape = [k] + [int(s) for i, s in enumerate(self.shape) if i != d]
    values = aten.movedim.int(_shrink(values, shape), 0, d)
    return (values, inverse if return_inverse else _empty_int(self),
            _shrink(counts, (k,)) if return_counts else _empty_int(self))


def _unique_dim(self, dim, sorted=True, return_inverse=False, return_counts=False):
    """aten::unique_dim (``torch.unique(x, dim=d)``): distinct slices in lexicographic order."""
    args = (self, dim, sorted, return_inverse, return_counts)
    if not (_on_device(self) and _native_dtype(self)) or self.dtype == torch.bool:
        return eager.fallback(aten.unique_dim.default, *args)
    return _unique_dim_common(aten.unique_dim.default, self, int(dim), False, return_inverse, return_counts, args)


def _unique_consecutive(self, return_inverse=False, return_counts=False, dim=None):
    """aten::unique_consecutive, flat or along ``dim``."""
    op = aten.unique_consecutive.default
    args = (self, return_inverse, return_counts, dim)
    if not (_on_device(self) and _native_dtype(self)) or (self.dtype == torch.bool and dim is not None):
        return eager.fallback(op, *args)
    if dim is not None:
        return _unique_dim_common(op, self, int(dim), True, return_inverse, return_counts, args)
    if self.numel() == 0:
        return (_empty((0,), self.dtype, self), _empty(self.shape if return_inverse else (0,), torch.int64, self),
                _empty_int(self))
    values, inverse, counts, count = eager.run_op(_op("unique_consecutive_padded"), (self,), {})
    k = _count(count)
    return (_shrink(values, (k,)), inverse if return_inverse else _empty_int(self),
            _shrink(counts, (k,)) if return_counts else _empty_int(self))


def _long_indices(self: torch.Tensor, indices) -> Optional[List[Optional[torch.Tensor]]]:
    """``indices`` (of ``self``) with CPU index tensors moved to the device and each boolean mask replaced by the
    integer indices of its ``True`` elements (the device ``nonzero``, one count read back), as torch's
    ``expandTensors`` does; None for what the host should word or do (wrong mask shapes, 0-d masks, uint8 masks,
    index dtypes torch refuses)."""
    out: List[Optional[torch.Tensor]] = []
    pos = 0
    for idx in indices:
        if idx is None:
            out.append(None)
            pos += 1
            continue
        if type(idx) is not torch.Tensor:
            return None
        if idx.device.type == "cpu":
            idx = idx.to(self.device)     # CUDA accepts CPU index tensors here; so does the device
        if idx.device != self.device:
            return None
        if idx.dtype == torch.bool:
            k = idx.dim()
            if k == 0 or tuple(idx.shape) != tuple(self.shape[pos:pos + k]):
                return None
            nz = _nonzero(idx)
            out.extend(aten.select.int(nz, 1, j) for j in range(k))
            pos += k
            continue
        if idx.dtype not in (torch.int64, torch.int32):
            return None
        out.append(idx)
        pos += 1
    return out


def _index_put_impl(self, indices, values, accumulate=False, unsafe=False):
    """aten::_index_put_impl_ (``index_put``, ``x[idx] = v``): boolean indices become integer ones through
    the device ``nonzero`` (as torch's ``expandTensors`` does), then one ``index_put_`` device program."""
    op = aten._index_put_impl_.default
    args = (self, indices, values, accumulate, unsafe)
    if not (_on_device(self) and type(values) is torch.Tensor) or self.is_complex() or values.is_complex():
        return eager.fallback(op, *args)
    if accumulate and self.dtype.is_floating_point and self.dtype != torch.float32:
        # torch's CPU kernel adds repeated indices one by one in the tensor's dtype; the device's sums round
        # differently, 2 bf16 ulps off where the CPU is 1 (OpInfo _unsafe_masked_index_put_accumulate): host
        return eager.fallback(op, *args)
    out = _long_indices(self, indices)
    if out is None:
        return eager.fallback(op, *args)
    if values.device.type == "cpu" and values.dim() == 0:
        values = values.to(self.device)
    if any(i is not None and i.numel() == 0 for i in out):
        # nothing is selected: self stays as it is, once torch's meta kernel has checked the shapes
        try:
            aten.index_put_.default(_meta(self), [None if i is None else _meta(i) for i in out], _meta(values),
                                    bool(accumulate))
        except RuntimeError:
            return eager.fallback(op, *args)   # torch's own error
        return self
    eager.run_op(aten.index_put_.default, (self, out, values, bool(accumulate)), {})
    return self


def _index_out(self, indices, *, out):
    """aten::index.Tensor_out (``x[mask]``, ``x[idx]``: torch's ``index`` sizes ``out`` and calls it): boolean
    masks become integer indices through the device ``nonzero``; the gather is one device program."""
    op = aten.index.Tensor_out
    if not any(type(i) is torch.Tensor and i.dtype == torch.bool for i in indices) or not _on_device(self):
        return eager.fallback(op, self, indices, out=out)
    idx = _long_indices(self, indices)
    if idx is None:
        return eager.fallback(op, self, indices, out=out)
    return eager.run_op(op, (self, idx), {"out": out})


def _hist_native(x: torch.Tensor, weight, bins_tensors=()) -> bool:
    ts = [x] + ([weight] if weight is not None else []) + list(bins_tensors)
    return _on_device(*ts) and all(t.dtype == torch.float32 for t in ts)


def _outer_edges(x2: torch.Tensor, rng) -> Optional[List[tuple]]:
    """torch's ``select_outer_bin_edges``: ``rng`` (the ``range`` argument), else each column's minimum and
    maximum (one device program, read back: they place the bins), an empty range widened by 0.5 each side; None
    when they are not finite or in order (the host words torch's error)."""
    N = int(x2.shape[1])
    if rng is not None:
        if len(rng) != 2 * N:
            return None
        pairs = [(float(rng[2 * d]), float(rng[2 * d + 1])) for d in range(N)]
    elif x2.numel() > 0:
        mm = eager.run_op(_op("aminmax_columns"), (x2,), {}).cpu()   # 2N scalars, counted as a copy to the host
        pairs = [(float(mm[0, d]), float(mm[1, d])) for d in range(N)]
    else:
        pairs = [(0.0, 1.0)] * N
    out = []
    for lo, hi in pairs:
        if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi:
            return None
        out.append((lo - 0.5, hi + 0.5) if lo == hi else (lo, hi))
    return out


def _linspace_edges(pairs, bins, like: torch.Tensor) -> List[torch.Tensor]:
    return [torch.linspace(lo, hi, int(b) + 1, dtype=like.dtype, device=like.device) for (lo, hi), b in
            zip(pairs, bins)]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as (M, N): its last dim the coordinates."""
    return x.reshape(-1, x.shape[-1]) if x.dim() >= 1 else x.reshape(1, 1)


def _hist_counts(x2: torch.Tensor, edges: List[torch.Tensor], weight, density: bool) -> torch.Tensor:
    if weight is not None:
        weight = weight.reshape(-1)
    if x2.shape[0] == 0:   # no element: zeros (density divides 0 by 0, as torch does)
        hist = torch.zeros([int(e.shape[0]) - 1 for e in edges], dtype=x2.dtype, device=x2.device)
        return hist / hist.sum() if density else hist
    return eager.run_op(_op("histogramdd_counts"), (x2, list(edges), weight, bool(density)), {})


def _histogram_bin_ct(self, bins=100, *, range=None, weight=None, density=False):
    """aten::histogram.bin_ct: equal-width bins over ``range`` or the data's range."""
    op = aten.histogram.bin_ct
    kw = {"range": range, "weight": weight, "density": density}
    x2 = self.reshape(-1, 1)
    if not _hist_native(self, weight) or int(bins) <= 0 or (weight is not None and weight.numel() != self.numel()):
        return eager.fallback(op, self, bins, **kw)
    pairs = _outer_edges(x2, range)
    if pairs is None:
        return eager.fallback(op, self, bins, **kw)
    edges = _linspace_edges(pairs, [bins], self)
    return _hist_counts(x2, edges, weight, density), edges[0]


def _histogram_bins_tensor(self, bins, *, weight=None, density=False):
    """aten::histogram.bins_tensor: the given edges."""
    op = aten.histogram.bins_tensor
    if (not _hist_native(self, weight, [bins]) or bins.dim() != 1 or bins.numel() < 1
            or (weight is not None and weight.numel() != self.numel())):
        return eager.fallback(op, self, bins, weight=weight, density=density)
    edges = bins.contiguous()
    return _hist_counts(self.reshape(-1, 1), [edges], weight, density), edges.clone()


def _dd_ok(self, bins, weight) -> bool:
    return (_hist_native(self, weight) and self.dim() >= 2 and len(bins) == self.shape[-1]
            and all(int(b) > 0 for b in bins)
            and (weight is None or tuple(weight.shape) == tuple(self.shape[:-1])))


def _histogramdd_bin_edges(self, bins, *, range=None, weight=None, density=False):
    """aten::_histogramdd_bin_edges: equal-width edges per dimension."""
    op = aten._histogramdd_bin_edges.default
    pairs = _outer_edges(_rows(self), range) if _dd_ok(self, bins, weight) else None
    if pairs is None:
        return eager.fallback(op, self, bins, range=range, weight=weight, density=density)
    return _linspace_edges(pairs, bins, self)


def _histogramdd_from_bin_cts(self, bins, *, range=None, weight=None, density=False):
    """aten::_histogramdd_from_bin_cts: the histogram over those equal-width edges."""
    op = aten._histogramdd_from_bin_cts.default
    pairs = _outer_edges(_rows(self), range) if _dd_ok(self, bins, weight) else None
    if pairs is None:
        return eager.fallback(op, self, bins, range=range, weight=weight, density=density)
    return _hist_counts(_rows(self), _linspace_edges(pairs, bins, self), weight, density)


def _histogramdd_from_bin_tensors(self, bins, *, weight=None, density=False):
    """aten::_histogramdd_from_bin_tensors: the histogram over the given edges."""
    op = aten._histogramdd_from_bin_tensors.default
    if not (_dd_ok(self, [max(int(b.numel()) - 1, 1) for b in bins], weight) and _hist_native(self, None, bins)
            and all(b.dim() == 1 and b.numel() >= 1 for b in bins)):
        return eager.fallback(op, self, bins, weight=weight, density=density)
    return _hist_counts(_rows(self), [b.contiguous() for b in bins], weight, density)



def kernels() -> Dict[str, Any]:
    """The device kernels of this module by aten overload name (for :func:`tn.device.aten.register`); defines
    the padded ops first."""
    define_ops()
    return {"nonzero": _nonzero, "masked_select": _masked_select, "equal": _equal, "_unique2": _unique2,
            "_unique": _unique,
            "unique_dim": _unique_dim, "unique_consecutive": _unique_consecutive,
            "_index_put_impl_": _index_put_impl, "index.Tensor_out": _index_out,
            "histogram.bin_ct": _histogram_bin_ct, "histogram.bins_tensor": _histogram_bins_tensor,
            "_histogramdd_bin_edges": _histogramdd_bin_edges, "_histogramdd_from_bin_cts": _histogramdd_from_bin_cts,
            "_histogramdd_from_bin_tensors": _histogramdd_from_bin_tensors}
