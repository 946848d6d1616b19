# Tests of tn.adaptive: per-region eager/jit choice, bucketing with padding, fallbacks, report, bounded caches, training.
import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tn
import tn.adaptive
from tn import pytree as pt
from tn import bucketing
from tn.adaptive import region
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


class CausalBlock(nn.Module):
    """Causal self-attention (mask built inside, as GPT blocks do) + MLP: the sequence may be padded at its end."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / (d // h) ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc(F.gelu(x))


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
    with pytest.raises(tn.TnError, match="max_recurrence"):
        tn.adaptive(nn.Linear(2, 2), max_recurrence=1.0)


def test_jit_is_tracing_hook():
    seen = []

    @tn.jit(backend="reference")
    def f(x):
        seen.append(tn.jit.is_tracing())
        return x * 2

    assert not tn.jit.is_tracing()
    f(torch.ones(2))
    assert seen == [True] and not tn.jit.is_tracing()


def test_cost_model_and_buckets():
    p = make_policy(min_calls=2)
    # should_compile(policy, seen, future, t_now, t_eager, t_compiled, t_compile)
    assert not should_compile(p, 1, 100.0, 1.0, 1.0, 0.0, 0.1)           # seen once < min_calls: never
    assert should_compile(p, 2, 2.0, 0.01, 0.01, 0.001, 0.027)           # 9 ms now + 2 * 9 ms >= 27 ms
    assert not should_compile(p, 2, 2.0, 0.01, 0.01, 0.001, 0.028)
    assert should_compile(p, 2, 0.0, 0.2, 0.01, 0.001, 0.15)             # a cold eager call dearer than a compile
    p1 = make_policy()
    assert p1.min_calls == 1 and p1.max_recurrence == 0.8
    assert expected_future(p1, 3, 0.5) == pytest.approx(3.0)
    assert expected_future(p1, 3, 0.5, share=4) == pytest.approx(12.0)  # four identical blocks share the program
    assert expected_future(p1, 3, 1.0) == pytest.approx(3 * 0.8 / 0.2)   # capped
    assert expected_future(p1, 3, 0.0) == 0.0
    assert bucket_size(p, 5) == 8 and bucket_size(p, 8) == 8 and bucket_size(p, 1) == 1
    assert bucket_size(make_policy(bucket=[4, 16]), 5) == 16
    assert bucket_size(make_policy(bucket=[4, 16]), 17) is None
    assert bucket_size(make_policy(bucket=None), 5) is None
    assert bucket_size(make_policy(max_bucket=8), 9) is None


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
    a = tn.adaptive(m, regions=[""], **FAST)
    x = torch.randn(4, 16)
    ref = plain(m, x)
    with torch.no_grad():
        for _ in range(8):
            close(a(x), ref)
    root = a.regions["<root>"]
    assert root.mode() in ("compiled", "mixed") and root.compiles == 1 and root.hits >= 5
    assert "compiling" in a.report(print_table=False)[0]["reason"]


def test_identical_blocks_share_one_program():
    torch.manual_seed(0)
    m = nn.Sequential(MLPBlock(), MLPBlock(), MLPBlock(), MLPBlock())
    a = tn.adaptive(m, **FAST)
    blocks = [a.regions[str(i)] for i in range(4)]
    assert len({id(r.group) for r in blocks}) == 1 and a.regions["<root>"].group is not blocks[0].group
    x = torch.randn(4, 16)
    ref = plain(m, x)
    with torch.no_grad():
        for _ in range(6):
            close(a(x), ref)
    assert sum(r.compiles for r in blocks) == 1  # one compile serves the four blocks
    assert all(r.hits >= 1 for r in blocks)
    assert blocks[0].group.jf().cache_info().misses == 1
    rows = {r["region"]: r for r in a.report(print_table=False)}
    assert rows["0"]["shares"] == "" and rows["3"]["shares"] == "0"


def test_different_structure_does_not_share():
    class Scaled(nn.Module):
        def __init__(self, s):
            super().__init__()
            self.s = s
            self.l = nn.Linear(8, 8)

        def forward(self, x):
            return self.l(x) * self.s

    torch.manual_seed(0)
    m = nn.Sequential(Scaled(1.0), Scaled(2.0), Scaled(1.0))
    a = tn.adaptive(m, **FAST)
    assert a.regions["0"].group is a.regions["2"].group
    assert a.regions["0"].group is not a.regions["1"].group  # a Python attribute differs: baked into the program
    x = torch.randn(3, 8)
    with torch.no_grad():
        for _ in range(6):
            close(a(x), plain(m, x))
    assert a.regions["1"].hits >= 1 and a.regions["0"].hits >= 1
    m2 = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8, bias=False))
    a2 = tn.adaptive(m2, regions=["0", "1"], **FAST)
    assert a2.regions["0"].group is not a2.regions["1"].group
    a3 = tn.adaptive(nn.Sequential(MLPBlock(), MLPBlock()), share=False, **FAST)
    assert a3.regions["0"].group is not a3.regions["1"].group


def test_measured_times_decide_too():
    """Without injected costs the controller uses the clock; a fake clock makes compiling pay."""
    t = [0.0]

    def clock():
        t[0] += 0.05
        return t[0]

    torch.manual_seed(0)
    m = nn.Sequential(MLPBlock(), MLPBlock())
    a = tn.adaptive(m, regions=[""], clock=clock, compile_time_prior=0.01, backend="reference")
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
    assert r.group.bucketing is not None and r.group.bucketing.groups == [((0, 0),)]
    assert r.mode() == "bucketed" and r.padded > 0 and 1 <= r.compiles <= 5  # buckets 1, 2, 4, 8, 16


def test_causal_sequence_bucketing_pads_at_the_end_exactly():
    """A causal mask makes the sequence prefix-dependent: padding it at the end and slicing back is exact."""
    torch.manual_seed(0)
    m = nn.Sequential(CausalBlock(), CausalBlock())
    a = tn.adaptive(m, **FAST)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for i in range(40):
            b, t = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(2, 17, (1,), generator=g))
            x = torch.randn(b, t, 16, generator=g)
            close(a(x), plain(m, x))
    grp = a.regions["0"].group
    assert a.regions["1"].group is grp
    assert grp.bucketing is not None and sorted(grp.bucketing.groups) == [((0, 0),), ((0, 1),)]
    assert a.regions["0"].padded > 0 and a.regions["1"].padded > 0
    assert grp.bucket_refused is None


def test_bucketing_refused_when_the_dim_is_mixed():
    torch.manual_seed(0)
    m = nn.Sequential(AttnBlock(), AttnBlock())
    a = tn.adaptive(m, regions=[""], **FAST)
    with torch.no_grad():
        for i in range(30):
            x = torch.randn(2, 3 + i, 16)  # the sequence churns; attention without a mask mixes positions along it
            close(a(x), plain(m, x))
    r = a.regions["<root>"]
    assert r.group.bucketing is None and r.compiles == 0
    assert "contracts over it" in r.group.bucket_refused or "reduces" in r.group.bucket_refused
    assert "no bucketing" in a.report(print_table=False)[0]["reason"]
    # its children became regions; position-wise ones (the Linears) bucket the sequence
    assert "0" in a.regions and "1" in a.regions
    assert a.regions["0.qkv"].group.bucketing is not None and a.regions["0.qkv"].padded > 0


def _axes(fn, *xs, axes):
    return bucketing.independent_axes(tn.make_ir(fn)(*xs), axes)


def test_independence_analysis_on_ir():
    x = torch.randn(4, 8)
    assert _axes(lambda t: torch.softmax(t, dim=-1) * 2, x, axes={0: 0}) == [((0, 1),)]
    with pytest.raises(bucketing.Mixed, match="along it"):
        _axes(lambda t: torch.softmax(t, dim=-1) * 2, x, axes={0: 1})
    assert _axes(lambda t: t.reshape(4, 2, 4).sum(-1), x, axes={0: 0}) == [((0, 1),)]
    assert _axes(lambda t: t.reshape(32) * 2, x, axes={0: 0}) == [((0, 8),)]
    with pytest.raises(bucketing.Mixed, match="merged"):
        _axes(lambda t: t.t().reshape(32) * 2, x, axes={0: 0})
    assert _axes(lambda t: t.cumsum(0), x, axes={0: 0}) == [((0, 1),)]  # a prefix scan keeps prefixes
    with pytest.raises(bucketing.Mixed, match="along it"):
        _axes(lambda t: t.flip(0), x, axes={0: 0})
    with pytest.raises(bucketing.Mixed, match="along it"):
        _axes(lambda t: t.mean(0), x, axes={0: 0})
    # the positions themselves (arange) are the same at every size
    assert _axes(lambda t: t + torch.arange(4.0)[:, None], x, axes={0: 0}) == [((0, 1),)]
    with pytest.raises(bucketing.Mixed, match="fixed tensor"):
        _axes(lambda t: t + torch.linspace(0, 1, 4)[:, None] ** 2, x, axes={0: 0})


def _attn(mask_kind):
    def f(q, k, v):
        t = q.shape[-2]
        s = q @ k.transpose(-1, -2)
        if mask_kind == "causal":
            s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        elif mask_kind == "additive":
            s = s + torch.full((t, t), float("-inf")).triu(1)
        elif mask_kind == "finfo":
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
        elif mask_kind == "anticausal":
            s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).triu(), float("-inf"))
        return torch.softmax(s, dim=-1) @ v
    return f


def test_independence_of_causal_attention():
    q, k, v = (torch.randn(2, 6, 4) for _ in range(3))
    for kind in ("causal", "additive", "finfo"):
        assert _axes(_attn(kind), q, k, v, axes={0: 1, 1: 1, 2: 1}) == [((1, 1),)], kind
    for kind in (None, "anticausal"):
        with pytest.raises(bucketing.Mixed):
            _axes(_attn(kind), q, k, v, axes={0: 1, 1: 1, 2: 1})
    assert _axes(_attn(None), q, k, v, axes={0: 0, 1: 0, 2: 0}) == [((0, 1),)]  # the batch never mixes
    # the weights themselves are returned: sliced along both axes
    f = lambda q, k: torch.softmax(q @ k.transpose(-1, -2), -1)  # noqa: E731
    with pytest.raises(bucketing.Mixed, match="reduces along it"):
        _axes(f, q, k, axes={0: 1, 1: 1})
    h = lambda q, k: _attn("causal")(q, k, k).sum(-1) + torch.softmax(q @ k.transpose(-1, -2), -1).mean(-1)  # noqa
    with pytest.raises(bucketing.Mixed):
        _axes(h, q, k, axes={0: 1, 1: 1})
    g = lambda q, k: _attn("causal")(q, k, torch.eye(6).expand(2, 6, 6).contiguous())  # noqa: E731
    with pytest.raises(bucketing.Mixed):
        _axes(g, q, k, axes={0: 1, 1: 1})  # contracts against a fixed tensor


def test_same_program_catches_sizes_baked_in():
    f = lambda x: x * 2 + x.sum(-1, keepdim=True) / x.shape[0]  # noqa: E731
    small, big = tn.make_ir(f)(torch.randn(3, 4)), tn.make_ir(f)(torch.randn(4, 4))
    why = bucketing.same_program(small, big, [(0, 0)])
    assert why is not None and "literal" in why
    g = lambda x: torch.softmax(x, -1)  # noqa: E731
    assert bucketing.same_program(tn.make_ir(g)(torch.randn(3, 4)), tn.make_ir(g)(torch.randn(4, 4)), [(0, 0)]) \
        is None
    assert bucketing.same_program(tn.make_ir(g)(torch.randn(3, 4)), tn.make_ir(g)(torch.randn(3, 5)),
                                     [(0, 0)]) is not None  # another axis changed


def test_size_literal_stops_bucketing():
    class Avg(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(8, 8)

        def forward(self, x):
            return self.l(x) * (1.0 / x.shape[0])  # the batch size baked into a literal

    torch.manual_seed(0)
    m = nn.Sequential(Avg(), Avg())
    a = tn.adaptive(m, regions=[""], **FAST)
    with torch.no_grad():
        for b in [3, 5, 6, 7, 3, 5, 6, 7, 5, 6, 7, 3]:
            x = torch.randn(b, 8)
            close(a(x), plain(m, x))
    g = a.regions["<root>"].group
    assert g.bucketing is None and "literal" in g.bucket_refused


def test_padded_eager_keeps_new_shapes_warm():
    """When a new shape's first eager call costs much more than a known one's (the device compiles its one-op
    programs), eager calls run at their bucket's shape."""
    torch.manual_seed(0)
    m = nn.Sequential(MLPBlock(), MLPBlock())
    a = tn.adaptive(m, regions=[""], costs={"compile": 100.0}, compile_time_prior=100.0, backend="reference")
    r = a.regions["<root>"]
    g = r.group
    with torch.no_grad():
        for b in (3, 5, 6, 7):
            a(torch.randn(b, 16))
        assert g.bucketing is not None
        g.cold_n, g.cold_s, g.warm_n, g.warm_s = 10, 1.0, 10, 0.1  # cold ten times warm
        before = r.padded
        for b in (9, 10, 11, 12, 13):
            x = torch.randn(b, 16)
            close(a(x), plain(m, x))
    assert r.padded - before >= 4 and r.compiles == 0
    assert r.mode() in ("eager (padded)", "eager")


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
                            "compiled_s", "compile_s", "eager_on", "eager_device_us", "shares", "reason"}
    assert all(isinstance(r["reason"], str) and r["reason"] for r in rows)
    assert rows[-1]["region"] == "<root>" and rows[-1]["calls"] == 4
    assert rows == a.report(print_table=False)
    with pytest.raises(tn.TnError, match="tn.adaptive"):
        tn.adaptive_report(nn.Linear(2, 2))


