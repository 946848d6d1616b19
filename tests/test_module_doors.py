# nn modules that tn.jit or torch.compile(backend="neuron") could not take (module_db sweep, issue 17), forward and backward.
import copy

import pytest
import torch
import torch.nn.functional as F

import tn
import tn.lower  # noqa: F401  (registers the lowerings and the neuron backend)


def _grads_through_jit(fn, *inputs):
    """``fn``'s result and the gradients of ``sum(out * w)`` by the inputs, computed inside tn.jit and eagerly."""
    inputs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    g = torch.Generator().manual_seed(1)
    w = torch.randn(fn(*inputs).shape, generator=g)
    wanted = [x for x in inputs if x.requires_grad]

    def step(*xs):
        out = fn(*xs)
        return out, torch.autograd.grad((out * w).sum(), [x for x in xs if x.requires_grad])

    want = step(*inputs)
    got = tn.jit(step)(*inputs)
    assert len(wanted) == len(want[1])
    return got, want


def _assert_close(got, want, **kw):
    torch.testing.assert_close(got[0], want[0], **kw)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, **kw)


# --------------------------------------------------------------------------- recurrent layers


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN])
def test_recurrent_layers_train_through_jit(cls):
    """LSTM used to stop tn.jit at aten.mkldnn_rnn_layer (oneDNN's fused layer); traced, it takes the cells."""
    torch.manual_seed(0)
    m = cls(3, 4, num_layers=2, bidirectional=True)
    names = [n for n, _ in m.named_parameters()]

    def fn(x, *params):
        return torch.func.functional_call(m, dict(zip(names, params)), (x,))[0]

    got, want = _grads_through_jit(fn, torch.randn(5, 2, 3), *[p.detach() for p in m.parameters()])
    _assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN])
def test_recurrent_layers_reach_the_compile_door(cls):
    """Dynamo graph-broke on every RNN/GRU/LSTM module (allow_rnn is off by default): they ran outside tn."""
    from tn import dynamo_backend

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = cls(3, 4, num_layers=2)
    x = torch.randn(5, 2, 3, requires_grad=True)
    want = m(x)[0]
    (want * 2).sum().backward()
    want_grads = [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    x.grad = None
    m.zero_grad()
    before = dynamo_backend.graphs_compiled()
    got = torch.compile(m, backend="neuron")(x)[0]
    (got * 2).sum().backward()
    assert dynamo_backend.graphs_compiled() - before == 2     # one forward and one backward graph: no break
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip([x.grad] + [p.grad for p in m.parameters()], want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- gradients that had no decomposition


_PADS = {
    "1d": ((3, 1, 6), (2, 3)),
    "1d-size1": ((2, 1, 1), (2, 1)),
    "2d": ((2, 3, 4, 5), (1, 2, 0, 3)),
    "2d-size2": ((1, 2, 2, 2), (3, 1, 2, 2)),
    "3d": ((1, 2, 3, 4, 5), (1, 0, 2, 1, 0, 2)),
    "2d-crop": ((1, 3, 4, 4), (-1, 1, -2, 1)),
    "2d-crop-all": ((2, 3, 4, 4), (-4, 5, 0, 0)),
}


@pytest.mark.parametrize("case", sorted(_PADS))
def test_replication_pad_gradient_through_jit(case):
    shape, pad = _PADS[case]
    got, want = _grads_through_jit(lambda x: F.pad(x, pad, mode="replicate"), torch.randn(shape))
    _assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", [dict(kernel_size=2), dict(kernel_size=3, stride=1, padding=1),
                                dict(kernel_size=(2, 3, 2), stride=(1, 2, 1), dilation=(1, 1, 2), ceil_mode=True)])
def test_max_pool3d_gradient_through_jit(kw):
    x = torch.randn(2, 3, 5, 6, 7)
    got, want = _grads_through_jit(lambda x: F.max_pool3d(x, **kw), x)
    _assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("rows", [0, 4])
def test_multi_margin_loss_gradient_through_jit(p, reduction, weighted, rows):
    g = torch.Generator().manual_seed(0)
    x = torch.randn((rows, 6) if rows else (6,), generator=g)
    t = torch.randint(0, 6, (rows,) if rows else (), generator=g)
    w = torch.rand(6, generator=g) + 0.5 if weighted else None
    got, want = _grads_through_jit(
        lambda x: F.multi_margin_loss(x, t, p=p, margin=0.7, weight=w, reduction=reduction), x)
    _assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fn", [lambda x: F.pad(x, (1, 2, 2, 1), mode="replicate"),
                                lambda x: F.max_pool3d(x.view(1, 2, 3, 4, 4), 2, stride=1)],
                         ids=["replication_pad2d", "max_pool3d"])
