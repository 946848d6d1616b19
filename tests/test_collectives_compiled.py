# Collectives inside compiled programs: functional collectives traced as IR ops, run on the collective engine, timed.
import pytest
import torch
import torch.distributed._functional_collectives as funcol

import tn
import tn.lower
from tn import dynamo_backend, passes
from tn.ops.collective import COLLECTIVE_OPS
from tn.distributed import compiled
from tn.lower import collective
from tn.neuron import collectives as model
from tn.neuron import timeline
from tn.neuron.machine import machine


c10d = torch.ops._c10d_functional


def _ops(ir):
    return [e.op.name for e in ir.eqns]


def test_functional_collectives_trace_to_ir_ops(solo_group):
    def f(x):
        return (funcol.all_reduce(x, "sum", solo_group), funcol.all_gather_single(x, 0, solo_group),
                funcol.reduce_scatter_tensor(x, "avg", 0, solo_group),
                funcol.all_to_all_single(x, None, None, solo_group), funcol.broadcast(x, 0, solo_group))

    ir = tn.make_ir(f)(torch.randn(4, 3))
    names = _ops(ir)
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        assert names.count(op) == 1, (op, names)
    assert names.count("wait") == 5
    text = str(ir)
    assert f"all_reduce[reduce_op='sum' group='{solo_group}']" in text
    assert "reduce_scatter[reduce_op='avg' group_size=1" in text
    assert "all_to_all[output_split_sizes=(4,) input_split_sizes=(4,)" in text
    assert all(tn.ops.OPS[n].category == "collective" and tn.ops.OPS[n].effectful for n in COLLECTIVE_OPS)


def test_collectives_are_never_merged_or_folded(solo_group):
    def f(x):
        a = funcol.all_reduce(x, "sum", solo_group)
        b = funcol.all_reduce(x, "sum", solo_group)        # same inputs: still two collectives (every rank issues both)
        c = funcol.all_reduce(torch.ones(3), "sum", solo_group)   # constant input: not folded
        return a + b + c

    ir = passes.optimize(tn.make_ir(f)(torch.randn(3)))
    assert _ops(ir).count("all_reduce") == 3
    assert passes.is_impure(tn.ops.OPS["all_reduce"]) and passes.is_impure(tn.ops.OPS["wait"])


def test_inplace_out_and_coalesced_forms_decompose_into_collectives(solo_group):
    def f(x, y, out):
        c10d.all_reduce_(x, "sum", solo_group)
        p, q = c10d.all_reduce_coalesced([x, y], "max", solo_group)
        c10d.all_gather_into_tensor_out(y, 1, solo_group, out=out)
        r, = c10d.reduce_scatter_tensor_coalesced([y], "sum", 1, solo_group)
        c10d.broadcast_(y, 0, solo_group)
        return c10d.wait_tensor(p) * 2, c10d.wait_tensor(q), c10d.wait_tensor(r)

    x, y, out = torch.randn(3), torch.randn(2, 2), torch.zeros(2, 2)
    ir = tn.make_ir(f)(x, y, out)
    names = _ops(ir)
    assert names.count("all_reduce") == 3 and names.count("all_gather") == 1
    assert names.count("reduce_scatter") == 1 and names.count("broadcast") == 1
    assert len(ir.mutations) == 3      # x, y and out are written back
    x2, y2, out2 = x.clone(), y.clone(), out.clone()
    got = tn.jit(f)(x2, y2, out2)
    torch.testing.assert_close(got[0], x * 2)
    torch.testing.assert_close(got[2], y)
    torch.testing.assert_close(out2, y)     # one rank: the gathered value is the input


def test_jit_results_match_torch(solo_group, backend):
    def f(x, w):
        h = x @ w
        return funcol.all_reduce(h, "sum", solo_group) * 2, funcol.all_gather_single(torch.relu(h), 0, solo_group)

    x, w = torch.randn(8, 16), torch.randn(16, 16)
    got = tn.jit(f, backend=backend)(x, w)
    want = f(x, w)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


