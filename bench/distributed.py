# bench/distributed.py: modelled all-reduce bus bandwidth over sizes and ranks; simulated rows through the neuron backend.
"""Print the all-reduce bus-bandwidth table of :mod:`tn.neuron.collectives` (every row is modelled, not
measured: the ring model over :func:`tn.neuron.machine.machine`). ``--json PATH`` writes the rows.

``--simulate`` also runs real ranks (2 and 4 spawned processes on trn2.3xlarge, the ``neuron``
torch.distributed backend, bytes over gloo on loopback): each all-reduce's modelled time as the backend
placed it in ``tn.profile()`` beside the analytic model (they must agree within 5%), the host wall time of
the collective (min and median of 5), and one DDP step of a small MLP (modelled compute, collectives,
exposed communication = step span minus compute, host wall time)."""
import argparse
import json
import statistics
import time

from tabulate import tabulate

from tn.neuron import collectives as C
from tn.neuron.machine import machine

SIZES = [1 << 10, 1 << 20, 1 << 24, 1 << 28]
RANKS = [2, 4, 8, 16, 64]


def rows():
    """One row per (instance, ranks, bytes): modelled µs and bus bandwidth GB/s."""
    out = []
    for name in ("trn2.48xlarge", "trn1.32xlarge"):
        one = machine(name)
        for n in RANKS:
            m = one if n <= one.device_count else machine(name, instances=-(-n // one.device_count))
            for nb in SIZES:
                ns = C.collective_ns("all_reduce", m, nb, list(range(n)))
                out.append({"instance": name, "ranks": n, "bytes": nb, "us": ns / 1e3,
                            "busbw_GBps": C.bus_bandwidth("all_reduce", nb, ns, n) / 1e9, "kind": "modelled"})
    return out


SIM_SIZES = [1 << 10, 1 << 20, 1 << 24]
SIM_RANKS = [2, 4]
REPS = 5


def _sim_job(rank, world):
    """One rank of the simulated rows: all-reduces of SIM_SIZES, then a DDP step (runs in a spawned process)."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import tn

    dist.init_process_group("neuron", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    out = {"cores": dist.group.WORLD.cores, "all_reduce": [], "ddp": None}
    for nb in SIM_SIZES:
        t = torch.ones(nb // 4, device="neuron")
        dist.all_reduce(t)
        walls, modelled = [], []
        for _ in range(REPS):
            dist.barrier()
            with tn.profile() as prof:
                w0 = time.perf_counter()
                dist.all_reduce(t)
                walls.append(time.perf_counter() - w0)
            modelled.append(sum(r.dur_ns for r in prof.records if r.name == "all_reduce"))
        out["all_reduce"].append({"bytes": nb, "modelled_ns": statistics.median(modelled), "host_s": walls})
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(3) for m in (torch.nn.Linear(256, 256), torch.nn.GELU())])
    ddp = DDP(model.to("neuron"), bucket_cap_mb=0.25)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(32, 256).to("neuron")

    def step():
        loss = ddp(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch.neuron.synchronize()

    step()
    walls = []
    for _ in range(REPS):
        dist.barrier()
        with tn.profile() as prof:
            w0 = time.perf_counter()
            step()
            walls.append(time.perf_counter() - w0)
    starts = [r.start_ns for r in prof.runs] + [r.start_ns for r in prof.records]
    ends = [r.start_ns + r.total_ns for r in prof.runs] + [r.end_ns for r in prof.records]
    compute = sum(r.total_ns for r in prof.runs)
    coll = sum(r.dur_ns for r in prof.records if r.track == "collectives")
    span = max(ends) - min(starts)
    out["ddp"] = {"compute_ns": compute, "collective_ns": coll, "step_ns": span,
                  "exposed_ns": max(0.0, span - compute), "host_s": walls,
                  "buckets": sum(1 for r in prof.records if r.name == "all_reduce")}
    dist.destroy_process_group()
    return out


def simulated_rows():
    """Rows of the simulated runs (rank 0's view) with the analytic model beside them."""
    from tn.distributed.spawn import results_of, run_ranks

    ar, ddp = [], []
    for n in SIM_RANKS:
        res = results_of(run_ranks(_sim_job, n, timeout=900)[0])[0]
        m = machine()
        for x in res["all_reduce"]:
            model = C.collective_ns("all_reduce", m, x["bytes"], res["cores"])
            ar.append({"ranks": n, "bytes": x["bytes"], "simulated_us": x["modelled_ns"] / 1e3,
                       "modelled_us": model / 1e3, "agree": abs(x["modelled_ns"] - model) <= 0.05 * model,
                       "busbw_GBps": C.bus_bandwidth("all_reduce", x["bytes"], x["modelled_ns"], n) / 1e9,
                       "host_min_ms": min(x["host_s"]) * 1e3,
                       "host_median_ms": statistics.median(x["host_s"]) * 1e3, "kind": "simulated"})
        d = res["ddp"]
        ddp.append({"ranks": n, "compute_us": d["compute_ns"] / 1e3, "collective_us": d["collective_ns"] / 1e3,
                    "exposed_us": d["exposed_ns"] / 1e3, "step_us": d["step_ns"] / 1e3, "buckets": d["buckets"],
                    "host_min_ms": min(d["host_s"]) * 1e3, "host_median_ms": statistics.median(d["host_s"]) * 1e3,
                    "kind": "simulated"})
    return ar, ddp


def main():
    """Print the table; verdict fails if the model stops being monotone in bytes (or, with --simulate, if the
    backend's placed times disagree with the model by more than 5%)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--simulate", action="store_true", help="also run 2 and 4 real ranks through the backend")
    a = ap.parse_args()
    r = rows()
    print(tabulate([[x["instance"], x["ranks"], x["bytes"], f"{x['us']:.2f}", f"{x['busbw_GBps']:.2f}", x["kind"]]
                    for x in r], headers=["instance", "ranks", "bytes", "all-reduce µs", "busbw GB/s", "kind"]))
    ok = all(r[i]["us"] < r[i + 1]["us"] for i in range(len(r) - 1) if r[i]["ranks"] == r[i + 1]["ranks"]
             and r[i]["instance"] == r[i + 1]["instance"])
    print("verdict:", "ok (time grows with bytes)" if ok else "FAIL: time not monotone in bytes")
    doc = {"modelled": r}
    if a.simulate:
        ar, ddp = simulated_rows()
        print()
        print(tabulate([[x["ranks"], x["bytes"], f"{x['simulated_us']:.2f}", f"{x['modelled_us']:.2f}",
                         f"{x['busbw_GBps']:.2f}", f"{x['host_min_ms']:.2f}", f"{x['host_median_ms']:.2f}"]
                        for x in ar], headers=["ranks (trn2.3xlarge)", "bytes", "simulated µs", "modelled µs",
                                               "busbw GB/s", "host min ms", "host median ms"]))
        print()
        print(tabulate([[x["ranks"], f"{x['compute_us']:.1f}", f"{x['collective_us']:.1f}",
                         f"{x['exposed_us']:.1f}", f"{x['step_us']:.1f}", x["buckets"], f"{x['host_min_ms']:.1f}",
                         f"{x['host_median_ms']:.1f}"] for x in ddp],
                       headers=["DDP MLP 3x256 ranks", "compute µs", "collective µs", "exposed µs", "step µs",
                                "all-reduces", "host min ms", "host median ms"]))
        agree = all(x["agree"] for x in ar)
        print("verdict:", "ok (simulated collectives agree with the model within 5%)" if agree
              else "FAIL: simulated and modelled collective times differ by more than 5%")
        ok = ok and agree
        doc.update(simulated_all_reduce=ar, simulated_ddp=ddp)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc if a.simulate else r, f, indent=1)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
