# What an ML engineer does with a model on the neuron device, each compared with the CPU: printing, save/load,
# numpy, pinned memory and DataLoader, seeds and dropout, no_grad/inference_mode, clipping, optimizers,
# copies, strided views, non_blocking, torch.neuron / torch.accelerator functions, convolutions, RNNs, profiling.
import copy
import gc
import io

import pytest
import torch
import torch.nn.functional as F

import tn
from tn.device import eager, fastpath, pinned

NEURON = torch.device("neuron", 0)


def close(a, b, atol=1e-5):
    assert a.device.type == "neuron", a.device
    torch.testing.assert_close(a.cpu(), b, atol=atol, rtol=atol)


# ---------------------------------------------------------------- printing is a host read
def test_printing_runs_no_device_op_even_in_strict_mode(monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")
    eager.clear_cache()
    x = torch.randn(3, 4)
    d = x.to("neuron")
    w = torch.randn(2, device="neuron", requires_grad=True)
    big = torch.randn(3000).to("neuron")
    torch.neuron.reset_op_counts()
    texts = [repr(d), str(d.t()[1:]), repr(d.bfloat16()), repr(big), repr(w), repr(w * 2), str(d[0, 0]),
             repr(torch.nn.Parameter(d)), repr(torch.empty(0, 3, device="neuron")),
             repr(torch.arange(5, device="neuron") > 2), f"{d[0, 0]:.2f}"]
    assert torch.neuron.fallback_ops() == {}
    # only the ops the test itself runs (bfloat16(), w * 2, arange > 2, item() of the format spec)
    assert set(torch.neuron.executed_ops()) <= {"aten::_local_scalar_dense", "aten::gt.Scalar_out",
                                                  "aten::arange.start_out", "aten::mul.Tensor", "aten::_copy_from"}
    assert texts[0] == repr(x).replace(")", ", device='neuron:0')")
    assert "..." in texts[3] and "device='neuron:0'" in texts[3]
    assert "requires_grad=True" in texts[4] and "grad_fn=<MulBackward0>" in texts[5]
    assert "dtype=torch.bfloat16" in texts[2] and "size=(0, 3)" in texts[8]
    assert texts[-1] == f"{x[0, 0].item():.2f}"
    monkeypatch.delenv("TN_STRICT")
    eager.clear_cache()


@pytest.mark.op_mode_only
# ---------------------------------------------------------------- fast path and host fallbacks are visible
def test_fast_path_is_counted_and_profiles_only_hold_real_runs():
    a, b = torch.randn(8, 8).to("neuron"), torch.randn(8, 8).to("neuron")
    a + b  # compiles and runs the program once: arms the fast path for this signature
    torch.neuron.reset_op_counts()
    for _ in range(3):
        a + b
    assert torch.neuron.fastpath_ops() == {"aten::add.Tensor": 3}
    assert torch.neuron.executed_ops()["aten::add.Tensor"] == 3
    assert torch.neuron.device_time_ns() > 0        # charged the program's modelled time
    with tn.profile() as prof:
        for _ in range(3):
            a + b
    assert len(prof.runs) == 3                      # inside a profile every call is a real program run
    assert torch.neuron.fastpath_ops() == {"aten::add.Tensor": 3}
    assert tn.neuron.fastpath_ops is torch.neuron.fastpath_ops
    assert "fastpath_ops" in fastpath.__doc__ and "tn.profile" in fastpath.__doc__


def test_host_fallbacks_show_in_the_profile():
    d = torch.randn(5, 5).to("neuron")
    with tn.profile() as prof:
        torch.unique(d > 0, dim=0)     # bool unique along a dim: still a host op (nonzero runs on the device)
        torch.randn(3, device="neuron")
    assert prof.host_ops.get("aten::unique_dim") == 1 and prof.host_ops.get("aten::normal_") == 1
    assert "aten::unique_dim x1" in prof.table(print_it=False)


# ---------------------------------------------------------------- save / load
def test_save_load_state_dicts_and_map_locations(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).to("neuron")
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.randn(5, 3, device="neuron")).sum().backward()
    opt.step()
    ref = {k: v.cpu() for k, v in m.state_dict().items()}
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, buf)
    for loc in ("neuron", "neuron:0", NEURON, None, lambda s, _loc: s.to(device="neuron")):
        buf.seek(0)
        ck = torch.load(buf, map_location=loc)
        for k, v in ck["model"].items():
            assert v.device == NEURON, (loc, k)
            assert torch.equal(v.cpu(), ref[k])
    buf.seek(0)
    on_cpu = torch.load(buf, map_location={"neuron:0": "cpu"})
    assert all(v.device.type == "cpu" for v in on_cpu["model"].values())
    # a CPU checkpoint straight onto the device, through a file and mmap
    path = tmp_path / "ck.pt"
    torch.save({k: v for k, v in on_cpu["model"].items()}, path)
    sd = torch.load(path, map_location="neuron", mmap=True, weights_only=True)
    assert all(v.device == NEURON for v in sd.values())
    m2 = copy.deepcopy(m)
    m2.load_state_dict(sd)
    opt2 = torch.optim.Adam(m2.parameters(), lr=0.1)
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf)["opt"])
    st = opt2.state[m2[0].weight]
    assert st["exp_avg"].device == NEURON
    assert torch.equal(st["exp_avg"].cpu(), opt.state[m[0].weight]["exp_avg"].cpu())


