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


def _engine_busy(exe):
    runs = exe.last_profile.runs
    busy = {}
    for r in runs:
        for q, ns in r.busy_ns.items():
            busy[q] = busy.get(q, 0.0) + ns
    return busy, sum(r.total_ns for r in runs)


def test_attention_balances_copies_and_row_ops_across_engines(monkeypatch):
    """BERT's attention under autocast at batch 2, 12 heads of 64 (bf16 projections split into heads, cast to
    fp32 and scaled, the additive mask, softmax with the all-masked-row check, P V, heads merged and cast back):
    with the balance (attention.BALANCE_ENGINES) the PSUM evacuations and casts go to whichever of VectorE /
    ScalarE (/ GpSimd for SBUF-only copies) would finish first, and row ops weigh every engine's counted work,
    instead of copies alternating VectorE and ScalarE. Same instructions but their engines: bit-identical results,
    same HBM bytes, VectorE (the busiest engine before) at most 80 % as busy, the modelled time 10 % shorter."""
    Bq, Sq, Hq, Dq = 2, 128, 12, 64

    def split(t):
        return t.reshape(Bq, Sq, Hq, Dq).permute(0, 2, 1, 3).float()

    def f(a, b, c, mask):
        """Scores of fp32 heads scaled as BERT's sdpa scales them, masked softmax, P V, merged bf16 heads."""
        o = F.scaled_dot_product_attention(split(a), split(b), split(c), attn_mask=mask)
        return o.to(torch.bfloat16).permute(0, 2, 1, 3).reshape(Bq * Sq, Hq * Dq)

    g = torch.Generator().manual_seed(3)
    args = [torch.randn(Bq * Sq, Hq * Dq, generator=g).to(torch.bfloat16) for _ in range(3)]
    mask = torch.zeros(Bq, 1, 1, Sq)
    mask[1, ..., 100:] = torch.finfo(torch.float32).min
    args.append(mask)
    want = f(*args)
    ir = tn.make_ir(f)(*args)
    res = {}
    for balance in (False, True):
        monkeypatch.setattr(attention, "BALANCE_ENGINES", balance)
        exe = compiler.compile_ir(ir, strict=True, arch="trn1")
        assert [u.kind for u in exe.schedule.units] == ["attention"]
        (out,), nbytes = run_with_hbm_bytes(exe, args)
        res[balance] = (out, nbytes, exe.stats["instructions"]) + _engine_busy(exe)
    monkeypatch.undo()
    (o0, b0, n0, busy0, t0), (o1, b1, n1, busy1, t1) = res[False], res[True]
    assert torch.equal(o0, o1) and b0 == b1 and n0 == n1
    torch.testing.assert_close(o1.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert max(busy0["VectorE"], busy0["ScalarE"], busy0["GpSimd"]) == busy0["VectorE"]
    assert busy1["VectorE"] <= 0.8 * busy0["VectorE"]
    assert t1 <= 0.9 * t0


def test_q_and_k_are_transposed_as_loaded_and_cast_as_they_leave_psum(monkeypatch):
    """BERT's q/k prologue under autocast (bf16 -> fp32 cast, then the d**-0.25 scale) is applied as each
    transposed block leaves PSUM (attention.LATE_PROLOGUE): the bf16 blocks are transposed as loaded (a quarter
    of an fp32 transpose's TensorE time) and the cast and scale ride on the evacuation. Bit-identical results, the
    same HBM bytes, fewer instructions (the casts and scales of the loaded q and k blocks), less TensorE time,
    a shorter modelled time."""
    Bq, Sq, Hq, Dq = 2, 128, 4, 64

    def split(t):
        return t.reshape(Bq, Sq, Hq, Dq).permute(0, 2, 1, 3).float()

    def f(a, b, c):
        """Scores of fp32 heads scaled as BERT's sdpa scales them, softmax, P V."""
        return F.scaled_dot_product_attention(split(a), split(b), split(c))

    g = torch.Generator().manual_seed(4)
    args = [torch.randn(Bq * Sq, Hq * Dq, generator=g).to(torch.bfloat16) for _ in range(3)]
    ir = tn.make_ir(f)(*args)
    res = {}
    for late in (False, True):
        monkeypatch.setattr(attention, "LATE_PROLOGUE", late)
        exe = compiler.compile_ir(ir, strict=True, arch="trn1")
        (out,), nbytes = run_with_hbm_bytes(exe, args)
        res[late] = (out, nbytes, exe.stats["instructions"]) + _engine_busy(exe)
    monkeypatch.undo()
    (o0, b0, n0, busy0, t0), (o1, b1, n1, busy1, t1) = res[False], res[True]
    assert torch.equal(o0, o1) and b0 == b1 and n1 < n0
    torch.testing.assert_close(o1, f(*args), rtol=1e-4, atol=1e-4)
    assert busy1["TensorE"] < 0.9 * busy0["TensorE"]
    assert t1 < t0


def test_safe_softmax_rows_of_minus_inf_are_zeroed_by_the_division(monkeypatch):
    """sdpa with a boolean mask (torch's _safe_softmax: rows of -inf give zeros, not NaN): with
    attention.SAFE_ROWS the group computes exp(x + min(-max, FLT_MAX)) / (sum + masked) instead of a select over
    the scores: one select per head fewer, results bit-identical to the select's (a fully masked row is 0, a row
    with a NaN or an inf is what torch gives), the same HBM bytes, a shorter modelled time."""
    Bq, Sq, Hq, Dq = 2, 128, 4, 64

    def split(t):
        return t.reshape(Bq, Sq, Hq, Dq).permute(0, 2, 1, 3).float()

    def f(a, b, c, mask):
        """Masked scaled-dot-product attention of fp32 heads."""
        return F.scaled_dot_product_attention(split(a), split(b), split(c), attn_mask=mask)

    g = torch.Generator().manual_seed(1)
    args = [torch.randn(Bq * Sq, Hq * Dq, generator=g).to(torch.bfloat16) for _ in range(3)]
    mask = torch.ones(Bq, 1, Sq, Sq, dtype=torch.bool)
    mask[1, 0, 5, :] = False            # a fully masked query row: zeros
    mask[0, 0, :, 100:] = False
    args.append(mask)
    odd = [a.clone() for a in args]
    odd[0][3, 5] = float("nan")
    odd[1][9, 70] = float("inf")
    ir = tn.make_ir(f)(*args)
    res = {}
    for safe in (False, True):
        monkeypatch.setattr(attention, "SAFE_ROWS", safe)
        exe = compiler.compile_ir(ir, strict=True, arch="trn1")
        (out,), nbytes = run_with_hbm_bytes(exe, args)
        t = sum(r.total_ns for r in exe.last_profile.runs)
        (out_odd,), _ = run_with_hbm_bytes(exe, odd)
        ops = {}
        for st in exe._steps:
            for k, v in getattr(getattr(st, "enc", None), "opcode_counts", lambda: {})().items():
                ops[k] = ops.get(k, 0) + v
        res[safe] = (out, nbytes, t, out_odd, ops)
    monkeypatch.undo()
    (o0, b0, t0, x0, ops0), (o1, b1, t1, x1, ops1) = res[False], res[True]
    assert ops0["select"] - ops1.get("select", 0) == Bq * Hq      # one per head (the mask's own where stays)
    assert torch.equal(o0, o1) and b0 == b1 and t1 < t0
    assert torch.equal(o1[1, :, 5], torch.zeros_like(o1[1, :, 5]))
    torch.testing.assert_close(o1, f(*args), rtol=1e-4, atol=1e-4)
    assert torch.equal(x0.isnan(), x1.isnan()) and torch.equal(x0.nan_to_num(), x1.nan_to_num())
    assert torch.equal(x1.isnan(), f(*odd).isnan())
