# torch.autocast("neuron"): CUDA's cast policy per op on the neuron device; models match CPU autocast.
import copy

import pytest
import torch
import torch.nn.functional as F

import tn  # noqa: F401  (registers the neuron device)
from tn.device import autocast as ac

BF16, F32 = torch.bfloat16, torch.float32


def test_policy_covers_cudas_autocast_op_set():
    # the ops torch registers for AutocastCUDA in this build, minus the cuDNN-only ones, are exactly ours
    cuda = {n[len("aten::"):] for n in torch._C._dispatch_get_all_op_names()
            if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCUDA")}
    cuda -= {"cudnn_convolution", "cudnn_convolution_transpose"}
    ours = {n for names in ac.POLICY.values() for n in names}
    assert ours == cuda
    for n in ours:
        assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::" + n, "AutocastPrivateUse1"), n
    assert ac.policy_of("mm") == "lower" and ac.policy_of("softmax.int") == "fp32_set_opt_dtype"
    assert ac.policy_of("add.Tensor") is None
    assert torch.neuron.get_amp_supported_dtype() == [BF16, torch.float16]


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


@pytest.mark.filterwarnings("ignore::UserWarning")  # the list's chain_matmul and cross are deprecated forms
def test_op_dtypes_follow_cuda_policy():
    from torch.testing._internal.autocast_test_lists import AutocastTestLists

    torch.manual_seed(0)
    lists = AutocastTestLists(torch.device("neuron"))
    cases = [(lists.torch_fp16, torch, BF16), (lists.torch_fp32, torch, F32), (lists.nn_fp16, torch._C._nn, BF16),
             (lists.nn_fp32, torch._C._nn, F32), (lists.linalg_fp16, torch._C._linalg, BF16),
             (lists.torch_need_autocast_promote, torch, F32)]
    seen = 0
    for entries, mod, expect in cases:
        for entry in entries:
            name, args = entry[0], entry[1]
            if name.startswith("cudnn") or name == "einsum":  # einsum's entry there has a 4-d equation, 2-d args
                continue
            kwargs = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
            with torch.autocast("neuron", dtype=BF16):
                out = _first(getattr(mod, name)(*args, **kwargs))
            assert out.dtype == expect, (name, out.dtype, expect)
            assert out.device.type == "neuron", name
            seen += 1
    assert seen >= 90
    x = torch.randn(4, 4, device="neuron")
    with torch.autocast("neuron", dtype=BF16):
        assert torch.einsum("ij,jk->ik", x, x).dtype == BF16
    # fp16 autocast too, and nothing is cast outside the region
    with torch.autocast("neuron", dtype=torch.float16):
        assert (x @ x).dtype == torch.float16
        assert torch.softmax(x.half(), -1).dtype == F32
    assert (x @ x).dtype == F32


def test_set_opt_dtype_append_dtype_promote_and_banned():
    x = torch.randn(4, 6, device="neuron")
    xb = x.to(BF16)
    with torch.autocast("neuron", dtype=BF16):
        assert (x + x).dtype == F32 and (xb + xb).dtype == BF16   # not listed: runs in the dtypes given
        assert xb.sum().dtype == F32 and xb.sum(1).dtype == F32
        assert torch.sum(xb, dtype=torch.float64).dtype == torch.float64  # an explicit dtype is kept
        assert F.softmax(xb, -1).dtype == F32 and F.log_softmax(xb, -1).dtype == F32
        assert xb.cumsum(0).dtype == F32
        assert torch.norm(xb).dtype == F32 and torch.norm(xb, dim=0).dtype == F32
        assert torch.addcmul(x, xb, xb).dtype == F32
        assert torch.addcmul(xb, xb, xb).dtype == BF16
        i = torch.arange(4, device="neuron")
        assert (i * 2).dtype == torch.int64          # integer tensors are never cast
        with pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
            F.binary_cross_entropy(torch.rand(3, device="neuron"), torch.rand(3, device="neuron"))
        with torch.autocast("neuron", enabled=False):
            assert (x @ x.t()).dtype == F32
    # values: a lower-precision op is the op on bf16-rounded inputs
    w = torch.randn(6, 5)
    with torch.autocast("neuron", dtype=BF16):
        y = x @ w.to("neuron")
    torch.testing.assert_close(y.cpu().float(), (x.cpu().to(BF16) @ w.to(BF16)).float(), atol=2e-2, rtol=2e-2)


class _Block(torch.nn.Module):
    """A small transformer block with a conv front end: linear, layer norm, attention, GELU, residuals."""

    def __init__(self, d=32, heads=2, vocab=50):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.conv = torch.nn.Conv1d(d, d, 3, padding=1)
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))
        self.head = torch.nn.Linear(d, vocab)
        self.heads = heads

    def forward(self, ids):
        x = self.emb(ids)
        x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, -1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        att = att.softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        x = x + self.mlp(self.ln2(x))
        return self.head(x)