def test_compiler_makes_collectives_steps_not_host_ops(solo_group):
    def f(x, w):
        y = funcol.all_reduce(x @ w, "sum", solo_group)
        return y + 1

    x, w = torch.randn(8, 16), torch.randn(16, 16)
    ir = passes.optimize(tn.make_ir(f)(x, w))
    exe = tn.lower.compile_ir(ir, strict=True)     # strict: a host fallback would raise
    assert exe.stats["host_ops"] == {} and exe.stats["collectives"] == 1
    assert exe.stats["programs"] == 2              # one program before the collective, one after
    out, = exe([x, w])
    torch.testing.assert_close(out, x @ w + 1, rtol=1e-4, atol=1e-4)
    run, = exe.last_profile.collectives
    assert run.name == "all_reduce" and run.nbytes == 8 * 16 * 4
    assert tn.ops.OPS["all_reduce"].lowering is not None


def test_torch_compile_graph_with_collectives(solo_group):
    def f(x, w):
        h = torch.tanh(x @ w)
        return funcol.all_reduce(h, "avg", solo_group) + funcol.all_gather_single(h, 0, solo_group).sum(0)

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    before = {id(j) for j in dynamo_backend.compiled_graphs()}
    g = torch.compile(f, backend="neuron", fullgraph=True)
    torch.testing.assert_close(g(x, w), f(x, w), rtol=1e-4, atol=1e-4)
    graphs = [j for j in dynamo_backend.compiled_graphs() if id(j) not in before]
    assert graphs
    assert all(dynamo_backend.host_ops_of(j) == {} for j in graphs)
    exes = [e for j in graphs for e in dynamo_backend.executables_of(j)]
    assert sum(e.stats.get("collectives", 0) for e in exes) == 2


def test_wait_moves_to_first_use(solo_group):
    def f(x, w):
        y = funcol.all_reduce(x, "sum", solo_group)     # torch puts the wait right here
        z = torch.relu(x @ w) @ w                        # independent compute
        return y * 2, z

    ir = passes.optimize(tn.make_ir(f)(torch.randn(8, 16), torch.randn(16, 16)))
    names = _ops(ir)
    assert names.index("wait") == names.index("all_reduce") + 1
    moved = _ops(collective.sink_waits(ir))
    assert moved.index("wait") > max(i for i, n in enumerate(moved) if n == "matmul")
    assert moved.index("wait") == moved.index("mul") - 1
    assert collective.sink_waits(collective.sink_waits(ir)).eqns == collective.sink_waits(ir).eqns


@pytest.fixture
def two_core_group(solo_group):
    """The one-rank group, timed as if its ranks ran on global cores 0 and 1 (the transport stays one rank)."""
    compiled.set_group_cores(lambda name: [0, 1] if name == solo_group else None)
    yield solo_group
    compiled.set_group_cores(None)


def test_collective_time_comes_from_the_ring_model_and_overlaps_compute(two_core_group):
    g = two_core_group

    def f(x, w):
        y = funcol.all_reduce(x @ w, "sum", g)
        z = torch.relu(x @ w.T) @ w          # does not need y: runs while the all-reduce is in flight
        return y + 1, z

    x, w = torch.randn(128, 256), torch.randn(256, 256)
    fj = tn.jit(f)
    fj(x, w)
    timeline.reset()
    with tn.profile() as prof:
        fj(x, w)
    rec, = [r for r in prof.records if r.track == "collectives"]
    want = model.collective_ns("all_reduce", machine(), 128 * 256 * 4, [0, 1])
    assert want > 0 and rec.dur_ns == pytest.approx(want)
    runs = sorted(prof.runs, key=lambda r: r.start_ns)
    overlapped = [r for r in runs if rec.start_ns <= r.start_ns < rec.end_ns]
    assert overlapped, "the independent matmuls should start while the all-reduce runs"
    last = runs[-1]     # the program adding 1 to the all-reduce's result waits for it
    assert last.start_ns >= rec.end_ns


