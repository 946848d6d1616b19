# OpInfo conformance through tn.jit: a fast subset of representative ops here, the whole op_db under -m slow.
import importlib.util
import json
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
    rec = cov.run_item("op", name, "jit", backend, max_samples=12, timeout=60, info=_INFOS[name])
    assert rec["status"] == "pass", f"{name}: {rec['status']}: {rec['reason']}"
    assert rec["samples"] > 0


def test_compare_reports_mismatches_and_structure():
    a = torch.ones(3)
    assert cov.compare((a, 1), (a.clone(), 2)) is None  # only tensor leaves are compared
    assert "mismatch" in cov.compare(a, a + 1e-3)
    assert "result 0 is" in cov.compare(a, a.double())
    assert "tensor results" in cov.compare((a, a), (a,))
    assert cov.compare(torch.tensor([float("nan")]), torch.tensor([float("nan")])) is None
    assert cov.compare(torch.empty(2), torch.empty(2) + 7, values=False) is None
    # bf16 results against fp32 values: dtype from the bf16 meta, values at bf16 tolerance
    x = torch.randn(64)
    b = x.bfloat16()
    assert cov.compare(b, x, expected_meta=b) is None
    assert "mismatch" in cov.compare((x * 1.05).bfloat16(), x, expected_meta=b)   # 5% off, eager bf16 is not
    assert "result 0 is" in cov.compare(x, x, expected_meta=b)


def test_summary_and_report(capsys):
    recs = [dict(name="a", status="pass", reason="", samples=1),
            dict(name="b.v", status="fail", reason="sample 0: mismatch: result 0 at [1, 2]", samples=1),
            dict(name="c", status="error", reason="UnsupportedOpError: aten.foo f32[3]", samples=1),
            dict(name="d", status="crash", reason="worker died: SIGSEGV at sample 0", samples=0),
            dict(name="e", status="pass_host", reason="on the host: aten::foo", samples=2),
            dict(name="f", status="excluded", reason="random: draws random numbers", samples=0),
            dict(name="g", status="skip", reason="no float32 sample", samples=0),
            dict(name="h", status="refused", reason=cov.REFUSED + "data-dependent control flow", samples=1)]
    rep = cov.summarize(recs, mode="jit")
    assert rep["total"] == 8 and all(rep["totals"][s] == 1 for s in cov.STATUSES)
    assert rep["rates"]["native"] == 0.1667 and rep["rates"]["correct"] == 0.3333   # of the 6 not skipped/excluded
    cov.print_report(rep)
    out = capsys.readouterr().out
    for word in ("b.v", "UnsupportedOpError", "SIGSEGV", "aten::foo", "random", "crash", "refused by design"):
        assert word in out


class FakeInfo:
    """Just enough of an OpInfo for run_item."""

    def __init__(self, name, op, n=2):
        self.name, self.variant_test_name, self.op, self.n = name, "", op, n

    def sample_inputs(self, device, dtype, requires_grad=False):
        from torch.testing._internal.opinfo.core import SampleInput

        return [SampleInput(torch.randn(3, 4, dtype=dtype, requires_grad=requires_grad)) for _ in range(self.n)]


def _fake(name, op, backend, mode="jit", **kw):
    return cov.run_item("op", name, mode, backend, info=FakeInfo(name, op), **kw)


def test_run_item_statuses(backend):
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

    rec = _fake("ok", lambda x: x.exp() + 1, backend)
    assert (rec["status"], rec["samples"]) == ("pass", 2)
    rec = _fake("busy", busy, backend, timeout=0.2)
    assert rec["status"] == "error" and "timeout" in rec["reason"]
    rec = _fake("branchy", branchy, backend)
    if backend == "neuron":   # tn.jit runs a value read split there, on the device (tests/test_jit_split.py)
        assert rec["status"] == "pass", rec
    else:
        assert rec["status"] == "error" and "TracingError" in rec["reason"]
    rec = _fake("wrong", wrong, backend)
    assert rec["status"] == "fail" and "mismatch" in rec["reason"]
    rec = _fake("fails", fails_only_traced, backend)
    assert rec["status"] == "error" and "ValueError: boom" in rec["reason"]
    rec = _fake("random", lambda x: torch.rand_like(x) + x, backend)
    assert rec["status"] == "excluded" and "random" in rec["reason"]


def test_gradients_are_compared(backend):
    class WrongGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2 if type(g) is torch.Tensor else g * 0   # wrong only when traced

    rec = _fake("double", lambda x: x * 2, backend, grad=True)
    assert rec["status"] == "pass", rec
    rec = _fake("wrong-grad", WrongGrad.apply, backend, grad=True)
    assert rec["status"] == "fail" and "gradient" in rec["reason"], rec


def test_host_fallback_is_its_own_status():
    rec = cov.run_item("op", "linalg.eigh", "eager", max_samples=2)   # eigenvectors (signs): host by design
    assert rec["status"] == "pass_host" and "linalg_eigh" in rec["reason"], rec


def test_bf16_compares_with_fp32_on_the_same_inputs():
    rec = cov.run_item("op", "mm", "eager", dtype=torch.bfloat16, max_samples=2)
    assert rec["status"] == "pass", rec


def test_bench_catches_a_wrong_backend():
    import tn
    from tn.reference import compile_ir

    def off_by_a_little(ir):
        run = compile_ir(ir)
        return lambda xs: [o + 1e-3 if o.is_floating_point() else o for o in run(xs)]

    tn.jit.register_backend("test-coverage-wrong", off_by_a_little)
    for name in ("add", "matmul", "sum"):
        rec = cov.run_item("op", name, "jit", "test-coverage-wrong", max_samples=4, info=_INFOS[name])
        assert rec["status"] == "fail" and "mismatch" in rec["reason"], rec


