# Fused LSTM/GRU cell kernels of the neuron device (torch's RNNs call these CUDA-style ops for any non-CPU device).
"""``aten::_thnn_fused_lstm_cell`` / ``_thnn_fused_gru_cell`` and their backward ops on the ``neuron`` device.

torch's ``nn.LSTM``/``nn.GRU``/``nn.LSTMCell``/``nn.GRUCell`` (``aten::lstm``,
``lstm_cell`` ...) finish each time step with these fused cell ops whenever
the input is on CUDA, XPU or a PrivateUse1 device; torch implements them for
CUDA only, so without these kernels every LSTM/GRU on ``neuron`` fails. The
kernels compute the cell from device ops (``sigmoid``, ``tanh``, ``mul``,
``add``, ``cat``, ``sum``: each an eager NeuronCore program), with the same
formulas and outputs as the CUDA kernels:

* LSTM: gates ``i, f, g, o`` from ``input_gates + hidden_gates (+ biases)``;
  ``cy = f*cx + i*g``, ``hy = o*tanh(cy)``; the workspace holds the
  activated gates ``[i, f, g, o]`` for the backward op.
* GRU: ``r, z`` from the summed gates, ``n = tanh(in + r*hn)``,
  ``hy = (1-z)*n + z*hx``; the workspace holds ``[r, z, n, hx, hn]``.

Autograd uses torch's formulas (``_thnn_fused_lstm_cell_backward`` calls the
``_impl`` below; under ``create_graph=True`` torch's differentiable composite
backward is used instead).
"""
from __future__ import annotations

import torch

from .registry import install_kernels

__all__ = ["register"]

_LIBS: list = []


def _lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias
    if hidden_bias is not None:
        gates = gates + hidden_bias
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    hy = o * cy.tanh()
    return hy, cy, torch.cat([i, f, g, o], 1)


def _lstm_cell_backward_impl(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    i, f, g, o = workspace.chunk(4, 1)
    tanh_cy = cy.tanh()
    gcy = grad_cy if grad_cy is not None else torch.zeros_like(cy)
    if grad_hy is not None:
        gcy = gcy + grad_hy * o * (1 - tanh_cy * tanh_cy)
        grad_o = grad_hy * tanh_cy * o * (1 - o)
    else:
        grad_o = torch.zeros_like(o)
    grad_i = gcy * g * i * (1 - i)
    grad_f = gcy * cx * f * (1 - f)
    grad_g = gcy * i * (1 - g * g)
    grad_gates = torch.cat([grad_i, grad_f, grad_g, grad_o], 1)
    grad_cx = gcy * f
    grad_bias = grad_gates.sum(0) if has_bias else None
    return grad_gates, grad_cx, grad_bias


def _gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    if input_bias is not None:
        input_gates = input_gates + input_bias
    if hidden_bias is not None:
        hidden_gates = hidden_gates + hidden_bias
    ir, ii, in_ = input_gates.chunk(3, 1)
    hr, hi, hn = hidden_gates.chunk(3, 1)
    r = (ir + hr).sigmoid()
    z = (ii + hi).sigmoid()
    n = (in_ + r * hn).tanh()
    hy = n + z * (hx - n)
    return hy, torch.cat([r, z, n, hx, hn], 1)


def _gru_cell_backward(grad_hy, workspace, has_bias):
    r, z, n, hx, hn = workspace.chunk(5, 1)
    grad_hx = grad_hy * z
    gz = grad_hy * (hx - n) * z * (1 - z)
    gn = grad_hy * (1 - z) * (1 - n * n)
    gr = gn * hn * r * (1 - r)
    grad_input_gates = torch.cat([gr, gz, gn], 1)
    grad_hidden_gates = torch.cat([gr, gz, gn * r], 1)
    if has_bias:
        return grad_input_gates, grad_hidden_gates, grad_hx, grad_input_gates.sum(0), grad_hidden_gates.sum(0)
    return grad_input_gates, grad_hidden_gates, grad_hx, None, None


def register() -> None:
    """Install the fused cell kernels for the neuron device (idempotent)."""
    if _LIBS:
        return

    install_kernels(_LIBS, {"_thnn_fused_lstm_cell": _lstm_cell,
                            "_thnn_fused_lstm_cell_backward_impl": _lstm_cell_backward_impl,
                            "_thnn_fused_gru_cell": _gru_cell, "_thnn_fused_gru_cell_backward": _gru_cell_backward})
