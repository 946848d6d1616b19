# Gradients of torch's separable resampling (interpolate/upsample backward) as per-axis transposed weight matrices.
"""Backward of ``F.interpolate``'s nearest, nearest-exact, linear, bilinear, bicubic and trilinear modes.

Every one of these resamplings is separable and linear in its input: along each spatial axis the output is
``out[o] = sum_c A[o, c] * in[c]`` with a fixed ``[out, in]`` weight matrix ``A`` (0/1 for nearest, two
non-zero taps for linear, four clamped taps for bicubic), and the N-d op applies one such matrix per axis.
Its gradient is therefore the transposed matrices applied to the output gradient, one axis after the other:
one small matmul per axis (TensorE work), instead of torch's scatter of every output element into its taps
(which has no NeuronCore lowering and made every ``interpolate`` gradient a host op).

The matrices are not re-derived here: each is torch's own forward kernel applied, at trace time, to an
identity probe (the axis under study carries ``in`` one-hot channels; the other spatial axes have size 1,
which every mode maps to itself with weight exactly 1). So the taps, the clamping at the borders, the
``align_corners`` rule and the handling of explicit ``scale_factor`` s are torch's by construction. Sums
differ from torch's scatter only in the order of fp32 additions. Matrices are cached per
(op, axis sizes, options) and bounded in size (:data:`MAX_MATRIX`); beyond that the op stays a host op.
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .low_precision import acc_dtype
from .table import decomposition

aten = torch.ops.aten

#: Largest per-axis matrix (elements) built as a constant; a larger axis leaves the op to the host.
MAX_MATRIX = 1 << 22

# backward overload -> (forward overload, number of spatial dims, whether it takes align_corners)
_FORWARD = {
    aten.upsample_nearest1d_backward.default: (aten.upsample_nearest1d.default, 1, False),
    aten.upsample_nearest2d_backward.default: (aten.upsample_nearest2d.default, 2, False),
    aten.upsample_nearest3d_backward.default: (aten.upsample_nearest3d.default, 3, False),
    aten._upsample_nearest_exact1d_backward.default: (aten._upsample_nearest_exact1d.default, 1, False),
    aten._upsample_nearest_exact2d_backward.default: (aten._upsample_nearest_exact2d.default, 2, False),
    aten._upsample_nearest_exact3d_backward.default: (aten._upsample_nearest_exact3d.default, 3, False),
    aten.upsample_linear1d_backward.default: (aten.upsample_linear1d.default, 1, True),
    aten.upsample_bilinear2d_backward.default: (aten.upsample_bilinear2d.default, 2, True),
    aten.upsample_trilinear3d_backward.default: (aten.upsample_trilinear3d.default, 3, True),
    aten.upsample_bicubic2d_backward.default: (aten.upsample_bicubic2d.default, 2, True),
}


@functools.lru_cache(maxsize=256)
def axis_matrix(forward: Any, k: int, axis: int, n_in: int, n_out: int, align: Optional[bool],
                scale: Optional[float]) -> Optional[torch.Tensor]:
    """The ``[n_out, n_in]`` weight matrix ``A`` of spatial axis ``axis`` of a ``k``-d resampling
    (``out[o] = sum_c A[o, c] * in[c]``, so ``grad_in = grad_out @ A`` along that axis), from torch's ``forward``
    kernel on an identity probe; ``None`` when it is the identity. The caller bounds its size
    (:data:`MAX_MATRIX`)."""
    with _disable_current_modes():
        ones = [1] * k
        shape = [1, n_in] + ones
        shape[2 + axis] = n_in
        probe = torch.zeros(shape, dtype=torch.float32)
        idx = [0, torch.arange(n_in)] + [0] * k
        idx[2 + axis] = torch.arange(n_in)
        probe[tuple(idx)] = 1.0
        size = list(ones)
        size[axis] = n_out
        scales = [None] * k
        scales[axis] = scale
        args = [probe, size] + ([align] if align is not None else []) + scales
        out = forward(*args)                       # [1, n_in, ..., n_out at axis, ...]
        m = out.reshape(n_in, n_out).t().contiguous()   # [n_out, n_in]: out[o] = sum_c m[o, c] * in[c]
        if n_in == n_out and torch.equal(m, torch.eye(n_in)):
            return None
        return m


_SCALE_NAMES = {1: ("scales",), 2: ("scales_h", "scales_w"), 3: ("scales_d", "scales_h", "scales_w")}


def _resample_backward(func: Any, grad_output: torch.Tensor, output_size: Sequence[int],
                       input_size: Sequence[int], *rest: Any, **kw: Any) -> Any:
    forward, k, takes_align = _FORWARD[func]
    rest = list(rest)
    if takes_align:
        align = bool(rest.pop(0) if rest else kw.get("align_corners", False))
    else:
        align = None
    names = _SCALE_NAMES[k]
    scales = [rest[i] if i < len(rest) else kw.get(names[i]) for i in range(k)]
    mats = []
    for axis in range(k):
        n_in, n_out = int(input_size[2 + axis]), int(output_size[axis])
        s = None if scales[axis] is None else float(scales[axis])
        if n_in * n_out > MAX_MATRIX:
            return NotImplemented
        mats.append(axis_matrix(forward, k, axis, n_in, n_out, align, s))
    g = grad_output
    acc = acc_dtype(g.dtype)
    g = g.to(acc)
    for axis in range(k):
        m = mats[axis]
        if m is None:
            continue
        dim = 2 + axis
        moved = g.movedim(dim, -1)
        g = torch.matmul(moved, m.to(acc)).movedim(-1, dim)
    return g.to(grad_output.dtype).contiguous()


def _backward_of(ov: Any) -> Any:
    def resample_backward(*args: Any, **kwargs: Any) -> Any:
        """Decomposition of one resampling backward overload (see the module docstring)."""
        return _resample_backward(ov, *args, **kwargs)

    return resample_backward


def _register() -> None:
    for ov in _FORWARD:
        decomposition(ov)(_backward_of(ov))


_register()
