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




class _Attention(torch.nn.Module):
    """One causal self-attention layer through F.scaled_dot_product_attention."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, d)

    def forward(self, x, mask=None):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "bool_mask"])
def test_backward_through_scaled_dot_product_attention(masked):
    # The fused CPU attention kernel's backward op has no tn decomposition; the backend
    # has AOTAutograd trace SDPA's math backend instead (boolean masks converted as SDPA does).
    torch.manual_seed(0)
    model = _Attention()
    x = torch.randn(2, 5, 16)
    mask = torch.rand(2, 1, 5, 5) > 0.3 if masked else None
    if masked:
        mask[..., 0] = True  # every query sees at least one key
    compiled = torch.compile(model, backend="neuron")
    out = compiled(x, mask)
    torch.testing.assert_close(out, model(x, mask), rtol=1e-4, atol=1e-5)
    out.square().sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x, mask).square().sum().backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)
    assert dynamo_backend.host_ops() == {}, "every op of the attention forward and backward lowers natively"


def test_host_ops_of_rejects_non_jitted():
    with pytest.raises(tn.TnError, match="tn.jit function or module"):
        dynamo_backend.host_ops_of(lambda x: x)


def test_device_inputs_results_stay_on_device():
    model = _mlp()
    x = torch.randn(8, 16)
    want = model(x)
    dev = _mlp().to("neuron")
    compiled = torch.compile(dev, backend="neuron")
    with torch.no_grad():
        out = compiled(x.to("neuron"))
    assert out.device.type == "neuron"
    torch.testing.assert_close(out.cpu(), want, rtol=1e-4, atol=1e-5)
    assert all(p.device.type == "neuron" for p in dev.parameters())


def test_device_training_sgd_and_adamw_follow_cpu():
    torch.manual_seed(3)
    data, target = torch.randn(16, 16), torch.randn(16, 4)
    for make_opt in (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), lambda p: torch.optim.AdamW(p, lr=1e-2)):
        losses = {}
        for mode in ("cpu", "neuron"):
            torch._dynamo.reset()
            model = _mlp().to(mode)
            opt = make_opt(model.parameters())
            step_model = model if mode == "cpu" else torch.compile(model, backend="neuron")
            x, y = data.to(mode), target.to(mode)
            losses[mode] = []
            for _ in range(5):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(step_model(x), y)
                loss.backward()
                opt.step()
                losses[mode].append(loss.item())
            if mode == "neuron":
                assert all(p.device.type == "neuron" and p.grad.device.type == "neuron" for p in model.parameters())
        torch.testing.assert_close(torch.tensor(losses["neuron"]), torch.tensor(losses["cpu"]), rtol=1e-4, atol=1e-6)


def test_device_buffer_mutation_is_written_back():
    # BatchNorm's running stats are input mutations of the graph: they must land in device memory.
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)).train()
    dev = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)).train()
    dev.load_state_dict(cpu.state_dict())
    dev = dev.to("neuron")
    x = torch.randn(6, 8)
    compiled = torch.compile(dev, backend="neuron")
    for _ in range(2):
        want = cpu(x)
        got = compiled(x.to("neuron"))
        torch.testing.assert_close(got.detach().cpu(), want.detach(), rtol=1e-4, atol=1e-5)
    bn_cpu, bn_dev = cpu[1], dev[1]
    assert bn_dev.running_mean.device.type == "neuron"
    torch.testing.assert_close(bn_dev.running_mean.cpu(), bn_cpu.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bn_dev.running_var.cpu(), bn_cpu.running_var, rtol=1e-5, atol=1e-6)
    assert int(bn_dev.num_batches_tracked.cpu()) == 2


def test_no_graph_break_from_the_accelerator_stream_hooks():
    # Dynamo's stream tracking calls torch.accelerator.current_stream around every compiled frame; with the neuron
    # device as the accelerator that is tn's wrapper, which Dynamo once compiled as a frame of its own and counted
    # as a graph break ("torch.* op returned non-Tensor") in every torch.compile'd function.
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(lambda a, b: a + b * 2, backend="neuron")
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    torch.testing.assert_close(compiled(a, b), a + b * 2)
    torch.testing.assert_close(compiled(b, a), b + a * 2)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert isinstance(torch.accelerator.current_stream(), torch.neuron.Stream)


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_multilabel_margin_loss_takes_tns_decomposition(reduction):
    """torch registers its multilabel_margin_loss_forward decomposition as the op's Autograd kernel, so AOTAutograd
    took it whatever the table said: it counts the target slots after the first -1 and shapes a 1-d input's
    unreduced loss (1,). The compile door leaves the op to tn's decomposition, as the other doors do."""
    torch.manual_seed(0)
    loss = torch.nn.MultiLabelMarginLoss(reduction=reduction)
    compiled = torch.compile(loss, backend="neuron")
    cases = [(torch.randn(4), torch.tensor([3, 0, -1, 1])),
             (torch.randn(3, 5), torch.tensor([[3, 0, -1, 1, 2], [0, 1, 2, 3, 4], [1, -1, 2, 2, 0]]))]
    for x, t in cases:
        want_x, got_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        want, got = loss(want_x, t), compiled(got_x, t)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * max(1.0, want.abs().max().item()))
        w = torch.randn(want.shape)
        (want * w).sum().backward()
        (got * w).sum().backward()
        torch.testing.assert_close(got_x.grad, want_x.grad, rtol=1e-4, atol=1e-6)
    assert not [op for op in dynamo_backend.host_ops() if "multilabel" in str(op)]


