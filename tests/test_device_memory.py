# Allocation accounting of the neuron device: every allocation made by models, training and eager ops is freed.
import gc

import torch

import tn  # noqa: F401  (registers the neuron device)
from tn.device import allocator


def test_memory_returns_to_start_after_models_and_training():
    gc.collect()
    start = torch.neuron.memory_allocated()
    blocks = allocator.live_blocks()
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)).to("neuron")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x = torch.randn(8, 16).to("neuron")
    for _ in range(3):
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()
    views = [x.t(), x[1:3], x.view(-1)]
    assert torch.neuron.memory_allocated() > start
    assert torch.neuron.max_memory_allocated() >= torch.neuron.memory_allocated()
    del m, opt, x, views
    gc.collect()
    assert torch.neuron.memory_allocated() == start
    assert allocator.live_blocks() == blocks
    torch.neuron.empty_cache()
    assert torch.neuron.memory_reserved() == torch.neuron.memory_allocated()


def test_storage_freed_exactly_when_last_view_dies():
    gc.collect()
    start = torch.neuron.memory_allocated()
    x = torch.empty(1024, device="neuron")
    v = x[10:20]
    del x
    gc.collect()
    assert torch.neuron.memory_allocated() > start  # the view keeps the storage
    del v
    gc.collect()
    assert torch.neuron.memory_allocated() == start


def test_storage_resize_in_place_frees_and_reallocates_for_every_view():
    """``UntypedStorage.resize_`` on the device (FSDP2 frees its unsharded parameters with ``resize_(0)`` and
    re-allocates them before each all-gather): the same storage object, seen by every view, memory counted."""
    gc.collect()
    start = torch.neuron.memory_allocated()
    x = torch.arange(256., device="neuron")
    x = x * 1.0   # an op result: in adaptive mode still queued when resize_ runs
    view = x[128:]
    st = x.untyped_storage()
    assert st.nbytes() == 1024 and torch.neuron.memory_allocated() - start >= 1024
    assert st.resize_(0) is st and st.nbytes() == 0
    assert view.untyped_storage().nbytes() == 0 and view.untyped_storage().data_ptr() == 0
    assert torch.neuron.memory_allocated() == start
    st.resize_(1024)
    assert view.untyped_storage().data_ptr() == st.data_ptr() != 0
    view.fill_(3.0)
    x[:128].fill_(1.0)
    assert torch.equal(x.cpu(), torch.cat([torch.ones(128), torch.full((128,), 3.0)]))
    st.resize_(512)                        # shrinking and growing keep the bytes both sizes hold
    st.resize_(2048)
    assert st.nbytes() == 2048 and torch.equal(x[:128].cpu(), torch.ones(128))
    del x, view, st
    gc.collect()
    assert torch.neuron.memory_allocated() == start


def test_storage_resize_errors():
    import pytest

    st = torch.empty(4, device="neuron").untyped_storage()
    with pytest.raises(ValueError, match="size must be >= 0"):
        st.resize_(-1)
    cpu = torch.UntypedStorage(8)
    cpu.resize_(16)                        # CPU storages keep torch's own resize
    assert cpu.nbytes() == 16
