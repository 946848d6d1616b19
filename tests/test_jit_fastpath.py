# Tests of tn.jit's cached-call fast path (generated matchers + signature tables): every guard of the general path holds.
import logging
from typing import NamedTuple, Optional

import pytest
import torch
import torch.nn as nn

import tn
from tn.errors import TnError

pytest.importorskip("tn.trace", reason="tn.jit needs the tracer (tn/trace.py)")


def close(a, b):
    """fp32 comparison with tight tolerances."""
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def counts(f):
    """``(misses, hits)`` of a jitted function or module."""
    info = f.cache_info()
    return info.misses, info.hits


def core_of(f):
    """The jit core behind a jitted function or module."""
    return getattr(f, "_core", None) or f._tn_core


def mlp():
    """A small seeded MLP."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()


def test_fast_path_is_taken_and_counts_hits():
    m = mlp()
    jm = tn.jit(m, backend="reference")
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            close(jm(x), m(x))
    assert counts(jm) == (1, 2)
    plans = core_of(jm).plans
    assert len(plans) == 1 and "def gather" in plans[0].gather.source


def test_in_place_update_and_replaced_parameter_hit_with_new_values():
    m = mlp()
    jm = tn.jit(m, backend="reference")
    x = torch.randn(2, 4)
    with torch.no_grad():
        jm(x)
        jm(x)
        m[0].weight.mul_(0.5)  # bumps _version only
        close(jm(x), m(x))
        m[2].weight = nn.Parameter(torch.randn(3, 8))  # replaced through setattr (registration hook)
        close(jm(x), m(x))
        m[2]._parameters["bias"] = nn.Parameter(torch.randn(3))  # replaced behind torch's hooks
        close(jm(x), m(x))
        m[0].weight.data = torch.randn(8, 4)  # same signature through .data
        close(jm(x), m(x))
    assert counts(jm) == (1, 5)


class Scale(nn.Module):
    """``x * w + b`` with a parameter and a buffer."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.register_buffer("b", torch.randn(4))

    def forward(self, x):
        return x * self.w + self.b


@pytest.mark.parametrize("change", ["data_shape", "data_dtype", "requires_grad", "buffer_dtype", "module_double"])
def test_signature_changes_that_keep_identity_and_version_miss(change):
    torch.manual_seed(0)
    m = Scale()
    jm = tn.jit(m, backend="reference")
    x = torch.randn(3, 4)
    with torch.no_grad():
        jm(x)
        jm(x)
    w, b = m.w, m.b
    v = w._version
    if change == "data_shape":
        m.w.data = torch.randn(1)  # broadcasts: same Parameter, version unchanged, new shape
    elif change == "data_dtype":
        m.w.data = m.w.data.double()
    elif change == "requires_grad":
        m.w.requires_grad_(False)
    elif change == "buffer_dtype":
        m.b.data = m.b.data.double()
    else:
        m.double()  # parameters through .data (same objects), buffers replaced in _buffers (no hook runs)
        x = x.double()
    assert m.w is w and w._version == v and (m.b is b or change == "module_double")
    with torch.no_grad():
        got = jm(x)
        close(got, m(x))
        jm(x)
    assert counts(jm) == (2, 2)


def test_training_flag_of_a_submodule_and_structure_change():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).eval()
    jm = tn.jit(m, backend="reference")
    x = torch.randn(2, 4)
    with torch.no_grad():
        jm(x)
        jm(x)
        m[1].train()  # only the dropout
        jm(x)
        assert counts(jm) == (2, 1)
        m[1].eval()
        close(jm(x), m(x))
        assert counts(jm) == (2, 2)
        m.register_parameter("extra", nn.Parameter(torch.zeros(1)))  # names change: a new program
        close(jm(x), m(x))
        assert counts(jm) == (3, 2)
        nn.Linear(2, 2)  # a structure change elsewhere: the matcher revalidates, still a hit
        close(jm(x), m(x))
    assert counts(jm) == (3, 3)