def test_numpy_needs_cpu_first_with_a_clear_message():
    d = torch.arange(6.0).reshape(2, 3).to("neuron")
    with pytest.raises(TypeError, match=r"Use Tensor.cpu\(\)"):
        d.numpy()
    with pytest.raises(TypeError, match="neuron"):
        __import__("numpy").asarray(d)
    assert d.cpu().numpy().tolist() == d.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert float(d[1, 2]) == 5.0 and int(d[0, 1]) == 1 and bool(d[0, 1])


# ---------------------------------------------------------------- pinned memory, non_blocking, DataLoader
def test_pin_memory_and_non_blocking_copies():
    x = torch.randn(4, 5)
    assert not x.is_pinned()
    p = x.pin_memory()
    assert p.is_pinned() and p.device.type == "cpu" and torch.equal(p, x)
    assert p.pin_memory() is p and p[1:].is_pinned()      # already pinned; views of pinned memory are pinned
    t = x.t().pin_memory()
    assert t.is_pinned() and torch.equal(t, x.t())
    d = p.to("neuron", non_blocking=True)
    assert d.device == NEURON and torch.equal(d.cpu(), x)
    back = d.to("cpu", non_blocking=True)                   # a non-blocking copy to the CPU is synchronous here
    assert back.device.type == "cpu" and torch.equal(back, x)
    assert torch.equal(d.t().to("cpu", non_blocking=True), x.t())
    assert d.to(torch.bfloat16, non_blocking=True).dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):
        d.pin_memory()
    assert not d.is_pinned()
    del p, t
    gc.collect()
    assert pinned.pinned_bytes() == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_with_pin_memory(workers):
    ds = torch.utils.data.TensorDataset(torch.randn(10, 3), torch.arange(10))
    seen = []
    for x, y in torch.utils.data.DataLoader(ds, batch_size=4, pin_memory=True, num_workers=workers):
        assert x.is_pinned() and y.is_pinned()
        xd, yd = x.to("neuron", non_blocking=True), y.to("neuron", non_blocking=True)
        seen.append((xd.sum().item(), yd.tolist()))
    assert [s[1] for s in seen] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


# ---------------------------------------------------------------- randomness, grad modes
def test_manual_seed_makes_dropout_reproducible_and_equal_to_cpu():
    x = torch.ones(64, 32)
    drop = torch.nn.Dropout(0.3)
    torch.manual_seed(7)
    a = drop(x.to("neuron"))
    torch.manual_seed(7)
    b = drop(x.to("neuron"))
    torch.manual_seed(7)
    c = drop(x)
    assert torch.equal(a.cpu(), b.cpu()) and torch.equal(a.cpu(), c)
    torch.neuron.manual_seed(7)
    assert torch.equal(F.dropout(x.to("neuron"), 0.3).cpu(), c)
    drop.eval()
    assert torch.equal(drop(x.to("neuron")).cpu(), x)
    state = torch.neuron.get_rng_state()
    r1 = torch.rand(5, device="neuron")
    torch.neuron.set_rng_state(state)
    assert torch.equal(torch.rand(5, device="neuron").cpu(), r1.cpu())


