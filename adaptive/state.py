# tn.adaptive.state: caller-owned objects a region mutates (HF KV caches), carried through compiled programs.
"""Mutable state objects as region arguments.

HF models hand every block a ``Cache`` (``DynamicCache`` and its layers) that
the attention updates in place: ``layer.keys = torch.cat([layer.keys, k])``.
tn.jit takes pytrees of tensors, so such an object is carried through a
compiled region in three steps:

1. :func:`flatten` turns the object into a static, hashable spec (classes,
   attribute names, non-tensor attribute values) and its tensors (leaves);
   the spec is part of the region's signature.
2. Inside the traced program, :func:`build` makes a *proxy*: new instances of
   the same classes holding the traced tensors. The region's forward runs on
   the proxy, which records the mutation as ordinary traced ops.
3. After the forward, :func:`flatten` of the proxy (with ``pre``, the proxy's
   own input tensors) gives the post-call spec: a tensor attribute still
   holding its input tensor is ``("same", i)``, a new tensor becomes a
   program output. :func:`write_back` applies that spec and the outputs to
   the caller's real object, in place (nested objects and lists keep their
   identity), so code holding the cache sees what eager PyTorch would leave.

Which types count: ``transformers.cache_utils.Cache``, ``CacheLayerMixin`` and
``LinearAttentionCacheLayerMixin`` (Mamba's conv/recurrent states, updated in
place with ``copy_``; when transformers is imported) and anything passed to
:func:`register_state_type`.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
from torch import Tensor
import torch.utils._pytree as _pytree

from ..errors import ArgumentTypeError
from ..pytree import register_state_predicate

__all__ = ["register_state_type", "is_state", "flatten", "build", "write_back", "StateArg", "StateError"]


class StateError(ArgumentTypeError):
    """A state object holds something that cannot be carried through a program (a TypeError; the message says what).

    ``path`` lists the attribute/index steps from the object to the offending value; it is filled in as the
    error unwinds, so flattening builds no path strings when nothing is wrong (it runs on every call)."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what
        self.path: List[str] = []

    def __str__(self) -> str:
        return f"{''.join(self.path)} is {self.what}"


_REGISTERED: List[type] = []
_KNOWN: Dict[type, bool] = {}


def register_state_type(cls: type) -> None:
    """Treat instances of ``cls`` (and subclasses) as mutable state a region may update in place.

    Their tensor attributes (also inside lists, tuples, dicts and nested state
    objects) become program inputs, new values after the call become program
    outputs written back into the caller's object; other attribute values are
    static parts of the region's signature and must be hashable.
    """
    if not isinstance(cls, type):
        raise ArgumentTypeError(f"register_state_type: expected a class, got {type(cls).__name__}")
    if cls not in _REGISTERED:
        _REGISTERED.append(cls)
        _KNOWN.clear()


def _bases() -> List[type]:
    mod = sys.modules.get("transformers.cache_utils")
    found = list(_REGISTERED)
    if mod is not None:
        for name in ("Cache", "CacheLayerMixin", "LinearAttentionCacheLayerMixin"):
            c = getattr(mod, name, None)
            if isinstance(c, type) and c not in found:
                found.append(c)
    return found


def is_state(x: Any) -> bool:
    """True when ``x`` is an instance of a state type (HF ``Cache``/cache layer, or registered)."""
    t = type(x)
    hit = _KNOWN.get(t)
    if hit is None:
        hit = bool(getattr(x, "__dict__", None) is not None) and any(issubclass(t, b) for b in _bases())
        _KNOWN[t] = hit
    return hit


# Spec nodes (tuples, hashable): ("t",) a tensor input leaf; ("same", i) the i-th input leaf unchanged (post
# specs only); ("s", value) a static value; ("seq", type, children); ("d", keys, children);
# ("o", class, names, children) a state object.

def flatten(obj: Any, out: List[Tensor], pre: Optional[Sequence[Tensor]] = None) -> tuple:
    """Spec of state object ``obj``; its tensors are appended to ``out``.

    With ``pre`` (the object's tensors before the call, in flatten order), a
    tensor that is ``pre[i]`` is recorded as ``("same", i)`` instead of being
    appended: used on the proxy after the forward, to tell unchanged
    attributes from new ones. Raises :class:`StateError` for an unhashable
    non-tensor value.
    """
    where = None if pre is None else {id(t): i for i, t in enumerate(pre)}  # ``pre`` keeps the ids alive
    try:
        return _node(obj, out, where)
    except StateError as e:
        e.path.insert(0, type(obj).__name__)
        raise


def _node(x: Any, out: List[Tensor], pre: Optional[Dict[int, int]]) -> tuple:
    if isinstance(x, Tensor):
        if pre is not None:
            i = pre.get(id(x))
            if i is not None:
                return ("same", i)
        out.append(x)
        return ("t",)
    t = type(x)
    if t is list or t is tuple:
        return ("seq", t, _children(enumerate(x), out, pre, "[{!r}]"))
    if t is dict:
        return ("d", tuple(x), _children(x.items(), out, pre, "[{!r}]"))
    if is_state(x):
        d = vars(x)
        return ("o", t, tuple(d), _children(d.items(), out, pre, ".{}"))
    try:
        hash(x)
    except TypeError:
        raise StateError(f"a {t.__name__}, which is neither a tensor nor hashable: it cannot be part of a "
                         f"program's signature") from None
    if isinstance(x, torch.nn.Module) or getattr(x, "__dict__", None) is not None and not isinstance(x, type) \
            and _holds_tensor(x):
        raise StateError(f"a {t.__name__} holding tensors that is not a registered state type")
    return ("s", x)


