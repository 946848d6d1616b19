# Tests of `tn assess --cores`: DDP bucketing and its modelled schedule, modelled rows, real ranks against the CPU.
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from tn.assess import AssessError, cli, scaling
from tn.assess.doors import Options, reference
from tn.assess.target import Target
from tn.neuron import collectives as C
from tn.neuron.machine import machine


def test_ddp_buckets_are_the_reducers_buckets():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        numels = torch.randint(1, 400, (12,), generator=g).tolist()
        tensors = [torch.empty(n) for n in numels]
        first, cap = 1000, 3000
        # DDP's reducer buckets gradients in the order they become ready (reverse parameter order)
        idx, _ = dist._compute_bucket_assignment_by_size(list(reversed(tensors)), [first, cap], [False] * 12)
        want = [sum(4 * numels[len(numels) - 1 - i] for i in b) for b in idx]
        assert scaling.ddp_buckets([4 * n for n in numels], cap=cap, first_cap=first) == want


def test_bucket_schedule_hides_what_the_backward_covers():
    ar = lambda b: b / 10.0   # noqa: E731  (10 bytes per ns)
    # two equal buckets: the first is ready halfway through the backward and hides; the last is exposed
    s = scaling.bucket_schedule([500, 500], forward_ns=100.0, backward_ns=200.0, all_reduce_ns=ar)
    assert s["compute_ns"] == 300.0 and s["collective_ns"] == 100.0
    assert s["step_ns"] == 350.0 and s["exposed_ns"] == 50.0 and s["buckets"] == 2
    # collectives longer than the backward queue up behind each other
    s = scaling.bucket_schedule([500, 500], forward_ns=0.0, backward_ns=20.0, all_reduce_ns=ar)
    assert s["step_ns"] == 10.0 + 50.0 + 50.0
    # no communication: the step is the compute
    assert scaling.bucket_schedule([], 5.0, 7.0, ar)["step_ns"] == 12.0


def test_modelled_rows_scale_from_one_core_and_cross_instances():
    m = machine(instance="trn2.3xlarge", lnc=2)
    grads = [4 << 20] * 20   # 80 MiB of gradients
    rows = scaling.modelled_rows(2 * m.device_count, 1e6, 2e6, grads, instance="trn2.3xlarge", lnc=2)
    assert [r["cores"] for r in rows] == [1, 2, 4, 8][:len(rows)] and rows[-1]["cores"] == 2 * m.device_count
    assert rows[0]["efficiency"] == 1.0 and rows[0]["collective_ns"] == 0.0
    assert all(a["efficiency"] >= b["efficiency"] for a, b in zip(rows, rows[1:]))
    assert rows[-1]["instances"] == 2 and all(r["instances"] == 1 for r in rows[:-1])
    two = rows[1]
    bk = scaling.ddp_buckets(grads)
    assert two["collective_ns"] == pytest.approx(sum(C.collective_ns("all_reduce", m, b, [0, 1]) for b in bk))
    assert two["busbw_GBps"] > 0 and two["link_GBps"] > two["busbw_GBps"] * 0.5


def test_cli_checks_simulate_ranks_before_running(tmp_path, capsys):
    p = tmp_path / "t.py"
    p.write_text("import torch\ndef make():\n    return torch.nn.Linear(4, 4), (torch.randn(2, 4),)\n")
    assert cli.main([f"{p}:make", "--train", "--cores", "2", "--simulate-ranks", "1", "--quiet"]) == 2
    assert "--simulate-ranks 1" in capsys.readouterr().err
    assert cli.main([f"{p}:make", "--cores", "0", "--quiet"]) == 2
    assert "positive number of cores" in capsys.readouterr().err


def test_inference_with_cores_says_what_it_did():
    model = torch.nn.Linear(8, 8)
    import tn

    res = tn.assess(model, torch.randn(2, 8), doors="jit", cores=4, progress=False, repeats=1)
    assert res.scaling is None and any("--cores 4" in n and "--train" in n for n in res.notes)


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 128), torch.nn.Linear(128, 16)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class _BreaksUnderDistributed(_Mlp):
    def forward(self, x):
        if torch.distributed.is_initialized():
            raise ValueError("this model refuses to be distributed")
        return super().forward(x)


@pytest.mark.slow
def test_two_real_ranks_match_the_cpu_and_the_model(tmp_path):
    p = tmp_path / "t.py"
    p.write_text(f"import sys, torch\nsys.path.insert(0, {os.path.dirname(__file__)!r})\n"
                 "from test_assess_scaling import _Mlp\n"
                 "def make():\n    torch.manual_seed(0)\n    return _Mlp(), (torch.randn(16, 64),)\n")
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "tn", "assess", f"{p}:make", "--train", "--cores", "8",
                           "--simulate-ranks", "2", "--doors", "eager", "--repeats", "1", "--quiet", "--json",
                           str(out), "--html", str(tmp_path / "r.html")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "scales over cores?   DDP at 8 cores" in proc.stdout and "2 simulated ranks matched the CPU" in proc.stdout
    sc = json.loads(out.read_text())["scaling"]
    sim = sc["simulated"]
    assert sim["status"] == "ok" and len(sim["ranks"]) == 2
    assert {r["core"] for r in sim["ranks"]} == {0, 1} and sim["collectives"] == ["all_reduce"]
    assert all(o["ok"] for r in sim["ranks"] for o in r["outputs"])
    # the same step modelled analytically agrees with the one the ranks' cores timed
    assert abs(sc["simulated_vs_modelled"]) < 0.05
    assert [r["cores"] for r in sc["rows"] if r["kind"] == "modelled"] == [1, 2, 4, 8]
    assert 'id="scaling"' in (tmp_path / "r.html").read_text()


@pytest.mark.slow
def test_a_rank_that_fails_is_reported_with_its_error():
    torch.manual_seed(0)
    target = Target(_BreaksUnderDistributed(), (torch.randn(4, 64),), {}, "breaks")
    opts = Options(train=True, repeats=1)
    ref, _ = reference(target, opts)
    res = scaling.simulate(target, opts, ref, 2, timeout=120, overrides={}, import_file=os.path.abspath(__file__),
                           show=False)
    assert res["status"] == "error" and "refuses to be distributed" in res["error"]["message"]


def test_simulate_refuses_more_ranks_than_one_instance():
    with pytest.raises(AssessError, match="--simulate-ranks 9"):
        import tn

        tn.assess(torch.nn.Linear(4, 4), torch.randn(2, 4), train=True, cores=16, simulate_ranks=9,
                  instance="trn2.3xlarge", progress=False)
