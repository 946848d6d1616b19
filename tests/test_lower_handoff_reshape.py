# Tests of the SBUF hand-off through a reshape (tn/lower/schedule.py _plan_handoff, tn/lower/emit.py pass_reshape):
# a Linear's [1, S, F] output reshaped to the next Linear's [S, F] rows stays in SBUF.
import pytest
import torch

pytest.importorskip("tn.lower.schedule")
import tn  # noqa: E402
import tn.passes  # noqa: E402
from tn.lower.compiler import compile_ir  # noqa: E402


def _ffn(x, w1, b1, w2):
    """BERT's FFN pattern: the first Linear's output is [1, S, F] (gelu), the second reads it as [S, F] rows
    after its own weight's scaled cast (which ends the first matmul's epilogue before the reshape; a plain cast of
    a program input would not: tn.lower.schedule.hoist_past_weight_casts moves the reshape before it)."""
    h = torch.nn.functional.gelu((x.reshape(64, 96) @ w1 + b1).reshape(1, 64, 384))
    w2b = (w2 * 2).to(torch.bfloat16)
    return h.reshape(64, 384) @ w2b


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, 96, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(96, 384, generator=g) / 10).to(torch.bfloat16)
    b1 = torch.randn(384, generator=g).to(torch.bfloat16)
    w2 = torch.randn(384, 96, generator=g) / 10
    return x, w1, b1, w2


def test_reshape_passes_the_sbuf_tile_on():
    """The reshape between the two Linears is a hand-off consumer and producer: the intermediate [1, 64, 384]
    is never written to HBM nor read back, and the result agrees with torch."""
    args = _inputs()
    exe = compile_ir(tn.passes.optimize(tn.make_ir(_ffn)(*args)), strict=True)
    sched = exe.schedule
    reshapes = [k for k, e in enumerate(exe.ir.eqns) if e.op.name == "reshape" and e.outputs[0] in sched.handoff]
    assert len(reshapes) == 1
    k = reshapes[0]
    src = exe.ir.eqns[k].inputs[0]
    assert sched.handoff[exe.ir.eqns[k].outputs[0]][0] == k and k in sched.handoff[src][1]
    (got,) = exe(list(args))
    torch.testing.assert_close(got.float(), _ffn(*args).float(), rtol=3e-2, atol=3e-2)
    (run,) = exe.last_profile.runs
    x, w1, b1, w2 = args
    # written: the result and w2's bf16 cast (a convert of its own), not the [64, 384] intermediate
    assert run.hbm_write_bytes == 64 * 96 * 2 + w2.numel() * 2
    assert run.hbm_read_bytes == (x.numel() + w1.numel() + b1.numel()) * 2 + w2.numel() * (4 + 2)


def test_reshape_hand_off_needs_its_result_handed_off_too():
    """When the reshape's result is a program output it cannot stay in SBUF: neither value is handed off
    through the reshape (the first Linear's output goes to HBM as before) and the answers still agree."""
    def f(x, w1, b1, w2):
        h = torch.nn.functional.gelu((x.reshape(64, 96) @ w1 + b1).reshape(1, 64, 384))
        w2b = w2.to(torch.bfloat16)
        r = h.reshape(64, 384)
        return r @ w2b, r

    args = _inputs()
    exe = compile_ir(tn.passes.optimize(tn.make_ir(f)(*args)), strict=True)
    assert not any(e.op.name == "reshape" and (e.outputs[0] in exe.schedule.handoff or
                                               e.inputs[0] in exe.schedule.handoff) for e in exe.ir.eqns)
    got = exe(list(args))
    for g, w in zip(got, f(*args)):
        torch.testing.assert_close(g.float(), w.float(), rtol=3e-2, atol=3e-2)
