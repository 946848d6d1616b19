# tn.jit and tn.make_ir: whole-function compilation, cached per abstract signature, over pluggable backends.
"""``tn.jit``: trace a function (or ``nn.Module``) once per input signature, run the program after.

A call flattens its arguments (:mod:`tn.pytree`) into tensors and a hashable
spec, builds the cache key (spec, tensor shapes/dtypes/devices/requires_grad,
grad mode) and looks it up in a bounded LRU cache. On a hit it runs the cached
program; on a miss it traces with :func:`tn.trace.trace_flat`, optimises with
:func:`tn.passes.optimize`, compiles with the backend, and caches the result.

Cached calls take a fast path: every spec seen is also compiled into a
*matcher* (:func:`tn.pytree.make_gather`, straight-line checks of that
spec), kept with a table ``(tensor signatures, grad/autocast mode) ->
program``. A call whose arguments pass a matcher skips the general
flattening and the hashing of the whole key; its tensors' signatures are
still read on every call (``.data`` assignment or ``requires_grad_()`` keep a
tensor's identity and version but change its signature). Anything a matcher
does not prove equal falls back to the general path, which decides as before.

Semantics worth knowing:

* Tensors are program inputs; every other leaf (ints, floats, strings, None,
  dtypes...) is a compile-time constant and part of the cache key, as are
  arguments named in ``static_argnums``/``static_argnames`` (which must be
  hashable). Calling with a new Python value retraces. Grad mode and
  enabled autocast regions are in the key too.
* An ``nn.Module`` passed as an argument (or jitted directly with
  ``tn.jit(module)``) contributes its parameters and buffers as program
  inputs: updating them in place changes results without a retrace. Module
  structure (parameter names, submodules' training flags) is in the key;
  other Python attributes read by ``forward`` are baked in at trace time
  (call ``cache_clear()`` after changing them). The key holds the module
  itself (by identity). Tracing runs on a structural copy whose parameters
  are tracer tensors, so the user's module is never modified meanwhile.
* An argument object that is not a pytree but holds tensors in its
  attributes is an error (they would be baked in as constants).
* In-place updates of inputs and buffers (``x.add_(1)``, BatchNorm running
  statistics in train mode) are written back after the call
  (:attr:`tn.ir.IR.mutations`), so callers see what eager PyTorch does.
* The program runs where the backend runs (host CPU for ``"reference"``);
  inputs on another device are copied to the host and results come back on
  the inputs' device.
* Programs run without autograd on every backend: results never carry
  autograd history (``requires_grad=False``). To train, call
  ``torch.autograd.grad`` inside the jitted function: its IR then holds the
  forward and the backward.
* A jitted function called while another one is being traced is inlined.

Environment: ``TN_BACKEND`` picks the default backend, ``TN_LOG=recompiles``
logs every cache miss (logger ``"tn"``) with the arguments that changed versus
the closest cached signature.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import functools
import importlib
import inspect
import logging
import os
import sys
import threading
import types
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.utils._pytree as _pytree
from torch.nn.utils.stateless import _reparametrize_module

from . import config, passes, reference
from . import pytree as _pt
from . import trace as _trace
from .errors import ArgumentTypeError, ArgumentValueError, DeviceError, ExecutionError, TracingError
from .ir import IR
from .ops.low_precision import fp32_gradients_while_tracing

__all__ = [
    "jit", "make_ir", "register_backend", "backends", "default_backend", "is_tracing", "CacheInfo",
    "JittedFunction", "JittedModule", "DEFAULT_BACKEND", "DEFAULT_CACHE_SIZE", "shadow_module", "backend_compile_fn",
]

#: The backend used when ``jit(..., backend=None)``; ``TN_BACKEND`` overrides it.
DEFAULT_BACKEND: str = "neuron"

#: Programs kept per jitted function (LRU) when ``cache_size`` is not given.
DEFAULT_CACHE_SIZE: int = 64

log = logging.getLogger("tn")

Tensor = torch.Tensor


# ---------------------------------------------------------------- backends

class _Backend(NamedTuple):
    compile_fn: Callable[[IR], Callable[[List[Tensor]], List[Tensor]]]
    host_only: bool


_BACKENDS: Dict[str, _Backend] = {}


def register_backend(name: str, compile_fn: Callable[[IR], Callable[[List[Tensor]], List[Tensor]]],
                     *, host_only: bool = True) -> None:
    """Register a jit backend.

    ``compile_fn(ir)`` returns ``run(list_of_input_tensors) -> list_of_outputs``
    (values of ``ir.outputs``; mutations are written back by jit). With
    ``host_only`` (the default) ``run`` receives CPU tensors and jit moves
    inputs and results between the host and the inputs' device; a backend that
    handles device tensors itself passes ``host_only=False``.
    Registering an existing name replaces it.
    """
    if not isinstance(name, str) or not name:
        raise ArgumentValueError(f"register_backend: the name must be a non-empty string, got {name!r}")
    if not callable(compile_fn):
        raise ArgumentTypeError(f"register_backend({name!r}, ...): compile_fn must be callable (ir -> run function), "
                                f"got {type(compile_fn).__name__}")
    _BACKENDS[name] = _Backend(compile_fn, bool(host_only))


def backends() -> List[str]:
    """Names of the registered backends, with those a lower layer provides on first use (``"neuron"``)."""
    return sorted(set(_BACKENDS) | set(_BACKEND_PROVIDERS))


def default_backend() -> str:
    """The backend ``tn.jit`` uses when none is given: ``TN_BACKEND`` or :data:`DEFAULT_BACKEND`."""
    return config.get("backend") or DEFAULT_BACKEND


def _reference_compile(ir: IR) -> Callable[[List[Tensor]], List[Tensor]]:
    """The ``"reference"`` backend: run the IR with each op's torch implementation."""
    return reference.compile_ir(ir)


register_backend("reference", _reference_compile)

#: Backends provided by a lower layer, registered the first time their name is asked for:
#: ``name -> (module, compile function name, host_only)``. The compiler never imports tn.jit to register itself.
_BACKEND_PROVIDERS: Dict[str, Tuple[str, str, bool]] = {"neuron": ("tn.lower", "compile_ir", True)}


