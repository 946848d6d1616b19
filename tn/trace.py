# The tracer: runs a PyTorch function on shape-only tensors and records the aten ops it dispatches as a pure tn IR.
"""Tracing PyTorch functions into :class:`tn.ir.IR`.

:func:`trace_flat` calls ``fn`` on :class:`TracerTensor` s: wrapper tensors
that carry a meta tensor (shape, dtype, strides, aliasing) and nothing else.
A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op
below autograd (so ``torch.autograd.grad`` inside ``fn`` is recorded too),
computes shapes with torch's meta kernels and records an equation of the op
table (:mod:`tn.ops`). No real computation happens while tracing.

Per aten op, in this order:

1. data-dependent ops (``.item()``, ``bool(t)``, ``nonzero`` ...) raise
   :class:`tn.TracingError` naming the user's file and line;
2. views (``view``, ``permute``, ``slice``, ``select``, ``expand`` ...)
   become functional shape ops, remembered as a chain from their base;
3. in-place ops (``add_``, ``copy_``, ``x[:, 0] += 1`` ...) are
   functionalised: the new value is computed out of place and written into
   the base through the inverse of the view chain (``slice_scatter`` ...);
   an input whose value changed is returned as an extra output listed in
   :attr:`IR.mutations`; ``out=`` overloads (``torch.mm(a, b, out=c)``)
   are their functional form plus a ``copy_`` into each out tensor (an out
   tensor the op would resize is an :class:`tn.UnsupportedOpError`);
4. ops in :data:`tn.ops.FROM_ATEN` are recorded as core ops (output shapes
   from torch's meta kernels, cached by the arguments' metadata, so a warm
   trace runs almost none);
5. everything else is decomposed (:data:`tn.ops.DECOMPOSITIONS`, then
   ``torch._decomp.decomposition_table``, then the op's own
   CompositeImplicit decomposition) or raises :class:`tn.UnsupportedOpError`
   naming the aten op and its input shapes.

Tensors that ``fn`` creates without traced inputs (``torch.ones(T, T)``,
``torch.arange``) are traced factory ops; real tensors it captures
(``torch.tensor([...])``, globals) become :attr:`IR.consts`.

Limits (each a clear :class:`tn.TnError`, never a silent difference):
shape changes of an *input* in place (``x.unsqueeze_(0)``), writes into
tensors captured from outside ``fn`` (they cannot be written back), writes
into broadcast views, bit reinterpretation (``view(dtype)``; the complex views
``view_as_real``/``view_as_complex`` are ops of :mod:`tn.ops.fft`),
and ops whose output shape depends on values (``x[mask]``, ``nonzero``).
``p.grad`` set by ``loss.backward()`` inside ``fn`` is usable inside ``fn``
(e.g. by an in-place SGD step, which is written back) but is not itself an
output.

The first trace in a process would cost ~1.2 s (torch's meta kernels import
sympy and torch._dynamo on first use); ``import tn`` ends by calling
:func:`warm_up`, which pays it up front (see there why not in a thread).
"""
from __future__ import annotations

import linecache
import os
import sys
import sysconfig
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.compiler as tc
import torch.utils._pytree as pytree
from torch._decomp import decomposition_table
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from . import config
from . import ops as _ops
from .errors import TracingError, UnsupportedOpError
from .ir import CONSTANT_TYPES, IR, Eqn, Literal, Var, aval_str
from .shapes import contiguous_strides

__all__ = ["trace_flat", "Traced", "Static", "TracerTensor", "user_source"]

aten = torch.ops.aten
Tensor = torch.Tensor
OPS = _ops.OPS


# --------------------------------------------------------------------------- results


