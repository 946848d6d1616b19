# The core ops: every op the IR may contain (elementwise, reductions, scans, sort, matmul, conv, pool, shape, index, creation, random, host) with its torch reference and its aten/prims converters.
"""The core op set (listed in :mod:`tn.ops`' docstring) and the converters that map aten and prims overloads onto it.

Each op is registered with :func:`tn.ops.table.register` on its reference
implementation; each converter with :func:`tn.ops.table.from_aten` on the
overloads it takes (``(inputs, attrs)`` in the op's form, :data:`IDENTITY`, or
``None`` to decompose the call instead).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .low_precision import is_low_precision
from .table import FROM_ATEN, IDENTITY, OPS, Op, from_aten, register

aten = torch.ops.aten
Tensor = torch.Tensor

# --------------------------------------------------------------------------- helpers


def _wrap(s: Any, like: Tensor) -> Tensor:
    """A Python scalar as a 0-d tensor on ``like``'s device (bool, int64 or the default float)."""
    if isinstance(s, Tensor):
        return s
    dtype = (torch.bool if isinstance(s, bool) else torch.int64 if isinstance(s, int)
             else torch.complex64 if isinstance(s, complex) else torch.get_default_dtype())
    return torch.scalar_tensor(s, dtype=dtype, device=like.device)


def _ndim(x: Any) -> int:
    return x.dim() if isinstance(x, Tensor) else 0


def _dims(dim: Any, ndim: int) -> Tuple[int, ...]:
    """Canonical reduction dims: sorted, non-negative; ``None``/``[]`` mean all."""
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = [dim]
    if len(dim) == 0:
        return tuple(range(ndim))
    if ndim == 0:
        return ()
    return tuple(sorted({d % ndim for d in dim}))


def _dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


# --------------------------------------------------------------------------- elementwise: unary

_UNARY = [
    "neg", "abs", "exp", "exp2", "expm1", "log", "log2", "log1p", "sqrt", "rsqrt", "reciprocal",
    "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh",
    "sigmoid", "erf", "erfinv", "relu", "sign", "floor", "ceil", "trunc", "logical_not",
    "bitwise_not", "isnan", "isinf",
]


def _unary_conv(x: Any) -> Tuple[List[Any], Dict[str, Any]]:
    return [x], {}


def _make_unary(name: str) -> Op:
    overload = getattr(aten, name).default

    def impl(x: Tensor) -> Tensor:
        return overload(x)

    impl.__name__ = name
    impl.__doc__ = f"Elementwise {name} (aten.{name})."
    op = register(name, "elementwise", (overload,))(impl)
    from_aten(op, overload)(_unary_conv)
    return op


for _n in _UNARY:
    _make_unary(_n)


@register("conj", "elementwise")
def conj(x: Tensor) -> Tensor:
    """Complex conjugate, materialized (aten._conj's conjugate view, aten.conj_physical)."""
    return aten.conj_physical.default(x)


@from_aten(conj, aten._conj.default, aten.conj_physical.default, aten._conj_physical.default)
def _conj_conv(x):
    # the view torch marks with a conjugate bit is a value here; real tensors are their own conjugate
    return [x], {} if isinstance(x, complex) or isinstance(x, Tensor) and x.is_complex() else IDENTITY


from_aten(OPS["neg"], aten._neg_view.default)(_unary_conv)   # the negative-bit view of conj(x).imag


@register("round", "elementwise")
def round_(x: Tensor) -> Tensor:
    """Round half to even (aten.round)."""
    return aten.round.default(x)


@from_aten(OPS["round"], aten.round.default)
def _round_conv(x):
    return [x], {}


@register("gelu", "elementwise")
def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """GELU activation; ``approximate`` is ``'none'`` (erf) or ``'tanh'``."""
    return aten.gelu.default(x, approximate=approximate)


@from_aten(gelu, aten.gelu.default)
def _gelu_conv(x, approximate="none"):
    return [x], ({} if approximate == "none" else {"approximate": approximate})


