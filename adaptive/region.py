# tn.adaptive.region: regions of a model and the groups of identical regions that share statistics and programs.
"""Regions and groups.

A :class:`Region` is a module whose ``forward`` the adaptive controller
dispatches. Regions whose modules have the same structure
(:func:`fingerprint`: classes, parameter and buffer shapes, Python
attributes) belong to one :class:`Group` (the blocks of a transformer): the
group holds the signature statistics, the compiled programs and the
bucketing decision, so one compile serves every block. A group's program
is one :func:`tn.jit` function of ``(parameters, training flags, args,
kwargs)`` over a private structural copy of the first member's module, so
each member calls it with its own parameters.

Each call computes the abstract signature of the arguments (tensor shapes,
dtypes, devices, ``requires_grad``; other leaves by value; grad mode; the
module's training flag), then either

* runs eager (:func:`run_eager`: the module's own PyTorch code on the
  NeuronCore model: on the ``neuron`` device as given when the model is
  there, moved there by :mod:`tn.adaptive.placement` when it lives on the
  CPU, unless the policy keeps it on the host), measuring the time per call (cold: the first eager call of a shape in
  the group; warm: later ones), or
* runs the group's program of the signature (or of its bucket, with inputs
  padded at the end of the bucketed dimensions and results sliced back; or,
  for a dimension the program grows by ``cat``, padded at the front, masked
  inside the program and narrowed back: :mod:`tn.bucketing`), or
* compiles it because the cost model of :mod:`tn.adaptive.policy` says it
  pays back.

Mutable state arguments (HF KV caches, :mod:`tn.adaptive.state`) are
flattened into the signature; the program builds proxies of them, and the
tensors the forward leaves in the proxies are extra program outputs written
back into the caller's objects after the call.

Under autograd a compiled call goes through :class:`_RegionFunction`: the
forward is the jitted forward, the backward a jitted vjp that recomputes the
forward and calls ``torch.autograd.grad`` inside the program.
"""
from __future__ import annotations

import collections
import gc
import logging
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.utils._pytree as _pytree
from torch.nn.utils.stateless import _reparametrize_module

from .. import config
from ..device.allocator import cpu_alias
from ..device.eager import to_device
from ..ir import CONSTANT_TYPES
from ..bucketing import Mixed, independent_axes, masked_axes, masked_program, same_program
from ..jit import backend_compile_fn, is_tracing, jit, make_ir, shadow_module
from ..pytree import OPAQUE, SLOT, FlattenRule, HashedTuple, flatten, module_state, unflatten
from . import state as _state
from .policy import Policy, bucket_size, expected_future, should_compile

__all__ = ["Region", "Group", "run_eager", "fingerprint"]

log = logging.getLogger("tn")

_PRIMITIVE = tuple(CONSTANT_TYPES)   # constants a region keys by value and passes to tn.jit as such

Tensor = torch.Tensor


def _tracing() -> bool:
    """True while tn.jit traces on this thread (regions met inside a trace are inlined)."""
    global _tracing
    _tracing = is_tracing
    return is_tracing()


def log_enabled() -> bool:
    """True when ``TN_LOG`` names ``adaptive`` (or ``all``): decisions are logged to logger ``"tn"``."""
    return config.log_enabled("adaptive")


_GC_SECONDS = {"cpu": 0.0, "wall": 0.0}  # time the cyclic garbage collector has run in this process
_GC_START: List[float] = [0.0, 0.0]


def _gc_callback(phase: str, info: dict) -> None:
    """``gc.callbacks`` hook: adds each collection's CPU and wall time to ``_GC_SECONDS``."""
    if phase == "start":
        _GC_START[0], _GC_START[1] = time.process_time(), time.perf_counter()
    else:
        _GC_SECONDS["cpu"] += time.process_time() - _GC_START[0]
        _GC_SECONDS["wall"] += time.perf_counter() - _GC_START[1]


def install_gc_clock() -> None:
    """Start counting garbage-collection time (idempotent).

    A full collection in a process holding torch and transformers takes
    ~100 ms. It lands in whatever region happens to run, where it would make
    a 0.3 ms compiled call look 300x slower and flip decisions; regions
    therefore exclude it from their measured times, as they exclude compiles.
    """
    if _gc_callback not in gc.callbacks:
        gc.callbacks.append(_gc_callback)


def gc_seconds(clock: Any) -> float:
    """Garbage-collection seconds so far on ``clock``'s scale (CPU time for ``time.process_time``, wall time for
    ``time.perf_counter``/``time.monotonic``; 0 for any other clock, e.g. a test's)."""
    if clock is time.process_time:
        return _GC_SECONDS["cpu"]
    if clock is time.perf_counter or clock is time.monotonic:
        return _GC_SECONDS["wall"]
    return 0.0


def run_eager(region: "Region", module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """Eager execution of a region: its PyTorch code op by op.

    This is the one place that decides what "eager" means: the code runs on
    the NeuronCore model. A call whose inputs and parameters are on the
    ``neuron`` device runs there as given (in the device's eager mode); a
    call of a model that lives on the CPU is moved there by the controller's
    :class:`tn.adaptive.placement.Placement` (parameters mirrored, inputs
    moved, results and in-place writes brought back; the device's windows
    when ``Policy.eager_windows``), unless ``Policy.eager_on`` keeps it on
    the host.
    """
    return region.ctl.placement.run(region, region.base_forward, module, args, kwargs)


def _host_views(tree: Any) -> Tuple[Any, Dict[int, Tensor]]:
    """``tree`` with every neuron-device tensor replaced by a CPU tensor on the same memory (no copy), and
    ``{id(alias): device tensor}``. The device's memory is host memory: programs read parameters and inputs in
    place and write mutations straight through (tn.jit's own route copies each input to the host and back)."""
    back: Dict[int, Tensor] = {}
    grad = torch.is_grad_enabled()

    def view(t: Any) -> Any:
        if isinstance(t, Tensor) and t.device.type == "neuron":
            a = None if grad else _cached_alias(t)
            if a is None:
                a = cpu_alias(t)
                if t.requires_grad:
                    a.requires_grad_(True)
                if not grad and isinstance(t, torch.nn.Parameter):
                    _cache_alias(t, a)
            back[id(a)] = t
            return a
        return t

    def walk(x: Any) -> Any:
        if isinstance(x, Tensor):
            return view(x)
        t = type(x)
        if t is tuple or t is list:
            return t(walk(e) for e in x)
        if t is dict:
            return {k: walk(v) for k, v in x.items()}
        if t in _LEAF_TYPES or _pytree.tree_is_leaf(x):
            return x
        return _pytree.tree_map(view, x)

    return walk(tree), back


_ALIASES: Dict[int, Tuple[Any, Tensor]] = {}  # id(parameter) -> (weakref to it, its CPU alias), for no-grad calls


def _cached_alias(t: Tensor) -> Optional[Tensor]:
    """The cached CPU alias of parameter ``t`` if it still views ``t``'s memory as ``t`` (else None).

    Parameters are aliased afresh on every call otherwise (~5 us each); the
    cache is used only with grad mode off, where the alias's ``requires_grad``
    flag never reaches an autograd graph. ``.data`` assignment or a move is
    caught by comparing pointer, sizes, strides and dtype.
    """
    hit = _ALIASES.get(id(t))
    if hit is None:
        return None
    ref, a = hit
    if ref() is not t or a.data_ptr() != t.data_ptr() or a.dtype != t.dtype or a.shape != t.shape \
            or a.stride() != t.stride() or a.requires_grad != t.requires_grad:
        del _ALIASES[id(t)]
        return None
    return a


def _cache_alias(t: Tensor, a: Tensor) -> None:
    """Remember ``a`` as the CPU alias of parameter ``t`` (entries of dead parameters are dropped as it grows)."""
    if len(_ALIASES) >= 4096:
        for k in [k for k, (r, _) in _ALIASES.items() if r() is None]:
            del _ALIASES[k]
        if len(_ALIASES) >= 4096:
            _ALIASES.clear()
    _ALIASES[id(t)] = (weakref.ref(t), a)


def _on_host(fn, call: tuple) -> Any:
    """``fn(*call)`` on host views of the neuron-device tensors of ``call``; tensor results come back on the
    device (a result that is an input comes back as that input)."""
    host, back = _host_views(call)
    out = fn(*host)
    if not back:
        return out
    def put(o: Any) -> Any:
        if not isinstance(o, Tensor):
            return o
        d = back.get(id(o))
        if d is not None:
            return d
        return to_device(o) if o.device.type == "cpu" else o

    if type(out) is tuple and len(out) == 2 and isinstance(out[1], _OutStruct):
        return tuple(put(o) for o in out[0]), out[1]
    return [put(o) for o in out]


def _module_state(module: torch.nn.Module):
    return module_state(module)


# ------------------------------------------------------------------ structure

_SKIP_ATTRS = frozenset({"_parameters", "_buffers", "_modules", "training", "_tn_region",
                         "_non_persistent_buffers_set"})


def _fp_value(v: Any, depth: int = 0) -> Any:
    """A hashable stand-in of an attribute value: by value for plain data, by identity otherwise."""
    if isinstance(v, _PRIMITIVE) or v is None:
        return (type(v).__name__, v) if not isinstance(v, slice) else ("slice", v.start, v.stop, v.step)
    if depth < 4 and isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_fp_value(x, depth + 1) for x in v))
    if depth < 4 and isinstance(v, (set, frozenset)):
        try:
            return ("set", frozenset(_fp_value(x, depth + 1) for x in v))
        except TypeError:
            return ("id", id(v))
    if depth < 4 and isinstance(v, dict):
        return ("dict", tuple((_fp_value(k, depth + 1), _fp_value(x, depth + 1)) for k, x in v.items()))
    return ("id", id(v))


