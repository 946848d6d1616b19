# The precomputed call paths (issue 13): BoundPlan runs and NeuronExecutable's per-step plans give what the
# value-by-value path gives (outputs, RunResult fields, profiles, errors, the range-check flag, block reuse).
import numpy as np
import pytest
import torch

import tn
from tn.errors import NeuronError
from tn.lower import compile_ir
from tn.lower.compiler import _StepPlan
from tn.lower.testing import build_eqn_ir
from tn.neuron import Program
from tn.neuron.runtime import BoundPlan


def _prog():
    """y = 2 x + 1 and z = x (outputs), plus a scratch tensor the program writes and one it never touches."""
    prog = Program("plan")
    x = prog.hbm("x", (128, 16), "float32")
    y = prog.hbm("y", (128, 16), "float32", kind="output")
    z = prog.hbm("z", (128, 16), "float32", kind="output")
    s = prog.hbm("s", (128, 16), "float32", kind="scratch")
    prog.hbm("never", (3, 5), "int32", kind="scratch")
    t = prog.sbuf((128, 16), "float32")
    prog.dma_copy(t, x)
    prog.dma_copy(z, t)
    prog.activation(t, t, "identity", scale=2.0, bias=1.0)
    prog.dma_copy(s, t)
    prog.dma_copy(y, t)
    return prog.build()


def _fields(r):
    return (r.name, r.total_ns, r.hbm_read_bytes, r.hbm_write_bytes, r.sbuf_peak_bytes, r.psum_peak_bytes,
            r.matmul_flops, r.busy_ns, r.counts, r.times.tolist(), r.queues.tolist(), r.opcodes.tolist())


def test_a_plan_run_equals_a_positional_run():
    enc = _prog()
    call = enc.prepare_call()
    x = torch.randn(128, 16)
    y = torch.empty(128, 16)
    plan = call.plan([0, 1])     # x and y bound, z and the scratch tensors allocated by the run
    assert isinstance(plan, BoundPlan) and plan.at == (0, 1)
    assert plan.fast == ((torch.float32, x.nbytes), (torch.float32, y.nbytes))
    ref = call([x, torch.empty(128, 16)])
    with tn.profile() as prof:
        res = plan([x, y], [x.data_ptr(), y.data_ptr()])
    assert prof.runs == [res]
    assert _fields(res) == _fields(ref)
    torch.testing.assert_close(y, 2 * x + 1)
    out = res.outputs
    assert list(out) == ["x", "y", "z", "s", "never"]
    assert out["x"] is x and out["y"] is y
    np.testing.assert_array_equal(out["z"], x.numpy())
    np.testing.assert_array_equal(out["s"], (2 * x + 1).numpy())
    assert out["never"].dtype == np.int32 and out["never"].shape == (3, 5) and not out["never"].any()
    assert plan.first(res, 2) == x[0, 0].item()
    # every carved piece is aligned and disjoint
    addrs = sorted((out[k].__array_interface__["data"][0], out[k].nbytes) for k in ("z", "s", "never"))
    assert all(a % 64 == 0 for a, _ in addrs)
    assert all(a + n <= b for (a, n), (b, _) in zip(addrs, addrs[1:]))
    assert res.start_ns is not None and res.core == ref.core


def test_a_plan_binding_everything_carves_nothing_and_reports_unless_told_not_to():
    enc = _prog()
    call = enc.prepare_call()
    vals = [torch.randn(128, 16), torch.empty(128, 16), torch.empty(128, 16), torch.empty(128, 16),
            torch.zeros(3, 5, dtype=torch.int32)]
    plan = call.plan([4, 3, 2, 1, 0])   # any order
    with tn.profile() as prof:
        res = plan(vals[::-1], [v.data_ptr() for v in vals[::-1]], report=False)
    assert prof.runs == []
    torch.testing.assert_close(vals[1], 2 * vals[0] + 1)
    assert res.outputs["y"] is vals[1] and res.outputs["never"] is vals[4]


def test_a_plan_refuses_what_a_call_would_refuse_with_the_same_errors():
    enc = _prog()
    call = enc.prepare_call()
    with pytest.raises(NeuronError) as plan_err:
        call.plan([1])
    with pytest.raises(NeuronError) as call_err:
        call([None, torch.empty(128, 16)])
    assert str(plan_err.value) == str(call_err.value) and "input HBM tensor 'x'" in str(plan_err.value)
    with pytest.raises(NeuronError, match="each index once"):
        call.plan([0, 0])
    with pytest.raises(NeuronError, match="each index once"):
        call.plan([0, 5])
    plan = call.plan([0])
    for bad in (torch.randn(128, 16, dtype=torch.float64), torch.randn(4, 4), torch.randn(16, 128).t()):
        with pytest.raises(NeuronError) as plan_err:
            plan.address(0, bad)
        with pytest.raises(NeuronError) as call_err:
            call([bad])
        assert str(plan_err.value) == str(call_err.value)
    x = torch.randn(128, 16)
    assert plan.address(0, x) == x.data_ptr()
    for p in (plan, call.plan([0, 1, 2, 3, 4])):       # a carving plan and one binding everything
        with pytest.raises(NeuronError, match="addresses for a plan binding"):
            p([x], [])


