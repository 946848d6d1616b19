# Tests of tn.adaptive: per-region eager/jit choice, bucketing with padding, fallbacks, report, bounded caches, training.
import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tn
import tn.adaptive
from tn.adaptive import independence
from tn.adaptive.policy import bucket_size, expected_future, make_policy, should_compile

FAST = dict(costs={"eager": 0.01, "compiled": 0.001, "compile": 0.02}, compile_time_prior=0.02,
            backend="reference")


class MLPBlock(nn.Module):
    def __init__(self, d=16, h=32):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.l1 = nn.Linear(d, h)
        self.l2 = nn.Linear(h, d)

    def forward(self, x):
        return x + self.l2(F.gelu(self.l1(self.ln(x))))


class AttnBlock(nn.Module):
    """Self-attention over the sequence axis (mixes positions along it, never along the batch)."""

    def __init__(self, d=16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1)
        return x + self.proj(att @ v)


class Picky(nn.Module):
    """Data-dependent Python: cannot be traced."""

    def __init__(self, d=16):
        super().__init__()
        self.a = MLPBlock(d)
        self.b = MLPBlock(d)

    def forward(self, x):
        if x.sum().item() > 0:
            return self.a(x)
        return self.b(x)


def plain(model, *args):
    """Eager result of a model patched by tn.adaptive (the original classes' forward)."""
    m = copy.deepcopy(model)
    for mod in m.modules():
        base = getattr(type(mod), "_tn_adaptive_base", None)
        if base is not None:
            mod.__class__ = base
            del mod.__dict__["_tn_region"]
    return m(*args)


def close(a, b, tol=1e-5):
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_module_is_callable_and_importable():
    import importlib
    mod = importlib.import_module("tn.adaptive")
    assert callable(tn.adaptive) and mod is tn.adaptive
    assert callable(tn.adaptive_report)
    with pytest.raises(tn.TnError, match="unknown policy keyword"):
        tn.adaptive(nn.Linear(2, 2), treshold=3)
    with pytest.raises(tn.TnError, match="nn.Module"):
        tn.adaptive(lambda x: x)


def test_cost_model_and_buckets():
    p = make_policy(min_calls=2)
    assert not should_compile(p, 1, 0.9, 1.0, 0.0, 0.1)       # seen once: never
    assert should_compile(p, 2, 0.5, 0.01, 0.001, 0.018)      # 2 more calls expected * 9ms >= 18ms
    assert not should_compile(p, 2, 0.5, 0.01, 0.001, 0.02)
    assert not should_compile(p, 2, 0.1, 0.01, 0.001, 0.005)  # churning region: ~0.2 more calls expected
    assert expected_future(p, 3, 1.0) == pytest.approx(3 * 0.97 / 0.03)  # capped
    assert bucket_size(p, 5) == 8 and bucket_size(p, 8) == 8 and bucket_size(p, 1) == 1
    assert bucket_size(make_policy(bucket=[4, 16]), 5) == 16
    assert bucket_size(make_policy(bucket=[4, 16]), 17) is None
    assert bucket_size(make_policy(bucket=None), 5) is None


def test_wrapper_behaves_like_the_model():
    torch.manual_seed(0)
    m = nn.Sequential(MLPBlock(), MLPBlock())
    keys = list(m.state_dict())
    a = tn.adaptive(m, **FAST)
    assert list(a.state_dict()) == keys
    assert a[0] is m[0] and isinstance(a[0], MLPBlock)
    assert a.train() is a and m.training and a.eval() is a and not m.training
    assert set(a.regions) == {"0", "1", "<root>"}
    x = torch.randn(3, 16)
    with torch.no_grad():
        close(a(x), plain(m, x))
        close(a.forward(x), plain(m, x))


def test_stable_shapes_compile():
    torch.manual_seed(0)
    m = nn.Sequential(MLPBlock(), MLPBlock(), MLPBlock())
    a = tn.adaptive(m, **FAST)
    x = torch.randn(4, 16)
    ref = plain(m, x)
    with torch.no_grad():
        for _ in range(8):
            close(a(x), ref)
    root = a.regions["<root>"]
    assert root.mode() == "compiled" and root.compiles == 1 and root.hits >= 5
    assert "compiling" in root.reason


def test_measured_times_decide_too():
    """Without injected costs the controller uses the clock; a fake clock makes compiling pay."""
    t = [0.0]

    def clock():
        t[0] += 0.05
        return t[0]

    torch.manual_seed(0)
    m = nn.Sequential(MLPBlock(), MLPBlock())
    a = tn.adaptive(m, clock=clock, compile_time_prior=0.01, backend="reference")
    x = torch.randn(2, 16)
    with torch.no_grad():
        for _ in range(4):
            a(x)
    assert a.regions["<root>"].compiles == 1


