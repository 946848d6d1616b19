# Wrong answers found by bench/coverage.py sweeps at 6 samples per OpInfo (issue 17), one regression test each.
"""Each case is the smallest input that showed a silent wrong answer in a ``--max-samples 6`` sweep of
``bench/coverage.py`` (the published rows use 2 samples) and failed before its fix. bf16 cases are checked as
the bench checks them: the fp32 computation on the same bf16 inputs is the oracle, rounded once to bf16.
"""
import importlib.util
import pathlib

import pytest
import torch
import torch.nn.functional as F

import tn
import tn.dynamo_backend
import tn.lower  # noqa: F401  (registers the lowerings and the neuron backend)

BF16 = torch.bfloat16


def _addr_inputs():
    """addr's sample 2 reduced to the element that cancelled: 0.6 * -8.0625 + 0.2 * 4.5625 * 5.15625 = -0.1324
    (bf16 -0.1328125); torch's kernel for other backends rounded each step to bf16 and gave -0.15625."""
    x = torch.tensor([[-8.0625, 1.5], [2.0, -3.25]], dtype=BF16)
    a = torch.tensor([4.5625, -1.0], dtype=BF16)
    b = torch.tensor([5.15625, 0.75], dtype=BF16)
    return x, a, b


def _addr_oracle(x, a, b):
    return torch.addr(x.float(), a.float(), b.float(), beta=0.6, alpha=0.2).to(BF16)


def test_addr_bf16_on_the_device_rounds_once():
    x, a, b = _addr_inputs()
    got = torch.addr(x.to("neuron"), a.to("neuron"), b.to("neuron"), beta=0.6, alpha=0.2)
    assert got.device.type == "neuron" and got.dtype == BF16
    assert torch.equal(got.cpu(), _addr_oracle(x, a, b))
    assert got.cpu()[0, 0].item() == -0.1328125


def test_addr_inplace_and_out_bf16_on_the_device_round_once():
    x, a, b = _addr_inputs()
    want = _addr_oracle(x, a, b)
    xd = x.to("neuron")
    r = xd.addr_(a.to("neuron"), b.to("neuron"), beta=0.6, alpha=0.2)
    assert r is xd
    assert torch.equal(xd.cpu(), want)
    out = torch.empty(2, 2, dtype=BF16, device="neuron")
    torch.addr(x.to("neuron"), a.to("neuron"), b.to("neuron"), beta=0.6, alpha=0.2, out=out)
    assert torch.equal(out.cpu(), want)


def test_addr_on_the_device_keeps_beta_zero_semantics_and_gradients():
    # beta=0 ignores NaN in the input (as eager); the gradient of a float32 addr still flows to every operand
    x = torch.tensor([[float("nan"), 1.0], [2.0, 3.0]])
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -1.0])
    got = torch.addr(x.to("neuron"), a.to("neuron"), b.to("neuron"), beta=0.0, alpha=2.0).cpu()
    assert torch.equal(got, torch.addr(x, a, b, beta=0.0, alpha=2.0))
    xd, ad, bd = (t.clone().to("neuron").requires_grad_() for t in (x.nan_to_num(), a, b))
    torch.addr(xd, ad, bd, beta=0.5, alpha=2.0).sum().backward()
    assert torch.allclose(xd.grad.cpu(), torch.full((2, 2), 0.5))
    assert torch.allclose(ad.grad.cpu(), 2.0 * b.sum().expand(2))
    assert torch.allclose(bd.grad.cpu(), 2.0 * a.sum().expand(2))


def _bf16_rule(actual, want32, eager16):
    """The bench's bf16 rule: ``actual`` within rtol 1.6e-2 / atol 1e-3 of the fp32 oracle ``want32``, widened
    element by element by twice eager bf16's own error ``|eager16 - want32|``."""
    a, e, m = actual.detach().cpu().float(), want32.detach().float(), eager16.detach().float()
    allowed = 1e-3 + 1.6e-2 * e.abs() + 2 * (m - e).abs()
    bad = (a - e).abs() > allowed
    assert not bad.any(), f"door {a[bad][:4].tolist()}, fp32 {e[bad][:4].tolist()}, eager bf16 {m[bad][:4].tolist()}"


