# Builder + runtime end to end: the docstring example, bf16 matmul with accumulation, views, dependencies, profile.
import json

import numpy as np
import pytest

import tn
from tn.neuron import Program, from_bf16, run, to_bf16


def _linear_relu_prog():
    prog = Program("linear_relu")
    x = prog.hbm("x", (128, 64), "float32")
    w = prog.hbm("w", (64, 256), "float32")
    b = prog.hbm("b", (128, 1), "float32")
    y = prog.hbm("y", (128, 256), "float32", kind="output")
    xT = prog.sbuf((64, 128), "float32")
    wt = prog.sbuf((64, 256), "float32")
    bt = prog.sbuf((128, 1), "float32")
    prog.dma_copy(xT, x.T)
    prog.dma_copy(wt, w)
    prog.dma_copy(bt, b)
    acc = prog.psum((128, 256))
    prog.matmul(acc, xT, wt)
    out = prog.sbuf((128, 256), "float32")
    prog.activation(out, acc, "relu", bias=bt)
    prog.dma_copy(y, out)
    return prog


def test_docstring_example_matches_numpy():
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((128, 64)).astype(np.float32)
    ws = rng.standard_normal((64, 256)).astype(np.float32)
    bs = rng.standard_normal((128, 1)).astype(np.float32)
    res = _linear_relu_prog().run({"x": xs, "w": ws, "b": bs})
    np.testing.assert_allclose(res.outputs["y"], np.maximum(xs @ ws + bs, 0), rtol=1e-5, atol=1e-4)
    assert res.total_ns > 0 and res.counts["TensorE"] == 1 and res.counts["ScalarE"] == 1
    assert res.hbm_read_bytes == (128 * 64 + 64 * 256 + 128) * 4
    assert res.hbm_write_bytes == 128 * 256 * 4
    # dependencies: the matmul waits for both its DMAs, the activation for the matmul, the store for it
    inst = res.instructions()
    assert inst[3][1] >= max(inst[0][2], inst[1][2]) - 1e-6
    assert inst[4][1] >= inst[3][2] - 1e-6 and inst[5][1] >= inst[4][2] - 1e-6


