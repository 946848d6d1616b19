# Tests of bench/distributed.py: its analytic DDP/FSDP2/TP models on made-up timelines, its verdicts, and --quick.
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


def _made_up_step():
    names = ["transformer.wte.weight", "transformer.h.0.w", "transformer.h.1.w", "transformer.ln_f.weight"]
    return {"names": names, "numel": [1024, 4096, 4096, 1024], "itemsize": 2, "reads": [[0.0], [10e3], [20e3], [30e3]],
            "loss_ready": 40e3, "grad_ready": [100e3, 90e3, 60e3, 50e3], "fwd_bwd_ns": 100e3, "opt_ns": 8e3}


def test_fsdp_model_takes_a_measured_sharded_update():
    D = _bench()
    cs = _made_up_step()
    assert D.fsdp_model(cs, 2)["compute_ns"] == pytest.approx(100e3 + 4e3)     # 1/n of the one-rank update
    cs["opt_shard_ns"] = {2: 7e3}                                               # eager: fixed cost per program
    assert D.fsdp_model(cs, 2)["compute_ns"] == pytest.approx(100e3 + 7e3)


def test_agreement_and_collective_verdicts_can_fail():
    D = _bench()
    assert D._agree("TP", 2, 104e3, 100e3, 10e3, 10e3)["agree"]
    assert not D._agree("TP", 2, 106e3, 100e3, 10e3, 10e3)["agree"]        # step off by 6%
    assert not D._agree("TP", 2, 100e3, 100e3, 11e3, 10e3)["agree"]        # collectives off by 10%
    cs = _made_up_step()
    L = D.SMALL["config"]["n_layer"]
    assert L == 2
    b = D.fsdp_model(cs, 2)["bytes"]
    good = {"all_gather_into_tensor": {"calls": 5, "bytes": b["all_gather"], "ns": 1.0},
            "reduce_scatter_tensor": {"calls": 3, "bytes": b["reduce_scatter"], "ns": 1.0}}
    one = {"plain": cs, "params": 0}
    assert D.small_verdicts(one, {("FSDP2", 2): good})[0][0]
    no_reshard = dict(good, all_gather_into_tensor={"calls": 3, "bytes": b["all_gather"] - 2 * 4096 * 2, "ns": 1.0})
    assert not D.small_verdicts(one, {("FSDP2", 2): no_reshard})[0][0]    # no backward all-gathers: FAIL
    k, act, _ = D.tp_allreduces(D.SMALL, 2)
    assert (k, act) == (4 * L, 8 * 128 * 128 * 2)
    assert D.small_verdicts(one, {("TP", 2): {"all_reduce": {"calls": k, "bytes": k * act, "ns": 1.0}}})[0][0]
    assert not D.small_verdicts(one, {("TP", 2): {"all_reduce": {"calls": k // 2, "bytes": k * act // 2,
                                                                   "ns": 1.0}}})[0][0]


def test_program_diff_names_the_programs_a_rank_adds():
    D = _bench()
    ns, text = D.program_diff({"tn_0_cat": [3, 20e3], "tn_0_mul": [5, 10e3]}, {"tn_0_mul": [5, 12e3]})
    assert ns == pytest.approx(18e3) and text.startswith("cat +3 runs +20.0 µs") and "mul +0 runs -2.0 µs" in text


def test_tp_rank_shards_add_up_to_the_full_layers():
    """The local models of tensor-parallel ranks (tp_rank_shard) hold the rank's heads and MLP columns: their
    attention and MLP outputs (row-parallel partial sums, the c_proj bias once) add up to the full model's."""
    import torch

    D = _bench()
    tp = 2
    full = D.gpt2_model(D.SMALL).float().eval()
    shards = [D.tp_rank_shard(D.gpt2_model(D.SMALL).float().eval(), tp, r) for r in range(tp)]
    x = torch.randn(2, 16, D.SMALL["config"]["n_embd"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        blk = full.transformer.h[0]
        locs = [s.transformer.h[0] for s in shards]
        assert locs[0].attn.c_attn.out_features == 3 * 128 // tp and locs[0].mlp.c_fc.out_features == 4 * 128 // tp
        want = blk.attn(x)[0]
        got = sum(lb.attn(x)[0] for lb in locs) - (tp - 1) * locs[0].attn.c_proj.bias
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        want = blk.mlp(x)
        got = sum(lb.mlp(x) for lb in locs) - (tp - 1) * locs[0].mlp.c_proj.bias
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_bench_quick_runs_green(tmp_path):
    out = tmp_path / "dist.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "distributed.py"), "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "FAIL" not in r.stdout and "verdict: ok" in r.stdout
    doc = json.loads(out.read_text())
    assert sorted((c["strategy"], c["cores"]) for c in doc["agreement"]) == [("DDP", 2), ("FSDP2", 2), ("TP", 2)]
    assert all(c["agree"] for c in doc["agreement"])
    methods = {(x["strategy"], x["method"], x["cores"]) for x in doc["scaling"]}
    for s in ("DDP", "FSDP2", "TP"):
        assert {(s, "simulated", 2), (s, "modelled", 2), (s, "one rank", 1)} <= methods
    assert ("DDP", "modelled", 8) in methods and ("FSDP2", "modelled", 8) in methods