def test_churning_shapes_stay_eager_without_buckets():
    torch.manual_seed(0)
    m = nn.Sequential(MLPBlock(), MLPBlock())
    a = tn.adaptive(m, bucket=None, **FAST)
    with torch.no_grad():
        for n in range(1, 25):
            x = torch.randn(n, 16)
            close(a(x), plain(m, x))
    rows = a.report(print_table=False)
    assert all(r["compiles"] == 0 and r["mode"] == "eager" for r in rows)
    assert rows[-1]["signatures"] == 24


def test_batch_bucketing_pads_and_slices_exactly():
    torch.manual_seed(0)
    m = nn.Sequential(AttnBlock(), MLPBlock(), AttnBlock())
    a = tn.adaptive(m, regions=[""], **FAST)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for i in range(40):
            b = int(torch.randint(1, 17, (1,), generator=g))
            x = torch.randn(b, 6, 16, generator=g)
            close(a(x), plain(m, x))
    r = a.regions["<root>"]
    assert r.bucketing is not None and r.mode() == "bucketed"
    assert r.padded > 0 and 1 <= r.compiles <= 5  # buckets 1, 2, 4, 8, 16


def test_bucketing_refused_when_the_dim_is_mixed():
    torch.manual_seed(0)
    m = nn.Sequential(AttnBlock(), AttnBlock())
    a = tn.adaptive(m, regions=[""], **FAST)
    with torch.no_grad():
        for i in range(30):
            x = torch.randn(2, 3 + i, 16)  # the sequence churns; attention mixes positions along it
            close(a(x), plain(m, x))
    r = a.regions["<root>"]
    assert r.bucketing is None and r.compiles == 0
    assert "matmul" in r.bucket_refused
    assert "no bucketing" in a.report(print_table=False)[0]["reason"]
    # its children became regions; position-wise ones (the Linears) bucket the sequence
    assert "0" in a.regions and "1" in a.regions
    assert a.regions["0.qkv"].bucketing is not None and a.regions["0.qkv"].padded > 0


def test_independence_analysis_on_ir():
    x = torch.randn(4, 8)
    ir = tn.make_ir(lambda t: torch.softmax(t, dim=-1) * 2)(x)
    assert independence.independent_axes(ir, {0: 0}) == [(0, 1)]
    with pytest.raises(independence.Mixed, match="along it"):
        independence.independent_axes(ir, {0: 1})
    ir = tn.make_ir(lambda t: t.reshape(4, 2, 4).sum(-1))(x)
    assert independence.independent_axes(ir, {0: 0}) == [(0, 1)]
    ir = tn.make_ir(lambda t: t.reshape(32) * 2)(x)
    assert independence.independent_axes(ir, {0: 0}) == [(0, 8)]
    ir = tn.make_ir(lambda t: t.t().reshape(32) * 2)(x)
    with pytest.raises(independence.Mixed, match="merged"):
        independence.independent_axes(ir, {0: 0})


def test_untraceable_region_falls_back_and_children_become_regions():
    torch.manual_seed(0)
    m = nn.Sequential(Picky(), MLPBlock())
    a = tn.adaptive(m, regions=["0"], **FAST)
    x = torch.randn(4, 16)
    with torch.no_grad():
        for _ in range(6):
            close(a(x), plain(m, x))
    r = a.regions["0"]
    assert r.mode() == "eager (for good)" and "TracingError" in r.dead
    assert "0.a" in a.regions and "0.b" in a.regions
    assert a.regions["0.a"].calls + a.regions["0.b"].calls >= 1
    rows = {row["region"]: row for row in a.report(print_table=False)}
    assert rows["0"]["reason"].startswith("eager for good")


def test_report_rows_and_table(capsys):
    torch.manual_seed(0)
    a = tn.adaptive(nn.Sequential(MLPBlock(), MLPBlock()), **FAST)
    with torch.no_grad():
        for _ in range(4):
            a(torch.randn(2, 16))
    rows = tn.adaptive_report(a)
    out = capsys.readouterr().out
    assert "region" in out and "<root>" in out
    assert set(rows[0]) == {"region", "mode", "calls", "signatures", "compiles", "hits", "padded", "eager_s",
                            "compiled_s", "compile_s", "reason"}
    assert rows == a.report(print_table=False)
    with pytest.raises(tn.TnError, match="tn.adaptive"):
        tn.adaptive_report(nn.Linear(2, 2))


def test_log_each_decision(monkeypatch, caplog):
    monkeypatch.setenv("TN_LOG", "adaptive")
    a = tn.adaptive(nn.Sequential(MLPBlock(), MLPBlock()), **FAST)
    with caplog.at_level(logging.WARNING, logger="tn"), torch.no_grad():
        for _ in range(4):
            a(torch.randn(2, 16))
    assert any("tn.adaptive: <root>: compiling" in r.getMessage() for r in caplog.records)


