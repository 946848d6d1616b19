# Tests of cheaper cold eager programs on the neuron device: fused scaled_dot_product_attention and its IR builder.
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import tn
from tn.device import attention, eager, tracking
from tn.ir import Literal
from tn.trace import trace_flat

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def canon(ir):
    """An IR as nested tuples (variables numbered by definition order), for equation-by-equation comparison."""
    idx = {}

    def atom(a):
        if isinstance(a, Literal):
            return ("lit", repr(a.value), a.dtype)
        return ("var", idx[a])

    for v in ir.inputs:
        idx[v] = len(idx)
    out = [tuple(v.aval for v in ir.inputs)]
    for e in ir.eqns:
        ins = [atom(a) for a in e.inputs]
        for v in e.outputs:
            idx[v] = len(idx)
        out.append((e.op.name, ins, sorted((k, repr(x)) for k, x in e.attrs.items()), [v.aval for v in e.outputs]))
    out.append([atom(a) for a in ir.outputs])
    out.append((list(ir.mutations), len(ir.consts)))
    return out


def _meta(shape, dtype):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [(2,), (1, 3), (2, 1, 2)])
@pytest.mark.parametrize("mask", [None, "bool", "float", "bool-rows", "float-2d"])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_sdpa_builder_matches_trace(dtype, batch, mask, scale):
    # the direct IR builder writes exactly the equations tracing the math decomposition records
    L, S, E, Ev = 3, 7, 8, 6
    metas = [_meta(batch + (L, E), dtype), _meta(batch + (S, E), dtype), _meta(batch + (S, Ev), dtype)]
    if mask is not None:
        shape = {"bool": batch + (L, S), "float": batch + (L, S), "bool-rows": (1,) * len(batch) + (1, S),
                 "float-2d": (L, S)}[mask]
        metas.append(_meta(shape, torch.bool if mask.startswith("bool") else dtype))
    flat = metas[:3] + [metas[3] if mask else None, 0.0, False, scale, False]

    def f(*ts):
        return SDPA(ts[0], ts[1], ts[2], ts[3] if mask else None, 0.0, False, scale=scale, enable_gqa=False)

    built = attention.build_ir(metas, flat, None)
    assert built is not None and built.out_leaves == [0]
    assert canon(built.ir) == canon(trace_flat(f, metas).ir)


def test_sdpa_builder_declines_what_it_does_not_cover():
    m = _meta((1, 2, 3, 4), torch.float32)
    k = _meta((1, 2, 5, 4), torch.float32)
    assert attention.build_ir([m, k, k], [m, k, k, None, 0.0, True, None, False], None) is None   # causal
    assert attention.build_ir([m, k, k], [m, k, k, None, 0.0, False, None, True], None) is None   # GQA
    kb = _meta((2, 2, 5, 4), torch.float32)
    assert attention.build_ir([m, kb, kb], [m, kb, kb, None, 0.0, False, None, False], None) is None  # broadcast
    big = _meta((3, 1, 3, 5), torch.bool)   # a mask that would widen the scores
    assert attention.build_ir([m, k, k, big], [m, k, k, big, 0.0, False, None, False], None) is None


def _reference(q, k, v, **kw):
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw)


def _dev(x):
    return x.to("neuron") if isinstance(x, torch.Tensor) else x


