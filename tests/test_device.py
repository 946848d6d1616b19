# Tests of the `neuron` torch device: registration, memory, transfers, views, eager ops vs CPU, save/load, tracking.
import io

import pytest
import torch

import tn
from tn.device import allocator, eager

NEURON = torch.device("neuron", 0)


def close(a, b, dtype=torch.float32):
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}.get(dtype, 1e-5)
    a = a.cpu() if isinstance(a, torch.Tensor) else torch.tensor(a)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    if a.is_floating_point():
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    else:
        assert torch.equal(a, b)


def test_private_torch_apis_exist():
    # the device rests on experimental torch APIs: fail loudly if a torch upgrade removes one
    import torch.utils.backend_registration as br

    assert hasattr(br, "_setup_privateuseone_for_python_backend")
    assert hasattr(torch._C, "_construct_storage_from_data_pointer")
    assert hasattr(torch._C._acc, "create_empty_tensor")
    assert hasattr(br, "_DummyPrivateUse1Hook") and hasattr(br, "_DummyDeviceGuard")


def test_registration():
    assert torch._C._get_privateuse1_backend_name() == "neuron"
    assert torch.neuron.is_available() and torch.neuron.device_count() == tn.neuron.machine.machine().device_count
    assert torch.neuron.current_device() == 0
    torch.neuron.synchronize()
    x = torch.ones(2).neuron()
    assert x.is_neuron and x.device == NEURON and type(x) is torch.Tensor
    for fn in ("memory_allocated", "max_memory_allocated", "memory_reserved", "reset_peak_memory_stats",
               "empty_cache", "executed_ops", "fallback_ops"):
        assert callable(getattr(torch.neuron, fn))
    assert callable(tn.neuron.fallback_ops) and callable(tn.neuron.executed_ops)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int32, torch.bool])
def test_to_and_cpu_roundtrip(dtype):
    x = (torch.randn(5, 7) * 10).to(dtype)
    d = x.to("neuron")
    assert d.device == NEURON and d.dtype == dtype
    close(d, x, dtype)
    close(x.to("neuron").to("neuron").cpu(), x, dtype)


def test_storage_is_device_memory():
    d = torch.randn(4, 4).to("neuron")
    before = allocator.stats()["allocated"]
    e = torch.empty(100, device="neuron")
    assert allocator.stats()["allocated"] >= before + 400
    assert e.data_ptr() % 64 == 0
    # the program runtime binds device tensors by pointer
    assert d.untyped_storage().device == NEURON


def test_factories():
    close(torch.zeros(3, 2, device="neuron"), torch.zeros(3, 2))
    close(torch.ones(4, device="neuron", dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16), torch.bfloat16)
    close(torch.full((2, 3), 7.5, device="neuron"), torch.full((2, 3), 7.5))
    close(torch.arange(10, device="neuron"), torch.arange(10))
    close(torch.arange(0, 1, 0.25, device="neuron"), torch.arange(0, 1, 0.25))
    assert torch.empty(2, 3, device="neuron").shape == (2, 3)
    close(torch.eye(3, device="neuron"), torch.eye(3))
    # random ops draw from torch's CPU generator: same numbers as on the CPU
    torch.manual_seed(3)
    r = torch.randn(6, device="neuron")
    u = torch.rand(2, 2, device="neuron")
    torch.manual_seed(3)
    close(r, torch.randn(6))
    close(u, torch.rand(2, 2))


def test_views_alias():
    x = torch.arange(12.0).reshape(3, 4)
    d = x.to("neuron")
    base = d.untyped_storage().data_ptr()
    for v in (d.t(), d.view(4, 3), d[1:, ::2], d[1], d.unsqueeze(0), d.permute(1, 0), d.transpose(0, 1),
              d[:1].expand(5, 4), d.detach(), d.reshape(12), d.narrow(1, 1, 2), d.diagonal(), d.unfold(1, 2, 1)):
        assert v.device == NEURON
        assert v.untyped_storage().data_ptr() == base
    close(d.t(), x.t())
    close(d[1:, ::2], x[1:, ::2])
    close(d.diagonal(), x.diagonal())
    parts = d.split(2, dim=1)
    assert all(p.untyped_storage().data_ptr() == base for p in parts)
    close(parts[1], x.split(2, dim=1)[1])
    # writes through a view land in the base
    d[1:, 1:3].mul_(10)
    x[1:, 1:3].mul_(10)
    close(d, x)
    d.t()[0].fill_(-1)
    x.t()[0].fill_(-1)
    close(d, x)


