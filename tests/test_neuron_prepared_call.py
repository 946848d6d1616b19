# Encoded.prepare_call(): the runtime's positional fast entry (binding checks, errors, results, profiling, threads).
import threading

import numpy as np
import pytest
import torch

import tn
from tn.neuron import Program, RunResult, run
from tn.neuron.runtime import PreparedCall


def _axpb_prog(n=64, dtype="float32"):
    """y = 2 x + 1 over a (128, n) tensor, plus an unbound scratch tensor."""
    prog = Program("axpb")
    x = prog.hbm("x", (128, n), dtype)
    y = prog.hbm("y", (128, n), dtype, kind="output")
    s = prog.hbm("s", (128, n), dtype, kind="scratch")
    t = prog.sbuf((128, n), dtype)
    prog.dma_copy(t, x)
    prog.activation(t, t, "identity", scale=2.0, bias=1.0)
    prog.dma_copy(s, t)
    prog.dma_copy(y, t)
    return prog.build()


def test_prepare_call_is_cached_and_describes_the_hbm_tensors():
    enc = _axpb_prog()
    call = enc.prepare_call()
    assert isinstance(call, PreparedCall) and enc.prepare_call() is call
    assert call.names == ("x", "y", "s") and call.kinds == ("input", "output", "scratch")
    assert "axpb" in repr(call)


def test_call_matches_run_and_binds_in_place():
    enc = _axpb_prog()
    x = torch.randn(128, 64)
    y = torch.empty(128, 64)
    res = enc.prepare_call()([x, y])
    torch.testing.assert_close(y, 2 * x + 1)
    ref = run(enc, {"x": x.numpy()})
    assert res.total_ns == ref.total_ns and res.busy_ns == ref.busy_ns and res.counts == ref.counts
    assert (res.hbm_read_bytes, res.hbm_write_bytes) == (ref.hbm_read_bytes, ref.hbm_write_bytes)
    np.testing.assert_array_equal(res.times, ref.times)
    # outputs: every HBM tensor, the bound tensors themselves and the allocated scratch
    assert set(res.outputs) == {"x", "y", "s"} and res.outputs["y"] is y and res.outputs["x"] is x
    np.testing.assert_allclose(res.outputs["s"], (2 * x + 1).numpy())
    np.testing.assert_allclose(ref.outputs["y"], (2 * x + 1).numpy())


def test_unbound_outputs_are_allocated_and_numpy_raw_and_bf16_bindings_work():
    enc = _axpb_prog()
    xs = np.random.default_rng(0).standard_normal((128, 64)).astype(np.float32)
    res = enc.prepare_call()([xs])  # shorter list: y and s allocated
    np.testing.assert_allclose(res.outputs["y"], 2 * xs + 1)
    out = np.empty((128, 64), np.float32)
    enc.prepare_call()([(xs.ctypes.data, xs.nbytes), (out.ctypes.data, out.nbytes), None])
    np.testing.assert_allclose(out, 2 * xs + 1)
    enc16 = _axpb_prog(dtype="bf16")
    xb = torch.randn(128, 64).to(torch.bfloat16)
    yb = torch.empty(128, 64, dtype=torch.bfloat16)
    enc16.prepare_call()([xb, yb])
    torch.testing.assert_close(yb, (2 * xb.float() + 1).to(torch.bfloat16))


@pytest.mark.parametrize("bad, match", [
    (lambda: torch.zeros(128, 64, dtype=torch.float64), "float32 but the bound tensor is torch.float64"),
    (lambda: torch.zeros(128, 32), "needs 32768 bytes"),
    (lambda: torch.zeros(64, 128).t(), "not contiguous"),
    (lambda: torch.zeros(128, 64, device="meta"), "bound tensor is on meta"),
    (lambda: np.zeros((128, 64)), "float32 but the bound array is float64"),
    (lambda: [0.0] * 8192, "cannot bind a list"),
    (lambda: None, "input HBM tensor 'x'"),
])
def test_bad_bindings_raise_clear_errors(bad, match):
    enc = _axpb_prog()
    call = enc.prepare_call()
    with pytest.raises(tn.NeuronError, match=match):
        call([bad(), torch.empty(128, 64)])
    with pytest.raises(tn.NeuronError, match=match):  # run() reports the same
        run(enc, {"x": bad(), "y": torch.empty(128, 64)} if bad() is not None else {})


