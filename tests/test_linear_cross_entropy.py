# Tests of tn.ops.linear_cross_entropy: torch's chunked linear + cross-entropy custom op, traced, vs torch's own op.
import pytest
import torch
import torch.nn.functional as F
import torch.nn.modules.linear_cross_entropy  # noqa: F401  (defines the custom op)

import tn
import tn.lower  # noqa: F401  (registers the lowerings and the neuron backend)

OP = torch.ops.torch_nn._linear_cross_entropy_batch_chunked.default


def _case(seed, n=6, h=5, c=7, bias=True, class_weight=False, ignore=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g)
    w = torch.randn(c, h, generator=g)
    b = torch.randn(c, generator=g) if bias else None
    t = torch.randint(0, c, (n,), generator=g)
    if ignore:
        t[1] = -100
    cw = torch.rand(c, generator=g) + 0.5 if class_weight else None
    return x, w, t, b, cw


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("class_weight", [False, True])
def test_loss_and_gradients_equal_torchs_op_with_no_host_op(reduction, class_weight, monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")
    x, w, t, b, cw = _case(3, class_weight=class_weight)
    args = (x, w, t, b, cw, reduction, -100, 0.0, 2, "compact", torch.float32, True, True, True, True)
    want = OP(*args)
    got = tn.jit(lambda x, w, t, b: OP(x, w, t, b, *args[4:]))(x, w, t, b)
    for a, e, name in zip(got, want, ("loss", "grad_input", "grad_weight", "grad_bias")):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, msg=name)


def test_forward_door_matches_functional_and_asks_for_no_gradient(monkeypatch):
    from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions

    monkeypatch.setenv("TN_STRICT", "1")
    x, w, t, _, _ = _case(5, bias=False)
    opts = LinearCrossEntropyOptions(batch_chunk_size=2)
    f = lambda x, w, t: F.linear_cross_entropy(x, w, t, options=opts)  # noqa: E731
    torch.testing.assert_close(tn.jit(f)(x, w, t), f(x, w, t), rtol=1e-5, atol=1e-6)
    per_row = lambda x, w, t: F.linear_cross_entropy(x, w, t, reduction="none", options=opts)  # noqa: E731
    torch.testing.assert_close(tn.jit(per_row)(x, w, t), per_row(x, w, t), rtol=1e-5, atol=1e-6)


def test_neuron_auto_policy_does_not_break_compiled_graphs():
    """tn resolves acc_policy='auto' for the neuron device with a function torch calls from
    F.linear_cross_entropy; it lives in tn.ops.torch_options, off Dynamo's skip list, so a compiled chunked
    linear_cross_entropy is one graph (fullgraph=True raised a graph break while it lived in a skipped file)."""
    from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions

    import tn  # noqa: F401  (installs the neuron policy and Dynamo's skip list)

    def loss(x, w, t):
        return torch.nn.functional.linear_cross_entropy(
            x, w, t, options=LinearCrossEntropyOptions(allow_retain_graph=True, batch_chunk_size=2))

    x, w, t = torch.randn(8, 3), torch.randn(4, 3), torch.randint(0, 4, (8,))
    torch._dynamo.reset()
    got = torch.compile(loss, backend="neuron", fullgraph=True)(x, w, t)
    torch.testing.assert_close(got, loss(x, w, t))
    torch._dynamo.reset()
