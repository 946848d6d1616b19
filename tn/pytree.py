# Argument flattening for tn.jit: pytrees of tensors, Python values and nn.Modules -> flat tensors + a hashable spec.
"""Flattening of call arguments into program inputs.

:func:`flatten` walks a pytree (tuple, list, dict, NamedTuple, dataclass,
HF ``ModelOutput``, anything registered with ``torch.utils._pytree``) and
returns a hashable *spec* plus, appended to a caller's list, the tensors it
found. The spec records everything that is not a tensor value: the tree
structure, the values of non-tensor leaves (they are compile-time constants
of the program), and for every ``nn.Module`` found as a leaf, the module
itself, its parameter/buffer names and its submodules' training flags. The
module's parameters and buffers become tensor inputs, so updating them in place
changes a program's result without a retrace.

:func:`unflatten` rebuilds the arguments from a spec and tensors (at trace
time only); :func:`describe` turns a spec plus tensor signatures into
``{label: text}`` for messages that say which argument changed.

Spec nodes (a spec is made of these, nested):

* ``TENSOR`` (the int 0): one tensor, taken from the tensor list in order;
* ``(SEQ, type, children)``: a plain tuple or list;
* ``(DICT, keys, children)``: a plain dict (insertion order, as torch's pytree);
* ``(LEAF, type, value)``: a non-tensor leaf, part of the cache key;
* ``(STATIC, type, value)``: a whole argument declared static;
* ``(MODULE, module, names, training)``: an ``nn.Module`` whose parameters and
  buffers (``names``) follow as tensors;
* ``(NODE, treespec, children)``: any other registered pytree node;
* ``SLOT`` (the int 7) and ``(OPAQUE, ...)``: what another :class:`FlattenRule`
  makes (tn.adaptive's regions: a leaf taken from the list in order like a
  tensor; a state object, rebuilt by :func:`unflatten`'s ``opaque``).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import threading
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as _pytree
from torch.nn.modules import module as _m

from .errors import ArgumentTypeError, CompileError
from .ir import CONSTANT_TYPES, aval_str

__all__ = [
    "TENSOR", "SEQ", "DICT", "LEAF", "STATIC", "MODULE", "NODE", "SLOT", "OPAQUE", "FlattenRule",
    "flatten", "unflatten", "describe", "register_dataclasses_in",
    "module_state", "tensor_sig", "sig_str", "find_unhashable", "register_dataclass_type",
    "HashedTuple", "ModuleState", "make_gather", "SIG", "register_state_predicate",
]

TENSOR, SEQ, DICT, LEAF, STATIC, MODULE, NODE, SLOT, OPAQUE = 0, 1, 2, 3, 4, 5, 6, 7, 8

Tensor = torch.Tensor

# Leaf types that are compile-time constants and need no further inspection (one list for tn: tn.ir's).
_SCALAR_TYPES = CONSTANT_TYPES

_register_lock = threading.Lock()


def register_dataclass_type(cls: type) -> None:
    """Register a dataclass type with ``torch.utils._pytree`` (fields become children).

    Does nothing if the type is already a registered pytree node (HF
    ``ModelOutput`` registers itself). Only ``init=True`` fields are children,
    as the dataclass constructor needs them.
    """
    if cls in _pytree.SUPPORTED_NODES:
        return
    with _register_lock:
        if cls in _pytree.SUPPORTED_NODES:
            return
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        dropped = [f.name for f in dataclasses.fields(cls) if not f.init]
        try:
            _pytree.register_dataclass(cls, field_names=names, drop_field_names=dropped)
        except Exception as e:  # torch refuses some dataclasses (e.g. odd field setups)
            raise ArgumentTypeError(
                f"tn.jit could not register dataclass {cls.__qualname__} as a pytree ({e}); "
                f"register it yourself with torch.utils._pytree.register_dataclass or "
                f"register_pytree_node before calling the jitted function") from e


def register_dataclasses_in(tree: Any, _depth: int = 0) -> None:
    """Register every dataclass type found (recursively) in ``tree`` as a pytree node.

    Called on a traced function's result so dataclass outputs flatten into
    their tensor fields instead of being one opaque leaf.
    """
    if _depth > 100 or isinstance(tree, (Tensor, torch.nn.Module)):
        return
    t = type(tree)
    if t in _SCALAR_TYPES:
        return
    if isinstance(tree, (tuple, list)):
        for x in tree:
            register_dataclasses_in(x, _depth + 1)
    elif isinstance(tree, dict):
        for x in tree.values():
            register_dataclasses_in(x, _depth + 1)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        register_dataclass_type(t)
        for f in dataclasses.fields(tree):
            register_dataclasses_in(getattr(tree, f.name, None), _depth + 1)


# ---------------------------------------------------------------- modules

_struct_version = [0]


def _bump(*_args: Any) -> None:
    """Global nn.Module registration hook: something's parameters/buffers/children changed."""
    _struct_version[0] += 1


