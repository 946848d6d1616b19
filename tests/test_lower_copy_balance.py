# Tests of tn/lower/elementwise.py's copy placement (issue 16): a float cast in a fused group (LayerNorm's bf16
# output under autocast) goes to ScalarE when VectorE has more work, instead of always queueing on VectorE.
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("tn.lower.elementwise")
import tn  # noqa: E402
import tn.lower  # noqa: E402,F401
import tn.lower.compiler as compiler  # noqa: E402
import tn.lower.elementwise as elementwise  # noqa: E402

R, H = 1024, 768


def _norm_cast(x, res, gamma, beta):
    """The residual add and LayerNorm of a BERT layer, its fp32 result and the bf16 copy the next matmul reads."""
    n = F.layer_norm(x + res, (H,), gamma, beta, 1e-12)
    return n, n.to(torch.bfloat16)


def _args():
    g = torch.Generator().manual_seed(4)
    return [torch.randn(R, H, generator=g), torch.randn(R, H, generator=g), torch.randn(H, generator=g),
            torch.randn(H, generator=g)]


def _vector_copy(ctx, out, x):
    """The placement before: every copy on VectorE."""
    if not hasattr(x, "mem"):
        ctx.prog.memset(out, float(x))
    else:
        ctx.prog.tensor_copy(out, x)


def _compile(monkeypatch, balanced=True):
    if not balanced:
        monkeypatch.setattr(elementwise, "_copy", _vector_copy)
    exe = compiler.compile_ir(tn.make_ir(_norm_cast)(*_args()), strict=True, arch="trn1")
    out = exe(_args())
    monkeypatch.undo()
    return exe, out


def _copies(exe):
    return [q for q, _, _, o in exe.last_profile.runs[-1].instructions() if o == "tensor_copy"]


def test_the_norm_cast_is_shared_with_scalare(monkeypatch):
    """One row group; some of its casts run on ScalarE (none before); the results are bit-identical, equal to
    torch, and the modelled time is lower."""
    new, got = _compile(monkeypatch)
    old, want = _compile(monkeypatch, balanced=False)
    assert [u.kind for u in new.schedule.units] == ["row"]
    assert "ScalarE" in _copies(new) and "ScalarE" not in _copies(old)
    assert len(_copies(new)) == len(_copies(old))
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    ref = _norm_cast(*_args())
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1].float(), ref[1].float(), rtol=1e-2, atol=1e-2)
    assert new.last_profile.runs[-1].total_ns < old.last_profile.runs[-1].total_ns
