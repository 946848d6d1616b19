# FFTs on the NeuronCore (tn.ops.fft, tn.lower.complex_pairs): every torch.fft function against torch on the CPU.
import pytest
import torch

import tn
from tn.lower import compile_ir

C64 = torch.complex64
NORMS = [None, "ortho", "forward"]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _real(*shape, seed=0, requires_grad=False):
    return torch.randn(*shape, generator=_gen(seed), requires_grad=requires_grad)


def _cplx(*shape, seed=0):
    return torch.randn(*shape, dtype=C64, generator=_gen(seed))


def _native(fn, *args):
    """``fn(*args)`` traced and compiled strictly (a host equation is an error); returns the outputs and the IR."""
    ir = tn.jit(fn, backend="reference").lower(*args)
    assert "host" not in ir.op_counts(), ir
    exe = compile_ir(ir, strict=True)
    assert exe.stats["host_ops"] == {}
    return exe(list(args)), ir


def _check(fn, *args, tol=1e-5):
    want = fn(*args)
    (got,), _ = _native(fn, *args)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


# --------------------------------------------------------------------------- 1-D


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("name", ["fft", "ifft", "rfft", "ihfft"])
@pytest.mark.parametrize("size,n", [(8, None), (5, None), (1, None), (6, 4), (5, 9), (7, 1)])
def test_real_input_1d(name, norm, size, n):
    fn = getattr(torch.fft, name)
    _check(lambda x: fn(x, n=n, norm=norm), _real(3, size))


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("name", ["fft", "ifft", "irfft", "hfft"])
@pytest.mark.parametrize("size,n", [(8, None), (5, None), (2, None), (6, 4), (5, 9), (4, 1), (3, 2)])
def test_complex_input_1d(name, norm, size, n):
    fn = getattr(torch.fft, name)
    _check(lambda x: fn(x, n=n, norm=norm), _cplx(2, 3, size))


@pytest.mark.parametrize("dim", [0, 1, -2])
def test_transform_of_an_inner_dim(dim):
    x = _cplx(4, 6, 3)
    _check(lambda x: torch.fft.fft(x, dim=dim), x)
    _check(lambda x: torch.fft.irfft(x, dim=dim), x)
    _check(lambda x: torch.fft.rfft(x, dim=dim), _real(4, 6, 3))


# --------------------------------------------------------------------------- 2-D and N-D


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("name", ["fft2", "ifft2", "rfft2", "ihfft2", "fftn", "ifftn", "rfftn", "ihfftn"])
def test_real_input_nd(name, norm):
    fn = getattr(torch.fft, name)
    x = _real(2, 5, 6)
    _check(lambda x: fn(x, norm=norm), x)
    _check(lambda x: fn(x, s=(4, 7), norm=norm), x)
    if name.endswith("n"):
        _check(lambda x: fn(x, dim=(0, 2), norm=norm), x)
        _check(lambda x: fn(x, norm=norm), _real(3, 4, 5))


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("name", ["fft2", "ifft2", "irfft2", "hfft2", "fftn", "ifftn", "irfftn", "hfftn"])
def test_complex_input_nd(name, norm):
    fn = getattr(torch.fft, name)
    x = _cplx(2, 5, 4)
    _check(lambda x: fn(x, norm=norm), x, tol=2e-5)
    _check(lambda x: fn(x, s=(3, 6), norm=norm), x, tol=2e-5)
    if name.endswith("n"):
        _check(lambda x: fn(x, dim=(0, 1), norm=norm), x, tol=2e-5)


def test_shifts_and_a_round_trip():
    x = _real(4, 9)
    _check(lambda x: torch.fft.fftshift(torch.fft.fft(x)), x)
    _check(lambda x: torch.fft.irfft(torch.fft.rfft(x), n=9), x)
    _check(lambda x: torch.fft.ifftshift(torch.fft.ifft2(torch.fft.fft2(x))), x)


