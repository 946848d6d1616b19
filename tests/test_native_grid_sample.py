# grid_sampler_2d / grid_sampler_3d as NeuronCore programs (tn's decompositions in tn.ops.nn_layers) vs torch on CPU.
import itertools

import pytest
import torch

import tn
from tn.lower import compiler
from tn.ops import nn_layers

F = torch.nn.functional
MODES_2D = ("bilinear", "nearest", "bicubic")
MODES_3D = ("bilinear", "nearest")
PADDINGS = ("zeros", "border", "reflection")


def _grid(shape, k, seed):
    """A sampling grid reaching well outside [-1, 1] (several reflections), with exact corners, the centre
    and half-pixel points among its values."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.randn(*shape, k, generator=g) * 2.5
    special = torch.tensor([-1.0, 1.0, 0.0, 0.5, -0.5, 3.0, -5.0, 1.25])
    flat = grid.view(-1)
    flat[: special.numel()] = special
    return grid


def _inputs(k, seed=0):
    """(x, grid) for a k-d sample: batch 2, 3 channels, spatial sizes that differ per axis."""
    g = torch.Generator().manual_seed(seed + 100)
    if k == 2:
        return torch.randn(2, 3, 5, 7, generator=g), _grid((2, 4, 6), 2, seed)
    return torch.randn(2, 3, 4, 5, 6, generator=g), _grid((2, 3, 4, 5), 3, seed)


def _sample(mode, padding, align_corners):
    def f(x, grid):
        return F.grid_sample(x, grid, mode=mode, padding_mode=padding, align_corners=align_corners)
    return f


def _strict(fn, *args, backend):
    """``fn(*args)`` through tn.jit; on the neuron backend the IR holds no host op and no int8, and it is
    compiled strictly (a host op left would raise)."""
    jf = tn.jit(fn, backend=backend)
    if backend != "neuron":
        return jf(*args)
    ir = str(jf.lower(*args))
    assert "host" not in ir and "int8" not in ir
    return compiler.compile_ir(jf.lower(*args), strict=True)(list(args))[0]


CASES = ([(2, m, p, a) for m, p, a in itertools.product(MODES_2D, PADDINGS, (False, True))]
         + [(3, m, p, a) for m, p, a in itertools.product(MODES_3D, PADDINGS, (False, True))])


@pytest.mark.parametrize("k,mode,padding,align_corners", CASES)
def test_grid_sample_matches_torch(k, mode, padding, align_corners, backend):
    """Every interpolation mode, padding mode and align_corners, batch 2, against eager torch at
    assert_close's float32 tolerances."""
    x, grid = _inputs(k)
    f = _sample(mode, padding, align_corners)
    torch.testing.assert_close(_strict(f, x, grid, backend=backend), f(x, grid))


@pytest.mark.parametrize("k,mode,padding,align_corners",
                         [c for c in CASES if c[0] == 3 or c[1] == "nearest"])
def test_decomposition_is_bit_exact(k, mode, padding, align_corners):
    """Evaluated by torch itself, the decomposition gives the CPU kernel's bits for 3-d (trilinear and
    nearest) and for 2-d nearest: the same unnormalisation, reflection, rounding and summation order."""
    x, grid = _inputs(k, seed=3)
    im = MODES_2D.index(mode)
    pm = PADDINGS.index(padding)
    ours = (nn_layers._grid_sampler_2d if k == 2 else nn_layers._grid_sampler_3d)(x, grid, im, pm, align_corners)
    op = torch.ops.aten.grid_sampler_2d if k == 2 else torch.ops.aten.grid_sampler_3d
    assert torch.equal(ours, op(x, grid, im, pm, align_corners))


