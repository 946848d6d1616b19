# The NKI matmul tutorial's kernels as tn programs (tn.neuron.nki_matmul) and bench/fidelity.py's fast rows.
import os
import sys

import numpy as np
import pytest
import torch

import tn
import tn.lower  # noqa: F401
from tn.neuron import nki_matmul, simulate_timing
from tn.neuron.arch import get_arch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))


def _bf16(x):
    return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)


@pytest.mark.parametrize("version,blocks", [("tiled", {}), ("hoist_load", {}), ("block_free", {}),
                                            ("fully_optimized", {"bm": 2, "bn": 2, "bk": 2})])
def test_tutorial_kernels_compute_the_product(version, blocks):
    K, M, N = 512, 256, 1024
    g = torch.Generator().manual_seed(7)
    lhsT = torch.randn(K, M, generator=g).to(torch.bfloat16)
    rhs = torch.randn(K, N, generator=g).to(torch.bfloat16)
    res = nki_matmul.build(version, K, M, N, **blocks).run({"lhsT": lhsT, "rhs": rhs})
    out = res.outputs["result"]
    out = _bf16(out) if isinstance(out, np.ndarray) else out
    ref = lhsT.float().T @ rhs.float()
    # bf16 result: one rounding (v1-v3), or one per K-block accumulation into the bf16 SBUF tile (v4)
    rounds = 1 if version != "fully_optimized" else K // (128 * blocks["bk"]) + 1
    tol = rounds * 2.0 ** -8 * float(ref.abs().max())
    assert float((out.float() - ref).abs().max()) <= tol
    assert res.matmul_flops == 2 * K * M * N


@pytest.mark.parametrize("version,blocks", [("tiled", {}), ("hoist_load", {}), ("block_free", {}),
                                            ("block_k", {"bm": 2, "bn": 2, "bk": 2})])
@pytest.mark.parametrize("io_queues", [1, 2])
def test_trn2_guide_kernels_compute_the_fp32_product(version, blocks, io_queues):
    K, M, N = 512, 256, 2048
    g = torch.Generator().manual_seed(11)
    lhsT = torch.randn(K, M, generator=g)
    rhs = torch.randn(K, N, generator=g)
    p = nki_matmul.build_trn2(version, K, M, N, io_queues=io_queues, **blocks)
    res = p.run({"lhsT": lhsT.numpy(), "rhs": rhs.numpy()})
    out = torch.as_tensor(np.asarray(res.outputs["result"]))
    assert out.dtype == torch.float32 and res.arch.name == "trn2"
    torch.testing.assert_close(out, lhsT.T @ rhs, rtol=1e-4, atol=1e-3)
    assert res.matmul_flops == 2 * K * M * N
    queues = {res.arch.queue_name(q) for q in np.unique(res.queues) if q >= 4}
    assert queues == ({"DMA0"} if io_queues == 1 else {"DMA0", "DMA1"})


def test_trn2_guide_kernels_fit_sbuf_and_follow_the_published_shapes():
    # the published shape: block_k's single-buffered fp32 tile set fills trn2's SBUF exactly (module docstring)
    e = nki_matmul.build_trn2("block_k").build(check=False)
    assert e.sbuf_peak_bytes == e.arch.sbuf_partition_bytes == 224 * 1024
    counts = e.opcode_counts() if callable(e.opcode_counts) else e.opcode_counts
    nbn, nbk, nbm = 8192 // 1024, 8192 // 1024, 4096 // 2048
    assert counts["matmul"] == 64 * 32 * 16 and counts["tensor_tensor"] == nbn * nbk * nbm * 16 * 2
    # per (n, k): 8 rhs [128, 1024] loads + 8 lhsT [128, 2048] loads per M-block; 32 packed stores per n
    assert counts["dma_copy"] == nbn * nbk * 8 * (1 + nbm) + nbn * 32
    assert counts["memset"] == counts["tensor_copy"] == nbn * 32 * 2
    with pytest.raises(tn.NeuronError, match="unknown trn2 version"):
        nki_matmul.build_trn2("fully_optimized")
    with pytest.raises(tn.NeuronError, match="io_queues"):
        nki_matmul.build_trn2("tiled", 256, 128, 512, io_queues=3)


def test_trn2_block_k_busy_shares_are_pinned():
    # modelled cycles are deterministic: the fidelity rows' shares at the published shape (one DMA queue)
    import fidelity

    s = fidelity.trn2_busy_shares("block_k")
    assert s["TensorE"] == pytest.approx(89.28, abs=0.01)
    assert s["VectorE"] == pytest.approx(6.98, abs=0.01)
    assert s["DMA"] == pytest.approx(13.18, abs=0.01)
    assert s["ms"] == pytest.approx(31.32, abs=0.01)
    rows = {r["anchor"]: r for r in fidelity.run(only=["trn2 matmul block_k"])}
    kernel = rows.pop("trn2 matmul block_k kernel")
    assert set(rows) == {f"trn2 matmul block_k {e} busy" for e in ("DMA", "TensorE", "VectorE")}
    assert rows["trn2 matmul block_k TensorE busy"]["verdict"] == "within"
    assert kernel["unit"] == "ms" and kernel["published"] == 28.30
    assert kernel["modelled"] == pytest.approx(s["ms"]) and kernel["verdict"] == "within"
    for r in rows.values():
        assert r["unit"] == "%" and r["band"] == 0.15 and r["arch"] == "trn2"
        assert r["verdict"] == ("within" if abs(r["modelled"] / r["published"] - 1) <= 0.15 else "OUT")


