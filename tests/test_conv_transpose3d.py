# conv_transpose3d (F.conv_transpose3d / nn.ConvTranspose3d) and its backward on the NeuronCore, from every door:
# decomposed at trace time (tn.ops._conv_transpose3d_decomp) into one transposed 2-d convolution over depth taps.
import pytest
import torch
import torch.nn.functional as F

import tn
import tn.lower  # noqa: F401  (registers the lowerings and the neuron backend)

_CT3D = [dict(), dict(padding=1), dict(stride=2, padding=(1, 0, 2), output_padding=(1, 0, 1)),
         dict(dilation=(2, 1, 1), padding=2), dict(groups=2, stride=(2, 1, 2)),
         dict(stride=3, dilation=2, padding=(0, 1, 1), output_padding=(2, 1, 0)),
         dict(stride=(1, 2, 1), output_padding=(0, 1, 0), dilation=(3, 1, 1))]


@pytest.fixture
def strict(monkeypatch):
    """Every equation must run on the NeuronCore (a host fallback is an UnsupportedOpError)."""
    monkeypatch.setenv("TN_STRICT", "1")


def _data(dtype, groups=1, seed=0):
    """(x, w, b) of a transposed 3-d convolution with 4 input and 6 output channels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 5, 6, 7, generator=g).to(dtype)
    w = torch.randn(4, 6 // groups, 3, 2, 3, generator=g).to(dtype)
    b = torch.randn(6, generator=g).to(dtype)
    return x, w, b


def _check(got, ref, r64, dtype, names):
    """Each result of tn within torch's own error (both measured from float64, scaled by the largest value)."""
    for name, a, r, r6 in zip(names, got, ref, r64):
        assert a.shape == r.shape and a.dtype == r.dtype, name
        scale = r6.abs().max().item()
        err = (a.double() - r6).abs().max().item() / scale
        err_torch = (r.double() - r6).abs().max().item() / scale
        bound = 1e-5 if dtype == torch.float32 else 2 * err_torch + 4e-3
        assert err <= bound, f"{name}: error {err:.3g} (torch {err_torch:.3g})"


@pytest.mark.parametrize("kw", _CT3D, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "plain")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_transpose3d_forward_backward(strict, kw, dtype):
    def f(x, w, b):
        y = F.conv_transpose3d(x, w, b, **kw)
        return (y,) + torch.autograd.grad((y * y.detach().sin()).sum(), (x, w, b))

    x, w, b = _data(dtype, kw.get("groups", 1))
    ir = tn.make_ir(f)(*(t.clone().requires_grad_() for t in (x, w, b)))
    convs = [e for e in ir.eqns if e.op.category == "conv"]
    assert convs and all(len(e.inputs[0].shape) == 4 for e in convs)
    ref = f(*(t.clone().requires_grad_() for t in (x, w, b)))
    r64 = f(*(t.double().requires_grad_() for t in (x, w, b)))
    got = tn.jit(f, backend="neuron")(*(t.clone().requires_grad_() for t in (x, w, b)))
    _check(got, ref, r64, dtype, ("y", "gx", "gw", "gb"))


@pytest.mark.parametrize("wrt", ["x", "w"])
def test_conv_transpose3d_one_gradient_no_bias_unbatched(strict, wrt):
    kw = dict(stride=2, padding=1, output_padding=1)

    def f(x, w):
        y = F.conv_transpose3d(x, w, None, **kw)
        return (y,) + torch.autograd.grad(y.square().sum(), x if wrt == "x" else w)

    x, w, _ = _data(torch.float32)
    x = x[0]                                                   # unbatched [C, D, H, W]
    args = lambda dt=torch.float32: (x.to(dt).requires_grad_(wrt == "x"), w.to(dt).requires_grad_(wrt == "w"))
    got = tn.jit(f, backend="neuron")(*args())
    _check(got, f(*args()), f(*args(torch.float64)), torch.float32, ("y", "g"))


def test_conv_transpose3d_module_on_the_neuron_device(strict, module_matches_on_device):
    torch.manual_seed(0)
    make = lambda: torch.nn.ConvTranspose3d(3, 5, 3, padding=1, stride=(1, 2, 2), output_padding=(0, 1, 1))  # noqa
    module_matches_on_device(make, torch.randn(2, 3, 4, 5, 5), out_tol=1e-5)


def test_conv_transpose3d_torch_compile(strict):
    from tn.dynamo_backend import host_ops

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = torch.nn.ConvTranspose3d(4, 6, (3, 2, 3), stride=(2, 1, 2), groups=2, dilation=(1, 2, 1))
    mc = torch.nn.ConvTranspose3d(4, 6, (3, 2, 3), stride=(2, 1, 2), groups=2, dilation=(1, 2, 1))
    mc.load_state_dict(m.state_dict())
    compiled = torch.compile(mc, backend="neuron")
    x = torch.randn(2, 4, 3, 5, 4)
    xc = x.clone().requires_grad_()
    x.requires_grad_()
    y, yc = m(x), compiled(xc)
    y.sin().sum().backward()
    yc.sin().sum().backward()
    torch.testing.assert_close(yc, y, rtol=1e-5, atol=1e-5)
    for a, r in ((xc.grad, x.grad), (mc.weight.grad, m.weight.grad), (mc.bias.grad, m.bias.grad)):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)
    assert not any("conv" in k for k in host_ops())
