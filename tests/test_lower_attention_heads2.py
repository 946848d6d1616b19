# Tests of tn/lower/attention.py's two-level batch views (issue 16): at batch > 1 a head split
# ([B * S, E] -> [B, S, H, D] -> [B, H, S, D]) and the head merge are not one strided view of [B * H, S, D];
# the attention group reads q/k/v and writes O through [batch, heads] views instead of permute copies in HBM.
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("tn.lower.attention")
import tn  # noqa: E402
import tn.lower  # noqa: E402,F401
import tn.lower.compiler as compiler  # noqa: E402
from tn.lower import attention  # noqa: E402
from tn.lower.testing import run_with_hbm_bytes  # noqa: E402

B, S, D = 2, 64, 32


def _attn(H, causal=False):
    E = H * D

    def f(x, wq, wk, wv, wo):
        """Separate q/k/v projections, each split into heads, attention, heads merged, an output projection."""
        q = (x @ wq).view(B, S, H, D).transpose(1, 2)
        k = (x @ wk).view(B, S, H, D).transpose(1, 2)
        v = (x @ wv).view(B, S, H, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return o.transpose(1, 2).reshape(B * S, E) @ wo

    g = torch.Generator().manual_seed(H)
    args = [torch.randn(B, S, E, generator=g)] + [torch.randn(E, E, generator=g) / E ** 0.5 for _ in range(4)]
    return f, args


def _compile(monkeypatch, ir, two_level):
    monkeypatch.setattr(attention, "TWO_LEVEL_BATCH", two_level)
    exe = compiler.compile_ir(ir, strict=True, arch="trn1")
    monkeypatch.undo()
    return exe


@pytest.mark.parametrize("H,causal", [(4, False), (6, False), (6, True)])
def test_head_split_and_merge_are_views_of_the_attention(monkeypatch, H, causal):
    """The attention unit takes the head splits of q, k, v and the head merge: no permute is lowered on its own,
    the program writes q, k, v once (the projections) and the output once (O goes to the o-projection in SBUF):
    exactly 4 x B x S x E fp32 elements, where the one-level compile writes permute copies too. Both equal torch.
    (6 heads of 32: head groups of 4 heads cross a batch, so the groups are cut at each batch's heads.)"""
    f, args = _attn(H, causal)
    ir = tn.make_ir(f)(*args)
    old = _compile(monkeypatch, ir, False)
    new = _compile(monkeypatch, ir, True)
    kinds = [(u.kind, u.label) for u in new.schedule.units]
    assert ("attention", "attention") in kinds and not any(label == "permute" for _, label in kinds)
    assert any(label == "permute" for _, label in ((u.kind, u.label) for u in old.schedule.units))
    want = f(*args)
    (out_old,), (r_old, w_old) = run_with_hbm_bytes(old, args)
    (out_new,), (r_new, w_new) = run_with_hbm_bytes(new, args)
    for out in (out_old, out_new):
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    act = B * S * H * D * 4
    assert w_new == 4 * act
    assert w_old >= w_new + 3 * act and r_old >= r_new + 3 * act


def test_segments_never_cross_a_block():
    """Head groups: runs of at most ``bg`` heads, cut at every multiple of each view's block."""
    assert attention._segments(12, 4, [6, 12]) == [(0, 4), (4, 2), (6, 4), (10, 2)]
    assert attention._segments(8, 8, [4]) == [(0, 4), (4, 4)]
    assert attention._segments(5, 2, [5, 1 * 5]) == [(0, 2), (2, 2), (4, 1)]


def test_bert_model_batch2_reads_heads_in_place():
    """A small BertModel (2 layers, 4 heads) at batch 2 under bf16 autocast: each layer's attention unit absorbs
    its head splits and merge (no permute unit in the schedule), and tn.jit equals torch."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=4,
                                  intermediate_size=1024, vocab_size=512, max_position_embeddings=128)
    model = transformers.BertModel(cfg).eval()
    ids = torch.randint(0, 512, (2, 64))
    mask = torch.ones(2, 64, dtype=torch.long)
    mask[1, 50:] = 0

    def fwd(input_ids, attention_mask):
        """The last hidden state."""
        return model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = fwd(ids, mask)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):     # (a fresh autocast weight cache)
        ir = tn.make_ir(fwd)(ids, mask)
    exe = compiler.compile_ir(ir, strict=True, arch="trn1")
    got = exe([ids, mask])[0]
    labels = [u.label for u in exe.schedule.units]
    assert labels.count("attention") == 2 and "permute" not in labels
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
