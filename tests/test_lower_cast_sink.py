# Tests of tn/lower/schedule.py sink_casts_past_views (issue 16): at batch > 1 the q/k/v head splits are cut from
# the attention group (batch and heads do not merge into one strided view); their fp32 casts, traced between the
# splits, move below them so the group takes them as its on-chip prologue instead of a cast writing fp32 copies.
import pytest
import torch

pytest.importorskip("tn.lower.schedule")
import tn  # noqa: E402
import tn.lower  # noqa: E402,F401
from tn.lower.testing import run_with_hbm_bytes  # noqa: E402
import tn.lower.compiler as compiler  # noqa: E402
from tn.lower import attention  # noqa: E402
from tn.lower.schedule import sink_casts_past_views  # noqa: E402

B, S, NH, D = 2, 64, 4, 32
N = B * S * NH * D


def _split(x):
    return x.reshape(B, S, NH, D).permute(0, 2, 1, 3)


def _f(a, b, c):
    """BERT's attention under autocast at batch B: bf16 projections split into heads, each split cast to fp32
    right after it, scaled scores, softmax, P V."""
    q = _split(a).float()
    k = _split(b).float()
    v = _split(c).float()
    s = (q * D ** -0.25) @ (k * D ** -0.25).transpose(-2, -1)
    return torch.softmax(s, dim=-1) @ v


def _args():
    g = torch.Generator().manual_seed(2)
    return [torch.randn(B * S, NH * D, generator=g).to(torch.bfloat16) for _ in range(3)]


def _compile(monkeypatch, sink=True):
    # the one-level views this pass is for: with two-level views (tn.lower.attention.TWO_LEVEL_BATCH) the group
    # takes the splits too, casts between them included (tests/test_lower_attention_heads2.py)
    monkeypatch.setattr(attention, "TWO_LEVEL_BATCH", False)
    if not sink:
        monkeypatch.setattr(compiler, "sink_casts_past_views", lambda ir: ir)
    exe = compiler.compile_ir(tn.make_ir(_f)(*_args()), strict=True, arch="trn1")
    monkeypatch.undo()
    return exe



def test_casts_move_below_the_splits():
    """Each cast moves below the view equations after it (the later splits and casts), once; the casts keep
    their order; an IR with nothing to move comes back as is."""
    ir = tn.make_ir(_f)(*_args())
    ops = [e.op.name for e in ir.eqns]
    assert ops[:9] == ["reshape", "permute", "convert"] * 3
    out = sink_casts_past_views(ir)
    assert [e.op.name for e in out.eqns][:9] == ["reshape", "permute"] * 3 + ["convert"] * 3
    casts = [e for e in out.eqns if e.op.name == "convert"]
    assert casts == [e for e in ir.eqns if e.op.name == "convert"]
    assert sink_casts_past_views(out) is out


def test_attention_takes_the_casts_as_its_prologue(monkeypatch):
    """With the casts sunk no cast is a unit of its own: the attention group reads the bf16 splits and converts
    them on chip. Before, q's and k's casts (v's adjoins the group) each read N x 2 bytes and wrote N x 4 that
    the group read back instead of N x 2: reads change by -2 x N x 4 bytes, writes by -2 x N x 4. The result is
    bit-identical and equals torch."""
    new = _compile(monkeypatch)
    old = _compile(monkeypatch, sink=False)
    assert [u.kind for u in new.schedule.units].count("attention") == 1
    assert not [u for u in new.schedule.units if u.label == "convert"]
    assert len([u for u in old.schedule.units if u.label == "convert"]) == 2
    (got,), (rd_new, wr_new) = run_with_hbm_bytes(new, _args())
    (want,), (rd_old, wr_old) = run_with_hbm_bytes(old, _args())
    assert torch.equal(got, want)
    torch.testing.assert_close(got, _f(*_args()), rtol=2e-4, atol=2e-4)
    assert rd_old - rd_new == 2 * N * 4 and wr_old - wr_new == 2 * N * 4