def test_log_each_decision(monkeypatch, caplog):
    monkeypatch.setenv("TN_LOG", "adaptive")
    a = tn.adaptive(nn.Sequential(MLPBlock(), MLPBlock()), **FAST)
    with caplog.at_level(logging.WARNING, logger="tn"), torch.no_grad():
        for _ in range(4):
            a(torch.randn(2, 16))
    assert any(r.getMessage().startswith("tn.adaptive: ") and ": compiling signature" in r.getMessage()
               for r in caplog.records)
    monkeypatch.setenv("TN_LOG", "")
    caplog.clear()
    b = tn.adaptive(nn.Sequential(MLPBlock(), MLPBlock()), **FAST)
    with caplog.at_level(logging.WARNING, logger="tn"), torch.no_grad():
        for _ in range(4):
            b(torch.randn(2, 16))
    assert not any("tn.adaptive" in r.getMessage() for r in caplog.records)


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
    g = r.group
    assert r.distinct >= 2000  # counted in a bounded table: evicted shapes count again
    assert len(g.sigs) <= 8 and len(r._raw) <= 8 and len(r.seen) <= 8 and len(g.eager_keys) <= 8
    assert len(g.compiled) <= 2 and g.jf().cache_info().size <= 2 and r.compiles >= 3


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


