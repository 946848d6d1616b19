# Orthogonal polynomials (Chebyshev T/U/V/W and shifted, Hermite H/He, Laguerre, Legendre) as NeuronCore programs vs torch.
import math

import pytest
import torch

import tn
from tn.lower import compiler
from tn.ops import special

NAN, INF = float("nan"), float("inf")
S = torch.special

CHEBYSHEV = [f"{s}chebyshev_polynomial_{k}" for s in ("", "shifted_") for k in "tuvw"]
OTHERS = ["hermite_polynomial_h", "hermite_polynomial_he", "laguerre_polynomial_l", "legendre_polynomial_p"]
POLYNOMIALS = CHEBYSHEV + OTHERS

#: x: the ends of the intervals (+-1 and, shifted, 0), values next to them, tiny, large, NaN and infinities.
X = torch.cat([torch.linspace(-9, 9, 73), torch.tensor(
    [1., -1., 0., -0., 0.5, 1e-10, -1e-10, 1.0000001, 0.9999999, -1.0000001, -0.9999999, 1e-30, 30., -30.,
     NAN, INF, -INF])])
#: degrees as torch reads them (truncated; negative, NaN and infinite degrees give 0), small and medium.
N_SMALL = torch.tensor([-2.5, -1., -0.5, 0., 0.7, 1., 1.9, 2., 3., 4., 5., 6., 6.5, 7., 8., 9., 9.9, 12., 20.,
                        NAN, INF, -INF])


#: torch's kernels return an uninitialised value for NaN x (their loop stops on NaN before the first term)
#: except for T, H and He; tn gives NaN (test_nan_x).
NAN_X_UNDEFINED = [n for n in POLYNOMIALS if n not in ("chebyshev_polynomial_t", "hermite_polynomial_h",
                                                       "hermite_polynomial_he")]


def _x(name):
    return X[~X.isnan()] if name in NAN_X_UNDEFINED else X


def _grid(ns, name):
    xs, ns = torch.broadcast_tensors(_x(name)[:, None], ns[None, :])
    return xs.contiguous(), ns.contiguous()


def _strict(fn, *args, backend):
    """``fn(*args)`` through tn.jit; on the neuron backend compiled strictly (no host op may be left)."""
    jf = tn.jit(fn, backend=backend)
    if backend != "neuron":
        return jf(*args)
    ir = jf.lower(*args)
    assert "host" not in str(ir)
    return compiler.compile_ir(ir, strict=True)(list(args))[0]


def _same(got, want):
    """Values equal to 1e-5 (relative and absolute), NaN where torch has NaN, infinities equal."""
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("name", POLYNOMIALS)
def test_polynomial_tensor_degree(name, backend):
    """Degree a tensor (values are data): every x edge case with degrees -2.5..20, NaN and infinities."""
    f = getattr(S, name)
    xs, ns = _grid(N_SMALL, name)
    _same(_strict(f, xs, ns, backend=backend), f(xs, ns))


@pytest.mark.parametrize("name", ["chebyshev_polynomial_t", "shifted_chebyshev_polynomial_w", "hermite_polynomial_h",
                                  "hermite_polynomial_he", "laguerre_polynomial_l", "legendre_polynomial_p"])
def test_polynomial_high_degree(name, backend):
    """Degrees up to the unrolled bound give torch's numbers, overflow included, away from the closed forms'
    ill-conditioned large multiples of acos(y) (Chebyshev inside (-1, 1))."""
    f = getattr(S, name)
    x = torch.cat([torch.linspace(-3, 3, 25), torch.tensor([0., 1., -1., 0.5, 1.0000001, -0.9999999])])
    n = torch.tensor([21., 25., 31., 32.])
    if name.startswith("hermite"):      # large values (past fp32's range torch's inf/NaN pattern is its own)
        x = torch.cat([x, torch.tensor([-9., 9.])])
    if "chebyshev" in name:
        y = 2 * x - 1 if name.startswith("shifted") else x
        x = x[(y.abs() >= 1)]
    xs, ns = torch.broadcast_tensors(x[:, None], n[None, :])
    xs, ns = xs.contiguous(), ns.contiguous()
    _same(_strict(f, xs, ns, backend=backend), f(xs, ns))


@pytest.mark.parametrize("name", POLYNOMIALS)
@pytest.mark.parametrize("n", [-1, 3.9, 40])
def test_polynomial_python_degree(name, n, backend):
    """Degree a Python number (the n_scalar overload): the recurrence unrolled to exactly that degree."""
    f = getattr(S, name)
    x = _x(name)
    _same(_strict(lambda x: f(x, n), x, backend=backend), f(x, n))


@pytest.mark.parametrize("name", NAN_X_UNDEFINED)
def test_nan_x(name):
    """NaN x gives NaN for every degree >= 1 (torch: an uninitialised value from degree 2 on)."""
    got = tn.jit(getattr(S, name), backend="reference")(torch.full((4,), NAN), torch.tensor([1., 2., 5., 31.]))
    assert bool(got.isnan().all()), got


