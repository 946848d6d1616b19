# Tests of the tracer (tn.trace.trace_flat): IR listing, numerics vs eager, functionalisation, autograd, constants, errors.
import inspect
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

import tn
import tn.passes
from tn.ir import IR
from tn.reference import run_ir
from tn.trace import Static, TracerTensor, trace_flat

THIS_FILE = os.path.basename(__file__)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


def _line_of(fn, needle):
    """Absolute line number of the first source line of ``fn`` containing ``needle``."""
    lines, start = inspect.getsourcelines(fn)
    for i, line in enumerate(lines):
        if needle in line:
            return start + i
    raise AssertionError(f"{needle!r} not in {fn.__name__}")


def check(fn, *xs, tol=None):
    """Trace ``fn``, run the IR with the reference executor, compare outputs and write-backs with eager."""
    xs = list(xs)
    tr = trace_flat(fn, xs)
    tn.passes.verify(tr.ir)
    ir_in = [x.detach().clone() for x in xs]
    outs = run_ir(tr.ir, ir_in)
    eager_in = [x.detach().clone().requires_grad_(x.requires_grad) for x in xs]
    expected = fn(*eager_in)
    leaves, spec = pytree.tree_flatten(expected)
    assert spec == tr.out_tree
    for leaf, e in zip(tr.out_leaves, leaves):
        if isinstance(leaf, Static):
            assert leaf.value == e
        else:
            got = outs[leaf]
            kw = tol or TOL.get(e.dtype, dict(rtol=1e-5, atol=1e-5))
            assert got.dtype == e.dtype and got.shape == e.shape
            torch.testing.assert_close(got, e.detach(), **kw)
    for i, k in tr.ir.mutations:
        torch.testing.assert_close(outs[k], eager_in[i].detach(), **(tol or TOL.get(xs[i].dtype, {})))
    return tr


# --------------------------------------------------------------------------- listing


def test_listing_shows_every_aval():
    def f(x, h, i, m):
        return x.sum(1), h * 2, i + 1, m.logical_not()

    tr = trace_flat(f, [torch.randn(4, 8), torch.randn(128, dtype=torch.bfloat16),
                        torch.tensor(3), torch.tensor([True, False, True])])
    text = str(tr.ir)
    for aval in ("f32[4,8]", "bf16[128]", "i64[]", "b8[3]", "f32[4]"):
        assert aval in text
    assert text.startswith("{ lambda ; a:f32[4,8] b:bf16[128] c:i64[] d:b8[3]. let")
    assert "sum[dims=(1,) keepdim=False] a" in text
    assert isinstance(tr.ir, IR) and len(tr.ir.inputs) == 4


def test_eqn_source_names_user_line():
    def f(x):
        return torch.exp(x)  # the exp line

    tr = trace_flat(f, [torch.randn(3)])
    (eqn,) = tr.ir.eqns
    assert eqn.source == f"{THIS_FILE}:{_line_of(f, 'the exp line')}"
    assert f"# {THIS_FILE}:" in tr.ir.pretty(show_source=True)


def test_tn_files_reached_through_dotdot_paths_are_still_tn_code():
    """A file of tn named through ``..`` (``sys.path`` holding ``bench/..``, as the bench scripts do) is tn's own,
    not the user's: errors and sources must not name it."""
    import tn.trace as T

    path = os.path.join(os.path.dirname(T.__file__), "..", "tn", "jit.py")
    code = compile("tn_file = 1", path, "exec")      # (code objects compare equal whatever their file names)
    assert os.path.isabs(path) and ".." in path
    assert T._is_internal(code)
    assert not T._is_internal(compile("user_file = 1", os.path.abspath(__file__), "exec"))


# --------------------------------------------------------------------------- numerics


def test_elementwise_broadcast_and_scalars():
    def f(x, y, i):
        return (x + y) * 2 - y / 3, torch.where(x > 0, x, y), i * 2 + 1, (i > 1).float() * x[0], x ** 2

    check(f, torch.randn(4, 5), torch.randn(5), torch.arange(5))


