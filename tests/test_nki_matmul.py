# The NKI matmul tutorial's kernels as tn programs (tn.neuron.nki_matmul) and bench/fidelity.py's fast rows.
import os
import sys

import numpy as np
import pytest
import torch

import tn
import tn.lower  # noqa: F401
from tn.neuron import nki_matmul, simulate_timing

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