@pytest.mark.parametrize("name", ["chebyshev_polynomial_u", "legendre_polynomial_p"])
def test_polynomial_scalar_x_batch_and_empty(name, backend):
    """Scalar x with a tensor degree (x_scalar overload), a broadcast batch, 0-size inputs, integer degrees."""
    f = getattr(S, name)
    n = torch.tensor([[0., 1., 2., 5.], [3., 4., 8., 11.]])
    _same(_strict(lambda d: f(0.3, d), n, backend=backend), f(0.3, n))
    x = torch.randn(3, 1, 4)
    _same(_strict(f, x, n, backend=backend), f(x, n))
    e = torch.randn(0, 4)
    _same(_strict(f, e, n[:1], backend=backend), f(e, n[:1]))
    ni = torch.tensor([0, 1, 3, 6])
    _same(_strict(f, x, ni, backend=backend), f(x, ni))


def test_chebyshev_above_the_unrolled_bound_is_the_closed_form():
    """Outside [-1, 1] degrees above the unrolled bound use cosh/sinh(m acosh|y|): compared with float64 torch
    (the exact polynomial) to the closed form's own error, m acosh|y| ulps; NaN once torch's fp32 recurrence
    would have overflowed two degrees down (inf - inf)."""
    bound = special.POLY_UNROLL["chebyshev"]
    x = torch.tensor([1.0000001, 1.001, 1.05, -1.05, -1.001, 1.3])
    n = torch.tensor([bound + 1., bound + 50., 600.])
    xs, ns = torch.broadcast_tensors(x[:, None], n[None, :])
    for k in "tuvw":
        f = getattr(S, f"chebyshev_polynomial_{k}")
        got = tn.jit(f, backend="reference")(xs, ns)
        exact = f(xs.double(), ns.double())
        t = torch.acosh(xs.double().abs())
        finite = exact.abs() < 3e38
        rel = ((got.double() - exact).abs() / exact.abs())[finite]
        allowed = ((ns.double() + 1) * t * 2 ** -23 * 4 + 2 ** -20)[finite]
        assert bool((rel <= allowed).all()), (k, rel.max())
        assert bool(got[~finite].isnan().all() | got[~finite].isinf().all())


def test_hermite_laguerre_legendre_above_the_bound_are_nan():
    """A tensor degree above the unrolled bound has no closed form for Hermite, Laguerre and Legendre: NaN
    (the documented limit), never a wrong number."""
    bound = special.POLY_UNROLL["laguerre"]
    x = torch.tensor([0.5, -0.5, 2.0])
    n = torch.tensor([bound + 1., 1000.])
    xs, ns = torch.broadcast_tensors(x[:, None], n[None, :])
    for f in (S.laguerre_polynomial_l, S.legendre_polynomial_p, S.hermite_polynomial_h, S.hermite_polynomial_he):
        assert bool(tn.jit(f, backend="reference")(xs.contiguous(), ns.contiguous()).isnan().all())


def test_polynomials_on_the_device(monkeypatch):
    """The device door runs them as NeuronCore programs (strict: a host fallback raises)."""
    monkeypatch.setenv("TN_STRICT", "1")
    before = dict(torch.neuron.fallback_ops())
    for name in ("chebyshev_polynomial_t", "hermite_polynomial_he"):
        f = getattr(S, name)
        xs, ns = _grid(N_SMALL, name)
        got = f(xs.to("neuron"), ns.to("neuron"))
        assert got.device.type == "neuron"
        _same(got.cpu(), f(xs, ns))
    assert torch.neuron.fallback_ops() == before


def test_float64_is_refused():
    with pytest.raises(tn.UnsupportedOpError):
        tn.jit(S.legendre_polynomial_p, backend="reference")(torch.randn(3, dtype=torch.float64),
                                                           torch.tensor([1., 2., 3.], dtype=torch.float64))


def test_fma_emulation_rounds_once():
    """``_fma`` equals a*b + c computed in float64 and rounded once (where float64 holds it exactly)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4000, generator=g) * 100
    b = torch.randn(4000, generator=g) * 100
    c = -(a * b) * (1 + torch.randn(4000, generator=g) * 1e-3)
    want = (a.double() * b.double() + c.double()).float()
    got = special._fma(a, b, c)
    assert torch.equal(got, want)
    assert math.isinf(special._fma(torch.tensor([3e38]), torch.tensor([2.]), torch.tensor([0.]))[0].item())


# --------------------------------------------------------------------------- Airy Ai


AIRY_X = torch.cat([torch.linspace(-40, 110, 1501), torch.tensor(
    [0., -0., -2.09, 2.09, -2.0899999, 2.0899999, 8.3203353, 8.33, 103.892, 103.9, 1e-30, NAN, INF, -INF])])


def test_airy_ai(backend):
    """The three regions (oscillating below -2.09, series, exp-scaled rational fit), their borders, the cut to 0
    above 103.892, NaN at infinities and NaN; a 0-size and a batched input. Below about -40 both torch's and
    this fp32 evaluation lose digits to sin/cos of 2/3 |x|^1.5 (not compared)."""
    _same(_strict(S.airy_ai, AIRY_X, backend=backend), S.airy_ai(AIRY_X))
    x = torch.randn(3, 0, 2)
    _same(_strict(S.airy_ai, x, backend=backend), S.airy_ai(x))
    x = torch.randn(4, 5) * 4
    _same(_strict(S.airy_ai, x, backend=backend), S.airy_ai(x))


def test_airy_ai_on_the_device(monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")
    before = dict(torch.neuron.fallback_ops())
    got = S.airy_ai(AIRY_X.to("neuron"))
    _same(got.cpu(), S.airy_ai(AIRY_X))
    assert torch.neuron.fallback_ops() == before