_hooks_installed = False


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _m.register_module_parameter_registration_hook(_bump)
    _m.register_module_buffer_registration_hook(_bump)
    _m.register_module_module_registration_hook(_bump)
    _hooks_installed = True


class HashedTuple(tuple):
    """A tuple that computes its hash once (module parameter names are hashed on every call)."""

    def __new__(cls, items: Sequence[Any]) -> "HashedTuple":
        self = super().__new__(cls, items)
        self._hash = tuple.__hash__(self)
        return self

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)


class ModuleState:
    """What tn.jit reads from an ``nn.Module`` on every call, prepared once.

    ``names`` are the qualified names of its parameters then buffers
    (deduplicated, as ``named_parameters()``), ``refs`` the ``(dict, key)``
    pairs holding them (read on each call so reassignment is seen), ``mods``
    its submodules (for training flags); ``dicts``/``keys`` are ``refs``
    unzipped (``map(getitem, dicts, keys)`` reads the tensors in C). Rebuilt
    when any module registers a
    parameter, buffer or child anywhere (a global counter bumped by torch's
    module registration hooks).
    """

    __slots__ = ("version", "names", "refs", "dicts", "keys", "mods", "mod_names", "__weakref__")

    def __init__(self, module: torch.nn.Module):
        self.version = _struct_version[0]
        names: List[str] = []
        refs: List[Tuple[Dict[str, Any], str]] = []
        seen: set = set()
        for kind in ("_parameters", "_buffers"):  # parameters first, as named_parameters()
            for prefix, m in module.named_modules():
                d = m.__dict__.get(kind) or {}
                for k, v in d.items():
                    if v is None or id(v) in seen:
                        continue
                    seen.add(id(v))
                    names.append(f"{prefix}.{k}" if prefix else k)
                    refs.append((d, k))
        self.names = HashedTuple(names)
        self.refs = tuple(refs)
        self.dicts = tuple(d for d, _ in refs)
        self.keys = tuple(k for _, k in refs)
        mods = list(module.named_modules())
        self.mods = tuple(m for _, m in mods)
        self.mod_names = tuple(n or "<root>" for n, _ in mods)


_module_states: "weakref.WeakKeyDictionary[torch.nn.Module, ModuleState]" = weakref.WeakKeyDictionary()


def module_state(module: torch.nn.Module) -> ModuleState:
    """The (cached, revalidated) :class:`ModuleState` of ``module``."""
    _install_hooks()
    st = _module_states.get(module)
    if st is None or st.version != _struct_version[0]:
        st = ModuleState(module)
        _module_states[module] = st
    return st


# ---------------------------------------------------------------- flatten

class FlattenRule:
    """How :func:`flatten` treats what is not a tensor or a container (tuple, list, dict, registered pytree node):
    each hook returns the value's spec. The default rule is tn.jit's: Python constants go into the spec, a
    module's parameters and buffers become tensors, dataclasses are registered as pytree nodes, mutable state
    objects are refused. tn.adaptive's regions use their own rule (constants kept as leaves, state opened)."""

    def constant(self, x: Any, t: type, tensors: List[Any]) -> Any:
        """Spec of ``x``, a Python constant (a :data:`tn.ir.CONSTANT_TYPES` type)."""
        return (LEAF, t, x)

    def before_node(self, x: Any, t: type, tensors: List[Any]) -> Any:
        """Spec of any other ``x`` before registered pytree nodes are opened, or None to go on."""
        if isinstance(x, torch.nn.Module):
            st = module_state(x)
            for d, k in st.refs:
                tensors.append(d[k])
            return (MODULE, x, st.names, tuple([m.training for m in st.mods]))
        if t not in _pytree.SUPPORTED_NODES and dataclasses.is_dataclass(x) and not isinstance(x, type):
            register_dataclass_type(t)
        return None

    def leaf(self, x: Any, t: type, tensors: List[Any]) -> Any:
        """Spec of ``x``, a leaf of torch's pytrees that is neither a tensor nor a constant."""
        if getattr(x, "__dict__", None):
            if _is_state(x):  # even while empty: the call would store traced tensors into it
                raise ArgumentTypeError(
                    f"tn.jit: an argument of type {t.__qualname__} is a mutable state object (a KV cache the call "
                    f"updates in place), which tn.jit does not take. Use tn.adaptive(model), which carries caches "
                    f"through compiled regions (written back after each call) and buckets their length, or call "
                    f"without a cache (HF: use_cache=False)")
            where = _tensor_inside(x.__dict__, 0)
            if where is not None:
                raise ArgumentTypeError(
                    f"tn.jit: an argument of type {t.__qualname__} holds a tensor (at {where}), but tn.jit only "
                    f"sees tensors inside pytrees: this one would be baked into the program as a constant and go "
                    f"stale. Make the type a dataclass, register it with torch.utils._pytree.register_pytree_node, "
                    f"or pass the tensors as arguments")
        return (LEAF, t, x)


