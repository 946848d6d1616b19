# The functional IR: typed SSA variables, equations and programs, printed like a jaxpr.
"""tn's intermediate representation.

A program (:class:`IR`) is a list of equations (:class:`Eqn`) over typed
variables (:class:`Var`). It is pure: no equation mutates a variable, and
every variable is defined exactly once (SSA). Mutation of program inputs is
expressed as extra outputs (see :attr:`IR.mutations`), which the runtime writes
back after the call.

The IR knows nothing about torch tracing or the NeuronCore; it only needs
torch for dtypes. Operators are objects from the single op table in
:mod:`tn.ops` (anything with a ``name`` attribute prints).

Example listing::

    { lambda ; a:f32[4,8] b:f32[8]. let
        c:f32[4,8] = add a b
        d:f32[4] = sum[dim=(1,) keepdim=False] c
      in (d,) }
"""
from __future__ import annotations

import itertools
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

__all__ = ["Var", "Literal", "Eqn", "IR", "dtype_name", "aval_str", "Atom"]

_DTYPE_NAMES = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.complex64: "c64",
    torch.complex128: "c128",
}


def dtype_name(dtype: torch.dtype) -> str:
    """Short printable name of a torch dtype: ``f32``, ``bf16``, ``i64``, ``b8`` ..."""
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def aval_str(shape: Sequence[int], dtype: torch.dtype) -> str:
    """Abstract value as text, e.g. ``f32[4,8]`` or ``i64[]`` for a scalar."""
    return f"{dtype_name(dtype)}[{','.join(str(int(d)) for d in shape)}]"


_var_ids = itertools.count()


class Var:
    """A typed SSA variable: a tensor of known ``shape`` and ``dtype``.

    Identity is by object (``is``); ``id`` is a process-unique integer used
    for stable ordering and hashing. Names are assigned only when printing.
    """

    __slots__ = ("shape", "dtype", "id")

    def __init__(self, shape: Sequence[int], dtype: torch.dtype):
        self.shape: Tuple[int, ...] = tuple(int(d) for d in shape)
        self.dtype: torch.dtype = dtype
        self.id: int = next(_var_ids)

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def aval(self) -> str:
        """The abstract value as text, e.g. ``f32[4,8]``."""
        return aval_str(self.shape, self.dtype)

    def __hash__(self) -> int:
        return self.id

    def __eq__(self, other: object) -> bool:
        return self is other

    def __repr__(self) -> str:
        return f"Var#{self.id}:{self.aval}"


#: Python value types tn treats as compile-time constants: a pytree leaf of one of these types is baked into a
#: program (tn.jit, tn.adaptive) and keys its cache by value, as is such an argument of a traced aten call. All are
#: hashable (``slice`` is not, before Python 3.12, so it is not one of them).
CONSTANT_TYPES = frozenset({
    bool, int, float, complex, str, bytes, type(None), type(Ellipsis),
    torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size,
})


class Literal:
    """A Python scalar (bool, int, float) used directly as an equation input."""

    __slots__ = ("value", "dtype")

    def __init__(self, value: Union[bool, int, float], dtype: Optional[torch.dtype] = None):
        self.value = value
        if dtype is None:
            dtype = torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) else torch.float32
        self.dtype = dtype

    shape: Tuple[int, ...] = ()

    @property
    def aval(self) -> str:
        """The abstract value as text (always a scalar)."""
        return aval_str((), self.dtype)

    def __hash__(self) -> int:
        return hash((type(self.value), self.value, self.dtype))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Literal)
            and type(other.value) is type(self.value)
            and other.value == self.value
            and other.dtype == self.dtype
        )

    def __repr__(self) -> str:
        return f"Literal({self.value!r})"


Atom = Union[Var, Literal]


class Eqn:
    """One equation: ``outputs = op[attrs](*inputs)``.

    ``op`` is an operator from :mod:`tn.ops` (an object with a ``name``).
    ``inputs`` are :class:`Var` or :class:`Literal`; ``outputs`` are fresh
    :class:`Var`. ``attrs`` holds static, hashable parameters (ints, floats,
    tuples, dtypes, strings). ``source`` is the user's ``file:line`` that
    produced the equation, when known (for errors and listings).
    """

    __slots__ = ("op", "inputs", "outputs", "attrs", "source")

    def __init__(self, op: Any, inputs: Sequence[Atom], outputs: Sequence[Var],
                 attrs: Optional[Dict[str, Any]] = None, source: Optional[str] = None):
        self.op = op
        self.inputs: List[Atom] = list(inputs)
        self.outputs: List[Var] = list(outputs)
        self.attrs: Dict[str, Any] = dict(attrs) if attrs else {}
        self.source = source

    def __repr__(self) -> str:
        return f"Eqn({self.op.name}, {self.inputs} -> {self.outputs}, {self.attrs})"


