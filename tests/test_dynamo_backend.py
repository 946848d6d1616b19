# torch.compile(backend="neuron"): forward, training (AOTAutograd backward), graph breaks, new shapes, entry point.
import subprocess
import sys

import pytest
import torch

import tn
from tn import dynamo_backend

torch._dynamo.config.cache_size_limit = 64


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_forward_matches_eager_and_runs_through_tn():
    model = _mlp()
    x = torch.randn(8, 16)
    before = dynamo_backend.graphs_compiled()
    compiled = torch.compile(model, backend="neuron")
    with tn.profile() as prof:
        out = compiled(x)
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
    assert dynamo_backend.graphs_compiled() > before
    assert prof.runs and prof.total_us > 0, "the compiled graph must run on the NeuronCore model"


def test_backward_through_compiled_model_matches_eager_grads():
    model = _mlp()
    x = torch.randn(8, 16)
    compiled = torch.compile(model, backend="neuron")
    compiled(x).pow(2).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).pow(2).sum().backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)


def test_sgd_steps_follow_eager_losses():
    data = torch.randn(16, 16)
    target = torch.randn(16, 4)
    losses = {}
    for mode in ("eager", "neuron"):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        step_model = torch.compile(model, backend="neuron") if mode == "neuron" else model
        losses[mode] = []
        for _ in range(5):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(step_model(data), target)
            loss.backward()
            opt.step()
            losses[mode].append(loss.item())
    torch.testing.assert_close(torch.tensor(losses["neuron"]), torch.tensor(losses["eager"]), rtol=1e-4, atol=1e-6)


def test_graph_break_on_data_dependent_branch():
    def f(x):
        y = x.sin()
        if y.sum() > 0:  # needs a real value: Dynamo breaks the graph here
            return y * 2
        return y - 1

    compiled = torch.compile(f, backend="neuron")
    for seed in range(3):
        torch.manual_seed(seed)
        x = torch.randn(10)
        torch.testing.assert_close(compiled(x), f(x))


def test_new_batch_sizes_compile_and_match():
    model = _mlp()
    compiled = torch.compile(model, backend="neuron")
    for batch in (3, 5, 7):
        x = torch.randn(batch, 16)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def test_reference_backend_option_and_bad_option():
    model = _mlp()
    x = torch.randn(4, 16)
    compiled = torch.compile(model, backend="neuron", options={"tn_backend": "reference"})
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
    bad = torch.compile(model, backend="neuron", options={"nope": 1})
    with pytest.raises(Exception, match="unknown options"):
        bad(x)


def test_entry_point_finds_the_backend_without_importing_tn():
    code = (
        "import sys, torch\n"
        "f = torch.compile(lambda x: x * 2 + 1, backend='neuron')\n"
        "assert torch.allclose(f(torch.ones(3)), torch.full((3,), 3.0))\n"
        "assert 'tn' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
