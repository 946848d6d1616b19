# Tests of tn/lower/attention.py's masked score evacuation (issue 16): an additive mask (BERT's extended attention
# mask) is added by the VectorE instruction that reads the scores out of PSUM, instead of a copy out of PSUM and a
# second pass adding two SBUF operands.
import pytest
import torch

pytest.importorskip("tn.lower.attention")
import tn  # noqa: E402
import tn.lower  # noqa: E402,F401
import tn.lower.compiler as compiler  # noqa: E402
import tn.passes  # noqa: E402
from tn.lower import attention  # noqa: E402

B, H, T, D = 2, 4, 96, 32


def _sdpa(q, k, v, bias):
    """Attention with an additive mask broadcast over the heads, added to the fp32 scores (a bf16 mask is
    promoted, as BERT's extended mask under autocast); ``q`` comes scaled."""
    return torch.softmax(q @ k.transpose(-2, -1) + bias, dim=-1) @ v


def _args(dtype=torch.float32):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    q = q * D ** -0.5
    bias = torch.where(torch.rand(B, 1, T, T, generator=g) > 0.2, 0.0, -1e4).to(dtype)
    return [q, k, v, bias]


def _compile(monkeypatch, args, fused=True):
    monkeypatch.setattr(attention._Emitter, "mask_in_evacuation", fused)
    exe = compiler.compile_ir(tn.passes.optimize(tn.make_ir(_sdpa)(*args)), strict=True, arch="trn1")
    out = exe(args)
    monkeypatch.undo()
    return exe, out


def _count(exe, opcode):
    return sum(1 for _, _, _, o in exe.last_profile.runs[-1].instructions() if o == opcode)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mask_added_as_the_scores_leave_psum(monkeypatch, dtype):
    """One attention group either way; with the mask in the evacuation one score copy per (batch, head) is gone
    (the add reads PSUM), the result is bit-identical and equal to torch, and the modelled time is lower."""
    args = _args(dtype)
    new, (got,) = _compile(monkeypatch, args)
    old, (want_old,) = _compile(monkeypatch, args, fused=False)
    assert [u.kind for u in new.schedule.units].count("attention") == 1
    assert [u.kind for u in old.schedule.units].count("attention") == 1
    assert torch.equal(got, want_old)
    torch.testing.assert_close(got, _sdpa(*args), rtol=2e-4, atol=2e-4)
    assert _count(new, "tensor_tensor") == _count(old, "tensor_tensor") == B * H
    assert _count(old, "tensor_copy") - _count(new, "tensor_copy") == B * H
    assert new.last_profile.runs[-1].total_ns < old.last_profile.runs[-1].total_ns