def backend_compile_fn(backend: Union[str, Callable, None], where: str = "tn.jit") -> Callable:
    """The ``compile_fn(ir) -> run`` of ``backend`` (a registered name, a compile function, or None for the
    default backend), for a door that compiles IR it made itself (tn.adaptive's masked buckets)."""
    return _resolve_backend(backend, where)[1].compile_fn


def _resolve_backend(backend: Union[str, Callable, None], where: str) -> Tuple[str, _Backend]:
    if backend is None:
        backend = default_backend()
    if callable(backend) and not isinstance(backend, str):
        return getattr(backend, "__name__", "custom"), _Backend(backend, True)
    if not isinstance(backend, str):
        raise ArgumentTypeError(f"{where}: backend must be a registered name or a compile function, got {backend!r}")
    b = _BACKENDS.get(backend)
    if b is None and backend in _BACKEND_PROVIDERS:  # a lower layer's compiler, registered on first use
        module, attr, host_only = _BACKEND_PROVIDERS[backend]
        # lazy: the provider's module (the compiler) loads when its backend is first asked for, not with import tn
        register_backend(backend, getattr(importlib.import_module(module), attr), host_only=host_only)
        b = _BACKENDS.get(backend)
    if b is None:
        raise ArgumentValueError(f"{where}: unknown backend {backend!r}; registered backends: {', '.join(backends())}. "
                                 f"Register one with tn.jit.register_backend(name, compile_fn)")
    return backend, b


# ---------------------------------------------------------------- passes

def _optimize(ir: IR) -> IR:
    """``ir`` through :func:`tn.passes.optimize`."""
    return passes.optimize(ir)


# ---------------------------------------------------------------- cache bits

class CacheInfo(NamedTuple):
    """Statistics of a jitted function's program cache."""
    hits: int
    misses: int
    size: int
    maxsize: Optional[int]


class _TLS(threading.local):
    depth = 0  # > 0 while this thread traces a jitted function


_tls = _TLS()
_TRACE_LOCK = threading.RLock()


def is_tracing() -> bool:
    """True while this thread traces a jitted function (``tn.jit``/``tn.make_ir``).

    Jitted functions called meanwhile are inlined; code that dispatches on
    its own (``tn.adaptive``'s regions) should run its plain PyTorch code too.
    """
    return _tls.depth > 0


_any_autocast = torch._C._is_any_autocast_enabled


def _autocast_state() -> Tuple[bool, Tuple[Tuple[str, torch.dtype], ...]]:
    """Grad mode and the enabled autocast regions (they change what a trace records)."""
    on = []
    for dev in ("cpu", "cuda", "xpu", "mps", "hpu", "xla", torch._C._get_privateuse1_backend_name()):
        try:
            if torch.is_autocast_enabled(dev):
                on.append((dev, torch.get_autocast_dtype(dev)))
        except (RuntimeError, ValueError, TypeError):  # a device type autocast does not know
            continue
    return (torch.is_grad_enabled(), tuple(on))


_log_enabled = config.log_enabled


_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled


class _Key(tuple):
    """A cache key ``(spec, sigs, mode)`` that hashes once (the fast path moves it in the LRU order per call)."""

    def __new__(cls, items: Tuple[Any, ...]) -> "_Key":
        self = tuple.__new__(cls, items)
        self._h = tuple.__hash__(self)  # raises TypeError for an unhashable constant
        return self

    def __hash__(self) -> int:
        return self._h


class _Plan:
    """The fast path for one argument spec: its matcher and ``{(sigs, mode): entry}``."""

    __slots__ = ("spec", "gather", "table", "last")

    def __init__(self, spec: Any, gather: Callable[[Tuple[Any, ...], Dict[str, Any]], Optional[List[Tensor]]]):
        self.spec = spec
        self.gather = gather
        self.table: Dict[Tuple[Any, Any], "_Entry"] = {}
        self.last: Tuple[Any, Optional["_Entry"]] = (None, None)  # the last hit: compared before hashing


#: Matchers kept per jitted function, and how many it may build in all (a call site whose structure keeps
#: changing stops getting new ones and takes the general path).
_MAX_PLANS = 8
_MAX_PLAN_BUILDS = 32
_SIG = _pt.SIG


class _Entry:
    """One compiled program and how to turn its outputs into the user's result.

    ``live`` is False once the entry left its cache (evicted or cleared): the
    fast path's tables may still hold it and must not run it then.
    """

    __slots__ = ("ir", "run", "mutations", "aliases", "assemble", "host", "key", "desc", "live")

    def __init__(self, ir: IR, run: Callable, assemble: Callable, host: Optional[torch.device],
                 key: Any, desc: Optional[Dict[str, str]]):
        self.ir = ir
        self.run = run
        self.mutations = tuple(tuple(m) for m in ir.mutations)
        # Outputs that are the new value of a mutated input are returned as that input
        # (after write-back), so `x.add_(1); return x` gives back x itself, as eager does.
        mutated_outs = {o for _, o in self.mutations}
        self.aliases = tuple(
            (k, i) for i, o in self.mutations for k, v in enumerate(ir.outputs)
            if k not in mutated_outs and v is ir.outputs[o])
        self.assemble = assemble
        self.host = host  # device to move results back to, when the backend runs on the host
        self.key = key
        self.desc = desc
        self.live = False  # set while the entry is in its cache

    def __call__(self, tensors: List[Tensor]) -> Any:
        host = self.host
        grad = _grad_enabled()
        if grad:  # programs run without autograd, on every backend alike
            _set_grad_enabled(False)
        try:
            if host is None:
                outs = self.run(tensors)
            else:
                outs = self.run([t.to("cpu") for t in tensors])
                outs = [o.to(host) if isinstance(o, Tensor) else o for o in outs]
        except ExecutionError as e:
            cause = e.__cause__
            if isinstance(cause, torch.linalg.LinAlgError) or getattr(cause, "tn_eager_error", False):
                raise cause from None   # a linalg error check (tn.ops.linalg_check) fails as in eager
            raise
        finally:
            if grad:
                _set_grad_enabled(True)
        if self.mutations:
            with torch.no_grad():
                for i, o in self.mutations:
                    dst = tensors[i]
                    src = outs[o]
                    if src is not dst:
                        dst.copy_(src)
            if self.aliases:
                outs = list(outs)
                for k, i in self.aliases:
                    outs[k] = tensors[i]
        return self.assemble(outs)


