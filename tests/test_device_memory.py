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
