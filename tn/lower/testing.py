# Test helper for lowerings: compile one equation for the NeuronCore in strict mode, run it, compare with the op's torch impl.
"""``check_lowering``: the one-line unit test of a lowering.

::

    from tn.lower.testing import check_lowering
    res = check_lowering("add", torch.randn(300, 70), 2.5)        # Literal second operand
    res = check_lowering("sum", torch.randn(4, 9), dims=(1,), keepdim=False)
    res.hbm_read_bytes, res.total_us                                 # the RunResult of the program
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .. import ops
from ..ir import IR, Eqn, Literal, Var
from .compiler import compile_ir

__all__ = ["check_lowering", "build_eqn_ir", "TOLERANCES", "assert_close", "run_with_hbm_bytes"]

#: Default (rtol, atol) per result dtype.
TOLERANCES = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


def run_with_hbm_bytes(exe: Any, args: Any) -> Any:
    """One run of the executable ``exe`` on ``args``: ``(its outputs, (HBM bytes read, HBM bytes written))``
    summed over the programs of that run (``exe.last_profile``)."""
    out = exe(args)
    runs = exe.last_profile.runs
    return out, (sum(r.hbm_read_bytes for r in runs), sum(r.hbm_write_bytes for r in runs))


def build_eqn_ir(op_name: str, *inputs: Any, **attrs: Any) -> IR:
    """A one-equation IR ``op_name[attrs](*inputs)``: tensors become IR inputs, Python scalars Literals."""
    op = ops.get(op_name)
    ins = []
    args = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            v = Var(tuple(x.shape), x.dtype)
            ins.append(v)
            args.append(v)
        else:
            args.append(Literal(x))
    outs = [Var(s, d) for s, d in op.shape_rule(*args, **attrs)]
    return IR(ins, [Eqn(op, args, outs, attrs)], outs)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: Optional[float] = None,
                 atol: Optional[float] = None, what: str = "result") -> None:
    """Compare with per-dtype tolerances (exact for integer/bool); AssertionError with details otherwise."""
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: dtype {actual.dtype} differs from the reference's {expected.dtype}")
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} differs from the reference's "
                             f"{tuple(expected.shape)}")
    if expected.dtype.is_floating_point:
        r, a = TOLERANCES.get(expected.dtype, (1e-4, 1e-5))
        rtol = r if rtol is None else rtol
        atol = a if atol is None else atol
    else:
        rtol, atol = 0.0, 0.0
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as e:
        raise AssertionError(f"{what}: NeuronCore result differs from the torch reference "
                             f"(rtol={rtol}, atol={atol}):\n{e}") from None


def check_lowering(op_name: str, *inputs: Any, rtol: Optional[float] = None, atol: Optional[float] = None,
                   arch: Any = None, **attrs: Any):
    """Lower ``op_name[attrs](*inputs)`` alone in strict mode, run it, compare with ``op.impl``.

    ``inputs``: CPU tensors (program inputs) or Python scalars (Literals).
    Raises :class:`tn.UnsupportedOpError` if the op falls back to the host,
    AssertionError (with details) if results differ beyond the per-dtype
    tolerances (:data:`TOLERANCES`; exact for integers/bools). Returns the
    :class:`tn.neuron.RunResult` of the program (or the merged
    :class:`tn.lower.ExecProfile` if the equation needed several programs).
    """
    ir = build_eqn_ir(op_name, *inputs, **attrs)
    exe = compile_ir(ir, arch=arch, strict=True, debug=True)
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    got = exe([t.clone() for t in tensors])
    want = ops.get(op_name).impl(*inputs, **attrs)
    if isinstance(want, torch.Tensor):
        want = [want]
    want = list(want)
    if len(got) != len(want):
        raise AssertionError(f"{op_name}: {len(got)} outputs, the reference has {len(want)}")
    for j, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, rtol, atol, what=f"{op_name} output {j}")
    prof = exe.last_profile
    return prof.runs[0] if len(prof.runs) == 1 else prof
