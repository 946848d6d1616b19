# Tests of the hand-written NeuronCore programs (tn/neuron/handwritten.py) against torch on CPU.
import numpy as np
import pytest
import torch

import tn
from tn.neuron import simulate_timing
from tn.neuron.handwritten import layer_norm, run_layer_norm, run_matmul, tiled_matmul

RNG = np.random.default_rng(7)


def _bf16(x: np.ndarray) -> torch.Tensor:
    """x rounded to bf16 (as fp32), as the program's inputs are."""
    return torch.from_numpy(x).bfloat16().float()


@pytest.mark.parametrize("M,K,N", [(128, 128, 512), (256, 384, 1024), (512, 256, 256), (128, 256, 128),
                                   (640, 128, 512)])
def test_matmul_bf16_matches_torch(M, K, N):
    a = RNG.standard_normal((M, K)).astype(np.float32)
    b = RNG.standard_normal((K, N)).astype(np.float32)
    c, res = run_matmul(a, b)
    ref = (_bf16(a).double() @ _bf16(b).double()).float()
    # bf16 output: one rounding of an fp32-accumulated exact-product sum
    torch.testing.assert_close(torch.from_numpy(c), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))
    # and as torch computes it in bf16
    tb = (torch.from_numpy(a).bfloat16() @ torch.from_numpy(b).bfloat16()).float()
    torch.testing.assert_close(torch.from_numpy(c), tb, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
    assert res.matmul_flops == 2 * M * K * N
    assert res.counts["TensorE"] == (M // 128) * (K // 128) * (N // min(N, 512))


@pytest.mark.parametrize("M,K,N", [(128, 128, 512), (256, 384, 1024), (1024, 256, 512), (128, 2048, 256)])
def test_matmul_a_as_stored_transposed_on_tensore(M, K, N):
    a = RNG.standard_normal((M, K)).astype(np.float32)
    b = RNG.standard_normal((K, N)).astype(np.float32)
    c, res = run_matmul(a, b, a_layout="MK", out_dtype="float32")
    ref = (_bf16(a).double() @ _bf16(b).double()).float()
    torch.testing.assert_close(torch.from_numpy(c), ref, rtol=1e-5, atol=1e-4)
    n_mm = (M // 128) * (K // 128) * (N // min(N, 512))
    assert res.counts["TensorE"] == n_mm + (M // 128) * (K // 128)  # matmuls + one transpose per A block


def test_matmul_a_layout_mk_2048_schedule():
    res = simulate_timing(tiled_matmul(2048, 2048, 2048, a_layout="MK").build(check=False))
    # TensorE also spends 256 transposes: lower than the KM layout, still mostly busy
    assert res.tensor_utilisation >= 0.75
    assert res.hbm_read_bytes == 2 * 2048 * 2048 * 2


def test_matmul_bad_layout_raises():
    with pytest.raises(tn.NeuronError, match="a_layout"):
        tiled_matmul(128, 128, 512, a_layout="T")


def test_matmul_fp32_output_is_fp32_accurate():
    M, K, N = 256, 512, 512
    a = RNG.standard_normal((M, K)).astype(np.float32)
    b = RNG.standard_normal((K, N)).astype(np.float32)
    c, _ = run_matmul(a, b, out_dtype="float32")
    ref = (_bf16(a).double() @ _bf16(b).double()).float()
    torch.testing.assert_close(torch.from_numpy(c), ref, rtol=1e-5, atol=1e-4)


def test_matmul_fp32_inputs():
    M, K, N = 128, 256, 512
    a = RNG.standard_normal((M, K)).astype(np.float32)
    b = RNG.standard_normal((K, N)).astype(np.float32)
    c, res = run_matmul(torch.from_numpy(a), torch.from_numpy(b), dtype="float32", out_dtype="float32")
    torch.testing.assert_close(torch.from_numpy(c), torch.from_numpy(a) @ torch.from_numpy(b), rtol=1e-5, atol=1e-4)
    # fp32 runs TensorE at quarter rate: at most a quarter of the bf16 peak
    assert res.tensor_utilisation <= 0.25 + 1e-9


def test_matmul_2048_schedule_keeps_tensore_busy():
    """The bench's program (timing only, no data): TensorE >= 85% of the trn2 bf16 peak, DMA overlapped."""
    enc = tiled_matmul(2048, 2048, 2048).build(check=False)
    res = simulate_timing(enc)
    assert res.tensor_utilisation >= 0.85
    assert res.utilisation["TensorE"] >= 0.95
    # inputs read once (aT resident, each moving block loaded once), output written once, in bf16
    assert res.hbm_read_bytes == 2 * 2048 * 2048 * 2
    assert res.hbm_write_bytes == 2048 * 2048 * 2
    assert res.psum_peak_bytes <= res.arch.psum_partition_bytes


def test_matmul_trn1_runs():
    a = RNG.standard_normal((256, 256)).astype(np.float32)
    b = RNG.standard_normal((256, 512)).astype(np.float32)
    c, res = run_matmul(a, b, arch="trn1", out_dtype="float32")
    torch.testing.assert_close(torch.from_numpy(c), (_bf16(a) @ _bf16(b)), rtol=1e-4, atol=1e-3)
    assert res.arch.name == "trn1"


@pytest.mark.parametrize("M,K,N", [(100, 128, 512), (128, 100, 512), (128, 128, 700), (0, 128, 128)])
def test_matmul_bad_shapes_raise(M, K, N):
    with pytest.raises(tn.NeuronError, match="tiled_matmul"):
        tiled_matmul(M, K, N)


def test_matmul_too_big_for_sbuf_raises():
    with pytest.raises(tn.NeuronError, match="SBUF"):
        tiled_matmul(128 * 64, 128 * 32, 512)


def test_run_matmul_checks_shapes():
    with pytest.raises(tn.NeuronError, match="matrix product"):
        run_matmul(np.ones((128, 128), np.float32), np.ones((256, 512), np.float32))


@pytest.mark.parametrize("rows,dim", [(128, 1024), (300, 1024), (256, 768), (64, 64), (130, 2048)])
def test_layer_norm_fp32_matches_torch(rows, dim):
    x = (RNG.standard_normal((rows, dim)) * 3 + 1).astype(np.float32)
    g = RNG.standard_normal(dim).astype(np.float32)
    b = RNG.standard_normal(dim).astype(np.float32)
    y, res = run_layer_norm(x, g, b, eps=1e-5)
    ref = torch.nn.functional.layer_norm(torch.from_numpy(x), (dim,), torch.from_numpy(g), torch.from_numpy(b),
                                         eps=1e-5)
    torch.testing.assert_close(torch.from_numpy(y), ref, rtol=1e-4, atol=1e-4)
    assert res.hbm_read_bytes == (rows * dim + 2 * min(rows, 128) * dim) * 4  # gamma/beta broadcast per partition
    assert res.hbm_write_bytes == rows * dim * 4


def test_layer_norm_bf16_matches_torch():
    rows, dim = 256, 512
    x = RNG.standard_normal((rows, dim)).astype(np.float32)
    g = RNG.standard_normal(dim).astype(np.float32)
    b = RNG.standard_normal(dim).astype(np.float32)
    y, _ = run_layer_norm(x, g, b, dtype="bfloat16")
    ref = torch.nn.functional.layer_norm(_bf16(x), (dim,), _bf16(g), _bf16(b), eps=1e-5)
    torch.testing.assert_close(torch.from_numpy(y), ref, rtol=2e-2, atol=3e-2)


def test_layer_norm_overlaps_engines():
    res = simulate_timing(layer_norm(2048, 1024).build(check=False))
    busy = res.busy_ns
    # the engines overlap: the run is shorter than their work done one after the other
    assert res.total_ns < busy["VectorE"] + busy["GpSimd"] + busy["ScalarE"]


def test_layer_norm_bad_args_raise():
    with pytest.raises(tn.NeuronError, match="layer_norm"):
        layer_norm(0, 128)
    with pytest.raises(tn.NeuronError, match="run_layer_norm"):
        run_layer_norm(np.ones((4, 8), np.float32), np.ones(7, np.float32), np.ones(8, np.float32))


@pytest.fixture(autouse=False)
def keep_torch_threads():
    """The benches pin torch to one thread; give the rest of the session its setting back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _load_bench(name):
    """Imports bench/<name>.py as a module (the bench folder is not a package)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_neuroncore_smoke(tmp_path, capsys, keep_torch_threads):
    out = _load_bench("neuroncore").main(["--size", "512", "--ln-rows", "256", "--ln-dim", "256", "--repeats", "1",
                                          "--json", str(tmp_path / "nc.json")])
    import json

    data = json.loads((tmp_path / "nc.json").read_text())
    assert set(data) >= {"matmul_tensor_util", "sim_vs_numpy", "matmul_modelled_us", "layer_norm_modelled_us"}
    assert 0 < data["matmul_tensor_util"] <= 1 and data["sim_vs_numpy"] > 0
    assert out["size"] == 512
    assert "TensorE util" in capsys.readouterr().out


def test_bench_matmul_kernel_smoke(capsys, keep_torch_threads):
    res = _load_bench("matmul_kernel").main(["--size", "512", "--repeats", "1", "--isa", "auto"])
    assert any("tn_matmul_bf16" in k for k in res) and any("numpy" in k for k in res)
    assert "GFLOP/s" in capsys.readouterr().out
