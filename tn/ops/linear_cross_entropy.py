# torch's chunked linear + cross-entropy custom op (torch_nn::_linear_cross_entropy_batch_chunked) in core ops.
"""``F.linear_cross_entropy``'s fused op, traced instead of run on the host.

torch's chunked form of ``cross_entropy(linear(input, W, b), target)`` is a ``torch.library`` custom op,
``torch_nn::_linear_cross_entropy_batch_chunked``, that returns the scalar loss and, when asked at trace time
(``compute_*_grad``), the gradients of the loss with respect to the input, the weight and the bias, computed
in its forward (its backward scales them by the upstream gradient). Chunking over the batch is a memory
schedule of the CPU/GPU kernel; on the NeuronCore the compiler tiles the matmuls itself, so here the op is one
linear, a log-softmax and the loss, in the accumulation dtype, and the gradients in closed form:

``d loss / d logits = w[t] * (p - onehot(t)) / denominator``

per row that is not ``ignore_index`` (zero for those), with ``p`` the softmax, ``w`` the class weights (ones
when none) and the denominator ``sum_rows w[t]`` for ``reduction='mean'`` (1 for ``'sum'``), as torch's
``cross_entropy`` defines the loss. torch's op refuses label smoothing; so does this one (the call then runs
torch's op on the host, which raises its error). Then ``grad_input = g @ W``, ``grad_W = g^T @ input``,
``grad_b = sum_rows g``. Other reductions are not this op (torch routes ``'none'`` to another one).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .table import decomposition_by_name
from .torch_options import install_neuron_auto_acc_policy


def _row_losses(input: Any, linear_weight: Any, target: Any, linear_bias: Any, weight: Any, ignore_index: int,
                acc: Any) -> Any:
    """``(x, W, logits, safe targets, target weights, row losses)`` in the accumulation dtype ``acc``: ``x`` the
    input as rows, ``logits = x @ W^T + b``, each row's loss ``-w[t] * log_softmax(logits)[t]``, where an
    ``ignore_index`` row gathers class 0 with weight 0."""
    x = input.reshape(-1, input.shape[-1]).to(acc)
    w_lin = linear_weight.to(acc)
    logits = x @ w_lin.t()
    if linear_bias is not None:
        logits = logits + linear_bias.to(acc)
    t = target.reshape(-1)
    keep = t != ignore_index
    safe_t = torch.where(keep, t, torch.zeros_like(t))
    w_t = keep.to(acc) if weight is None else weight.to(acc)[safe_t] * keep.to(acc)
    picked = torch.log_softmax(logits, dim=-1).gather(1, safe_t[:, None]).squeeze(1)
    return x, w_lin, logits, safe_t, w_t, -(picked * w_t)


def _acc_dtype(acc_dtype: Any) -> Any:
    return acc_dtype if isinstance(acc_dtype, torch.dtype) else torch.float32


@decomposition_by_name("torch_nn::_linear_cross_entropy_batch_chunked")
def _linear_cross_entropy_batch_chunked(input: Any, linear_weight: Any, target: Any, linear_bias: Any, weight: Any,
                                        reduction: str, ignore_index: int, label_smoothing: float,
                                        batch_chunk_size: int, acc_policy: str, acc_dtype: Any,
                                        allow_retain_graph: bool, compute_input_grad: bool,
                                        compute_linear_weight_grad: bool, compute_linear_bias_grad: bool) -> Any:
    """``(loss, grad_input, grad_linear_weight, grad_linear_bias)`` as the custom op returns them (a gradient
    not asked for is an empty tensor of the op's fake shape)."""
    if reduction not in ("mean", "sum") or linear_weight.dim() != 2 or label_smoothing:
        return NotImplemented    # torch's op refuses label smoothing (NotImplementedError): so does the host run
    acc = _acc_dtype(acc_dtype)
    x, w_lin, logits, safe_t, w_t, rows = _row_losses(input, linear_weight, target, linear_bias, weight,
                                                       ignore_index, acc)
    loss = rows.sum()
    denom = w_t.sum() if reduction == "mean" else None
    if denom is not None:
        loss = loss / denom
    grads = [input.new_empty((0, 0)), input.new_empty((0, 0)), input.new_empty((0,))]   # the fake's shapes/dtypes
    if compute_input_grad or compute_linear_weight_grad or compute_linear_bias_grad:
        p = torch.softmax(logits, dim=-1)
        onehot = F.one_hot(safe_t, logits.shape[-1]).to(acc)
        g = w_t[:, None] * (p - onehot)
        if denom is not None:
            g = g / denom
        if compute_input_grad:
            grads[0] = (g @ w_lin).reshape(input.shape).to(input.dtype)
        if compute_linear_weight_grad:
            grads[1] = (g.t() @ x).to(input.dtype)
        if compute_linear_bias_grad:
            grads[2] = g.sum(0).to(input.dtype)
    return loss.to(input.dtype), grads[0], grads[1], grads[2]


@decomposition_by_name("torch_nn::_linear_cross_entropy_batch_chunked_no_reduction")
def _linear_cross_entropy_batch_chunked_no_reduction(input: Any, linear_weight: Any, target: Any, linear_bias: Any,
                                                     weight: Any, ignore_index: int, batch_chunk_size: int,
                                                     acc_policy: str, acc_dtype: Any) -> Any:
    """``reduction='none'``: the per-row loss ``-w[t] * log_softmax(linear(input))[t]`` (0 on ignored rows);
    its gradient is torch's own Python backward, which traces."""
    if linear_weight.dim() != 2:
        return NotImplemented
    rows = _row_losses(input, linear_weight, target, linear_bias, weight, ignore_index, _acc_dtype(acc_dtype))[-1]
    return rows.reshape(target.shape).to(input.dtype)


install_neuron_auto_acc_policy()
