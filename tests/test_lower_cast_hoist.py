# Tests of tn/lower/schedule.py hoist_past_weight_casts (issue 16): an activation's cast to bf16 traced after
# the casts of a Linear's weight and bias (autocast's order) joins its producer's LayerNorm row group, which hands
# the bf16 rows to the matmul in SBUF instead of a map group reading the fp32 norm back from HBM.
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("tn.lower.schedule")
import tn  # noqa: E402
import tn.lower  # noqa: E402,F401
import tn.lower.compiler as compiler  # noqa: E402
from tn.lower.schedule import hoist_past_weight_casts  # noqa: E402

S, H, O = 64, 96, 128


def _f(x, gamma, beta, w, bias):
    """LayerNorm, then a bf16 Linear whose weight and bias are cast where it is called (as under autocast); the
    fp32 norm is also a result (BERT's residual reads it)."""
    n = F.layer_norm(x, (H,), gamma, beta, 1e-12)
    wb, bb = w.to(torch.bfloat16), bias.to(torch.bfloat16)
    return F.linear(n.to(torch.bfloat16), wb, bb), n


def _args():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(S, H, generator=g), torch.randn(H, generator=g), torch.randn(H, generator=g),
            torch.randn(O, H, generator=g) / 10, torch.randn(O, generator=g))


def _compile_ir(monkeypatch, ir, without=None):
    """``ir`` compiled for trn1 (strict), with the schedule pass named ``without`` (if any) switched off."""
    if without is not None:
        monkeypatch.setattr(compiler, without, lambda ir: ir)
    exe = compiler.compile_ir(ir, strict=True, arch="trn1")
    monkeypatch.undo()
    return exe


def _compile(monkeypatch, hoist):
    args = _args()
    ir = tn.make_ir(_f)(*args)
    return _compile_ir(monkeypatch, ir, without=None if hoist else "hoist_past_weight_casts"), args


def _hbm_bytes_of_a_checked_run(exe, args, want):
    """``(HBM bytes read, written)`` of one run of ``exe``, whose first output must match ``want`` (bf16)."""
    got = exe(args)[0]
    torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-2)
    return (sum(r.hbm_read_bytes for r in exe.last_profile.runs),
            sum(r.hbm_write_bytes for r in exe.last_profile.runs))


def test_hoist_moves_the_cast_before_the_weight_casts():
    """The activation's cast moves before the two weight casts; the casts keep their order; an IR with nothing
    left to move comes back as is."""
    ir = tn.make_ir(_f)(*_args())
    before = [(e.op.name, e.inputs[0] in ir.inputs) for e in ir.eqns if e.op.name == "convert"]
    assert before == [("convert", True), ("convert", True), ("convert", False)]
    out = hoist_past_weight_casts(ir)
    after = [(e.op.name, e.inputs[0] in ir.inputs) for e in out.eqns if e.op.name == "convert"]
    assert after == [("convert", False), ("convert", True), ("convert", True)]
    assert sorted(map(id, out.eqns)) == sorted(map(id, ir.eqns))
    assert hoist_past_weight_casts(out) is out


def test_norm_hands_bf16_rows_to_the_matmul(monkeypatch):
    """With the hoist the row group ends with the cast and keeps its bf16 result in SBUF for the matmul: one
    unit fewer; the fp32 norm is no longer read back from HBM (S x H x 4 bytes) nor its bf16 cast written and
    read (S x H x 2 each way). Both agree with torch."""
    old, args = _compile(monkeypatch, hoist=False)
    new, _ = _compile(monkeypatch, hoist=True)
    rows = [u for u in new.schedule.units if u.kind == "row"]
    assert len(rows) == 1 and [v.dtype for v in rows[0].keeps] == [torch.bfloat16]
    assert not any(u.kind == "row" and u.keeps for u in old.schedule.units)
    assert len(new.schedule.units) == len(old.schedule.units) - 1
    want = _f(*args)
    for exe in (old, new):
        got = exe(list(args))
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2e-2, atol=2e-2)
    (r_old,), (r_new,) = old.last_profile.runs, new.last_profile.runs
    assert r_old.hbm_read_bytes - r_new.hbm_read_bytes == S * H * (4 + 2)
    assert r_old.hbm_write_bytes - r_new.hbm_write_bytes == S * H * 2
    assert r_new.total_ns < r_old.total_ns