def test_matmul_linear_bmm_and_vector_matmul():
    def f(x, w, b, a, v):
        return F.linear(x, w, b), a @ a.transpose(1, 2), v @ w, w @ v.new_ones(w.shape[1])

    check(f, torch.randn(3, 4), torch.randn(5, 4), torch.randn(5), torch.randn(2, 3, 4), torch.randn(5))


def test_reductions():
    def f(x):
        return (x.sum(), x.sum(0), x.mean(-1, keepdim=True), x.amax(1), x.max(1).indices, x.min(),
                x.var(0), x.std(1), x.prod(1), x.argmax(), x.cumsum(1), torch.logsumexp(x, 1))

    check(f, torch.randn(4, 6), tol=dict(rtol=1e-4, atol=1e-4))


def test_views_and_reshapes():
    def f(x):
        y = x.view(2, 3, 4).permute(2, 0, 1)
        z = y.reshape(4, 6)[1:3, ::2]
        a, b = x.split([5, 7], dim=1)
        return z, x.t().contiguous().view(-1), x.unsqueeze(0).expand(3, 2, 12), a.flip(1), b.unbind(1)[2], \
            x[:, None, 1], torch.cat([a, b], 1), F.pad(x, (1, 2))

    check(f, torch.randn(2, 12))


def test_softmax_layernorm_gelu_bf16():
    def f(x, w, b):
        return F.gelu(F.layer_norm(x, (8,), w, b)).softmax(-1)

    check(f, torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, dtype=torch.bfloat16),
          torch.randn(8, dtype=torch.bfloat16))


def test_gather_scatter_index():
    def f(x, idx, emb):
        return (x.gather(1, idx), torch.zeros(3, 4).scatter_add(1, idx, x[:, :2]), x[idx[:, 0]],
                F.embedding(idx, emb), x.index_select(1, idx[0]))

    check(f, torch.randn(3, 4), torch.tensor([[0, 3], [1, 1], [2, 0]]), torch.randn(4, 6))


def test_static_and_pytree_outputs():
    def f(x):
        return {"y": x * 2, "shape": tuple(x.shape), "n": 3}, [x.sum()]

    tr = check(f, torch.randn(2, 3))
    statics = [leaf for leaf in tr.out_leaves if isinstance(leaf, Static)]
    assert Static(2) in statics and Static(3) in statics
    assert Static(3) == Static(3) and hash(Static(3)) == hash(Static(3))


# --------------------------------------------------------------------------- functionalisation


def test_inplace_on_input_is_a_mutation():
    def f(x, y):
        x.add_(y)
        return x * 2

    tr = check(f, torch.randn(3), torch.randn(3))
    assert len(tr.ir.mutations) == 1 and tr.ir.mutations[0][0] == 0
    assert "writes back: input 0" in str(tr.ir)


def test_inplace_on_a_view_updates_the_base():
    def f(x):
        x[:, 0] += 1
        return x.sum(0)

    tr = check(f, torch.randn(3, 4))
    assert tr.ir.mutations == [(0, 1)]
    assert "slice_scatter" in tr.ir.op_counts()


def test_views_see_later_writes_to_their_base():
    def f(x):
        row = x[1]
        col = x.t()[2]
        x.mul_(2)
        flat = x.view(-1)
        flat[0] = 5.0
        return row + 0, col * 1, x.clone()

    check(f, torch.randn(3, 4))


def test_inplace_through_chains_of_views():
    def f(x):
        y = x.t()
        y[0, 1:] = 7.0
        a, b = x.chunk(2, dim=1)
        a.zero_()
        x.diagonal().add_(1)
        return b * 2

    check(f, torch.randn(4, 4))


def test_strided_views_of_permuted_layouts():
    def f(x):
        y = x.t() * 2  # a result whose memory order is x's, not row-major
        y[0] = 1.0
        y.diagonal().zero_()
        return y, x.unfold(1, 2, 1).sum(-1)

    check(f, torch.randn(3, 4))


def test_out_variants_and_inplace_index_ops_on_inputs():
    def f(a, b, out, x, i):
        torch.add(a, b, out=out)
        x.index_put_((i,), b[:3], accumulate=True)
        return out * 1

    tr = check(f, torch.randn(3), torch.randn(3), torch.randn(3), torch.randn(5), torch.tensor([0, 0, 3]))
    assert sorted(i for i, _ in tr.ir.mutations) == [2, 3]


