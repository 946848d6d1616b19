# Tests of fused attention (tn/lower/attention.py): planning by dataflow, masks, head split/merge views, odd sizes, fp32/bf16.
import math
import os
import sys

import pytest
import torch

pytest.importorskip("tn.lower.attention")
import tn  # noqa: E402
import tn.lower  # noqa: E402,F401
import tn.passes  # noqa: E402
from tn.lower import attention  # noqa: E402
from tn.lower.compiler import compile_ir  # noqa: E402

TOL = {torch.float32: dict(rtol=2e-4, atol=2e-4), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def _check(f, *args, expect_group=True):
    ir = tn.passes.optimize(tn.make_ir(f)(*args))
    groups = attention.plan(ir, {})
    if expect_group:
        assert groups, "no attention group planned"
    exe = compile_ir(ir, strict=True)
    got = exe(list(args))
    want = f(*args)
    want = want if isinstance(want, (tuple, list)) else (want,)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL[w.dtype])
    return ir, exe


def plain_attention(q, k, v):
    s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    return torch.softmax(s, dim=-1) @ v


def causal_heads(qkv, heads):
    """GPT-2's head split of a fused qkv projection, causal softmax, head merge."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    q, k, v = qkv.split(C, dim=2)
    q = q.view(B, T, heads, C // heads).transpose(1, 2)
    k = k.view(B, T, heads, C // heads).transpose(1, 2)
    v = v.view(B, T, heads, C // heads).transpose(1, 2)
    att = (q @ k.transpose(-2, -1)) * ((C // heads) ** -0.5)
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    att = att.masked_fill(~mask, float("-inf")).softmax(-1)
    return (att @ v).transpose(1, 2).reshape(B, T, C)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("b,h,t,tk,d", [(1, 8, 128, 128, 64), (2, 3, 50, 70, 16), (1, 2, 200, 300, 128),
                                       (1, 1, 1, 2, 1), (1, 4, 130, 512, 32)])
def test_plain_attention(b, h, t, tk, d, dtype):
    g = torch.Generator().manual_seed(b * 100 + t)
    q = torch.randn(b, h, t, d, generator=g).to(dtype)
    k = torch.randn(b, h, tk, d, generator=g).to(dtype)
    v = torch.randn(b, h, tk, d, generator=g).to(dtype)
    ir, exe = _check(plain_attention, q, k, v)
    # scores never leave the chip: HBM traffic is q, k, v in and the output out
    nbytes = sum(x.numel() for x in (q, k, v)) * q.element_size() + b * h * t * d * q.element_size()
    assert exe.last_profile.hbm_bytes == nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("t,c,heads", [(128, 768, 12), (37, 96, 3), (160, 128, 2)])
def test_gpt2_causal_heads(t, c, heads, dtype):
    g = torch.Generator().manual_seed(t)
    qkv = torch.randn(1, t, 3 * c, generator=g).to(dtype)
    ir, exe = _check(lambda x: causal_heads(x, heads), qkv)
    # the triangular mask is a GpSimd affine_select (no mask tensor loaded, no VectorE select)
    prof = exe.last_profile
    assert prof.counts.get("GpSimd", 0) >= heads
    assert prof.hbm_read_bytes == qkv.numel() * qkv.element_size()


def test_additive_float_mask_and_batch_broadcast():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 64, 32, generator=g) for _ in range(3))
    bias = torch.randn(2, 1, 64, 64, generator=g)        # per batch, broadcast over heads

    def f(q, k, v, bias):
        s = q @ k.transpose(-2, -1) / math.sqrt(32) + bias
        return torch.softmax(s, -1) @ v

    _check(f, q, k, v, bias)


def test_sdpa_causal():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 4, 96, 64, generator=g) for _ in range(3))

    def f(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    _check(f, q, k, v, expect_group=False)


def test_not_planned_when_scores_escape():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))

    def f(q, k, v):
        p = torch.softmax(q @ k.transpose(-2, -1), -1)
        return p @ v, p

    ir = tn.passes.optimize(tn.make_ir(f)(q, k, v))
    assert not attention.plan(ir, {})
    exe = compile_ir(ir, strict=True)
    for got, want in zip(exe([q, k, v]), f(q, k, v)):
        torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_gpt2_block_device_time_and_utilisation():
    """The benchmark's GPT-2 block (bf16): TensorE-active utilisation >= 70% in steady state."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    from models import GPT2Block

    torch.manual_seed(0)
    m = GPT2Block().eval().to(torch.bfloat16)
    x = torch.randn(1, 128, 768).to(torch.bfloat16)
    f = tn.jit(m, backend="neuron")
    with torch.no_grad():
        want = m(x)
        f(x)
        with tn.profile() as prof:
            got = f(x)
    torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)
    runs = prof.runs
    flops = sum(r.matmul_flops for r in runs)
    busy = sum(r.busy_ns["TensorE"] for r in runs) * 1e-9
    assert flops / (runs[0].arch.peak_flops_bf16 * busy) >= 0.7


