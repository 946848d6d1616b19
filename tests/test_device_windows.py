# Adaptive eager on the neuron device (tn.device.windows): queued ops, one compiled program per window, as eager.
import copy
import logging
import threading

import pytest
import torch

import tn
from tn.device import windows


def _dev(*ts):
    return [t.to("neuron") for t in ts]


def test_elementwise_chain_is_one_window_run_when_read(adaptive):
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    xd, wd = _dev(x, w)
    yd = ((xd @ wd).relu() * 2 + 1).sum(1)
    assert yd.shape == (4,) and yd.dtype == torch.float32 and yd.device.type == "neuron"
    assert windows.pending_ops() == 5          # nothing ran yet
    torch.testing.assert_close(yd.cpu(), ((x @ w).relu() * 2 + 1).sum(1))
    s = windows.stats()
    assert (s["windows"], s["ops"], s["compiles"], s["pending_ops"]) == (1, 5, 1, 0)
    assert s["flush_reasons"] == {"host access": 1}
    yd2 = ((xd @ wd).relu() * 2 + 1).sum(1)    # the same sequence again: the cached program
    torch.testing.assert_close(yd2.cpu(), yd.cpu(), rtol=0, atol=0)
    s = windows.stats()
    assert (s["windows"], s["hits"], s["compiles"]) == (2, 1, 1) and s["hit_rate"] == 0.5


def test_views_and_in_place_ops_behave_as_in_eager(adaptive):
    x = torch.randn(6, 5)
    p = torch.randn(5)

    def f(x, p):
        y = x * 2
        v = y[1:4, ::2]            # a strided view of a pending result
        v.add_(1)                  # written through the view
        y.t()[0].mul_(3)           # a transposed row: column 0 of y
        p.sub_(y.mean(0))          # an in-place update of a tensor made before the window
        z = torch.cat([y, p[None]], 0).unsqueeze(0)
        return y, v, z, p

    want = f(x.clone(), p.clone())
    xd, pd = _dev(x, p)
    got = f(xd, pd)
    assert got[3] is pd and windows.pending_ops() > 0
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.stride() == w.stride() or not w.is_contiguous()
        torch.testing.assert_close(g.cpu(), w)
    torch.testing.assert_close(pd.cpu(), want[3])


def test_results_nobody_holds_are_not_written_back(adaptive):
    xd = torch.randn(64, 64).to("neuron")
    a = xd.exp()
    b = a * 2
    c = b + 1
    del a, b
    c.cpu()
    entry = next(reversed(windows._CACHE.values()))[0]
    assert len(entry.outputs) == 1             # only c leaves the program; a and b stayed on chip


def test_a_program_serves_calls_with_fewer_live_results(adaptive):
    xd = torch.randn(8, 8).to("neuron")

    def f(keep):
        a = xd.exp()
        b = a * 2
        if not keep:
            del a
        return (b + 1).cpu(), b

    f(True)
    f(False)                                    # fewer results alive: the same program, a's output skipped
    assert windows.stats()["compiles"] == 1 and windows.stats()["hits"] == 1
    torch.testing.assert_close(f(False)[0], (xd.cpu().exp() * 2) + 1)


def test_error_at_flush_names_the_users_line(adaptive):
    w = torch.randn(5, 3).to("neuron")
    idx = torch.tensor([1, 7]).to("neuron")
    y = torch.nn.functional.embedding(idx, w) * 2   # index 7 is out of range: found when the window runs
    with pytest.raises(Exception, match=r"test_device_windows.py:\d+: `y = torch.nn.functional.embedding"):
        y.cpu()


def test_shape_errors_raise_when_the_op_is_issued(adaptive):
    a, b = _dev(torch.randn(3, 4), torch.randn(5, 6))
    with pytest.raises(RuntimeError):
        a @ b                                       # the meta kernel runs at once, as eager checks
    assert windows.pending_ops() == 0


