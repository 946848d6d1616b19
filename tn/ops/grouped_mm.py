# Grouped matmul (the expert layers of mixture-of-experts models) as core ops, so MoE models compile for the chip.
"""Decompositions of grouped matmul: ``aten._grouped_mm`` and Hugging Face's fallback custom ops.

A grouped matmul multiplies consecutive groups of rows (or of the contracted
axis) by one matrix each; the group boundaries are cumulative offsets held in a
tensor (``offs``, one per group), i.e. data the program computes (MoE routing:
sort the token-expert pairs by expert, count them, ``cumsum``). A traced program
has static shapes, so the groups are expressed densely: each position gets its
group id (the number of offsets at or below it; past the last offset it belongs
to no group) and a 0/1 one-hot ``[positions, groups]``, and

* ``a[M, K] @ b[G, K, N]``, groups of rows: ``(a[:, None, :] * onehot[:, :, None]).reshape(M, G*K)
  @ b.reshape(G*K, N)`` -- one matmul, every row meets only its own group's weight (the other
  products are exact zeros);
* ``a[M, K] @ b[K, N]``, groups along ``K`` (the weight gradient): ``(a * onehot_K[g]) @ b`` per
  group, one batched matmul ``[G, M, N]``;
* ``a[G, M, K] @ b[K, N]``, groups of columns: ``(a @ b) * onehot_N`` summed over groups;
* ``a[G, M, K] @ b[G, K, N]``: a batched matmul.

This costs ``G`` times the multiply-adds of the real grouped kernel (the zero
blocks are computed), which is what a static program can do without
data-dependent tiling; the results are exact (the zero terms add nothing; in
bf16 the 0/1 masks are exact and the matmul accumulates in fp32). Rows past
the last offset are zero (the kernels leave them unspecified; HF's fallback
writes zeros).

Hugging Face Transformers routes experts through ``torch.ops.transformers.
grouped_mm_fallback`` (and its backward op) when ``torch._grouped_mm`` cannot
be used (e.g. fp32 weights under compilation); those custom ops are registered
by name (they exist only once transformers is imported) and decomposed the
same way, so they trace to core ops instead of an opaque host op.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..errors import ArgumentValueError
from .table import decomposition, decomposition_by_name

aten = torch.ops.aten


def group_one_hot(offs: Any, n: int, dtype: torch.dtype) -> Any:
    """``[n, G]`` 0/1 of ``dtype``: position ``i`` is in group ``g`` when ``offs[g-1] <= i < offs[g]``
    (``offs`` cumulative, ``G = len(offs)``); positions at or past ``offs[-1]`` are in no group."""
    pos = torch.arange(n, device=offs.device, dtype=torch.int64)
    group = (pos[:, None] >= offs.to(torch.int64)[None, :]).sum(-1)            # [n], G past the last offset
    ids = torch.arange(offs.shape[0], device=offs.device, dtype=torch.int64)
    return (group[:, None] == ids[None, :]).to(dtype)


def grouped_mm_dense(a: Any, b: Any, offs: Optional[Any] = None, out_dtype: Optional[torch.dtype] = None) -> Any:
    """``torch._grouped_mm(a, b, offs=offs, out_dtype=out_dtype)`` in dense core ops (see the module docstring for
    the four shape modes)."""
    dtype = a.dtype
    if a.dim() == 3 and b.dim() == 3:
        out = torch.bmm(a, b)
    elif offs is None:
        raise ArgumentValueError("grouped_mm: offs is required unless both operands are 3-d")
    elif a.dim() == 2 and b.dim() == 3:           # groups of rows of a, one [K, N] matrix each
        m, k = a.shape
        g, _, n = b.shape
        hot = group_one_hot(offs, m, dtype)                                     # [M, G]
        spread = (a[:, None, :] * hot[:, :, None]).reshape(m, g * k)            # row i's K values in its group's slot
        out = torch.matmul(spread, b.reshape(g * k, n))
    elif a.dim() == 2 and b.dim() == 2:           # groups along the contracted axis: one [M, N] result per group
        hot = group_one_hot(offs, a.shape[1], dtype)                            # [K, G]
        out = torch.matmul(a[None, :, :] * hot.t()[:, None, :], b)             # [G, M, N]
    elif a.dim() == 3 and b.dim() == 2:           # groups of columns of b, one [M, K] matrix each
        hot = group_one_hot(offs, b.shape[1], dtype)                            # [N, G]
        out = (torch.matmul(a, b) * hot.t()[:, None, :]).sum(0)                 # [M, N]
    else:
        raise ArgumentValueError(f"grouped_mm: operands must be 2-d or 3-d, got {a.dim()}-d and {b.dim()}-d")
    return out.to(out_dtype) if out_dtype is not None else out


@decomposition(aten._grouped_mm.default)
def _grouped_mm(mat_a: Any, mat_b: Any, offs: Any = None, bias: Any = None, out_dtype: Any = None) -> Any:
    """``aten._grouped_mm``: :func:`grouped_mm_dense` (a bias is refused, as torch's kernels do)."""
    if bias is not None:
        return NotImplemented
    return grouped_mm_dense(mat_a, mat_b, offs, out_dtype)


@decomposition_by_name("transformers::grouped_mm_fallback")
def _hf_grouped_mm_fallback(input: Any, weight: Any, offs: Any) -> Any:
    """HF's ``grouped_mm_fallback(input[S, K], weight[G, K, N], offs)``: rows grouped by ``offs``."""
    return grouped_mm_dense(input, weight, offs).to(input.dtype)


@decomposition_by_name("transformers::grouped_mm_fallback_backward")
def _hf_grouped_mm_fallback_backward(input: Any, weight: Any, offs: Any, grad_output: Any) -> Any:
    """HF's backward op: ``(grad_input, grad_weight)`` of :func:`_hf_grouped_mm_fallback`."""
    grad_input = grouped_mm_dense(grad_output, weight.transpose(-2, -1), offs)           # [S, K]
    grad_weight = grouped_mm_dense(input.transpose(0, 1), grad_output, offs)           # [G, K, N]
    return grad_input.to(input.dtype), grad_weight.to(weight.dtype)
