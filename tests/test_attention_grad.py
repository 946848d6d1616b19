# The CPU flash-attention backward decomposition (tn.ops.attention_grad) and nn.Transformer* trained through torch.compile.
import pytest
import torch

import tn
from tn.ops.attention_grad import flash_attention_cpu_backward

_OP = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


@pytest.mark.parametrize("case", ["plain", "causal", "inf_mask", "float_mask", "scale", "cross", "causal_cross", "gqa"])
def test_decomposition_matches_the_fused_kernel(case):
    g = torch.Generator().manual_seed(3)
    L, S = (5, 7) if case.endswith("cross") else (6, 6)
    kv_heads = 1 if case == "gqa" else 3
    q = torch.randn(2, 3, L, 8, generator=g)
    k = torch.randn(2, kv_heads, S, 8, generator=g)
    v = torch.randn(2, kv_heads, S, 8, generator=g)
    kw = {}
    causal = case.startswith("causal")
    if case == "inf_mask":   # a boolean mask as SDPA hands it to the fused kernel: 0 / -inf in the query's dtype
        keep = torch.rand(L, S, generator=g) > 0.3
        keep[:, 0] = True
        kw["attn_mask"] = torch.zeros(L, S).masked_fill(keep.logical_not(), float("-inf"))
    elif case == "float_mask":
        kw["attn_mask"] = torch.randn(2, 1, L, S, generator=g)
    elif case == "scale":
        kw["scale"] = 0.3
    out, lse = _OP.default(q, k, v, 0.0, causal, **kw)
    grad = torch.randn(out.shape, generator=g)
    want = _BWD(grad, q, k, v, out, lse, 0.0, causal, **kw)
    got = flash_attention_cpu_backward(grad, q, k, v, out, lse, 0.0, causal, **kw)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _train_step_grads(model, inputs, compiled):
    model.zero_grad()
    fn = torch.compile(model, backend="neuron") if compiled else model
    out = fn(*inputs)
    out.mul(torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("which", ["encoder_layer", "transformer"])
def test_transformer_trains_through_the_compile_door(which):
    torch.manual_seed(0)
    if which == "transformer":
        model = torch.nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                     dim_feedforward=32, dropout=0.0)
        inputs = (torch.randn(5, 2, 16), torch.randn(3, 2, 16))
    else:
        model = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        inputs = (torch.randn(2, 5, 16),)
    model.train()
    want_out, want = _train_step_grads(model, inputs, compiled=False)
    with tn.profile() as prof:
        got_out, got = _train_step_grads(model, inputs, compiled=True)
    torch.testing.assert_close(got_out, want_out, rtol=1e-4, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert not prof.host_ops