def test_gradients_through_the_compile_door(fn):
    from tn import dynamo_backend

    torch._dynamo.reset()
    x = torch.randn(2, 6, 8, requires_grad=True)
    want = torch.autograd.grad((fn(x) ** 2).sum(), x)[0]
    before = dynamo_backend.graphs_compiled()
    got = torch.autograd.grad((torch.compile(fn, backend="neuron")(x) ** 2).sum(), x)[0]
    assert dynamo_backend.graphs_compiled() - before == 2
    torch.testing.assert_close(got, want)


# --------------------------------------------------------------------------- fractional max pooling

_FRACTIONAL = {
    "2d": ((2, 3, 9, 11), (2, 3), (4, 5)),
    "2d-unbatched": ((3, 10, 7), (3, 2), (5, 3)),
    "2d-one-output": ((2, 2, 6, 6), (2, 2), (1, 3)),
    "3d": ((2, 2, 7, 8, 9), (2, 3, 2), (3, 4, 5)),
    "3d-unbatched": ((4, 5, 5, 5), (2, 2, 2), (2, 2, 2)),
}


@pytest.mark.parametrize("case", sorted(_FRACTIONAL))
def test_fractional_max_pool_matches_torch_exactly(case):
    """torch's windows (drawn from the samples in the input's dtype) and its flat indices, bit for bit; the
    gradient scatters to them."""
    shape, k, o = _FRACTIONAL[case]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=g)
    d = len(k)
    s = torch.rand((shape[0] if len(shape) == d + 2 else 1, shape[-d - 1], d), generator=g)
    op = torch.ops.aten.fractional_max_pool2d if d == 2 else torch.ops.aten.fractional_max_pool3d
    want = op(x, k, o, s)
    got = tn.jit(lambda x, s: op(x, k, o, s))(x, s)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    got, want = _grads_through_jit(lambda x: op(x, k, o, s)[0], x)
    _assert_close(got, want, rtol=0, atol=0)


def test_fractional_max_pool_module_with_batched_samples_on_unbatched_input():
    """module_db's case: samples drawn for a batch of 2, the input unbatched."""
    g = torch.Generator().manual_seed(4)
    m = torch.nn.FractionalMaxPool3d(2, output_ratio=0.5,
                                     _random_samples=torch.rand(2, 4, 3, generator=g))
    x = torch.randn(4, 5, 5, 5, generator=g)
    torch.testing.assert_close(tn.jit(m)(x), m(x), rtol=0, atol=0)


# --------------------------------------------------------------------------- refusals by design


@pytest.mark.parametrize("case", ["gaussian_nll", "batchnorm_cumulative"])
def test_value_reads_inside_torch_are_refused_naming_the_library_line(case):
    """GaussianNLLLoss checks ``torch.any(var < 0)`` and BatchNorm(momentum=None) divides by
    ``float(num_batches_tracked)``: Python reading a tensor's value, refused under ``tn.jit(fullgraph=True)``
    with an error that names torch's line, not only the user's call; run split at the read otherwise."""
    if case == "gaussian_nll":
        fn, args, where = torch.nn.GaussianNLLLoss(), (torch.randn(3), torch.randn(3), torch.rand(3)), \
            "torch/nn/functional.py"
    else:
        fn, args, where = torch.nn.BatchNorm1d(3, momentum=None), (torch.randn(4, 3),), \
            "torch/nn/modules/batchnorm.py"
    with pytest.raises(tn.TracingError) as err:
        tn.jit(fn, fullgraph=True)(*args)
    msg = str(err.value)
    assert "test_module_doors.py:" in msg and f"read in {where}:" in msg and "in one program" in msg
    # without fullgraph, tn.jit runs the module split at the read, on the device: eager's results and buffers
    ref = copy.deepcopy(fn)
    want = ref(*args)
    got = tn.jit(fn)(*args)
    torch.testing.assert_close(got, want)
    for (name, b), (_, rb) in zip(fn.named_buffers(), ref.named_buffers()):
        torch.testing.assert_close(b, rb, msg=name)   # BatchNorm's running statistics written back
