# Cholesky, triangular solves, LU- and QR-based linear algebra run as core ops (tn/ops/linalg.py), not host ops.
import pytest
import torch

import tn
import tn.lower  # noqa: F401  (registers the lowerings and the neuron backend)

#: matrix size n first, then batch dims; the 5x5 and batched sizes (~3 s each with the compile) run with -m slow
SHAPES = [(3, 2), (1,), (0, 3), (2, 0), pytest.param((5,), marks=pytest.mark.slow),
          pytest.param((2, 3, 4), marks=pytest.mark.slow)]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _matrix(n, batch, seed=0):
    """A well-conditioned general matrix."""
    a = torch.randn(*batch, n, n, generator=_gen(seed))
    return a + n * torch.eye(n) * torch.sign(torch.randn(*batch, 1, 1, generator=_gen(seed + 1)))


def _pd(n, batch, seed=0):
    a = torch.randn(*batch, n, n, generator=_gen(seed))
    return a @ a.mT + n * torch.eye(n)


def _rhs(n, batch, k=2, seed=3):
    return torch.randn(*batch, n, k, generator=_gen(seed))


def _lu(a):
    return torch.linalg.lu_factor(a)


# name -> (function, inputs(n, batch))
CASES = {
    "cholesky_ex": (lambda a: torch.linalg.cholesky_ex(a), lambda n, b: (_pd(n, b),)),
    "cholesky_upper": (lambda a: torch.linalg.cholesky(a, upper=True), lambda n, b: (_pd(n, b),)),
    "cholesky_old": (lambda a: torch.cholesky(a), lambda n, b: (_pd(n, b),)),
    "cholesky_solve": (lambda b, l: torch.cholesky_solve(b, l),
                       lambda n, b: (_rhs(n, b), torch.linalg.cholesky(_pd(n, b)))),
    "cholesky_solve_upper": (lambda b, u: torch.cholesky_solve(b, u, upper=True),
                             lambda n, b: (_rhs(n, b), torch.linalg.cholesky(_pd(n, b), upper=True))),
    "cholesky_inverse": (lambda l: torch.cholesky_inverse(l), lambda n, b: (torch.linalg.cholesky(_pd(n, b)),)),
    "solve_triangular_lower": (lambda a, b: torch.linalg.solve_triangular(a, b, upper=False),
                               lambda n, b: (_matrix(n, b), _rhs(n, b))),
    "solve_triangular_upper_right_unit": (
        lambda a, b: torch.linalg.solve_triangular(a, b, upper=True, left=False, unitriangular=True),
        lambda n, b: (_matrix(n, b), _rhs(n, b).mT)),
    "triangular_solve_transpose": (lambda b, a: torch.triangular_solve(b, a, upper=False, transpose=True),
                                   lambda n, b: (_rhs(n, b), _matrix(n, b))),
    "lu_factor_ex": (lambda a: torch.linalg.lu_factor_ex(a), lambda n, b: (torch.randn(*b, n, n, generator=_gen(4)),)),
    "lu_factor_wide": (lambda a: torch.linalg.lu_factor_ex(a), lambda n, b: (torch.randn(*b, n, n + 2, generator=_gen(5)),)),
    "lu_tall": (lambda a: torch.linalg.lu(a), lambda n, b: (torch.randn(*b, n + 2, n, generator=_gen(6)),)),
    "lu_unpack": (lambda lu, p: torch.lu_unpack(lu, p), lambda n, b: _lu(_matrix(n, b))),
    "lu_solve": (lambda lu, p, b: torch.linalg.lu_solve(lu, p, b), lambda n, b: (*_lu(_matrix(n, b)), _rhs(n, b))),
    "lu_solve_adjoint_right": (lambda lu, p, b: torch.linalg.lu_solve(lu, p, b, left=False, adjoint=True),
                               lambda n, b: (*_lu(_matrix(n, b)), _rhs(n, b).mT)),
    "solve": (lambda a, b: torch.linalg.solve(a, b), lambda n, b: (_matrix(n, b), _rhs(n, b))),
    "solve_vector_broadcast": (lambda a, b: torch.linalg.solve(a, b),
                               lambda n, b: (_matrix(n, b), torch.randn(n, generator=_gen(7)))),
    "solve_right": (lambda a, b: torch.linalg.solve(a, b, left=False), lambda n, b: (_matrix(n, b), _rhs(n, b).mT)),
    "inv": (lambda a: torch.linalg.inv(a), lambda n, b: (_matrix(n, b),)),
    "inv_ex": (lambda a: torch.linalg.inv_ex(a), lambda n, b: (_matrix(n, b),)),
    "det": (lambda a: torch.linalg.det(a), lambda n, b: (torch.randn(*b, n, n, generator=_gen(8)),)),
    "det_transposed": (lambda a: torch.linalg.det(a.mT), lambda n, b: (torch.randn(*b, n, n, generator=_gen(8)),)),
    "slogdet": (lambda a: torch.linalg.slogdet(a), lambda n, b: (torch.randn(*b, n, n, generator=_gen(9)),)),
    "logdet": (lambda a: torch.logdet(a), lambda n, b: (_pd(n, b),)),
    "geqrf_tall": (lambda a: torch.geqrf(a), lambda n, b: (torch.randn(*b, n + 2, n, generator=_gen(10)),)),
    "geqrf_wide": (lambda a: torch.geqrf(a), lambda n, b: (torch.randn(*b, n, n + 2, generator=_gen(11)),)),
    "qr_reduced": (lambda a: torch.linalg.qr(a), lambda n, b: (torch.randn(*b, n + 1, n, generator=_gen(12)),)),
    "qr_complete": (lambda a: torch.linalg.qr(a, mode="complete"),
                    lambda n, b: (torch.randn(*b, n + 1, n, generator=_gen(13)),)),
    "qr_r": (lambda a: torch.linalg.qr(a, mode="r"), lambda n, b: (torch.randn(*b, n, n + 1, generator=_gen(14)),)),
    "householder_product": (lambda a, t: torch.linalg.householder_product(a, t),
                            lambda n, b: torch.geqrf(torch.randn(*b, n + 1, n, generator=_gen(15)))),
    "ormqr_left": (lambda a, t, c: torch.ormqr(a, t, c),
                   lambda n, b: (*torch.geqrf(torch.randn(*b, n, n, generator=_gen(16))), _rhs(n, b))),
    "ormqr_right_transpose": (lambda a, t, c: torch.ormqr(a, t, c, left=False, transpose=True),
                              lambda n, b: (*torch.geqrf(torch.randn(*b, n, n, generator=_gen(17))), _rhs(n, b).mT)),
}

