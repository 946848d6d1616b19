# Tests of conformance fixes from issue 17 (bench/coverage.py findings): ops that ran on the host or gave wrong answers.
import pytest
import torch

import tn
import tn.lower  # noqa: F401  (registers the lowerings and the neuron backend)


def _no_new_fallbacks(before):
    after = torch.neuron.fallback_ops()
    new = {k: v for k, v in after.items() if v != before.get(k, 0)}
    assert not new, f"host fallbacks: {new} ({torch.neuron.fallback_reasons()})"


# --------------------------------------------------------------------------- scans on the device


_SCANS = {
    "logcumsumexp": lambda t: torch.logcumsumexp(t, 1),
    "cummax": lambda t: torch.cummax(t, 1),
    "cummin": lambda t: torch.cummin(t, 0),
}


@pytest.mark.parametrize("name", sorted(_SCANS))
def test_scans_run_natively_on_the_device(monkeypatch, name):
    """The device's composite logcumsumexp/cummax/cummin call the kernels aten._logcumsumexp and
    aten._cummax_helper/_cummin_helper (no Meta kernel, no core op): they ran on the host."""
    monkeypatch.setenv("TN_STRICT", "1")
    f = _SCANS[name]
    x = torch.randn(6, 7, generator=torch.Generator().manual_seed(0))
    x[2, 3] = x[2, 1]                      # a tie: the later index wins
    before = dict(torch.neuron.fallback_ops())
    got = f(x.to("neuron"))
    want = f(x)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert g.device.type == "neuron"
        torch.testing.assert_close(g.cpu(), w)
    _no_new_fallbacks(before)


