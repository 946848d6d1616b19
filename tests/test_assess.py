# Tests of tn assess: comparisons, timelines, door processes (failure, crash, timeout), the CLI's bad inputs, HF heads.
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import tn
from tn.assess import AssessError, cli
from tn.assess.doors import Options, compare, named_leaves
from tn.assess.html import runs_data, timeline_boxes
from tn.assess.runner import run_in_child
from tn.assess.target import hf_inputs, load_file_factory, load_hf

HERE = os.path.abspath(__file__)


class LstsqModel(torch.nn.Module):
    """A Linear then a float64 least-squares solve: only float32 lstsq is decomposed, so a host op on the device,
    and with no meta kernel untraceable in tn.jit. (FFTs, then float32 lstsq, were this example until they
    became core ops.)"""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        y = torch.linalg.lstsq(self.lin(x).double(), x.double()).solution.float()   # HOST_LINE
        return y * 2


HOST_LINE = f"{HERE}:{next(i for i, s in enumerate(open(HERE), 1) if s.rstrip().endswith('# HOST_LINE'))}"


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))


# --------------------------------------------------------------------------- comparisons


def test_compare_passes_close_values_and_fails_a_wrong_one():
    ref = [("y", torch.linspace(-3, 3, 100))]
    close = [("y", ref[0][1] + 1e-6)]
    rows = compare(ref, close, "fp32")
    assert rows[0]["ok"] and 0 < rows[0]["ratio"] < 1
    wrong = ref[0][1].clone()
    wrong[17] += 1e-3   # one element off by 1e-3: far outside fp32 tolerance (1e-4 rel, 3e-5 abs here)
    rows = compare(ref, [("y", wrong)], "fp32")
    assert not rows[0]["ok"] and rows[0]["ratio"] > 1
    assert rows[0]["max_abs_err"] == pytest.approx(1e-3, rel=1e-3)
    # the same error is fine for bf16
    assert compare(ref, [("y", wrong)], "bf16")[0]["ok"]


def test_compare_nan_pattern_shape_and_missing_outputs():
    r = torch.tensor([1.0, float("nan"), 3.0])
    assert compare([("y", r)], [("y", r.clone())], "fp32")[0]["ok"]
    bad = torch.tensor([1.0, 2.0, 3.0])
    row = compare([("y", r)], [("y", bad)], "fp32")[0]
    assert not row["ok"] and "NaN" in row["note"]
    assert not compare([("y", r)], [("y", torch.zeros(4))], "fp32")[0]["ok"]
    assert not compare([("y", r)], [], "fp32")[0]["ok"]
    ints = torch.arange(4)
    assert compare([("i", ints)], [("i", ints.clone())], "fp32")[0]["ok"]
    assert not compare([("i", ints)], [("i", ints + 1)], "fp32")[0]["ok"]


def test_gradients_are_summarised_in_one_row_naming_the_worst():
    ref = [("loss", torch.tensor(1.0)), ("grad a", torch.ones(3)), ("grad b", torch.ones(3))]
    got = [("loss", torch.tensor(1.0)), ("grad a", torch.ones(3)), ("grad b", torch.ones(3) * 1.1)]
    rows = compare(ref, got, "fp32")
    assert [r["output"].split(" (")[0] for r in rows] == ["loss", "gradients"]
    assert "worst: b" in rows[1]["output"] and not rows[1]["ok"]


def test_named_leaves_of_nested_outputs():
    out = {"logits": torch.zeros(2), "aux": (torch.ones(1), [torch.ones(2)]), "n": 3}
    assert [n for n, _ in named_leaves(out)] == ["logits", "aux[0]", "aux[1][0]"]


# --------------------------------------------------------------------------- timeline


def test_timeline_merges_short_instructions_and_counts_every_one():
    f = tn.jit(_mlp())
    with torch.no_grad(), tn.profile() as prof:
        f(torch.randn(128, 32))
        f(torch.randn(128, 32))
    runs = runs_data(prof.runs)
    n = sum(len(r["opcodes"]) for r in runs)
    full = timeline_boxes(runs, resolution=10 ** 9)   # nothing shorter than span/1e9: every instruction drawn
    assert sum(b[4] for b in full["boxes"] if b[3] != "program") == n == full["instructions"]
    assert len([b for b in full["boxes"] if b[3] != "program"]) == n
    coarse = timeline_boxes(runs, resolution=20)
    boxes = [b for b in coarse["boxes"] if b[3] != "program"]
    assert sum(b[4] for b in boxes) == n and len(boxes) < n
    assert {"TensorE", "programs"} <= set(coarse["lanes"])
    span = sum(r["total_ns"] for r in runs)
    assert all(0 <= b[1] <= b[2] <= span + 1e-6 for b in coarse["boxes"])