def fingerprint(module: torch.nn.Module) -> Any:
    """What makes two modules run the same program up to parameter values.

    Per submodule (in ``named_modules()`` order): its name and class, its
    parameter and buffer names, shapes, dtypes and ``requires_grad``, and
    every other attribute (plain data by value, other objects such as a
    shared config or a hook by identity). Training flags are left out: they
    are part of each call's signature.
    """
    items = []
    for name, m in module.named_modules():
        cls = getattr(type(m), "_tn_adaptive_base", type(m))
        ps = tuple((k, None if p is None else (tuple(p.shape), p.dtype, p.requires_grad, p.device.type))
                   for k, p in m._parameters.items())
        bs = tuple((k, None if b is None else (tuple(b.shape), b.dtype, b.device.type))
                   for k, b in m._buffers.items())
        attrs = tuple((k, _fp_value(v)) for k, v in sorted(m.__dict__.items()) if k not in _SKIP_ATTRS)
        items.append((name, cls, ps, bs, attrs))
    return tuple(items)


class _Unsupported(Exception):
    pass


_LEAF_TYPES = CONSTANT_TYPES


class _RegionRule(FlattenRule):
    """How a region flattens a call (:func:`tn.pytree.flatten`'s walk with this rule): Python constants and other
    leaves are kept as leaves (``SLOT``: the signature keys them by value and buckets sizes), and a mutable state
    object (:mod:`tn.adaptive.state`) is opened: its ``n`` tensors are leaves, its spec ``(OPAQUE, spec, n)``, and
    ``(object, first leaf, n, spec)`` is appended to ``states`` when given."""

    __slots__ = ("states",)

    def __init__(self, states: Optional[list]):
        self.states = states

    def constant(self, x: Any, t: type, out: list) -> Any:
        out.append(x)
        return SLOT

    def before_node(self, x: Any, t: type, out: list) -> Any:
        if not _state.is_state(x):
            return None
        first = len(out)
        try:
            sspec = _state.flatten(x, out)
        except _state.StateError as e:
            raise _Unsupported(str(e)) from None
        n = len(out) - first
        if self.states is not None:
            self.states.append((x, first, n, sspec))
        return (OPAQUE, sspec, n)

    def leaf(self, x: Any, t: type, out: list) -> Any:
        out.append(x)
        return SLOT


_NO_STATES = _RegionRule(None)


def _flatten(x: Any, out: list, states: Optional[list] = None) -> Any:
    """Spec of the pytree ``x`` (hashable); its leaves (tensors, constants, other leaves and the tensors of state
    objects) are appended to ``out`` in ``torch.utils._pytree`` order: :func:`tn.pytree.flatten` with the
    region's rule (:class:`_RegionRule`)."""
    return flatten(x, out, _RegionRule(states) if states is not None else _NO_STATES)


def _state_arg(spec: Any, it) -> Any:
    """A state object's node (``(OPAQUE, spec, n)``) as a :class:`tn.adaptive.state.StateArg` of its tensors."""
    return _state.StateArg(spec[1], [next(it) for _ in range(spec[2])])


def _unflatten(spec: Any, it) -> Any:
    """The pytree of ``spec`` (from :func:`_flatten`) with leaves taken from iterator ``it`` (a state object
    comes back as a :class:`tn.adaptive.state.StateArg` of its tensors, which the program turns into a proxy)."""
    return unflatten(spec, it, [], opaque=_state_arg)


def _args_of(leaves: list, spec: Any) -> Tuple[tuple, dict]:
    return _unflatten(spec, iter(leaves))


class _OutStruct:
    """How a program's result pytree is rebuilt from its tensors (a static leaf of the jitted program), and
    what it did to the state objects among its arguments (post-call specs; None: left as it was)."""

    __slots__ = ("spec", "leaves", "n_out", "posts", "state_refs")

    def __init__(self, spec: Any, leaves: list, posts: Tuple[Any, ...] = (), proxies: Tuple[Any, ...] = ()):
        self.spec = spec
        self.leaves = [_TENSOR_SLOT if isinstance(l, Tensor) else l for l in leaves]  # a None leaf stays None
        self.n_out = sum(1 for l in self.leaves if l is _TENSOR_SLOT)
        self.posts = posts
        # a result leaf that is a state proxy (HF returns the cache it was given): the caller's object instead
        where = {id(p): k for k, p in enumerate(proxies)}
        self.state_refs = tuple((j, where[id(l)]) for j, l in enumerate(leaves) if id(l) in where)
        for j, _ in self.state_refs:
            self.leaves[j] = _STATE_REF

    def rebuild(self, tensors: list, states: Optional[list] = None, leaves: Optional[list] = None) -> Any:
        """The result pytree with ``tensors`` in the places of its tensor leaves; the tensors after the
        result's are written back into the caller's state objects ``states`` (from :func:`_flatten`; ``leaves``
        are the call's leaves, holding each object's tensors before the call)."""
        if self.posts:
            it = iter(tensors[self.n_out:])
            dev = next((t.device for t in tensors if t.device.type != "cpu"), None)
            for (obj, first, n, _), post in zip(states or (), self.posts):
                if post is not None:
                    _state.write_back(obj, post, it, leaves[first:first + n], dev)
            tensors = tensors[:self.n_out]
        leaves_out = self.leaves
        if self.state_refs:
            leaves_out = list(leaves_out)
            for j, k in self.state_refs:
                leaves_out[j] = states[k][0]
        elif self.spec.is_leaf():  # a region returning one tensor (Linear, LayerNorm, MLP ...)
            return tensors[0] if leaves_out[0] is _TENSOR_SLOT else leaves_out[0]
        it = iter(tensors)
        return _pytree.tree_unflatten([next(it) if l is _TENSOR_SLOT else l for l in leaves_out], self.spec)