@pytest.mark.parametrize("name", sorted(_SCANS))
def test_scans_gradient_on_the_device(name):
    f = _SCANS[name]
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    xd = x.to("neuron").requires_grad_()
    xc = x.clone().requires_grad_()
    out_d, out_c = f(xd), f(xc)
    (out_d[0] if isinstance(out_d, tuple) else out_d).sum().backward()
    (out_c[0] if isinstance(out_c, tuple) else out_c).sum().backward()
    torch.testing.assert_close(xd.grad.cpu(), xc.grad, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- masked_scatter's gradient

_MS_CASES = {"same_shape": ((5, 5), (5, 5)), "broadcast_mask": ((5, 5), (5,)), "x_broadcast": ((5,), (5, 5)),
             "scalar_mask": ((5, 5), ())}


def _ms_inputs(xs, ms):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(xs, generator=g)
    m = torch.rand(ms, generator=g) > 0.4
    src = torch.randn(6, 5, generator=g)
    return x, m, src


def _ms_grads(x, m, src):
    y = x.masked_scatter(m, src)
    w = torch.arange(y.numel(), dtype=y.dtype, device=y.device).reshape(y.shape)
    return torch.autograd.grad((y * w).sum(), (x, src))


@pytest.mark.parametrize("case", sorted(_MS_CASES))
def test_masked_scatter_gradient_through_jit_and_compile(monkeypatch, case):
    """aten.masked_scatter_backward (masked_select + pad in torch: data-dependent) had no decomposition:
    tn.jit and the compile door refused masked_scatter's gradient."""
    monkeypatch.setenv("TN_STRICT", "1")
    x, m, src = _ms_inputs(*_MS_CASES[case])
    want = _ms_grads(x.requires_grad_(), m, src.requires_grad_())
    got = tn.jit(_ms_grads, backend="neuron")(x, m, src)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    cf = torch.compile(lambda a, b, c: a.masked_scatter(b, c), backend="neuron")
    xa, sa = x.detach().clone().requires_grad_(), src.detach().clone().requires_grad_()
    y = cf(xa, m, sa)
    (y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
    torch.testing.assert_close(xa.grad, want[0])
    torch.testing.assert_close(sa.grad, want[1])



# --------------------------------------------------------------------------- arg reductions over the partitions


@pytest.mark.parametrize("shape", [(8, 512, 768), (3, 40, 700), (200, 3, 300)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_argmax_argmin_over_a_partition_only_axis(monkeypatch, shape, dtype):
    """argmax(0) where axis 0 lies on the partitions and the kept axes span several tiles (no reduced axis in
    the tile) ran on the host ("argmax with no reduced axis in the tile"); ties go to the first index, a NaN
    wins."""
    monkeypatch.setenv("TN_STRICT", "1")
    g = torch.Generator().manual_seed(3)
    with_nan = torch.randn(shape, generator=g)
    with_nan.view(-1)[::11] = float("nan")
    for x in (torch.randn(shape, generator=g), torch.randint(0, 3, shape, generator=g).float(), with_nan):
        x = x.to(dtype)
        for mode in ("argmax", "argmin"):
            got = tn.jit(lambda t: getattr(t, mode)(0), backend="neuron")(x)
            assert torch.equal(got, getattr(x, mode)(0)), (mode, x.dtype)


# --------------------------------------------------------------------------- scatter into more than 2^24 elements


def test_scatter_masked_path_bounds_probe_still_catches_bad_indices():
    """The masked-reduction scatter checks its indices with a one-row probe gather now (it gathered from a
    table of all x's elements, which passes the DMA's 2^24-row limit for a [4096, 50257] cross-entropy
    gradient, so that scatter ran on the host)."""
    from tn.errors import TnError
    from tn.lower.testing import check_lowering

    g = torch.Generator().manual_seed(4)
    x, src = torch.randn(5, 7, generator=g), torch.randn(5, 3, generator=g)
    check_lowering("scatter_reduce", x, torch.randint(0, 7, (5, 3), generator=g), src, dim=1, reduce="amax",
                   include_self=True)
    for bad in (7, -1):
        with pytest.raises(TnError):
            check_lowering("scatter_reduce", x, torch.full((5, 3), bad), src, dim=1, reduce="amax",
                           include_self=True)


def test_scatter_beyond_two_to_the_24_elements_compiles_natively():
    """The cross-entropy gradient's scatter of -1/N into [N, V] with N*V > 2^24 (GPT-2's vocabulary) lowers
    (compiled only: running it with values takes minutes)."""
    from tn.lower import compile_ir
    from tn.lower.testing import build_eqn_ir

    x, idx = torch.empty(340, 50257, device="meta"), torch.empty(340, 1, dtype=torch.int64, device="meta")
    exe = compile_ir(build_eqn_ir("scatter", x, idx, -1.0, dim=1), strict=True)
    assert not exe.stats.get("host_ops")


# --------------------------------------------------------------------------- bf16 embedding_bag


def _bag(weight, idx, offsets, psw):
    return torch.nn.functional.embedding_bag(idx, weight, offsets, mode="sum", per_sample_weights=psw)


@pytest.mark.parametrize("door", ["jit", "device"])
def test_bf16_embedding_bag_sums_in_fp32(door):
    """bf16 embedding_bag (sum, per-sample weights) multiplied and summed in bf16: a bag of terms near 40
    summing to ~0.9 came out 0.14 off (CPU's kernel accumulates in fp32 and rounds once). The
    per-sample-weight gradient's dot products likewise."""
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(10, 5, generator=g) * 8).to(torch.bfloat16)
    psw = (torch.rand(6, generator=g) * 10 - 4).to(torch.bfloat16)
    idx, offsets = torch.tensor([1, 4, 7, 2, 2, 9]), torch.tensor([0, 3])

    def f(w, psw):
        out = _bag(w, idx if w.device.type == "cpu" else idx.to(w.device),
                   offsets if w.device.type == "cpu" else offsets.to(w.device), psw)
        gw = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape).to(out.dtype)
        return (out,) + torch.autograd.grad((out * gw).sum(), (w, psw))

    ref = f(w.float().requires_grad_(), psw.float().requires_grad_())
    if door == "jit":
        got = tn.jit(f, backend="neuron")(w.requires_grad_(), psw.requires_grad_())
    else:
        got = [t.cpu() for t in f(w.to("neuron").requires_grad_(), psw.to("neuron").requires_grad_())]
    for name, a, r in zip(("out", "grad weight", "grad psw"), got, ref):
        assert a.dtype == torch.bfloat16
        err = (a.float() - r).abs()
        assert (err <= r.abs() * 2 ** -8 + 1e-3).all(), (name, err.max().item())


# --------------------------------------------------------------------------- bf16 addbmm


@pytest.mark.parametrize("door", ["jit", "device"])
def test_bf16_addbmm_rounds_the_batch_sum_once(door):
    """bf16 addbmm summed its batches' products one by one, each rounded to bf16 (twice eager bf16's error on
    the bench); the batches side by side in one matmul keep the sum in fp32 until it is rounded."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(6, 7, generator=g).to(torch.bfloat16)
    b1 = (torch.randn(24, 6, 5, generator=g) * 4).to(torch.bfloat16)
    b2 = (torch.randn(24, 5, 7, generator=g) * 4).to(torch.bfloat16)
    p = torch.einsum("bnm,bmp->np", b1.float(), b2.float())
    ref = x.float() + p
    f = lambda x, b1, b2: torch.addbmm(x, b1, b2)
    got = tn.jit(f, backend="neuron")(x, b1, b2) if door == "jit" else \
        f(x.to("neuron"), b1.to("neuron"), b2.to("neuron")).cpu()
    assert got.dtype == torch.bfloat16
    err = (got.float() - ref).abs()
    allowed = (p.abs() + ref.abs()) * 2 ** -8 + 1e-3       # the product and the sum rounded once each
    assert (err <= allowed).all(), (err - allowed).max().item()


# --------------------------------------------------------------------------- linalg through the compile door


def test_linalg_through_the_compile_door():
    """AOTAutograd wraps torch.linalg's error checks (_linalg_check_errors) in the with_effects higher-order op,
    which tn's tracer has no rule for: every torch.linalg call failed under torch.compile(backend="neuron").
    The compile door inlines them (linear algebra then runs as counted host ops, as under tn.jit)."""
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(7)) + 4 * torch.eye(4)
    torch._dynamo.reset()
    f = torch.compile(lambda a: torch.linalg.inv(a) @ a.sin(), backend="neuron")
    xa, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = f(xa)
    want = torch.linalg.inv(xr) @ xr.sin()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(xa.grad, xr.grad, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()
    c = torch.compile(lambda a: torch.linalg.cholesky(a @ a.mT), backend="neuron")
    torch.testing.assert_close(c(x), torch.linalg.cholesky(x @ x.mT), rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- bf16 conv_transpose3d


@pytest.mark.parametrize("door", ["jit", "device"])
def test_bf16_conv_transpose3d_rounds_once(door):
    """A bf16 transposed 3-d convolution (one transposed 2-d convolution per depth tap, the taps summed
    along depth) rounded each tap to bf16 before the sum: off by several ulps where taps cancel."""
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(1, 3, 4, 5, 5, generator=g) * 3).to(torch.bfloat16)
    w = (torch.randn(3, 2, 3, 3, 3, generator=g) * 3).to(torch.bfloat16)
    f = lambda x, w: torch.nn.functional.conv_transpose3d(x, w, stride=(2, 1, 1))
    ref = f(x.float(), w.float())
    got = tn.jit(f, backend="neuron")(x, w) if door == "jit" else f(x.to("neuron"), w.to("neuron")).cpu()
    assert got.dtype == torch.bfloat16
    err = (got.float() - ref).abs()
    allowed = ref.abs() * 2 ** -8 + 1e-2
    assert (err <= allowed).all(), (err - allowed).max().item()


@pytest.mark.parametrize("door", ["jit", "device"])
def test_bf16_conv3d_input_gradient_rounds_once(door):
    """A bf16 3-d convolution's input gradient (one 2-d gradient per depth tap, the taps summed along depth)
    rounded each tap to bf16 before the sum: 2.5 ulps off at an element of the bf16 OpInfo sweep (dilation 3,
    padding 'same'); the taps are now computed in fp32 and the sum rounded once, as eager does."""
    g = torch.Generator().manual_seed(12)
    x = (torch.randn(1, 1, 10, 11, 12, generator=g) * 3).to(torch.bfloat16)
    w = (torch.randn(1, 1, 4, 4, 4, generator=g) * 3).to(torch.bfloat16)
    up = torch.randn(1, 1, 10, 11, 12, generator=g).to(torch.bfloat16)   # the same upstream gradient in both

    def dx(x, w):
        y = torch.nn.functional.conv3d(x, w, padding="same", dilation=3)
        return torch.autograd.grad((y * up.to(y.device, y.dtype)).sum(), x)[0]

    ref = dx(x.float().requires_grad_(), w.float())
    got = (tn.jit(dx, backend="neuron")(x.clone().requires_grad_(), w) if door == "jit"
           else dx(x.to("neuron").requires_grad_(), w.to("neuron")).cpu())
    assert got.dtype == torch.bfloat16
    err = (got.float() - ref).abs()
    allowed = ref.abs() * 2 ** -8 + 1e-2      # one bf16 rounding (half an ulp is 2^-9 relative)
    assert (err <= allowed).all(), (err - allowed).max().item()


# --------------------------------------------------------------------------- shrink gradients


@pytest.mark.parametrize("fn", [torch.nn.functional.hardshrink, torch.nn.functional.softshrink], ids=lambda f: f.__name__)
def test_shrink_gradients_trace(monkeypatch, fn):
    """hardshrink_backward/softshrink_backward had no decomposition: nn.Hardshrink/Softshrink could not be
    trained through tn.jit or the compile door and ran their backward on the device's host."""
    monkeypatch.setenv("TN_STRICT", "1")
    x = torch.tensor([-1.0, -0.5, -0.3, 0.0, 0.2, 0.5, 0.7, 2.0])

    def f(x):
        y = fn(x, 0.5)
        return y, torch.autograd.grad((y * torch.arange(8.0)).sum(), x)[0]

    want = f(x.clone().requires_grad_())
    got = tn.jit(f, backend="neuron")(x.clone().requires_grad_())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.detach())
    before = dict(torch.neuron.fallback_ops())
    xd = x.to("neuron").requires_grad_()
    y = fn(xd, 0.5)
    (y * torch.arange(8.0, device="neuron")).sum().backward()
    torch.testing.assert_close(xd.grad.cpu(), want[1])
    _no_new_fallbacks(before)


# --------------------------------------------------------------------------- bf16 layer norm statistics


@pytest.mark.parametrize("door", ["jit", "device"])
def test_bf16_native_layer_norm_statistics_have_the_input_dtype(door):
    """torch's CPU kernel returns a bf16 input's mean and rstd in bf16 (CUDA keeps fp32); tn gave fp32."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 3, 8, generator=g).to(torch.bfloat16)
    w, b = torch.randn(8, generator=g).to(torch.bfloat16), torch.randn(8, generator=g).to(torch.bfloat16)

    def f(x, w, b):
        return torch.ops.aten.native_layer_norm(x, [3, 8], w.expand(3, 8), b.expand(3, 8), 1e-5)

    want = f(x, w, b)
    got = tn.jit(f)(x, w, b) if door == "jit" else [t.cpu() for t in f(x.to("neuron"), w.to("neuron"),
                                                                       b.to("neuron"))]
    assert [t.dtype for t in got] == [t.dtype for t in want] == [torch.bfloat16] * 3
    assert [t.shape for t in got] == [t.shape for t in want]
    for a, e in zip(got, want):
        torch.testing.assert_close(a.float(), e.float(), rtol=1.6e-2, atol=1e-2)


# --------------------------------------------------------------------------- value-shaped ops on static masks


@pytest.mark.parametrize("r,with_replacement", [(1, False), (2, False), (3, True)])
def test_combinations_through_jit(r, with_replacement):
    """torch.combinations masks a meshgrid with a triangular mask built from arange and masked_selects it: the
    mask depends on no input, so the result's shape is known while tracing (it was refused as data-dependent)."""
    x = torch.randn(5, requires_grad=True)

    def f(x):
        out = torch.combinations(x, r, with_replacement=with_replacement)
        return out, torch.autograd.grad((out * torch.arange(out.numel()).view(out.shape)).sum(), x)[0]

    got, want = tn.jit(f)(x), f(x)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_masked_select_on_an_input_mask_is_still_refused():
    # refused as one program (fullgraph); without fullgraph tn.jit splits there (tests/test_jit_split.py)
    with pytest.raises(tn.TracingError, match="depends on tensor values"):
        tn.jit(lambda x: torch.masked_select(x, x > 0), fullgraph=True)(torch.randn(5))