def test_reflection_parity_in_float():
    """Reflection of coordinates up to thousands of spans away, both bound pairs: equal to a float64
    reference that takes the parity with integers."""
    c = torch.cat([torch.linspace(-3000, 3000, 20001), torch.tensor([-1.0, -0.5, 0.0, 6.5, 13.0, 13.5])])
    for lo2, hi2 in ((0, 12), (-1, 13), (0, 0)):
        got = nn_layers._gs_reflect(c, lo2, hi2)
        if lo2 == hi2:
            assert torch.equal(got, torch.zeros_like(c))
            continue
        lo, span = lo2 / 2, (hi2 - lo2) / 2
        a = (c.double() - lo).abs()
        flips = torch.floor(a / span).long()
        extra = torch.fmod(a, span)
        want = torch.where(flips % 2 == 0, extra + lo, span - extra + lo)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-3)
        assert bool(((got >= lo) & (got <= lo + span)).all())


def test_batch_one_and_single_point(backend):
    """Batch 1, one channel, one output point (the smallest OpInfo samples), 2-d and 3-d."""
    for k in (2, 3):
        x = torch.randn(1, 1, *([2] * k))
        grid = torch.tensor([0.3, -0.7, 0.1][:k]).view(1, *([1] * k), k)
        for mode, padding in (("bilinear", "zeros"), ("nearest", "reflection")):
            f = _sample(mode, padding, False)
            torch.testing.assert_close(_strict(f, x, grid, backend=backend), f(x, grid))


def test_bfloat16_is_computed_in_fp32():
    """bf16 input: computed in fp32 on the bf16 values and rounded once."""
    x, grid = _inputs(2, seed=5)
    xb, gb = x.bfloat16(), grid.bfloat16()
    f = _sample("bilinear", "reflection", False)
    got = tn.jit(f, backend="reference")(xb, gb)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, f(xb.float(), gb.float()).bfloat16(), rtol=0, atol=0)


def test_on_the_device_strict(monkeypatch):
    """The device door runs 2-d (reflection) and 3-d sampling as NeuronCore programs: under TN_STRICT a
    host fallback would raise, and none is counted."""
    monkeypatch.setenv("TN_STRICT", "1")
    before = dict(torch.neuron.fallback_ops())
    for k, mode in ((2, "bilinear"), (2, "bicubic"), (3, "bilinear"), (3, "nearest")):
        x, grid = _inputs(k, seed=7)
        f = _sample(mode, "reflection", k == 3)
        got = f(x.to("neuron"), grid.to("neuron"))
        assert got.device.type == "neuron"
        torch.testing.assert_close(got.cpu(), f(x, grid))
    assert torch.neuron.fallback_ops() == before


@pytest.mark.parametrize("k,mode,padding,align_corners", CASES)
def test_gradients_match_torch(k, mode, padding, align_corners, backend):
    """Gradients with respect to the input and the grid (grid_sampler_{2,3}d_backward) through tn.jit, no
    host op in the IR, against eager torch's backward kernels: within assert_close's float32 tolerances of
    the float64 gradient, widened by twice eager float32's own error there (the grid gradient of a point
    next to a pixel edge is ill-conditioned: torch's kernel is 1.4e-5 off at 1.36 in one case)."""
    x, grid = _inputs(k, seed=11)
    x.requires_grad_()
    grid.requires_grad_()
    f = _sample(mode, padding, align_corners)

    def grads(x, grid):
        out = f(x, grid)
        w = torch.linspace(-1.0, 2.0, out.numel(), dtype=out.dtype).reshape(out.shape)
        return torch.autograd.grad((out * w).sum(), [x, grid])

    eager = grads(x, grid)
    exact = grads(x.detach().double().requires_grad_(), grid.detach().double().requires_grad_())
    if backend == "neuron":
        ir = tn.make_ir(grads)(x, grid)
        assert [e.op.name for e in ir.eqns if e.op.name == "host"] == []
    got = tn.jit(grads, backend=backend)(x, grid)
    for g, e, r in zip(got, eager, exact):
        _close_to_exact(g, e, r)