_JIT_RULE = FlattenRule()


def flatten(x: Any, tensors: List[Any], rule: FlattenRule = _JIT_RULE) -> Any:
    """Spec of pytree ``x``; its tensors (and module parameters/buffers) are appended to ``tensors``.

    ``rule`` says what becomes of values that are not tensors or containers (default: tn.jit's,
    :class:`FlattenRule`); a rule may append them to ``tensors`` too and return :data:`SLOT`, or return an
    ``(OPAQUE, ...)`` node that :func:`unflatten` hands back to its ``opaque`` function."""
    if isinstance(x, Tensor):
        tensors.append(x)
        return TENSOR
    t = type(x)
    if t in _SCALAR_TYPES:
        return rule.constant(x, t, tensors)
    if t is tuple or t is list:
        return (SEQ, t, tuple([flatten(e, tensors, rule) for e in x]))
    if t is dict:
        return (DICT, tuple(x), tuple([flatten(v, tensors, rule) for v in x.values()]))
    spec = rule.before_node(x, t, tensors)
    if spec is not None:
        return spec
    if not _pytree.tree_is_leaf(x):  # registered nodes, NamedTuples, torch.return_types
        leaves, ts = _pytree.tree_flatten(x)
        return (NODE, ts, tuple([flatten(e, tensors, rule) for e in leaves]))
    return rule.leaf(x, t, tensors)


#: Predicates ``fn(obj) -> bool`` marking mutable state objects (KV caches) that a door above carries and tn.jit
#: refuses as arguments; tn.adaptive registers its own (:func:`tn.adaptive.state.is_state`) when imported.
_STATE_PREDICATES: List[Callable[[Any], bool]] = []


def register_state_predicate(predicate: Callable[[Any], bool]) -> None:
    """Make :func:`flatten` refuse objects for which ``predicate(obj)`` is true as mutable state (the layer that
    carries state registers it from above, so this module imports nothing of it)."""
    if predicate not in _STATE_PREDICATES:
        _STATE_PREDICATES.append(predicate)


def _is_state(x: Any) -> bool:
    """True for a state object a registered predicate claims (tn.adaptive: HF ``Cache``, registered types)."""
    for predicate in _STATE_PREDICATES:
        if predicate(x):
            return True
    return False


def _tensor_inside(d: Any, depth: int, attrs: bool = True) -> Optional[str]:
    """Path (``bias``, ``layers[0].keys``) of a tensor within a few levels of an object's attribute
    dict ``d`` (through dicts, lists, tuples and plain objects), or None."""
    if depth > 3:
        return None
    if isinstance(d, dict):
        items = [(f".{k}" if attrs else f"[{k!r}]", v) for k, v in d.items()]
    elif isinstance(d, (list, tuple)):
        items = [(f"[{i}]", v) for i, v in enumerate(d[:64])]
    else:
        return None
    for k, v in items:
        if isinstance(v, Tensor):
            r: Optional[str] = ""
        elif isinstance(v, (dict, list, tuple)):
            r = _tensor_inside(v, depth + 1, attrs=False)
        elif type(v) not in _SCALAR_TYPES and not isinstance(v, torch.nn.Module) and getattr(v, "__dict__", None):
            r = _tensor_inside(v.__dict__, depth + 1, attrs=True)
        else:
            r = None
        if r is not None:
            path = k + r
            return path[1:] if depth == 0 and path.startswith(".") else path
    return None