def _format_attr(value: Any) -> str:
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, tuple):
        inner = ",".join(_format_attr(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ",".join(_format_attr(v) for v in value) + "]"
    return repr(value) if isinstance(value, str) else str(value)


def _names() -> Iterator[str]:
    """a, b, ..., z, ba, bb, ... as jaxprs name their variables."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    for n in itertools.count(1):
        for combo in itertools.product(letters, repeat=n):
            if n > 1 and combo[0] == "a":
                continue
            yield "".join(combo)


class IR:
    """A whole program: inputs, constants, equations and outputs.

    Attributes:
        inputs: the program's parameters, in call order (flattened tensors).
        consts: constant tensors the program captured (e.g. a tensor created
            inside the traced function without a traced input), as
            ``(Var, torch.Tensor)`` pairs; executors bind them before inputs.
        eqns: equations in a valid execution order.
        outputs: the results, in order: first the user's flattened outputs,
            then the new values of mutated inputs (see ``mutations``).
        mutations: ``(input_index, output_index)`` pairs: after a call,
            output ``output_index`` must be written back into input
            ``input_index`` (in-place ops and buffer updates, functionalised).
        name: what the program was traced from (the jitted function or
            module, e.g. ``"GPT2Block"``), or None; a compiler names its
            programs after it. Not part of the program's meaning.
    """

    __slots__ = ("inputs", "consts", "eqns", "outputs", "mutations", "name")

    def __init__(self, inputs: Sequence[Var], eqns: Sequence[Eqn], outputs: Sequence[Atom],
                 consts: Sequence[Tuple[Var, torch.Tensor]] = (),
                 mutations: Sequence[Tuple[int, int]] = (), name: Optional[str] = None):
        self.inputs: List[Var] = list(inputs)
        self.consts: List[Tuple[Var, torch.Tensor]] = list(consts)
        self.eqns: List[Eqn] = list(eqns)
        self.outputs: List[Atom] = list(outputs)
        self.mutations: List[Tuple[int, int]] = [tuple(m) for m in mutations]
        self.name: Optional[str] = name

    def replace(self, **changes: Any) -> "IR":
        """A copy with some fields replaced (equations are shared, not copied)."""
        fields = {name: getattr(self, name) for name in self.__slots__}
        fields.update(changes)
        return IR(**fields)

    def op_counts(self) -> Dict[str, int]:
        """How many equations use each op, by op name."""
        counts: Dict[str, int] = {}
        for eqn in self.eqns:
            counts[eqn.op.name] = counts.get(eqn.op.name, 0) + 1
        return counts

    def var_names(self) -> Dict[Var, str]:
        """The name :meth:`pretty` prints for each variable (``a``, ``b``, ... in order of definition: constants,
        inputs, equation outputs); later stages (``print(exe.schedule)``) name values the same way."""
        fresh = _names()
        return {v: next(fresh) for v in self.all_vars()}

    def pretty(self, show_source: bool = False) -> str:
        """The program as text, jaxpr style, every variable with its aval.

        With ``show_source`` each equation is followed by the user's
        ``file:line`` that produced it, as a comment.
        """
        names = self.var_names()

        def bind(v: Var) -> str:
            return f"{names[v]}:{v.aval}"

        def use(a: Atom) -> str:
            if isinstance(a, Literal):
                return f"{a.value!r}"
            return names.get(a, f"?{a.id}")

        const_part = " ".join(bind(v) for v, _ in self.consts)
        in_part = " ".join(bind(v) for v in self.inputs)
        lines = [f"{{ lambda {const_part}{' ' if const_part else ''}; {in_part}. let"]
        for eqn in self.eqns:
            outs = " ".join(bind(v) for v in eqn.outputs)
            attrs = ""
            if eqn.attrs:
                attrs = "[" + " ".join(f"{k}={_format_attr(v)}" for k, v in eqn.attrs.items()) + "]"
            args = " ".join(use(a) for a in eqn.inputs)
            line = f"    {outs} = {eqn.op.name}{attrs} {args}".rstrip()
            if show_source and eqn.source:
                line += f"    # {eqn.source}"
            lines.append(line)
        outs = ", ".join(use(a) for a in self.outputs)
        if len(self.outputs) == 1:
            outs += ","
        tail = f"  in ({outs}) }}"
        if self.mutations:
            tail += "  # writes back: " + ", ".join(f"input {i} <- out {o}" for i, o in self.mutations)
        lines.append(tail)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.pretty()

    def __repr__(self) -> str:
        return f"<tn.IR: {len(self.inputs)} inputs, {len(self.eqns)} eqns, {len(self.outputs)} outputs>"

    def all_vars(self) -> Iterable[Var]:
        """Every variable defined in the program (constants, inputs, equation outputs)."""
        for v, _ in self.consts:
            yield v
        yield from self.inputs
        for eqn in self.eqns:
            yield from eqn.outputs