def test_model_under_autocast_matches_cpu_autocast():
    torch.manual_seed(0)
    cpu = _Block()
    dev = copy.deepcopy(cpu).to("neuron")
    ids = torch.randint(0, 50, (2, 8))
    tgt = torch.randint(0, 50, (2, 8))
    with torch.autocast("cpu", dtype=BF16):
        out_c = cpu(ids)
        loss_c = F.cross_entropy(out_c.flatten(0, 1), tgt.flatten())
    with torch.autocast("neuron", dtype=BF16):
        out_d = dev(ids.to("neuron"))
        loss_d = F.cross_entropy(out_d.flatten(0, 1), tgt.to("neuron").flatten())
    assert out_d.dtype == out_c.dtype == BF16          # the head is a linear: bf16 on both
    assert loss_d.dtype == F32                         # log_softmax / nll_loss run in fp32 (CUDA policy)
    torch.testing.assert_close(out_d.cpu().float(), out_c.float(), atol=6e-2, rtol=5e-2)
    torch.testing.assert_close(loss_d.cpu(), loss_c.float(), atol=2e-2, rtol=2e-2)
    loss_c.backward()
    loss_d.backward()
    for (name, p), q in zip(cpu.named_parameters(), dev.parameters()):
        assert q.grad.dtype == F32 and q.grad.device.type == "neuron", name   # fp32 master weights get fp32 grads
        # tolerances scaled to the gradient's values (a fixed atol of 3e-2 passed an all-zero gradient for
        # 9 of the 17 parameters): elementwise at 3% of the largest entry, and as a whole within 5% in norm
        # (bf16 rounding gives ~1%); an all-zero gradient is 100% off, a sign-flipped one 200%
        scale = p.grad.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(q.grad.cpu(), p.grad, atol=3e-2 * scale, rtol=5e-2, msg=name)
        rel = ((q.grad.cpu() - p.grad).norm() / p.grad.norm()).item()
        assert rel < 5e-2, f"{name}: gradient off by {rel:.1%} in norm"
    # and against the fp32 model: autocast changes the numbers only by bf16 rounding
    with torch.no_grad():
        ref = cpu(ids)
    torch.testing.assert_close(out_d.cpu().float(), ref, atol=1e-1, rtol=1e-1)


def test_autocast_training_step_with_grad_scaler():
    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to("neuron")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("neuron")
    x, y = torch.randn(16, 8).to("neuron"), torch.randint(0, 4, (16,)).to("neuron")
    losses = []
    for _ in range(5):
        opt.zero_grad()
        with torch.autocast("neuron", dtype=BF16):
            loss = F.cross_entropy(m(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    assert all(p.dtype == F32 for p in m.parameters())
    assert losses[-1] < losses[0]


def test_gpt2_under_autocast_matches_cpu_autocast():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    cpu = transformers.GPT2LMHeadModel(cfg).eval()
    dev = copy.deepcopy(cpu).to("neuron")
    ids = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=BF16):
        a = cpu(input_ids=ids, labels=ids)
    with torch.autocast("neuron", dtype=BF16):
        b = dev(input_ids=ids.to("neuron"), labels=ids.to("neuron"))
    assert b.logits.dtype == a.logits.dtype == BF16
    torch.testing.assert_close(b.logits.cpu().float(), a.logits.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(b.loss.cpu().float(), a.loss.float(), atol=5e-3, rtol=5e-3)