class Static:
    """A non-tensor leaf of a traced function's result, returned as-is on every call."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Static) and type(other.value) is type(self.value) and other.value == self.value

    def __hash__(self) -> int:
        try:
            return hash((type(self.value), self.value))
        except TypeError:
            return id(self.value)

    def __repr__(self) -> str:
        return f"Static({self.value!r})"


class Traced:
    """The result of :func:`trace_flat`.

    Attributes:
        ir: the program; ``ir.inputs[i]`` stands for ``flat_tensors[i]``.
        out_tree: the ``torch.utils._pytree`` spec of ``fn``'s result.
        out_leaves: per leaf of the result, an ``int k`` (the leaf is
            ``ir.outputs[k]``) or a :class:`Static` holding a non-tensor leaf.
    """

    __slots__ = ("ir", "out_tree", "out_leaves")

    def __init__(self, ir: IR, out_tree: Any, out_leaves: List[Any]):
        self.ir = ir
        self.out_tree = out_tree
        self.out_leaves = out_leaves

    def __repr__(self) -> str:
        return f"Traced({self.ir!r}, leaves={self.out_leaves})"


# --------------------------------------------------------------------------- user frames

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_TN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
_internal_code: Dict[Any, bool] = {}
#: Folders of packages whose frames are tn's, not the user's (tn/ itself; doors installed from other folders,
#: such as ``adaptive/``, add theirs with :func:`register_internal_dir`).
_INTERNAL_DIRS = [_TORCH_DIR, _TN_DIR]


def register_internal_dir(path: str) -> None:
    """Count frames of files under ``path`` as tn's own (errors then name the user's line above them)."""
    d = os.path.abspath(path) + os.sep
    if d not in _INTERNAL_DIRS:
        _INTERNAL_DIRS.append(d)
        _internal_code.clear()


def _is_internal(code: Any) -> bool:
    r = _internal_code.get(code)
    if r is None:
        fn = code.co_filename
        if not fn.startswith("<"):
            fn = os.path.abspath(fn)      # also normalises: a "../" on sys.path gives tn's files such names
        r = (fn.startswith(tuple(_INTERNAL_DIRS)) or fn.startswith("<frozen") or fn.startswith("<string>-torch")
             or (fn.startswith(_STDLIB_DIR) and "-packages" not in fn))
        _internal_code[code] = r
    return r


def is_internal_code(code: Any) -> bool:
    """True when a code object belongs to torch, tn (or a registered internal folder) or the standard library:
    its frames are never "the user's line" an error names."""
    return _is_internal(code)


def internal_dirs_generation() -> int:
    """A number that changes whenever :func:`register_internal_dir` adds a folder (callers caching
    :func:`is_internal_code` verdicts drop their cache when it changes)."""
    return len(_INTERNAL_DIRS)


def user_frame() -> Optional[Any]:
    """The innermost Python frame outside torch, tn and the standard library (``None`` if none)."""
    f = sys._getframe(1)
    while f is not None:
        if not _is_internal(f.f_code):
            return f
        f = f.f_back
    return None


_SOURCE_HINT = threading.local()


class source_hint:
    """Context manager: equations traced inside name ``src`` (``"file.py:12"``) as their user source.

    For code that replays ops recorded earlier (the device's adaptive eager windows), so an equation
    names the line that issued the op, not the line that replays it.
    """

    __slots__ = ("src", "saved")

    def __init__(self, src: Optional[str]):
        self.src = src
        self.saved = None

    def __enter__(self) -> None:
        self.saved = getattr(_SOURCE_HINT, "src", None)
        _SOURCE_HINT.src = self.src

    def __exit__(self, *exc: Any) -> None:
        _SOURCE_HINT.src = self.saved


def user_source() -> Optional[str]:
    """``file:line`` of the user code running the current op (the hint set by :func:`source_hint` first), or None."""
    hint = getattr(_SOURCE_HINT, "src", None)
    if hint is not None:
        return hint
    f = user_frame()
    if f is None:
        return None
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"


def _where() -> str:
    """``file:line: `code``` of the user's innermost frame, for error messages."""
    f = user_frame()
    if f is None:
        return "<unknown location>"

    line = linecache.getline(f.f_code.co_filename, f.f_lineno).strip()
    where = f"{f.f_code.co_filename}:{f.f_lineno}"
    return f"{where}: `{line}`" if line else where


def _where_in_traceback(e: BaseException) -> str:
    """``file:line: `code``` of the innermost user frame in ``e``'s traceback."""
    best = None
    tb = e.__traceback__
    while tb is not None:
        if not _is_internal(tb.tb_frame.f_code):
            best = tb
        tb = tb.tb_next
    if best is None:
        return "<unknown location>"
    fn, line = best.tb_frame.f_code.co_filename, best.tb_lineno
    code = linecache.getline(fn, line).strip()
    return f"{fn}:{line}: `{code}`" if code else f"{fn}:{line}"


_ADVICE = ("Make the value static (tn.jit(..., static_argnums=/static_argnames=) or a Python "
           "constant), run this code eagerly outside tn.jit, or use tn.adaptive to let tn "
           "choose per region; without fullgraph=True, tn.jit on the neuron backend runs such a "
           "function split at its value reads, as device windows.")


# --------------------------------------------------------------------------- traced tensors


class _Spec:
    """Metadata of a tensor as a meta kernel computed it: shape, strides, storage offset, dtype."""

    __slots__ = ("shape", "strides", "offset", "dtype")

    def __init__(self, shape: Tuple[int, ...], strides: Tuple[int, ...], offset: int, dtype: torch.dtype):
        self.shape = shape
        self.strides = strides
        self.offset = offset
        self.dtype = dtype

    @staticmethod
    def of(t: Tensor) -> "_Spec":
        """The spec of a (meta) tensor."""
        return _Spec(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)

    @staticmethod
    def contiguous(shape: Sequence[int], dtype: torch.dtype) -> "_Spec":
        """A row-major spec of ``shape``."""
        shape = tuple(int(d) for d in shape)
        return _Spec(shape, contiguous_strides(shape), 0, dtype)

    def stride(self) -> Tuple[int, ...]:
        """Strides (like ``Tensor.stride()``)."""
        return self.strides

    def storage_offset(self) -> int:
        """Storage offset (like ``Tensor.storage_offset()``)."""
        return self.offset

    def dim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    def is_row_major(self) -> bool:
        """Whether the layout is contiguous row-major with offset 0 (size-1 dims ignored)."""
        if self.offset:
            return False
        expected = 1
        for d, st in zip(reversed(self.shape), reversed(self.strides)):
            if d != 1 and st != expected:
                return False
            expected *= d
        return True


class _Store:
    """The current value (a Var) of a base tensor and every view of it."""

    __slots__ = ("var", "version", "spec", "input_index", "captured")

    def __init__(self, var: Var, spec: _Spec, input_index: Optional[int] = None):
        self.var = var
        self.version = 0
        self.spec = spec
        self.input_index = input_index
        self.captured = False  # a real tensor from outside the traced function (not writable)


class TracerTensor(Tensor):
    """A tensor seen while tracing: shape, dtype and strides only, plus its IR value.

    Holds the store of its base (``_tn_store``), the chain of view steps from
    that base (``_tn_chain``) and, made on demand, a meta tensor with the same
    metadata (``_tn_meta``) for torch's meta kernels. Using one after its
    trace ended raises :class:`tn.TracingError`.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, spec: _Spec, device: torch.device, store: _Store, chain: tuple, var: Var,
                requires_grad: bool = False):
        t = Tensor._make_wrapper_subclass(cls, spec.shape, strides=spec.strides, storage_offset=spec.offset,
                                          dtype=spec.dtype, device=device, requires_grad=requires_grad)
        t._tn_meta = None
        t._tn_input = False
        t._tn_store = store
        t._tn_chain = chain
        t._tn_var = var
        t._tn_ver = store.version
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TracingError(
            f"{_where()}: a tensor from a finished tn trace was used in {func} (it has a shape but "
            f"no value). Do not keep tensors created inside a traced function (e.g. in globals "
            f"or module attributes); return them instead.")

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"TracerTensor({aval_str(self.shape, self.dtype)})"


def _make_meta(t: TracerTensor) -> Tensor:
    """A meta tensor with ``t``'s shape, strides, storage offset and dtype."""
    shape, stride, off = tuple(t.shape), t.stride(), t.storage_offset()
    if off == 0:
        m = torch.empty_strided(shape, stride, dtype=t.dtype, device="meta")
    else:
        extent = off + 1 + sum((d - 1) * st for d, st in zip(shape, stride) if d > 0)
        m = torch.empty((extent,), dtype=t.dtype, device="meta").as_strided(shape, stride, off)
    t._tn_meta = m
    return m


def _meta(a: Any) -> Any:
    if type(a) is TracerTensor:
        return a._tn_meta if a._tn_meta is not None else _make_meta(a)
    return a


def _metas(args: Sequence[Any]) -> List[Any]:
    out = []
    for a in args:
        if type(a) is TracerTensor:
            out.append(a._tn_meta if a._tn_meta is not None else _make_meta(a))
        elif type(a) in (list, tuple):
            out.append(type(a)(_meta(x) for x in a))
        else:
            out.append(a)
    return out


_HAS_DEVICE_ARG: Dict[Any, bool] = {}


def meta_kwargs(kwargs: Dict[str, Any], func: Any = None) -> Dict[str, Any]:
    """kwargs for running ``func`` on meta tensors: traced tensors become metas, any device becomes meta."""
    has_dev = _HAS_DEVICE_ARG.get(func) if func is not None else None
    if has_dev is None and func is not None:
        has_dev = any(a.name == "device" and a.kwarg_only for a in func._schema.arguments)
        _HAS_DEVICE_ARG[func] = has_dev
    if not kwargs and not has_dev:
        return kwargs
    out = {}
    for k, v in kwargs.items():
        if type(v) is TracerTensor:
            v = _meta(v)
        out[k] = v
    if has_dev or "device" in out:
        out["device"] = "meta"
    return out


class _NoKey(Exception):
    pass




def _key_part(a: Any) -> Any:
    ta = type(a)
    if ta is TracerTensor:
        return (tuple(a.shape), a.stride(), a.storage_offset(), a.dtype)
    if ta is list or ta is tuple:
        return tuple(_key_part(x) for x in a)
    if ta in CONSTANT_TYPES:
        return (ta, a)
    raise _NoKey


def _to_specs(out: Any) -> Any:
    if isinstance(out, Tensor):
        return _Spec.of(out)
    if isinstance(out, (list, tuple)):
        return tuple(_to_specs(o) for o in out)
    return out


#: (func, metadata of the arguments) -> specs of the results, filled by :func:`meta_call`.
_META_CACHE: Dict[Any, Any] = {}
_META_CACHE_MAX = 100_000


def meta_call(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """Run ``func``'s meta kernel on the traced arguments; returns the results as specs.

    Results depend only on the arguments' metadata, so they are cached: a warm
    trace runs almost no meta kernels. Tensor results become :class:`_Spec`,
    sequences become tuples, anything else is returned as is.
    """
    try:
        key = (func, _key_part(args), _key_part(tuple(kwargs.items())) if kwargs else None)
    except _NoKey:
        key = None
    if key is not None:
        hit = _META_CACHE.get(key)
        if hit is not None:
            return hit
    out = _to_specs(func(*_metas(args), **meta_kwargs(kwargs, func)))
    if key is not None and out is not None:
        if len(_META_CACHE) >= _META_CACHE_MAX:
            _META_CACHE.clear()
        _META_CACHE[key] = out
    return out


def _describe_inputs(args: Sequence[Any], kwargs: Dict[str, Any]) -> str:
    parts = []
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, Tensor):
            parts.append(aval_str(a.shape, a.dtype))
        elif isinstance(a, (list, tuple)) and any(isinstance(x, Tensor) for x in a):
            parts.append("[" + ", ".join(aval_str(x.shape, x.dtype) if isinstance(x, Tensor) else repr(x)
                                         for x in a) + "]")
        else:
            parts.append(repr(a))
    return ", ".join(parts)


# --------------------------------------------------------------------------- handler tables

_DATA_DEPENDENT = {
    aten._local_scalar_dense.default: "reads a traced tensor's value (.item(), bool(t), int(t), float(t), `if t:`)",
    aten.is_nonzero.default: "reads a traced tensor's value (bool(t), `if t:`)",
    aten.item.default: "reads a traced tensor's value (.item(), or a 0-d tensor used as a Python index)",
    torch.ops.prims.item.default: "reads a traced tensor's value (.item(), or a 0-d tensor used as a Python index)",
    aten.allclose.default: "compares traced tensors' values (torch.allclose)",
    aten.equal.default: "compares traced tensors' values (torch.equal)",
    aten.nonzero.default: "has an output shape that depends on tensor values (nonzero)",
    aten.masked_select.default: "has an output shape that depends on tensor values (masked_select)",
    aten._unique2.default: "has an output shape that depends on tensor values (unique)",
    aten._unique.default: "has an output shape that depends on tensor values (unique)",
    aten.unique_dim.default: "has an output shape that depends on tensor values (unique)",
    aten.unique_consecutive.default: "has an output shape that depends on tensor values (unique_consecutive)",
    aten.repeat_interleave.Tensor: "has an output shape that depends on tensor values (repeat_interleave)",
}

_METADATA_INPLACE = {"t_", "transpose_", "squeeze_", "unsqueeze_", "as_strided_", "resize_",
                     "resize_as_", "set_", "swapdims_", "swapaxes_", "detach_", "resize_as_sparse_"}

_HANDLERS: Dict[Any, Callable[..., Any]] = {}


def _decomposition_for(func: Any) -> Optional[Callable[..., Any]]:
    d = _ops.DECOMPOSITIONS.get(func)
    if d is None:
        d = _ops.DECOMPOSITIONS_BY_NAME.get(func.name())
    if d is not None:
        return d

    return decomposition_table.get(func)


_FUNCTIONAL: Dict[Any, Optional[Any]] = {}


def _functional_variant(func: Any) -> Optional[Any]:
    """The functional overload of the in-place overload ``func`` (``add_.Tensor`` -> ``add.Tensor``), or None;
    cached per overload (every traced in-place op asks)."""
    try:
        return _FUNCTIONAL[func]
    except KeyError:
        r = _FUNCTIONAL[func] = _find_functional_variant(func)
        return r


def _find_functional_variant(func: Any) -> Optional[Any]:
    name = func._schema.name.split("::")[-1]
    if name.startswith("__i") and name.endswith("__"):
        base = "__" + name[3:]
    elif name.endswith("_") and not name.endswith("__"):
        base = name[:-1]
    else:
        return None
    packet = getattr(aten, base, None)
    if packet is None:
        return None
    same = getattr(packet, func._overloadname, None)
    want = _arg_types(func)
    if same is not None and _arg_types(same) == want:
        return same
    # overload names differ between in-place and functional forms (pow_.Scalar is pow.Tensor_Scalar, while
    # pow.Scalar takes a Scalar base): pick the functional overload taking the same argument types
    for ov in packet.overloads():
        cand = getattr(packet, ov)
        if _arg_types(cand) == want and not _mutated_args(cand):
            return cand
    return same


def _arg_types(func: Any) -> Tuple[Tuple[str, str], ...]:
    """``(name, type)`` of the schema's arguments, alias annotations left out."""
    return tuple((a.name, str(a.type)) for a in func._schema.arguments)


_OUT_FORMS: Dict[Any, Tuple[Optional[Any], Tuple[str, ...]]] = {}


def _out_form(func: Any) -> Tuple[Optional[Any], Tuple[str, ...]]:
    """For an ``out=`` overload (``mm.out``, ``sum.IntList_out``, ``max.dim_max`` ...): the functional
    overload taking the same other arguments and the names of the out arguments; ``(None, ())`` otherwise."""
    hit = _OUT_FORMS.get(func)
    if hit is not None:
        return hit
    schema = func._schema
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    res: Tuple[Optional[Any], Tuple[str, ...]] = (None, ())
    if written and all(a.kwarg_only for a in written):
        outs = tuple(a.name for a in written)
        ins = [(a.name, str(a.type)) for a in schema.arguments if a.name not in outs]
        packet = getattr(aten, schema.name.split("::")[-1], None)
        for ov in (packet.overloads() if packet is not None else ()):
            cs = getattr(packet, ov)._schema
            if any(r.alias_info is not None for r in cs.returns) or len(cs.returns) != len(outs):
                continue
            if [(a.name, str(a.type)) for a in cs.arguments] == ins:
                res = (getattr(packet, ov), outs)
                break
    _OUT_FORMS[func] = res
    return res


def _is_view(func: Any) -> bool:
    rets = func._schema.returns
    if not rets:
        return False
    info = rets[0].alias_info
    return info is not None and not info.is_write


def _mutated_args(func: Any) -> List[int]:
    return [i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def _returns_tensors(func: Any) -> bool:
    for r in func._schema.returns:
        t = str(r.type)
        if "Tensor" in t:
            return True
    return False


def records_as_core_op(func: Any) -> bool:
    """True when the tracer records the aten overload ``func`` as one equation of a core op of tn's table
    (no decomposition, no view step): the device's eager path may then build that one-equation IR directly."""
    return _resolve(func) is _h_core


def can_replay(func: Any) -> bool:
    """False for aten overloads the tracer surely cannot record: results whose shape or use depends on tensor
    values (``.item()``, ``nonzero``, ...), and ops with neither a core op, a decomposition nor a composite
    kernel (e.g. fused optimizer kernels). The device's adaptive eager windows run those ops eagerly."""
    if func in _DATA_DEPENDENT:
        return False
    return not (_resolve(func) is _h_decompose and _decomposition_for(func) is None
                and not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"))


def _resolve(func: Any) -> Callable[..., Any]:
    """Pick the handler of an aten overload (cached per overload)."""
    h = _SPECIAL.get(func)
    if h is None:
        if func in _DATA_DEPENDENT:
            h = _h_data_dependent
        elif func in _ops.FROM_ATEN:
            h = _h_core
        elif func._schema.name.startswith("aten::_foreach_") and not _mutated_args(func):
            h = _h_foreach
        elif func not in _VIEW_STEPS and torch._C._dispatch_has_kernel_for_dispatch_key(
                func.name(), "CompositeImplicitAutograd"):
            h = _h_decompose  # e.g. aten.to, aten.reshape reached us from inside a decomposition
        elif func in _VIEW_STEPS or (_is_view(func) and not _mutated_args(func)):
            h = _h_view
        elif _is_custom_op(func):
            h = _h_custom
        elif _mutated_args(func):
            name = func._schema.name.split("::")[-1]
            if name in _METADATA_INPLACE:
                h = _h_metadata_inplace
            elif _functional_variant(func) is not None and _mutated_args(func) == [0]:
                h = _h_inplace
            elif _out_form(func)[0] is not None:
                h = _h_out
            else:
                h = _h_decompose
        elif not _returns_tensors(func):
            h = _h_meta_only
        else:
            h = _h_decompose
    _HANDLERS[func] = h
    return h


# --------------------------------------------------------------------------- the tracer


class _Tracer(TorchDispatchMode):
    """The dispatch mode that records one trace."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch would wrap __torch_dispatch__ in torch._dynamo.disable: that imports
        # dynamo (~1 s) on first use and adds overhead to every op. Tracing never
        # runs under torch.compile, so leave it unwrapped.
        return False

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.eqns: List[Eqn] = []
        self.consts: List[Tuple[Var, Tensor]] = []
        self._const_of: Dict[int, Tuple[Tensor, "TracerTensor"]] = {}
        self._depth = 0  # nesting of __torch_dispatch__ (decompositions re-enter it)
        self._src: Optional[str] = None  # user file:line of the current top-level op, found lazily

    # ---- values

    def var_of(self, t: TracerTensor) -> Var:
        """The current value of ``t`` (replaying its view chain if its base changed)."""
        st = t._tn_store
        if t._tn_ver == st.version:
            return t._tn_var
        v = st.var
        for step in t._tn_chain:
            v = self.apply_step(step, v)
        t._tn_var = v
        t._tn_ver = st.version
        return v

    def atom(self, x: Any) -> Any:
        """The IR input for ``x``: a traced tensor's current Var or a Literal for a Python scalar."""
        if type(x) is TracerTensor:
            return self.var_of(x)
        if isinstance(x, Tensor):
            return self.var_of(self.lift(x))
        if isinstance(x, (bool, int, float)):
            return Literal(x)
        if isinstance(x, complex):     # (Literals are real): a 0-d complex128 constant, typed as torch types the
            with _disable_current_modes():   # scalar (it does not widen complex64 tensors; conj(1j) is complex128)
                c = torch.tensor(x, dtype=torch.complex128)
            return self.var_of(self.lift(c))
        raise UnsupportedOpError(f"tn cannot use {x!r} ({type(x).__name__}) as an op input")

    def emit(self, op: Any, inputs: List[Any], attrs: Dict[str, Any],
             outs: Sequence[Tuple[Tuple[int, ...], torch.dtype]]) -> List[Var]:
        """Append ``outs = op[attrs](*inputs)``; returns the new Vars."""
        vs = [Var(s, d) for s, d in outs]
        src = self._src
        if src is None:
            src = user_source()
            if self._depth:
                self._src = src
        self.eqns.append(Eqn(op, inputs, vs, attrs, src))
        return vs

    def new(self, spec: _Spec, var: Var) -> TracerTensor:
        """A fresh base tensor of metadata ``spec`` holding ``var``."""
        return TracerTensor(spec, self.device, _Store(var, spec), (), var)

    def lift(self, t: Tensor) -> TracerTensor:
        """A real tensor captured by the traced code, as a program constant."""
        hit = self._const_of.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        if t.device.type == "meta":
            raise TracingError(
                f"{_where()}: the traced code uses a meta tensor {aval_str(t.shape, t.dtype)} that is not "
                f"an input; meta tensors have no values to bake into the program. Pass it as an argument.")
        c = t.detach()
        v = Var(c.shape, c.dtype)
        self.consts.append((v, c))
        tt = self.new(_Spec.contiguous(c.shape, c.dtype), v)
        tt._tn_store.captured = True
        self._const_of[id(t)] = (t, tt)
        return tt

    def lift_args(self, args: Sequence[Any]) -> Sequence[Any]:
        """``args`` with every real tensor (also inside lists) replaced by its constant tracer."""
        out = None
        for i, a in enumerate(args):
            ta = type(a)
            if ta is TracerTensor:
                continue
            if isinstance(a, Tensor):
                a = self.lift(a)
            elif (ta is list or ta is tuple) and any(isinstance(x, Tensor) and type(x) is not TracerTensor
                                                     for x in a):
                a = ta(self.lift(x) if isinstance(x, Tensor) and type(x) is not TracerTensor else x for x in a)
            else:
                continue
            if out is None:
                out = list(args)
            out[i] = a
        return args if out is None else out

    # ---- view steps: (op, attrs, out_shape)

    def apply_step(self, step: tuple, v: Var) -> Var:
        """Emit one view step ``(op, attrs, out_shape)`` on ``v``."""
        op, attrs, shape = step
        dtype = _ops.fft.view_dtype(op.name, v.dtype) if op.name in _COMPLEX_VIEW_OPS else v.dtype
        return self.emit(op, [v], attrs, [(shape, dtype)])[0]

    def inverse_step(self, step: tuple, parent: Var, new: Var) -> Var:
        """The new value of ``parent`` after its view ``step`` was overwritten with ``new``."""
        op, attrs, shape = step
        name = op.name
        if name == "reshape":
            return self.emit(OPS["reshape"], [new], {"shape": parent.shape}, [(parent.shape, parent.dtype)])[0]
        if name == "permute":
            dims = attrs["dims"]
            inv = tuple(sorted(range(len(dims)), key=lambda i: dims[i]))
            return self.emit(OPS["permute"], [new], {"dims": inv}, [(parent.shape, parent.dtype)])[0]
        if name == "slice":
            return self.emit(OPS["slice_scatter"], [parent, new], dict(attrs), [(parent.shape, parent.dtype)])[0]
        if name == "as_strided":
            return self.emit(OPS["as_strided_scatter"], [parent, new], dict(attrs),
                             [(parent.shape, parent.dtype)])[0]
        if name in _COMPLEX_VIEW_OPS:   # the pairs of a complex value, or the value of its pairs: each the other's inverse
            return self.emit(OPS[_COMPLEX_VIEW_OPS[name]], [new], {}, [(parent.shape, parent.dtype)])[0]
        raise UnsupportedOpError(
            f"{_where()}: an in-place write into a broadcast view ({name} {aval_str(parent.shape, parent.dtype)} "
            f"-> {aval_str(shape, parent.dtype)}) writes one element several times; tn cannot trace it. "
            f"Write into a copy (.clone()) instead.")

    def make_view(self, x: TracerTensor, meta: _Spec, steps: List[tuple]) -> TracerTensor:
        """A view of ``x`` (same store), ``steps`` further down its chain."""
        v = self.var_of(x)
        for step in steps:
            v = self.apply_step(step, v)
        return TracerTensor(meta, self.device, x._tn_store, x._tn_chain + tuple(steps), v)

    def make_strided_view(self, x: TracerTensor, meta: _Spec, func: Any) -> TracerTensor:
        """A view no explicit rule covers (diagonal, unfold ...): ``as_strided`` of the base.

        The view's strides address the base's memory; if the base is a dense
        permutation of row-major (e.g. the result of ``x.t() * 2``), the base
        is first permuted into memory order.
        """
        st = x._tn_store
        base = st.spec
        steps: List[tuple] = []
        offset = int(meta.storage_offset())
        if 0 in base.shape and 0 in meta.shape:
            offset = 0          # an empty view of an empty tensor: no memory order to respect, no element to address
        elif not base.is_row_major():
            perm = sorted(range(len(base.shape)), key=lambda d: -base.strides[d])
            mem = _Spec(tuple(base.shape[d] for d in perm), tuple(base.strides[d] for d in perm), base.offset,
                        base.dtype)
            if not mem.is_row_major():
                raise UnsupportedOpError(
                    f"{_where()}: tn cannot trace the view {func} of a tensor whose layout is not dense "
                    f"(input {aval_str(x.shape, x.dtype)}); call .contiguous() first.")
            steps += _permute_dims(perm, tuple(base.shape))
        steps.append((OPS["as_strided"], {"size": tuple(meta.shape), "stride": tuple(meta.stride()),
                                          "offset": offset}, tuple(meta.shape)))
        v = st.var
        for step in steps:
            v = self.apply_step(step, v)
        return TracerTensor(meta, self.device, st, tuple(steps), v)

    def write(self, t: TracerTensor, new: Var) -> None:
        """Functionalised in-place update: ``t`` (and its base and views) now hold ``new``."""
        st = t._tn_store
        if st.captured:
            raise UnsupportedOpError(
                f"{_where()}: the traced function writes in place into a tensor "
                f"{aval_str(st.spec.shape, st.spec.dtype)} it did not receive as an argument (a global, "
                f"a closure variable or a module attribute); a compiled program can only write back its "
                f"inputs. Pass the tensor as an argument (module buffers are arguments under tn.jit).")
        chain = t._tn_chain
        written = new
        if chain:
            vals = [st.var]
            for step in chain[:-1]:
                vals.append(self.apply_step(step, vals[-1]))
            for step, parent in zip(reversed(chain), reversed(vals)):
                new_parent = self.inverse_step(step, parent, new)
                new = new_parent
            st.var = new
        else:
            st.var = new
        st.version += 1
        t._tn_var = written  # reading t back gives exactly what was written
        t._tn_ver = st.version

    def cast_to(self, v: Var, shape: Tuple[int, ...], dtype: torch.dtype) -> Var:
        """``v`` converted to ``dtype`` and broadcast to ``shape`` (for in-place writes)."""
        if v.dtype != dtype:
            v = self.emit(OPS["convert"], [v], {"dtype": dtype}, [(v.shape, dtype)])[0]
        if tuple(v.shape) != tuple(shape):
            v = self.emit(OPS["expand"], [v], {"shape": tuple(shape)}, [(tuple(shape), dtype)])[0]
        return v

    # ---- dispatch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        args = self.lift_args(args)
        if kwargs:
            kwargs = dict(zip(kwargs.keys(), self.lift_args(list(kwargs.values()))))
        h = _HANDLERS.get(func)
        if h is None:
            h = _resolve(func)
        if self._depth == 0:
            self._src = None
        self._depth += 1
        try:
            return h(self, func, args, kwargs)
        finally:
            self._depth -= 1

    def dispatch(self, func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        """Handle ``func`` as if torch dispatched it here (no autograd on the way)."""
        h = _HANDLERS.get(func)
        if h is None:
            h = _resolve(func)
        return h(self, func, args, kwargs)


# --------------------------------------------------------------------------- handlers


def _unsupported(func: Any, args: Sequence[Any], kwargs: Dict[str, Any], why: str = "") -> UnsupportedOpError:
    return UnsupportedOpError(
        f"{_where()}: tn cannot trace {func} with inputs ({_describe_inputs(args, kwargs)}): "
        f"{why or 'it is not in the core op set (tn.ops) and has no decomposition'}. Run this part eagerly "
        f"(outside tn.jit), use tn.adaptive, or add the op to tn.ops.")


def _wrap_out(tr: _Tracer, spec_out: Any, vars_: List[Var]) -> Any:
    it = iter(vars_)
    if type(spec_out) is _Spec:
        return tr.new(spec_out, next(it))
    return tuple(tr.new(m, next(it)) if type(m) is _Spec else m for m in spec_out)


#: Operator namespaces of torch itself: ops there are never traced as opaque custom ops.
_TORCH_NAMESPACES = frozenset({"aten", "prims", "prim", "_c10d_functional", "c10d", "c10d_functional",
                               "_dtensor", "higher_order", "profiler", "inductor", "quantized", "_quantized"})


def _is_custom_op(func: Any) -> bool:
    """Whether ``func`` is a user's ``torch.library`` op (not torch's own namespaces) that is functional
    and returns tensors; whether it has a fake/meta kernel is checked when it is traced."""
    ns = getattr(func, "namespace", "aten")
    return ns not in _TORCH_NAMESPACES and not _mutated_args(func) and _returns_tensors(func)


def _h_custom(tr: _Tracer, func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """A ``torch.library`` custom op: one opaque ``host`` equation (run by torch on the host, counted as
    host work, refused by a strict compile) whose shapes come from the op's fake (meta) kernel; one with a tn
    decomposition (:data:`tn.ops.DECOMPOSITIONS_BY_NAME`) is traced through it instead."""
    if _ops.DECOMPOSITIONS_BY_NAME.get(func.name()) is not None:
        return _h_decompose(tr, func, args, kwargs)
    try:
        has_meta = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "Meta")
        if has_meta:
            meta_call(func, args, kwargs)
    except Exception as err:   # custom_op's Meta kernel raises when no fake implementation is registered
        has_meta, why = False, f" ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
    else:
        why = ""
    if not has_meta:
        raise _unsupported(func, args, kwargs,
                           "it is a custom op without a working fake (meta) implementation, so tn cannot know its "
                           "result shapes; register one with @torch.library.register_fake "
                           f"(or @{func.name().split('::')[-1]}.register_fake){why}")
    _ops.trace_as_host(func)
    if _ops.FROM_ATEN[func][1](*args, **kwargs) is None:   # a tensor-list argument: no host form
        raise _unsupported(func, args, kwargs, "custom ops taking lists of tensors are not supported")
    return _h_core(tr, func, args, kwargs)


def _h_core(tr: _Tracer, func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    op, conv = _ops.FROM_ATEN[func]
    r = conv(*args, **kwargs)
    if r is None:
        return _h_decompose(tr, func, args, kwargs)
    spec = meta_call(func, args, kwargs)
    if r is _ops.IDENTITY:
        return tr.new(spec, tr.var_of(args[0]))
    inputs, attrs = r
    atoms = [tr.atom(x) for x in inputs]
    if type(spec) is _Spec:
        outs = [(spec.shape, spec.dtype)]
    else:
        outs = [(m.shape, m.dtype) for m in spec if type(m) is _Spec]
    return _wrap_out(tr, spec, tr.emit(op, atoms, attrs, outs))


def _h_linalg_check(tr: _Tracer, func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """``aten._linalg_check_errors`` (the error check of every ``torch.linalg.*_ex`` call): one effectful
    ``linalg_check`` equation, kept by the passes though it has no result, that raises eager's
    ``torch.linalg.LinAlgError`` at run time naming the user's line; no result."""
    op, conv = _ops.FROM_ATEN[func]
    inputs, attrs = conv(*args, **kwargs)
    tr.emit(op, [tr.atom(x) for x in inputs], attrs, [])
    eqn = tr.eqns[-1]
    eqn.attrs = {**eqn.attrs, "where": eqn.source}
    return None


def _h_index(tr: _Tracer, func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    for t in indices:
        if t is not None and t.dtype in (torch.bool, torch.uint8):
            where = _where()
            err = TracingError(
                f"{where}: indexing with a boolean mask ({aval_str(t.shape, t.dtype)}) gives a result "
                f"whose shape depends on the mask's values, which tracing cannot know. Use "
                f"torch.where(mask, x, other) to keep the shape, or: {_ADVICE}")
            err.value_read = f"{where}: boolean mask index"
            raise err
    return _h_core(tr, func, args, kwargs)


#: torch's own plumbing between Python code and an op (never the line that reads a value).
_TORCH_PLUMBING = tuple(os.path.join(_TORCH_DIR, p) for p in (
    "_ops.py", "_tensor.py", "overrides.py", "utils" + os.sep + "_python_dispatch.py", "_compile.py",
    "_dynamo" + os.sep, "_jit_internal.py", "nn" + os.sep + "modules" + os.sep + "module.py"))


def _library_reader() -> str:
    """`` (read in file:line: `code`)`` for the innermost library frame (torch's or a package's, not tn's
    and not torch's dispatch plumbing) below the user's line, or ``""`` when the user's own line reads it."""
    user = user_frame()
    f = sys._getframe(1)
    while f is not None and f is not user:
        fn = os.path.abspath(f.f_code.co_filename)
        if not (fn.startswith(_TN_DIR) or fn.startswith(_TORCH_PLUMBING) or fn.startswith("<")
                or (fn.startswith(_STDLIB_DIR) and "-packages" not in fn)):
            line = linecache.getline(fn, f.f_lineno).strip()
            short = fn[len(_TORCH_DIR) - len("torch") - 1:] if fn.startswith(_TORCH_DIR) else fn
            return f" (read in {short}:{f.f_lineno} {f.f_code.co_name}: `{line}`)"
        f = f.f_back
    return ""


def _h_data_dependent(tr: _Tracer, func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    where = _where()
    err = TracingError(
        f"{where}: this line {_DATA_DEPENDENT[func]}{_library_reader()}, but while tn traces a function "
        f"tensors have shapes and dtypes only: Python control flow on tensor values cannot be recorded in one "
        f"program. {_ADVICE}")
    # what tn.jit names when it runs the function split at its value reads instead (tn.jit's fullgraph=False)
    err.value_read = f"{where}: {func.name()}"
    raise err


#: Largest static value (elements) and equation count :func:`_static_value` computes while tracing.
_STATIC_LIMIT = (1 << 20, 256)


def _static_value(tr: _Tracer, v: Var) -> Optional[Tensor]:
    """The value of ``v`` when it depends on no input of the trace (only on constants, iota/full and the like,
    e.g. the mask ``torch.combinations`` builds from ``arange``), computed now with the ops' reference
    implementations; ``None`` when it depends on an input, on a random or effectful op, or is too large."""
    known: Dict[Var, Any] = {c: t for c, t in tr.consts}
    made = {o: e for e in tr.eqns for o in e.outputs}
    need: List[Eqn] = []
    seen = set()
    stack = [v]
    while stack:
        u = stack.pop()
        if not isinstance(u, Var) or u in known or u in seen:
            continue
        e = made.get(u)
        if e is None or e.op.impure or len(need) >= _STATIC_LIMIT[1] or u.numel > _STATIC_LIMIT[0]:
            return None          # an input of the trace, a random draw, or too much work
        seen.update(e.outputs)
        need.append(e)
        stack.extend(e.inputs)
    order = {id(e): k for k, e in enumerate(tr.eqns)}
    with _disable_current_modes():
        for e in sorted(need, key=lambda e: order[id(e)]):
            out = e.op.impl(*[known[a] if isinstance(a, Var) else a.value for a in e.inputs], **e.attrs)
            outs = [out] if isinstance(out, Tensor) else list(out)
            known.update(zip(e.outputs, outs))
    return known.get(v)


def _h_value_shaped(tr: _Tracer, func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """``masked_select`` / ``nonzero`` whose mask depends on no input (a static value): the result's shape is
    known while tracing, so it is a gather at constant indices (``torch.combinations``'s triangular mask);
    otherwise the data-dependent refusal."""
    x = args[0]
    mask = args[1] if func is aten.masked_select.default else x
    st = _static_value(tr, tr.var_of(mask)) if type(mask) is TracerTensor else None
    if st is None:
        return _h_data_dependent(tr, func, args, kwargs)
    with _disable_current_modes():
        st = st.to(torch.bool) if st.dtype != torch.bool else st
        if func is aten.nonzero.default:
            return tr.lift(torch.nonzero(st))
        shape = torch.broadcast_shapes(tuple(x.shape), tuple(mask.shape))
        idx = torch.nonzero(st.expand(shape).reshape(-1)).reshape(-1)
    with tr:
        flat = aten.reshape.default(aten.expand.default(x, list(shape)), [-1])
        return aten.index.Tensor(flat, [idx])


def _h_meta_only(tr: _Tracer, func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    return func(*_metas(args), **meta_kwargs(kwargs, func))  # non-tensor results (sizes, flags)


def _fresh(tr: _Tracer, out: Any, args: Sequence[Any]) -> Any:
    """Decomposition results that are input objects become fresh tensors (ops return new tensors)."""
    ins = [a for a in args if type(a) is TracerTensor]
    if not ins:
        return out
    if type(out) is TracerTensor:
        return tr.new(_Spec.of(out), tr.var_of(out)) if any(out is a for a in ins) else out
    if isinstance(out, (list, tuple)):
        items = [tr.new(_Spec.of(o), tr.var_of(o)) if type(o) is TracerTensor and any(o is a for a in ins)
                 else o for o in out]
        return items if isinstance(out, list) else tuple(items)
    return out


def _h_decompose(tr: _Tracer, func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    d = _decomposition_for(func)
    out: Any = NotImplemented
    with tr:
        if d is not None:
            out = d(*args, **kwargs)
        if out is NotImplemented:
            out = func.decompose(*args, **kwargs)
    if out is NotImplemented:
        raise _unsupported(func, args, kwargs)
    if not _mutated_args(func):
        out = _fresh(tr, out, args)
        out = _restride(tr, func, args, kwargs, out)
    return out


def _dense(spec: _Spec) -> bool:
    """Whether ``spec`` is a permutation of a row-major layout at offset 0 (a valid base of a store)."""
    if spec.offset:
        return False
    perm = sorted(range(len(spec.shape)), key=lambda d: -spec.strides[d])
    return _Spec(tuple(spec.shape[d] for d in perm), tuple(spec.strides[d] for d in perm), 0,
                 spec.dtype).is_row_major()


def _restride(tr: _Tracer, func: Any, args: Sequence[Any], kwargs: Dict[str, Any], out: Any) -> Any:
    """Give fresh results of a decomposed op the strides of the op's own meta kernel.

    A decomposition computes the right values but not always the real kernel's
    layout (``native_layer_norm`` of a permuted input keeps the input's strides
    where the kernel returns a contiguous result). Code that follows, e.g. an
    AOTAutograd graph's ``aten.view``, relies on the kernel's strides, so
    results that do not alias an input take the meta kernel's layout.
    """
    single = type(out) is TracerTensor
    if not single and not (isinstance(out, (list, tuple)) and any(type(o) is TracerTensor for o in out)):
        return out
    try:
        spec = meta_call(func, args, kwargs)
    except Exception:
        return out  # no meta kernel: keep the decomposition's layout
    outs = [out] if single else list(out)
    specs = [spec] if type(spec) is _Spec else (list(spec) if isinstance(spec, (list, tuple)) else None)
    if specs is None or len(specs) != len(outs):
        return out
    in_stores = set()
    for a in list(args) + list(kwargs.values()):
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            if type(x) is TracerTensor:
                in_stores.add(id(x._tn_store))
    changed = False
    for i, (o, m) in enumerate(zip(outs, specs)):
        if (type(o) is TracerTensor and type(m) is _Spec and tuple(o.stride()) != m.strides
                and tuple(o.shape) == m.shape and o.dtype == m.dtype and id(o._tn_store) not in in_stores
                and _dense(m)):
            outs[i] = tr.new(m, tr.var_of(o))
            changed = True
    if not changed:
        return out
    if single:
        return outs[0]
    return outs if isinstance(out, list) else tuple(outs)


def _h_foreach(tr: _Tracer, func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """``_foreach_op(lists...)``: the op once per list element (scalars and single tensors broadcast)."""
    name = func._schema.name.split("::")[-1][len("_foreach_"):]
    packet = getattr(aten, name, None)
    if packet is None:
        raise _unsupported(func, args, kwargs, f"there is no aten.{name} to apply per element")
    n = len(args[0])

    def pick(a: Any, i: int) -> Any:
        return a[i] if isinstance(a, (list, tuple)) else a

    with tr:
        return [packet(*[pick(a, i) for a in args], **{k: pick(v, i) for k, v in kwargs.items()})
                for i in range(n)]


def _h_inplace(tr: _Tracer, func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    self_t = args[0]
    if type(self_t) in (list, tuple) and func._schema.name.startswith("aten::_foreach_"):
        # one in-place op per element, in order (as eager's loop does, so aliasing behaves the same)
        packet = getattr(aten, func._schema.name.split("::")[-1][len("_foreach_"):], None)
        if packet is None:
            raise _unsupported(func, args, kwargs, "there is no per-element in-place aten op")
        with tr:
            for i in range(len(self_t)):
                packet(*[a[i] if isinstance(a, (list, tuple)) else a for a in args],
                       **{k: v[i] if isinstance(v, (list, tuple)) else v for k, v in kwargs.items()})
        return None
    if type(self_t) is not TracerTensor:
        raise _unsupported(func, args, kwargs, "its first argument is not a traced tensor")
    meta_call(func, args, kwargs)  # the checks eager would do (dtype, broadcast, overlap)
    functional = _functional_variant(func)
    r = tr.dispatch(functional, args, kwargs)
    new = tr.cast_to(tr.var_of(r), tuple(self_t.shape), self_t.dtype)
    tr.write(self_t, new)
    return self_t


def _h_out(tr: _Tracer, func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """An ``out=`` op: its functional form, then an in-place copy into each out tensor (as ``copy_``)."""
    functional, names = _out_form(func)
    outs = [kwargs.get(n) for n in names]
    fkw = {k: v for k, v in kwargs.items() if k not in names}
    if any(type(o) is not TracerTensor for o in outs):
        raise _unsupported(func, args, kwargs, "an out= argument is not a tensor of the traced function")
    try:
        specs = meta_call(func, args, kwargs)   # eager's checks: result dtypes castable to the out dtypes ...
    except NotImplementedError:
        specs = None
    if specs is not None:
        specs = [specs] if type(specs) is _Spec else [m for m in specs if type(m) is _Spec]
        for o, m in zip(outs, specs):
            if tuple(o.shape) != tuple(m.shape):
                raise UnsupportedOpError(
                    f"{_where()}: {func} would resize its out= tensor {aval_str(tuple(o.shape), o.dtype)} to "
                    f"{list(m.shape)}; tn traces values, not storage, and cannot resize a tensor in place. Pass "
                    f"an out= tensor of the result's shape, or use the functional form (y = op(...)).")
    if len(outs) == 1 and fkw.get("dtype") is None and \
            any(a.name == "dtype" for a in functional._schema.arguments):
        fkw["dtype"] = outs[0].dtype   # sum/cumsum/arange/full ... compute in the out tensor's dtype
    r = tr.dispatch(functional, args, fkw)
    rs = list(r) if isinstance(r, (list, tuple)) else [r]
    for o, v in zip(outs, rs):
        tr.dispatch(aten.copy_.default, (o, v), {})
    return outs[0] if len(outs) == 1 else tuple(outs)


def _h_copy_(tr: _Tracer, func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    dst, src = args[0], args[1]
    meta_call(func, args, kwargs)
    if (type(src) is TracerTensor and type(dst) is TracerTensor and src._tn_store is dst._tn_store
            and src._tn_chain == dst._tn_chain and src.dtype == dst.dtype):
        return dst  # a region copied onto itself (``x[i] += v`` ends with x[i].copy_(x[i]))
    new = tr.cast_to(tr.atom(src) if type(src) is TracerTensor else tr.var_of(tr.lift(src)),
                     tuple(dst.shape), dst.dtype)
    tr.write(dst, new)
    return dst


_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _h_copy(tr: _Tracer, func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """Functional ``aten.copy(self, src)``: ``src`` cast to self's dtype and broadcast to its shape."""
    dst, src = args[0], args[1]
    spec = meta_call(func, args, kwargs)
    new = tr.cast_to(tr.atom(src), tuple(dst.shape), dst.dtype)
    return tr.new(spec, new)


def _h_metadata_inplace(tr: _Tracer, func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """``squeeze_``, ``unsqueeze_``, ``t_``, ``transpose_`` ...: the tensor becomes a view of its old value."""
    t = args[0]
    name = func._schema.name.split("::")[-1]
    if type(t) is not TracerTensor or name in ("resize_", "resize_as_", "set_"):
        if name == "resize_" and type(t) is TracerTensor and tuple(args[1]) == tuple(t.shape):
            return t
        raise UnsupportedOpError(
            f"{_where()}: {func} changes a tensor's storage or shape in place (inputs "
            f"{_describe_inputs(args, kwargs)}); tn traces values, not storage. Create a new tensor "
            f"instead (e.g. torch.empty(new_shape) or `x = x.reshape(...)`).")
    if name == "detach_":
        return t
    if t._tn_input:
        raise UnsupportedOpError(
            f"{_where()}: {func} changes the shape of an input tensor in place (inputs "
            f"{_describe_inputs(args, kwargs)}); a compiled program can update an input's values but "
            f"not its shape. Use the out-of-place form, e.g. `x = x.{name[:-1]}(...)`.")
    old_shape = tuple(t.shape)
    old_stride, old_offset = t.stride(), t.storage_offset()
    v = tr.var_of(t)
    meta = _meta(t)
    func(meta, *_metas(args[1:]), **meta_kwargs(kwargs, func))  # the meta view changes shape in place
    with torch._C._DisableTorchDispatch():  # so does the traced tensor (metadata only: CPU kernel)
        func.redispatch(_CPU_KEYS, t, *args[1:], **kwargs)
    new_shape = tuple(meta.shape)
    if name in ("squeeze_", "unsqueeze_"):
        steps = [] if new_shape == old_shape else [(OPS["reshape"], {"shape": new_shape}, new_shape)]
    elif name in ("t_", "transpose_", "swapdims_", "swapaxes_"):
        n = len(old_shape)
        if n < 2:
            steps = []
        else:
            d0, d1 = (0, 1) if name == "t_" else (args[1] % n, args[2] % n)
            dims = list(range(n))
            dims[d0], dims[d1] = dims[d1], dims[d0]
            steps = _permute_dims(dims, old_shape)
    elif name == "as_strided_" and new_shape == old_shape and t.storage_offset() == old_offset and all(
            a == b or n <= 1 for a, b, n in zip(old_stride, t.stride(), new_shape)):
        steps = []   # a restride that moves no element (strides change on size-1 dims only: channels-last pooling)
    else:
        raise _unsupported(func, args, kwargs, "tn does not trace this in-place layout change")
    for step in steps:
        v = tr.apply_step(step, v)
    t._tn_chain = t._tn_chain + tuple(steps)
    t._tn_var = v
    t._tn_ver = t._tn_store.version
    return t


def _h_clone(tr: _Tracer, func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    x = args[0]
    return tr.new(meta_call(func, args, kwargs), tr.var_of(x))


def _h_lift_fresh(tr: _Tracer, func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """``torch.tensor([...])`` inside the traced code: a fresh constant, free to be written to."""
    t = args[0]
    if type(t) is TracerTensor:
        t._tn_store.captured = False
    return t


def _h_view(tr: _Tracer, func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    x = args[0]
    if type(x) is not TracerTensor:
        raise _unsupported(func, args, kwargs, "its input is not a traced tensor")
    meta_out = meta_call(func, args, kwargs)
    for m in ([meta_out] if type(meta_out) is _Spec else meta_out):
        if m.dtype != x.dtype and func not in _COMPLEX_VIEWS:
            raise _unsupported(func, args, kwargs, "it reinterprets memory as another dtype, which tn's "
                                                   "value-based IR cannot express")
    maker = _VIEW_STEPS.get(func)
    if maker is None:
        if type(meta_out) is _Spec:
            return tr.make_strided_view(x, meta_out, func)
        return [tr.make_strided_view(x, m, func) for m in meta_out]
    if type(meta_out) is _Spec:
        return tr.make_view(x, meta_out, maker(x, meta_out, *args[1:], **kwargs))
    steps = maker(x, meta_out, *args[1:], **kwargs)
    return [tr.make_view(x, m, s) for m, s in zip(meta_out, steps)]


# ---- view steps per aten view op: maker(x, meta_out, *args, **kwargs) -> [step, ...]


def _reshape_steps(x, out, *args, **kwargs):
    shape = tuple(out.shape)
    if shape == tuple(x.shape):
        return []
    return [(OPS["reshape"], {"shape": shape}, shape)]


def _permute_dims(dims: Sequence[int], shape: Tuple[int, ...]) -> List[tuple]:
    dims = tuple(int(d) for d in dims)
    if dims == tuple(range(len(dims))):
        return []
    out_shape = tuple(shape[d] for d in dims)
    return [(OPS["permute"], {"dims": dims}, out_shape)]


def _permute_steps(x, out, dims):
    n = x.dim()
    return _permute_dims([d % n for d in dims] if n else [], tuple(x.shape))


def _transpose_steps(x, out, d0, d1):
    n = x.dim()
    if n < 2:
        return []
    dims = list(range(n))
    d0, d1 = d0 % n, d1 % n
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return _permute_dims(dims, tuple(x.shape))


def _t_steps(x, out):
    return _transpose_steps(x, out, 0, 1) if x.dim() == 2 else []


def _expand_steps(x, out, size, *, implicit=False):
    shape = tuple(out.shape)
    if shape == tuple(x.shape):
        return []
    return [(OPS["expand"], {"shape": shape}, shape)]


def _slice_step(shape: Tuple[int, ...], dim: int, start: Optional[int], end: Optional[int], step: int) -> List[tuple]:
    n = len(shape)
    dim = dim % n if n else 0
    start, end = _ops.slice_bounds(shape[dim], start, end)
    if start == 0 and end == shape[dim] and step == 1:
        return []
    length = max(0, (end - start + step - 1) // step)
    out_shape = shape[:dim] + (length,) + shape[dim + 1:]
    return [(OPS["slice"], {"dim": dim, "start": start, "end": end, "step": step}, out_shape)]


def _slice_steps(x, out, dim=0, start=None, end=None, step=1):
    return _slice_step(tuple(x.shape), dim, start, end, step)


def _select_steps(x, out, dim, index):
    shape = tuple(x.shape)
    dim = dim % len(shape)
    index = index % shape[dim] if shape[dim] else index
    steps = _slice_step(shape, dim, index, index + 1, 1)
    return steps + [(OPS["reshape"], {"shape": tuple(out.shape)}, tuple(out.shape))]


def _split_with_sizes_steps(x, outs, sizes, dim=0):
    shape = tuple(x.shape)
    dim = dim % len(shape)
    res, start = [], 0
    for s in sizes:
        res.append(_slice_step(shape, dim, start, start + s, 1))
        start += s
    return res


def _split_steps(x, outs, split_size, dim=0):
    return _split_with_sizes_steps(x, outs, [o.shape[dim] for o in outs], dim)


def _unbind_steps(x, outs, dim=0):
    return [_select_steps(x, o, dim, i) for i, o in enumerate(outs)]


def _alias_steps(x, out, *args, **kwargs):
    return []


def _complex_view_steps(x, out):
    op = "view_as_real" if x.dtype.is_complex else "view_as_complex"
    return [(OPS[op], {}, tuple(out.shape))]


#: The views between a complex tensor and its (re, im) pairs (a reinterpretation of the same bytes: core ops
#: of tn.ops.fft), and the op names of each one's inverse.
_COMPLEX_VIEWS = (aten.view_as_real.default, aten.view_as_complex.default)
_COMPLEX_VIEW_OPS = {"view_as_real": "view_as_complex", "view_as_complex": "view_as_real"}


_VIEW_STEPS: Dict[Any, Callable[..., Any]] = {
    aten.view.default: _reshape_steps,
    aten._reshape_alias.default: _reshape_steps,
    aten.unsqueeze.default: _reshape_steps,
    aten.squeeze.default: _reshape_steps,
    aten.squeeze.dim: _reshape_steps,
    aten.squeeze.dims: _reshape_steps,
    aten.permute.default: _permute_steps,
    aten.transpose.int: _transpose_steps,
    aten.t.default: _t_steps,
    aten.expand.default: _expand_steps,
    aten.slice.Tensor: _slice_steps,
    aten.select.int: _select_steps,
    aten.split_with_sizes.default: _split_with_sizes_steps,
    aten.split.Tensor: _split_steps,
    aten.unbind.int: _unbind_steps,
    aten.alias.default: _alias_steps,
    aten.detach.default: _alias_steps,
    aten.view_as_real.default: _complex_view_steps,
    aten.view_as_complex.default: _complex_view_steps,
}

_SPECIAL: Dict[Any, Callable[..., Any]] = {
    aten.copy_.default: _h_copy_,
    aten.copy.default: _h_copy,
    aten.clone.default: _h_clone,
    aten.lift_fresh.default: _h_lift_fresh,
    aten.lift_fresh_copy.default: _h_clone,
    aten.index.Tensor: _h_index,
    aten._linalg_check_errors.default: _h_linalg_check,
    aten.masked_select.default: _h_value_shaped,
    aten.nonzero.default: _h_value_shaped,
    aten._unsafe_index.Tensor: _h_index,
    aten.view.dtype: lambda tr, func, args, kwargs: (_ for _ in ()).throw(
        _unsupported(func, args, kwargs, "reinterpreting bits as another dtype is not in tn's op set")),
}


# --------------------------------------------------------------------------- entry point


def _check_no_aliased_mutation(flat_tensors: Sequence[Tensor], mutated: List[int]) -> None:
    """Refuse to trace writes into an input that shares memory with another input.

    The IR treats inputs as independent values; eager PyTorch would make the
    write visible through the other input too.
    """
    ptrs: Dict[int, List[int]] = {}
    for i, t in enumerate(flat_tensors):
        try:
            if t.device.type == "meta" or t.numel() == 0:
                continue
            ptr = t.untyped_storage().data_ptr()
        except Exception:  # tensors without accessible storage cannot be checked
            continue
        ptrs.setdefault(ptr, []).append(i)
    for group in ptrs.values():
        if len(group) > 1 and any(i in mutated for i in group):
            raise UnsupportedOpError(
                f"trace_flat: inputs {group} share memory and the traced function writes to input "
                f"{[i for i in group if i in mutated][0]} in place; tn treats inputs as independent values, "
                f"so the write would not show through the others. Pass separate tensors (e.g. .clone()).")


class _TracingGlobals:
    """Process-wide settings that hold while any trace runs, set by the first and restored by the last.

    * ``torch.compiler.is_compiling()`` is true, as under Dynamo and
      torch.export. Libraries ask it before reading tensor values: Hugging
      Face Transformers' ``is_tracing()`` (``transformers.utils.import_utils``)
      is ``torch.compiler.is_compiling()`` or a check that the tensor is an FX
      proxy, a FakeTensor or a torch.jit trace, none of which a
      :class:`TracerTensor` is; without this, ``masking_utils`` calls
      ``bool(mask.all())`` on a traced mask (a :class:`tn.TracingError`).
      torch's optimizers likewise keep step counts as tensors when compiling.
    * ``F.scaled_dot_product_attention`` picks only its math composite. On
      CPU it would pick the fused flash kernel, whose autograd formula calls
      ``_scaled_dot_product_flash_attention_for_cpu_backward``, an op with no
      decomposition, so ``torch.autograd.grad`` through attention could not be
      traced. The math composite (matmul, softmax, matmul; grouped-query
      attention included) differentiates into core ops and traces to the same
      forward IR.
    * oneDNN (mkldnn) is off, so ``nn.LSTM`` on CPU takes its composite path
      (the cell's matmuls and gates, which trace) instead of
      ``aten.mkldnn_rnn_layer``, an op with no decomposition (tn.jit refused
      every LSTM). Convolutions are traced as ``aten.convolution``, above the
      choice of a oneDNN kernel, so they do not change.

    All are process-wide in torch, not per thread, so concurrent traces share
    one depth count under a lock: saving and restoring per trace would let two
    overlapping traces leave the flags set for good. While any thread traces,
    other threads see these settings too.
    """

    _lock = threading.Lock()
    _depth = 0
    _saved_flag: Any = None
    _sdpa: Any = None
    _saved_mkldnn = True

    def __enter__(self) -> None:
        cls = _TracingGlobals
        with cls._lock:
            if cls._depth == 0:
                cls._saved_flag = getattr(tc, "_is_compiling_flag", None)
                if cls._saved_flag is not None:
                    tc._is_compiling_flag = True
                cls._sdpa = sdpa_kernel([SDPBackend.MATH])
                cls._sdpa.__enter__()
                cls._saved_mkldnn = torch._C._get_mkldnn_enabled()
                torch._C._set_mkldnn_enabled(False)
            cls._depth += 1

    def __exit__(self, *exc: Any) -> None:
        cls = _TracingGlobals
        with cls._lock:
            cls._depth -= 1
            if cls._depth == 0:
                if cls._saved_flag is not None:
                    tc._is_compiling_flag = cls._saved_flag
                sdpa, cls._sdpa = cls._sdpa, None
                sdpa.__exit__(None, None, None)
                torch._C._set_mkldnn_enabled(cls._saved_mkldnn)


def trace_flat(fn: Callable[..., Any], flat_tensors: Sequence[Tensor]) -> Traced:
    """Trace ``fn(*flat_tensors)`` into a pure IR, using only the inputs' shapes, dtypes and requires_grad.

    Returns a :class:`Traced`: ``ir.inputs[i]`` stands for ``flat_tensors[i]``;
    ``out_tree``/``out_leaves`` describe ``fn``'s (pytree) result. Inputs that
    ``fn`` mutates in place get their new values appended to ``ir.outputs``
    and listed in ``ir.mutations``.

    Raises:
        tn.TracingError: ``fn`` branches on a traced value (``.item()``, ``bool(t)`` ...).
        tn.UnsupportedOpError: ``fn`` uses an aten op tn cannot express.
    """
    device = torch.device("cpu")
    for t in flat_tensors:
        if not isinstance(t, Tensor):
            raise TracingError(
                f"trace_flat: every flat input must be a torch.Tensor, got {type(t).__name__} ({t!r}); "
                f"pass Python values as static arguments (static_argnums/static_argnames)")
    if flat_tensors and flat_tensors[0].device.type != "meta":
        device = flat_tensors[0].device
    tracer = _Tracer(device)
    in_vars: List[Var] = []
    tracers: List[TracerTensor] = []
    for i, t in enumerate(flat_tensors):
        v = Var(tuple(t.shape), t.dtype)
        spec = _Spec.contiguous(t.shape, t.dtype)
        tt = TracerTensor(spec, device, _Store(v, spec, i), (), v,
                          requires_grad=bool(t.requires_grad and (t.is_floating_point() or t.is_complex())))
        tt._tn_input = True
        in_vars.append(v)
        tracers.append(tt)
    with tracer, _TracingGlobals():
        try:
            out = fn(*tracers)
        except RuntimeError as e:
            msg = str(e)
            err = None
            if "not supported for tensor subclasses" in msg and (".numpy()" in msg or ".tolist()" in msg):
                err = TracingError(
                    f"{_where_in_traceback(e)}: this line converts a traced tensor to Python/numpy values "
                    f"(.numpy(), .tolist(), np.asarray), which tracing cannot provide. {_ADVICE}")
                err.value_read = f"{_where_in_traceback(e)}: .numpy()/.tolist()"
            elif "data is not allocated" in msg or "Cannot access data pointer" in msg:
                err = TracingError(
                    f"{_where_in_traceback(e)}: this line reads the values of a traced tensor in C++ "
                    f"(for example a tensor of split points or sizes), which tracing cannot provide. "
                    f"{_ADVICE}")
                err.value_read = f"{_where_in_traceback(e)}: a value read in C++"
            if err is not None:
                raise err from e
            raise
    leaves, out_tree = pytree.tree_flatten(out)
    outputs: List[Var] = []
    out_leaves: List[Any] = []
    for leaf in leaves:
        if type(leaf) is TracerTensor:
            out_leaves.append(len(outputs))
            outputs.append(tracer.var_of(leaf))
        elif isinstance(leaf, Tensor):
            out_leaves.append(len(outputs))
            outputs.append(tracer.var_of(tracer.lift(leaf)))
        else:
            out_leaves.append(Static(leaf))
    mutations: List[Tuple[int, int]] = []
    for i, tt in enumerate(tracers):
        if tt._tn_store.version:
            mutations.append((i, len(outputs)))
            outputs.append(tt._tn_store.var)
    if mutations:
        _check_no_aliased_mutation(flat_tensors, [i for i, _ in mutations])
    ir = IR(in_vars, tracer.eqns, outputs, consts=tracer.consts, mutations=mutations)
    return Traced(ir, out_tree, out_leaves)


# --------------------------------------------------------------------------- warm-up

_WARM = False


def warm_up() -> None:
    """Pay torch's one-time costs of tracing now (``import tn`` calls this last).

    The first meta kernel in a process imports sympy and ``torch._dynamo``
    (~1.2 s on an idle machine); a tiny trace afterwards warms tn's own caches
    (~15 ms). This runs in the calling thread on purpose: importing those
    modules from a background thread while the main thread imports other
    modules can deadlock Python's per-module import locks (seen as
    ``_DeadlockError`` when a test imported torch.testing internals during the
    warm-up), and holding the global import lock instead stalls the main
    thread just as long. Set ``TN_NO_WARMUP=1`` to skip it (the first trace
    then pays the cost).
    """
    global _WARM
    if _WARM or config.get("no_warmup"):
        return
    _WARM = True

    def f(x, w):
        y = torch.nn.functional.layer_norm(x, (4,))
        return torch.softmax(y @ w, -1).sum()

    try:
        import torch._dynamo  # lazy: heavy; what torch's meta kernels import on first use (TN_NO_WARMUP skips it)
        import torch.fx.experimental.symbolic_shapes  # lazy: heavy; only the warm-up trace needs it here

        trace_flat(f, [torch.empty(2, 4), torch.empty(4, 4)])
    except Exception:  # best effort: `import tn` must not fail here; a real problem shows in the first trace
        pass