def test_inplace_and_out():
    x = torch.randn(4, 6)
    d = x.to("neuron")
    r = d.add_(1.5)
    assert r is d
    close(d, x + 1.5)
    o = torch.empty(4, 6, device="neuron")
    r = torch.mul(d, 3, out=o)
    assert r is o
    close(o, (x + 1.5) * 3)
    # out= into an empty tensor resizes it
    o2 = torch.empty(0, device="neuron")
    torch.abs(d, out=o2)
    close(o2, (x + 1.5).abs())
    vals = torch.empty(4, device="neuron")
    idx = torch.empty(4, dtype=torch.int64, device="neuron")
    torch.max(d, 1, out=(vals, idx))
    m = (x + 1.5).max(1)
    close(vals, m.values)
    close(idx, m.indices)


def test_ops_match_cpu():
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(16, 8)
    dx, dy = x.to("neuron"), y.to("neuron")
    close(dx @ dy, x @ y)
    close(dx.sum(1), x.sum(1))
    close(dx.softmax(-1), x.softmax(-1))
    close(torch.relu(dx), torch.relu(x))
    close(torch.nn.functional.gelu(dx), torch.nn.functional.gelu(x))
    close(torch.where(dx > 0, dx, -dx), torch.where(x > 0, x, -x))
    close(torch.cat([dx, dx], 0), torch.cat([x, x], 0))
    close(dx.max(), x.max())
    close(dx.argmax(1), x.argmax(1))
    close(dx[torch.tensor([0, 3]).to("neuron")], x[torch.tensor([0, 3])])
    close(dx * 2 + 1, x * 2 + 1)
    close((dx.to(torch.bfloat16) @ dy.to(torch.bfloat16)), x.bfloat16() @ y.bfloat16(), torch.bfloat16)
    i = torch.randint(0, 100, (10,))
    close(i.to("neuron") % 7, i % 7)
    close(dx.t().contiguous(), x.t().contiguous())


def test_item_and_printing():
    d = torch.tensor([1.5, -2.0]).to("neuron")
    assert d[0].item() == pytest.approx(1.5)
    s = repr(d)
    assert "device='neuron:0'" in s and "1.5" in s


def test_module_to_keeps_parameters_and_tying():
    m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    m[1].weight = m[0].weight  # tied (like GPT-2's lm_head / wte)
    w = m[0].weight
    m.to("neuron")
    assert m[0].weight is w and m[1].weight is m[0].weight
    assert isinstance(w, torch.nn.Parameter) and w.device == NEURON
    m.cpu()
    assert m[0].weight is w and w.device.type == "cpu"


def test_state_dict_save_load():
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    ref = {k: v.clone() for k, v in m.state_dict().items()}
    m.to("neuron")
    sd = m.state_dict()
    assert all(v.device == NEURON for v in sd.values())
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    on_cpu = torch.load(buf, map_location="cpu")
    for k in ref:
        close(on_cpu[k], ref[k])
    buf.seek(0)
    on_dev = torch.load(buf, map_location="neuron")
    for k in ref:
        assert on_dev[k].device == NEURON
        close(on_dev[k], ref[k])
    buf.seek(0)
    kept = torch.load(buf)  # saved on neuron: comes back on neuron
    assert kept["weight"].device == NEURON
    m2 = torch.nn.Linear(3, 2).to("neuron")
    m2.load_state_dict(on_cpu)
    close(m2.weight, ref["weight"])
    s = torch.UntypedStorage(32, device="neuron")
    assert s.device == NEURON and s.nbytes() == 32


def test_bad_device_index_and_mixing():
    bad = f"neuron:{torch.neuron.device_count()}"   # one past the modelled machine's last device
    with pytest.raises(RuntimeError, match=bad):
        torch.zeros(2, device=bad)
    with pytest.raises(RuntimeError, match=bad):
        torch.ones(2).to(bad)
    with pytest.raises(RuntimeError, match=bad):
        torch.UntypedStorage(8, device=bad)
    with pytest.raises(Exception, match="device_count"):
        buf = io.BytesIO()
        torch.save(torch.ones(2), buf)
        buf.seek(0)
        torch.load(buf, map_location=bad)
    with pytest.raises((tn.TnError, RuntimeError), match="device"):
        torch.add(torch.ones(3).to("neuron"), torch.ones(3))
    # a 0-dim CPU tensor mixes in, as with CUDA
    close(torch.ones(3).to("neuron") * torch.tensor(2.0), torch.full((3,), 2.0))


