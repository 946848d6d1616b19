# The oracle executor: runs an IR equation by equation with each op's torch reference implementation.
"""Reference executor for :class:`tn.ir.IR`.

Every op in :mod:`tn.ops` carries ``impl(*inputs, **attrs)``, a torch
implementation. This module runs a whole program with those implementations.
It is the test oracle for the NeuronCore compiler and, until that compiler
exists, the default backend of :func:`tn.jit`.

:func:`compile_ir` turns an IR once into a straight-line Python function, one
line per equation (``v7 = f3(v5, 2.0, **a3)``), with the impls, attributes
and constants bound as globals of that function. Running a program then
costs one Python call per equation and nothing else; intermediates are
deleted after their last use. ``CompiledIR.source`` is the generated code,
readable like the IR listing::

    def program(flat_inputs):
        if len(flat_inputs) != 2: _arity(flat_inputs)
        v0, v1 = flat_inputs
        v2 = f0(v0, v1)  # 0: add
        v3 = f1(v2, **a1)  # 1: sum
        del v2
        return [v3]

Mutations (:attr:`IR.mutations`) are *not* applied here: the executor returns
the values of ``ir.outputs`` and the caller writes them back. An input or
constant returned as an output comes back as a copy, so a caller writing into
a result never changes its inputs or the program's constants.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from .errors import ExecutionError, TnError
from .ir import IR, Literal, Var

__all__ = ["compile_ir", "run_ir", "ExecutionError", "CompiledIR"]


def _eqn_line(ir: IR, index: int) -> str:
    """The listing line of equation ``index`` (names as in ``str(ir)``)."""
    lines = ir.pretty(show_source=True).splitlines()
    # Line 0 is the header; equation k is line k + 1.
    if 0 <= index < len(ir.eqns) and index + 1 < len(lines):
        return lines[index + 1].strip()
    return repr(ir.eqns[index]) if 0 <= index < len(ir.eqns) else "?"


def _literal_source(value: Any, bind: Callable[[Any], str]) -> str:
    """Python source for a literal value: inline when ``repr`` round-trips, else a bound global."""
    if type(value) is bool or type(value) is int:
        return repr(value)
    if type(value) is float and math.isfinite(value):
        return repr(value)
    return bind(value)


class CompiledIR:
    """An IR prepared for repeated execution with torch reference ops.

    Call it with the flat list of input tensors (``ir.inputs`` order); it
    returns the list of output values (``ir.outputs`` order).

    Attributes:
        ir: the program.
        source: the generated Python code (one line per equation).
    """

    __slots__ = ("ir", "source", "_fn", "_line_to_eqn", "_nin")

    def __init__(self, ir: IR):
        self.ir = ir
        self._nin = len(ir.inputs)
        names: Dict[Var, str] = {}
        glb: Dict[str, Any] = {"_arity": self._arity_error, "_clone": torch.Tensor.clone,
                               "_tensor": torch.tensor}
        counter = [0]

        def bind(value: Any, prefix: str = "g") -> str:
            name = f"{prefix}{counter[0]}"
            counter[0] += 1
            glb[name] = value
            return name

        def define(v: Var) -> str:
            name = f"v{len(names)}"
            names[v] = name
            return name

        def use(a: Any, where: str) -> str:
            if isinstance(a, Literal):
                return _literal_source(a.value, bind)
            name = names.get(a)
            if name is None:
                raise ExecutionError(
                    f"reference executor: {where} uses {a!r}, which no constant, input or "
                    f"earlier equation defines; the IR is malformed (run tn.passes.verify(ir) to locate it)")
            return name

        bound = set()  # names of constants and inputs (returned as copies)
        for v, t in ir.consts:
            name = define(v)
            glb[name] = t
            bound.add(name)
        in_names = [define(v) for v in ir.inputs]
        bound.update(in_names)

        lines = ["def program(flat_inputs):",
                 f"    if len(flat_inputs) != {self._nin}: _arity(flat_inputs)"]
        if in_names:
            lines.append(f"    {', '.join(in_names)}{',' if len(in_names) == 1 else ''} = flat_inputs")

        # Last use of every equation-defined variable, to delete it right after.
        out_vars = {a for a in ir.outputs if isinstance(a, Var)}
        last_use: Dict[Var, int] = {}
        for k, e in enumerate(ir.eqns):
            for a in e.inputs:
                if isinstance(a, Var):
                    last_use[a] = k
        line_to_eqn: Dict[int, int] = {}
        frees: Dict[int, List[Var]] = {}
        for k, e in enumerate(ir.eqns):
            for v in e.outputs:
                if v not in out_vars:
                    frees.setdefault(last_use.get(v, k), []).append(v)

        for k, e in enumerate(ir.eqns):
            impl = getattr(e.op, "impl", None)
            if impl is None:
                raise ExecutionError(
                    f"reference executor: equation {k} ({e.op.name}) has no reference implementation; "
                    f"give the op an impl in tn.ops")
            args = [use(a, f"equation {k} ({e.op.name})") for a in e.inputs]
            if e.attrs:
                args.append(f"**{bind(e.attrs, 'a')}")
            outs = [define(v) for v in e.outputs]
            target = outs[0] if len(outs) == 1 else ", ".join(outs) + ("," if len(outs) == 1 else "")
            if not outs:
                target = "_"
            line_to_eqn[len(lines) + 1] = k
            lines.append(f"    {target} = {bind(impl, 'f')}({', '.join(args)})  # {k}: {e.op.name}")
            dead = [names[v] for v in frees.get(k, ())]
            if dead:
                lines.append(f"    del {', '.join(dead)}")

        results = []
        for a in ir.outputs:
            if isinstance(a, Literal):  # a constant result: a fresh 0-d tensor per call
                results.append(f"_tensor({_literal_source(a.value, bind)}, dtype={bind(a.dtype, 'd')})")
                continue
            name = use(a, "program output")
            results.append(f"_clone({name})" if name in bound else name)
        lines.append(f"    return [{', '.join(results)}]")
        self.source = "\n".join(lines) + "\n"
        self._line_to_eqn = line_to_eqn
        code = compile(self.source, f"<tn.reference program {id(self):x}>", "exec")
        exec(code, glb)
        self._fn = glb["program"]

    def _arity_error(self, flat_inputs: Sequence[Any]) -> None:
        raise ExecutionError(
            f"reference executor: the program takes {self._nin} input tensors, got {len(flat_inputs)}; "
            f"pass the flattened inputs in ir.inputs order")

    def _failed_eqn(self, exc: BaseException) -> Optional[int]:
        """Index of the equation whose line of generated code raised ``exc``."""
        tb = exc.__traceback__
        code = self._fn.__code__
        k = None
        while tb is not None:
            if tb.tb_frame.f_code is code:
                k = self._line_to_eqn.get(tb.tb_lineno, k)
            tb = tb.tb_next
        return k

    def __call__(self, flat_inputs: Sequence[Any]) -> List[Any]:
        """Run the program on ``flat_inputs``; return the outputs as a list."""
        try:
            return self._fn(flat_inputs)
        except TnError:
            raise
        except Exception as e:  # any failure inside an impl: name the equation
            k = self._failed_eqn(e)
            if k is None:
                raise ExecutionError(f"reference executor: the program failed with {type(e).__name__}: {e}") from e
            raise ExecutionError(
                f"reference executor: equation {k} `{_eqn_line(self.ir, k)}` failed with "
                f"{type(e).__name__}: {e}") from e


def compile_ir(ir: IR) -> Callable[[Sequence[Any]], List[Any]]:
    """Prepare ``ir`` for execution; returns ``callable(flat_inputs) -> outputs``.

    This is the ``compile_fn`` of the ``"reference"`` jit backend.
    """
    return CompiledIR(ir)


def run_ir(ir: IR, flat_inputs: Sequence[Any]) -> List[Any]:
    """Execute ``ir`` on ``flat_inputs`` with torch reference ops.

    Returns the values of ``ir.outputs`` in order (user outputs first, then the
    new values of mutated inputs); mutations are not written back here.
    """
    return CompiledIR(ir)(flat_inputs)
