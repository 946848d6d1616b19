# torch.compile(backend="neuron") on nn.CTCLoss: tn.ops.ctc's shape rules let Dynamo and AOTAutograd capture
# ctc_loss whole (int-list, tensor and concatenated lengths), and tn compiles its forward and backward natively.
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols

import tn  # registers the neuron device and tn.ops.ctc's shape rules
from tn import dynamo_backend

aten = torch.ops.aten


pytestmark = pytest.mark.usefixtures("fresh_dynamo")   # tests/conftest.py


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def _case(lengths: str, batched: bool = True):
    """(log_probs [T, N, C] leaf, targets, input_lengths, target_lengths) with unequal lengths per sample."""
    g = torch.Generator().manual_seed(7)
    t, n, c, s = 7, 3, 6, 4
    il, tl = [7, 5, 6], [4, 2, 3]
    lp = torch.randn(t, n, c, generator=g).log_softmax(2)
    if lengths == "concat":
        tg = torch.randint(1, c, (sum(tl),), generator=g)
    else:
        tg = torch.randint(1, c, (n, s), generator=g)
    if not batched:
        lp, tg, il, tl = lp[:, 0], tg[0, :tl[0]], il[:1], tl[:1]
    if lengths != "list":
        il, tl = torch.tensor(il), torch.tensor(tl)
    return lp.detach().requires_grad_(), tg, il, tl


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("lengths", ["list", "tensor", "concat"])
def test_ctc_loss_compiles_whole_forward_and_backward(lengths, reduction):
    lp, tg, il, tl = _case(lengths)
    m = torch.nn.CTCLoss(reduction=reduction, zero_infinity=True)
    before = dynamo_backend.graphs_compiled()
    old = {id(j) for j in dynamo_backend.compiled_graphs()}
    out = torch.compile(m, backend="neuron")(lp, tg, il, tl)
    out.sum().backward()
    got = lp.grad.clone()
    assert _graph_breaks() == 0
    assert dynamo_backend.graphs_compiled() - before == 2        # the forward and the backward graph reached tn
    mine = [j for j in dynamo_backend.compiled_graphs() if id(j) not in old]
    assert all(dynamo_backend.host_ops_of(j) == {} for j in mine)   # nothing ran on the host
    lp.grad = None
    ref = m(lp, tg, il, tl)
    ref.sum().backward()
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, lp.grad, rtol=1e-5, atol=1e-6)
    assert got.abs().max() > 1e-3                                   # a gradient that is not all zeros


def test_unbatched_ctc_loss_compiles():
    lp, tg, il, tl = _case("list", batched=False)
    m = torch.nn.CTCLoss(reduction="none")
    out = torch.compile(m, backend="neuron")(lp, tg, il, tl)
    out.sum().backward()
    got = lp.grad.clone()
    assert _graph_breaks() == 0
    lp.grad = None
    ref = m(lp, tg, il, tl)
    ref.sum().backward()
    assert out.shape == ref.shape == ()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, lp.grad, rtol=1e-5, atol=1e-6)


def test_shape_rules_under_fake_tensors():
    with FakeTensorMode(shape_env=ShapeEnv(allow_dynamic_output_shape_ops=True)) as mode:
        lp = mode.from_tensor(torch.randn(7, 3, 6))
        tg = mode.from_tensor(torch.randint(1, 6, (3, 4)))
        nll, alpha = aten._ctc_loss.default(lp, tg, [7, 5, 6], [4, 2, 3])
        assert list(nll.shape) == [3] and list(alpha.shape) == [3, 7, 9]      # E = 2 max(L) + 1, as torch's
        il = mode.from_tensor(torch.tensor([7, 5, 6]))
        tl = mode.from_tensor(torch.tensor([4, 2, 3]))
        nll, alpha = aten._ctc_loss.Tensor(lp, tg, il, tl)
        assert list(nll.shape) == [3] and list(alpha.shape[:2]) == [3, 7]
        assert free_unbacked_symbols(alpha.shape[2])                          # E: known only from the values
        grad = aten._ctc_loss_backward.Tensor(nll, lp, tg, il, tl, nll, alpha, 0)
        assert grad.shape == lp.shape and grad.is_contiguous()


def test_other_backends_capture_ctc_loss_too():
    # The shape rules are process-wide: a backend running torch's CPU kernels gets log_alpha at torch's exact
    # width, where the rule said "unbacked", and still gives torch's answer.
    lp, tg, il, tl = _case("concat")
    m = torch.nn.CTCLoss()
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        out = torch.compile(m, backend="aot_eager")(lp, tg, il, tl)
        out.backward()
    got = lp.grad.clone()
    assert _graph_breaks() == 0
    lp.grad = None
    ref = m(lp, tg, il, tl)
    ref.backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(got, lp.grad)


def test_ctc_loss_compiles_on_the_neuron_device():
    lp, tg, il, tl = _case("list")
    m = torch.nn.CTCLoss()
    dev = lp.detach().to("neuron").requires_grad_()
    tn.device.tracking.reset_op_counts()
    with tn.profile() as prof:
        out = torch.compile(m, backend="neuron")(dev, tg.to("neuron"), il, tl)
        out.backward()
    assert _graph_breaks() == 0
    assert out.device.type == "neuron"
    assert dict(prof.host_ops) == {} and tn.device.fallback_ops() == {}
    ref = m(lp, tg, il, tl)
    ref.backward()
    torch.testing.assert_close(out.cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dev.grad.cpu(), lp.grad, rtol=1e-5, atol=1e-6)
