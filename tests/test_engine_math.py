# Accuracy of the engine's vectorised activation math (kernels.c: exp, tanh, sigmoid, silu, gelu, erf, log, sin, ...)
# over every kind of fp32 and bf16 input, against float64 torch (the truth) and against torch at the input dtype.
import math

import numpy as np
import pytest
import torch

from tn.neuron import Program, run

P = 128
TINY = 2.0 ** -140     # absolute slack for results that went through a subnormal intermediate

# name -> (float64 reference, ulps allowed for fp32, input-conditioning factor in units of 2^-23)
# The conditioning term |x f'(x)| * k * 2^-23 covers functions that round an argument before the expensive part
# (gelu divides by sqrt(2), gelu_tanh forms 2u = 2 sqrt(2/pi)(x + 0.044715 x^3)): the result is then exact for a
# neighbouring input, which in the far tails (tiny results) is many ulps away.
SQRT1_2 = 1.0 / math.sqrt(2.0)


def _gelu_tanh64(x):
    u = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)
    return x * torch.sigmoid(2.0 * u)


FUNCS = {
    "exp": (torch.exp, 2, 0),
    "tanh": (torch.tanh, 2, 0),
    "sigmoid": (torch.sigmoid, 3, 0),
    "silu": (lambda x: x * torch.sigmoid(x), 4, 0),
    "gelu": (lambda x: torch.where(x < 0, 0.5 * x * torch.special.erfc(-x * SQRT1_2),
                                   0.5 * x * (1.0 + torch.erf(x * SQRT1_2))), 4, 2),
    "gelu_tanh": (_gelu_tanh64, 4, 6),
    "erf": (torch.erf, 3, 0),
    "log": (torch.log, 2, 0),
    "softplus": (lambda x: torch.clamp(x, min=0) + torch.log1p(torch.exp(-x.abs())), 3, 0),
    "sin": (torch.sin, 3, 0),
    "cos": (torch.cos, 3, 0),
}

# the same functions as torch computes them at the input's dtype
TORCH = {
    "exp": torch.exp, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu, "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "erf": torch.erf, "log": torch.log, "softplus": torch.nn.functional.softplus,
    "sin": torch.sin, "cos": torch.cos,
}


def fp32_inputs():
    """~200k fp32 values: every binade of both signs, random bit patterns, dense ranges and special values."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2 ** 32, 60000, dtype=np.uint64).astype(np.uint32)
    rand_bits = bits.view(np.float32)
    rand_bits = rand_bits[np.isfinite(rand_bits)]
    mags = 10.0 ** rng.uniform(-45, 38.5, 40000)
    dense = rng.uniform(-20, 20, 60000)
    tails = rng.uniform(-110, 110, 30000)
    edges = []
    for e in [0.625, 1.0, 1.41421356, 8192.0, 9.5, 10.5, 10.5 * math.sqrt(2), 14.85, 87.33654, 88.7228, 103.97,
              104.0, 1.17549435e-38, math.pi / 4, math.pi / 2, math.pi, 4096 * math.pi]:
        v = np.float32(e)
        near = np.nextafter(np.full(5, v), np.float32(np.inf)), np.nextafter(np.full(5, v), np.float32(0))
        edges += [v, -v, *near[0][:1], *near[1][:1], -near[0][0], -near[1][0]]
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-40, -1e-40, 3.4028235e38, -3.4028235e38,
                1e30, -1e30, 1e10, -1e10, 1e5, -1e5]
    x = np.concatenate([rand_bits, mags, -mags, dense, tails, np.array(edges, np.float64), specials])
    return torch.from_numpy(x.astype(np.float32))


def bf16_inputs():
    """Every bf16 value."""
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def engine_act(func, x):
    """activation(func) of the 1-D tensor x on the engine (x padded to [128, F] with zeros)."""
    n = x.numel()
    f = -(-n // P)
    xp = torch.zeros(P * f, dtype=x.dtype)
    xp[:n] = x
    dt = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[x.dtype]
    prog = Program(f"act_{func}")
    hx = prog.hbm("x", (P, f), dt)
    hy = prog.hbm("y", (P, f), dt, kind="output")
    t = prog.sbuf((P, f), dt)
    prog.dma_copy(t, hx)
    prog.activation(t, t, func)
    prog.dma_copy(hy, t)
    y = torch.empty(P, f, dtype=x.dtype)
    run(prog, {"x": xp.view(P, f), "y": y})
    return y.reshape(-1)[:n]


def _ulp32(r):
    """ulp of float64 values as float32 numbers (2^-149 below the normal range)."""
    a = r.abs().clamp(min=2.0 ** -126)
    e = torch.floor(torch.log2(a))
    return torch.pow(2.0, e - 23)


def _check_specials(got, ref, x):
    gn, rn = torch.isnan(got), torch.isnan(ref)
    bad = gn != rn
    assert not bad.any(), f"NaN mismatch at x={x[bad][:5].tolist()}: got {got[bad][:5].tolist()}, want {ref[bad][:5].tolist()}"
    gi, ri = torch.isinf(got), torch.isinf(ref) | (ref.abs() > 3.4028234663852886e38)
    bad = (gi != ri) | (gi & (got.sign() != ref.sign()))
    assert not bad.any(), f"inf mismatch at x={x[bad][:5].tolist()}: got {got[bad][:5].tolist()}, want {ref[bad][:5].tolist()}"
    return ~(gn | gi)


def _torch_comparable(func, x, want):
    """Where torch's own formula is not at fault: its gelu, 0.5 * x * (1 + erf(x / sqrt 2)), overflows for
    x > 1.7e38 and gives NaN for +inf, where the engine keeps the true value."""
    with torch.no_grad():
        truth = FUNCS[func][0](x.double())
    return (torch.isfinite(want) | ~torch.isfinite(truth)) & ~(torch.isnan(want) & ~torch.isnan(truth))


def _cond(fn, x64):
    """|x f'(x)| in float64 (0 where not finite)."""
    xg = x64.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(fn(xg).sum(), xg)
    c = (x64 * g).abs()
    return torch.where(torch.isfinite(c), c, torch.zeros_like(c))