def test_too_many_values_and_bad_outputs():
    call = _axpb_prog().prepare_call()
    x = torch.zeros(128, 64)
    with pytest.raises(tn.NeuronError, match="4 values bound but program 'axpb' declares 3"):
        call([x, None, None, None])
    with pytest.raises(tn.NeuronError, match="'y' needs 32768 bytes"):
        call([x, torch.empty(3)])
    ro = np.zeros((128, 64), np.float32)
    ro.flags.writeable = False
    with pytest.raises(tn.NeuronError, match="'y' is written by the program but the bound array is read-only"):
        call([x, ro])


def test_reports_to_profilers_unless_told_not_to():
    call = _axpb_prog().prepare_call()
    x = torch.randn(128, 64)
    with tn.profile() as prof:
        r1 = call([x])
        call([x], report=False)
    assert prof.runs == [r1]
    assert "axpb" in prof.table(print_it=False)


def test_fresh_memory_and_threads():
    call = _axpb_prog().prepare_call()
    xs = [torch.randn(128, 64) for _ in range(4)]
    outs = [torch.empty(128, 64) for _ in range(4)]
    errors = []

    def work(i):
        try:
            for _ in range(20):
                call([xs[i], outs[i]], fresh_memory=(i % 2 == 0))
                torch.testing.assert_close(outs[i], 2 * xs[i] + 1)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_run_result_fields_lazy_and_constructible():
    res = _axpb_prog().prepare_call()([torch.randn(128, 64)])
    assert res.busy_ns is res.busy_ns and res.counts["ScalarE"] == 1 and res.counts["DMA0"] >= 1
    assert res.utilisation["ScalarE"] > 0 and res.summary()["instructions"] == 4
    res.busy_ns = {"TensorE": 1.0}
    assert res.busy_ns == {"TensorE": 1.0}
    assert "axpb" in repr(res)
    arch = tn.neuron.get_arch("trn2")
    r = RunResult("p", arch, 10.0, {"TensorE": 5.0}, {"TensorE": 1}, 4, 8, 0, 0, 0)
    assert r.outputs == {} and r.utilisation == {"TensorE": 0.5} and r.total_us == 0.01
    r2 = RunResult(name="q", arch=arch, total_ns=1.0, busy_ns={}, counts={}, hbm_read_bytes=0, hbm_write_bytes=0,
                   sbuf_peak_bytes=0, psum_peak_bytes=0, matmul_flops=0, outputs={"a": 1}, wall_s=0.5)
    assert r2.outputs == {"a": 1} and r2.wall_s == 0.5 and r2.times is None


def test_neuron_executable_rejects_a_wrong_input_and_profiles_stay_right():
    import tn.lower

    def f(x):
        return torch.tanh(x * 1.5) + 1.0

    x = torch.randn(16, 16)
    exe = tn.lower.compile_ir(tn.make_ir(f)(x))
    torch.testing.assert_close(exe([x])[0], f(x))
    with pytest.raises(tn.TnError, match="float32 but the bound tensor is torch.float64"):
        exe([x.double()])
    with pytest.raises(tn.TnError, match="bytes"):
        exe([torch.randn(4, 4)])
    jf = tn.jit(f, backend="neuron")
    with tn.profile() as prof:
        y1 = jf(x)
        p1 = jf.last_profile
        jf(x + 1)
    p2 = jf.last_profile
    torch.testing.assert_close(y1, f(x))
    assert p1 is not p2 and len(prof.runs) == 2 * len(p1.runs)
    assert p1.runs[0] is prof.runs[0] and p2.runs[-1] is prof.runs[-1]
    assert p1.total_ns == sum(r.total_ns for r in prof.runs[:len(p1.runs)]) > 0
    assert p1.busy_ns and p1.counts and p1.instructions > 0


