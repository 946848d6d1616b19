# Adaptive eager on the neuron device: eager ops queued into windows, each window compiled and run as one program.
"""Adaptive eager mode of the ``neuron`` device (``torch.neuron.set_eager_mode("adaptive")``).

In op mode (the default) every eager op is its own one-op program, run at
once (:mod:`tn.device.eager`). In adaptive mode an op on neuron tensors is
*recorded* instead: its results are real neuron tensors at once (shape,
dtype, strides from the op's meta kernel, memory from the caching allocator,
autograd graph as usual, since recording happens below autograd), but their
contents are computed later, when a **window** of recorded ops is flushed:

* the host needs memory the window writes or reads (``.cpu()``, ``.item()``,
  ``print``, ``numpy()``, a host fallback op, a device op that is not
  recorded, ``tn.jit``/``torch.compile``/``tn.adaptive`` reading the tensor):
  every such access goes through :func:`tn.device.allocator.cpu_alias`,
  whose hook flushes first;
* ``torch.neuron.synchronize()``, leaving adaptive mode, a random op (drawn
  on the host from torch's CPU generator as in op mode, so the same seed
  gives the same numbers), an op tn cannot record (data-dependent shapes,
  a dtype reinterpretation of pending memory), or the buffer limit
  (``TN_WINDOW_OPS`` ops, default 1024).

A flushed window is replayed through the tracer (:func:`tn.trace.trace_flat`)
into one IR: every storage the window touches is one value (a program input
when it existed before the window, a result when an op of the window made it),
tensors are views of their storage's value, in-place ops are functionalised
by the tracer as under ``tn.jit``. Results whose memory nobody holds any more
(intermediates, activations that backward already consumed) are not outputs,
so they stay on chip. The IR is optimised and compiled by
:func:`tn.lower.compile_ir` (the same fusion as ``tn.jit``) and cached by the
window's signature: the op sequence, every tensor's metadata and storage slot,
non-tensor arguments, and which results are still alive. Steady loops
(training steps, decode steps of the same length) hit the cache. The scalars of
elementwise ops are keyed by kind only: a program bakes a scalar in as a literal
until its value is seen to change (AdamW's bias corrections, a scheduled
learning rate), then takes it as a 0-dim input, so such loops hit the cache too.

Windows that recur with one size growing (a decode step's window over a KV cache that ``cat`` grows by one
every step) share one program per bucket of that size instead of compiling each size: the padding proofs and the
bucket rule are :mod:`tn.bucketing`'s, the ones :mod:`tn.adaptive` uses (see "buckets" below).

A window that cannot be traced or compiled runs op by op through the eager
path (and its signature is remembered, so a steady loop does not retry).
Errors keep eager's debuggability: an op's shape and dtype errors surface
when it is recorded (its meta kernel runs then), at the user's line; an error
while a window runs re-runs the window op by op, and the failing op's error
names the user's ``file:line`` that issued it. Equations carry that line too
(``Eqn.source``), so compiler messages name it.

Windows belong to a queue; there is one queue per device and stream
(:func:`_queue`: today one stream, the device's default; the seam for
``torch.neuron.Stream``). Threads share it under a lock, so a backward pass lands in the same queue in
issue order: forward, backward and optimizer step form few windows. The thread that switches adaptive mode on
runs the backward passes it starts itself, as on the CPU (:func:`_backward_on_this_thread`): autograd's device
thread would only add two thread hand-offs per backward; a backward started by another thread runs on the
device's worker thread, as torch does, into the same queue.

``TN_LOG=windows`` logs every window (ops, cache hit, bucket hit or compile, why it was
flushed); :func:`stats` counts windows, ops, hits (bucket hits among them), compiles (bucket compiles among
them) and flush reasons.

Host cost of a cache hit. Recording: the device's kernels hand the common call
(tensors of one device, no math bits, not a view) to :func:`record_plain`, which
checks and records it in one pass over its arguments; structured ops (``tanh``,
``addmm``, ``cat`` ...) are queued as their functional op, not as torch's
``empty`` + ``out=`` composite (:mod:`tn.device.fastpath`); signatures hold op
numbers, not ``OpOverload`` objects (which hash in Python); a result is
allocated from the metadata its op's plan cached; a recorded argument and the op's
record are tuples built in C (:data:`_mkref`). Measured on 2 shared cores: a chain
of 50 small ops (matmul, tanh, add, mul) records in ~11 us per op (CPU eager runs
it at 1.4), torch's dispatch to the Python kernels and their checks (~3.7) included;
the rest is the result's allocation (~1.5-2.5 with its release), the user's line
(~1.2), ~1 per tensor argument (metadata, storage slot) and the signature's trie
step. A hit re-plans nothing and never traces: the window's signature finds the
program, its inputs bind through the last call's host views where they did not
move (else views kept per address), and the NeuronCore model's execution of the
program (the native engine: ~10.5 ms of a GPT-2 training step's ~20 ms; ~33 ms of
the ~150 ms of HF generate's 32 tokens) dominates what is left.
"""
from __future__ import annotations

import contextlib
import linecache
import logging
import os
import sys
import threading
import time
import weakref
from collections import Counter, OrderedDict
from operator import itemgetter
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import bucketing, config, trace
from ..errors import ArgumentValueError
from ..ir import Var
from ..neuron import runtime as _runtime
from ..neuron import timeline as _tl
from ..neuron.program import HbmView, Program
from ..passes import optimize
from ..shapes import numel
from ..trace import source_hint, trace_flat
from . import allocator, tracking
from .opargs import unflatten_args

__all__ = ["mode", "set_mode", "eager_mode", "active", "flush", "stats", "reset_stats", "clear_cache",
           "pending_ops"]

log = logging.getLogger("tn")
aten = torch.ops.aten

_MODES = ("op", "adaptive")
_STATE = {"mode": None}          # None: not read from the configuration yet
_TLS = threading.local()         # .executing: this thread is running a flushed window (record nothing)
_CACHE: "OrderedDict[Any, List[_Compiled]]" = OrderedDict()   # signature -> programs (by live results)
_CACHE_MAX = 512
_REFUSED: set = set()            # per-op signatures the tracer could not replay: flushed around, run eagerly
#: per-op metadata key -> result plan (from the op's meta kernel), least recently used first; bounded by
#: :data:`_META_MAX` (a KV cache's ops have a new key per decode step: unbounded, it would grow without end)
_META: "OrderedDict[Any, Any]" = OrderedDict()
_META_MAX = 4096
_SEEDED = torch.Tag.nondeterministic_seeded
_STATS: Dict[str, Any] = {}


def _zero_stats() -> None:
    _STATS.clear()
    _STATS.update({"windows": 0, "ops": 0, "hits": 0, "compiles": 0, "op_by_op": 0, "compile_s": 0.0,
                   "flush_reasons": Counter(), "ops_per_window": Counter(), "device_ns": 0.0,
                   "bucket_hits": 0, "bucket_compiles": 0})


_zero_stats()


# --------------------------------------------------------------------------- the switch


def mode() -> str:
    """The eager mode of the neuron device: ``"op"`` (one program per op, at once) or ``"adaptive"`` (windows)."""
    m = _STATE["mode"]
    if m is None:
        m = _STATE["mode"] = config.get("eager_mode")
        if m == "adaptive":       # (TN_EAGER_MODE=adaptive: the thread that first asks is the one that switched)
            _backward_on_this_thread(True)
    return m


def _backward_on_this_thread(on: bool) -> None:
    """Adaptive mode: backward passes this thread starts run on this thread, as on the CPU
    (``torch.autograd.set_multithreading_enabled(False)``, thread-local), instead of on autograd's device thread;
    ``on=False`` restores what the thread had before. A window queues the ops whichever thread issues them and runs
    nothing while they are issued, so the device thread bought no overlap: it cost two thread hand-offs per
    backward (start and finish), each a wake-up the scheduler may delay on a busy host (interleaved steps on 2
    loaded shared cores: MLP training step median wall 2.73 -> 2.55 ms, GPT-2 51.2 -> 48.5 ms; CPU time 2-3%
    lower). Other threads keep torch's behaviour (their backward runs on the device thread, into the same
    thread-safe queue), as does a thread that sets the flag itself."""
    saved = getattr(_TLS, "multithreading", None)
    if on:
        if saved is None:
            _TLS.multithreading = torch._C._is_multithreading_enabled()
            torch._C._set_multithreading_enabled(False)
    elif saved is not None:
        _TLS.multithreading = None
        torch._C._set_multithreading_enabled(saved)


def set_mode(m: str) -> None:
    """Switch the neuron device's eager mode (``"op"`` or ``"adaptive"``); leaving adaptive runs what is queued."""
    if m not in _MODES:
        raise ArgumentValueError(f"eager mode {m!r} does not exist: use 'op' (one program per op) or 'adaptive' (ops "
                      f"gathered into compiled windows)")
    if m != "adaptive" and mode() == "adaptive":
        flush("eager mode change")
    _STATE["mode"] = m
    _backward_on_this_thread(m == "adaptive")


@contextlib.contextmanager
def eager_mode(m: str) -> Iterator[None]:
    """Context manager: the neuron device runs eager ops in mode ``m`` inside the block (restored after)."""
    saved = mode()
    set_mode(m)
    try:
        yield
    finally:
        set_mode(saved)


def active() -> bool:
    """Whether ops issued now are recorded into a window (adaptive mode, not while a window runs)."""
    return (_STATE["mode"] or mode()) == "adaptive" and not getattr(_TLS, "executing", False)


# --------------------------------------------------------------------------- queues, slots, records


