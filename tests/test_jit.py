# Tests of tn.jit / tn.make_ir: cache behaviour, static args, pytrees, modules, write-back, logging, threads, errors.
import copy
import dataclasses
import logging
import threading
from typing import NamedTuple

import pytest
import torch
import torch.nn as nn

import tn
from tn.jit import DEFAULT_CACHE_SIZE, CacheInfo, register_backend

pytest.importorskip("tn.trace", reason="tn.jit needs the tracer (tn/trace.py)")

FP32 = dict(rtol=1e-5, atol=1e-5)


def close(a, b, **tol):
    torch.testing.assert_close(a, b, **(tol or FP32))


# ---------------------------------------------------------------- cache

def test_cache_hits_and_misses_on_abstract_signature():
    @tn.jit
    def f(x, y):
        return x * y + 1

    x, y = torch.randn(4, 8), torch.randn(4, 8)
    close(f(x, y), x * y + 1)
    assert f.cache_info() == CacheInfo(hits=0, misses=1, size=1, maxsize=DEFAULT_CACHE_SIZE)
    x2, y2 = torch.randn(4, 8), torch.randn(4, 8)  # new values, same signature: a hit
    close(f(x2, y2), x2 * y2 + 1)
    assert (f.cache_info().hits, f.cache_info().misses) == (1, 1)
    f(torch.randn(5, 8), torch.randn(5, 8))  # shape
    f(x.double(), y.double())  # dtype
    f(x.requires_grad_(), y)  # requires_grad
    assert f.cache_info().misses == 4
    with torch.no_grad():  # grad mode
        close(f(x, y), x * y + 1)
    assert f.cache_info().misses == 5
    assert f.cache_info().size == 5
    f.cache_clear()
    assert f.cache_info() == CacheInfo(0, 0, 0, f.cache_info().maxsize)


def test_autocast_is_in_the_key():
    @tn.jit
    def f(x, w):
        return x @ w

    x, w = torch.randn(4, 8), torch.randn(8, 3)
    assert f(x, w).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = f(x, w)
        want = x @ w
    assert got.dtype == want.dtype == torch.bfloat16
    close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
    assert f.cache_info().misses == 2
    assert f(x, w).dtype == torch.float32


def test_cache_size_evicts_least_recently_used():
    @tn.jit(cache_size=2)
    def f(x):
        return x.sin()

    a, b, c = torch.randn(2), torch.randn(3), torch.randn(4)
    f(a), f(b)
    f(a)  # a is now most recent
    f(c)  # evicts b
    info = f.cache_info()
    assert (info.size, info.misses, info.hits, info.maxsize) == (2, 3, 1, 2)
    f(a)
    assert f.cache_info().hits == 2
    close(f(b), b.sin())  # b was evicted: a miss
    assert f.cache_info().misses == 4


def test_python_scalars_are_constants_in_the_key():
    @tn.jit
    def f(x, alpha):
        return x * alpha

    x = torch.randn(3)
    close(f(x, 2.0), x * 2)
    close(f(x, 3.0), x * 3)
    close(f(x, 2.0), x * 2)
    assert (f.cache_info().misses, f.cache_info().hits) == (2, 1)


# ---------------------------------------------------------------- static args

def test_static_argnums_and_argnames():
    def f(x, n, *, mode="sum"):
        y = x.reshape(n, -1)
        return y.sum(0) if mode == "sum" else y.amax(0)

    x = torch.randn(12)
    jf = tn.jit(f, static_argnums=1, static_argnames="mode")
    close(jf(x, 3), f(x, 3))
    close(jf(x, 4), f(x, 4))
    close(jf(x, 3, mode="max"), f(x, 3, mode="max"))
    close(jf(x, 3), f(x, 3))
    assert (jf.cache_info().misses, jf.cache_info().hits) == (3, 1)


def test_static_position_passed_by_keyword_and_name_passed_by_position():
    def f(x, n):
        return x.reshape(n, -1).sum(0)

    x = torch.randn(12)
    by_num = tn.jit(f, static_argnums=(1,))
    close(by_num(x, n=3), f(x, 3))
    by_name = tn.jit(f, static_argnames=("n",))
    close(by_name(x, 4), f(x, 4))
    close(by_name(x, n=4), f(x, 4))


