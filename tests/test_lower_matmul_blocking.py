# Tests of the matmul lowering's streamed-B blocking (tn/lower/matmul.py, _Matmul.emit_streamed): numerics
# against torch/numpy and the blocking pinned by modelled HBM bytes and DMA counts (deterministic).
import numpy as np
import pytest
import torch

pytest.importorskip("tn.lower.base")
from tn.lower import matmul as mm  # noqa: E402
from tn.lower.base import LowerCtx  # noqa: E402
from tn.neuron import Program  # noqa: E402

#: SBUF bytes per partition the small-shape tests leave to the matmul (the rest is reserved), so that a
#: shape of a few hundred rows needs the streamed plan.
_SMALL_BUDGET = 37 * 1024


def _small_budget(monkeypatch, prog, budget=_SMALL_BUDGET):
    monkeypatch.setattr(mm, "_RESERVE", prog.arch.sbuf_partition_bytes - budget)


def _plan(prog, M, K, N, dtype="float32", a_t=False):
    """The _Matmul plan for ``[M, K] @ [K, N]`` in ``prog`` (nothing emitted)."""
    ah = prog.hbm("pa", (1, K, M) if a_t else (1, M, K), dtype)
    bh = prog.hbm("pb", (1, K, N), dtype)
    ch = prog.hbm("pc", (1, M, N), dtype, kind="output")
    return mm._Matmul(prog, None if a_t else ah.view(), ah.view() if a_t else None, bh.view(), None, ch.view(),
                      1, M, K, N, None, None, mm._sbuf_free(prog))


@pytest.mark.parametrize("a_t,budget,sg", [(False, 37 * 1024, 4), (True, 26 * 1024, 3)],
                         ids=["rows", "transposed"])
def test_streamed_blocking_bytes_dmas_and_numerics(monkeypatch, a_t, budget, sg):
    """M, K, N = 600, 700, 1100 fp32 (partial row tile, K chunk and column bank) with a small SBUF budget:
    stripes of ``sg`` row tiles (A^T of all K chunks; A's rows staged in pieces of 4 K chunks and transposed
    when A^T is not given), B streamed in blocks of 2 K chunks x 512 columns and read once per stripe (2
    stripes), A read once; exact DMA and TensorE counts; the result equals A @ B."""
    M, K, N = 600, 700, 1100
    prog = Program("mm_streamed")
    _small_budget(monkeypatch, prog, budget)
    plan = _plan(Program("plan"), M, K, N, a_t=a_t)
    assert plan.streamed and (plan.s_sg, plan.s_kb) == (sg, 2)
    rng = np.random.default_rng(7)
    A = rng.standard_normal((1, M, K)).astype(np.float32)
    B = rng.standard_normal((1, K, N)).astype(np.float32)
    ah = prog.hbm("a", (1, K, M) if a_t else (1, M, K))
    bh = prog.hbm("b", (1, K, N))
    c = prog.hbm("c", (1, M, N), kind="output")
    mm.emit_matmul(LowerCtx(prog), None if a_t else ah.view(), bh.view(), c.view(), a_t=ah.view() if a_t else None)
    assert prog._sbuf.in_use == 0 and prog._psum.in_use == 0
    res = prog.run({"a": np.ascontiguousarray(A.transpose(0, 2, 1)) if a_t else A, "b": B})
    np.testing.assert_allclose(res.outputs["c"], A @ B, rtol=1e-4, atol=1e-3)
    stripes, cols = 2, 3
    assert res.hbm_read_bytes == (M * K + K * N * stripes) * 4
    assert res.hbm_write_bytes == M * N * 4
    # B: per stripe and column bank, K blocks [0, 2) [2, 4) [4, 6) (the last one's partial chunk is its own DMA)
    b_dmas = stripes * cols * 4
    # A^T given: loaded beside the first column's B blocks, per K block ([0, 2) [2, 4) [4, 5) and the partial
    # chunk 5 on its own: 4 a stripe); A rows: per row tile, pieces of 4 chunks and of 2
    a_dmas = stripes * 4 if a_t else 5 * 2
    stores = 5 * cols
    dmas = sum(v for k, v in res.counts.items() if k.startswith("DMA"))
    assert dmas == b_dmas + a_dmas + stores
    assert res.counts["TensorE"] == 5 * cols * 6 + (0 if a_t else 5 * 6)   # matmuls (+ A's transposes)


def test_streamed_matmul_batched_bf16(monkeypatch):
    """Two batches of a bf16 matmul through the streamed plan agree with torch (fp32 accumulation, rounded once)."""
    from tn.lower.testing import check_lowering

    _small_budget(monkeypatch, Program("budget"))
    g = torch.Generator().manual_seed(3)
    a = torch.randn(2, 300, 1100, generator=g).to(torch.bfloat16)
    b = torch.randn(2, 1100, 600, generator=g).to(torch.bfloat16)
    plan = _plan(Program("plan"), 300, 1100, 600, "bfloat16")
    assert plan.streamed
    check_lowering("matmul", a, b, rtol=2e-2, atol=1e-1)


