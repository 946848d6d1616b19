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


def test_error_check_is_a_status_read_after_the_program_not_a_host_op(monkeypatch):
    """The check reads LAPACK's ``info`` back after the run (tn.lower.status_checks): no host op, strict
    compiles, one program; a singular input still raises eager's error and leaves mutated inputs unwritten."""
    def solve_and_step(a, b, w):
        x = torch.linalg.solve(a, b)
        w.add_(1.0)                 # a mutation after the check: eager never reaches it on a singular input
        return x

    monkeypatch.setenv("TN_STRICT", "1")     # a host op would raise UnsupportedOpError
    f = tn.jit(solve_and_step, backend="neuron")
    a = torch.tensor([[4.0, 1.0, 0.5], [1.0, 3.0, 0.2], [0.5, 0.2, 2.0]])
    b, w = torch.tensor([1.0, -2.0, 0.5]), torch.zeros(2)
    torch.testing.assert_close(f(a, b, w), torch.linalg.solve(a, b))
    assert w.tolist() == [1.0, 1.0]
    assert f.stats["host_ops"] == {} and f.stats["programs"] == 1
    s, _ = _singular()
    with pytest.raises(torch.linalg.LinAlgError) as got:
        f(s, b, w)
    with pytest.raises(torch.linalg.LinAlgError) as want:
        torch.linalg.solve(s, b)
    assert str(got.value) == str(want.value)
    assert w.tolist() == [1.0, 1.0]


def test_host_op_linalg_errors_keep_eagers_type_on_the_device():
    # the full SVD's vectors stay a host op inside the device's program; its LinAlgError on non-finite input
    # reaches the caller as eager's error, not wrapped in tn.ExecutionError
    x = torch.randn(4, 4)
    x[0, 0] = float("nan")
    with pytest.raises(torch.linalg.LinAlgError, match="non-finite"):
        torch.linalg.svd(x.to("neuron"))
