# Data-dependent ops on the neuron device (tn.device.data_dependent): exact against torch on CPU, no host fallback.
import pytest
import torch

import tn  # noqa: F401  (registers the neuron device)
from tn.device.windows import eager_mode

NAN = float("nan")


@pytest.fixture(autouse=True)
def _strict(monkeypatch, request):
    """Every test runs under TN_STRICT=1 (a host fallback raises) and checks that none was counted; except
    the ``test_host_errors_*`` ones, which check that torch's own errors reach the user through the host."""
    if request.node.name.startswith("test_host_errors"):
        monkeypatch.delenv("TN_STRICT", raising=False)
        yield
        return
    monkeypatch.setenv("TN_STRICT", "1")
    before = dict(torch.neuron.fallback_ops())
    yield
    assert torch.neuron.fallback_ops() == before


def _same(got, want):
    """``got`` (device results) equals ``want`` (CPU results) exactly: values (NaN where NaN), shape, dtype
    and strides; bools and ints compared as they are."""
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
        return
    if not isinstance(want, torch.Tensor):
        assert got == want and type(got) is type(want)
        return
    assert got.device.type == "neuron"
    g = got.cpu()
    assert g.dtype == want.dtype and g.shape == want.shape and got.stride() == want.stride(), \
        (g.dtype, want.dtype, g.shape, want.shape, got.stride(), want.stride())
    assert torch.equal(g.isnan() if g.is_floating_point() else g, want.isnan() if want.is_floating_point() else want)
    if g.is_floating_point():
        assert torch.equal(torch.nan_to_num(g), torch.nan_to_num(want))
        assert torch.equal(torch.signbit(g), torch.signbit(want))


def _inputs():
    """Tensors with repeats, zeros, -0.0 and NaN, in several shapes and layouts (0-d, empty, transposed)."""
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-2, 3, (4, 6), generator=g).float()
    a[1, 2] = NAN
    a[2, 3] = -0.0
    return {
        "2d": a,
        "transposed": a.t(),
        "0d": torch.tensor(2.5),
        "0d_zero": torch.tensor(0.0),
        "empty": torch.empty(0, 3),
        "zeros": torch.zeros(3, 2),
        "ones3d": torch.ones(2, 3, 2),
        "int": torch.randint(-1, 2, (5, 3), generator=g),
        "bool": torch.randint(0, 2, (7,), generator=g).bool(),
    }


@pytest.mark.parametrize("name", list(_inputs()))
def test_nonzero_and_argwhere(name):
    """nonzero (both forms) and argwhere: int64 coordinates in row-major order, torch's column-major strides."""
    x = _inputs()[name]
    d = x.to("neuron")
    _same(torch.nonzero(d), torch.nonzero(x))
    _same(torch.argwhere(d), torch.argwhere(x))
    _same(torch.nonzero(d, as_tuple=True), torch.nonzero(x, as_tuple=True))


@pytest.mark.parametrize("shapes", [((4, 6), (4, 6)), ((4, 6), (6,)), ((6,), (4, 6)), ((4, 1, 6), (3, 6)), ((), ()),
                                    ((0, 3), (3,))])
@pytest.mark.parametrize("fill", ["random", "all_true", "all_false"])
def test_masked_select(shapes, fill):
    """masked_select with broadcasting masks, all-true and all-false masks (empty result), 0-d operands."""
    g = torch.Generator().manual_seed(5)
    xs, ms = shapes
    x = torch.randn(xs, generator=g)
    m = {"random": torch.rand(ms, generator=g) > 0.4, "all_true": torch.ones(ms, dtype=torch.bool),
         "all_false": torch.zeros(ms, dtype=torch.bool)}[fill]
    _same(torch.masked_select(x.to("neuron"), m.to("neuron")), torch.masked_select(x, m))


def test_masked_select_non_contiguous_keeps_signs_and_nan():
    """A transposed input and mask; -0.0 and NaN come through as they are."""
    x = _inputs()["2d"].t()
    m = x != 1
    _same(torch.masked_select(x.to("neuron"), m.to("neuron")), torch.masked_select(x, m))
    _same(x.to("neuron")[m.to("neuron")], x[m])