def test_hf_gpt2_generate_equals_plain(tiny_hf):
    m = tiny_hf("gpt2")
    ids = torch.randint(2, 64, (2, 5))
    ref = m.generate(ids, max_new_tokens=8, do_sample=False)
    a = tn.adaptive(m, **FAST)
    out = a.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, ref)
    out = a.generate(ids, max_new_tokens=8, do_sample=False)  # again, now with compiled regions
    assert torch.equal(out, ref)
    rows = {r["region"]: r for r in a.report(print_table=False)}
    # the blocks take HF's DynamicCache (a state object written back after each compiled call)
    for name in ("transformer.h.0", "transformer.h.1"):
        assert "eager for good" not in str(rows[name]["reason"]), rows[name]["reason"]
        assert rows[name]["hits"] > 0, rows[name]
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

    monkeypatch.setattr(r.group, "run", boom)
    x = torch.randn(2, 16)
    with torch.no_grad():
        for _ in range(5):
            close(a(x), plain(m, x))
    assert r.dead and "backend exploded" in r.dead and "0" in a.regions


def test_training_through_causal_buckets():
    torch.manual_seed(0)
    m = nn.Sequential(CausalBlock(), CausalBlock())
    ref = copy.deepcopy(m)
    a = tn.adaptive(m, **FAST)
    g = torch.Generator().manual_seed(3)
    for i in range(14):
        b, t = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(3, 12, (1,), generator=g))
        x = torch.randn(b, t, 16, generator=g)
        xa, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ya, yr = a(xa), ref(xr)
        close(ya.detach(), yr.detach())
        (ya ** 2).sum().backward()
        (yr ** 2).sum().backward()
        close(xa.grad, xr.grad, 1e-4)
    assert a.regions["0"].padded > 0
    for (n, p), (_, pr) in zip(m.named_parameters(), ref.named_parameters()):
        close(p.grad, pr.grad, 1e-4)