def test_a_plan_reuses_a_dropped_results_block_zeroed_and_never_a_held_one():
    enc = _prog()
    call = enc.prepare_call()
    plan = call.plan([0])
    x = torch.randn(128, 16)
    res = plan([x], [x.data_ptr()])
    block = res._lazy[3][-1].block
    addr = block.__array_interface__["data"][0]
    block.fill(0xFF)
    del block, res
    assert len(call._spare) == 1
    res = plan([x], [x.data_ptr()])
    assert call._spare == [] and res._lazy[3][-1].addr == addr
    out = res.outputs
    assert not out["never"].any()                     # zeroed before reuse
    held = out["y"]
    del out, res
    assert call._spare == []                          # an output array is alive: the block is not given back
    res = plan([x * 3], [(x3 := x * 3).data_ptr()])
    assert res._lazy[3][-1].addr != addr
    np.testing.assert_array_equal(held, (2 * x + 1).numpy())
    np.testing.assert_array_equal(res.outputs["y"], (2 * x3 + 1).numpy())


def test_executable_plans_give_the_same_results_profiles_and_errors_as_binding_value_by_value():
    def f(x, w):
        return torch.tanh(x @ w * 1.5) + 1.0, x.sum(0)

    x, w = torch.randn(16, 32), torch.randn(32, 8)
    ir = tn.make_ir(f)(x, w)
    fast, slow = compile_ir(ir), compile_ir(ir)
    fast([x, w])
    assert fast._plans and all(isinstance(p, _StepPlan) for p in fast._plans if p is not None)
    assert any(p is not None for p in fast._plans)
    slow([x, w])
    slow._plans = tuple(None for _ in slow._plans)
    xt = torch.randn(32, 16).t()                 # not contiguous: copied for the program, as before
    for args in ([x, w], [xt, w], [x.requires_grad_(), w]):
        a, b = fast(args), slow(args)
        for u, v in zip(a, b):
            torch.testing.assert_close(u, v, rtol=0, atol=0)
        torch.testing.assert_close(a[0], f(*[t.detach() for t in args])[0])
        pa, pb = fast.last_profile, slow.last_profile
        assert [_fields(r) for r in pa.runs] == [_fields(r) for r in pb.runs]
        assert pa.host_ops == pb.host_ops and pa.total_ns == pb.total_ns
    x = x.detach()
    # outputs into given memory (out=): the program writes them there on both paths
    for exe in (fast, slow):
        dest = torch.empty(16, 8)
        r = exe([x, w], out=[dest, None])
        assert r[0] is dest
        torch.testing.assert_close(dest, f(x, w)[0])
        flat = torch.empty(128)                   # the same element count: written through a view of it
        r = exe([x, w], out=[flat, None])
        assert r[0].shape == (16, 8) and r[0].data_ptr() == flat.data_ptr()
        torch.testing.assert_close(flat.view(16, 8), f(x, w)[0])
        for unfit in (torch.zeros(16, 8, dtype=torch.float64), torch.zeros(8, 8), torch.zeros(8, 16).t()):
            r = exe([x, w], out=[unfit, None])    # does not fit: allocated as usual, the tensor untouched
            assert r[0].data_ptr() != unfit.data_ptr() and not unfit.any()
            torch.testing.assert_close(r[0], f(x, w)[0])
    for bad in ([x.double(), w], [torch.randn(4, 4), w]):
        with pytest.raises(tn.TnError) as e_fast:
            fast(bad)
        with pytest.raises(tn.TnError) as e_slow:
            slow(bad)
        assert str(e_fast.value) == str(e_slow.value)


def test_executable_plans_read_the_range_flag_and_recompute_on_the_host():
    a = torch.randint(-1000, 1000, (200, 3))
    b = torch.randint(-1000, 1000, (200, 3))
    exe = compile_ir(build_eqn_ir("add", a, b))
    assert torch.equal(exe([a, b])[0], a + b)
    assert exe.last_profile.host_ops == {}
    (plan,) = [p for p in exe._plans if p is not None]
    assert plan.flag is not None
    assert exe.last_profile.runs[-1].outputs["_range_flag"].tolist() == [0]
    big = a.clone()
    big[7, 1] = 1 << 40
    assert torch.equal(exe([big, b])[0], big + b)
    assert exe.last_profile.host_ops == {"<out of range: whole call>": 1}
    assert exe.last_profile.runs[-1].outputs["_range_flag"].tolist() != [0]
    assert torch.equal(exe([a, b])[0], a + b)        # the flag's memory is zeroed for the next call
    assert exe.last_profile.host_ops == {}