# ---------------------------------------------------------------- pytrees

class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


@dataclasses.dataclass
class Out:
    total: torch.Tensor
    parts: list
    note: str = "ok"


def test_pytrees_in_and_out():
    def f(p, d, items):
        s = p.a + p.b
        return Out(total=s + d["w"] * items[0], parts=[s, {"k": items[1].exp()}], note=d["tag"])

    jf = tn.jit(f)
    for _ in range(2):  # new values, same signature: the second call is a hit (all tensors are inputs)
        p = Pair(torch.randn(3), torch.randn(3))
        d = {"w": torch.randn(3), "tag": "hello"}
        items = [torch.randn(3), torch.randn(2)]
        got = jf(p, d, items)
        want = f(p, d, items)
        assert isinstance(got, Out) and got.note == "hello"
        close(got.total, want.total)
        close(got.parts[0], want.parts[0])
        close(got.parts[1]["k"], want.parts[1]["k"])
    assert (jf.cache_info().misses, jf.cache_info().hits) == (1, 1)
    assert len(tn.make_ir(f)(p, d, items).inputs) == 5


@dataclasses.dataclass(frozen=True)
class Batch:
    x: torch.Tensor
    mask: torch.Tensor
    scale: float = 2.0


def test_dataclass_inputs():
    @tn.jit
    def f(b):
        return (b.x * b.scale).masked_fill(b.mask, 0.0)

    b = Batch(torch.randn(3, 4), torch.rand(3, 4) > 0.5)
    close(f(b), (b.x * 2.0).masked_fill(b.mask, 0.0))
    close(f(Batch(b.x, b.mask, 3.0)), (b.x * 3.0).masked_fill(b.mask, 0.0))
    f(Batch(torch.randn(3, 4), b.mask))
    assert (f.cache_info().misses, f.cache_info().hits) == (2, 1)


def test_namedtuple_and_none_outputs():
    @tn.jit
    def f(x):
        return Pair(x + 1, x * 2), None, 3

    x = torch.randn(4)
    pair, none, three = f(x)
    assert isinstance(pair, Pair) and none is None and three == 3
    close(pair.b, x * 2)


def test_hf_model_output_round_trips():
    mo = pytest.importorskip("transformers.modeling_outputs")

    @tn.jit
    def f(h):
        return mo.BaseModelOutput(last_hidden_state=h.tanh(), hidden_states=(h, h * 2))

    h = torch.randn(2, 3)
    out = f(h)
    assert isinstance(out, mo.BaseModelOutput)
    close(out.last_hidden_state, h.tanh())
    close(out.hidden_states[1], h * 2)


# ---------------------------------------------------------------- modules

def test_module_parameters_are_inputs_not_constants():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    jm = tn.jit(m)
    x = torch.randn(5, 8)
    with torch.no_grad():
        close(jm(x), m(x))
        m[0].weight.mul_(0.5)
        m[2].bias.add_(1.0)
        close(jm(x), m(x))
    info = jm.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    ir = tn.make_ir(m)(x)
    assert len(ir.inputs) == 5  # 4 parameters + x


def test_gru_module_uses_current_weights_and_is_left_untouched():
    torch.manual_seed(0)
    g = nn.GRU(4, 8, batch_first=True)
    jg = tn.jit(g)
    x = torch.randn(2, 5, 4)
    with torch.no_grad():
        close(jg(x)[0], g(x)[0])
        g.weight_hh_l0.mul_(0.5)
        out, h = jg(x)
        want_out, want_h = g(x)
    close(out, want_out)
    close(h, want_h)
    assert jg.cache_info().misses == 1
    assert all(type(w) is nn.Parameter for w in g._flat_weights)


