# Fast paths of eager ops on the neuron device: direct kernels for small add/sub/mul, functional structured ops.
"""Cheap dispatch of eager ops: the functional kernels of structured ops (at the
end of this module: in adaptive eager mode ``tanh(x)`` is queued as one op
instead of torch's ``empty`` + ``tanh.out``), and direct kernels for small
elementwise ops (``add``, ``sub``, ``mul`` of two
same-shape contiguous fp32/bf16 tensors, ``alpha=1``, at most
``TN_DEVICE_FAST_NUMEL`` elements, default 65536).

These ops get their own PrivateUse1 kernels, so they skip torch's
``empty`` + ``out=`` composite and the boxed fallback. The first call of a
signature goes the normal way: its one-op NeuronCore program is compiled,
validated and run on the model, and its modelled time is kept. Later calls
allocate the result from the caching allocator and compute it with one native
call (``tn_dev_binary``: fp32 math, bf16 rounded to nearest even, the same
arithmetic the NeuronCore engines do for these ops), charging the program's
modelled time to :func:`tn.device.tracking.device_time_ns`.

How to tell: such calls are counted in ``torch.neuron.fastpath_ops()``
(as well as in ``executed_ops()``). While a :func:`tn.profile` is active, or
with ``TN_DEVICE_FASTPATH=0`` (or :func:`set_enabled`), every call runs the
real program instead, so profiles only ever show real program runs.
"""
from __future__ import annotations

from typing import Any, List

import torch

from .. import config
from ..neuron import runtime as _runtime
from ..neuron import timeline as _timeline
from . import eager, tracking, windows
from .allocator import _lib, contiguous_strides, new_dense

__all__ = ["register", "enabled", "FAST_OPS", "STRUCTURED_OPS"]

aten = torch.ops.aten
_F32, _BF16 = torch.float32, torch.bfloat16
_CODES = {_F32: 0, _BF16: 1}
_MAX = config.get("device_fast_numel")
#: (op index, shape, dtype) -> modelled ns of the op's NeuronCore program
_SEEN: dict = {}
_new_dense = new_dense
_binary = _lib.tn_dev_binary
_count = tracking.count_fast
_add_ns = tracking.add_device_ns
_advance = _timeline.advance


def enabled() -> bool:
    """False when ``TN_DEVICE_FASTPATH=0``."""
    return config.get("device_fastpath")


def _make(idx: int, op, name: str):
    def kernel(a, b, *, alpha=1):
        if windows.active():    # adaptive eager: queued into the window; no program runs now to learn a time from
            args, kwargs = (a, b), ({"alpha": alpha} if alpha != 1 else {})
            r = eager._record_plain(op, args, kwargs)     # (run_op's first step, without its frame)
            return r if r is not windows.GENERAL else eager.run_op_general(op, args, kwargs)
        if (type(b) is torch.Tensor and type(a) is torch.Tensor and alpha == 1 and not a.is_cpu and not b.is_cpu
                and b.dtype is a.dtype and a.is_contiguous() and b.is_contiguous() and a.shape == b.shape):
            e = _SEEN.get((idx, a.shape, a.dtype))
            # off while a tn.profile() block is active
            if e is not None and _ON[0] and not _runtime.listening():
                index = a.device.index
                if b.device.index != index:   # mixed devices: the eager path raises torch's error
                    return eager.run_op(op, (a, b), {})
                ns, n, nbytes, _, code = e
                out, st = _new_dense(a.shape, a.dtype, nbytes, index)
                _binary(idx, code, a.data_ptr(), b.data_ptr(), st.data_ptr(), n)
                _count(name)
                _add_ns(ns, index)
                _advance(ns, index)    # the program it stands in for, on that device's current stream
                return out
            before = eager.last_program_profile()
            r = eager.run_op(op, (a, b), {})
            if e is None and a.dtype in _CODES and a.numel() <= _MAX and _ON[0]:
                prof = eager.last_program_profile()
                if prof is not None and prof is not before and not prof.host_ops:   # (this call's program)
                    _SEEN[(idx, a.shape, a.dtype)] = (prof.total_ns, a.numel(), a.numel() * a.element_size(),
                                                      contiguous_strides(a.shape), _CODES[a.dtype])
            return r
        return eager.run_op(op, (a, b), {"alpha": alpha} if alpha != 1 else {})

    kernel.__name__ = f"neuron_fast_{name.split('::')[-1].replace('.', '_')}"
    kernel.__doc__ = f"{name} on the neuron device with the small-op fast path (see tn.device.fastpath)."
    return kernel


FAST_OPS = (("add.Tensor", aten.add.Tensor), ("sub.Tensor", aten.sub.Tensor), ("mul.Tensor", aten.mul.Tensor))
_ON = [enabled()]
_LIBS: list = []


def register() -> None:
    """Install the fast kernels and the functional kernels of structured ops (idempotent)."""
    if _LIBS:
        return
    lib = torch.library.Library("aten", "IMPL")
    for idx, (name, op) in enumerate(FAST_OPS):
        if name == "mul.Tensor":
            kernel = _make(2, op, "aten::mul.Tensor")

            def mul(a, b, _k=kernel):
                return _k(a, b)

            mul.__doc__ = kernel.__doc__
            lib.impl(name, mul, "PrivateUse1")
        else:
            lib.impl(name, _make(idx, op, f"aten::{name}"), "PrivateUse1")
    _LIBS.append(lib)
    _register_structured()   # after the kernels above: only ops whose kernel is torch's composite


