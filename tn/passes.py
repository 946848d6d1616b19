# IR-to-IR passes (DCE, CSE, simplification, constant folding) and the verifier run after each.
"""Passes over :class:`tn.ir.IR`.

Every pass takes an IR and returns a new IR; the input is never modified
(equations are shared between IRs, so a pass that changes an equation builds
a new :class:`~tn.ir.Eqn`).

- :func:`dce`: drops equations whose results nobody uses (program outputs,
  including the new values of mutated inputs, are always kept) and unused
  constants.
- :func:`cse`: merges equations with the same op, inputs and attributes.
  Random and side-effecting ops are never merged.
- :func:`simplify`: removes no-op equations (identity reshape, permute,
  as_strided, convert ...) and collapses chains of reshapes and permutes.
- :func:`fold_constants`: evaluates equations whose inputs are all constants
  or literals with the op's reference implementation, when the result is
  small (:data:`FOLD_MAX_NUMEL`); the result becomes a program constant.
- :func:`verify`: checks SSA (every variable defined once, before use),
  types (re-runs each op's shape rule) and that outputs and mutations are well
  formed; raises :class:`VerifyError` naming the equation.

:func:`optimize` runs the default pipeline. With verification on
(``TN_VERIFY=1`` in the environment, or ``tn.passes.VERIFY = True``) it
verifies the IR before the first pass and after every pass, and an error names
the pass that broke the IR.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from . import config
from .errors import CompileError
from .ir import IR, Eqn, Literal, Var, aval_str
from .ops import Op
from .shapes import contiguous_strides

__all__ = [
    "VerifyError", "VERIFY", "FOLD_MAX_NUMEL", "verify", "dce", "cse", "fold_constants",
    "optimize", "PIPELINE",
    "is_impure", "simplify", "env_flag",
]


def env_flag(text: Optional[str]) -> bool:
    """Whether an environment variable's text means "on" (tn's one flag rule, :func:`tn.config.parse_flag`)."""
    return config.parse_flag(text or "")


#: Verify after every pass of :func:`optimize` (``TN_VERIFY=1``; the test suite turns it on).
VERIFY: bool = config.get("verify")

#: Constant folding only folds an equation whose outputs have at most this many
#: elements in total, so huge tensors are never baked into a program.
FOLD_MAX_NUMEL: int = 1 << 16


class VerifyError(CompileError):
    """The IR is malformed: broken SSA, a type that disagrees with the op's
    shape rule, or bad outputs/mutations. The message names the equation (and,
    from :func:`optimize`, the pass that produced the broken IR)."""


# --------------------------------------------------------------------------- helpers

def is_impure(op: Op) -> bool:
    """Whether ``op`` must never be merged, folded or duplicated: it draws random numbers or has an effect
    (:attr:`tn.ops.Op.impure`)."""
    return op.impure


def _eqn_lines(ir: IR) -> List[str]:
    """Listing line of every equation, names consistent with ``str(ir)``."""
    lines = ir.pretty(show_source=True).splitlines()
    return [ln.strip() for ln in lines[1:1 + len(ir.eqns)]]


def _shape_tuple(shape: Any) -> Tuple[int, ...]:
    return tuple(int(d) for d in shape)


def _substitute(ir: IR, mapping: Dict[Var, Any], eqns: Optional[Sequence[Eqn]] = None) -> IR:
    """A copy of ``ir`` (with ``eqns`` if given) where every use of a key of
    ``mapping`` is replaced by its value. Equations are copied only when one of
    their inputs changes."""
    if eqns is None:
        eqns = ir.eqns
    if not mapping:
        return ir.replace(eqns=list(eqns))

    def sub(a: Any) -> Any:
        if isinstance(a, Var):
            return mapping.get(a, a)
        return a

    new_eqns = []
    for e in eqns:
        if any(isinstance(a, Var) and a in mapping for a in e.inputs):
            e = Eqn(e.op, [sub(a) for a in e.inputs], e.outputs, e.attrs, e.source)
        new_eqns.append(e)
    return ir.replace(eqns=new_eqns, outputs=[sub(a) for a in ir.outputs])


# --------------------------------------------------------------------------- verify

def verify(ir: IR) -> IR:
    """Check that ``ir`` is well formed; return it unchanged.

    Checks: constants are tensors matching their variables; every variable is
    defined exactly once and before use; equation inputs are variables or
    literals; each op's shape rule, re-run on the input avals, gives the
    shapes and dtypes of the equation's outputs; outputs are defined;
    mutations are ``(input_index, output_index)`` pairs in range, each input
    written at most once, with matching shape and dtype.

    Raises :class:`VerifyError` naming the first equation (or input, constant,
    output, mutation) at fault.
    """
    defined: Set[Var] = set()
    lines: Optional[List[str]] = None

    def where(k: int) -> str:
        nonlocal lines
        if lines is None:
            try:
                lines = _eqn_lines(ir)
            except Exception:  # printing a broken IR may fail; fall back to repr
                lines = [repr(e) for e in ir.eqns]
        text = lines[k] if k < len(lines) else repr(ir.eqns[k])
        return f"equation {k} `{text}`"

    def define(v: Any, what: str) -> None:
        if not isinstance(v, Var):
            raise VerifyError(f"{what} is {v!r}, not a tn.ir.Var; every definition must be a fresh Var")
        if v in defined:
            raise VerifyError(f"{what} redefines {v!r}, already defined earlier: the IR is not in SSA form "
                              f"(each Var must be defined exactly once)")
        defined.add(v)

    for j, pair in enumerate(ir.consts):
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise VerifyError(f"constant {j} is {pair!r}; constants must be (Var, torch.Tensor) pairs")
        v, t = pair
        define(v, f"constant {j}")
        if not isinstance(t, torch.Tensor):
            raise VerifyError(f"constant {j} ({v!r}) is bound to a {type(t).__name__}, not a torch.Tensor")
        if _shape_tuple(t.shape) != v.shape or t.dtype != v.dtype:
            raise VerifyError(f"constant {j} is declared {v.aval} but its tensor is "
                              f"{aval_str(t.shape, t.dtype)}")
    for j, v in enumerate(ir.inputs):
        define(v, f"input {j}")

    for k, e in enumerate(ir.eqns):
        op = e.op
        if not isinstance(op, Op):
            raise VerifyError(f"{where(k)}: its op {op!r} is not a tn.ops.Op")
        name = op.name
        for i, a in enumerate(e.inputs):
            if isinstance(a, Literal):
                continue
            if not isinstance(a, Var):
                raise VerifyError(f"{where(k)}: input {i} is {a!r}; equation inputs must be Var or Literal")
            if a not in defined:
                raise VerifyError(f"{where(k)}: input {i} ({a!r}) is used before it is defined "
                                  f"(or never defined); equations must come in dependency order")
        if not isinstance(e.attrs, dict):
            raise VerifyError(f"{where(k)}: attrs must be a dict, got {type(e.attrs).__name__}")
        try:
            expected = list(op.shape_rule(*e.inputs, **e.attrs))
        except Exception as exc:
            raise VerifyError(f"{where(k)}: the shape rule of {name} rejects these inputs: "
                              f"{type(exc).__name__}: {exc}") from exc
        if len(expected) != len(e.outputs):
            raise VerifyError(f"{where(k)}: {len(e.outputs)} outputs, but the shape rule of {name} "
                              f"gives {len(expected)}")
        for i, (v, exp) in enumerate(zip(e.outputs, expected)):
            try:
                shape, dtype = exp
                shape = _shape_tuple(shape)
            except Exception as exc:
                raise VerifyError(f"{where(k)}: the shape rule of {name} returned {exp!r} for output {i}; "
                                  f"it must return (shape, dtype) pairs") from exc
            if not isinstance(v, Var):
                raise VerifyError(f"{where(k)}: output {i} is {v!r}, not a tn.ir.Var")
            if v.shape != shape or v.dtype != dtype:
                raise VerifyError(f"{where(k)}: output {i} is declared {v.aval} but the shape rule of {name} "
                                  f"gives {aval_str(shape, dtype)}")
        for i, v in enumerate(e.outputs):
            define(v, f"{where(k)}, output {i},")

    for j, a in enumerate(ir.outputs):
        if isinstance(a, Literal):
            continue
        if not isinstance(a, Var):
            raise VerifyError(f"program output {j} is {a!r}; outputs must be Var or Literal")
        if a not in defined:
            raise VerifyError(f"program output {j} ({a!r}) is never defined by a constant, input or equation")

    written: Set[int] = set()
    for m in ir.mutations:
        if not (isinstance(m, tuple) and len(m) == 2 and all(isinstance(x, int) for x in m)):
            raise VerifyError(f"mutation {m!r} must be an (input_index, output_index) pair of ints")
        i, o = m
        if not 0 <= i < len(ir.inputs):
            raise VerifyError(f"mutation {m}: input index {i} is out of range (program has "
                              f"{len(ir.inputs)} inputs)")
        if not 0 <= o < len(ir.outputs):
            raise VerifyError(f"mutation {m}: output index {o} is out of range (program has "
                              f"{len(ir.outputs)} outputs)")
        if i in written:
            raise VerifyError(f"mutation {m}: input {i} is written back more than once")
        written.add(i)
        src, dst = ir.outputs[o], ir.inputs[i]
        if _shape_tuple(src.shape) != dst.shape or src.dtype != dst.dtype:
            raise VerifyError(f"mutation {m}: output {o} is {src.aval} but input {i} is {dst.aval}; "
                              f"a written-back value must have the input's shape and dtype")
    return ir


# --------------------------------------------------------------------------- DCE

def dce(ir: IR) -> IR:
    """Dead code elimination: keep only equations that contribute to an output.

    Every program output (including mutation outputs) is live. Impure
    equations (see :func:`is_impure`) are dropped too when unused: the IR has
    no effects other than its outputs. Unused constants are removed; inputs
    are kept (they are the program's signature).
    """
    live: Set[Var] = {a for a in ir.outputs if isinstance(a, Var)}
    kept: List[Eqn] = []
    for e in reversed(ir.eqns):
        if any(v in live for v in e.outputs) or e.op.effectful:
            kept.append(e)
            live.update(a for a in e.inputs if isinstance(a, Var))
    kept.reverse()
    consts = [(v, t) for v, t in ir.consts if v in live]
    return ir.replace(eqns=kept, consts=consts)


# --------------------------------------------------------------------------- CSE

class _Unhashable(Exception):
    pass


def _freeze(value: Any) -> Any:
    """A hashable key for an attribute value that tells apart values Python
    considers equal but ops do not (``1`` vs ``1.0`` vs ``True``, ``0.0`` vs
    ``-0.0``). Raises :class:`_Unhashable` for values without a safe key."""
    t = type(value)
    if value is None or t in (bool, int, str):
        return (t, value)
    if t is float:
        return (float, repr(value))  # repr tells -0.0 from 0.0 and makes nan equal to nan
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return (t, str(value))
    if t in (tuple, list):
        return (t, tuple(_freeze(v) for v in value))
    if t is dict:
        return (dict, tuple(sorted((str(k), _freeze(v)) for k, v in value.items())))
    if t is torch.Size:
        return (tuple, tuple((int, int(d)) for d in value))
    raise _Unhashable(t.__name__)


def _atom_key(a: Any) -> Any:
    if isinstance(a, Literal):
        return ("lit", type(a.value), repr(a.value), a.dtype)
    return a


#: Constants of at most this many elements are merged by value in :func:`cse`.
SMALL_CONST = 16


def _small_const_key(t: Any) -> Any:
    """``(dtype, shape, bytes)`` of a small plain constant tensor (bitwise: ``-0.0`` and ``0.0`` differ, NaN
    payloads count), None for a large, sparse, quantized, parameter or non-tensor one."""
    if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter) or t.layout != torch.strided or \
            t.is_quantized or t.numel() > SMALL_CONST or t.requires_grad:
        return None
    c = t.detach().cpu()
    if c.numel() == 0:
        return (c.dtype, tuple(c.shape), ())
    # a fresh 1-d copy: a size-1 (or expanded) tensor may keep a zero stride even when "contiguous", which
    # view(uint8) refuses (quantile's and index_fill's scalar constants)
    flat = c.new_empty((c.numel(),)).copy_(c.reshape(-1))
    return (c.dtype, tuple(c.shape), tuple(flat.view(torch.uint8).tolist()))


def cse(ir: IR) -> IR:
    """Common subexpression elimination.

    Two equations merge when they have the same op, the same inputs (after
    earlier merges) and the same attributes. Attribute values are compared by
    type as well as value (``1``, ``1.0`` and ``True`` differ; ``0.0`` and
    ``-0.0`` differ). Equations with attributes that have no safe hashable
    form, and random or side-effecting ops (:func:`is_impure`), are never
    merged. Identical constant tensors (the same object) are merged too, and so are small constants
    (at most :data:`SMALL_CONST` elements) of the same dtype, shape and bytes: the scalars a traced model makes
    anew in every layer (BERT's attention-mask fill values), so the equations reading them merge as well.
    """
    mapping: Dict[Var, Var] = {}
    consts = []
    by_tensor: Dict[int, Var] = {}
    by_value: Dict[Any, Var] = {}
    for v, t in ir.consts:
        first = by_tensor.get(id(t))
        if first is None:
            vkey = _small_const_key(t)
            first = by_value.get(vkey) if vkey is not None else None
        if first is not None and first.shape == v.shape and first.dtype == v.dtype:
            mapping[v] = first
        else:
            by_tensor[id(t)] = v
            vkey = _small_const_key(t)
            if vkey is not None:
                by_value.setdefault(vkey, v)
            consts.append((v, t))

    seen: Dict[Any, Eqn] = {}
    new_eqns: List[Eqn] = []
    for e in ir.eqns:
        if any(isinstance(a, Var) and a in mapping for a in e.inputs):
            e = Eqn(e.op, [mapping.get(a, a) if isinstance(a, Var) else a for a in e.inputs],
                    e.outputs, e.attrs, e.source)
        if not is_impure(e.op):
            try:
                key = (id(e.op), e.op.name, tuple(_atom_key(a) for a in e.inputs),
                       _freeze(e.attrs), tuple((v.shape, v.dtype) for v in e.outputs))
                hash(key)
            except (_Unhashable, TypeError):
                key = None
            if key is not None:
                prev = seen.get(key)
                if prev is not None:
                    for old, new in zip(e.outputs, prev.outputs):
                        mapping[old] = new
                    continue
                seen[key] = e
        new_eqns.append(e)
    outputs = [mapping.get(a, a) if isinstance(a, Var) else a for a in ir.outputs]
    return ir.replace(eqns=new_eqns, outputs=outputs, consts=consts)


# --------------------------------------------------------------------------- simplification

def _same_aval(a: Any, b: Any) -> bool:
    return _shape_tuple(a.shape) == _shape_tuple(b.shape) and a.dtype == b.dtype


def _is_identity(e: Eqn) -> bool:
    """Whether equation ``e`` returns its first input unchanged (by its op and attrs)."""
    if len(e.outputs) != 1 or not e.inputs or not isinstance(e.inputs[0], Var):
        return False
    x, out, name, at = e.inputs[0], e.outputs[0], e.op.name, e.attrs
    if not _same_aval(x, out):
        return False
    if name in ("reshape", "expand", "slice", "convert") and len(e.inputs) == 1:
        return True  # same shape and dtype: nothing moved or changed
    if name == "permute":
        return tuple(at.get("dims", ())) == tuple(range(x.ndim))
    if name == "flip":
        return all(x.shape[d] <= 1 for d in at.get("dims", ()))
    if name == "cat":
        return len(e.inputs) == 1
    if name == "pad":
        return all(p == 0 for p in at.get("pad", ()))
    if name == "as_strided":
        return (tuple(at.get("size", ())) == x.shape and at.get("offset", 0) == 0
                and all(st == cs for st, cs, d in zip(at.get("stride", ()), contiguous_strides(x.shape), x.shape)
                        if d > 1))
    if name == "mul" and len(e.inputs) == 2 and isinstance(e.inputs[1], Literal):
        v = e.inputs[1].value
        return type(v) in (int, float) and v == 1
    return False


def simplify(ir: IR) -> IR:
    """Remove no-op equations and collapse chains of reshapes.

    An equation is a no-op when its op and attributes leave the first input
    unchanged and the output has the input's shape and dtype: ``reshape``,
    ``expand``, ``slice`` or ``convert`` to the same aval, the identity
    ``permute``, ``flip`` of size-1 dims, ``cat`` of one input, zero ``pad``,
    an ``as_strided`` that reads the whole row-major layout, ``mul`` by the
    literal 1. Its uses are rewired to its input. A ``reshape`` of a
    ``reshape`` reads the first one's input directly, and a ``permute`` of a
    ``permute`` becomes one permute (or nothing); run :func:`dce` to drop the
    inner one when it becomes unused.
    """
    mapping: Dict[Var, Any] = {}
    producer: Dict[Var, Eqn] = {}
    new_eqns: List[Eqn] = []
    for e in ir.eqns:
        if any(isinstance(a, Var) and a in mapping for a in e.inputs):
            e = Eqn(e.op, [mapping.get(a, a) if isinstance(a, Var) else a for a in e.inputs],
                    e.outputs, e.attrs, e.source)
        if _is_identity(e):
            mapping[e.outputs[0]] = e.inputs[0]
            continue
        if e.op.name == "reshape" and len(e.inputs) == 1 and isinstance(e.inputs[0], Var):
            inner = producer.get(e.inputs[0])
            if inner is not None and inner.op is e.op and isinstance(inner.inputs[0], Var):
                src = inner.inputs[0]
                if tuple(e.outputs[0].shape) == src.shape:
                    mapping[e.outputs[0]] = src
                    continue
                e = Eqn(e.op, [src], e.outputs, e.attrs, e.source)
        if e.op.name == "permute" and len(e.inputs) == 1 and isinstance(e.inputs[0], Var):
            inner = producer.get(e.inputs[0])
            if inner is not None and inner.op is e.op and isinstance(inner.inputs[0], Var):
                src, d1, d2 = inner.inputs[0], tuple(inner.attrs["dims"]), tuple(e.attrs["dims"])
                dims = tuple(d1[i] for i in d2)
                if dims == tuple(range(len(dims))):
                    mapping[e.outputs[0]] = src
                    continue
                e = Eqn(e.op, [src], e.outputs, {**e.attrs, "dims": dims}, e.source)
        for v in e.outputs:
            producer[v] = e
        new_eqns.append(e)
    outputs = [mapping.get(a, a) if isinstance(a, Var) else a for a in ir.outputs]
    return ir.replace(eqns=new_eqns, outputs=outputs)


# --------------------------------------------------------------------------- constant folding

#: Tensors that constant folding created. Only these (and literals) feed later
#: folds: a tensor the traced function captured (a closure's weight, a global)
#: may be changed in place by the user later, so results derived from it are
#: never baked into a program.
#: Keyed by ``id``: a WeakSet would compare two entries with equal hashes by
#: ``==``, which for tensors is elementwise (and raises for more than one element).
_FOLDED: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def _was_folded(t: torch.Tensor) -> bool:
    return _FOLDED.get(id(t)) is t


def fold_constants(ir: IR, max_numel: Optional[int] = None) -> IR:
    """Evaluate equations whose inputs are all literals or folded constants.

    Each such equation (random/side-effecting ops excepted; factory ops with
    no inputs included) is run with its op's reference implementation; when
    its outputs hold at most ``max_numel`` elements in total (default
    :data:`FOLD_MAX_NUMEL`) and come out with the declared shapes and dtypes,
    they become program constants and the equation disappears. Folding chains:
    a folded result feeds later folds. Constants the traced function captured
    (a closure's tensor, a global) are *not* folded through, since the user may
    update them in place between calls. Equations whose implementation fails
    are left in place. Run :func:`dce` afterwards to drop constants nobody
    uses any more.
    """
    limit = FOLD_MAX_NUMEL if max_numel is None else max_numel
    known: Dict[Var, torch.Tensor] = {v: t for v, t in ir.consts if _was_folded(t)}
    consts = list(ir.consts)
    kept: List[Eqn] = []
    for e in ir.eqns:
        if is_impure(e.op) or sum(v.numel for v in e.outputs) > limit:
            kept.append(e)
            continue
        if not all(isinstance(a, Literal) or a in known for a in e.inputs):
            kept.append(e)
            continue
        args = [a.value if isinstance(a, Literal) else known[a] for a in e.inputs]
        try:
            with torch.no_grad():
                r = e.op.impl(*args, **e.attrs)
        except Exception:  # an op that cannot run on these constants stays in the program
            kept.append(e)
            continue
        results = list(r) if isinstance(r, (tuple, list)) else [r]
        if len(results) != len(e.outputs) or not all(
                isinstance(t, torch.Tensor) and _shape_tuple(t.shape) == v.shape and t.dtype == v.dtype
                for t, v in zip(results, e.outputs)):
            kept.append(e)
            continue
        for v, t in zip(e.outputs, results):
            t = t.detach().contiguous()
            _FOLDED[id(t)] = t
            known[v] = t
            consts.append((v, t))
    return ir.replace(eqns=kept, consts=consts)


# --------------------------------------------------------------------------- pipeline

#: The default pipeline of :func:`optimize`: (name, pass) pairs, run in order.
PIPELINE: List[Tuple[str, Callable[[IR], IR]]] = [
    ("simplify", simplify),
    ("fold_constants", fold_constants),
    ("cse", cse),
    ("dce", dce),
]


def optimize(ir: IR, passes: Optional[Sequence[Tuple[str, Callable[[IR], IR]]]] = None,
             verify_each: Optional[bool] = None) -> IR:
    """Run ``passes`` (default :data:`PIPELINE`) over ``ir`` and return the result.

    With ``verify_each`` (default: :data:`VERIFY`) the IR is verified before
    the first pass and after every pass; a :class:`VerifyError` then names the
    pass that broke the IR.
    """
    check = VERIFY if verify_each is None else verify_each
    if check:
        try:
            verify(ir)
        except VerifyError as exc:
            raise VerifyError(f"the IR given to optimize() is malformed (the tracer built it): {exc}") from exc
    for name, p in (PIPELINE if passes is None else passes):
        ir = p(ir)
        if check:
            try:
                verify(ir)
            except VerifyError as exc:
                raise VerifyError(f"pass {name!r} produced a malformed IR: {exc}") from exc
    return ir