def test_pool_counts_a_crash_and_goes_on(monkeypatch):
    """A worker killed by SIGSEGV is one crash record carrying the Python stack at the crash; the other items still
    run (fork start method)."""
    import multiprocessing as mp

    if "fork" not in mp.get_all_start_methods():
        pytest.skip("the patched item runner reaches the workers only when they are forked")
    real = cov.run_item

    def run_item(kind, key, progress=None, **opts):
        if key == "boom":
            progress("sample 0")
            import ctypes

            ctypes.string_at(0)          # SIGSEGV
        return real(kind, key, progress=progress, info=_INFOS[key], **opts)

    monkeypatch.setattr(cov, "run_item", run_item)
    items = [("op", "add"), ("op", "boom"), ("op", "mul")]
    recs = cov.run_pool(items, dict(mode="jit", backend="reference", max_samples=2), workers=2)
    by = {r["name"]: r for r in recs}
    assert by["boom"]["status"] == "crash" and "SIGSEGV" in by["boom"]["reason"]
    assert "sample 0" in by["boom"]["reason"]
    # the worker's fault handler left the Python stack of the crash in the record (the line that faulted)
    assert "Segmentation fault" in by["boom"]["trace"] and "run_item" in by["boom"]["trace"]
    assert by["add"]["status"] == by["mul"]["status"] == "pass"
    assert [r["name"] for r in recs] == ["add", "boom", "mul"]


def test_main_writes_the_json(tmp_path):
    import json

    out = tmp_path / "r.json"
    cov.main(["--mode", "eager", "--ops", "add,linalg.eigh", "--max-samples", "2", "--workers", "1",
              "--json", str(out)])
    rep = json.loads(out.read_text())
    assert rep["mode"] == "eager" and rep["total"] == 2
    assert {r["name"]: r["status"] for r in rep["items"]} == {"add": "pass", "linalg.eigh": "pass_host"}


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_lazy_modules_are_measured_not_skipped(mode):
    """module_db's lazy modules (uninitialised parameters until their first call) are materialised on the CPU
    first, so every door runs and is compared on them instead of the item being skipped for "no samples"."""
    rec = cov.run_item("module", "nn.LazyConv2d/train", mode, max_samples=1, grad=True)
    assert rec["status"] == "pass" and rec["samples"] == 1, rec


def test_shards_merge_into_one_full_report(tmp_path):
    """--shard k/n runs every n-th item; --merge of shards 1..n gives the items of one run, counted again,
    marked full only when every shard is there; mismatched or overlapping shards are refused."""
    names = "abs,neg,exp,sin,cos"
    paths = []
    for k in (1, 2):
        path = tmp_path / f"s{k}.json"
        assert cov.main(["--mode", "eager", "--ops", names, "--max-samples", "1", "--workers", "1",
                         "--shard", f"{k}/2", "--json", str(path)]) == 0
        paths.append(str(path))
    shards = [json.loads(open(p).read()) for p in paths]
    assert [s["total"] for s in shards] == [3, 2] and shards[0]["shard"] == "1/2"
    assert "shard 1/2" in cov.scope_text(shards[0])
    merged_path = tmp_path / "all.json"
    assert cov.main(["--merge", *paths, "--json", str(merged_path)]) == 0
    merged = json.loads(merged_path.read_text())
    assert sorted(r["name"] for r in merged["items"]) == sorted(names.split(","))
    assert merged["totals"]["pass"] == 5 and merged["shard"] is None
    assert cov.scope_text(merged) == "partial (5 named items, <= 1 samples/item)"
    only_first = cov.merge_shards(shards[:1])
    assert only_first["shard"] == "1/2" and only_first["partial"]
    with pytest.raises(ValueError, match="two shards|repeat"):
        cov.merge_shards([shards[0], shards[0]])
    other = dict(shards[1], grad=True)
    with pytest.raises(ValueError, match="differ"):
        cov.merge_shards([shards[0], other])


def test_mode_index_may_pick_any_occurrence_of_the_mode():
    """torch.mode's index is 'the index location of' the mode value: with repeats, any occurrence is right (bf16
    inputs repeat often; eager's pick is not documented), and an index of another value is wrong."""
    x = torch.tensor([[3.0, 1.0, 3.0, 2.0], [5.0, 5.0, 4.0, 4.0]])
    check = cov._tie_check("mode", (x,), {})
    values, eager = torch.mode(x, -1)
    other = torch.where(x[torch.arange(2), eager] == x[torch.arange(2), torch.tensor([0, 0])],
                        torch.tensor([2, 1]), eager)   # the other occurrence of each row's mode
    assert check((values, other), (values, eager))
    assert not check((values, torch.tensor([1, int(eager[1])])), (values, eager))   # row 0: 1.0 is not its mode


def test_bf16_creation_ops_are_compared_with_an_fp32_computation():
    """linspace(..., dtype=bf16) has no 16-bit input to widen: its reference is the same call with dtype=float32
    (eager's bf16 kernel steps in bf16 and lands 1.7e-3 from the exact value at sample 8, where tn.jit, computing
    in fp32 and rounding once, is right: the bench counted that as tn's wrong answer)."""
    infos = [o for o in cov.opinfos(torch.bfloat16, ["linspace"]) if o.variant_test_name == ""]
    cases = list(cov._op_cases(infos[0], torch.bfloat16, False))
    assert cases[8].fp32_fn is not None
    assert cases[8].fp32_fn().dtype == torch.float32 and cases[8].fn().dtype == torch.bfloat16
    rec = cov.run_item("op", "linspace", "jit", dtype=torch.bfloat16, max_samples=10)
    assert rec["status"] == "pass", rec
