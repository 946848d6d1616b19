# Tests of the compiler framework (tn/lower/compiler.py, schedule.py, fusion.py, base.py): programs, host fallback, strict mode, jit.

import pytest
import torch

import tn
import tn.lower  # noqa: F401  (registers the lowerings and the neuron backend)
from tn.ir import IR, Eqn, Literal, Var
from tn.lower import CannotLower, compile_ir
from tn.lower.base import LowerCtx, lowering, neuron_dtype
from tn.lower.testing import assert_close
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
    x = Var((8, 8), torch.float32)
    a, b, c = (Var((8, 8), torch.float32) for _ in range(3))
    mexp = torch.ops.aten.linalg_matrix_exp.default
    ir = IR([x], [_ir("mul", [x, Literal(0.5)], [a]), _ir("host", [a], [b], fn=mexp), _ir("exp", [b], [c])], [c])
    xv = torch.rand(8, 8) - 0.5
    exe = compile_ir(ir, strict=False)
    assert exe.stats["host_ops"] == {"host": 1}
    assert "host" in exe.stats["host_reasons"]
    assert exe.stats["programs"] == 2
    (got,) = exe([xv])
    assert_close(got, torch.exp(torch.linalg.matrix_exp(xv * 0.5)))
    assert exe.last_profile.host_ops == {"host": 1}
    assert len(exe.last_profile.runs) == 2
    with pytest.raises(tn.UnsupportedOpError, match=r"host.*f32\[8,8\]"):
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
    assert got[1] is not xv and torch.equal(got[1], xv)      # returned inputs come back as copies
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
    assert "total modelled time" in exe.last_profile.table(print_it=False)


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


# ------------------------------------------------------------------ fusion of row reductions and epilogues

def _both(fn, *xs, rtol=None, atol=None):
    """Compile fn's IR fused and unfused (strict), check both against eager, return the two profiles."""
    ir = tn.make_ir(fn)(*xs)
    want = fn(*xs)
    profs = []
    for fuse in (True, False):
        exe = compile_ir(ir, strict=True, fuse=fuse)
        got = exe(list(xs))[0]
        assert_close(got, want, rtol, atol)
        profs.append((exe.stats, exe.last_profile))
    return profs


def test_softmax_row_group_stays_in_sbuf():
    x = torch.randn(300, 200)
    (sf, pf), (su, pu) = _both(lambda x: torch.softmax(x, -1), x)
    assert sf["fused_eqns"] >= 5
    # fused: x read once, result written once
    assert pf.hbm_read_bytes == x.numel() * 4 and pf.hbm_write_bytes == x.numel() * 4
    assert pu.hbm_bytes > 3 * pf.hbm_bytes


def test_softmax_4d_bf16_and_keepdim_false_reduction():
    x = torch.randn(2, 3, 40, 24, dtype=torch.bfloat16)
    _both(lambda x: torch.softmax(x, -1), x)

    def f(x):
        s = x.sum(-1)
        return s * 0.5 + 1, (x - x.amax(-1, keepdim=True)).exp()

    x = torch.randn(130, 37)
    ir = tn.make_ir(f)(x)
    exe = compile_ir(ir, strict=True)
    got = exe([x])
    for g, w in zip(got, f(x)):
        assert_close(g, w)
    assert exe.stats["fused_eqns"] >= 4


def test_layer_norm_and_rms_norm_fuse():
    x, w, b = torch.randn(200, 96), torch.randn(96), torch.randn(96)
    (sf, pf), (_, pu) = _both(lambda x, w, b: torch.nn.functional.layer_norm(x, (96,), w, b), x, w, b,
                              rtol=1e-4, atol=1e-5)
    assert pf.hbm_bytes < pu.hbm_bytes / 2

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    (sf, pf), (_, pu) = _both(rms, x, w)
    assert sf["fused_eqns"] >= 6 and pf.hbm_bytes < pu.hbm_bytes


def test_matmul_epilogue_bias_gelu():
    x, w, b = torch.randn(256, 128), torch.randn(128, 384), torch.randn(384)

    def f(x, w, b):
        return torch.nn.functional.gelu(x @ w + b)

    (sf, pf), (_, pu) = _both(f, x, w, b, rtol=1e-4, atol=1e-4)
    assert sf["fused_eqns"] == 3
    # the matmul result never goes to HBM: saved one write and one read of the [256, 384] product at least
    assert pu.hbm_bytes - pf.hbm_bytes >= 2 * 256 * 384 * 4


