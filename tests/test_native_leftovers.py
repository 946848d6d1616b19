# Tests of host ops made native late in issue 17 (segment_reduce's gradient, LDL^T with LAPACK's pivots, histograms under tn.jit) and of hash_tensor, a counted host op under tn.jit: against torch on the CPU, under TN_STRICT, through tn.jit and on the device.
import itertools

import pytest
import torch

import tn
import tn.lower  # noqa: F401  (registers the lowerings and the neuron backend)

# --------------------------------------------------------------------------- segment_reduce's gradient

_SEG_LENGTHS = {1: torch.tensor([2, 0, 3, 1]), 3: torch.tensor([[2, 0, 3, 1], [1, 1, 0, 4]])}


def _segment_data(reduce, ndim, seed):
    g = torch.Generator().manual_seed(seed)
    shape = {1: (6,), 2: (6, 3), 3: (2, 6, 3)}[ndim]
    x = torch.randn(shape, generator=g)
    rows = x if ndim < 3 else x.transpose(0, 1)      # the reduced axis first (a view: writes reach x)
    if reduce == "prod":
        rows[1] = 0.0       # a zero row: its gradient is the product of the others, not grad * out / 0
    if reduce in ("max", "min"):
        rows[3] = rows[4]   # a tie in the third segment: torch's kernel shares positive gradients among ties
    return x


def _segment_loss_and_grad(x, reduce, kw):
    y = torch.segment_reduce(x, reduce, **kw)
    w = torch.arange(y.numel(), dtype=y.dtype, device=y.device).view(y.shape) - 3.0    # gradients of both signs
    return y, torch.autograd.grad((y * w).sum(), x)[0]


def _segment_kwargs(ndim, offsets, initial):
    lengths = _SEG_LENGTHS[3 if ndim == 3 else 1]
    kw = dict(axis=1 if ndim == 3 else 0, unsafe=True, initial=initial)
    if offsets:
        zero = torch.zeros(lengths.shape[:-1] + (1,), dtype=lengths.dtype)
        kw["offsets"] = torch.cat([zero, lengths.cumsum(-1)], -1)
    else:
        kw["lengths"] = lengths
    return kw


@pytest.mark.parametrize("reduce, ndim, offsets, initial",
                         [(r, d, o, i) for r, d, (o, i) in itertools.product(
                             ["sum", "mean", "max", "min", "prod"], [1, 2, 3],
                             [(False, None), (True, 2.0)])])