def _close_to_exact(got, eager, exact):
    """``got`` (float32) within assert_close's float32 tolerances of the float64 ``exact``, widened by twice
    eager float32's own error ``|eager - exact|`` there."""
    assert got.shape == exact.shape and got.dtype == torch.float32
    allowed = 1e-5 + 1.3e-6 * exact.abs() + 2 * (eager.double() - exact).abs()
    assert bool(((got.double() - exact).abs() <= allowed).all()), (got.double() - exact).abs().max()


def test_gradients_on_the_device_strict(monkeypatch):
    """Backward on the device door (2-d bicubic border, 3-d trilinear reflection) runs natively under
    TN_STRICT and no host fallback is counted."""
    monkeypatch.setenv("TN_STRICT", "1")
    before = dict(torch.neuron.fallback_ops())
    for k, mode, padding in ((2, "bicubic", "border"), (3, "bilinear", "reflection")):
        x, grid = _inputs(k, seed=17)
        f = _sample(mode, padding, False)
        res = []
        for dev, dt in (("neuron", torch.float32), ("cpu", torch.float32), ("cpu", torch.float64)):
            xs = x.detach().to(dev, dt).requires_grad_()
            gs = grid.detach().to(dev, dt).requires_grad_()
            out = f(xs, gs)
            (out * torch.linspace(-1.0, 2.0, out.numel(), dtype=dt).to(dev).reshape(out.shape)).sum().backward()
            res.append((xs.grad.cpu(), gs.grad.cpu()))
        for got, eager, exact in zip(*res):
            _close_to_exact(got, eager, exact)
    assert torch.neuron.fallback_ops() == before


def test_backward_decomposition_matches_kernels():
    """Evaluated by torch, the backward decompositions give the CPU backward kernels' gradients, also with
    only one of the two asked for (the other is None)."""
    for k in (2, 3):
        x, grid = _inputs(k, seed=13)
        fwd = torch.ops.aten.grid_sampler_2d if k == 2 else torch.ops.aten.grid_sampler_3d
        bwd = torch.ops.aten.grid_sampler_2d_backward if k == 2 else torch.ops.aten.grid_sampler_3d_backward
        ours = nn_layers._grid_sampler_2d_backward if k == 2 else nn_layers._grid_sampler_3d_backward
        go = torch.randn_like(fwd(x, grid, 0, 2, False))
        want = bwd(go, x, grid, 0, 2, False, [True, True])
        gx, gg = ours(go, x, grid, 0, 2, False, [True, False])
        assert gg is None
        torch.testing.assert_close(gx, want[0])
        gx, gg = ours(go, x, grid, 0, 2, False, [False, True])
        assert gx is None
        torch.testing.assert_close(gg, want[1])


def _opinfo_sample(name, k):
    """The ``k``-th float32 sample of ``name`` in torch's op database (its shapes and values, as
    bench/coverage.py runs them)."""
    from torch.testing._internal.common_methods_invocations import op_db
    info = next(o for o in op_db if o.name == name)
    return next(s for j, s in enumerate(info.sample_inputs("cpu", torch.float32)) if j == k)


@pytest.mark.parametrize("k", [12, 13, 14, 15, 16, 17])
def test_bicubic_grid_gradient_at_eagers_error_level(k):
    """The bicubic OpInfo samples (zeros, border, reflection; both align_corners) whose grid gradient
    bench/coverage.py counted as wrong: through tn.jit on the neuron backend it is within the bench's
    gradient tolerance (rtol 1e-4, atol 1e-5) of eager's, and its worst error against float64 is at most
    1.5x eager float32's own worst (the unnormalised position rounded as torch's kernel rounds it, the
    coefficients in its forms, the sum in its order; a flat region's gradient cancels to rounding noise, and
    eager's AVX2/AVX-512 kernel fuses each multiply-subtract of that sum, which no engine op does)."""
    s = _opinfo_sample("grid_sampler_2d", k)
    x, grid, (mode, padding, align) = s.input, s.args[0], s.args[1:]
    assert mode == 2
    w = torch.rand(tuple(torch.grid_sampler_2d(x, grid, mode, padding, align).shape),
                   generator=torch.Generator().manual_seed(1241)) + 0.5
    bwd = torch.ops.aten.grid_sampler_2d_backward
    eager = bwd(w, x, grid, mode, padding, align, [True, True])
    exact = bwd(w.double(), x.double(), grid.double(), mode, padding, align, [True, True])
    got = tn.jit(lambda w, x, g: bwd(w, x, g, mode, padding, align, [True, True]), backend="neuron")(w, x, grid)
    for g, e, r in zip(got, eager, exact):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
        err, eager_err = (g.double() - r).abs().max(), (e.double() - r).abs().max()
        assert err <= 1.5 * eager_err + 1e-7, (err, eager_err)


