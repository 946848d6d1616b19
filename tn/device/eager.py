# Eager mode of the neuron device: every aten op on neuron tensors runs as a cached one-op NeuronCore program.
"""The boxed PrivateUse1 fallback: eager ops of the ``neuron`` device.

Every aten op that reaches the device without a dedicated kernel (see
:mod:`tn.device.aten`) lands in :func:`fallback`, which sorts it:

* **program**: the op is traced alone with :func:`tn.trace.trace_flat`,
  optimised (:func:`tn.passes.optimize`) and compiled by the same compiler as
  ``tn.jit`` (:func:`tn.lower.compile_ir`): a one-op program that starts and
  ends in HBM. Compiled once per (op, input shapes/dtypes, non-tensor
  arguments) and kept in a bounded LRU cache (``TN_DEVICE_CACHE`` entries,
  default 4096). The inputs are bound by pointer to the device memory; in-place
  and ``out=`` ops write their results back into the device tensors (the IR's
  ``mutations`` say which input gets which output). An op that maps 1:1 to a
  core op (``bmm.out``, ``cat.out``, ``mul.Tensor`` ...) skips the tracer: its
  IR is written directly (:func:`_direct_ir`, the same equations), which
  takes about 0.4 ms off each cold compile.
* **fused**: composite ops the device runs whole (``scaled_dot_product_attention``,
  :mod:`tn.device.attention`) go through :func:`run_fused`: one program instead
  of one per op of their decomposition.
* **view**: ops whose result aliases an input (``unfold``, ``diagonal``,
  ``split`` ...) are metadata only: the result is a neuron view of the same
  storage, as in eager PyTorch.
* **foreach**: ``_foreach_*`` ops (the optimisers' default path on the device)
  run as one device op per list element.
* **host**: ops that cannot be traced (data-dependent shapes, no core op) or
  that draw random numbers run on the host on CPU aliases of the device
  memory. Random ops use torch's CPU generator, so ``torch.manual_seed`` gives
  the same numbers on ``neuron`` as on the CPU. Counted in
  :func:`tn.device.tracking.fallback_ops`; with ``TN_STRICT=1`` a non-random
  host fallback is a :class:`tn.UnsupportedOpError`.

Programs whose compiler left some equations on the host count as fallbacks too.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Dict, List, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import config
from .. import ops as _ops
from .. import trace as _trace
from ..errors import ArgumentValueError, DeviceError, UnsupportedOpError
from ..ir import IR, Eqn, Literal, Var
from ..passes import optimize
from ..trace import trace_flat
from . import tracking, windows
from .allocator import contiguous_strides, cpu_alias, current_index, new_tensor, on_device, resize_tensor
from .opargs import flatten_args, unflatten_args

_create_empty = torch._C._acc.create_empty_tensor
_set_storage = torch.ops.aten.set_.source_Storage_storage_offset
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_CPU = torch.device("cpu")

__all__ = ["fallback", "run_op", "run_fused", "cache_info", "clear_cache", "strict"]

_CACHE: "OrderedDict[Any, _Entry]" = OrderedDict()
_CACHE_MAX = config.get("device_cache")
_STATS = {"hits": 0, "misses": 0, "compile_s": 0.0}
_SEEDED = torch.Tag.nondeterministic_seeded


_LAST: list = [None]


def last_program_profile():
    """The :class:`tn.lower.ExecProfile` of the most recent eager program run (None before the first)."""
    return _LAST[0]


def strict() -> bool:
    """Strict mode (``TN_STRICT=1``): a host fallback of a non-random op raises :class:`tn.UnsupportedOpError`."""
    return config.get("strict")


class _Entry:
    """A cached decision for one (op, signature): a compiled program, or the reason it runs on the host."""

    __slots__ = ("exe", "out_tree", "out_leaves", "mutations", "reason", "host_ops", "tensor_pos", "single")

    def __init__(self, exe=None, out_tree=None, out_leaves=None, mutations=(), reason=None, host_ops=None,
                 tensor_pos=()):
        self.exe = exe
        self.out_tree = out_tree
        self.out_leaves = out_leaves
        self.mutations = tuple(mutations)
        self.reason = reason
        self.host_ops = host_ops or {}
        self.tensor_pos = tensor_pos
        self.single = out_tree is not None and out_tree.is_leaf()


def op_name(op) -> str:
    """``"aten::add.Tensor"`` for an OpOverload."""
    n = _NAMES.get(op)
    if n is None:
        ov = op._overloadname
        n = _NAMES[op] = f"{op._schema.name}.{ov}" if ov and ov != "default" else f"{op._schema.name}"
    return n


_NAMES: Dict[Any, str] = {}


def _leaf_key(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return (tuple(a.shape), a.dtype, a.device.type)
    if isinstance(a, float):
        return ("f", repr(a))
    if isinstance(a, (int, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return (type(a).__name__, a)
    return ("r", type(a).__name__, repr(a))


def cache_info() -> Dict[str, Any]:
    """Eager program cache: entries, hits, misses, seconds spent compiling, bound."""
    return {"entries": len(_CACHE), "hits": _STATS["hits"], "misses": _STATS["misses"],
            "compile_s": _STATS["compile_s"], "max_entries": _CACHE_MAX}


def clear_cache() -> None:
    """Drop every compiled eager program."""
    _CACHE.clear()


#: Ops whose ``indices`` (argument 1, a list) may be CPU tensors, as CUDA accepts them for ``x[idx]`` and
#: ``x[idx] = v``: they are copied to the device first.
_CPU_INDEX_OPS = frozenset(("aten::index.Tensor", "aten::index.Tensor_out", "aten::index_put", "aten::index_put_",
                            "aten::_index_put_impl_", "aten::_unsafe_index.Tensor", "aten::_unsafe_index_put"))


def _indices_to_device(args: tuple) -> tuple:
    """``args`` of an indexing op with its CPU index tensors copied to the device (as CUDA does)."""
    idx = args[1]
    if not any(isinstance(i, torch.Tensor) and i.device.type == "cpu" for i in idx):
        return args
    moved = [to_device(i) if isinstance(i, torch.Tensor) and i.device.type == "cpu" else i for i in idx]
    return (args[0], type(idx)(moved)) + tuple(args[2:])


class DeviceMismatchError(DeviceError):
    """An op's tensors are on different neuron devices (PyTorch's RuntimeError, with its wording)."""


def _op_device(args: tuple, kwargs: dict) -> int:
    """Index of the first neuron tensor among an op's arguments (lists opened one level); the current device if
    there is none."""
    for a in (*args, *kwargs.values()):
        if type(a) in (list, tuple):
            for b in a:
                if isinstance(b, torch.Tensor) and b.device.type == "neuron":
                    return b.device.index
        elif isinstance(a, torch.Tensor) and a.device.type == "neuron":
            return a.device.index
    return current_index()


def _check_devices(name: str, flat: list) -> bool:
    """Raise unless every tensor is on the current neuron device (0-d CPU tensors mix in, as with CUDA); True when
    one of them carries a lazy conjugate/negative bit (see :func:`_resolve_math_bits`)."""
    bits = False
    index = current_index()
    for a in flat:
        if isinstance(a, torch.Tensor):
            dev = a.device
            if dev.type == "neuron" and dev.index != index:
                raise DeviceMismatchError(f"Expected all tensors to be on the same device, but found at least two "
                                          f"devices, neuron:{index} and {dev}! ({name}; move tensors with "
                                          f".to(device))")
            if dev.type != "neuron" and a.dim() > 0:
                raise DeviceError(f"{name}: expected all tensors on the neuron device, but one argument is on {a.device} "
                              f"(shape {list(a.shape)}); move it with .to('neuron') (only 0-dim CPU tensors and the "
                              f"indices of indexing ops mix in, as with CUDA)")
            if a.is_conj() or a.is_neg():
                bits = True
    return bits


def _resolve_math_bits(op, name: str, flat: list, spec) -> list:
    """``flat`` with lazily conjugated/negated inputs (``x.conj()``, ``x.conj().imag``) materialised.

    Programs and host kernels read raw memory (CPU aliases carry no math bits), and ops such as ``mm`` fall
    through torch's Conjugate key to reach the device with the bit still set: computing on the raw memory would
    silently drop the conjugation. A written argument cannot be replaced by a copy, so that is an error."""
    schema = op._schema
    bound = _bind_args(schema, *unflatten_args(flat, spec))
    written = set()
    for a in schema.arguments:
        if a.alias_info is not None and a.alias_info.is_write:
            v = bound.get(a.name)
            for t in (v if isinstance(v, (list, tuple)) else (v,)):
                written.add(id(t))
    out = []
    for a in flat:
        if isinstance(a, torch.Tensor) and (a.is_conj() or a.is_neg()):
            if id(a) in written:
                raise UnsupportedOpError(f"{name}: the argument it writes into is a lazily conjugated or negated view "
                              f"(x.conj(), x.conj().imag); call .resolve_conj() / .resolve_neg() on it first")
            a = a.resolve_conj().resolve_neg()
        out.append(a)
    return out


def _is_view_op(op) -> bool:
    v = _VIEW_OPS.get(op)
    if v is None:
        v = _VIEW_OPS[op] = any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns)
    return v


_VIEW_OPS: Dict[Any, bool] = {}


_TENSOR_ARGS: Dict[Any, Tuple[Tuple[int, str], ...]] = {}


#: (type, value, dtype) -> the 0-dim CPU tensor :func:`_rewrap_scalars` hands ops for a Python number (read-only
#: arguments only); ``torch.tensor`` costs ~3.6 us a call and a loop passes the same constants every step
_SCALARS: Dict[Tuple[type, Any, torch.dtype], torch.Tensor] = {}
_SCALARS_MAX = 1024
_CACHED_TYPES = (bool, int, float)
#: id(op) -> (op, positions of its Tensor arguments an op may write: ``Tensor(a!)``)
_WRITTEN: Dict[int, Tuple[Any, frozenset]] = {}


def _scalar_tensor(v: Any, op, i: int) -> torch.Tensor:
    """The 0-dim CPU tensor for Python number ``v`` as argument ``i`` of ``op`` (bool, int64, the default float
    dtype, or complex): one cached tensor per value when the op only reads the argument (never for -0.0 or NaN,
    which compare equal to another value or to nothing)."""
    dtype = (torch.bool if isinstance(v, bool) else torch.int64 if isinstance(v, int) else
             torch.get_default_dtype() if isinstance(v, float) else None)
    tv = type(v)
    if dtype is None or tv not in _CACHED_TYPES or (tv is float and (v == 0.0 or v != v)):
        return torch.tensor(v) if dtype is None else torch.tensor(v, dtype=dtype)
    w = _WRITTEN.get(id(op))
    if w is None or w[0] is not op:
        w = _WRITTEN[id(op)] = (op, frozenset(j for j, a in enumerate(op._schema.arguments)
                                              if a.alias_info is not None and a.alias_info.is_write))
    if i in w[1]:
        return torch.tensor(v, dtype=dtype)
    key = (tv, v, dtype)
    t = _SCALARS.get(key)
    if t is None:
        if len(_SCALARS) >= _SCALARS_MAX:
            _SCALARS.clear()
        t = _SCALARS[key] = torch.tensor(v, dtype=dtype)
    return t


def _rewrap_scalars(op, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
    """The boxed fallback hands wrapped-number tensors (``x + 2``'s 2) over as Python scalars: turn them back
    into 0-dim CPU tensors (float -> default dtype, as wrapped numbers promote) where the schema wants a Tensor."""
    pos = _TENSOR_ARGS.get(op)
    if pos is None:
        pos = _TENSOR_ARGS[op] = tuple((i, a.name) for i, a in enumerate(op._schema.arguments)
                                       if str(a.type) == "Tensor")
    if not pos:
        return args, kwargs
    fix = None
    zero_dim = None    # the first tensor argument when every tensor argument is 0-dim, else False
    for i, n in pos:
        if i < len(args):
            v = args[i]
        elif n in kwargs:
            v = kwargs[n]
        else:
            continue
        if isinstance(v, (bool, int, float, complex)):
            if zero_dim is None:
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                zero_dim = tensors[0] if tensors and all(a.dim() == 0 for a in tensors) else False
            if zero_dim is not False:
                # a 0-dim tensor would promote against the 0-dim tensor arguments as their equal (0-d bf16 + 1.0
                # would give float32): it gets the dtype a wrapped number leads to (the value is cast to it, as
                # the promoted operation casts it)
                t = torch.tensor(v, dtype=torch.result_type(zero_dim, v))
            else:
                t = _scalar_tensor(v, op, i)
            if fix is None:
                fix = (list(args), dict(kwargs))
            if i < len(args):
                fix[0][i] = t
            else:
                fix[1][n] = t
    return (tuple(fix[0]), fix[1]) if fix is not None else (args, kwargs)


def fallback(op, *args, **kwargs):
    """Boxed PrivateUse1 fallback: run aten ``op`` on neuron tensors (see the module docstring)."""
    return run_op(op, args, kwargs)


def run_op(op, args: tuple, kwargs: dict):
    """Run an aten OpOverload whose tensor arguments live on a neuron device, with that device current (its
    programs are timed on that device's core, its results land there), as a CUDA kernel runs under a device
    guard."""
    if windows.active():    # adaptive eager: the common call is queued by one pass over its arguments
        r = _record_plain(op, args, kwargs)
        if r is not windows.GENERAL:
            return r
    index = _op_device(args, kwargs)
    if index == current_index():
        return _run_op(op, args, kwargs)
    with on_device(index):
        return _run_op(op, args, kwargs)


def run_op_general(op, args: tuple, kwargs: dict):
    """:func:`run_op` past its adaptive eager shortcut (a caller that tried :func:`_record_plain` itself and got
    :data:`tn.device.windows.GENERAL`): the checked general path, which still queues the op in adaptive mode when
    it can, on the op's device."""
    index = _op_device(args, kwargs)
    if index == current_index():
        return _run_op(op, args, kwargs)
    with on_device(index):
        return _run_op(op, args, kwargs)


#: id(op) -> ``(op, name, has out= arguments, positions of its Tensor arguments)`` for ops :func:`_record_plain`
#: may queue, ``(op, None, ...)`` for the others (foreach, view and indexing ops with host indices: the general
#: path sorts them). Keyed by id: an OpOverload hashes in Python.
_PLAIN: Dict[int, Tuple[Any, Any, bool, tuple]] = {}
_NUMBERS = (float, int, bool, complex)


def _plain_info(op) -> Tuple[Any, Any, bool, tuple]:
    name = op_name(op)
    if name.startswith("aten::_foreach_") or name in _CPU_INDEX_OPS or _is_view_op(op):
        name = None
    info = _PLAIN[id(op)] = (op, name, _has_out_args(op), tuple((i, a.name) for i, a in enumerate(
        op._schema.arguments) if str(a.type) == "Tensor"))
    return info


def _plain_args(op, args: tuple, kwargs: dict, pos: tuple) -> Tuple[tuple, dict]:
    """:func:`_rewrap_scalars`, skipped when no Tensor argument (positions ``pos``) is a Python number (the common
    call; ``x * 0.5`` is not)."""
    n = len(args)
    for i, k in pos:
        if type(args[i] if i < n else kwargs.get(k)) in _NUMBERS:
            return _rewrap_scalars(op, args, kwargs)
    return args, kwargs


def record_functional(op, name: str, args: tuple, kwargs: dict):
    """Queue functional ``op`` (a kernel of :mod:`tn.device.fastpath`) into the open adaptive eager window,
    counted as ``name``; ``NotImplemented`` when it is not queued (the caller runs torch's composite kernel:
    ``empty`` + ``out=``)."""
    info = _PLAIN.get(id(op))
    if info is None or info[0] is not op:
        info = _plain_info(op)
    if info[1] is None:
        return NotImplemented
    args, kwargs = _plain_args(op, args, kwargs, info[3])
    flat, spec = flatten_args(args, kwargs)
    r = windows.record_plain(op, name, flat, spec, exact=True)
    return NotImplemented if r is windows.GENERAL else r


def _record_plain(op, args: tuple, kwargs: dict):
    """Queue ``op`` into the open adaptive eager window when the call is the common one (see
    :func:`tn.device.windows.record_plain`); :data:`tn.device.windows.GENERAL` leaves it to :func:`_run_op`."""
    info = _PLAIN.get(id(op))
    if info is None or info[0] is not op:
        info = _plain_info(op)
    _, name, has_out, pos = info
    if name is None:
        return windows.GENERAL
    if has_out:     # an empty out= tensor is sized first (the general path)
        for v in kwargs.values():
            if type(v) is torch.Tensor and not v.numel():
                return windows.GENERAL
    args, kwargs = _plain_args(op, args, kwargs, pos)
    flat, spec = flatten_args(args, kwargs)
    r = windows.record_plain(op, name, flat, spec)
    if r is NotImplemented:   # the window declined the op (and flushed what it depends on): it runs now
        index = _op_device(args, kwargs)
        if index == current_index():
            return _run_op(op, args, kwargs, queue=False)
        with on_device(index):
            return _run_op(op, args, kwargs, queue=False)
    return r


def _run_op(op, args: tuple, kwargs: dict, queue: bool = True):
    name = op_name(op)
    args, kwargs = _rewrap_scalars(op, args, kwargs)
    if name in _CPU_INDEX_OPS:
        args = _indices_to_device(args)
    flat, spec = flatten_args(args, kwargs)
    bits = _check_devices(name, flat)
    if name.startswith("aten::_foreach_"):
        return _run_foreach(op, name, args, kwargs)
    if _is_view_op(op):
        tracking.count(name)
        return _run_view(op, flat, spec)
    if bits:
        flat = _resolve_math_bits(op, name, flat, spec)
    if _has_out_args(op):   # out= overloads, whatever their name (kthvalue.values, max.dim_max ...)
        _presize_empty_outs(op, flat, spec)
    if queue and windows.active():    # adaptive eager: queue the op into the open window (tn.device.windows)
        r = windows.record(op, name, flat, spec)
        if r is not NotImplemented:
            return r
    if _SEEDED in op.tags:
        tracking.count(name)
        tracking.count_fallback(name, "random op: numbers drawn from torch's CPU generator on the host")
        return _run_host(op, flat, spec)
    entry = _entry(op, name, flat, spec)
    tracking.count(name)
    if entry.exe is None:
        tracking.count_fallback(name, entry.reason)
        return _run_host(op, flat, spec)
    if entry.host_ops:
        tracking.count_fallback(name, f"part of its program runs on the host: {entry.reason}", profile=False)
    return _run_program(op, entry, flat, spec)


def _entry(op, name: str, flat: list, spec, build=None, quiet: bool = False) -> _Entry:
    """The cached :class:`_Entry` of ``op`` for this signature, compiled on a miss."""
    # the structure (kwarg names, list lengths) belongs to the key: the boxed fallback passes only non-default
    # keyword arguments, so bucketize(x, b, out_int32=True) and bucketize(x, b, right=True) have the same leaves
    key = (op, spec, tuple(_leaf_key(a) for a in flat))
    entry = _CACHE.get(key)
    if entry is None:
        _STATS["misses"] += 1
        entry = _compile(op, name, flat, spec, build, quiet)
        _CACHE[key] = entry
        if len(_CACHE) > _CACHE_MAX:
            _CACHE.popitem(last=False)
    else:
        _STATS["hits"] += 1
        _CACHE.move_to_end(key)
    return entry


def run_fused(op, args: tuple, kwargs: dict, build=None):
    """Run a composite aten op (e.g. ``scaled_dot_product_attention``) as *one* device program.

    For ops that would otherwise reach the device as their decomposition, op by
    op. The caller guarantees the call is deterministic (torch may tag the op
    random for arguments not used here, e.g. ``dropout_p > 0``). ``build``
    (optional) is a direct IR builder ``build(metas, flat, spec) -> Traced | None``
    that skips the tracer; None falls back to tracing ``op``. Returns
    ``NotImplemented`` when the op cannot be compiled (the caller then runs the
    decomposition), never a host fallback of the whole op.
    """
    index = _op_device(args, kwargs)
    if index == current_index():
        return _run_fused(op, args, kwargs, build)
    with on_device(index):
        return _run_fused(op, args, kwargs, build)


def _run_fused(op, args: tuple, kwargs: dict, build=None):
    name = op_name(op)
    flat, spec = flatten_args(args, kwargs)
    _check_devices(name, flat)
    if windows.active():    # adaptive eager: the composite op is one op of the open window
        r = windows.record(op, name, flat, spec, deterministic=True)
        if r is not NotImplemented:
            return r
    entry = _entry(op, name, flat, spec, build, quiet=True)
    if entry.exe is None:
        return NotImplemented
    tracking.count(name)
    if entry.host_ops:
        tracking.count_fallback(name, f"part of its program runs on the host: {entry.reason}", profile=False)
    return _run_program(op, entry, flat, spec)


def _compile(op, name: str, flat: list, spec, build=None, quiet: bool = False) -> _Entry:
    from .. import lower  # lazy: the compiler loads on the first op (import tn does not pay for it)

    t0 = time.perf_counter()
    tensor_pos = tuple(i for i, a in enumerate(flat) if isinstance(a, torch.Tensor))
    metas = [torch.empty(flat[i].shape, dtype=flat[i].dtype, device="meta") for i in tensor_pos]

    functional, out_names = _functional_of(op)
    one_op = _one_op(op, flat, spec, tensor_pos)

    shapes = ", ".join(f"{flat[i].dtype}{list(flat[i].shape)}" for i in tensor_pos)
    try:
        traced = build(metas, flat, spec) if build is not None else _direct_ir(op, functional, out_names, flat, spec,
                                                                                  tensor_pos, metas)
        if traced is None:
            traced = trace_flat(one_op, metas)
        ir = optimize(traced.ir)
    except Exception as e:  # any op tracing cannot express runs on the host
        reason = f"it cannot be traced ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        if name.startswith("aten::_fused_"):
            reason += ("; fused optimizer kernels (fused=True) have no NeuronCore lowering: use foreach=True or "
                       "leave foreach/fused unset, whose per-tensor ops run as device programs")
        if strict() and not quiet:
            raise UnsupportedOpError(f"{name} on neuron tensors ({shapes}) cannot run on the NeuronCore: {reason}. "
                                     f"Strict mode is on (TN_STRICT=1); unset it to run this op on the host") from e
        _STATS["compile_s"] += time.perf_counter() - t0
        return _Entry(reason=reason, tensor_pos=tensor_pos)
    try:
        exe = lower.compile_ir(ir)   # strict mode: raises UnsupportedOpError for equations without a lowering
    except UnsupportedOpError as e:
        if not quiet:
            raise
        _STATS["compile_s"] += time.perf_counter() - t0
        return _Entry(reason=str(e), tensor_pos=tensor_pos)
    host = dict(exe.stats.get("host_ops", {}))
    reasons = exe.stats.get("host_reasons", {})
    _STATS["compile_s"] += time.perf_counter() - t0
    return _Entry(exe=exe, out_tree=traced.out_tree, out_leaves=traced.out_leaves, mutations=ir.mutations,
                  reason="; ".join(f"{k}: {v}" for k, v in reasons.items()) or None, host_ops=host,
                  tensor_pos=tensor_pos)


def _one_op(op, flat: list, spec, tensor_pos: tuple):
    """The function of the tensor arguments that :func:`_compile` traces: ``op`` with the other arguments fixed
    (an ``out=`` op as its functional form plus a copy into the out tensors)."""
    functional, out_names = _functional_of(op)

    def one_op(*ts):
        leaves = list(flat)
        for p, t in zip(tensor_pos, ts):
            leaves[p] = t
        a, k = unflatten_args(leaves, spec)
        if functional is None:
            return op(*a, **k)
        outs = [k.pop(n) for n in out_names]
        r = functional(*a, **k)
        rs = list(r) if isinstance(r, (tuple, list)) else [r]
        for o, v in zip(outs, rs):
            o.copy_(v)
        return outs[0] if len(outs) == 1 else tuple(outs)

    return one_op


_DIRECT_OK: Dict[Any, bool] = {}
_LEAF_SPEC = tree_flatten(0)[1]


def _direct_ir(op, functional, out_names: List[str], flat: list, spec, tensor_pos: tuple, metas: list):
    """The IR of a one-op program whose aten op maps 1:1 to a core op, built without the tracer (or None).

    Writes exactly what :func:`tn.trace.trace_flat` records for such an op (the
    tests compare the two): one equation of the core op (its inputs and
    attributes from the op table's converter, its result's shape and dtype from
    torch's meta kernel, as the tracer's ``meta_call``), and for an ``out=``
    overload with one out tensor of the result's shape, the result (cast to the
    out tensor's dtype) written back into it. Anything else (converters that
    decompose, views, in-place ops, several results, unusual arguments) returns
    None and is traced. Saves the tracer's tensor wrappers, dispatch mode and
    pytree work: about half of a simple op's trace time.
    """
    try:
        return _direct_ir_or_none(op, functional, out_names, flat, spec, tensor_pos, metas)
    except Exception:   # whatever went wrong, the tracer decides (and words the error)
        return None


def _direct_ir_or_none(op, functional, out_names: List[str], flat: list, spec, tensor_pos: tuple, metas: list):
    func = op if functional is None else functional
    if functional is not None and len(out_names) != 1:
        return None
    ok = _DIRECT_OK.get(func)
    if ok is None:
        ok = _DIRECT_OK[func] = (func in _ops.FROM_ATEN and _trace.records_as_core_op(func)
                                 and not torch._C._dispatch_has_kernel_for_dispatch_key(
                                     func.name(), "CompositeImplicitAutograd"))
    if not ok:
        return None
    leaves = list(flat)
    for p, m in zip(tensor_pos, metas):
        leaves[p] = m
    args, kwargs = unflatten_args(leaves, spec)
    out_meta = None
    if functional is not None:
        out_meta = kwargs.pop(out_names[0], None)
        if not isinstance(out_meta, torch.Tensor):
            return None
    core, conv = _ops.FROM_ATEN[func]
    r = conv(*args, **kwargs)
    if r is None or r is _ops.IDENTITY:
        return None
    inputs, attrs = r
    res = func(*args, **_trace.meta_kwargs(kwargs, func))
    if type(res) is not torch.Tensor:
        return None
    in_vars = [Var(tuple(m.shape), m.dtype) for m in metas]
    var_of = {id(m): v for m, v in zip(metas, in_vars)}
    atoms = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            v = var_of.get(id(x))
            if v is None:
                return None   # a converter that made a new tensor: let the tracer handle it
            atoms.append(v)
        elif isinstance(x, (bool, int, float)):
            atoms.append(Literal(x))
        else:
            return None
    src = _trace.user_source()
    out = Var(tuple(res.shape), res.dtype)
    eqns = [Eqn(core, atoms, [out], attrs, src)]
    if out_meta is None:
        return _trace.Traced(IR(in_vars, eqns, [out]), _LEAF_SPEC, [0])
    if tuple(out_meta.shape) != tuple(res.shape):
        return None
    new = out
    if out_meta.dtype != res.dtype:
        new = Var(tuple(res.shape), out_meta.dtype)
        eqns.append(Eqn(_ops.OPS["convert"], [out], [new], {"dtype": out_meta.dtype}, src))
    k = next(i for i, m in enumerate(metas) if m is out_meta)
    return _trace.Traced(IR(in_vars, eqns, [new, new], mutations=[(k, 1)]), _LEAF_SPEC, [0])


_FUNCTIONAL: Dict[Any, Any] = {}
_HAS_OUT: Dict[Any, bool] = {}


def _has_out_args(op) -> bool:
    """Whether ``op`` has keyword-only arguments it writes into (``out=``, ``values=``/``indices=`` ...)."""
    hit = _HAS_OUT.get(op)
    if hit is None:
        hit = _HAS_OUT[op] = any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
                                 for a in op._schema.arguments)
    return hit


def _functional_of(op) -> Tuple[Any, List[str]]:
    """For an ``out=`` overload (``mm.out``, ``max.dim_max``...): the functional overload with the same
    non-out arguments and the out argument names; ``(None, [])`` for other ops."""
    hit = _FUNCTIONAL.get(op)
    if hit is not None:
        return hit
    schema = op._schema
    outs = [a.name for a in schema.arguments if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]
    res: Tuple[Any, List[str]] = (None, [])
    if outs:
        ins = [(a.name, str(a.type)) for a in schema.arguments if a.name not in outs]
        packet = getattr(torch.ops.aten, schema.name.split("::")[-1], None)
        for ov in (packet.overloads() if packet is not None else ()):
            cand = getattr(packet, ov)
            cs = cand._schema
            if any(r.alias_info is not None for r in cs.returns) or len(cs.returns) != len(outs):
                continue
            if [(a.name, str(a.type)) for a in cs.arguments] == ins:
                res = (cand, outs)
                break
    _FUNCTIONAL[op] = res
    return res


def to_device(r: torch.Tensor) -> torch.Tensor:
    """A new contiguous neuron tensor holding CPU tensor ``r``'s values."""
    out = new_tensor(tuple(r.shape), contiguous_strides(r.shape), r.dtype)
    if r.numel():
        cpu_alias(out).copy_(r)
    return out


def _run_program(op, entry: _Entry, flat: list, spec):
    aliases: List[torch.Tensor] = []
    ins: List[torch.Tensor] = []
    for i in entry.tensor_pos:
        t = flat[i]
        a = cpu_alias(t) if t.device.type == "neuron" else t
        aliases.append(a)
        ins.append(a if a.is_contiguous() else a.contiguous())
    outs = entry.exe(ins)
    prof = entry.exe.last_profile
    _LAST[0] = prof
    if prof is not None:
        tracking.add_device_ns(prof.total_ns)
    written = {}
    for i, j in entry.mutations:
        aliases[i].copy_(outs[j])
        written[j] = flat[entry.tensor_pos[i]]
    # results: tensors an in-place/out= op returns are its (device) arguments
    schema = op._schema
    ret_alias = _returned_args(op)
    leaves = []
    for leaf in entry.out_leaves:
        if isinstance(leaf, int):
            leaves.append(written.get(leaf) if leaf in written else to_device(outs[leaf]))
        else:
            leaves.append(leaf.value)
    result = leaves[0] if entry.single else tree_unflatten(leaves, entry.out_tree)
    if ret_alias:
        # make sure in-place/out= results are the very argument objects
        args, kwargs = unflatten_args(flat, spec)
        bound = _bind_args(schema, args, kwargs)
        if len(schema.returns) == 1:
            return bound.get(ret_alias.get(0), result)
        result = list(result) if isinstance(result, (tuple, list)) else [result]
        for r_i, an in ret_alias.items():
            if an in bound:
                result[r_i] = bound[an]
        return tuple(result)
    return result


_RET_ALIAS: Dict[Any, Dict[int, str]] = {}


def _returned_args(op) -> Dict[int, str]:
    """``{return index: argument name}`` for the results of ``op`` that are its (written) arguments."""
    hit = _RET_ALIAS.get(op)
    if hit is None:
        hit = {}
        schema = op._schema
        for r_i, r in enumerate(schema.returns):
            if r.alias_info is not None and r.alias_info.is_write:
                for a in schema.arguments:
                    if a.alias_info is not None and a.alias_info.before_set & r.alias_info.before_set:
                        hit[r_i] = a.name
        _RET_ALIAS[op] = hit
    return hit


def _bind_args(schema, args: tuple, kwargs: dict) -> Dict[str, Any]:
    out = {}
    for i, a in enumerate(schema.arguments):
        if i < len(args) and not a.kwarg_only:
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
    return out


def _run_host(op, flat: list, spec):
    """Run ``op`` with torch's CPU kernels on aliases of the device memory; fresh results are copied to the device.

    ``out=`` tensors on the device are replaced by fresh CPU tensors for the call and written back after it
    (resized to what the kernel made): a CPU alias cannot be resized, and some kernels size an out tensor
    differently from their meta kernel before narrowing it (``linalg.lstsq``)."""
    dev_outs = {}
    if _has_out_args(op):
        args, kwargs = unflatten_args(flat, spec)
        for a in op._schema.arguments:
            v = kwargs.get(a.name)
            if (a.kwarg_only and a.alias_info is not None and a.alias_info.is_write and isinstance(v, torch.Tensor)
                    and v.device.type == "neuron"):
                host = torch.empty(0, dtype=v.dtype)
                dev_outs[id(host)] = v
                kwargs[a.name] = host
        if dev_outs:
            flat, spec = flatten_args(args, kwargs)
    back = {}
    leaves = []
    for a in flat:
        if isinstance(a, torch.Tensor) and a.device.type == "neuron":
            c = cpu_alias(a)
            back[id(c)] = a
            leaves.append(c)
        elif isinstance(a, torch.device) and a.type == "neuron":
            leaves.append(_CPU)   # a factory op (_efficientzerotensor ...) made on the host, its result copied over
        else:
            leaves.append(a)
    args, kwargs = unflatten_args(leaves, spec)
    r = op(*args, **kwargs)
    if dev_outs:
        for a in flat:
            d = dev_outs.get(id(a))
            if d is not None:
                if d.shape != a.shape:
                    resize_tensor(d, a.shape)
                if a.numel():
                    cpu_alias(d).copy_(a)
                back[id(a)] = d

    def conv(x):
        if isinstance(x, torch.Tensor):
            d = back.get(id(x))
            return d if d is not None else to_device(x)
        return x

    if isinstance(r, (tuple, list)):
        return type(r)(conv(x) if not isinstance(x, (tuple, list)) else type(x)(conv(y) for y in x) for x in r)
    return conv(r)


def _presize_empty_outs(op, flat: list, spec) -> None:
    """Give empty ``out=`` tensors their result shape before tracing (the trace cannot resize a tensor)."""
    args, kwargs = unflatten_args(flat, spec)
    if any(isinstance(v, torch.Tensor) and v.numel() == 0 for v in kwargs.values()):
        _presize_outs(op, flat, spec)


def _presize_outs(op, flat: list, spec) -> None:
    """Resize the device ``out=`` tensors of ``op`` to the shapes its meta kernel gives (CPU aliases cannot grow)."""
    outs = [a.name for a in op._schema.arguments if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]
    if not outs:
        return
    args, kwargs = unflatten_args(flat, spec)
    if not any(isinstance(kwargs.get(n), torch.Tensor) for n in outs):
        return

    # the shapes the meta kernel gives, kept per signature (arange's meta kernel is Python: ~0.4 ms a call, and HF's
    # generate sizes an empty out= tensor with it at every decode step)
    key = (op, spec, tuple(_leaf_key(a) if not (isinstance(a, torch.Tensor) and a.is_cpu and a.dim() == 0)
                           else ("v", a.dtype, a.item()) for a in flat))
    shapes = _PRESIZED.get(key, _PRESIZED)
    if shapes is _PRESIZED:
        def meta(x):
            if isinstance(x, torch.Tensor):
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
            return x

        margs, mkwargs = unflatten_args([meta(a) for a in flat], spec)
        try:
            op(*margs, **mkwargs)
            shapes = tuple((n, tuple(m.shape)) for n in outs if isinstance(m := mkwargs.get(n), torch.Tensor))
        except Exception:
            shapes = None   # the CPU kernel reports the problem itself
        if len(_PRESIZED) > 4096:
            _PRESIZED.clear()
        _PRESIZED[key] = shapes
    for n, shape in shapes or ():
        d = kwargs.get(n)
        if isinstance(d, torch.Tensor) and tuple(d.shape) != shape:
            resize_tensor(d, shape)


_PRESIZED: Dict[Any, Any] = {}


def _run_view(op, flat: list, spec):
    """A view op: computed on a CPU alias, returned as neuron views of the same storage."""
    base = None
    leaves = []
    for a in flat:
        if isinstance(a, torch.Tensor) and a.device.type == "neuron":
            if base is None:
                base = a
            leaves.append(cpu_alias(a, sync=False))   # metadata only: queued ops need not run
        else:
            leaves.append(a)
    args, kwargs = unflatten_args(leaves, spec)
    r = op(*args, **kwargs)
    as_strided = torch.ops.aten.as_strided.default

    def conv(x):
        if isinstance(x, torch.Tensor):
            if x.dtype != base.dtype:
                # a view of another dtype (view_as_real, .real/.imag, view(dtype)): a neuron tensor of that dtype
                # set on the same storage, with the view's size/stride/offset (in its own elements, as on the CPU
                # alias, which starts where the storage does). view.dtype on the base would refuse 0-d tensors
                # and last strides other than 1, which the view itself need not have.
                t = _create_empty([0], x.dtype)
                _set_storage.redispatch(_CPU_KEYS, t, base.untyped_storage(), x.storage_offset(), x.shape,
                                        x.stride())
                return t
            return as_strided(base, x.shape, x.stride(), x.storage_offset())
        return x

    if isinstance(r, (tuple, list)):
        return type(r)(conv(x) for x in r)
    return conv(r)


def _run_foreach(op, name: str, args: tuple, kwargs: dict):
    """``_foreach_<op>[_]``: one device op per list element (list arguments and scalar lists indexed together)."""
    base = name[len("aten::_foreach_"):].split(".")[0]
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        tracking.count(name)
        tracking.count_fallback(name, "no per-tensor aten op to split it into")
        flat, spec = flatten_args(args, kwargs)
        return _run_host(op, flat, spec)
    n = None
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple)):
            n = len(a)
            break
    if n is None:
        raise ArgumentValueError(f"{name}: no list argument found")

    def pick(a, k):
        return a[k] if isinstance(a, (list, tuple)) else a

    outs = []
    for k in range(n):
        r = packet(*[pick(a, k) for a in args], **{kk: pick(v, k) for kk, v in kwargs.items()})
        outs.append(r)
    if base.endswith("_"):
        return None
    return outs


windows.install_op_runner(run_op)