def test_bf16_matmul_accumulates_in_fp32():
    K, M, N = 256, 128, 512
    rng = np.random.default_rng(1)
    a = to_bf16(rng.standard_normal((K, M)))
    b = to_bf16(rng.standard_normal((K, N)))
    prog = Program("mm_bf16")
    A = prog.hbm("a", (K, M), "bf16")
    B = prog.hbm("b", (K, N), "bf16")
    C = prog.hbm("c", (M, N), "float32", kind="output")
    acc = prog.psum((M, N))
    for k in range(K // 128):
        at = prog.sbuf((128, M), "bf16")
        bt = prog.sbuf((128, N), "bf16")
        prog.dma_copy(at, A[k * 128:(k + 1) * 128])
        prog.dma_copy(bt, B[k * 128:(k + 1) * 128])
        prog.matmul(acc, at, bt, accumulate=k > 0)
    o = prog.sbuf((M, N), "float32")
    prog.tensor_copy(o, acc)
    prog.dma_copy(C, o)
    res = prog.run({"a": a, "b": b})
    ref = from_bf16(a).astype(np.float64).T @ from_bf16(b).astype(np.float64)
    np.testing.assert_allclose(res.outputs["c"], ref, rtol=1e-4, atol=1e-3)
    assert res.matmul_flops == 2 * K * M * N


def test_torch_tensors_bind_in_place():
    torch = pytest.importorskip("torch")
    prog = Program("scale")
    x = prog.hbm("x", (4, 8), "bf16")
    y = prog.hbm("y", (4, 8), "bf16", kind="output")
    t = prog.sbuf((4, 8), "bf16")
    prog.dma_copy(t, x)
    prog.activation(t, t, "identity", scale=2.0)
    prog.dma_copy(y, t)
    xs = torch.randn(4, 8, dtype=torch.bfloat16)
    ys = torch.empty(4, 8, dtype=torch.bfloat16)
    prog.run({"x": xs, "y": ys})
    torch.testing.assert_close(ys, xs * 2)


def test_profile_collects_runs_and_writes_trace(tmp_path):
    rng = np.random.default_rng(0)
    args = {"x": rng.standard_normal((128, 64)).astype(np.float32),
            "w": rng.standard_normal((64, 256)).astype(np.float32),
            "b": rng.standard_normal((128, 1)).astype(np.float32)}
    enc = _linear_relu_prog().build()
    with tn.profile() as prof:
        enc.run(args)
        enc.run(args)
    enc.run(args)  # outside: not collected
    assert len(prof.runs) == 2
    text = prof.table(print_it=False)
    assert "linear_relu" in text and "TensorE" in text
    by_op = prof.opcode_rows()
    assert {(r["engine"], r["opcode"]) for r in by_op} == {("TensorE", "matmul"), ("ScalarE", "activation"),
                                                            ("DMA", "dma_copy")}
    assert next(r for r in by_op if r["opcode"] == "dma_copy")["count"] == 8
    assert "matmul" in prof.table(print_it=False, by="opcode")
    path = prof.save_trace(tmp_path / "t.json")
    data = json.load(open(path))
    names = {e["args"]["name"] for e in data["traceEvents"] if e.get("name") == "thread_name"}
    assert {"TensorE", "ScalarE", "DMA0"} <= names
    slices = [e for e in data["traceEvents"] if e["ph"] == "X" and e["cat"] == "instruction"]
    assert sum(e["ph"] == "X" and e["cat"] == "program" for e in data["traceEvents"]) == 2   # one per run
    assert len(slices) == 12 and {"matmul", "activation", "dma_copy"} <= {e["name"] for e in slices}


def test_unbound_input_and_wrong_dtype_are_named():
    enc = _linear_relu_prog().build()
    with pytest.raises(tn.NeuronError, match="'x'"):
        run(enc, {})
    with pytest.raises(tn.NeuronError, match="float32 but the bound array is float64"):
        run(enc, {"x": np.zeros((128, 64)), "w": np.zeros((64, 256), np.float32), "b": np.zeros((128, 1), np.float32)})


def test_dma_operands_share_one_pattern_when_possible():
    from tn.neuron import isa

    prog = Program("joint")
    A = prog.hbm("a", (2048, 256), "bf16")
    t = prog.sbuf((128, 16, 128), "bf16")
    prog.dma_copy(t, A[:, 128:].reshape(16, 128, 128).permute(1, 0, 2))
    rec = prog.build().records[0]
    nums = lambda k: [int(rec[isa.OPERAND_BASE + k * isa.OPERAND_WIDTH + isa.O_NUM0 + 2 * d]) for d in range(4)]
    assert nums(0) == nums(1) == [1, 1, 16, 128]
    a = to_bf16(np.random.default_rng(0).standard_normal((2048, 256)))
    p2 = Program("joint2")
    A2 = p2.hbm("a", (2048, 256), "bf16")
    O2 = p2.hbm("o", (128, 16, 128), "bf16", kind="output")
    t2 = p2.sbuf((128, 16, 128), "bf16")
    p2.dma_copy(t2, A2[:, 128:].reshape(16, 128, 128).permute(1, 0, 2))
    p2.dma_copy(O2, t2)
    res = p2.run({"a": a})
    np.testing.assert_array_equal(res.outputs["o"], a[:, 128:].reshape(16, 128, 128).transpose(1, 0, 2))


def test_fresh_memory_starts_from_zeroed_sbuf():
    prog = Program("reads_uninitialised")
    o = prog.hbm("o", (4, 4), "float32", kind="output")
    t = prog.sbuf((4, 4))
    prog.dma_copy(o, t)
    res = prog.run(fresh_memory=True)
    np.testing.assert_allclose(res.outputs["o"], np.zeros((4, 4)))


def test_listing_is_readable():
    text = str(_linear_relu_prog().build())
    assert "program 'linear_relu' (trn2): 6 instructions" in text
    assert "#3    TensorE  matmul" in text and "waits [0, 1]" in text
    assert "src=float32[64:1 | 128:64]@x@0" in text   # the transposing DMA: partition stride 1, free stride 64


def test_hbm_utilisation_of_a_pure_dma_program():
    prog = Program("copy")
    x = prog.hbm("x", (128, 8192), "float32")
    t = prog.sbuf((128, 8192), "float32")
    for q in range(4):
        prog.dma_copy(t[:, q * 2048:(q + 1) * 2048], x[:, q * 2048:(q + 1) * 2048], queue=q)
    res = prog.run({"x": np.zeros((128, 8192), np.float32)})
    assert 0.5 < res.hbm_utilisation < 1.0
    with tn.profile() as prof:
        prog.run({"x": np.zeros((128, 8192), np.float32)})
    assert 50 < prof.rows()[0]["HBM %"] < 100


def test_raw_address_binding():
    prog = Program("raw")
    x = prog.hbm("x", (4, 4), "float32")
    y = prog.hbm("y", (4, 4), "float32", kind="output")
    t = prog.sbuf((4, 4))
    prog.dma_copy(t, x)
    prog.dma_copy(y, t)
    xs = np.arange(16, dtype=np.float32).reshape(4, 4)
    ys = np.zeros((4, 4), np.float32)
    prog.run({"x": (xs.ctypes.data, xs.nbytes), "y": (ys.ctypes.data, ys.nbytes)})
    np.testing.assert_allclose(ys, xs)
    with pytest.raises(tn.NeuronError, match="needs 64 bytes"):
        prog.run({"x": (xs.ctypes.data, 32)})
