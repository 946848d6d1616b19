# Decompositions of neural-network layer ops: 3-d (and transposed 3-d) convolutions and their gradients, 3-d and adaptive pooling, antialiased resampling, embedding_bag and embedding_renorm, distances, bilinear forms, the multi-label and multi-class margin losses' gradients, replication padding's gradient, fractional max pooling.
"""Decompositions of layer ops into core ops (see :mod:`tn.ops.decompositions` for the general ones)."""
from __future__ import annotations

import itertools
import math
from typing import Any, Callable, List, Sequence, Tuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .core import _ndim
from .low_precision import acc_dtype, is_low_precision
from .table import decomposition

aten = torch.ops.aten
Tensor = torch.Tensor


def _triple(v: Any) -> List[int]:
    """A 3-d convolution's or pooling's per-axis argument as three ints (aten also takes one for all axes)."""
    v = [int(a) for a in (v if isinstance(v, (list, tuple)) else [v])]
    return v * 3 if len(v) == 1 else v



# 3-d convolution as one 2-d convolution: the kD depth taps of every output depth are stacked into the
# channels (im2col along depth), so x [N, C, D, H, W] becomes x2 [N*Do, G*kD*Cg, H, W] (per group: tap-major,
# then channel) and w [O, Cg, kD, kH, kW] becomes w2 [O, kD*Cg, kH, kW]; height and width keep their
# stride, padding and dilation in the 2-d convolution, whose contraction covers all three kernel axes.

def _conv3d_geometry(x, w, stride, padding, dilation):
    N, C, D = int(x.shape[0]), int(x.shape[1]), int(x.shape[2])
    kD = int(w.shape[2])
    Do = (D + 2 * padding[0] - dilation[0] * (kD - 1) - 1) // stride[0] + 1
    return N, C, D, kD, Do