def test_trn2_published_kernel_times_agree_with_active_time_over_share():
    """The trn2 kernel anchors are the spans of the published profile timelines; each profile summary's engine
    active time / active share gives the same kernel time (figures v2-* ... v5-* of the kernel-optimization
    guide), so a mistyped anchor fails here."""
    import fidelity

    for version, actives in fidelity.TRN2_ACTIVE_MS.items():
        shares = dict(fidelity.TRN2_SHARES[version])
        assert set(shares) == {e for e, _ in actives}
        for eng, ms in actives:
            assert ms / (shares[eng] / 100) == pytest.approx(fidelity.TRN2_KERNEL_MS[version], rel=3e-3), (version, eng)


@pytest.mark.parametrize("arch", ["trn1", "trn2"])
def test_queue_rule_puts_every_transfer_of_a_kernel_on_one_queue(arch):
    """[dma]: "The queue ID is typically tied to the trigger engine and the method of descriptor generation";
    the tutorials' kernels trigger all their IO one way (IO_QUEUE_RULE: trn1 qSyncIO0, trn2 qGpSimdDynamic),
    so every load and store of every version is on IO_QUEUE; io_queues=2 (no source) moves only the rhs loads."""
    trigger, descriptors, name, source = nki_matmul.IO_QUEUE_RULE[arch]
    assert name in source
    versions = nki_matmul.VERSIONS if arch == "trn1" else nki_matmul.TRN2_VERSIONS
    small = {"fully_optimized": {"bm": 2, "bn": 2, "bk": 2}, "block_k": {"bm": 2, "bn": 2, "bk": 2}}
    for version in versions:
        for io_queues in (1, 2):
            if arch == "trn1":
                p = nki_matmul.build(version, 512, 256, 2048, io_queues=io_queues, **small.get(version, {}))
            else:
                p = nki_matmul.build_trn2(version, 512, 256, 2048, io_queues=io_queues, **small.get(version, {}))
            e = p.build(check=False)
            dq = sorted({int(q) for q in np.asarray(simulate_timing(e).queues) if q >= 4})
            assert [e.arch.queue_name(q) for q in dq] == [f"DMA{nki_matmul.IO_QUEUE + i}" for i in range(io_queues)]
    with pytest.raises(tn.NeuronError, match="io_queues"):
        nki_matmul.build("tiled", 256, 128, 512, io_queues=0)


def test_v1_step_on_one_queue_is_two_per_transfer_minimums():
    """What the queue rule costs v1 on trn1: each matmul step loads a [128, 128] lhsT tile (256 B per partition)
    and a [128, 512] rhs tile (1 KiB) on the one IO queue; both are below the per-transfer minimum
    (Arch.dma_transfer_min_ns, ~1141 ns on trn1, from the published DMA curve), so a steady step costs two of them
    (the published v1 - v2 difference is ~0.29 us per lhsT load: the row's note). With the rhs loads on a second
    queue (no source) the step is one minimum."""
    a = get_arch("trn1")

    def m_tile_ns(io_queues):
        """Modelled ns of one more M-tile at K = 8192, N = 512: 64 steps and one store."""
        t = [simulate_timing(nki_matmul.build("tiled", 8192, 128 * m, 512, io_queues=io_queues)
                             .build(check=False)).total_ns for m in (2, 3)]
        return t[1] - t[0]
    assert m_tile_ns(1) == pytest.approx((2 * 64 + 1) * a.dma_transfer_min_ns, rel=0.02)
    assert m_tile_ns(2) == pytest.approx((64 + 1) * a.dma_transfer_min_ns, rel=0.02)


def test_tutorial_kernels_keep_the_published_order():
    # at a shape where every version runs its loops more than once, each optimisation is faster than the last
    K, M, N = 2048, 2048, 2048
    blocks = {"fully_optimized": {"bm": 8, "bn": 2, "bk": 8}}
    t = [simulate_timing(nki_matmul.build(v, K, M, N, **blocks.get(v, {})).build(check=False)).total_ns
         for v in nki_matmul.VERSIONS]
    assert t[0] > t[1] > t[2] > t[3]


def test_unknown_version_and_bad_shapes_are_errors():
    with pytest.raises(tn.NeuronError, match="unknown version"):
        nki_matmul.build("fastest")
    with pytest.raises(tn.NeuronError, match="multiple of"):
        nki_matmul.build("fully_optimized", 1024, 1024, 1024)


def test_model_timing_matches_a_real_run():
    def f(a, b):
        return a.T @ b

    a = torch.randn(256, 128).to(torch.bfloat16)
    b = torch.randn(256, 512).to(torch.bfloat16)
    exe = tn.lower.compile_ir(tn.make_ir(f)(a, b), arch="trn1")
    modelled = exe.model_timing().runs
    exe([a, b])
    assert [r.total_ns for r in modelled] == pytest.approx([r.total_ns for r in exe.last_profile.runs])


def test_fidelity_bench_fast_rows():
    import fidelity

    rows = {r["anchor"]: r for r in fidelity.run(only=["DMA 32 KiB", "ScalarE dependent", "LayerNorm"])}
    dma = rows["DMA 32 KiB HBM->SBUF"]
    assert dma["modelled"] > 0 and dma["ratio"] == pytest.approx(dma["modelled"] / 1416.0)
    assert rows["ScalarE dependent interval"]["modelled"] > 0
    assert rows["LayerNorm tutorial v1 -> v2"]["verdict"] == "n/a"
    for r in rows.values():
        assert r["source"]