class _SplitEntry:
    """A signature whose function reads tensor values (``.item()``, ``nonzero``, ``if t:``): no single program.

    Each call runs the function on the ``neuron`` device in its adaptive eager mode: the ops between two value
    reads are gathered into windows, each traced and compiled by tn's compiler like a jitted program (and cached
    by the device), and a value read runs what is queued and reads the value back, as torch_xla does at a sync.
    So every op runs on the NeuronCore model with eager's numbers, in as many programs as the reads require,
    and Python control flow on values takes the branch of each call's values. As for a program: inputs on the
    host are copied to the device (parameters and buffers of modules among the arguments too), results come
    back on the inputs' device without autograd history, and in-place updates of inputs are written back
    (those that bump the tensor's version, and any change of an input that does not require grad: BatchNorm's
    running statistics are written by a kernel whose schema does not say so).
    Tensors the function captures from outside (globals, module attributes that are not parameters or buffers)
    stay where they are; tensors it creates are made on the device.
    ``error`` is the tracing error (``tn.jit(..., fullgraph=True)`` raises it; ``lower`` does).
    """

    __slots__ = ("core", "spec", "device", "host", "error", "ir", "run", "key", "desc", "live")

    def __init__(self, core: "_Core", spec: Any, device: torch.device, host: torch.device, error: TracingError,
                 key: Any, desc: Optional[Dict[str, str]]):
        self.core = core
        self.spec = spec
        self.device = device   # where the call runs
        self.host = host       # the inputs' device (fixed by the signature): where results go back
        self.error = error
        self.ir = None     # no single program
        self.run = None    # no backend run (profiles: the device's windows appear in tn.profile())
        self.key = key
        self.desc = desc
        self.live = False

    def __call__(self, tensors: List[Tensor]) -> Any:
        dev = self.device
        moved: List[Tensor] = []
        for t in tensors:
            if t.device == dev:
                moved.append(t)
            else:
                d = t.detach().to(dev)
                if t.requires_grad and (d.is_floating_point() or d.is_complex()):
                    d.requires_grad_(True)
                moved.append(d)
        versions = [d._version for d in moved]
        neuron = getattr(torch, "neuron")
        try:
            with neuron.eager_mode("adaptive"), dev:
                out = self.core.flat_fn(self.spec)(*moved)
        except Exception as e:
            e.add_note(f"tn.jit({self.core.name}) ran this call on {dev} as eager windows split at its value "
                       f"reads, because tracing it stopped at: {self.error.value_read}")
            raise
        home = {id(d): t for t, d in zip(tensors, moved)}
        with torch.no_grad():
            for t, d, v in zip(tensors, moved, versions):
                if d is t:
                    continue
                if d._version != v:
                    t.copy_(d)     # an in-place update of an input, written back as a program's mutation is
                elif not t.requires_grad:
                    # kernels whose schema does not mark a write (native_batch_norm's running statistics) leave
                    # the version alone: compare the values of inputs that could be such state
                    value = d.to(t.device)
                    if not torch.equal(value, t):
                        t.copy_(value)
        host = self.host

        def back(x: Any) -> Any:
            if not isinstance(x, Tensor):
                return x
            orig = home.get(id(x))
            if orig is not None:
                return orig        # an input returned (e.g. after x.add_(1)): the caller's tensor, as eager
            x = x.detach()
            return x.to(host) if x.device != host else x

        return _pytree.tree_map(back, out)


def _make_assemble(out_tree: Any, out_leaves: Sequence[Any]) -> Callable[[List[Any]], Any]:
    """A function turning the program's output list into the user's result pytree."""
    picks = []
    for leaf in out_leaves:
        if isinstance(leaf, int) and not isinstance(leaf, bool):
            picks.append((True, leaf))
        else:
            picks.append((False, getattr(leaf, "value", leaf)))
    if out_tree.is_leaf() and len(picks) == 1:
        is_out, v = picks[0]
        if is_out:
            return lambda outs: outs[v]
        return lambda outs: v
    if all(p[0] for p in picks):
        idx = tuple(p[1] for p in picks)
        if out_tree.type is tuple and all(c.is_leaf() for c in out_tree.children()):
            return lambda outs: tuple([outs[k] for k in idx])
        return lambda outs: _pytree.tree_unflatten([outs[k] for k in idx], out_tree)
    picks_t = tuple(picks)
    return lambda outs: _pytree.tree_unflatten([outs[v] if o else v for o, v in picks_t], out_tree)


def _exec_device(tensors: Sequence[Tensor], where: str) -> torch.device:
    """The device the inputs live on (CPU for none); mixed non-CPU devices are an error."""
    dev = None
    for t in tensors:
        d = t.device
        if d.type == "cpu":
            continue
        if dev is None:
            dev = d
        elif d != dev:
            raise DeviceError(f"{where}: inputs live on different devices ({dev} and {d}); "
                              f"move them to one device before calling")
    return dev if dev is not None else torch.device("cpu")


# ---------------------------------------------------------------- the jitted function

def _normalize_argnums(v: Any, where: str) -> Tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,)
    try:
        vals = tuple(v)
    except TypeError:
        raise ArgumentTypeError(f"{where}: static_argnums must be an int or a sequence of ints, got {v!r}") from None
    for x in vals:
        if not isinstance(x, int) or isinstance(x, bool):
            raise ArgumentTypeError(f"{where}: static_argnums must be an int or a sequence of ints, got {v!r}")
    return vals


def _normalize_argnames(v: Any, where: str) -> Tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    try:
        vals = tuple(v)
    except TypeError:
        raise ArgumentTypeError(f"{where}: static_argnames must be a str or a sequence of str, got {v!r}") from None
    for x in vals:
        if not isinstance(x, str):
            raise ArgumentTypeError(f"{where}: static_argnames must be a str or a sequence of str, got {v!r}")
    return vals