def _bilinear_inputs():
    """bilinear's sample 3 shapes ([2, 3, 3] x [2, 3, 4], weight [5, 3, 4], bias [5]) with fixed values."""
    g = torch.Generator().manual_seed(3)
    return [(torch.rand(*s, generator=g) * 18 - 9).to(BF16) for s in ((2, 3, 3), (2, 3, 4), (5, 3, 4), (5,))]


#: the gradient weights: bf16 values, as the bench's (the backward gets d loss / d out in bf16 on every side)
_BILINEAR_W = (torch.rand(2, 3, 5, generator=torch.Generator().manual_seed(4)) + 0.5).to(BF16).float()


def _bilinear_grads(x1, x2, weight, bias):
    """bilinear's result and the gradients of a weighted sum of it."""
    y = F.bilinear(x1, x2, weight, bias)
    return (y,) + torch.autograd.grad((y.float() * _BILINEAR_W.to(y.device)).sum(), (x1, x2, weight, bias))


def test_bilinear_bf16_gradient_contracts_in_fp32_under_jit():
    # each gradient is a contraction over two axes (two matrix products); the first product rounded to bf16
    # before the second put elements 19% off where the gradient cancels. Now the contraction runs in fp32 and
    # every gradient is fp32's rounded once, bit for bit (the result too, up to the bias add torch does apart).
    xs = _bilinear_inputs()
    want = _bilinear_grads(*[x.float().requires_grad_() for x in xs])
    eager = _bilinear_grads(*[x.clone().requires_grad_() for x in xs])
    got = tn.jit(_bilinear_grads)(*[x.clone().requires_grad_() for x in xs])
    _bf16_rule(got[0], want[0], eager[0])
    for g, e in zip(got[1:], want[1:]):
        assert g.dtype == BF16
        assert torch.equal(g, e.to(BF16))



def _normalize_inputs():
    """normalize's sample 2 form: p=0.5 over a dim of size 1 (the result is sign(x), the exact gradient 0), with
    bf16 gradient weights as the bench's."""
    g = torch.Generator().manual_seed(5)
    x = (torch.rand(1, 2, 4, 5, generator=g) * 2 - 1).to(BF16)
    w = (torch.rand(1, 2, 4, 5, generator=g) + 0.5).to(BF16).float()
    return x, w


def _normalize_grad(x, w):
    """The gradient of a weighted sum of ``F.normalize(x, p=0.5, dim=0)``."""
    y = F.normalize(x, p=0.5, dim=0)
    return torch.autograd.grad((y.float() * w.to(y.device)).sum(), x)[0]


def _check_normalize_gradient(got, x, w):
    # the exact gradient is 0 and fp32 on the same inputs leaves ~1e-6; the division's and the norm's gradients
    # (~20 each, bf16 ulp 0.125) computed op by op in bf16 left 0.125 / 0.0156 at some elements
    want = _normalize_grad(x.float().requires_grad_(), w)
    assert got.dtype == BF16 and got.shape == x.shape
    assert want.abs().max() < 1e-4
    assert got.float().abs().max() < 1e-4, got.float().abs().max()


def test_normalize_bf16_gradient_on_the_device_cancels_in_fp32():
    x, w = _normalize_inputs()
    got = _normalize_grad(x.to("neuron").requires_grad_(), w)
    assert got.device.type == "neuron"
    _check_normalize_gradient(got.cpu(), x, w)


def test_normalize_bf16_gradient_under_jit_cancels_in_fp32():
    x, w = _normalize_inputs()
    got = tn.jit(_normalize_grad)(x.clone().requires_grad_(), w)
    _check_normalize_gradient(got, x, w)


