# Tests of the compiler framework (tn/lower/compiler.py, fusion.py, base.py): programs, host fallback, strict mode, jit.
import os

import pytest
import torch

import tn
import tn.lower  # noqa: F401  (registers the lowerings and the neuron backend)
from tn.ir import IR, Eqn, Literal, Var
from tn.lower import CannotLower, compile_ir
from tn.lower.base import LowerCtx, lowering, neuron_dtype
from tn.lower.testing import assert_close, build_eqn_ir, check_lowering
from tn import ops


def _ir(op, ins, outs, **attrs):
    return Eqn(ops.get(op), ins, outs, attrs)


def _chain_ir(n=64, d=96):
    """x -> exp(x) * 2 -> + y -> tanh, plus an intermediate that is also returned."""
    x, y = Var((n, d), torch.float32), Var((n, d), torch.float32)
    a, b, c, e = (Var((n, d), torch.float32) for _ in range(4))
    eqns = [_ir("exp", [x], [a]), _ir("mul", [a, Literal(2.0)], [b]), _ir("add", [b, y], [c]),
            _ir("tanh", [c], [e])]
    return IR([x, y], eqns, [e, b])


def test_neuron_dtype_mapping():
    assert neuron_dtype(torch.bfloat16) == "bfloat16"
    assert neuron_dtype(torch.bool) == "bool"
    with pytest.raises(CannotLower, match="float64"):
        neuron_dtype(torch.float64)
    with pytest.raises(CannotLower):
        LowerCtx.neuron_dtype(torch.complex64)


def test_lowering_decorator_rejects_unknown_op():
    with pytest.raises(tn.TnError, match="no op named"):
        lowering("definitely_not_an_op")


def test_multi_output_literals_and_fusion_cut_hbm_traffic():
    ir = _chain_ir()
    x, y = torch.randn(64, 96), torch.randn(64, 96)
    want = [torch.tanh(torch.exp(x) * 2 + y), torch.exp(x) * 2]
    fused = compile_ir(ir, strict=True)
    unfused = compile_ir(ir, strict=True, fuse=False)
    for exe in (fused, unfused):
        got = exe([x, y])
        for g, w in zip(got, want):
            assert_close(g, w)
        assert exe.stats["programs"] == 1 and exe.stats["host_ops"] == {}
    assert fused.stats["fused_eqns"] == 4
    pf, pu = fused.last_profile, unfused.last_profile
    # fused: read x, y once, write the two outputs once; unfused: every intermediate goes through HBM
    nbytes = 64 * 96 * 4
    assert pf.hbm_read_bytes == 2 * nbytes and pf.hbm_write_bytes == 2 * nbytes
    assert pu.hbm_bytes > pf.hbm_bytes
    assert pf.instructions < pu.instructions


def test_host_fallback_is_counted_and_strict_mode_raises(monkeypatch):
    x = Var((8, 5), torch.float32)
    a, b, c = (Var((8, 5), torch.float32) for _ in range(3))
    ir = IR([x], [_ir("mul", [x, Literal(0.5)], [a]), _ir("erfinv", [a], [b]), _ir("exp", [b], [c])], [c])
    xv = torch.rand(8, 5) - 0.5
    exe = compile_ir(ir, strict=False)
    assert exe.stats["host_ops"] == {"erfinv": 1}
    assert "erfinv" in exe.stats["host_reasons"]
    assert exe.stats["programs"] == 2
    (got,) = exe([xv])
    assert_close(got, torch.exp(torch.erfinv(xv * 0.5)))
    assert exe.last_profile.host_ops == {"erfinv": 1}
    assert len(exe.last_profile.runs) == 2
    with pytest.raises(tn.UnsupportedOpError, match=r"erfinv.*f32\[8,5\]"):
        compile_ir(ir, strict=True)
    monkeypatch.setenv("TN_STRICT", "1")
    with pytest.raises(tn.UnsupportedOpError, match="TN_STRICT"):
        compile_ir(ir)


