# The oracle executor: runs an IR equation by equation with each op's torch reference implementation.
"""Reference executor for :class:`tn.ir.IR`.

Every op in :mod:`tn.ops` carries ``impl(*inputs, **attrs)``, a torch
implementation. This module runs a whole program with those implementations.
It is the test oracle for the NeuronCore compiler and, until that compiler
exists, the default backend of :func:`tn.jit`.

:func:`compile_ir` turns an IR once into a flat list of steps
``(impl, input slots, attrs, output slots)`` over one list of value slots, so
running a program costs one Python call per equation and nothing else.
Constants and :class:`~tn.ir.Literal` inputs are bound into their slots at
compile time. Intermediate values are dropped after their last use.

Mutations (:attr:`IR.mutations`) are *not* applied here: the executor returns
the values of ``ir.outputs`` and the caller writes them back.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from .errors import TnError
from .ir import IR, Literal, Var

__all__ = ["compile_ir", "run_ir", "ExecutionError", "CompiledIR"]


class ExecutionError(TnError):
    """An equation's reference implementation failed while running a program.

    The message names the equation (its index and listing line) and the
    underlying error; the original exception is chained as ``__cause__``.
    """


def _eqn_line(ir: IR, index: int) -> str:
    """The listing line of equation ``index`` (names as in ``str(ir)``)."""
    lines = ir.pretty(show_source=True).splitlines()
    # Line 0 is the header; equation k is line k + 1.
    if 0 <= index < len(ir.eqns) and index + 1 < len(lines):
        return lines[index + 1].strip()
    return repr(ir.eqns[index]) if 0 <= index < len(ir.eqns) else "?"


class CompiledIR:
    """An IR prepared for repeated execution with torch reference ops.

    Call it with the flat list of input tensors (``ir.inputs`` order); it
    returns the list of output values (``ir.outputs`` order).
    """

    __slots__ = ("ir", "_nslots", "_init", "_in_slots", "_steps", "_out", "_nin", "_lit_outs", "_copy_outs")

    def __init__(self, ir: IR):
        self.ir = ir
        slot_of: Dict[Var, int] = {}
        init: List[Tuple[int, Any]] = []  # (slot, value) bound before every run

        slot_of_list: List[Any] = []

        def define(v: Var) -> int:
            s = len(slot_of_list)
            slot_of_list.append(None)
            slot_of[v] = s
            return s

        literal_slot: Dict[Tuple[type, str, torch.dtype], int] = {}

        def use(a: Any, where: str) -> int:
            if isinstance(a, Literal):
                key = (type(a.value), repr(a.value), a.dtype)
                s = literal_slot.get(key)
                if s is None:
                    s = len(slot_of_list)
                    slot_of_list.append(None)
                    literal_slot[key] = s
                    init.append((s, a.value))
                return s
            s = slot_of.get(a)
            if s is None:
                raise ExecutionError(
                    f"reference executor: {where} uses {a!r}, which no constant, input or "
                    f"earlier equation defines; the IR is malformed (run tn.passes.verify(ir) to locate it)")
            return s

        for v, t in ir.consts:
            init.append((define(v), t))
        self._in_slots = tuple(define(v) for v in ir.inputs)
        self._nin = len(ir.inputs)
        n_bound = len(slot_of_list)  # slots below this hold constants and inputs

        raw_steps = []
        for k, eqn in enumerate(ir.eqns):
            impl = getattr(eqn.op, "impl", None)
            if impl is None:
                raise ExecutionError(
                    f"reference executor: equation {k} ({eqn.op.name}) has no reference implementation; "
                    f"give the op an impl in tn.ops")
            ins = tuple(use(a, f"equation {k} ({eqn.op.name})") for a in eqn.inputs)
            outs = tuple(define(v) for v in eqn.outputs)
            raw_steps.append((k, impl, ins, eqn.attrs, outs))
        out = []
        lit_outs = []
        copy_outs = []
        for j, a in enumerate(ir.outputs):
            if isinstance(a, Literal):  # a constant result: a fresh 0-d tensor per call
                lit_outs.append((j, a.value, a.dtype))
                out.append(0)
            else:
                s = use(a, "program output")
                out.append(s)
                if s < n_bound:  # an input or constant returned as is: hand out a copy
                    copy_outs.append(j)
        out = tuple(out)
        self._lit_outs = tuple(lit_outs)
        self._copy_outs = tuple(copy_outs)

        # Liveness: free each equation-defined slot right after its last use,
        # unless it is a program output. Inputs, constants and literals stay.
        keep = set(out)
        last_use: Dict[int, int] = {}
        defined_by_eqn = set()
        for k, _, ins, _, outs in raw_steps:
            for s in ins:
                last_use[s] = k
            defined_by_eqn.update(outs)
        frees: Dict[int, List[int]] = {}
        for s, k in last_use.items():
            if s in defined_by_eqn and s not in keep:
                frees.setdefault(k, []).append(s)
        # Outputs nobody uses (and that are not program outputs) are dropped at once.
        for k, _, ins, _, outs in raw_steps:
            for s in outs:
                if s not in last_use and s not in keep:
                    frees.setdefault(k, []).append(s)

        self._steps = tuple(
            (k, impl, ins, attrs, outs[0] if len(outs) == 1 else outs, len(outs) == 1,
             tuple(frees.get(k, ())))
            for k, impl, ins, attrs, outs in raw_steps
        )
        self._init = tuple(init)
        self._nslots = len(slot_of_list)
        self._out = out

    def __call__(self, flat_inputs: Sequence[Any]) -> List[Any]:
        """Run the program on ``flat_inputs``; return the outputs as a list."""
        if len(flat_inputs) != self._nin:
            raise ExecutionError(
                f"reference executor: the program takes {self._nin} input tensors, got {len(flat_inputs)}; "
                f"pass the flattened inputs in ir.inputs order")
        env: List[Any] = [None] * self._nslots
        for s, v in self._init:
            env[s] = v
        for s, v in zip(self._in_slots, flat_inputs):
            env[s] = v
        step = None
        try:
            for step in self._steps:
                _, impl, ins, attrs, outs, single, frees = step
                r = impl(*[env[i] for i in ins], **attrs)
                if single:
                    if type(r) is tuple or type(r) is list:
                        (r,) = r
                    env[outs] = r
                else:
                    for s, v in zip(outs, r, strict=True):
                        env[s] = v
                for s in frees:
                    env[s] = None
        except TnError:
            raise
        except Exception as e:  # any failure inside an impl: name the equation
            k = step[0] if step is not None else -1
            raise ExecutionError(
                f"reference executor: equation {k} `{_eqn_line(self.ir, k)}` failed with "
                f"{type(e).__name__}: {e}") from e
        result = [env[s] for s in self._out]
        for j, value, dtype in self._lit_outs:
            result[j] = torch.tensor(value, dtype=dtype)
        for j in self._copy_outs:
            result[j] = result[j].clone()
        return result


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
