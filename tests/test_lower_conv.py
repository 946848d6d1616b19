# Tests of the convolution and pooling lowerings (tn/lower/conv.py) against torch on CPU.
import pytest
import torch

pytest.importorskip("tn.lower.base")
from tn.lower.testing import check_lowering  # noqa: E402


def _conv(x, w, b=None, stride=1, padding=0, dilation=1, groups=1, **tol):
    nd = x.dim() - 2
    t = lambda v: (v,) * nd if isinstance(v, int) else tuple(v)  # noqa: E731
    ins = (x, w) if b is None else (x, w, b)
    return check_lowering("convolution", *ins, stride=t(stride), padding=t(padding), dilation=t(dilation),
                          transposed=False, output_padding=t(0), groups=groups, **tol)


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("case", [
    # (x shape, w shape, bias, stride, padding, dilation, groups)
    ((2, 3, 8, 8), (4, 3, 3, 3), False, 1, 0, 1, 1),
    ((2, 3, 8, 8), (4, 3, 3, 3), True, 1, 1, 1, 1),
    ((2, 16, 10, 9), (8, 16, 3, 3), True, 2, 1, 1, 1),
    ((1, 20, 12, 12), (8, 5, 3, 3), False, 1, (2, 1), (2, 1), 4),
    ((2, 8, 9, 9), (8, 1, 3, 3), True, 1, 1, 1, 8),          # depthwise
    ((2, 150, 7, 7), (130, 150, 1, 1), True, 1, 0, 1, 1),    # > 128 channels both ways, 1x1
    ((1, 4, 5, 40), (3, 4, 2, 5), True, (1, 3), (0, 2), 1, 1),  # non-square everything
    ((1, 1, 1, 1), (1, 1, 1, 1), False, 1, 0, 1, 1),
    ((1, 2, 30, 30), (3, 2, 3, 3), True, 1, 1, 1, 1),        # 900 pixels: several row blocks
    ((1, 2, 3, 600), (2, 2, 1, 3), False, 1, (0, 1), 1, 1),   # width > 512: column blocks
    ((1, 3, 20, 20), (4, 3, 7, 7), True, 2, 3, 1, 1),        # 7x7 stem: two stacked groups of taps
    ((2, 16, 16, 16), (8, 16, 3, 3), True, 1, 1, 1, 1),      # 16 channels: 8 taps per stacked group
    ((1, 4, 16, 16), (4, 4, 3, 3), False, 1, 2, 2, 1),       # stacked with dilation
    ((1, 40, 5, 5), (300, 20, 3, 3), True, 1, 1, 1, 2),      # 2 groups of 150 output channels (2 tiles each)
], ids=lambda c: "x{}w{}".format(c[0], c[1]))
def test_conv2d_fp32(case):
    xs, ws, bias, stride, padding, dilation, groups = case
    x, w = _rand(*xs), _rand(*ws, seed=1)
    b = _rand(ws[0], seed=2) if bias else None
    _conv(x, w, b, stride, padding, dilation, groups)


def test_conv_tap_stacking_is_used_for_few_channels():
    from tn.lower.base import LowerCtx
    from tn.lower.conv import _Conv
    from tn.neuron import Program

    prog = Program("t")
    x, w, o = prog.hbm("x", (1, 3, 20, 20)), prog.hbm("w", (4, 3, 7, 7)), prog.hbm("o", (1, 4, 10, 10))
    cv = _Conv(LowerCtx(prog), x.view(), w.view(), None, o.view(), (2, 2), (3, 3), (1, 1), 1)
    assert cv.stacked and cv.TG == 2
    x2, w2, o2 = prog.hbm("x2", (1, 256, 8, 8)), prog.hbm("w2", (4, 256, 3, 3)), prog.hbm("o2", (1, 4, 8, 8))
    assert not _Conv(LowerCtx(prog), x2.view(), w2.view(), None, o2.view(), (1, 1), (1, 1), (1, 1), 1).stacked


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_conv2d_low_precision(dtype):
    x, w, b = _rand(2, 3, 16, 16, dtype=dtype), _rand(8, 3, 3, 3, dtype=dtype, seed=1), _rand(8, dtype=dtype, seed=2)
    _conv(x, w, b, padding=1)
    x2, w2 = _rand(2, 8, 8, 8, dtype=dtype), _rand(16, 8, 3, 3, dtype=dtype, seed=3)
    _conv(x2, w2, None, stride=2, padding=1)