def test_streamed_bias_in_psum(monkeypatch):
    """``x @ w + b`` (bf16, w row-major) through the compiler with the streamed plan: the bias row's K=1 matmul
    opens each accumulation; the result agrees with torch."""
    import tn
    import tn.passes
    from tn.lower.compiler import compile_ir

    _small_budget(monkeypatch, Program("budget"))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, 1100, generator=g).to(torch.bfloat16)
    w = torch.randn(1100, 600, generator=g).to(torch.bfloat16)
    b = torch.randn(600, generator=g).to(torch.bfloat16)

    def f(x, w, b):
        return x @ w + b

    exe = compile_ir(tn.passes.optimize(tn.make_ir(f)(x, w, b)), strict=True)
    (got,) = exe([x, w, b])
    torch.testing.assert_close(got.float(), f(x.float(), w.float(), b.float()), rtol=3e-2, atol=3e-1)


def test_streamed_plan_only_when_it_moves_fewer_bytes():
    """At the full SBUF budget a matmul whose B stays resident keeps the resident plan; the NKI tutorial's
    shape (B of 128 MiB) streams B with stripes of 8 row tiles (all 8 PSUM banks, no transposes)."""
    assert not _plan(Program("p", arch="trn1"), 2048, 2048, 2048, "bfloat16").streamed
    big = _plan(Program("p", arch="trn1"), 4096, 8192, 8192, "bfloat16", a_t=True)
    assert big.streamed and big.s_sg == 8


def test_tutorial_shape_timing_reads_each_operand_the_planned_times():
    """``lhsT.T @ rhs`` at a quarter of the tutorial's shape (K, M, N = 8192, 1024, 2048 bf16, trn1), timing
    only: A^T read once, B once per stripe of 8 row tiles (once), no TensorE transposes, and TensorE busy
    for most of the modelled time (the loads overlap the matmuls)."""
    import tn
    from tn.lower.compiler import compile_ir

    K, M, N = 8192, 1024, 2048
    lhsT = torch.empty(K, M, dtype=torch.bfloat16)
    rhs = torch.empty(K, N, dtype=torch.bfloat16)
    exe = compile_ir(tn.make_ir(lambda a, b: a.T @ b)(lhsT, rhs), arch="trn1")
    (run,) = exe.model_timing().runs
    assert run.hbm_read_bytes == (K * M + K * N) * 2
    assert run.hbm_write_bytes == M * N * 2
    assert run.counts["TensorE"] == (M // 128) * (N // 512) * (K // 128)
    assert run.busy_ns["TensorE"] / run.total_ns > 0.8


def test_streamed_loads_fall_back_to_one_dma_per_chunk(monkeypatch):
    """An HBM view that refuses to split its K axis into [chunks, 128]: the streamed plan loads B and A^T one
    K chunk per DMA instead, with the same result and the same bytes."""
    from tn.errors import NeuronError
    from tn.neuron.program import HbmView

    M, K, N = 600, 700, 1100
    prog = Program("mm_streamed_split")
    _small_budget(monkeypatch, prog, 26 * 1024)
    rng = np.random.default_rng(11)
    A = rng.standard_normal((1, M, K)).astype(np.float32)
    B = rng.standard_normal((1, K, N)).astype(np.float32)
    ah = prog.hbm("a", (1, K, M))
    bh = prog.hbm("b", (1, K, N))
    c = prog.hbm("c", (1, M, N), kind="output")
    plain = HbmView.reshape

    def no_split(self, *shape):
        if len(shape) == 3 and shape[1] == 128 and len(self.shape) == 2:
            raise NeuronError("this view cannot split its rows")
        return plain(self, *shape)

    monkeypatch.setattr(HbmView, "reshape", no_split)
    mm.emit_matmul(LowerCtx(prog), None, bh.view(), c.view(), a_t=ah.view())
    monkeypatch.setattr(HbmView, "reshape", plain)
    res = prog.run({"a": np.ascontiguousarray(A.transpose(0, 2, 1)), "b": B})
    np.testing.assert_allclose(res.outputs["c"], A @ B, rtol=1e-4, atol=1e-3)
    assert res.hbm_read_bytes == (M * K + K * N * 2) * 4
    dmas = sum(v for k, v in res.counts.items() if k.startswith("DMA"))
    assert dmas == 2 * 3 * 6 + 2 * 6 + 5 * 3     # B: one per chunk; A^T: one per chunk; stores