def test_masked_select_gradient():
    """The gradient flows through masked_select (torch's masked_scatter backward) and equals the CPU one."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(5, 4, generator=g)
    m = torch.rand(4, generator=g) > 0.5
    w = torch.randn(int(m.sum()) * 5, generator=g)
    grads = []
    for dev in ("cpu", "neuron"):
        xs = x.detach().to(dev).requires_grad_()
        (torch.masked_select(xs, m.to(dev)) * w.to(dev)).sum().backward()
        grads.append(xs.grad)
    _same(grads[1], grads[0])


def test_equal():
    """equal: same values, a differing element, NaN (never equal), other shapes, empty and 0-d tensors."""
    x = torch.arange(6.0).reshape(2, 3)
    d = x.to("neuron")
    assert torch.equal(d, x.clone().to("neuron")) is True
    y = x.clone()
    y[1, 2] = 7
    assert torch.equal(d, y.to("neuron")) is False
    assert torch.equal(d, d.t().contiguous().t()) is True
    assert torch.equal(d, d[:1]) is False
    n = torch.tensor([NAN, 1.0]).to("neuron")
    assert torch.equal(n, n) is torch.equal(torch.tensor([NAN, 1.0]), torch.tensor([NAN, 1.0])) is False
    assert torch.equal(torch.empty(0).to("neuron"), torch.empty(0).to("neuron")) is True
    assert torch.equal(torch.tensor(3.0).to("neuron"), torch.tensor(3.0).to("neuron")) is True
    assert torch.equal(torch.tensor(3.0).to("neuron"), torch.tensor([3.0]).to("neuron")) is False


def test_cov_and_corrcoef():
    """cov and corrcoef (which call equal) run on the device and match the CPU."""
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(torch.cov(x.to("neuron")).cpu(), torch.cov(x))
    torch.testing.assert_close(torch.corrcoef(x.to("neuron")).cpu(), torch.corrcoef(x))


@pytest.mark.parametrize("name", ["2d", "transposed", "0d", "empty", "zeros", "int", "bool"])
@pytest.mark.parametrize("inverse,counts", [(False, False), (True, False), (True, True), (False, True)])
def test_unique_flat(name, inverse, counts):
    """torch.unique without dim, sorted or not (torch always sorts), and unique_consecutive."""
    x = _inputs()[name]
    if name == "2d":
        # NaNs compare unequal (each its own value, in an order torch leaves open), and which of 0.0 / -0.0 stands
        # for their group depends on the sort (torch's CPU sort is not stable): compare on values without either
        x = torch.nan_to_num(x) + 0.0
    d = x.to("neuron")
    for s in (True, False):
        _same(torch.unique(d, sorted=s, return_inverse=inverse, return_counts=counts),
              torch.unique(x, sorted=s, return_inverse=inverse, return_counts=counts))
    _same(torch.unique_consecutive(d, return_inverse=inverse, return_counts=counts),
          torch.unique_consecutive(x, return_inverse=inverse, return_counts=counts))
    _same(torch.ops.aten._unique(d, True, inverse), torch.ops.aten._unique(x, True, inverse))


@pytest.mark.parametrize("shape,dim", [((5, 4), 0), ((5, 4), 1), ((3, 4, 2), -1), ((3, 4, 2), 1), ((5, 1, 3), 1),
                                       ((4,), 0), ((5, 0, 5), 1)])
@pytest.mark.parametrize("consecutive", [False, True])
def test_unique_dim(shape, dim, consecutive):
    """unique / unique_consecutive along a dim: slices in lexicographic order, torch's result layout."""
    x = torch.randint(0, 2, shape, generator=torch.Generator().manual_seed(4)).float()
    d = x.to("neuron")
    for inverse, counts in ((False, False), (True, True)):
        if consecutive:
            want = torch.unique_consecutive(x, dim=dim, return_inverse=inverse, return_counts=counts)
            got = torch.unique_consecutive(d, dim=dim, return_inverse=inverse, return_counts=counts)
        else:
            want = torch.unique(x, dim=dim, return_inverse=inverse, return_counts=counts)
            got = torch.unique(d, dim=dim, return_inverse=inverse, return_counts=counts)
        _same(got, want)


