# Tests of bench/coverage.py's report side: the published table (scope, commit), host-op ranking, exclusions.
import importlib.util
import json
import pathlib

import torch

_PATH = pathlib.Path(__file__).resolve().parents[1] / "bench" / "coverage.py"
_spec = importlib.util.spec_from_file_location("tn_bench_coverage_publish", _PATH)
cov = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cov)


def _report(mode="eager", grad=False, **meta):
    recs = [dict(name="a", status="pass", reason="", samples=1),
            dict(name="b", status="pass_host", reason="sample 0: on the host: host, mul", samples=1),
            dict(name="c", status="pass_host", reason="sample 2: on the host: host", samples=1)]
    return cov.summarize(recs, kind="op", mode=mode, dtype="float32", grad=grad, **meta)


def test_table_says_full_or_partial_and_the_commit():
    full = _report(commit="abc1234", max_samples=None)
    part = _report(commit="def5678+dirty", max_samples=3, ops=["a", "b", "c"])
    table = cov.markdown_table([full, part])
    rows = [line for line in table.splitlines() if line.startswith("| op ")]
    assert len(rows) == 2
    assert "| full | abc1234 |" in rows[0]
    assert "partial (3 named items, <= 3 samples/item)" in rows[1] and "def5678+dirty" in rows[1]
    assert "| 1 | 2 | 0 | 0 | 0 | 0 | 0 | 0 | 3 | 33.3% | 100.0% |" in rows[0]


def test_publish_writes_between_the_markers_and_keeps_the_page(tmp_path):
    page = tmp_path / "coverage.md"
    page.write_text("# title\n\nintro\n\n" + cov.TABLE_BEGIN + "\n(old)\n" + cov.TABLE_END + "\n\nnotes\n")
    reports = []
    for i, grad in enumerate((False, True)):
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps(_report(grad=grad, commit="abc1234")))
        reports.append(str(p))
    assert cov.main(["--markdown", *reports, "--publish", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# title\n\nintro\n\n") and text.endswith("\n\nnotes\n")
    assert "(old)" not in text and text.count("| op | eager |") == 2
    cov.main(["--markdown", *reports, "--publish", str(page)])    # idempotent
    assert page.read_text() == text
    fresh = tmp_path / "new.md"
    cov.publish(str(fresh), [_report()])
    assert cov.TABLE_BEGIN in fresh.read_text() and "| op | eager |" in fresh.read_text()


def test_host_ops_ranked_by_the_items_they_block():
    ranked = cov.rank_host_ops([_report(), _report(mode="jit", grad=True)])
    assert ranked[0] == ("host", 4, ["b (eager)", "c (eager)", "b (jit+grad)", "c (jit+grad)"])
    assert ranked[1][:2] == ("mul", 2)


def test_attention_without_dropout_is_not_random():
    """Eval-mode transformers call the seeded attention op with dropout_p=0: deterministic, so compared."""
    q = torch.randn(1, 2, 3, 4)
    for p, random in ((0.0, False), (0.5, True)):
        mode = cov._SeededOps()
        with mode:
            torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=p)
        assert bool(mode.seen) is random
    rec = cov.run_item("module", "nn.TransformerEncoderLayer/eval", "eager", max_samples=1)
    assert rec["status"] == "pass", rec


def test_sort_indices_may_order_ties_either_way_unless_stable():
    x = torch.tensor([[2.0, 1.0, 2.0, 0.0]])
    v, i = torch.sort(x, dim=1)
    other = torch.tensor([[3, 1, 2, 0]])       # the two 2.0s swapped (eager: [3, 1, 0, 2])
    check = cov._tie_check("sort", (x, 1), {})
    assert check((v, other), (v, i)) and check((v, i), (v, i))
    assert not check((v, torch.tensor([[1, 3, 0, 2]])), (v, i))        # picks other keys
    assert not check((v, torch.tensor([[3, 1, 0, 0]])), (v, i))        # not a permutation
    assert cov._tie_check("sort", (x, 1), {"stable": True}) is None
    assert cov._tie_check("sort", (x, 1, False, True), {}) is None
    assert cov._tie_check("add", (x, x), {}) is None
    tk = cov._tie_check("topk", (x, 2), {"largest": True})
    assert tk((torch.tensor([[2.0, 2.0]]), torch.tensor([[2, 0]])), (torch.tensor([[2.0, 2.0]]), torch.tensor([[0, 2]])))
    assert not tk((torch.tensor([[2.0, 2.0]]), torch.tensor([[2, 1]])), (torch.tensor([[2.0, 2.0]]), torch.tensor([[0, 2]])))
