# The backward of CPU flash attention as core ops, so attention trained through torch.compile / tn.jit traces.
"""Decomposition of ``aten._scaled_dot_product_flash_attention_for_cpu_backward``.

On the CPU, ``F.scaled_dot_product_attention`` (also inside ``nn.MultiheadAttention``
and so in every ``nn.Transformer*`` module) runs the fused flash kernel, and
AOTAutograd's backward graph then calls this backward op, which has no
decomposition in torch. Here it is written with the math of attention:
the probabilities ``P = softmax(q k^T s + mask)`` are recomputed (causal and
additive masks as the fused kernel applies them), then

    dV = P^T dO,   dS = P * (dO V^T - rowsum(dO * O)),   dQ = dS K s,   dK = dS^T Q s

computed in fp32 (low-precision inputs are widened; gradients are rounded back to
the inputs' dtypes). Dropout is refused (no decomposition: the random mask of the
forward is not known here). Rows the mask removes entirely get zero gradients.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .table import decomposition

aten = torch.ops.aten


@decomposition(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def flash_attention_cpu_backward(grad_out: Any, query: Any, key: Any, value: Any, out: Any, logsumexp: Any,
                                 dropout_p: float, is_causal: bool, *, attn_mask: Any = None,
                                 scale: Any = None) -> Any:
    """``(grad_query, grad_key, grad_value)`` of attention, recomputing the probabilities (no dropout)."""
    if dropout_p:
        return NotImplemented
    dtype = query.dtype
    q, k, v, o, g = (t.float() for t in (query, key, value, out, grad_out))
    s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if k.shape[-3] != q.shape[-3]:   # grouped-query attention: each key/value head serves several query heads
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    scores = torch.matmul(q, k.transpose(-2, -1)) * s
    L, S = q.shape[-2], k.shape[-2]
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(keep.logical_not(), float("-inf"))
    if attn_mask is not None:   # the fused kernel takes additive masks only (SDPA turns a boolean one into 0 / -inf)
        scores = scores + attn_mask.float()
    p = torch.softmax(scores, dim=-1)
    p = torch.where(torch.isnan(p), torch.zeros_like(p), p)      # rows with every key masked
    dv = torch.matmul(p.transpose(-2, -1), g)
    dp = torch.matmul(g, v.transpose(-2, -1))
    ds = p * (dp - (g * o).sum(dim=-1, keepdim=True))
    dq = torch.matmul(ds, k) * s
    dk = torch.matmul(ds.transpose(-2, -1), q) * s
    if key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        dk = dk.unflatten(-3, (key.shape[-3], rep)).sum(-3)
        dv = dv.unflatten(-3, (key.shape[-3], rep)).sum(-3)
    return dq.to(dtype), dk.to(key.dtype), dv.to(value.dtype)