def test_epilogue_output_also_used_later():
    x, w = torch.randn(64, 32), torch.randn(32, 48)

    def f(x, w):
        y = x @ w
        return torch.relu(y) + y * 2, y

    ir = tn.make_ir(f)(x, w)
    exe = compile_ir(ir, strict=True)
    got = exe([x, w])
    for g, v in zip(got, f(x, w)):
        assert_close(g, v, rtol=1e-4, atol=1e-4)


def test_attention_fused_matches():
    q, k, v = (torch.randn(2, 4, 64, 32) for _ in range(3))

    def attn(q, k, v):
        s = (q @ k.transpose(-1, -2)) * 32 ** -0.5
        mask = torch.ones(64, 64, dtype=torch.bool).tril()
        s = s.masked_fill(~mask, float("-inf"))
        return torch.softmax(s, -1) @ v

    ir = tn.make_ir(attn)(q, k, v)
    exe = compile_ir(ir)
    assert_close(exe([q, k, v])[0], attn(q, k, v), rtol=1e-4, atol=1e-5)
    assert exe.stats["fused_eqns"] >= 5


def test_long_rows_use_per_partition_scalars_and_fused_activation_reduce():
    """Rows >= 256: one row per partition, row statistics as [P, 1] operands, exp/square + sum on ScalarE."""
    x = torch.randn(260, 300)
    (sf, pf), _ = _both(lambda x: torch.softmax(x, -1), x)
    run = pf.runs[0]
    # no tensor_tensor for the row-broadcast ops and only the amax left as a VectorE reduce
    from tn.neuron import isa
    ops_used = {isa.OPCODE_NAMES[int(o)] for o in run.opcodes}
    assert "tensor_tensor" not in ops_used
    assert sum(1 for o in run.opcodes if int(o) == isa.OPCODES["tensor_reduce"]) == 3  # amax per row tile
    w, b = torch.randn(300), torch.randn(300)
    _both(lambda x, w, b: torch.nn.functional.layer_norm(x, (300,), w, b), x, w, b, rtol=1e-4, atol=1e-5)


def test_zero_size_tensors_are_folded_not_sent_to_the_chip():
    def f(x, y):
        return torch.exp(x) + 1, y.sum(0), y.t() @ torch.ones(0, 3), torch.softmax(x, -1)

    x, y = torch.randn(2, 0, 3), torch.randn(0, 4)
    ir = tn.make_ir(f)(x, y)
    exe = compile_ir(ir, strict=True)
    for g, w in zip(exe([x, y]), f(x, y)):
        assert_close(g, w)
    assert exe.stats["host_ops"] == {}


def test_linear_weight_permute_is_not_materialised():
    pytest.importorskip("tn.lower.matmul")
    from tn.lower import matmul

    if not hasattr(matmul, "lower_matmul_transposed"):
        pytest.skip("tn.lower.matmul has no lower_matmul_transposed yet")
    lin = torch.nn.Linear(256, 384)
    x = torch.randn(64, 256)
    with torch.no_grad():
        ir = tn.make_ir(lambda x: lin(x))(x)
        want = lin(x)
    assert "permute" in ir.op_counts()
    fused = compile_ir(ir, strict=True)
    plain = compile_ir(ir, strict=True, fuse=False)
    for exe in (fused, plain):
        assert_close(exe([x])[0], want, rtol=1e-4, atol=1e-4)
    # the weight is read once, never written back transposed
    wbytes = 256 * 384 * 4
    assert plain.last_profile.hbm_write_bytes - fused.last_profile.hbm_write_bytes >= wbytes
    assert fused.last_profile.hbm_read_bytes < plain.last_profile.hbm_read_bytes


def test_affine_folding_into_activations():
    def f(x):
        a = torch.relu(x * 1.5 + 0.25)          # one ScalarE activation
        b = torch.exp((2.0 - x) / 4.0)          # one ScalarE activation
        c = (x * 3.0) * x                       # x*3 feeds a tensor_tensor: computed on its own
        return a + b + c, torch.sigmoid(-x + 1)

    x = torch.randn(300, 50)
    ir = tn.make_ir(f)(x)
    exe = compile_ir(ir, strict=True)
    for g, w in zip(exe([x]), f(x)):
        assert_close(g, w)
    run = exe.last_profile.runs[0]
    from tn.neuron import isa
    n_act = sum(1 for o in run.opcodes if int(o) == isa.OPCODES["activation"])
    n_compute = sum(1 for o in run.opcodes if int(o) != isa.OPCODES["dma_copy"])
    tiles = sum(1 for o in run.opcodes if int(o) == isa.OPCODES["dma_copy"]) // 3   # 1 load + 2 stores per tile
    # relu, exp, sigmoid as activations; x*3, the product and the two adds: 7 compute ops per tile
    assert n_compute == 7 * tiles and n_act >= 3 * tiles


