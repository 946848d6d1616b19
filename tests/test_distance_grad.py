# Tests of tn.ops.decompositions' cdist/pdist gradients (aten._cdist_backward, aten._pdist_backward) vs torch.
import math

import pytest
import torch

import tn
import tn.lower  # noqa: F401  (registers the lowerings and the neuron backend)

PS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, math.inf]


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    x1 = torch.randn(2, 5, 3, generator=g)
    x2 = torch.randn(2, 4, 3, generator=g)
    x2[0, 1] = x1[0, 2]            # a zero distance, and zero differences
    x2[1, 0, 1] = x1[1, 3, 1]
    return x1.requires_grad_(), x2.requires_grad_(), torch.rand(2, 5, 4, generator=g)


@pytest.mark.parametrize("p", PS)
def test_cdist_gradients_equal_torchs_with_no_host_op(p, monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")
    x1, x2, w = _inputs(int(p * 10) if p != math.inf else 99)

    def f(x1, x2, w):
        return torch.autograd.grad((torch.cdist(x1, x2, p=p) * w).sum(), (x1, x2))

    for a, e in zip(tn.jit(f)(x1, x2, w), f(x1, x2, w)):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("p", PS)
def test_pdist_gradient_equals_torchs_with_no_host_op(p, monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 4, generator=g)
    x[4] = x[1]                     # a zero distance
    x.requires_grad_()
    w = torch.rand(15, generator=g)

    def f(x, w):
        return torch.autograd.grad((torch.nn.functional.pdist(x, p=p) * w).sum(), x)[0]

    torch.testing.assert_close(tn.jit(f)(x, w), f(x, w), rtol=1e-4, atol=1e-5)