def test_collective_read_without_wait_is_synchronous(two_core_group):
    g = two_core_group

    def f(x):
        return c10d.all_reduce(x, "sum", g) * 3     # no wait_tensor: the result is waited for at once

    x = torch.randn(64, 64)
    fj = tn.jit(f)
    fj(x)
    timeline.reset()
    with tn.profile() as prof:
        torch.testing.assert_close(fj(x), x * 3)
    rec, = prof.records
    after = [r for r in prof.runs if r.start_ns >= rec.start_ns]
    assert after and all(r.start_ns >= rec.end_ns for r in after)


# ------------------------------------------------------------------ real ranks on the neuron backend
def _mlp_step(x, w):
    """Compute, collectives on its results and independent compute (the compiled program's shape under test)."""
    h = x @ w
    return (funcol.all_reduce(h, "sum", "0"), funcol.all_gather_tensor(h, 0, "0"),
            funcol.reduce_scatter_tensor(h, "sum", 0, "0"), funcol.all_to_all_single(h, None, None, "0"),
            funcol.broadcast(h, 1, "0"), torch.relu(h))


def _overlap(x, w):
    y = funcol.all_reduce(x @ w, "avg", "0")
    z = torch.relu(x @ w.T) @ w          # does not need y: runs while the all-reduce is in flight
    return y + 1, z


