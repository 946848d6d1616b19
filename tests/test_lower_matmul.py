# Tests of the matmul lowering (tn/lower/matmul.py): edge shapes, dtypes, batching, epilogue store path, CannotLower.
import pytest
import torch

pytest.importorskip("tn.lower.base")
from tn.lower.base import CannotLower, LowerCtx  # noqa: E402
from tn.lower.testing import check_lowering  # noqa: E402
from tn.lower import matmul as mm  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _mats(m, k, n, dtype, batch=()):
    g = torch.Generator().manual_seed(m * 1000003 + k * 1009 + n)
    a = torch.randn(*batch, m, k, generator=g).to(dtype)
    b = torch.randn(*batch, k, n, generator=g).to(dtype)
    return a, b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (1, 7, 1), (3, 5, 7), (127, 128, 129), (128, 129, 128),
                                   (129, 127, 513), (2, 300, 3)])
def test_matmul_edge_shapes(m, k, n, dtype):
    a, b = _mats(m, k, n, dtype)
    check_lowering("matmul", a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch,m,k,n", [((2,), 1, 1, 1), ((3,), 5, 7, 9), ((4,), 128, 64, 128),
                                         ((2, 3), 33, 70, 20), ((2,), 130, 129, 40), ((3,), 4, 200, 600)])
def test_matmul_batched(batch, m, k, n, dtype):
    a, b = _mats(m, k, n, dtype, batch)
    check_lowering("matmul", a, b)


def test_matmul_uses_tensore_and_psum_accumulation():
    a, b = _mats(256, 384, 600, torch.bfloat16)
    res = check_lowering("matmul", a, b)
    # 2 row tiles x 2 column banks x 3 K chunks, all on TensorE, exact flop count
    assert res.matmul_flops == 2 * 256 * 384 * 600
    assert res.counts["TensorE"] >= 2 * 2 * 3
    # A read once, B read once, C written once (no spills)
    assert res.hbm_read_bytes == (256 * 384 + 384 * 600) * 2
    assert res.hbm_write_bytes == 256 * 600 * 2


def test_matmul_special_values():
    a = torch.tensor([[1.0, float("inf")], [0.0, 2.0]])
    b = torch.tensor([[1.0, 0.5], [2.0, -1.0]])
    check_lowering("matmul", a, b)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64], ids=str)
def test_matmul_cannot_lower_other_dtypes(dtype):
    from tn.lower.testing import build_eqn_ir
    from tn.neuron import Program

    a = torch.ones(4, 4, dtype=dtype)
    ir = build_eqn_ir("matmul", a, a)
    eqn = ir.eqns[0]
    prog = Program("t")
    ctx = LowerCtx(prog)
    with pytest.raises(CannotLower):
        ins = [prog.hbm("a", (4, 4), "int32"), prog.hbm("b", (4, 4), "int32")]
        mm.lower_matmul(ctx, eqn, ins, [prog.hbm("c", (4, 4), "int32", kind="output")])