def _device_blocks():
    """Two MLP blocks on CPU, a copy on the neuron device and its adaptive wrapper (costs injected: compiles soon)."""
    pytest.importorskip("tn.lower")
    torch.manual_seed(0)
    cpu = nn.Sequential(MLPBlock(), MLPBlock())
    m = copy.deepcopy(cpu).to("neuron")
    a = tn.adaptive(m, costs={"eager": 0.01, "compiled": 0.001, "compile": 0.02}, compile_time_prior=0.02,
                    backend="neuron")
    return cpu, m, a


def _calls_on_device(a, cpu, batches):
    """Call adaptive ``a`` on neuron-device inputs of these batch sizes; results stay there and equal ``cpu``'s."""
    with torch.no_grad():
        for b in batches:
            x = torch.randn(b, 16)
            y = a(x.to("neuron"))
            assert y.device.type == "neuron"
            close(y.cpu(), cpu(x), 1e-4)


def test_neuron_device_inputs_stay_on_the_device():
    cpu, m, a = _device_blocks()
    _calls_on_device(a, cpu, (4, 4, 4, 3, 5, 6, 7, 3, 5, 4))
    blocks = [a.regions["0"], a.regions["1"]]
    assert sum(r.compiles for r in blocks) >= 1 and all(r.hits >= 1 for r in blocks)
    assert blocks[0].padded > 0