def test_no_grad_and_inference_mode():
    w = torch.randn(3, 3, device="neuron", requires_grad=True)
    x = torch.randn(2, 3, device="neuron")
    with torch.no_grad():
        y = x @ w
    assert not y.requires_grad and y.grad_fn is None
    with torch.inference_mode():
        z = (x @ w).relu()
    assert z.is_inference() and not z.requires_grad
    close(z, (x.cpu() @ w.detach().cpu()).relu())
    with pytest.raises(RuntimeError, match="Inference tensors"):
        (z * w).sum().backward()
    (x @ w).sum().backward()
    close(w.grad, x.cpu().sum(0, keepdim=True).t().expand(3, 3).contiguous())


# ---------------------------------------------------------------- clipping and optimizers
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("norm_type", [2.0, "inf"])
def test_clip_grad_norm_and_value_match_cpu(foreach, norm_type):
    torch.manual_seed(2)
    grads = [torch.randn(4, 3) * 3, torch.randn(5) * 3]
    pc = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    pd = [torch.nn.Parameter(torch.zeros_like(g).to("neuron")) for g in grads]
    for p, q, g in zip(pc, pd, grads):
        p.grad, q.grad = g.clone(), g.to("neuron")
    nt = float(norm_type)
    tc = torch.nn.utils.clip_grad_norm_(pc, 1.0, norm_type=nt, foreach=foreach)
    td = torch.nn.utils.clip_grad_norm_(pd, 1.0, norm_type=nt, foreach=foreach)
    close(td, tc)
    for p, q in zip(pc, pd):
        close(q.grad, p.grad)
    torch.nn.utils.clip_grad_value_(pc, 0.1, foreach=foreach)
    torch.nn.utils.clip_grad_value_(pd, 0.1, foreach=foreach)
    for p, q in zip(pc, pd):
        close(q.grad, p.grad)


OPTIMIZERS = [
    ("adam_foreach", lambda p: torch.optim.Adam(p, lr=0.1, foreach=True)),
    ("adamw_amsgrad_foreach", lambda p: torch.optim.AdamW(p, lr=0.1, amsgrad=True, foreach=True)),
    ("sgd_nesterov_foreach", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, foreach=True)),
    ("rmsprop_foreach", lambda p: torch.optim.RMSprop(p, lr=0.01, foreach=True)),
    ("adam_fused", lambda p: torch.optim.Adam(p, lr=0.1, fused=True)),
    ("adamw_fused", lambda p: torch.optim.AdamW(p, lr=0.1, fused=True)),
    ("sgd_fused", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True)),
    ("adagrad_fused", lambda p: torch.optim.Adagrad(p, lr=0.1, fused=True)),
]


@pytest.mark.parametrize("name,make", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_foreach_and_fused_optimizers_match_cpu(name, make):
    torch.manual_seed(3)
    init, grad = torch.randn(6, 4), torch.randn(6, 4)
    pc, pd = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.to("neuron"))
    oc, od = make([pc]), make([pd])
    torch.neuron.reset_op_counts()
    for k in range(3):
        pc.grad, pd.grad = grad * (k + 1), (grad * (k + 1)).to("neuron")
        oc.step()
        od.step()
    close(pd.detach(), pc.detach())
    fb = torch.neuron.fallback_ops()
    if "fused" in name:
        # fused kernels run on the host (counted, with the way out in the reason)
        (op,) = [k for k in fb if k.startswith("aten::_fused_")]
        assert "foreach=True" in torch.neuron.fallback_reasons()[op]
    else:
        assert not any(k.startswith("aten::_f") for k in fb), fb


def test_fused_optimizer_in_strict_mode_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")
    eager.clear_cache()
    p = torch.nn.Parameter(torch.randn(3, device="neuron"))
    p.grad = torch.ones(3, device="neuron")
    with pytest.raises(tn.UnsupportedOpError, match="foreach=True"):
        torch.optim.Adam([p], lr=0.1, fused=True).step()
    torch.optim.Adam([p], lr=0.1, foreach=True).step()   # the default path runs on the NeuronCore
    monkeypatch.delenv("TN_STRICT")
    eager.clear_cache()


# ---------------------------------------------------------------- copies, views, strides
def test_copy_across_devices_dtypes_and_broadcasts():
    x = torch.randn(3, 4)
    d = torch.empty(3, 4, device="neuron")
    assert d.copy_(x) is d
    close(d, x)
    c = torch.empty(3, 4, dtype=torch.float64)
    c.copy_(d)
    assert torch.equal(c, x.double())
    b = torch.empty(3, 4, device="neuron", dtype=torch.bfloat16).copy_(torch.arange(4))
    close(b, torch.arange(4).to(torch.bfloat16).expand(3, 4))
    t = torch.zeros(4, 3, device="neuron")
    t.t().copy_(d)                                   # strided destination on the device
    close(t, x.t())
    e = torch.zeros(2, 4, device="neuron")
    e.copy_(d[1:])                                   # device to device from a view
    close(e, x[1:])
    h = torch.zeros(4, 3)
    h.copy_(d.t())                                   # strided source on the device
    assert torch.equal(h, x.t())


