# Multi-process harness of the torch.distributed tests: spawn ranks on loopback with a hard timeout, and the rank jobs.
"""Rank jobs for ``tests/test_distributed.py``, run by :func:`run_ranks` (:mod:`tn.distributed.spawn`).

A job is a module-level function ``job(rank, world) -> picklable result``
(CPU tensors, numbers, strings). ``run_ranks`` starts ``world`` processes
with the ``spawn`` method (the neuron device refuses use after fork), sets
``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT``, and waits at most
``timeout`` seconds: a hang fails the test instead of hanging it. Each rank
reports ``("ok", result)`` or ``("error", "Type: message", traceback)``.
"""
from __future__ import annotations

import datetime
import os

import torch

from tn.distributed import spawn


def run_ranks(job, world: int = 2, timeout: float = 120.0, env=None, expect_exit=()):
    """:func:`tn.distributed.spawn.run_ranks` (spawned ranks, loopback, hard timeout); tn's warm-up is skipped in
    the ranks."""
    saved = os.environ.get("TN_NO_WARMUP")
    os.environ["TN_NO_WARMUP"] = "1"
    try:
        return spawn.run_ranks(job, world, timeout=timeout, env=env, expect_exit=expect_exit)
    finally:
        if saved is None:
            os.environ.pop("TN_NO_WARMUP", None)
        else:
            os.environ["TN_NO_WARMUP"] = saved


def ok(reports):
    """The results of every rank (RankFailed with the first failing rank's error and traceback)."""
    return spawn.results_of(reports)


def _init(rank, world, timeout_s=30.0, backend="neuron"):
    import torch.distributed as dist

    import tn  # noqa: F401  (registers the backend)

    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    return dist


def _cpu(x):
    return x.detach().to("cpu").clone() if isinstance(x, torch.Tensor) else x


# ---------------------------------------------------------------------------------------------- collectives
def _compiled_collectives(t):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    return fc.all_reduce(t @ t, "sum", dist.group.WORLD), fc.all_gather_tensor(t + 1, 0, dist.group.WORLD)


