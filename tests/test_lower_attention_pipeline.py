# Tests of fused attention's software pipelining across head groups (tn/lower/attention.py): several groups of heads
# loaded from HBM, odd group sizes, several query blocks and key blocks, masks; results against torch on the CPU.
import pytest
import torch

pytest.importorskip("tn.lower.attention")
import tn  # noqa: E402
import tn.lower  # noqa: E402,F401
import tn.passes  # noqa: E402
from tn.lower import attention  # noqa: E402
from tn.lower.compiler import compile_ir  # noqa: E402

TOL = {torch.float32: dict(rtol=2e-4, atol=2e-4), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def _check(f, *args):
    """Compile ``f`` strictly, check one attention group was planned and the results match torch."""
    ir = tn.passes.optimize(tn.make_ir(f)(*args))
    assert attention.plan(ir, {}), "no attention group planned"
    exe = compile_ir(ir, strict=True)
    got = exe(list(args))
    want = f(*args)
    torch.testing.assert_close(got[0], want, **TOL[want.dtype])
    return exe


def plain(q, k, v):
    """softmax(q k^T / sqrt(d)) v."""
    s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    return torch.softmax(s, dim=-1) @ v


def causal(q, k, v):
    """Causal attention over [B, H, T, d] heads (query i sees keys <= i)."""
    T = q.shape[-2]
    s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("b,h,t,tk,d", [(1, 12, 130, 200, 64),   # 4 groups of 3 heads, 2 query and key blocks
                                       (2, 5, 64, 64, 16),       # head size below 32: one head per transpose
                                       (1, 6, 200, 260, 32),     # 2 groups of 4 heads (4 heads per transpose)
                                       (3, 3, 17, 33, 8)])       # 9 heads in groups of 3, tiny rows
def test_head_groups_from_hbm(b, h, t, tk, d, dtype):
    """Heads split into several groups (each group's loads overlap the previous group's compute)."""
    g = torch.Generator().manual_seed(b * 1000 + h * 10 + d)
    q = torch.randn(b, h, t, d, generator=g).to(dtype)
    k = torch.randn(b, h, tk, d, generator=g).to(dtype)
    v = torch.randn(b, h, tk, d, generator=g).to(dtype)
    _check(plain, q, k, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_causal_head_groups(dtype):
    """A constant causal mask (affine_select) with heads in several pipelined groups."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 8, 128, 64, generator=g).to(dtype) for _ in range(3))
    _check(causal, q, k, v)


def test_repeated_calls_same_result():
    """The pipelined program gives the same result on every call (no state carried between runs)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 8, 128, 64, generator=g) for _ in range(3))
    exe = _check(plain, q, k, v)
    a = exe([q, k, v])[0]
    b = exe([q, k, v])[0]
    assert torch.equal(a, b)