def test_emit_matmul_with_transposed_a_and_custom_store():
    """The conv entry point: A^T given in HBM, results written through a store callback."""
    import numpy as np
    from tn.neuron import Program

    M, K, N = 200, 150, 70
    prog = Program("mmT")
    at = prog.hbm("at", (1, K, M), "float32")
    b = prog.hbm("b", (1, K, N), "float32")
    c = prog.hbm("c", (1, M, N), "float32", kind="output")
    ctx = LowerCtx(prog)
    stored = []

    def store(dst, tile):
        stored.append(tuple(dst.shape))
        prog.dma_copy(dst, tile)

    mm.emit_matmul(ctx, None, b.view(), c.view(), a_t=at.view(), store=store)
    assert stored and sum(s[0] * s[1] for s in stored) == M * N
    A = np.random.default_rng(0).standard_normal((M, K)).astype(np.float32)
    B = np.random.default_rng(1).standard_normal((K, N)).astype(np.float32)
    res = prog.run({"at": np.ascontiguousarray(A.T[None]), "b": B[None].copy()})
    assert res.counts["TensorE"] > 0 and "transpose" not in {o for *_, o in res.instructions()}
    np.testing.assert_allclose(res.outputs["c"][0], A @ B, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ta,tb", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("bt,m,k,n", [(1, 200, 150, 70), (1, 130, 257, 600), (3, 64, 40, 100), (2, 5, 300, 9)])
def test_emit_matmul_transposed_operands(ta, tb, bt, m, k, n):
    """A given as A^T and/or B given as B^T (a Linear weight) in HBM."""
    import numpy as np
    from tn.neuron import Program

    prog = Program("mmT")
    rng = np.random.default_rng(m + k + n)
    A = rng.standard_normal((bt, m, k)).astype(np.float32)
    B = rng.standard_normal((bt, k, n)).astype(np.float32)
    if ta:
        ah, av = prog.hbm("a", (bt, k, m)), np.ascontiguousarray(A.transpose(0, 2, 1))
    else:
        ah, av = prog.hbm("a", (bt, m, k)), A
    if tb:
        bh, bv = prog.hbm("b", (bt, n, k)), np.ascontiguousarray(B.transpose(0, 2, 1))
    else:
        bh, bv = prog.hbm("b", (bt, k, n)), B
    c = prog.hbm("c", (bt, m, n), "float32", kind="output")
    ctx = LowerCtx(prog)
    mm.emit_matmul(ctx, None if ta else ah.view(), None if tb else bh.view(), c.view(),
                   a_t=ah.view() if ta else None, b_t=bh.view() if tb else None)
    assert prog._sbuf.in_use == 0 and prog._psum.in_use == 0
    res = prog.run({"a": av, "b": bv})
    np.testing.assert_allclose(res.outputs["c"], A @ B, rtol=1e-4, atol=1e-4)


def test_matmul_frees_all_tiles():
    from tn.lower.testing import build_eqn_ir
    from tn.neuron import Program

    a, b = _mats(300, 200, 700, torch.float32)
    ir = build_eqn_ir("matmul", a, b)
    prog = Program("free")
    ctx = LowerCtx(prog)
    ins = [prog.hbm("a", (300, 200)), prog.hbm("b", (200, 700))]
    mm.lower_matmul(ctx, ir.eqns[0], ins, [prog.hbm("c", (300, 700), kind="output")])
    assert prog._sbuf.in_use == 0 and prog._psum.in_use == 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_matmul_large(dtype):
    a, b = _mats(512, 2048, 1024, dtype)
    res = check_lowering("matmul", a, b, rtol=2e-2 if dtype == torch.bfloat16 else 1e-3, atol=1e-1)
    assert res.tensor_utilisation > 0


@pytest.mark.slow
@pytest.mark.parametrize("m,k,n", [(256, 2048, 4096), (130, 12000, 600), (600, 3000, 3000)])
def test_matmul_streams_when_operands_do_not_fit(m, k, n):
    # fp32 operands too large for SBUF: B panels streamed, A^T per row-tile group, K split into panels
    a, b = _mats(m, k, n, torch.float32)
    check_lowering("matmul", a / 50, b, rtol=1e-3, atol=1e-3)


def test_matmul_epilogue_through_compiler():
    """matmul -> + bias -> gelu compiled together: the epilogue (if fused) runs on the matmul's output tiles."""
    import tn
    import tn.passes
    from tn.lower.compiler import compile_ir

    def f(x, w, b):
        return torch.nn.functional.gelu(x @ w + b)

    x, w = _mats(130, 200, 600, torch.float32)
    b = torch.randn(600)
    ir = tn.passes.optimize(tn.make_ir(f)(x, w, b))
    exe = compile_ir(ir, strict=True)
    (got,) = exe([x, w, b])
    torch.testing.assert_close(got, f(x, w, b), rtol=1e-4, atol=1e-4)
    if exe.stats.get("fused_eqns"):
        # the fused chain never round-trips the matmul result through HBM
        prof = exe.last_profile
        assert prof.hbm_write_bytes == 130 * 600 * 4


@pytest.mark.parametrize("case", ["linear", "attention_scores", "a_transposed", "head_split_k", "batch2_heads"])
def test_permute_matmul_fused_through_transposed_sources(case):
    """transposed_source finds the permute behind a matmul operand; lower_matmul_transposed reads its source
    through a permuted HBM view."""
    import numpy as np
    import tn
    from tn.neuron import Program

    if case == "linear":
        def f(x, w):
            return x @ w.t()
        args = (torch.randn(70, 130), torch.randn(300, 130))
    elif case == "attention_scores":
        def f(q, k):
            return q @ k.transpose(-1, -2)
        args = (torch.randn(1, 4, 128, 64), torch.randn(1, 4, 128, 64))
    elif case == "a_transposed":
        def f(a, b):
            return a.transpose(-1, -2) @ b
        args = (torch.randn(3, 40, 20), torch.randn(3, 40, 30))
    elif case == "head_split_k":
        # GPT-2 style: k [B=1, S, H, D] -> permute(0, 2, 3, 1) = k^T per head
        def f(q, k):
            return q @ k.permute(0, 2, 3, 1)
        args = (torch.randn(1, 4, 96, 32), torch.randn(1, 96, 4, 32))
    else:
        # two batch axes that do not merge into one strided axis
        def f(q, k):
            return q @ k.permute(0, 2, 3, 1)
        args = (torch.randn(2, 3, 50, 16), torch.randn(2, 50, 3, 16))
    ir = tn.make_ir(f)(*args)
    prod = {v: e for e in ir.eqns for v in e.outputs}
    mm_eqn = next(e for e in ir.eqns if e.op.name == "matmul")
    srcs = [mm.transposed_source(v, prod.get) for v in mm_eqn.inputs]
    assert any(s is not None for s in srcs)
    prog = Program("fused")
    ctx = LowerCtx(prog)
    hbm = {v: prog.hbm(f"in{i}", tuple(t.shape), "float32") for i, (v, t) in enumerate(zip(ir.inputs, args))}
    t_kw = {}
    ins = [None, None]
    for j, (v, src) in enumerate(zip(mm_eqn.inputs, srcs)):
        if src is not None and src[0] in hbm:
            t_kw["a_t" if j == 0 else "b_t"] = hbm[src[0]].permute(*src[1])
        else:
            # a reshape of a program input needs no copy: the lowering views it as [lead, M, K]
            ins[j] = hbm[v] if v in hbm else hbm[prod[v].inputs[0]]
    assert t_kw
    out = prog.hbm("out", mm_eqn.outputs[0].shape, "float32", kind="output")
    mm.lower_matmul_transposed(ctx, mm_eqn, ins, [out], **t_kw)
    res = prog.run({f"in{i}": t.contiguous() for i, t in enumerate(args)})
    want = f(*args).reshape(mm_eqn.outputs[0].shape)
    np.testing.assert_allclose(res.outputs["out"], want.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_large_matmul_with_long_fused_epilogue():
    """A large bf16 matmul that fills SBUF still leaves room for a long fused epilogue (bias, gelu, residual)."""
    import tn
    import tn.passes
    from tn.lower.compiler import compile_ir

    def f(x, w, b, r, s):
        return torch.nn.functional.gelu(x @ w + b) * s + r

    bf = torch.bfloat16
    x, w = _mats(512, 2048, 2048, bf)
    b, r, s = torch.randn(2048, dtype=bf), torch.randn(512, 2048, dtype=bf), torch.randn(512, 1, dtype=bf)
    ir = tn.passes.optimize(tn.make_ir(f)(x, w, b, r, s))
    exe = compile_ir(ir, strict=True)
    (got,) = exe([x, w, b, r, s])
    want = f(x.float(), w.float(), b.float(), r.float(), s.float())
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m,k,n", [(128, 768, 2304), (100, 130, 700), (1, 64, 33)])
def test_linear_bias_added_in_psum(m, k, n, dtype):
    """matmul -> + bias (a row of the matmul's dtype) -> gelu: the bias goes into the PSUM accumulation (a K=1
    matmul), the epilogue does the rest; agrees with torch's Linear."""
    import tn
    import tn.passes
    from tn.lower.compiler import compile_ir

    torch.manual_seed(m + n)
    lin = torch.nn.Linear(k, n).to(dtype)
    x = torch.randn(m, k).to(dtype)

    def f(lin, x):
        return torch.nn.functional.gelu(lin(x))

    ir = tn.passes.optimize(tn.make_ir(f)(lin, x))
    exe = compile_ir(ir, strict=True)
    with torch.no_grad():
        want = f(lin, x)
    for _ in range(2):
        (got,) = exe([lin.weight, lin.bias, x])
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