@register("convert", "elementwise")
def convert(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Cast to ``dtype`` (aten._to_copy with a dtype, prims.convert_element_type)."""
    if not isinstance(x, Tensor):
        x = _wrap(x, torch.empty(0))
    return x.to(dtype)


@from_aten(convert, aten._to_copy.default)
def _to_copy_conv(x, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
                  memory_format=None):
    if dtype is None or dtype == x.dtype:
        return IDENTITY
    return [x], {"dtype": dtype}


@from_aten(convert, torch.ops.prims.convert_element_type.default)
def _convert_conv(x, dtype):
    if dtype == x.dtype:
        return IDENTITY
    return [x], {"dtype": dtype}


# --------------------------------------------------------------------------- elementwise: binary


def _binary_conv(x, y):
    return [x, y], {}


def _alpha_conv(x, y, alpha=1):
    return ([x, y], {}) if alpha == 1 else None


def _make_binary(name: str, impl: Callable[[Any, Any], Tensor], overloads: Sequence[Any],
                 conv: Callable[..., Any] = _binary_conv, doc: str = "") -> Op:
    impl.__name__ = name
    impl.__doc__ = doc or f"Elementwise {name}; either input may be a Python scalar."
    op = register(name, "elementwise")(impl)
    from_aten(op, *overloads)(conv)
    return op


def _tensor_fn(fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Any, Any], Tensor]:
    def impl(x, y):
        if not isinstance(x, Tensor):
            x = _wrap(x, y)
        if not isinstance(y, Tensor):
            y = _wrap(y, x)
        return fn(x, y)
    return impl


_make_binary("add", lambda x, y: x + y, [aten.add.Tensor, aten.add.Scalar], _alpha_conv)
_make_binary("sub", lambda x, y: x - y, [aten.sub.Tensor, aten.sub.Scalar], _alpha_conv)
_make_binary("mul", lambda x, y: x * y, [aten.mul.Tensor, aten.mul.Scalar])
_make_binary("pow", lambda x, y: x ** y,
             [aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar])
_make_binary("remainder", lambda x, y: x % y, [aten.remainder.Tensor, aten.remainder.Scalar])
_make_binary("fmod", _tensor_fn(torch.fmod), [aten.fmod.Tensor, aten.fmod.Scalar])
_make_binary("maximum", _tensor_fn(torch.maximum), [aten.maximum.default])
_make_binary("minimum", _tensor_fn(torch.minimum), [aten.minimum.default])
_make_binary("atan2", _tensor_fn(torch.atan2), [aten.atan2.default])
for _n in ("eq", "ne", "lt", "le", "gt", "ge"):
    _make_binary(_n, _tensor_fn(getattr(torch, _n)),
                 [getattr(aten, _n).Tensor, getattr(aten, _n).Scalar])
for _n in ("logical_and", "logical_or", "logical_xor"):
    _make_binary(_n, _tensor_fn(getattr(torch, _n)), [getattr(aten, _n).default])
for _n in ("bitwise_and", "bitwise_or", "bitwise_xor"):
    _make_binary(_n, _tensor_fn(getattr(torch, _n)),
                 [getattr(aten, _n).Tensor, getattr(aten, _n).Scalar])
for _n, _dunder, _prim in (("bitwise_left_shift", "__lshift__", "shift_left"),
                           ("bitwise_right_shift", "__rshift__", "shift_right_arithmetic")):
    _make_binary(_n, _tensor_fn(getattr(torch, _n)),
                 [getattr(aten, _n).Tensor, getattr(aten, _n).Tensor_Scalar, getattr(aten, _n).Scalar_Tensor,
                  getattr(aten, _dunder).Tensor, getattr(aten, _dunder).Scalar,
                  getattr(torch.ops.prims, _prim).default],
                 doc=f"Elementwise {_n} of integers (torch's results for negative or too wide shift amounts); "
                     f"either input may be a Python scalar.")


@register("div", "elementwise")
def div(x: Any, y: Any, rounding_mode: Optional[str] = None) -> Tensor:
    """Elementwise division; ``rounding_mode`` is None (true), ``'trunc'`` or ``'floor'``."""
    if rounding_mode is None:
        return x / y
    if not isinstance(x, Tensor):
        x = _wrap(x, y)
    return torch.div(x, y, rounding_mode=rounding_mode)


@from_aten(div, aten.div.Tensor, aten.div.Scalar)
def _div_conv(x, y):
    return [x, y], {}


@from_aten(div, aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div_mode_conv(x, y, *, rounding_mode=None):
    return [x, y], ({} if rounding_mode is None else {"rounding_mode": rounding_mode})


@register("where", "elementwise")
def where(c: Tensor, x: Any, y: Any) -> Tensor:
    """``x`` where ``c`` else ``y``; ``x`` and ``y`` may be Python scalars."""
    if not isinstance(x, Tensor):
        x = _wrap(x, c)
    if not isinstance(y, Tensor):
        y = _wrap(y, c)
    return aten.where.self(c, x, y)


@from_aten(where, aten.where.self)
def _where_conv(c, x, y):
    return [c, x, y], {}


# --------------------------------------------------------------------------- reductions and scans


def _reduction(name: str, fn: Callable[..., Tensor], with_dtype: bool, doc: str, alu: str, identity: Any) -> Op:
    def impl(x: Tensor, dims: Tuple[int, ...], keepdim: bool = False, dtype: Optional[torch.dtype] = None) -> Tensor:
        if with_dtype:
            return fn(x, dims, keepdim, dtype)
        return fn(x, dims, keepdim)

    impl.__name__ = name
    impl.__doc__ = doc
    return register(name, "reduction", reduce_alu=alu, reduce_identity=identity)(impl)


def _prod(x, dims, keepdim, dtype):
    if x.dim() == 0:
        return aten.prod.default(x, dtype=dtype)
    out = x
    for d in sorted(dims, reverse=True):
        out = aten.prod.dim_int(out, d, keepdim, dtype=dtype)
        dtype = None
    return out


def _any(x, dims, keepdim):
    if x.dim() == 0:
        return aten.any.default(x)
    return aten.any.dims(x, list(dims), keepdim)


_reduction("sum", lambda x, dims, keepdim, dtype: aten.sum.dim_IntList(x, list(dims), keepdim, dtype=dtype),
           True, "Sum over ``dims`` (sorted, non-negative); ``dtype`` is the accumulation/result dtype.", "add", 0.0)
_reduction("prod", _prod, True, "Product over ``dims``.", "multiply", 1.0)
_reduction("amax", lambda x, dims, keepdim: aten.amax.default(x, list(dims), keepdim), False,
           "Maximum over ``dims`` (NaN propagates).", "max", -math.inf)
_reduction("amin", lambda x, dims, keepdim: aten.amin.default(x, list(dims), keepdim), False,
           "Minimum over ``dims`` (NaN propagates).", "min", math.inf)
_reduction("any", _any, False, "Logical or over ``dims``.", "logical_or", False)


def _red_attrs(x, dim, keepdim, dtype=None):
    attrs: Dict[str, Any] = {"dims": _dims(dim, _ndim(x)), "keepdim": bool(keepdim)}
    if dtype is not None:
        attrs["dtype"] = dtype
    return [x], attrs


@from_aten(OPS["sum"], aten.sum.dim_IntList)
def _sum_conv(x, dim=None, keepdim=False, *, dtype=None):
    return _red_attrs(x, dim, keepdim, dtype)


@from_aten(OPS["sum"], torch.ops.prims.sum.default)
def _prims_sum_conv(x, dims, *, output_dtype=None):
    return _red_attrs(x, dims, False, output_dtype)


@from_aten(OPS["sum"], aten.sum.default)
def _sum_all_conv(x, *, dtype=None):
    return _red_attrs(x, None, False, dtype)


@from_aten(OPS["prod"], aten.prod.dim_int)
def _prod_conv(x, dim, keepdim=False, *, dtype=None):
    return _red_attrs(x, dim, keepdim, dtype)


@from_aten(OPS["prod"], aten.prod.default)
def _prod_all_conv(x, *, dtype=None):
    return _red_attrs(x, None, False, dtype)


@from_aten(OPS["amax"], aten.amax.default)
def _amax_conv(x, dim=(), keepdim=False):
    return _red_attrs(x, dim, keepdim)


@from_aten(OPS["amin"], aten.amin.default)
def _amin_conv(x, dim=(), keepdim=False):
    return _red_attrs(x, dim, keepdim)


@from_aten(OPS["amax"], aten.max.default)
def _max_all_conv(x):
    return _red_attrs(x, None, False)


@from_aten(OPS["amin"], aten.min.default)
def _min_all_conv(x):
    return _red_attrs(x, None, False)


@from_aten(OPS["any"], aten.any.default)
def _any_all_conv(x):
    return _red_attrs(x, None, False)


@from_aten(OPS["any"], aten.any.dim, aten.any.dims)
def _any_conv(x, dim=None, keepdim=False):
    return _red_attrs(x, dim, keepdim)


@register("argmax", "reduction")
def argmax(x: Tensor, dim: Optional[int] = None, keepdim: bool = False) -> Tensor:
    """Index of the first maximum along ``dim`` (``None``: of the flattened tensor)."""
    return aten.argmax.default(x, dim, keepdim)


@register("argmin", "reduction")
def argmin(x: Tensor, dim: Optional[int] = None, keepdim: bool = False) -> Tensor:
    """Index of the first minimum along ``dim`` (``None``: of the flattened tensor)."""
    return aten.argmin.default(x, dim, keepdim)


@from_aten(argmax, aten.argmax.default)
@from_aten(argmin, aten.argmin.default)
def _arg_conv(x, dim=None, keepdim=False):
    attrs: Dict[str, Any] = {}
    if dim is not None:
        attrs["dim"] = _dim(dim, _ndim(x))
    if keepdim:
        attrs["keepdim"] = True
    return [x], attrs


@register("cumsum", "scan")
def cumsum(x: Tensor, dim: int, dtype: Optional[torch.dtype] = None) -> Tensor:
    """Inclusive prefix sum along ``dim``."""
    return aten.cumsum.default(x, dim, dtype=dtype)


@from_aten(cumsum, aten.cumsum.default)
def _cumsum_conv(x, dim, *, dtype=None):
    attrs: Dict[str, Any] = {"dim": _dim(dim, _ndim(x))}
    if dtype is not None:
        attrs["dtype"] = dtype
    return [x], attrs


@register("cummax", "scan")
def cummax(x: Tensor, dim: int) -> Tuple[Tensor, Tensor]:
    """(running maximum, int64 index of the last element holding it) along ``dim``; NaN wins and stays."""
    return tuple(aten.cummax.default(x, dim))


@register("cummin", "scan")
def cummin(x: Tensor, dim: int) -> Tuple[Tensor, Tensor]:
    """(running minimum, int64 index of the last element holding it) along ``dim``; NaN wins and stays."""
    return tuple(aten.cummin.default(x, dim))


@register("logcumsumexp", "scan")
def logcumsumexp(x: Tensor, dim: int) -> Tensor:
    """``log(cumsum(exp(x)))`` along ``dim``, computed without overflow."""
    return aten.logcumsumexp.default(x, dim)


@from_aten(cummax, aten.cummax.default)
@from_aten(cummin, aten.cummin.default)
@from_aten(logcumsumexp, aten.logcumsumexp.default)
def _scan_conv(x, dim):
    return [x], {"dim": _dim(dim, _ndim(x))}


@register("sort", "sort")
def sort(x: Tensor, dim: int = -1, descending: bool = False, stable: bool = False) -> Tuple[Tensor, Tensor]:
    """(values, indices) of ``x`` sorted along ``dim``."""
    return tuple(aten.sort.stable(x, stable=stable, dim=dim, descending=descending))


@from_aten(sort, aten.sort.default)
def _sort_conv(x, dim=-1, descending=False):
    return [x], {"dim": _dim(dim, _ndim(x)), "descending": bool(descending), "stable": False}


@from_aten(sort, aten.sort.stable)
def _sort_stable_conv(x, *, stable=None, dim=-1, descending=False):
    return [x], {"dim": _dim(dim, _ndim(x)), "descending": bool(descending), "stable": bool(stable)}


@register("topk", "sort")
def topk(x: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Tuple[Tensor, Tensor]:
    """(values, indices) of the ``k`` largest (or smallest) elements along ``dim``."""
    return tuple(aten.topk.default(x, k, dim, largest, sorted))


@from_aten(topk, aten.topk.default)
def _topk_conv(x, k, dim=-1, largest=True, sorted=True):
    return [x], {"k": int(k), "dim": _dim(dim, _ndim(x)), "largest": bool(largest), "sorted": bool(sorted)}


# --------------------------------------------------------------------------- matmul, conv, pool


@register("matmul", "matmul")
def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``[..., M, K] @ [..., K, N]`` with equal batch dims (aten mm, bmm)."""
    if a.dim() == 2:
        return aten.mm.default(a, b)
    if a.dim() == 3:
        return aten.bmm.default(a, b)
    return torch.matmul(a, b)


@from_aten(matmul, aten.mm.default, aten.bmm.default)
def _mm_conv(a, b):
    return [a, b], {}


@register("convolution", "conv")
def convolution(x: Tensor, w: Tensor, b: Optional[Tensor] = None, *, stride: Tuple[int, ...],
                padding: Tuple[int, ...], dilation: Tuple[int, ...], transposed: bool,
                output_padding: Tuple[int, ...], groups: int) -> Tensor:
    """N-d convolution (aten.convolution); the bias input is optional."""
    return aten.convolution.default(x, w, b, list(stride), list(padding), list(dilation), transposed,
                                    list(output_padding), groups)


@from_aten(convolution, aten.convolution.default)
def _conv_conv(x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    if _ndim(w) == 5:
        return None     # 3-d: 2-d convolutions over depth-stacked channels (_conv3d_decomp, _conv_transpose3d_decomp)
    inputs = [x, w] if b is None else [x, w, b]
    return inputs, {"stride": tuple(stride), "padding": tuple(padding), "dilation": tuple(dilation),
                    "transposed": bool(transposed), "output_padding": tuple(output_padding),
                    "groups": int(groups)}


@register("convolution_backward", "conv")
def convolution_backward(grad: Tensor, x: Tensor, w: Tensor, *, bias_sizes: Optional[Tuple[int, ...]],
                         stride: Tuple[int, ...], padding: Tuple[int, ...], dilation: Tuple[int, ...],
                         transposed: bool, output_padding: Tuple[int, ...], groups: int,
                         output_mask: Tuple[bool, bool, bool]) -> Tuple[Tensor, ...]:
    """Gradients of convolution w.r.t. (input, weight, bias), only those in ``output_mask``."""
    out = aten.convolution_backward.default(
        grad, x, w, None if bias_sizes is None else list(bias_sizes), list(stride), list(padding),
        list(dilation), transposed, list(output_padding), groups, list(output_mask))
    return tuple(o for o, m in zip(out, output_mask) if m)


@from_aten(convolution_backward, aten.convolution_backward.default)
def _conv_bwd_conv(grad, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding,
                   groups, output_mask):
    if _ndim(w) == 5:
        return None     # 3-d: the gradients of the 2-d form (_conv3d_backward_decomp, _conv_transpose3d_backward_decomp)
    return [grad, x, w], {
        "bias_sizes": None if bias_sizes is None else tuple(bias_sizes), "stride": tuple(stride),
        "padding": tuple(padding), "dilation": tuple(dilation), "transposed": bool(transposed),
        "output_padding": tuple(output_padding), "groups": int(groups),
        "output_mask": tuple(bool(m) for m in output_mask)}


def _pool_attrs(kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    return {"kernel_size": tuple(kernel_size), "stride": tuple(stride), "padding": tuple(padding),
            "ceil_mode": bool(ceil_mode), "count_include_pad": bool(count_include_pad),
            "divisor_override": divisor_override}


@register("avg_pool2d", "pool")
def avg_pool2d(x: Tensor, *, kernel_size, stride, padding, ceil_mode, count_include_pad,
               divisor_override) -> Tensor:
    """2-d average pooling (aten.avg_pool2d)."""
    return aten.avg_pool2d.default(x, list(kernel_size), list(stride), list(padding), ceil_mode,
                                   count_include_pad, divisor_override)


@from_aten(avg_pool2d, aten.avg_pool2d.default)
def _avg_pool_conv(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                   divisor_override=None):
    if isinstance(padding, int):
        padding = (padding,)
    return [x], _pool_attrs(kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@register("avg_pool2d_backward", "pool")
def avg_pool2d_backward(grad: Tensor, x: Tensor, *, kernel_size, stride, padding, ceil_mode,
                        count_include_pad, divisor_override) -> Tensor:
    """Gradient of 2-d average pooling w.r.t. its input."""
    return aten.avg_pool2d_backward.default(grad, x, list(kernel_size), list(stride), list(padding),
                                            ceil_mode, count_include_pad, divisor_override)


@from_aten(avg_pool2d_backward, aten.avg_pool2d_backward.default)
def _avg_pool_bwd_conv(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                       divisor_override):
    return [grad, x], _pool_attrs(kernel_size, stride, padding, ceil_mode, count_include_pad,
                                  divisor_override)


# --------------------------------------------------------------------------- shape


@register("reshape", "shape")
def reshape(x: Tensor, shape: Tuple[int, ...]) -> Tensor:
    """Same elements in row-major order, new ``shape`` (view, reshape, squeeze, unsqueeze)."""
    return x.reshape(shape)


@from_aten(reshape, aten._unsafe_view.default, aten.view_copy.default, aten._reshape_copy.default)
def _reshape_conv(x, size):
    shape = tuple(torch.empty(tuple(x.shape), device="meta").reshape(size).shape)
    if shape == tuple(x.shape):
        return IDENTITY
    return [x], {"shape": shape}


@register("permute", "shape")
def permute(x: Tensor, dims: Tuple[int, ...]) -> Tensor:
    """Reorder dimensions: output dim i is input dim ``dims[i]``."""
    return x.permute(dims)


@from_aten(permute, aten.permute_copy.default)
def _permute_conv(x, dims):
    return [x], {"dims": tuple(_dim(d, _ndim(x)) for d in dims)}


@register("expand", "shape")
def expand(x: Tensor, shape: Tuple[int, ...]) -> Tensor:
    """Broadcast to ``shape`` (numpy rules; new leading dims allowed)."""
    return x.expand(shape)


@from_aten(expand, aten.expand_copy.default)
def _expand_conv(x, size, *, implicit=False):
    shape = tuple(torch.empty(tuple(x.shape), device="meta").expand(size).shape)
    return [x], {"shape": shape}


@register("slice", "shape")
def slice_(x: Tensor, dim: int, start: int, end: int, step: int = 1) -> Tensor:
    """``x[..., start:end:step, ...]`` along ``dim`` (bounds already clamped)."""
    return aten.slice.Tensor(x, dim, start, end, step).clone()


def slice_bounds(size: int, start: Optional[int], end: Optional[int]) -> Tuple[int, int]:
    """Python slice bounds clamped into ``[0, size]`` with ``start <= end``."""
    start = 0 if start is None else start
    end = size if end is None else end
    if start < 0:
        start += size
    if end < 0:
        end += size
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return start, end


@from_aten(slice_, aten.slice_copy.Tensor)
def _slice_conv(x, dim=0, start=None, end=None, step=1):
    dim = _dim(dim, _ndim(x))
    start, end = slice_bounds(x.shape[dim], start, end)
    return [x], {"dim": dim, "start": start, "end": end, "step": step}


@register("slice_scatter", "shape")
def slice_scatter(x: Tensor, src: Tensor, dim: int, start: int, end: int, step: int = 1) -> Tensor:
    """A copy of ``x`` with ``x[..., start:end:step, ...] = src`` along ``dim``."""
    return aten.slice_scatter.default(x, src, dim, start, end, step)


@from_aten(slice_scatter, aten.slice_scatter.default)
def _slice_scatter_conv(x, src, dim=0, start=None, end=None, step=1):
    dim = _dim(dim, _ndim(x))
    start, end = slice_bounds(x.shape[dim], start, end)
    return [x, src], {"dim": dim, "start": start, "end": end, "step": step}


@register("cat", "shape")
def cat(*xs: Tensor, dim: int) -> Tensor:
    """Concatenate the inputs along ``dim``."""
    return aten.cat.default(list(xs), dim)


@from_aten(cat, aten.cat.default)
def _cat_conv(xs, dim=0):
    nd = max(_ndim(x) for x in xs)
    # operands with no elements (legacy 1-d empties, zero length along ``dim``) add nothing: dropped, unless
    # nothing else is left (the chip never sees a zero-size operand); when they take part in the dtype
    # promotion, the others are cast first (_cat_decomp)
    full = [x for x in xs if x.numel() > 0]
    if full and len(full) < len(xs):
        if _promoted(full) != _promoted(xs):
            return None
        xs = full
    else:
        xs = [x for x in xs if not (x.dim() == 1 and x.shape[0] == 0 and nd > 1)]
    return list(xs), {"dim": _dim(dim, nd)}


def _promoted(xs: Sequence[Any]) -> torch.dtype:
    dt = xs[0].dtype
    for x in xs[1:]:
        dt = torch.promote_types(dt, x.dtype)
    return dt


@register("pad", "shape")
def pad(x: Tensor, pad: Tuple[int, ...], value: float = 0.0) -> Tensor:
    """Constant padding (aten.constant_pad_nd); ``pad`` pairs run from the last dim backwards."""
    return aten.constant_pad_nd.default(x, list(pad), value)


@from_aten(pad, aten.constant_pad_nd.default)
def _pad_conv(x, pad, value=0):
    return [x], {"pad": tuple(pad), "value": value}


@register("flip", "shape")
def flip(x: Tensor, dims: Tuple[int, ...]) -> Tensor:
    """Reverse the order of elements along ``dims``."""
    return aten.flip.default(x, list(dims))


@from_aten(flip, aten.flip.default)
def _flip_conv(x, dims):
    return [x], {"dims": _dims(dims, _ndim(x)) if len(dims) else ()}


@register("as_strided", "shape")
def as_strided(x: Tensor, size: Tuple[int, ...], stride: Tuple[int, ...], offset: int) -> Tensor:
    """Elements of the row-major layout of ``x`` picked by ``size``/``stride``/``offset``."""
    return torch.as_strided(x.contiguous(), size, stride, offset).clone()


@register("as_strided_scatter", "shape")
def as_strided_scatter(x: Tensor, src: Tensor, size: Tuple[int, ...], stride: Tuple[int, ...],
                       offset: int) -> Tensor:
    """A copy of ``x`` (row-major) with the ``as_strided`` window replaced by ``src``."""
    return aten.as_strided_scatter.default(x.contiguous(), src, list(size), list(stride), offset)


@from_aten(as_strided_scatter, aten.as_strided_scatter.default)
def _as_strided_scatter_conv(x, src, size, stride, storage_offset=None):
    return [x, src], {"size": tuple(size), "stride": tuple(stride), "offset": storage_offset or 0}


# --------------------------------------------------------------------------- index


@register("gather", "index")
def gather(x: Tensor, index: Tensor, dim: int) -> Tensor:
    """``out[i][j] = x[index[i][j]][j]`` for ``dim=0`` (aten.gather)."""
    return aten.gather.default(x, dim, index)


@from_aten(gather, aten.gather.default)
def _gather_conv(x, dim, index, *, sparse_grad=False):
    return [x, index], {"dim": _dim(dim, _ndim(x))}


@register("scatter", "index")
def scatter(x: Tensor, index: Tensor, src: Any, dim: int) -> Tensor:
    """A copy of ``x`` with ``src`` (tensor or scalar) written at ``index`` along ``dim``."""
    if isinstance(src, Tensor):
        return aten.scatter.src(x, dim, index, src)
    return aten.scatter.value(x, dim, index, src)


@from_aten(scatter, aten.scatter.src, aten.scatter.value)
def _scatter_conv(x, dim, index, src):
    return [x, index, src], {"dim": _dim(dim, _ndim(x))}


@register("scatter_add", "index")
def scatter_add(x: Tensor, index: Tensor, src: Tensor, dim: int) -> Tensor:
    """A copy of ``x`` with ``src`` added at ``index`` along ``dim``."""
    return aten.scatter_add.default(x, dim, index, src)


@from_aten(scatter_add, aten.scatter_add.default)
def _scatter_add_conv(x, dim, index, src):
    return [x, index, src], {"dim": _dim(dim, _ndim(x))}


@register("scatter_reduce", "index")
def scatter_reduce(x: Tensor, index: Tensor, src: Tensor, dim: int, reduce: str,
                   include_self: bool = True) -> Tensor:
    """A copy of ``x`` with ``src`` reduced (sum/prod/mean/amax/amin) into ``index`` along ``dim``."""
    return aten.scatter_reduce.two(x, dim, index, src, reduce, include_self=include_self)


@from_aten(scatter_reduce, aten.scatter_reduce.two)
def _scatter_reduce_conv(x, dim, index, src, reduce, *, include_self=True):
    return [x, index, src], {"dim": _dim(dim, _ndim(x)), "reduce": reduce, "include_self": bool(include_self)}


def _index_list(idx: Sequence[Tensor], dims: Tuple[int, ...]) -> List[Optional[Tensor]]:
    lst: List[Optional[Tensor]] = [None] * (max(dims) + 1 if dims else 0)
    for d, t in zip(dims, idx):
        lst[d] = t
    return lst


@register("index", "index")
def index(x: Tensor, *idx: Tensor, dims: Tuple[int, ...]) -> Tensor:
    """Advanced indexing ``x[..., idx0, ..., idx1, ...]``: index tensor k applies to dim ``dims[k]``."""
    return aten.index.Tensor(x, _index_list(idx, dims))


@from_aten(index, aten.index.Tensor, aten._unsafe_index.Tensor)
def _index_conv(x, indices):
    dims = tuple(i for i, t in enumerate(indices) if t is not None)
    return [x] + [indices[i] for i in dims], {"dims": dims}


@from_aten(index, aten.index_select.default)
def _index_select_conv(x, dim, idx):
    if idx.dim() != 1 or _ndim(x) == 0:  # 0-d cases keep their shape: decompose
        return None
    return [x, idx], {"dims": (_dim(dim, _ndim(x)),)}


@register("index_put", "index")
def index_put(x: Tensor, values: Tensor, *idx: Tensor, dims: Tuple[int, ...], accumulate: bool = False) -> Tensor:
    """A copy of ``x`` with ``x[idx...] = values`` (or ``+=`` when ``accumulate``)."""
    return aten.index_put.default(x, _index_list(idx, dims), values, accumulate)


def _is_mask_fill(x, indices, values, accumulate) -> bool:
    """``x[mask] = scalar``: one boolean index over the leading dims and a one-element value."""
    return (not accumulate and len(indices) == 1 and indices[0] is not None
            and indices[0].dtype == torch.bool and values.numel() == 1
            and tuple(indices[0].shape) == tuple(x.shape[:indices[0].dim()]))


@from_aten(index_put, aten.index_put.default, aten._unsafe_index_put.default)
def _index_put_conv(x, indices, values, accumulate=False):
    if _is_mask_fill(x, indices, values, accumulate):
        return None  # becomes a where (see _index_put_mask)
    if accumulate and is_low_precision(x.dtype):
        return None  # accumulated in fp32 and rounded once (see _index_put_mask)
    dims = tuple(i for i, t in enumerate(indices) if t is not None)
    attrs: Dict[str, Any] = {"dims": dims}
    if accumulate:
        attrs["accumulate"] = True
    return [x, values] + [indices[i] for i in dims], attrs


# --------------------------------------------------------------------------- creation and random


@register("full", "creation", shape_rule=lambda *, shape, value, dtype: [(tuple(shape), dtype)])
def full(*, shape: Tuple[int, ...], value: Any, dtype: torch.dtype) -> Tensor:
    """A tensor of ``shape`` filled with ``value``."""
    return torch.full(shape, value, dtype=dtype)


@from_aten(full, aten.full.default)
def _full_conv(size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    if dtype is None:  # the tracer fills in the dtype torch inferred
        return None
    return [], {"shape": tuple(size), "value": fill_value, "dtype": dtype}


@from_aten(full, aten.scalar_tensor.default)
def _scalar_tensor_conv(s, *, dtype=None, layout=None, device=None, pin_memory=None):
    return [], {"shape": (), "value": s, "dtype": dtype or torch.get_default_dtype()}


@register("iota", "creation",
          shape_rule=lambda *, length, start, step, dtype: [((length,), dtype)])
def iota(*, length: int, start: Any, step: Any, dtype: torch.dtype) -> Tensor:
    """``[start, start + step, ...]`` (``length`` elements), computed in 64-bit as aten.arange does."""
    acc = torch.float64 if (dtype.is_floating_point or isinstance(start, float) or isinstance(step, float)) \
        else torch.int64
    return (torch.arange(length, dtype=acc) * step + start).to(dtype)


@from_aten(iota, aten.arange.start_step)
def _arange_conv(start, end, step=1, *, dtype=None, layout=None, device=None, pin_memory=None):
    out = aten.arange.start_step(start, end, step, dtype=dtype, device="meta")
    return [], {"length": int(out.shape[0]), "start": start, "step": step, "dtype": out.dtype}


@register("rand", "random", random=True,
          shape_rule=lambda *, shape, dtype: [(tuple(shape), dtype)])
def rand(*, shape: Tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Uniform random numbers in [0, 1)."""
    return torch.rand(shape, dtype=dtype)


@register("randn", "random", random=True,
          shape_rule=lambda *, shape, dtype: [(tuple(shape), dtype)])
def randn(*, shape: Tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Standard normal random numbers."""
    return torch.randn(shape, dtype=dtype)


@from_aten(OPS["rand"], aten.rand.default)
def _rand_conv(size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    return [], {"shape": tuple(size), "dtype": dtype or torch.get_default_dtype()}


@from_aten(OPS["randn"], aten.randn.default)
def _randn_conv(size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    return [], {"shape": tuple(size), "dtype": dtype or torch.get_default_dtype()}


# --------------------------------------------------------------------------- host ops
# Dense linear algebra (factorizations, solves, eigen- and singular values) and FFTs of other dtypes than
# float32/complex64 (those are DFT matmuls: tn.ops.fft) have no
# NeuronCore kernel: they stay torch calls on the host, visible in the IR as ``host[fn=...]``
# and counted as host fallbacks by the compiler. (linalg_lstsq and geqrf are left out: they
# have no meta kernel, so their result shapes cannot be traced.)

#: aten overloads traced as the ``host`` op. (Cholesky, LU, QR, triangular solves and what follows from them,
#: singular values, symmetric eigenvalues, pinv and matrix_exp are :data:`tn.ops.linalg.NATIVE_OVERLOADS`: core
#: ops for float32, this host op for other dtypes and for the singular/eigen vectors.)
HOST_OVERLOADS = tuple(
    getattr(getattr(aten, _p), _o) for _p, _o in (
        ("linalg_eig", "default"),
        # the xor of float64/int64 bit patterns: 64-bit words, which the engine carries only as range-checked
        # int32 (a uint64 hash never fits), so no program can make it
        ("hash_tensor", "default"))
    if hasattr(getattr(aten, _p, None), _o))


@register("host", "host")
def host(*inputs: Tensor, fn: Any, **attrs: Any) -> Any:
    """``fn`` (an aten overload) called by torch: tensor arguments are the inputs in schema order,
    every other argument is an attribute named as in the schema."""
    it = iter(inputs)
    args: List[Any] = []
    kwargs: Dict[str, Any] = {}
    for a in fn._schema.arguments:
        v = attrs[a.name] if a.name in attrs else next(it)
        if isinstance(v, tuple):
            v = list(v)
        if a.kwarg_only:
            kwargs[a.name] = v
        else:
            args.append(v)
    return fn(*args, **kwargs)


def _host_conv(fn: Any) -> Callable[..., Any]:
    def conv(*args, **kwargs):
        inputs: List[Any] = []
        attrs: Dict[str, Any] = {"fn": fn}
        for i, a in enumerate(fn._schema.arguments):
            if i < len(args) and not a.kwarg_only:
                v = args[i]
            elif a.name in kwargs:
                v = kwargs[a.name]
            else:
                v = a.default_value
            if isinstance(v, Tensor):
                inputs.append(v)
            elif isinstance(v, (list, tuple)) and any(isinstance(t, Tensor) for t in v):
                return None    # tensor lists are not host-op inputs
            else:
                attrs[a.name] = tuple(v) if isinstance(v, list) else v
        return inputs, attrs
    return conv


for _ov in HOST_OVERLOADS:
    from_aten(host, _ov)(_host_conv(_ov))


def _no_results(*avals: Any, **attrs: Any) -> List[Tuple[Tuple[int, ...], torch.dtype]]:
    """An op with no tensor results (it only checks)."""
    return []


@register("linalg_check", "host", aten_ops=(aten._linalg_check_errors.default,), effectful=True,
          shape_rule=_no_results)
def linalg_check(info: Tensor, *, api_name: str, is_matrix: bool, where: Any = None) -> Tuple[()]:
    """Raise ``torch.linalg.LinAlgError`` (a ``RuntimeError`` for ``lu_factor``) as eager does when the LAPACK status ``info`` of a
    ``torch.linalg.*_ex`` call is nonzero (a singular matrix to ``inv``, a matrix that is not positive
    definite to ``cholesky``...): same type, same message, with a note naming the user's line ``where``.
    Effectful: the passes keep it though it has no result, so the check survives tracing; it runs on
    the host (it reads ``info``'s values). Returns no results."""
    try:
        aten._linalg_check_errors(info.cpu(), api_name, is_matrix=is_matrix)
    except RuntimeError as e:   # LinAlgError, or a RuntimeError for lu_factor, as in eager
        if where:
            e.add_note(f"(checked by tn at {where})")
        e.tn_eager_error = True   # the doors re-raise it as it is (not wrapped in tn.ExecutionError)
        raise
    return ()


@from_aten(linalg_check, aten._linalg_check_errors.default)
def _linalg_check_conv(info, api_name, *, is_matrix):
    return [info], {"api_name": api_name, "is_matrix": bool(is_matrix)}


def trace_as_host(fn: Any) -> None:
    """From now on trace the op overload ``fn`` as the ``host`` op (one opaque equation run by torch on the
    host; shapes from its meta kernel). The tracer does this for ``torch.library`` custom ops."""
    if fn not in FROM_ATEN:
        from_aten(host, fn)(_host_conv(fn))


# --------------------------------------------------------------------------- prims
# torch._refs-based decompositions call prims; the common ones map onto core ops.

prims = torch.ops.prims

for _n in _UNARY + ["round"]:
    _p = getattr(prims, "erf_inv" if _n == "erfinv" else _n, None)
    if _p is not None and hasattr(_p, "default"):
        from_aten(OPS[_n], _p.default)(_unary_conv)

for _n in ("add", "sub", "mul", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge", "bitwise_and",
           "bitwise_or", "bitwise_xor", "pow", "remainder", "fmod", "atan2"):
    from_aten(OPS[_n], getattr(prims, _n).default)(_binary_conv)

from_aten(where, prims.where.default)(_where_conv)


@from_aten(div, prims.div.default)
def _prims_div_conv(x, y):
    """prims.div truncates for integers and is true division otherwise."""
    def is_int(a):
        return (not a.is_floating_point() and not a.is_complex()) if isinstance(a, Tensor) \
            else isinstance(a, int)
    if is_int(x) and is_int(y):
        return [x, y], {"rounding_mode": "trunc"}
    return [x, y], {}


@from_aten(OPS["amax"], prims.amax.default)
@from_aten(OPS["amin"], prims.amin.default)
def _prims_minmax_conv(x, dims, *, output_dtype=None):
    return _red_attrs(x, dims, False)


@from_aten(OPS["prod"], prims.prod.default)
def _prims_prod_conv(x, dims, *, output_dtype=None):
    return _red_attrs(x, dims, False, output_dtype)


@from_aten(iota, prims.iota.default)
def _prims_iota_conv(length, *, start, step, dtype, device, requires_grad):
    return [], {"length": int(length), "start": start, "step": step, "dtype": dtype}


@from_aten(full, prims.full.default)
def _prims_full_conv(shape, fill_value, *, dtype, device, requires_grad):
    return [], {"shape": tuple(shape), "value": fill_value, "dtype": dtype}


@from_aten(full, prims.scalar_tensor.default)
def _prims_scalar_tensor_conv(s, *, dtype=None, device=None):
    return [], {"shape": (), "value": s, "dtype": dtype or torch.get_default_dtype()}