def test_jitted_module_forwards_attributes():
    m = nn.Linear(3, 2)
    jm = tn.jit(m)
    assert jm.weight is m.weight and jm.module is m
    assert set(jm.state_dict()) == set(m.state_dict())
    assert jm.eval() is jm and not m.training
    assert jm.train() is jm and m.training
    jm.new_attr = 5
    assert m.new_attr == 5
    x = torch.randn(2, 3)
    with torch.no_grad():
        close(jm.forward(x), m(x))
    assert jm.cache_info().misses == 1


def test_module_training_flag_and_structure_are_in_the_key():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    jm = tn.jit(m)
    x = torch.randn(2, 4)
    with torch.no_grad():
        m.eval()
        close(jm(x), m(x))
        m[0] = nn.Linear(4, 4)  # replaced submodule: new parameters must be used
        close(jm(x), m(x))
        m[0].weight = nn.Parameter(torch.randn(4, 4))  # reassigned parameter
        close(jm(x), m(x))
    assert jm.cache_info().misses >= 1
    m.train()
    jm(x)
    assert jm.cache_info().misses >= 2


def test_batchnorm_train_mode_writes_back_running_stats():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(6)
    ref = copy.deepcopy(bn)
    jbn = tn.jit(bn)
    for _ in range(2):
        x = torch.randn(8, 6)
        close(jbn(x), ref(x), rtol=1e-4, atol=1e-4)
    close(bn.running_mean, ref.running_mean)
    close(bn.running_var, ref.running_var)
    assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked) == 2
    bn.eval(), ref.eval()
    x = torch.randn(8, 6)
    close(jbn(x), ref(x), rtol=1e-4, atol=1e-4)
    assert jbn.cache_info().misses == 2


def test_input_mutation_is_written_back():
    def f(x, y):
        x.add_(y)
        return x * 2

    x, y = torch.randn(5), torch.randn(5)
    xe = x.clone()
    want = f(xe, y)
    got = tn.jit(f)(x, y)
    close(got, want)
    close(x, xe)


def test_module_as_argument_with_tied_weights():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Linear(4, 6, bias=False)
            self.head = nn.Linear(6, 4, bias=False)
            self.head.weight = self.emb.weight  # 6x4 used both ways: tied

        def forward(self, x):
            return self.emb(x) @ self.head.weight

    torch.manual_seed(0)
    m = Tied()

    def f(model, x):
        return model(x).sum(-1)

    jf = tn.jit(f)
    x = torch.randn(3, 4)
    with torch.no_grad():
        close(jf(m, x), f(m, x))
        m.emb.weight.mul_(2)
        close(jf(m, x), f(m, x))
    assert jf.cache_info().misses == 1
    assert len(tn.make_ir(f)(m, x).inputs) == 2  # one shared weight + x


def test_module_static_argnums_refer_to_forward_parameters():
    class Scale(nn.Module):
        def forward(self, x, k):
            return x.reshape(k, -1) * 2

    jm = tn.jit(Scale(), static_argnums=1)
    x = torch.randn(12)
    close(jm(x, 3), x.reshape(3, -1) * 2)
    close(jm(x, k=4), x.reshape(4, -1) * 2)
    with pytest.raises(tn.TnError, match="out of range"):
        tn.jit(Scale(), static_argnums=2)


def test_lower_returns_the_cached_program():
    f = tn.jit(lambda x: x.relu() * 3)
    x = torch.randn(2, 5)
    ir = f.lower(x)
    assert isinstance(ir, tn.IR) and "f32[2,5]" in str(ir)
    f(x)
    assert f.cache_info().misses == 1 and f.cache_info().hits == 1


def test_recompile_log_names_module_training_flag(monkeypatch, caplog):
    monkeypatch.setenv("TN_LOG", "recompiles")
    jm = tn.jit(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)).eval())
    x = torch.randn(1, 2)
    with caplog.at_level(logging.WARNING, logger="tn"), torch.no_grad():
        jm(x)
        jm.train()
        jm(x)
    last = [r.getMessage() for r in caplog.records if r.name == "tn"][-1]
    assert "module (training flags): eval -> train" in last


