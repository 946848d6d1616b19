# bfloat16 conformance (issue 17): ops whose bf16 results or gradients were wrong on the device and tn.jit doors.
"""Each test runs one op with bf16 inputs through the device door (``.to("neuron")``) and ``tn.jit`` and
checks it with the rule of ``bench/coverage.py``: the fp32 computation on the same (bf16-valued) inputs is the
oracle, at bf16 tolerances (rtol 1.6e-2, atol 1e-3) widened, element by element, by twice the error of eager
PyTorch's own bf16 CPU kernel there (a CPU bf16 kernel is not the oracle, but where it loses digits to
cancellation any bf16 computation may). Each failed before its fix.
"""
import pytest
import torch
import torch.nn.functional as F

import tn
import tn.lower  # noqa: F401  (registers the lowerings and the neuron backend)

RTOL, ATOL = 1.6e-2, 1e-3
BF16 = torch.bfloat16


def _assert_bf16_close(actual, want32, eager16):
    """``actual`` (bf16) within the bench's bf16 rule of the fp32 oracle ``want32``, widened by twice eager's
    bf16 error ``|eager16 - want32|`` (no widening where eager's value is not finite)."""
    assert actual.dtype == BF16 and actual.shape == want32.shape
    a = actual.detach().cpu().float()
    e = want32.detach().float()
    m = eager16.detach().float()
    slack = torch.where(torch.isfinite(m), 2 * (m - e).abs(), torch.zeros_like(e))
    allowed = ATOL + RTOL * e.abs() + slack
    bad = ~((a - e).abs() <= allowed)
    assert not bad.any(), (f"{int(bad.sum())} of {a.numel()} elements off: door {a[bad][:4].tolist()}, "
                           f"fp32 {e[bad][:4].tolist()}, eager bf16 {m[bad][:4].tolist()}")


def _doors(fn, *xs):
    """``fn``'s bf16 results through the device door and through ``tn.jit``."""
    dev = fn(*[x.to("neuron") for x in xs])
    jit = tn.jit(fn)(*xs)
    return {"device": dev, "jit": jit}


def _matrix_exp_input():
    """OpInfo matrix_exp's first sample shape and scale: a 5x5 bf16 matrix of 1-norm ~27 (exp entries ~9e4)."""
    g = torch.Generator().manual_seed(0)
    return (torch.rand(5, 5, generator=g) * 18 - 9).to(BF16)


def test_matrix_exp_bf16_is_finite_and_right():
    # torch's CPU bf16 kernel evaluates its Taylor polynomial and squarings in bf16 and returns NaN here; the
    # doors ran that kernel as a host op (NaN, a wrong answer against fp32). Now decomposed natively in fp32.
    a = _matrix_exp_input()
    want = torch.linalg.matrix_exp(a.float())
    assert torch.isfinite(want).all()
    eager = torch.linalg.matrix_exp(a)
    for door, got in _doors(torch.linalg.matrix_exp, a).items():
        assert torch.isfinite(got.cpu()).all(), door
        _assert_bf16_close(got, want, eager)