def test_segment_reduce_gradient_through_jit_equals_torchs(reduce, ndim, offsets, initial, monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")      # a host op would raise
    x = _segment_data(reduce, ndim, ndim).requires_grad_()
    kw = _segment_kwargs(ndim, offsets, initial)
    got = tn.jit(lambda x: _segment_loss_and_grad(x, reduce, kw))(x)
    torch.testing.assert_close(got, _segment_loss_and_grad(x, reduce, kw), equal_nan=True)


@pytest.mark.parametrize("reduce", ["mean", "max", "prod"])
def test_segment_reduce_gradient_on_the_device_runs_natively(reduce, monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")
    x = _segment_data(reduce, 2, 5)
    kw = _segment_kwargs(2, False, None)
    want = _segment_loss_and_grad(x.clone().requires_grad_(), reduce, kw)
    kwd = {k: (v.to("neuron") if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    got = _segment_loss_and_grad(x.to("neuron").requires_grad_(), reduce, kwd)
    torch.testing.assert_close([t.cpu() for t in got], list(want), equal_nan=True)


def test_segment_reduce_max_gradient_keeps_torchs_tie_rule():
    """Two rows equal to a segment's maximum: torch's kernel divides a positive gradient by 2 and leaves a
    negative one whole (its own rule, kept: the decomposition is compared with the kernel, not with calculus)."""
    x = torch.tensor([1.0, 3.0, 3.0, 2.0, 2.0]).requires_grad_()
    kw = dict(lengths=torch.tensor([3, 2]), unsafe=True)
    f = lambda x, w: torch.autograd.grad((torch.segment_reduce(x, "max", **kw) * w).sum(), x)[0]   # noqa: E731
    w = torch.tensor([4.0, -6.0])
    want = torch.tensor([0.0, 2.0, 2.0, -6.0, -6.0])
    torch.testing.assert_close(f(x, w), want)
    torch.testing.assert_close(tn.jit(f)(x, w), want)


# --------------------------------------------------------------------------- hash_tensor: a counted host op


@pytest.mark.parametrize("kw", [{}, dict(dim=[0], keepdim=True), dict(dim=[-1])])
def test_hash_tensor_through_jit_is_torchs_hash_as_one_counted_host_op(kw):
    """The xor of float64 bit patterns needs 64-bit words (the engine has range-checked int32 ones): under
    tn.jit it is one host equation, counted, torch's exact hash (it raised UnsupportedOpError before)."""
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    f = lambda x: torch.hash_tensor(x * 2, **kw)    # noqa: E731
    with tn.profile() as prof:
        got = tn.jit(f)(x)
    assert got.dtype == torch.uint64 and torch.equal(got, f(x))
    assert sum(prof.host_ops.values()) == 1


def test_hash_tensor_through_jit_is_refused_under_strict(monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")
    with pytest.raises(tn.UnsupportedOpError):
        tn.jit(lambda x: torch.hash_tensor(x + 1))(torch.randn(4))


# --------------------------------------------------------------------------- LDL^T with Bunch-Kaufman pivots


def _symmetric(batch, n, seed, definite=False):
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(*batch, n, n, generator=g)
    return b @ b.mT if definite else b + b.mT


@pytest.mark.parametrize("n, definite", [(1, False), (2, False), (3, False), (5, False), (6, True), (8, False),
                                         (10, False)])
def test_ldl_factor_through_jit_has_lapacks_pivots(n, definite, monkeypatch):
    """Bunch-Kaufman pivots (1x1 and 2x2 blocks, interchanges) are LAPACK's exactly, and LD too (the updates
    follow dsytf2's order of operations); a zero matrix reports info = 1 as LAPACK does."""
    monkeypatch.setenv("TN_STRICT", "1")
    a = _symmetric((4,), n, n, definite)
    a[2] = 0.0
    got = tn.jit(lambda a: torch.linalg.ldl_factor_ex(a))(a)
    want = torch.linalg.ldl_factor_ex(a)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)


def test_ldl_factor_pivots_include_2x2_blocks():
    """The cases above exercise every branch: some matrices take 2x2 blocks (negative pivots)."""
    pivots = torch.cat([torch.linalg.ldl_factor(_symmetric((4,), n, n))[1].flatten() for n in (3, 5, 8, 10)])
    assert (pivots < 0).any() and (pivots > 0).any()


@pytest.mark.parametrize("n, batch_ld, batch_b", [(1, (), (2,)), (4, (3,), (3,)), (7, (), ()), (9, (2,), (2,))])
def test_ldl_solve_through_jit_equals_torchs(n, batch_ld, batch_b, monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")
    ld, piv = torch.linalg.ldl_factor(_symmetric(batch_ld, n, 10 + n))
    b = torch.randn(*batch_b, n, 3, generator=torch.Generator().manual_seed(n))
    got = tn.jit(lambda ld, piv, b: torch.linalg.ldl_solve(ld, piv, b))(ld, piv, b)
    torch.testing.assert_close(got, torch.linalg.ldl_solve(ld, piv, b), rtol=1e-4, atol=1e-5)


def test_ldl_factor_and_solve_on_the_device_run_natively(monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")
    a = _symmetric((2,), 6, 3)
    b = torch.randn(2, 6, 2, generator=torch.Generator().manual_seed(4))
    ld, piv = torch.linalg.ldl_factor(a.to("neuron"))
    x = torch.linalg.ldl_solve(ld, piv, b.to("neuron"))
    ld0, piv0 = torch.linalg.ldl_factor(a)
    assert torch.equal(piv.cpu(), piv0)
    torch.testing.assert_close(ld.cpu(), ld0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.cpu(), torch.linalg.ldl_solve(ld0, piv0, b), rtol=1e-4, atol=1e-5)


def test_ldl_of_float64_and_large_matrices_stay_counted_host_ops():
    with tn.profile() as prof:
        tn.jit(lambda a: torch.linalg.ldl_factor_ex(a))(_symmetric((), 4, 1).double())
        tn.jit(lambda a: torch.linalg.ldl_factor_ex(a))(_symmetric((), 40, 1))
    assert sum(prof.host_ops.values()) == 2


# --------------------------------------------------------------------------- histograms under tn.jit


def _hist_data(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("kw", [dict(bins=5), dict(bins=3, range=(-1.0, 2.0)), dict(bins=4, density=True),
                                dict(bins=1, range=(0.5, 0.5)), dict(bins=6, weighted=True, density=True)],
                         ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_histogram_bin_count_through_jit_equals_torchs(kw, monkeypatch):
    """Edges from the data's range (torch's linspace, in the program), the bin search and the weighted counts,
    as one program (tn.jit raised UnsupportedOpError before)."""
    monkeypatch.setenv("TN_STRICT", "1")
    kw = dict(kw)
    x = _hist_data((7, 3), 1)
    w = torch.rand(7, 3, generator=torch.Generator().manual_seed(2)) if kw.pop("weighted", False) else None
    f = lambda x, w: torch.histogram(x, weight=w, **kw)   # noqa: E731
    got, want = tn.jit(f)(x, w), f(x, w)
    torch.testing.assert_close(got.bin_edges, want.bin_edges)
    torch.testing.assert_close(got.hist, want.hist)


@pytest.mark.parametrize("x", [torch.full((4,), 2.0), torch.tensor(1.5), torch.zeros(0)],
                         ids=["constant", "0-d", "empty"])
def test_histogram_of_degenerate_data_through_jit(x, monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")
    f = lambda x: torch.histogram(x, bins=3)    # noqa: E731
    got, want = tn.jit(f)(x), f(x)
    torch.testing.assert_close(got.bin_edges, want.bin_edges)
    torch.testing.assert_close(got.hist, want.hist)


def test_histogram_given_edges_unsorted_too_through_jit(monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")
    x = _hist_data((20,), 3)
    f = lambda x, e: torch.histogram(x, e)      # noqa: E731
    for edges in (torch.tensor([-4.0, -1.0, 0.0, 0.5, 3.0]), torch.tensor([-2.0, 1.0, -0.5, 4.0])):
        got, want = tn.jit(f)(x, edges), f(x, edges)
        torch.testing.assert_close(got.hist, want.hist)
        torch.testing.assert_close(got.bin_edges, want.bin_edges)


def test_histogramdd_through_jit_equals_torchs(monkeypatch):
    monkeypatch.setenv("TN_STRICT", "1")
    x = _hist_data((2, 9, 3), 4)
    w = torch.rand(2, 9, generator=torch.Generator().manual_seed(5))
    f = lambda x, w: torch.histogramdd(x, bins=[2, 3, 4], weight=w, density=True)     # noqa: E731
    got, want = tn.jit(f)(x, w), f(x, w)
    torch.testing.assert_close(got.hist, want.hist)
    for a, b in zip(got.bin_edges, want.bin_edges):
        torch.testing.assert_close(a, b)
    edges = [torch.tensor([-3.0, 0.0, 3.0]), torch.tensor([-1.0, 1.0]), torch.tensor([-5.0, -1.0, 2.0, 5.0])]
    g = lambda x, e0, e1, e2: torch.histogramdd(x, bins=[e0, e1, e2]).hist    # noqa: E731
    torch.testing.assert_close(tn.jit(g)(x, *edges), g(x, *edges))