def unflatten(spec: Any, it: Iterator[Tensor], modules: List[Tuple[torch.nn.Module, Dict[str, Tensor]]],
              wrap: Optional[Callable[[torch.nn.Module], torch.nn.Module]] = None,
              opaque: Optional[Callable[[Any, Iterator[Any]], Any]] = None) -> Any:
    """Rebuild the value described by ``spec``, taking tensors (and a rule's :data:`SLOT` leaves) from ``it``.

    A module is returned as ``wrap(module)`` (itself without ``wrap``), and
    ``(that module, {name: tensor})`` is appended to ``modules`` so the caller
    can reparametrize it. An ``(OPAQUE, ...)`` node (made by a
    :class:`FlattenRule`) is rebuilt by ``opaque(node, it)``.
    """
    if type(spec) is int:
        return next(it)
    tag = spec[0]
    if tag == SEQ:
        return spec[1]([unflatten(c, it, modules, wrap, opaque) for c in spec[2]])
    if tag == DICT:
        return {k: unflatten(c, it, modules, wrap, opaque) for k, c in zip(spec[1], spec[2])}
    if tag == LEAF or tag == STATIC:
        return spec[2]
    if tag == MODULE:
        _, m, names, _training = spec
        if wrap is not None:
            m = wrap(m)
        modules.append((m, {n: next(it) for n in names}))
        return m
    if tag == NODE:
        return _pytree.tree_unflatten([unflatten(c, it, modules, wrap, opaque) for c in spec[2]], spec[1])
    if tag == OPAQUE and opaque is not None:
        return opaque(spec, it)
    raise CompileError(f"tn.jit internal: unknown argument spec node {spec!r}")


# ---------------------------------------------------------------- matchers (the cached-call fast path)

class _NoMatcher(Exception):
    """The spec holds something a generated matcher does not check (the call keeps the general path)."""


_REP_TENSOR = itertools.repeat(Tensor)  # map(isinstance, xs, _REP_TENSOR): "is a tensor" per element, in C
_TRAINING = operator.attrgetter("training")


class _Emitter:
    """Builds the source of a matcher: straight-line checks of one spec, constants bound by name."""

    def __init__(self) -> None:
        self.lines: List[str] = []
        self.consts: Dict[str, Any] = {}
        self.n = 0

    def const(self, value: Any) -> str:
        """A global name for ``value`` in the generated function."""
        name = f"C{len(self.consts)}"
        self.consts[name] = value
        return name

    def var(self) -> str:
        """A fresh local name."""
        self.n += 1
        return f"v{self.n}"

    def put(self, ind: str, line: str) -> None:
        """Append one line of code at indentation ``ind``."""
        self.lines.append(ind + line)

    def tensors(self, v: str, ind: str) -> None:
        """Check that every element of the sequence ``v`` is a tensor and collect them."""
        self.put(ind, f"if not all(map(isinstance, {v}, REP)): return None")
        self.put(ind, f"T.extend({v})")

    def node(self, spec: Any, expr: str, ind: str) -> None:
        """Code that checks the value ``expr`` has spec ``spec`` exactly (else ``return None``) and appends its
        tensors to ``T`` in :func:`flatten`'s order."""
        v = self.var()
        self.put(ind, f"{v} = {expr}")
        if type(spec) is int:
            self.put(ind, f"if not isinstance({v}, Tensor): return None")
            self.put(ind, f"T.append({v})")
            return
        tag = spec[0]
        if tag == SEQ:
            t, children = spec[1], spec[2]
            self.put(ind, f"if type({v}) is not {self.const(t)} or len({v}) != {len(children)}: return None")
            self.children(children, v, ind)
        elif tag == DICT:
            keys, children = spec[1], spec[2]
            self.put(ind, f"if type({v}) is not dict or len({v}) != {len(keys)} or tuple({v}) != "
                          f"{self.const(keys)}: return None")
            vals = self.var()
            self.put(ind, f"{vals} = tuple({v}.values())")
            self.children(children, vals, ind)
        elif tag == LEAF or tag == STATIC:
            t, x = spec[1], spec[2]
            if tag == LEAF and t not in _SCALAR_TYPES:  # other objects are checked for hidden tensors per call
                raise _NoMatcher(f"leaf of type {t.__qualname__}")
            try:
                h = hash(x)
            except TypeError:
                raise _NoMatcher("unhashable leaf") from None
            # equal as the cache key compares them: same type, identical or equal with the same hash
            cx = self.const(x)
            self.put(ind, f"if type({v}) is not {self.const(t)} or not ({v} is {cx} or "
                          f"({v} == {cx}) is True and hash({v}) == {h}): return None")
        elif tag == MODULE:
            m, names, training = spec[1], spec[2], spec[3]
            st = module_state(m)
            if st.names != names:
                raise _NoMatcher("stale module spec")
            cell = [st, m, names]  # the state in use; revalidated when any module's structure changes
            c = self.const(cell)
            s = self.var()
            self.put(ind, f"if {v} is not {self.const(m)}: return None")
            self.put(ind, f"{s} = {c}[0]")
            self.put(ind, f"if {s}.version != SV[0]:")
            self.put(ind, f"    {s} = REVALIDATE({c})")
            self.put(ind, f"    if {s} is None: return None")
            self.put(ind, f"if tuple(map(TRAINING, {s}.mods)) != {self.const(training)}: return None")
            self.put(ind, f"T.extend(map(GETITEM, {s}.dicts, {s}.keys))")
        elif tag == NODE:
            # other pytree nodes: flattened as in the general path, the result compared with the spec
            self.put(ind, f"if flatten({v}, T) != {self.const(spec)}: return None")
        else:
            raise _NoMatcher(f"unknown spec node {tag!r}")

    def children(self, children: Sequence[Any], v: str, ind: str) -> None:
        """Code for the elements of the sequence ``v`` (all tensors: one C-level check)."""
        if all(type(c) is int for c in children):
            if children:
                self.tensors(v, ind)
            return
        for i, c in enumerate(children):
            self.node(c, f"{v}[{i}]", ind)