def _bert_layer():
    """A small BertLayer (hidden 256, 4 heads, sequence 64: the fingerprinted block) and its input."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=256, num_attention_heads=4, intermediate_size=1024, attn_implementation="sdpa")
    return BertLayer(cfg).eval(), torch.randn(1, 64, 256)


def test_attention_hands_its_merged_heads_to_the_o_projection(monkeypatch):
    """BertLayer under bf16 autocast: the reshape merging the heads, traced after the o-projection's weight and
    bias casts, is hoisted next to the attention group, which absorbs it and keeps its [64, 256] bf16 output in
    SBUF for the o-projection (before: it went through HBM). Same answer."""
    pytest.importorskip("transformers")
    layer, x = _bert_layer()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ir = tn.make_ir(layer)(x)
        want = layer(x)
    want = want[0] if isinstance(want, tuple) else want
    args = [p.detach() for p in layer.parameters()] + [x]     # make_ir of a module: parameters, then inputs
    assert len(args) == len(ir.inputs)

    old, new = _compile_ir(monkeypatch, ir, without="hoist_past_weight_casts"), _compile_ir(monkeypatch, ir)
    att_new = [u for u in new.schedule.units if u.kind == "attention"]
    att_old = [u for u in old.schedule.units if u.kind == "attention"]
    assert len(att_new) == 1 and len(att_old) == 1
    assert not att_old[0].keeps and len(att_new[0].keeps) == 1
    kept = att_new[0].keeps[0]
    assert tuple(kept.shape) == (64, 256) and kept.dtype == torch.bfloat16
    assert any(kept in u.takes and u.kind == "epilogue" for u in new.schedule.units)
    rb = {name: _hbm_bytes_of_a_checked_run(exe, args, want) for name, exe in (("old", old), ("new", new))}
    tile = 64 * 256 * 2
    # before: the attention output stored, copied by the reshape (read and written) and read back by the
    # o-projection: 4 tiles read and 2 written more
    assert rb["old"][0] - rb["new"][0] == 4 * tile and rb["old"][1] - rb["new"][1] == 2 * tile


def test_head_splits_sink_into_the_attention_group(monkeypatch):
    """BertLayer under bf16 autocast: each of q, k, v is split into heads (reshape, permute) right after its
    projection, before the next projection's weight casts. schedule.sink_head_splits moves the splits next to the
    scores' matmul, where the attention group reads them as views of the projections' outputs, which the
    projections keep in SBUF: no permute copies, no q/k/v through HBM. Same answer; GPT-2's split of its fused
    qkv (views of slices) is left alone."""
    pytest.importorskip("transformers")
    from tn.lower.schedule import sink_head_splits

    layer, x = _bert_layer()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ir = tn.make_ir(layer)(x)
        want = layer(x)
    want = want[0] if isinstance(want, tuple) else want
    args = [p.detach() for p in layer.parameters()] + [x]     # make_ir of a module: parameters, then inputs

    old, new = _compile_ir(monkeypatch, ir, without="sink_head_splits"), _compile_ir(monkeypatch, ir)
    (att,) = [u for u in new.schedule.units if u.kind == "attention"]
    assert len(att.takes) == 3 and all(tuple(v.shape) == (64, 256) for v in att.takes)
    assert not any(u.kind == "op" and new.ir.eqns[u.start].op.name == "permute" for u in new.schedule.units)
    assert any(u.kind == "op" and old.ir.eqns[u.start].op.name == "permute" for u in old.schedule.units)
    rb = {name: _hbm_bytes_of_a_checked_run(exe, args, want) for name, exe in (("old", old), ("new", new))}
    tile = 64 * 256 * 2
    # before: the projections' stores, the permute copies and the attention's reads of them
    assert rb["old"][0] - rb["new"][0] == 5 * tile and rb["old"][1] - rb["new"][1] == 5 * tile
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    block = GPT2Block(GPT2Config(n_embd=64, n_head=4, n_positions=32, attn_implementation="sdpa")).eval()
    with torch.no_grad():
        gir = tn.make_ir(block)(torch.randn(1, 16, 64))
    assert sink_head_splits(gir) is gir



def test_two_head_splits_read_by_one_matmul_sink_once():
    """Two splits whose first reader is the same matmul each move once (no ping-pong), in their order, and the
    program still agrees with torch."""
    from tn.lower.schedule import sink_head_splits

    def f(x, w1, w2, w3):
        q = (x @ w1).reshape(8, 2, 16).permute(1, 0, 2)
        k = (x @ w2).reshape(8, 2, 16).permute(1, 2, 0)
        return q @ k, x @ w3

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(8, 32, generator=g)] + [torch.randn(32, 32, generator=g) for _ in range(3)]
    ir = tn.make_ir(f)(*args)
    assert [e.op.name for e in ir.eqns] == ["matmul", "reshape", "permute"] * 2 + ["matmul", "matmul"]
    assert [e.op.name for e in sink_head_splits(ir).eqns] == \
        ["matmul"] * 2 + ["reshape", "permute"] * 2 + ["matmul"] * 2
    for got, want in zip(compiler.compile_ir(ir, strict=True)(args), f(*args)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