def test_inplace_on_intermediate_is_not_a_mutation():
    def f(x):
        y = x * 1
        y.relu_()
        y.unsqueeze_(0)
        return y

    tr = check(f, torch.randn(5))
    assert tr.ir.mutations == []


def test_batchnorm_train_mode_updates_running_stats():
    bn = nn.BatchNorm1d(4).train()
    names = [n for n, _ in bn.named_parameters()] + [n for n, _ in bn.named_buffers()]

    def f(x, *state):
        return torch.func.functional_call(bn, dict(zip(names, state)), (x,))

    state = [t.detach().clone() for t in list(bn.parameters()) + list(bn.buffers())]
    tr = check(f, torch.randn(8, 4), *state, tol=dict(rtol=1e-4, atol=1e-4))
    written = {i for i, _ in tr.ir.mutations}
    idx = {n: 1 + k for k, n in enumerate(names)}
    assert written == {idx["running_mean"], idx["running_var"], idx["num_batches_tracked"]}


# --------------------------------------------------------------------------- autograd


def test_autograd_grad_traces_forward_and_backward():
    def f(x, w, b):
        loss = F.gelu(F.linear(x, w, b)).pow(2).mean()
        gw, gb = torch.autograd.grad(loss, [w, b])
        return loss, gw, gb

    x = torch.randn(6, 4)
    w = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    tr = check(f, x, w, b, tol=dict(rtol=1e-4, atol=1e-5))
    assert tr.ir.op_counts()["matmul"] >= 2  # the forward matmul and the weight gradient


def test_requires_grad_of_inputs_is_respected():
    def f(x, w):
        return torch.autograd.grad((x * w).sum(), [w])

    with pytest.raises(RuntimeError, match="does not require grad"):
        trace_flat(f, [torch.randn(3), torch.randn(3)])
    check(f, torch.randn(3), torch.randn(3, requires_grad=True))


def test_double_backward():
    def hvp(x, w):
        (g,) = torch.autograd.grad(torch.tanh(x @ w).sum(), [w], create_graph=True)
        return torch.autograd.grad((g * g).sum(), [w])

    check(hvp, torch.randn(3, 4), torch.randn(4, 2, requires_grad=True), tol=dict(rtol=1e-4, atol=1e-5))


def test_backward_and_inplace_sgd_step_write_back_parameters():
    def step(x, w):
        loss = (x @ w).pow(2).mean()
        loss.backward()
        with torch.no_grad():
            w -= 0.1 * w.grad
        return loss

    tr = check(step, torch.randn(3, 4), torch.randn(4, 2, requires_grad=True))
    assert [i for i, _ in tr.ir.mutations] == [1]


def test_autocast_region_is_traced_in_bf16():
    def f(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return x @ w

    tr = check(f, torch.randn(3, 4), torch.randn(4, 5), tol=TOL[torch.bfloat16])
    assert "bf16[3,5]" in str(tr.ir)


def test_concurrent_traces_in_threads_are_independent():
    import threading

    fns = [lambda x: x.exp().sum(0), lambda x: (x @ x.t()).relu()]
    expected = [str(trace_flat(f, [torch.randn(4, 4)]).ir) for f in fns]
    seen = [set(), set()]

    def work(k):
        for _ in range(10):
            seen[k % 2].add(str(trace_flat(fns[k % 2], [torch.randn(4, 4)]).ir))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [{expected[0]}, {expected[1]}]


def test_training_step_of_a_convnet():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64, 3))
    names = [n for n, _ in net.named_parameters()]

    def step(x, y, *ps):
        out = torch.func.functional_call(net, dict(zip(names, ps)), (x,))
        loss = F.cross_entropy(out, y)
        grads = torch.autograd.grad(loss, ps)
        return [loss] + [p - 0.1 * g for p, g in zip(ps, grads)]

    ps = [p.detach().clone().requires_grad_() for p in net.parameters()]
    check(step, torch.randn(2, 1, 8, 8), torch.tensor([0, 2]), *ps, tol=dict(rtol=1e-4, atol=1e-5))