def test_returned_mutated_input_is_the_input_itself():
    def f(x, y):
        x.mul_(y)
        return x, x + 1

    x, y = torch.randn(4), torch.randn(4)
    want = x * y
    same, plus = tn.jit(f)(x, y)
    assert same is x
    close(x, want)
    close(plus, want + 1)


def test_jit_as_method_decorator_sees_module_parameters():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        @tn.jit
        def forward(self, x):
            return self.lin(x).relu()

    torch.manual_seed(0)
    m = M()
    x = torch.randn(2, 3)
    with torch.no_grad():
        want = m.lin(x).relu()
        close(m(x), want)
        m.lin.weight.mul_(-1)
        close(m(x), m.lin(x).relu())
    assert m.forward.cache_info().misses == 1


def test_nested_jit_is_inlined():
    inner = tn.jit(lambda x: x.exp())

    @tn.jit
    def outer(x):
        return inner(x) + 1

    x = torch.randn(3)
    close(outer(x), x.exp() + 1)
    assert inner.cache_info().misses == 0


# ---------------------------------------------------------------- logging, threads, devices, backends

def test_recompile_logging_names_the_changed_argument(monkeypatch, caplog):
    monkeypatch.setenv("TN_LOG", "recompiles")

    @tn.jit
    def f(x, y):
        return x + y

    with caplog.at_level(logging.WARNING, logger="tn"):
        f(torch.randn(4, 8), torch.randn(8))
        f(torch.randn(5, 8), torch.randn(8))
    msgs = [r.getMessage() for r in caplog.records if r.name == "tn"]
    assert len(msgs) == 2
    assert "first call" in msgs[0]
    assert "x: f32[4,8] cpu -> f32[5,8] cpu" in msgs[1]
    assert "called from test_jit.py:" in msgs[1]
    assert "y:" not in msgs[1].split("signature:")[1]  # y did not change


def test_no_recompile_logging_by_default(monkeypatch, caplog):
    monkeypatch.delenv("TN_LOG", raising=False)
    f = tn.jit(lambda x: x + 1)
    with caplog.at_level(logging.DEBUG, logger="tn"):
        f(torch.randn(2))
        f(torch.randn(3))
    assert not [r for r in caplog.records if r.name == "tn"]


def test_thread_safety_many_threads_one_function():
    @tn.jit
    def f(x):
        return (x * 3).sum(-1)

    inputs = [torch.randn(4, 8), torch.randn(2, 16)]
    errors = []

    def worker(k):
        try:
            for i in range(40):
                x = inputs[(i + k) % 2]
                torch.testing.assert_close(f(x), (x * 3).sum(-1))
        except Exception as e:  # collected and re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    info = f.cache_info()
    assert info.misses == 2 and info.hits == 4 * 40 - 2


def test_thread_safety_jitted_module_traces_while_others_run():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)).eval()
    jm = tn.jit(m)
    shapes = [(2, 8), (3, 8), (4, 8), (5, 8), (6, 8), (7, 8)]
    errors = []

    def worker(k):
        try:
            with torch.no_grad():
                for i in range(12):
                    x = torch.randn(*shapes[(i * (k + 1)) % len(shapes)])
                    got = jm(x)  # traces of new shapes overlap other threads' calls,
                    torch.testing.assert_close(got, m(x), rtol=1e-5, atol=1e-5)  # jitted and eager
        except Exception as e:  # collected and re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert jm.cache_info().misses == len(shapes)
    assert all(not isinstance(p, torch.Tensor) or type(p) in (torch.Tensor, nn.Parameter) for p in m.parameters())


def test_keyword_order_does_not_retrace():
    f = tn.jit(lambda x, y: x - y)
    a, b = torch.randn(3), torch.randn(3)
    close(f(x=a, y=b), a - b)
    close(f(y=b, x=a), a - b)
    assert (f.cache_info().misses, f.cache_info().hits) == (1, 1)


