# The device's cheap result allocation (tn.device.allocator.new_dense): metadata, memory accounting, errors.
import gc

import pytest
import torch

import tn  # noqa: F401  (registers the neuron device)
from tn.device import allocator, windows


def _live(t: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() != 0


@pytest.mark.parametrize("shape, dtype", [((3, 5), torch.float32), ((2, 1, 4), torch.bfloat16), ((7,), torch.int64),
                                          ((), torch.float32)])
def test_new_dense_makes_a_contiguous_device_tensor_on_fresh_tracked_memory(shape, dtype):
    item = torch.empty((), dtype=dtype).element_size()
    nbytes = max(1, torch.Size(shape).numel()) * item
    gc.collect()
    base, blocks = allocator.memory_allocated(0), allocator.live_blocks()
    t, st = allocator.new_dense(shape, dtype, nbytes, 0)
    assert (t.device, t.dtype, tuple(t.shape), t.stride(), t.storage_offset()) == (
        torch.device("neuron", 0), dtype, shape, allocator.contiguous_strides(shape), 0)
    assert t.untyped_storage() is st and st.nbytes() == nbytes and st.device == torch.device("neuron", 0)
    assert allocator.memory_allocated(0) > base and allocator.live_blocks() == blocks + 1
    vals = torch.arange(torch.Size(shape).numel()).reshape(shape).to(dtype)
    allocator.cpu_alias(t).copy_(vals)
    torch.testing.assert_close(t.cpu(), vals, rtol=0, atol=0)
    v = t.reshape(-1)[:1]          # a view keeps the block alive ...
    del t, st
    gc.collect()
    assert allocator.live_blocks() == blocks + 1 and _live(v)
    assert v.cpu().item() == vals.reshape(-1)[0].item()
    del v                          # ... and the block returns to the allocator with the last user
    gc.collect()
    assert allocator.memory_allocated(0) == base and allocator.live_blocks() == blocks


def test_new_dense_takes_the_general_way_for_empty_shapes_and_other_devices():
    t, st = allocator.new_dense((0, 3), torch.float32, 0, 0)
    assert tuple(t.shape) == (0, 3) and t.stride() == allocator.contiguous_strides((0, 3)) and st.nbytes() == 0
    if allocator.device_count() > 1:
        u, ust = allocator.new_dense((2, 2), torch.float32, 16, 1)
        assert u.device == torch.device("neuron", 1) and ust.nbytes() == 16 and u.stride() == (2, 1)


def test_new_dense_out_of_memory_is_the_allocators_error():
    allocator.set_memory_limit(1 << 20, 0)
    try:
        with pytest.raises(allocator.DeviceMemoryError, match="cannot allocate"):
            allocator.new_dense((1 << 20,), torch.float32, 4 << 20, 0)
    finally:
        allocator.set_memory_limit(0, 0)


def test_window_results_free_their_memory_when_dropped():
    """Results of an adaptive eager window (made by new_dense) give their memory back once nobody holds them,
    and the window does not write a dropped result."""
    x = torch.randn(64, 64)
    xd = x.to("neuron")
    with windows.eager_mode("adaptive"):
        (xd * 2 + 1).cpu()          # compile once
        gc.collect()
        base = allocator.memory_allocated(0)
        y = torch.tanh(xd * 2 + 1)
        kept = y * 3
        del y
        torch.testing.assert_close(kept.cpu(), torch.tanh(x * 2 + 1) * 3)
        del kept
        gc.collect()
        assert allocator.memory_allocated(0) == base


def test_a_small_op_first_seen_in_adaptive_mode_is_charged_its_own_programs_time_in_op_mode():
    """The small-op fast path (tn.device.fastpath) learns an op's modelled time from the program its first call
    ran; a call queued in an adaptive window ran none, so it must not take the time of whatever program ran last."""
    from tn.device import eager, tracking

    big = torch.randn(64, 64).to("neuron")
    (big @ big).cpu()                                # op mode: the last program run is a matmul
    assert eager.last_program_profile() is not None
    a, b = torch.randn(3, 7, 13).to("neuron"), torch.randn(3, 7, 13).to("neuron")
    with windows.eager_mode("adaptive"):
        torch.testing.assert_close((a + b).cpu(), a.cpu() + b.cpu())
    with tn.profile() as prof:                       # the real program (no fast path under a profile)
        a + b
    (run,) = prof.runs
    a + b                                            # op mode: learns the time (first call outside a profile)
    t0 = tracking.device_time_ns()
    c = a + b                                        # the fast path, charged the learnt time
    assert tracking.device_time_ns() - t0 == pytest.approx(run.total_ns, rel=1e-9)
    torch.testing.assert_close(c.cpu(), a.cpu() + b.cpu())


def test_executable_writes_outputs_into_given_memory_and_windows_skip_the_copy(adaptive, monkeypatch):
    # NeuronExecutable(out=...): a fitting buffer (same dtype and element count, any shape) is the program's output
    # memory; one that does not fit (dtype) is ignored and the output allocated as before
    from tn.lower import compile_ir
    from tn.trace import trace_flat

    def f(x):
        return (x * 2 + 1).reshape(4, 6), x.sum()

    x = torch.randn(6, 4)
    exe = compile_ir(trace_flat(f, [x]).ir)
    want = f(x)
    buf, bad = torch.empty(24), torch.empty((), dtype=torch.float64)
    a, s = exe([x], out=[buf, bad])
    assert a.data_ptr() == buf.data_ptr() and tuple(a.shape) == (4, 6) and s.dtype == torch.float32
    torch.testing.assert_close(a, want[0], rtol=0, atol=0)
    torch.testing.assert_close(buf.reshape(4, 6), want[0], rtol=0, atol=0)
    torch.testing.assert_close(s, want[1])
    # an adaptive window's program writes its results into the results' own memory: no copy after the run
    xd = x.to("neuron")
    y = (xd * 2 + 1).relu()
    windows.flush()            # (compiles the window: tracing copies)
    torch.testing.assert_close(y.cpu(), (x * 2 + 1).relu(), rtol=0, atol=0)
    x2 = torch.randn(6, 4)
    xd2 = x2.to("neuron")
    copies = []
    real = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, *a, **k: (copies.append(1), real(self, src, *a, **k))[1])
    hits = windows.stats()["hits"]
    y = (xd2 * 2 + 1).relu()
    windows.flush()
    assert windows.stats()["hits"] == hits + 1 and not copies
    monkeypatch.undo()
    torch.testing.assert_close(y.cpu(), (x2 * 2 + 1).relu(), rtol=0, atol=0)
