# OpInfo conformance through tn.jit: a fast subset of representative ops here, the whole op_db under -m slow.
import importlib.util
import pathlib
import time

import pytest
import torch

pytest.importorskip("tn.jit", reason="tn.jit (tn/jit.py) has not landed yet")
pytest.importorskip("tn.trace", reason="the tracer (tn/trace.py) has not landed yet")

_PATH = pathlib.Path(__file__).resolve().parents[1] / "bench" / "coverage.py"
_spec = importlib.util.spec_from_file_location("tn_bench_coverage", _PATH)
cov = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cov)

#: Representative ops: elementwise, broadcasting, reductions, shape ops,
#: indexing, matmul and the usual NN layers.
FAST_OPS = [
    "add", "mul", "sub", "div.no_rounding_mode", "neg", "abs", "exp", "log", "tanh", "sigmoid", "rsqrt",
    "pow", "maximum", "where", "clamp", "sum", "mean", "amax", "argmax", "softmax", "log_softmax",
    "matmul", "mm", "bmm", "addmm", "nn.functional.linear", "nn.functional.relu", "nn.functional.gelu",
    "nn.functional.layer_norm", "cat", "stack", "reshape", "transpose", "permute", "gather",
    "index_select", "masked_fill", "expand", "unsqueeze", "nn.functional.embedding", "cumsum",
]

_INFOS = {cov.op_key(i): i for i in cov.float32_ops(FAST_OPS) if cov.op_key(i) in FAST_OPS}


def test_fast_subset_is_all_found():
    assert sorted(_INFOS) == sorted(FAST_OPS)


@pytest.mark.parametrize("name", FAST_OPS)
def test_opinfo_fast_subset(name, backend):
    rec = cov.run_op(_INFOS[name], backend, max_samples=12, timeout=60)
    assert rec["status"] == "passed", f"{name}: {rec['status']}: {rec['reason']}"
    assert rec["samples"] > 0


def test_compare_reports_mismatches_and_structure():
    a = torch.ones(3)
    assert cov.compare((a, 1), (a.clone(), 2)) is None  # only tensor leaves are compared
    assert "mismatch" in cov.compare(a, a + 1e-3)
    assert "result 0 is" in cov.compare(a, a.double())
    assert "tensor results" in cov.compare((a, a), (a,))
    assert cov.compare(torch.tensor([float("nan")]), torch.tensor([float("nan")])) is None
    assert cov.compare(torch.empty(2), torch.empty(2) + 7, values=False) is None


def test_summary_and_report(capsys):
    recs = [dict(name="a", variant="", status="passed", reason="", samples=1),
            dict(name="b", variant="v", status="failed", reason="mismatch: result 0 at [1, 2]", samples=1),
            dict(name="c", variant="", status="skipped", reason="UnsupportedOpError: aten.foo f32[3]", samples=0)]
    rep = cov.summarize(recs)
    assert (rep["total"], rep["passed"], rep["failed"], rep["skipped"]) == (3, 1, 1, 1)
    cov.print_report(rep)
    out = capsys.readouterr().out
    assert "passed" in out and "b.v" in out and "UnsupportedOpError" in out


class FakeInfo:
    """Just enough of an OpInfo for run_op."""

    def __init__(self, name, op, n=2):
        self.name, self.variant_test_name, self.op, self.n = name, "", op, n

    def sample_inputs(self, device, dtype, requires_grad=False):
        from torch.testing._internal.opinfo.core import SampleInput

        return [SampleInput(torch.randn(3, 4, dtype=dtype)) for _ in range(self.n)]


def test_run_op_statuses(backend):
    def busy(x):
        t = time.process_time()
        while time.process_time() - t < 1.0:
            pass
        return x + 1

    def branchy(x):
        return x * 2 if x.sum() > 0 else x

    def wrong(x):
        return x + 1 if isinstance(x, torch.Tensor) and type(x) is not torch.Tensor else x  # differs when traced

    def fails_only_traced(x):
        if type(x) is not torch.Tensor:
            raise ValueError("boom")
        return x

    rec = cov.run_op(FakeInfo("ok", lambda x: x.exp() + 1), backend)
    assert (rec["status"], rec["samples"]) == ("passed", 2)
    rec = cov.run_op(FakeInfo("busy", busy), backend, timeout=0.2)
    assert rec["status"] == "failed" and "timeout" in rec["reason"]
    rec = cov.run_op(FakeInfo("branchy", branchy), backend)
    assert rec["status"] == "skipped" and rec["reason"].startswith("TracingError")
    rec = cov.run_op(FakeInfo("wrong", wrong), backend)
    assert rec["status"] == "failed" and rec["reason"].startswith("mismatch")
    rec = cov.run_op(FakeInfo("fails", fails_only_traced), backend)
    assert rec["status"] == "failed" and "ValueError: boom" in rec["reason"]
    rec = cov.run_op(FakeInfo("random", lambda x: torch.rand_like(x) + x), backend)
    assert rec["status"] == "passed" and rec["random"]


def test_bench_catches_a_wrong_backend():
    import tn
    from tn.reference import compile_ir

    def off_by_a_little(ir):
        run = compile_ir(ir)
        return lambda xs: [o + 1e-3 if o.is_floating_point() else o for o in run(xs)]

    tn.jit.register_backend("test-coverage-wrong", off_by_a_little)
    for name in ("add", "matmul", "sum"):
        rec = cov.run_op(_INFOS[name], "test-coverage-wrong", max_samples=4)
        assert rec["status"] == "failed" and rec["reason"].startswith("mismatch"), rec


@pytest.mark.slow
def test_full_opinfo_run(backend, tmp_path):
    report = cov.run(backend, timeout=60)
    assert report["total"] >= 600
    assert report["passed"] + report["failed"] + report["skipped"] == report["total"]
    for rec in report["ops"]:
        assert rec["status"] in ("passed", "failed", "skipped")
        assert rec["status"] == "passed" or rec["reason"]
    assert report["passed"] > report["total"] // 2


def test_compiling_backend_runs_strict(monkeypatch, capsys, tmp_path):
    """On neuron an op the compiler would run on the host is skipped unless --allow-host."""
    pytest.importorskip("tn.lower")
    monkeypatch.setenv("TN_STRICT", "0")      # restored after the test (main sets it to 1)
    out = tmp_path / "r.json"
    cov.main(["--backend", "neuron", "--ops", "linalg.inv", "--json", str(out)])   # linear algebra: host by design
    import json

    rec = json.loads(out.read_text())["ops"][0]
    assert rec["status"] == "skipped" and "linalg_inv_ex" in rec["reason"]
    monkeypatch.setenv("TN_STRICT", "0")
    cov.main(["--backend", "neuron", "--ops", "linalg.inv", "--allow-host", "--json", str(out)])
    assert json.loads(out.read_text())["ops"][0]["status"] == "passed"