def test_neuron_device_eager_at_the_bucket_shape_stays_on_the_device():
    """Eager calls run padded to their bucket when a new shape's first eager call is dear (pad_eager): the
    padding must then happen on the device the eager code runs on."""
    cpu, m, a = _device_blocks()
    for r in (a.regions["0"], a.regions["1"]):
        r.group.pad_eager = lambda: True
        r.policy.costs = {"eager": 0.01, "compiled": 0.001, "compile": 100.0}  # never pays back: stays eager
    _calls_on_device(a, cpu, (4, 4, 3, 5, 6, 7, 3, 5, 6, 7))
    assert any(3 in r.modes for r in (a.regions["0"], a.regions["1"]))  # 3: an eager call run padded


def test_neuron_device_parameter_changes_reach_compiled_regions():
    """Compiled no-grad calls reuse host views of device parameters: a .data swap, an in-place update and a
    new Parameter must all be seen by the next call."""
    cpu, m, a = _device_blocks()
    x = torch.randn(4, 16)
    with torch.no_grad():
        for _ in range(4):
            close(a(x.to("neuron")).cpu(), cpu(x), 1e-4)
        assert a.regions["0"].hits + a.regions["1"].hits >= 1
        lin, lin_cpu = m[0].l1, cpu[0].l1
        new_w = torch.randn_like(lin_cpu.weight)
        lin_cpu.weight.data = new_w.clone()
        lin.weight.data = new_w.clone().to("neuron")       # .data swap: new memory, same Parameter
        close(a(x.to("neuron")).cpu(), cpu(x), 1e-4)
        lin_cpu.bias.add_(1.0)
        lin.bias.add_(1.0)                                   # in place: same memory
        close(a(x.to("neuron")).cpu(), cpu(x), 1e-4)
        w2 = torch.randn_like(lin_cpu.weight)
        lin_cpu.weight = nn.Parameter(w2.clone())
        lin.weight = nn.Parameter(w2.clone().to("neuron"))   # a new Parameter object
        close(a(x.to("neuron")).cpu(), cpu(x), 1e-4)


