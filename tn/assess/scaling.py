# `tn assess --cores N`: how a training step scales over NeuronCores with DDP, simulated on real ranks and modelled.
"""Data-parallel scaling of the assessed training step.

Weak scaling, as a DDP job runs it: every core takes the example batch,
computes the same step and DDP all-reduces the gradients in buckets while
the backward runs. Two methods, reported side by side:

* **simulated** (:func:`simulate`): ``k`` real ranks (``k = min(N, 4)`` by
  default; spawned processes on loopback, ``backend="neuron"``), each on its
  own modelled core, run the step under ``DistributedDataParallel``; the
  collectives move the bytes and are timed on each core's collectives
  resource (:mod:`tn.distributed`). Since every rank runs the same batch, the
  averaged gradients must equal the CPU reference's: every rank's loss and
  gradients are compared with it. Rank 0's profile gives compute, collective
  and exposed (not overlapped) time of the step.
* **modelled** (:func:`modelled_rows`): one core's compute (forward and
  backward) from the simulated run or the eager door, DDP's buckets (the
  first 1 MiB, then 25 MiB, filled in reverse parameter order) ready at the
  point of the backward where their gradients are done (gradients assumed to
  come at an even rate in bytes), each bucket's all-reduce on the ring of the
  first ``n`` cores (:func:`tn.neuron.collectives.collective_ns`), one bucket
  at a time. Rows for 1, 2, 4, ... N cores, past one instance over EFA.

Efficiency is one core's step time over the ``n``-core step time (weak
scaling: 100% means the collectives hide entirely behind the backward). The
optimizer step is not part of the step (as in the doors).
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import io
import math
import os
import statistics
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import tn

from .. import config
from ..distributed.spawn import RanksTimeout, run_ranks
from ..neuron import collectives as C
from ..neuron.machine import machine
from .doors import _autocast, _cpu_leaves, _disable_dropout, _grads, _loss_of, _to, compare, error_info
from .html import runs_data
from .runner import ProgressBar
from .target import import_file as _import

__all__ = ["simulate", "modelled_rows", "ddp_buckets", "bucket_schedule", "SIMULATE_MAX_RANKS",
           "DDP_BUCKET_BYTES", "DDP_FIRST_BUCKET_BYTES"]

#: Ranks simulated by default at most (each is a process holding the model; this machine class has 2 cores).
SIMULATE_MAX_RANKS = 4
#: DDP's defaults: ``bucket_cap_mb=25`` and a first bucket of 1 MiB (``dist._DEFAULT_FIRST_BUCKET_BYTES``).
DDP_BUCKET_BYTES = 25 * 1024 * 1024
DDP_FIRST_BUCKET_BYTES = 1024 * 1024


def ddp_buckets(grad_bytes: List[int], cap: int = DDP_BUCKET_BYTES,
                first_cap: int = DDP_FIRST_BUCKET_BYTES) -> List[int]:
    """Bytes per DDP bucket for gradients of ``grad_bytes`` (in parameter order), as DDP's reducer assigns them:
    in reverse order, each tensor joins the open bucket, which closes once it holds at least its limit
    (``first_cap`` for the first bucket, ``cap`` after)."""
    buckets: List[int] = []
    cur, limit = 0, first_cap
    for b in reversed(grad_bytes):
        cur += b
        if cur >= limit:
            buckets.append(cur)
            cur, limit = 0, cap
    if cur:
        buckets.append(cur)
    return buckets


def bucket_schedule(buckets: List[int], forward_ns: float, backward_ns: float,
                    all_reduce_ns: Callable[[int], float]) -> Dict[str, float]:
    """Modelled DDP step: bucket ``i`` is ready when the backward has produced its bytes (even rate), its
    all-reduce starts when it is ready and the previous one finished; returns compute, collective, step and
    exposed ns (exposed: step minus compute)."""
    total = float(sum(buckets)) or 1.0
    compute = forward_ns + backward_ns
    end, done, coll = forward_ns, 0.0, 0.0
    for b in buckets:
        done += b
        ready = forward_ns + backward_ns * done / total
        ns = all_reduce_ns(b)
        end = max(end, ready) + ns
        coll += ns
    step = max(compute, end) if buckets else compute
    return {"compute_ns": compute, "collective_ns": coll, "step_ns": step, "exposed_ns": step - compute,
            "buckets": len(buckets)}


def _core_counts(cores: int) -> List[int]:
    out, n = [], 1
    while n < cores:
        out.append(n)
        n *= 2
    return out + [cores]


def modelled_rows(cores: int, forward_ns: float, backward_ns: float, grad_bytes: List[int],
                  instance: Optional[str] = None, lnc: Optional[int] = None) -> List[Dict[str, Any]]:
    """One row per core count 1, 2, 4, ... ``cores`` of the modelled DDP step (see the module docstring); core
    counts past one instance span several (EFA between them)."""
    base = machine(instance=instance, lnc=lnc)
    buckets = ddp_buckets(grad_bytes)
    one = bucket_schedule(buckets, forward_ns, backward_ns, lambda b: 0.0)["step_ns"]
    rows = []
    for n in _core_counts(cores):
        m = machine(instance=instance, lnc=lnc, instances=max(1, math.ceil(n / base.device_count)))
        ring = list(range(n))
        if n == 1:
            sched = bucket_schedule(buckets, forward_ns, backward_ns, lambda b: 0.0)
            busbw = link = None
        else:
            sched = bucket_schedule(buckets, forward_ns, backward_ns,
                                    lambda b: C.collective_ns("all_reduce", m, b, ring))
            big = max(buckets)
            busbw = C.bus_bandwidth("all_reduce", big, C.collective_ns("all_reduce", m, big, ring), n) / 1e9
            link = C.ring_step(m, ring)[1] / 1e9
        rows.append({"cores": n, "kind": "modelled", "instances": m.instances, **sched,
                     "efficiency": one / sched["step_ns"] if sched["step_ns"] else None,
                     "busbw_GBps": busbw, "link_GBps": link})
    return rows


def _rank_job(blob_path: str, import_file: Optional[str], overrides: Dict[str, Any], rank: int,
              world: int) -> Dict[str, Any]:
    """One rank of the simulated run (module level: the spawned ranks import it by name)."""
    if import_file:
        _import(import_file)
    with open(blob_path, "rb") as f:
        target, opts, ref, timeout = torch.load(io.BytesIO(f.read()), weights_only=False)

    with config.override(**overrides) if overrides else contextlib.nullcontext():
        dist.init_process_group("neuron", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=max(30.0, timeout)))
        try:
            model = target.model
            model.train(True)
            _disable_dropout(model)
            model = model.to("neuron")
            ddp = DDP(model)
            args, kwargs = _to(target.inputs, "neuron"), _to(target.kwargs, "neuron")
            marks: List[int] = []

            def step(prof=None):
                model.zero_grad(set_to_none=True)
                torch.manual_seed(opts.seed)
                with _autocast(opts, "neuron"):
                    loss = _loss_of(ddp(*args, **kwargs))
                torch.neuron.synchronize()
                if prof is not None:
                    marks.append(len(prof.runs))
                loss.backward()
                torch.neuron.synchronize()
                return _cpu_leaves([("loss", loss)] + _grads(model))

            first = step()
            rows = compare(ref, first, opts.dtype)
            walls = []
            for _ in range(max(1, opts.repeats)):
                dist.barrier()
                t0 = time.perf_counter()
                step()
                walls.append(time.perf_counter() - t0)
            dist.barrier()
            with tn.profile() as prof:
                last = step(prof)
            for a, b in zip(rows, compare(ref, last, opts.dtype)):
                if (b["ratio"] or 0) > (a["ratio"] or 0) or not b["ok"]:
                    a.update(b)
            runs, recs = prof.runs, prof.records
            coll = [x for x in recs if x.track == "collectives"]
            starts = [r.start_ns for r in runs] + [x.start_ns for x in coll]
            ends = [r.start_ns + r.total_ns for r in runs] + [x.end_ns for x in coll]
            fwd = sum(r.total_ns for r in runs[:marks[0]])
            compute = sum(r.total_ns for r in runs)
            span = (max(ends) - min(starts)) if starts else 0.0
            out = {"rank": rank, "core": int(dist.group.WORLD.cores[rank]), "outputs": rows,
                   "forward_ns": fwd, "backward_ns": compute - fwd, "compute_ns": compute,
                   "collective_ns": sum(x.dur_ns for x in coll), "step_ns": span,
                   "exposed_ns": max(0.0, span - compute), "buckets": sum(1 for x in coll if x.name == "all_reduce"),
                   "collectives": sorted({x.name for x in coll}), "host_s": walls,
                   "hbm_peak_bytes": int(torch.neuron.max_memory_allocated())}
            if rank == 0:
                out["timeline_runs"] = runs_data(runs)
            return out
        finally:
            dist.destroy_process_group()


def simulate(target: Any, opts: Any, ref: list, ranks: int, timeout: float, overrides: Dict[str, Any],
             import_file: Optional[str] = None, show: bool = True, stream: Any = None) -> Dict[str, Any]:
    """Run the training step under DDP on ``ranks`` spawned ranks (see the module docstring); a dict with
    ``status`` (ok / mismatch / error / timeout), per-rank results (``ranks``) and rank 0's breakdown. Never
    raises for the model's failure."""
    bar = ProgressBar(f"ddp x{ranks}", stream, show)
    bar.update(f"{ranks} ranks: serialising the model", 0.0)
    res: Dict[str, Any] = {"status": "error", "ranks_simulated": ranks, "error": None}
    t0 = time.perf_counter()
    fd, path = tempfile.mkstemp(prefix="tn-assess-ddp-", suffix=".pt")
    os.close(fd)
    try:
        try:
            torch.save((target, opts, ref, timeout), path)
        except Exception as e:  # noqa: BLE001  (an unpicklable model: say what to change)
            res["error"] = {"stage": "serialising the model", "type": type(e).__name__, "where": None,
                            "traceback": "", "message": "DDP ranks are fresh processes, so the model and inputs "
                            f"must pickle (classes defined at module level, not inside a function): {e}"}
            bar.finish("FAIL: error at serialising the model")
            return res
        job = functools.partial(_rank_job, path, import_file, dict(overrides))
        box: Dict[str, Any] = {}

        def work():
            try:
                # DDP's C++ logger warns once per rank that it times CPU/CUDA only: not the user's concern
                box["reports"] = run_ranks(job, ranks, timeout=timeout, env={"TORCH_CPP_LOG_LEVEL": "ERROR"})[0]
            except BaseException as e:  # noqa: BLE001  (reported below)
                box["error"] = e

        th = threading.Thread(target=work, daemon=True)
        th.start()
        stage = f"{ranks} ranks: DDP steps (spawn, warm-up, {max(1, opts.repeats)} timed, profiled)"
        while th.is_alive():
            th.join(0.25)
            bar.update(stage, min(0.9, (time.perf_counter() - t0) / max(timeout, 1.0)))
        if "error" in box:
            e = box["error"]
            res["status"] = "timeout" if isinstance(e, RanksTimeout) else "error"
            res["error"] = error_info(e, "DDP ranks")
        else:
            reports = box["reports"]
            bad = [r for r in sorted(reports) if reports[r][0] != "ok"]
            if bad:
                r = bad[0]
                msg = reports[r][1]
                res["error"] = {"stage": f"rank {r}", "type": msg.split(":", 1)[0], "where": None,
                                "message": msg[:2000], "traceback": reports[r][2][-6000:]}
            else:
                per = [reports[r][1] for r in sorted(reports)]
                res["ranks"] = [{k: v for k, v in p.items() if k != "timeline_runs"} for p in per]
                res["timeline_runs"] = per[0].get("timeline_runs", [])
                res.update({k: per[0][k] for k in ("forward_ns", "backward_ns", "compute_ns", "collective_ns",
                                                   "step_ns", "exposed_ns", "buckets", "collectives",
                                                   "hbm_peak_bytes")})
                walls = [w for p in per for w in p["host_s"]]
                res["host_s_min"], res["host_s_median"] = min(walls), statistics.median(walls)
                res["outputs"] = per[0]["outputs"]
                worst = [o for p in per for o in p["outputs"] if not o["ok"]]
                res["status"] = "ok" if not worst else "mismatch"
                if worst:
                    res["outputs"] = [o for p in per for o in p["outputs"] if not o["ok"]][:8]
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    res["wall_s"] = time.perf_counter() - t0
    bar.finish("ok" if res["status"] == "ok" else f"FAIL: {res['status']}"
               + (f" at {res['error']['stage']}" if res.get("error") else ""))
    return res