@pytest.mark.parametrize("accumulate", [False, True])
def test_index_put(accumulate):
    """index_put with integer indices (repeats when accumulating), boolean masks (some, all, none selected),
    a 2-d mask, broadcast values and a CPU index tensor."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, 4, generator=g)
    mask = torch.tensor([True, False, True, True, False])
    cases = [
        ([torch.tensor([1, 1, 3] if accumulate else [1, 3, 0])], torch.randn(3, 4, generator=g)),
        ([mask], torch.randn(4, generator=g)),
        ([mask], torch.randn(3, 4, generator=g)),
        ([torch.ones(5, dtype=torch.bool)], torch.randn(5, 4, generator=g)),
        ([torch.zeros(5, dtype=torch.bool)], torch.randn(4, generator=g)),
        ([torch.rand(5, 4, generator=g) > 0.5], torch.tensor(2.5)),
        ([None, torch.tensor([True, False, False, True])], torch.randn(5, 2, generator=g)),
    ]
    for idx, v in cases:
        want = torch.ops.aten.index_put.default(x, idx, v, accumulate)
        got = torch.ops.aten.index_put.default(x.to("neuron"), [None if i is None else i.to("neuron") for i in idx],
                                               v.to("neuron"), accumulate)
        _same(got, want)
    # a CPU mask (CUDA accepts CPU index tensors): moved to the device
    got = torch.index_put(x.to("neuron"), [mask], torch.ones(4).to("neuron"), accumulate=accumulate)
    _same(got, torch.index_put(x, [mask], torch.ones(4), accumulate=accumulate))


def test_boolean_indexing_and_its_gradient():
    """x[mask], x[:, mask], x[mask] = v, x[mask] += v on the device; the gradient of x[mask]."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 4, generator=g)
    m = torch.tensor([True, False, True, True, False])
    m2 = torch.rand(5, 4, generator=g) > 0.5
    d = x.to("neuron")
    _same(d[m.to("neuron")], x[m])
    _same(d[:, m2[0].to("neuron")], x[:, m2[0]])
    _same(d[m2.to("neuron")], x[m2])
    _same(d[torch.zeros(5, dtype=torch.bool).to("neuron")], x[torch.zeros(5, dtype=torch.bool)])
    y, yd = x.clone(), d.clone()
    y[m2] = 7.0
    yd[m2.to("neuron")] = 7.0
    _same(yd, y)
    y[m] += 1.0
    yd[m.to("neuron")] += 1.0
    _same(yd, y)
    grads = []
    for dev in ("cpu", "neuron"):
        xs = x.detach().to(dev).requires_grad_()
        (xs[m.to(dev)] * torch.arange(4.0).to(dev)).sum().backward()
        grads.append(xs.grad)
    _same(grads[1], grads[0])


def test_adaptive_eager_windows():
    """In adaptive eager mode the padded programs queue into windows; the count read flushes them."""
    x = _inputs()["2d"]
    with eager_mode("adaptive"):
        d = x.to("neuron") * 2
        nz = torch.nonzero(d)
        sel = torch.masked_select(d + 1, d > 0)
        u = torch.unique(torch.nan_to_num(d) + 0.0, return_counts=True)
    _same(nz, torch.nonzero(x * 2))
    _same(sel, torch.masked_select(x * 2 + 1, x * 2 > 0))
    _same(u, torch.unique(torch.nan_to_num(x * 2) + 0.0, return_counts=True))


def test_one_count_read_per_call():
    """A nonzero is one padded program plus one scalar read back (counted as .item() is)."""
    d = _inputs()["2d"].to("neuron")
    torch.nonzero(d)    # compiled
    before = dict(torch.neuron.executed_ops())
    torch.nonzero(d)
    after = torch.neuron.executed_ops()
    diff = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    assert diff.get("aten::_local_scalar_dense") == 1
    assert diff.get("tn_device::nonzero_padded") == 1


def test_host_errors_are_torchs():
    """A mask of the wrong shape and a unique over non-selected empty dims raise torch's own errors (the
    device leaves these calls to the host kernel, which words them)."""
    x = torch.randn(3, 4)
    with pytest.raises(IndexError, match="does not match"):
        x.to("neuron")[torch.ones(4, dtype=torch.bool).to("neuron")]
    with pytest.raises(RuntimeError, match="must match"):
        torch.masked_select(x.to("neuron"), torch.ones(5, dtype=torch.bool).to("neuron"))
    with pytest.raises(RuntimeError, match="0 sized dimensions"):
        torch.unique(torch.empty(5, 0, 5).to("neuron"), dim=0)


def _hist_close(got, want):
    """Histogram results: counts equal (float32 sums of small integers or weights), edges within float32
    tolerance of the CPU's (the device linspace rounds its own way)."""
    got = [got] if isinstance(got, torch.Tensor) else list(got)
    want = [want] if isinstance(want, torch.Tensor) else list(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.device.type == "neuron" and g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.cpu(), w, equal_nan=True)


@pytest.mark.parametrize("kw", [{}, {"density": True}, {"weight": True}, {"weight": True, "density": True},
                                {"range": (-1.0, 1.0)}, {"range": (2.0, 2.0)}])
