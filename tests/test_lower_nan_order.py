# NaN and infinity ordering of the NeuronCore argmax/argmin, max/min with indices, sort and topk vs torch on CPU.
"""torch's rules, checked through ``tn.jit`` on the neuron backend (strict: no host fallback):
argmax/argmin/max/min pick the first NaN of a line (NaN propagates); an ascending sort puts the NaNs
last and a descending one first, in index order (stable); topk treats NaN as larger than every
number. fp32 and bf16, lines shorter and longer than 128 partitions, multi-chunk lines, and
reductions over leading axes (several lines per partition)."""
import pytest
import torch

import tn

NAN, INF = float("nan"), float("inf")


def _run(fn, *args):
    """``fn(*args)`` compiled for the NeuronCore in strict mode (a host fallback raises)."""
    from tn.lower import compiler

    ir = tn.jit(fn, backend="neuron").lower(*args)
    got = compiler.compile_ir(ir, strict=True)(list(args))
    return got[0] if len(got) == 1 else tuple(got)


def _same(got, want):
    """Equal dtypes and shapes, NaN where the other has NaN, equal elsewhere (bit-exact values)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    if want.is_floating_point():
        assert torch.equal(got.isnan(), want.isnan()), (got, want)
        ok = got.isnan() | (got == want)
        assert bool(ok.all()), (got[~ok], want[~ok])
    else:
        assert torch.equal(got, want), (got, want)


def _lines(rows: int, n: int, dtype, seed: int = 0) -> torch.Tensor:
    """``[rows, n]`` random lines with NaN and +-inf sprinkled in, plus special lines: all NaN, all -inf,
    +inf before the first NaN, NaN at the end, no NaN with ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    r = torch.rand(rows, n, generator=g)
    x[r < 0.05] = NAN
    x[(r >= 0.05) & (r < 0.08)] = INF
    x[(r >= 0.08) & (r < 0.11)] = -INF
    special = [torch.full((n,), NAN), torch.full((n,), -INF)]
    a = torch.randn(n, generator=g)
    a[: n // 3] = INF
    a[n // 2:] = NAN
    special.append(a)
    b = torch.randn(n, generator=g)
    b[-1] = NAN
    special.append(b)
    c = torch.randint(0, 3, (n,), generator=g).float()   # ties, no NaN
    special.append(c)
    for i, s in enumerate(special[:rows]):
        x[i] = s
    return x.to(dtype)


DTYPES = [torch.float32, torch.bfloat16]
ARG_SHAPES = [(6, 1), (6, 5), (7, 128), (5, 129), (6, 300), (5, 1000), (3, 9000)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n", ARG_SHAPES)
def test_argmax_argmin_first_nan(rows, n, dtype):
    x = _lines(rows, n, dtype)
    for f in (lambda x: torch.argmax(x, 1), lambda x: torch.argmin(x, 1),
              lambda x: torch.argmax(x, -1, keepdim=True)):
        _same(_run(f, x), f(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n", [(6, 5), (130, 7), (300, 40), (3000, 30)])
def test_argmax_argmin_over_leading_axis(rows, n, dtype):
    """Reductions over dim 0: lines along the free axis of a partition (several lines per partition)."""
    x = _lines(n, rows, dtype, seed=1).T.contiguous()
    for f in (lambda x: torch.argmax(x, 0), lambda x: torch.argmin(x, 0)):
        _same(_run(f, x), f(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7,), (129,), (1000,), (3, 300), (130, 129)])
def test_flat_argmax_argmin(shape, dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(*shape, generator=g)
    flat = x.view(-1)
    flat[flat.numel() // 2] = INF
    for where in (None, flat.numel() - 1, flat.numel() // 3):
        y = x.clone()
        if where is not None:
            y.view(-1)[where] = NAN
            y.view(-1)[-1] = NAN
        y = y.to(dtype)
        for f in (torch.argmax, torch.argmin):
            _same(_run(f, y), f(y))


def test_argmax_middle_axis():
    x = _lines(24, 50, torch.float32, seed=3).reshape(4, 6, 50).permute(0, 2, 1).contiguous()   # [4, 50, 6]
    for f in (lambda x: torch.argmax(x, 1), lambda x: torch.argmin(x, 1)):
        _same(_run(f, x), f(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n,dim", [(6, 5, 1), (5, 129, 1), (4, 9000, 1), (300, 40, 0), (130, 6, 0)])
def test_max_min_with_indices(rows, n, dim, dtype):
    x = _lines(rows, n, dtype, seed=4) if dim == 1 else _lines(n, rows, dtype, seed=4).T.contiguous()
    for f in (lambda x: torch.max(x, dim), lambda x: torch.min(x, dim), lambda x: torch.amax(x, dim),
              lambda x: torch.amin(x, dim)):
        got, want = _run(f, x), f(x)
        got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
        for g, w in zip(got, want):
            _same(g, w)


SORT_SHAPES = [(6, 1), (6, 7), (6, 128), (5, 129), (5, 300)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n", SORT_SHAPES)
@pytest.mark.parametrize("descending", [False, True])
def test_sort_nan_and_inf(rows, n, descending, dtype):
    x = _lines(rows, n, dtype, seed=5)

    def f(x):
        return torch.sort(x, dim=1, descending=descending, stable=True)
    got, want = _run(f, x), f(x)
    _same(got[0], want[0])
    _same(got[1], want[1])


def test_sort_leading_axis_and_several_nans():
    x = torch.tensor([[NAN, 1., -INF, NAN, INF, 0., NAN, -0., 1., INF]]).repeat(3, 1)
    x[1] = x[1].flip(0)
    x = x.T.contiguous()                    # sort along dim 0
    for desc in (False, True):
        def f(x):
            return torch.sort(x, dim=0, descending=desc, stable=True)
        got, want = _run(f, x), f(x)
        _same(got[0], want[0])
        _same(got[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n", [(6, 7), (5, 129), (5, 300)])
@pytest.mark.parametrize("largest", [True, False])
def test_topk_nan(rows, n, largest, dtype):
    x = _lines(rows, n, dtype, seed=6)
    for k in sorted({1, 3, n // 2, n}):
        k = min(k, n)

        def f(x):
            return torch.topk(x, k, 1, largest=largest)
        got, want = _run(f, x), f(x)
        _same(got[0], want[0])
        # indices of equal values may differ from torch's (unspecified order): they must pick the values
        _same(x.gather(1, got[1]), got[0])


def test_masked_argmax_argmin():
    """torch.masked.argmax/argmin (built on masked_fill) with NaN inputs and an all-NaN line."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 9, generator=g)
    x[1, 4] = NAN
    x[3, :] = NAN
    mask = torch.rand(5, 9, generator=g) > 0.3
    for f in (lambda x, m: torch.masked.argmax(x, 1, mask=m), lambda x, m: torch.masked.argmin(x, 0, mask=m)):
        _same(_run(f, x, mask), f(x, mask))


def test_nan_free_results_unchanged():
    """Plain random lines (no NaN): the same answers as torch, ties to the first index."""
    g = torch.Generator().manual_seed(8)
    x = torch.randint(-3, 4, (9, 257), generator=g).float()
    for f in (lambda x: torch.argmax(x, 1), lambda x: torch.argmin(x, 0), lambda x: torch.max(x, 1),
              lambda x: torch.sort(x, dim=1, stable=True),
              lambda x: torch.sort(x, dim=1, descending=True, stable=True)):
        got, want = _run(f, x), f(x)
        got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
        for a, b in zip(got, want):
            _same(a, b)