def test_timeline_of_several_cores_has_lanes_per_core_placed_by_start():
    f = tn.jit(_mlp())
    with torch.no_grad(), tn.profile() as prof:
        f(torch.randn(16, 32))
    one = runs_data(prof.runs)[0]
    runs = [dict(one, core=0, start_ns=1000.0), dict(one, core=1, start_ns=1500.0)]
    tl = timeline_boxes(runs, resolution=10 ** 9)
    assert tl["placed"] and tl["lanes"][0] == "core0 programs" and "core1 TensorE" in tl["lanes"]
    assert tl["span_ns"] == pytest.approx(500.0 + one["total_ns"])
    progs = sorted((b[1], b[0]) for b in tl["boxes"] if b[3] == "program")
    assert progs == [(0.0, "core0 programs"), (500.0, "core1 programs")]


# --------------------------------------------------------------------------- door processes


def test_child_failures_are_results_not_fatal():
    def crash(progress):
        progress("about to die", 0.5)
        os._exit(7)

    r = run_in_child("crash", crash, timeout_s=60, show=False)
    assert r["status"] == "crash" and "exit code 7" in r["error"]["message"] and "about to die" in r["error"]["message"]

    def hang(progress):
        time.sleep(60)

    r = run_in_child("hang", hang, timeout_s=0.5, show=False)
    assert r["status"] == "timeout"

    def boom(progress):
        raise RuntimeError("door exploded")

    r = run_in_child("boom", boom, timeout_s=60, show=False)
    assert r["status"] == "error" and "door exploded" in r["error"]["message"]


def test_progress_bar_off_a_terminal_prints_stages_and_a_heartbeat():
    import io

    from tn.assess.runner import ProgressBar

    out = io.StringIO()
    bar = ProgressBar("jit", out)
    bar.HEARTBEAT_S = 0.0
    bar.update("first call", 0.25)
    bar.update()                       # same stage: a heartbeat line (HEARTBEAT_S passed)
    bar.finish("ok")
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and "first call" in lines[0] and " 25%" in lines[1] and lines[2].rstrip().endswith("s")
    assert "ok" in lines[2]


def test_assess_mlp_every_door_matches():
    x = torch.randn(8, 32)
    res = tn.assess(_mlp(), (x,), progress=False, repeats=1)
    assert res.ok, res.summary()
    for door in ("eager", "compile", "jit", "adaptive"):
        d = res.doors[door]
        assert d["status"] == "ok" and d["runs"] >= 1 and d["device_us"] > 0
        assert all(o["ok"] for o in d["outputs"]) and d["host_ops"] == []
        assert d["hbm_peak_bytes"] >= d["weights_bytes"] > 0
    assert res.doors["jit"]["instructions"] > 0
    text = res.summary()
    assert "runs natively?       YES" in text and "numerically right?   YES" in text
    assert json.loads(json.dumps(res.to_dict(), default=str))["ok"] is True


def test_doors_run_after_the_parent_used_the_device():
    y = (torch.ones(3, device="neuron") * 2).cpu()   # forked door processes must still use the device
    assert torch.equal(y, torch.full((3,), 2.0))
    res = tn.assess(torch.nn.Linear(8, 8), torch.randn(2, 8), doors="eager", progress=False, repeats=1)
    assert res.ok, res.summary()


def test_assess_reports_host_op_lines_and_a_failing_door():
    res = tn.assess(LstsqModel(), torch.randn(4, 16), doors="eager,jit", progress=False, repeats=1)
    assert not res.ok
    eager, jit = res.doors["eager"], res.doors["jit"]
    assert eager["status"] == "ok"
    assert eager["host_ops"] and any(site == HOST_LINE for h in eager["host_ops"] for site, _ in h["where"])
    assert jit["status"] == "error" and jit["error"]["type"] == "UnsupportedOpError"
    assert jit["error"]["where"] == HOST_LINE
    v = "\n".join(res.verdicts())
    assert "PARTLY" in v and "jit fails: UnsupportedOpError at " + HOST_LINE in v