def test_no_reference_cycle_keeps_a_program_alive():
    import gc
    import weakref

    enc = _axpb_prog()
    call = enc.prepare_call()
    res = call([torch.randn(128, 64)])
    ref = weakref.ref(enc)
    gc.disable()
    try:
        del enc
        assert ref() is None and call.enc is None  # freed by reference counting alone
    finally:
        gc.enable()
    assert res.name == "axpb" and res.counts["ScalarE"] == 1


def test_unbound_tensors_share_one_zeroed_block_in_disjoint_aligned_pieces():
    # three unbound tensors of odd byte sizes (one bf16, one int32, one scratch never written): one block per call,
    # each piece 64-byte aligned, none overlapping, the untouched one all zeros, each array of its own dtype/shape
    prog = Program("carve")
    x = prog.hbm("x", (3, 5), "float32")
    y = prog.hbm("y", (3, 5), "bf16", kind="output")
    prog.hbm("z", (3, 7), "int32", kind="output")
    prog.hbm("s", (3, 9), "float32", kind="scratch")
    t = prog.sbuf((3, 5), "float32")
    tb = prog.sbuf((3, 5), "bf16")
    prog.dma_copy(t, x)
    prog.tensor_copy(tb, t)
    prog.dma_copy(y, tb)
    enc = prog.build()
    call = enc.prepare_call()
    xs = np.arange(15, dtype=np.float32).reshape(3, 5)
    res = call([xs])
    out = res.outputs
    assert out["y"].dtype == np.uint16 and out["y"].shape == (3, 5)
    assert out["z"].dtype == np.int32 and out["z"].shape == (3, 7) and not out["z"].any()
    assert out["s"].dtype == np.float32 and out["s"].shape == (3, 9) and not out["s"].any()
    np.testing.assert_array_equal(tn.neuron.runtime.from_bf16(out["y"]), xs)
    addrs = sorted((out[k].__array_interface__["data"][0], out[k].nbytes) for k in ("y", "z", "s"))
    assert all(a % 64 == 0 for a, _ in addrs)
    assert all(a + n <= b for (a, n), (b, _) in zip(addrs, addrs[1:]))
    # a second call gets fresh zeroed memory: the first result's arrays keep their values
    res2 = call([xs * 0 + 7])
    np.testing.assert_array_equal(tn.neuron.runtime.from_bf16(out["y"]), xs)
    assert (tn.neuron.runtime.from_bf16(res2.outputs["y"]) == 7).all()


def test_a_dropped_results_block_is_zeroed_and_reused_and_a_held_one_is_not():
    # the block of unbound outputs/scratch goes back to its program when the result is dropped and no array made
    # from it is alive; the next call zeroes it (a scratch tensor the program never writes reads as zeros again)
    # and uses it; while an output array of an earlier run is held, later runs do not touch that memory
    prog = Program("recycle")
    x = prog.hbm("x", (4, 8), "float32")
    y = prog.hbm("y", (4, 8), "float32", kind="output")
    prog.hbm("s", (4, 8), "float32", kind="scratch")   # never written
    t = prog.sbuf((4, 8), "float32")
    prog.dma_copy(t, x)
    prog.dma_copy(y, t)
    call = prog.build().prepare_call()
    xs = np.full((4, 8), 3.0, np.float32)
    res = call([xs])
    first = res._lazy[3][-1].block
    addr = first.__array_interface__["data"][0]
    first.fill(0xFF)   # dirty the whole block, the never-written scratch included
    del first, res
    assert len(call._spare) == 1                                    # given back
    res = call([xs * 2])
    assert call._spare == []
    block = res._lazy[3][-1].block
    assert block.__array_interface__["data"][0] == addr            # the same memory, reused
    out = res.outputs
    assert not out["s"].any()                                       # zeroed before reuse
    np.testing.assert_array_equal(out["y"], xs * 2)
    held = out["y"]
    del block, out, res                                             # the result dies, an output array lives
    assert call._spare == []
    res3 = call([xs * 5])
    assert res3._lazy[3][-1].block.__array_interface__["data"][0] != addr
    np.testing.assert_array_equal(held, xs * 2)                     # untouched by the later run
    np.testing.assert_array_equal(res3.outputs["y"], xs * 5)
