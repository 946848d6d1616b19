# torch.library custom ops through every door: traced as one opaque host equation (shapes from the fake kernel).
import gc

import pytest
import torch

import tn
from tn import config, dynamo_backend


@torch.library.custom_op("tntest::scale_add", mutates_args=())
def scale_add(x: torch.Tensor, y: torch.Tensor, a: float) -> torch.Tensor:
    """x * a + y (computed by torch wherever it runs)."""
    return x * a + y


@scale_add.register_fake
def _scale_add_fake(x, y, a):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.a = inputs[2]


def _backward(ctx, g):
    return g * ctx.a, g, None


scale_add.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("tntest::no_fake", mutates_args=())
def no_fake(x: torch.Tensor) -> torch.Tensor:
    """x + 1, with no fake implementation registered."""
    return x + 1


def _f(x, y):
    return scale_add(x.sin(), y, 2.0).cos()


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)


def _grads(fn, x, y):
    x = x.clone().requires_grad_()
    y = y.clone().requires_grad_()
    fn(x, y).mul(torch.arange(20.0).reshape(4, 5)).sum().backward()
    return x.grad, y.grad


def test_jit_traces_custom_op_as_one_counted_host_equation():
    x, y = _inputs()
    with tn.profile() as prof:
        out = tn.jit(_f)(x, y)
    torch.testing.assert_close(out, _f(x, y))
    assert prof.host_ops == {"host": 1}
    ir = tn.make_ir(_f)(x, y)
    assert [e.op.name for e in ir.eqns].count("host") == 1


def test_jit_gradient_through_custom_op_autograd_formula():
    x, y = _inputs()

    def loss_grad(x, y):
        return torch.autograd.grad(_f(x, y).sum(), [x, y])

    gx, gy = tn.jit(loss_grad)(x.clone().requires_grad_(), y.clone().requires_grad_())
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    ex, ey = torch.autograd.grad(_f(xr, yr).sum(), [xr, yr])
    torch.testing.assert_close(gx, ex)
    torch.testing.assert_close(gy, ey)


@pytest.fixture
def forget_compiled_graphs():
    """Drop this test's compiled graphs afterwards: they hold a host op, and dynamo_backend.host_ops() counts
    every live graph (other tests assert it is empty)."""
    yield
    torch._dynamo.reset()
    gc.collect()
    assert dynamo_backend.host_ops() == {}


def test_compile_door_forward_and_backward(forget_compiled_graphs):
    x, y = _inputs()
    compiled = torch.compile(_f, backend="neuron")
    torch.testing.assert_close(compiled(x, y), _f(x, y))
    for got, want in zip(_grads(compiled, x, y), _grads(_f, x, y)):
        torch.testing.assert_close(got, want)
    assert dynamo_backend.host_ops().get("host")


def test_device_eager_forward_and_backward():
    x, y = _inputs()
    torch.testing.assert_close(_f(x.to("neuron"), y.to("neuron")).cpu(), _f(x, y))
    xd = x.to("neuron").requires_grad_()
    yd = y.to("neuron").requires_grad_()
    _f(xd, yd).mul(torch.arange(20.0).reshape(4, 5).to("neuron")).sum().backward()
    for got, want in zip((xd.grad.cpu(), yd.grad.cpu()), _grads(_f, x, y)):
        torch.testing.assert_close(got, want)


def test_strict_mode_refuses_the_host_equation():
    x, y = _inputs()
    with config.override(strict=True):
        with pytest.raises(tn.TnError, match="host"):
            tn.jit(_f)(x, y)


def test_custom_op_without_fake_kernel_is_a_clear_error():
    with pytest.raises(tn.UnsupportedOpError, match="register_fake"):
        tn.jit(lambda x: no_fake(x) * 2)(torch.randn(3))