def set_enabled(flag: bool) -> None:
    """Turn the fast path on or off at run time (benches compare both)."""
    _ON[0] = bool(flag)


# --------------------------------------------------------------------------- structured ops, functional
#
# torch gives a backend without its own kernel for a structured op (``tanh``, ``addmm``, ``cat`` ...) its
# ``CompositeExplicitAutogradNonFunctional`` kernel: ``torch.empty`` for the result (tn's ``empty`` kernel, the caching
# allocator and, in adaptive eager mode, a blank slot of the window), then the ``out=`` overload through the boxed
# fallback. In adaptive eager mode (tn.device.windows) that is two trips through Python for one recorded op; the
# kernels below queue the functional op itself, its result allocated from the metadata the window cached for the
# call (tn.device.eager.record_functional). Every other call (op mode, a call the window declines, results whose
# strides torch would not make contiguous) runs torch's own composite kernel, called by its dispatch key, so op mode
# runs exactly the ops it ran before (``empty`` + ``out=``), and adaptive mode counts the op under the name of its
# ``out=`` overload, as op mode does. Only ops whose neuron kernel is that composite are overridden (checked at
# registration); the list holds the structured ops of transformer training and generation.

#: functional overloads (``name`` or ``name.overload``) given a kernel when torch's is the composite
STRUCTURED_OPS = ("addmm", "mm", "bmm", "baddbmm", "cat", "tanh", "tanh_backward", "pow.Tensor_Scalar",
    "pow.Tensor_Tensor", "eq.Scalar", "eq.Tensor", "ne.Scalar", "ne.Tensor", "lt.Scalar", "lt.Tensor", "le.Scalar",
    "gt.Scalar", "gt.Tensor", "ge.Scalar", "bitwise_or.Tensor", "bitwise_and.Tensor", "bitwise_not", "logical_not",
    "any", "any.dim", "all", "argmax", "argmin", "isin.Tensor_Tensor", "div.Tensor", "div.Scalar", "neg", "exp",
    "log", "sqrt", "rsqrt", "sigmoid", "sigmoid_backward", "silu", "silu_backward", "gelu", "gelu_backward",
    "threshold_backward", "_softmax", "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data",
    "nll_loss_forward", "nll_loss_backward", "sum.dim_IntList", "mean.dim", "amax", "amin", "maximum", "minimum",
    "where.self", "clamp", "clamp_min", "addcmul", "addcdiv", "lerp.Scalar", "lerp.Tensor", "cumsum", "sort", "topk",
    "max.dim", "min.dim", "sub.Tensor", "mul.Tensor", "add.Tensor", "index_add", "scatter_add", "gather",
    "embedding_dense_backward", "masked_fill.Scalar", "tril", "triu", "sgn", "abs", "reciprocal", "cos", "sin",
    "erf", "exp2", "log1p", "expm1", "hardtanh", "elu", "leaky_relu", "softplus", "mse_loss",
    "native_dropout_backward", "fmod.Scalar", "remainder.Scalar", "floor", "round", "sign", "atan2", "xlogy.Tensor",
    "pow.Scalar", "rsub.Tensor", "avg_pool2d", "max_pool2d_with_indices", "upsample_nearest2d",
    "upsample_bilinear2d", "logit", "hardswish", "hardsigmoid", "mish")

_NONFUNCTIONAL = torch._C.DispatchKey.CompositeExplicitAutogradNonFunctional
#: the ops given a kernel here
STRUCTURED: List[Any] = []


def _out_name(op) -> str:
    """The name of ``op``'s ``out=`` overload (what op mode runs and counts), or ``op``'s own name."""
    packet = getattr(torch.ops.aten, op._schema.name.split("::")[-1])
    for ov in packet.overloads():
        cand = getattr(packet, ov)
        if cand is not op and eager._functional_of(cand)[0] is op:
            return eager.op_name(cand)
    return eager.op_name(op)


def _structured_kernel(op):
    composite = op._op_dk    # torch's composite kernel, called by its dispatch key (Python numbers wrap as usual)
    name = _out_name(op)     # counted (torch.neuron.executed_ops) under the name op mode counts

    def kernel(*args, **kwargs):
        if windows.active():
            r = eager.record_functional(op, name, args, kwargs)
            if r is not NotImplemented:
                return r
        return composite(_NONFUNCTIONAL, *args, **kwargs)

    kernel.__name__ = f"neuron_{op.__name__.replace('.', '_')}"
    kernel.__doc__ = f"{op} on the neuron device: queued whole in adaptive eager mode, else torch's composite."
    return kernel


def _register_structured() -> None:
    """Install the functional kernels for the ops of :data:`STRUCTURED_OPS` whose neuron kernel is torch's
    composite."""
    lib = torch.library.Library("aten", "IMPL")
    for name in STRUCTURED_OPS:
        packet, _, ov = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet, None), ov or "default", None)
        if op is None:
            continue
        full = f"aten::{name}"
        try:
            k = torch._C._dispatch_get_computed_kernel_for_dispatch_key(full, torch._C.DispatchKey.PrivateUse1)
        except RuntimeError:
            continue
        if "CompositeExplicitAutogradNonFunctional" not in repr(k):
            continue
        if any(a.alias_info is not None for a in op._schema.arguments):
            continue
        STRUCTURED.append(op)
        lib.impl(name, _structured_kernel(op), "PrivateUse1")
    _LIBS.append(lib)