def job_compiled_collectives(rank, world):
    """On the neuron backend: a tn.jit program and a torch.compile graph with every functional collective (against
    eager on the device), the timing of one compiled all-reduce (profile records, runs), and a mismatched
    compiled collective."""
    import datetime

    import torch.distributed as dist

    import tn
    from tn.distributed import CollectiveMismatchError

    dist.init_process_group("neuron", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    assert dist.group.WORLD.group_name == "0"
    cpu = (lambda t: t.detach().to("cpu").clone())
    torch.manual_seed(rank)
    x, w = torch.randn(16, 32).to("neuron"), torch.randn(32, 32).to("neuron")
    R = {"x": cpu(x), "w": cpu(w)}
    R["eager"] = [cpu(t) for t in _mlp_step(x, w)]
    fj = tn.jit(_mlp_step)
    R["jit"] = [cpu(t) for t in fj(x, w)]
    from tn import dynamo_backend

    (exe,) = dynamo_backend.executables_of(fj)
    R["jit_stats"] = dict(exe.stats)
    g = torch.compile(_mlp_step, backend="neuron", fullgraph=True)
    R["compile"] = [cpu(t) for t in g(x, w)]
    R["compile_host_ops"] = dynamo_backend.host_ops()
    exes = [e for j in dynamo_backend.compiled_graphs() for e in dynamo_backend.executables_of(j)]
    R["compile_collectives"] = sum(e.stats.get("collectives", 0) for e in exes)
    fo = tn.jit(_overlap)
    R["overlap_eager"] = [cpu(t) for t in _overlap(x, w)]
    R["overlap_jit"] = [cpu(t) for t in fo(x, w)]
    dist.barrier()
    tn.neuron.timeline.reset()
    with tn.profile() as prof:
        fo(x, w)
    R["records"] = [(r.name, r.start_ns, r.end_ns, r.nbytes, r.track) for r in prof.records]
    R["runs"] = [(r.start_ns, r.start_ns + r.total_ns) for r in prof.runs]
    R["stats"] = tn.distributed.collective_stats()
    bad = tn.jit(lambda t: funcol.all_reduce(t, "sum", "0"))
    try:
        bad(torch.ones(3 + rank, device="neuron"))
        R["mismatch"] = None
    except CollectiveMismatchError as e:
        R["mismatch"] = str(e)
    R["dtensor"] = _dtensor_mlp(world)
    dist.destroy_process_group()
    return R


def _dtensor_mlp(world):
    """A Colwise/Rowwise tensor-parallel MLP (DTensor) in eager and under torch.compile(backend="neuron"): outputs
    and local weight gradients of both, plus what the compiled graphs held."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from tn import dynamo_backend

    mesh = init_device_mesh("neuron", (world,))
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.randn(4, 16)
    out = {"ref": ref(x).detach(), "ref_state": {k: v.detach().clone() for k, v in ref.state_dict().items()}}
    before = {id(j) for j in dynamo_backend.compiled_graphs()}
    for door in ("eager", "compile"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
        model.load_state_dict(ref.state_dict())
        model = parallelize_module(model.to("neuron"), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        run = torch.compile(model, backend="neuron") if door == "compile" else model
        y = run(x.to("neuron"))
        (y * y).sum().backward()
        out[door] = y.detach().to("cpu").clone()
        out[door + "_grads"] = {n: p.grad.to_local().to("cpu").clone() for n, p in model.named_parameters()}
    graphs = [j for j in dynamo_backend.compiled_graphs() if id(j) not in before]
    exes = [e for j in graphs for e in dynamo_backend.executables_of(j)]
    out["graphs"] = len(graphs)
    out["collectives"] = sum(e.stats.get("collectives", 0) for e in exes)
    out["host_ops"] = {k: v for j in graphs for k, v in dynamo_backend.host_ops_of(j).items()}
    return out


@pytest.fixture(scope="module")
def ranks():
    import dist_workers as W

    return W.ok(W.run_ranks(job_compiled_collectives, 2, timeout=300)[0])


@pytest.mark.slow
def test_two_ranks_compiled_collectives_match_eager(ranks):
    hs = [r["x"] @ r["w"] for r in ranks]
    tol = {"rtol": 1e-4, "atol": 1e-4}
    for rank, r in enumerate(ranks):
        want = [hs[0] + hs[1], torch.cat(hs), (hs[0] + hs[1]).chunk(2)[rank],
                torch.cat([hs[0].chunk(2)[rank], hs[1].chunk(2)[rank]]), hs[1], torch.relu(hs[rank])]
        for door in ("eager", "jit", "compile"):
            for got, ref in zip(r[door], want):
                torch.testing.assert_close(got, ref, **tol)
        for got, ref in zip(r["jit"] + r["overlap_jit"], r["eager"] + r["overlap_eager"]):
            torch.testing.assert_close(got, ref, **tol)
        assert r["compile_host_ops"] == {} and r["compile_collectives"] == 5
        assert r["jit_stats"]["host_ops"] == {} and r["jit_stats"]["collectives"] == 5


@pytest.mark.slow
def test_two_ranks_compiled_all_reduce_is_timed_on_the_collectives_track_and_overlaps(ranks):
    for r in ranks:
        (name, start, end, nbytes, track), = r["records"]
        assert (name, nbytes, track) == ("all_reduce", 16 * 32 * 4, "collectives")
        assert end - start == pytest.approx(model.collective_ns("all_reduce", machine(), nbytes, [0, 1]))
        runs = sorted(r["runs"])
        assert any(start <= s < end for s, _ in runs), "independent programs overlap the all-reduce"
        assert runs[-1][0] >= end        # the program reading the result waits for it
        assert r["stats"]["all_reduce"]["calls"] >= 3


@pytest.mark.slow
def test_two_ranks_mismatched_compiled_collective_raises_on_every_rank(ranks):
    for r in ranks:
        assert r["mismatch"] and "disagree" in r["mismatch"]


@pytest.mark.slow
def test_two_ranks_dtensor_tensor_parallel_mlp_compiles_and_matches_eager(ranks):
    for rank, r in enumerate(ranks):
        D = r["dtensor"]
        assert D["graphs"] >= 2 and D["collectives"] >= 1 and D["host_ops"] == {}   # forward and backward graphs
        torch.testing.assert_close(D["eager"], D["ref"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(D["compile"], D["eager"], rtol=1e-5, atol=1e-5)
        for name, g in D["eager_grads"].items():
            torch.testing.assert_close(D["compile_grads"][name], g, rtol=1e-5, atol=1e-5)
        assert D["eager_grads"]["0.weight"].shape == (16, 16)        # colwise: this rank's half of the rows
