# Grouped matmul (MoE experts) as core ops: aten._grouped_mm and HF's grouped_mm_fallback ops through tn.jit and
# torch.compile, and tiny Mixtral / Qwen2-MoE models with their expert matmuls on the NeuronCore.
import logging

import pytest
import torch

import tn
from tn.ops.grouped_mm import grouped_mm_dense

OFFS = torch.tensor([3, 3, 7, 9], dtype=torch.int32)   # groups of 3, 0, 4, 2 rows; rows 9.. belong to none


def _loop_grouped_mm(a, b, offs):
    """The grouped matmul written as its definition: one matmul per group (zeros outside every group)."""
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if a.dim() == 2 and b.dim() == 3:
        out = torch.zeros(a.shape[0], b.shape[2], dtype=a.dtype)
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = a[s:e] @ b[g]
    elif a.dim() == 2 and b.dim() == 2:
        out = torch.stack([a[:, s:e] @ b[s:e] for s, e in zip(starts, ends)])
    else:
        out = torch.zeros(a.shape[1], b.shape[1], dtype=a.dtype)
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[:, s:e] = a[g] @ b[:, s:e]
    return out


@pytest.mark.parametrize("mode", ["rows", "contracted", "columns", "batched"])
def test_dense_form_matches_the_per_group_definition(mode):
    gen = torch.Generator().manual_seed(0)
    if mode == "rows":
        a, b = torch.randn(11, 6, generator=gen), torch.randn(4, 6, 5, generator=gen)
    elif mode == "contracted":
        a, b = torch.randn(5, 11, generator=gen), torch.randn(11, 6, generator=gen)
    elif mode == "columns":
        a, b = torch.randn(4, 5, 6, generator=gen), torch.randn(6, 11, generator=gen)
    else:
        a, b = torch.randn(4, 5, 6, generator=gen), torch.randn(4, 6, 3, generator=gen)
    want = torch.bmm(a, b) if mode == "batched" else _loop_grouped_mm(a, b, OFFS)
    got = grouped_mm_dense(a, b, None if mode == "batched" else OFFS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _moe_layer(x, w, logits):
    """A routed expert layer as HF writes it: top-2 experts per token, rows sorted by expert, offsets from a
    histogram, one grouped matmul, outputs scattered back and weighted."""
    top_w, top_i = logits.softmax(-1).topk(2, dim=-1)
    ids = top_i.reshape(-1)
    ids_sorted, perm = torch.sort(ids)
    rows = x[perm // 2]
    counts = torch.histc(ids_sorted.float(), bins=w.shape[0], min=0, max=w.shape[0] - 1)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    y = torch._grouped_mm(rows, w, offs=offs)
    out = torch.zeros(ids.shape[0], w.shape[2], dtype=y.dtype).index_copy(0, perm, y)
    return (out.reshape(x.shape[0], 2, -1) * top_w[..., None].to(y.dtype)).sum(1)


def _moe_inputs():
    gen = torch.Generator().manual_seed(1)
    bf = torch.bfloat16
    return (torch.randn(8, 16, generator=gen).to(bf), (torch.randn(4, 16, 8, generator=gen) / 4).to(bf),
            torch.randn(8, 4, generator=gen))


def test_aten_grouped_mm_compiles_with_no_host_op_and_matches_eager():
    x, w, logits = _moe_inputs()
    want = _moe_layer(x, w, logits)
    with tn.profile() as prof:
        got = tn.jit(_moe_layer)(x, w, logits)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert prof.host_ops == {}   # routing (topk, sort of expert ids, histc, cumsum) included
    ir = tn.make_ir(_moe_layer)(x, w, logits)
    assert "matmul" in {e.op.name for e in ir.eqns}


def test_aten_grouped_mm_gradient_through_tn_jit():
    # the backward of aten._grouped_mm is itself grouped matmuls (groups along the contracted axis for the weights)
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(11, 16, generator=gen).to(torch.bfloat16)
    b = torch.randn(4, 16, 8, generator=gen).to(torch.bfloat16)
    offs = torch.tensor([3, 3, 7, 11], dtype=torch.int32)
    proj = torch.randn(11, 8, generator=gen).to(torch.bfloat16)

    def grads(a, b, offs):
        return torch.autograd.grad((torch._grouped_mm(a, b, offs=offs) * proj).sum(), [a, b])

    ga, gb = tn.jit(grads)(a.clone().requires_grad_(), b.clone().requires_grad_(), offs)
    af, bf = a.float().requires_grad_(), b.float().requires_grad_()
    (_loop_grouped_mm(af, bf, offs) * proj.float()).sum().backward()
    torch.testing.assert_close(ga.float(), af.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gb.float(), bf.grad, rtol=2e-2, atol=2e-2)


transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)


def _tiny_moe(name):
    torch.manual_seed(0)
    common = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=64, num_experts_per_tok=2, max_position_embeddings=32)
    if name == "mixtral":
        model = transformers.MixtralForCausalLM(
            transformers.MixtralConfig(intermediate_size=64, num_local_experts=4, **common))
    elif name == "deepseek_v3":   # grouped routing: top-1 of 2 groups, then top-2 of 4 experts (sorted=False)
        common["num_key_value_heads"] = 4
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1, n_group=2,
            topk_group=1, first_k_dense_replace=0, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8, **common))
    else:
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4,
            **common))
    return model.eval()


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_hf_moe_experts_trace_to_core_ops(name):
    # HF's fallback custom op (fp32 experts) becomes matmuls, not the opaque host op of an unknown custom op
    model = _tiny_moe(name)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
        with tn.profile() as prof:
            got = tn.jit(lambda ids: model(ids).logits)(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert prof.host_ops == {}   # routing (topk, sort of expert ids, histc, cumsum) included


@pytest.mark.parametrize("name", ["mixtral"])
def test_hf_moe_trains_through_the_compile_door(name):
    model = _tiny_moe(name).train()
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(4))

    def grads(step):
        model.zero_grad()
        out = step(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want_loss, want = grads(model)
    with tn.profile() as prof:
        got_loss, got = grads(torch.compile(model, backend="neuron"))
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-4, atol=1e-5)
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-3, atol=1e-5, msg=n)
    assert prof.host_ops == {}   # routing (topk, sort of expert ids, histc, cumsum) included