def test_conv_streams_weights_that_do_not_fit():
    """1024 -> 1024 channels 3x3 fp32: 36 MiB of weights are streamed in chunks of output channels."""
    from tn.lower.base import LowerCtx
    from tn.lower.conv import _Conv
    from tn.neuron import Program

    prog = Program("t")
    x, w, o = prog.hbm("x", (1, 1024, 4, 4)), prog.hbm("w", (1024, 1024, 3, 3)), prog.hbm("o", (1, 1024, 4, 4))
    cv = _Conv(LowerCtx(prog), x.view(), w.view(), None, o.view(), (1, 1), (1, 1), (1, 1), 1)
    assert cv.ocw < 1024 and cv.ocw % 128 == 0
    # a smaller case through the whole lowering with the chunk forced small
    import tn.lower.conv as conv_mod
    old = conv_mod._sbuf_free
    try:
        conv_mod._sbuf_free = lambda prog, ctx=None: 36 * 1024
        p2 = Program("t2")
        x2, w2, o2 = p2.hbm("x", (1, 130, 6, 6)), p2.hbm("w", (300, 130, 3, 3)), p2.hbm("o", (1, 300, 6, 6))
        assert _Conv(LowerCtx(p2), x2.view(), w2.view(), None, o2.view(), (1, 1), (1, 1), (1, 1), 1).ocw == 128
        _conv(_rand(1, 130, 6, 6), _rand(300, 130, 3, 3, seed=1), _rand(300, seed=2), padding=1, atol=1e-4)
    finally:
        conv_mod._sbuf_free = old


def test_conv1d():
    _conv(_rand(2, 8, 30), _rand(6, 8, 5, seed=1), _rand(6, seed=2), stride=2, padding=2)
    _conv(_rand(1, 130, 17), _rand(4, 130, 3, seed=1), None, dilation=2)


def test_small_convnet_layers():
    """The convolutions of a small CIFAR-style ConvNet (3->16->32 channels, 32x32, batch 4)."""
    x = _rand(4, 3, 32, 32)
    r1 = _conv(x, _rand(16, 3, 3, 3, seed=1), _rand(16, seed=2), padding=1)
    _conv(_rand(4, 16, 16, 16), _rand(32, 16, 3, 3, seed=3), _rand(32, seed=4), padding=1)
    _conv(_rand(4, 32, 8, 8), _rand(32, 32, 3, 3, seed=5), _rand(32, seed=6), stride=2, padding=1)
    assert r1.matmul_flops > 0 and r1.counts["TensorE"] > 0


@pytest.mark.parametrize("case", [
    # (x shape, w shape [Cin, Cout/g, kh, kw], bias, stride, padding, output_padding, dilation, groups)
    ((2, 4, 5, 5), (4, 3, 3, 3), True, 1, 0, 0, 1, 1),
    ((2, 4, 5, 6), (4, 3, 3, 3), False, 2, 1, 1, 1, 1),
    ((1, 6, 4, 4), (6, 2, 2, 2), True, 2, 0, 0, 1, 3),
    ((1, 3, 7, 5), (3, 5, 3, 2), True, (2, 3), (1, 0), (1, 2), (2, 1), 1),
    ((2, 8, 12), (8, 4, 4), True, 2, 1, 0, 1, 1),
], ids=lambda c: "x{}w{}".format(c[0], c[1]))
def test_conv_transposed(case):
    xs, ws, bias, stride, padding, opad, dilation, groups = case
    nd = len(xs) - 2
    t = lambda v: (v,) * nd if isinstance(v, int) else tuple(v)  # noqa: E731
    x, w = _rand(*xs), _rand(*ws, seed=1)
    ins = (x, w, _rand(ws[1] * groups, seed=2)) if bias else (x, w)
    check_lowering("convolution", *ins, stride=t(stride), padding=t(padding), dilation=t(dilation), transposed=True,
                   output_padding=t(opad), groups=groups)