def test_op_tracking_and_strict(monkeypatch):
    torch.neuron.reset_op_counts()
    d = torch.randn(5, 5).to("neuron")
    (d + d).sum()
    ex = torch.neuron.executed_ops()
    assert ex.get("aten::add.Tensor", 0) >= 1
    assert "aten::add.Tensor" not in torch.neuron.fallback_ops()
    # data-dependent shape: a padded device program and its count read back (tn.device.data_dependent)
    nz = torch.nonzero(d > 0)
    close(nz, torch.nonzero(d.cpu() > 0))
    assert "aten::nonzero" not in torch.neuron.fallback_ops()
    # an op without a device program (unique of a bool tensor along a dim) runs on the host, counted
    close(torch.unique(d > 0, dim=0), torch.unique(d.cpu() > 0, dim=0))
    assert torch.neuron.fallback_ops().get("aten::unique_dim", 0) >= 1
    assert "aten::unique_dim" in torch.neuron.fallback_reasons()
    monkeypatch.setenv("TN_STRICT", "1")
    eager.clear_cache()
    with pytest.raises(tn.UnsupportedOpError, match="unique_dim"):
        torch.unique(d > 0, dim=0)
    # random numbers always come from the host generator (documented), strict or not
    assert torch.randn(3, device="neuron").shape == (3,)
    monkeypatch.delenv("TN_STRICT")
    eager.clear_cache()


@pytest.mark.op_mode_only
def test_one_op_programs_are_cached_and_profiled():
    d = torch.randn(6, 10).to("neuron")
    e = torch.randn(6, 10).to("neuron")
    d + e
    info = eager.cache_info()
    with tn.profile() as prof:
        d + e
        d * e
    assert eager.cache_info()["misses"] == info["misses"] + 1  # add was cached; mul compiled once
    assert len(prof.runs) == 2
    assert all(r.hbm_read_bytes >= 2 * 6 * 10 * 4 and r.hbm_write_bytes >= 6 * 10 * 4 for r in prof.runs)
    assert "add" in prof.table(print_it=False)


def test_allocator_reuse_stats_and_limit():
    s0 = allocator.stats()
    t = torch.empty(1000, device="neuron")
    del t
    t = torch.empty(1000, device="neuron")
    s1 = allocator.stats()
    assert s1["cache_hits"] > s0["cache_hits"]
    assert torch.neuron.memory_reserved() >= torch.neuron.memory_allocated()
    torch.neuron.reset_peak_memory_stats()
    assert torch.neuron.max_memory_allocated() == torch.neuron.memory_allocated()
    del t
    torch.neuron.empty_cache()
    try:
        allocator.set_memory_limit(torch.neuron.memory_reserved() + 4096)
        with pytest.raises(allocator.DeviceMemoryError, match="cannot allocate"):
            torch.empty(1 << 20, device="neuron")
    finally:
        allocator.set_memory_limit(0)


def test_native_free_checks_pointers():
    from tn._native._kernels import ffi, lib

    p = lib.tn_dev_alloc(100)
    assert lib.tn_dev_block_bytes(p) >= 100
    assert lib.tn_dev_free(p) == 0
    assert lib.tn_dev_free(p) != 0          # double free reported, not a crash
    assert lib.tn_dev_free(ffi.NULL) != 0


@pytest.mark.op_mode_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("opname", ["add", "sub", "mul"])
def test_fast_path_matches_cpu_and_program(dtype, opname):
    from tn.device import fastpath

    torch.manual_seed(5)
    x, y = torch.randn(4, 4).to(dtype), torch.randn(4, 4).to(dtype)
    dx, dy = x.to("neuron"), y.to("neuron")
    f = getattr(torch, opname)
    first = f(dx, dy)  # compiles and runs the one-op program
    t0 = torch.neuron.device_time_ns()
    fast = f(dx, dy)   # fast path
    assert torch.neuron.device_time_ns() > t0  # charged the program's modelled time
    close(first, f(x, y), dtype)
    close(fast, f(x, y), dtype)
    assert torch.equal(fast.cpu(), first.cpu())  # same arithmetic as the NeuronCore program
    with tn.profile() as prof:     # profiling: real program runs
        f(dx, dy)
    assert len(prof.runs) == 1
    fastpath.set_enabled(False)
    try:
        close(f(dx, dy), f(x, y), dtype)
    finally:
        fastpath.set_enabled(True)


@pytest.mark.op_mode_only
def test_fast_path_falls_back_for_other_cases():
    x = torch.randn(4, 4)
    d = x.to("neuron")
    close(d + 1, x + 1)                               # scalar
    close(torch.add(1, d[0]), torch.add(1, x[0]))     # scalar first (arrives unwrapped)
    close(torch.mul(2.5, d), torch.mul(2.5, x))
    close(d + d[0], x + x[0])                         # broadcast
    close(d.t() + d, x.t() + x)                       # non-contiguous
    close(torch.add(d, d, alpha=2), torch.add(x, x, alpha=2))
    i = torch.arange(16).reshape(4, 4)
    close(i.to("neuron") * i.to("neuron"), i * i)      # int64: no fast kernel
    w = d.clone().requires_grad_()
    (w * w).sum().backward()                          # autograd through the fast kernels
    close(w.grad, 2 * x)
