# Model-level tests: tn.jit against eager PyTorch on ops, layers, small models and a training step, per backend.
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tn

pytest.importorskip("tn.jit", reason="tn.jit (tn/jit.py) has not landed yet")
pytest.importorskip("tn.trace", reason="the tracer (tn/trace.py) has not landed yet")

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}


def close(actual, expected, dtype=torch.float32, rtol=None, atol=None):
    """assert_close on every tensor leaf of two pytrees, with per-dtype tolerances."""
    a_leaves = torch.utils._pytree.tree_leaves(actual)
    e_leaves = torch.utils._pytree.tree_leaves(expected)
    assert len(a_leaves) == len(e_leaves)
    for a, e in zip(a_leaves, e_leaves):
        if not isinstance(e, torch.Tensor):
            assert a == e
            continue
        kw = dict(TOL.get(e.dtype, TOL[dtype])) if e.dtype.is_floating_point else dict(rtol=0, atol=0)
        if rtol is not None:
            kw["rtol"] = rtol
        if atol is not None:
            kw["atol"] = atol
        torch.testing.assert_close(a, e, **kw)


def _state(args):
    """Arguments with every nn.Module replaced by its state_dict (for comparison)."""
    return [dict(a.state_dict()) if isinstance(a, nn.Module) else a for a in args]


def check(fn, *args, backend, dtype=torch.float32, rtol=None, atol=None, **jit_kw):
    """Run ``fn`` eagerly and through tn.jit on clones of ``args``; compare results."""
    eager_args = copy.deepcopy(args)
    jit_args = copy.deepcopy(args)
    expected = fn(*eager_args)
    actual = tn.jit(fn, backend=backend, **jit_kw)(*jit_args)
    close(actual, expected, dtype, rtol, atol)
    # in-place effects on the arguments (module buffers included) are the same as eager's
    close(_state(jit_args), _state(eager_args), dtype, rtol, atol)
    return actual


# --------------------------------------------------------------------------- elementwise and broadcasting

def test_broadcasting(backend):
    def f(a, b, c):
        return a + b * c, torch.where(a > 0, b, c), (a - c).exp().clamp(max=3.0), a * 2 + 1

    check(f, torch.randn(4, 1, 3), torch.randn(5, 1), torch.randn(3), backend=backend)


