# The op table's machinery: the Op class (an op and the facts it declares), the OPS/FROM_ATEN/DECOMPOSITIONS tables and the decorators that fill them.
"""The op table: :class:`Op`, :data:`OPS`, :data:`FROM_ATEN`, :data:`DECOMPOSITIONS` and their decorators.

The ops themselves are registered by :mod:`tn.ops.core`; the decompositions by
:mod:`tn.ops.decompositions`, :mod:`tn.ops.nn_layers` and :mod:`tn.ops.special`.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import ArgumentValueError, UnsupportedOpError
from ..ir import Literal

Tensor = torch.Tensor

#: Category names the compiler may rely on.
CATEGORIES = ("elementwise", "reduction", "scan", "sort", "matmul", "conv", "pool", "shape", "index",
              "creation", "random", "host", "collective")


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

#: Decompositions of library ops that may be registered after tn is imported (``torch.library`` custom ops
#: of other packages, e.g. Hugging Face's grouped matmul), keyed by the overload's ``name()``
#: (``"namespace::op"``, ``"namespace::op.overload"``); the tracer looks them up by name.
DECOMPOSITIONS_BY_NAME: Dict[str, Callable[..., Any]] = {}

#: aten overload -> why tn's decomposition is used instead of ``torch._decomp``'s (one line each; only
#: overloads that have both).
OVERRIDE_REASONS: Dict[Any, str] = {}

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
            if ov in FROM_ATEN:
                raise ArgumentValueError(f"{ov} is mapped onto a core op twice")
            FROM_ATEN[ov] = (op, conv)
            if ov not in op.aten:
                op.aten = op.aten + (ov,)
        return conv

    return deco


def decomposition(*overloads: Any, instead_of_torch: Optional[str] = None
                  ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register a tn decomposition for ``overloads``.

    Where an overload also has a decomposition in ``torch._decomp.decomposition_table``, tn's is tried
    first; ``instead_of_torch`` says in one line why (kept in :data:`OVERRIDE_REASONS`;
    ``tests/test_ops_table.py`` requires it exactly there).
    """

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for ov in overloads:
            if ov in DECOMPOSITIONS:
                raise ArgumentValueError(f"{ov} has two tn decompositions")
            DECOMPOSITIONS[ov] = fn
            if instead_of_torch is not None:
                OVERRIDE_REASONS[ov] = instead_of_torch
        return fn

    return deco


def decomposition_by_name(*qualified_names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register a tn decomposition for ops named ``"namespace::op"`` that need not exist yet
    (custom ops of packages tn does not import); see :data:`DECOMPOSITIONS_BY_NAME`."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for name in qualified_names:
            if name in DECOMPOSITIONS_BY_NAME:
                raise ArgumentValueError(f"{name} has two tn decompositions")
            DECOMPOSITIONS_BY_NAME[name] = fn
        return fn

    return deco