def job_collectives(rank, world):
    """Every collective on neuron tensors, async work, functional collectives, object collectives, profile."""
    dist = _init(rank, world)
    import torch.distributed._functional_collectives as fc

    import tn

    dev = "neuron"
    R = {}
    n, r = world, rank
    base = torch.arange(6.).reshape(2, 3) + r
    R["backend"] = dist.get_backend()
    R["device_count"] = torch.neuron.device_count()
    R["cores"] = dist.group.WORLD.cores
    R["device_types"] = [str(d) for d in dist.group.WORLD._device_types]
    t = torch.full((3, 4), float(r + 1), device=dev)
    dist.all_reduce(t)
    R["sum"] = _cpu(t)
    for name in ("AVG", "MAX", "MIN", "PRODUCT"):
        t = base.to(dev)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
        R[name] = _cpu(t)
    t = (torch.arange(5) * (r + 2)).to(dev)
    dist.all_reduce(t)
    R["int_sum"] = _cpu(t)
    t = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16).to(dev) * (r + 1)
    dist.all_reduce(t)
    R["bf16_sum"] = _cpu(t)
    whole = torch.zeros(4, 6, device=dev)
    view = whole[:, ::2]
    view.copy_(torch.full((4, 3), float(r + 1)))
    dist.all_reduce(view)
    R["strided"] = (_cpu(whole), view.is_contiguous())
    outs = [torch.empty(2, 3, device=dev) for _ in range(n)]
    dist.all_gather(outs, base.to(dev))
    R["all_gather"] = [_cpu(o) for o in outs]
    out = torch.empty(2 * n, 3, device=dev)
    dist.all_gather_into_tensor(out, base.to(dev))
    R["all_gather_into_tensor"] = _cpu(out)
    a_out, b_out = torch.empty(n * 2, device=dev), torch.empty(n * 3, 2, device=dev)
    with dist._coalescing_manager():
        dist.all_gather_into_tensor(a_out, torch.full((2,), float(r), device=dev))
        dist.all_gather_into_tensor(b_out, torch.full((3, 2), float(10 + r), device=dev))
    R["all_gather_coalesced"] = (_cpu(a_out), _cpu(b_out))
    ins = [torch.full((2,), float((r + 1) * 10 + j), device=dev) for j in range(n)]
    out = torch.empty(2, device=dev)
    dist.reduce_scatter(out, ins)
    R["reduce_scatter"] = _cpu(out)
    inp = (torch.arange(2. * n * 3).reshape(2 * n, 3) + r).to(dev)
    out = torch.empty(2, 3, device=dev)
    dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.AVG)
    R["reduce_scatter_tensor_avg"] = _cpu(out)
    o1, o2 = torch.empty(1, device=dev), torch.empty(2, device=dev)
    with dist._coalescing_manager():
        dist.reduce_scatter_tensor(o1, torch.arange(float(n), device=dev) + r)
        dist.reduce_scatter_tensor(o2, torch.ones(2 * n, device=dev) * (r + 1))
    R["reduce_scatter_coalesced"] = (_cpu(o1), _cpu(o2))
    x1, x2 = torch.full((2,), float(r + 1), device=dev), torch.full((3,), float(r + 2), device=dev)
    with dist._coalescing_manager():
        dist.all_reduce(x1)
        dist.all_reduce(x2)
    R["all_reduce_coalesced"] = (_cpu(x1), _cpu(x2))
    t = torch.full((3,), float(r + 5), device=dev)
    dist.broadcast(t, src=1)
    R["broadcast"] = _cpu(t)
    ins = [torch.full((r + j + 1,), float(10 * r + j), device=dev) for j in range(n)]
    outs = [torch.empty(j + r + 1, device=dev) for j in range(n)]
    dist.all_to_all(outs, ins)
    R["all_to_all"] = [_cpu(o) for o in outs]
    inp = (torch.arange(2. * n) + 100 * r).to(dev)
    out = torch.empty(2 * n, device=dev)
    dist.all_to_all_single(out, inp)
    R["all_to_all_single"] = _cpu(out)
    in_splits = [r + j + 1 for j in range(n)]
    out_splits = [j + r + 1 for j in range(n)]
    inp = torch.cat([torch.full((s, 2), float(100 * r + j)) for j, s in enumerate(in_splits)]).to(dev)
    out = torch.empty(sum(out_splits), 2, device=dev)
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    R["all_to_all_uneven"] = _cpu(out)
    if r == 0:
        dist.send((torch.arange(5.) * 7).to(dev), dst=1)
    else:
        got = torch.empty(5, device=dev)
        dist.recv(got, src=0)
        R["recv"] = _cpu(got)
    dist.barrier()
    t = torch.full((4,), float(r + 1), device=dev)
    work = dist.all_reduce(t, async_op=True)
    R["async"] = (work.is_completed(), work.wait(), _cpu(work.get_future().wait()[0]), _cpu(t))
    R["functional"] = {
        "all_reduce": _cpu(fc.all_reduce(torch.full((3,), float(r + 1), device=dev), "sum", dist.group.WORLD)),
        "all_gather_tensor": _cpu(fc.all_gather_tensor(torch.full((2,), float(r), device=dev), 0,
                                                       dist.group.WORLD)),
        "reduce_scatter_tensor": _cpu(fc.reduce_scatter_tensor(torch.arange(2. * n, device=dev) * (r + 1), "sum",
                                                               0, dist.group.WORLD)),
        "all_to_all_single": _cpu(fc.all_to_all_single(torch.arange(float(n), device=dev) + 10 * r, None, None,
                                                       dist.group.WORLD)),
    }
    F = R["functional"]
    F["broadcast"] = _cpu(fc.broadcast(torch.full((2,), float(r + 7), device=dev), 1, dist.group.WORLD))
    F["all_reduce_coalesced"] = [_cpu(x) for x in fc.all_reduce_coalesced(
        [torch.ones(2, device=dev) * (r + 1), torch.ones(3, device=dev) * (r + 2)], "max", dist.group.WORLD)]
    F["all_gather_coalesced"] = [_cpu(x) for x in fc.all_gather_single_coalesced(
        [torch.full((1,), float(r), device=dev), torch.full((2,), float(r + 5), device=dev)], dist.group.WORLD)]
    F["reduce_scatter_coalesced"] = [_cpu(x) for x in fc.reduce_scatter_single_coalesced(
        [torch.arange(float(n), device=dev) + r, torch.ones(2 * n, device=dev)], "sum", [0, 0], dist.group.WORLD)]
    leaf = torch.full((2,), float(r + 1), device=dev, requires_grad=True)
    gathered = fc.all_gather_single_autograd(leaf * 2, 0, dist.group.WORLD)
    gathered = fc.wait_tensor(gathered) if isinstance(gathered, torch.Tensor) else gathered
    (gathered * torch.arange(1., 2 * n + 1, device=dev)).sum().backward()
    F["autograd_all_gather"] = (_cpu(gathered), _cpu(leaf.grad))
    raw = torch.ops._c10d_functional.all_reduce(torch.ones(2, device=dev) * (r + 1), "avg",
                                                dist.group.WORLD.group_name)
    R["functional"]["raw_avg"] = _cpu(torch.ops._c10d_functional.wait_tensor(raw))
    sq = torch.full((2, 2), float(r + 1), device=dev)     # collectives inside a compiled program (tn.jit)
    R["compiled"] = [_cpu(t) for t in tn.jit(_compiled_collectives)(sq)]
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r, "s": "x" * (r + 3)})
    R["all_gather_object"] = objs
    lst = [f"from {r}", r * 11]
    dist.broadcast_object_list(lst, src=1)
    R["broadcast_object_list"] = lst
    sub = dist.new_group(list(range(n)))
    t = torch.ones(2, device=dev) * (r + 1)
    dist.all_reduce(t, group=sub)
    R["new_group"] = (_cpu(t), dist.get_backend(sub))
    # profile records and modelled overlap with compute
    tn.neuron.timeline.reset()
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(dev)
    big = torch.ones(64 * 1024, device=dev)
    with tn.profile() as prof:
        a = x @ x
        w = dist.all_reduce(big, async_op=True)
        b = x @ x
        w.wait()
        c = b + a
    R["profile"] = {
        "records": [(rec.core, rec.name, rec.start_ns, rec.end_ns, rec.nbytes, rec.track) for rec in prof.records],
        "runs": [(run.start_ns, run.total_ns) for run in prof.runs],
    }
    del c
    R["stats"] = torch.neuron.collective_stats()
    dist.destroy_process_group()
    return R


