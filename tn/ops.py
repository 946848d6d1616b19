# The single op table: every op the IR may contain, with its shape rule, torch reference implementation and lowering slot.
"""tn's core op set.

Every equation of a :class:`tn.ir.IR` names one :class:`Op` from :data:`OPS`.
The tracer (:mod:`tn.trace`) maps the aten ops PyTorch dispatches onto these
ops through :data:`FROM_ATEN` (one converter per aten overload) and, for
everything else, through decompositions (:data:`DECOMPOSITIONS` here, then
``torch._decomp.decomposition_table``). Views and in-place ops never reach
the table: the tracer functionalises them into the ops below.

An :class:`Op` has

- ``name``: printed in the IR;
- ``category``: what kind of work it is, for the compiler (see below);
- ``aten``: the aten overloads it stands for;
- ``impl(*inputs, **attrs)``: the torch reference (inputs are tensors or
  Python scalars in ``Eqn.inputs`` order; returns a tensor, or a tuple of
  tensors for multi-output ops);
- ``shape_rule(*avals, **attrs) -> [(shape, dtype), ...]``: by default the
  impl run on meta tensors;
- ``lowering``: ``None`` until the NeuronCore compiler registers one;
  ``tile_rule``: ``None`` until the compiler registers an SBUF tile rule
  (elementwise ops the tile engine computes in SBUF);
- ``random``: draws random numbers; ``effectful``: has an effect beyond its
  outputs; ``impure`` is either (never merged, folded or duplicated);
- ``reduce_alu`` and ``reduce_identity`` (reductions that combine elements
  with one associative ALU op: sum, prod, amax, amin, any): the VectorE ALU
  op and the value that leaves it unchanged (``None`` for other ops).

Passes and the compiler read these facts from the op; they never key tables
by op name.

The core op set (attributes in brackets):

==============  ==========================================================================
category        ops
==============  ==========================================================================
elementwise     unary: neg abs exp exp2 expm1 log log2 log1p sqrt rsqrt reciprocal sin cos
                tan asin acos atan sinh cosh tanh asinh acosh atanh sigmoid erf erfinv
                relu gelu[approximate] sign floor ceil trunc round logical_not bitwise_not
                isnan isinf conj (complex conjugate);
                binary (either input may be a Literal): add sub mul div[rounding_mode]
                pow maximum minimum eq ne lt le gt ge logical_and logical_or logical_xor
                bitwise_and bitwise_or bitwise_xor bitwise_left_shift bitwise_right_shift
                remainder fmod atan2;
                ternary: where; cast: convert[dtype]
reduction       sum[dims keepdim dtype] prod[dims keepdim dtype] amax[dims keepdim]
                amin[dims keepdim] argmax[dim keepdim] argmin[dim keepdim] any[dims keepdim]
scan            cumsum[dim dtype] cummax[dim] cummin[dim] (values, int64 indices) logcumsumexp[dim]
sort            sort[dim descending stable] topk[k dim largest sorted] (values, int64 indices)
matmul          matmul (``[..., M, K] @ [..., K, N]``, equal batch dims: aten mm and bmm)
conv            convolution[stride padding dilation transposed output_padding groups]
                convolution_backward[... output_mask]
pool            avg_pool2d[...] avg_pool2d_backward[...]
shape           reshape[shape] permute[dims] expand[shape] slice[dim start end step]
                slice_scatter[dim start end step] cat[dim] pad[pad value] flip[dims]
                as_strided[size stride offset] as_strided_scatter[size stride offset]
index           gather[dim] scatter[dim] scatter_add[dim] scatter_reduce[dim reduce
                include_self] index[dims] index_put[dims accumulate]
creation        full[shape value dtype] iota[length start step dtype]
random          rand[shape dtype] randn[shape dtype]
host            host[fn ...]: an aten op of :data:`HOST_OVERLOADS` (FFTs, linear algebra) run by torch
                on the host, its non-tensor arguments as attributes (no NeuronCore lowering)
==============  ==========================================================================

Unary functions stay ops rather than formulas (``asinh`` as a log/sqrt
expression loses accuracy): the compiler maps them to ScalarE activation
functions or runs them on the host. Everything else (softmax, layer/batch
norm, linear, mean, var, dropout, embedding, losses, backward ops, 3-d and
adaptive pooling, 3-d convolutions and their gradients (one 2-d convolution
over depth-stacked channels), ``cat`` whose empty operands promote the dtype,
embedding_bag, median/kthvalue/mode from ``sort``,
searchsorted, distances ...) is decomposed into these by
:data:`DECOMPOSITIONS` or ``torch._decomp``; special functions (erfcx,
lgamma, digamma, zeta, Bessel functions, ndtri ...) by :mod:`tn.special`,
in elementwise ops. ``slice`` always has a
non-negative ``start <= end`` within bounds and ``step >= 1``; ``dims`` of
reductions are sorted and non-negative and list every reduced dimension.

Register a new op with :func:`register` (a decorator on its reference
implementation) and map aten overloads to it with :func:`from_aten`.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .errors import ArgumentValueError, UnsupportedOpError
from .ir import Literal

__all__ = [
    "Op", "OPS", "FROM_ATEN", "DECOMPOSITIONS", "IDENTITY", "register", "from_aten",
    "meta_shape_rule", "get",
]

aten = torch.ops.aten
Tensor = torch.Tensor

#: Category names the compiler may rely on.
CATEGORIES = ("elementwise", "reduction", "scan", "sort", "matmul", "conv", "pool", "shape", "index",
              "creation", "random", "host")


class Op:
    """One operator of the core op set.

    Attributes:
        name: the name printed in the IR (unique key of :data:`OPS`).
        category: one of :data:`CATEGORIES`; tells the compiler what kind of
            work the op is (elementwise, reduction, matmul, shape ...).
        impl: ``impl(*inputs, **attrs)``, the reference implementation in torch.
        shape_rule: ``shape_rule(*avals, **attrs) -> [(shape, dtype), ...]``,
            one entry per output.
        aten: the aten overloads this op stands for (documentation and lookup).
        lowering: filled by the NeuronCore compiler; ``None`` until then.
        tile_rule: the compiler's SBUF tile rule ``rule(ctx, eqn, out_tile, in_tiles)``
            (``tn.lower.elementwise.tile_rule``); ``None`` until registered.
        random: ``True`` for ops that draw random numbers (never CSE'd or folded).
        effectful: ``True`` for ops with an effect beyond their outputs (kept by DCE).
        reduce_alu: for a reduction combining elements with one associative
            ALU op, that op's VectorE name (``add``, ``multiply``, ``max``,
            ``min``, ``logical_or``); else ``None``.
        reduce_identity: the value ``reduce_alu`` leaves unchanged (``0.0``,
            ``1.0``, ``-inf``, ``inf``, ``False``); else ``None``.
    """

    __slots__ = ("name", "category", "impl", "shape_rule", "aten", "lowering", "tile_rule", "random", "effectful",
                 "reduce_alu", "reduce_identity", "doc")

    def __init__(self, name: str, category: str, impl: Callable[..., Any],
                 shape_rule: Optional[Callable[..., List[Tuple[Tuple[int, ...], torch.dtype]]]] = None,
                 aten: Sequence[Any] = (), random: bool = False, doc: Optional[str] = None, *,
                 effectful: bool = False, reduce_alu: Optional[str] = None, reduce_identity: Any = None):
        if category not in CATEGORIES:
            raise ArgumentValueError(f"op {name!r}: unknown category {category!r}; use one of {CATEGORIES}")
        if (reduce_alu is None) != (reduce_identity is None):
            raise ArgumentValueError(f"op {name!r}: reduce_alu and reduce_identity go together")
        self.name = name
        self.category = category
        self.impl = impl
        self.shape_rule = shape_rule if shape_rule is not None else meta_shape_rule(impl)
        self.aten: Tuple[Any, ...] = tuple(aten)
        self.lowering: Optional[Callable[..., Any]] = None
        self.tile_rule: Optional[Callable[..., Any]] = None
        self.random = bool(random)
        self.effectful = bool(effectful)
        self.reduce_alu = reduce_alu
        self.reduce_identity = reduce_identity
        self.doc = doc or getattr(impl, "__doc__", None) or f"tn core op {name}"

    @property
    def impure(self) -> bool:
        """Random or effectful: never merged, folded or duplicated by a pass."""
        return self.random or self.effectful

    def __repr__(self) -> str:
        return f"<tn op {self.name} ({self.category})>"


#: The op table: name -> Op.
OPS: Dict[str, Op] = {}

#: aten overload -> (Op, converter). ``converter(*args, **kwargs)`` receives the
#: aten call's arguments and returns ``(inputs, attrs)`` in the op's form, the
#: :data:`IDENTITY` marker (the result is the first argument's value), or
#: ``None`` (this call is not in canonical form: decompose it instead).
FROM_ATEN: Dict[Any, Tuple[Op, Callable[..., Any]]] = {}

#: tn's own decompositions (aten overload -> function over aten ops), tried
#: before ``torch._decomp.decomposition_table``.
DECOMPOSITIONS: Dict[Any, Callable[..., Any]] = {}

#: Converter result meaning "the op returns its first argument's value unchanged".
IDENTITY = object()


def get(name: str) -> Op:
    """The op called ``name``; raises :class:`tn.UnsupportedOpError` if there is none."""
    try:
        return OPS[name]
    except KeyError:
        raise UnsupportedOpError(
            f"tn has no core op named {name!r}; the core ops are listed in tn.ops.OPS") from None


def _flat_tensors(out: Any) -> List[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    return [o for o in out if isinstance(o, Tensor)]


def _meta_arg(a: Any) -> Any:
    if isinstance(a, Literal):
        return a.value
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        return torch.empty(tuple(a.shape), dtype=a.dtype, device="meta")
    return a


def meta_shape_rule(impl: Callable[..., Any]) -> Callable[..., List[Tuple[Tuple[int, ...], torch.dtype]]]:
    """A shape rule that runs ``impl`` on meta tensors of the given avals."""

    def rule(*avals: Any, **attrs: Any) -> List[Tuple[Tuple[int, ...], torch.dtype]]:
        out = impl(*[_meta_arg(a) for a in avals], **attrs)
        return [(tuple(o.shape), o.dtype) for o in _flat_tensors(out)]

    rule.__doc__ = f"Shapes and dtypes of {getattr(impl, '__name__', 'the op')} computed on meta tensors."
    return rule


def register(name: str, category: str, aten_ops: Sequence[Any] = (), *, random: bool = False,
             shape_rule: Optional[Callable[..., Any]] = None, effectful: bool = False,
             reduce_alu: Optional[str] = None, reduce_identity: Any = None) -> Callable[[Callable[..., Any]], Op]:
    """Decorator: register the decorated reference implementation as core op ``name`` with the facts given
    (see :class:`Op`).

    Returns the :class:`Op` (so the module-level name refers to the op).
    """

    def deco(impl: Callable[..., Any]) -> Op:
        if name in OPS:
            raise ArgumentValueError(f"op {name!r} is registered twice")
        op = Op(name, category, impl, shape_rule=shape_rule, aten=aten_ops, random=random, effectful=effectful,
                reduce_alu=reduce_alu, reduce_identity=reduce_identity)
        OPS[name] = op
        return op

    return deco


def from_aten(op: Op, *overloads: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: the decorated converter maps ``overloads`` onto ``op``."""

    def deco(conv: Callable[..., Any]) -> Callable[..., Any]:
        for ov in overloads:
            FROM_ATEN[ov] = (op, conv)
            if ov not in op.aten:
                op.aten = op.aten + (ov,)
        return conv

    return deco