def _revalidate(cell: List[Any]) -> Optional[ModuleState]:
    """A matcher's module state after a structure change anywhere: the new state if the module's
    parameter/buffer names are unchanged (its spec is then unchanged), else None."""
    st = module_state(cell[1])
    if st.names != cell[2]:
        return None
    cell[0] = st
    return st


@functools.lru_cache(maxsize=256)
def _compile_source(src: str) -> Any:
    """Code object of a generated matcher (the same call structure reuses it)."""
    return compile(src, "<tn.jit matcher>", "exec")


_MATCHER_GLOBALS = {"Tensor": Tensor, "REP": _REP_TENSOR, "TRAINING": _TRAINING, "GETITEM": operator.getitem,
                    "SV": _struct_version, "REVALIDATE": _revalidate, "flatten": None, "isinstance": isinstance,
                    "type": type, "len": len, "tuple": tuple, "map": map, "all": all, "hash": hash}


def make_gather(aspec: Sequence[Any], kspec: Sequence[Tuple[str, Any]], bound: Sequence[Any] = ()
                ) -> Optional[Callable[[Tuple[Any, ...], Dict[str, Any]], Optional[List[Tensor]]]]:
    """A function ``gather(args, kwargs)`` for calls whose flattening is ``(aspec, kspec)``.

    ``aspec`` covers ``bound + args`` (``bound``: leading arguments a wrapper
    supplies), ``kspec`` the keyword arguments in key order. ``gather``
    returns the call's tensors (the list :func:`flatten` would build) when
    the arguments' spec is exactly ``(aspec, kspec)``, else None; it never
    returns a list for a call whose spec differs, so the caller may reuse
    anything it keyed on that spec. Its checks are straight-line code
    generated for the spec (types, lengths, dict key order, constant leaves,
    module identity, structure and training flags). Returns None when the
    spec holds leaves it does not check (objects other than Python scalars,
    whose hidden tensors :func:`flatten` looks for on every call).
    """
    em = _Emitter()
    nb = len(bound)
    na = len(aspec) - nb
    em.put("    ", f"if len(args) != {na} or len(kwargs) != {len(kspec)}: return None")
    em.put("    ", "T = []")
    try:
        if not bound and all(type(c) is int for c in aspec):
            if aspec:
                em.tensors("args", "    ")
        else:
            for i, s in enumerate(aspec):
                em.node(s, em.const(bound[i]) if i < nb else f"args[{i - nb}]", "    ")
        for k, s in kspec:
            em.node(s, f"kwargs.get({em.const(k)}, MISSING)", "    ")
    except _NoMatcher:
        return None
    src = "def gather(args, kwargs):\n" + "\n".join(em.lines) + "\n    return T\n"
    g = dict(_MATCHER_GLOBALS, flatten=flatten, MISSING=object(), **em.consts)
    exec(_compile_source(src), g)  # noqa: S102 (generated from a spec, no user text in the source)
    fn = g["gather"]
    fn.source = src  # for debugging: print(fn.source)
    return fn


