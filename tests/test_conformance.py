# Regression tests of issue 17: crashes and silent wrong answers found by running PyTorch's op database on every door.
import subprocess
import sys
import textwrap

import pytest
import torch

import tn

DEV = "neuron"

#: Complex-valued ops that killed the process with SIGSEGV on the device (an endless recursion between torch's
#: math-bit fallback and the device copy of a lazily conjugated tensor). Each line is run, compared with the CPU
#: and its gradient checked, in a child process: a crash fails the test and names the case.
_COMPLEX_CASES = {
    "fft.ihfft": "torch.fft.ihfft(r)",
    "fft.ifft": "torch.fft.ifft(c)",
    "fft.hfft": "torch.fft.hfft(c)",
    "fft.hfft_real": "torch.fft.hfft(r)",
    "fft.hfft2": "torch.fft.hfft2(m)",
    "fft.ihfft2": "torch.fft.ihfft2(m)",
    "fft.hfftn": "torch.fft.hfftn(m)",
    "fft.ihfftn": "torch.fft.ihfftn(m)",
    "fft.irfft": "torch.fft.irfft(c)",
    "polar": "torch.polar(r.abs() + 0.1, r)",
    "linalg.eigvals": "torch.linalg.eigvals(m[:, :4])",
    "conj_mm": "c.reshape(2, 4).conj() @ c.reshape(4, 2)",
    "mm_adjoint": "c.reshape(2, 4) @ c.reshape(2, 4).mH",
    "conj_imag": "c.conj().imag * 2",
    "real_0d": "torch.view_as_complex(r[:2]).real",
    "imag_0d": "torch.view_as_complex(r[:2]).imag",
    "view_as_real_strided": "torch.view_as_real(c[::2])",
    "sgn": "torch.sgn(c)",
}

_CHILD = textwrap.dedent("""
    import sys, torch, tn
    torch.manual_seed(0)
    r = torch.randn(8)
    c = torch.randn(8, dtype=torch.complex64)
    m = torch.randn(4, 6)
    cases = {cases!r}
    grad = {grad!r}

    def grads(expr, env):
        leaves = {{k: v.detach().clone().requires_grad_() for k, v in env.items()}}
        out = eval(expr, {{"torch": torch}}, leaves)
        loss = (out.abs() if out.is_complex() else out).sum()
        return torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)

    for name, expr in cases.items():
        print("case", name, flush=True)
        cpu = dict(r=r, c=c, m=m)
        dev = {{k: v.to("neuron") for k, v in cpu.items()}}
        want = eval(expr, {{"torch": torch}}, cpu)
        got = eval(expr, {{"torch": torch}}, dev)
        assert got.device.type == "neuron", name
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4, msg=lambda m: name + ": " + m)
        if grad:
            for g, w in zip(grads(expr, dev), grads(expr, cpu)):
                if w is None:
                    continue
                torch.testing.assert_close(g.cpu(), w, rtol=1e-4, atol=1e-4, msg=lambda m: name + " grad: " + m)
    print("all done", flush=True)
""")


def _run_child(code: str, timeout: float = 600) -> None:
    p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                       timeout=timeout)
    last = [ln for ln in p.stdout.splitlines() if ln.startswith("case ")]
    where = last[-1] if last else "before the first case"
    assert p.returncode == 0, (f"child exited with {p.returncode} at {where}:\n{p.stdout[-2000:]}\n"
                               f"{p.stderr[-4000:]}")
    assert "all done" in p.stdout


def test_complex_ops_on_device_do_not_crash_and_match_cpu():
    _run_child(_CHILD.format(cases=_COMPLEX_CASES, grad=False))


def test_complex_ops_gradients_on_device_match_cpu():
    cases = {k: v for k, v in _COMPLEX_CASES.items() if k not in ("linalg.eigvals",)}
    _run_child(_CHILD.format(cases=cases, grad=True))


def test_conjugated_copy_to_host_and_into_conjugated_view():
    c = torch.randn(5, dtype=torch.complex64)
    d = c.to(DEV)
    torch.testing.assert_close(d.conj().cpu(), c.conj())
    torch.testing.assert_close(d.conj().imag.cpu(), -c.imag)      # a lazily negated view
    out = torch.zeros(5, dtype=torch.complex64, device=DEV)
    out.conj().copy_(d)          # writing through a conjugated view stores conj(d)
    torch.testing.assert_close(out.cpu(), c.conj())


def test_writing_op_into_conjugated_argument_is_refused_with_advice():
    a = torch.randn(2, 2, dtype=torch.complex64, device=DEV)
    b = torch.randn(2, 2, dtype=torch.complex64, device=DEV)
    with pytest.raises(tn.TnError, match="resolve_conj"):
        torch.mm(a, b, out=torch.empty(2, 2, dtype=torch.complex64, device=DEV).conj())


# ---------------------------------------------------------------- 0-d inputs: shape () not (0,)

_ZERO_D = {
    "kthvalue": lambda t: torch.kthvalue(t, 1),
    "kthvalue_dim": lambda t: torch.kthvalue(t, 1, 0, keepdim=True),
    "median_dim": lambda t: torch.median(t, 0),
    "nanmedian_dim": lambda t: torch.nanmedian(t, 0),
    "max_dim": lambda t: torch.max(t, 0),
    "mode": lambda t: torch.mode(t, 0),
    "masked.median": lambda t: torch.masked._ops.median(t, 0, mask=torch.tensor(True, device=t.device)),
}