def test_training_steps_match_op_mode_with_backward_in_the_window():
    def run(mode):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Dropout(0.1), torch.nn.Linear(32, 4)).to("neuron")
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        x = torch.randn(8, 16).to("neuron")
        y = torch.randint(0, 4, (8,)).to("neuron")
        threads = set()
        m[0].weight.register_hook(lambda g: threads.add(threading.get_ident()))
        losses = []
        with windows.eager_mode(mode):
            for _ in range(6):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(m(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
        return losses, threads

    windows.reset_stats()
    want, _ = run("op")
    got, threads = run("adaptive")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert threads == {threading.get_ident()}       # backward ran on the thread that switched adaptive mode on
    s = windows.stats()
    assert s["hits"] >= 6 and s["flush_reasons"].get("random op", 0) == 6   # dropout: drawn on the host


def test_dropout_draws_the_numbers_of_op_mode(adaptive):
    x = torch.randn(4, 100).to("neuron")
    torch.manual_seed(3)
    got = torch.nn.functional.dropout(x * 1, 0.5).cpu()
    with windows.eager_mode("op"):
        torch.manual_seed(3)
        want = torch.nn.functional.dropout(x * 1, 0.5).cpu()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_branching_on_a_value_flushes(adaptive):
    xd = torch.tensor([1.0, -2.0, 3.0]).to("neuron")
    s = (xd * 2).sum()
    if s > 0:                                   # reads the value: the window runs here
        out = s + 1
    assert windows.stats()["windows"] == 1
    assert out.item() == pytest.approx(5.0)


def test_synchronize_memory_stats_and_leaving_the_mode_flush():
    windows.reset_stats()
    xd = torch.randn(8).to("neuron")
    with windows.eager_mode("adaptive"):
        y = xd + 1
        torch.neuron.synchronize()
        assert windows.pending_ops() == 0
        z = y * 2
        torch.neuron.memory_allocated()
        assert windows.pending_ops() == 0
        w = z - 1
    assert windows.pending_ops() == 0 and windows.mode() == "op"
    torch.testing.assert_close(w.cpu(), (xd.cpu() + 1) * 2 - 1)
    assert windows.stats()["flush_reasons"] == {"synchronize": 1, "memory statistics": 1,
                                                "eager mode change": 1}


def test_switch_and_environment(monkeypatch):
    with pytest.raises(tn.TnError, match="'op'.*'adaptive'"):
        torch.neuron.set_eager_mode("lazy")
    assert torch.neuron.get_eager_mode() == "op"
    monkeypatch.setenv("TN_EAGER_MODE", "adaptive")
    monkeypatch.setitem(windows._STATE, "mode", None)     # as at start-up: read from the configuration
    assert torch.neuron.get_eager_mode() == "adaptive"
    torch.neuron.set_eager_mode("op")
    with torch.neuron.eager_mode("adaptive"):
        assert windows.active()
    assert not windows.active()


def test_buffer_limit_and_log(adaptive, caplog):
    xd = torch.randn(8).to("neuron")
    with tn.config.override(window_ops=4, log={"windows"}), caplog.at_level(logging.INFO, logger="tn"):
        y = xd
        for _ in range(10):
            y = y + 1
        torch.testing.assert_close(y.cpu(), xd.cpu() + 10)
    assert windows.stats()["ops_per_window"] == {4: 2, 2: 1}
    lines = [r.getMessage() for r in caplog.records if "tn.device window" in r.getMessage()]
    assert len(lines) == 3 and "flushed by buffer limit" in lines[0] and "compiled" in lines[0]
    assert "cache hit" in lines[1] and "host access (test_device_windows.py:" in lines[2]


def test_profile_shows_windows_as_programs(adaptive):
    xd = torch.randn(16, 16).to("neuron")
    with tn.profile() as prof:
        (xd.exp() * xd).sum(0).cpu()
    names = [r.name for r in prof.runs]
    assert names and all(n.startswith("window3_exp_mul_sum") for n in names)
    assert windows.stats()["device_ns"] == pytest.approx(sum(r.total_ns for r in prof.runs))


def test_window_that_cannot_compile_runs_op_by_op(adaptive, monkeypatch):
    def refuse(ir, name):
        raise tn.UnsupportedOpError("refused for the test")

    monkeypatch.setattr(windows, "_compile_ir", refuse)
    xd = torch.randn(5, 7).to("neuron")
    y = (xd * 3).softmax(-1)
    torch.testing.assert_close(y.cpu(), (xd.cpu() * 3).softmax(-1))
    assert windows.stats()["op_by_op"] == 1


def test_backward_from_another_thread_shares_the_queue(adaptive):
    xd = torch.randn(4, 4).to("neuron").requires_grad_()
    out = {}

    def work():
        out["y"] = (xd * xd).sum()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    out["y"].backward()
    torch.testing.assert_close(xd.grad.cpu(), 2 * xd.detach().cpu())


def test_hf_gpt2_generate_same_tokens(tiny_hf):
    m = tiny_hf("gpt2")
    ids = torch.randint(2, 64, (1, 6))
    want = m.generate(ids, max_new_tokens=5, do_sample=False)
    md = copy.deepcopy(m).to("neuron")
    windows.reset_stats()
    with torch.no_grad(), windows.eager_mode("adaptive"):
        got = md.generate(ids.to("neuron"), max_new_tokens=5, do_sample=False)
    assert torch.equal(got.cpu(), want)
    s = windows.stats()
    assert s["windows"] and s["op_by_op"] == 0 and s["mean_ops_per_window"] > 5
    assert s["bucket_compiles"] >= 1 and s["bucket_hits"] >= 2      # decode steps share bucket programs


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gpt2-eager-attention"])
def test_hf_generate_same_tokens_slow(tiny_hf, kind):
    m = tiny_hf(kind)
    ids = torch.randint(2, 64, (2, 5))
    want = m.generate(ids, max_new_tokens=6, do_sample=False)
    md = copy.deepcopy(m).to("neuron")
    windows.reset_stats()
    with torch.no_grad(), windows.eager_mode("adaptive"):
        got = md.generate(ids.to("neuron"), max_new_tokens=6, do_sample=False)
    assert torch.equal(got.cpu(), want)
    assert windows.stats()["bucket_hits"] >= 2    # batch 2: the ids' storage is [2, L], its last column a slice


@pytest.mark.slow
def test_hf_bert_forward_matches_cpu():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32)
    m = transformers.BertModel(cfg).eval()
    ids = torch.randint(0, 64, (2, 9))
    want = m(input_ids=ids).last_hidden_state
    md = copy.deepcopy(m).to("neuron")
    with torch.no_grad(), windows.eager_mode("adaptive"):
        got = md(input_ids=ids.to("neuron")).last_hidden_state.cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _mlp_steps(mode, make_opt, steps, lr_at=None):
    """Losses and per-step (compiles, hits) of a small MLP trained ``steps`` steps on the device in ``mode``."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to("neuron")
    opt = make_opt(m.parameters())
    x = torch.randn(8, 16).to("neuron")
    y = torch.randint(0, 4, (8,)).to("neuron")
    losses, counts = [], []
    with windows.eager_mode(mode):
        for i in range(steps):
            if lr_at is not None:
                for g in opt.param_groups:
                    g["lr"] = lr_at(i)
            s0 = windows.stats()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            s1 = windows.stats()
            counts.append((s1["compiles"] - s0["compiles"], s1["hits"] - s0["hits"]))
    return losses, counts, [p.detach().cpu() for p in m.parameters()]


def test_adamw_step_scalars_are_program_inputs():
    # AdamW's bias corrections change every step: baked into the program as constants, each step compiled anew
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)   # noqa: E731
    want, _, want_p = _mlp_steps("op", make, 4)
    windows.clear_cache()
    windows.reset_stats()
    got, counts, got_p = _mlp_steps("adaptive", make, 4)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    for g, w in zip(got_p, want_p):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    # step 0 creates the optimizer state (another program); step 1 compiles the steady step; then only hits
    assert counts[1][0] >= 1 and all(c == 0 and h >= 1 for c, h in counts[2:]), counts


def test_a_learning_rate_that_changes_is_a_program_input():
    make = lambda ps: torch.optim.SGD(ps, lr=0.1)   # noqa: E731
    lr_at = lambda i: 0.1 / (1 + i)                 # noqa: E731
    want, _, _ = _mlp_steps("op", make, 4, lr_at)
    windows.clear_cache()
    windows.reset_stats()
    got, counts, _ = _mlp_steps("adaptive", make, 4, lr_at)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    # step 1 sees the learning rate change and compiles it as an input; later steps reuse that program
    assert all(c == 0 and h >= 1 for c, h in counts[2:]), counts


def test_constant_scalars_stay_literals_in_the_program(adaptive):
    xd = torch.randn(8, 8).to("neuron")
    for _ in range(3):
        (xd * 0.5 + 1.0).cpu()
    entry = next(reversed(windows._CACHE.values()))[0]
    assert windows.stats()["compiles"] == 1 and entry.params == ()


def test_recording_makes_no_reference_cycles(adaptive, monkeypatch):
    # a result held by a garbage cycle (the frame that looked for the user's line) is not freed when the user
    # drops it, so autograd's AccumulateGrad sees a second reference and copies the gradient: the op sequence,
    # and so the window's cache key, then depended on when the garbage collector ran. tn frames counted as
    # the user's (tn imported from a path spelled bench/../tn) made such a cycle on every recorded op.
    import gc
    import weakref

    from tn import trace

    monkeypatch.setattr(trace, "_INTERNAL_DIRS", [trace._TORCH_DIR])
    monkeypatch.setattr(trace, "_internal_code", {})
    xd = torch.randn(4, 4).to("neuron")
    gc.collect()
    gc.disable()
    try:
        y = xd * 2
        ref = weakref.ref(y)
        del y
        assert ref() is None
    finally:
        gc.enable()


def test_a_steady_loop_binds_its_inputs_without_new_aliases(adaptive, monkeypatch):
    # a cache hit's cost is per op and per binding: the inputs of a steady loop (weights, optimizer state) keep
    # their addresses, so their host views are made once, not at every flush
    made = []
    real = windows._alias
    monkeypatch.setattr(windows, "_alias", lambda *a: made.append(a) or real(*a))
    w = torch.randn(16, 16).to("neuron")
    b = torch.randn(16).to("neuron")
    x = torch.randn(4, 16).to("neuron")
    outs = []
    for _ in range(3):
        made.clear()
        outs.append(((x @ w + b).relu() * 2).cpu())
    assert windows.stats()["hits"] == 2
    # at most the one result (its block, reused from the caching allocator, usually has its view kept too); x, w
    # and b were bound through the views kept from the first call
    assert len(made) <= 1
    torch.testing.assert_close(outs[2], ((x.cpu() @ w.cpu() + b.cpu()).relu() * 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_changing_scalars_match_op_mode(adaptive, dtype):
    # x * s, x / s and add(..., alpha=s) with s changing every call: equal to op mode, compiled twice, then hits
    x = torch.randn(8, 16).to(dtype)
    y = torch.randn(8, 16).to(dtype)
    xd, yd = _dev(x, y)

    def f(a, b, s):
        return (a * s).add(b, alpha=2 * s) / (1 + s)

    for i in range(4):
        s = 0.1 * (i + 1)
        with windows.eager_mode("op"):
            want = f(xd, yd, s).cpu()
        got = f(xd, yd, s).cpu()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    st = windows.stats()
    # fp32: every scalar becomes an input; bf16: add's alpha stays a literal (scaling a bf16 operand by it first
    # would round where the fused add does not), so that window compiles for each value
    assert (st["compiles"], st["hits"]) == ((2, 2) if dtype == torch.float32 else (4, 0))


# ---------------------------------------------------------------- streams and devices
def test_a_window_holds_one_streams_ops_and_runs_on_that_stream(adaptive):
    """Ops issued under ``torch.neuron.stream(s)`` are timed on ``s``: a change of stream flushes the open window,
    and the window's program runs on the stream its ops were issued on, whichever stream is current at the flush."""
    x = torch.randn(64, 64)
    xd = x.to("neuron")
    torch.neuron.synchronize()
    side = torch.neuron.Stream()
    main = torch.neuron.current_stream()
    side_before, main_before = side._queue.ready_ns, main._queue.ready_ns
    with torch.neuron.stream(side):
        y = (xd @ xd).relu()                 # queued: issued on `side`
    assert windows.pending_ops() == 2
    z = y + 1                                 # issued on the default stream: the side window is flushed first
    s = windows.stats()
    assert s["flush_reasons"].get("stream change") == 1 and windows.pending_ops() == 1
    assert side._queue.ready_ns > side_before  # the matmul window ran on `side` ...
    assert main._queue.ready_ns == main_before  # ... not on the default stream (its own op is still queued)
    torch.testing.assert_close(z.cpu(), (x @ x).relu() + 1)
    assert main._queue.ready_ns > main_before


def test_events_and_stream_sync_include_queued_ops(adaptive):
    """An event recorded after queued ops is later than one recorded before them (the queue is run first)."""
    xd = torch.randn(128, 128).to("neuron")
    torch.neuron.synchronize()
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    start.record()
    y = xd @ xd @ xd
    assert windows.pending_ops() == 2
    end.record()
    assert windows.pending_ops() == 0 and start.elapsed_time(end) > 0
    w = y * 2
    assert windows.pending_ops() == 1
    torch.neuron.current_stream().synchronize()
    assert windows.pending_ops() == 0
    torch.testing.assert_close(w.cpu(), (y * 2).cpu())


@pytest.mark.skipif(torch.neuron.device_count() < 2, reason="the modelled machine has one core")
def test_a_window_of_another_device_is_timed_on_that_devices_core(adaptive):
    x = torch.randn(64, 64)
    x1 = x.to("neuron:1")
    torch.neuron.synchronize(1)
    torch.neuron.reset_op_counts()
    y = x1 @ x1                               # queued on neuron:1 while neuron:0 is the current device
    assert torch.neuron.current_device() == 0
    torch.testing.assert_close(y.cpu(), x @ x)
    assert torch.neuron.device_time_ns(1) > 0 and torch.neuron.device_time_ns(0) == 0


# ---------------------------------------------------------------- the host cost of recording (tn.device.fastpath)


def test_a_structured_op_is_queued_whole_and_counted_as_op_mode_counts_it(adaptive):
    # tanh/addmm/gt reach the device as torch's empty + out= composite in op mode; adaptive mode queues the functional
    # op itself (one recorded op, no blank memory), counted under the out= name op mode counts
    from tn.device import fastpath

    assert torch.ops.aten.tanh.default in fastpath.STRUCTURED and torch.ops.aten.addmm.default in fastpath.STRUCTURED
    x, w, b = torch.randn(4, 8), torch.randn(8, 8), torch.randn(8)
    xd, wd, bd = _dev(x, w, b)
    torch.neuron.reset_op_counts()
    y = torch.tanh(torch.addmm(bd, xd, wd))
    m = y > 0.1
    assert windows.pending_ops() == 3 and not any(s.blank for s in windows._QUEUES[0].window.slots)
    assert set(torch.neuron.executed_ops()) == {"aten::addmm.out", "aten::tanh.out", "aten::gt.Scalar_out"}
    torch.testing.assert_close(y.cpu(), torch.tanh(torch.addmm(b, x, w)))
    assert torch.equal(m.cpu(), torch.tanh(torch.addmm(b, x, w)) > 0.1)


def test_a_structured_op_keeps_eager_strides_and_wrapped_numbers():
    # results torch lays out like a transposed input are not queued as contiguous tensors (the window declines and
    # torch's composite runs, in both modes); a Python number keeps its wrapped-number promotion (bf16 / 1.1 is bf16)
    x = torch.randn(6, 4)
    h = torch.randn(5, 3).bfloat16()
    xd, hd = _dev(x, h)
    for m in ("op", "adaptive"):
        with windows.eager_mode(m):
            y = torch.tanh(xd.t())
            z = torch.div(hd, 1.1)
            c = torch.where(hd > 0, hd, 0.0)
            assert y.stride() == torch.tanh(x.t()).stride() and z.dtype == torch.bfloat16 == c.dtype
            torch.testing.assert_close(y.cpu(), torch.tanh(x.t()))
            torch.testing.assert_close(z.cpu(), torch.div(h, 1.1))
            torch.testing.assert_close(c.cpu(), torch.where(h > 0, h, 0.0))


def test_the_one_pass_recording_leaves_unusual_calls_to_the_checked_path(adaptive):
    # a host tensor with dimensions and tensors of two devices raise PyTorch's errors (nothing queued, no flush);
    # an op of the queued kind after them still queues
    xd = torch.randn(3, 4).to("neuron")
    y = xd * 3
    with pytest.raises(RuntimeError, match="neuron"):
        torch.tanh(xd) + torch.randn(3, 4)
    assert windows.stats()["windows"] == 0
    z = torch.sigmoid(y)
    assert windows.pending_ops() >= 3
    torch.testing.assert_close(z.cpu(), torch.sigmoid(xd.cpu() * 3))


@pytest.mark.parametrize("m", ["op", "adaptive"])
def test_empty_out_tensors_are_sized_per_call(m):
    # the shapes an empty out= tensor is given are kept per signature: arguments of other values size it anew
    with windows.eager_mode(m):
        for end, want in ((3, 3), (5, 5), (3, 3), (2.5, 3)):
            o = torch.empty(0, device="neuron", dtype=torch.float32)
            torch.arange(0, end, out=o)
            assert o.shape == (want,)
            torch.testing.assert_close(o.cpu(), torch.arange(0, end, dtype=torch.float32))


def _kv_step(q, kc, vc, k_new, v_new, head_slice=False):
    """One decode step of attention over a KV cache that grows by ``cat`` (the cache's length is axis 1)."""
    kc = torch.cat([kc, k_new], 1)
    vc = torch.cat([vc, v_new], 1)
    keys = kc[:, :2] if head_slice else kc          # a slice at the front of the cache: padding would land in it
    s = (q @ keys.transpose(1, 2)) * 0.25
    out = s.softmax(-1) @ (vc[:, :2] if head_slice else vc)
    return out, kc, vc


def _kv_loop(steps, head_slice=False, device="neuron"):
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(2, 4, 8, generator=g), torch.randn(2, 4, 8, generator=g)
    kc, vc = kc.to(device), vc.to(device)
    outs = []
    for _ in range(steps):
        q, k_new, v_new = (torch.randn(2, 1, 8, generator=g).to(device) for _ in range(3))
        out, kc, vc = _kv_step(q, kc, vc, k_new, v_new, head_slice)
        outs.append(out.cpu())                     # read every step: one window per step
    return outs, kc.cpu(), vc.cpu()


def test_a_growing_kv_cache_runs_one_bucket_program_across_sizes(adaptive, caplog):
    want, wk, wv = _kv_loop(8, device="cpu")
    with windows.eager_mode("op"):
        op_outs, _, _ = _kv_loop(8)
    with tn.config.override(log={"windows"}), caplog.at_level(logging.INFO, logger="tn"):
        got, gk, gv = _kv_loop(8)
    for g, o, w in zip(got, op_outs, want):
        torch.testing.assert_close(g, o)
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(gk, wk, rtol=0, atol=0)   # the caches narrowed back from the padded program exactly
    torch.testing.assert_close(gv, wv, rtol=0, atol=0)
    s = windows.stats()
    # cache lengths 4..11: the first window compiles for its size, the second finds the growth and compiles the
    # bucket's program (tn.bucketing, masked front padding), the other six reuse it
    assert (s["windows"], s["compiles"], s["bucket_compiles"], s["bucket_hits"], s["op_by_op"]) == (8, 2, 1, 6, 0)
    lines = [r.getMessage() for r in caplog.records if "tn.device window" in r.getMessage()]
    assert "bucket compile (size 5 of 128)" in lines[1] and all("bucket hit" in x for x in lines[2:])
    with tn.profile() as prof:                            # the padding copies run on the NeuronCore model too
        again, _, _ = _kv_loop(3)
    names = [r.name for r in prof.runs]
    assert any("_pad" in n for n in names) and any("_narrow" in n for n in names)
    s = windows.stats()
    assert s["compiles"] == 2 and s["bucket_hits"] == 8     # a second loop: the same programs, exact cache hits
    for g, w in zip(again, want):
        torch.testing.assert_close(g, w)


def test_bucket_padding_is_zeros_again_when_a_loop_restarts_shorter(adaptive):
    """A bucket's padded input buffers are reused across calls; the front padding is written only when it grew
    (a decode loop's shrinks every step). A loop that starts again at a short size (the next generate call) has
    longer padding than the last call left: it is zeros again, and the results equal op mode's."""
    with windows.eager_mode("op"):
        op_outs, ok, ov = _kv_loop(8)
    _kv_loop(8)                                        # known sizes: the host does the pad copies
    got, gk, gv = _kv_loop(8)                          # restarts at the shortest size
    for g, o in zip(got, op_outs):
        torch.testing.assert_close(g, o)
    torch.testing.assert_close(gk, ok, rtol=0, atol=0)
    torch.testing.assert_close(gv, ov, rtol=0, atol=0)
    _kv_loop(2)                                        # ends on a long padding after a short one
    checked = 0
    for sk in windows._SKELS.values():
        for fam in sk.families:
            for bk in fam.buckets.values():
                for pos, buf in bk.bufs.items():
                    p = bk.zeroed.get(id(buf))
                    if p:
                        assert not buf.narrow(bk.axes[pos], 0, p).any()
                        checked += 1
    assert checked


def test_a_growing_window_the_proof_refuses_compiles_per_size(adaptive, caplog):
    want, _, _ = _kv_loop(5, head_slice=True, device="cpu")
    with tn.config.override(log={"windows"}), caplog.at_level(logging.INFO, logger="tn"):
        got, _, _ = _kv_loop(5, head_slice=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    s = windows.stats()
    assert (s["compiles"], s["bucket_compiles"], s["bucket_hits"]) == (5, 0, 0)
    refused = [r.getMessage() for r in caplog.records if "no bucket" in r.getMessage()]
    assert len(refused) == 1 and "test_device_windows.py:" in refused[0]   # the refusing op's line is named


def test_bucket_padding_copies_are_charged_the_same_with_and_without_a_profile(adaptive):
    _kv_loop(4)                                      # sizes 4..7: a per-size program, then the bucket's
    d0 = windows.stats()["device_ns"]
    _kv_loop(4)                                      # known sizes: the host copies, charged their modelled time
    d1 = windows.stats()["device_ns"]
    with tn.profile():
        _kv_loop(4)                                  # under a profile: the real DMA programs run
    d2 = windows.stats()["device_ns"]
    assert d1 - d0 == pytest.approx(d2 - d1, rel=1e-6) and d1 > d0


def test_the_per_op_meta_plan_cache_is_bounded_least_recently_used_first(adaptive, monkeypatch):
    """Ops of ever new shapes (a KV cache's) do not grow the per-op plan cache without end: past the cap the
    least recently used plans go, a plan in use is not made again (its window's trie path holds it), and
    evicted plans are simply made again."""
    monkeypatch.setattr(windows, "_META", type(windows._META)())
    monkeypatch.setattr(windows, "_META_MAX", 6)
    monkeypatch.setattr(windows, "_TRIE", [windows._Node(), 0])
    made = []
    plan = windows._plan
    monkeypatch.setattr(windows, "_plan", lambda op, leaves, spec: made.append(leaves[0].shape) or plan(op, leaves,
                                                                                                          spec))
    keep = torch.randn(3, 5)
    keep_d = keep.to("neuron")
    for n in range(1, 13):                      # twelve new shapes, each with a new plan for mul
        x = torch.randn(n, 4)
        got = (x.to("neuron") * 3.0).cpu()
        torch.testing.assert_close(got, x * 3.0)
        torch.testing.assert_close((keep_d * 2.0).cpu(), keep * 2.0)   # used every time: never made again
        assert len(windows._META) <= 6
    assert made.count((3, 5)) == 1 and made.count((1, 4)) == 1
    shapes = [k for k in windows._META]
    assert not any(((1, 4), (4, 1), 0, torch.float32) in k for k in shapes)  # the oldest went
    windows._reset_trie()                       # (the trie's paths hold plans too: without them ...)
    torch.testing.assert_close((torch.ones(1, 4).to("neuron") * 3.0).cpu(), torch.full((1, 4), 3.0))
    assert made.count((1, 4)) == 2                                           # ... an evicted plan is made again


def test_the_trie_of_op_sequences_is_bounded_and_a_new_one_keeps_results_right(adaptive, monkeypatch):
    """Window signatures are paths in a trie of op keys; ever new shapes start a new trie past the cap (windows
    cached under the old one compile once more), results stay right and cache hits resume."""
    monkeypatch.setattr(windows, "_TRIE", [windows._Node(), 0])
    monkeypatch.setattr(windows, "_TRIE_MAX", 5)
    keep = torch.randn(3, 5)
    keep_d = keep.to("neuron")
    roots = set()
    for n in range(1, 10):
        x = torch.randn(n, 4)
        torch.testing.assert_close((x.to("neuron") * 3.0 + 1.0).cpu(), x * 3.0 + 1.0)
        torch.testing.assert_close((keep_d * 2.0).cpu(), keep * 2.0)
        assert windows._TRIE[1] <= 5
        roots.add(id(windows._TRIE[0]))
    assert len(roots) > 1                       # the trie was started anew
    s = windows.stats()
    torch.testing.assert_close((keep_d * 2.0).cpu(), keep * 2.0)
    assert windows.stats()["hits"] == s["hits"] + 1


@pytest.mark.parametrize("mode", ["op", "adaptive"])
def test_python_numbers_reused_as_cached_tensors_keep_sign_dtype_and_value(mode):
    """Python numbers in tensor arguments (``x * 2.5``) become cached 0-dim tensors (tn.device.eager): the
    cache keeps -0.0 apart from 0.0, follows the default dtype and bool/int/float, and results equal CPU's.
    (The device's ``x * 0.0`` drops the sign of ``-2 * 0.0`` with or without the cache: not compared here.)"""
    from tn.device import eager
    xi = torch.arange(6).reshape(2, 3)
    xf = torch.tensor([1.0, -2.0, 3.5])
    with windows.eager_mode(mode):
        di, df = xi.to("neuron"), xf.to("neuron")
        for _ in range(2):                        # the second round takes the cached tensors
            torch.testing.assert_close((df * 2.5).cpu(), xf * 2.5, rtol=0, atol=0)
            torch.testing.assert_close((di + 3).cpu(), xi + 3, rtol=0, atol=0)
            torch.testing.assert_close((di * True).cpu(), xi * True, rtol=0, atol=0)
            mul = torch.ops.aten.mul.Tensor
            assert eager._scalar_tensor(7.0, mul, 1) is eager._scalar_tensor(7.0, mul, 1)
            assert not torch.signbit(eager._scalar_tensor(0.0, mul, 1))
            assert torch.signbit(eager._scalar_tensor(-0.0, mul, 1))
            assert eager._scalar_tensor(1, mul, 1).dtype == torch.int64
            assert eager._scalar_tensor(True, mul, 1).dtype == torch.bool
            got = (di * 2.5).cpu()
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, xi * 2.5, rtol=0, atol=0)
        saved = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            got = (di * 2.5).cpu()
        finally:
            torch.set_default_dtype(saved)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, xi.double() * 2.5, rtol=0, atol=0)
    assert all(t.dim() == 0 and not t.requires_grad for t in eager._SCALARS.values())


def test_base_shape_of_a_view_with_a_broadcast_axis():
    """A view whose strides include a 0 (an expanded axis) between row-major ones is not a slice of a row-major
    array; its base shape is the flat element count (it divided by that 0 stride: ZeroDivisionError, seen in
    nn.Transformer's training under tn.jit's split windows)."""
    from tn.device import windows

    base = torch.zeros(6, 4)
    view = base.as_strided((2, 3, 4), (4, 0, 1))
    assert windows._base_shape(view, base.numel() * base.element_size()) == (24,)
    row = base[:, -1:]
    assert windows._base_shape(row, base.numel() * base.element_size()) == (6, 4)
