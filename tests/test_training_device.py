# Training on the neuron device: autograd, SGD/AdamW, zero_grad, clipping; MLP and 2-layer GPT-2 losses match the CPU.
import copy

import pytest
import torch

import tn  # noqa: F401  (registers the neuron device)


def _train(model, opt_fn, batches, steps=20, clip=1.0, loss_fn=None):
    opt = opt_fn(model.parameters())
    losses = []
    for step in range(steps):
        x, y = batches[step % len(batches)]
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses


def _mlp_loss(m, x, y):
    return torch.nn.functional.cross_entropy(m(x), y)


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd_foreach_off": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01),
    "adamw_foreach_off": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False),
}


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_mlp_20_steps_match_cpu(opt):
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                              torch.nn.Linear(32, 4))
    dev = copy.deepcopy(cpu).to("neuron")
    assert all(p.device.type == "neuron" for p in dev.parameters())
    batches = [(torch.randn(16, 8), torch.randint(0, 4, (16,))) for _ in range(4)]
    dev_batches = [(x.to("neuron"), y.to("neuron")) for x, y in batches]
    lc = _train(cpu, OPTIMIZERS[opt], batches, loss_fn=_mlp_loss)
    ld = _train(dev, OPTIMIZERS[opt], dev_batches, loss_fn=_mlp_loss)
    assert lc[-1] < lc[0]
    torch.testing.assert_close(torch.tensor(ld), torch.tensor(lc), atol=1e-4, rtol=1e-4)
    for p, q in zip(cpu.parameters(), dev.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), atol=1e-4, rtol=1e-4)


def test_gradients_and_zero_grad():
    torch.manual_seed(1)
    w = torch.randn(5, 3, requires_grad=True)
    wd = w.detach().to("neuron").requires_grad_()
    x = torch.randn(4, 5)
    (x @ w).tanh().sum().backward()
    (x.to("neuron") @ wd).tanh().sum().backward()
    assert wd.grad.device.type == "neuron"
    torch.testing.assert_close(wd.grad.cpu(), w.grad, atol=1e-5, rtol=1e-5)
    total = torch.nn.utils.clip_grad_norm_([wd], 0.5)
    ref = torch.nn.utils.clip_grad_norm_([w], 0.5)
    torch.testing.assert_close(total.cpu(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(wd.grad.cpu(), w.grad, atol=1e-5, rtol=1e-5)
    opt = torch.optim.SGD([wd], lr=0.1)
    opt.zero_grad()
    assert wd.grad is None


@pytest.mark.adaptive_slow
def test_gpt2_two_layers_20_steps_match_cpu():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    cpu = transformers.GPT2LMHeadModel(cfg)
    dev = copy.deepcopy(cpu).to("neuron")
    assert dev.lm_head.weight is dev.transformer.wte.weight  # tying survives .to("neuron")
    cpu.train()
    dev.train()
    ids = [torch.randint(0, 64, (2, 16)) for _ in range(2)]

    def lm_loss(m, x, y):
        return m(input_ids=x, labels=y).loss

    opt = lambda p: torch.optim.AdamW(p, lr=1e-3)  # noqa: E731
    lc = _train(cpu, opt, [(i, i) for i in ids], loss_fn=lm_loss)
    ld = _train(dev, opt, [(i.to("neuron"), i.to("neuron")) for i in ids], loss_fn=lm_loss)
    assert lc[-1] < lc[0]
    torch.testing.assert_close(torch.tensor(ld), torch.tensor(lc), atol=2e-4, rtol=2e-4)