def test_estimates_of_parents_and_tiny_regions():
    """A parent whose eager time is spent in child regions expects little from compiling itself (and a compile as
    dear as theirs); no compiled call is expected faster than the fastest one measured."""
    a = tn.adaptive(nn.Sequential(MLPBlock(), MLPBlock()), **FAST)
    g = a.regions["<root>"].group
    ctl = a.regions["<root>"].ctl
    st = g.stats("k")
    g.note_eager(st, "k", 0.010, 0.9, 0.05)  # 90% of its time in child regions, which stand for 50 ms of compiles
    assert g.split(st) == (0.9, 0.05)
    assert g.compile_estimate(0.010, st) >= 0.05
    assert g.split(g.stats("other")) == (g.frac_cc, g.child_comp) == (0.9, 0.05)  # a new signature: the group's
    ctl.comp_floor = 0.004
    g.note_eager(st, "k", 0.010, 0.9, 0.05)  # now warm
    assert not a.regions["<root>"]._pays_back(st, "k", 100)
    assert " > now" in st.reason()
    small = a.regions["0"].group
    s2 = small.stats("s")
    small.note_eager(s2, "s", 0.001, 0.0, 0.0)
    small.note_eager(s2, "s", 0.001, 0.0, 0.0)
    assert not a.regions["0"]._pays_back(s2, "s", 100)  # eager 1 ms < the 4 ms floor of a program call


def test_gc_pauses_are_not_region_time():
    """A garbage collection that lands inside a region's call is process overhead, not the region's time (a 100 ms
    full collection in a 0.3 ms compiled call would otherwise flip the region back to eager)."""
    import gc
    import time

    from tn.adaptive.region import gc_seconds

    junk = [[i] for i in range(300_000)]  # live objects: every full collection has to walk them

    class Collecting(nn.Module):
        def forward(self, x):
            gc.collect()
            return x * 2

    a = tn.adaptive(nn.Sequential(Collecting(), Collecting()), clock=time.process_time, min_calls=10**9)
    before = gc_seconds(time.process_time)
    with torch.no_grad():
        for _ in range(3):
            close(a(torch.ones(4)), torch.full((4,), 4.0), 0)
    spent = gc_seconds(time.process_time) - before
    in_blocks = a.regions["0"].eager_s + a.regions["1"].eager_s
    assert spent > 0 and in_blocks < spent / 4, (in_blocks, spent)
    assert gc_seconds(lambda: 0.0) == 0.0  # a test's own clock: nothing to subtract
    del junk


class ReturnsNone(nn.Module):
    """Returns a tuple with a None in it (as HF T5 blocks do)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x), None, x * 2


def test_results_holding_none_compile():
    torch.manual_seed(0)
    m = ReturnsNone()
    a = tn.adaptive(m, regions=[""], **FAST)
    for _ in range(4):
        x = torch.randn(3, 16)
        y, none, z = a(x)
        assert none is None
        close(y, m.lin(x), 1e-5)
        close(z, x * 2, 1e-6)
    r = a.regions["<root>"]
    assert r.hits > 0 and r.dead is None, r.dead


def test_region_flattens_with_the_one_pytree_walk():
    """A region's call flattening is tn.pytree.flatten with the region's rule (issue 14: one flattener): the same
    container specs as tn.jit's, Python constants kept as leaves in order (jit bakes them into the spec), and the
    region's unflatten rebuilds the call."""
    x, y = torch.randn(2), torch.randn(3)
    call = ((x, 2.5, [y, "gelu"]), {"k": None, "n": 4})
    leaves, tensors = [], []
    spec = region._flatten(call, leaves)
    assert leaves[0] is x and leaves[2] is y and [leaves[i] for i in (1, 3, 4, 5)] == [2.5, "gelu", None, 4]
    jit_spec = pt.flatten(call, tensors)
    assert len(tensors) == 2 and tensors[0] is x and tensors[1] is y
    # the containers are described alike; only the constants differ (leaf slots vs values in the spec)
    assert spec[0] == jit_spec[0] == pt.SEQ and spec[2][1][0] == pt.DICT
    assert spec[2][0][2][1] == pt.SLOT and jit_spec[2][0][2][1] == (pt.LEAF, float, 2.5)
    back = region._unflatten(spec, iter(leaves))
    assert back[0][0] is x and back[0][1] == 2.5 and back[0][2][0] is y and back[1] == {"k": None, "n": 4}
    hash(spec)