class _Slot:
    """One storage a window touches: its index in the window, dtype, the value's shape, and the storage.

    ``external`` storages existed before the window (program inputs; held strongly until the flush);
    the others were made by an op of the window (held weakly: when the user drops every tensor on one,
    its value is not written back).
    """

    __slots__ = ("index", "external", "dtype", "shape", "nbytes", "strong", "ref", "blank")

    def __init__(self, index: int, st: Any, external: bool, dtype: torch.dtype, shape: Tuple[int, ...],
                 blank: bool = False, nbytes: Optional[int] = None):
        self.index = index
        self.external = external
        self.blank = blank      # made by torch.empty while the window was open: no value until an op writes it
        self.dtype = dtype
        self.shape = shape
        self.nbytes = st.nbytes() if nbytes is None else nbytes
        self.strong = st if external else None
        self.ref = None if external else weakref.ref(st)

    def storage(self) -> Any:
        """The storage object (None once a window-made storage has died)."""
        return self.strong if self.external else self.ref()


class _Ref(tuple):
    """A tensor argument of a recorded op: ``(slot, shape, stride, offset, dtype)`` (storage slot, metadata).

    A tuple, made by :data:`_mkref` (``tuple.__new__``, no Python ``__init__`` frame): a steady loop records one
    per tensor argument of every op, and a cache hit never reads them (only a compile, a replay op by op or a
    bucket's skeleton does)."""

    __slots__ = ()

    def __new__(cls, slot: int, shape: tuple, stride: tuple, offset: int, dtype: torch.dtype):
        return tuple.__new__(cls, (slot, shape, stride, offset, dtype))

    slot = property(itemgetter(0))
    shape = property(itemgetter(1))
    stride = property(itemgetter(2))
    offset = property(itemgetter(3))
    dtype = property(itemgetter(4))


class _Rec(tuple):
    """One recorded op: ``(op, leaves, spec, plan, fresh, src, scal)``: the aten overload, its flat arguments
    (tensors as :class:`_Ref`), their structure, the result plan, ``fresh`` ``[(result leaf index, slot index)]``,
    ``src`` the user's ``(file, line)`` or None, ``scal`` ``[(leaf index, index in the window's scalars)]`` (values
    that may be program inputs). A tuple made by :data:`_mkref`, as :class:`_Ref`."""

    __slots__ = ()

    def __new__(cls, op, leaves, spec, plan, fresh, src, scal=()):
        return tuple.__new__(cls, (op, leaves, spec, plan, fresh, src, scal))

    op = property(itemgetter(0))
    leaves = property(itemgetter(1))
    spec = property(itemgetter(2))
    plan = property(itemgetter(3))
    fresh = property(itemgetter(4))
    src = property(itemgetter(5))
    scal = property(itemgetter(6))


#: ``_mkref(_Ref, (slot, shape, stride, offset, dtype))`` / ``_mkref(_Rec, (...))``: the C constructor of a tuple
_mkref = tuple.__new__


class _Window:
    """The ops recorded since the last flush of one queue."""

    __slots__ = ("recs", "slots", "by_ptr", "keys", "blanks", "index", "svals", "sdtypes", "limit", "stream", "node")

    def __init__(self, index: int = 0):
        self.index = index                 # the neuron device the window's memory lives on
        self.stream: Any = None            # the stream (tn.neuron.timeline.Queue) its ops were issued on
        self.recs: List[_Rec] = []
        self.slots: List[_Slot] = []
        self.by_ptr: Dict[int, _Slot] = {}
        self.keys: List[Any] = []
        self.blanks: Dict[int, Any] = {}   # address -> weak reference: memory torch.empty made, no op used yet
        self.svals: List[float] = []       # values of the scalar arguments that may be program inputs ...
        self.sdtypes: List[torch.dtype] = []   # ... and the dtypes they have as inputs
        self.limit = 1024                  # the buffer limit (TN_WINDOW_OPS), read when the first op is recorded
        self.node: Any = _TRIE[0]          # the trie node of the ops recorded so far (the window's signature)

    def slot_of(self, st: Any) -> Optional[_Slot]:
        """The live slot of storage ``st`` (None if the window does not touch it)."""
        s = self.by_ptr.get(st.data_ptr())
        if s is not None and s.storage() is st:
            return s
        return None


class _Queue:
    """A device stream's queue of work: the open window, under a lock shared by every thread."""

    __slots__ = ("lock", "window")

    def __init__(self, index: int = 0):
        self.lock = threading.RLock()
        self.window = _Window(index)


_QUEUES: Dict[Any, _Queue] = {}


def _queue(index: int) -> _Queue:
    """The queue of device ``neuron:index`` that ops issued now go to (one per device). A window holds the ops of
    one stream: an op issued on another stream than the open window's flushes it first (:func:`record`), and
    the window's program runs on the stream its ops were issued on (:func:`_run_window`)."""
    q = _QUEUES.get(index)
    if q is None:
        q = _QUEUES.setdefault(index, _Queue(index))
    return q


def pending_ops() -> int:
    """Ops recorded and not yet run (in every queue)."""
    return sum(len(q.window.recs) for q in _QUEUES.values())


# --------------------------------------------------------------------------- recording


_CODES: Dict[int, Tuple[Any, bool]] = {}    # id(code) -> (code, tn's or torch's own): tn.trace's verdict, cached
_CODES_DIRS = [0]                           # tn.trace.internal_dirs_generation() the cache was made with


def _user_src(depth: int = 1) -> Optional[Tuple[str, int]]:
    """``(file, line)`` of the innermost frame of the user's code (as :func:`tn.trace.user_frame`), or None;
    the search starts ``depth`` frames up (frames known to be tn's need no look-up)."""
    codes = _CODES
    if _dirs_generation() != _CODES_DIRS[0] or len(codes) > 4096:
        codes.clear()
        _CODES_DIRS[0] = _dirs_generation()
    get = codes.get
    f = _getframe(depth)
    while f is not None:
        c = f.f_code
        e = get(id(c))
        if e is None or e[0] is not c:
            e = codes[id(c)] = (c, _is_internal(c))
        if not e[1]:
            src = (c.co_filename, f.f_lineno)
            # drop the frame before returning: were it this very frame (tn's files counted as the user's), the
            # local would make a cycle that holds every caller's locals, the op's results among them, until the
            # collector runs
            del f
            return src
        f = f.f_back
    return None


_getframe = sys._getframe
_dirs_generation = trace.internal_dirs_generation
_is_internal = trace.is_internal_code


def _memory_order(shape: tuple, stride: tuple) -> Optional[Tuple[list, tuple]]:
    """``(perm, shape in memory order)`` when ``shape``/``stride`` is a dense permutation of a row-major
    layout (``x.t()``, ``x.permute(...)`` of a contiguous tensor), else None."""
    perm = sorted(range(len(shape)), key=lambda d: (-stride[d], d))
    mem = tuple(shape[d] for d in perm)
    want = allocator.contiguous_strides(mem)
    if all(stride[d] == w or n == 1 for d, w, n in zip(perm, want, mem)):
        return perm, mem
    return None


