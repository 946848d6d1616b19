# Adaptive eager windows in a steady loop: a cached window's modelled time is the same every run, and the recording
# fast paths (leaf keys by exact type, the conjugate check only on complex tensors) keep the general path's answers.
import enum
import threading

import torch

import tn
from tn.device import windows


def _train_step_runs(steps: int):
    """Per step of a small MLP training step (forward, backward, SGD) on the device: the window programs the
    step ran, as ``(name, total_ns, total_cycles)``, and the loss."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10)).to("neuron")
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 32, generator=g).to("neuron"), torch.randint(0, 10, (8,), generator=g).to("neuron")
    out = []
    for _ in range(steps):
        with tn.profile() as prof:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            value = loss.item()
        out.append(([(r.name, r.total_ns, r.total_cycles) for r in prof.runs], value))
    return out


def test_a_cached_windows_modelled_time_is_the_same_every_run(adaptive):
    # the premise of reusing a cached program's timing: same program, same shapes and placement -> same cycles
    runs = _train_step_runs(5)
    steady = [r for r, _ in runs[1:]]
    assert steady[0] and all(name.startswith("window") for name, _, _ in steady[0])
    assert all(ns > 0 and cycles > 0 for _, ns, cycles in steady[0])     # each window shows with its time
    assert all(r == steady[0] for r in steady[1:])                        # bit-identical modelled times
    s = windows.stats()
    assert s["op_by_op"] == 0 and s["hits"] >= 4 * len(steady[0])
    losses = [v for _, v in runs]
    assert losses[-1] < losses[0]                                          # it trains


class _Kind(enum.IntEnum):
    A = 3


def test_leaf_keys_by_exact_type_match_the_general_checks():
    for v, key in [(3, ("int", 3)), (True, ("bool", True)), ("mean", ("str", "mean")), (None, ("NoneType", None)),
                   (torch.float32, ("dtype", torch.float32)), (torch.device("cpu"), ("device", torch.device("cpu"))),
                   (torch.strided, ("layout", torch.strided)),
                   (torch.contiguous_format, ("memory_format", torch.contiguous_format)),
                   (_Kind.A, ("_Kind", _Kind.A)), (0.5, ("f", "0.5")), (torch.tensor(2.0), ("t", torch.float32, 2.0)),
                   ([1, 2], ("r", "list", "[1, 2]"))]:
        assert windows._leaf_key(v) == key
    assert windows._leaf_key(1) != windows._leaf_key(True) and windows._leaf_key(1) != windows._leaf_key(1.0)


def test_a_conjugated_complex_argument_still_takes_the_checked_path(adaptive):
    a = torch.randn(4, 4, dtype=torch.complex64)
    b = torch.randn(4, 4, dtype=torch.complex64)
    ad, bd = a.to("neuron"), b.to("neuron")
    # mm reaches the device with the lazy conjugate bit set (torch's Conjugate key falls through for it): the
    # one-pass recording must leave it to the checked path, which materialises the conjugate
    got = (ad.conj() @ bd).cpu()
    torch.testing.assert_close(got, a.conj() @ b)
    real = torch.randn(4, 4)
    torch.testing.assert_close((real.to("neuron") * 2).cpu(), real * 2)


def _train(steps: int, hook_threads: set, multithreading=None):
    """Losses of a small training step with a gradient hook recording its thread, in adaptive mode (``None``) or
    with autograd's multithreading flag set explicitly inside adaptive mode."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to("neuron")
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 16).to("neuron"), torch.randint(0, 4, (8,)).to("neuron")
    m[0].weight.register_hook(lambda g: hook_threads.add(threading.get_ident()))
    losses = []
    with windows.eager_mode("adaptive"):
        if multithreading is not None:
            torch._C._set_multithreading_enabled(multithreading)
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def test_backward_runs_on_the_switching_thread_and_on_the_device_thread_alike():
    here, there = set(), set()
    windows.reset_stats()
    got = _train(4, here)
    assert here == {threading.get_ident()}                      # no hand-off to autograd's device thread
    assert torch._C._is_multithreading_enabled()                # leaving adaptive mode restored the flag
    want = _train(4, there, multithreading=True)                # the device thread, as torch runs it
    assert there and threading.get_ident() not in there
    assert got == want                                          # the same windows, the same numbers
    assert windows.stats()["op_by_op"] == 0


def test_a_threads_own_multithreading_choice_survives_the_mode_switch():
    torch._C._set_multithreading_enabled(False)
    try:
        with windows.eager_mode("adaptive"):
            assert not torch._C._is_multithreading_enabled()
        assert not torch._C._is_multithreading_enabled()        # it was off before: it stays off
    finally:
        torch._C._set_multithreading_enabled(True)
    with windows.eager_mode("adaptive"):
        assert not torch._C._is_multithreading_enabled()
        with windows.eager_mode("op"):
            assert torch._C._is_multithreading_enabled()
        assert not torch._C._is_multithreading_enabled()
    assert torch._C._is_multithreading_enabled()


def test_a_backward_started_by_another_thread_runs_on_the_device_thread(adaptive):
    xd = torch.randn(4, 4).to("neuron").requires_grad_()
    seen = set()
    xd.register_hook(lambda g: seen.add(threading.get_ident()))
    out = {}

    def work():
        (xd * xd).sum().backward()
        out["thread"] = threading.get_ident()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen and out["thread"] not in seen                   # that thread did not switch: torch's device thread
    torch.testing.assert_close(xd.grad.cpu(), 2 * xd.detach().cpu())


def test_a_cache_hit_binds_inputs_that_moved_and_keeps_those_that_did_not(adaptive):
    # one window, cached; between calls one input moves to new memory (a decode step's KV cache), the other stays
    # (a weight): each call reads the values its inputs hold now, whichever of them moved
    g = torch.Generator().manual_seed(3)
    w_cpu = torch.randn(16, 16, generator=g)
    w = w_cpu.to("neuron")
    xs_cpu = [torch.randn(4, 16, generator=g) for _ in range(4)]
    got = []
    for k, x_cpu in enumerate(xs_cpu + xs_cpu[:1]):
        x = x_cpu.to("neuron")                  # new memory every call
        if k == 3:
            w.mul_(2.0)                         # the weight's values change in place (same memory)
            w_cpu = w_cpu * 2.0
        got.append((torch.tanh(x @ w) + x).cpu())
        assert torch.allclose(got[-1], torch.tanh(x_cpu @ w_cpu) + x_cpu, atol=1e-5, rtol=1e-5)
    s = windows.stats()
    assert s["op_by_op"] == 0 and s["hits"] >= 3
