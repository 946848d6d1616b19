# Tests of tn/lower/schedule.py's bias casts (issue 16): under autocast nn.Linear casts its fp32 bias where it is
# called; the matmul that adds the bias in PSUM loads the fp32 row and rounds it on chip, so the cast is not an
# equation of its own storing a bf16 copy to HBM that the matmul reads back.
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("tn.lower.schedule")
import tn  # noqa: E402
import tn.lower  # noqa: E402,F401
from tn.lower.testing import run_with_hbm_bytes  # noqa: E402
import tn.lower.compiler as compiler  # noqa: E402
import tn.lower.matmul as matmul  # noqa: E402
import tn.lower.schedule as schedule  # noqa: E402

S, H, O = 64, 96, 256


def _f(x, w, bias):
    """A bf16 Linear whose weight and bias are cast where it is called (as under autocast)."""
    return F.linear(x.to(torch.bfloat16), w.to(torch.bfloat16), bias.to(torch.bfloat16))


def _f_bias_kept(x, w, bias):
    """As ``_f``, with the cast bias also a result: it must be made, so it is not cast by the matmul."""
    b = bias.to(torch.bfloat16)
    return F.linear(x.to(torch.bfloat16), w.to(torch.bfloat16), b), b


def _args():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(S, H, generator=g), torch.randn(O, H, generator=g) / 10, torch.randn(O, generator=g)]


def _compile(monkeypatch, fn, cast=True):
    """``fn`` compiled for trn1 (strict); ``cast=False``: without the bias-cast plan (the convert lowered)."""
    if not cast:
        monkeypatch.setattr(schedule, "_plan_bias_casts", lambda *a: {})
    exe = compiler.compile_ir(tn.make_ir(fn)(*_args()), strict=True, arch="trn1")
    monkeypatch.undo()
    return exe



def test_the_matmul_rounds_the_fp32_bias(monkeypatch):
    """The bias's convert is skipped (no op unit of its own) and the epilogue unit names the cast; the result is
    bit-identical to the compile lowering the convert (the same rounding, added in PSUM either way) and equal to
    torch; the bf16 copy is neither written (O x 2 bytes) nor read back (O x 2): reads change by -O x 2."""
    new = _compile(monkeypatch, _f)
    old = _compile(monkeypatch, _f, cast=False)
    assert not any(u.label == "convert" and u.kind == "op" and u.group is None and
                   new.ir.eqns[u.start].inputs[0] is new.ir.inputs[2] for u in new.schedule.units)
    assert any(u.label == "convert" for u in old.schedule.units)
    assert len(new.schedule.bias_casts) == 1
    (b, (j, src)), = new.schedule.bias_casts.items()
    assert src is new.ir.inputs[2] and new.ir.eqns[j].op.name == "convert" and j in new.schedule.skipped
    assert "on chip" in str(new.schedule)
    (got,), (rd_new, wr_new) = run_with_hbm_bytes(new, _args())
    (want,), (rd_old, wr_old) = run_with_hbm_bytes(old, _args())
    assert torch.equal(got, want)
    torch.testing.assert_close(got.float(), _f(*_args()).float(), rtol=2e-2, atol=2e-2)
    assert rd_old - rd_new == O * 2
    assert wr_old - wr_new == O * 2
    assert new.last_profile.runs[-1].total_ns < old.last_profile.runs[-1].total_ns


def test_a_cast_bias_that_is_a_result_is_made(monkeypatch):
    """A cast bias read by something else (here: returned) is lowered as its convert, as before."""
    exe = _compile(monkeypatch, _f_bias_kept)
    assert not exe.schedule.bias_casts
    (y, b), _ = run_with_hbm_bytes(exe, _args())
    wy, wb = _f_bias_kept(*_args())
    assert torch.equal(b, wb)
    torch.testing.assert_close(y.float(), wy.float(), rtol=2e-2, atol=2e-2)


def test_a_matmul_that_does_not_add_the_bias_gets_the_convert_back(monkeypatch):
    """When the matmul does not take the bias (here: it is not offered one) the unit fails with a veto at the
    convert, and the next plan lowers the convert and applies the add in the epilogue; the answer is still
    right."""
    emit_matmul = matmul.emit_matmul

    def refusing(ctx, *args, **kw):
        ctx.unit.matmul_bias = None
        return emit_matmul(ctx, *args, **kw)

    monkeypatch.setattr(matmul, "emit_matmul", refusing)
    exe = compiler.compile_ir(tn.make_ir(_f)(*_args()), strict=True, arch="trn1")
    assert not exe.schedule.bias_casts
    assert [v.kind for v in exe.schedule.vetoes.history] == ["nofuse"]
    assert exe.ir.eqns[exe.schedule.vetoes.history[0].at].op.name == "convert"
    (got,), _ = run_with_hbm_bytes(exe, _args())
    torch.testing.assert_close(got.float(), _f(*_args()).float(), rtol=2e-2, atol=2e-2)