@pytest.mark.parametrize("func", sorted(FUNCS))
def test_fp32_against_float64(func):
    ref_fn, ulps, k = FUNCS[func]
    x = fp32_inputs()
    got = engine_act(func, x).double()
    x64 = x.double()
    with torch.no_grad():
        ref = ref_fn(x64)
    fin = _check_specials(got, ref, x)
    tol = ulps * _ulp32(ref) + TINY * (1 + x64.abs())
    if k:
        tol = tol + k * 2.0 ** -23 * _cond(ref_fn, x64)
    err = (got - ref).abs()
    bad = fin & ~(err <= tol)
    assert not bad.any(), (f"{func}: {int(bad.sum())} results off; worst x={x[bad][:5].tolist()} got "
                           f"{got[bad][:5].tolist()} want {ref[bad][:5].tolist()}")


@pytest.mark.parametrize("func", sorted(FUNCS))
def test_fp32_against_torch(func):
    x = fp32_inputs()
    got = engine_act(func, x)
    want = TORCH[func](x)
    keep = _torch_comparable(func, x, want)
    torch.testing.assert_close(got[keep], want[keep], rtol=2e-4, atol=2e-5, equal_nan=True)


@pytest.mark.parametrize("func", sorted(FUNCS))
def test_bf16_every_value(func):
    ref_fn, _, k = FUNCS[func]
    x = bf16_inputs()
    got = engine_act(func, x).double()
    x64 = x.double()
    with torch.no_grad():
        ref = ref_fn(x64)
    fin = _check_specials(got, ref.to(torch.bfloat16).double(), x)
    # fp32 math then one bf16 rounding: within one bf16 ulp (2^-8 relative, 2^-133 among subnormals) of the truth
    tol = torch.clamp(2.0 ** -8 * ref.abs(), min=2.0 ** -133) + TINY * (1 + x64.abs())
    if k:
        tol = tol + k * 2.0 ** -23 * _cond(ref_fn, x64)
    err = (got - ref).abs()
    bad = fin & ~(err <= tol)
    assert not bad.any(), (f"{func}: {int(bad.sum())} results off; x={x[bad][:5].tolist()} got "
                           f"{got[bad][:5].tolist()} want {ref[bad][:5].tolist()}")
    want = TORCH[func](x)
    keep = _torch_comparable(func, x, want)
    torch.testing.assert_close(got.to(torch.bfloat16)[keep], want[keep], rtol=1.6e-2, atol=1e-2, equal_nan=True)


def test_fp32_bits_do_not_depend_on_the_row():
    """Every element is computed independently: the same input gives the same bits wherever it sits in a row
    (vector body, loop remainder, the libm fix-up of sin/cos)."""
    x = fp32_inputs()[:5000]
    for func in ("exp", "gelu", "sin"):
        a = engine_act(func, x)
        b = engine_act(func, torch.cat([x[1:], x[:1]]))
        assert torch.equal(torch.cat([a[1:], a[:1]]).view(torch.int32), b.view(torch.int32))