def _fn_name(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    code = getattr(fn, "__code__", None)
    if code is not None:
        return f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"
    return name


def program_prefix(code: Any) -> str:
    """A short identifier for the code a program comes from: a module's class name (``GPT2Block``), a function's
    qualified name without ``<locals>`` (``Trainer.step``, ``lambda``), ``graph`` for a torch.compile graph."""
    if isinstance(code, torch.fx.GraphModule):
        return "graph"                  # torch.compile's graphs (their classes are named <lambda>)
    if isinstance(code, torch.nn.Module):
        name = type(code).__name__
    else:
        name = getattr(code, "__qualname__", None) or getattr(code, "__name__", None) or type(code).__name__
    innermost = str(name).split("<locals>.")[-1]          # a nested function: its own name (or Class.method)
    return innermost.replace("<", "").replace(">", "") or "tn"


class _Core:
    """The machinery shared by :class:`JittedFunction`, :class:`JittedModule` and :func:`make_ir`."""

    def __init__(self, fn: Callable, static_argnums: Any, static_argnames: Any, backend: Any,
                 cache_size: Optional[int], where: str, bound: Tuple[Any, ...] = (), fullgraph: bool = False):
        if not callable(fn):
            raise ArgumentTypeError(f"{where}: expected a function or an nn.Module, got {type(fn).__name__}")
        self.fn = fn
        self.bound = bound  # leading arguments supplied by the wrapper (the module for tn.jit(module))
        self.fullgraph = bool(fullgraph)  # refuse value reads instead of splitting at them
        self.name = _fn_name(fn)
        self.program_prefix = program_prefix(bound[0] if bound else fn)
        nums = _normalize_argnums(static_argnums, where)
        names = _normalize_argnames(static_argnames, where)
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            sig = None
        params = list(sig.parameters.values()) if sig is not None else []
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        has_varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
        has_varkw = any(p.kind == p.VAR_KEYWORD for p in params)
        n_bound = len(bound)
        self.arg_names = [p.name for p in positional[n_bound:]] if sig is not None else []
        self.varargs_name = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), None)
        pos: List[int] = []
        for i in nums:
            j = i
            if i < 0:
                if has_varargs or sig is None:
                    raise ArgumentValueError(f"{where}: static_argnums={nums!r}: negative indices need a function with a "
                                             f"fixed number of positional parameters; {self.name} takes *args")
                j = len(self.arg_names) + i
            if j < 0 or (sig is not None and not has_varargs and j >= len(self.arg_names)):
                raise ArgumentValueError(
                    f"{where}: static_argnums={nums!r}: index {i} is out of range for {self.name}, which takes "
                    f"{len(self.arg_names)} positional argument(s) ({', '.join(self.arg_names) or 'none'})")
            pos.append(j)
        kwnames = list(names)
        by_name = {p.name: p for p in params}
        for n in names:
            if sig is not None and n not in by_name and not has_varkw:
                raise ArgumentValueError(f"{where}: static_argnames={names!r}: {self.name} has no parameter {n!r} "
                                         f"(parameters: {', '.join(by_name) or 'none'})")
            if n in self.arg_names:  # a static name passed positionally is static too
                pos.append(self.arg_names.index(n))
        for j in pos:  # and a static position passed by keyword
            if j < len(self.arg_names) and self.arg_names[j] not in kwnames:
                kwnames.append(self.arg_names[j])
        self.static_pos = frozenset(pos)
        self.static_names = frozenset(kwnames)
        self.has_static = bool(self.static_pos or self.static_names)
        self.backend_name, self.backend = _resolve_backend(backend, where)
        if cache_size is not None and (not isinstance(cache_size, int) or isinstance(cache_size, bool)
                                       or cache_size < 1):
            raise ArgumentValueError(f"{where}: cache_size must be a positive int or None (unbounded), got {cache_size!r}")
        self.maxsize = cache_size
        self.cache: "collections.OrderedDict[Any, _Entry]" = collections.OrderedDict()
        self.lock = threading.Lock()
        self.hits = 0
        self.last_entry: Optional[_Entry] = None  # the program of the most recent call (for profiles/stats)
        self.misses = 0
        self.plans: Tuple[_Plan, ...] = ()  # fast-path matchers, oldest first (replaced whole, read without lock)
        self.plan_builds = 0

    # -- flattening -------------------------------------------------------

    def _label(self, i: int) -> str:
        if i < len(self.arg_names):
            return self.arg_names[i]
        if self.varargs_name:
            return f"{self.varargs_name}[{i - len(self.arg_names)}]"
        return f"args[{i}]"

    def flatten(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Any, List[Tensor]]:
        """``(spec, tensors)`` of a call (``bound`` arguments first)."""
        tensors: List[Tensor] = []
        flat = _pt.flatten
        if self.has_static:
            sp = self.static_pos
            sn = self.static_names
            nb = len(self.bound)
            aspec = []
            for i, a in enumerate(self.bound + args):
                j = i - nb
                if j >= 0 and j in sp:
                    if isinstance(a, Tensor):
                        raise ArgumentTypeError(f"tn.jit({self.name}): static argument {self._label(j)!r} is a tensor; "
                                                f"tensors are program inputs: remove it from static_argnums/static_argnames")
                    aspec.append((_pt.STATIC, type(a), a))
                else:
                    aspec.append(flat(a, tensors))
            kspec = []
            for k, v in (sorted(kwargs.items()) if len(kwargs) > 1 else kwargs.items()):
                if k in sn:
                    if isinstance(v, Tensor):
                        raise ArgumentTypeError(f"tn.jit({self.name}): static argument {k!r} is a tensor; tensors are "
                                                f"program inputs: remove it from static_argnums/static_argnames")
                    kspec.append((k, (_pt.STATIC, type(v), v)))
                else:
                    kspec.append((k, flat(v, tensors)))
            return (tuple(aspec), tuple(kspec)), tensors
        aspec = tuple([flat(a, tensors) for a in self.bound + args])
        kspec = tuple([(k, flat(v, tensors)) for k, v in (sorted(kwargs.items()) if len(kwargs) > 1
                                                            else kwargs.items())]) if kwargs else ()
        return (aspec, kspec), tensors

    def describe(self, key: Any) -> Dict[str, str]:
        """``{label: text}`` of a cache key, for recompile messages."""
        spec, sigs, mode = key
        grad, autocast = mode if type(mode) is tuple else (mode, ())
        out: Dict[str, str] = {"grad mode": "enabled" if grad else "disabled",
                               "autocast": ", ".join(f"{d} {dt}" for d, dt in autocast) or "off"}
        pos = [0]
        if type(spec) is int:  # fast path key: all positional tensors
            for i in range(spec):
                _pt.describe(_pt.TENSOR, sigs, self._label(i), out, pos)
            return out
        aspec, kspec = spec
        nb = len(self.bound)
        out["number of positional arguments"] = str(len(aspec) - nb)
        for i, s in enumerate(aspec):
            _pt.describe(s, sigs, "module" if i < nb else self._label(i - nb), out, pos)
        out["keyword arguments"] = ", ".join(k for k, _ in kspec) or "none"
        for k, s in kspec:
            _pt.describe(s, sigs, k, out, pos)
        return out

    # -- tracing and compiling -------------------------------------------

    def flat_fn(self, spec: Any) -> Callable[..., Any]:
        """The function on this spec's flat tensors: rebuilds the arguments (modules reparametrised with the given
        parameters and buffers, on structural copies) and calls ``fn``. Tracing calls it with tracer tensors, a
        split run (:class:`_SplitEntry`) with device tensors."""
        fn = self.fn

        def flat_fn(*flat_tensors: Tensor) -> Any:
            it = iter(flat_tensors)
            modules: List[Tuple[torch.nn.Module, Dict[str, Tensor]]] = []
            if type(spec) is int:
                args, kwargs = tuple(flat_tensors), {}
            else:
                aspec, kspec = spec
                memo: Dict[int, torch.nn.Module] = {}
                wrap = functools.partial(_shadow, memo=memo)
                args = tuple(_pt.unflatten(s, it, modules, wrap) for s in aspec)
                kwargs = {k: _pt.unflatten(s, it, modules, wrap) for k, s in kspec}
            with contextlib.ExitStack() as stack:
                for m, named in modules:
                    stack.enter_context(_reparametrize(m, named))
                out = fn(*args, **kwargs)
            _pt.register_dataclasses_in(out)
            return out

        return flat_fn

    def trace(self, spec: Any, tensors: List[Tensor]) -> Tuple[IR, Any, Any]:
        """Trace the function for this call's spec; returns ``(optimised IR, out_tree, out_leaves)``."""
        _tls.depth += 1
        try:
            with fp32_gradients_while_tracing():   # 16-bit norms/divisions: fp32 gradients (tn.ops.low_precision)
                traced = _trace.trace_flat(self.flat_fn(spec), list(tensors))
        finally:
            _tls.depth -= 1
        ir = _optimize(traced.ir)
        ir.name = self.program_prefix     # programs are named after the function or module they come from
        return ir, traced.out_tree, traced.out_leaves

    def compile(self, key: Any, spec: Any, tensors: List[Tensor]) -> _Entry:
        """Trace, optimise and compile one signature into a cache entry."""
        where = f"tn.jit({self.name})"
        dev = _exec_device(tensors, where)
        try:
            ir, out_tree, out_leaves = self.trace(spec, tensors)
        except TracingError as err:
            split_dev = self.split_device(err, dev)
            if split_dev is None:
                raise
            desc = self.describe(key) if key is not None else None
            if _log_enabled("splits"):
                log.warning("tn.jit: %s reads tensor values; it runs as device windows split at the reads: %s",
                            self.name, err.value_read)
            return _SplitEntry(self, spec, split_dev, dev, err, key, desc)
        run = self.backend.compile_fn(ir)
        host = dev if (self.backend.host_only and dev.type != "cpu") else None
        desc = self.describe(key) if key is not None else None
        return _Entry(ir, run, _make_assemble(out_tree, out_leaves), host, key, desc)

    def split_device(self, err: TracingError, dev: torch.device) -> Optional[torch.device]:
        """The device a function whose trace failed with ``err`` runs on split at its value reads, or None (raise).

        Only a value read (``err.value_read``) splits, only on the ``neuron`` backend, unless ``fullgraph`` or
        ``TN_JIT_SPLIT=0``; the inputs' neuron device, or the current one for host inputs."""
        if self.fullgraph or not getattr(err, "value_read", None) or self.backend_name != "neuron":
            return None
        if not config.get("jit_split"):
            return None
        neuron = getattr(torch, "neuron", None)   # the torch device module tn.device registers
        if neuron is None or dev.type not in ("cpu", "neuron"):
            return None
        return dev if dev.type == "neuron" else torch.device("neuron", neuron.current_device())

    # -- the call ---------------------------------------------------------

    def key_of(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Any, Any, List[Tensor]]:
        """``(key, spec, tensors)`` of a call."""
        if not kwargs and not self.has_static and not self.bound:
            for a in args:
                if not isinstance(a, Tensor):
                    break
            else:  # all positional tensors: the spec is their number
                return (_Key((len(args), tuple(map(_SIG, args)),
                              _autocast_state() if _any_autocast() else torch.is_grad_enabled())),
                        len(args), list(args))
        spec, tensors = self.flatten(args, kwargs)
        try:
            sigs = tuple([(t.shape, t.dtype, t.device, t.requires_grad) for t in tensors])
        except AttributeError:  # only module parameters/buffers can be non-tensors here
            bad = next(t for t in tensors if not isinstance(t, Tensor))
            raise ArgumentTypeError(f"tn.jit({self.name}): a module parameter or buffer is a {type(bad).__name__}, "
                                    f"not a tensor; assign tensors (or None) to parameters and buffers") from None
        mode = _autocast_state() if _any_autocast() else torch.is_grad_enabled()
        try:
            key = _Key((spec, sigs, mode))
        except TypeError:
            self._raise_unhashable(spec)
            raise
        return key, spec, tensors

    def lookup(self, key: Any, spec: Any) -> Optional[_Entry]:
        """The cached entry for ``key`` (counted as a hit), or None."""
        try:
            with self.lock:
                e = self.cache.get(key)
                if e is not None:
                    self.cache.move_to_end(key)
                    self.hits += 1
                return e
        except TypeError:
            self._raise_unhashable(spec)
            raise

    def _raise_unhashable(self, spec: Any) -> None:
        if type(spec) is int:
            return
        aspec, kspec = spec
        nb = len(self.bound)
        found = None
        for i, s in enumerate(aspec):
            found = _pt.find_unhashable(s, "module" if i < nb else self._label(i - nb))
            if found:
                break
        if not found:
            for k, s in kspec:
                found = _pt.find_unhashable(s, k)
                if found:
                    break
        if found:
            label, value = found
            hint = ""
            if type(value).__module__ == "numpy":
                hint = " Convert arrays with torch.from_numpy (tensors are program inputs)."
            raise ArgumentTypeError(
                f"tn.jit({self.name}): argument {label!r} is a {type(value).__name__}, which is neither a tensor "
                f"nor hashable. Non-tensor arguments are compile-time constants (part of the cache key) and must "
                f"be hashable: pass a tensor, a tuple instead of a list-like value, or register its type as a "
                f"pytree node.{hint}")

    def miss(self, key: Any, spec: Any, tensors: List[Tensor]) -> _Entry:
        """Compile ``key`` (once, even if several threads miss together) and insert it in the cache."""
        with _TRACE_LOCK:
            with self.lock:
                e = self.cache.get(key)
                if e is not None:
                    self.cache.move_to_end(key)
                    self.hits += 1
                    return e
            if _log_enabled("recompiles"):
                self._log_miss(key)
            e = self.compile(key, spec, tensors)
            with self.lock:
                self.misses += 1
                self.cache[key] = e
                e.live = True
                if self.maxsize is not None:
                    while len(self.cache) > self.maxsize:
                        self.cache.popitem(last=False)[1].live = False
            return e

    def _log_miss(self, key: Any) -> None:
        new = self.describe(key)
        where = _caller()
        with self.lock:
            olds = [e.desc for e in self.cache.values() if e.desc is not None]
        if not olds:
            log.warning("tn.jit: compiling %s (first call, cache miss %d%s): %s", self.name, self.misses + 1,
                        where, "; ".join(f"{k}: {v}" for k, v in new.items() if not k.endswith("(structure)")))
            return
        best, best_diff = None, None
        for old in olds:
            diff = [k for k in dict.fromkeys(list(new) + list(old)) if new.get(k) != old.get(k)]
            if best_diff is None or len(diff) < len(best_diff):
                best, best_diff = old, diff
        changes = "; ".join(f"{k}: {best.get(k, '(absent)')} -> {new.get(k, '(absent)')}" for k in best_diff)
        log.warning("tn.jit: recompiling %s (cache miss %d%s, %d program(s) cached); versus the closest cached "
                    "signature: %s", self.name, self.misses + 1, where, len(olds), changes or "no visible difference")

    def call(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """Run the function on ``args``/``kwargs``: cached program, or trace + compile first.

        The fast path: the first matcher that accepts the arguments gives
        their tensors (the spec is then the matcher's), whose signatures and
        the grad/autocast mode pick the program from the matcher's table. A
        program still in the cache runs as a hit (LRU order and statistics
        as on the general path). Anything else takes the general path, which
        then teaches the matchers this call's spec and program.
        """
        for p in self.plans:
            try:
                tensors = p.gather(args, kwargs)
                if tensors is None:
                    continue
                k = (tuple(map(_SIG, tensors)), _autocast_state() if _any_autocast() else _grad_enabled())
                last_k, e = p.last
                if k != last_k:
                    e = p.table.get(k)
                    if e is not None:
                        p.last = (k, e)
            except Exception:  # anything unusual: the general path decides (and reports errors)
                break
            if e is not None:
                with self.lock:
                    live = e.live
                    if live:
                        self.cache.move_to_end(e.key)
                        self.hits += 1
                if live:
                    self.last_entry = e
                    return e(tensors)
            break  # the spec matched: no other matcher can
        key, spec, tensors = self.key_of(args, kwargs)
        e = self.lookup(key, spec)
        if e is None:
            e = self.miss(key, spec, tensors)
        self.learn(key, spec, e)
        self.last_entry = e
        return e(tensors)

    def learn(self, key: Any, spec: Any, e: _Entry) -> None:
        """Teach the fast path that calls with ``spec`` and ``key``'s signatures run ``e``.

        Finds (or builds, within :data:`_MAX_PLANS`/:data:`_MAX_PLAN_BUILDS`)
        the matcher of ``spec`` and records ``e`` in its table.
        """
        _, sigs, mode = key
        with self.lock:
            if not e.live:
                return
            plan = None
            for p in self.plans:
                try:
                    if p.spec == spec:
                        plan = p
                        break
                except Exception:  # a constant whose == misbehaves: no fast path for it
                    return
            if plan is None:
                if self.plan_builds >= _MAX_PLAN_BUILDS:
                    return
                self.plan_builds += 1
                if type(spec) is int:
                    gather = _pt.make_gather((_pt.TENSOR,) * spec, ())
                else:
                    gather = _pt.make_gather(spec[0], spec[1], self.bound)
                if gather is None:
                    return
                plan = _Plan(spec, gather)
                self.plans = (self.plans + (plan,))[-_MAX_PLANS:]
            if len(plan.table) >= max(64, 2 * (self.maxsize or 0)):
                plan.table = {}  # dead entries pile up when signatures churn
            plan.table[(sigs, mode)] = e

    def lower(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> IR:
        """The IR the cached program for these arguments runs (compiled now if needed).

        A function that runs split at value reads has no single program: its tracing error is raised."""
        key, spec, tensors = self.key_of(args, kwargs)
        e = self.lookup(key, spec) or self.miss(key, spec, tensors)
        if e.ir is None:
            raise e.error
        return e.ir

    def last_run_attr(self, name: str) -> Any:
        """Attribute ``name`` of the most recent call's compiled program (e.g. its profile), or None."""
        e = self.last_entry
        return getattr(e.run, name, None) if e is not None else None

    def cache_info(self) -> CacheInfo:
        """Hits, misses, current size and bound of the program cache."""
        with self.lock:
            return CacheInfo(self.hits, self.misses, len(self.cache), self.maxsize)

    def cache_clear(self) -> None:
        """Drop every cached program and reset the statistics."""
        with self.lock:
            for e in self.cache.values():
                e.live = False
            self.cache.clear()
            self.plans = ()
            self.plan_builds = 0
            self.hits = 0
            self.misses = 0


def shadow_module(module: torch.nn.Module, memo: Optional[Dict[int, torch.nn.Module]] = None) -> torch.nn.Module:
    """A structural copy of ``module`` to trace on: own parameter/buffer/child dicts, shared tensors.

    Public to tn's other doors (``tn.adaptive`` traces its groups' programs
    on one). ``memo`` maps ``id`` of modules already copied to their copy
    (shared submodules are copied once); a fresh one is used when omitted.
    """
    return _shadow(module, {} if memo is None else memo)


def _shadow(module: torch.nn.Module, memo: Dict[int, torch.nn.Module]) -> torch.nn.Module:
    """A structural copy of ``module`` for tracing: own parameter/buffer/child dicts, shared tensors.

    The trace swaps parameters for tracer tensors in the copy, so the user's
    module is never touched (other threads may use it, eagerly or jitted,
    while a trace runs). Submodules are shadowed recursively (shared ones
    once, through ``memo``).
    """
    c = memo.get(id(module))
    if c is not None:
        return c
    c = copy.copy(module)
    memo[id(module)] = c
    d = c.__dict__
    d["_parameters"] = dict(module._parameters)
    d["_buffers"] = dict(module._buffers)
    d["_modules"] = {k: (_shadow(v, memo) if v is not None else None) for k, v in module._modules.items()}
    for k, v in d.items():  # lists of tensors (nn.RNN's _flat_weights) are updated in place on reassignment
        if type(v) is list:
            d[k] = list(v)
    return c


_TN_DIR = os.path.dirname(os.path.abspath(__file__))


def _caller() -> str:
    """``", called from file:line"`` of the first frame outside tn and torch, for log messages."""
    f = sys._getframe(1)
    while f is not None:
        fn = f.f_code.co_filename
        if not (fn.startswith(_TN_DIR) or os.sep + "torch" + os.sep in fn):
            return f", called from {os.path.basename(fn)}:{f.f_lineno}"
        f = f.f_back
    return ""


def _reparametrize(module: torch.nn.Module, named: Dict[str, Tensor]) -> Any:
    """Context manager: ``module``'s parameters and buffers replaced by ``named`` (tied weights kept tied)."""
    return _reparametrize_module(module, named, tie_weights=True, strict=False)


class JittedFunction:
    """A function compiled by :func:`jit`: call it like the original.

    ``cache_info()`` reports hits, misses and size of its program cache;
    ``cache_clear()`` empties it. Works as a method decorator too (the
    instance is then the first argument; an ``nn.Module`` instance
    contributes its parameters and buffers as inputs).
    """

    def __init__(self, fn: Callable, static_argnums: Any = (), static_argnames: Any = (),
                 backend: Any = None, cache_size: Optional[int] = DEFAULT_CACHE_SIZE, fullgraph: bool = False):
        self._core = _Core(fn, static_argnums, static_argnames, backend, cache_size, "tn.jit", fullgraph=fullgraph)
        functools.update_wrapper(self, fn)

    def __copy__(self) -> "JittedFunction":
        return self

    def __deepcopy__(self, memo: Dict[int, Any]) -> "JittedFunction":
        return self  # like a function: shared, with its cache

    def __reduce__(self) -> Any:
        # like a function: pickled by reference to its module-level name
        return self.__qualname__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _tls.depth:  # called while tracing another jitted function: inline
            return self._core.fn(*args, **kwargs)
        return self._core.call(args, kwargs)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        return types.MethodType(self, obj)

    @property
    def last_profile(self) -> Any:
        """The NeuronCore profile of the most recent call (``tn.lower.ExecProfile``), or None.

        ``None`` before the first call and on backends that do not model the chip (``"reference"``).
        """
        return self._core.last_run_attr("last_profile")

    @property
    def stats(self) -> Any:
        """Compile statistics of the most recent call's program (host-fallback ops, programs,
        instructions) from the backend, or None (e.g. on ``"reference"``)."""
        return self._core.last_run_attr("stats")

    def cache_info(self) -> CacheInfo:
        """Hits, misses, current size and bound (``maxsize``) of the program cache."""
        return self._core.cache_info()

    def cache_clear(self) -> None:
        """Drop every cached program and reset the statistics."""
        self._core.cache_clear()

    def lower(self, *args: Any, **kwargs: Any) -> IR:
        """The (optimised) IR this function runs for these arguments, compiling it if needed."""
        return self._core.lower(args, kwargs)

    def __repr__(self) -> str:
        return f"<tn.jit {self._core.name} backend={self._core.backend_name!r}>"


def _call_module(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Call ``module`` (with its hooks), as eager code would."""
    return module(*args, **kwargs)


class JittedModule:
    """An ``nn.Module`` compiled by :func:`jit`.

    Calling it runs the compiled program with the module's current parameters
    and buffers as inputs. Every other attribute (``parameters()``,
    ``state_dict()``, submodules, ``weight``...) is the wrapped module's;
    setting an attribute sets it on the module. ``forward`` is the jitted
    call; ``train()``/``eval()``/``to()`` return the wrapper. The wrapped module is ``.module``. It is not itself an
    ``nn.Module``: register the original module as a child, not the wrapper.
    """

    _own = frozenset({"_tn_core", "_tn_module", "_tn_options"})

    def __init__(self, module: torch.nn.Module, static_argnums: Any = (), static_argnames: Any = (),
                 backend: Any = None, cache_size: Optional[int] = DEFAULT_CACHE_SIZE, fullgraph: bool = False):
        object.__setattr__(self, "_tn_module", module)
        # Argument names and static args refer to forward's parameters (after self).
        holder: Callable[..., Any] = _call_module
        try:
            params = list(inspect.signature(type(module).forward).parameters.values())[1:]
        except (AttributeError, TypeError, ValueError):
            params = None
        if params is not None:
            def holder(*a: Any, **k: Any) -> Any:
                """Signature holder: forward's parameters after the module."""
            holder.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
                [inspect.Parameter("module", inspect.Parameter.POSITIONAL_ONLY)] + params)
        core = _Core(holder, static_argnums, static_argnames, backend, cache_size,
                     f"tn.jit({type(module).__name__})", bound=(module,), fullgraph=fullgraph)
        core.fn = _call_module
        core.name = f"{type(module).__name__} module"
        object.__setattr__(self, "_tn_core", core)
        object.__setattr__(self, "_tn_options", (static_argnums, static_argnames, backend, cache_size, fullgraph))

    def __deepcopy__(self, memo: Dict[int, Any]) -> "JittedModule":
        """A jitted deep copy of the module, same options, empty cache."""
        return JittedModule(copy.deepcopy(self._tn_module, memo), *self._tn_options)

    def __copy__(self) -> "JittedModule":
        """A new wrapper of the same module, same options, empty cache."""
        return JittedModule(self._tn_module, *self._tn_options)

    def __reduce__(self) -> Any:
        # pickles as "tn.jit(module, options)"; the compiled programs are not pickled
        return (JittedModule, (self._tn_module, *self._tn_options))

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped module."""
        return self._tn_module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _tls.depth:
            return self._tn_module(*args, **kwargs)
        return self._tn_core.call(args, kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The jitted call (as ``self(...)``), so code calling ``.forward`` is compiled too."""
        return self(*args, **kwargs)

    @property
    def last_profile(self) -> Any:
        """The NeuronCore profile of the most recent call (``tn.lower.ExecProfile``), or None.

        ``None`` before the first call and on backends that do not model the chip (``"reference"``).
        """
        return self._tn_core.last_run_attr("last_profile")

    @property
    def stats(self) -> Any:
        """Compile statistics of the most recent call's program (host-fallback ops, programs,
        instructions) from the backend, or None (e.g. on ``"reference"``)."""
        return self._tn_core.last_run_attr("stats")

    def cache_info(self) -> CacheInfo:
        """Hits, misses, current size and bound (``maxsize``) of the program cache."""
        return self._tn_core.cache_info()

    def cache_clear(self) -> None:
        """Drop every cached program and reset the statistics."""
        self._tn_core.cache_clear()

    def lower(self, *args: Any, **kwargs: Any) -> IR:
        """The (optimised) IR this module runs for these arguments, compiling it if needed."""
        return self._tn_core.lower(args, kwargs)

    def train(self, mode: bool = True) -> "JittedModule":
        """Set training mode on the module; returns the wrapper."""
        self._tn_module.train(mode)
        return self

    def eval(self) -> "JittedModule":
        """Set evaluation mode on the module; returns the wrapper."""
        self._tn_module.eval()
        return self

    def to(self, *args: Any, **kwargs: Any) -> "JittedModule":
        """``module.to(...)``; returns the wrapper."""
        self._tn_module.to(*args, **kwargs)
        return self

    def __getattr__(self, name: str) -> Any:
        if name in JittedModule._own:
            raise AttributeError(name)
        return getattr(self._tn_module, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._tn_module, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._tn_module, name)

    def __dir__(self) -> Iterable[str]:
        return sorted(set(dir(type(self))) | set(dir(self._tn_module)))

    def __repr__(self) -> str:
        return f"tn.jit({self._tn_module!r})"


def jit(fn: Any = None, *, static_argnums: Any = (), static_argnames: Any = (), backend: Any = None,
        cache_size: Optional[int] = DEFAULT_CACHE_SIZE, fullgraph: bool = False) -> Any:
    """Compile ``fn`` (a function or an ``nn.Module``) into a cached whole program.

    Usable as ``@tn.jit``, ``@tn.jit(static_argnums=..., ...)`` or
    ``tn.jit(module)``.

    Args:
        fn: the function or module.
        static_argnums: positions of arguments that are compile-time constants
            (hashable; each new value retraces).
        static_argnames: names of such arguments (positions and names are
            matched against each other through ``fn``'s signature).
        backend: a registered backend name (default :func:`default_backend`)
            or a ``compile_fn(ir) -> run`` callable.
        cache_size: how many programs to keep (LRU); ``None`` for unbounded.
        fullgraph: refuse (:class:`tn.TracingError`) a function that reads tensor values (``.item()``,
            ``nonzero``, ``if t:``) instead of running it split at the reads (see below), as
            ``torch.compile(fullgraph=True)`` refuses a graph break.

    A function whose trace reads a tensor value has no single program. On the
    ``neuron`` backend tn.jit then runs it, for that signature, on the device
    as eager windows split at the reads (the device's adaptive eager mode: the
    ops between two reads are compiled together by the same compiler, the
    value is read back, Python continues), so it gives eager's results with
    every op on the NeuronCore model; ``TN_LOG=splits`` logs where it split,
    ``lower()`` raises the tracing error, ``fullgraph=True`` or
    ``TN_JIT_SPLIT=0`` refuse. Other backends refuse.

    Returns:
        A :class:`JittedFunction` or :class:`JittedModule`.
    """
    if fn is None:
        return lambda f: jit(f, static_argnums=static_argnums, static_argnames=static_argnames,
                             backend=backend, cache_size=cache_size, fullgraph=fullgraph)
    if isinstance(fn, JittedModule):
        fn = fn.module
    if isinstance(fn, torch.nn.Module):
        return JittedModule(fn, static_argnums, static_argnames, backend, cache_size, fullgraph)
    if isinstance(fn, JittedFunction):
        fn = fn._core.fn
    if not callable(fn):
        raise ArgumentTypeError(f"tn.jit: expected a function or an nn.Module, got {type(fn).__name__} ({fn!r:.60})")
    return JittedFunction(fn, static_argnums, static_argnames, backend, cache_size, fullgraph)


def make_ir(fn: Any, static_argnums: Any = (), static_argnames: Any = ()) -> Callable[..., IR]:
    """``make_ir(fn, ...)(*args, **kwargs)`` is the IR of ``fn`` for those arguments.

    The IR is what ``tn.jit`` would run: traced, then optimised by the default
    passes. ``fn`` may be an ``nn.Module`` (its parameters and buffers are the
    first inputs). ``print(ir)`` shows a jaxpr-like listing.
    """
    if isinstance(fn, (JittedFunction, JittedModule)):
        fn = fn.module if isinstance(fn, JittedModule) else fn._core.fn
    if isinstance(fn, torch.nn.Module):
        core = JittedModule(fn, static_argnums, static_argnames, backend="reference", cache_size=1)._tn_core
    else:
        if not callable(fn):
            raise ArgumentTypeError(f"tn.make_ir: expected a function or an nn.Module, got {type(fn).__name__}")
        core = _Core(fn, static_argnums, static_argnames, "reference", 1, "tn.make_ir")

    @functools.wraps(fn if not isinstance(fn, torch.nn.Module) else type(fn).forward)
    def build(*args: Any, **kwargs: Any) -> IR:
        key, spec, tensors = core.key_of(args, kwargs)
        try:
            hash(key)
        except TypeError:
            core._raise_unhashable(spec)
            raise
        with _TRACE_LOCK:
            ir, _, _ = core.trace(spec, tensors)
        return ir

    return build


jit.register_backend = register_backend  # type: ignore[attr-defined]
jit.backends = backends  # type: ignore[attr-defined]
jit.default_backend = default_backend  # type: ignore[attr-defined]
jit.is_tracing = is_tracing  # type: ignore[attr-defined]