def test_histogram(kw):
    """histogram with a bin count (the data's range, a given range, an empty one widened) and with edges,
    weighted and as a density; 0-d, empty and transposed inputs."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(6, 9, generator=g).t()
    kw = dict(kw)
    if kw.pop("weight", False):
        kw["weight"] = torch.rand(9, 6, generator=g)
    dev = {k: v.to("neuron") if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    _hist_close(torch.histogram(x.to("neuron"), 7, **dev), torch.histogram(x, 7, **kw))
    kw.pop("range", None)
    dev.pop("range", None)
    edges = torch.tensor([-2.0, -0.5, 0.0, 0.3, 2.0])
    _hist_close(torch.histogram(x.to("neuron"), edges.to("neuron"), **dev), torch.histogram(x, edges, **kw))
    _hist_close(torch.histogram(torch.tensor(2.0).to("neuron"), 1), torch.histogram(torch.tensor(2.0), 1))
    _hist_close(torch.histogram(torch.empty(0).to("neuron"), 3), torch.histogram(torch.empty(0), 3))


@pytest.mark.parametrize("kw", [{}, {"density": True}, {"weight": True}, {"range": [-1.0, 1.0, -2.0, 2.0, 0.0, 1.0]}])
def test_histogramdd(kw):
    """histogramdd with bin counts and with edge tensors (sorted, and unsorted: torch's binary search)."""
    g = torch.Generator().manual_seed(22)
    y = torch.randn(30, 3, generator=g)
    kw = dict(kw)
    if kw.pop("weight", False):
        kw["weight"] = torch.rand(30, generator=g)
    dev = {k: v.to("neuron") if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    r, c = torch.histogramdd(y.to("neuron"), [3, 4, 2], **dev), torch.histogramdd(y, [3, 4, 2], **kw)
    _hist_close([r.hist, *r.bin_edges], [c.hist, *c.bin_edges])
    kw.pop("range", None)
    dev.pop("range", None)
    for edges in ([torch.sort(torch.randn(4, generator=g)).values for _ in range(3)],
                  [torch.randn(5, generator=g) for _ in range(3)]):
        r = torch.histogramdd(y.to("neuron"), [e.to("neuron") for e in edges], **dev)
        c = torch.histogramdd(y, edges, **kw)
        _hist_close([r.hist, *r.bin_edges], [c.hist, *c.bin_edges])


# --------------------------------------------------------------------------- igamma / igammac (tn.ops.special)


def _igamma_grid():
    """``(a, x)`` over the OpInfo's range (the negatives give NaN), near ``x = a``, large ``a`` and tiny ones."""
    g = torch.Generator().manual_seed(12)
    a = torch.cat([torch.rand(4000, generator=g) * 18 - 9, torch.rand(2000, generator=g) * 200,
                   torch.rand(1000, generator=g) * 1e-3])
    x = torch.cat([torch.rand(4000, generator=g) * 18 - 9, torch.rand(2000, generator=g) * 200,
                   torch.rand(1000, generator=g) * 2])
    near = torch.rand(3000, generator=g) * 150 + 0.01
    a = torch.cat([a, near])
    x = torch.cat([x, near * (1 + (torch.rand(3000, generator=g) - 0.5) * 0.2)])
    return a, x


@pytest.mark.parametrize("name", ["igamma", "igammac"])
def test_igamma_on_the_device(name):
    """igamma/igammac run as device programs (no host op under TN_STRICT) within assert_close's float32
    tolerance of torch's CPU kernel, NaN where torch gives NaN."""
    f = getattr(torch, name)
    a, x = _igamma_grid()
    got = f(a.to("neuron"), x.to("neuron")).cpu()
    want = f(a, x)
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got, want, equal_nan=True)
    # close to the float64 values too (torch's own fp32 kernel is 1e-6 off at most here)
    exact = f(a.double(), x.double())
    ok = ~exact.isnan()
    assert float((got.double()[ok] - exact[ok]).abs().max()) < 1e-5


@pytest.mark.parametrize("name", ["igamma", "igammac"])
def test_igamma_boundaries_through_jit(name):
    """torch's boundary values (a or x zero, infinite, negative or NaN, in calc_igamma's order) exactly, through
    tn.jit with no host equation, and on 0-d and broadcast, non-contiguous device operands."""
    f = getattr(torch, name)
    edges = torch.tensor([0.0, 1.0, float("inf"), -1.0, float("nan"), 2.5])
    a, x = torch.meshgrid(edges, edges, indexing="ij")
    ir = tn.make_ir(f)(a, x)
    assert [e.op.name for e in ir.eqns if e.op.name == "host"] == []
    got = tn.jit(f)(a, x)
    want = f(a, x)
    assert torch.equal(got.isnan(), want.isnan())
    special = ~(a.isfinite() & x.isfinite() & (a > 0) & (x > 0))
    assert torch.equal(got[special & ~want.isnan()], want[special & ~want.isnan()])
    torch.testing.assert_close(got, want, equal_nan=True)
    t = torch.rand(4, 3, generator=torch.Generator().manual_seed(1)) * 5
    s = torch.tensor(1.5)
    torch.testing.assert_close(f(t.to("neuron").t(), s.to("neuron")).cpu(), f(t.t(), s))
    torch.testing.assert_close(f(s.to("neuron"), s.to("neuron")).cpu(), f(s, s))
