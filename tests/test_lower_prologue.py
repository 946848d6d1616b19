# Tests of matmul prologues (tn.lower.prologue): LayerNorm's gamma/beta applied in the evacuation of the next Linear's input transposes, against torch.
import pytest
import torch

import tn  # noqa: F401
import tn.lower  # noqa: F401
import tn.passes
from tn.lower import layout, prologue
from tn.lower.compiler import compile_ir

TOL = {torch.float32: dict(rtol=2e-4, atol=2e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def _ir(f, *args):
    """The optimized IR of ``f(*args)``."""
    return tn.passes.optimize(tn.make_ir(f)(*args))


def _run(ir, flat, calls=2):
    """Compile ``ir`` (strict) and call it ``calls`` times (plain, then laid-out weights); returns (exe, outputs)."""
    exe = compile_ir(ir, strict=True)
    layout.clear()
    outs = [exe(flat) for _ in range(calls)]
    return exe, outs


def _without_prologues(ir, flat, calls=2):
    """Outputs of ``ir`` compiled with no prologue planned (the equations lowered as before)."""
    orig = prologue.plan
    prologue.plan = lambda *a, **k: {}
    try:
        return _run(ir, flat, calls)[1]
    finally:
        prologue.plan = orig


def _seed_affine(ln):
    """Non-trivial gamma/beta (the defaults 1/0 would hide a missing scale or shift)."""
    with torch.no_grad():
        if ln.weight is not None:
            ln.weight.normal_()
        if getattr(ln, "bias", None) is not None:
            ln.bias.normal_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("affine,ln_bias", [(True, True), (True, False), (False, False)], ids=["affine", "no_bias", "plain"])
@pytest.mark.parametrize("rows,d,n", [(128, 768, 512), (37, 130, 70)])
def test_layernorm_into_linear(rows, d, n, affine, ln_bias, dtype):
    """LayerNorm (with/without elementwise_affine, bias=False) -> Linear: torch's results, bit-identical to the
    unfused lowering; the prologue is planned exactly when there is a scale or shift to absorb."""
    torch.manual_seed(rows + d)
    ln = torch.nn.LayerNorm(d, elementwise_affine=affine, bias=ln_bias).to(dtype)
    _seed_affine(ln)
    lin = torch.nn.Linear(d, n).to(dtype)
    x = torch.randn(rows, d).to(dtype)

    def f(ln, lin, x):
        return lin(ln(x))

    ir = _ir(f, ln, lin, x)
    pros = prologue.plan(ir, {})
    assert len(pros) == (1 if affine else 0)
    flat = [p for p in ln.parameters()] + [lin.weight, lin.bias, x]
    exe, outs = _run(ir, flat)
    with torch.no_grad():
        want = f(ln, lin, x)
    for (got,) in outs:
        torch.testing.assert_close(got, want, **TOL[dtype])
    for (got,), (ref,) in zip(outs, _without_prologues(ir, flat)):
        assert torch.equal(got, ref)
    assert exe.stats["host_ops"] == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layernorm_into_linear_without_bias(dtype):
    """The Linear has no bias (plain matmul lowering, no epilogue)."""
    torch.manual_seed(1)
    ln = torch.nn.LayerNorm(256).to(dtype)
    _seed_affine(ln)
    lin = torch.nn.Linear(256, 384, bias=False).to(dtype)
    x = torch.randn(2, 40, 256).to(dtype)

    def f(ln, lin, x):
        return lin(ln(x))

    ir = _ir(f, ln, lin, x)
    assert len(prologue.plan(ir, {})) == 1
    flat = [ln.weight, ln.bias, lin.weight, x]
    _, outs = _run(ir, flat)
    with torch.no_grad():
        want = f(ln, lin, x)
    for (got,), (ref,) in zip(outs, _without_prologues(ir, flat)):
        torch.testing.assert_close(got, want, **TOL[dtype])
        assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layernorm_output_also_used_elsewhere_is_not_absorbed(dtype):
    """The normalised value feeds the Linear and a residual: it must be materialised, so no prologue."""
    torch.manual_seed(2)
    ln = torch.nn.LayerNorm(192).to(dtype)
    _seed_affine(ln)
    lin = torch.nn.Linear(192, 192).to(dtype)
    x = torch.randn(64, 192).to(dtype)

    def f(ln, lin, x):
        h = ln(x)
        return h + lin(h)

    ir = _ir(f, ln, lin, x)
    assert prologue.plan(ir, {}) == {}
    flat = [ln.weight, ln.bias, lin.weight, lin.bias, x]
    _, outs = _run(ir, flat)
    with torch.no_grad():
        want = f(ln, lin, x)
    for (got,) in outs:
        torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layernorm_into_mlp_chain(dtype):
    """LayerNorm -> Linear -> GELU -> Linear (+ residual): the Linear chain applies the prologue."""
    torch.manual_seed(3)
    d = 256
    ln = torch.nn.LayerNorm(d).to(dtype)
    _seed_affine(ln)
    fc = torch.nn.Linear(d, 4 * d).to(dtype)
    out = torch.nn.Linear(4 * d, d).to(dtype)
    x = torch.randn(1, 100, d).to(dtype)

    def f(ln, fc, out, x):
        return x + out(torch.nn.functional.gelu(fc(ln(x)), approximate="tanh"))

    ir = _ir(f, ln, fc, out, x)
    assert len(prologue.plan(ir, {})) == 1
    flat = [ln.weight, ln.bias, fc.weight, fc.bias, out.weight, out.bias, x]
    _, outs = _run(ir, flat, calls=3)
    with torch.no_grad():
        want = f(ln, fc, out, x)
    for (got,), (ref,) in zip(outs, _without_prologues(ir, flat, calls=3)):
        torch.testing.assert_close(got, want, **TOL[dtype])
        assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpt2_block_prologues(dtype):
    """Both LayerNorms of a GPT-2 block become prologues (of the qkv matmul and of the MLP chain); the results
    are the unfused lowering's, bit for bit, with random gamma/beta."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    from models import GPT2Block

    torch.manual_seed(0)
    m = GPT2Block(d=192, heads=3).eval().to(dtype)
    _seed_affine(m.ln1)
    _seed_affine(m.ln2)
    x = torch.randn(1, 64, 192).to(dtype)
    ir = tn.jit(m, backend="neuron").lower(x)
    assert len(prologue.plan(ir, {})) == 2
    flat = [p.detach() for p in m.parameters()] + [x]
    _, outs = _run(ir, flat, calls=3)
    with torch.no_grad():
        want = m(x)
    for (got,), (ref,) in zip(outs, _without_prologues(ir, flat, calls=3)):
        torch.testing.assert_close(got, want, **TOL[dtype])
        assert torch.equal(got, ref)


def test_many_rows_bf16_keeps_the_norm():
    """bf16 with more than 128 rows: fp32 transposes would cost TensorE time, so no prologue is planned."""
    ln = torch.nn.LayerNorm(128).to(torch.bfloat16)
    lin = torch.nn.Linear(128, 64).to(torch.bfloat16)
    x = torch.randn(300, 128).to(torch.bfloat16)
    ir = _ir(lambda ln, lin, x: lin(ln(x)), ln, lin, x)
    assert prologue.plan(ir, {}) == {}


def test_many_rows_fp32():
    """fp32 with several row tiles (source in HBM, no hand-off): a prologue, torch's results."""
    torch.manual_seed(4)
    ln = torch.nn.LayerNorm(200)
    _seed_affine(ln)
    lin = torch.nn.Linear(200, 96)
    x = torch.randn(300, 200)

    def f(ln, lin, x):
        return lin(ln(x))

    ir = _ir(f, ln, lin, x)
    assert len(prologue.plan(ir, {})) == 1
    flat = [ln.weight, ln.bias, lin.weight, lin.bias, x]
    _, outs = _run(ir, flat)
    with torch.no_grad():
        want = f(ln, lin, x)
    for (got,), (ref,) in zip(outs, _without_prologues(ir, flat)):
        torch.testing.assert_close(got, want, **TOL[torch.float32])
        assert torch.equal(got, ref)


def test_scale_and_shift_by_numbers_and_training_variant():
    """``(y * 0.5 + bias_vec) @ W^T`` with weights that change between calls (the plain variant, weights
    transposed on chip): numbers as immediates."""
    torch.manual_seed(5)
    w = torch.randn(96, 160)
    b = torch.randn(160)
    x = torch.randn(50, 160)

    def f(x, b, w):
        return (torch.relu(x) * 0.5 + b) @ w.t()

    ir = _ir(f, x, b, w)
    assert len(prologue.plan(ir, {})) == 1
    exe = compile_ir(ir, strict=True)
    for i in range(3):
        w2 = w + i
        (got,) = exe([x, b, w2])
        torch.testing.assert_close(got, f(x, b, w2), **TOL[torch.float32])