@pytest.mark.parametrize("mask", [(True, False, False), (False, True, False), (True, True, True)], ids=str)
@pytest.mark.parametrize("case", [
    ((2, 4, 5, 6), (4, 3, 3, 3), 2, 1, 1, 1, 1),
    ((1, 6, 4, 4), (6, 2, 2, 2), 2, 0, 0, 1, 3),
    ((1, 3, 7, 5), (3, 5, 3, 2), (2, 3), (1, 0), (1, 2), (2, 1), 1),
], ids=lambda c: "x{}w{}".format(c[0], c[1]))
def test_conv_transposed_backward(case, mask):
    xs, ws, stride, padding, opad, dilation, groups = case
    nd = len(xs) - 2
    t = lambda v: (v,) * nd if isinstance(v, int) else tuple(v)  # noqa: E731
    attrs = dict(stride=t(stride), padding=t(padding), dilation=t(dilation), transposed=True,
                 output_padding=t(opad), groups=groups)
    x, w = _rand(*xs), _rand(*ws, seed=1)
    y = torch.ops.aten.convolution.default(x, w, None, list(attrs["stride"]), list(attrs["padding"]),
                                           list(attrs["dilation"]), True, list(attrs["output_padding"]), groups)
    check_lowering("convolution_backward", _rand(*y.shape, seed=3), x, w, bias_sizes=(ws[1] * groups,),
                   output_mask=mask, **attrs)


def _pool_attrs(k, s, p, ceil_mode=False, cip=True, div=None):
    t = lambda v: (v, v) if isinstance(v, int) else tuple(v)  # noqa: E731
    return dict(kernel_size=t(k), stride=t(s), padding=t(p), ceil_mode=ceil_mode, count_include_pad=cip,
                divisor_override=div)


POOL_CASES = [
    ((2, 3, 8, 8), 2, 2, 0, False, True, None),
    ((2, 3, 9, 7), 3, 2, 1, False, True, None),
    ((2, 3, 9, 7), 3, 2, 1, False, False, None),
    ((1, 5, 10, 10), 3, 2, 1, True, True, None),
    ((1, 5, 10, 11), (2, 3), (3, 2), (1, 1), True, False, None),
    ((3, 50, 6, 6), 2, 1, 0, False, True, 3),
    ((1, 130, 4, 4), 2, 2, 0, False, True, None),
]


@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: str(c[0]) + "k" + str(c[1]))
def test_avg_pool2d(case):
    xs, k, s, p, cm, cip, div = case
    check_lowering("avg_pool2d", _rand(*xs), **_pool_attrs(k, s, p, cm, cip, div))


@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: str(c[0]) + "k" + str(c[1]))
def test_avg_pool2d_backward(case):
    xs, k, s, p, cm, cip, div = case
    attrs = _pool_attrs(k, s, p, cm, cip, div)
    x = _rand(*xs)
    y = torch.ops.aten.avg_pool2d.default(x, list(attrs["kernel_size"]), list(attrs["stride"]),
                                          list(attrs["padding"]), cm, cip, div)
    check_lowering("avg_pool2d_backward", _rand(*y.shape, seed=7), x, **attrs)


@pytest.mark.parametrize("case", POOL_CASES[:5], ids=lambda c: str(c[0]) + "k" + str(c[1]))
def test_avg_pool2d_row_bands(case, monkeypatch):
    """Planes too large for SBUF are pooled in bands of output rows (forced here with a tiny SBUF budget)."""
    import tn.lower.conv as conv_mod

    xs, k, s, p, cm, cip, div = case
    xs = (xs[0], xs[1], xs[2] * 3, xs[3])
    monkeypatch.setattr(conv_mod, "_sbuf_free", lambda prog, ctx=None: 1200)
    check_lowering("avg_pool2d", _rand(*xs), **_pool_attrs(k, s, p, cm, cip, div))