def test_training_step_compares_loss_and_gradients():
    g = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.5), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4))
    res = tn.assess(model, (torch.randn(8, 16, generator=g),), doors=("eager", "jit", "compile"), train=True,
                    progress=False, repeats=1)
    assert res.ok, res.summary()
    for d in res.doors.values():
        names = [o["output"] for o in d["outputs"]]
        assert names[0] == "loss" and names[1].startswith("gradients (4 tensors")


def test_training_with_an_unpicklable_model_is_a_door_error():
    class Local(torch.nn.Module):   # defined in a function: a fresh (spawned) process cannot import it
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

    res = tn.assess(Local(), torch.randn(2, 4), doors="jit", train=True, progress=False, repeats=1)
    err = res.doors["jit"]["error"]
    assert res.doors["jit"]["status"] == "error" and "must pickle" in err["message"] and not res.ok


def test_bad_api_inputs_raise_assess_errors():
    with pytest.raises(AssessError, match="not a torch.nn.Module"):
        tn.assess(lambda x: x, torch.randn(2))
    with pytest.raises(AssessError, match="example inputs are a str"):
        tn.assess(_mlp(), "x")
    with pytest.raises(AssessError, match="does not run on the CPU"):
        tn.assess(_mlp(), torch.randn(2, 5), progress=False)
    with pytest.raises(AssessError, match="unknown door"):
        tn.assess(_mlp(), torch.randn(2, 32), doors="gpu", progress=False)


# --------------------------------------------------------------------------- CLI


@pytest.fixture
def target_file(tmp_path):
    p = tmp_path / "targets.py"
    p.write_text(
        "import torch\n"
        "def good():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), (torch.randn(4, 8),)\n"
        "def raises():\n"
        "    raise ValueError('factory broke')\n"
        "def wrong_types():\n"
        "    return torch.nn.Linear(8, 8), 42\n"
        "def cpu_fails():\n"
        "    return torch.nn.Linear(8, 8), torch.randn(4, 9)\n"
        "def not_a_pair():\n"
        "    return torch.nn.Linear(8, 8)\n")
    (tmp_path / "broken.py").write_text("import no_such_module_for_tn_tests\n")
    return tmp_path


