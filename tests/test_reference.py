# Tests of the reference executor (tn.reference): slots, literals, constants, multi-output ops, errors.
import pytest
import torch

import tn
from tn.ir import IR, Eqn, Literal, Var
from tn.ops import OPS
from tn.reference import ExecutionError, compile_ir, run_ir


# Real ops of tn's table (tn.ops.OPS): the executor is tested on what it runs.
ADD, MUL, SUM, TOPK = OPS["add"], OPS["mul"], OPS["sum"], OPS["topk"]


def test_run_simple_chain_with_literal_and_const():
    a, b = Var((4, 8), torch.float32), Var((8,), torch.float32)
    c = Var((8,), torch.float32)
    d, e, f = Var((4, 8), torch.float32), Var((4, 8), torch.float32), Var((4,), torch.float32)
    ct = torch.randn(8)
    ir = IR([a, b], [Eqn(ADD, [a, b], [d]), Eqn(MUL, [d, Literal(2.0)], [e]), Eqn(ADD, [e, c], [e2 := Var((4, 8), torch.float32)]),
                     Eqn(SUM, [e2], [f], {"dims": (1,), "keepdim": False})],
            [f, e2], consts=[(c, ct)])
    x, y = torch.randn(4, 8), torch.randn(8)
    out = run_ir(ir, [x, y])
    exp2 = (x + y) * 2.0 + ct
    torch.testing.assert_close(out[1], exp2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[0], exp2.sum(1), rtol=1e-5, atol=1e-5)


def test_compiled_program_runs_repeatedly_and_frees_intermediates():
    a = Var((3,), torch.float32)
    vs = [a]
    eqns = []
    for _ in range(20):
        n = Var((3,), torch.float32)
        eqns.append(Eqn(ADD, [vs[-1], Literal(1.0)], [n]))
        vs.append(n)
    run = compile_ir(IR([a], eqns, [vs[-1]]))
    for _ in range(3):
        x = torch.randn(3)
        torch.testing.assert_close(run([x])[0], x + 20.0)
    # every intermediate except the output is freed right after its last use
    freed = sum(len(line.split(",")) for line in run.source.splitlines() if line.strip().startswith("del "))
    assert freed == 19
    assert run.source.count("# ") == 20  # one line per equation, commented with its op


def test_multi_output_and_input_passthrough_and_literal_output():
    a = Var((5, 6), torch.float32)
    m, i = Var((5, 1), torch.float32), Var((5, 1), torch.int64)
    ir = IR([a], [Eqn(TOPK, [a], [m, i], {"k": 1, "dim": 1})], [m, i, a, Literal(3, torch.int64)])
    x = torch.randn(5, 6)
    out = run_ir(ir, [x])
    ev, ei = x.topk(1, 1)
    torch.testing.assert_close(out[0], ev)
    assert torch.equal(out[1], ei)
    # an input returned as is comes back as a copy (the caller may write into results)
    assert out[2] is not x and torch.equal(out[2], x)
    assert isinstance(out[3], torch.Tensor) and out[3].dtype == torch.int64 and int(out[3]) == 3


def test_nonfinite_literals_and_unused_results():
    a = Var((3,), torch.float32)
    m, i, dead = Var((3,), torch.float32), Var((3,), torch.float32), Var((3,), torch.float32)
    ir = IR([a], [Eqn(ADD, [a, Literal(float("inf"))], [m]),
                  Eqn(MUL, [a, Literal(float("nan"))], [i]),
                  Eqn(ADD, [a, Literal(-float("inf"))], [dead])], [m, i])
    x = torch.randn(3)
    out = run_ir(ir, [x])
    assert torch.isinf(out[0]).all() and torch.isnan(out[1]).all()


def test_wrong_input_count_is_a_tn_error():
    a = Var((2,), torch.float32)
    ir = IR([a], [], [a])
    with pytest.raises(tn.TnError, match="takes 1 input tensors, got 2"):
        run_ir(ir, [torch.zeros(2), torch.zeros(2)])


def test_failing_impl_names_the_equation():
    a, b = Var((2, 3), torch.float32), Var((4,), torch.float32)
    c = Var((2, 3), torch.float32)
    ir = IR([a, b], [Eqn(ADD, [a, b], [c], source="model.py:7")], [c])
    with pytest.raises(ExecutionError, match=r"equation 0 .*add.*model.py:7.*RuntimeError") as info:
        run_ir(ir, [torch.zeros(2, 3), torch.zeros(4)])
    assert isinstance(info.value.__cause__, RuntimeError)


def test_undefined_variable_is_reported_at_compile_time():
    a, ghost, c = Var((2,), torch.float32), Var((2,), torch.float32), Var((2,), torch.float32)
    ir = IR([a], [Eqn(ADD, [a, ghost], [c])], [c])
    with pytest.raises(ExecutionError, match="no constant, input or earlier equation defines"):
        compile_ir(ir)