def decomposition(*overloads: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register a tn decomposition for ``overloads``."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for ov in overloads:
            DECOMPOSITIONS[ov] = fn
        return fn

    return deco


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
    return [x], {} if x.is_complex() else IDENTITY


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


# 3-d convolution as one 2-d convolution: the kD depth taps of every output depth are stacked into the
# channels (im2col along depth), so x [N, C, D, H, W] becomes x2 [N*Do, G*kD*Cg, H, W] (per group: tap-major,
# then channel) and w [O, Cg, kD, kH, kW] becomes w2 [O, kD*Cg, kH, kW]; height and width keep their
# stride, padding and dilation in the 2-d convolution, whose contraction covers all three kernel axes.

def _triple(v) -> List[int]:
    """A 3-d convolution's stride/padding/dilation as three ints (aten also takes one for all axes)."""
    v = [int(v)] if isinstance(v, int) else [int(n) for n in v]
    return v * 3 if len(v) == 1 else v


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
    gx2, gw2, gb = aten.convolution_backward.default(
        g2, _conv3d_x2(x, w, stride, padding, dilation, groups), _conv3d_w2(w), bias_sizes, list(stride[1:]),
        list(padding[1:]), list(dilation[1:]), False, [0, 0], groups, list(output_mask))
    gx = gw = None
    if output_mask[1]:
        gw = aten.reshape.default(gw2, [O, kD, Cg] + [int(n) for n in w.shape[3:]])
        gw = aten.clone.default(aten.permute.default(gw, [0, 2, 1, 3, 4]), memory_format=torch.contiguous_format)
    if output_mask[0]:
        acc_dt = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
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
    the depth taps, scattered and summed along depth (in fp32 for 16-bit dtypes), bias added after."""
    if _ndim(w) != 5 or not transposed:
        return NotImplemented
    stride, padding, dilation, opad, N, C, D, H, W, Og, kD, Dy = _conv_transpose3d_params(
        x, w, stride, padding, dilation, output_padding)
    sd, pd, dd = stride[0], padding[0], dilation[0]
    x2, w2 = _conv_transpose3d_x2w2(x, w)
    y2 = aten.convolution.default(x2, w2, None, list(stride[1:]), list(padding[1:]), list(dilation[1:]), True,
                                  list(opad[1:]), groups)                # [N*D, G*kD*Og, Ho, Wo]
    Ho, Wo = int(y2.shape[2]), int(y2.shape[3])
    O = groups * Og
    t = aten.reshape.default(y2, [N, D, groups, kD, Og, Ho, Wo])
    t = aten.permute.default(t, [0, 3, 2, 4, 1, 5, 6])                 # [N, kD, G, Og, D, Ho, Wo]
    t = aten.reshape.default(t, [N, kD, O, D, Ho, Wo])
    acc_dt = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
    if acc_dt != x.dtype:
        t = aten._to_copy.default(t, dtype=acc_dt)
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
        acc_dt = torch.float32 if grad.dtype in (torch.bfloat16, torch.float16) else grad.dtype
        g = aten._to_copy.default(grad, dtype=acc_dt) if acc_dt != grad.dtype else grad
        gb = aten.sum.dim_IntList(g, [0, 2, 3, 4])
        if acc_dt != grad.dtype:
            gb = aten._to_copy.default(gb, dtype=grad.dtype)
    return gx, gw, gb


def _conv5d_decomp(x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    """aten.convolution of a 5-d input, plain (_conv3d_decomp) or transposed (_conv_transpose3d_decomp)."""
    fn = _conv_transpose3d_decomp if transposed else _conv3d_decomp
    return fn(x, w, b, stride, padding, dilation, transposed, output_padding, groups)


def _conv5d_backward_decomp(grad, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding,
                            groups, output_mask):
    """aten.convolution_backward of a 5-d convolution, plain (_conv3d_backward_decomp) or transposed
    (_conv_transpose3d_backward_decomp)."""
    fn = _conv_transpose3d_backward_decomp if transposed else _conv3d_backward_decomp
    return fn(grad, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask)


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


def _cat_decomp(xs, dim=0):
    """``cat`` whose empty operands promote the dtype: the non-empty operands cast, then concatenated."""
    dt = _promoted(xs)
    full = [x if x.dtype == dt else aten._to_copy.default(x, dtype=dt) for x in xs if x.numel() > 0]
    return aten.cat.default(full, dim)


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
# FFTs and dense linear algebra (factorizations, solves, eigen- and singular values) have no
# NeuronCore kernel: they stay torch calls on the host, visible in the IR as ``host[fn=...]``
# and counted as host fallbacks by the compiler. (linalg_lstsq and geqrf are left out: they
# have no meta kernel, so their result shapes cannot be traced.)

#: aten overloads traced as the ``host`` op.
HOST_OVERLOADS = tuple(
    getattr(getattr(aten, _p), _o) for _p, _o in (
        ("_fft_r2c", "default"), ("_fft_c2c", "default"), ("_fft_c2r", "default"),
        ("_linalg_svd", "default"), ("linalg_qr", "default"), ("linalg_pinv", "atol_rtol_tensor"),
        ("linalg_inv_ex", "default"), ("linalg_lu_factor_ex", "default"), ("_linalg_eigh", "default"),
        ("_linalg_solve_ex", "default"), ("linalg_lu_solve", "default"), ("_linalg_slogdet", "default"),
        ("linalg_cholesky_ex", "default"), ("linalg_eig", "default"), ("linalg_ldl_factor_ex", "default"),
        ("linalg_ldl_solve", "default"), ("cholesky", "default"),
        ("cholesky_inverse", "default"), ("cholesky_solve", "default"),
        ("ormqr", "default"), ("linalg_householder_product", "default"), ("lu_unpack", "default"),
        ("linalg_lu", "default"), ("linalg_matrix_exp", "default"), ("triangular_solve", "default"),
        ("linalg_solve_triangular", "default"), ("_linalg_det", "default"))
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


# --------------------------------------------------------------------------- tn decompositions

# Functions over aten ops, run by the tracer on traced tensors; they bring
# calls into the canonical forms above.

DECOMPOSITIONS[aten.cat.default] = _cat_decomp
DECOMPOSITIONS[aten.convolution.default] = _conv5d_decomp
DECOMPOSITIONS[aten.convolution_backward.default] = _conv5d_backward_decomp


@decomposition(aten.add.Tensor, aten.add.Scalar)
def _add_alpha(x, y, alpha=1):
    """``x + alpha * y``."""
    return aten.add.Tensor(x, aten.mul.Tensor(y, alpha) if isinstance(y, Tensor) else y * alpha)


@decomposition(aten.sub.Tensor, aten.sub.Scalar)
def _sub_alpha(x, y, alpha=1):
    """``x - alpha * y``."""
    return aten.sub.Tensor(x, aten.mul.Tensor(y, alpha) if isinstance(y, Tensor) else y * alpha)


@decomposition(aten.rsub.Tensor, aten.rsub.Scalar)
def _rsub(x, y, alpha=1):
    """``y - alpha * x``."""
    if alpha != 1:
        x = aten.mul.Tensor(x, alpha)
    if isinstance(y, Tensor):
        return aten.sub.Tensor(y, x)
    return aten.add.Tensor(aten.neg.default(x), y)


@decomposition(aten.full.default)
def _full_infer_dtype(size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    """``full`` without a dtype: the dtype torch infers from the fill value."""
    dtype = (torch.bool if isinstance(fill_value, bool) else torch.int64 if isinstance(fill_value, int)
             else torch.complex64 if isinstance(fill_value, complex) else torch.get_default_dtype())
    return aten.full.default(size, fill_value, dtype=dtype)


@decomposition(aten.empty.memory_format)
def _empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """Uninitialised memory is zeros in tn."""
    return aten.full.default(size, 0, dtype=dtype or torch.get_default_dtype())


@decomposition(aten.empty_strided.default)
def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    """Uninitialised memory is zeros in tn (strides do not exist in the IR)."""
    return aten.full.default(size, 0, dtype=dtype or torch.get_default_dtype())


@decomposition(aten.empty_permuted.default)
def _empty_permuted(size, physical_layout, *, dtype=None, layout=None, device=None, pin_memory=None):
    """Uninitialised memory is zeros in tn (layouts do not exist in the IR)."""
    return aten.full.default(size, 0, dtype=dtype or torch.get_default_dtype())


@decomposition(aten.new_empty_strided.default)
def _new_empty_strided(x, size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    """Uninitialised memory is zeros in tn."""
    return aten.full.default(size, 0, dtype=dtype or x.dtype)


@decomposition(aten.full_like.default)
def _full_like(x, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None,
               memory_format=None):
    """``full`` with ``x``'s shape and dtype."""
    return aten.full.default(tuple(x.shape), fill_value, dtype=dtype or x.dtype)


@decomposition(aten.rand_like.default)
def _rand_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """``rand`` with ``x``'s shape and dtype."""
    return aten.rand.default(tuple(x.shape), dtype=dtype or x.dtype)


@decomposition(aten.randn_like.default)
def _randn_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """``randn`` with ``x``'s shape and dtype."""
    return aten.randn.default(tuple(x.shape), dtype=dtype or x.dtype)


@decomposition(aten.bernoulli.p)
def _bernoulli_p(x, p=0.5, *, generator=None):
    """1 with probability ``p`` else 0, shaped like ``x``."""
    return aten._to_copy.default(aten.lt.Scalar(aten.rand.default(tuple(x.shape), dtype=torch.float32), p),
                                 dtype=x.dtype)


@decomposition(aten.bernoulli_.float)
def _bernoulli_inplace(x, p=0.5, *, generator=None):
    """In place: ``x`` becomes 1 with probability ``p`` else 0."""
    return aten.copy_.default(x, _bernoulli_p(x, p))


@decomposition(aten.bernoulli.default)
def _bernoulli(p, *, generator=None):
    """1 with probability ``p`` (elementwise) else 0."""
    r = aten.rand.default(tuple(p.shape), dtype=p.dtype)
    return aten._to_copy.default(aten.lt.Tensor(r, p), dtype=p.dtype)


@decomposition(aten.mean.dim)
def _mean_dim(x, dim=None, keepdim=False, *, dtype=None):
    """Sum (accumulated in fp32 for low-precision floats) divided by the count."""
    dims = _dims(dim, x.dim())
    n = 1
    for d in dims:
        n *= x.shape[d]
    out_dtype = dtype or x.dtype
    acc = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype
    s = aten.sum.dim_IntList(x, list(dims), keepdim, dtype=acc)
    r = aten.div.Tensor(s, n)
    return aten._to_copy.default(r, dtype=out_dtype) if r.dtype != out_dtype else r


@decomposition(aten.mean.default)
def _mean_all(x, *, dtype=None):
    """Mean of all elements."""
    return _mean_dim(x, None, False, dtype=dtype)


@decomposition(aten.max.dim)
def _max_dim(x, dim, keepdim=False):
    """(amax, argmax) along ``dim``."""
    return aten.amax.default(x, [dim], keepdim), aten.argmax.default(x, dim, keepdim)


@decomposition(aten.min.dim)
def _min_dim(x, dim, keepdim=False):
    """(amin, argmin) along ``dim``."""
    return aten.amin.default(x, [dim], keepdim), aten.argmin.default(x, dim, keepdim)


@decomposition(aten.clamp.default)
def _clamp(x, min=None, max=None):
    """``minimum(maximum(x, min), max)`` in the result dtype of clamp."""
    out_dtype = x.dtype
    for b in (min, max):
        if b is not None:
            out_dtype = torch.promote_types(out_dtype, torch.result_type(x, b))
    y = x if x.dtype == out_dtype else aten._to_copy.default(x, dtype=out_dtype)
    if min is not None:
        y = aten.maximum.default(y, aten.scalar_tensor.default(min, dtype=out_dtype))
    if max is not None:
        y = aten.minimum.default(y, aten.scalar_tensor.default(max, dtype=out_dtype))
    return y


@decomposition(aten.clamp.Tensor)
def _clamp_tensor(x, min=None, max=None):
    """``minimum(maximum(x, min), max)`` with tensor bounds."""
    y = x
    if min is not None:
        y = aten.maximum.default(y, min)
    if max is not None:
        y = aten.minimum.default(y, max)
    return y


@decomposition(aten.addmm.default)
def _addmm(bias, a, b, *, beta=1, alpha=1):
    """``beta * bias + alpha * (a @ b)``."""
    out = aten.mm.default(a, b)
    if alpha != 1:
        out = aten.mul.Tensor(out, alpha)
    if beta == 0:
        return out
    if beta != 1:
        bias = aten.mul.Tensor(bias, beta)
    return aten.add.Tensor(out, bias)


@decomposition(aten.select_scatter.default)
def _select_scatter(x, src, dim, index):
    """slice_scatter of ``src`` unsqueezed at ``dim``."""
    dim = _dim(dim, x.dim())
    index = index % x.shape[dim]
    return aten.slice_scatter.default(x, aten.unsqueeze.default(src, dim), dim, index, index + 1, 1)


@decomposition(aten.sigmoid_backward.default)
def _sigmoid_backward(grad, y):
    """``grad * y * (1 - y)``."""
    return aten.mul.Tensor(grad, aten.mul.Tensor(y, aten.rsub.Scalar(y, 1)))


@decomposition(aten.tanh_backward.default)
def _tanh_backward(grad, y):
    """``grad * (1 - y * y)``."""
    return aten.mul.Tensor(grad, aten.rsub.Scalar(aten.mul.Tensor(y, y), 1))


@decomposition(aten.threshold_backward.default)
def _threshold_backward(grad, x, threshold):
    """``grad`` where ``x > threshold`` else 0."""
    return aten.where.self(aten.le.Scalar(x, threshold), aten.scalar_tensor.default(0, dtype=grad.dtype), grad)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _moments(x, dims, correction):
    """(var, mean), both keepdim, in the accumulation dtype (fp32 for fp16/bf16 inputs)."""
    n = 1
    for d in dims:
        n *= x.shape[d]
    acc = _acc_dtype(x.dtype)
    xa = x if x.dtype == acc else aten._to_copy.default(x, dtype=acc)
    mean = aten.div.Tensor(aten.sum.dim_IntList(xa, list(dims), True), n)
    d = aten.sub.Tensor(xa, mean)
    var = aten.div.Tensor(aten.sum.dim_IntList(aten.mul.Tensor(d, d), list(dims), True), max(n - correction, 0))
    return var, mean


def _var_core(x, dims, correction, keepdim):
    """(var, mean) over ``dims``, computed in fp32 for low-precision inputs."""
    var, mean = _moments(x, dims, correction)
    if not keepdim:
        shape = [s for i, s in enumerate(x.shape) if i not in dims]
        var = aten.view.default(var, shape)
        mean = aten.view.default(mean, shape)
    if var.dtype != x.dtype:
        var = aten._to_copy.default(var, dtype=x.dtype)
        mean = aten._to_copy.default(mean, dtype=x.dtype)
    return var, mean


@decomposition(aten.native_layer_norm.default)
def _layer_norm(x, normalized_shape, weight, bias, eps):
    """(out, mean, rstd): ``(x - mean) * rsqrt(var + eps) * weight + bias``, in fp32 for fp16/bf16."""
    axis = x.dim() - len(normalized_shape)
    dims = tuple(range(axis, x.dim()))
    var, mean = _moments(x, dims, 0)
    rstd = aten.rsqrt.default(aten.add.Tensor(var, eps))
    xa = x if x.dtype == mean.dtype else aten._to_copy.default(x, dtype=mean.dtype)
    out = aten.mul.Tensor(aten.sub.Tensor(xa, mean), rstd)
    if weight is not None:
        out = aten.mul.Tensor(out, weight)
    if bias is not None:
        out = aten.add.Tensor(out, bias)
    if out.dtype != x.dtype:
        out = aten._to_copy.default(out, dtype=x.dtype)
    return out, mean, rstd


@decomposition(torch.ops.prims.broadcast_in_dim.default)
def _broadcast_in_dim(x, shape, broadcast_dimensions):
    """prims.broadcast_in_dim: reshape to rank ``len(shape)`` with 1s, then expand."""
    mid = [1] * len(shape)
    for src, dst in enumerate(broadcast_dimensions):
        mid[dst] = x.shape[src]
    return aten.expand.default(aten.view.default(x, mid), list(shape))


def _correction(unbiased=None, correction=None):
    if correction is not None:
        return correction
    return 1 if unbiased is None or unbiased else 0


@decomposition(aten.var.correction)
def _var(x, dim=None, *, correction=None, keepdim=False):
    """Two-pass variance: ``sum((x - mean)^2) / (n - correction)``."""
    return _var_core(x, _dims(dim, x.dim()), _correction(None, correction), keepdim)[0]


@decomposition(aten.var_mean.correction)
def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    """(variance, mean) as :func:`_var`."""
    return _var_core(x, _dims(dim, x.dim()), _correction(None, correction), keepdim)


@decomposition(torch.ops.prims.var.default)
def _prims_var(x, dims, correction, *, output_dtype=None):
    """prims.var (used by torch._refs) in core ops."""
    return _var_core(x, _dims(dims, x.dim()), correction, False)[0]


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


@decomposition(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def _masked_fill(x, mask, value):
    """``where(mask, value, x)`` in ``x``'s dtype."""
    if isinstance(value, Tensor):
        if value.dtype != x.dtype:
            value = aten._to_copy.default(value, dtype=x.dtype)
    else:
        value = aten.scalar_tensor.default(value, dtype=x.dtype)
    return aten.where.self(mask, value, x)


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


@decomposition(aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where_scalars(c, x, y):
    """``where`` with Python-scalar branches: the scalars become 0-d tensors of the result dtype."""
    if isinstance(x, Tensor):
        dtype = torch.result_type(x, y)
    elif isinstance(y, Tensor):
        dtype = torch.result_type(y, x)
    else:
        dtype = (torch.bool if isinstance(x, bool) and isinstance(y, bool) else
                 torch.int64 if isinstance(x, int) and isinstance(y, int) else torch.get_default_dtype())
    if not isinstance(x, Tensor):
        x = aten.scalar_tensor.default(x, dtype=dtype)
    elif x.dtype != dtype:
        x = aten._to_copy.default(x, dtype=dtype)
    if not isinstance(y, Tensor):
        y = aten.scalar_tensor.default(y, dtype=dtype)
    elif y.dtype != dtype:
        y = aten._to_copy.default(y, dtype=dtype)
    return aten.where.self(c, x, y)


@decomposition(prims.log10.default, aten.log10.default)
def _log10(x):
    """``log(x) / log(10)``."""
    return aten.div.Tensor(aten.log.default(x), 2.302585092994046)


@decomposition(prims.fmax.default, aten.fmax.default)
def _fmax(x, y):
    """Maximum ignoring NaN (NaN only where both are NaN)."""
    m = aten.maximum.default(x, y)
    return aten.where.self(aten.isnan.default(x), y, aten.where.self(aten.isnan.default(y), x, m))


@decomposition(prims.fmin.default, aten.fmin.default)
def _fmin(x, y):
    """Minimum ignoring NaN (NaN only where both are NaN)."""
    m = aten.minimum.default(x, y)
    return aten.where.self(aten.isnan.default(x), y, aten.where.self(aten.isnan.default(y), x, m))


@decomposition(prims.signbit.default, aten.signbit.default)
def _signbit(x):
    """Sign bit: ``x < 0``, or ``x`` is -0.0 (its reciprocal is -inf)."""
    if not x.is_floating_point():
        return aten.lt.Scalar(x, 0)
    neg_zero = aten.logical_and.default(aten.eq.Scalar(x, 0), aten.lt.Scalar(aten.reciprocal.default(x), 0))
    return aten.logical_or.default(aten.lt.Scalar(x, 0), neg_zero)


@decomposition(prims.copy_to.default)
def _copy_to(a, b):
    """prims.copy_to: ``a.copy_(b)``."""
    return aten.copy_.default(a, b)


@decomposition(aten.addbmm.default)
def _addbmm(x, b1, b2, *, beta=1, alpha=1):
    """``beta * x + alpha * sum_i b1[i] @ b2[i]``, accumulated batch by batch as eager does."""
    shape = list(torch.broadcast_shapes(tuple(x.shape), (b1.shape[1], b2.shape[2])))
    out = aten.expand.default(x if beta == 1 else aten.mul.Tensor(x, beta), shape)
    if beta == 0:
        out = aten.full.default(shape, 0, dtype=x.dtype)
    for i in range(b1.shape[0]):
        p = aten.mm.default(aten.select.int(b1, 0, i), aten.select.int(b2, 0, i))
        out = aten.add.Tensor(out, p if alpha == 1 else aten.mul.Tensor(p, alpha))
    return out


@decomposition(aten.copysign.Tensor, aten.copysign.Scalar)
def _copysign(x, y):
    """``|x|`` with the sign bit of ``y``, in the promoted floating dtype."""
    dtype = torch.result_type(x, y)
    if not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    if x.dtype != dtype:
        x = aten._to_copy.default(x, dtype=dtype)
    a = aten.abs.default(x)
    if isinstance(y, Tensor):
        return aten.where.self(_signbit(y), aten.neg.default(a), a)
    import math

    return aten.neg.default(a) if math.copysign(1.0, y) < 0 else a


@decomposition(prims.uniform.default)
def _prims_uniform(shape, *, low, high, dtype, device, stride=None, generator=None):
    """``low + (high - low) * rand``."""
    r = aten.rand.default(list(shape), dtype=dtype)
    return aten.add.Tensor(aten.mul.Tensor(r, high - low), low)


@decomposition(prims.normal.default)
def _prims_normal(shape, *, mean, std, dtype, device, requires_grad, generator=None):
    """``mean + std * randn``."""
    r = aten.randn.default(list(shape), dtype=dtype)
    return aten.add.Tensor(aten.mul.Tensor(r, std), mean)


@decomposition(aten.masked_scatter.default)
def _masked_scatter(x, mask, source):
    """Fill ``x`` where ``mask`` with consecutive elements of ``source`` (a prefix sum picks them)."""
    shape = torch.broadcast_shapes(tuple(x.shape), tuple(mask.shape))
    m = aten.expand.default(mask, list(shape))
    flat_m = aten.view.default(aten.clone.default(m), [-1])
    pos = aten.sub.Tensor(aten.cumsum.default(flat_m, 0, dtype=torch.int64), 1)
    pos = aten.clamp.default(pos, 0, max(source.numel() - 1, 0))
    picked = aten.view.default(aten.index.Tensor(aten.view.default(aten.clone.default(source), [-1]), [pos]),
                               list(shape))
    return aten.where.self(m, picked, aten.expand.default(x, list(shape)))


@decomposition(aten.index_put.default, aten._unsafe_index_put.default)
def _index_put_mask(x, indices, values, accumulate=False):
    """``x[mask] = v`` with a one-element ``v``: ``where(mask, v, x)`` (no data-dependent indexing)."""
    mask = indices[0]
    mask = aten.view.default(mask, list(mask.shape) + [1] * (x.dim() - mask.dim()))
    v = aten.view.default(values, [])
    if v.dtype != x.dtype:
        v = aten._to_copy.default(v, dtype=x.dtype)
    return aten.where.self(mask, v, x)


# --------------------------------------------------------------------------- sort-based selections
# median, kthvalue and mode pick from a stable ascending sort with NaN last (torch's order).
# The sort itself only sees NaN-free keys (NaN replaced by +inf; the sort lowering does not
# order NaN), and the NaNs are put back from their count. Indices of tied values may differ
# from torch's, whose nth_element leaves them unspecified.


def _keep(t: Tensor, dim: int, keepdim: bool) -> Tensor:
    return t if keepdim else aten.squeeze.dim(t, dim)


def _line_iota(n: int, dim: int, ndim: int) -> Tensor:
    """int64 ``0..n-1`` laid along ``dim`` of an ``ndim``-d tensor (size 1 elsewhere)."""
    shape = [1] * ndim
    shape[dim] = n
    return aten.view.default(aten.arange.start_step(0, n, 1, dtype=torch.int64), shape)


def _first_true(mask: Tensor, dim: int) -> Tensor:
    """int64 keepdim index of the first True along ``dim`` (0 when there is none)."""
    return aten.argmax.default(aten._to_copy.default(mask, dtype=torch.int32), dim, True)


def _sort_nan_last(x: Tensor, dim: int) -> Tuple[Tensor, Tensor, Any, Any]:
    """(values, indices, isnan(x), keepdim NaN count) of a stable ascending sort along ``dim`` with NaN
    last (the last two None for non-float ``x``).

    The values are exact. Inside the trailing block of +inf and NaN values an index may point at
    a NaN where torch's points at a +inf (the sort saw both as +inf); :func:`_sorted_pick` mends
    the indices it returns.
    """
    if not x.is_floating_point():
        vals, idx = aten.sort.stable(x, stable=True, dim=dim)
        return vals, idx, None, None
    n = x.shape[dim]
    isn = aten.isnan.default(x)
    nans = aten.sum.dim_IntList(isn, [dim], True, dtype=torch.int64)
    vals, idx = aten.sort.stable(aten.where.self(isn, aten.full.default([], float("inf"), dtype=x.dtype), x),
                                 stable=True, dim=dim)
    tail = aten.ge.Tensor(_line_iota(n, dim, x.dim()), aten.rsub.Scalar(nans, n))
    vals = aten.where.self(tail, aten.full.default([], float("nan"), dtype=x.dtype), vals)
    return vals, idx, isn, nans


def _sorted_pick(x: Tensor, dim: int, keepdim: bool, pos: Any) -> Tuple[Tensor, Tensor]:
    """(values, indices) at sorted position ``pos`` along ``dim``: an int, or a function of the keepdim
    NaN count giving int64 keepdim positions. A NaN result has the index of the first NaN, a +inf
    one the index of a +inf."""
    vals, idx, isn, nans = _sort_nan_last(x, dim)
    if callable(pos):
        pos = pos(nans)
    if isinstance(pos, int):
        v, i = aten.slice.Tensor(vals, dim, pos, pos + 1), aten.slice.Tensor(idx, dim, pos, pos + 1)
    else:
        v, i = aten.gather.default(vals, dim, pos), aten.gather.default(idx, dim, pos)
    if isn is not None:
        picked_nan = aten.isnan.default(aten.gather.default(x, dim, i))
        i = aten.where.self(aten.isnan.default(v), _first_true(isn, dim),
                            aten.where.self(picked_nan, _first_true(aten.eq.Scalar(x, float("inf")), dim), i))
    return _keep(v, dim, keepdim), _keep(i, dim, keepdim)


def _median_dim(x: Tensor, dim: int, keepdim: bool, ignore_nan: bool) -> Tuple[Tensor, Tensor]:
    if x.dim() == 0:
        return aten.clone.default(x), aten.full.default([], 0, dtype=torch.int64)
    d = _dim(dim, x.dim())
    n = x.shape[d]
    if not x.is_floating_point():
        return _sorted_pick(x, d, keepdim, (n - 1) // 2)
    if ignore_nan:   # the median of the non-NaN values (position 0, a NaN, when all are NaN)
        def pos(nans):
            return aten.clamp.default(aten.div.Tensor_mode(aten.rsub.Scalar(nans, n - 1), 2, rounding_mode="floor"), 0)
    else:            # a NaN makes the median NaN (sorted last, from position n - nans)
        def pos(nans):
            return aten.where.self(aten.gt.Scalar(nans, 0), aten.rsub.Scalar(nans, n),
                                   aten.full.default([], (n - 1) // 2, dtype=torch.int64))
    return _sorted_pick(x, d, keepdim, pos)


@decomposition(aten.median.dim)
def _median(x, dim, keepdim=False):
    """(lower median, its index) along ``dim``; NaN when the line holds a NaN (its first one)."""
    return _median_dim(x, dim, keepdim, ignore_nan=False)


@decomposition(aten.nanmedian.dim)
def _nanmedian(x, dim, keepdim=False):
    """(lower median of the non-NaN values, its index) along ``dim``."""
    return _median_dim(x, dim, keepdim, ignore_nan=True)


@decomposition(aten.median.default)
def _median_all(x):
    """Lower median of all elements (NaN if any is NaN or there are none)."""
    if x.numel() == 0:
        return aten.full.default([], float("nan"), dtype=x.dtype)
    return _median_dim(aten.view.default(x, [-1]), 0, False, ignore_nan=False)[0]


@decomposition(aten.nanmedian.default)
def _nanmedian_all(x):
    """Lower median of the non-NaN elements."""
    if x.numel() == 0:
        return aten.full.default([], float("nan"), dtype=x.dtype)
    return _median_dim(aten.view.default(x, [-1]), 0, False, ignore_nan=True)[0]


@decomposition(aten.kthvalue.default)
def _kthvalue(x, k, dim=-1, keepdim=False):
    """(k-th smallest value, its index) along ``dim`` (NaN sorts last)."""
    if x.dim() == 0:
        return aten.clone.default(x), aten.full.default([], 0, dtype=torch.int64)
    return _sorted_pick(x, _dim(dim, x.dim()), keepdim, int(k) - 1)


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


@decomposition(aten.multilabel_margin_loss_forward.default)
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
    if reduction == 0:
        g = aten.mul.Tensor(g, aten.view.default(grad_output, [-1, 1]))
    else:
        scale = aten.div.Scalar(grad_output, x2.shape[0]) if reduction == 1 else grad_output
        g = aten.mul.Tensor(g, scale)
    return aten.view.default(g, list(x.shape))


@decomposition(aten.mode.default)
def _mode(x, dim=-1, keepdim=False):
    """(most frequent value, the last index holding it) along ``dim``; the smallest such value on ties.

    On the sorted line, each element's run length is its position minus the start of its run
    (a running maximum of the run starts); the first position reaching the longest run ends the
    smallest most frequent value.
    """
    if x.dim() == 0:
        return aten.clone.default(x), aten.full.default([], 0, dtype=torch.int64)
    d = _dim(dim, x.dim())
    n = x.shape[d]
    s = _sort_nan_last(x, d)[0]
    pos = _line_iota(n, d, x.dim())
    prev = aten.cat.default([aten.slice.Tensor(s, d, 0, 1), aten.slice.Tensor(s, d, 0, n - 1)], d)
    new = aten.logical_or.default(aten.ne.Tensor(s, prev), aten.eq.Scalar(pos, 0))   # NaN != NaN: own runs
    start = aten.cummax.default(aten.where.self(new, pos, aten.full.default([], 0, dtype=torch.int64)), d)[0]
    length = aten.sub.Tensor(pos, start)
    best = aten.amax.default(length, [d], True)
    first = _first_true(aten.eq.Tensor(length, best), d)
    v = aten.gather.default(s, d, first)
    match = aten.eq.Tensor(x, v)
    if x.is_floating_point():
        match = aten.logical_or.default(match, aten.logical_and.default(aten.isnan.default(x), aten.isnan.default(v)))
    idx = aten.amax.default(aten.where.self(match, pos, aten.full.default([], -1, dtype=torch.int64)), [d], True)
    return _keep(v, d, keepdim), _keep(idx, d, keepdim)


# --------------------------------------------------------------------------- searching


@decomposition(aten.searchsorted.Tensor)
def _searchsorted(seq, values, *, out_int32=False, right=False, side=None, sorter=None):
    """How many elements of each sorted row of ``seq`` go before each value: counts of
    ``not (seq >= v)`` (left) or ``not (seq > v)`` (right), so NaN behaves as in torch's binary
    search. Compares every value with the whole row (``[..., k, m]`` booleans)."""
    right = bool(right) or side == "right"
    if sorter is not None:
        seq = aten.gather.default(seq, -1, sorter)
    m = seq.shape[-1]
    if seq.dim() == 1:
        s = aten.view.default(seq, [1] * values.dim() + [m])
    else:
        s = aten.unsqueeze.default(seq, -2)
    v = aten.unsqueeze.default(values, -1)
    after = aten.gt.Tensor(s, v) if right else aten.ge.Tensor(s, v)
    return aten.sum.dim_IntList(aten.logical_not.default(after), [-1], False,
                                dtype=torch.int32 if out_int32 else torch.int64)


@decomposition(aten.searchsorted.Scalar)
def _searchsorted_scalar(seq, value, *, out_int32=False, right=False, side=None, sorter=None):
    """searchsorted of one Python number."""
    v = aten.full.default([], value, dtype=seq.dtype)
    return _searchsorted(seq, v, out_int32=out_int32, right=right, side=side, sorter=sorter)


@decomposition(aten.bucketize.Tensor)
def _bucketize(x, boundaries, *, out_int32=False, right=False):
    """Bucket of each element: searchsorted of ``x`` in the 1-d ``boundaries``."""
    return _searchsorted(boundaries, x, out_int32=out_int32, right=right)


@decomposition(aten.bucketize.Scalar)
def _bucketize_scalar(x, boundaries, *, out_int32=False, right=False):
    """Bucket of one Python number."""
    return _searchsorted_scalar(boundaries, x, out_int32=out_int32, right=right)


# --------------------------------------------------------------------------- indexing forms


@decomposition(aten.index_reduce.default)
def _index_reduce(x, dim, index, source, reduce, *, include_self=True):
    """scatter_reduce with ``index`` laid along ``dim`` of ``source``."""
    if x.dim() == 0:
        return aten.scatter_reduce.two(x, 0, index, source, reduce, include_self=include_self)
    d = _dim(dim, x.dim())
    shape = [1] * source.dim()
    shape[d] = -1
    idx = aten.expand.default(aten.view.default(index, shape), list(source.shape))
    return aten.scatter_reduce.two(x, d, idx, source, reduce, include_self=include_self)


@decomposition(aten.scatter.reduce, aten.scatter.value_reduce)
def _scatter_legacy_reduce(x, dim, index, src, *, reduce):
    """``scatter(..., reduce='add'|'multiply')``: scatter_reduce sum/prod including ``x``."""
    if not isinstance(src, Tensor):
        src = aten.full.default(list(index.shape), src, dtype=x.dtype)
    r = {"add": "sum", "multiply": "prod"}[reduce]
    return aten.scatter_reduce.two(x, dim, index, src, r, include_self=True)


@decomposition(aten.take.default)
def _take(x, index):
    """Elements of the flattened ``x`` at ``index`` (negative indices count from the end)."""
    return aten.index.Tensor(aten.view.default(aten.clone.default(x), [-1]), [index])


@decomposition(aten.put.default)
def _put(x, index, source, accumulate=False):
    """``x`` with its flattened elements at ``index`` replaced by (or, accumulating, added to) ``source``."""
    if index.numel() == 0:
        return aten.clone.default(x)
    flat = aten.view.default(aten.clone.default(x), [-1])
    out = aten.index_put.default(flat, [aten.view.default(index, [-1])],
                                 aten.view.default(aten.clone.default(source), [-1]), accumulate)
    return aten.view.default(out, list(x.shape))


# --------------------------------------------------------------------------- 3-d and adaptive pooling
# 3-d average pooling is two 2-d average poolings: over (H, W), then over D with a (kd, 1) window
# (a box's divisor is the product of its per-axis counts, so the two divisions make torch's).
# Adaptive average pooling whose windows do not tile the input is a product with a constant
# [out, in] averaging matrix per axis; adaptive max pooling gathers every window (clamped,
# masked to -inf past its end) and reduces it.


def _triple(v: Any) -> List[int]:
    v = [int(a) for a in (v if isinstance(v, (list, tuple)) else [v])]
    return v * 3 if len(v) == 1 else v


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
    acc = _acc_dtype(x.dtype)
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


@decomposition(aten.adaptive_max_pool2d.default)
def _adaptive_max_pool2d(x, output_size):
    """(values, indices) of 2-d adaptive max pooling."""
    return _adaptive_max(x, [int(o) for o in output_size])


@decomposition(aten.adaptive_max_pool3d.default)
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



# --------------------------------------------------------------------------- antialiased resampling
# _upsample_bilinear2d_aa / _upsample_bicubic2d_aa are separable linear maps: output = A x B^T with
# constant [out, in] weights per axis. The weights are read off torch's own kernel applied to unit
# images at trace time (so they are torch's, window rules and normalisation included) and become
# program constants; the maps are then two matrix products, in fp32 for fp16/bf16 inputs.


def _aa_weights(op: Any, in_hw: Sequence[int], out_hw: Sequence[int], align_corners: bool, scales_h: Any,
                scales_w: Any) -> Tuple[Tensor, Tensor]:
    from torch.utils._python_dispatch import _disable_current_modes

    (ih, iw), (oh, ow) = in_hw, out_hw
    with _disable_current_modes():   # real computation, outside the trace
        eh = torch.eye(ih).reshape(ih, 1, ih, 1).expand(ih, 1, ih, iw).contiguous()
        a = op(eh, [oh, ow], align_corners, scales_h, scales_w)[:, 0, :, 0].t().contiguous()   # [oh, ih]
        ew = torch.eye(iw).reshape(iw, 1, 1, iw).expand(iw, 1, ih, iw).contiguous()
        b = op(ew, [oh, ow], align_corners, scales_h, scales_w)[:, 0, 0, :].t().contiguous()   # [ow, iw]
    return a, b


def _aa_apply(x: Tensor, a: Tensor, b: Tensor) -> Tensor:
    acc = _acc_dtype(x.dtype)
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
        if per_sample_weights is not None:
            rows = aten.mul.Tensor(rows, aten.view.default(per_sample_weights, [-1, 1]))
        if kept is not None:
            rows = aten.where.self(kept, rows, aten.full.default([], 0, dtype=weight.dtype))
        out = aten.index_put.default(zeros, [o2b], rows, True)
    if mode == 1:
        out = aten.div.Tensor(out, aten.view.default(aten.clamp.default(bag_size, 1), [-1, 1]))
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
    g = aten.sum.dim_IntList(aten.mul.Tensor(aten.index.Tensor(grad, [o2b]), aten.index.Tensor(weight, [indices])),
                             [1], False)
    if keep is not None:
        g = aten.where.self(keep, g, aten.full.default([], 0, dtype=g.dtype))
    return g



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


@decomposition(aten._trilinear.default)
def _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """``sum over sumdim of i1.unsqueeze(expand1) * i2.unsqueeze(expand2) * i3.unsqueeze(expand3)`` as
    one einsum (matrix products, no broadcast product of all three)."""
    n = i1.dim() + len(expand1)
    letters = "abcdefghijklmnopqrstuvwxyz"[:n]
    subs = ["".join(letters[d] for d in range(n) if d not in set(e)) for e in (expand1, expand2, expand3)]
    out = "".join(letters[d] for d in range(n) if d not in set(sumdim))
    return torch.einsum(f"{subs[0]},{subs[1]},{subs[2]}->{out}", i1, i2, i3)


# --------------------------------------------------------------------------- counting


@decomposition(aten.histc.default)
def _histc(x, bins=100, min=0, max=0):
    """Counts of ``x`` in ``bins`` equal bins over ``[min, max]`` (the data's range when they are equal),
    binned as torch does: ``trunc((x - min) * bins / (max - min))``, ``max`` in the last bin."""
    flat = aten.view.default(x, [-1])
    if flat.shape[0] == 0:
        return aten.full.default([bins], 0, dtype=x.dtype)
    if min == max:
        lo, hi = aten.amin.default(flat, [0], True), aten.amax.default(flat, [0], True)
        same = aten.eq.Tensor(lo, hi)
        lo = aten.where.self(same, aten.sub.Tensor(lo, 1), lo)
        hi = aten.where.self(same, aten.add.Tensor(hi, 1), hi)
    else:
        lo = aten.full.default([1], min, dtype=x.dtype)
        hi = aten.full.default([1], max, dtype=x.dtype)
    pos = aten.trunc.default(aten.div.Tensor(aten.mul.Tensor(aten.sub.Tensor(flat, lo), bins), aten.sub.Tensor(hi, lo)))
    pos = aten.clamp.default(pos, None, bins - 1)
    inside = aten.logical_and.default(aten.ge.Tensor(flat, lo), aten.le.Tensor(flat, hi))
    onehot = aten.logical_and.default(aten.unsqueeze.default(inside, 1), aten.eq.Tensor(
        aten.unsqueeze.default(pos, 1), aten.arange.start_step(0, bins, 1, dtype=x.dtype)))
    return aten.sum.dim_IntList(onehot, [0], False, dtype=x.dtype)


@decomposition(aten.nonzero_static.default)
def _nonzero_static(x, *, size, fill_value=-1):
    """Coordinates of the first ``size`` non-zero elements (row-major), rows past them ``fill_value``:
    each non-zero's rank (a prefix count) places its flat index."""
    size = int(size)
    n = x.numel()
    if n == 0:
        return aten.full.default([size, x.dim()], fill_value, dtype=torch.int64)
    nz = aten.ne.Scalar(aten.view.default(x, [-1]), 0)
    rank = aten.sub.Tensor(aten.cumsum.default(nz, 0, dtype=torch.int64), 1)
    slot = aten.where.self(aten.logical_and.default(nz, aten.lt.Scalar(rank, size)), rank,
                           aten.full.default([], size, dtype=torch.int64))
    buf = aten.scatter.src(aten.full.default([size + 1], -1, dtype=torch.int64), 0, slot,
                           aten.arange.start_step(0, n, 1, dtype=torch.int64))
    first = aten.slice.Tensor(buf, 0, 0, size)
    found = aten.ge.Scalar(first, 0)
    cols = []
    stride = n
    for d in x.shape:
        stride //= d
        c = aten.remainder.Scalar(aten.div.Tensor_mode(first, stride, rounding_mode="floor"), d)
        cols.append(aten.where.self(found, c, aten.full.default([], fill_value, dtype=torch.int64)))
    if not cols:
        return aten.full.default([size, 0], 0, dtype=torch.int64)
    return aten.stack.default(cols, 1)


@decomposition(aten.segment_reduce.default)
def _segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    """Reduction of consecutive segments along ``axis`` (``lengths``/``offsets`` batched over the axes
    before it) by scatter_reduce; an ``initial`` value takes part in every segment, as in torch (for
    ``mean`` it is added to the sum, not counted)."""
    if indices is not None:
        return NotImplemented
    if lengths is not None:
        ends = aten.cumsum.default(lengths, -1)
    elif offsets is not None:
        ends = aten.slice.Tensor(offsets, -1, 1, offsets.shape[-1])
    else:
        return NotImplemented
    axis = ends.dim() - 1
    nseg, rows = ends.shape[-1], data.shape[axis]
    r = aten.view.default(aten.arange.start_step(0, rows, 1, dtype=ends.dtype), [rows, 1])
    # segment of each row: how many segment ends lie at or before it (rows past the last end: slot nseg)
    seg = aten.sum.dim_IntList(aten.le.Tensor(aten.unsqueeze.default(ends, -2), r), [-1], False, dtype=torch.int64)
    rest = list(data.shape[axis + 1:])
    idx = aten.expand.default(aten.view.default(seg, list(seg.shape) + [1] * len(rest)), list(data.shape))
    red = {"sum": "sum", "prod": "prod", "max": "amax", "min": "amin", "mean": "sum"}[reduce]
    empty = {"sum": 0.0, "prod": 1.0, "max": -math.inf, "min": math.inf, "mean": 0.0}[reduce]
    shape = list(data.shape[:axis]) + [nseg + 1] + rest
    start = empty if initial is None else initial
    out = aten.scatter_reduce.two(aten.full.default(shape, start, dtype=data.dtype), axis, idx, data, red,
                                  include_self=True)
    out = aten.slice.Tensor(out, axis, 0, nseg)
    if reduce == "mean":
        count = aten.scatter_add.default(aten.full.default(shape, 0, dtype=data.dtype), axis, idx,
                                         aten.full.default(list(data.shape), 1, dtype=data.dtype))
        count = aten.slice.Tensor(count, axis, 0, nseg)
        if initial is None:
            out = aten.div.Tensor(out, count)                                # 0 / 0: NaN for empty segments
        else:
            out = aten.where.self(aten.gt.Scalar(count, 0), aten.div.Tensor(out, count), out)
    return out


# --------------------------------------------------------------------------- random draws from rand


def _randint(low, high, size, dtype):
    span = int(high) - int(low)
    u = aten.rand.default(list(size), dtype=torch.float32 if span <= (1 << 24) else torch.float64)
    k = aten.clamp.default(aten.floor.default(aten.mul.Tensor(u, span)), None, max(span - 1, 0))
    return aten._to_copy.default(aten.add.Tensor(k, int(low)), dtype=dtype or torch.int64)


@decomposition(aten.randint.default, aten.randint.generator)
def _randint_high(high, size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    """Uniform integers in ``[0, high)``: ``floor(rand * high)``."""
    return _randint(0, high, size, dtype)


@decomposition(aten.randint.low, aten.randint.low_generator)
def _randint_low(low, high, size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    """Uniform integers in ``[low, high)``."""
    return _randint(low, high, size, dtype)


@decomposition(aten.randint_like.default)
def _randint_like(x, high, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """randint shaped like ``x`` (its dtype by default)."""
    return _randint(0, high, tuple(x.shape), dtype or x.dtype)


@decomposition(aten.randint_like.low_dtype)
def _randint_like_low(x, low, high, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """randint in ``[low, high)`` shaped like ``x``."""
    return _randint(low, high, tuple(x.shape), dtype or x.dtype)


@decomposition(aten.multinomial.default)
def _multinomial(probs, num_samples, replacement=False, *, generator=None):
    """Category draws: with replacement by inverting the running sum of ``probs`` at uniform points,
    without by the ``num_samples`` largest of ``log(p) + Gumbel noise``."""
    n = probs.shape[-1]
    lead = list(probs.shape[:-1])
    p = probs if probs.dtype == torch.float32 else aten._to_copy.default(probs, dtype=torch.float32)
    if replacement:
        cdf = aten.cumsum.default(p, -1)
        u = aten.mul.Tensor(aten.rand.default(lead + [int(num_samples)], dtype=torch.float32),
                            aten.slice.Tensor(cdf, -1, n - 1, n))
        return aten.clamp.default(aten.searchsorted.Tensor(cdf, u, right=True), None, n - 1)
    u = aten.rand.default(lead + [n], dtype=torch.float32)
    gumbel = aten.neg.default(aten.log.default(aten.neg.default(aten.log.default(aten.clamp.default(u, 1e-38)))))
    keys = aten.add.Tensor(aten.log.default(p), gumbel)
    return aten.topk.default(keys, int(num_samples), -1)[1]


@decomposition(aten.rrelu_with_noise.default)
def _rrelu_with_noise(x, noise, lower=0.125, upper=1 / 3, training=False, generator=None):
    """Randomized leaky ReLU: in training, slopes drawn uniformly from ``[lower, upper]`` where
    ``x <= 0`` (written into ``noise``, 1 elsewhere); in eval the mean slope."""
    if not training:
        return aten.leaky_relu.default(x, (lower + upper) / 2)
    slope = aten.add.Tensor(aten.mul.Tensor(aten.rand.default(list(x.shape), dtype=x.dtype), upper - lower), lower)
    new = aten.where.self(aten.le.Scalar(x, 0), slope, aten.full.default([], 1, dtype=x.dtype))
    aten.copy_.default(noise, new)
    return aten.mul.Tensor(x, new)


# --------------------------------------------------------------------------- float representation


def _pow2(k: Tensor) -> Tensor:
    """``2**k`` for integral fp32 ``k`` in [-149, 127], exactly (pow, not exp2, which may round)."""
    return aten.pow.Scalar(2.0, k)


def _frexp32(xf: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """(mantissa, fp32 exponent, finite-and-non-zero mask) of fp32 ``xf``; the exponent from log2 is
    corrected by one either way, the scaling split in two so no factor over- or underflows."""
    a = aten.abs.default(xf)
    finite = aten.logical_and.default(aten.logical_not.default(aten.isinf.default(xf)),
                                      aten.logical_not.default(aten.isnan.default(xf)))
    ok = aten.logical_and.default(finite, aten.gt.Scalar(a, 0))
    safe = aten.where.self(ok, a, aten.full.default([], 1.0, dtype=torch.float32))
    e = aten.add.Tensor(aten.floor.default(aten.log2.default(safe)), 1)

    def scaled(e):
        h = aten.floor.default(aten.div.Tensor(e, 2))
        return aten.mul.Tensor(aten.mul.Tensor(safe, _pow2(aten.neg.default(h))),
                               _pow2(aten.neg.default(aten.sub.Tensor(e, h))))

    m = scaled(e)
    e = aten.add.Tensor(e, aten.sub.Tensor(aten._to_copy.default(aten.ge.Scalar(m, 1.0), dtype=torch.float32),
                                           aten._to_copy.default(aten.lt.Scalar(m, 0.5), dtype=torch.float32)))
    m = scaled(e)
    m = aten.where.self(ok, aten.where.self(aten.lt.Scalar(xf, 0), aten.neg.default(m), m), xf)
    e = aten.where.self(ok, e, aten.full.default([], 0.0, dtype=torch.float32))
    return m, e, ok


@decomposition(torch.ops.prims.frexp.default, aten.frexp.Tensor)
def _frexp(x):
    """(mantissa in ``[0.5, 1)`` by magnitude, int32 exponent) with ``x = mantissa * 2**exponent``; zero,
    infinities and NaN keep exponent 0."""
    if not x.is_floating_point() or x.dtype == torch.float64:
        return NotImplemented
    xf = x if x.dtype == torch.float32 else aten._to_copy.default(x, dtype=torch.float32)
    m, e, _ = _frexp32(xf)
    if m.dtype != x.dtype:
        m = aten._to_copy.default(m, dtype=x.dtype)
    return m, aten._to_copy.default(e, dtype=torch.int32)


@decomposition(torch.ops.prims.nextafter.default, aten.nextafter.default)
def _nextafter(x, y):
    """The fp32 number after ``x`` towards ``y``: ``x`` plus or minus its ulp (``2**(e-24)`` from frexp,
    half that stepping down from a power of two, ``2**-149`` among subnormals)."""
    if x.dtype != torch.float32 or y.dtype != torch.float32:
        return NotImplemented
    m, e, ok = _frexp32(x)
    ulp = _pow2(aten.clamp.default(aten.sub.Tensor(e, 24), -149.0))
    up = aten.gt.Tensor(y, x)
    away = aten.eq.Tensor(up, aten.gt.Scalar(x, 0))                       # the step grows |x|
    halve = aten.logical_and.default(aten.eq.Scalar(aten.abs.default(m), 0.5), aten.gt.Scalar(e, -125))
    step = aten.where.self(aten.logical_and.default(aten.logical_not.default(away), halve),
                           aten.mul.Tensor(ulp, 0.5), ulp)
    r = aten.where.self(up, aten.add.Tensor(x, step), aten.sub.Tensor(x, step))
    tiny = aten.full.default([], 2.0 ** -149, dtype=torch.float32)
    r = aten.where.self(aten.eq.Scalar(x, 0), aten.where.self(up, tiny, aten.neg.default(tiny)), r)
    big = aten.full.default([], 3.4028234663852886e38, dtype=torch.float32)
    r = aten.where.self(aten.isinf.default(x), aten.where.self(aten.gt.Scalar(x, 0), big, aten.neg.default(big)), r)
    r = aten.where.self(aten.eq.Tensor(x, y), y, r)
    nan = aten.logical_or.default(aten.isnan.default(x), aten.isnan.default(y))
    return aten.where.self(nan, aten.full.default([], math.nan, dtype=torch.float32), r)

from . import special  # noqa: E402,F401  (registers the special-function decompositions)