def test_normalize_bf16_gradient_under_torch_compile_cancels_in_fp32(fresh_dynamo):
    x, w = _normalize_inputs()
    xc = x.clone().requires_grad_()
    before = tn.dynamo_backend.graphs_compiled()
    y = torch.compile(lambda t: F.normalize(t, p=0.5, dim=0), backend="neuron", fullgraph=True)(xc)
    got, = torch.autograd.grad((y.float() * w).sum(), xc)   # AOTAutograd's backward graph, compiled by tn
    assert tn.dynamo_backend.graphs_compiled() == before + 2   # forward and backward
    _check_normalize_gradient(got, x, w)


def test_fp32_gradient_rules_leave_float32_and_eager_cpu_alone():
    # float32 keeps torch's own autograd formula on the device; bf16 there is the float32 op rounded once
    x = torch.randn(3, 4)
    n32 = torch.linalg.vector_norm(x.to("neuron").requires_grad_(), 2, 1)
    n16 = torch.linalg.vector_norm(x.to(BF16).to("neuron").requires_grad_(), 2, 1)
    assert type(n32.grad_fn).__name__ == "LinalgVectorNormBackward0"
    assert type(n16.grad_fn).__name__ == "ToCopyBackward0"
    assert torch.equal(n16.cpu(), torch.linalg.vector_norm(x.to(BF16), 2, 1))
    d16 = x.to(BF16).to("neuron") / x.to(BF16).to("neuron").requires_grad_()
    assert type(d16.grad_fn).__name__ == "ToCopyBackward0"
    # the CPU rules exist only while tn traces: eager CPU bf16 keeps torch's kernels after a tn.jit trace
    x16, w = _normalize_inputs()
    tn.jit(_normalize_grad)(x16.clone().requires_grad_(), w)
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::linalg_vector_norm", "AutogradCPU")
    y = F.normalize(x16.clone().requires_grad_(), p=0.5, dim=0)
    assert type(y.grad_fn).__name__ == "DivBackward0"


def test_fp32_gradient_rules_keep_a_python_number_divisor_a_wrapped_number():
    # x / 3.0 reaches the rules' kernel with 3.0 as a Python float; handing torch's kernel a plain 0-d tensor
    # instead would promote a 0-d bf16 x to float32 (and torch's boxed call refused the float outright)
    y = torch.tensor(1.0, dtype=BF16)
    on_device = y.to("neuron").requires_grad_() / 3.0
    assert on_device.dtype == BF16 and torch.equal(on_device.detach().cpu(), y / 3.0)
    traced = tn.jit(lambda t: (t / 3.0, torch.autograd.grad(t / 3.0, t)[0]))(y.clone().requires_grad_())
    assert traced[0].dtype == BF16 and torch.equal(traced[0], y / 3.0)
    assert traced[1].dtype == BF16 and torch.equal(traced[1], torch.tensor(1 / 3.0).to(BF16))


# ----------------------------------------------------------------- the bench's rule for fp32 leaves of a bf16 run

_BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench" / "coverage.py"
_bench_spec = importlib.util.spec_from_file_location("tn_bench_coverage_samples", _BENCH)
bench = importlib.util.module_from_spec(_bench_spec)
_bench_spec.loader.exec_module(bench)


def _cov_case():
    """cov's sample 24 in a bf16 --grad run: bf16 observations, fp32 ``aweights`` (both need a gradient). torch's
    type promotion makes the whole computation and its result fp32; the weights' exact gradient is 0 and -2e-13,
    a sum of terms ~10^3 that cancels (fp32 ulp there 6.1e-5)."""
    x = torch.tensor([[-8.5, -1.765625], [-4.3125, -2.40625], [-7.9375, 3.609375]], dtype=BF16)
    w = torch.tensor([0.25984418392181396, 0.3666413426399231])
    return bench.Case(lambda a, aw: torch.cov(a, correction=1, aweights=aw),
                      [x.requires_grad_(), w.requires_grad_()], "cov sample 24")


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_cov_fp32_weights_gradient_in_a_bf16_run_passes_fp32s_rule(mode):
    # eager fp32 gives the weights' gradient 0 and -6.1e-5, the device and tn.jit 6.1e-5 and -6.1e-5: one ulp of
    # the cancelling terms each, as close to the exact 0 as eager. Held element-wise to fp32's 1e-5 with no
    # allowance, the first element failed.
    case = _cov_case()
    status, why = bench._run_case(case, mode, "neuron", BF16, True, None, False)
    assert status in ("pass", "pass_host"), why


