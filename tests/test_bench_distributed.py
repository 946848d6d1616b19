# Tests of bench/distributed.py: its analytic DDP/FSDP2 schedules on made-up timelines, and that --quick runs green.
"""The bench's models are pure functions of a one-rank timeline; these pin what they do with known inputs (modelled
numbers only, never host time). The slow test runs the bench's ``--quick`` mode (2 spawned ranks)."""
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_distributed", ROOT / "bench" / "distributed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ddp_model_hides_early_buckets_and_waits_for_the_last():
    D = _bench()
    C = D.C
    nb = 8 << 20
    one = D.ddp_model({"buckets": [(0.0, nb)], "bwd_end_ns": 1e6, "span_ns": 1.2e6, "compute_ns": 1.2e6}, 1)
    assert one["step_ns"] == 1.2e6 and one["collective_ns"] == 0.0
    ar = C.collective_ns("all_reduce", D.machine_for(8), nb, list(range(8)))
    early = D.ddp_model({"buckets": [(0.0, nb)], "bwd_end_ns": 1e6, "span_ns": 1.2e6, "compute_ns": 1.2e6}, 8)
    assert early["step_ns"] == 1.2e6 and early["collective_ns"] == pytest.approx(ar)   # hidden under the backward
    late = D.ddp_model({"buckets": [(0.5e6, nb), (1e6, nb)], "bwd_end_ns": 1e6, "span_ns": 1.2e6,
                        "compute_ns": 1.2e6}, 8)
    assert late["step_ns"] == pytest.approx(1.2e6 + ar)    # the last bucket starts at the end of backward
    row = D._row("w", "DDP", "modelled", 8, 1.2e6, late["collective_ns"], late["step_ns"], 1.2e6, 2 * nb)
    assert row["exposed_us"] == pytest.approx(ar / 1e3) and row["efficiency"] == pytest.approx(1.2e6 / (1.2e6 + ar))
    assert row["busbw_GBps"] == pytest.approx(C.bus_bandwidth("all_reduce", 2 * nb, 2 * ar, 8) / 1e9)
    assert row["link"] == "neuronlink"     # 8 logical cores of trn2.48xlarge span two chips


def test_fsdp_model_stalls_on_all_gathers_it_cannot_prefetch():
    D = _bench()
    names = ["transformer.wte.weight", "transformer.h.0.w", "transformer.h.1.w", "transformer.ln_f.weight"]
    big = 64 << 20
    cs = {"names": names, "numel": [1024, big, big, 1024], "itemsize": 2,
          # forward reads: root at 0, block 0 at 10 us, block 1 at 20 us; loss at 40 us
          "reads": [[0.0], [10e3], [20e3], [30e3]], "loss_ready": 40e3,
          "grad_ready": [100e3, 90e3, 60e3, 50e3], "fwd_bwd_ns": 100e3, "opt_ns": 8e3}
    root, blocks = D.fsdp_units(names)
    assert root == [0, 3] and blocks == [[1], [2]]
    f = D.fsdp_model(cs, 8)
    m, cores = D.machine_for(8), list(range(8))
    ag = D.C.collective_ns("all_gather", m, 2 * big, cores)
    assert ag > 10e3     # each block's all-gather is longer than the compute it can hide under
    assert f["step_ns"] > cs["fwd_bwd_ns"] + cs["opt_ns"] / 8 + ag
    assert f["exposed"]["forward all-gathers"] > 0 and f["exposed"]["backward all-gathers"] > 0
    assert f["bytes"]["reduce_scatter"] == 2 * sum(cs["numel"])
    assert f["compute_ns"] == pytest.approx(cs["fwd_bwd_ns"] + cs["opt_ns"] / 8)


@pytest.mark.slow
def test_bench_quick_runs_green(tmp_path):
    out = tmp_path / "dist.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "distributed.py"), "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "FAIL" not in r.stdout and "verdict: ok" in r.stdout
    doc = json.loads(out.read_text())
    assert [c["cores"] for c in doc["agreement"]] == [2] and all(c["agree"] for c in doc["agreement"])
    methods = {(x["method"], x["cores"]) for x in doc["scaling"]}
    assert ("simulated", 2) in methods and ("modelled", 8) in methods and ("one rank", 1) in methods