# ---------------------------------------------------------------- signatures and descriptions

#: ``SIG(t)`` is :func:`tensor_sig` read in C: ``tuple(map(SIG, tensors))`` builds a call's signatures.
SIG = operator.attrgetter("shape", "dtype", "device", "requires_grad")


def tensor_sig(t: Tensor) -> Tuple[Any, ...]:
    """The abstract signature of one tensor input: shape, dtype, device, requires_grad."""
    return (t.shape, t.dtype, t.device, t.requires_grad)


def sig_str(sig: Tuple[Any, ...]) -> str:
    """``f32[4,8] cpu`` (plus ``requires_grad``) for a tensor signature."""
    shape, dtype, device, rg = sig
    return f"{aval_str(tuple(shape), dtype)} {device}" + (" requires_grad" if rg else "")


def _short(v: Any, limit: int = 60) -> str:
    try:
        s = repr(v)
    except Exception:
        s = f"<{type(v).__name__}>"
    return s if len(s) <= limit else s[: limit - 3] + "..."


def describe(spec: Any, sigs: Sequence[Tuple[Any, ...]], label: str, out: Dict[str, str],
             pos: List[int]) -> None:
    """Fill ``out`` with ``{label: text}`` for every leaf of ``spec`` (tensors use ``sigs`` from ``pos[0]``)."""
    if type(spec) is int:
        out[label] = sig_str(sigs[pos[0]])
        pos[0] += 1
        return
    tag = spec[0]
    if tag == SEQ:
        out[label + " (structure)"] = f"{spec[1].__name__} of {len(spec[2])}"
        for i, c in enumerate(spec[2]):
            describe(c, sigs, f"{label}[{i}]", out, pos)
    elif tag == DICT:
        out[label + " (structure)"] = "dict with keys " + _short(list(spec[1]))
        for k, c in zip(spec[1], spec[2]):
            describe(c, sigs, f"{label}[{k!r}]", out, pos)
    elif tag == LEAF:
        out[label] = f"{spec[1].__name__} {_short(spec[2])}"
    elif tag == STATIC:
        out[label] = f"static {spec[1].__name__} {_short(spec[2])}"
    elif tag == MODULE:
        _, m, names, training = spec
        out[label] = f"{type(m).__name__} module at {id(m):#x}"
        n_train = sum(training)
        out[label + " (training flags)"] = (
            "train" if n_train == len(training) else "eval" if n_train == 0
            else f"{n_train} of {len(training)} submodules training")
        out[label + " (parameter/buffer names)"] = _short(names, 80)
        for n in names:
            describe(TENSOR, sigs, f"{label}.{n}", out, pos)
    elif tag == NODE:
        out[label + " (structure)"] = _short(str(spec[1]).replace("\n", " "), 80)
        for path, c in zip(_leaf_paths(spec), spec[2]):
            describe(c, sigs, label + path, out, pos)


def _leaf_paths(spec: Any) -> List[str]:
    """Key paths (``.field``, ``[0]``, ``['k']``) of a NODE spec's leaves, for messages."""
    n = len(spec[2])
    try:
        dummy = _pytree.tree_unflatten(list(range(n)), spec[1])
        paths = [_pytree.keystr(p) for p, _ in _pytree.tree_flatten_with_path(dummy)[0]]
        if len(paths) == n:
            return paths
    except Exception:  # a node type whose constructor rejects placeholder leaves
        pass
    return [f"<leaf {i}>" for i in range(n)]


def find_unhashable(spec: Any, label: str) -> Tuple[str, Any] | None:
    """The ``(label, value)`` of the first non-tensor leaf of ``spec`` that cannot be hashed, if any."""
    if type(spec) is int:
        return None
    tag = spec[0]
    if tag in (LEAF, STATIC):
        try:
            hash(spec[2])
        except TypeError:
            return label, spec[2]
        return None
    if tag == SEQ or tag == NODE:
        paths = [f"[{i}]" for i in range(len(spec[2]))] if tag == SEQ else _leaf_paths(spec)
        for path, c in zip(paths, spec[2]):
            r = find_unhashable(c, label + path)
            if r:
                return r
    if tag == DICT:
        for k, c in zip(spec[1], spec[2]):
            r = find_unhashable(c, f"{label}[{k!r}]")
            if r:
                return r
    return None
