# Scaled dot-product attention on the neuron device: one fused device program per shape, not ~13 eager ops.
"""``F.scaled_dot_product_attention`` on neuron tensors.

``aten::scaled_dot_product_attention`` is a CompositeImplicitAutograd op: on
a backend without its own kernel torch runs its math decomposition, which on
the device is about 13 eager ops (mask to floats, two scalings, two ``bmm``,
``add``, ``_softmax``, the ``isneginf``/``all``/``where`` of the safe
softmax ...), each its own one-op program. This module registers a kernel
(keys ``AutogradPrivateUse1`` and ``PrivateUse1``) that runs the whole
attention as **one** device program per shape signature instead, through
:func:`tn.device.eager.run_fused`: the same equations the tracer records for
the math decomposition, compiled together (the compiler's attention fusion,
:mod:`tn.lower.attention`, keeps scores and probabilities on chip). Results
match the decomposition to float rounding; the modelled device time is that
of the fused program (one launch, no HBM round trips between the pieces).

The program's IR comes from :func:`build_ir`, a direct builder that writes
the equations the tracer would record (tests compare the two equation by
equation) in well under a millisecond; cases it does not cover (``is_causal``,
``enable_gqa``, batch dimensions that differ or broadcast, other dtypes) are
traced as before, still as one program.

The decomposition (the previous behaviour) still runs when autograd needs it
(grad mode on and an input requires grad), for ``dropout_p > 0`` (random
numbers), for tensor subclasses (tracers, FakeTensors), for inputs not all on
the device, and when the fused program cannot be compiled.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional

import torch
from torch.utils._pytree import tree_flatten

from ..ir import IR, Eqn, Literal, Var
from ..ops import OPS
from ..trace import Traced, user_source
from . import eager

__all__ = ["register", "build_ir", "fusable"]

aten = torch.ops.aten
_OP = aten.scaled_dot_product_attention.default
_LEAF_SPEC = tree_flatten(torch.empty(0))[1]   # out_tree of a single-tensor result
_LIBS: list = []


def fusable(query, key, value, attn_mask, dropout_p) -> bool:
    """Whether a call can run as one fused program (see the module docstring)."""
    if dropout_p != 0.0:
        return False
    ts = (query, key, value) if attn_mask is None else (query, key, value, attn_mask)
    for t in ts:
        if type(t) is not torch.Tensor or t.device.type != "neuron":
            return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return False
    return True


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """aten::scaled_dot_product_attention on the neuron device: one fused program, or the decomposition."""
    if fusable(query, key, value, attn_mask, dropout_p):
        r = eager.run_fused(_OP, (query, key, value, attn_mask, float(dropout_p), bool(is_causal)),
                            {"scale": scale, "enable_gqa": bool(enable_gqa)}, build=build_ir)
        if r is not NotImplemented:
            return r
    return _OP.decompose(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def register() -> None:
    """Install the fused attention kernel of the neuron device (idempotent)."""
    if _LIBS:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("scaled_dot_product_attention", _sdpa, "AutogradPrivateUse1")
    lib.impl("scaled_dot_product_attention", _sdpa, "PrivateUse1")   # inference_mode skips the autograd key
    _LIBS.append(lib)


def build_ir(metas: List[torch.Tensor], flat: list, spec: Any):
    """The IR of ``scaled_dot_product_attention`` as tracing its math decomposition records it, or None.

    ``metas``: meta tensors of the tensor arguments (query, key, value[, mask]);
    ``flat``: the call's flat arguments ``(q, k, v, attn_mask, dropout_p,
    is_causal, scale, enable_gqa)``. Covers query/key/value of one rank >= 3
    with the same batch dimensions, fp32/bf16/fp16, no mask or a bool mask or a
    mask of the query's dtype that broadcasts to the scores, ``dropout_p == 0``,
    not causal, no GQA; returns None otherwise (the caller traces instead).
    """
    if len(flat) != 8:
        return None
    attn_mask, dropout_p, is_causal, scale, gqa = flat[3:8]
    if dropout_p or is_causal or gqa:
        return None
    q, k, v = metas[0], metas[1], metas[2]
    m = metas[3] if attn_mask is not None else None
    n = q.dim()
    if n < 3 or k.dim() != n or v.dim() != n:
        return None
    batch = tuple(q.shape[:-2])
    if tuple(k.shape[:-2]) != batch or tuple(v.shape[:-2]) != batch:
        return None
    L, E = q.shape[-2:]
    S, Ek = k.shape[-2:]
    Sv, Ev = v.shape[-2:]
    if Ek != E or Sv != S:
        return None
    dt = q.dtype
    if k.dtype != dt or v.dtype != dt or dt not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if 0 in q.shape or 0 in k.shape or 0 in v.shape:
        return None
    scores = batch + (L, S)
    if m is not None:
        if m.dim() > n or (m.dtype != torch.bool and m.dtype != dt) or 0 in m.shape:
            return None
        for dm, ds in zip(reversed(m.shape), reversed(scores)):
            if dm != 1 and dm != ds:
                return None
    src = user_source()
    f32 = torch.float32
    eqns: List[Eqn] = []

    def emit(name: str, inputs: list, out_shape, out_dtype, **attrs) -> Var:
        out = Var(out_shape, out_dtype)
        eqns.append(Eqn(OPS[name], inputs, [out], attrs, src))
        return out

    qv, kv, vv = Var(q.shape, dt), Var(k.shape, dt), Var(v.shape, dt)
    inputs = [qv, kv, vv]
    mask: Optional[Var] = None
    if m is not None:
        mv = Var(m.shape, m.dtype)
        inputs.append(mv)
        mask = mv
        if m.dtype == torch.bool:   # convert_boolean_attn_mask: where(mask, 0, -inf) in the query's dtype
            ninf = emit("full", [], (), dt, shape=(), value=-math.inf, dtype=dt)
            zero = emit("full", [], (), dt, shape=(), value=0.0, dtype=dt)
            mask = emit("where", [mv, zero, ninf], tuple(m.shape), dt)
    up = dt != f32
    if up:   # the math composite computes reduced-precision attention in fp32
        qv = emit("convert", [qv], q.shape, f32, dtype=f32)
        kv = emit("convert", [kv], k.shape, f32, dtype=f32)
        vv = emit("convert", [vv], v.shape, f32, dtype=f32)
    s = float(math.sqrt(scale if scale is not None else 1.0 / math.sqrt(E)))
    qs = emit("mul", [qv, Literal(s)], q.shape, f32)
    dims = tuple(range(n - 2)) + (n - 1, n - 2)
    kt = emit("permute", [kv], batch + (E, S), f32, dims=dims)
    ks = emit("mul", [kt, Literal(s)], batch + (E, S), f32)
    bf = 1
    for d in batch:
        bf *= d
    if n > 3:
        qs = emit("reshape", [qs], (bf, L, E), f32, shape=(bf, L, E))
        ks = emit("reshape", [ks], (bf, E, S), f32, shape=(bf, E, S))
    a = emit("matmul", [qs, ks], (bf, L, S) if n > 3 else scores, f32)
    if n > 3:
        a = emit("reshape", [a], scores, f32, shape=scores)
    if mask is not None:
        a = emit("add", [a, mask], scores, f32)
    # _safe_softmax: softmax, and rows that are all -inf give zeros
    last = (n - 1,)
    rows = batch + (L, 1)
    mx = emit("amax", [a], rows, f32, dims=last, keepdim=True)
    sh = emit("sub", [a, mx], scores, f32)
    ex = emit("exp", [sh], scores, f32)
    sm = emit("sum", [ex], rows, f32, dims=last, keepdim=True)
    p = emit("div", [ex, sm], scores, f32)
    isinf = emit("eq", [a, Literal(-math.inf)], scores, torch.bool)
    keep = emit("logical_not", [isinf], scores, torch.bool)
    anyk = emit("any", [keep], rows, torch.bool, dims=last, keepdim=True)
    dead = emit("logical_not", [anyk], rows, torch.bool)
    zeros = emit("full", [], scores, f32, shape=scores, value=0, dtype=f32)
    p = emit("where", [dead, zeros, p], scores, f32)
    if up:
        emit("convert", [p], scores, dt, dtype=dt)   # (the composite's unused low-precision copy)
    if n > 3:
        p = emit("reshape", [p], (bf, L, S), f32, shape=(bf, L, S))
        vv = emit("reshape", [vv], (bf, S, Ev), f32, shape=(bf, S, Ev))
    o = emit("matmul", [p, vv], (bf, L, Ev) if n > 3 else batch + (L, Ev), f32)
    if n > 3:
        o = emit("reshape", [o], batch + (L, Ev), f32, shape=batch + (L, Ev))
    if up:
        o = emit("convert", [o], batch + (L, Ev), dt, dtype=dt)
    return Traced(IR(inputs, eqns, [o]), _LEAF_SPEC, [0])
