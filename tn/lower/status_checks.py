# Error checks of torch.linalg (linalg_check) as a status read after the program, not a host op inside it.
"""``linalg_check`` equations read back as a status, after the program.

A ``torch.linalg.*`` call traces as its factorization (native core ops, :mod:`tn.ops.linalg`)
followed by ``linalg_check(info)``, which raises eager's ``LinAlgError`` when LAPACK's status
``info`` is nonzero. Lowered in place, the check is a host op: it splits the program in two and
counts as a host fallback, although the host only reads a few int32 status values (what a CUDA
program does when it syncs on ``info``). Here the checks leave the IR before it is compiled: their
``info`` values become extra outputs of the program, and the executable raises after the run,
checking in program order, before it hands back any result. Mutations of the inputs are written
back by the door after the call returns, so a raising check leaves them unwritten, as eager (which
stops at the failing call) would.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch

from ..ir import IR, Var
from ..ops import OPS
from .base import ExecutableWrapper

__all__ = ["hoist_checks", "CheckedExecutable"]


def hoist_checks(ir: IR) -> Tuple[IR, List[Tuple[int, Dict[str, Any]]]]:
    """``ir`` without its ``linalg_check`` equations, whose ``info`` inputs are appended to the outputs,
    and the checks as ``(output index, attrs)`` in program order. Returns ``ir`` itself when it has none
    (or when a check's status is not a variable)."""
    checks = [e for e in ir.eqns if e.op.name == "linalg_check"]
    if not checks or not all(isinstance(e.inputs[0], Var) for e in checks):
        return ir, []
    outputs = list(ir.outputs)
    found: List[Tuple[int, Dict[str, Any]]] = []
    for e in checks:
        found.append((len(outputs), dict(e.attrs)))
        outputs.append(e.inputs[0])
    eqns = [e for e in ir.eqns if e.op.name != "linalg_check"]
    return IR(ir.inputs, eqns, outputs, consts=ir.consts, mutations=ir.mutations, name=ir.name), found


class CheckedExecutable(ExecutableWrapper):
    """Runs the executable of an IR rewritten by :func:`hoist_checks`, raises eager's error for the first
    check (in program order) whose status is nonzero, and otherwise returns the original outputs. Every
    other attribute is the wrapped executable's (``stats``, ``last_profile``, ``schedule``...), read and
    written."""

    def __init__(self, exe: Any, n_outputs: int, checks: Sequence[Tuple[int, Dict[str, Any]]]):
        self.exe = exe
        self.n_outputs = n_outputs
        self.checks = tuple(checks)

    def __call__(self, tensors: Sequence[torch.Tensor]) -> List[Any]:
        """Run on the flat inputs; raise a failed check's error, else return the IR's outputs."""
        out = list(self.exe(tensors))
        for index, attrs in self.checks:
            OPS["linalg_check"].impl(out[index], **attrs)
        return out[:self.n_outputs]

    _OWN = ("exe", "n_outputs", "checks")

    def __repr__(self) -> str:
        return f"<CheckedExecutable ({len(self.checks)} status checks) of {self.exe!r}>"