_STATE_REF = object()  # placeholder of a state object in a result (replaced by the caller's object)
_TENSOR_SLOT = object()  # placeholder of a tensor in a result (filled from the program's outputs)


def _proxies(x: Any, found: list) -> Any:
    """``x`` with each :class:`StateArg` replaced by a proxy object built from its (traced) tensors; ``found``
    collects ``(proxy, StateArg)`` in order."""
    t = type(x)
    if t is _state.StateArg:
        proxy = _state.build(x.spec, iter(x.tensors))
        found.append((proxy, x))
        return proxy
    if t is tuple or t is list:
        return t(_proxies(e, found) for e in x)
    if t is dict:
        return {k: _proxies(v, found) for k, v in x.items()}
    return x


class SigStats:
    """Statistics of one signature (or bucket) in a group."""

    __slots__ = ("count", "cold_n", "cold_s", "warm_n", "warm_s", "comp_n", "comp_s", "state", "reason",
                 "frac_cc", "child_comp", "refused")

    def __init__(self) -> None:
        self.count = 0
        self.cold_n = self.warm_n = self.comp_n = 0
        self.cold_s = self.warm_s = self.comp_s = 0.0
        self.state = "eager"  # eager | compiled | slower
        self.reason: Any = ""
        self.frac_cc = 0.0  # share of the eager time spent in live child regions (moving average)
        self.child_comp = 0.0  # compile time the child regions called per call stand for (moving average)
        self.refused: Optional[str] = None


class _Bucketing:
    """How a group pads: the independent groups of (leaf, axis), the output axes carrying each, and which
    groups are padded at the front with masks (:mod:`tn.bucketing`) instead of at the end (all of them
    by one pad count, so their positions stay aligned)."""

    def __init__(self, pattern: Any, groups: List[Tuple[Tuple[int, int], ...]],
                 out_axes: List[List[Optional[Tuple[Tuple[int, int], ...]]]], ir: Any, ckey: Any,
                 masked: Optional[List[bool]] = None):
        self.pattern = pattern
        self.groups = groups
        self.out_axes = out_axes
        self.ir = ir  # the IR the proof was made on (compared with each bucket's program)
        self.ckey = ckey
        self.positions = [p for g in groups for p in g]
        self.masked = list(masked) if masked is not None else [False] * len(groups)
        self.masked_at = {p for g, m in zip(groups, self.masked) if m for p in g}  # (leaf, axis) padded in front