# --------------------------------------------------------------------------- HF attention shapes (issue 16)

def _hf_model(name):
    sys_path = os.path.join(os.path.dirname(__file__))
    if sys_path not in sys.path:
        sys.path.insert(0, sys_path)
    from test_hf_models import build

    return build(name)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("batch,pad", [(1, False), (2, True)], ids=["b1", "b2-padded"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_hf_attention_planned_and_matches_torch(name, batch, pad, autocast):
    """Every layer's attention of tiny HF GPT-2, Llama (GQA, rotary) and BERT is one attention group, in fp32 and
    under bf16 autocast, at batch 1 and batch 2 with padding (fully masked rows: ``_safe_softmax``'s zeros);
    the logits match torch."""
    pytest.importorskip("transformers")
    from test_hf_models import inputs

    m = _hf_model(name)
    ids, mask = inputs(batch=batch, seq=16, pad=pad)

    def f(m, ids, mask):
        return m(input_ids=ids, attention_mask=mask).logits

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ir = tn.passes.optimize(tn.make_ir(f)(m, ids, mask))
        assert len(attention.plan(ir, {})) == 2
        got = tn.jit(f, backend="neuron")(m, ids, mask)
        want = f(m, ids, mask)
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_materialised_k_transpose_read_as_laid_out():
    """K^T that lies in HBM keys-contiguous (an input here; BERT's scaled key under autocast is made so by an
    elementwise group) is loaded as it lies, the layout the scores' matmul reads: no TensorE transposes of K,
    unlike K given as rows (``k.transpose(-2, -1)``), and the same result."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 4, 128, 64, generator=g) for _ in range(3))
    kt = k.transpose(-2, -1).contiguous()

    def laid_out(q, kt, v):
        return torch.softmax((q @ kt) * 0.125, -1) @ v

    def rows(q, k, v):
        return torch.softmax((q @ k.transpose(-2, -1)) * 0.125, -1) @ v

    _, exe_t = _check(laid_out, q, kt, v)
    _, exe_r = _check(rows, q, k, v)
    n_transposes = [sum(st.enc.opcode_counts().get("transpose", 0) for st in e._steps) for e in (exe_t, exe_r)]
    k_transposes = 4 // 2        # 4 heads of 64, two per 128-partition transpose
    assert n_transposes[0] == n_transposes[1] - k_transposes
    torch.testing.assert_close(exe_t([q, kt, v])[0], exe_r([q, k, v])[0], rtol=0, atol=0)


def test_safe_softmax_constant_made_inside_and_shared():
    """SDPA with a boolean mask: ``_safe_softmax`` makes a ``full`` zeros between the matmuls (too large to fold
    into a constant), which CSE shares with the next attention. Both attentions are groups: the first writes
    the constant for its later readers, the second fills it on chip instead of loading it."""
    g = torch.Generator().manual_seed(9)
    q, k, v, k2, v2 = (torch.randn(1, 8, 96, 16, generator=g) for _ in range(5))
    keep = torch.rand(1, 1, 96, 96, generator=g) > 0.3
    keep[:, :, 0] = False                    # a fully masked row

    def f(q, k, v, k2, v2, keep):
        sdpa = torch.nn.functional.scaled_dot_product_attention
        o = sdpa(q, k, v, attn_mask=keep)
        return sdpa(o, k2, v2, attn_mask=keep)

    ir = tn.passes.optimize(tn.make_ir(f)(q, k, v, k2, v2, keep))
    assert sum(e.op.name == "full" for e in ir.eqns) == 1
    groups = list(attention.plan(ir, {}).values())
    assert len(groups) == 2 and all(gr.fills for gr in groups)
    assert len(groups[0].outputs) == 2 and groups[0].outputs[1] in groups[1].fills
    assert groups[0].outputs[1] not in groups[1].inputs
    _check(f, q, k, v, k2, v2, keep)


def test_shared_key_transpose_is_a_base():
    """A scaled K^T read by two attentions (CSE) is made once and is each group's base: both are groups."""
    g = torch.Generator().manual_seed(10)
    q, k, v, v2 = (torch.randn(2, 4, 32, 16, generator=g) for _ in range(4))

    def f(q, k, v, v2):
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return sdpa(sdpa(q, k, v), k, v2)

    ir = tn.passes.optimize(tn.make_ir(f)(q, k, v, v2))
    assert len(attention.plan(ir, {})) == 2
    _check(f, q, k, v, v2)


@pytest.mark.parametrize("src,dst", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)], ids=str)
def test_cast_and_scale_prologue_applied_on_chip(src, dst):
    """q/k/v cast (and q, k scaled, as BERT's SDPA does under autocast: ``q * d**-0.25``, ``k^T * d**-0.25``)
    before the attention: the casts and scales are the group's, applied on chip to the loaded blocks, so the
    program reads q, k and v once in their own dtype and writes only the output; the result matches torch."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 4, 128, 64, generator=g).to(src) for _ in range(3))
    c = 64 ** -0.25

    def f(q, k, v):
        s = (q.to(dst) * c) @ (k.to(dst).transpose(-2, -1) * c)
        return torch.softmax(s, -1) @ (v.to(dst) / 2.0)

    ir, exe = _check(f, q, k, v)
    (grp,) = attention.plan(ir, {}).values()
    assert all(any(e.op.name == "convert" for e in ch) for ch in (grp.q_chain, grp.k_chain, grp.v_chain))
    assert grp.bases == tuple(ir.inputs)
    prof = exe.last_profile
    assert prof.hbm_read_bytes == sum(x.numel() * x.element_size() for x in (q, k, v))
    assert prof.hbm_write_bytes == q.numel() * torch.empty((), dtype=dst).element_size()


def test_output_cast_and_head_merge_written_by_the_group():
    """An fp32 attention whose output is cast to bf16 and merged back to ``[B, T, H*d]`` (BERT under autocast):
    the cast is the group's (O rounded once from PSUM), so the group writes the bf16 merged output and nothing
    else; equal to torch's fp32 result rounded to bf16."""
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 4, 128, 64, generator=g) for _ in range(3))

    def f(q, k, v):
        o = torch.softmax(q @ k.transpose(-2, -1) * 0.125, -1) @ v
        return o.to(torch.bfloat16).transpose(1, 2).reshape(1, 128, 256)

    ir, exe = _check(f, q, k, v)
    (grp,) = attention.plan(ir, {}).values()
    names = [e.op.name for e in grp.out_chain]
    assert "convert" in names and "permute" in names
    assert exe.last_profile.hbm_write_bytes == q.numel() * 2