def test_fp32_leaves_of_a_bf16_run_keep_fp32_tolerance():
    # the rule the cov case takes, on fixed values: an fp32 leaf whose exact value is 0 where eager's fp32 error
    # elsewhere in the tensor is 6.1e-5 may be off by that much; a larger error, or one at an element far from 0,
    # still fails (a bf16 tolerance, atol 1e-3 / rtol 1.6e-2, would have let both through); a float32 run keeps
    # the element-wise allowance
    exact = torch.tensor([0.0, -2.3e-13, 4.0], dtype=torch.float64)
    eager = torch.tensor([0.0, -6.103515625e-05, 4.0])
    kw = dict(tolerances={**bench.TOLERANCES, **bench.GRAD_TOLERANCES}, oracle=[exact])
    door = torch.tensor([6.103515625e-05, -6.103515625e-05, 4.0])
    assert bench.compare([door], [eager], promoted=True, **kw) is None
    assert bench.compare([door], [eager], **kw) is not None
    assert bench.compare([door * 8], [eager], promoted=True, **kw) is not None
    assert bench.compare([torch.tensor([0.0, -6.1e-05, 4.0005])], [eager], promoted=True, **kw) is not None


def test_fp32_leaves_near_zero_allowance_ignores_eagers_overflow():
    # eager fp32 overflowing to inf where float64 is finite measures no ulp: it must not widen the other elements
    exact = torch.tensor([0.0, 3e38, 1.0], dtype=torch.float64)
    eager = torch.tensor([0.0, float("inf"), 1.0])
    kw = dict(tolerances={**bench.TOLERANCES, **bench.GRAD_TOLERANCES}, oracle=[exact])
    assert bench.compare([torch.tensor([0.5, float("inf"), 1.0])], [eager], promoted=True, **kw) is not None


def _addcdiv_inputs():
    """addcdiv's sample 3: input [5, 5], tensor1 [5, 1], tensor2 [1, 5] (broadcast: the gradients of tensor1/2
    are sums that cancel), value 3.14, with bf16 values and gradient weights."""
    g = torch.Generator().manual_seed(6)
    x, t1 = ((torch.rand(*s, generator=g) * 18 - 9).to(BF16) for s in ((5, 5), (5, 1)))
    t2 = torch.tensor([[2.984375, -2.984375, 5.21875, -3.203125, 0.4453125]], dtype=BF16)
    w = (torch.rand(5, 5, generator=g) + 0.5).to(BF16).float()
    return x, t1, t2, w


def test_addcdiv_bf16_gradient_under_torch_compile_is_eagers(fresh_dynamo):
    # Dynamo splits torch.addcdiv(x, t1, t2, value=v) into div, mul, add; in bf16 autograd's backward then rounded
    # grad * v to bf16 before the divisions and sums (an element of tensor2's gradient 86% off). The compile
    # door now runs one addcdiv as eager does: its gradients are eager's (AddcdivBackward), bit for bit.
    x, t1, t2, w = _addcdiv_inputs()

    def grads(f, *ts):
        ts = [t.clone().requires_grad_() for t in ts]
        return torch.autograd.grad((f(*ts).float() * w).sum(), ts)

    def op(a, b, c):
        return torch.addcdiv(a, b, c, value=3.14)

    want = grads(op, x, t1, t2)
    got = grads(torch.compile(op, backend="neuron", fullgraph=True), x, t1, t2)
    for gg, ww in zip(got, want):
        assert gg.dtype == BF16 and torch.equal(gg, ww)
    out = torch.compile(op, backend="neuron", fullgraph=True)(x, t1, t2)
    assert torch.equal(out, torch.addcdiv(x.float(), t1.float(), t2.float(), value=3.14).to(BF16))