# ---------------------------------------------------------------------------------------------- faults
def _raises(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None


def job_faults(rank, world):
    """Mismatched shapes/dtypes/ops/roots/splits, tensors of other devices, use after destroy (run with
    TN_VISIBLE_CORES set per rank, so each rank sees two devices). Started with backend=None; also checks
    PREMUL_SUM (FSDP2's gradient divide factor)."""
    dist = _init(rank, world, backend=None)
    r = rank
    R = {"cores": dist.group.WORLD.cores, "device_count": torch.neuron.device_count(),
         "group_type": type(dist.group.WORLD).__name__}
    t = torch.full((3,), float(r + 1), device="neuron")
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    out = torch.empty(1, device="neuron")
    dist.reduce_scatter_tensor(out, torch.full((world,), float(r + 1), device="neuron"),
                               op=dist._make_nccl_premul_sum(0.25))
    R["premul_sum"] = (_cpu(t), _cpu(out))
    R["shape"] = _raises(lambda: dist.all_reduce(torch.ones(3 + r, device="neuron")))
    R["dtype"] = _raises(lambda: dist.all_reduce(torch.ones(3, dtype=torch.float32 if r == 0 else torch.float64,
                                                            device="neuron")))
    R["op"] = _raises(lambda: dist.all_reduce(torch.ones(3, device="neuron")) if r == 0
                      else dist.broadcast(torch.ones(3, device="neuron"), src=0))
    R["root"] = _raises(lambda: dist.broadcast(torch.ones(3, device="neuron"), src=r))
    ins, outs = ([1, 1], [1, 1]) if r == 0 else ([2, 1], [1, 1])
    R["splits"] = _raises(lambda: dist.all_to_all_single(torch.empty(sum(outs), device="neuron"),
                                                         torch.ones(sum(ins), device="neuron"), outs, ins))
    t = torch.ones(2, device="neuron")
    dist.all_reduce(t)
    R["after_mismatch"] = _cpu(t)
    R["cpu_tensor"] = _raises(lambda: dist.all_reduce(torch.ones(2)))
    R["other_device"] = _raises(lambda: dist.all_reduce(torch.ones(2, device="neuron:1")))
    pg = dist.group.WORLD
    dist.destroy_process_group()
    R["after_destroy_default"] = _raises(lambda: dist.all_reduce(torch.ones(2, device="neuron")))
    R["after_destroy_handle"] = _raises(lambda: pg.allreduce([torch.ones(2, device="neuron")]))
    R["after_destroy_group_arg"] = _raises(lambda: dist.all_reduce(torch.ones(2, device="neuron"), group=pg))
    return R


def job_rank_dies_and_stalls(rank, world):
    """3 ranks, timeout 3 s. Rank 2 dies after the first collective: ranks 0 and 1 raise on the world group.
    Then on group [0, 1] rank 1 stalls (sleeps past the timeout): rank 0 raises within the timeout."""
    import time

    dist = _init(rank, world, timeout_s=3)
    t = torch.ones(2, device="neuron")
    dist.all_reduce(t)
    pair = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))   # new_group's default is 30 min
    if rank == 2:
        os._exit(7)
    time.sleep(0.5)
    t0 = time.monotonic()
    R = {"died": _raises(lambda: dist.all_reduce(t))}
    R["died_again"] = _raises(lambda: dist.broadcast(t, src=0))
    R["died_seconds"] = time.monotonic() - t0
    dist.all_reduce(t, group=pair)       # the pair still works
    R["pair"] = _cpu(t)
    if rank == 1:
        time.sleep(6.0)
        return R
    t0 = time.monotonic()
    R["stalled"] = _raises(lambda: dist.all_reduce(t, group=pair))
    R["stalled_seconds"] = time.monotonic() - t0
    return R


