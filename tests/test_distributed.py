# torch.distributed on the neuron device: the `neuron` backend's collectives, timing, faults and DDP, in real processes.
"""Tests of :mod:`tn.distributed` with real ranks (spawned processes on loopback, ``tests/dist_workers.py``).

Each multi-rank job runs once per module (fixtures) and the tests check its
results against values computed here; every job has a hard timeout, so a
hang fails instead of blocking the suite. DDP training runs are ``slow``.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tn
import dist_workers as W

WORLD = 2


@pytest.fixture(scope="module")
def coll():
    reports, _ = W.run_ranks(W.job_collectives, WORLD, timeout=240)
    return W.ok(reports)


def _base(r):
    return torch.arange(6.).reshape(2, 3) + r


# ------------------------------------------------------------------ registration (in this process, no ranks)
def test_backend_registered_for_the_neuron_device():
    assert "neuron" in dist.Backend.backend_list
    assert dist.Backend.default_device_backend_map["neuron"] == "neuron"
    assert dist.Backend.backend_capability["neuron"] == ["neuron"]
    plugin = dist.Backend._plugins["NEURON"]
    assert plugin.extended_api and plugin.creator_fn is tn.distributed.backend.create
    assert torch.neuron.collective_stats is tn.distributed.collective_stats


def test_backend_none_resolves_to_neuron():
    cfg = dist.distributed_c10d.BackendConfig(dist.Backend(dist.Backend.UNDEFINED))
    assert {k: str(v) for k, v in cfg.get_device_backend_map().items()} == {"neuron": "neuron"}
    cfg = dist.distributed_c10d.BackendConfig(dist.Backend("cpu:gloo,neuron:neuron"))
    assert {k: str(v) for k, v in cfg.get_device_backend_map().items()} == {"cpu": "gloo", "neuron": "neuron"}


# ------------------------------------------------------------------ collectives (one 2-rank job)
def test_group_identity(coll):
    for r, R in enumerate(coll):
        assert R["backend"] == "neuron"
        assert R["device_count"] == 1          # one process per core: the rank's core is its neuron:0
        assert R["cores"] == [0, 1]
        assert R["device_types"] == ["neuron"]


def test_all_reduce_ops(coll):
    b = [_base(r) for r in range(WORLD)]
    want = {"AVG": sum(b) / WORLD, "MAX": torch.maximum(*b), "MIN": torch.minimum(*b), "PRODUCT": b[0] * b[1]}
    for R in coll:
        torch.testing.assert_close(R["sum"], torch.full((3, 4), float(sum(range(1, WORLD + 1)))))
        for name, w in want.items():
            torch.testing.assert_close(R[name], w, msg=name)
        assert torch.equal(R["int_sum"], sum(torch.arange(5) * (r + 2) for r in range(WORLD)))
        assert R["bf16_sum"].dtype == torch.bfloat16
        torch.testing.assert_close(R["bf16_sum"].float(), torch.tensor([1.5, -2.25, 3.0]) * 3)


def test_all_reduce_of_a_strided_view_writes_only_the_view(coll):
    for R in coll:
        whole, contiguous = R["strided"]
        assert not contiguous
        want = torch.zeros(4, 6)
        want[:, ::2] = 3.0
        assert torch.equal(whole, want)


def test_all_gather_variants(coll):
    for R in coll:
        for r in range(WORLD):
            assert torch.equal(R["all_gather"][r], _base(r))
        assert torch.equal(R["all_gather_into_tensor"], torch.cat([_base(r) for r in range(WORLD)]))
        a, b = R["all_gather_coalesced"]
        assert torch.equal(a, torch.tensor([0., 0., 1., 1.]))
        assert torch.equal(b, torch.cat([torch.full((3, 2), 10. + r) for r in range(WORLD)]))


def test_reduce_scatter_variants(coll):
    for r, R in enumerate(coll):
        assert torch.equal(R["reduce_scatter"], torch.full((2,), float(sum((q + 1) * 10 + r for q in range(WORLD)))))
        full = sum(torch.arange(2. * WORLD * 3).reshape(2 * WORLD, 3) + q for q in range(WORLD)) / WORLD
        torch.testing.assert_close(R["reduce_scatter_tensor_avg"], full[2 * r:2 * r + 2])
        o1, o2 = R["reduce_scatter_coalesced"]
        assert torch.equal(o1, sum(torch.arange(float(WORLD)) + q for q in range(WORLD))[r:r + 1])
        assert torch.equal(o2, torch.full((2,), float(sum(q + 1 for q in range(WORLD)))))


def test_all_reduce_coalesced_broadcast_send_recv(coll):
    for r, R in enumerate(coll):
        x1, x2 = R["all_reduce_coalesced"]
        assert torch.equal(x1, torch.full((2,), 3.)) and torch.equal(x2, torch.full((3,), 5.))
        assert torch.equal(R["broadcast"], torch.full((3,), 6.))   # rank 1's value 1 + 5
    assert torch.equal(coll[1]["recv"], torch.arange(5.) * 7)


def test_all_to_all_even_uneven_and_lists(coll):
    for r, R in enumerate(coll):
        for j in range(WORLD):
            assert torch.equal(R["all_to_all"][j], torch.full((j + r + 1,), float(10 * j + r)))
        want = torch.cat([(torch.arange(2. * WORLD) + 100 * j)[2 * r:2 * r + 2] for j in range(WORLD)])
        assert torch.equal(R["all_to_all_single"], want)
        want = torch.cat([torch.full((j + r + 1, 2), float(100 * j + r)) for j in range(WORLD)])
        assert torch.equal(R["all_to_all_uneven"], want)


def test_async_work_and_future(coll):
    for R in coll:
        completed, waited, fut_value, tensor = R["async"]
        assert completed is True and waited is True
        assert torch.equal(fut_value, torch.full((4,), 3.)) and torch.equal(tensor, fut_value)


def test_functional_collectives(coll):
    for r, R in enumerate(coll):
        F = R["functional"]
        assert torch.equal(F["all_reduce"], torch.full((3,), 3.))
        assert torch.equal(F["all_gather_tensor"], torch.tensor([0., 0., 1., 1.]))
        assert torch.equal(F["reduce_scatter_tensor"], (torch.arange(2. * WORLD) * 3)[2 * r:2 * r + 2])
        assert torch.equal(F["all_to_all_single"], torch.tensor([float(r), 10. + r]))
        assert torch.equal(F["raw_avg"], torch.full((2,), 1.5))
        assert torch.equal(F["broadcast"], torch.full((2,), 8.))
        a, b = F["all_reduce_coalesced"]
        assert torch.equal(a, torch.full((2,), 2.)) and torch.equal(b, torch.full((3,), 3.))
        a, b = F["all_gather_coalesced"]
        assert torch.equal(a, torch.tensor([0., 1.])) and torch.equal(b, torch.tensor([5., 5., 6., 6.]))
        a, b = F["reduce_scatter_coalesced"]
        assert torch.equal(a, torch.tensor([2. * r + 1])) and torch.equal(b, torch.full((2,), 2.))
        gathered, grad = F["autograd_all_gather"]   # backward of all-gather is a reduce-scatter of the grads
        assert torch.equal(gathered, torch.tensor([2., 2., 4., 4.]))
        weights = torch.arange(1., 2 * WORLD + 1)
        assert torch.equal(grad, 2 * WORLD * weights[2 * r:2 * r + 2])


def test_collectives_in_a_compiled_program(coll):
    # tn.jit of matmul -> all_reduce and all_gather on the neuron group "0": bytes move between the ranks
    for R in coll:
        total, gathered = R["compiled"]
        torch.testing.assert_close(total, torch.full((2, 2), 2. * (1 + 4)))
        torch.testing.assert_close(gathered, torch.tensor([[2., 2.], [2., 2.], [3., 3.], [3., 3.]]))


def test_object_collectives_and_new_group(coll):
    for R in coll:
        assert R["all_gather_object"] == [{"rank": r, "s": "x" * (r + 3)} for r in range(WORLD)]
        assert R["broadcast_object_list"] == ["from 1", 11]
        t, backend = R["new_group"]
        assert torch.equal(t, torch.full((2,), 3.)) and backend == "neuron"


def test_collectives_are_timed_recorded_and_overlap_compute(coll):
    from tn.neuron.collectives import collective_ns
    from tn.neuron.machine import machine

    for R in coll:
        (core, name, start, end, nbytes, track), = R["profile"]["records"]
        assert (core, name, nbytes, track) == (0, "all_reduce", 64 * 1024 * 4, "collectives")
        assert end - start == pytest.approx(collective_ns("all_reduce", machine(), nbytes, [0, 1]))
        (a_start, a_ns), (b_start, b_ns), (c_start, c_ns) = R["profile"]["runs"]
        assert start == pytest.approx(a_start + a_ns)       # starts when the issuing stream's work is done
        assert b_start < end                                 # the next program overlaps the collective
        assert c_start >= end                                # work after wait() waits for it
        stats = R["stats"]
        assert stats["all_reduce"]["calls"] >= 10 and stats["all_reduce"]["bytes"] >= nbytes
        for op in ("all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all_single",
                   "barrier", "reduce_scatter_tensor_coalesced", "all_reduce_coalesced"):
            assert stats[op]["calls"] >= 1 and stats[op]["modelled_ns"] > 0, op


# ------------------------------------------------------------------ faults: an exception on every surviving rank
@pytest.fixture(scope="module")
def faults():
    env = [{"TN_VISIBLE_CORES": "0,1"}, {"TN_VISIBLE_CORES": "2,3"}]   # each rank sees two devices
    reports, _ = W.run_ranks(W.job_faults, WORLD, timeout=240, env=env)
    return W.ok(reports)


def test_visible_cores_set_by_the_user_are_kept_and_backend_none_is_neuron(faults):
    for R in faults:
        assert R["device_count"] == 2 and R["cores"] == [0, 2]
        assert R["group_type"] == "ProcessGroupNeuron"


def test_premul_sum(faults):
    for r, R in enumerate(faults):
        t, out = R["premul_sum"]
        assert torch.equal(t, torch.full((3,), 0.5 * 3)) and torch.equal(out, torch.full((1,), 0.25 * 3))


@pytest.mark.parametrize("case, words", [
    ("shape", ["[3]", "[4]", "dtype/shape"]), ("dtype", ["torch.float32", "torch.float64"]),
    ("op", ["operation", "all_reduce", "broadcast"]), ("root", ["broadcast"]),
    ("splits", ["split sizes", "in_splits=[2, 1]"])])
def test_mismatched_calls_raise_on_every_rank(faults, case, words):
    for R in faults:
        kind, msg = R[case]
        assert kind == "CollectiveMismatchError"
        assert "rank 0" in msg and "rank 1" in msg and all(w in msg for w in words), msg
        assert torch.equal(R["after_mismatch"], torch.full((2,), 2.))   # the group still works after


def test_tensor_of_another_device_raises(faults):
    for R in faults:
        kind, msg = R["cpu_tensor"]
        assert kind == "WrongDeviceError" and "CPU tensor" in msg and "cpu:gloo,neuron:neuron" in msg
        kind, msg = R["other_device"]
        assert kind == "WrongDeviceError" and "neuron:1" in msg and "neuron:0" in msg


def test_use_after_destroy_raises(faults):
    for R in faults:
        assert R["after_destroy_default"][0] == "ValueError"      # torch's own: no default group
        for case in ("after_destroy_handle", "after_destroy_group_arg"):
            kind, msg = R[case]
            assert kind == "ProcessGroupDestroyedError" and "destroy_process_group" in msg


def test_dead_and_stalled_ranks_raise_within_the_timeout():
    reports, codes = W.run_ranks(W.job_rank_dies_and_stalls, 3, timeout=240, expect_exit=(2,))
    assert codes[2] == 7 and 2 not in reports
    R0, R1 = W.ok({0: reports[0], 1: reports[1]})
    for R in (R0, R1):   # rank 2 died: both survivors raise, at once (gloo sees the closed connection)
        assert R["died"][0] == "CollectiveError" and "died" in R["died"][1]
        assert R["died_again"][0] == "CollectiveError"
        assert R["died_seconds"] < 3.0 + 5.0
        assert torch.equal(R["pair"], torch.full((2,), 6.))   # a group without the dead rank still works
    kind, msg = R0["stalled"]                       # rank 1 stopped calling: rank 0 raises after the 3 s timeout
    assert kind == "CollectiveError" and "3 s" in msg
    assert 2.5 < R0["stalled_seconds"] < 3.0 + 5.0


# ------------------------------------------------------------------ torchrun
def test_torchrun_two_ranks(tmp_path):
    import json
    import os
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parent / "dist_torchrun_script.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", TN_NO_WARMUP="1")
    for k in ("TN_VISIBLE_CORES", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, o in enumerate(outs):
        assert (o["rank"], o["world"], o["local_rank"], o["backend"]) == (r, 2, r, "neuron")
        assert o["device_count"] == 1 and o["cores"] == [0, 1]
        assert o["weights_equal_across_ranks"]
        assert o["all_reduce_calls"] >= 3 and o["records"] >= 3
        assert not [t for t in o["threads_after_destroy"] if "gloo" in t], o["threads_after_destroy"]
    assert outs[0]["losses"] != outs[1]["losses"]   # each rank saw its own data
    merged = tn.profile.merge_traces([tmp_path / f"rank{r}.trace.json" for r in range(2)], tmp_path / "job.json")
    events = json.loads(pathlib.Path(merged).read_text())["traceEvents"]
    groups = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert any(g.startswith("rank0 neuron:0") for g in groups) and any(g.startswith("rank1 neuron:0") for g in groups)
    assert {e["pid"] // 10000 for e in events if e.get("name") == "all_reduce" and e.get("ph") == "X"} == {0, 1}


# ------------------------------------------------------------------ DDP training (slow)
def _check_ddp(world):
    reports, _ = W.run_ranks(W.job_ddp, world, timeout=600)
    results = W.ok(reports)
    for R in results:
        torch.testing.assert_close(torch.tensor(R["losses"]), torch.tensor(R["ref_losses"]), rtol=1e-4, atol=1e-5)
        for w, rw in zip(R["weights"], R["ref_weights"]):
            torch.testing.assert_close(w, rw, rtol=1e-4, atol=1e-5)
        assert R["stats"]["all_reduce"]["calls"] >= 2 * 6     # gradient buckets and the loss average
        assert R["records"] >= R["stats"]["all_reduce"]["calls"]
    for R in results[1:]:
        assert R["losses"] == results[0]["losses"]


@pytest.mark.slow
def test_ddp_two_ranks_matches_single_device():
    _check_ddp(2)


@pytest.mark.slow
def test_ddp_four_ranks_matches_single_device():
    _check_ddp(4)


def test_harness_kills_ranks_that_hang():
    import time

    t0 = time.monotonic()
    with pytest.raises(tn.distributed.spawn.RanksTimeout, match=r"ranks \[0\] did not report within 10"):
        W.run_ranks(W.job_sleep, 1, timeout=10)
    assert time.monotonic() - t0 < 10 + 20