def test_type_promotion_and_scalars(backend):
    def f(x, i):
        return x + i, i * 2, (i > 2).float() * x, x / 3, i // 2

    check(f, torch.randn(6), torch.arange(6), backend=backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_elementwise_dtypes(backend, dtype):
    def f(x, y):
        return torch.tanh(x) * torch.sigmoid(y) + F.gelu(x) - F.silu(y) + torch.rsqrt(y.abs() + 1)

    check(f, torch.randn(8, 16, dtype=dtype), torch.randn(8, 16, dtype=dtype), backend=backend, dtype=dtype)


def test_inplace_on_input_is_written_back(backend):
    def f(x, y):
        x.add_(y)
        x.mul_(2)
        return x.sum()

    check(f, torch.randn(3, 4), torch.randn(4), backend=backend)


# --------------------------------------------------------------------------- reductions

def test_reductions(backend):
    def f(x):
        return (x.sum(), x.sum(1), x.mean((0, 2), keepdim=True), x.amax(-1), x.argmax(1), x.argmin(),
                x.var(1), x.std(0, unbiased=False), x.prod(2), torch.logsumexp(x, 1), x.norm(dim=-1),
                x.cumsum(1), x.max(dim=1))

    check(f, torch.randn(3, 5, 7), backend=backend, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- indexing

def test_slicing_and_views(backend):
    def f(x):
        return (x[1:3, ::2], x[:, None, -1], x.t().contiguous(), x.reshape(2, -1), x.view(-1)[3:9],
                x.permute(1, 0).flip(0), torch.cat([x, x * 2], 1), torch.stack([x, -x]), x.unsqueeze(0).expand(3, 4, 6),
                x.chunk(2, 1), x.narrow(0, 1, 2), x.roll(1, 0), x.transpose(0, 1)[2])

    check(f, torch.randn(4, 6), backend=backend)


def test_gather_scatter_index(backend):
    def f(x, idx, src, rows, add_src):
        return (torch.gather(x, 1, idx), x.scatter(1, idx, src), x.scatter_add(1, idx, src), x[rows],
                x.index_select(0, rows), x[rows, 1:3], torch.index_add(x, 0, rows, add_src),
                x.masked_fill(x > 0.5, -1.0), torch.take_along_dim(x, idx, 1))

    x = torch.randn(5, 4)
    idx = torch.randint(0, 4, (5, 3))
    src = torch.randn(5, 3)
    rows = torch.tensor([4, 0, 2])
    check(f, x, idx, src, rows, torch.randn(3, 4), backend=backend, rtol=1e-5, atol=1e-5)


def test_scatter_reduce_index_put_and_friends(backend):
    def f(x, idx, src, rows, vals, cols, newcols):
        y = x.clone()
        y[:, cols] = newcols
        return (x.scatter_reduce(1, idx, src, "amax"), x.scatter_reduce(1, idx, src, "mean", include_self=False),
                x.index_put((rows,), vals, accumulate=True), x.masked_scatter(x > 0, torch.arange(20.0)),
                y, x.unfold(1, 2, 1), F.one_hot(idx, 4), x.tril(), x.triu(1), x[None, ..., cols], x[-1, -2:],
                x.topk(2, 1), x.sort(1, descending=True))

    x = torch.randn(5, 4)
    check(f, x, torch.randint(0, 4, (5, 3)), torch.randn(5, 3), torch.tensor([0, 0, 2]), torch.randn(3, 4),
          torch.tensor([1, 3]), torch.randn(5, 2), backend=backend)


def test_index_put_inplace(backend):
    def f(x, rows, v):
        x[rows] = v
        x[:, 0] += 1.0
        return x * 2

    check(f, torch.randn(5, 3), torch.tensor([0, 3]), torch.randn(2, 3), backend=backend)


def test_embedding(backend):
    emb = nn.Embedding(10, 8)
    check(lambda m, ids: m(ids), emb, torch.randint(0, 10, (2, 5)), backend=backend)


# --------------------------------------------------------------------------- matmul, softmax, norms

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_linear(backend, dtype):
    def f(a, b, w, bias, c):
        return (a @ b, F.linear(a, w, bias[:3]), torch.bmm(c, c.transpose(1, 2)), torch.einsum("ij,jk->ik", a, b),
                torch.addmm(bias[:5], a, b), c @ b)

    check(f, torch.randn(4, 6, dtype=dtype), torch.randn(6, 5, dtype=dtype), torch.randn(3, 6, dtype=dtype),
          torch.randn(3, dtype=dtype).repeat(2), torch.randn(2, 4, 6, dtype=dtype), backend=backend, dtype=dtype,
          rtol=None if dtype == torch.bfloat16 else 1e-5, atol=None if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax(backend, dtype):
    def f(x):
        return F.softmax(x, -1), F.log_softmax(x, 1), torch.softmax(x * 10, 0)

    check(f, torch.randn(4, 9, dtype=dtype), backend=backend, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm(backend, dtype):
    ln = nn.LayerNorm(16).to(dtype)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    check(lambda m, x: m(x), ln, torch.randn(2, 3, 16, dtype=dtype), backend=backend, dtype=dtype,
          atol=1e-4 if dtype == torch.float32 else None)


def test_batch_norm_eval(backend):
    bn = nn.BatchNorm2d(3)
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.normal_()
    bn.eval()
    check(lambda m, x: m(x), bn, torch.randn(4, 3, 5, 5), backend=backend, atol=1e-4)


def test_batch_norm_train_updates_running_stats(backend):
    bn = nn.BatchNorm1d(6)
    bn.train()
    eager = copy.deepcopy(bn)
    jbn = copy.deepcopy(bn)
    f = tn.jit(lambda m, x: m(x), backend=backend)
    for step in range(3):
        x = torch.randn(8, 6) * (step + 1) + step
        close(f(jbn, x), eager(x), atol=1e-4)
        close(jbn.running_mean, eager.running_mean, atol=1e-5)
        close(jbn.running_var, eager.running_var, atol=1e-5)
        assert int(jbn.num_batches_tracked) == int(eager.num_batches_tracked) == step + 1


# --------------------------------------------------------------------------- models

class MLP(nn.Module):
    def __init__(self, d_in=16, d_hidden=32, d_out=4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.fc3 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(torch.relu(self.fc1(x)))))


def test_mlp_module(backend):
    torch.manual_seed(0)
    model = MLP().eval()
    jm = tn.jit(model, backend=backend)
    x = torch.randn(8, 16)
    close(jm(x), model(x), atol=1e-5)
    # parameters are inputs, not baked constants: an in-place update shows up without retracing
    with torch.no_grad():
        model.fc3.bias.add_(1.0)
    close(jm(x), model(x), atol=1e-5)


def test_mlp_bf16(backend):
    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16).eval()
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    close(tn.jit(model, backend=backend)(x), model(x), dtype=torch.bfloat16)


def causal_attention(x, w_qkv, w_out, n_heads):
    B, T, C = x.shape
    q, k, v = (x @ w_qkv).split(C, dim=2)
    q = q.view(B, T, n_heads, C // n_heads).transpose(1, 2)
    k = k.view(B, T, n_heads, C // n_heads).transpose(1, 2)
    v = v.view(B, T, n_heads, C // n_heads).transpose(1, 2)
    att = (q @ k.transpose(-2, -1)) / (C // n_heads) ** 0.5
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    att = att.masked_fill(~mask, float("-inf")).softmax(-1)
    y = (att @ v).transpose(1, 2).reshape(B, T, C)
    return y @ w_out


def test_causal_attention(backend):
    torch.manual_seed(0)
    C = 32
    x, w_qkv, w_out = torch.randn(2, 7, C), torch.randn(C, 3 * C) / C ** 0.5, torch.randn(C, C) / C ** 0.5
    check(causal_attention, x, w_qkv, w_out, 4, backend=backend, atol=1e-4, static_argnums=(3,))


def test_sdpa_causal(backend):
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v,
          backend=backend, atol=1e-5)


def _block_out(m, h):
    """Hidden states out of a transformers block (a tuple in some versions, a tensor in others)."""
    out = m(h)
    return out[0] if isinstance(out, tuple) else out


def test_gpt2_block(backend):
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_head=4, n_layer=1, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "eager"
    block = GPT2Block(cfg, layer_idx=0).eval()
    x = torch.randn(2, 10, 64)

    check(_block_out, block, x, backend=backend, atol=1e-4)


def test_gru_cell_unrolled(backend):
    torch.manual_seed(0)
    cell = nn.GRUCell(6, 10)

    def f(c, xs, h):
        outs = []
        for t in range(xs.shape[0]):
            h = c(xs[t], h)
            outs.append(h)
        return torch.stack(outs)

    check(f, cell, torch.randn(5, 3, 6), torch.zeros(3, 10), backend=backend, atol=1e-5)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 16, 3, stride=2)
        self.fc = nn.Linear(16 * 3 * 3, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.c1(x))), 2)
        x = F.relu(self.c2(x))
        x = F.adaptive_avg_pool2d(x, 3)
        return self.fc(x.flatten(1))


@pytest.mark.parametrize("train", [False, True])
def test_convnet(backend, train):
    torch.manual_seed(0)
    net = ConvNet().train(train)
    check(lambda m, x: m(x), net, torch.randn(2, 3, 16, 16), backend=backend, atol=1e-4)


# --------------------------------------------------------------------------- training

def test_training_step_autograd_grad(backend):
    torch.manual_seed(0)
    model = MLP()
    params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    x, y = torch.randn(8, 16), torch.randn(8, 4)

    def step(params, x, y, lr):
        out = torch.func.functional_call(model, dict(zip(names, params)), (x,))
        loss = F.mse_loss(out, y)
        grads = torch.autograd.grad(loss, params)
        new = [p.detach() - lr * g for p, g in zip(params, grads)]
        return loss.detach(), grads, new

    loss_e, grads_e, new_e = step(params, x, y, 0.1)
    loss_j, grads_j, new_j = tn.jit(step, backend=backend, static_argnums=(3,))(params, x, y, 0.1)
    close(loss_j, loss_e, atol=1e-5)
    close(list(grads_j), list(grads_e), atol=1e-5)
    close(new_j, new_e, atol=1e-5)


def test_training_step_inplace_sgd_on_module(backend):
    torch.manual_seed(0)
    eager_model = MLP()
    jit_model = copy.deepcopy(eager_model)

    def step(m, x, y):
        loss = F.mse_loss(m(x), y)
        grads = torch.autograd.grad(loss, list(m.parameters()))
        with torch.no_grad():
            for p, g in zip(m.parameters(), grads):
                p.sub_(0.05 * g)
        return loss.detach()

    jstep = tn.jit(step, backend=backend)
    for _ in range(3):
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        close(jstep(jit_model, x, y), step(eager_model, x, y), atol=1e-5)
    for pj, pe in zip(jit_model.parameters(), eager_model.parameters()):
        close(pj, pe, atol=1e-5)


def test_gpt2_block_bf16(backend):
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_head=4, n_layer=1, n_positions=32)
    cfg._attn_implementation = "eager"
    block = GPT2Block(cfg, layer_idx=0).to(torch.bfloat16).eval()
    x = torch.randn(2, 10, 64, dtype=torch.bfloat16)
    check(_block_out, block, x, backend=backend, dtype=torch.bfloat16, atol=3e-2, rtol=3e-2)


def test_gpt2_block_grads(backend):
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=1, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "eager"
    block = GPT2Block(cfg, layer_idx=0).train()
    x = torch.randn(2, 6, 32)

    def f(m, h):
        out = m(h)
        out = out[0] if isinstance(out, tuple) else out
        loss = (out ** 2).mean()
        return loss.detach(), torch.autograd.grad(loss, list(m.parameters()))

    check(f, block, x, backend=backend, atol=1e-4, rtol=1e-4)


def test_gpt2_lm_head_model(backend):
    transformers = pytest.importorskip("transformers")

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_head=4, n_layer=2, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 100, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding in the second sequence

    def f(m, ids, mask):
        # An explicit attention mask: without one, transformers inspects position ids
        # with Python control flow (packed-sequence detection) unless it sees a tracer it knows.
        return m(input_ids=ids, attention_mask=mask, use_cache=False).logits

    check(f, model, ids, mask, backend=backend, atol=1e-4, rtol=1e-4)


class TrainConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, stride=2)
        self.fc = nn.Linear(8 * 3 * 3, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.c1(x))), 2)
        x = F.avg_pool2d(F.relu(self.c2(x)), 1)
        return self.fc(x.flatten(1))


def test_convnet_training_step(backend):
    torch.manual_seed(0)
    eager_net = TrainConvNet().train()
    jit_net = copy.deepcopy(eager_net)

    def step(m, x, target):
        loss = F.cross_entropy(m(x), target)
        grads = torch.autograd.grad(loss, list(m.parameters()))
        with torch.no_grad():
            for p, g in zip(m.parameters(), grads):
                p.add_(g, alpha=-0.1)
        return loss.detach()

    jstep = tn.jit(step, backend=backend)
    for _ in range(2):
        x, target = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
        close(jstep(jit_net, x, target), step(eager_net, x, target), atol=1e-5)
    for (name, a), (_, b) in zip(jit_net.state_dict().items(), eager_net.state_dict().items()):
        close(a, b, atol=1e-4, rtol=1e-4)


def test_captured_tensor_updated_in_place_is_seen(backend):
    # constant folding must not bake values derived from a tensor the function captured
    W = torch.randn(4, 4)
    f = tn.jit(lambda x: x @ W.t() + W.sum(), backend=backend)
    x = torch.randn(2, 4)
    close(f(x), x @ W.t() + W.sum())
    with torch.no_grad():
        W.add_(1.0)
    close(f(x), x @ W.t() + W.sum(), atol=1e-5)