# --------------------------------------------------------------------------- constants and factories


def test_factories_and_captured_tensors():
    table = torch.tensor([1.0, 2.0, 3.0])

    def f(x):
        T = x.shape[0]
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        pos = torch.arange(T)
        return x.masked_fill(~mask, 0.0) + pos + torch.tensor([0.5, 0.25, 0.125]) * table, torch.zeros(2)

    tr = check(f, torch.randn(3, 3))
    ops = tr.ir.op_counts()
    assert ops.get("full", 0) >= 1 and ops.get("iota", 0) >= 1
    assert any(c is not None and c.shape == (3,) for _, c in tr.ir.consts)


def test_causal_attention_block_matches_eager():
    torch.manual_seed(0)
    d, h, T = 16, 2, 5
    qkv, proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def attn(x, wq, bq, wp, bp):
        B, T, C = x.shape
        q, k, v = F.linear(x, wq, bq).split(C, dim=2)
        q, k, v = (t.view(B, T, h, C // h).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (C // h) ** 0.5
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.linear((att @ v + y).transpose(1, 2).reshape(B, T, C), wp, bp)

    check(attn, torch.randn(2, T, d), qkv.weight.detach(), qkv.bias.detach(), proj.weight.detach(),
          proj.bias.detach(), tol=dict(rtol=1e-4, atol=1e-5))


# --------------------------------------------------------------------------- no real compute


def test_tracing_does_no_real_compute():
    # 4 TiB of fp32 inputs: any real matmul or allocation during tracing would fail.
    n = 1 << 20

    def f(a, b):
        return F.gelu(a @ b).softmax(-1).sum(0)

    tr = trace_flat(f, [torch.empty(n, n, device="meta"), torch.empty(n, 1024, device="meta")])
    assert tr.ir.outputs[0].shape == (1024,)
    assert tr.ir.op_counts()["matmul"] == 1


def test_gpt2_block_traces_without_running_matmuls():
    d, h, T = 768, 12, 128

    def block(x, wqkv, wproj, wfc, wout):
        B, T, C = x.shape
        q, k, v = F.linear(F.layer_norm(x, (C,)), wqkv).split(C, dim=2)
        q, k, v = (t.view(B, T, h, C // h).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (C // h) ** 0.5)
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
        x = x + F.linear((att @ v).transpose(1, 2).contiguous().view(B, T, C), wproj)
        return x + F.linear(F.gelu(F.linear(F.layer_norm(x, (C,)), wfc)), wout)

    shapes = [(1, T, d), (3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]
    tr = trace_flat(block, [torch.empty(s, device="meta") for s in shapes])
    assert tr.ir.op_counts()["matmul"] == 6
    # the same IR computes the right thing on small real inputs
    small = [(1, 4, 24), (72, 24), (24, 24), (96, 24), (24, 96)]
    h = 2
    check(block, *[torch.randn(s) / 4 for s in small], tol=dict(rtol=1e-4, atol=1e-5))


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kind", ["if", "item", "bool", "int", "float"])
def test_control_flow_on_traced_values_names_the_line(kind):
    def f(x):
        s = x.sum()
        if kind == "if":
            if s > 0:  # branch-line
                return x
        elif kind == "item":
            return x * s.item()  # branch-line
        elif kind == "bool":
            return x * bool(s)  # branch-line
        elif kind == "int":
            return x * int(s)  # branch-line
        else:
            return x * float(s)  # branch-line
        return -x

    lines = inspect.getsourcelines(f)[0]
    start = inspect.getsourcelines(f)[1]
    markers = [start + i for i, line in enumerate(lines) if "# branch-line" in line]
    with pytest.raises(tn.TracingError) as info:
        trace_flat(f, [torch.randn(3)])
    msg = str(info.value)
    assert f"{THIS_FILE}:" in msg
    line = int(msg.split(f"{THIS_FILE}:")[1].split(":")[0])
    assert line in markers
    assert "static_argnums" in msg and "eager" in msg and "tn.adaptive" in msg


@pytest.mark.parametrize("conv", ["numpy", "tolist"])
def test_conversion_to_python_values_is_a_tracing_error(conv):
    def f(x):
        return torch.tensor(getattr(x, conv)())  # conversion-line

    with pytest.raises(tn.TracingError) as info:
        trace_flat(f, [torch.randn(2)])
    assert f"{THIS_FILE}:{_line_of(f, 'conversion-line')}" in str(info.value)


def test_masked_assignment_becomes_where():
    def f(x, m):
        y = x.clone()
        y[y > 0] = 0.0
        y[m] = 5
        return y

    tr = check(f, torch.randn(3, 4), torch.tensor([True, False, True]))
    assert "index_put" not in tr.ir.op_counts() and tr.ir.op_counts()["where"] == 2


def test_boolean_mask_indexing_is_a_tracing_error():
    with pytest.raises(tn.TracingError, match="boolean mask"):
        trace_flat(lambda x: x[x > 0], [torch.randn(5)])


def test_unsupported_op_names_op_and_shapes():
    with pytest.raises(tn.UnsupportedOpError) as info:
        # float64 linalg ops are host ops, but geqrf (no meta kernel) is not one
        trace_flat(lambda x: torch.geqrf(x)[0], [torch.randn(2, 7, dtype=torch.float64)])
    msg = str(info.value)
    assert "aten.geqrf" in msg and "f64[2,7]" in msg and THIS_FILE in msg


def test_sort_and_topk():
    check(lambda x: (x.sort(1), x.topk(2, dim=0), x.argsort(1, descending=True)), torch.randn(4, 5))


def test_write_into_broadcast_view_is_unsupported():
    with pytest.raises(tn.UnsupportedOpError, match="broadcast view"):
        trace_flat(lambda x: x.expand(3, 3).add_(1), [torch.randn(3)])


def test_inplace_shape_change_of_an_input_is_unsupported():
    with pytest.raises(tn.UnsupportedOpError, match="shape of an input"):
        trace_flat(lambda x: x.unsqueeze_(0), [torch.randn(3)])


def test_writing_into_a_captured_tensor_is_unsupported():
    state = torch.zeros(3)

    def f(x):
        state.add_(x)
        return x

    with pytest.raises(tn.UnsupportedOpError, match="did not receive as an argument"):
        trace_flat(f, [torch.randn(3)])

    def g(x):  # a tensor made inside the function may be written freely
        t = torch.tensor([1.0, 2.0, 3.0])
        t.mul_(x)
        return t

    check(g, torch.randn(3))


def test_inplace_write_to_aliased_inputs_is_unsupported():
    x = torch.randn(3, 4)
    with pytest.raises(tn.UnsupportedOpError, match="share memory"):
        trace_flat(lambda a, b: a.add_(1) + b, [x, x[0]])
    trace_flat(lambda a, b: a + b, [x, x[0]])  # reading aliased inputs is fine


def test_escaped_tracer_is_an_error():
    kept = []

    def f(x):
        kept.append(x * 2)
        return x

    trace_flat(f, [torch.randn(2)])
    assert isinstance(kept[0], TracerTensor) and "f32[2]" in repr(kept[0])
    with pytest.raises(tn.TracingError, match="finished tn trace"):
        kept[0] + 1


def test_non_tensor_flat_input_is_an_error():
    with pytest.raises(tn.TracingError, match="static_argnums"):
        trace_flat(lambda x, n: x * n, [torch.randn(2), 3])


def test_gru_cell_loop_unrolls():
    torch.manual_seed(0)
    cell = nn.GRUCell(4, 8)
    names = [n for n, _ in cell.named_parameters()]

    def gru(xs, h, *ps):
        for t in range(xs.shape[0]):
            h = torch.func.functional_call(cell, dict(zip(names, ps)), (xs[t], h))
        return h

    check(gru, torch.randn(5, 3, 4), torch.randn(3, 8), *[p.detach() for p in cell.parameters()])


def test_sgd_update_under_no_grad_is_written_back():
    def step(x, w):
        loss = (x @ w).pow(2).sum()
        (g,) = torch.autograd.grad(loss, [w])
        with torch.no_grad():
            w.sub_(0.1 * g)
        return loss

    tr = check(step, torch.randn(3, 4), torch.randn(4, 2, requires_grad=True))
    assert [i for i, _ in tr.ir.mutations] == [1]


def test_foreach_inplace_matches_eager_order():
    def f(a, b):
        torch._foreach_add_([a, b], [b, a])
        torch._foreach_mul_([a, b], 2.0)
        return a - b

    check(f, torch.randn(3), torch.randn(3))


def test_random_ops_are_marked_random():
    def f(x):
        return F.dropout(x, 0.5, training=True)

    tr = trace_flat(f, [torch.randn(4, 4)])
    assert any(getattr(e.op, "random", False) for e in tr.ir.eqns)


def test_tracing_looks_like_compiling_to_libraries():
    # Hugging Face Transformers' is_tracing() (and torch's optimizers) ask
    # torch.compiler.is_compiling() before reading tensor values.
    seen = []

    def f(x):
        seen.append(torch.compiler.is_compiling())
        if not torch.compiler.is_compiling() and bool((x > 0).all()):
            return x * 2
        return x + 1

    assert not torch.compiler.is_compiling()
    check(f, torch.randn(3))
    assert seen[0] is True
    assert not torch.compiler.is_compiling(), "the flag must be restored after tracing"


def test_compiling_flag_restored_after_a_tracing_error():
    def f(x):
        return x * 2 if x.sum() > 0 else x

    with pytest.raises(tn.TracingError):
        trace_flat(f, [torch.randn(3)])
    assert not torch.compiler.is_compiling()


@pytest.mark.parametrize("gqa", [False, True])
def test_gradients_through_scaled_dot_product_attention(gqa):
    # On CPU, SDPA would pick the fused flash kernel whose backward op has no decomposition;
    # tracing picks the math composite (training any Transformers model needs this).
    def f(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return torch.autograd.grad(out.square().sum(), [q, k, v])

    kv_heads = 2 if gqa else 4
    check(f, torch.randn(2, 4, 6, 8, requires_grad=True), torch.randn(2, kv_heads, 6, 8, requires_grad=True),
          torch.randn(2, kv_heads, 6, 8, requires_grad=True))
    assert torch.backends.cuda.flash_sdp_enabled(), "the SDPA backend flags must be restored after tracing"


def test_as_strided_in_place_that_moves_no_element_is_traced():
    """Swin (through adaptive_avg_pool's channels-last output) restrides a pooled [N, C, 1, 1] tensor in place:
    the strides change on size-1 dims only, so the values stay where they are; a restride that moves elements
    is still refused."""
    def pooled(x):
        y = torch.nn.functional.adaptive_avg_pool2d(x, 1)
        y.as_strided_((2, 3, 1, 1), (3, 1, 3, 3))
        return y.flatten(1) * 2

    x = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(tn.jit(pooled)(x), pooled(x))

    def moves(x):
        y = x * 2
        y.as_strided_((2, 3), (1, 2))
        return y

    with pytest.raises(tn.UnsupportedOpError, match="as_strided_"):
        tn.jit(moves)(torch.randn(2, 3))


def test_inplace_overloads_map_to_the_functional_overload_of_the_same_argument_types():
    # pow_.Scalar (Tensor self, Scalar exponent) is pow.Tensor_Scalar, not pow.Scalar (Scalar self, Tensor
    # exponent): vector_norm's gradient calls it (found by bench/coverage.py --mode jit --grad)
    from tn.trace import _functional_variant

    aten = torch.ops.aten
    assert _functional_variant(aten.pow_.Scalar) is aten.pow.Tensor_Scalar
    assert _functional_variant(aten.pow_.Tensor) is aten.pow.Tensor_Tensor
    assert _functional_variant(aten.add_.Tensor) is aten.add.Tensor

    x = torch.randn(6, requires_grad=True)
    f = tn.jit(lambda x: torch.autograd.grad(torch.linalg.vector_norm(x, 3.0), x)[0], fullgraph=True)
    torch.testing.assert_close(f(x), torch.autograd.grad(torch.linalg.vector_norm(x, 3.0), x)[0])