def test_avg_pool2d_bf16():
    check_lowering("avg_pool2d", _rand(2, 4, 8, 8, dtype=torch.bfloat16), **_pool_attrs(2, 2, 0))


CONV_BWD_CASES = [
    ((2, 3, 8, 8), (4, 3, 3, 3), {}),
    ((2, 3, 8, 8), (4, 3, 3, 3), dict(padding=(1, 1))),
    ((2, 16, 10, 9), (8, 16, 3, 3), dict(stride=(2, 2), padding=(1, 1))),
    ((1, 20, 12, 12), (8, 5, 3, 3), dict(padding=(2, 1), dilation=(2, 1), groups=4)),
    ((2, 8, 9, 9), (8, 1, 3, 3), dict(padding=(1, 1), groups=8)),
    ((2, 150, 7, 7), (130, 150, 1, 1), {}),
    ((1, 4, 5, 40), (3, 4, 2, 5), dict(stride=(1, 3), padding=(0, 2))),
    ((2, 3, 9, 7), (4, 3, 3, 3), dict(stride=(2, 2))),
    ((1, 2, 3, 200), (2, 2, 1, 3), dict(padding=(0, 1))),
    ((2, 8, 30), (6, 8, 5), dict(stride=(2,), padding=(2,), dilation=(1,))),
    ((1, 600, 3, 3), (4, 600, 1, 1), {}),                     # > 512 input channels: channel-sliced banks
]


def _conv_bwd(xs, ws, kw, mask, dtype=torch.float32, **tol):
    nd = len(xs) - 2
    attrs = dict(stride=(1,) * nd, padding=(0,) * nd, dilation=(1,) * nd, groups=1)
    attrs.update(kw)
    x, w = _rand(*xs, dtype=dtype), _rand(*ws, dtype=dtype, seed=1)
    y = torch.ops.aten.convolution.default(x, w, None, list(attrs["stride"]), list(attrs["padding"]),
                                           list(attrs["dilation"]), False, [0] * nd, attrs["groups"])
    g = _rand(*y.shape, dtype=dtype, seed=2)
    return check_lowering("convolution_backward", g, x, w, bias_sizes=(ws[0],), transposed=False,
                          output_padding=(0,) * nd, output_mask=mask, **attrs, **tol)


@pytest.mark.parametrize("mask", [(True, False, False), (False, True, False), (True, True, True)], ids=str)
@pytest.mark.parametrize("case", CONV_BWD_CASES, ids=lambda c: "x{}w{}".format(c[0], c[1]))
def test_convolution_backward(case, mask):
    xs, ws, kw = case
    _conv_bwd(xs, ws, kw, mask)


def test_convolution_backward_bf16():
    # bf16 sums of many products: compare with a tolerance scaled to the sum length
    _conv_bwd((2, 4, 8, 8), (8, 4, 3, 3), dict(padding=(1, 1)), (True, True, True), dtype=torch.bfloat16,
              rtol=3e-2, atol=1e-1)


def test_small_convnet_train_step_runs_natively(monkeypatch):
    """Forward and gradients of a small ConvNet through tn.jit on the neuron backend, strict (no host fallback)."""
    import tn
    import tn.lower  # noqa: F401  (registers the backend)

    monkeypatch.setenv("TN_STRICT", "1")
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.AvgPool2d(2),
        torch.nn.Conv2d(8, 16, 3, stride=2, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(16 * 4 * 4, 10))
    x = torch.randn(4, 3, 16, 16)

    def step(net, x):
        out = net(x)
        return (out,) + tuple(torch.autograd.grad(out.square().mean(), list(net.parameters())))

    got = tn.jit(step, backend="neuron")(net, x)
    want = step(net, x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
