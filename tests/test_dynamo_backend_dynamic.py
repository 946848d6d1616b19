# torch.compile(backend="neuron") with dynamic and data-dependent numbers: views of inputs at offsets that only the
# call knows (dynamic ints, .item()), value reads captured into the graph (nonzero, tensor_split by a tensor).
import pytest
import torch

import tn  # noqa: F401  (registers the neuron device)
from tn import dynamo_backend

torch._dynamo.config.cache_size_limit = 64


pytestmark = pytest.mark.usefixtures("fresh_dynamo")   # tests/conftest.py


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def _same(got, expected):
    got = got if isinstance(got, (tuple, list)) else (got,)
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        assert torch.equal(g.cpu(), e.cpu()), (g, e)


def test_capture_settings_are_on_once_the_backend_is_looked_up():
    torch.compile(lambda x: x, backend="neuron")
    for name in dynamo_backend.CAPTURE_SETTINGS:
        assert getattr(torch._dynamo.config, name) is True, name


@pytest.mark.parametrize("capture", [False, True])
def test_view_of_input_at_a_dynamic_offset(capture):
    # After the second call Dynamo makes the offset a SymInt graph input; AOTAutograd then rebuilds the view
    # from the backend's result (as_strided with the result's storage offset): tn's new tensor gave x[0:3].
    def f(x, s):
        return x.narrow(0, s, 3), x[:, s:] if x.dim() > 1 else x[s:]

    x = torch.arange(10.)
    with torch._dynamo.config.patch(capture_scalar_outputs=capture, capture_dynamic_output_shape_ops=capture):
        g = torch.compile(f, backend="neuron")
        for s in (2, 4, 5, 6):
            _same(g(x, s), f(x, s))
        x2 = torch.arange(36.).reshape(6, 6)
        for s in (1, 2, 3):
            _same(g(x2, s), f(x2, s))


def test_view_of_an_intermediate_at_a_dynamic_offset():
    def f(x, s):
        y = x * 2
        return y, y[s:]

    g = torch.compile(f, backend="neuron")
    x = torch.arange(10.)
    for s in (2, 4, 5):
        _same(g(x, s), f(x, s))


def test_tensor_split_and_narrow_by_tensor_values_pass_through_the_graph():
    def split(x, t):
        return torch.tensor_split(x, t)

    def narrow(x, t):
        return x.narrow(0, t, 3)

    x = torch.arange(10.)
    before = dynamo_backend.graphs_compiled()
    gs, gn = torch.compile(split, backend="neuron"), torch.compile(narrow, backend="neuron")
    for t in (torch.tensor([2, 5]), torch.tensor([1, 7])):
        _same(gs(x, t), split(x, t))
    for t in (torch.tensor(2), torch.tensor(6)):
        _same(gn(x, t), narrow(x, t))
    assert _graph_breaks() == 0, torch._dynamo.utils.counters["graph_break"]
    assert dynamo_backend.graphs_compiled() > before


def test_value_reads_on_device_inputs():
    def f(x, t):
        return x.narrow(0, t, 3), x[x > 4]

    x = torch.arange(10.)
    xd = x.to("neuron")
    g = torch.compile(f, backend="neuron")
    for t in (torch.tensor(2), torch.tensor(5)):
        got = g(xd, t)
        assert all(r.device.type == "neuron" for r in got)
        _same(got, f(x, t))
    assert _graph_breaks() == 0


def test_gradient_through_a_narrow_at_a_read_offset_with_a_created_tensor():
    # The forward graph reads t and creates arange(3, device=cpu): run as split windows on the device, the
    # created tensor must follow the inputs there.
    def f(x, t):
        return (x.narrow(0, t, 3) * torch.arange(3.)).sum()

    g = torch.compile(f, backend="neuron")
    for t in (torch.tensor(2), torch.tensor(6)):
        x = torch.arange(10., requires_grad=True)
        g(x, t).backward()
        got = x.grad.clone()
        x.grad = None
        f(x, t).backward()
        assert torch.equal(got, x.grad)
    assert _graph_breaks() == 0


def test_data_dependent_ops_reach_tn():
    def f(x):
        return torch.nonzero(x > 0), torch.unique(x), x[x > 0].sum() + x.max().item()

    torch.manual_seed(0)
    g = torch.compile(f, backend="neuron")
    for _ in range(2):
        x = torch.randn(12).round()
        got, expected = g(x), f(x)
        _same(got[:2], expected[:2])
        torch.testing.assert_close(got[2], expected[2])
    assert _graph_breaks() == 0