def test_results_carry_no_autograd_history_and_training_uses_autograd_grad():
    torch.manual_seed(0)
    lin = nn.Linear(4, 1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    assert not tn.jit(lin)(x).requires_grad

    def step(model, x, y):
        loss = ((model(x) - y) ** 2).mean()
        return loss, torch.autograd.grad(loss, list(model.parameters()))

    loss, grads = tn.jit(step)(lin, x, y)
    want_loss, want_grads = step(lin, x, y)
    close(loss, want_loss.detach())
    for g, w in zip(grads, want_grads):
        close(g, w)


def test_results_come_back_on_the_inputs_device():
    f = tn.jit(lambda x: (x + 1, x.sum()))
    a, b = f(torch.randn(3))
    assert a.device.type == "cpu" and b.device.type == "cpu"


def test_inputs_on_another_device_run_on_the_host_and_come_back():
    x = torch.randn(4).to("neuron")   # the device is part of tn: a broken one fails here
    seen = []

    def compile_fn(ir):
        from tn.reference import run_ir

        def run(flat):
            seen.append({t.device.type for t in flat})
            return run_ir(ir, flat)
        return run

    register_backend("test-host", compile_fn)
    f = tn.jit(lambda x: (x * 3).sum(), backend="test-host")
    out = f(x)
    assert seen == [{"cpu"}]
    assert out.device == x.device
    close(out.cpu(), (x.cpu() * 3).sum())


def test_custom_backend_registry():
    seen = []

    def compile_fn(ir):
        seen.append(ir)
        from tn.reference import run_ir
        return lambda flat: run_ir(ir, flat)

    register_backend("test-counting", compile_fn)
    assert "test-counting" in tn.jit.backends()
    f = tn.jit(lambda x: x.cos(), backend="test-counting")
    x = torch.randn(3)
    close(f(x), x.cos())
    f(x)
    assert len(seen) == 1 and isinstance(seen[0], tn.IR)


def test_neuron_backend_is_found_by_name():
    import importlib.util
    if importlib.util.find_spec("tn.lower") is None:
        pytest.skip("the NeuronCore compiler (tn.lower) has not landed")
    f = tn.jit(lambda x, y: (x * y).sum(-1), backend="neuron")
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    close(f(x, y), (x * y).sum(-1), rtol=1e-5, atol=1e-5)


def test_default_backend_from_environment(monkeypatch):
    from tn.jit import DEFAULT_BACKEND
    assert tn.jit.default_backend() == DEFAULT_BACKEND or "TN_BACKEND" in __import__("os").environ
    used = []

    def compile_fn(ir):
        used.append(ir)
        from tn.reference import compile_ir
        return compile_ir(ir)

    register_backend("test-env", compile_fn)
    monkeypatch.setenv("TN_BACKEND", "test-env")
    assert tn.jit.default_backend() == "test-env"
    f = tn.jit(lambda x: x.abs())
    x = torch.randn(3)
    close(f(x), x.abs())
    assert len(used) == 1


def test_make_ir_prints_avals():
    def f(x, w):
        return (x @ w).relu()

    ir = tn.make_ir(f)(torch.randn(4, 8), torch.randn(8, 3))
    assert isinstance(ir, tn.IR)
    text = str(ir)
    assert "f32[4,8]" in text and "f32[8,3]" in text and "f32[4,3]" in text


def test_make_ir_static_args():
    ir = tn.make_ir(lambda x, n: x.reshape(n, -1), static_argnums=1)(torch.randn(12), 3)
    assert "f32[3,4]" in str(ir)


# ---------------------------------------------------------------- errors

def test_error_static_argnums_out_of_range():
    with pytest.raises(tn.TnError, match=r"static_argnums=\(2,\).*out of range.*x, n"):
        tn.jit(lambda x, n: x, static_argnums=2)


def test_error_unknown_static_argname():
    with pytest.raises(tn.TnError, match=r"no parameter 'm'"):
        tn.jit(lambda x, n: x, static_argnames="m")


def test_error_unhashable_static_argument():
    f = tn.jit(lambda x, shape: x.reshape(shape), static_argnums=1)
    with pytest.raises(tn.TnError, match=r"'shape' is a list.*hashable"):
        f(torch.randn(4), [2, 2])


def test_error_tensor_as_static_argument():
    f = tn.jit(lambda x, y: x + y, static_argnames="y")
    with pytest.raises(tn.TnError, match=r"static argument 'y' is a tensor"):
        f(torch.randn(2), y=torch.randn(2))


def test_error_numpy_array_argument():
    np = pytest.importorskip("numpy")
    f = tn.jit(lambda x: x)
    with pytest.raises(tn.TnError, match=r"'x' is a ndarray.*torch.from_numpy"):
        f(np.ones(3))


def test_error_object_hiding_tensors():
    class Holder:
        def __init__(self):
            self.name = "h"
            self.layers = [{"bias": torch.randn(2)}]

    f = tn.jit(lambda x, h: x + h.layers[0]["bias"])
    with pytest.raises(tn.TnError, match=r"type .*Holder holds a tensor \(at layers\[0\]\['bias'\]\).*dataclass"):
        f(torch.randn(2), Holder())


def test_error_not_callable_and_bad_options():
    with pytest.raises(tn.TnError, match="expected a function or an nn.Module"):
        tn.jit(42)
    with pytest.raises(tn.TnError, match="unknown backend 'nope'.*reference"):
        tn.jit(lambda x: x, backend="nope")
    with pytest.raises(tn.TnError, match="cache_size"):
        tn.jit(lambda x: x, cache_size=0)


def test_tracing_error_propagates_unchanged():
    # fullgraph=True refuses a value read (without it the neuron backend splits there: tests/test_jit_split.py)
    @tn.jit(fullgraph=True)
    def f(x):
        if x.sum() > 0:
            return x
        return -x

    with pytest.raises(tn.TracingError):
        f(torch.randn(3))


# ---------------------------------------------------------------- the demo

def test_demo_passes_and_fails_loudly(monkeypatch, capsys):
    import tn.demo as demo

    small = [demo.Case("tiny mlp", demo.MLP(8, 16, 4).eval(), (torch.randn(2, 8),))]
    monkeypatch.setattr(demo, "cases", lambda: small)
    assert demo.main([]) == 0
    out = capsys.readouterr().out
    assert "tn.make_ir(MLP)(f32[2,8])" in out and "ok" in out

    def wrong(ir):
        from tn.reference import run_ir
        return lambda flat: [o + 1 for o in run_ir(ir, flat)]

    register_backend("test-wrong", wrong)
    assert demo.main(["--no-ir", "--backend", "test-wrong"]) == 1
    assert "FAIL" in capsys.readouterr().out


@tn.jit
def _module_level_jitted(x):
    return x + 1


def test_copy_and_pickle():
    import pickle

    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    jm = tn.jit(m, cache_size=5)
    x = torch.randn(4, 3)
    jm(x)
    jc = copy.deepcopy(jm)
    assert isinstance(jc, type(jm)) and jc.module is not m and jc.cache_info().maxsize == 5
    with torch.no_grad():
        jc.weight.zero_()
        close(jc(x), jc.bias.expand(4, 2))
        close(jm(x), m(x))
    jp = pickle.loads(pickle.dumps(jm))
    with torch.no_grad():
        close(jp(x), m(x))
    assert copy.deepcopy(_module_level_jitted) is _module_level_jitted
    assert pickle.loads(pickle.dumps(_module_level_jitted)) is _module_level_jitted


# ---------------------------------------------------------------- profile and stats of the last call

def test_last_profile_and_stats_of_the_neuron_backend():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    f = tn.jit(model, backend="neuron")
    g = tn.jit(lambda x: x.exp(), backend="neuron")
    assert f.last_profile is None and f.stats is None  # nothing ran yet
    with torch.no_grad():
        f(torch.randn(4, 8))
        g(torch.randn(3))
    assert f.last_profile.total_us > 0
    assert f.last_profile.matmul_flops == 2 * 4 * (8 * 16 + 16 * 4)
    assert g.last_profile.total_us > 0 and g.last_profile.matmul_flops == 0
    assert f.stats["host_ops"] == {}
    ref = tn.jit(lambda x: x + 1, backend="reference")
    ref(torch.ones(2))
    assert ref.last_profile is None and ref.stats is None