def test_non_contiguous_views_and_as_strided():
    x = torch.arange(24.0).reshape(4, 6)
    d = x.to("neuron")
    v, vc = d.as_strided((3, 2), (1, 6), 2), x.as_strided((3, 2), (1, 6), 2)
    assert v.untyped_storage().data_ptr() == d.untyped_storage().data_ptr()
    close(v, vc)
    close(v * 2 + 1, vc * 2 + 1)
    close(d.t()[1:, ::2].sum(0), x.t()[1:, ::2].sum(0))
    close(d[:, 1:4].t() @ d[:, :2], x[:, 1:4].t() @ x[:, :2])
    close(d[:1].expand(3, 6) + d[1:], x[:1].expand(3, 6) + x[1:])
    close(d.t().contiguous(), x.t().contiguous())
    assert d.t().contiguous().is_contiguous()
    v.mul_(-1)                                       # in place through an as_strided view writes the base
    vc.mul_(-1)
    close(d, x)
    torch.as_strided(d, (2, 2), (6, 1), 7).fill_(100)
    torch.as_strided(x, (2, 2), (6, 1), 7).fill_(100)
    close(d, x)


# ---------------------------------------------------------------- module functions
def test_torch_neuron_module_functions():
    n = torch.neuron
    assert n.is_available() and n.device_count() == 4 and n.current_device() == 0 and n.is_initialized()
    n.synchronize()
    n.synchronize("neuron:0")
    gc.collect()
    n.empty_cache()
    before = n.memory_allocated()
    t = torch.empty(1 << 16, device="neuron")
    assert n.memory_allocated() >= before + (1 << 18)
    assert n.max_memory_allocated() >= n.memory_allocated() and n.memory_reserved() >= n.memory_allocated()
    del t
    gc.collect()
    assert n.memory_allocated() == before
    n.empty_cache()
    assert n.memory_reserved() == n.memory_allocated()
    n.reset_peak_memory_stats()
    assert n.max_memory_allocated() == n.memory_allocated()
    free, total = n.mem_get_info()
    assert 0 <= free <= total and total > 0
    props = n.get_device_properties(0)
    assert props.total_memory == total and "NeuronCore" in props.name == n.get_device_name()
    assert n.is_bf16_supported() and torch.bfloat16 in n.get_amp_supported_dtype()
    with pytest.raises(RuntimeError, match="neuron:4 does not exist"):
        n.set_device(4)
    with n.device(0):
        pass


def test_torch_accelerator_functions():
    acc = torch.accelerator
    assert acc.current_accelerator().type == "neuron" and acc.device_count() == 4 and acc.is_available()
    acc.synchronize()
    gc.collect()
    t = torch.empty(1000, device="neuron")
    assert acc.memory_allocated() == torch.neuron.memory_allocated() > 0
    assert acc.memory_stats()["allocated_bytes.all.current"] == acc.memory_allocated()
    assert acc.max_memory_allocated() >= acc.memory_allocated() and acc.memory_reserved() >= acc.memory_allocated()
    acc.reset_peak_memory_stats()
    acc.empty_cache()
    assert acc.get_memory_info() == torch.neuron.mem_get_info() or acc.get_memory_info()[1] > 0
    with pytest.raises(tn.TnError, match="does not track"):
        acc.max_memory_reserved()
    del t


# ---------------------------------------------------------------- convolutions and RNNs
CONVS = [
    (lambda: torch.nn.Conv2d(3, 4, 3, padding=1), (2, 3, 9, 9)),
    (lambda: torch.nn.Conv2d(4, 8, 3, stride=2, groups=2, bias=False), (2, 4, 9, 9)),
    (lambda: torch.nn.Conv1d(3, 4, 5, dilation=2), (2, 3, 20)),
    (lambda: torch.nn.ConvTranspose2d(3, 4, 3, stride=2, output_padding=1), (2, 3, 5, 5)),
]


