# Tests of tn/lower/schedule.py row_any_from_max (issue 16): torch's _safe_softmax checks for all -inf rows with
# any(logical_not(eq(x, -inf))) over the whole score tensor; the compiler reads it off softmax's row max instead.
import pytest
import torch

pytest.importorskip("tn.lower.schedule")
import tn  # noqa: E402
import tn.lower  # noqa: E402,F401
import tn.lower.compiler as compiler  # noqa: E402
import tn.passes  # noqa: E402
from tn.lower.schedule import row_any_from_max  # noqa: E402

B, H, T, D = 2, 4, 96, 32
INF, NAN = float("inf"), float("nan")


def _sdpa(q, k, v, keep):
    """Scaled dot-product attention with a boolean mask (torch's ``_safe_softmax`` path)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def _args(nan_row=False):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    keep = torch.rand(B, 1, T, T, generator=g) > 0.3
    keep[0, :, 0] = False                    # a fully masked row: zeros
    keep[1, :, 5, 1:] = False                # one key left
    if nan_row:
        q[1, 2, 7, 0] = NAN                  # a NaN score row: NaN, as torch
    return [q, k, v, keep]


def _ops(ir):
    return [e.op.name for e in ir.eqns]


def _compile(monkeypatch, rewrite=True):
    """The SDPA compiled for trn1 (strict), with or without the rewrite."""
    if not rewrite:
        monkeypatch.setattr(compiler, "row_any_from_max", lambda ir: ir)
    exe = compiler.compile_ir(tn.passes.optimize(tn.make_ir(_sdpa)(*_args())), strict=True, arch="trn1")
    monkeypatch.undo()
    return exe


def test_the_check_is_read_off_the_row_max():
    """eq / logical_not / any over the scores become one ne(amax, -inf) over the row maxima; the other
    equations are unchanged and in order; an IR without the pattern comes back as is."""
    ir = tn.passes.optimize(tn.make_ir(_sdpa)(*_args()))
    ops = _ops(ir)
    assert "any" in ops and "eq" in ops
    out = row_any_from_max(ir)
    new = _ops(out)
    assert "any" not in new and "eq" not in new and new.count("ne") == ops.count("ne") + 1
    assert len(new) == len(ops) - 2
    ne = next(e for e in out.eqns if e.op.name == "ne")
    amax = next(e for e in out.eqns if e.op.name == "amax")
    assert ne.inputs[0] is amax.outputs[0] and ne.inputs[1].value == -INF
    assert tuple(ne.outputs[0].shape) == (B, H, T, 1)
    assert row_any_from_max(out) is out


def test_sdpa_with_masked_rows_matches_torch_and_does_less(monkeypatch):
    """The compiled SDPA equals torch (zeros for the fully masked row), bit-identical to the compile without
    the rewrite, with fewer instructions and less modelled time (the two passes over the scores are gone)."""
    new = _compile(monkeypatch)
    old = _compile(monkeypatch, rewrite=False)
    args = _args()
    got, = new(args)
    want = _sdpa(*args)
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    assert torch.equal(got[0, :, 0], torch.zeros_like(got[0, :, 0]))
    assert torch.equal(got, old(args)[0])
    assert new.stats["instructions"] < old.stats["instructions"]
    assert new.last_profile.runs[-1].total_ns < old.last_profile.runs[-1].total_ns


def test_a_nan_row_stays_nan(monkeypatch):
    """A NaN in a row's scores: torch returns NaN for it (the row is not all -inf); so does tn."""
    exe = _compile(monkeypatch)
    args = _args(nan_row=True)
    got, = exe(args)
    want = _sdpa(*args)
    assert torch.equal(got.isnan(), want.isnan()) and want.isnan().any()
    ok = ~want.isnan()
    torch.testing.assert_close(got[ok], want[ok], rtol=2e-4, atol=2e-4)