CASES = {
    "plain": lambda g, s: {},
    "bool-mask": lambda g, s: {"attn_mask": torch.rand(s[0], 1, s[2], s[3], generator=g) > 0.3},
    "bool-mask-dead-row": lambda g, s: {"attn_mask": torch.zeros(s[2], s[3], dtype=torch.bool).index_fill_(
        0, torch.tensor([0]), True)},
    "float-mask": lambda g, s: {"attn_mask": torch.randn(s[2], s[3], generator=g)},
    "causal": lambda g, s: {"is_causal": True},
    "scale": lambda g, s: {"scale": 0.17, "attn_mask": torch.rand(s[2], s[3], generator=g) > 0.2},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("L", [1, 5])
def test_sdpa_on_device_is_one_program_and_matches_torch(dtype, case, L):
    g = torch.Generator().manual_seed(len(case) * 10 + L)
    B, H, S, D = 2, 3, 9, 16
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(dtype) for n in (L, S, S))
    kw = CASES[case](g, (B, H, L, S))
    if "attn_mask" in kw and kw["attn_mask"].is_floating_point():
        kw["attn_mask"] = kw["attn_mask"].to(dtype)
    ref = _reference(q, k, v, **{n: (x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
                                 for n, x in kw.items()})
    tracking.reset_op_counts()
    with torch.no_grad():
        out = F.scaled_dot_product_attention(_dev(q), _dev(k), _dev(v), **{n: _dev(x) for n, x in kw.items()})
    assert out.device.type == "neuron" and out.dtype == dtype and out.shape == (B, H, L, D)
    ops = tracking.executed_ops()
    assert ops.get("aten::scaled_dot_product_attention") == 1
    assert set(ops) <= {"aten::scaled_dot_product_attention", "aten::_copy_from"}, ops
    assert not tracking.fallback_ops()
    torch.testing.assert_close(out.cpu().float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    if case == "bool-mask-dead-row":
        assert torch.equal(out.cpu()[:, :, 1:], torch.zeros_like(out.cpu()[:, :, 1:]))


def test_sdpa_cached_per_shape_and_3d_and_gqa():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(4, 3, 8, generator=g), torch.randn(4, 6, 8, generator=g), torch.randn(4, 6, 5, generator=g)
    eager.clear_cache()
    with torch.no_grad():
        for _ in range(2):
            out = F.scaled_dot_product_attention(_dev(q), _dev(k), _dev(v))
    info = eager.cache_info()
    assert info["entries"] == 1
    torch.testing.assert_close(out.cpu(), _reference(q, k, v), atol=2e-5, rtol=2e-5)
    # grouped-query attention: not covered by the builder, traced (still one program)
    q4, k4 = torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    v4 = torch.randn(1, 2, 6, 8, generator=g)
    tracking.reset_op_counts()
    with torch.no_grad():
        out = F.scaled_dot_product_attention(_dev(q4), _dev(k4), _dev(v4), enable_gqa=True)
    assert tracking.executed_ops().get("aten::scaled_dot_product_attention") == 1
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True)
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=2e-5)


def test_sdpa_inference_mode():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (3, 4, 4))
    tracking.reset_op_counts()
    with torch.inference_mode():
        out = F.scaled_dot_product_attention(_dev(q), _dev(k), _dev(v))
    assert tracking.executed_ops().get("aten::scaled_dot_product_attention") == 1
    torch.testing.assert_close(out.cpu(), _reference(q, k, v), atol=2e-5, rtol=2e-5)


def test_sdpa_with_grad_runs_the_decomposition_and_differentiates():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (3, 5, 5))
    mask = torch.rand(3, 5, generator=g) > 0.3
    qd, kd, vd = (_dev(t).requires_grad_() for t in (q, k, v))
    tracking.reset_op_counts()
    out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=_dev(mask))
    assert "aten::scaled_dot_product_attention" not in tracking.executed_ops()   # the decomposition ran
    out.sum().backward()
    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask).sum().backward()
    for a, b in ((qd, qc), (kd, kc), (vd, vc)):
        torch.testing.assert_close(a.grad.cpu(), b.grad, atol=1e-5, rtol=1e-5)


def test_sdpa_dropout_runs_the_decomposition():
    q = torch.randn(1, 2, 3, 8)
    tracking.reset_op_counts()
    with torch.no_grad():
        out = F.scaled_dot_product_attention(_dev(q), _dev(q), _dev(q), dropout_p=0.5)
    assert out.shape == q.shape and torch.isfinite(out.cpu()).all()
    assert "aten::scaled_dot_product_attention" not in tracking.executed_ops()


def test_sdpa_inside_jit_of_device_tensors():
    # tracer tensors reach the device kernel as a subclass: the decomposition is traced as before
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (3, 4, 4))

    @tn.jit
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v) * 2

    out = f(_dev(q), _dev(k), _dev(v))
    torch.testing.assert_close(out.cpu(), _reference(q, k, v) * 2, atol=2e-5, rtol=2e-5)


def test_sdpa_scale_literal_is_torch_s():
    # the builder's scaling factor is torch's sqrt(1/sqrt(E)), computed in double as the C++ composite does
    metas = [_meta((2, 3, 8), torch.float32), _meta((2, 5, 8), torch.float32), _meta((2, 5, 8), torch.float32)]
    ir = attention.build_ir(metas, metas + [None, 0.0, False, None, False], None).ir
    lits = [a.value for e in ir.eqns if e.op.name == "mul" for a in e.inputs if isinstance(a, Literal)]
    assert lits == [math.sqrt(1.0 / math.sqrt(8))] * 2


# --------------------------------------------------------------------------- the direct one-op IR builder

