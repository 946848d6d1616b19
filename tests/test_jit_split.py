# Tests of tn.jit on functions that read tensor values: run split at the reads, as device windows, or refused.
import logging

import pytest
import torch

import tn


def _count_programs(fn, *args):
    with tn.profile() as prof:
        out = fn(*args)
    return out, prof


def test_value_dependent_branch_takes_each_calls_branch():
    @tn.jit
    def f(x):
        if x.sum() > 0:
            return x * 2
        return x - 1

    pos, neg = torch.rand(4) + 0.1, -torch.rand(4) - 0.1
    torch.testing.assert_close(f(pos), pos * 2)
    torch.testing.assert_close(f(neg), neg - 1)      # same signature, other branch: no stale program
    assert f.cache_info().misses == 1


def test_data_dependent_shapes_match_eager_and_run_on_the_neuroncore():
    def g(x, y):
        sel = x[x > 0]
        idx = torch.nonzero(y > 0.5)
        n = int((x > 0).sum())
        return sel * 2 + n, idx, torch.unique(torch.round(y * 3))

    x, y = torch.randn(64), torch.rand(8, 8)
    want = g(x, y)
    got, prof = _count_programs(tn.jit(g), x, y)
    for a, e in zip(got, want):
        assert a.device.type == "cpu" and a.dtype == e.dtype and a.shape == e.shape
        torch.testing.assert_close(a, e)
    assert len(prof.runs) >= 2 and not prof.host_ops, (len(prof.runs), prof.host_ops)


def test_fullgraph_and_env_refuse_and_lower_names_the_read(monkeypatch):
    def f(x):
        return x[x > 0]

    x = torch.randn(6)
    with pytest.raises(tn.TracingError, match="boolean mask"):
        tn.jit(f, fullgraph=True)(x)
    with pytest.raises(tn.TracingError, match="boolean mask"):
        tn.jit(f, backend="reference")(x)       # a backend without a device: nothing to split on
    jf = tn.jit(f)
    torch.testing.assert_close(jf(x), x[x > 0])
    with pytest.raises(tn.TracingError, match="boolean mask"):
        jf.lower(x)                              # no single program to show
    monkeypatch.setenv("TN_JIT_SPLIT", "0")
    with pytest.raises(tn.TracingError, match="boolean mask"):
        tn.jit(f)(x)


def test_inputs_mutated_in_place_are_written_back_and_returned_as_themselves():
    @tn.jit
    def f(x, acc):
        k = int((x > 0).sum())
        acc.add_(k)
        return acc, x[:k]

    x, acc = torch.tensor([1.0, -2.0, 3.0, 4.0]), torch.zeros(2)
    out, head = f(x, acc)
    assert out is acc
    torch.testing.assert_close(acc, torch.full((2,), 3.0))
    torch.testing.assert_close(head, x[:3])


def test_gradients_inside_the_function_and_module_parameters():
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 3)

    def step(model, x):
        y = model(x)
        loss = y[y > 0].sum()       # a loss over a data-dependent selection
        return loss, torch.autograd.grad(loss, list(model.parameters()))

    x = torch.randn(7, 5)
    want_loss, want_g = step(lin, x)
    got_loss, got_g = tn.jit(step)(lin, x)
    torch.testing.assert_close(got_loss, want_loss)
    for a, e in zip(got_g, want_g):
        assert a.device.type == "cpu" and not a.requires_grad
        torch.testing.assert_close(a, e)
    assert lin.weight.device.type == "cpu"


def test_results_carry_no_autograd_history_and_neuron_inputs_stay_on_the_device():
    @tn.jit
    def f(x):
        return x[x > 0].exp()

    x = torch.randn(9, requires_grad=True)
    out = f(x)
    assert not out.requires_grad
    xd = x.detach().to("neuron")
    od = f(xd)
    assert od.device.type == "neuron"
    torch.testing.assert_close(od.cpu(), x.detach()[x.detach() > 0].exp())


def test_split_is_logged_and_errors_inside_name_the_split(monkeypatch, caplog):
    monkeypatch.setenv("TN_LOG", "splits")

    @tn.jit
    def f(x):
        n = int(x.sum())
        return x.reshape(n + 1, -1)  # 7 rows of 6 elements: eager's own error, at run time

    with caplog.at_level(logging.WARNING, logger="tn"):
        with pytest.raises(RuntimeError) as info:
            f(torch.ones(6))
    assert any("split at the reads" in r.getMessage() for r in caplog.records)
    assert any("split at its value" in n for n in getattr(info.value, "__notes__", []))


def test_gradients_through_efficient_zeros_and_unique():
    # sgn's backward builds aten._efficientzerotensor (now a zero fill); index_fill's calls aten._unique (a
    # value read: split there)
    x = torch.tensor([[0.0, -1.5, 2.0], [3.0, 0.0, -4.0]], requires_grad=True)
    w = torch.rand(2, 3)
    f = lambda x, w: torch.autograd.grad((torch.sgn(x) * w).sum(), x)[0]  # noqa: E731
    torch.testing.assert_close(tn.jit(f, fullgraph=True)(x, w), f(x, w))
    idx = torch.tensor([0, 2, 0])
    g = lambda x, w: torch.autograd.grad((x.index_fill(1, idx, 0.5) * w).sum(), x)[0]  # noqa: E731
    torch.testing.assert_close(tn.jit(g)(x, w), g(x, w))
