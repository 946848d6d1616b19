# Tests of tn/lower/fusion.py + epilogue.py (issue 16): a matmul's epilogue goes on through a reshape regrouping
# the head's leading axes ([B*S, F] -> [B, S, F], as HF's Linear over a batch), so GELU after BERT's FFN-in at
# batch > 1 is applied in the matmul's stores instead of an HBM round trip of its own.
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("tn.lower.fusion")
import tn  # noqa: E402
import tn.lower  # noqa: E402,F401
from tn.lower.testing import run_with_hbm_bytes  # noqa: E402
import tn.lower.compiler as compiler  # noqa: E402
import tn.lower.fusion as fusion  # noqa: E402
from tn.lower.epilogue import EpilogueGroup  # noqa: E402

B, S, H, FF = 4, 64, 96, 384


def _ffn_in(x, w, b, g):
    """Linear over [B*S, H] rows viewed as [B, S, FF], GELU and a per-feature scale, back to rows."""
    y = F.linear(x, w, b).reshape(B, S, FF)
    return (F.gelu(y) * g).reshape(B * S, FF)


def _ffn_in_batch_operand(x, w, b, t):
    """As ``_ffn_in`` with a [B, 1, FF] operand after the regroup: not a vector along the last axis."""
    y = F.linear(x, w, b).reshape(B, S, FF)
    return F.gelu(y) + t


def _args(last=None):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B * S, H, generator=gen).to(torch.bfloat16)
    w = (torch.randn(FF, H, generator=gen) / 10).to(torch.bfloat16)
    b = torch.randn(FF, generator=gen).to(torch.bfloat16)
    return [x, w, b, torch.randn(*(last or (FF,)), generator=gen).to(torch.bfloat16)]


def _compile(monkeypatch, fn, args, regroup=True):
    if not regroup:
        monkeypatch.setattr(fusion, "is_regroup", lambda *a: False)
    exe = compiler.compile_ir(tn.make_ir(fn)(*args), strict=True, arch="trn1")
    monkeypatch.undo()
    return exe



def test_gelu_after_a_regrouping_reshape_joins_the_matmul_epilogue(monkeypatch):
    """One epilogue unit covers the bias add, the reshape, GELU, the scale and the reshape back; the program
    moves the minimum HBM bytes; bit-identical to the unfused compile and equal to torch."""
    args = _args()
    new = _compile(monkeypatch, _ffn_in, args)
    old = _compile(monkeypatch, _ffn_in, args, regroup=False)
    epi = [u for u in new.schedule.units if u.kind == "epilogue"]
    assert len(epi) == 1 and isinstance(epi[0].group, EpilogueGroup)
    assert [e.op.name for e in epi[0].group.eqns] == ["add", "reshape", "gelu", "mul", "reshape"]
    assert len(new.schedule.units) < len(old.schedule.units)
    (got,), (rd_new, wr_new) = run_with_hbm_bytes(new, args)
    (want_old,), (rd_old, wr_old) = run_with_hbm_bytes(old, args)
    assert torch.equal(got, want_old)
    torch.testing.assert_close(got.float(), _ffn_in(*args).float(), rtol=2e-2, atol=2e-2)
    # the minimum: x, W, b and the scale read once, the result written once (before: the matmul's result
    # stored and read back by a map group, whose output a reshape copied into the result)
    assert rd_new == (B * S * H + FF * H + 2 * FF) * 2 and wr_new == B * S * FF * 2
    assert rd_old - rd_new == 2 * B * S * FF * 2 and wr_old - wr_new == 2 * B * S * FF * 2


def test_an_operand_that_broadcasts_over_the_regrouped_axes_ends_the_epilogue(monkeypatch):
    """A [B, 1, FF] operand after the regroup broadcasts differently over [B*S, FF]: the epilogue stops
    before its add (GELU may still join); the answer equals torch."""
    args = _args(last=(B, 1, FF))
    exe = _compile(monkeypatch, _ffn_in_batch_operand, args)
    epi = [u for u in exe.schedule.units if u.kind == "epilogue"]
    assert epi and all("add" not in [e.op.name for e in u.group.eqns[1:]] for u in epi)
    (got,), _ = run_with_hbm_bytes(exe, args)
    torch.testing.assert_close(got.float(), _ffn_in_batch_operand(*args).float(), rtol=2e-2, atol=2e-2)
