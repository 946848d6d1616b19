# Tests of tn.ops.ctc: the CTC loss and its gradient as NeuronCore programs (no host op) through tn.jit and on the device.
import pytest
import torch
import torch.nn.functional as F

import tn
import tn.lower  # noqa: F401  (registers the lowerings and the neuron backend)

_CASES = {   # targets, input lengths, target lengths (log-probabilities [8, 3, 5])
    "padded": (torch.tensor([[1, 2, 2, 3, 1], [3, 1, 0, 0, 0], [4, 4, 4, 0, 0]]), [8, 6, 7], [5, 2, 0]),
    "concatenated": (torch.tensor([1, 2, 3, 4, 1, 2]), [8, 6, 5], [3, 2, 1]),
    "concatenated-empty-last": (torch.tensor([1, 2, 3, 4, 1]), [8, 6, 5], [3, 2, 0]),
    # 6 labels with 5 repeats need 11 steps: an infinite loss (NaN gradient, or 0 with zero_infinity)
    "infinite": (torch.tensor([[1, 2, 1, 2, 1, 2], [1, 1, 1, 1, 1, 1], [2, 3, 0, 0, 0, 0]]), [8, 8, 8], [6, 6, 2]),
    "no-targets": (torch.zeros(3, 0, dtype=torch.int64), [8, 5, 2], [0, 0, 0]),
    "empty-inputs": (torch.tensor([[1, 2], [3, 0], [0, 0]]), [8, 0, 0], [2, 1, 0]),
}

# (reduction, zero_infinity, lengths as tensors)
_MODES = [("none", False, False), ("sum", True, False), ("mean", False, True), ("none", True, True),
          ("mean", True, False)]


def _loss_and_grad(x, targets, il, tl, **kw):
    out = F.ctc_loss(x, targets, il, tl, **kw)
    return out, torch.autograd.grad(out.sum(), x)[0]


def _log_probs(shape, seed):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return x.log_softmax(-1).requires_grad_()


@pytest.mark.parametrize("mode", _MODES, ids=lambda m: f"{m[0]}-zi{int(m[1])}-{'tensors' if m[2] else 'lists'}")
@pytest.mark.parametrize("case", sorted(_CASES))
def test_jit_loss_and_gradient_equal_torchs_with_no_host_op(case, mode, monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")      # a host op would raise
    reduction, zero_infinity, tensors = mode
    targets, il, tl = _CASES[case]
    if tensors:
        il, tl = torch.tensor(il), torch.tensor(tl)
    x = _log_probs((8, 3, 5), 6)
    kw = dict(reduction=reduction, zero_infinity=zero_infinity)
    got = tn.jit(lambda x, t, a, b: _loss_and_grad(x, t, a, b, **kw))(x, targets, il, tl)
    want = _loss_and_grad(x, targets, il, tl, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("blank, dtype", [(0, torch.int32), (4, torch.int64)])
def test_jit_unbatched_input_other_blank_and_int32_targets(blank, dtype, monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")
    x = _log_probs((9, 5), 7)
    labels = [1, 2, 2, 3] if blank == 0 else [0, 2, 2, 3]
    targets = torch.tensor(labels, dtype=dtype)
    f = lambda x, t: _loss_and_grad(x, t, [9], [4], blank=blank, reduction="sum")   # noqa: E731
    torch.testing.assert_close(tn.jit(f)(x, targets), f(x, targets), rtol=1e-5, atol=1e-5)


def test_jit_module_db_sized_gradient_follows_torchs_rounding(monkeypatch):
    """nn.CTCLoss's module_db input (T=50, 15 classes, targets of 30/25/20 labels): the alpha/beta recursions
    and the per-class collection follow torch's kernel's order, so the gradient stays within a few float32
    ulps of torch's (2e-9 when written; the bound leaves room for another libm's expf), where summing the
    collection in another order was 1e-5..3e-5 away."""
    monkeypatch.setenv("TN_STRICT", "1")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, 3, 15, generator=g).log_softmax(2).requires_grad_()
    targets = torch.randint(1, 15, (3, 30), generator=g)
    ctc = torch.nn.CTCLoss()
    f = lambda x, t: (lambda out: (out, torch.autograd.grad(out, x)[0]))(ctc(x, t, (50, 50, 50), (30, 25, 20)))  # noqa: E731
    (loss, grad), (loss0, grad0) = tn.jit(f)(x, targets), f(x, targets)
    torch.testing.assert_close(loss, loss0, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, grad0, rtol=0, atol=1e-6)


@pytest.mark.parametrize("case, reduction", [("padded", "mean"), ("concatenated", "none"), ("infinite", "sum")])
def test_device_loss_and_gradient_run_natively(case, reduction, monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")
    targets, il, tl = _CASES[case]
    x = _log_probs((8, 3, 5), 8)
    kw = dict(reduction=reduction, zero_infinity=True)
    want = _loss_and_grad(x, targets, il, tl, **kw)
    xd = x.detach().to("neuron").requires_grad_()
    got = _loss_and_grad(xd, targets.to("neuron"), torch.tensor(il, device="neuron"),
                         torch.tensor(tl, device="neuron"), **kw)
    torch.testing.assert_close([t.cpu() for t in got], list(want), rtol=1e-5, atol=1e-5)


def test_the_trace_has_no_host_equation_and_lists_are_constants():
    targets, il, tl = _CASES["padded"]
    x = _log_probs((8, 3, 5), 9)
    ir = tn.jit(lambda x: _loss_and_grad(x, targets, il, tl, reduction="sum")).lower(x)
    names = {e.op.name for e in ir.eqns}
    assert "host" not in names and names <= {n for n, op in tn.ops.OPS.items() if op.lowering is not None}
    assert len(ir.inputs) == 1


def test_a_float64_loss_is_one_counted_host_op():
    """The chip has no float64 arithmetic: the loss is torch's kernel as one host equation (not a recursion of
    host equations), counted and correct."""
    targets, il, tl = _CASES["padded"]
    x = _log_probs((8, 3, 5), 10).detach().double()
    f = lambda x: F.ctc_loss(x, targets, il, tl, reduction="none")    # noqa: E731
    with tn.profile() as prof:
        got = tn.jit(f)(x)
    assert prof.host_ops == {"host": 1}
    torch.testing.assert_close(got, f(x))
