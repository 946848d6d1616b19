# torch.compile(backend="neuron") where Dynamo refuses by design (data-dependent control flow inside torch.nn):
# the bench names the refusal, and on the neuron device the refused part still runs through tn, right.
import importlib.util
import pathlib

import pytest
import torch

import tn
from tn import dynamo_backend

_PATH = pathlib.Path(__file__).resolve().parents[1] / "bench" / "coverage.py"
_spec = importlib.util.spec_from_file_location("tn_bench_coverage_refusals", _PATH)
cov = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cov)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")   # tests/conftest.py


def _modules():
    g = torch.Generator().manual_seed(3)
    return [
        ("batchnorm_cumulative", lambda: torch.nn.BatchNorm2d(3, momentum=None),
         lambda: (torch.randn(4, 3, 5, 5, generator=g) * 2 + 1,)),
        ("gaussian_nll", lambda: torch.nn.GaussianNLLLoss(),
         lambda: (torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g),
                  torch.rand(4, 3, generator=g) + 0.1)),
    ]


@pytest.mark.parametrize("name,make,inputs", _modules(), ids=[m[0] for m in _modules()])
def test_refused_module_runs_through_tn_on_the_device(name, make, inputs):
    # Dynamo gives up on these calls and runs them eagerly; on the neuron device that is tn's device kernels,
    # which Dynamo must not try to trace as user code (it failed inside the NeuronCore model's program builder).
    m_ref, m_dev = make(), make()
    m_dev.load_state_dict(m_ref.state_dict())
    compiled = torch.compile(m_dev.to("neuron"), backend="neuron")
    xs = inputs()
    ref_in = [x.clone().requires_grad_(i == 0) for i, x in enumerate(xs)]
    dev_in = [x.to("neuron").requires_grad_(i == 0) for i, x in enumerate(xs)]
    tn.device.tracking.reset_op_counts()
    with tn.profile() as prof:
        for _ in range(2):                      # BatchNorm's cumulative average: 1 / num_batches_tracked changes
            out = compiled(*dev_in)
            out.sum().backward()
            ref = m_ref(*ref_in)
            ref.sum().backward()
    assert out.device.type == "neuron"
    torch.testing.assert_close(out.cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dev_in[0].grad.cpu(), ref_in[0].grad, rtol=1e-5, atol=1e-5)
    for (k, b_dev), b_ref in zip(m_dev.state_dict().items(), m_ref.state_dict().values()):
        torch.testing.assert_close(b_dev.cpu(), b_ref, rtol=1e-5, atol=1e-6, msg=k)
    assert dict(prof.host_ops) == {} and tn.device.fallback_ops() == {}    # nothing fell back to the host


def test_tn_runtime_is_on_dynamos_skip_list():
    from torch._dynamo import trace_rules

    dynamo_backend.skip_tn_runtime_in_dynamo()
    import tn.device.eager
    import tn.neuron.program

    import tn.ops.linear_cross_entropy
    import tn.ops.torch_options

    for mod in (tn.device.eager, tn.neuron.program, tn.trace, tn.ops.linear_cross_entropy, tn.ops.table):
        assert trace_rules.check_file(mod.__file__).skipped, mod.__name__
    # the policies tn installs into torch, which torch calls from traced code, stay traceable
    assert not trace_rules.check_file(tn.ops.torch_options.__file__).skipped


@pytest.mark.parametrize("key", ["nn.GaussianNLLLoss/train", "nn.BatchNorm2d/train"])
def test_bench_names_the_refusal(key):
    # max_samples=2: BatchNorm2d's second sample is "2d_simple_average" (momentum=None)
    rec = cov.run_item("module", key, "compile", grad=True, max_samples=2)
    assert rec["status"] == "refused", rec
    assert cov.REFUSED + "data-dependent control flow" in rec["reason"]
    assert "Could not guard on data-dependent expression" in rec["reason"]


@pytest.mark.parametrize("name,words", [("nn.functional.gaussian_nll_loss", "Could not guard on data-dependent"),
                                        ("cov", "Data dependent operator")])
def test_bench_names_op_refusals(name, words):
    """Dynamo refuses these ops' data-dependent branches with every backend: gaussian_nll_loss's Python check of
    ``var`` leaves no graph at all, and ``cov``'s C++ kernel reads ``aten.equal``'s bool."""
    rec = cov.run_item("op", name, "compile", max_samples=1)
    assert rec["status"] == "refused", rec
    assert words in rec["reason"], rec


def test_bench_keeps_other_graph_breaks_as_errors():
    def f(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    assert cov._data_dependent(f, [torch.randn(3)], False, []) is None