def _workload():
    """A spread of eager ops on the device (functional, out=, scalars, dtypes, broadcasting, reductions)."""
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    m = torch.randn(4, 5, generator=g)
    bb = torch.randn(2, 3, 4, generator=g), torch.randn(2, 4, 5, generator=g)
    i = torch.randint(0, 3, (3, 4), generator=g)
    yield "add", lambda t: t(a) + t(b)
    yield "add-scalar", lambda t: t(a) + 2.5
    yield "add-alpha", lambda t: torch.add(t(a), t(b), alpha=3)
    yield "mul-broadcast", lambda t: t(a) * t(b[:1].contiguous())
    yield "mul-int-float", lambda t: t(i) * t(a)
    yield "div", lambda t: t(a) / t(b)
    yield "mm", lambda t: t(a) @ t(m)
    yield "bmm", lambda t: torch.bmm(t(bb[0]), t(bb[1]))
    yield "bmm-out", lambda t: torch.bmm(t(bb[0]), t(bb[1]), out=t(torch.empty(2, 3, 5)))
    yield "addmm", lambda t: torch.addmm(t(m[0]), t(a), t(m))
    yield "cat", lambda t: torch.cat([t(a), t(b)], dim=1)
    yield "cat-neg-dim", lambda t: torch.cat([t(a), t(b), t(a)], dim=-2)
    yield "softmax", lambda t: torch.softmax(t(a), -1)
    yield "where", lambda t: torch.where(t(a) > 0, t(a), t(b))
    yield "eq-scalar", lambda t: t(i) == 1
    yield "lt", lambda t: t(a) < t(b)
    yield "sum-dim", lambda t: t(a).sum(1)
    yield "sum-dtype", lambda t: t(i).sum(0, dtype=torch.float32)
    yield "mean", lambda t: t(a).mean(0, keepdim=True)
    yield "amax", lambda t: t(a).amax(-1)
    yield "pow", lambda t: t(a) ** 2
    yield "tanh", lambda t: torch.tanh(t(a))
    yield "exp-out-double-cast", lambda t: torch.exp(t(a), out=t(torch.empty(3, 4, dtype=torch.bfloat16)))
    yield "gelu", lambda t: F.gelu(t(a))
    yield "neg", lambda t: -t(a)
    yield "abs-int", lambda t: torch.abs(t(i - 1))
    yield "cumsum", lambda t: torch.cumsum(t(a), 1)
    yield "argmax", lambda t: torch.argmax(t(a), 1)
    yield "to-dtype", lambda t: t(a).to(torch.bfloat16)
    yield "clamp", lambda t: torch.clamp(t(a), -0.5, 0.5)
    yield "embedding", lambda t: F.embedding(t(i), t(m))
    yield "index-select", lambda t: torch.index_select(t(m), 0, t(i[0]))
    yield "layer-norm", lambda t: F.layer_norm(t(a), (4,))
    yield "linear", lambda t: F.linear(t(a), t(m.t().contiguous()), t(m[0].contiguous()))
    yield "add-inplace", lambda t: t(a.clone()).add_(1.0)
    yield "masked-fill", lambda t: t(a).masked_fill(t(a > 0), -1.0)
    yield "rsub", lambda t: 1.0 - t(a)
    yield "triu", lambda t: torch.triu(t(a))


def test_direct_ir_matches_trace_and_torch(monkeypatch):
    # every one-op program the direct builder writes is, equation by equation, the tracer's
    checked = []
    orig = eager._direct_ir

    def checking(op, functional, out_names, flat, spec, tensor_pos, metas):
        got = orig(op, functional, out_names, flat, spec, tensor_pos, metas)
        if got is not None:
            ref = trace_flat(eager._one_op(op, flat, spec, tensor_pos), metas)
            assert canon(got.ir) == canon(ref.ir), (op, got.ir, ref.ir)
            assert got.out_leaves == ref.out_leaves and got.out_tree == ref.out_tree
            checked.append(eager.op_name(op))
        return got

    monkeypatch.setattr(eager, "_direct_ir", checking)
    eager.clear_cache()
    for name, fn in _workload():
        with torch.no_grad():
            want = fn(lambda x: x)
            got = fn(lambda x: x.to("neuron"))
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if want.is_floating_point():
            tol = 2e-2 if want.dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol, msg=name)
        else:
            assert torch.equal(got.cpu(), want), name
    assert len(checked) >= 20, checked
    assert {"aten::bmm.out", "aten::cat.out", "aten::mul.Tensor", "aten::exp.out"} <= set(checked), checked


def test_direct_ir_declines_what_it_does_not_map():
    mt = torch.empty(3, 4, device="meta")
    # in-place op, view op, a converter that decomposes: all traced instead
    for op, flat, spec in [(aten.add_.Tensor, [mt, mt], (2, (), (None, None))),
                           (aten.max.dim, [mt, 1], (2, (), (None, None)))]:
        functional, outs = eager._functional_of(op)
        assert eager._direct_ir(op, functional, outs, flat, spec, (0, 1)[:sum(isinstance(x, torch.Tensor)
                                                                                for x in flat)],
                                [x for x in flat if isinstance(x, torch.Tensor)]) is None
