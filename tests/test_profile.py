# tn.profile(): runs from every thread (autograd's device backward worker included) and host-fallback counts.
import threading

import torch

import tn
from tn.neuron import runtime


def test_runs_in_other_threads_are_collected():
    f = tn.jit(lambda x: x.exp() + 1)
    x = torch.randn(4, 4)
    f(x)
    with tn.profile() as prof:
        t = threading.Thread(target=f, args=(x,))
        t.start()
        t.join()
    assert len(prof.runs) == 1
    assert runtime.active_listeners() == ()


def test_nested_profiles_and_removal():
    f = tn.jit(lambda x: x * 2)
    x = torch.randn(3)
    with tn.profile() as outer:
        f(x)
        with tn.profile() as inner:
            f(x)
        f(x)
    f(x)
    assert len(outer.runs) == 3 and len(inner.runs) == 1


def test_host_fallbacks_are_counted_in_the_profile():
    from tn.profile import note_host_op

    with tn.profile() as prof:
        note_host_op("erfinv", 2)
    note_host_op("erfinv")  # outside any block: nobody counts it
    assert prof.host_ops == {"erfinv": 2}
    assert "erfinv x2" in prof.table(print_it=False) or "no NeuronCore programs" in prof.table(print_it=False)


def test_a_real_host_fallback_shows_in_the_profile():
    f = tn.jit(lambda x: torch.linalg.svd(x).U + 1, backend="neuron")     # singular vectors: a host op
    x = torch.rand(4, 4) * 0.5
    with torch.no_grad(), tn.profile() as prof:
        torch.testing.assert_close(f(x), torch.linalg.svd(x).U + 1)
    assert prof.host_ops.get("host", 0) >= 1
    assert "host" in prof.table(print_it=False)


def test_device_backward_runs_are_profiled():
    if not hasattr(torch, "neuron"):
        import pytest

        pytest.skip("neuron device not registered")
    x_cpu, w_cpu = torch.randn(4, 8), torch.randn(8, 8)
    w = w_cpu.to("neuron").requires_grad_()
    x = x_cpu.to("neuron")
    with tn.profile() as prof:
        loss = (x @ w).relu().sum()
        n_forward = len(prof.runs)
        loss.backward()
    assert len(prof.runs) > n_forward  # the backward ran in autograd's worker thread and was still seen
    expected = x_cpu.T @ ((x_cpu @ w_cpu) > 0).float()
    torch.testing.assert_close(w.grad.cpu(), expected, rtol=1e-4, atol=1e-5)


def test_host_times_per_opcode():
    f = tn.jit(lambda x: torch.tanh(x @ x.T) + 1)
    x = torch.randn(64, 32)
    f(x)
    with tn.profile() as plain:
        f(x)
    assert plain.runs[0].host_ns is None and plain.runs[0].host_ns_by_opcode() == {}
    assert "host_times=True" in plain.table(by="host", print_it=False)
    with tn.profile(host_times=True) as prof:
        f(x)
    assert runtime.HOST_TIMES[0] is False          # restored on exit
    r = prof.runs[0]
    assert r.host_ns.shape == (len(r.opcodes), 2) and (r.host_ns >= 0).all() and r.host_ns.sum() > 0
    by_op = r.host_ns_by_opcode()
    assert sum(c for c, _, _ in by_op.values()) == len(r.opcodes)
    assert {"matmul", "activation"} <= set(by_op)
    text = prof.table(by="host", print_it=False)
    assert "matmul" in text and "kernel_us" in text


def test_programs_are_named_after_their_code_and_what_they_compute():
    """Profiles name a program ``{function or module}_{k}_{what it computes}``, not after its first equation."""
    import torch.nn.functional as F

    class Attention(torch.nn.Module):
        def forward(self, x):
            q = F.layer_norm(x, x.shape[-1:]).reshape(1, 16, 2, 8).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    def step(a, b):
        return (a @ b).relu()

    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    with torch.no_grad(), tn.profile() as prof:
        tn.jit(Attention())(torch.randn(1, 16, 16))
        tn.jit(step)(torch.randn(8, 8), torch.randn(8, 8))
        tn.jit(mlp)(torch.randn(4, 16))
        tn.jit(lambda x: torch.softmax(x, -1))(torch.randn(4, 9))
        torch.compile(mlp, backend="neuron")(torch.randn(4, 16))
    names = [r.name for r in prof.runs if not r.name.startswith("tn_layout")]
    assert names == ["Attention_0_norm+attention", "step_0_matmul+relu", "Sequential_0_mlp", "lambda_0_softmax",
                     "graph_0_mlp"], names
    with tn.profile() as prof:
        x = torch.randn(4, 4).to("neuron")
        torch.softmax(x + 1, -1).cpu()
    assert [r.name for r in prof.runs] == ["tn_0_add", "tn_0_softmax"]      # the device's one-op programs