def test_regions_by_type_and_errors():
    m = nn.Sequential(MLPBlock(), nn.ReLU(), MLPBlock())
    a = tn.adaptive(m, regions=[MLPBlock], **FAST)
    assert set(a.regions) == {"0", "2"}
    with pytest.raises(tn.TnError, match="not a submodule"):
        tn.adaptive(nn.Sequential(MLPBlock()), regions=["nope"])


def test_caches_bounded_under_thousands_of_shapes():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    a = tn.adaptive(m, regions=[""], bucket=None, max_signatures=8, cache_size=2, **FAST)
    with torch.no_grad():
        for i in range(2000):
            a(torch.randn(i + 1, 4))
        for rep in range(10):  # a few hot shapes compile, more than the program cache holds
            for n in (1, 2, 3, 4):
                x = torch.randn(n, 4)
                close(a(x), plain(m, x))
    r = a.regions["<root>"]
    assert r.distinct >= 2000  # counted in a bounded table: evicted shapes count again
    assert len(r.sigs) <= 8 and len(r._raw) <= 8 and len(r.compiled) <= 2
    assert r._jitted().cache_info().size <= 2 and r.compiles >= 3


def test_training_grads_equal_eager(backend):
    torch.manual_seed(0)
    m = nn.Sequential(MLPBlock(), MLPBlock())
    ref = copy.deepcopy(m)
    a = tn.adaptive(m, **dict(FAST, backend=backend))
    for i in range(5):
        x = torch.randn(4, 16, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        y = a(x)
        (y ** 2).sum().backward()
        yr = ref(xr)
        (yr ** 2).sum().backward()
        close(y.detach(), yr.detach())
        close(x.grad, xr.grad, 1e-4)
    assert a.regions["<root>"].compiles >= 1 and a.regions["<root>"].hits >= 1
    for (n, p), (_, pr) in zip(m.named_parameters(), ref.named_parameters()):
        close(p.grad, pr.grad, 1e-4)


def test_training_with_padded_buckets():
    torch.manual_seed(0)
    m = nn.Sequential(MLPBlock(), MLPBlock())
    ref = copy.deepcopy(m)
    a = tn.adaptive(m, regions=[""], **FAST)
    for b in [3, 5, 6, 7, 3, 5, 6, 7, 5, 6]:
        x = torch.randn(b, 16)
        (a(x) ** 2).sum().backward()
        (ref(x) ** 2).sum().backward()
    assert a.regions["<root>"].padded > 0
    for (n, p), (_, pr) in zip(m.named_parameters(), ref.named_parameters()):
        close(p.grad, pr.grad, 1e-4)


def test_hf_gpt2_generate_equals_plain():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64,
                                  bos_token_id=0, eos_token_id=1, pad_token_id=1)
    m = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(2, 64, (2, 5))
    ref = m.generate(ids, max_new_tokens=8, do_sample=False)
    a = tn.adaptive(m, **FAST)
    out = a.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, ref)
    out = a.generate(ids, max_new_tokens=8, do_sample=False)  # again, now with compiled regions
    assert torch.equal(out, ref)
    rows = {r["region"]: r for r in a.report(print_table=False)}
    assert rows["transformer.h.0"]["mode"] == "eager (for good)"
    assert sum(r["compiles"] for r in rows.values()) >= 1


def test_copies_and_double_wrapping():
    torch.manual_seed(0)
    m = nn.Sequential(MLPBlock(), MLPBlock())
    a = tn.adaptive(m, **FAST)
    x = torch.randn(2, 16)
    with torch.no_grad():
        for _ in range(4):
            a(x)
        c = copy.deepcopy(m)  # a copy runs its own (eager) code, the original's statistics are untouched
        calls = a.regions["<root>"].calls
        close(c(x), a(x))
    assert a.regions["<root>"].calls == calls + 1
    with pytest.raises(tn.TnError, match="already belongs"):
        tn.adaptive(m)


def test_training_with_dropout_or_buffers_stays_eager():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8)).train()
    a = tn.adaptive(m, regions=[""], **FAST)
    for _ in range(5):
        a(torch.randn(4, 8)).sum().backward()
    r = a.regions["<root>"]
    assert r.compiles == 0 and "dropout" in r.reason
    m = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).train()
    a = tn.adaptive(m, regions=[""], **FAST)
    for _ in range(5):
        a(torch.randn(4, 8)).sum().backward()
    assert a.regions["<root>"].compiles == 0 and "buffers" in a.regions["<root>"].reason


def test_compile_failure_of_any_kind_falls_back(monkeypatch):
    torch.manual_seed(0)
    m = nn.Sequential(MLPBlock(), MLPBlock())
    a = tn.adaptive(m, regions=[""], **FAST)
    r = a.regions["<root>"]

    def boom(*a, **k):
        raise RuntimeError("backend exploded")

    monkeypatch.setattr(r, "_jitted", lambda: boom)
    x = torch.randn(2, 16)
    with torch.no_grad():
        for _ in range(5):
            close(a(x), plain(m, x))
    assert r.dead and "backend exploded" in r.dead and "0" in a.regions