def test_lowering_that_raises_after_emitting_is_retried_on_host():
    """A CannotLower raised mid-emission: the compiler rebuilds the program without that equation."""
    calls = []
    op = ops.get("sign")
    saved = op.lowering

    def bad(ctx, eqn, ins, outs):
        t = ctx.prog.sbuf((1, 4), "float32")
        ctx.prog.memset(t, 1.0)
        calls.append(1)
        raise CannotLower("test: gave up late")

    op.lowering = bad
    try:
        x = Var((4,), torch.float32)
        a, b = Var((4,), torch.float32), Var((4,), torch.float32)
        ir = IR([x], [_ir("sign", [x], [a]), _ir("neg", [a], [b])], [b])
        exe = compile_ir(ir, fuse=False)
        assert exe.stats["host_ops"] == {"sign": 1}
        assert exe.stats["host_reasons"]["sign"].startswith("test: gave up late")
        xv = torch.tensor([-2.0, 0.0, 3.0, -0.5])
        assert_close(exe([xv])[0], -torch.sign(xv))
    finally:
        op.lowering = saved


def test_consts_literal_outputs_and_passthrough():
    x = Var((3, 4), torch.float32)
    k = Var((4,), torch.float32)
    a = Var((3, 4), torch.float32)
    kv = torch.tensor([1.0, -2.0, 3.0, 0.5])
    ir = IR([x], [_ir("mul", [x, k], [a])], [a, x, Literal(7)], consts=[(k, kv)])
    exe = compile_ir(ir, strict=True)
    xv = torch.randn(3, 4)
    got = exe([xv])
    assert_close(got[0], xv * kv)
    assert got[1] is xv
    assert got[2].item() == 7
    # runs again with new data (bindings are per call)
    xv2 = torch.randn(3, 4)
    assert_close(exe([xv2])[0], xv2 * kv)


def test_scalar_vars_and_noncontiguous_inputs():
    x = Var((), torch.float32)
    y = Var((5, 3), torch.float32)
    a = Var((5, 3), torch.float32)
    ir = IR([x, y], [_ir("add", [y, x], [a])], [a])
    exe = compile_ir(ir, strict=True)
    yv = torch.randn(3, 5).t()      # not contiguous
    xv = torch.tensor(2.5)
    assert_close(exe([xv, yv])[0], yv + xv)


def test_profile_reports_every_program():
    exe = compile_ir(_chain_ir(), strict=True)
    with tn.profile() as prof:
        exe([torch.randn(64, 96), torch.randn(64, 96)])
    assert len(prof.runs) == 1
    assert prof.runs[0].total_ns > 0
    s = exe.last_profile.summary()
    assert s["programs"] == 1 and s["time_us"] > 0 and s["hbm_read"] > 0 and s["instructions"] > 0


# ------------------------------------------------------------------ through tn.jit

def _jit_neuron(fn):
    return tn.jit(fn, backend="neuron")


def test_jit_backend_registered():
    assert "neuron" in tn.jit.backends()


def test_jit_softmax_matches_eager():
    def f(x):
        return torch.softmax(x, dim=-1)

    x = torch.randn(200, 77)
    with tn.profile() as prof:
        got = _jit_neuron(f)(x)
    assert_close(got, f(x))
    assert prof.runs, "the neuron backend ran no NeuronCore program"


def test_jit_mlp_matches_eager():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    x = torch.randn(40, 32)
    with torch.no_grad():
        want = mlp(x)
        with tn.profile() as prof:
            got = tn.jit(mlp, backend="neuron")(x)
    assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert prof.runs


def test_jit_mutation_written_back_and_multi_output():
    def f(x, y):
        x.mul_(2)
        return x + y, y * 3

    x, y = torch.randn(6, 7), torch.randn(6, 7)
    x0 = x.clone()
    a, b = _jit_neuron(f)(x, y)
    assert_close(x, x0 * 2)
    assert_close(a, x0 * 2 + y)
    assert_close(b, y * 3)


def test_jit_bf16_chain():
    def f(x):
        return torch.nn.functional.silu(x) * x + 1

    x = torch.randn(130, 64, dtype=torch.bfloat16)
    assert_close(_jit_neuron(f)(x), f(x))