def _conv3d_x2(x, w, stride, padding, dilation, groups):
    """x [N, C, D, H, W] -> [N*Do, G*kD*Cg, H, W]: for output depth j, channel (g, k, c) holds input
    depth j*stride + k*dilation - padding of channel g*Cg + c (zero outside)."""
    N, C, D, kD, Do = _conv3d_geometry(x, w, stride, padding, dilation)
    H, W = int(x.shape[3]), int(x.shape[4])
    sd, pd, dd = stride[0], padding[0], dilation[0]
    xp = aten.constant_pad_nd.default(x, [0, 0, 0, 0, pd, pd]) if pd else x
    taps = [aten.slice.Tensor(xp, 2, k * dd, k * dd + sd * (Do - 1) + 1, sd) for k in range(kD)]
    st = aten.stack.default(taps, 1)                                   # [N, kD, C, Do, H, W]
    st = aten.reshape.default(st, [N, kD, groups, C // groups, Do, H, W])
    st = aten.permute.default(st, [0, 4, 2, 1, 3, 5, 6])               # [N, Do, G, kD, Cg, H, W]
    return aten.reshape.default(st, [N * Do, C * kD, H, W])


def _conv3d_w2(w):
    O, Cg, kD, kH, kW = (int(n) for n in w.shape)
    return aten.reshape.default(aten.permute.default(w, [0, 2, 1, 3, 4]), [O, kD * Cg, kH, kW])


def _conv3d_decomp(x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    """aten.convolution of a 5-d input (not transposed) as one 2-d convolution over depth-stacked channels."""
    if _ndim(w) != 5 or transposed:
        return NotImplemented
    stride, padding, dilation = _triple(stride), _triple(padding), _triple(dilation)
    N, C, D, kD, Do = _conv3d_geometry(x, w, stride, padding, dilation)
    y2 = aten.convolution.default(_conv3d_x2(x, w, stride, padding, dilation, groups), _conv3d_w2(w), b,
                                  list(stride[1:]), list(padding[1:]), list(dilation[1:]), False, [0, 0],
                                  groups)
    O, Ho, Wo = int(y2.shape[1]), int(y2.shape[2]), int(y2.shape[3])
    y = aten.reshape.default(y2, [N, Do, O, Ho, Wo])
    return aten.clone.default(aten.permute.default(y, [0, 2, 1, 3, 4]), memory_format=torch.contiguous_format)


def _conv3d_backward_decomp(grad, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding,
                            groups, output_mask):
    """aten.convolution_backward of a 5-d convolution (not transposed): the 2-d form's gradients, the input
    gradient scattered back from the stacked depth taps (summed in fp32 for 16-bit dtypes)."""
    if _ndim(w) != 5 or transposed:
        return NotImplemented
    stride, padding, dilation = _triple(stride), _triple(padding), _triple(dilation)
    N, C, D, kD, Do = _conv3d_geometry(x, w, stride, padding, dilation)
    H, W = int(x.shape[3]), int(x.shape[4])
    O, Cg = int(w.shape[0]), int(w.shape[1])
    sd, pd, dd = stride[0], padding[0], dilation[0]
    g2 = aten.permute.default(grad, [0, 2, 1, 3, 4])
    g2 = aten.reshape.default(g2, [N * Do, O, int(grad.shape[3]), int(grad.shape[4])])
    x2, w2 = _conv3d_x2(x, w, stride, padding, dilation, groups), _conv3d_w2(w)
    acc_dt = acc_dtype(x.dtype)
    mask = list(output_mask)
    gx2 = None
    if output_mask[0] and acc_dt != x.dtype:
        # the depth taps' input gradients in fp32 (exact widening of the 16-bit operands): a 16-bit 2-d gradient
        # rounds each tap before the depth sum below, several ulps off where taps cancel (0.31 at an element of
        # conv3d's bf16 sweep, dilation 3: 2.5 ulps; eager rounds once)
        gx2 = aten.convolution_backward.default(
            aten._to_copy.default(g2, dtype=acc_dt), aten._to_copy.default(x2, dtype=acc_dt),
            aten._to_copy.default(w2, dtype=acc_dt), None,
            list(stride[1:]), list(padding[1:]), list(dilation[1:]), False, [0, 0], groups, [True, False, False])[0]
        mask[0] = False
    gx2_16, gw2, gb = aten.convolution_backward.default(
        g2, x2, w2, bias_sizes, list(stride[1:]), list(padding[1:]), list(dilation[1:]), False, [0, 0], groups,
        mask)
    gx2 = gx2_16 if gx2 is None else gx2
    gx = gw = None
    if output_mask[1]:
        gw = aten.reshape.default(gw2, [O, kD, Cg] + [int(n) for n in w.shape[3:]])
        gw = aten.clone.default(aten.permute.default(gw, [0, 2, 1, 3, 4]), memory_format=torch.contiguous_format)
    if output_mask[0]:
        t = aten.reshape.default(gx2, [N, Do, groups, kD, Cg, H, W])
        t = aten.permute.default(t, [0, 3, 2, 4, 1, 5, 6])             # [N, kD, G, Cg, Do, H, W]
        t = aten.reshape.default(t, [N, kD, C, Do, H, W])
        if acc_dt != x.dtype:
            t = aten._to_copy.default(t, dtype=acc_dt)
        Dp = D + 2 * pd
        acc = aten.full.default([N, C, Dp, H, W], 0, dtype=acc_dt)
        for k in range(kD):
            tk = aten.select.int(t, 1, k)
            lo, hi = k * dd, k * dd + sd * (Do - 1) + 1
            cur = aten.slice.Tensor(acc, 2, lo, hi, sd)
            acc = aten.slice_scatter.default(acc, aten.add.Tensor(cur, tk), 2, lo, hi, sd)
        gx = aten.slice.Tensor(acc, 2, pd, pd + D) if pd else acc
        gx = aten._to_copy.default(gx, dtype=x.dtype, memory_format=torch.contiguous_format) \
            if gx.dtype != x.dtype or pd else gx
    return gx, gw, gb



# Transposed 3-d convolution as one transposed 2-d convolution: every input depth i is a 2-d image whose output
# channels carry all kD depth taps (w [Cin, Og, kD, kH, kW] -> w2 [Cin, kD*Og, kH, kW]; per group tap-major,
# then channel), so x [N, Cin, D, H, W] -> x2 [N*D, Cin, H, W] and y2 [N*D, G*kD*Og, Ho, Wo]; tap k of input
# depth i lands on output depth i*stride + k*dilation - padding (col2im along depth, summed in fp32 for 16-bit
# dtypes). Height and width keep their stride, padding, dilation and output padding in the 2-d convolution.
# The backward gathers the output gradient's depth taps (im2col, as _conv3d_x2) and takes the 2-d gradients.

def _conv_transpose3d_params(x, w, stride, padding, dilation, output_padding):
    """A transposed 3-d convolution's parameters as four 3-lists and its sizes: (stride, padding, dilation,
    output_padding, N, Cin, D, H, W, Og, kD, Dy) with Dy the output depth."""
    stride, padding, dilation, opad = (_triple(v) for v in (stride, padding, dilation, output_padding))
    N, C, D, H, W = (int(n) for n in x.shape)
    Og, kD = int(w.shape[1]), int(w.shape[2])
    Dy = (D - 1) * stride[0] - 2 * padding[0] + dilation[0] * (kD - 1) + opad[0] + 1
    return stride, padding, dilation, opad, N, C, D, H, W, Og, kD, Dy


def _conv_transpose3d_x2w2(x, w):
    """x [N, Cin, D, H, W] -> [N*D, Cin, H, W] (each input depth an image) and w [Cin, Og, kD, kH, kW] ->
    [Cin, kD*Og, kH, kW] (the depth taps stacked into the output channels of each group)."""
    N, C, D, H, W = (int(n) for n in x.shape)
    Cw, Og, kD, kH, kW = (int(n) for n in w.shape)
    x2 = aten.reshape.default(aten.permute.default(x, [0, 2, 1, 3, 4]), [N * D, C, H, W])
    w2 = aten.reshape.default(aten.permute.default(w, [0, 2, 1, 3, 4]), [Cw, kD * Og, kH, kW])
    return x2, w2


def _conv_transpose3d_decomp(x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    """aten.convolution of a 5-d input, transposed: one transposed 2-d convolution whose output channels hold
    the depth taps, scattered and summed along depth (the taps and the sum in fp32 for 16-bit dtypes, rounded
    once), bias added after."""
    if _ndim(w) != 5 or not transposed:
        return NotImplemented
    stride, padding, dilation, opad, N, C, D, H, W, Og, kD, Dy = _conv_transpose3d_params(
        x, w, stride, padding, dilation, output_padding)
    sd, pd, dd = stride[0], padding[0], dilation[0]
    x2, w2 = _conv_transpose3d_x2w2(x, w)
    acc_dt = acc_dtype(x.dtype)
    if acc_dt != x.dtype:
        # the taps themselves in fp32 (exact widening): a 16-bit 2-d convolution rounds each tap before the
        # depth sum, off by several ulps where the taps cancel (0.63 at an element of the bf16 sweep)
        x2, w2 = aten._to_copy.default(x2, dtype=acc_dt), aten._to_copy.default(w2, dtype=acc_dt)
    y2 = aten.convolution.default(x2, w2, None, list(stride[1:]), list(padding[1:]), list(dilation[1:]), True,
                                  list(opad[1:]), groups)                # [N*D, G*kD*Og, Ho, Wo]
    Ho, Wo = int(y2.shape[2]), int(y2.shape[3])
    O = groups * Og
    t = aten.reshape.default(y2, [N, D, groups, kD, Og, Ho, Wo])
    t = aten.permute.default(t, [0, 3, 2, 4, 1, 5, 6])                 # [N, kD, G, Og, D, Ho, Wo]
    t = aten.reshape.default(t, [N, kD, O, D, Ho, Wo])
    span = sd * (D - 1) + 1
    L = max(Dy + pd, dd * (kD - 1) + span)       # padded output depth covering every tap and the output
    if kD == 1 and sd == 1 and L == D:
        acc = aten.select.int(t, 1, 0)
    else:
        acc = aten.full.default([N, O, L, Ho, Wo], 0, dtype=acc_dt)
        for k in range(kD):
            lo, hi = k * dd, k * dd + span
            cur = aten.slice.Tensor(acc, 2, lo, hi, sd)
            acc = aten.slice_scatter.default(acc, aten.add.Tensor(cur, aten.select.int(t, 1, k)), 2, lo, hi, sd)
    y = aten.slice.Tensor(acc, 2, pd, pd + Dy) if (pd or L != Dy) else acc
    if b is not None:
        y = aten.add.Tensor(y, aten.reshape.default(b, [1, O, 1, 1, 1]))
    return aten._to_copy.default(y, dtype=x.dtype, memory_format=torch.contiguous_format)


def _conv_transpose3d_backward_decomp(grad, x, w, bias_sizes, stride, padding, dilation, transposed,
                                      output_padding, groups, output_mask):
    """aten.convolution_backward of a transposed 5-d convolution: the output gradient's depth taps gathered
    into channels (im2col along depth), then the transposed 2-d form's input and weight gradients; the bias
    gradient is the output gradient summed over all but the channel axis (in fp32 for 16-bit dtypes)."""
    if _ndim(w) != 5 or not transposed:
        return NotImplemented
    stride, padding, dilation, opad, N, C, D, H, W, Og, kD, Dy = _conv_transpose3d_params(
        x, w, stride, padding, dilation, output_padding)
    sd, pd, dd = stride[0], padding[0], dilation[0]
    O = groups * Og
    Ho, Wo = int(grad.shape[3]), int(grad.shape[4])
    gx = gw = gb = None
    if output_mask[0] or output_mask[1]:
        # tap k of input depth i read the output depth i*sd + k*dd - pd (zero outside)
        span = sd * (D - 1) + 1
        rpad = max(0, dd * (kD - 1) + span - (Dy + pd))
        gp = aten.constant_pad_nd.default(grad, [0, 0, 0, 0, pd, rpad]) if (pd or rpad) else grad
        taps = [aten.slice.Tensor(gp, 2, k * dd, k * dd + span, sd) for k in range(kD)]
        g2 = aten.stack.default(taps, 1)                                # [N, kD, O, D, Ho, Wo]
        g2 = aten.reshape.default(g2, [N, kD, groups, Og, D, Ho, Wo])
        g2 = aten.permute.default(g2, [0, 4, 2, 1, 3, 5, 6])            # [N, D, G, kD, Og, Ho, Wo]
        g2 = aten.reshape.default(g2, [N * D, O * kD, Ho, Wo])
        x2, w2 = _conv_transpose3d_x2w2(x, w)
        gx2, gw2, _ = aten.convolution_backward.default(
            g2, x2, w2, None, list(stride[1:]), list(padding[1:]), list(dilation[1:]), True, list(opad[1:]),
            groups, [bool(output_mask[0]), bool(output_mask[1]), False])
        if output_mask[0]:
            gx = aten.reshape.default(gx2, [N, D, C, H, W])
            gx = aten.clone.default(aten.permute.default(gx, [0, 2, 1, 3, 4]), memory_format=torch.contiguous_format)
        if output_mask[1]:
            gw = aten.reshape.default(gw2, [C, kD, Og] + [int(n) for n in w.shape[3:]])
            gw = aten.clone.default(aten.permute.default(gw, [0, 2, 1, 3, 4]), memory_format=torch.contiguous_format)
    if output_mask[2]:
        acc_dt = acc_dtype(grad.dtype)
        g = aten._to_copy.default(grad, dtype=acc_dt) if acc_dt != grad.dtype else grad
        gb = aten.sum.dim_IntList(g, [0, 2, 3, 4])
        if acc_dt != grad.dtype:
            gb = aten._to_copy.default(gb, dtype=grad.dtype)
    return gx, gw, gb


@decomposition(aten.convolution.default)
def _conv5d_decomp(x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    """aten.convolution of a 5-d input, plain (_conv3d_decomp) or transposed (_conv_transpose3d_decomp)."""
    fn = _conv_transpose3d_decomp if transposed else _conv3d_decomp
    return fn(x, w, b, stride, padding, dilation, transposed, output_padding, groups)


@decomposition(aten.convolution_backward.default)
def _conv5d_backward_decomp(grad, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding,
                            groups, output_mask):
    """aten.convolution_backward of a 5-d convolution, plain (_conv3d_backward_decomp) or transposed
    (_conv_transpose3d_backward_decomp)."""
    fn = _conv_transpose3d_backward_decomp if transposed else _conv3d_backward_decomp
    return fn(grad, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask)


@decomposition(aten.embedding_renorm.default)
def _embedding_renorm(w, indices, max_norm, norm_type):
    """Rows of ``w`` picked by ``indices`` rescaled to norm ``max_norm`` where it is exceeded."""
    flat = aten.view.default(indices, [-1])
    rows = aten.index.Tensor(w, [flat])
    a = aten.abs.default(rows)
    norms = aten.pow.Tensor_Scalar(aten.sum.dim_IntList(aten.pow.Tensor_Scalar(a, norm_type), [1], True),
                                   1.0 / norm_type)
    scale = aten.where.self(aten.gt.Scalar(norms, max_norm),
                            aten.div.Tensor(aten.reciprocal.default(aten.add.Tensor(norms, 1e-7)), 1.0 / max_norm),
                            aten.scalar_tensor.default(1.0, dtype=w.dtype))
    return aten.index_put.default(w, [flat], aten.mul.Tensor(rows, scale))


def _multilabel_margin_terms(x, target):
    """``(x2, valid, tidx, is_target, active)`` of a multi-label margin loss, over rows ``[N, C]``: ``valid[n, i]``
    marks the target positions before the first -1, ``tidx`` those targets (0 elsewhere), ``is_target[n, j]``
    whether class j is a target of row n, ``active[n, i, j]`` whether the hinge of target i against non-target j
    is positive (its term counts)."""
    c = x.shape[-1] if x.dim() else 1
    x2 = aten.view.default(x, [-1, c])
    t2 = aten.view.default(target, [-1, c])
    pos = aten.arange.start_step(0, c, 1, dtype=torch.int64, device=x.device)
    first = aten.amin.default(aten.where.self(aten.eq.Scalar(t2, -1), pos, aten.full_like.default(pos, c)), [1],
                              True)
    valid = aten.lt.Tensor(pos, first)
    tidx = aten.where.self(valid, t2, aten.zeros_like.default(t2))
    hit = aten.logical_and.default(aten.eq.Tensor(aten.unsqueeze.default(tidx, 2), pos),
                                   aten.unsqueeze.default(valid, 2))
    is_target = aten.any.dim(hit, 1)
    xt = aten.gather.default(x2, 1, tidx)
    hinge = aten.add.Tensor(aten.rsub.Scalar(aten.unsqueeze.default(xt, 2), 1), aten.unsqueeze.default(x2, 1))
    counted = aten.logical_and.default(aten.unsqueeze.default(valid, 2),
                                       aten.logical_not.default(aten.unsqueeze.default(is_target, 1)))
    return x2, valid, tidx, is_target, hinge, counted


@decomposition(aten.multilabel_margin_loss_forward.default,
               instead_of_torch="torch's also counts the target slots after the first -1 (a wrong loss)")
def _multilabel_margin_loss_forward(x, target, reduction):
    """(loss, is_target) of ``multilabel_margin_loss``: per row, the hinge ``max(0, 1 - (x[t_i] - x[j])) / C`` of
    every target ``t_i`` before the first -1 against every non-target class ``j``.

    Written here because torch's decomposition also counts the target slots after the first -1 (a wrong value
    whenever their hinge is positive) and gives a 1-d input's unreduced loss shape ``(1,)`` instead of ``()``."""
    c = x.shape[-1] if x.dim() else 1
    x2, valid, tidx, is_target, hinge, counted = _multilabel_margin_terms(x, target)
    terms = aten.where.self(counted, aten.clamp_min.default(hinge, 0), aten.zeros_like.default(hinge))
    loss = aten.div.Scalar(aten.sum.dim_IntList(terms, [1, 2]), c)
    if reduction == 1:
        loss = aten.mean.default(loss)
    elif reduction == 2:
        loss = aten.sum.default(loss)
    elif x.dim() <= 1:
        loss = aten.view.default(loss, [])
    return loss, aten.view.default(aten._to_copy.default(is_target, dtype=x.dtype), list(target.shape))


def _row_loss_grad(g, grad_output, reduction, rows):
    """A per-row loss's input gradient ``g`` (``[rows, C]``) times the gradient of its reduction: per row
    (``reduction`` 0: none), ``grad_output / rows`` (1: mean) or ``grad_output`` (2: sum)."""
    if reduction == 0:
        return aten.mul.Tensor(g, aten.view.default(grad_output, [-1, 1]))
    return aten.mul.Tensor(g, aten.div.Scalar(grad_output, rows) if reduction == 1 else grad_output)


def _class_rows(x, target):
    """``(C, x as [rows, C], target as [rows, 1], the class positions 0..C-1)`` of a multi-class margin loss."""
    c = x.shape[-1] if x.dim() else 1
    return (c, aten.view.default(x, [-1, c]), aten.view.default(target, [-1, 1]),
            aten.arange.start_step(0, c, 1, dtype=torch.int64, device=x.device))


def _target_weight(weight, t2):
    """The class weight of each row's target (``t2`` ``[rows, 1]``), as ``[rows, 1]``."""
    return aten.view.default(aten.index_select.default(weight, 0, aten.view.default(t2, [-1])), [-1, 1])


@decomposition(aten.multilabel_margin_loss_backward.default)
def _multilabel_margin_loss_backward(grad_output, x, target, reduction, is_target):
    """Gradient of :func:`_multilabel_margin_loss_forward` with respect to ``x``: each positive hinge adds
    ``1/C`` at its non-target class and ``-1/C`` at its target."""
    c = x.shape[-1] if x.dim() else 1
    x2, valid, tidx, _, hinge, counted = _multilabel_margin_terms(x, target)
    active = aten._to_copy.default(aten.logical_and.default(counted, aten.gt.Scalar(hinge, 0)), dtype=x.dtype)
    g = aten.sub.Tensor(aten.sum.dim_IntList(active, [1]),
                        aten.scatter_add.default(aten.zeros_like.default(x2), 1, tidx,
                                                 aten.sum.dim_IntList(active, [2])))
    g = aten.div.Scalar(g, c)
    return aten.view.default(_row_loss_grad(g, grad_output, reduction, x2.shape[0]), list(x.shape))


@decomposition(aten.multi_margin_loss.default,
               instead_of_torch="torch's gives a 1-d input's unreduced loss shape (1,) instead of () (a wrong shape)")
def _multi_margin_loss(x, target, p=1, margin=1, weight=None, reduction=1):
    """``multi_margin_loss``: per row, ``sum_{j != y} max(0, margin - x[y] + x[j])^p w[y] / C``, reduced."""
    c, x2, t2, pos = _class_rows(x, target)
    z = aten.clamp_min.default(aten.add.Tensor(aten.rsub.Scalar(aten.gather.default(x2, 1, t2), margin), x2), 0)
    if p == 2:
        z = aten.mul.Tensor(z, z)
    if weight is not None:
        z = aten.mul.Tensor(z, _target_weight(weight, t2))
    z = aten.where.self(aten.eq.Tensor(pos, t2), aten.zeros_like.default(z), z)
    loss = aten.div.Scalar(aten.sum.dim_IntList(z, [1]), c)
    if reduction == 1:
        return aten.mean.default(loss)
    if reduction == 2:
        return aten.sum.default(loss)
    return aten.view.default(loss, list(target.shape))


@decomposition(aten.multi_margin_loss_backward.default)
def _multi_margin_loss_backward(grad_output, x, target, p, margin, weight=None, reduction=1):
    """Gradient of ``multi_margin_loss`` with respect to ``x``: every class ``j != y`` whose hinge
    ``z = margin - x[y] + x[j]`` is positive gets ``w[y] / C`` (``p=1``) or ``2 z w[y] / C`` (``p=2``),
    and the target class ``y`` minus their sum."""
    c, x2, t2, pos = _class_rows(x, target)
    is_y = aten.eq.Tensor(pos, t2)
    z = aten.add.Tensor(aten.rsub.Scalar(aten.gather.default(x2, 1, t2), margin), x2)
    active = aten.logical_and.default(aten.gt.Scalar(z, 0), aten.logical_not.default(is_y))
    d = aten.mul.Scalar(z, 2) if p == 2 else aten.full_like.default(z, 1)
    d = aten.where.self(active, d, aten.zeros_like.default(d))
    if weight is not None:
        d = aten.mul.Tensor(d, _target_weight(weight, t2))
    d = aten.div.Scalar(d, c)
    g = aten.sub.Tensor(d, aten.where.self(is_y, aten.sum.dim_IntList(d, [1], True), aten.zeros_like.default(d)))
    return aten.view.default(_row_loss_grad(g, grad_output, reduction, x2.shape[0]), list(x.shape))


# --------------------------------------------------------------------------- fractional max pooling
# Each (sample, channel) plane draws one number u in [0, 1) per axis; window i of an axis of n inputs, k
# wide and m outputs, starts at int((i + u) * alpha) - int(u * alpha) with alpha = (n - k) / (m - 1), the
# last at n - k (torch's generate_intervals, computed in the input's dtype). The windows are gathered and
# reduced as adaptive max pooling's are; the gradient scatters to the winning flat index.


def _fractional_starts(u: Tensor, n: int, k: int, m: int) -> Tensor:
    """``[..., m]`` int64 window starts along one axis from the samples ``u`` (``[...]``)."""
    last = aten.full.default(list(u.shape) + [1], n - k, dtype=torch.int64, device=u.device)
    if m == 1:
        return last
    with _disable_current_modes():    # a constant of the trace, divided in the input's dtype as torch does
        alpha = (torch.tensor(n - k, dtype=u.dtype) / torch.tensor(m - 1, dtype=u.dtype)).item()
    i = aten.arange.start_step(0, m - 1, 1, dtype=u.dtype, device=u.device)
    ua = aten.unsqueeze.default(u, -1)
    a = aten._to_copy.default(aten.mul.Tensor(aten.add.Tensor(i, ua), alpha), dtype=torch.int64)
    b = aten._to_copy.default(aten.mul.Tensor(ua, alpha), dtype=torch.int64)
    return aten.cat.default([aten.sub.Tensor(a, b), last], -1)


def _fractional_max_pool(x: Tensor, kernel_size: Sequence[int], output_size: Sequence[int],
                         samples: Tensor) -> Tuple[Tensor, Tensor]:
    """(values, flat indices) of ``k``-d fractional max pooling (``k = len(kernel_size)``); ``samples`` is
    ``[N, C, k]`` with the width's number first for 2-d (torch's order), time, height, width for 3-d."""
    k = len(kernel_size)
    batched = x.dim() == k + 2
    xb = x if batched else aten.unsqueeze.default(x, 0)
    lead = list(xb.shape[:2])
    sizes = list(xb.shape[2:])
    order = [1, 0] if k == 2 else [0, 1, 2]     # the sample of each spatial axis
    if samples.shape[0] != lead[0]:             # an unbatched input takes the first sample row
        samples = aten.slice.Tensor(samples, 0, 0, lead[0])
    if samples.dtype != x.dtype:                # the kernel reads the samples in the input's dtype
        samples = aten._to_copy.default(samples, dtype=x.dtype)
    flat = None
    for ax in range(k):
        u = aten.select.int(samples, -1, order[ax])
        starts = _fractional_starts(u, sizes[ax], int(kernel_size[ax]), int(output_size[ax]))   # [N, C, m]
        taps = aten.arange.start_step(0, int(kernel_size[ax]), 1, dtype=torch.int64, device=x.device)
        idx = aten.add.Tensor(aten.unsqueeze.default(starts, -1), taps)                          # [N, C, m, kw]
        stride = math.prod(sizes[ax + 1:])
        if stride != 1:
            idx = aten.mul.Tensor(idx, stride)
        if flat is None:
            flat = idx
        else:   # flat: [N, C, m0.., kw0..] -> outputs first, taps last
            nd = ax
            a = aten.view.default(flat, lead + list(flat.shape[2:2 + nd]) + [1] + list(flat.shape[2 + nd:]) + [1])
            bshape = lead + [1] * nd + [idx.shape[2]] + [1] * nd + [idx.shape[3]]
            flat = aten.add.Tensor(a, aten.view.default(idx, bshape))
    outs = [int(o) for o in output_size]
    taps = math.prod(int(v) for v in kernel_size)
    flat = aten.view.default(flat, lead + [math.prod(outs) * taps])
    vals = aten.gather.default(aten.view.default(xb, lead + [-1]), 2, flat)
    vals = aten.view.default(vals, lead + [math.prod(outs), taps])
    win = aten.argmax.default(vals, 3, True)
    out = aten.view.default(aten.gather.default(vals, 3, win), lead + outs)
    ind = aten.view.default(aten.gather.default(aten.view.default(flat, lead + [math.prod(outs), taps]), 3, win),
                            lead + outs)
    if not batched:
        out, ind = aten.squeeze.dim(out, 0), aten.squeeze.dim(ind, 0)
    return out, ind


@decomposition(aten.fractional_max_pool2d.default, aten.fractional_max_pool3d.default)
def _fractional_max_pool_nd(x, kernel_size, output_size, random_samples):
    """fractional_max_pool2d/3d: the windows torch's kernel draws from ``random_samples``, max-reduced."""
    return _fractional_max_pool(x, kernel_size, output_size, random_samples)


@decomposition(aten.fractional_max_pool2d_backward.default)
def _fractional_max_pool2d_backward(grad, x, kernel_size, output_size, indices):
    """Gradient of fractional_max_pool2d: ``grad`` added at each window's winning flat index."""
    return _adaptive_max_backward(grad, x, indices, 2)


@decomposition(aten.fractional_max_pool3d_backward.default)
def _fractional_max_pool3d_backward(grad, x, kernel_size, output_size, indices):
    """Gradient of fractional_max_pool3d."""
    return _adaptive_max_backward(grad, x, indices, 3)


# --------------------------------------------------------------------------- replication padding gradient
# Replication padding repeats each edge element into the pad; its gradient is the pad's gradient summed
# into that edge element, one axis after the other (the padding is separable).


def _replication_pad_backward(grad, x, padding):
    """Gradient of ``replication_pad{1,2,3}d``: per padded axis (``padding`` in ``F.pad`` order, last axis
    first), the first element takes the sum of the left pad and itself, the last the sum of itself and
    the right pad. An axis with negative padding (cropping) scatters its gradient to the source index of
    each output position, ``clamp(j - left, 0, n - 1)``."""
    g = grad
    for k in range(len(padding) // 2):
        dim = grad.dim() - 1 - k
        lo, hi = int(padding[2 * k]), int(padding[2 * k + 1])
        n = x.shape[dim]
        if lo == 0 and hi == 0:
            continue
        if lo < 0 or hi < 0:
            gt = aten.transpose.int(g, dim, -1)
            m = gt.shape[-1]
            src = aten.clamp.default(aten.arange.start_step(-lo, m - lo, 1, dtype=torch.int64, device=g.device),
                                     0, n - 1)
            src = aten.expand.default(src, list(gt.shape))
            out = aten.scatter_add.default(aten.full.default(list(gt.shape[:-1]) + [n], 0, dtype=g.dtype), -1, src,
                                           gt)
            g = aten.transpose.int(out, dim, -1)
            continue
        if n == 1:
            g = aten.sum.dim_IntList(g, [dim], True)
            continue
        first = aten.sum.dim_IntList(aten.slice.Tensor(g, dim, 0, lo + 1), [dim], True)
        last = aten.sum.dim_IntList(aten.slice.Tensor(g, dim, lo + n - 1, lo + n + hi), [dim], True)
        mid = aten.slice.Tensor(g, dim, lo + 1, lo + n - 1)
        g = aten.cat.default([first, mid, last], dim)
    return g if g is not grad else aten.clone.default(grad)


@decomposition(aten.replication_pad1d_backward.default, aten.replication_pad2d_backward.default,
               aten.replication_pad3d_backward.default)
def _replication_pad_nd_backward(grad, x, padding):
    """Gradient of replication_pad1d/2d/3d."""
    return _replication_pad_backward(grad, x, padding)


# --------------------------------------------------------------------------- 3-d and adaptive pooling
# 3-d average pooling is two 2-d average poolings: over (H, W), then over D with a (kd, 1) window
# (a box's divisor is the product of its per-axis counts, so the two divisions make torch's).
# Adaptive average pooling whose windows do not tile the input is a product with a constant
# [out, in] averaging matrix per axis; adaptive max pooling gathers every window (clamped,
# masked to -inf past its end) and reduces it.


def _pool3d_steps(x_shape, kernel_size, stride, padding):
    k, p = _triple(kernel_size), _triple(padding)
    s = _triple(stride) if stride else k
    lead = list(x_shape[:-4]) if len(x_shape) == 5 else []
    c, d, h, w = x_shape[-4:]
    return lead, (c, d, h, w), k, s, p


@decomposition(aten.avg_pool3d.default)
def _avg_pool3d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    """avg_pool3d as avg_pool2d over (H, W) then over D."""
    lead, (c, d, h, w), k, s, p = _pool3d_steps(tuple(x.shape), kernel_size, stride, padding)
    n = lead or [1]
    hw = aten.avg_pool2d.default(aten.view.default(x, n + [c * d, h, w]), k[1:], s[1:], p[1:], ceil_mode,
                                 count_include_pad, None if divisor_override is None else 1)
    oh, ow = hw.shape[-2:]
    out = aten.avg_pool2d.default(aten.view.default(hw, n + [c, d, oh * ow]), [k[0], 1], [s[0], 1], [p[0], 0],
                                  ceil_mode, count_include_pad, divisor_override)
    return aten.view.default(out, lead + [c, out.shape[-2], oh, ow])


@decomposition(aten.avg_pool3d_backward.default)
def _avg_pool3d_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    """Gradient of :func:`_avg_pool3d`: the two avg_pool2d gradients in reverse order."""
    lead, (c, d, h, w), k, s, p = _pool3d_steps(tuple(x.shape), kernel_size, stride, padding)
    n = lead or [1]
    od, oh, ow = grad.shape[-3:]
    mid = aten.expand.default(aten.full.default([], 0, dtype=grad.dtype), n + [c, d, oh * ow])
    g = aten.avg_pool2d_backward.default(aten.view.default(grad, n + [c, od, oh * ow]), mid, [k[0], 1], [s[0], 1],
                                         [p[0], 0], ceil_mode, count_include_pad, divisor_override)
    g = aten.avg_pool2d_backward.default(aten.view.default(g, n + [c * d, oh, ow]),
                                         aten.view.default(x, n + [c * d, h, w]), k[1:], s[1:], p[1:], ceil_mode,
                                         count_include_pad, None if divisor_override is None else 1)
    return aten.view.default(g, list(x.shape))


def _adaptive_bounds(n_in: int, n_out: int) -> Tuple[List[int], List[int]]:
    """torch's adaptive windows: output ``o`` covers ``[start[o], end[o])`` of the input axis."""
    return ([(o * n_in) // n_out for o in range(n_out)],
            [((o + 1) * n_in + n_out - 1) // n_out for o in range(n_out)])


def _average_matrix(n_in: int, n_out: int, dtype: torch.dtype) -> Tensor:
    """``[n_in, n_out]``: column ``o`` averages the input window of output ``o``."""
    start, end = _adaptive_bounds(n_in, n_out)
    i = aten.view.default(aten.arange.start_step(0, n_in, 1, dtype=torch.int64), [n_in, 1])
    lo = aten.view.default(aten.arange.start_step(0, n_out * n_in, n_in, dtype=torch.int64), [1, n_out])
    lo = aten.div.Tensor_mode(lo, n_out, rounding_mode="floor")                       # start[o]
    hi = aten.div.Tensor_mode(aten.add.Tensor(aten.arange.start_step(n_in, (n_out + 1) * n_in, n_in,
                                                                      dtype=torch.int64), n_out - 1),
                              n_out, rounding_mode="floor")                            # end[o]
    inside = aten.logical_and.default(aten.ge.Tensor(i, lo), aten.lt.Tensor(i, aten.view.default(hi, [1, n_out])))
    return aten.div.Tensor(aten._to_copy.default(inside, dtype=dtype),
                           aten._to_copy.default(aten.sub.Tensor(hi, lo), dtype=dtype))


def _axis_product(x: Tensor, axis: int, m: Tensor) -> Tensor:
    """``x`` with axis ``axis`` contracted against the rows of matrix ``m``."""
    xt = aten.movedim.int(x, axis, -1)
    return aten.movedim.int(aten.matmul.default(xt, m), -1, axis)


def _adaptive_avg(x: Tensor, out_size: Sequence[int], transpose: bool) -> Tensor:
    """Adaptive average pooling of the trailing ``len(out_size)`` axes (or, ``transpose``, its gradient:
    ``x`` is then the output gradient and ``out_size`` the input's spatial shape), in fp32 for fp16/bf16."""
    k = len(out_size)
    acc = acc_dtype(x.dtype)
    y = x if x.dtype == acc else aten._to_copy.default(x, dtype=acc)
    for j in range(k):
        axis = x.dim() - k + j
        if transpose:
            m = aten.t.default(_average_matrix(out_size[j], x.shape[axis], acc))
        else:
            m = _average_matrix(x.shape[axis], out_size[j], acc)
        y = _axis_product(y, axis, m)
    return y if y.dtype == x.dtype else aten._to_copy.default(y, dtype=x.dtype)


def _divisible(in_shape: Sequence[int], out_size: Sequence[int]) -> bool:
    return all(o > 0 and i % o == 0 for i, o in zip(in_shape, out_size))


@decomposition(aten._adaptive_avg_pool3d.default)
def _adaptive_avg_pool3d(x, output_size):
    """avg_pool3d when the windows tile the input, else per-axis averaging matrices."""
    size = [int(o) for o in output_size]
    spatial = list(x.shape[-3:])
    if _divisible(spatial, size):
        k = [i // o for i, o in zip(spatial, size)]
        return _avg_pool3d(x, k, k, 0)
    return _adaptive_avg(x, size, transpose=False)


def _adaptive_avg_backward(grad: Tensor, x: Tensor, k: int) -> Tensor:
    """Gradient of ``k``-d adaptive average pooling: the avg_pool gradient when the windows tile the
    input, else the transposed averaging matrices."""
    spatial, size = list(x.shape[-k:]), list(grad.shape[-k:])
    if _divisible(spatial, size):
        kern = [i // o for i, o in zip(spatial, size)]
        if k == 2:
            return aten.avg_pool2d_backward.default(grad, x, kern, kern, [0, 0], False, True, None)
        return _avg_pool3d_backward(grad, x, kern, kern, [0, 0, 0], False, True, None)
    return _adaptive_avg(grad, spatial, transpose=True)


@decomposition(aten._adaptive_avg_pool2d_backward.default)
def _adaptive_avg_pool2d_backward(grad, x):
    """Gradient of adaptive_avg_pool2d."""
    return _adaptive_avg_backward(grad, x, 2)


@decomposition(aten._adaptive_avg_pool3d_backward.default)
def _adaptive_avg_pool3d_backward(grad, x):
    """Gradient of adaptive_avg_pool3d."""
    return _adaptive_avg_backward(grad, x, 3)


def _adaptive_max(x: Tensor, size: Sequence[int]) -> Tuple[Tensor, Tensor]:
    """(values, int64 indices into the flattened spatial plane) of adaptive max pooling over the
    trailing ``len(size)`` axes: every window gathered at its longest length, the overhang masked."""
    k = len(size)
    spatial = list(x.shape[-k:])
    lead = list(x.shape[:-k])
    idx, valid, lengths = [], None, []
    flat = None
    for j, (n_in, n_out) in enumerate(zip(spatial, size)):
        start, end = _adaptive_bounds(n_in, n_out)
        length = max(e - s for s, e in zip(start, end))
        lengths.append(length)
        o = aten.view.default(aten.arange.start_step(0, n_out * n_in, n_in, dtype=torch.int64), [n_out, 1])
        first = aten.div.Tensor_mode(o, n_out, rounding_mode="floor")
        last = aten.div.Tensor_mode(aten.add.Tensor(o, n_in + n_out - 1), n_out, rounding_mode="floor")
        pos = aten.add.Tensor(first, aten.view.default(aten.arange.start_step(0, length, 1, dtype=torch.int64),
                                                       [1, length]))
        ok = aten.lt.Tensor(pos, last)
        pos = aten.clamp.default(pos, None, n_in - 1)
        # [n_out, length] laid out on axes (2j, 2j+1) of [o1, L1, o2, L2, ...]
        shape = [1] * (2 * k)
        shape[2 * j], shape[2 * j + 1] = n_out, length
        pos, ok = aten.view.default(pos, shape), aten.view.default(ok, shape)
        idx.append(pos)
        valid = ok if valid is None else aten.logical_and.default(valid, ok)
        flat = pos if flat is None else aten.add.Tensor(aten.mul.Tensor(flat, n_in), pos)
    win = aten.index.Tensor(x, [None] * len(lead) + idx)                  # [..., o1, L1, o2, L2, ...]
    low = float("-inf") if x.is_floating_point() else torch.iinfo(x.dtype).min
    win = aten.where.self(valid, win, aten.full.default([], low, dtype=x.dtype))
    nl = len(lead)
    order = list(range(nl)) + [nl + 2 * j for j in range(k)] + [nl + 2 * j + 1 for j in range(k)]
    wsize = math.prod(lengths)
    win = aten.reshape.default(aten.permute.default(win, order), lead + list(size) + [wsize])
    grid = [d for j in range(k) for d in (size[j], lengths[j])]
    flat = aten.reshape.default(aten.permute.default(aten.expand.default(flat, grid), [a - nl for a in order[nl:]]),
                                list(size) + [wsize])                          # flat input index per window slot
    am = aten.argmax.default(win, -1, True)
    flat = aten.expand.default(flat, lead + list(size) + [wsize])
    return aten.amax.default(win, [-1], False), aten.squeeze.dim(aten.gather.default(flat, -1, am), -1)


@decomposition(aten.adaptive_max_pool2d.default,
               instead_of_torch="torch's does not trace (UnsupportedOpError); this gathers every window and reduces "
                                "it")
def _adaptive_max_pool2d(x, output_size):
    """(values, indices) of 2-d adaptive max pooling."""
    return _adaptive_max(x, [int(o) for o in output_size])


@decomposition(aten.adaptive_max_pool3d.default,
               instead_of_torch="8 equations where torch's builds 20 (one gather of every window and one reduction)")
def _adaptive_max_pool3d(x, output_size):
    """(values, indices) of 3-d adaptive max pooling."""
    return _adaptive_max(x, [int(o) for o in output_size])


def _adaptive_max_backward(grad: Tensor, x: Tensor, indices: Tensor, k: int) -> Tensor:
    """Gradient of ``k``-d adaptive max pooling: ``grad`` added at the winning flat index of each plane."""
    lead = list(x.shape[:-k])
    plane = math.prod(x.shape[-k:])
    g = aten.view.default(aten.clone.default(grad), lead + [-1])
    i = aten.view.default(aten.clone.default(indices), lead + [-1])
    out = aten.scatter_add.default(aten.full.default(lead + [plane], 0, dtype=grad.dtype), len(lead), i, g)
    return aten.view.default(out, list(x.shape))


@decomposition(aten.adaptive_max_pool2d_backward.default)
def _adaptive_max_pool2d_backward(grad, x, indices):
    """Gradient of adaptive_max_pool2d."""
    return _adaptive_max_backward(grad, x, indices, 2)


@decomposition(aten.adaptive_max_pool3d_backward.default)
def _adaptive_max_pool3d_backward(grad, x, indices):
    """Gradient of adaptive_max_pool3d."""
    return _adaptive_max_backward(grad, x, indices, 3)


@decomposition(aten.max_pool3d_with_indices_backward.default)
def _max_pool3d_with_indices_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    """Gradient of max_pool3d: ``grad`` added at each window's winning flat index (the window geometry is in
    ``indices`` already; overlapping windows add up, as torch's kernel does)."""
    return _adaptive_max_backward(grad, x, indices, 3)



# --------------------------------------------------------------------------- antialiased resampling
# _upsample_bilinear2d_aa / _upsample_bicubic2d_aa are separable linear maps: output = A x B^T with
# constant [out, in] weights per axis. The weights are read off torch's own kernel applied to unit
# images at trace time (so they are torch's, window rules and normalisation included) and become
# program constants; the maps are then two matrix products, in fp32 for fp16/bf16 inputs.


def _aa_weights(op: Any, in_hw: Sequence[int], out_hw: Sequence[int], align_corners: bool, scales_h: Any,
                scales_w: Any) -> Tuple[Tensor, Tensor]:
    (ih, iw), (oh, ow) = in_hw, out_hw
    with _disable_current_modes():   # real computation, outside the trace
        eh = torch.eye(ih).reshape(ih, 1, ih, 1).expand(ih, 1, ih, iw).contiguous()
        a = op(eh, [oh, ow], align_corners, scales_h, scales_w)[:, 0, :, 0].t().contiguous()   # [oh, ih]
        ew = torch.eye(iw).reshape(iw, 1, 1, iw).expand(iw, 1, ih, iw).contiguous()
        b = op(ew, [oh, ow], align_corners, scales_h, scales_w)[:, 0, 0, :].t().contiguous()   # [ow, iw]
    return a, b


def _aa_apply(x: Tensor, a: Tensor, b: Tensor) -> Tensor:
    acc = acc_dtype(x.dtype)
    y = x if x.dtype == acc else aten._to_copy.default(x, dtype=acc)
    y = aten.matmul.default(aten.matmul.default(a, y), aten.t.default(b))
    return y if y.dtype == x.dtype else aten._to_copy.default(y, dtype=x.dtype)


def _aa_forward(op: Any) -> Callable[..., Tensor]:
    def fn(x, output_size, align_corners, scales_h=None, scales_w=None):
        a, b = _aa_weights(op, x.shape[-2:], output_size, align_corners, scales_h, scales_w)
        return _aa_apply(x, a, b)
    fn.__doc__ = f"{op}: two matrix products with torch's own per-axis weights."
    return fn


def _aa_backward(op: Any) -> Callable[..., Tensor]:
    def fn(grad, output_size, input_size, align_corners, scales_h=None, scales_w=None):
        a, b = _aa_weights(op, input_size[-2:], output_size, align_corners, scales_h, scales_w)
        return _aa_apply(grad, aten.t.default(a), aten.t.default(b))
    fn.__doc__ = f"Gradient of {op}: the transposed weights."
    return fn


for _fwd, _bwd in (("_upsample_bilinear2d_aa", "_upsample_bilinear2d_aa_backward"),
                   ("_upsample_bicubic2d_aa", "_upsample_bicubic2d_aa_backward")):
    if hasattr(aten, _fwd) and hasattr(aten, _bwd):
        decomposition(getattr(aten, _fwd).default)(_aa_forward(getattr(aten, _fwd).default))
        decomposition(getattr(aten, _bwd).default)(_aa_backward(getattr(aten, _fwd).default))


# --------------------------------------------------------------------------- embedding_bag


def _bag_layout(indices, offsets, include_last_offset, padding_idx):
    """(offset2bag, keep mask, number of bags) of a flat ``indices`` split at ``offsets``."""
    nbags = offsets.shape[0] - (1 if include_last_offset else 0)
    starts = aten.slice.Tensor(offsets, 0, 0, nbags)
    pos = aten.arange.start_step(0, indices.shape[0], 1, dtype=torch.int64)
    # bag of position i: how many bags start at or before i, minus one (empty bags are skipped)
    o2b = aten.sub.Tensor(aten.sum.dim_IntList(aten.le.Tensor(aten.view.default(starts, [1, nbags]),
                                                               aten.view.default(pos, [-1, 1])), [1], False,
                                               dtype=torch.int64), 1)
    o2b = aten.clamp.default(o2b, 0)
    keep = None if padding_idx is None or padding_idx < 0 else aten.ne.Scalar(indices, padding_idx)
    return o2b, keep, nbags


@decomposition(aten._embedding_bag_forward_only.default, aten._embedding_bag.default)
def _embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                   per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    """(output, offset2bag, bag_size, max_indices) as torch's CPU kernel: rows gathered, then summed
    (``mode`` 0), averaged (1) or maxed (2) per bag by index_put/scatter_reduce; entries equal to
    ``padding_idx`` are left out, empty bags give zeros."""
    d = weight.shape[1]
    o2b, keep, nbags = _bag_layout(indices, offsets, include_last_offset, padding_idx)
    rows = aten.index.Tensor(weight, [indices])
    zeros = aten.full.default([nbags, d], 0, dtype=weight.dtype)
    kept = None if keep is None else aten.view.default(keep, [-1, 1])
    # counts and positions are accumulated in fp32 (exact below 2**24), which the chip's index ops take
    counted = aten.full.default(list(indices.shape), 1, dtype=torch.float32) if keep is None else \
        aten._to_copy.default(keep, dtype=torch.float32)
    bag_size = aten._to_copy.default(
        aten.index_put.default(aten.full.default([nbags], 0, dtype=torch.float32), [o2b], counted, True),
        dtype=torch.int64)
    if mode == 2:
        if kept is not None:
            rows = aten.where.self(kept, rows, aten.full.default([], float("-inf"), dtype=weight.dtype))
        idx2 = aten.expand.default(aten.view.default(o2b, [-1, 1]), list(rows.shape))
        out = aten.scatter_reduce.two(zeros, 0, idx2, rows, "amax", include_self=False)
        if kept is not None:   # a bag of padding only stays zero
            out = aten.where.self(aten.view.default(aten.gt.Scalar(bag_size, 0), [-1, 1]), out,
                                  aten.full.default([], 0, dtype=weight.dtype))
    else:
        # sums (and means) of 16-bit rows are accumulated in fp32 and rounded once, as torch's CPU kernel does
        # (a bf16 product per row, then bf16 sums, lost 0.14 of a bag summing to 0.89 from terms near 40)
        acc = acc_dtype(weight.dtype)
        if acc != weight.dtype:
            rows = aten._to_copy.default(rows, dtype=acc)
            zeros = aten.full.default([nbags, d], 0, dtype=acc)
        if per_sample_weights is not None:
            psw = per_sample_weights if per_sample_weights.dtype == acc else \
                aten._to_copy.default(per_sample_weights, dtype=acc)
            rows = aten.mul.Tensor(rows, aten.view.default(psw, [-1, 1]))
        if kept is not None:
            rows = aten.where.self(kept, rows, aten.full.default([], 0, dtype=acc))
        out = aten.index_put.default(zeros, [o2b], rows, True)
        if mode == 1:
            out = aten.div.Tensor(out, aten.view.default(aten.clamp.default(bag_size, 1), [-1, 1]))
        if acc != weight.dtype:
            out = aten._to_copy.default(out, dtype=weight.dtype)
    if mode == 0:
        bag_size = aten.full.default([nbags], 0, dtype=torch.int64)
    if mode == 2:
        # the weight row of each bag's (first) maximum, per column
        winner = aten.eq.Tensor(rows, aten.index.Tensor(out, [o2b]))
        if kept is not None:
            winner = aten.logical_and.default(winner, kept)
        n = indices.shape[0]
        pos = aten.expand.default(aten.view.default(aten.arange.start_step(0, n, 1, dtype=torch.float32), [-1, 1]),
                                  [n, d])
        first = aten.scatter_reduce.two(aten.full.default([nbags, d], n, dtype=torch.float32), 0,
                                        aten.expand.default(aten.view.default(o2b, [-1, 1]), [n, d]),
                                        aten.where.self(winner, pos, aten.full.default([], n, dtype=torch.float32)),
                                        "amin", include_self=True)
        found = aten.lt.Scalar(first, n)
        first = aten._to_copy.default(first, dtype=torch.int64)
        flat_idx = aten.cat.default([indices, aten.full.default([1], 0, dtype=indices.dtype)])
        max_indices = aten.where.self(found, aten.index.Tensor(flat_idx, [first]),
                                      aten.full.default([], 0, dtype=indices.dtype))
    else:
        max_indices = aten.clone.default(bag_size)
    return out, o2b, bag_size, max_indices


@decomposition(aten._embedding_bag_backward.default)
def _embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                            scale_grad_by_freq, mode, sparse, per_sample_weights, padding_idx=-1):
    """Dense gradient of embedding_bag w.r.t. the weight: each position's bag gradient (scaled by its
    sample weight, or divided by the bag size for ``mean``) added into its row; for ``max`` each bag's
    gradient goes to the rows that won. Sparse gradients and ``scale_grad_by_freq`` are not
    decomposed (tn refuses them)."""
    if sparse or scale_grad_by_freq:   # torch's CPU scaling by frequency is not reproduced: refuse it
        return NotImplemented
    d = grad.shape[1]
    zeros = aten.full.default([int(num_weights), d], 0, dtype=grad.dtype)
    if mode == 2:
        nb = maximum_indices.shape[0]
        won = aten.gt.Scalar(aten.view.default(bag_size, [nb, 1]), 0)      # empty bags have no winner
        g = aten.where.self(won, grad, aten.full.default([], 0, dtype=grad.dtype))
        return aten.scatter_add.default(zeros, 0, maximum_indices, g)
    o2b, keep, _ = _bag_layout(indices, offsets, False, padding_idx)
    rows = aten.index.Tensor(grad, [o2b])
    if mode == 1:
        rows = aten.div.Tensor(rows, aten.view.default(
            aten._to_copy.default(aten.clamp.default(aten.index.Tensor(bag_size, [o2b]), 1), dtype=grad.dtype),
            [-1, 1]))
    elif per_sample_weights is not None:
        rows = aten.mul.Tensor(rows, aten.view.default(per_sample_weights, [-1, 1]))
    if keep is not None:
        rows = aten.where.self(aten.view.default(keep, [-1, 1]), rows, aten.full.default([], 0, dtype=grad.dtype))
    return aten.index_put.default(zeros, [indices], rows, True)


@decomposition(aten._embedding_bag_per_sample_weights_backward.default)
def _embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    """Gradient of a ``sum`` embedding_bag w.r.t. its per-sample weights: each position's row dotted
    with its bag's gradient (0 for padding)."""
    o2b, keep, _ = _bag_layout(indices, offsets, False, padding_idx)
    a, b = aten.index.Tensor(grad, [o2b]), aten.index.Tensor(weight, [indices])
    low = is_low_precision(grad.dtype)
    if low:   # the dot products in fp32, rounded once (as torch's CPU kernel)
        a, b = aten._to_copy.default(a, dtype=torch.float32), aten._to_copy.default(b, dtype=torch.float32)
    g = aten.sum.dim_IntList(aten.mul.Tensor(a, b), [1], False)
    if keep is not None:
        g = aten.where.self(keep, g, aten.full.default([], 0, dtype=g.dtype))
    return aten._to_copy.default(g, dtype=grad.dtype) if low else g



# --------------------------------------------------------------------------- distances, bilinear forms


def _pnorm_last(d: Tensor, p: float) -> Tensor:
    """The ``p``-norm of ``d`` over its last axis (``p = 0`` counts non-zeros), as torch's cdist/pdist."""
    if p == 0:
        return aten.sum.dim_IntList(aten._to_copy.default(aten.ne.Scalar(d, 0), dtype=d.dtype), [-1], False)
    a = aten.abs.default(d)
    if p == math.inf:
        return aten.amax.default(a, [-1], False)
    if p == 1:
        return aten.sum.dim_IntList(a, [-1], False)
    if p == 2:
        return aten.sqrt.default(aten.sum.dim_IntList(aten.mul.Tensor(d, d), [-1], False))
    return aten.pow.Tensor_Scalar(aten.sum.dim_IntList(aten.pow.Tensor_Scalar(a, p), [-1], False), 1.0 / p)


@decomposition(aten._cdist_forward.default)
def _cdist_forward(x1, x2, p, compute_mode=None):
    """Pairwise ``p``-norm distances of the rows of ``x1`` and ``x2`` (torch's choice of the
    matrix-product form for ``p = 2`` included, so results round alike)."""
    n1, n2 = x1.shape[-2], x2.shape[-2]
    if p == 2 and (compute_mode == 1 or (compute_mode in (None, 0) and (n1 > 25 or n2 > 25))):
        x1n = aten.sum.dim_IntList(aten.mul.Tensor(x1, x1), [-1], True)
        x2n = aten.sum.dim_IntList(aten.mul.Tensor(x2, x2), [-1], True)
        a = aten.cat.default([aten.mul.Tensor(x1, -2), x1n, aten.full_like.default(x1n, 1)], -1)
        b = aten.cat.default([x2, aten.full_like.default(x2n, 1), x2n], -1)
        r = aten.matmul.default(a, aten.transpose.int(b, -1, -2))
        return aten.sqrt.default(aten.clamp.default(r, 1e-30))
    d = aten.sub.Tensor(aten.unsqueeze.default(x1, -2), aten.unsqueeze.default(x2, -3))
    return _pnorm_last(d, float(p))


@decomposition(aten._pdist_forward.default)
def _pdist_forward(x, p=2.0):
    """Distances between rows ``i < j`` of ``x`` (row-major pair order)."""
    n = x.shape[0]
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    if not pairs:
        return aten.full.default([0], 0, dtype=x.dtype)
    ii = torch.tensor([i for i, _ in pairs], dtype=torch.int64)
    jj = torch.tensor([j for _, j in pairs], dtype=torch.int64)
    d = aten.sub.Tensor(aten.index.Tensor(x, [ii]), aten.index.Tensor(x, [jj]))
    return _pnorm_last(d, float(p))


def _low_precision(*dtypes: torch.dtype):
    """The 16-bit float dtype the operands promote to, or None (any other dtype)."""
    dt = dtypes[0]
    for d in dtypes[1:]:
        dt = torch.promote_types(dt, d)
    return dt if is_low_precision(dt) else None


@decomposition(aten._trilinear.default)
def _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """``sum over sumdim of i1.unsqueeze(expand1) * i2.unsqueeze(expand2) * i3.unsqueeze(expand3)`` as
    one einsum (matrix products, no broadcast product of all three). 16-bit operands are contracted in float32
    and the result rounded once: the einsum is two matrix products, and the first one's result rounded to bf16
    before the second lost the digits of a gradient that cancels (bilinear's input gradient at an element of
    -0.133 came out -0.158)."""
    low = _low_precision(i1.dtype, i2.dtype, i3.dtype)
    if low is not None:
        f32 = torch.float32
        r = _trilinear(*(aten._to_copy.default(t, dtype=f32) for t in (i1, i2, i3)), expand1, expand2, expand3,
                       sumdim, unroll_dim)
        return aten._to_copy.default(r, dtype=low)
    n = i1.dim() + len(expand1)
    letters = "abcdefghijklmnopqrstuvwxyz"[:n]
    subs = ["".join(letters[d] for d in range(n) if d not in set(e)) for e in (expand1, expand2, expand3)]
    out = "".join(letters[d] for d in range(n) if d not in set(sumdim))
    return torch.einsum(f"{subs[0]},{subs[1]},{subs[2]}->{out}", i1, i2, i3)


# grid_sampler_2d / grid_sampler_3d: the sampling positions are computed in float (unnormalize, then the
# padding mode: clamp for border, reflection with its parity taken in float, so no int8 appears), each
# corner (bilinear/trilinear), the nearest point or each of the 16 bicubic taps is one gather from the input
# flattened to [N, C, D*H*W], and the taps are summed with their weights in the order of torch's CPU kernels
# (2-d: the vectorised kernel's forms; 3-d: the scalar kernel's), so results match eager torch bit for bit on
# the reference backend.

def _gs_unnormalize(c: Tensor, size: int, align_corners: bool, two_d: bool) -> Tensor:
    """Grid coordinates in [-1, 1] to input coordinates, written as torch's 2-d (vectorised) or 3-d CPU
    kernel writes them, every step rounded as there (the compiler folds steps only where that rounds alike)."""
    if two_d:
        u = aten.mul.Tensor(aten.add.Scalar(c, 1), (size - 1) / 2 if align_corners else size / 2)
        return u if align_corners else aten.sub.Scalar(u, 0.5)
    if align_corners:
        return aten.mul.Tensor(aten.div.Scalar(aten.add.Scalar(c, 1), 2), size - 1)
    return aten.div.Scalar(aten.sub.Scalar(aten.mul.Tensor(aten.add.Scalar(c, 1), size), 1), 2)


def _gs_reflect(c: Tensor, twice_low: int, twice_high: int) -> Tensor:
    """``c`` reflected into [low, high] (bounds given doubled): the number of flips is even or odd by
    ``f - 2*floor(f/2)`` in float, exact for every integer-valued float ``f``."""
    if twice_low == twice_high:
        return aten.zeros_like.default(c)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    a = aten.abs.default(aten.sub.Tensor(c, low)) if low else aten.abs.default(c)
    extra = aten.fmod.Scalar(a, span)
    flips = aten.floor.default(aten.div.Scalar(a, span))
    odd = aten.sub.Tensor(flips, aten.mul.Tensor(aten.floor.default(aten.mul.Tensor(flips, 0.5)), 2))
    even_pos = aten.add.Tensor(extra, low) if low else extra
    odd_pos = aten.rsub.Scalar(extra, span)
    odd_pos = aten.add.Tensor(odd_pos, low) if low else odd_pos
    return aten.where.self(aten.eq.Scalar(odd, 0), even_pos, odd_pos)


def _gs_pad(c: Tensor, size: int, padding_mode: int, align_corners: bool) -> Tensor:
    """Input coordinates after the padding mode: 0 zeros (unchanged), 1 border (clamped), 2 reflection."""
    if padding_mode == 0:
        return c
    if padding_mode == 2:
        c = _gs_reflect(c, 0, 2 * (size - 1)) if align_corners else _gs_reflect(c, -1, 2 * size - 1)
    return aten.clamp.default(c, 0, size - 1)


def _gs_index(pos: Sequence[Tensor], sizes: Sequence[int]) -> Tuple[Tensor, Tensor]:
    """``(flat index [N, 1, P] int64, in_bounds)`` of the integer-valued float positions ``pos`` (one
    [N, 1, P] tensor per spatial axis, outermost first) in an input of spatial ``sizes``; out-of-bounds
    positions index element 0."""
    valid = None
    for p, n in zip(pos, sizes):
        ok = aten.logical_and.default(aten.ge.Scalar(p, 0), aten.lt.Scalar(p, n))
        valid = ok if valid is None else aten.logical_and.default(valid, ok)
    flat = None
    for p, n in zip(pos, sizes):
        i = aten._to_copy.default(aten.where.self(valid, p, aten.zeros_like.default(p)), dtype=torch.int64)
        flat = i if flat is None else aten.add.Tensor(aten.mul.Scalar(flat, n), i)
    return flat, valid


def _gs_tap(xt: Tensor, pos: Sequence[Tensor], sizes: Sequence[int]) -> Tuple[Tensor, Tensor]:
    """``(values [N, P, C], in_bounds [N, P, 1])`` of the channels-last input ``xt`` [N, prod(sizes), C] at
    the positions ``pos`` ([N, P, 1] each, see :func:`_gs_index`); out-of-bounds taps read element 0. One
    indexed row of C channels per point: a gather instruction fetches 128 points' channels at once, where an
    element gather of [N, C, P] fetched 128 elements (the 3-d OpInfo samples made ~10k instructions a tap)."""
    flat, valid = _gs_index(pos, sizes)
    N, P = int(flat.shape[0]), int(flat.shape[1])
    batch = aten.reshape.default(aten.arange.start(0, N, dtype=torch.int64, device=flat.device), [N, 1])
    return aten.index.Tensor(xt, [batch, aten.reshape.default(flat, [N, P])]), valid


def _gs_cubic_weights(t: Tensor) -> List[Tensor]:
    """The four cubic-convolution weights (A = -0.75, as torch) of taps -1, 0, 1, 2 at fraction ``t``, each
    product rounded as torch's kernels round it."""
    A = -0.75

    def near(s):   # |s| <= 1: ((A + 2) s - (A + 3)) s s + 1
        return aten.add.Scalar(aten.mul.Tensor(aten.mul.Tensor(
            aten.sub.Scalar(aten.mul.Tensor(s, A + 2), A + 3), s), s), 1)

    def far(s):    # 1 < |s| < 2: ((A s - 5A) s + 8A) s - 4A
        u = aten.add.Scalar(aten.mul.Tensor(aten.sub.Scalar(aten.mul.Tensor(s, A), 5 * A), s), 8 * A)
        return aten.sub.Scalar(aten.mul.Tensor(u, s), 4 * A)

    return [far(aten.add.Scalar(t, 1)), near(t), near(aten.rsub.Scalar(t, 1)), far(aten.rsub.Scalar(t, 2))]


def _gs_sum(terms: Sequence[Tensor]) -> Tensor:
    """``terms`` added left to right."""
    out = terms[0]
    for t in terms[1:]:
        out = aten.add.Tensor(out, t)
    return out


def _grid_sample(x: Tensor, grid: Tensor, interpolation_mode: int, padding_mode: int,
                 align_corners: bool) -> Tensor:
    """grid_sampler_2d (4-d ``x``) or grid_sampler_3d (5-d ``x``) as gathers and weights; 16-bit inputs are
    computed in fp32 and rounded once."""
    k = _ndim(x) - 2
    two_d = k == 2
    if interpolation_mode not in (0, 1, 2) or padding_mode not in (0, 1, 2) or (interpolation_mode == 2
                                                                                  and not two_d):
        return NotImplemented
    dt = x.dtype
    acc = acc_dtype(dt)
    if acc != dt:
        x = aten._to_copy.default(x, dtype=acc)
        grid = aten._to_copy.default(grid, dtype=acc)
    N, C = int(x.shape[0]), int(x.shape[1])
    sizes = [int(n) for n in x.shape[2:]]                       # outermost first: [D,] H, W
    out_sp = [int(n) for n in grid.shape[1:-1]]
    P = math.prod(out_sp)
    x3 = aten.permute.default(aten.reshape.default(x, [N, C, math.prod(sizes)]), [0, 2, 1])   # [N, S, C]
    g = aten.reshape.default(grid, [N, P, 1, k])                # positions [N, P, 1]; values [N, P, C]
    # grid's last axis is (x, y[, z]): x indexes W, the innermost axis
    raw = [aten.select.int(g, 3, k - 1 - a) for a in range(k)]
    raw = [_gs_unnormalize(c, n, align_corners, two_d) for c, n in zip(raw, sizes)]

    if interpolation_mode == 2:                                 # bicubic (2-d only)
        lo = [aten.floor.default(c) for c in raw]
        wy, wx = (_gs_cubic_weights(aten.sub.Tensor(c, f)) for c, f in zip(raw, lo))
        rows = []
        for i in range(4):
            py = _gs_pad(aten.add.Scalar(lo[0], i - 1), sizes[0], padding_mode, align_corners)
            row = []
            for j in range(4):
                px = _gs_pad(aten.add.Scalar(lo[1], j - 1), sizes[1], padding_mode, align_corners)
                v, ok = _gs_tap(x3, [py, px], sizes)
                row.append(aten.mul.Tensor(aten.where.self(ok, v, aten.zeros_like.default(v)), wx[j]))
            rows.append(aten.mul.Tensor(_gs_sum(row), wy[i]))
        out = _gs_sum(rows)
    else:
        pos = [_gs_pad(c, n, padding_mode, align_corners) for c, n in zip(raw, sizes)]
        if interpolation_mode == 1:                             # nearest (round half to even, as nearbyint)
            v, ok = _gs_tap(x3, [aten.round.default(c) for c in pos], sizes)
            out = aten.where.self(ok, v, aten.zeros_like.default(v))
        else:                                                   # bilinear / trilinear
            lo = [aten.floor.default(c) for c in pos]
            hi = [aten.add.Scalar(f, 1) for f in lo]
            if two_d:   # the vectorised kernel: fraction w, 1 - w; corner weight wy * wx
                fr = [aten.sub.Tensor(c, f) for c, f in zip(pos, lo)]
                per_axis = [(aten.rsub.Scalar(w, 1), w) for w in fr]
            else:       # the scalar kernel: hi - c, c - lo; corner weight wx * wy * wz
                per_axis = [(aten.sub.Tensor(h, c), aten.sub.Tensor(c, f)) for c, f, h in zip(pos, lo, hi)]
            terms = []
            for bits in itertools.product((0, 1), repeat=k):  # outermost axis slowest, as torch's corners
                ws = [per_axis[a][b] for a, b in enumerate(bits)]
                if two_d:
                    w = aten.mul.Tensor(ws[0], ws[1])
                else:
                    w = aten.mul.Tensor(aten.mul.Tensor(ws[2], ws[1]), ws[0])
                v, ok = _gs_tap(x3, [(hi if b else lo)[a] for a, b in enumerate(bits)], sizes)
                if two_d:
                    terms.append(aten.mul.Tensor(aten.where.self(ok, v, aten.zeros_like.default(v)), w))
                else:
                    t = aten.mul.Tensor(v, w)
                    terms.append(aten.where.self(ok, t, aten.zeros_like.default(t)))
            out = _gs_sum(terms)
    out = aten.reshape.default(aten.permute.default(out, [0, 2, 1]), [N, C] + out_sp)
    return aten._to_copy.default(out, dtype=dt) if acc != dt else out


@decomposition(aten.grid_sampler_2d.default,
               instead_of_torch="int8 parity: torch's takes reflection's flip parity as an int8 (no NeuronCore "
                                "dtype: three host ops); this takes it in float")
def _grid_sampler_2d(x, grid, interpolation_mode=0, padding_mode=0, align_corners=False):
    """grid_sampler_2d: bilinear (0), nearest (1) or bicubic (2) sampling of ``x`` [N, C, H, W] at ``grid``
    [N, oH, oW, 2] with zeros (0), border (1) or reflection (2) padding."""
    return _grid_sample(x, grid, interpolation_mode, padding_mode, align_corners)


@decomposition(aten.grid_sampler_3d.default)
def _grid_sampler_3d(x, grid, interpolation_mode=0, padding_mode=0, align_corners=False):
    """grid_sampler_3d: trilinear (0) or nearest (1) sampling of ``x`` [N, C, D, H, W] at ``grid``
    [N, oD, oH, oW, 3] with zeros (0), border (1) or reflection (2) padding."""
    return _grid_sample(x, grid, interpolation_mode, padding_mode, align_corners)


# The gradients of grid_sampler_{2,3}d: the input's is one scatter_add of every tap's weighted output
# gradient; the grid's is, per axis, the derivative of the tap weights times the gathered values (summed
# over channels), times the derivative of the padding mode (0 or +-1) and of the unnormalisation.

def _gs_pad_grad(c: Tensor, size: int, padding_mode: int, align_corners: bool) -> Tuple[Tensor, Any]:
    """``(position, d position / d c)`` of :func:`_gs_pad`: the derivative is ``None`` for zeros padding (1),
    else 0 where border/reflection clamp and +-1 where reflection mirrors."""
    if padding_mode == 0:
        return c, None
    mult = None
    if padding_mode == 2:
        twice_low, twice_high = (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)
        if twice_low == twice_high:
            z = aten.zeros_like.default(c)
            return z, z
        low, span = twice_low / 2, (twice_high - twice_low) / 2
        d = aten.sub.Tensor(c, low) if low else c
        sign = aten.where.self(aten.lt.Scalar(d, 0), aten.full_like.default(c, -1), aten.full_like.default(c, 1))
        flips = aten.floor.default(aten.div.Scalar(aten.abs.default(d), span))
        odd = aten.sub.Tensor(flips, aten.mul.Tensor(aten.floor.default(aten.mul.Tensor(flips, 0.5)), 2))
        mult = aten.where.self(aten.eq.Scalar(odd, 0), sign, aten.neg.default(sign))
        c = _gs_reflect(c, twice_low, twice_high)
    inside = aten.logical_and.default(aten.gt.Scalar(c, 0), aten.lt.Scalar(c, size - 1))
    clip = aten._to_copy.default(inside, dtype=c.dtype)
    mult = clip if mult is None else aten.mul.Tensor(mult, clip)
    return aten.clamp.default(c, 0, size - 1), mult


def _gs_cubic_coeff_grads(t: Tensor) -> List[Tensor]:
    """torch's ``get_cubic_coefficients_grad`` at fraction ``t`` (its forms and signs: minus d/dt of
    :func:`_gs_cubic_weights`; the grid gradient subtracts them), products rounded as there."""
    A = -0.75
    x0, x1 = aten.rsub.Scalar(t, -1), aten.rsub.Scalar(t, 0)
    x2, x3 = aten.rsub.Scalar(t, 1), aten.rsub.Scalar(t, 2)

    def poly(x, a, b):   # (a x + b) x
        return aten.mul.Tensor(aten.add.Scalar(aten.mul.Tensor(x, a), b), x)

    return [aten.sub.Scalar(poly(x0, -3 * A, -10 * A), 8 * A), poly(x1, -3 * (A + 2), -2 * (A + 3)),
            poly(x2, 3 * (A + 2), -2 * (A + 3)), aten.add.Scalar(poly(x3, 3 * A, -10 * A), 8 * A)]


def _gs_bicubic_grid_grad(vals: Any, g3: Tensor, wy: List[Tensor], wx: List[Tensor], t: Sequence[Tensor],
                          C: int) -> List[Tensor]:
    """``[d/dy, d/dx]`` (before the unnormalisation's scale) of the bicubic sample, [N, 1, P] each, summed as
    torch's vectorised kernel sums it: ``g -= value * grad_out * coeff_grad * coeff`` for each channel, each
    x tap, each y tap, in that order (the grid gradient of a flat region cancels to rounding noise, which only
    the same order reproduces). ``vals[i][j]``: the input at y tap ``i``, x tap ``j`` [N, C, P] (0 outside)."""
    dy, dx = (_gs_cubic_coeff_grads(f) for f in t)
    tx, ty = [], []
    for j in range(4):              # x taps outermost, as torch's loop
        for i in range(4):
            vg = aten.mul.Tensor(vals[i][j], g3)
            tx.append(aten.mul.Tensor(aten.mul.Tensor(vg, dx[j]), wy[i]))
            ty.append(aten.mul.Tensor(aten.mul.Tensor(vg, dy[i]), wx[j]))
    gx = gy = None
    for c in range(C):
        for a, b in zip(tx, ty):
            ac, bc = aten.slice.Tensor(a, 1, c, c + 1), aten.slice.Tensor(b, 1, c, c + 1)
            gx = aten.neg.default(ac) if gx is None else aten.sub.Tensor(gx, ac)
            gy = aten.neg.default(bc) if gy is None else aten.sub.Tensor(gy, bc)
    return [gy, gx]


def _grid_sample_backward(grad: Tensor, x: Tensor, grid: Tensor, interpolation_mode: int, padding_mode: int,
                          align_corners: bool, output_mask: Sequence[bool]) -> Any:
    """(grad_input, grad_grid) of :func:`_grid_sample` (``None`` where ``output_mask`` does not ask)."""
    k = _ndim(x) - 2
    two_d = k == 2
    if interpolation_mode not in (0, 1, 2) or padding_mode not in (0, 1, 2) or (interpolation_mode == 2
                                                                                  and not two_d):
        return NotImplemented
    dt, gdt = x.dtype, grid.dtype
    acc = acc_dtype(dt)
    if acc != dt:
        x, grid, grad = (aten._to_copy.default(t, dtype=acc) for t in (x, grid, grad))
    N, C = int(x.shape[0]), int(x.shape[1])
    sizes = [int(n) for n in x.shape[2:]]
    out_sp = [int(n) for n in grid.shape[1:-1]]
    P, S = math.prod(out_sp), math.prod(sizes)
    x3 = aten.reshape.default(x, [N, C, S])
    g3 = aten.reshape.default(grad, [N, C, P])
    gr = aten.reshape.default(grid, [N, 1, P, k])
    raw = [aten.select.int(gr, 3, k - 1 - a) for a in range(k)]
    raw = [_gs_unnormalize(c, n, align_corners, two_d) for c, n in zip(raw, sizes)]
    scale = [(n - 1) / 2 if align_corners else n / 2 for n in sizes]
    want_grid = bool(output_mask[1]) and interpolation_mode != 1
    taps: List[Tuple[Tensor, Tensor, Any]] = []         # (flat index, in bounds, output-gradient weights)
    gpos: List[Any] = [None] * k                         # d loss / d position, per axis

    def acc_pos(a, term):
        gpos[a] = term if gpos[a] is None else aten.add.Tensor(gpos[a], term)

    def gathered(flat, ok):
        """sum over channels of grad * x at the tap (0 out of bounds), [N, 1, P]."""
        v = aten.gather.default(x3, 2, aten.expand.default(flat, [N, C, P]))
        v = aten.where.self(ok, v, aten.zeros_like.default(v))
        return aten.sum.dim_IntList(aten.mul.Tensor(v, g3), [1], True)

    mults: List[Any] = [None] * k
    if interpolation_mode == 2:                                 # bicubic (2-d only)
        lo = [aten.floor.default(c) for c in raw]
        fr = [aten.sub.Tensor(c, f) for c, f in zip(raw, lo)]
        wy, wx = (_gs_cubic_weights(t) for t in fr)
        vals: List[List[Any]] = [[None] * 4 for _ in range(4)]
        for j in range(4):      # taps in torch's order (x outermost) for the input gradient's scatter too
            px = _gs_pad(aten.add.Scalar(lo[1], j - 1), sizes[1], padding_mode, align_corners)
            for i in range(4):
                py = _gs_pad(aten.add.Scalar(lo[0], i - 1), sizes[0], padding_mode, align_corners)
                flat, ok = _gs_index([py, px], sizes)
                taps.append((flat, ok, [wx[j], wy[i]]))
                if want_grid:
                    v = aten.gather.default(x3, 2, aten.expand.default(flat, [N, C, P]))
                    vals[i][j] = aten.where.self(ok, v, aten.zeros_like.default(v))
        if want_grid:
            gpos = _gs_bicubic_grid_grad(vals, g3, wy, wx, fr, C)
    else:
        padded = [_gs_pad_grad(c, n, padding_mode, align_corners) for c, n in zip(raw, sizes)]
        pos = [p for p, _ in padded]
        mults = [m for _, m in padded]
        if interpolation_mode == 1:
            flat, ok = _gs_index([aten.round.default(c) for c in pos], sizes)
            taps.append((flat, ok, None))
        else:
            lo = [aten.floor.default(c) for c in pos]
            hi = [aten.add.Scalar(f, 1) for f in lo]
            per_axis = [(aten.sub.Tensor(h, c), aten.sub.Tensor(c, f)) for c, f, h in zip(pos, lo, hi)]
            for bits in itertools.product((0, 1), repeat=k):
                ws = [per_axis[a][b] for a, b in enumerate(bits)]
                flat, ok = _gs_index([(hi if b else lo)[a] for a, b in enumerate(bits)], sizes)
                taps.append((flat, ok, [_gs_prod(ws)]))
                if want_grid:
                    gv = gathered(flat, ok)
                    for a in range(k):
                        others = [w for b, w in enumerate(ws) if b != a]
                        d = _gs_prod(others) if others else aten.ones_like.default(gv)
                        acc_pos(a, aten.mul.Tensor(gv, d) if bits[a] else aten.neg.default(aten.mul.Tensor(gv, d)))
    grad_x = grad_grid = None
    if output_mask[0]:
        idx = aten.cat.default([aten.expand.default(f, [N, C, P]) for f, _, _ in taps], 2)
        srcs = []
        for _, ok, ws in taps:
            t = g3
            for w in ws or ():        # grad_out * w0 * w1, left to right as torch
                t = aten.mul.Tensor(t, w)
            srcs.append(aten.where.self(ok, t, aten.zeros_like.default(t)))
        gx = aten.scatter_add.default(aten.full.default([N, C, S], 0, dtype=x.dtype), 2, idx,
                                      aten.cat.default(srcs, 2))
        grad_x = aten.reshape.default(gx, list(x.shape))
        if acc != dt:
            grad_x = aten._to_copy.default(grad_x, dtype=dt)
    if output_mask[1]:
        if not want_grid:
            grad_grid = aten.full.default(list(grid.shape), 0, dtype=gdt)
        else:
            comps = []
            for a in range(k):
                gp = aten.mul.Tensor(gpos[a], scale[a])
                if mults[a] is not None:
                    gp = aten.mul.Tensor(gp, mults[a])
                comps.append(gp)
            gg = aten.stack.default(comps[::-1], 3)               # [N, 1, P, k], x first
            grad_grid = aten.reshape.default(gg, list(grid.shape))
            if grad_grid.dtype != gdt:
                grad_grid = aten._to_copy.default(grad_grid, dtype=gdt)
    return grad_x, grad_grid


def _gs_prod(ws: Sequence[Tensor]) -> Tensor:
    """``ws`` multiplied left to right."""
    out = ws[0]
    for w in ws[1:]:
        out = aten.mul.Tensor(out, w)
    return out


@decomposition(aten.grid_sampler_2d_backward.default)
def _grid_sampler_2d_backward(grad, x, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    """Gradients of grid_sampler_2d with respect to the input and the grid."""
    return _grid_sample_backward(grad, x, grid, interpolation_mode, padding_mode, align_corners, output_mask)


@decomposition(aten.grid_sampler_3d_backward.default)
def _grid_sampler_3d_backward(grad, x, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    """Gradients of grid_sampler_3d with respect to the input and the grid."""
    return _grid_sample_backward(grad, x, grid, interpolation_mode, padding_mode, align_corners, output_mask)