def _children(items: Any, out: List[Tensor], pre: Optional[Dict[int, int]], step: str) -> tuple:
    """Specs of ``(key, value)`` members; ``step`` formats a key into an error's path (only on an error)."""
    specs = []
    k = None
    try:
        for k, v in items:
            specs.append(_node(v, out, pre))
    except StateError as e:
        e.path.insert(0, step.format(k))
        raise
    return tuple(specs)


def _holds_tensor(x: Any) -> bool:
    """Whether an object's attributes hold a tensor, directly or inside lists, tuples and dicts (a cache
    layer's ``conv_states = {0: tensor}``): such an object cannot be a static part of a signature."""
    return any(isinstance(v, Tensor) for v in _pytree.tree_leaves(list(vars(x).values())))


def build(spec: tuple, it: Iterator[Tensor], pre: Optional[Sequence[Tensor]] = None,
          device: Optional[torch.device] = None) -> Any:
    """A new value (proxy) described by ``spec``, with tensors taken from ``it``
    (``("same", i)`` nodes take ``pre[i]``). With ``device``, a static ``torch.device("cpu")`` becomes
    ``device``: programs run on host views of device tensors, so a device the forward recorded in the
    object (``self.device = keys.device``) is the host's where eager code would have seen ``device``."""
    tag = spec[0]
    if tag == "t":
        return next(it)
    if tag == "same":
        assert pre is not None
        return pre[spec[1]]
    if tag == "s":
        v = spec[1]
        if device is not None and type(v) is torch.device and v.type == "cpu":
            return device
        return v
    if tag == "seq":
        return spec[1]([build(c, it, pre, device) for c in spec[2]])
    if tag == "d":
        return {k: build(c, it, pre, device) for k, c in zip(spec[1], spec[2])}
    obj = spec[1].__new__(spec[1])
    obj.__dict__.update({n: build(c, it, pre, device) for n, c in zip(spec[2], spec[3])})
    return obj


def write_back(obj: Any, spec: tuple, it: Iterator[Tensor], pre: Sequence[Tensor],
               device: Optional[torch.device] = None) -> None:
    """Make the caller's state object ``obj`` hold what the post-call ``spec`` describes, in place.

    New tensors come from ``it`` (the program's outputs, in order), unchanged
    ones from ``pre`` (the object's tensors before the call). Nested state
    objects and lists present before the call keep their identity. ``device``:
    as in :func:`build` (the device the call's tensors are on).
    """
    d = obj.__dict__
    new = {}
    for n, c in zip(spec[2], spec[3]):
        new[n] = _merge(d.get(n), c, it, pre, device)
    for n in [n for n in d if n not in new]:
        del d[n]
    d.update(new)


def _merge(old: Any, spec: tuple, it: Iterator[Tensor], pre: Sequence[Tensor], device) -> Any:
    tag = spec[0]
    if tag == "o" and type(old) is spec[1]:
        write_back(old, spec, it, pre, device)
        return old
    if tag == "seq" and type(old) is list and spec[1] is list:
        items = [_merge(old[i] if i < len(old) else None, c, it, pre, device) for i, c in enumerate(spec[2])]
        old[:] = items
        return old
    if tag == "d" and type(old) is dict:
        items = {k: _merge(old.get(k), c, it, pre, device) for k, c in zip(spec[1], spec[2])}
        old.clear()
        old.update(items)
        return old
    return build(spec, it, pre, device)


def unchanged(pre_spec: tuple, post_spec: tuple) -> bool:
    """True when the post-call spec describes the object as it was (nothing to write back)."""
    counter = iter(range(1 << 30))
    return _same(pre_spec, post_spec, counter)


def _same(a: tuple, b: tuple, counter: Iterator[int]) -> bool:
    if a[0] == "t":
        return b[0] == "same" and b[1] == next(counter)
    if a[0] != b[0]:
        return False
    if a[0] == "s":
        return a == b
    if a[0] == "seq":
        return a[1] is b[1] and len(a[2]) == len(b[2]) and all(_same(x, y, counter) for x, y in zip(a[2], b[2]))
    if a[0] == "d":
        return a[1] == b[1] and all(_same(x, y, counter) for x, y in zip(a[2], b[2]))
    return a[1] is b[1] and a[2] == b[2] and all(_same(x, y, counter) for x, y in zip(a[3], b[3]))


class StateArg:
    """A state object inside a jitted call: its static spec and its tensors (a pytree node, so tn.jit sees
    the tensors as inputs and the spec as part of the signature)."""

    __slots__ = ("spec", "tensors")

    def __init__(self, spec: tuple, tensors: Sequence[Tensor]):
        self.spec = spec
        self.tensors = list(tensors)


_pytree.register_pytree_node(
    StateArg, lambda s: (list(s.tensors), s.spec), lambda xs, spec: StateArg(spec, xs),
    serialized_type_name="tn.adaptive.state.StateArg")


register_state_predicate(is_state)  # tn.jit refuses these arguments (and points to tn.adaptive)