def test_aot_decomposition_table_is_built_once_and_rebuilt_after_new_ops():
    """torch's decomposition table is materialised once (it walks every registered operator, ~0.1 s), not on
    every compile, and built again when an operator was registered since: a new torch.library op with a
    CompositeImplicitAutograd kernel may join it."""
    from tn import dynamo_backend

    first = dynamo_backend._aot_table()
    assert dynamo_backend._aot_table() is first
    assert first.keys() == dynamo_backend.aot_decompositions(torch._decomp.core_aten_decompositions()).keys()
    lib = torch.library.Library("tn_test_aot_table", "DEF")
    try:
        lib.define("twice(Tensor x) -> Tensor")
        lib.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")
        again = dynamo_backend._aot_table()
        assert again is not first and again.keys() == dynamo_backend.aot_decompositions(
            torch._decomp.core_aten_decompositions()).keys()
    finally:
        lib._destroy()


def test_graph_with_data_dependent_result_count_runs_op_by_op():
    """torch.tensor_split by a 0-d tensor returns as many tensors as the tensor's value says: AOTAutograd
    cannot trace that (a GuardOnDataDependentSymNode, which failed the whole compile before). The graph runs
    op by op instead, as Dynamo's own graph break would with torch's default settings: same results as eager,
    on the device for device tensors, counted as host work for CPU tensors; TN_STRICT refuses it."""
    import tn
    from tn import config, dynamo_backend

    def split(x, sections):
        return torch.tensor_split(x * 2, sections)

    x, sections = torch.randn(5, 4), torch.tensor(3)
    want = split(x, sections)
    torch._dynamo.reset()
    before = dynamo_backend.graphs_run_op_by_op()
    with tn.profile() as prof:
        got = torch.compile(split, backend="neuron")(x, sections)
    assert len(got) == 3 and all(torch.equal(g, w) for g, w in zip(got, want))
    assert dynamo_backend.graphs_run_op_by_op() == before + 1
    assert prof.host_ops.get(dynamo_backend.OP_BY_OP) == 1
    torch._dynamo.reset()
    with tn.profile() as prof:
        got = torch.compile(split, backend="neuron")(x.to("neuron"), sections)
    assert [g.device.type for g in got] == ["neuron"] * 3
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))
    assert dynamo_backend.OP_BY_OP not in prof.host_ops
    torch._dynamo.reset()
    with config.override(strict=True), pytest.raises(Exception, match="TN_STRICT"):
        torch.compile(split, backend="neuron")(x, sections)
    torch._dynamo.reset()