def _instructions(fn, *args):
    """Instructions of ``fn``'s strict neuron program (its result checked against torch on the way)."""
    exe = compiler.compile_ir(tn.jit(fn, backend="neuron").lower(*args), strict=True)
    torch.testing.assert_close(exe(list(args))[0], fn(*args))
    return exe.stats["instructions"]


def test_element_gather_partitions_over_its_longest_axis():
    """An element gather of grid [2, 3, 1320] puts 128 points of the long axis on the partitions, not the 6
    of the two short ones: one dma_gather per 128 elements (209 instructions; 1359 before)."""
    g = torch.Generator().manual_seed(0)
    x, idx = torch.randn(2, 3, 50, generator=g), torch.randint(0, 50, (2, 3, 1320), generator=g)
    assert _instructions(lambda x, i: torch.gather(x, 2, i), x, idx) <= 260


def test_scatter_add_partitions_over_its_longest_axis():
    """scatter_add of a [2, 3, 1320] source (grid_sample's input gradient) scatters 128 points of the long
    axis per instruction, not the 6 of the short ones (1320 -> 11 columns of dma_scatter per row)."""
    g = torch.Generator().manual_seed(2)
    x, src = torch.zeros(2, 3, 50), torch.randn(2, 3, 1320, generator=g)
    idx = torch.randint(0, 50, (2, 3, 1320), generator=g)
    assert _instructions(lambda x, i, s: torch.scatter_add(x, 2, i, s), x, idx, src) <= 260


@pytest.mark.parametrize("xs,gs,bound", [((2, 3, 5, 20, 20), (2, 12, 11, 10, 3), 5000),
                                         ((2, 16, 4, 5, 6), (2, 8, 8, 8, 3), 2400)])
def test_grid_sample_3d_program_size(xs, gs, bound):
    """3-d sampling gathers one row of C channels per point (channels-last input), over partitions of 128
    points: the OpInfo shape [2, 3, 5, 20, 20] compiles to 4554 instructions (13186 before, ~46 s to build
    on a busy machine; its 20x21-channel samples timed out), 16 channels to 1993 (5421 before)."""
    g = torch.Generator().manual_seed(1)
    x, grid = torch.randn(*xs, generator=g), torch.rand(*gs, generator=g) * 2.2 - 1.1
    f = _sample("bilinear", "zeros", False)
    assert _instructions(f, x, grid) <= bound


def test_grid_sample_3d_backward_program_size():
    """The 3-d backward on the OpInfo shape: the input gradient's scatter_add over partitions of 128 points
    (6073 instructions; 15331 before, minutes to build), gradients as torch's."""
    g = torch.Generator().manual_seed(3)
    x, grid = torch.randn(2, 3, 5, 20, 20, generator=g), torch.rand(2, 12, 11, 10, 3, generator=g) * 2.2 - 1.1
    go = torch.randn(2, 3, 12, 11, 10, generator=g)
    bwd = torch.ops.aten.grid_sampler_3d_backward
    exe = compiler.compile_ir(tn.jit(lambda go, x, g: bwd(go, x, g, 0, 0, False, [True, True]),
                                     backend="neuron").lower(go, x, grid), strict=True)
    for got, want in zip(exe([go, x, grid]), bwd(go, x, grid, 0, 0, False, [True, True])):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert exe.stats["instructions"] <= 7000
