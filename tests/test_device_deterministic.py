# torch.use_deterministic_algorithms(True) on the neuron device, in both eager modes (op by op and adaptive windows):
# memory torch makes uninitialised (empty, empty_like, a growing resize_) is filled as torch's CPU kernels fill it.
import pytest
import torch

import tn  # noqa: F401  (registers the neuron device)


@pytest.fixture
def deterministic():
    was, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(was)
    torch.utils.deterministic.fill_uninitialized_memory = fill


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64, torch.int32, torch.uint8,
                                   torch.bool])
def test_empty_is_filled_as_on_cpu(deterministic, device_eager_mode, dtype):
    want = torch.empty(5, dtype=dtype)
    got = torch.empty(5, dtype=dtype, device="neuron")
    like = torch.empty_like(torch.zeros(2, 3, dtype=dtype, device="neuron"))
    strided = torch.empty_strided((2, 3), (1, 2), dtype=dtype, device="neuron")
    for t in (got, like, strided):
        torch.testing.assert_close(t.cpu().flatten()[:1].expand(t.numel()), want[:1].expand(t.numel()),
                                   equal_nan=True)
        assert torch.equal(t.cpu().isnan() if dtype.is_floating_point or dtype.is_complex else t.cpu(),
                           torch.ones_like(t.cpu(), dtype=torch.bool) if dtype.is_floating_point or dtype.is_complex
                           else want[:1].expand(t.shape))


def test_values_computed_from_empty_memory_match_cpu(deterministic, device_eager_mode):
    """An op reading torch.empty's memory (inside one adaptive window too) sees the filled values."""
    a = torch.empty(4, device="neuron") + 1
    b = torch.empty(4, dtype=torch.int64, device="neuron") - 1
    assert a.cpu().isnan().all()
    assert torch.equal(b.cpu(), torch.empty(4, dtype=torch.int64) - 1)


def test_growing_resize_fills_the_new_elements(deterministic, device_eager_mode):
    for dtype in (torch.float32, torch.int16):
        want = torch.zeros(3, dtype=dtype).resize_(7)
        got = torch.zeros(3, dtype=dtype, device="neuron").resize_(7)
        torch.testing.assert_close(got.cpu(), want, equal_nan=True)


def test_without_deterministic_mode_empty_is_not_filled(device_eager_mode):
    """The fill costs a host write: it happens only in deterministic mode (then memory is whatever it was)."""
    assert not torch.are_deterministic_algorithms_enabled()
    torch.zeros(64, device="neuron").cpu()
    t = torch.empty(64, device="neuron")
    assert not t.cpu().isnan().all()
