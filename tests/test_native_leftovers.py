# Tests of host ops made native late in issue 17 (segment_reduce's gradient) and of hash_tensor, a counted host op under tn.jit: against torch on the CPU, under TN_STRICT, through tn.jit and on the device.
import itertools

import pytest
import torch

import tn
import tn.lower  # noqa: F401  (registers the lowerings and the neuron backend)

# --------------------------------------------------------------------------- segment_reduce's gradient

_SEG_LENGTHS = {1: torch.tensor([2, 0, 3, 1]), 3: torch.tensor([[2, 0, 3, 1], [1, 1, 0, 4]])}


def _segment_data(reduce, ndim, seed):
    g = torch.Generator().manual_seed(seed)
    shape = {1: (6,), 2: (6, 3), 3: (2, 6, 3)}[ndim]
    x = torch.randn(shape, generator=g)
    rows = x if ndim < 3 else x.transpose(0, 1)      # the reduced axis first (a view: writes reach x)
    if reduce == "prod":
        rows[1] = 0.0       # a zero row: its gradient is the product of the others, not grad * out / 0
    if reduce in ("max", "min"):
        rows[3] = rows[4]   # a tie in the third segment: torch's kernel shares positive gradients among ties
    return x


def _segment_loss_and_grad(x, reduce, kw):
    y = torch.segment_reduce(x, reduce, **kw)
    w = torch.arange(y.numel(), dtype=y.dtype, device=y.device).view(y.shape) - 3.0    # gradients of both signs
    return y, torch.autograd.grad((y * w).sum(), x)[0]


def _segment_kwargs(ndim, offsets, initial):
    lengths = _SEG_LENGTHS[3 if ndim == 3 else 1]
    kw = dict(axis=1 if ndim == 3 else 0, unsafe=True, initial=initial)
    if offsets:
        zero = torch.zeros(lengths.shape[:-1] + (1,), dtype=lengths.dtype)
        kw["offsets"] = torch.cat([zero, lengths.cumsum(-1)], -1)
    else:
        kw["lengths"] = lengths
    return kw


@pytest.mark.parametrize("reduce, ndim, offsets, initial",
                         [(r, d, o, i) for r, d, (o, i) in itertools.product(
                             ["sum", "mean", "max", "min", "prod"], [1, 2, 3],
                             [(False, None), (True, 2.0)])])
def test_segment_reduce_gradient_through_jit_equals_torchs(reduce, ndim, offsets, initial, monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")      # a host op would raise
    x = _segment_data(reduce, ndim, ndim).requires_grad_()
    kw = _segment_kwargs(ndim, offsets, initial)
    got = tn.jit(lambda x: _segment_loss_and_grad(x, reduce, kw))(x)
    torch.testing.assert_close(got, _segment_loss_and_grad(x, reduce, kw), equal_nan=True)


@pytest.mark.parametrize("reduce", ["mean", "max", "prod"])
def test_segment_reduce_gradient_on_the_device_runs_natively(reduce, monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")
    x = _segment_data(reduce, 2, 5)
    kw = _segment_kwargs(2, False, None)
    want = _segment_loss_and_grad(x.clone().requires_grad_(), reduce, kw)
    kwd = {k: (v.to("neuron") if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    got = _segment_loss_and_grad(x.to("neuron").requires_grad_(), reduce, kwd)
    torch.testing.assert_close([t.cpu() for t in got], list(want), equal_nan=True)


def test_segment_reduce_max_gradient_keeps_torchs_tie_rule():
    """Two rows equal to a segment's maximum: torch's kernel divides a positive gradient by 2 and leaves a
    negative one whole (its own rule, kept: the decomposition is compared with the kernel, not with calculus)."""
    x = torch.tensor([1.0, 3.0, 3.0, 2.0, 2.0]).requires_grad_()
    kw = dict(lengths=torch.tensor([3, 2]), unsafe=True)
    f = lambda x, w: torch.autograd.grad((torch.segment_reduce(x, "max", **kw) * w).sum(), x)[0]   # noqa: E731
    w = torch.tensor([4.0, -6.0])
    want = torch.tensor([0.0, 2.0, 2.0, -6.0, -6.0])
    torch.testing.assert_close(f(x, w), want)
    torch.testing.assert_close(tn.jit(f)(x, w), want)


# --------------------------------------------------------------------------- hash_tensor: a counted host op


@pytest.mark.parametrize("kw", [{}, dict(dim=[0], keepdim=True), dict(dim=[-1])])
def test_hash_tensor_through_jit_is_torchs_hash_as_one_counted_host_op(kw):
    """The xor of float64 bit patterns needs 64-bit words (the engine has range-checked int32 ones): under
    tn.jit it is one host equation, counted, torch's exact hash (it raised UnsupportedOpError before)."""
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    f = lambda x: torch.hash_tensor(x * 2, **kw)    # noqa: E731
    with tn.profile() as prof:
        got = tn.jit(f)(x)
    assert got.dtype == torch.uint64 and torch.equal(got, f(x))
    assert sum(prof.host_ops.values()) == 1


def test_hash_tensor_through_jit_is_refused_under_strict(monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")
    with pytest.raises(tn.UnsupportedOpError):
        tn.jit(lambda x: torch.hash_tensor(x + 1))(torch.randn(4))