def test_matrix_exp_bf16_runs_natively(monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")
    a = _matrix_exp_input()
    got = tn.jit(torch.linalg.matrix_exp)(a)
    _assert_bf16_close(got, torch.linalg.matrix_exp(a.float()), torch.linalg.matrix_exp(a))


def test_matrix_exp_bf16_gradient():
    # the gradient is matrix_exp of a 2n x 2n block matrix: the same bf16 path
    a = _matrix_exp_input()
    w = (torch.rand(5, 5, generator=torch.Generator().manual_seed(1)) + 0.5).to(BF16)

    def grad(x, dev=None):
        x = x.detach().to(dev or "cpu").requires_grad_()
        (torch.linalg.matrix_exp(x) * w.to(x.device).to(x.dtype)).sum().backward()
        return x.grad

    want = grad(a.float())
    got = grad(a, "neuron")
    assert torch.isfinite(got.cpu()).all()
    _assert_bf16_close(got, want, grad(a))


def _addmm_cancelling():
    """``C - A @ B`` where ``C`` is ``A @ B`` plus small noise: the result is ~50x smaller than the product."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 32, generator=g).to(BF16)
    b = torch.randn(32, 48, generator=g).to(BF16)
    c = ((a.float() @ b.float()) + 0.05 * torch.randn(64, 48, generator=g)).to(BF16)
    return c, a, b


@pytest.mark.parametrize("door", ["device", "jit"])
def test_addmm_bf16_into_a_full_matrix_rounds_once(door):
    # the product was rounded to bf16 before the sum: 0.06 off where eager (fp32 sum, one rounding) is 5e-4 off
    c, a, b = _addmm_cancelling()

    def f(c, a, b):
        return torch.addmm(c, a, b, alpha=-1)

    want = f(c.float(), a.float(), b.float())
    got = f(*[x.to("neuron") for x in (c, a, b)]) if door == "device" else tn.jit(f)(c, a, b)
    _assert_bf16_close(got, want, f(c, a, b))


def test_addmm_bf16_with_a_bias_vector_is_unchanged():
    # a broadcast bias (nn.Linear) keeps the bf16 matmul (TensorE at the bf16 rate); its result still conforms
    g = torch.Generator().manual_seed(2)
    x, w, bias = (torch.randn(16, 32, generator=g).to(BF16), torch.randn(32, 24, generator=g).to(BF16),
                  torch.randn(24, generator=g).to(BF16))
    got = tn.jit(torch.addmm)(bias, x, w)
    _assert_bf16_close(got, torch.addmm(bias.float(), x.float(), w.float()), torch.addmm(bias, x, w))


def test_linear_cross_entropy_auto_policy_on_neuron_accumulates_in_fp32():
    # torch resolves acc_policy='auto' per device type and knew only cpu/cuda: the neuron device got bf16
    # accumulation ('compact'), whose chunked input gradient (W[t] w - P W, cancelling) had twice eager's error
    from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions

    o = LinearCrossEntropyOptions(batch_chunk_size=2)._adjust(8, 3, 4, BF16, torch.device("neuron"))
    cpu = LinearCrossEntropyOptions(batch_chunk_size=2)._adjust(8, 3, 4, BF16, torch.device("cpu"))
    assert (o.acc_policy, o.acc_dtype) == (cpu.acc_policy, cpu.acc_dtype) == ("accurate", torch.float32)
    f32 = LinearCrossEntropyOptions(batch_chunk_size=2)._adjust(8, 3, 4, torch.float32, torch.device("neuron"))
    assert f32.acc_dtype == torch.float32


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_linear_cross_entropy_chunked_bf16_gradient_on_the_device(reduction):
    from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions

    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 3, generator=g).to(BF16)
    w = torch.randn(4, 3, generator=g).to(BF16)
    t = torch.randint(0, 4, (8,), generator=g)
    up = (torch.rand(8, generator=g) + 0.5).to(BF16)
    opts = LinearCrossEntropyOptions(batch_chunk_size=2)

    def grads(x, w, dev):
        x = x.detach().to(dev).requires_grad_()
        w = w.detach().to(dev).requires_grad_()
        out = F.linear_cross_entropy(x, w, t.to(dev), reduction=reduction, options=opts)
        loss = (out.float() * up.float().to(dev)).sum() if reduction == "none" else out.float()
        loss.backward()
        return x.grad, w.grad

    want = grads(x.float(), w.float(), "cpu")
    eager = grads(x, w, "cpu")
    got = grads(x, w, "neuron")
    for a, e, m in zip(got, want, eager):
        _assert_bf16_close(a, e, m)


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_nextafter_16_bit_every_value_natively(dtype, monkeypatch):
    # tn.jit refused nextafter of bf16/fp16 (the decomposition took fp32 only): every bit pattern, towards
    # +-inf, 0 and NaN, bit for bit with torch's CPU kernel, with no host op
    monkeypatch.setenv("TN_STRICT", "1")
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    f = tn.jit(torch.nextafter)
    for towards in (float("inf"), float("-inf"), 0.0, float("nan")):
        y = torch.full_like(x, towards)
        want, got = torch.nextafter(x, y), f(x, y)
        same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
        assert same.all(), (towards, x[~same][:4].tolist(), got[~same][:4].tolist(), want[~same][:4].tolist())


def test_nextafter_from_the_smallest_negative_subnormal_up_is_negative_zero():
    x = torch.tensor([-2.0 ** -149, 2.0 ** -149])
    y = torch.tensor([1.0, 0.0])
    want = torch.nextafter(x, y)            # [-0.0, 0.0]
    for got in (tn.jit(torch.nextafter)(x, y), torch.nextafter(x.to("neuron"), y.to("neuron")).cpu()):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), got


def test_index_put_accumulate_bf16_sums_in_fp32_through_jit():
    # ~50 additions per slot: torch's CPU kernel adds them one by one in bf16, tn.jit's scatter-add added them
    # in bf16 in another order (0.48 off fp32 on OpInfo's _unsafe_masked_index_put_accumulate sample 4); now
    # the fp32 sum rounded once (checked without eager's widening)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, generator=g).to(BF16)
    idx = torch.randint(0, 4, (200,), generator=g)
    v = (torch.randn(200, generator=g) * 4).to(BF16)

    def f(x, v):
        return torch.index_put(x, (idx,), v, accumulate=True)

    want = f(x.float(), v.float())
    _assert_bf16_close(tn.jit(f)(x, v), want, want)


# --------------------------------------------------------------------------- the bench's bf16 rules

def _bench():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "coverage.py"
    spec = importlib.util.spec_from_file_location("tn_bench_coverage_bf16", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_sort_gradient_accepts_equal_keys_in_another_order_only():
    cov = _bench()
    x = torch.tensor([[1., 2., 2., 3.], [5., 5., 1., 0.]], dtype=BF16)
    check = cov._tie_check("sort", (x,), {})
    want = torch.tensor([[.1, .2, .3, .4], [.5, .6, .7, .8]])
    swapped_ties = torch.tensor([[.1, .3, .2, .4], [.6, .5, .7, .8]]).to(BF16)
    swapped_keys = torch.tensor([[.2, .1, .3, .4], [.5, .6, .7, .8]]).to(BF16)
    kw = cov.TOLERANCES[BF16]
    assert check.grads((swapped_ties,), (want,), kw)
    assert not check.grads((swapped_keys,), (want,), kw)


def test_bench_gradient_weights_of_bf16_results_are_bf16_values():
    cov = _bench()
    o16 = torch.zeros(64, dtype=BF16, requires_grad=True)
    o32 = torch.zeros(64, requires_grad=True)
    w16, w32 = cov._grad_weights([o16])[0], cov._grad_weights([o32])[0]
    assert w16.dtype == torch.float32 and torch.equal(w16, w16.to(BF16).float())
    assert not torch.equal(w32, w32.to(BF16).float())


def test_bench_rounded_once_log_softmax_is_the_correctly_rounded_value():
    cov = _bench()
    x = torch.tensor([-0.6016, -0.0417, -1.5859, -2.7656], dtype=BF16)
    case = cov.Case(lambda t: torch.log_softmax(t, 0), [x], "log_softmax")
    out, _ = cov._rounded_eager(case, False, [])
    assert torch.equal(out, torch.log_softmax(x.float(), 0).to(BF16))
    assert not torch.equal(torch.log_softmax(x, 0), out)     # eager's own kernel rounds in between