class _BucketRefused(Exception):
    """The program traced at a bucket's size is not the analysed one (``why``): the group stops bucketing."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


class _RegionFunction(torch.autograd.Function):
    """Autograd through a compiled region: jitted forward, jitted vjp (recomputing the forward) as backward."""

    @staticmethod
    def forward(ctx, group, call, *tensors):  # type: ignore[override]
        touts, call["out"] = group.run(call["params"], call["flags"], call["args"], call["kwargs"])
        ctx.group = group
        ctx.call = call
        ctx.mark_non_differentiable(*[t for t in touts if not (t.is_floating_point() or t.is_complex())])
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in touts]
        return tuple(touts)

    @staticmethod
    def backward(ctx, *gys):  # type: ignore[override]
        call = ctx.call
        gys = [g if g is not None else torch.zeros(s, dtype=d, device=dev)
               for g, (s, d, dev) in zip(gys, ctx.shapes)]
        grads = _on_host(ctx.group.vjp(), (call["params"], call["flags"], call["args"], call["kwargs"], gys))
        return (None, None) + tuple(grads)


def _structure(key: Any) -> Any:
    """What a signature keeps when its sizes change: the pytree spec, per tensor leaf its dtype, device,
    requires_grad and rank, the Python constants, grad mode and training flag."""
    return (key[0], tuple((p[1:], len(p[0])) if p[0] != "v" else p for p in key[1]), key[2], key[3])


def _masked_out_axes(ir, ins: Dict[int, int]) -> List[Optional[Tuple[Tuple[int, int], ...]]]:
    """:func:`tn.adaptive.masked_axes` in the ``[(axis, inner)]`` form of the prefix analysis."""
    return [None if a is None else ((a, 1),) for a in masked_axes(ir, ins)]


def _mean(s: float, n: int) -> Optional[float]:
    return s / n if n else None


class Group:
    """Regions of identical structure: shared signature statistics, programs and bucketing."""

    def __init__(self, ctl: Any, first: "Region"):
        self.ctl = ctl
        self.policy: Policy = ctl.policy
        self.first = first
        self.name = first.name
        self.members: List["Region"] = []
        self.base_forward = first.base_forward
        self.sigs: "collections.OrderedDict[Any, SigStats]" = collections.OrderedDict()
        self.compiled: "collections.OrderedDict[Any, None]" = collections.OrderedDict()
        self.eager_keys: "collections.OrderedDict[Any, None]" = collections.OrderedDict()
        self.bucketing: Optional[_Bucketing] = None
        self.bucket_refused: Optional[str] = None
        self.analyses: Dict[Any, Any] = {}
        self.compile_n = self.cold_n = self.warm_n = self.ratio_n = 0
        self.compile_s = self.cold_s = self.warm_s = self.ratio_sum = 0.0
        self.frac_cc = 0.0
        self.child_comp = 0.0
        self._template = None
        self._tmods = None
        self._jf = None
        self._jf_masked = None
        self._mask_axes: Dict[int, int] = {}
        self._mask_check: Any = None
        self._vjp = None

    # -- programs ----------------------------------------------------------
    def template(self) -> torch.nn.Module:
        """The private structural copy of the first member's module the programs are traced on."""
        if self._template is None:
            self._template = shadow_module(self.first.module)
            self._tmods = list(_module_state(self._template).mods)
        return self._template

    def call_template(self, params: Dict[str, Tensor], flags: tuple, args: tuple, kwargs: dict) -> Any:
        """Run the region's forward on the template with ``params`` and training ``flags`` (traced)."""
        t = self.template()
        for m, f in zip(self._tmods, flags):
            m.training = f
        with _reparametrize_module(t, params, tie_weights=True, strict=False):
            return self.base_forward(t, *args, **kwargs)

    def _program(self, params, flags, args, kwargs, *extra):
        # extra: inputs the program does not read (the front-pad count of a masked bucket)
        found: list = []
        args, kwargs = _proxies((args, kwargs), found)
        out = self.call_template(params, flags, args, kwargs)
        leaves, spec = _pytree.tree_flatten(out)
        touts = [l for l in leaves if isinstance(l, Tensor)]
        posts = []
        for proxy, sa in found:  # what the forward did to each state object: new tensors are outputs too
            post = _state.flatten(proxy, touts, sa.tensors)
            posts.append(None if _state.unchanged(sa.spec, post) else post)
        return tuple(touts), _OutStruct(spec, leaves, tuple(posts) if any(p is not None for p in posts) else (),
                                        tuple(p for p, _ in found))

    def jf(self):
        """The group's jitted program: ``(params, flags, args, kwargs) -> (result tensors, _OutStruct)``."""
        if self._jf is None:
            self.template()
            self._jf = jit(self._program, static_argnums=(1,), backend=self.ctl.backend,
                           cache_size=self.policy.cache_size, fullgraph=True)
        return self._jf

    def run(self, params, flags, args, kwargs) -> Tuple[tuple, "_OutStruct"]:
        """Run the program (compiling it on a jit cache miss): ``(result tensors, how to rebuild the result)``."""
        touts, struct = _on_host(self.jf(), (params, flags, args, kwargs))
        return touts, struct

    def run_masked(self, params, flags, args, kwargs, pad: float, input_axes: Dict[int, int], check):
        """Run the masked program of a front-padded bucket (``pad`` positions in front of the dims at
        ``input_axes``, program input index -> axis), compiling it on a miss: like :meth:`run`. A compile
        first asks ``check(ir without the pad input)`` whether the traced program is the analysed one
        (None), else raises :class:`_BucketRefused` with its answer."""
        if self._jf_masked is None:
            def masked_neuron(ir):
                """compile_fn: check the bucket's program, mask its padded positions (tn.bucketing), then
                the group's backend."""
                why = self._mask_check(ir.replace(inputs=ir.inputs[:-1]))
                if why is not None:
                    raise _BucketRefused(why)
                mir, _ = masked_program(ir, self._mask_axes, len(ir.inputs) - 1)
                return self._backend_compile(mir)

            self.template()
            self._jf_masked = jit(self._program, static_argnums=(1,), backend=masked_neuron,
                                  cache_size=self.policy.cache_size, fullgraph=True)
        self._mask_axes = input_axes
        self._mask_check = check
        p = torch.tensor(float(pad), dtype=torch.float32)
        return _on_host(self._jf_masked, (params, flags, args, kwargs, p))

    def _backend_compile(self, ir):
        return backend_compile_fn(self.ctl.backend, "tn.adaptive")(ir)

    def lower(self, params, flags, args, kwargs):
        """The IR of the program for these arguments (compiled now on a jit cache miss)."""
        (hp, ha, hk), _ = _host_views((params, args, kwargs))
        return self.jf().lower(hp, flags, ha, hk)

    def vjp(self):
        """The jitted vjp: ``(params, flags, args, kwargs, cotangents) -> grads`` of the inputs and
        parameters that require grad (in that order)."""
        if self._vjp is None:
            def region_vjp(params, flags, args, kwargs, gys):
                """vjp of the region's forward at (args, kwargs) for output cotangents gys."""
                with torch.enable_grad():
                    out = self.call_template(params, flags, args, kwargs)
                outs = [t for t in _pytree.tree_leaves(out) if isinstance(t, Tensor)]
                targets = [t for t in _pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor) and t.requires_grad]
                targets += [p for p in params.values() if p.requires_grad]
                pairs = [(o, g) for o, g in zip(outs, gys) if o.requires_grad]
                grads = torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs], allow_unused=True)
                return [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, targets)]

            self.template()
            self._vjp = jit(region_vjp, static_argnums=(1,), backend=self.ctl.backend,
                            cache_size=self.policy.cache_size, fullgraph=True)
        return self._vjp

    def trace_ir(self, params, flags, args, kwargs):
        """The optimised IR of the program for these arguments (traced, not compiled)."""
        return make_ir(self._program, static_argnums=(1,))(params, flags, args, kwargs)

    # -- statistics ------------------------------------------------------------
    def stats(self, key: Any) -> SigStats:
        st = self.sigs.get(key)
        if st is None:
            st = SigStats()
            self.sigs[key] = st
            if len(self.sigs) > self.policy.max_signatures:
                old, _ = self.sigs.popitem(last=False)
                self.compiled.pop(old, None)
        else:
            self.sigs.move_to_end(key)
        return st

    def note_eager(self, st: SigStats, key: Any, dt: float, frac_cc: float, child_comp: float) -> None:
        """Record an eager call run at signature ``key`` (cold: the first of that shape in the group)."""
        if key in self.eager_keys:
            self.eager_keys.move_to_end(key)
            st.warm_n += 1
            st.warm_s += dt
            self.warm_n += 1
            self.warm_s += dt
        else:
            self.eager_keys[key] = None
            if len(self.eager_keys) > self.policy.max_signatures:
                self.eager_keys.popitem(last=False)
            st.cold_n += 1
            st.cold_s += dt
            self.cold_n += 1
            self.cold_s += dt
        if st.cold_n + st.warm_n == 1:
            st.frac_cc, st.child_comp = frac_cc, child_comp
        else:
            st.frac_cc, st.child_comp = 0.5 * (st.frac_cc + frac_cc), 0.5 * (st.child_comp + child_comp)
        if self.cold_n + self.warm_n == 1:
            self.frac_cc, self.child_comp = frac_cc, child_comp
        else:
            self.frac_cc = 0.9 * self.frac_cc + 0.1 * frac_cc
            self.child_comp = 0.9 * self.child_comp + 0.1 * child_comp

    def split(self, st: SigStats) -> Tuple[float, float]:
        """``(share of eager time in child regions, compile time they stand for)`` of a signature, else of the
        group's recent calls."""
        if st.cold_n + st.warm_n:
            return st.frac_cc, st.child_comp
        return self.frac_cc, self.child_comp

    def pad_eager(self) -> bool:
        """True when eager calls should run padded to their bucket: a shape new to the group costs much more
        than a known one (on the neuron device the first call of a shape compiles one-op programs), so
        sharing the bucket's shape keeps eager calls warm."""
        return (self.cold_n > 0 and self.warm_n > 0
                and self.cold_s / self.cold_n > 1.5 * self.warm_s / self.warm_n)

    def eager_key(self, key: Any, bkey: Any, pads: Optional[list]) -> Any:
        """The signature an eager call of ``key`` (bucket ``bkey``) runs at: padded when that keeps it warm
        (never for a masked bucket: eager code would not mask the padding)."""
        if pads and self.bucketing is not None and any((i, d) in self.bucketing.masked_at for i, d, _, _ in pads):
            return key
        if pads and key not in self.eager_keys and self.pad_eager():
            return bkey
        return key

    def compile_equiv(self, warm: Optional[float]) -> float:
        """Compile time one call of this group stands for (what a parent region compiling it inlines)."""
        if self.compile_n:
            return self.compile_s / self.compile_n
        return self.ctl.compile_estimate(warm or 0.0)

    def warm_estimate(self, st: SigStats) -> Optional[float]:
        """Expected warm eager time of a signature: measured, else scaled from its cold time, else the group's."""
        if st.warm_n:
            return st.warm_s / st.warm_n
        gw, gc = _mean(self.warm_s, self.warm_n), _mean(self.cold_s, self.cold_n)
        if st.cold_n:
            c = st.cold_s / st.cold_n
            return c * min(1.0, gw / gc) if gw is not None and gc else c
        return gw if gw is not None else gc

    def cold_estimate(self, st: SigStats, warm: float) -> float:
        """Expected eager time of a shape the group never ran eager (one-op programs to compile on the device)."""
        if st.cold_n:
            return st.cold_s / st.cold_n
        gc = _mean(self.cold_s, self.cold_n)
        return max(gc, warm) if gc is not None else warm

    def ratio(self) -> float:
        """Compiled/eager time ratio: measured in the group, else across the model, else the prior."""
        if self.ratio_n:
            return self.ratio_sum / self.ratio_n
        return self.ctl.ratio_estimate()

    def compile_estimate(self, warm: float, st: Optional[SigStats] = None, on_device: bool = False) -> float:
        """Expected compile time: the group's mean, else what its child regions stand for plus the model's compile
        seconds per second of eager time for the rest, else the prior. ``on_device``: the call's tensors are on
        the neuron device, so a cold eager call there compiled one-op programs (see below) even when no warm
        call measured how dear that was."""
        if self.compile_n:
            return self.compile_s / self.compile_n
        frac, child_comp = self.split(st) if st is not None else (0.0, 0.0)
        if child_comp:
            return child_comp + self.ctl.compile_estimate(warm * (1.0 - frac))
        est = self.ctl.compile_estimate(warm)
        if not self.ctl.compile_rate_e and self.cold_n and (self.pad_eager() or (on_device and not self.warm_n)):
            # nothing compiled yet, but a shape's first eager call here compiles one-op programs for each of its
            # ops: compiling the whole region costs about as much (measured: 0.5-2x on the neuron device)
            est = min(est, 2.0 * self.cold_s / self.cold_n)
        return est

    # -- buckets -------------------------------------------------------------------
    def pattern(self, key, positions) -> Any:
        spec, parts, grad, training = key[:4]
        parts = list(parts)
        for (i, d) in positions:
            if i >= len(parts) or parts[i][0] == "v" or d >= len(parts[i][0]):
                return None  # another structure (a state object with fewer tensors): not this bucketing
            shape = list(parts[i][0])
            shape[d] = None
            parts[i] = (tuple(shape),) + parts[i][1:]
        return (spec, tuple(parts), grad, training)

    def bucket_of(self, key) -> Tuple[Optional[list], Any]:
        """``(pads, bucket key)`` of a call; pads ``[(leaf, axis, n, bucket)]``; (None, key) when not bucketed."""
        b = self.bucketing
        if self.pattern(key, b.positions) != b.pattern:
            return None, key
        spec, parts, grad, training = key
        parts = [list(p) for p in parts]
        pads = []
        front = None  # the pad count of the masked groups (one for all: their positions stay aligned)
        for g, m in zip(b.groups, b.masked):
            sizes = {key[1][i][0][d] for (i, d) in g}
            if len(sizes) != 1:
                return None, key
            n = sizes.pop()
            if m and front is not None:
                bs = n + front
            else:
                bs = bucket_size(self.policy, n, m)
                if bs is None:
                    return None, key
                if m:
                    front = bs - n
            for (i, d) in g:
                shape = list(parts[i][0])
                shape[d] = bs
                parts[i][0] = tuple(shape)
                if bs != n or m:  # a masked bucket runs its masked program even when nothing is padded
                    pads.append((i, d, n, bs))
        return pads, HashedTuple((spec, tuple(tuple(p) for p in parts), grad, training))


