# torch.linalg's error checks (singular / not positive definite) raise eager's LinAlgError through every door.
import pytest
import torch

import tn
import tn.lower  # noqa: F401  (registers the lowerings and the neuron backend)


def _inv(a, b):
    return torch.linalg.inv(a)


def _cholesky(a, b):
    return torch.linalg.cholesky(a)


def _solve(a, b):
    return torch.linalg.solve(a, b)


def _lu_factor(a, b):
    return torch.linalg.lu_factor(a)


def _inv_unused(a, b):
    torch.linalg.inv(a)          # result unused: eager still raises, so the check must survive DCE
    return b + 1


CASES = {"inv": _inv, "cholesky": _cholesky, "solve": _solve, "lu_factor": _lu_factor, "inv_unused": _inv_unused}


def _door(door, fn):
    if door == "compile":
        torch._dynamo.reset()
        return torch.compile(fn, backend="neuron")
    return tn.jit(fn, backend=door)


def _singular():
    return torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.0, 0.0, 0.0]]), torch.ones(3)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("door", ["neuron", "reference", "compile"])
def test_singular_input_raises_eager_linalg_error(door, name):
    fn = CASES[name]
    a, b = _singular()
    with pytest.raises(RuntimeError) as want:      # LinAlgError; a plain RuntimeError for lu_factor
        fn(a, b)
    with pytest.raises(RuntimeError) as got:
        _door(door, fn)(a, b)
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)


@pytest.mark.parametrize("name", sorted(CASES))
def test_well_conditioned_input_still_matches_eager(name):
    fn = CASES[name]
    a = torch.tensor([[4.0, 1.0, 0.5], [1.0, 3.0, 0.2], [0.5, 0.2, 2.0]])
    b = torch.tensor([1.0, -2.0, 0.5])
    want = fn(a, b)
    got = tn.jit(fn)(a, b)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g, w)


def test_the_check_is_an_effectful_equation_naming_the_users_line():
    ir = tn.make_ir(_inv_unused)(*_singular())
    checks = [e for e in ir.eqns if e.op.name == "linalg_check"]
    assert len(checks) == 1 and checks[0].outputs == []
    assert checks[0].attrs["api_name"] == "linalg.inv"
    assert checks[0].attrs["where"].startswith("test_linalg_errors.py:")
    with pytest.raises(torch.linalg.LinAlgError) as got:
        tn.jit(_inv_unused)(*_singular())
    assert any("test_linalg_errors.py:" in n for n in getattr(got.value, "__notes__", []))


def test_batched_check_names_the_batch():
    a = torch.stack([torch.eye(3), torch.zeros(3, 3)])
    with pytest.raises(torch.linalg.LinAlgError) as want:
        torch.linalg.inv(a)
    with pytest.raises(torch.linalg.LinAlgError) as got:
        tn.jit(torch.linalg.inv)(a)
    assert str(got.value) == str(want.value) and "Batch element 1" in str(got.value)
