# Tests of ops that used to fail or run on the host: erfinv, cat with empty operands, conv3d, out= forms, int bitwise.
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tn
import tn.lower  # noqa: F401  (registers the lowerings and the neuron backend)
from tn.lower.testing import check_lowering


@pytest.fixture
def strict(monkeypatch):
    """Every equation must run on the NeuronCore (a host fallback is an UnsupportedOpError)."""
    monkeypatch.setenv("TN_STRICT", "1")


def _ulps(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    sp = torch.from_numpy(np.spacing(np.abs(ref.numpy())).astype(np.float64))
    return (got.double() - ref.double()).abs() / sp


# --------------------------------------------------------------------------- erfinv

def test_erfinv_fp32_within_a_few_ulp_of_torch():
    g = torch.Generator().manual_seed(0)
    n = 1 << 16
    x = torch.cat([torch.rand(n, generator=g) * 2 - 1,                       # central region
                   1 - torch.logspace(-7.2, -1, n),                           # tail (w >= 5)
                   -(1 - torch.logspace(-7.2, -1, n)),
                   torch.logspace(-38, -1, n) * torch.sign(torch.randn(n, generator=g)),
                   torch.tensor([1 - 2 ** -24, -1 + 2 ** -24, 2 ** -149, 0.5, -0.5])])
    from tn.lower import compile_ir
    from tn.lower.testing import build_eqn_ir

    (y,) = compile_ir(build_eqn_ir("erfinv", x), strict=True)([x])
    assert _ulps(y, torch.erfinv(x)).max().item() <= 4.0
    check_lowering("erfinv", x[:4096].to(torch.bfloat16))


def test_erfinv_special_values():
    x = torch.tensor([1.0, -1.0, 0.0, -0.0, 1.5, -2.0, math.nan, math.inf, -math.inf, 1.0000001])
    from tn.lower import compile_ir
    from tn.lower.testing import build_eqn_ir

    (y,) = compile_ir(build_eqn_ir("erfinv", x), strict=True)([x])
    ref = torch.erfinv(x)
    torch.testing.assert_close(y, ref, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(torch.signbit(y[:4]), torch.signbit(ref[:4]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_erfinv_jit_forward_backward(strict, dtype):
    def f(x):
        y = torch.special.erfinv(x)
        return y, torch.autograd.grad((y * y).sum(), x)[0]

    x = (torch.rand(37, 19, generator=torch.Generator().manual_seed(1)) * 1.98 - 0.99).to(dtype)
    y, g = tn.jit(f, backend="neuron")(x.clone().requires_grad_())
    yr, gr = f(x.clone().requires_grad_())
    torch.testing.assert_close(y, yr.detach())
    torch.testing.assert_close(g, gr, rtol=1e-4 if dtype == torch.float32 else 1.6e-2, atol=1e-4)


def test_erfinv_on_the_neuron_device(monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")
    x = torch.rand(300) * 2 - 1
    before = dict(torch.neuron.fallback_ops())
    y = torch.erfinv(x.to("neuron"))
    assert y.device.type == "neuron"
    torch.testing.assert_close(y.cpu(), torch.erfinv(x))
    assert torch.neuron.fallback_ops() == before


# --------------------------------------------------------------------------- cat with empty operands

_CATS = {
    "1d_empty_between": lambda a, b: torch.cat([a, torch.empty(0), b]),
    "zero_rows": lambda a, b: torch.cat([a, b[:0], b], 0),
    "zero_cols": lambda a, b: torch.cat([a.t(), b.t()[:, :0], b.t()], 1),
    "only_one_left": lambda a, b: torch.cat([a[:0], a, b[:0]]) * 2,
    "all_empty": lambda a, b: torch.cat([a[:0], b[:0]]),
    "promoting_empty": lambda a, b: torch.cat([a.to(torch.bfloat16), b[:0]]),
}


@pytest.mark.parametrize("case", sorted(_CATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cat_with_empty_operands(strict, case, dtype):
    f = _CATS[case]
    a, b = torch.randn(3, 4).to(dtype), torch.randn(2, 4).to(dtype)
    for backend in ("reference", "neuron"):
        got = tn.jit(f, backend=backend)(a, b)
        torch.testing.assert_close(got, f(a, b), rtol=0, atol=0)


def test_cat_with_empty_operands_backward(strict):
    def f(a, b, e):
        y = torch.cat([a, e, b, torch.empty(0)]) * torch.arange(5.0).unsqueeze(1)
        return torch.autograd.grad(y.sum(), (a, b, e))

    a, b, e = torch.randn(3, 4), torch.randn(2, 4), torch.randn(0, 4)
    got = tn.jit(f, backend="neuron")(a.requires_grad_(), b.requires_grad_(), e.requires_grad_())
    for g, r in zip(got, f(a, b, e)):
        torch.testing.assert_close(g, r)


def test_cat_with_empty_operands_on_the_device(monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")
    a, b = torch.randn(3, 4), torch.randn(2, 4)
    y = torch.cat([a.to("neuron"), torch.empty(0, 4, device="neuron"), b.to("neuron")])
    torch.testing.assert_close(y.cpu(), torch.cat([a, b]))


def test_masked_scatter_from_an_empty_source():
    """masked_scatter with an empty source (an all-False mask) leaves x as it is. Its decomposition read
    source[0] of the empty source anyway (an IndexError in the host fallback of index): the gradient of
    combinations(x, r=2) of a one-element x (no combination) on the device hit it."""
    x, mask = torch.randn(2, 3), torch.zeros(2, 3, dtype=torch.bool)
    want = x.masked_scatter(mask, torch.empty(0))
    got = tn.jit(lambda x, m, s: x.masked_scatter(m, s), backend="neuron")(x, mask, torch.empty(0))
    assert torch.equal(got, want)
    got = x.to("neuron").masked_scatter(mask.to("neuron"), torch.empty(0, device="neuron"))
    assert torch.equal(got.cpu(), want)
    for n in (1, 3):
        xs = torch.randn(n)
        xd = xs.to("neuron").requires_grad_()
        y = torch.combinations(xd, r=2)
        w = torch.randn(y.shape)
        (y * w.to("neuron")).sum().backward()
        xc = xs.clone().requires_grad_()
        (torch.combinations(xc, r=2) * w).sum().backward()
        assert y.shape == (n * (n - 1) // 2, 2)
        torch.testing.assert_close(xd.grad.cpu(), xc.grad, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- out= forms

def _out_add(a, b):
    c = torch.empty_like(a)
    torch.add(a, b, alpha=2, out=c)
    return c


def _out_matmul(a, b):
    c = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype)
    r = torch.matmul(a, b, out=c)
    return c, r is c


def _out_mm_bmm(a, b):
    c = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype)
    torch.mm(a, b, out=c)
    d = torch.empty(2, a.shape[0], b.shape[1], dtype=a.dtype)
    torch.bmm(torch.stack([a, a]), torch.stack([b, -b]), out=d)
    return c, d


def _out_sum(a, b):
    o = torch.empty(a.shape[0], dtype=torch.float32)     # fp32 out: torch accumulates in the out dtype
    torch.sum(a, 1, out=o)
    return o


def _out_max(a, b):
    v, i = torch.empty(a.shape[0], dtype=a.dtype), torch.empty(a.shape[0], dtype=torch.int64)
    torch.max(a, 1, out=(v, i))
    return v, i


def _out_into_slice(a, b):
    c = torch.zeros(3, a.shape[0], a.shape[1], dtype=a.dtype)
    torch.mul(a, b, out=c[1])
    torch.cumsum(a, 1, out=c[2])
    return c


def _out_aliasing_input(a, b):
    a = a.clone()
    torch.sub(a, b, out=a)
    torch.exp(a, out=a)
    return a


_OUTS = {f.__name__: f for f in (_out_add, _out_matmul, _out_mm_bmm, _out_sum, _out_max, _out_into_slice,
                                 _out_aliasing_input)}


@pytest.mark.parametrize("case", sorted(_OUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_forms_trace_functionally(strict, case, dtype):
    f = _OUTS[case]
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(6, 6, generator=g).to(dtype), torch.randn(6, 6, generator=g).to(dtype)
    ir = tn.make_ir(f)(a, b)
    assert not any(e.op.name == "host" for e in ir.eqns)
    for backend in ("reference", "neuron"):
        got, ref = tn.jit(f, backend=backend)(a, b), f(a, b)
        got, ref = (got, ref) if isinstance(got, tuple) else ((got,), (ref,))
        for x, y in zip(got, ref):
            if isinstance(y, torch.Tensor):
                torch.testing.assert_close(x, y, rtol=1e-5 if dtype == torch.float32 else 1.6e-2, atol=1e-4)
            else:
                assert x == y


def test_out_into_an_input_is_written_back(strict):
    def f(a, b, c):
        torch.add(a, b, out=c)
        torch.matmul(a, b, out=a)
        return c.sum()

    a, b, c = torch.randn(4, 4), torch.randn(4, 4), torch.zeros(4, 4)
    # Expected values from out-of-place ops: eager torch.matmul(a, b, out=a) writes into an input it still reads,
    # which is undefined (its result depends on the CPU's kernel: zeros on an AVX2-only machine). tn's semantics
    # are the functional ones: a becomes a @ b of the values before the call.
    c_want = a + b
    a_want = a @ b
    s = tn.jit(f, backend="neuron")(a, b, c)
    torch.testing.assert_close(s, c_want.sum())
    torch.testing.assert_close(c, c_want)
    torch.testing.assert_close(a, a_want)


def test_out_forms_that_cannot_be_traced_say_so():
    def resize(a):
        o = torch.empty(0)
        torch.add(a, 1, out=o)
        return o

    with pytest.raises(tn.UnsupportedOpError, match=r"add.*resize its out= tensor"):
        tn.make_ir(resize)(torch.randn(3))

    def bad_cast(a):   # eager's own error: a float result into an int64 out tensor
        o = torch.empty(3, dtype=torch.int64)
        torch.add(a, 1, out=o)
        return o

    with pytest.raises(RuntimeError, match="can't be cast"):
        tn.make_ir(bad_cast)(torch.randn(3))


# --------------------------------------------------------------------------- conv3d

_CONV3D = [dict(), dict(padding=1), dict(padding="valid"), dict(padding="same", dilation=(1, 2, 1)), dict(stride=2, padding=(1, 0, 2)), dict(dilation=(2, 1, 1), padding=2),
           dict(groups=2, stride=(2, 1, 2)), dict(stride=3, dilation=2, padding=(0, 1, 1))]


@pytest.mark.parametrize("kw", _CONV3D, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "plain")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv3d_forward_backward(strict, kw, dtype):
    def f(x, w, b):
        y = F.conv3d(x, w, b, **kw)
        return (y,) + torch.autograd.grad((y * y.detach().sin()).sum(), (x, w, b))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 7, 8, 9, generator=g).to(dtype)
    w = torch.randn(6, 4 // kw.get("groups", 1), 3, 2, 3, generator=g).to(dtype)
    b = torch.randn(6, generator=g).to(dtype)
    ir = tn.make_ir(f)(*(t.clone().requires_grad_() for t in (x, w, b)))
    assert all(len(e.inputs[0].shape) == 4 for e in ir.eqns if e.op.category == "conv")
    ref = f(*(t.clone().requires_grad_() for t in (x, w, b)))
    got = tn.jit(f, backend="neuron")(*(t.clone().requires_grad_() for t in (x, w, b)))
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    for name, a, r in zip(("y", "gx", "gw", "gb"), got, ref):
        scale = r.abs().max().item()
        torch.testing.assert_close(a / scale, r / scale, **tol, msg=lambda m: f"{name}: {m}")


def test_conv3d_module_on_the_neuron_device(monkeypatch, module_matches_on_device):
    monkeypatch.setenv("TN_STRICT", "1")
    torch.manual_seed(0)
    module_matches_on_device(lambda: torch.nn.Conv3d(3, 5, 3, padding=1, stride=(1, 2, 2)), torch.randn(2, 3, 6, 8, 8))


# --------------------------------------------------------------------------- integer bitwise ops

_I32 = torch.iinfo(torch.int32)


def _ints(shape, dtype=torch.int32, lo=None, hi=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    lo = _I32.min if lo is None else lo
    hi = _I32.max if hi is None else hi
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("op", ["bitwise_and", "bitwise_or", "bitwise_xor"])
def test_int32_bitwise_full_range(op):
    a, b = _ints((300, 70)), _ints((300, 70), seed=1)
    check_lowering(op, a, b)                              # exact over all 32 bits (not through fp32)
    check_lowering(op, a, 0x0F0F0F0F)
    check_lowering(op, -12345, b)
    check_lowering(op, a, b[:, :1].contiguous())          # per-partition scalar
    check_lowering(op, a, b > 0)                          # bool promotes to 0/1
    check_lowering(op, _ints((7, 9), torch.uint8, 0, 256), _ints((7, 9), torch.uint8, 0, 256, seed=2))
    check_lowering(op, _ints((7, 9), torch.int64, -2 ** 24, 2 ** 24), _ints((7, 9), torch.int64, -99, 99))


def test_int_bitwise_not():
    check_lowering("bitwise_not", _ints((129, 33)))
    check_lowering("bitwise_not", _ints((129, 33), torch.uint8, 0, 256))
    check_lowering("bitwise_not", _ints((129, 33), torch.int64, -2 ** 24, 2 ** 24))


@pytest.mark.parametrize("op", ["bitwise_left_shift", "bitwise_right_shift"])
def test_int_shifts_match_torch_at_every_amount(op):
    a = _ints((300, 80))
    s = torch.arange(-8, 40, dtype=torch.int32).repeat(300, 2)[:, :80].contiguous()   # out-of-range amounts too
    check_lowering(op, a, s)
    check_lowering(op, a, 3)
    check_lowering(op, 1, s.clamp(0, 31))
    u = _ints((16, 20), torch.uint8, 0, 256)
    check_lowering(op, u, _ints((16, 20), torch.uint8, 0, 12, seed=3))
    if op == "bitwise_right_shift":
        check_lowering(op, _ints((7, 9), torch.int64, -2 ** 24, 2 ** 24), _ints((7, 9), torch.int64, 0, 70))


def test_integer_alu_rules_are_checked():
    from tn.neuron import Program

    p = Program("bad")
    f, i = p.sbuf((4, 8), "float32"), p.sbuf((4, 8), "int32")
    with pytest.raises(tn.NeuronError, match="not an integer ALU operand"):
        p.tensor_tensor(i, i, f, "bitwise_and")
    with pytest.raises(tn.NeuronError, match="int32 range"):
        p.tensor_scalar(i, i, "left_shift", 1.5)
    with pytest.raises(tn.NeuronError, match="mixes an integer ALU op"):
        p.tensor_scalar(i, i, "bitwise_and", 3, "add", 1)


def test_bitwise_through_jit_and_device(strict):
    def f(x, y, m):
        z = ((x >> 4) & 0xFF) ^ (y << 2) | ~m.to(torch.int32)
        z ^= 7
        return z, (z & 1).float() * 0.5, torch.bitwise_left_shift(1, y & 7)

    x, y = _ints((64, 48)), _ints((64, 48), lo=0, hi=1 << 20, seed=1)
    m = torch.rand(64, 48, generator=torch.Generator().manual_seed(2)) > 0.5
    for backend in ("reference", "neuron"):
        for g, r in zip(tn.jit(f, backend=backend)(x, y, m), f(x, y, m)):
            torch.testing.assert_close(g, r, rtol=0, atol=0)
    xd, yd = x.to("neuron"), y.to("neuron")
    for g, r in (((xd & yd), x & y), ((xd >> 3), x >> 3), ((~xd), ~x), (torch.bitwise_xor(xd, yd), x ^ y)):
        assert g.device.type == "neuron"
        torch.testing.assert_close(g.cpu(), r, rtol=0, atol=0)