# ---------------------------------------------------------------------------------------------- DDP
def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4))


def job_ddp(rank, world, steps=6, per_rank=4):
    """DDP on a small neuron MLP (small buckets: several all-reduces per step) vs the same model trained on one
    device on the whole batch: the losses (averaged over ranks) and final weights must agree."""
    dist = _init(rank, world)
    from torch.nn.parallel import DistributedDataParallel as DDP

    import tn

    torch.manual_seed(0)
    model = _mlp()
    ref = _mlp()
    ref.load_state_dict(model.state_dict())
    model.to("neuron")
    ref.to("neuron")
    ddp = DDP(model, bucket_cap_mb=0.002)
    if world == 2:   # a comm hook: DDP reduces through the Work's future (then() on the result tensors)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    losses, ref_losses = [], []
    torch.neuron.reset_collective_stats()
    with tn.profile() as prof:
        for _ in range(steps):
            x, y = torch.randn(per_rank * world, 8, generator=g), torch.randn(per_rank * world, 4, generator=g)
            lo, hi = rank * per_rank, (rank + 1) * per_rank
            loss = torch.nn.functional.mse_loss(ddp(x[lo:hi].to("neuron")), y[lo:hi].to("neuron"))
            opt.zero_grad()
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
            losses.append(mean.item())
            rl = torch.nn.functional.mse_loss(ref(x.to("neuron")), y.to("neuron"))
            ropt.zero_grad()
            rl.backward()
            ropt.step()
            ref_losses.append(rl.item())
    stats = torch.neuron.collective_stats()
    buckets = ddp._get_ddp_logging_data().get("num_buckets_reduced", None)
    out = {"losses": losses, "ref_losses": ref_losses, "stats": stats, "buckets": buckets,
           "weights": [_cpu(p) for p in model.parameters()], "ref_weights": [_cpu(p) for p in ref.parameters()],
           "records": len([r for r in prof.records if r.track == "collectives"])}
    dist.destroy_process_group()
    return out


def job_sleep(rank, world):
    """Never finishes in time (the harness's own timeout test)."""
    import time

    time.sleep(300)