class Region:
    """One adaptive region: the module, its signature counts, counters, and its group."""

    def __init__(self, controller: Any, name: str, module: torch.nn.Module, base_forward: Any):
        self.ctl = controller
        self.policy: Policy = controller.policy
        self.name = name
        self.module = module
        self.base_forward = base_forward
        self.group: Group = None  # type: ignore[assignment]  (set by the controller)
        self.seen: "collections.OrderedDict[Any, int]" = collections.OrderedDict()
        self._raw: "collections.OrderedDict[Any, Any]" = collections.OrderedDict()  # signature -> its structure
        self.window: "collections.deque" = collections.deque(maxlen=self.policy.churn_window)
        self.repeats: "collections.deque" = collections.deque(maxlen=self.policy.churn_window)
        self.n_repeats = 0
        self.class_reps: "collections.OrderedDict[Any, list]" = collections.OrderedDict()  # structure -> [deque, n]
        # recent calls: 0 eager, 1 compiled, 2 compiled padded, 3 eager padded
        self.modes: "collections.deque" = collections.deque(maxlen=self.policy.churn_window)
        self.dead: Optional[str] = None
        self.reason: Any = "new: runs eager while it records signatures"
        self.calls = self.compiles = self.hits = self.padded = self.distinct = 0
        self.eager_s = self.compiled_s = self.compile_s = 0.0
        self.eager_host: Optional[str] = None  # why eager calls of a host model fell back to the host, if they did
        self.eager_device_us = 0.0  # modelled µs of the programs run during its eager calls moved to the device
        self.eager_device_programs = 0

    def __deepcopy__(self, memo: Dict[int, Any]) -> "Region":
        # a copied model shares the region; the region inlines calls on modules other than its own
        return self

    def __copy__(self) -> "Region":
        return self

    # -- bookkeeping --------------------------------------------------------
    def _decide(self, msg: Any) -> None:
        self.reason = msg
        if log_enabled():
            log.warning("tn.adaptive: %s: %s", self.name, msg() if callable(msg) else msg)

    def _cost(self, kind: str, measured: float) -> float:
        c = self.policy.injected(kind, self.name)
        return measured if c is None else float(c)

    def signature(self, mod: torch.nn.Module, args: tuple, kwargs: dict):
        """``(key, leaves, spec, states)`` of a call; raises _Unsupported for a leaf tn.jit cannot take.
        ``states`` lists the mutable state objects among the arguments (see :func:`_flatten`)."""
        leaves: list = []
        states: list = []
        spec = _flatten((args, kwargs), leaves, states)
        parts = []
        for i, l in enumerate(leaves):
            if isinstance(l, Tensor):
                parts.append((tuple(l.shape), l.dtype, l.device.type, l.requires_grad))
            elif isinstance(l, _PRIMITIVE):
                parts.append(("v", type(l).__name__, l))
            else:
                raise _Unsupported(f"argument leaf {i} is a {type(l).__name__} (not a tensor, pytree or Python "
                                   f"constant): tn.jit cannot take it")
        return HashedTuple((spec, tuple(parts), torch.is_grad_enabled(), mod.training)), leaves, spec, states

    def recurrence(self, cls: Any = None) -> float:
        """Share of the region's recent calls whose signature (or bucket) it had seen before; with ``cls`` (a
        call structure, :func:`_structure`), of its recent calls of that structure once it has two: a
        generation's prompt (a new length each time) does not recur however often its decode steps do."""
        c = self.class_reps.get(cls) if cls is not None else None
        if c is not None and len(c[0]) >= 2:
            return c[1] / len(c[0])
        n = len(self.repeats)
        return self.n_repeats / n if n else 0.0

    def _note_repeat(self, cls: Any, rep: bool) -> None:
        if len(self.repeats) == self.repeats.maxlen:
            self.n_repeats -= self.repeats[0]
        self.repeats.append(rep)
        self.n_repeats += rep
        c = self.class_reps.get(cls)
        if c is None:
            c = self.class_reps[cls] = [collections.deque(maxlen=self.policy.churn_window), 0]
            if len(self.class_reps) > self.policy.max_signatures:
                self.class_reps.popitem(last=False)
        else:
            self.class_reps.move_to_end(cls)
        if len(c[0]) == c[0].maxlen:
            c[1] -= c[0][0]
        c[0].append(rep)
        c[1] += rep

    # -- the call -----------------------------------------------------------
    def dispatch(self, mod: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """Run one call of the region: eager, compiled, padded-compiled, or compile now."""
        if mod is not self.module or _tracing():
            return self.base_forward(mod, *args, **kwargs)  # a tracing copy: inline
        self.calls += 1
        if self.dead is not None:
            return self._eager(None, None, args, kwargs)
        try:
            key, leaves, spec, states = self.signature(mod, args, kwargs)
        except _Unsupported as e:
            self._give_up(str(e))
            return self._eager(None, None, args, kwargs)
        pol = self.policy
        g = self.group
        self.window.append(key)
        raw = self._raw
        cls = raw.get(key)  # the call's structure (:func:`_structure`), computed once per signature
        if cls is not None:
            raw.move_to_end(key)
        else:
            cls = raw[key] = _structure(key)
            self.distinct += 1
            if len(raw) > pol.max_signatures:
                raw.popitem(last=False)
            if (g.bucketing is None and g.bucket_refused is None and pol.bucket is not None
                    and len(self.window) >= pol.churn_distinct and len(set(self.window)) >= pol.churn_distinct):
                self._try_bucketing(key, leaves, args, kwargs)
        pads = None
        bkey = key
        if g.bucketing is not None:
            pads, bkey = g.bucket_of(key)
        seen = self.seen.get(bkey, 0)
        rep = seen > 0
        self.seen[bkey] = seen + 1
        if rep:
            self.seen.move_to_end(bkey)
        elif len(self.seen) > pol.max_signatures:
            self.seen.popitem(last=False)
        self._note_repeat(cls, rep)
        st = g.stats(bkey)
        st.count += 1
        needs_grad = torch.is_grad_enabled() and (
            any(isinstance(l, Tensor) and l.requires_grad for l in leaves)
            or any(p.requires_grad for p in mod.parameters()))
        if needs_grad:
            why = self._autograd_blocker(mod) if not states else (
                "runs under autograd with a mutable state argument (a cache): eager")
            if why is not None:
                st.reason = self.reason = why
                return self._eager(st, key, args, kwargs)
        call = (leaves, spec, states, args, kwargs)
        if st.state == "compiled":
            return self._compiled(bkey, st, call, pads, needs_grad)
        ekey = key if states else g.eager_key(key, bkey, pads)  # state is never padded eager (it would be stored)
        if st.state == "eager" and st.refused is None and self._pays_back(st, ekey, seen + 1, cls):
            return self._compile(bkey, st, key, call, pads, needs_grad)
        if ekey is not key:
            return self._eager(st, ekey, args, kwargs, (leaves, spec, pads))
        return self._eager(st, key, args, kwargs)

    def _autograd_blocker(self, mod: torch.nn.Module) -> Optional[str]:
        """Why a call under autograd must run eager, or None.

        The backward recomputes the forward inside a jitted vjp, so a region
        that draws random numbers (dropout in training mode) or updates
        buffers in training mode (BatchNorm statistics) would see a different
        mask or update its buffers twice: such calls stay eager.
        """
        if not self.policy.autograd:
            return "runs under autograd and policy autograd=False: eager"
        if mod.training:
            for sub in mod.modules():
                if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.p > 0:
                    return "training with dropout under autograd (the vjp would redraw the mask): eager"
            if any(True for _ in mod.buffers()):
                return "training with buffers under autograd (the vjp would update them twice): eager"
        return None

    def _eager(self, st: Optional[SigStats], key: Any, args: tuple, kwargs: dict, padded=None) -> Any:
        """Run eager (``padded=(leaves, spec, pads)``: at the bucket's shape, results sliced back)."""
        ctl = self.ctl
        clock = self.policy.clock
        frames = ctl.frames()
        frame = [0.0, 0.0, 0.0]  # live child regions inside this call: [compiled s, eager s, compile-equivalent s]
        frames.append(frame)
        x0 = ctl.excluded_s(clock)
        t0 = clock()
        try:
            if padded is None:
                out = run_eager(self, self.module, args, kwargs)
            else:
                leaves, spec, pads = padded
                pargs, pkwargs = _args_of(self._padded(leaves, pads, host=False), spec)
                out = run_eager(self, self.module, pargs, pkwargs)
                oleaves, ospec = _pytree.tree_flatten(out)
                touts = self._sliced([l for l in oleaves if isinstance(l, Tensor)], pads)
                it = iter(touts)
                out = _pytree.tree_unflatten([next(it) if isinstance(l, Tensor) else l for l in oleaves], ospec)
        finally:
            frames.pop()
        # compiles of inner regions and garbage collections during this call are not eager time of this region
        dt = self._cost("eager", clock() - t0 - (ctl.excluded_s(clock) - x0))
        self.eager_s += dt
        self.modes.append(0 if padded is None else 3)
        if padded is not None:
            self.padded += 1
        g = self.group
        if st is not None:
            g.note_eager(st, key, dt, min(1.0, (frame[0] + frame[1]) / dt) if dt > 0 else 0.0, frame[2])
        if frames and self.dead is None:
            parent = frames[-1]
            parent[1] += dt
            parent[2] += g.compile_equiv(dt)
        return out

    def _pays_back(self, st: SigStats, key: Any, seen: int, cls: Any = None) -> bool:
        g = self.group
        te = g.warm_estimate(st)
        if te is None:
            return False  # nothing measured in the group yet: run eager and measure
        cold = key not in g.eager_keys
        t_now = g.cold_estimate(st, te) if cold else te
        ratio = g.ratio()
        if st.comp_n:
            tc = st.comp_s / st.comp_n
        else:  # child regions decide for themselves (sharing programs): only the rest speeds up
            frac = g.split(st)[0]
            tc = max(te * (frac + ratio * (1.0 - frac)), self.ctl.comp_floor)
        on_device = isinstance(key, tuple) and len(key) == 4 and any(
            p[0] != "v" and p[2] == "neuron" for p in key[1]) or self.ctl.placement.on_device(self)
        tcomp = g.compile_estimate(te, st, on_device)
        r = self.recurrence(cls)
        share = max(1.0, st.count / seen)
        fut = expected_future(self.policy, seen, r, share)
        ok = should_compile(self.policy, seen, fut, t_now, te, tc, tcomp) and te - tc >= self.policy.min_gain * te

        def why(ok=ok, seen=seen, r=r, share=share, fut=fut, t_now=t_now, cold=cold, te=te, tc=tc, tcomp=tcomp):
            return (f"seen {seen}x (x{share:.3g} in the group), recurrence {r:.2f}: compile~{tcomp * 1e3:.3g} ms "
                    f"{'<=' if ok else '>'} now ({'cold ' if cold else ''}eager {t_now * 1e3:.3g} - compiled~"
                    f"{tc * 1e3:.3g} ms) + ~{fut:.3g} more calls * (eager {te * 1e3:.3g} - compiled~{tc * 1e3:.3g} ms)")

        st.reason = why
        if not ok:
            self.reason = why
        return ok

    def _params(self):
        ms = _module_state(self.module)
        return {n: d[k] for n, (d, k) in zip(ms.names, ms.refs)}, tuple([m.training for m in ms.mods])

    def _padded(self, leaves, pads, host: bool = True):
        """The leaves padded to their bucket: at the end with copies of the last position, or at the front
        with copies of the first for a masked group (finite values the program masks out). ``host``: pad
        neuron-device leaves on the host (for a program, which reads host memory; a device ``cat`` would be
        a one-op program per size); else on their device (for an eager run there)."""
        leaves = list(leaves)
        front = self.group.bucketing.masked_at if self.group.bucketing is not None else ()
        for (i, d, n, b) in pads:
            if b == n:
                continue  # a masked bucket's call at the bucket's own size
            x = leaves[i]
            if host and x.device.type == "neuron":
                x = cpu_alias(x)
            shape = list(x.shape)
            shape[d] = b - n
            if (i, d) in front:
                leaves[i] = torch.cat([x.narrow(d, 0, 1).expand(shape), x], d)
            else:
                leaves[i] = torch.cat([x, x.narrow(d, n - 1, 1).expand(shape)], d)
        return leaves

    def _mask_plan(self, pads):
        """``(pad count, [(leaf, axis)])`` of the masked groups among ``pads``, or None."""
        b = self.group.bucketing
        hit = [(i, d, n, bs) for (i, d, n, bs) in pads if (i, d) in b.masked_at] if b is not None and pads else []
        if not hit:
            return None
        return hit[0][3] - hit[0][2], [(i, d) for (i, d, _, _) in hit]

    def _run_program(self, st: SigStats, call, pads, needs_grad) -> Any:
        """Run the group's program (padding to the bucket first and slicing back after, when bucketed)."""
        g = self.group
        params, flags = self._params()
        leaves0, spec, states = call[:3]
        leaves = self._padded(leaves0, pads) if pads else leaves0
        args, kwargs = _args_of(leaves, spec)
        plan = self._mask_plan(pads)
        if needs_grad:
            tensors = [l for l in leaves if isinstance(l, Tensor) and l.requires_grad]
            tensors += [p for p in params.values() if p.requires_grad]
            call = {"params": params, "flags": flags, "args": args, "kwargs": kwargs}
            touts = list(_RegionFunction.apply(g, call, *tensors))
            struct = call["out"]
        elif plan is not None:
            tix = self.ctl.tensor_index(leaves0)
            axes = {len(params) + tix[i]: d for (i, d) in plan[1]}
            touts, struct = g.run_masked(params, flags, args, kwargs, plan[0], axes,
                                         lambda big: self._check_bucket_ir(big, leaves0, len(params)))
            touts = list(touts)
        else:
            touts, struct = g.run(params, flags, args, kwargs)
            touts = list(touts)
        if pads:
            touts = self._sliced(touts, pads)
        return struct.rebuild(touts, states, leaves0)

    def _sliced(self, touts: list, pads: list) -> list:
        """The result tensors of a padded call sliced back to the real sizes."""
        touts = list(touts)
        b = self.group.bucketing
        by_group = {}
        for (i, d, n, bs) in pads:
            by_group[self._group_of(i, d)] = (n, bs)
        masked_done = False
        for gi, (n, bs) in by_group.items():
            if b.masked[gi]:
                if masked_done:
                    continue  # the masked groups share one analysis and one pad count: narrowed once
                masked_done = True
            for j, axes in enumerate(b.out_axes[gi]):
                for (ax, inner) in axes or ():
                    if b.masked[gi]:  # front padded: the real positions are the last size - (bs - n)
                        touts[j] = touts[j].narrow(ax, bs - n, touts[j].shape[ax] - (bs - n))
                    else:
                        touts[j] = touts[j].narrow(ax, 0, n * inner)
        return touts

    def _compiled(self, key, st: SigStats, call, pads, needs_grad) -> Any:
        g = self.group
        clock = self.policy.clock
        if key in g.compiled:
            g.compiled.move_to_end(key)
        x0 = self.ctl.excluded_s(clock)
        t0 = clock()
        try:
            out = self._run_program(st, call, pads, needs_grad)
        except _BucketRefused as e:  # a masked bucket recompiled (evicted from the jit cache) and refused now
            st.state, st.refused = "eager", e.why
            g.compiled.pop(key, None)
            self._stop_bucketing(e.why, "bucket not padded")
            return self._eager(st, key, call[3], call[4])
        except Exception as e:  # the program failed: eager gives the user's result (or the user's error)
            return self._failed(st, e, call)
        dt = self._cost("compiled", clock() - t0 - (self.ctl.excluded_s(clock) - x0))
        frames = self.ctl.frames()
        if frames:
            frames[-1][0] += dt
            frames[-1][2] += g.compile_equiv(None)
        st.comp_n += 1
        st.comp_s += dt
        self.compiled_s += dt
        self.hits += 1
        self.modes.append(2 if pads else 1)
        if pads:
            self.padded += 1
        te = g.warm_estimate(st)
        ctl = self.ctl
        if dt < ctl.comp_floor or not ctl.comp_floor:
            ctl.comp_floor = dt
        if te:
            g.ratio_sum += dt / te
            g.ratio_n += 1
            if te >= 4.0 * ctl.comp_floor:
                # other groups learn the speed-up only from calls the fixed cost of a program call does not
                # dominate (tiny regions are modelled by the floor: ``t_compiled >= comp_floor``)
                ctl.note_ratio(dt / te)
        if st.comp_n >= 4 and te is not None and st.comp_s / st.comp_n >= te:
            st.state = "slower"
            g.compiled.pop(key, None)
            st.reason = (f"compiled {st.comp_s / st.comp_n * 1e3:.3g} ms/call is not faster than eager "
                         f"{te * 1e3:.3g} ms: back to eager")
            self._decide(st.reason)
        return out

    def _compile(self, bkey, st: SigStats, key, call, pads, needs_grad) -> Any:
        g = self.group
        clock = self.policy.clock
        what = "bucket " + str([list(p[0]) for p in bkey[1] if p[0] != "v"]) if pads is not None else "signature"
        self._decide(lambda: f"compiling {what} ({st.reason() if callable(st.reason) else st.reason})")
        ctl = self.ctl
        x0 = ctl.excluded_s(clock)
        t0 = clock()
        try:
            why = None
            if pads and g.bucketing is not None and self._mask_plan(pads) is None:
                why = self._verify_bucket(st, call, pads)
            if why is None:
                out = self._run_program(st, call, pads, needs_grad)  # a masked bucket is checked as it compiles
        except _BucketRefused as e:
            why = e.why
        except Exception as e:  # cannot trace or compile: eager gives the user's result (or the user's error)
            return self._failed(st, e, call)
        if why is not None:
            dt = clock() - t0 - (ctl.excluded_s(clock) - x0)
            ctl.note_compile(dt, None)
            self.compile_s += dt
            self.compiles += 1
            st.refused = why
            self._stop_bucketing(why, f"{what} not padded")
            return self._eager(st, key, call[3], call[4])
        dt = self._cost("compile", clock() - t0 - (ctl.excluded_s(clock) - x0))
        te = g.warm_estimate(st)
        ctl.note_compile(dt, te)
        self.compiles += 1
        self.compile_s += dt
        g.compile_n += 1
        g.compile_s += dt
        self.hits += 1
        self.modes.append(2 if pads else 1)
        if pads:
            self.padded += 1
        frames = ctl.frames()
        if frames:
            frames[-1][0] += st.comp_s / st.comp_n if st.comp_n else 0.0
            frames[-1][2] += g.compile_equiv(None)
        st.state = "compiled"
        g.compiled[bkey] = None
        while len(g.compiled) > self.policy.cache_size:
            old, _ = g.compiled.popitem(last=False)
            ost = g.sigs.get(old)
            if ost is not None:
                ost.state, ost.reason = "eager", "compiled program evicted (cache_size)"
        return out

    def _verify_bucket(self, st: SigStats, call, pads) -> Optional[str]:
        """Compile the bucket's program and check its IR is the analysed program at the bucket size, padding
        exactly (None), else say why not. (A masked bucket is checked inside its compile: see
        :meth:`Group.run_masked`.)"""
        g = self.group
        params, flags = self._params()
        leaves, spec = call[:2]
        args, kwargs = _args_of(self._padded(leaves, pads), spec)
        return self._check_bucket_ir(g.lower(params, flags, args, kwargs), leaves, len(params))

    def _check_bucket_ir(self, big, leaves, offset: int) -> Optional[str]:
        """None when ``big`` (the program traced at the bucket size) is the analysed program and pads exactly,
        else why not."""
        b = self.group.bucketing
        tix = self.ctl.tensor_index(leaves)
        sized = [(offset + tix[i], d) for grp in b.groups for (i, d) in grp]
        why = same_program(b.ir, big, sized)
        if why is not None:
            return why
        joint = None
        for gi, grp in enumerate(b.groups):
            i0, d0 = grp[0]
            if not b.masked[gi] and bucket_size(self.policy, leaves[i0].shape[d0]) < 2:
                continue  # calls of this bucket never pad these dims
            try:
                if b.masked[gi]:
                    if joint is None:
                        joint = _masked_out_axes(big, {offset + tix[i]: d for (i, d) in b.masked_at})
                    axes = joint
                else:
                    axes = independent_axes(big, {offset + tix[i]: d for (i, d) in grp})
            except Mixed as e:
                return f"dims {list(grp)} at the bucket size: {e}"
            if axes != b.out_axes[gi]:
                return f"dims {list(grp)}: the outputs carry them differently at the bucket size"
        return None

    def _stop_bucketing(self, why: str, what: str) -> None:
        """The group's buckets turned out not to pad exactly: no more bucketing; as when the analysis refuses,
        the children of its regions become candidate regions (their signatures may churn less)."""
        g = self.group
        g.bucketing, g.bucket_refused = None, why
        self._decide(f"{what}: {why}; the group stops bucketing; its children become regions")
        for r in g.members:
            r.ctl.add_children(r)

    def _failed(self, st: SigStats, e: Exception, call) -> Any:
        """A trace, compile or compiled run failed: eager for good (with the error as reason), this call eager
        (on the caller's own arguments: state objects are left as they were until the eager run)."""
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        self._give_up(f"cannot be compiled ({type(e).__name__}: {msg[:300]})")
        return self._eager(None, None, call[3], call[4])

    def _give_up(self, why: str) -> None:
        if self.dead is None:
            self.dead = why
            self._decide(f"eager for good: {why}; its children become regions")
            self.ctl.add_children(self)

    # -- buckets ------------------------------------------------------------
    def _group_of(self, i: int, d: int) -> int:
        for gi, members in enumerate(self.group.bucketing.groups):
            if (i, d) in members:
                return gi
        return -1

    def _try_bucketing(self, key, leaves, args, kwargs) -> None:
        g = self.group
        spec, parts, grad, training = key
        if g.frac_cc >= 0.8 and g.cold_n + g.warm_n >= 2:
            g.bucket_refused = f"its eager time is {g.frac_cc:.0%} in child regions, which bucket for themselves"
            return

        sk = _structure(key)
        same = list({k for k in self.window if _structure(k) == sk})
        if len(same) < self.policy.churn_distinct:
            return
        varying: Dict[Tuple, List[Tuple[int, int]]] = {}
        for i, p in enumerate(parts):
            if p[0] == "v":
                continue
            for d in range(len(p[0])):
                sizes = tuple(k[1][i][0][d] for k in same)
                if len(set(sizes)) > 1:
                    varying.setdefault(sizes, []).append((i, d))
        if not varying or any(parts[i][0][d] < 2 for ms in varying.values() for (i, d) in ms):
            return  # nothing varies, or this call's size is too small to prove anything from: next time
        ckey = (sk, tuple(tuple(m) for m in varying.values()))
        cached = g.analyses.get(ckey)
        if cached is None:
            cached = self._analyse(key, varying, leaves)
            if cached is None:
                return
            if len(g.analyses) >= 16:
                g.analyses.pop(next(iter(g.analyses)))
            g.analyses[ckey] = cached
        groups, outs, refused, ir, masks = cached
        if not groups:
            g.bucket_refused = "; ".join(refused)
            self._decide(f"signatures churn; no bucketing: {g.bucket_refused}; its children become regions")
            for r in g.members:
                r.ctl.add_children(r)
            return
        g.bucketing = _Bucketing(g.pattern(key, [p for gr in groups for p in gr]), groups, outs, ir, ckey, masks)
        note = f" (not bucketed: {'; '.join(refused)})" if refused else ""
        how = "".join(f"; {gr} padded in front, masked" for gr, m in zip(groups, masks) if m)
        self._decide(f"signatures churn; bucketing (leaf, axis) groups {groups} to {self.policy.bucket}{how}{note}")
        if refused:
            g.bucket_refused = "; ".join(refused)

    def _analyse(self, key, varying, leaves):
        """Trace this call once and prove which varying groups may be padded: ``(groups, out_axes, refused, ir)``."""
        g = self.group
        clock = self.policy.clock
        x0 = self.ctl.excluded_s(clock)
        t0 = clock()
        try:
            params, flags = self._params()
            targs, tkwargs = _args_of(leaves, key[0])  # state objects as StateArgs (the program makes proxies)
            ir = g.trace_ir(params, flags, targs, tkwargs)
        except Exception as e:  # an untraceable region: the compile attempt will say so
            g.bucket_refused = f"cannot trace to analyse ({type(e).__name__})"
            return None
        finally:
            self.ctl.note_analysis(clock() - t0 - (self.ctl.excluded_s(clock) - x0))
        offset = len(params)
        tix = self.ctl.tensor_index(leaves)
        groups, outs, refused, masks = [], [], [], []
        mixed = []  # (members, why): not paddable at their end
        for members in varying.values():
            ins = {offset + tix[i]: d for (i, d) in members}
            try:
                res = independent_axes(ir, ins)
            except (Mixed, KeyError) as e:
                mixed.append((tuple(members), f"dims {members}: {e}"))
                continue
            groups.append(tuple(members))
            outs.append(res)
            masks.append(False)
        # front padding with masks (a cache grown by cat, a softmax over it): all such groups share one pad
        # count (a cache of length n and a mask of length n + 1 stay aligned), else the first one that works
        tries = [[m for m, _ in mixed]] + ([[m] for m, _ in mixed] if len(mixed) > 1 else [])
        for cand in tries if mixed else ():
            try:
                res = _masked_out_axes(ir, {offset + tix[i]: d for mem in cand for (i, d) in mem})
            except (Mixed, KeyError) as e:
                last = str(e)
                continue
            for mem in cand:
                groups.append(mem)
                outs.append(res)
                masks.append(True)
            break
        else:
            if mixed:
                refused.append(f"{'; '.join(w for _, w in mixed)}; masked: {last}")
                mixed = []
        refused += [w for m, w in mixed if m not in groups]
        return groups, outs, refused, ir, masks

    # -- report ---------------------------------------------------------------
    def mode(self) -> str:
        """Over the last 8 calls: ``eager``, ``eager (padded)``, ``eager (for good)``, ``compiled``, ``bucketed``
        (compiled, some padded) or ``mixed``."""
        if self.dead is not None:
            return "eager (for good)"
        m = list(self.modes)[-8:]
        comp = any(x in (1, 2) for x in m)
        eag = any(x in (0, 3) for x in m)
        if not comp:
            return "eager (padded)" if 3 in m else "eager"
        if not eag:
            return "bucketed" if 2 in m else "compiled"
        return "mixed"

    def row(self) -> Dict[str, Any]:
        """One report row."""
        g = self.group
        reason = f"eager for good: {self.dead}" if self.dead else self.reason
        if callable(reason):
            reason = reason()
        if self.dead is None and g.bucket_refused and not self.hits:
            reason = f"{reason}; no bucketing: {g.bucket_refused}"
        return {"region": self.name, "mode": self.mode(), "calls": self.calls, "signatures": self.distinct,
                "compiles": self.compiles, "hits": self.hits, "padded": self.padded,
                "eager_s": round(self.eager_s, 4), "compiled_s": round(self.compiled_s, 4),
                "compile_s": round(self.compile_s, 4),
                "eager_on": self.ctl.placement.label(self), "eager_device_us": round(self.eager_device_us, 1),
                "shares": g.name if g.name != self.name else "", "reason": reason}