def test_grad_mode_and_autocast_are_guarded():
    @tn.jit(backend="reference")
    def f(x, w):
        return x @ w

    x, w = torch.randn(4, 8), torch.randn(8, 3)
    f(x, w)
    f(x, w)
    with torch.no_grad():
        f(x, w)
        f(x, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert f(x, w).dtype == torch.bfloat16
        assert f(x, w).dtype == torch.bfloat16
    assert f(x, w).dtype == torch.float32
    assert counts(f) == (3, 4)


def test_static_arguments_and_scalar_leaves():
    @tn.jit(static_argnums=1, backend="reference")
    def f(x, flags, alpha=1.0):
        return x * alpha + sum(flags)

    x = torch.randn(3)
    f(x, (True, False))
    f(x, (True, False))  # an equal tuple, not the same object: a hit
    assert counts(f) == (1, 1)
    close(f(x, (True, True)), x + 2)  # new static value
    close(f(x, (True, False), alpha=2), x * 2 + 1)  # int leaf
    close(f(x, (True, False), alpha=2.0), x * 2 + 1)  # float leaf, equal value: another constant type
    assert counts(f) == (4, 1)
    close(f(x, (1, 0), alpha=2.0), x * 2 + 1)  # == and same hash as (True, False): a hit, as the cache key says
    assert counts(f) == (4, 2)
    f(x, (True, False), alpha=2.0)
    assert counts(f) == (4, 3)
    with pytest.raises(TnError, match="static argument"):
        f(x, torch.ones(1))


def test_pytree_structure_changes_miss():
    class Pair(NamedTuple):
        a: torch.Tensor
        b: Optional[torch.Tensor]

    @tn.jit(backend="reference")
    def f(d, p, *rest, **kw):
        out = d["x"] + p.a
        if p.b is not None:
            out = out + p.b
        for r in rest:
            out = out + r
        for v in kw.values():
            out = out + v
        return out

    x = torch.randn(3)
    f({"x": x, "y": 1}, Pair(x, x))
    f({"x": x, "y": 1}, Pair(x, x))
    assert counts(f) == (1, 1)
    f({"y": 1, "x": x}, Pair(x, x))  # key order
    f({"x": x, "y": 2}, Pair(x, x))  # constant in a dict
    f({"x": x, "y": 1}, Pair(x, None))  # a NamedTuple field
    f({"x": x, "y": 1}, Pair(x, x), x)  # one more positional
    f({"x": x, "y": 1}, Pair(x, x), u=x)
    f({"x": x, "y": 1}, Pair(x, x), v=x)  # same count of keywords, another name
    assert counts(f) == (7, 1)
    close(f({"x": x, "y": 1}, Pair(x, x), v=x), 4 * x)
    close(f([x][0:0] or {"x": x, "y": 1}, [x, x][0:0] or Pair(x, x)), 3 * x)
    assert counts(f) == (7, 3)


def test_list_and_tuple_are_different_structures():
    @tn.jit(backend="reference")
    def f(xs):
        return xs[0] + xs[1]

    x = torch.randn(2)
    f((x, x))
    f([x, x])
    f((x, x))
    f([x, x])
    assert counts(f) == (2, 2)


def test_evicted_and_cleared_programs_are_not_run_from_the_fast_tables():
    m = mlp()
    jm = tn.jit(m, backend="reference", cache_size=1)
    a, b = torch.randn(2, 4), torch.randn(3, 4)
    with torch.no_grad():
        jm(a)
        jm(a)
        jm(b)  # evicts a's program
        jm(a)
        assert counts(jm) == (3, 1) and jm.cache_info().size == 1
        jm.cache_clear()
        close(jm(a), m(a))
    assert counts(jm) == (1, 0)


def test_lru_order_is_kept_by_fast_hits():
    @tn.jit(cache_size=2, backend="reference")
    def f(x):
        return x.cos()

    a, b, c = torch.randn(2), torch.randn(3), torch.randn(4)
    f(a), f(b)
    f(a)  # fast hit: a is the most recent
    f(c)  # evicts b
    f(a)
    assert counts(f) == (3, 2)
    f(b)
    assert counts(f) == (4, 2)


def test_errors_are_still_raised_after_fast_hits():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3).eval()
    jm = tn.jit(bn, backend="reference")
    x = torch.randn(4, 3)
    with torch.no_grad():
        jm(x)
        jm(x)
        bn._buffers["running_mean"] = 3.0  # behind the hooks: not a tensor
        with pytest.raises(TnError, match="not a tensor"):
            jm(x)

    class Holder:
        """An object whose attributes may hide a tensor."""

    @tn.jit(backend="reference")
    def f(x, h):
        return x + 1

    h = Holder()
    f(x, h)
    f(x, h)
    h.t = torch.zeros(1)  # now it hides a tensor: the same error as on a first call
    with pytest.raises(TnError, match="holds a tensor"):
        f(x, h)


def test_adaptive_style_call_dict_of_parameters_and_static_flags():
    m = mlp()

    def program(params, flags, args, kwargs):
        """A region's program: the module's forward on a parameter dict."""
        return torch.func.functional_call(m, params, args, kwargs)

    jf = tn.jit(program, static_argnums=(1,), backend="reference")
    params = dict(m.named_parameters())
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            close(jf(dict(params), (False,) * 4, (x,), {}), m(x))
        assert counts(jf) == (1, 2)
        p2 = {k: nn.Parameter(v * 2) for k, v in params.items()}  # same signatures, new tensors
        close(jf(p2, (False,) * 4, (x,), {}), torch.func.functional_call(m, p2, (x,)))
        jf(params, (True,) * 4, (x,), {})
    assert counts(jf) == (2, 3)


def test_recompile_log_after_fast_hits(monkeypatch, caplog):
    monkeypatch.setenv("TN_LOG", "recompiles")
    m = mlp()
    jm = tn.jit(m, backend="reference")
    with caplog.at_level(logging.WARNING, logger="tn"), torch.no_grad():
        jm(torch.randn(2, 4))
        jm(torch.randn(2, 4))
        m.double()
        jm(torch.randn(2, 4).double())
    msgs = [r.getMessage() for r in caplog.records if r.name == "tn"]
    assert len(msgs) == 2
    assert "module.0.weight: f32[8,4] cpu requires_grad -> f64[8,4] cpu requires_grad" in msgs[1]


def test_shadow_module_is_a_structural_copy():
    m = mlp()
    from tn.jit import shadow_module
    c = shadow_module(m)
    assert c is not m and c[0] is not m[0] and c[0].weight is m[0].weight
    c[0]._parameters["weight"] = torch.zeros(8, 4)
    assert m[0].weight is not c[0].weight