def _base_shape(t: torch.Tensor, nbytes: int) -> Tuple[int, ...]:
    """The shape of a storage's value: ``t``'s in memory order when ``t`` covers it densely (contiguous or a
    permutation of contiguous); else, when ``t``'s strides are those of a row-major array the storage holds
    (``ids[:, -1:]`` of an ``[B, L]`` tensor: strides ``(L, 1)``), that array's shape, so the view is a slice of
    it (a window growing ``L`` then grows one axis); else the flat element count."""
    if t.storage_offset() == 0 and t.numel() * t.element_size() == nbytes:
        if t.is_contiguous():
            return tuple(t.shape)
        mo = _memory_order(tuple(t.shape), tuple(t.stride()))
        if mo is not None:
            return mo[1]
    n = nbytes // t.element_size()
    st = t.stride()
    if len(st) >= 2 and st[-1] == 1 and st[0] > 0 and n % st[0] == 0 and t.numel() and all(
            b > 0 and a > b and a % b == 0 for a, b in zip(st, st[1:])):   # b == 0: a broadcast (expanded) axis
        shape = (n // st[0],) + tuple(a // b for a, b in zip(st, st[1:]))
        if all(d <= b for d, b in zip(t.shape, shape)):
            return shape
    return (n,)


#: (shape, stride, offset, dtype, storage bytes) -> :func:`_base_shape` of such a tensor (a window's weights and
#: state are new slots of every window: their base shapes are looked up, not derived again)
_BASES: Dict[Tuple[Any, ...], Tuple[int, ...]] = {}


def _meta_of(r: _Ref) -> torch.Tensor:
    if r.offset == 0:
        return torch.empty_strided(r.shape, r.stride, dtype=r.dtype, device="meta")
    extent = r.offset + 1 + sum((d - 1) * s for d, s in zip(r.shape, r.stride) if d > 0)
    return torch.empty((extent,), dtype=r.dtype, device="meta").as_strided(r.shape, r.stride, r.offset)


def _plan(op, leaves: list, spec) -> Any:
    """Run ``op``'s meta kernel: ``(out_tree, [("alias", leaf) | ("fresh", shape, dtype, strides, nbytes) |
    ("static", v)], whether the result is one value, whether the fresh results are contiguous in the meta
    kernel too)`` (results are always made contiguous)."""
    metas = [_meta_of(x) if type(x) is _Ref else
             (torch.empty((), dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x) for x in leaves]
    by_id = {id(m): i for i, m in enumerate(metas) if type(leaves[i]) is _Ref}
    args, kwargs = unflatten_args(metas, spec)
    res = op(*args, **kwargs)
    flat, tree = tree_flatten(res)
    out = []
    exact = True
    for x in flat:
        if isinstance(x, torch.Tensor):
            i = by_id.get(id(x))
            shape = tuple(x.shape)
            if i is not None:
                out.append(("alias", i))
            else:
                strides = allocator.contiguous_strides(shape)
                if x.numel() > 1 and tuple(x.stride()) != strides:
                    exact = False
                out.append(("fresh", shape, x.dtype, strides, allocator.storage_nbytes(shape, strides, x.itemsize)))
        else:
            out.append(("static", x))
    return tree, out, tree.is_leaf(), exact


_COPY = aten.copy_.default


def record_copy(src: torch.Tensor, dst: torch.Tensor) -> Any:
    """A device-to-device copy (``_copy_from``: ``.contiguous()``, ``.clone()``, ``x[i] = y``, ``.to(dtype)``)
    as ``dst.copy_(src)`` in the window; ``NotImplemented`` when it must run now."""
    if not active():
        return NotImplemented
    flat = [dst, src, False]
    r = record_plain(_COPY, "aten::_copy_from", flat, _COPY_SPEC)
    return record(_COPY, "aten::_copy_from", flat, _COPY_SPEC) if r is GENERAL else r


_COPY_SPEC = (3, (), (None, None, None))


def _leaf_key(x: Any) -> Any:
    t = type(x)
    if t in _PLAIN_LEAVES:              # the common arguments (dims, flags, dtypes), by exact type: one set look-up
        return (t.__name__, x)
    if isinstance(x, torch.Tensor):     # a CPU scalar tensor (wrapped number): baked into the program
        return ("t", x.dtype, x.item())
    if isinstance(x, float):
        return ("f", repr(x))
    if isinstance(x, (int, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return (t.__name__, x)
    return ("r", t.__name__, repr(x))


#: exact types whose key is ``(type name, value)`` (subclasses take :func:`_leaf_key`'s checks, with the same key)
_PLAIN_LEAVES = frozenset((int, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format))


# --------------------------------------------------------------------------- scalars as program inputs
#
# A Python number in an elementwise op (``x * 0.5``; AdamW's bias corrections; a scheduled learning rate) would
# be a literal of the window's program, its value part of the cache key, and a value that changes every step
# would compile every step. So the key holds only such a scalar's kind and dtype, the window keeps its value,
# and a program either bakes it in (a literal; a cache hit then needs the same value) or takes it as a 0-dim
# input. A scalar becomes an input once its *site* (op and metadata, user line, occurrence) is seen with two
# values, in this window's earlier calls or in another window (AdamW's first step, which also creates the
# state, tells the steady step which scalars move); constants (GELU's 0.5, a fixed learning rate) stay literals.

#: ops whose 0-dim host tensor arguments (Python numbers PyTorch wrapped, ``x * 0.5``) may be program inputs
_T_SCALAR_OPS = frozenset(("add", "sub", "mul", "div", "rsub", "lerp", "where", "maximum", "minimum"))
#: op -> its float Scalar argument that may be a program input, for fp32 tensors: ``x + alpha * y`` (add/sub
#: ``alpha``), ``x + value * t1 / t2`` (addcdiv/addcmul ``value``: replayed with ``t1 * value``) and lerp's weight
_F_SCALAR_FORMS = {("add", "Tensor"): "alpha", ("add", "out"): "alpha", ("sub", "Tensor"): "alpha",
                   ("sub", "out"): "alpha", ("addcdiv", "default"): "value", ("addcdiv", "out"): "value",
                   ("addcmul", "default"): "value", ("addcmul", "out"): "value", ("lerp", "Scalar"): "weight",
                   ("lerp", "Scalar_out"): "weight"}
_LERP_TENSOR = {aten.lerp.Scalar: aten.lerp.Tensor, aten.lerp_.Scalar: aten.lerp_.Tensor,
                aten.lerp.Scalar_out: aten.lerp.Tensor_out}
_SCALAR_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FORMS: Dict[Any, Tuple[bool, Optional[str]]] = {}
_SITES: Dict[Any, float] = {}     # scalar site -> the value it had in the last window compiled with it
_VARYING: set = set()             # scalar sites seen with two values: program inputs from then on
_SITES_MAX = 1 << 16
_F_KEY = ("f?", torch.float32)
_MARK = object()                  # stands for a float scalar that the replay passes as a tensor


def _scalar_form(op) -> Tuple[bool, Optional[str]]:
    """``(host 0-dim tensors may be inputs, name of the float argument that may be an input or None)``."""
    form = _FORMS.get(op)
    if form is None:
        base = op._schema.name.split("::")[-1].rstrip("_")
        form = _FORMS[op] = (base in _T_SCALAR_OPS, _F_SCALAR_FORMS.get((base, op._overloadname)))
    return form


def _same(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)


def _tensor_scalar_call(op, args: tuple, kwargs: dict, t: torch.Tensor) -> Tuple[Any, list, dict]:
    """The call of ``op`` with its float scalar (``_MARK`` in the arguments) passed as the 0-dim tensor ``t``."""
    args, kwargs = list(args), dict(kwargs)
    where = next((k for k, v in kwargs.items() if v is _MARK), None)
    if where is None:
        where = args.index(_MARK)
    if _FORMS[op][1] == "weight":                  # lerp: the Tensor overload takes the weight as a tensor
        op = _LERP_TENSOR[op]
    else:                                          # x + alpha * y, x + value * t1 / t2, x + value * t1 * t2
        args[1] = args[1] * t
        t = 1
    if isinstance(where, str):
        kwargs[where] = t
    else:
        args[where] = t
    return op, args, kwargs


def _params(w: "_Window", entries: Optional[List["_Compiled"]]) -> Tuple[int, ...]:
    """Which of window ``w``'s scalars its new program takes as inputs: those whose site changed value."""
    if not w.svals:
        return ()
    sv = w.svals
    varying = set()
    for e in entries or ():
        varying.update(e.params)
        varying.update(i for i, v in e.fixed if not _same(sv[i], v))
    if len(_SITES) > _SITES_MAX:
        _SITES.clear()
    occurrence: Counter = Counter()
    for k, rec in enumerate(w.recs):
        if rec.scal:
            base = (w.keys[k][0], rec.src)
            n = occurrence[base]
            occurrence[base] = n + 1
            for li, gi in rec.scal:
                site = (base, n, li)
                prev = _SITES.get(site)
                if prev is not None and not _same(prev, sv[gi]):
                    _VARYING.add(site)
                _SITES[site] = sv[gi]
                if site in _VARYING:
                    varying.add(gi)
    return tuple(sorted(varying))


def _baked_match(e: "_Compiled", sv: List[float]) -> bool:
    for i, v in e.fixed:
        x = sv[i]
        if x != v and not (x != x and v != v):
            return False
    return True


class _NotRecordable(Exception):
    """This op is run eagerly instead (the reason is the message)."""


def record(op, name: str, flat: list, spec, deterministic: bool = False) -> Any:
    """Record aten ``op`` (flat arguments ``flat``, structure ``spec``) into the open window and return its
    results (neuron tensors whose contents the window's flush computes), or ``NotImplemented`` when the op
    must run eagerly now (the queue was flushed first where the op depends on it). ``deterministic``: the
    caller knows this call draws no random numbers although torch tags the op random (SDPA without dropout)."""
    info = _OPS.get(id(op))
    if info is None or info[0] is not op:
        info = _op_info(op)
    if info[4] and not deterministic:
        flush("random op", name)
        return NotImplemented
    index = -1
    for a in flat:
        if isinstance(a, torch.Tensor) and not a.is_cpu:
            i = a.get_device()
            if index < 0:
                index = i
            if i != index or i < 0:
                index = -2
                break
    if index < 0:
        flush("tensors on several devices", name)
        return NotImplemented
    return _record_locked(index, op, name, flat, spec, info, False)


#: :func:`record_plain`'s answer for a call it leaves to the general path (nothing was recorded or flushed)
GENERAL = object()


def record_plain(op, name: str, flat: list, spec, exact: bool = False) -> Any:
    """:func:`record` for the common call, checked on the way: tensors of one neuron device (0-dim host
    tensors mix in) without lazy conjugate/negative bits. Returns :data:`GENERAL`, having recorded nothing (a
    change of stream may have flushed the open window, as :func:`record` would), for any other call (the caller
    then checks it as op mode would and calls :func:`record`); otherwise what
    :func:`record` returns. One pass over the arguments instead of the eager path's checks plus :func:`record`'s.
    ``exact``: also decline an op whose results torch would not make contiguous (a functional op queued in
    place of torch's ``empty`` + ``out=`` composite, :mod:`tn.device.fastpath`, must not change strides)."""
    info = _OPS.get(id(op))
    if info is None or info[0] is not op:
        info = _op_info(op)
    if info[4]:
        return GENERAL
    for a in flat:
        if isinstance(a, torch.Tensor) and not a.is_cpu:
            index = a.get_device()
            break
    else:
        return GENERAL
    if index < 0:
        return GENERAL
    return _record_locked(index, op, name, flat, spec, info, True, exact)


def _record_locked(index: int, op, name: str, flat: list, spec, info, check: bool, exact: bool = False) -> Any:
    """:func:`_record` into device ``index``'s queue under its lock, after flushing a window of another stream."""
    q = _QUEUES.get(index) or _queue(index)
    stream = _current_queue(index)
    with q.lock:
        w = q.window
        if w.stream is not stream:
            if w.recs:
                if check:
                    try:
                        _check_plain(flat, index)
                    except _Decline:
                        return GENERAL
                flush("stream change", name)
            q.window.stream = stream
        try:
            return _record(q, index, op, name, flat, spec, info, check, exact)
        except _Decline:
            return GENERAL
        except _NotRecordable as e:
            flush(str(e), name)
            return NotImplemented


_current_queue = _tl.current_queue


class _Decline(Exception):
    """:func:`record_plain` leaves this call to the general path (nothing changed)."""


def _check_plain(flat: list, index: int) -> None:
    for a in flat:
        if isinstance(a, torch.Tensor):
            if a.is_cpu:
                if a.dim() or a.requires_grad:
                    raise _Decline()
            elif a.get_device() != index or a.is_conj() or a.is_neg():
                raise _Decline()


#: id(op) -> (op, traceable, t_form, f_form, random, number): keyed by id, as OpOverload hashes in Python
_OPS: Dict[int, Tuple[Any, bool, bool, Optional[str], bool, int]] = {}


def _op_info(op) -> Tuple[Any, bool, bool, Optional[str], bool, int]:
    """What recording needs to know of ``op``, once: traceable, its scalar forms, whether torch tags it random,
    and the number that stands for it in signatures (never reused, unlike an id)."""
    t_form, f_form = _scalar_form(op)
    replay = trace.can_replay(op)
    with _OP_LOCK:     # (autograd's device thread records too: two ops must never share a number)
        info = _OPS.get(id(op))
        if info is None or info[0] is not op:
            info = _OPS[id(op)] = (op, replay, t_form, f_form, _SEEDED in op.tags, len(_OP_NUMBERS))
            _OP_NUMBERS.append(op)
    return info


_OP_NUMBERS: List[Any] = []    # number -> op (keeps every numbered op alive, so its id is not reused)
_OP_LOCK = threading.Lock()


def _record(q: _Queue, index: int, op, name: str, flat: list, spec, info, check: bool = False,
            exact: bool = False) -> Any:
    """Append ``op`` to ``q``'s window (the caller holds the lock). ``check``: a call :func:`record_plain`
    must leave to the general path raises :class:`_Decline` (before anything changed); so does, with
    ``exact``, an op whose results torch would not make contiguous."""
    _, traceable, t_form, f_form, _, number = info
    if not traceable:
        if check:
            _check_plain(flat, index)
        raise _NotRecordable("an op the tracer cannot replay")
    w = q.window
    by_ptr = w.by_ptr
    leaves: list = []
    meta_key: list = [number]
    slot_key: list = []
    new_slots: Optional[list] = None
    any_dev = False
    scal: Optional[list] = None     # [(leaf index, value, dtype as an input)]
    all_fp32 = True
    Tensor = torch.Tensor
    for a in flat:
        if isinstance(a, Tensor):
            if a.is_cpu:
                if a.dim() or a.requires_grad:
                    if check:
                        raise _Decline()
                    raise _NotRecordable("a host tensor argument")
                if t_form and a.dtype in _SCALAR_DTYPES:
                    if scal is None:
                        scal = []
                    scal.append((len(leaves), a.item(), a.dtype))
                    meta_key.append(("t?", a.dtype))
                else:
                    meta_key.append(_leaf_key(a))
                leaves.append(a)
                continue
            dtype = a.dtype
            # (a conjugate bit is only ever set on a complex tensor: real ones skip that call)
            if check and (a.get_device() != index or (dtype.is_complex and a.is_conj()) or a.is_neg()):
                raise _Decline()
            any_dev = True
            if dtype is not _F32:
                all_fp32 = False
            shape = tuple(a.shape)
            stride = a.stride()
            offset = a.storage_offset()
            st = a.untyped_storage()
            ptr = st.data_ptr()
            s = by_ptr.get(ptr)
            if s is not None and (s.strong if s.external else s.ref()) is not st:
                s = None
            if s is None:
                if new_slots is not None:
                    for st2, t2 in new_slots:
                        if st2 is st:
                            s = t2
                            break
                else:
                    new_slots = []
                if s is None:
                    nb = st.nbytes()
                    blank = w.blanks.get(ptr)
                    blank = blank is not None and blank() is st
                    bk = (shape, stride, offset, dtype, nb)
                    base = _BASES.get(bk)
                    if base is None:
                        if len(_BASES) > 4096:
                            _BASES.clear()
                        base = _BASES[bk] = _base_shape(a, nb)
                    s = _Slot(len(w.slots) + len(new_slots), st, not blank, dtype, base, blank, nb)
                    new_slots.append((st, s))
                    slot_key.append(("blank" if blank else "ext", s.index, s.shape, dtype))
            if s.dtype is not dtype:
                if check:
                    _check_plain(flat, index)
                raise _NotRecordable("a dtype view of pending memory")
            si = s.index
            leaves.append(_mkref(_Ref, (si, shape, stride, offset, dtype)))
            meta_key.append((shape, stride, offset, dtype))
            slot_key.append(si)
        else:
            if f_form is not None and type(a) is float:
                if scal is None:
                    scal = []
                scal.append((len(leaves), a, None))
                meta_key.append(_F_KEY)
            else:
                meta_key.append(_leaf_key(a))
            leaves.append(a)
    if not any_dev:
        if check:
            raise _Decline()
        raise _NotRecordable("no device tensor argument")
    if f_form is not None and scal:
        fs = [x for x in scal if x[2] is None]
        if len(fs) > 1 or not all_fp32:     # the form scales one fp32 operand: otherwise the value is a literal
            for li, v, _ in fs:
                meta_key[li + 1] = _leaf_key(v)
            scal = [x for x in scal if x[2] is not None]
    mk = tuple(meta_key)
    rec_key = (mk, tuple(slot_key))
    if _REFUSED and rec_key in _REFUSED:
        raise _NotRecordable("an op the window tracer refused before")
    parent = w.node
    node = parent.kids.get(rec_key)
    if node is not None:      # a known path: the op's plan is the node's (no look-up, no LRU bookkeeping)
        plan = node.plan
    elif (plan := _META.get(mk)) is None:
        try:
            plan = _plan(op, leaves, spec)
        except Exception as e:   # no meta kernel, or a bad call: eager runs it (and raises at the user's line)
            raise _NotRecordable(f"its meta kernel failed ({type(e).__name__})") from None
        _meta_put(mk, plan)
    else:
        try:
            _META.move_to_end(mk)
        except KeyError:        # evicted meanwhile by another device's queue (another lock): the plan still holds
            pass
    tree, items, single, exact_plan = plan
    if exact and not exact_plan:
        raise _Decline()
    # commit: the op belongs to the window from here on
    slots = w.slots
    if new_slots:
        for st, s in new_slots:
            slots.append(s)
            by_ptr[st.data_ptr()] = s
            if s.blank:
                del w.blanks[st.data_ptr()]
    if single and items[0][0] == "fresh":     # the common case: one new tensor, from the plan's metadata
        _, shape, dtype, strides, nbytes = items[0]
        fresh = []
        result = _new_result(index, shape, strides, dtype, nbytes, slots, by_ptr, fresh, 0)
    else:
        fresh = []
        out = []
        for j, it in enumerate(items):
            kind = it[0]
            if kind == "fresh":
                out.append(_new_result(index, it[1], it[3], it[2], it[4], slots, by_ptr, fresh, j))
            elif kind == "alias":
                out.append(flat[it[1]])
            else:
                out.append(it[1])
        result = out[0] if single else tree_unflatten(out, tree)
    sc = ()
    if scal:
        n = len(w.svals)
        sc = tuple([(x[0], n + k) for k, x in enumerate(scal)])
        svals, sdtypes = w.svals, w.sdtypes
        for _, v, d in scal:
            svals.append(v)
            sdtypes.append(_F32 if d is None else d)
    recs = w.recs
    if not recs:
        w.limit = config.get("window_ops")
    recs.append(_mkref(_Rec, (op, leaves, spec, plan, fresh, _user_src(3), sc)))
    w.keys.append(rec_key)
    w.node = node if node is not None else _child(parent, rec_key, plan)
    _count(name)
    if len(recs) >= w.limit:
        flush("buffer limit")
    return result


class _Node:
    """A point of the trie of recorded op sequences (:data:`_TRIE`): the path from the root is the sequence of
    the ops' keys, so a window's last node *is* its signature (the cache key of :func:`_run_window`: no tuple
    of every op's key to build, hash and compare at each flush); a node keeps the plan of the op that led to it
    (a steady loop's ops skip the plan look-up)."""

    __slots__ = ("kids", "plan")

    def __init__(self, plan: Any = None):
        self.kids: Dict[Any, "_Node"] = {}
        self.plan = plan


#: ``[root, nodes made since it was]``; past :data:`_TRIE_MAX` nodes (a KV cache's ops make new keys every decode
#: step) a new root starts a new trie (windows cached under the old one compile once more when they recur)
_TRIE: list = [_Node(), 0]
_TRIE_MAX = 1 << 16


def _child(parent: _Node, rec_key: Any, plan: Any) -> _Node:
    """``parent``'s node for an op of key ``rec_key`` (made, with ``plan``, if new)."""
    node = parent.kids.setdefault(rec_key, _Node(plan))   # (queues of other devices record under other locks)
    if node.plan is plan:
        _TRIE[1] += 1
        if _TRIE[1] > _TRIE_MAX:
            _reset_trie()
    return node


def _reset_trie() -> None:
    """Start a new trie; the old one's nodes let go of their children (a cached window's node stays a valid key
    of its own, but no longer holds the paths below it)."""
    old = _TRIE[0]
    _TRIE[0], _TRIE[1] = _Node(), 0
    todo = [old]
    while todo:
        n = todo.pop()
        todo.extend(n.kids.values())
        n.kids = {}


def _meta_put(mk: Any, plan: Any) -> None:
    """Cache ``plan`` under ``mk`` in :data:`_META`, dropping the least recently used plans beyond
    :data:`_META_MAX` (queues of different devices record under different locks: a racing eviction is harmless)."""
    _META[mk] = plan
    while len(_META) > _META_MAX:
        try:
            _META.popitem(last=False)
        except KeyError:
            break


_F32 = torch.float32
_count = tracking.count
_new_dense = allocator.new_dense


def _new_result(index: int, shape: tuple, strides: tuple, dtype: torch.dtype, nbytes: int, slots: list,
                by_ptr: dict, fresh: list, j: int) -> torch.Tensor:
    """A new neuron tensor for result ``j`` of the op being recorded (its memory a new slot of the window;
    ``strides`` are ``shape``'s contiguous strides, as :func:`_plan` makes them)."""
    t, st = _new_dense(shape, dtype, nbytes, index)
    s = _Slot(len(slots), st, False, dtype, shape, False, nbytes)
    slots.append(s)
    by_ptr[st.data_ptr()] = s
    fresh.append((j, s.index))
    return t


# --------------------------------------------------------------------------- flushing


def flush(reason: str = "explicit", detail: Optional[str] = None) -> None:
    """Run every op recorded so far (``reason`` is counted in :func:`stats` and logged with ``TN_LOG=windows``)."""
    for q in tuple(_QUEUES.values()):
        with q.lock:
            w = q.window
            if not w.recs:
                if w.blanks:             # only blank memory, no op: nothing to run
                    q.window = _Window(w.index)
                continue
            q.window = _Window(w.index)
            _run_window(w, reason if detail is None else f"{reason} ({detail})", reason)


def on_empty(t: torch.Tensor) -> None:
    """Hook of the device's ``empty`` kernels: in adaptive mode, memory made now is a blank slot of the window
    (weakly held, no program input: an ``out=`` op that fills it defines its value)."""
    if not active() or t.numel() == 0:
        return
    q = _queue(t.device.index or 0)
    with q.lock:
        st = t.untyped_storage()
        q.window.blanks[st.data_ptr()] = weakref.ref(st)


def before_host_access(t: torch.Tensor) -> None:
    """Hook of :func:`tn.device.allocator.cpu_alias`: flush when a queued op reads or writes ``t``'s memory."""
    for q in tuple(_QUEUES.values()):
        w = q.window
        if not w.by_ptr and not w.blanks:
            continue
        st = t.untyped_storage()
        if w.blanks.pop(st.data_ptr(), None) is not None:   # blank memory the host writes (empty, then copy_)
            continue
        s = w.slot_of(st)
        if w.recs and s is not None:
            where = _user_src()
            flush("host access", f"{os.path.basename(where[0])}:{where[1]}" if where else None)
            return


class _Compiled:
    """A compiled window: the executable, which slots are its inputs and outputs, the IR's mutations, which
    scalars are inputs (``params``, after the slots) and the values of those baked in (``fixed``)."""

    __slots__ = ("exe", "inputs", "outputs", "mutations", "reason", "name", "params", "fixed", "bucket",
                 "fresh_bucket", "binds")

    def __init__(self, exe=None, inputs=(), outputs=(), mutations=(), reason=None, name="", params=(), fixed=()):
        self.exe = exe
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.mutations = tuple(mutations)
        self.reason = reason
        self.name = name
        self.params = tuple(params)
        self.fixed = tuple(fixed)
        self.bucket: Optional[Tuple[Any, int]] = None    # (its bucket's program, the window's size) for a bucket
        self.fresh_bucket = False                        # ... whose program this window compiled
        self.binds: Optional[Tuple[list, list]] = None    # (input addresses, their aliases) of the last call


def _short(src: Optional[Tuple[str, int]]) -> Optional[str]:
    return f"{os.path.basename(src[0])}:{src[1]}" if src else None


def _window_name(w: _Window) -> str:
    """``window12_addmm_gelu_native_layer_norm_mm``: a window's op count and its first four distinct ops."""
    seen: List[str] = []
    for r in w.recs:
        n = r.op._schema.name.split("::")[-1]
        if n not in seen:
            seen.append(n)
            if len(seen) == 4:
                break
    return f"window{len(w.recs)}_" + "_".join(seen)


def _run_window(w: _Window, reason: str, kind: str) -> None:
    live = tuple(s.index for s in w.slots if not s.external and s.ref() is not None)
    # the signature: the op sequence, every tensor's metadata and slot, the slots' shapes (new slots' are in their
    # first op's key, results' follow from their op's plan): all of it is the path to the window's trie node
    key = w.node
    _STATS["windows"] += 1
    _STATS["ops"] += len(w.recs)
    _STATS["ops_per_window"][len(w.recs)] += 1
    _STATS["flush_reasons"][kind] += 1
    # Which results are still held depends on when Python frees objects (HF caches die in the cycle
    # collector): a program that writes out a superset of the live results serves this call too (results
    # that died are skipped), and a miss compiles the union of what was live in this window's earlier calls.
    entries = _CACHE.get(key)
    entry = None
    if entries is not None:
        _CACHE.move_to_end(key)
        need = set(live)
        sv = w.svals
        entry = next((e for e in entries if e.exe is None or (need.issubset(e.outputs) and
                                                             (not e.fixed or _baked_match(e, sv)))), None)
    hit = entry is not None
    if hit:
        _STATS["hits"] += 1
        how = "cache hit"
        if entry.bucket is not None:
            _STATS["bucket_hits"] += 1
            how = f"bucket hit (size {entry.bucket[1]} of {entry.bucket[0].size})"
    else:
        # a window that recurs with a growing size: its bucket's program (tn.bucketing), else a program of this size
        entry = _bucket_entry(w, live, entries)
        if entry is not None:
            bk, n = entry.bucket
            if entry.fresh_bucket:
                _STATS["compiles"] += 1
                _STATS["bucket_compiles"] += 1
                how = f"bucket compile (size {n} of {bk.size})"
            else:
                _STATS["hits"] += 1
                _STATS["bucket_hits"] += 1
                how = f"bucket hit (size {n} of {bk.size})"
        else:
            if entries:
                live = tuple(sorted(set(live).union(*(e.outputs for e in entries))))
            t0 = time.perf_counter()
            entry = _compile(w, live, _params(w, entries))
            _STATS["compile_s"] += time.perf_counter() - t0
            _STATS["compiles"] += 1
            how = "compiled" if entry.exe is not None else f"op by op: {entry.reason}"
        if entries is None:
            entries = _CACHE[key] = []
        entries.insert(0, entry)
        del entries[4:]
        if len(_CACHE) > _CACHE_MAX:
            _CACHE.popitem(last=False)
    if config.log_enabled("windows"):
        log.info("tn.device window: %s, %s, flushed by %s%s", entry.name or _window_name(w), how,
                 reason, f"; {len(live)} results kept" if live else "")
    _TLS.executing = True
    # the window's program runs where its ops were issued: on its device's core, on their stream
    prev_core = _tl.set_current_core(w.index) if _tl.current_core() != w.index else None
    stream = w.stream
    prev = _tl.set_current_queue(stream) if stream is not None else None
    try:
        if entry.exe is not None:
            try:
                if entry.bucket is not None:
                    _run_bucket(w, entry)
                else:
                    _run_compiled(w, entry)
                return
            except Exception as e:   # the op-by-op re-run below raises the error at the op that caused it
                log.debug("tn.device window %s failed (%s: %s); re-running op by op", entry.name,
                          type(e).__name__, e)
        _STATS["op_by_op"] += 1
        _run_op_by_op(w)
    finally:
        _TLS.executing = False
        if prev is not None:
            _tl.set_current_queue(prev)
        if prev_core is not None:
            _tl.set_current_core(prev_core)


def _alias(st: Any, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
    """A contiguous CPU tensor of ``shape`` at the start of neuron storage ``st`` (no copy)."""
    return allocator.host_tensor(st.data_ptr(), st.nbytes(), dtype, shape)


_ALIASES: Dict[Tuple[int, torch.dtype, Tuple[int, ...]], torch.Tensor] = {}


def _cached_alias(st: Any, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
    """:func:`_alias`, kept per address, dtype and shape, for program inputs: a steady loop binds the same
    weights and state every call. (An alias only names memory: it is used while a live storage owns it.)"""
    k = (st.data_ptr(), dtype, shape)
    t = _ALIASES.get(k)
    if t is None:
        if len(_ALIASES) > 8192:
            _ALIASES.clear()
        t = _ALIASES[k] = _alias(st, dtype, shape)
    return t


def _result_memory(s: Any) -> Optional[torch.Tensor]:
    """A window result's own device memory (its cached alias), or None for a result the user dropped."""
    st = s.storage()
    return None if st is None else _cached_alias(st, s.dtype, s.shape)


def _land(out: torch.Tensor, dst: Optional[torch.Tensor]) -> None:
    """Copy a program output into its result's memory ``dst``, unless the program wrote it there (``out=``) or
    the result was dropped: an output the program did not write is an input, a literal or a host op's value."""
    if dst is not None and out.data_ptr() != dst.data_ptr():
        dst.copy_(out.reshape(dst.shape))


def _bind_inputs(w: _Window, entry: _Compiled) -> list:
    """The host aliases of window ``w``'s program inputs (a new list): per input, the last call's alias when the
    input is at the same address (a steady loop's weights and state; an input's dtype and shape are the window
    signature's), else from :func:`_cached_alias` (a decode step's KV cache and token ids move every step)."""
    slots = w.slots
    inputs = entry.inputs
    ptrs = [slots[i].strong.data_ptr() for i in inputs]
    b = entry.binds
    if b is None:
        ins = [_cached_alias(slots[i].strong, slots[i].dtype, slots[i].shape) for i in inputs]
    else:
        old, ins = b
        if old == ptrs:
            return list(ins)
        ins = [x if p == q else _cached_alias(slots[i].strong, slots[i].dtype, slots[i].shape)
               for x, p, q, i in zip(ins, ptrs, old, inputs)]
    entry.binds = (ptrs, ins)
    return list(ins)


def _run_compiled(w: _Window, entry: _Compiled) -> None:
    slots = w.slots
    ins = _bind_inputs(w, entry)
    if entry.params:
        sv, sd = w.svals, w.sdtypes
        ins += [torch.tensor(sv[i], dtype=sd[i]) for i in entry.params]
    # the results' own memory is where the program writes them (no copy afterwards); a result the user dropped
    # gets memory of the call's own. (A result's memory is reused by later windows: its alias is kept too.)
    dst = [_result_memory(slots[i]) for i in entry.outputs]
    outs = _exe_call(entry.exe, ins, dst)
    prof = entry.exe.last_profile
    if prof is not None:
        tracking.add_device_ns(prof.total_ns)
        _STATS["device_ns"] += prof.total_ns
    for o, d in zip(outs, dst):
        _land(o, d)
    for i, j in entry.mutations:
        ins[i].copy_(outs[j].reshape(ins[i].shape))


#: ``[NeuronExecutable]`` once the compiler is loaded: the executables that take ``out=`` (their wrappers, for
#: complex pairs or status checks, do not: those results are copied)
_PLAIN_EXE: list = [None]


def _exe_call(exe: Any, ins: list, dst: list) -> list:
    """Run ``exe`` on ``ins``, writing its outputs into ``dst`` (per output a tensor or None) when it can."""
    return exe(ins, out=dst) if type(exe) is _PLAIN_EXE[0] else exe(ins)


def _compile_ir(ir: Any, name: str) -> Any:
    """A window's executable (strict mode: a host equation raises, and the window runs op by op)."""
    from .. import lower  # lazy: the compiler loads on the first window (import tn does not pay for it)

    exe = lower.compile_ir(ir, name=name)
    _PLAIN_EXE[0] = lower.compiler.NeuronExecutable
    # No laid-out weight variant (tn.lower.layout): the executable would compile itself a second time on its
    # second call with the same weights. Measured on HF GPT-2 generate (32 decode windows, each run once per
    # call): 2.2 s of compiling in the second call, for 2% less modelled device time; a training window
    # updates its weights, so it never qualified.
    exe._layout = None
    return exe


def _compile(w: _Window, live: Tuple[int, ...], params: Tuple[int, ...] = ()) -> _Compiled:
    name = _window_name(w)
    ext = [s.index for s in w.slots if s.external]
    metas = [torch.empty(w.slots[i].shape, dtype=w.slots[i].dtype, device="meta") for i in ext]
    metas += [torch.empty((), dtype=w.sdtypes[i], device="meta") for i in params]
    try:
        traced = trace_flat(_replayer(w, ext, live, params), metas)
        ir = optimize(traced.ir)
        exe = _compile_ir(ir, name)
    except _ReplayError as e:
        _REFUSED.add(w.keys[e.k])
        return _Compiled(reason=f"{type(e.cause).__name__} at {_short(w.recs[e.k].src)}: "
                         f"{str(e.cause).splitlines()[0] if str(e.cause) else ''}", name=name)
    except Exception as e:   # the window runs op by op; its ops' own errors (if any) surface there
        return _Compiled(reason=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", name=name)
    ps = set(params)
    fixed = tuple((i, v) for i, v in enumerate(w.svals) if i not in ps)
    return _Compiled(exe, ext, live, ir.mutations, name=name, params=params, fixed=fixed)


class _ReplayError(Exception):
    def __init__(self, k: int, cause: BaseException):
        super().__init__(str(cause))
        self.k = k
        self.cause = cause


def _scalar_leaves(w: _Window, rec: _Rec, leaves: list, inputs: Optional[Dict[int, torch.Tensor]] = None) -> Any:
    """Put ``rec``'s scalars into ``leaves`` as recorded (host tensors rebuilt from the recorded value: the
    user may have changed them since) or, for those in ``inputs`` (window scalar index -> 0-dim tensor), as
    that tensor; returns the tensor that stands for a float scalar (its leaf is ``_MARK``), or None."""
    form = None
    for li, gi in rec.scal:
        x = rec.leaves[li]
        t = inputs.get(gi) if inputs else None
        if t is None:
            if type(x) is not float:
                leaves[li] = torch.tensor(w.svals[gi], dtype=x.dtype)
        elif type(x) is float:
            leaves[li] = _MARK
            form = t
        else:
            leaves[li] = t
    return form


def _replayer(w: _Window, ext: List[int], live: Tuple[int, ...], params: Tuple[int, ...] = ()):
    """The function :func:`tn.trace.trace_flat` traces: the window's ops, in order, on its storages' values
    (then the scalars ``params`` as 0-dim inputs)."""
    def view(bases: Dict[int, torch.Tensor], r: _Ref) -> torch.Tensor:
        b = bases.get(r.slot)
        if b is None:     # memory made by torch.empty inside the window, read before written: undefined values
            s = w.slots[r.slot]
            b = bases[r.slot] = torch.empty(s.shape, dtype=s.dtype)
        return _view_of(b, r.shape, r.stride, r.offset)

    def replay(*tensors):
        bases = dict(zip(ext, tensors))
        inputs = dict(zip(params, tensors[len(ext):]))
        for k, rec in enumerate(w.recs):
            try:
                with source_hint(_short(rec.src)):
                    leaves = [view(bases, x) if type(x) is _Ref else x for x in rec.leaves]
                    op = rec.op
                    form = _scalar_leaves(w, rec, leaves, inputs) if rec.scal else None
                    args, kwargs = unflatten_args(leaves, rec.spec)
                    if form is not None:
                        op, args, kwargs = _tensor_scalar_call(op, args, kwargs, form)
                    res = op(*args, **kwargs)
                    if rec.fresh:
                        flat = tree_flatten(res)[0]
                        for j, slot in rec.fresh:
                            t = flat[j]
                            if not (t.is_contiguous() and t.storage_offset() == 0):
                                t = t.contiguous()
                            bases[slot] = t
            except Exception as e:
                raise _ReplayError(k, e) from e
        return [bases[i] for i in live]

    return replay


def _view_of(b: torch.Tensor, shape: tuple, stride: tuple, offset: int) -> torch.Tensor:
    """The tensor ``as_strided(b, shape, stride, offset)`` of a row-major base ``b``, written with the view
    ops that say what it is (reshape, permute, narrow, expand), which the compiler reads better than a
    strided copy; ``as_strided`` only when none fits."""
    bshape = tuple(b.shape)
    if shape == bshape and offset == 0 and all(s == c or d == 1 for s, c, d in
                                               zip(stride, allocator.contiguous_strides(shape), shape)):
        return b
    if any(s == 0 and d != 1 for d, s in zip(shape, stride)):      # broadcast dims: view without them, expand
        core = tuple(1 if s == 0 else d for d, s in zip(shape, stride))
        return _view_of(b, core, stride, offset).expand(shape)
    n, bn = numel(shape), b.numel()
    contiguous = all(s == c or d == 1 for s, c, d in zip(stride, allocator.contiguous_strides(shape), shape))
    if contiguous:
        if offset == 0 and n == bn:
            return b.view(shape)
        if offset + n <= bn:
            return b.reshape(-1).narrow(0, offset, n).view(shape)
    if offset == 0 and n == bn:
        mo = _memory_order(shape, stride)
        if mo is not None:
            perm, mem = mo
            inv = [perm.index(d) for d in range(len(perm))]
            return (b if mem == bshape else b.view(mem)).permute(inv)
    bstr = allocator.contiguous_strides(bshape)
    if len(shape) == len(bshape) and all(s == c or d == 1 for d, s, c in zip(shape, stride, bstr)):
        starts, rest = [], offset
        for c in bstr:
            starts.append(rest // c)
            rest %= c
        if rest == 0 and all(st + d <= bd for st, d, bd in zip(starts, shape, bshape)):
            t = b
            for i, (st, d, bd) in enumerate(zip(starts, shape, bshape)):
                if st or d != bd:
                    t = t.narrow(i, st, d)
            return t
    return torch.as_strided(b, shape, stride, offset)


def _tensor_on(st: Any, r: _Ref) -> torch.Tensor:
    """A neuron tensor with ``r``'s metadata on storage ``st``."""
    t = allocator.blank(r.dtype, st.device.index or 0)
    allocator._set_handle(allocator._CPU_KEYS, t, st, r.offset, r.shape, r.stride)
    return t


#: The device's op-by-op path (:func:`tn.device.eager.run_op`), installed by that module when it is imported (it
#: sits above this one: it queues ops here).
_OP_RUNNER: List[Any] = [None]


def install_op_runner(run_op: Any) -> None:
    """Set the function a window replaying its ops one by one runs each op with (``run_op(op, args, kwargs)``)."""
    _OP_RUNNER[0] = run_op


def _run_op_by_op(w: _Window) -> None:
    """Run a window's ops one by one through the eager path; an error names the user's line of its op."""
    run_op = _OP_RUNNER[0]
    stores = []
    for s in w.slots:
        st = s.storage()
        if st is None:      # a result nobody holds any more: scratch memory for the ops that read it
            st = allocator.alloc_storage(s.nbytes, w.index)
        stores.append(st)
    for rec in w.recs:
        leaves = [_tensor_on(stores[x.slot], x) if type(x) is _Ref else x for x in rec.leaves]
        if rec.scal:
            _scalar_leaves(w, rec, leaves)
        args, kwargs = unflatten_args(leaves, rec.spec)
        try:
            res = run_op(rec.op, args, kwargs)
        except Exception as e:
            _name_the_line(e, rec)
            raise
        if rec.fresh:
            flat = tree_flatten(res)[0]
            for j, slot in rec.fresh:
                s = w.slots[slot]
                _alias(stores[slot], s.dtype, s.shape).copy_(allocator.cpu_alias(flat[j]))


def _name_the_line(e: BaseException, rec: _Rec) -> None:
    """Say in ``e`` which user line issued the op (the error surfaced later, when its window ran)."""
    if rec.src is None:
        return
    fn, line = rec.src
    code = linecache.getline(fn, line).strip()
    note = (f"{fn}:{line}: `{code}`" if code else f"{fn}:{line}") + \
        f": this op ({rec.op}) was queued in an adaptive eager window there and ran when the window was flushed"
    if e.args and isinstance(e.args[0], str):
        e.args = (f"{note}\n{e.args[0]}",) + tuple(e.args[1:])
    else:
        e.add_note(note)


# --------------------------------------------------------------------------- buckets: windows that grow (a KV cache)
#
# A decode step's window recurs with one dimension one longer each time (the KV cache's length): its signature is new
# every step, so each step would compile. A miss therefore also computes the window's *skeleton*: its signature with
# every integer of its metadata (shapes, strides, offsets, int arguments, input shapes) taken out, and those integers
# as a vector. The second window of a skeleton whose integers differ fits them as ``a + b * n`` (``n`` the growing
# size, the smallest input size that grows by one); a later window whose integers fit is the same window at another
# ``n``. Its bucket (``tn.bucketing.bucket_size``, masked: front padding) gets one program: the window replayed at
# the bucket's size, proved by :func:`tn.bucketing.same_program` to be the program traced at the window's own size,
# rewritten by :func:`tn.bucketing.masked_program` (inputs padded at the front along the growing axis, the padded
# positions masked where an equation mixes them). A call pads its inputs and narrows its results back with two
# small DMA programs run on the NeuronCore model (their time is the window's too; once a size's time is known and no
# tn.profile listens, the host does those copies and charges it, as the fast path does). A window the proofs refuse
# (a slice along the growing axis, a size baked into a literal, ...) keeps compiling per size, as before.

_SKELS: "OrderedDict[Any, _Skel]" = OrderedDict()
_SKELS_MAX = 256


class _Skel:
    """What is known of one skeleton: the integers of its last window and the families of sizes fitted so far."""

    __slots__ = ("last", "families")

    def __init__(self, nums: List[int]):
        self.last = nums
        self.families: List[_Family] = []


class _Family:
    """Windows of one skeleton whose integers are ``a + b * n``: the fit, the buckets' programs, or why none."""

    __slots__ = ("a", "b", "k0", "n_min", "buckets", "refused")

    def __init__(self, fit: Tuple[List[int], List[int], int, int]):
        self.a, self.b, self.k0, self.n_min = fit     # n is integer k0; n_min the smallest n seen
        self.buckets: Dict[int, "_Bucket"] = {}
        self.refused: Optional[str] = None

    def size_of(self, nums: List[int]) -> Optional[int]:
        """The ``n`` of a window with integers ``nums`` when it belongs to the family, else None (a window
        shorter than any seen does not: a tail slice may reach into the padding)."""
        n = nums[self.k0]
        if n < self.n_min or any(x != y + z * n for x, y, z in zip(nums, self.a, self.b)):
            return None
        return n


class _Bucket:
    """One bucket's program: size ``size``, padded inputs ``{input position: axis}``, output axes, its shapes."""

    __slots__ = ("size", "exe", "axes", "out_axes", "in_shapes", "out_shapes", "outputs", "moves", "bufs", "zeroed",
                 "name",
                 "params", "fixed", "mutations", "ns")

    def __init__(self, size, exe, axes, out_axes, in_shapes, out_shapes, outputs, name, params, fixed, mutations):
        self.size = size
        self.exe = exe
        self.axes = axes                # input position (in the window's external slots) -> growing axis
        self.out_axes = out_axes        # per output: the growing axis or None
        self.in_shapes = in_shapes      # per input position: its shape in the bucket's program
        self.out_shapes = out_shapes
        self.outputs = outputs          # slot indices of the program's outputs
        self.moves: Dict[int, Any] = {}  # n -> (pad program, narrow program) (tn.neuron Encoded, or None)
        self.bufs: Dict[int, torch.Tensor] = {}   # input position -> its padded buffer (reused every call)
        self.zeroed: Dict[int, int] = {}          # id of a buffer -> the padding known to be zeros (front, on its axis)
        self.ns: Dict[Tuple[int, int], float] = {}  # (n, 0 pad | 1 narrow) -> the DMA program's modelled ns
        self.name = name
        self.params = tuple(params)     # the window's scalars the program takes as inputs (after the slots)
        self.fixed = tuple(fixed)       # (scalar index, value) baked into the program
        self.mutations = tuple(mutations)


def _skeleton(w: _Window) -> Tuple[Any, List[int]]:
    """``(skeleton, integers)`` of window ``w`` (see above)."""
    nums: List[int] = []
    sk: list = []
    for s in w.slots:
        if s.external or s.blank:
            sk.append((s.index, s.blank, s.dtype, len(s.shape)))
            nums.extend(s.shape)
    for k, rec in enumerate(w.recs):
        mk = w.keys[k][0]
        ent = [mk[0]]
        for li, x in enumerate(rec.leaves):
            tx = type(x)
            if tx is _Ref:
                ent.append((x.slot, x.dtype, len(x.shape)))
                nums.extend(x.shape)
                nums.extend(x.stride)
                nums.append(x.offset)
            elif tx is int:
                ent.append(0)
                nums.append(x)
            else:
                ent.append(mk[li + 1])
        sk.append(tuple(ent))
    return tuple(sk), nums


def _ext_size_slots(w: _Window) -> List[Tuple[int, int, int]]:
    """``(position in the integers, external slot position, axis)`` of every input shape entry."""
    out, at, pos = [], 0, 0
    for s in w.slots:
        if s.external:
            for d in range(len(s.shape)):
                out.append((at + d, pos, d))
            pos += 1
        if s.external or s.blank:
            at += len(s.shape)
    return out


def _fit(w: _Window, old: List[int], new: List[int]) -> Optional[Tuple[List[int], List[int], int, int]]:
    """Fit the integers of two windows of one skeleton as ``a + b * n``: ``(a, b, index of n, n of the older)``,
    or None when they do not differ by one step of one growing size."""
    diff = [y - x for x, y in zip(old, new)]
    ins = _ext_size_slots(w)
    steps = [diff[i] for i, _, _ in ins if diff[i] > 0]
    if not steps:
        return None
    d = min(steps)
    if any(x % d for x in diff):
        return None
    b = [x // d for x in diff]
    grow = [i for i, _, _ in ins if b[i] == 1]
    if not grow or any(b[i] not in (0, 1) for i, _, _ in ins):
        return None
    k0 = min(grow, key=lambda i: new[i])
    a = [y - bb * new[k0] for y, bb in zip(new, b)]
    if any(a[i] < 0 for i in grow):
        return None
    return a, b, k0, old[k0]


def _resized(w: _Window, a: List[int], b: List[int], n: int) -> Any:
    """Window ``w`` with its integers set to ``a + b * n`` (its ops replayed at size ``n``): an object the replay
    (:func:`_replayer`) and :func:`_metas` read."""
    it = iter([x + y * n for x, y in zip(a, b)])
    slots = []
    for s in w.slots:
        shape = tuple(next(it) for _ in s.shape) if s.external or s.blank else s.shape
        slots.append(SimpleNamespace(index=s.index, external=s.external, blank=s.blank, dtype=s.dtype, shape=shape))
    recs = []
    for rec in w.recs:
        leaves = []
        for x in rec.leaves:
            tx = type(x)
            if tx is _Ref:
                r = len(x.shape)
                shape = tuple(next(it) for _ in range(r))
                stride = tuple(next(it) for _ in range(r))
                leaves.append(_Ref(x.slot, shape, stride, next(it), x.dtype))
            elif tx is int:
                leaves.append(next(it))
            else:
                leaves.append(x)
        recs.append(_Rec(rec.op, leaves, rec.spec, rec.plan, rec.fresh, rec.src, rec.scal))
    v = _Window(w.index)
    v.recs, v.slots, v.svals, v.sdtypes, v.keys = recs, slots, w.svals, w.sdtypes, w.keys
    return v


def _metas(w: Any, params: Tuple[int, ...]) -> List[torch.Tensor]:
    """Meta tensors of a window's program inputs: its external slots, then the scalars ``params``."""
    metas = [torch.empty(s.shape, dtype=s.dtype, device="meta") for s in w.slots if s.external]
    return metas + [torch.empty((), dtype=w.sdtypes[i], device="meta") for i in params]


def _bucket_entry(w: _Window, live: Tuple[int, ...], entries: Optional[List["_Compiled"]]) -> Optional["_Compiled"]:
    """The bucket program serving window ``w`` (compiling it if its bucket has none), or None: compile per size."""
    sk, nums = _skeleton(w)
    st = _SKELS.get(sk)
    if st is None:
        _SKELS[sk] = _Skel(nums)
        if len(_SKELS) > _SKELS_MAX:
            _SKELS.popitem(last=False)
        return None
    _SKELS.move_to_end(sk)
    fam, n = None, None
    for f in st.families:
        n = f.size_of(nums)
        if n is not None:
            fam = f
            break
    if fam is None:
        fit = _fit(w, st.last, nums)
        st.last = nums
        if fit is None:
            return None
        fam = _Family(fit)
        st.families.insert(0, fam)
        del st.families[4:]
        n = nums[fam.k0]
    st.last = nums
    if fam.refused is not None:
        return None
    size = bucketing.bucket_size(n, masked=True)
    if size is None or size < n:
        return None
    params = _params(w, entries)
    bk = fam.buckets.get(size)
    compiled = False
    if bk is None or not set(live).issubset(bk.outputs) or not set(params).issubset(bk.params) or (
            bk.fixed and not _baked_match(bk, w.svals)):
        if bk is not None:
            live = tuple(sorted(set(live).union(bk.outputs)))
            params = tuple(sorted(set(params).union(bk.params)))
        t0 = time.perf_counter()
        try:
            bk = _compile_bucket(w, fam.a, fam.b, n, size, live, params)
        except Exception as e:    # refused by a proof, or the program did not compile: per-size programs from now on
            fam.refused = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if config.log_enabled("windows"):
                log.info("tn.device window: %s, no bucket (%s)", _window_name(w), fam.refused)
            return None
        finally:
            _STATS["compile_s"] += time.perf_counter() - t0
        fam.buckets[size] = bk
        compiled = True
    e = _Compiled(bk.exe, [s.index for s in w.slots if s.external], bk.outputs, bk.mutations, name=bk.name,
                  params=bk.params, fixed=bk.fixed)
    e.bucket = (bk, n)
    e.fresh_bucket = compiled
    return e


def _compile_bucket(w: _Window, a: List[int], b: List[int], n: int, size: int, live: Tuple[int, ...],
                    params: Tuple[int, ...]) -> _Bucket:
    """Trace window ``w`` at its size and at ``size``, prove the padding exact, compile the masked program."""
    ext = [s.index for s in w.slots if s.external]
    small = optimize(trace_flat(_replayer(w, ext, live, params), _metas(w, params)).ir)
    big_w = _resized(w, a, b, size)
    big = optimize(trace_flat(_replayer(big_w, ext, live, params), _metas(big_w, params)).ir)
    axes: Dict[int, int] = {}
    for i, pos, d in _ext_size_slots(w):
        if b[i]:
            axes[pos] = d
    why = bucketing.same_program(small, big, sorted(axes.items()), tail_slices=True)
    if why is not None:
        raise bucketing.Mixed(why)
    muts = tuple(big.mutations)
    pad = Var((), torch.float32)
    core = big.replace(inputs=list(big.inputs) + [pad], mutations=())
    mir, out_axes = bucketing.masked_program(core, axes, len(core.inputs) - 1, tail_slices=True,
                                             finite_padding=True)   # the pad program fills zeros
    for i, j in muts:
        if i in axes or out_axes[j] is not None:
            raise bucketing.Mixed("the window writes padded positions back into an input")
    grow = size - n
    for j, (u, v) in enumerate(zip(small.outputs, big.outputs)):
        ax = out_axes[j]
        want = tuple(x + grow if d == ax else x for d, x in enumerate(u.shape))
        if tuple(v.shape) != want:
            raise bucketing.Mixed(f"result {j} is {list(v.shape)} at size {size}, {list(u.shape)} at size {n}: "
                                  f"not the same result padded along one axis")
    name = f"{_window_name(w)}_bucket{size}"
    exe = _compile_ir(optimize(mir.replace(mutations=muts)), name)
    ps = set(params)
    fixed = tuple((i, v) for i, v in enumerate(w.svals) if i not in ps)
    return _Bucket(size, exe, axes, list(out_axes), [tuple(v.shape) for v in big.inputs],
                   [tuple(v.shape) for v in big.outputs], tuple(live), name, params, fixed, muts)


def _flat2(shape: Tuple[int, ...], axis: int, itemsize: int) -> Tuple[int, int, int]:
    """``(outer, size along axis, inner)`` of a row-major shape (inner in 4-byte words when it divides)."""
    outer = numel(shape[:axis])
    inner = numel(shape[axis + 1:]) * itemsize
    return outer, shape[axis], inner


def _dma_program(name: str, moves: List[Tuple[int, int, int, int, int, int]]) -> Any:
    """A NeuronCore program of HBM -> HBM copies: per move ``(outer, src row, dst row, src offset, dst offset,
    length)`` in bytes, tensor ``s{k}`` (``[outer, src row]``) into ``d{k}`` (``[outer, dst row]``)."""
    prog = Program(name)
    for k, (outer, srow, drow, so, do, length) in enumerate(moves):
        src = prog.hbm(f"s{k}", (outer, srow), "uint8", "input")
        dst = prog.hbm(f"d{k}", (outer, drow), "uint8", "inout")
        prog.dma_copy(HbmView(dst, do, [(outer, drow), (length, 1)]), HbmView(src, so, [(outer, srow), (length, 1)]))
    return prog.build()


def _moves(bk: _Bucket, w: _Window, n: int) -> Any:
    """The pad and narrow programs of bucket ``bk`` at size ``n`` (built once per size)."""
    m = bk.moves.get(n)
    if m is not None:
        return m
    p = bk.size - n
    pad_moves, ext = [], [s for s in w.slots if s.external]
    for pos, ax in sorted(bk.axes.items()):
        s = ext[pos]
        isz = s.dtype.itemsize
        outer, real, inner = _flat2(s.shape, ax, isz)
        big = bk.in_shapes[pos][ax]
        if real:
            pad_moves.append((outer, real * inner, big * inner, 0, p * inner, real * inner))   # the real positions
        if p:
            pad_moves.append((outer, p * inner, big * inner, 0, 0, p * inner))                 # the front: zeros
    narrow_moves = []
    for j, ax in enumerate(bk.out_axes):
        if ax is None:
            continue
        shape = bk.out_shapes[j]
        isz = w.slots[bk.outputs[j]].dtype.itemsize
        outer, big, inner = _flat2(shape, ax, isz)
        narrow_moves.append((outer, big * inner, (big - p) * inner, p * inner, 0, (big - p) * inner))
    m = bk.moves[n] = (_dma_program(f"{bk.name}_pad{n}", pad_moves) if pad_moves else None,
                       _dma_program(f"{bk.name}_narrow{n}", narrow_moves) if narrow_moves else None)
    if len(bk.moves) > 4 * bk.size:
        bk.moves.clear()
        bk.ns.clear()
    return m


def _bytes(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` (contiguous) as a ``[rows, -1]`` uint8 tensor over the same memory."""
    return t.reshape(-1).view(torch.uint8).reshape(rows, -1)


def _charge(res: Any) -> None:
    tracking.add_device_ns(res.total_ns)
    _STATS["device_ns"] += res.total_ns


def _run_bucket(w: _Window, entry: "_Compiled") -> None:
    """Run window ``w`` by its bucket's program: inputs padded at the front along the growing axis (a DMA program),
    the masked program, results narrowed back (a DMA program) into the window's result memory."""
    bk, n = entry.bucket
    p = bk.size - n
    slots = w.slots
    ins = _bind_inputs(w, entry)
    pads = []
    for pos, ax in sorted(bk.axes.items()):
        real = ins[pos]
        buf = bk.bufs.get(pos)
        if buf is None:
            buf = bk.bufs[pos] = torch.empty(bk.in_shapes[pos], dtype=real.dtype)
        pads.append((real, buf, ax))
        ins[pos] = buf
    _dma(bk, w, n, 0, pads, p)
    if entry.params:
        sv, sd = w.svals, w.sdtypes
        ins += [torch.tensor(sv[i], dtype=sd[i]) for i in entry.params]
    pt = _PADS.get(p)
    if pt is None:
        if len(_PADS) > 4096:
            _PADS.clear()
        pt = _PADS[p] = torch.tensor(float(p))   # (a read-only input: kept per padding)
    ins.append(pt)
    # results of the window's own size (no growing axis) are written by the program into their memory directly
    dst = [_result_memory(slots[i]) if ax is None else None for i, ax in zip(entry.outputs, bk.out_axes)]
    outs = _exe_call(bk.exe, ins, dst)
    prof = bk.exe.last_profile
    if prof is not None:
        _charge(prof)
    narrows = []
    for j, i in enumerate(entry.outputs):
        ax = bk.out_axes[j]
        if ax is None:
            _land(outs[j], dst[j])
            continue
        s = slots[i]
        nd = _result_memory(s)
        if nd is None:
            nd = torch.empty(s.shape, dtype=s.dtype)
        src = outs[j].reshape(bk.out_shapes[j])
        narrows.append((src if src.is_contiguous() else src.contiguous(), nd, ax))
    _dma(bk, w, n, 1, narrows, p)
    for i, j in entry.mutations:
        ins[i].copy_(outs[j].reshape(ins[i].shape))
        bk.zeroed.pop(id(ins[i]), None)      # (a padded buffer written: its padding is no longer known)


_PADS: Dict[int, torch.Tensor] = {}


def _dma(bk: _Bucket, w: _Window, n: int, which: int, moves: list, p: int) -> None:
    """Pad (``which`` 0: ``(real, padded buffer, axis)``) or narrow back (1: ``(padded result, result, axis)``) on
    the NeuronCore model: the DMA program of :func:`_moves` runs, or, once its modelled time is known and no
    :func:`tn.profile` listens, the host does its copies and that time is charged (as :mod:`tn.device.fastpath`
    does for small ops), so profiles show only real program runs."""
    prog = _moves(bk, w, n)[which]
    if prog is None:
        return
    ns = bk.ns.get((n, which))
    if ns is not None and not _runtime.listening():
        zeroed = bk.zeroed
        for a, b, ax in moves:
            if which == 0:
                # the front padding is still zeros from an earlier call whose padding was at least as long (a
                # decode loop's padding shrinks by one each step): zeroed again only when it grew
                if p > zeroed.get(id(b), 0):
                    b.narrow(ax, 0, p).zero_()
                b.narrow(ax, p, a.shape[ax]).copy_(a)
                zeroed[id(b)] = p
            else:
                b.copy_(a.narrow(ax, p, a.shape[ax] - p))
        tracking.add_device_ns(ns)
        _STATS["device_ns"] += ns
        _tl.advance(ns)
        return
    binds = []
    for a, b, ax in moves:
        outer = numel(a.shape[:ax])
        if which == 0:
            if a.shape[ax]:
                binds += [_bytes(a, outer), _bytes(b, outer)]
            if p:
                binds += [_zeros(outer, p * numel(a.shape[ax + 1:]) * a.element_size()), _bytes(b, outer)]
        else:
            binds += [_bytes(a, outer), _bytes(b, outer)]
    res = prog.run(binds)
    if which == 0:
        for _, b, _ in moves:
            bk.zeroed[id(b)] = p
    bk.ns[(n, which)] = res.total_ns
    _charge(res)


_ZEROS: Dict[Tuple[int, int], torch.Tensor] = {}


def _zeros(rows: int, cols: int) -> torch.Tensor:
    """A zero ``[rows, cols]`` uint8 host tensor (the front padding's source), kept per shape."""
    z = _ZEROS.get((rows, cols))
    if z is None:
        if len(_ZEROS) > 256:
            _ZEROS.clear()
        z = _ZEROS[(rows, cols)] = torch.zeros((rows, cols), dtype=torch.uint8)
    return z


# --------------------------------------------------------------------------- counters


def stats() -> Dict[str, Any]:
    """Adaptive eager counters: windows run, ops, cache hits, compiles, op-by-op windows, compile seconds,
    modelled device ns, hit rate, mean ops per window, ``flush_reasons`` and ``ops_per_window`` histograms;
    ``bucket_hits`` / ``bucket_compiles``: windows run by (and programs compiled for) a bucket of a growing size
    (counted in ``hits`` / ``compiles`` too)."""
    out = {k: (dict(v) if isinstance(v, Counter) else v) for k, v in _STATS.items()}
    n = out["windows"]
    out["hit_rate"] = out["hits"] / n if n else 0.0
    out["mean_ops_per_window"] = out["ops"] / n if n else 0.0
    out["pending_ops"] = pending_ops()
    out["cached_windows"] = len(_CACHE)
    return out


def reset_stats() -> None:
    """Zero the counters of :func:`stats`."""
    _zero_stats()


def clear_cache() -> None:
    """Drop every compiled window (and the record of windows that could not be traced)."""
    _CACHE.clear()
    _reset_trie()
    _REFUSED.clear()
    _SITES.clear()
    _VARYING.clear()
    _ALIASES.clear()
    _SKELS.clear()


allocator.BEFORE_HOST_ACCESS[0] = before_host_access
allocator.ON_EMPTY[0] = on_empty
allocator.BEFORE_STATS[0] = lambda: flush("memory statistics") if pending_ops() else None