# forms whose result is fixed by the check in torch.linalg's non-_ex functions (raises through linalg_check)
CHECKED = {"inv", "solve", "solve_right", "solve_vector_broadcast", "cholesky_upper"}


def _leaves(x):
    return list(x) if isinstance(x, (tuple, list)) else [x]


def _assert_matches(got, want):
    got, want = _leaves(got), _leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        g = g.cpu()
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("shape", SHAPES, ids=["3x2", "1", "0x3", "2x0", "5", "2x3x4"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_neuron_door_matches_torch_with_no_host_op(name, shape):
    fn, make = CASES[name]
    n, batch = shape[0], tuple(shape[1:])
    args = make(n, batch)
    want = fn(*args)
    ir = tn.make_ir(fn)(*args)
    assert [e.op.name for e in ir.eqns if e.op.category == "host" and e.op.name != "linalg_check"] == []
    assert ("linalg_check" in {e.op.name for e in ir.eqns}) == (name in CHECKED)
    _assert_matches(tn.jit(fn)(*args), want)


@pytest.mark.parametrize("name", ["cholesky_ex", "solve_triangular_lower", "lu_factor_ex", "lu_solve", "solve",
                                  "inv", "det", "slogdet", "cholesky_inverse"])
def test_device_door_matches_torch_natively(name):
    from tn.device import tracking
    fn, make = CASES[name]
    args = make(4, (3,))
    want = fn(*args)
    tracking.reset_op_counts()
    got = fn(*[a.to("neuron") for a in args])
    _assert_matches(got, want)
    assert tracking.fallback_ops() == {}


@pytest.mark.parametrize("fn, shape", [(torch.linalg.inv_ex, (2, 0, 0)), (torch.linalg.cholesky_ex, (0, 3, 3)),
                                       (torch.linalg.det, (3, 0, 0)), (torch.linalg.qr, (2, 0, 3)),
                                       (torch.linalg.lu_factor_ex, (2, 3, 0))])
def test_device_door_empty_matrices(fn, shape):
    from tn.device import tracking
    a = torch.randn(shape)
    tracking.reset_op_counts()
    _assert_matches(fn(a.to("neuron")), fn(a))
    assert tracking.fallback_ops() == {}


def test_lu_pivots_follow_lapack_including_ties_and_zero_pivots():
    a = torch.tensor([[[1.0, 2.0, 3.0], [-1.0, 0.0, 1.0], [1.0, 5.0, 2.0]],        # ties: the first max wins
                      [[0.0, 0.0, 1.0], [0.0, 0.0, 2.0], [1.0, 1.0, 1.0]],         # second pivot is zero
                      [[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.0, 0.0, 0.0]]])        # singular
    want = torch.linalg.lu_factor_ex(a)
    got = tn.jit(torch.linalg.lu_factor_ex)(a)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    torch.testing.assert_close(got[0], want[0])
    assert want[2].tolist() == [0, 2, 2]


def test_cholesky_info_is_the_first_non_positive_leading_minor():
    a = torch.stack([torch.eye(3), torch.diag(torch.tensor([1.0, 1.0, -1.0])),
                     torch.tensor([[1.0, 2.0, 0.0], [2.0, 1.0, 0.0], [0.0, 0.0, 1.0]])])
    want = torch.linalg.cholesky_ex(a)[1]
    got = tn.jit(torch.linalg.cholesky_ex)(a)[1]
    assert torch.equal(got, want) and want.tolist() == [0, 3, 2]


@pytest.mark.parametrize("door", ["neuron", "device"])
def test_singular_and_indefinite_inputs_raise_eagers_error(door):
    cases = [(torch.linalg.inv, torch.tensor([[1.0, 2.0], [2.0, 4.0]])),
             (torch.linalg.cholesky, torch.tensor([[1.0, 2.0], [2.0, 1.0]]))]
    for fn, a in cases:
        with pytest.raises(torch.linalg.LinAlgError) as want:
            fn(a)
        with pytest.raises(torch.linalg.LinAlgError) as got:
            if door == "device":
                fn(a.to("neuron")).cpu()
            else:
                tn.jit(fn)(a)
        assert str(got.value) == str(want.value)


def test_det_of_singular_and_empty_matrices():
    a = torch.stack([torch.tensor([[1.0, 2.0], [2.0, 4.0]]), torch.tensor([[0.0, 1.0], [1.0, 0.0]])])
    _assert_matches(tn.jit(torch.linalg.slogdet)(a), torch.linalg.slogdet(a))
    _assert_matches(tn.jit(torch.linalg.det)(a), torch.linalg.det(a))
    e = torch.zeros(2, 0, 0)
    _assert_matches(tn.jit(torch.linalg.det)(e), torch.linalg.det(e))


def test_float64_and_check_errors_stay_host_ops():
    a = _matrix(3, (2,)).double()
    ir = tn.make_ir(torch.linalg.inv)(a)
    assert "host" in {e.op.name for e in ir.eqns}
    ir = tn.make_ir(lambda x: torch.linalg.inv_ex(x, check_errors=True))(a.float())
    assert "host" in {e.op.name for e in ir.eqns}
    _assert_matches(tn.jit(torch.linalg.inv)(a), torch.linalg.inv(a))


@pytest.mark.parametrize("name", ["det", "slogdet", "solve", "inv", "cholesky_ex", "lu_factor_ex",
                                  "solve_triangular_lower"])
def test_gradients_match_torch(name):
    fn, make = CASES[name]
    args = [a.requires_grad_() if a.is_floating_point() else a for a in make(4, (2,))]

    def grads(*xs):
        out = [o for o in _leaves(fn(*xs)) if o.is_floating_point()]
        loss = sum((o * torch.linspace(0.5, 1.5, o.numel()).reshape(o.shape)).sum() for o in out)
        return torch.autograd.grad(loss, [x for x in xs if x.requires_grad])

    want = grads(*args)
    ir = tn.make_ir(grads)(*args)
    assert [e.op.name for e in ir.eqns if e.op.name == "host"] == []
    _assert_matches(tn.jit(grads)(*args), want)


@pytest.mark.parametrize("shape", [(2, 4, 3), (0, 0), (2, 0, 0)])
def test_qr_gradient_including_empty_matrices(shape):
    """The QR backward takes the diagonal of an empty column-major matrix: the tracer's strided view of an empty
    tensor must not ask for a dense memory order."""
    a = torch.randn(shape, generator=_gen(20)).requires_grad_()

    def grads(x):
        q, r = torch.linalg.qr(x)
        return torch.autograd.grad((q * 0.5).sum() + (r * 1.5).sum(), x)[0]

    _assert_matches(tn.jit(grads)(a), grads(a))