@pytest.mark.parametrize("k", range(len(CONVS)))
def test_convolutions_forward_backward_match_cpu(k):
    make, shape = CONVS[k]
    torch.manual_seed(k)
    m = make()
    md = copy.deepcopy(m).to("neuron")
    x = torch.randn(*shape, requires_grad=True)
    xd = x.detach().to("neuron").requires_grad_()
    torch.neuron.reset_op_counts()
    y, yd = m(x), md(xd)
    close(yd, y.detach(), atol=1e-4)
    y.square().sum().backward()
    yd.square().sum().backward()
    close(xd.grad, x.grad, atol=1e-3)
    for p, q in zip(m.parameters(), md.parameters()):
        close(q.grad, p.grad, atol=1e-3)
    assert torch.neuron.fallback_ops() == {}   # forward and backward ran as NeuronCore programs


RNNS = [
    (lambda: torch.nn.LSTM(4, 5, num_layers=2, batch_first=True), (2, 3, 4)),
    (lambda: torch.nn.GRU(4, 5, bidirectional=True), (3, 2, 4)),
    (lambda: torch.nn.RNN(4, 5), (3, 2, 4)),
    (lambda: torch.nn.LSTMCell(4, 5), (3, 4)),
    (lambda: torch.nn.GRUCell(4, 5, bias=False), (3, 4)),
]


@pytest.mark.parametrize("k", range(len(RNNS)))
def test_rnns_forward_backward_match_cpu(k):
    make, shape = RNNS[k]
    torch.manual_seed(k)
    m = make()
    x = torch.randn(*shape, requires_grad=True)
    y = m(x)                         # the CPU graph still holds the parameters while the module moves
    md = copy.deepcopy(m)
    params = list(md.parameters())
    md.to("neuron")
    assert all(p is q and p.device == NEURON for p, q in zip(params, md.parameters()))
    xd = x.detach().to("neuron").requires_grad_()
    torch.neuron.reset_op_counts()
    yd = md(xd)
    first, first_d = (y[0], yd[0]) if isinstance(y, tuple) else (y, yd)
    close(first_d, first.detach(), atol=1e-5)
    first.square().sum().backward()
    first_d.square().sum().backward()
    close(xd.grad, x.grad, atol=1e-4)
    for p, q in zip(m.parameters(), md.parameters()):
        close(q.grad, p.grad, atol=1e-4)
    assert torch.neuron.fallback_ops() == {}


def test_module_to_keeps_parameters_while_a_graph_holds_them():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    m[1].weight.grad = torch.ones(2, 4)
    keep = m(torch.randn(3, 4))          # an un-backwarded graph referencing the parameters
    ps = list(m.parameters())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m.to("neuron")
    assert all(p is q for p, q in zip(ps, m.parameters()))
    assert m[1].weight.grad.device == NEURON
    m(torch.randn(3, 4, device="neuron")).sum().backward()
    opt.step()                           # the optimizer's references are the moved parameters
    m.to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and p.device == NEURON for p in m.parameters())
    m.cpu().float()
    assert all(p is q and p.device.type == "cpu" for p, q in zip(ps, m.parameters()))
    del keep


# ---------------------------------------------------------------- Python scalars promote as wrapped numbers
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int32, torch.int8, torch.bool])
def test_python_scalars_with_zero_dim_tensors_promote_as_on_cpu(dtype):
    """``x + 1.0`` of a 0-dim bf16 device tensor is bf16, as on the CPU: the boxed fallback hands the device a
    Python number where the schema wants a Tensor, and a 0-dim float32 tensor in its place would promote
    against the 0-dim operand as its equal (float32)."""
    x = torch.tensor(3, dtype=dtype)
    d = x.to("neuron")
    pairs = [(d + 1, x + 1), (d + 1.25, x + 1.25), (d * 2, x * 2),
             (torch.maximum(d, torch.tensor(2, dtype=dtype, device="neuron")) + 1,
              torch.maximum(x, torch.tensor(2, dtype=dtype)) + 1)]
    if dtype != torch.bool:     # torch refuses bool subtraction
        pairs.append((d - 0.5, x - 0.5))
    for got, want in pairs:
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        torch.testing.assert_close(got.cpu(), want)
    if dtype.is_floating_point:
        y = torch.tensor(0.5, dtype=dtype)
        got = torch.nn.functional.margin_ranking_loss(d, y.to("neuron"), torch.tensor(1.0, dtype=dtype, device="neuron"))
        want = torch.nn.functional.margin_ranking_loss(x, y, torch.tensor(1.0, dtype=dtype))
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.cpu(), want)