@pytest.mark.parametrize("name", sorted(_ZERO_D))
def test_zero_dim_reductions_keep_shape_on_device(name):
    f = _ZERO_D[name]
    x = torch.tensor(2.5)
    want = f(x)
    got = f(x.to(DEV))
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape)
        torch.testing.assert_close(g.cpu(), w)


@pytest.mark.parametrize("name", ["kthvalue", "median_dim", "nanmedian_dim"])
def test_zero_dim_reductions_keep_shape_under_jit(name):
    f = _ZERO_D[name]
    x = torch.tensor(2.5)
    for g, w in zip(tn.jit(f)(x), f(x)):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("door", ["device", "jit"])
@pytest.mark.parametrize("target", [[3, 0, -1, 1], [[3, 0, -1, 1], [1, -1, 2, 2], [0, 1, 2, 3]]])
def test_multilabel_margin_loss_value_shape_and_gradient(door, reduction, target):
    # torch's decomposition counted the target slots after the first -1 (3x the loss here) and gave a 1-d
    # input's unreduced loss shape (1,)
    t = torch.tensor(target)
    torch.manual_seed(1)
    x = torch.randn(t.shape) * 2

    def f(x, t):
        return torch.nn.functional.multilabel_margin_loss(x, t, reduction=reduction)

    xs = x.clone().requires_grad_()
    want = f(xs, t)
    (want_g,) = torch.autograd.grad(want.sum(), xs)
    if door == "device":
        xd = x.to(DEV).requires_grad_()
        got = f(xd, t.to(DEV))
        (got_g,) = torch.autograd.grad(got.sum(), xd)
        got, got_g = got.cpu(), got_g.cpu()
    else:
        got = tn.jit(f)(x, t)
        got_g = tn.jit(lambda x, t: torch.autograd.grad(f(x, t).sum(), x)[0])(x.clone().requires_grad_(), t)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want.detach())
    torch.testing.assert_close(got_g, want_g)


def test_eager_cache_tells_keyword_arguments_apart():
    # the boxed fallback passes only non-default keywords: out_int32=True and right=True have the same leaves
    x, b = torch.tensor(-1.0), torch.tensor([-2.0, 0.0, 3.0])
    xd, bd = x.to(DEV), b.to(DEV)
    for kw in ({"right": True}, {"out_int32": True}, {"out_int32": True, "right": True}, {}):
        got = torch.bucketize(xd, bd, **kw)
        want = torch.bucketize(x, b, **kw)
        assert got.dtype == want.dtype, kw
        assert torch.equal(got.cpu(), want)
        got = torch.searchsorted(bd, xd.reshape(1), **kw)
        assert got.dtype == torch.searchsorted(b, x.reshape(1), **kw).dtype, kw


# ---------------------------------------------------------------- CPU index tensors (CUDA accepts them)

def test_cpu_index_tensors_index_a_device_tensor():
    x = torch.randn(5, 4)
    d = x.to(DEV)
    idx = torch.tensor([0, 2, 4])
    mask = torch.tensor([True, False, True, False, True])
    torch.testing.assert_close(d[idx].cpu(), x[idx])
    torch.testing.assert_close(d[mask].cpu(), x[mask])
    torch.testing.assert_close(d[idx, idx % 4].cpu(), x[idx, idx % 4])
    y, e = x.clone(), d.clone()
    y[idx] = 1.5
    e[idx] = 1.5
    torch.testing.assert_close(e.cpu(), y)
    v = torch.randn(3, 4)
    y.index_put_((idx,), v, accumulate=True)
    e.index_put_((idx,), v.to(DEV), accumulate=True)
    torch.testing.assert_close(e.cpu(), y)


def test_other_cpu_tensors_still_refused():
    with pytest.raises(tn.TnError, match="neuron device"):
        torch.randn(3, device=DEV) + torch.randn(3)


def test_host_fallback_out_tensors_that_the_kernel_resizes():
    # linalg.lstsq's CPU kernel sizes its solution (m, k) before narrowing it to (n, k): a CPU alias of device
    # memory cannot be resized ("Trying to resize storage that is not resizable")
    a, b = torch.randn(5, 3), torch.randn(5, 2)
    got = torch.linalg.lstsq(a.to(DEV), b.to(DEV))
    for g, w in zip(got, torch.linalg.lstsq(a, b)):
        assert g.shape == w.shape
        torch.testing.assert_close(g.cpu(), w)
    out = torch.empty(0, device=DEV)
    torch.linalg.inv(a[:3, :3].to(DEV), out=out)
    torch.testing.assert_close(out.cpu(), torch.linalg.inv(a[:3, :3]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_sgn_gradient_on_device(dtype):
    # sgn's backward makes an _efficientzerotensor(device=neuron) on the host: the host fallback passed the
    # neuron device on and re-entered itself until RecursionError
    x0 = torch.randn(5, dtype=dtype)
    x0[1] = 0
    x, y = x0.to(DEV).requires_grad_(), x0.clone().requires_grad_()
    for t in (x, y):
        (torch.sgn(t) * t).abs().sum().backward()
    torch.testing.assert_close(x.grad.cpu(), y.grad)