@pytest.mark.parametrize("spec, message", [
    ("broken.py:make", "does not import: ModuleNotFoundError"),
    ("targets.py:raises", "the factory raised ValueError: factory broke (at "),
    ("targets.py:wrong_types", "example inputs are a int"),
    ("targets.py:cpu_fails", "does not run on the CPU"),
    ("targets.py:not_a_pair", "must return (model, example_inputs)"),
    ("targets.py:missing", "has no function 'missing'"),
    ("nofile.py:f", "no file"),
    ("targets.py", "expected path/to/file.py:factory"),
])
def test_cli_bad_input_is_one_message_and_exit_2(target_file, capsys, spec, message):
    code = cli.main([str(target_file / spec), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_cli_bad_hf_inputs(tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text('{"model_type": "gpt2", "n_layer": 1}')
    assert cli.main(["--hf-config", str(cfg), "--quiet"]) == 2
    assert "names no architectures" in capsys.readouterr().err
    assert cli.main(["NoSuchModelClass", "--hf-config", str(cfg), "--quiet"]) == 2
    assert "is not a model class of transformers" in capsys.readouterr().err
    assert cli.main(["GPT2LMHeadModel", "--hf-config", str(tmp_path / "none.json"), "--quiet"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_python_m_tn_assess_end_to_end(target_file, tmp_path):
    out_json, out_html = tmp_path / "r.json", tmp_path / "r.html"
    p = subprocess.run([sys.executable, "-m", "tn", "assess", f"{target_file}/targets.py:good", "--doors",
                        "jit,eager", "--repeats", "1", "--json", str(out_json), "--html", str(out_html)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "runs natively?       YES" in p.stdout and "[jit     ]" in p.stderr
    data = json.loads(out_json.read_text())
    assert data["ok"] and set(data["doors"]) == {"jit", "eager"}
    assert out_html.stat().st_size > 100_000 and "timeline" in out_html.read_text()
    bad = subprocess.run([sys.executable, "-m", "tn", "assess", f"{target_file}/targets.py:raises"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "factory broke" in bad.stderr


# --------------------------------------------------------------------------- Hugging Face heads


@pytest.fixture
def hf_configs(tmp_path):
    transformers = pytest.importorskip("transformers")
    paths = {}
    c = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    c.architectures = ["GPT2LMHeadModel"]
    c.to_json_file(paths.setdefault("gpt2", str(tmp_path / "gpt2.json")))
    c = transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                vocab_size=64, num_labels=3)
    c.to_json_file(paths.setdefault("bert", str(tmp_path / "bert.json")))
    c = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=5)
    c.to_json_file(paths.setdefault("resnet", str(tmp_path / "resnet.json")))
    return paths


def test_hf_inputs_follow_the_head(hf_configs):
    t = load_hf(None, hf_configs["gpt2"], batch=2, seq=8, train=True)
    assert t.kwargs["input_ids"].shape == (2, 8) and torch.equal(t.kwargs["labels"], t.kwargs["input_ids"])
    assert t.model.config.resid_pdrop == 0.0
    t = load_hf("BertForSequenceClassification", hf_configs["bert"], batch=3, seq=5)
    assert t.kwargs["input_ids"].shape == (3, 5) and t.kwargs["labels"].shape == (3,)
    assert int(t.kwargs["labels"].max()) < 3
    t = load_hf("transformers:ResNetForImageClassification", hf_configs["resnet"], batch=2, train=True)
    assert t.kwargs["pixel_values"].shape == (2, 3, 224, 224) and t.kwargs["labels"].shape == (2,)
    assert set(hf_inputs(t.model, "ResNetModel", 1, 1, False)) == {"pixel_values"}


def test_cli_hf_gpt2_jit_json(hf_configs, tmp_path, capsys):
    out = tmp_path / "gpt2.out.json"
    code = cli.main(["--hf-config", hf_configs["gpt2"], "--seq", "16", "--doors", "jit", "--repeats", "1",
                     "--json", str(out), "--quiet"])
    text = capsys.readouterr().out
    assert code == 0, text
    d = json.loads(out.read_text())["doors"]["jit"]
    assert d["outputs"][0]["output"] == "logits" and d["outputs"][0]["shape"] == [1, 16, 64]


def test_file_factory_module_is_importable_by_name(target_file):
    t = load_file_factory(f"{target_file}/targets.py:good")
    assert isinstance(t.model, torch.nn.Module) and t.inputs[0].shape == (4, 8)
    assert Options().dtype == "fp32"


# --------------------------------------------------------------------------- verdicts from result data


def _result(**door):
    from tn.assess.report import AssessResult

    base = {"status": "ok", "outputs": [{"output": "y", "ratio": 0.1, "max_abs_err": 1e-7, "ok": True}],
            "host_ops": [], "runs": 3, "device_us": 10.0, "utilisation": {"TensorE": 40.0},
            "hbm_peak_bytes": 1 << 20}
    base.update(door)
    return AssessResult(label="m", options={"dtype": "fp32", "arch": "trn2", "instance": "trn2.3xlarge", "lnc": 2,
                                            "hbm_per_device_bytes": 24 << 30, "devices_per_instance": 4},
                        cpu={"steady_ms_median": 2.0}, doors={"jit": base})


def test_verdicts_name_sharding_and_host_only_doors():
    v = _result().verdicts()
    assert v[0].startswith("runs natively?       YES") and "nothing found: fits one core's HBM" in v[3]
    v = _result(hbm_peak_bytes=100 << 30).verdicts()
    assert "needs sharding: 100 GiB > 24 GiB HBM of one core (>= 5 cores" in v[3]
    assert "more than one trn2.3xlarge (4 cores)" in v[3]
    v = _result(runs=0).verdicts()
    assert "ran on the host only" in v[0]
    v = _result(outputs=[{"output": "y", "ratio": 3.0, "max_abs_err": 0.5, "ok": False, "note": ""}]).verdicts()
    assert v[1].startswith("numerically right?   NO") and "'y' max error 0.5 (3x the tolerance)" in v[1]


def test_module_rows_leave_out_containers_holding_the_step():
    r = _result(modules_us={"(model)": 100.0, "body": 95.0, "body.0": 50.0, "body.1": 45.0, "head": 5.0})
    r.doors["eager"] = r.doors.pop("jit")
    assert [m["module"] for m in r.module_rows()] == ["body.0", "body.1", "head"]