def test_unit_axis_reshapes_do_not_break_fusion():
    x, w, b = torch.randn(128, 64), torch.randn(64, 256), torch.randn(256)

    def f(x, w, b):
        y = (x @ w + b).reshape(1, 128, 256)          # a size-1 axis added: same bytes
        return torch.tanh(y * 0.5) * y

    ir = tn.make_ir(f)(x, w, b)
    assert "reshape" in ir.op_counts()
    exe = compile_ir(ir, strict=True)
    assert_close(exe([x, w, b])[0], f(x, w, b), rtol=1e-4, atol=1e-4)
    assert exe.stats["fused_eqns"] == len(ir.eqns)
    # only the final result is written
    assert exe.last_profile.hbm_write_bytes == 128 * 256 * 4


def test_inner_unit_axis_reshape_is_not_an_alias():
    """[5,5,5] -> [5,5,1,5] then broadcast against [5,5,5,5]: the values move, so no aliasing."""
    x = torch.randn(5, 5, 5)
    for fn in (lambda x: torch.cumprod(x, 1), lambda x: torch.diag_embed(x)):
        ir = tn.make_ir(fn)(x)
        exe = compile_ir(ir, strict=True)
        assert_close(exe([x])[0], fn(x))


def test_rows_too_long_for_sbuf_fall_back_to_unfused():
    """A softmax row that does not fit the group's SBUF budget: the group is not fused (values go via HBM)."""
    x = torch.randn(3, 70000)
    ir = tn.make_ir(lambda x: torch.softmax(x, -1))(x)
    exe = compile_ir(ir, strict=True)
    assert_close(exe([x])[0], torch.softmax(x, -1))
    assert exe.stats["host_ops"] == {}


def test_model_timing_matches_a_run_and_orders_gradients():
    """NeuronExecutable.model_timing: the modelled time of a run without values, when each input is read and
    each output (here the gradients of a 2-layer MLP, made last layer first) is complete."""
    from tn import passes
    from tn import trace as tn_trace

    torch.manual_seed(0)
    w1, b1, w2, b2 = (torch.randn(*s).requires_grad_(True) for s in ((128, 64), (128,), (32, 128), (32,)))
    x = torch.randn(256, 64)

    def step(x, w1, b1, w2, b2):
        y = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w1, b1)), w2, b2)
        loss = y.square().mean()
        return (loss,) + torch.autograd.grad(loss, (w1, b1, w2, b2))

    ir = passes.optimize(tn_trace.trace_flat(step, [x, w1, b1, w2, b2]).ir)
    exe = compile_ir(ir)
    timing = exe.model_timing()
    with tn.profile() as prof:
        exe([x] + [t.detach() for t in (w1, b1, w2, b2)])
    ran = sum(r.total_ns for r in prof.runs)
    assert timing.total_ns == pytest.approx(ran, rel=1e-9)
    assert timing.host_eqns == 0 and len(timing.runs) == len(prof.runs)
    loss_t, gw1, gb1, gw2, gb2 = timing.output_ready_ns
    assert 0 < loss_t < gw2 < gw1 <= timing.total_ns        # backward: the last layer's gradient comes first
    assert all(0 < t <= timing.total_ns for t in (gb1, gb2))
    reads = timing.input_reads_ns
    assert len(reads) == 5 and all(len(r) for r in reads)
    assert reads[0][0] == 0.0 and reads[3][0] < loss_t     # x at once; w2 by the forward
    assert all((r[:-1] <= r[1:]).all() for r in reads)


def test_model_timing_of_steady_weights_matches_the_laid_out_run():
    """A repeated call with the same Linear weights runs the laid-out variant (weights read from a cached layout);
    ``model_timing(steady_weights=True)`` times that variant and equals such a run, the default times the plain
    program (weights laid out on chip every call), which is slower."""
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)
    x = torch.randn(128, 256)

    def f(x, w1, b1, w2, b2):
        return torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w1, b1)), w2, b2)

    args = [x] + [p.detach() for p in (lin1.weight, lin1.bias, lin2.weight, lin2.bias)]
    exe = compile_ir(tn.make_ir(f)(*args))
    for _ in range(3):                           # the policy lays the weights out once they prove steady
        exe(args)
    with tn.profile() as prof:
        out = exe(args)
    torch.testing.assert_close(out[0], f(*args), rtol=1e-4, atol=1e-4)
    ran = sum(r.total_ns for r in prof.runs)
    steady = exe.model_timing(steady_weights=True).total_ns
    assert steady == pytest.approx(ran, rel=1e-9)
    assert exe.model_timing().total_ns > steady