@pytest.mark.parametrize("name", ["fft", "rfft", "ihfft", "fft2", "irfftn", "hfft"])
def test_gradients_run_natively(name):
    fn = getattr(torch.fft, name)

    def f(x):
        y = fn(x)
        y = y.abs() if y.is_complex() else y
        return torch.autograd.grad((y * torch.linspace(0.5, 1.5, y.shape[-1])).sum(), x)

    x = _real(3, 6, requires_grad=True) if name != "irfftn" else _real(4, 6).requires_grad_()
    (got,), _ = _native(f, x)
    torch.testing.assert_close(got, f(x)[0], rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- what stays on the host


def test_float64_stays_a_host_op():
    ir = tn.jit(torch.fft.rfft, backend="reference").lower(torch.randn(4, dtype=torch.float64))
    assert ir.op_counts().get("host") == 1
    jf = tn.jit(torch.fft.rfft)
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(jf(x), torch.fft.rfft(x))
    assert jf.stats["host_ops"], jf.stats


def test_a_complex_op_without_a_pairs_form_stays_counted_on_the_host():
    fn = lambda x: torch.fft.fft(x).exp()   # noqa: E731
    ir = tn.jit(fn, backend="reference").lower(_real(5))
    exe = compile_ir(ir)
    # exp of a complex value has no pairs form: it runs on the host, reading and making complex tensors (the
    # views around it are host steps too: free, but counted)
    assert set(exe.stats["host_ops"]) == {"exp", "view_as_complex", "view_as_real"}
    torch.testing.assert_close(exe([_real(5)])[0], fn(_real(5)))


# --------------------------------------------------------------------------- doors


def test_jit_door_counts_no_host_op():
    jf = tn.jit(lambda x, z: (torch.fft.rfft2(x), torch.fft.ifft(z, norm="ortho"), torch.fft.hfft(z, n=7)))
    x, z = _real(3, 6, 8), _cplx(5, 4)
    for g, w in zip(jf(x, z), (torch.fft.rfft2(x), torch.fft.ifft(z, norm="ortho"), torch.fft.hfft(z, n=7))):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert jf.stats["host_ops"] == {}, jf.stats


@pytest.mark.parametrize("fn", [
    torch.fft.fft, torch.fft.rfft, torch.fft.ihfft, torch.fft.hfft, torch.fft.irfft,
    lambda t: torch.fft.irfftn(t, s=(4, 6)), lambda t: torch.fft.fft2(t.to(C64), norm="forward"),
    lambda t: torch.fft.ifftn(t, s=(2, 9), norm="ortho")], ids=lambda f: getattr(f, "__name__", "lambda"))
def test_device_door_runs_them_natively(fn):
    from tn.device import tracking

    x = _real(3, 8)
    tracking.reset_op_counts()
    got = fn(x.to("neuron")).cpu()
    assert tracking.fallback_ops() == {}, tracking.fallback_reasons()
    torch.testing.assert_close(got, fn(x), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- the complex views


def test_view_as_real_and_complex_round_trip_through_jit():
    z = _cplx(3, 4)
    jf = tn.jit(lambda z: (torch.view_as_real(z) * 2, torch.view_as_complex(torch.view_as_real(z) + 1)))
    a, b = jf(z)
    torch.testing.assert_close(a, torch.view_as_real(z) * 2)
    torch.testing.assert_close(b, torch.view_as_complex(torch.view_as_real(z) + 1))
    assert jf.stats["host_ops"] == {}, jf.stats
    ir = jf.lower(z)
    assert {"view_as_real", "view_as_complex"} <= set(ir.op_counts())


def test_complex_pairs_ops_match_torch():
    z, w, r = _cplx(3, 4), _cplx(3, 4, seed=1), _real(4)
    fn = lambda z, w, r: (z * w, z.conj() + w, (z * r) / 2.0, -z.sum(0), torch.cat([z, w], 1)[:, 1:5].flip(0),  # noqa: E731
                          z.t().reshape(2, 6), r.to(C64) - w[0], z.real, z.imag * 3, z.abs(),
                          torch.where(r > 0, z, w), z[:, torch.tensor([3, 0, 0])])
    got, _ = _native(fn, z, w, r)
    for g, e in zip(got, fn(z, w, r)):
        torch.testing.assert_close(g, e.resolve_conj(), rtol=1e-5, atol=1e-5)


def test_in_place_write_through_view_as_real_reaches_the_complex_input():
    def f(z):
        torch.view_as_real(z)[..., 1].mul_(-1)   # conjugate in place
        return z.abs()

    z = _cplx(5)
    want_z = z.conj().resolve_conj()
    zj = z.clone()
    out = tn.jit(f)(zj)
    torch.testing.assert_close(zj, want_z)
    torch.testing.assert_close(out, want_z.abs())


def test_view_as_real_and_complex_through_the_compile_door():
    torch._dynamo.reset()

    def f(x):
        z = torch.view_as_complex(x)
        return torch.view_as_real(torch.fft.fft(z) * 2)

    x = _real(4, 6, 2)
    got = torch.compile(f, backend="neuron")(x)
    torch.testing.assert_close(got, f(x), rtol=1e-5, atol=1e-5)


def test_the_pairs_executable_is_the_compiled_executable_to_its_callers():
    ir = tn.jit(torch.fft.fft, backend="reference").lower(_real(4))
    exe = compile_ir(ir)
    assert exe.ir is ir and exe.complex_outputs == (0,)
    exe._layout = None                # a door's setting (tn.device.windows) reaches the wrapped executable
    assert exe.exe._layout is None and "_layout" not in exe.__dict__
    assert exe.stats["programs"] == 1 and exe.stats["host_ops"] == {}
    torch.testing.assert_close(exe([_real(4)])[0], torch.fft.fft(_real(4)))
    assert exe.last_profile is not None and exe.last_profile.instructions > 0


def test_transforms_past_the_dft_size_limit_stay_host_ops():
    from tn.ops.fft import MAX_DFT_ELEMENTS

    assert 4 * 1448 ** 2 <= MAX_DFT_ELEMENTS < 4 * 1449 ** 2
    for fn, x, host in ((torch.fft.fft, _cplx(1448), None), (torch.fft.fft, _cplx(1449), 1),
                        (torch.fft.rfft, _real(2895), None), (torch.fft.rfft, _real(2896), 1),
                        (lambda t: torch.fft.irfft(t, n=2896), _cplx(1449), 1)):
        assert tn.jit(fn, backend="reference").lower(x).op_counts().get("host") == host
    x = _real(2, 1500)                # a long real transform, natively
    (got,), _ = _native(torch.fft.rfft, x)
    # a DFT by matmul sums n rounded products (error ~ sqrt(n) * eps * |x| per output, here ~2e-5 on outputs up
    # to ~120): within 1e-6 of the output's scale, not within the 1e-5 absolute tolerance of short transforms
    want = torch.fft.rfft(x)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()


def test_complex_python_scalars_are_complex64_constants():
    g = lambda z, x: (z * (2 - 3j), z + 1j, x * 1j)   # noqa: E731
    z, x = _cplx(4), _real(3)
    got, ir = _native(g, z, x)
    # 2-3j and 1j: the two uses of 1j are one constant (tn.passes.cse merges small constants by value)
    consts = [t for v, t in ir.consts if v.dtype == torch.complex128 and t.dim() == 0]
    assert sorted((c.real.item(), c.imag.item()) for c in consts) == [(0.0, 1.0), (2.0, -3.0)]
    for a, b in zip(got, g(z, x)):
        torch.testing.assert_close(a, b)


def test_polar_gradient_through_a_complex_scalar():
    def f(a, t):
        z = torch.polar(a, t)
        return torch.autograd.grad((z.abs() * 2 + (z * 1j).real + (z / (1 + 2j)).imag).sum(), (a, t))

    a, t = (_real(5).abs() + 0.5).requires_grad_(), _real(5, seed=1, requires_grad=True)
    jf = tn.jit(f)
    for g, w in zip(jf(a, t), f(a, t)):
        torch.testing.assert_close(g, w)
    assert jf.stats["host_ops"] == {}, jf.stats


def test_complex_division():
    z, w = _cplx(6), _cplx(6, seed=1)
    (got,), _ = _native(lambda z, w: z / w, z, w)
    torch.testing.assert_close(got, z / w)


def test_device_door_complex_tensors_natively():
    from tn.device import tracking

    z, w = _cplx(3, 8), _cplx(3, 8, seed=1)
    zd, wd = z.to("neuron"), w.to("neuron")
    tracking.reset_op_counts()
    got = [torch.fft.fft(zd), torch.fft.irfft(zd), zd * wd, zd / wd, zd.conj(), zd.abs(), torch.view_as_real(zd),
           zd * 1j]
    want = [torch.fft.fft(z), torch.fft.irfft(z), z * w, z / w, z.conj(), z.abs(), torch.view_as_real(z), z * 1j]
    for g, e in zip(got, want):
        torch.testing.assert_close(g.cpu().resolve_conj(), e.resolve_conj(), rtol=1e-5, atol=1e-5)
    assert tracking.fallback_ops() == {}, tracking.fallback_reasons()
