# Tests of tn.ops.resample: interpolate's gradients as per-axis transposed weight matrices, on every door.
import pytest
import torch
import torch.nn.functional as F

import tn
import tn.lower  # noqa: F401  (registers the lowerings and the neuron backend)
from tn.ops import resample

CASES = [
    # (input shape, interpolate kwargs)
    ((2, 3, 7), dict(scale_factor=2.5, mode="nearest")),
    ((2, 3, 7), dict(size=4, mode="nearest-exact")),
    ((1, 2, 9), dict(size=5, mode="linear", align_corners=True)),
    ((1, 2, 6), dict(scale_factor=1.7, mode="linear", align_corners=False)),
    ((2, 2, 5, 6), dict(size=(9, 4), mode="bilinear", align_corners=False)),
    ((1, 3, 4, 4), dict(scale_factor=(2.0, 0.75), mode="bilinear", align_corners=True)),
    ((1, 2, 5, 7), dict(size=(8, 3), mode="bicubic", align_corners=False)),
    ((1, 1, 6, 5), dict(scale_factor=1.5, mode="bicubic", align_corners=True)),
    ((1, 2, 3, 4, 5), dict(size=(5, 2, 7), mode="trilinear", align_corners=False)),
    ((1, 1, 3, 3, 4), dict(scale_factor=2, mode="nearest")),
]


def _grad(x, kw, w):
    y = F.interpolate(x, **kw)
    return torch.autograd.grad((y * w).sum(), x)[0]


def _reference(shape, kw, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).requires_grad_()
    w = torch.randn(F.interpolate(x.detach(), **kw).shape, generator=g)
    return x, w, _grad(x, kw, w)


@pytest.mark.parametrize("k", range(len(CASES)))
def test_jit_gradient_equals_torchs_with_no_host_op(k, monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")      # a host op would raise
    shape, kw = CASES[k]
    x, w, want = _reference(shape, kw, k)
    got = tn.jit(lambda x, w: _grad(x, kw, w))(x, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [0, 4, 6, 8])
def test_device_gradient_equals_torchs_natively(k, monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")
    shape, kw = CASES[k]
    x, w, want = _reference(shape, kw, k)
    xd = x.detach().to("neuron").requires_grad_()
    got = _grad(xd, kw, w.to("neuron"))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_axis_matrices_are_torchs_weights():
    # bilinear 5 -> 9 along one axis: the forward of a 1-d input is that matrix times the input
    m = resample.axis_matrix(torch.ops.aten.upsample_linear1d.default, 1, 0, 5, 9, False, None)
    x = torch.randn(5)
    torch.testing.assert_close(m @ x, F.interpolate(x.view(1, 1, 5), size=9, mode="linear").view(9))
    # nearest 4 -> 8: each output row is one-hot
    m = resample.axis_matrix(torch.ops.aten.upsample_nearest1d.default, 1, 0, 4, 8, None, None)
    assert torch.equal(m.sum(1), torch.ones(8)) and set(m.unique().tolist()) == {0.0, 1.0}
    # the identity is skipped
    assert resample.axis_matrix(torch.ops.aten.upsample_nearest1d.default, 1, 0, 6, 6, None, None) is None
