# tn.adaptive.placement: where a region's eager calls run: a CPU model's eager regions on the NeuronCore model.
"""Where eager regions run.

A compiled region always runs on the NeuronCore model (its program is a
:func:`tn.jit` program). Before this module an *eager* region of a model that
lives on the CPU ran as plain host PyTorch, so ``tn.profile()`` and the
adaptive report left its chip time out and the "adaptive" figure mixed host
and modelled execution. Now an eager call runs on the ``neuron`` device
whatever device the model lives on (:class:`Placement`, one per adaptive
model):

* **Where.** ``Policy.eager_on``: ``"neuron"`` runs eager calls of a model
  that lives on the CPU on the ``neuron`` device; ``"host"`` keeps them host
  PyTorch (the escape hatch, as before); ``None`` (default) follows the
  backend: ``"neuron"`` when compiled regions run on the NeuronCore model
  (backend ``"neuron"``), ``"host"`` for a host backend (``"reference"``),
  so that eager and compiled times are always measured on the same kind of
  machine. A model (or call) already on the ``neuron`` device runs there as
  before; a call mixing devices runs as given.
* **Parameters and buffers** reach the device through *mirrors*
  (:class:`Mirrors`, shared by the regions of one adaptive model): one device
  copy per host tensor, made on first use and reused while the host tensor
  is the same object with the same ``_version``, data pointer, shape, strides
  and dtype; an optimizer step (an in-place update bumps ``_version``),
  ``.data =`` or ``load_state_dict`` makes a fresh copy on the next call. The
  region's base forward runs with the mirrors substituted for the module's
  tensors (``torch.nn.utils.stateless``; tied weights stay tied). Under
  autograd a parameter that requires grad enters through :class:`_Upload`,
  whose backward moves the gradient back to the host, so ``p.grad`` of the
  CPU parameter accumulates as in host eager.
* **Arguments**: host tensors are moved to the device (differentiably, with
  ``.to``, when they require grad; else through the mirrors, so a tensor that
  an earlier call returned, such as a KV cache's, is not copied up again).
  Mutable state objects (HF caches, :mod:`tn.adaptive.state`) are replaced by
  proxies holding device tensors; what the forward leaves in a proxy is
  written back into the caller's object as host tensors.
* **Results** come back to the host (differentiably when they require grad);
  a result that is one of the call's own host tensors comes back as that
  tensor. A state object the forward made is converted to host tensors in
  place, one it was given is returned as the caller's object.
* **In-place writes** the forward makes to mirrored host tensors (an
  argument updated with ``copy_``, a parameter changed in place) are copied
  back into the host tensors after the call (a write changes the mirror's
  ``_version``). Kernels that update running statistics (BatchNorm) do not
  bump the version counter, so the buffers of a module in training mode are
  compared with their device copies after each call instead (in place, on a
  host view of the device memory) and copied back when they differ.
* **Reassigned buffers**: a buffer the forward replaces (``self.buf = t``)
  holds ``t``, brought to the host, after the call. Limits: host tensors
  that share memory (two views of one tensor) become separate device copies,
  so a write through one is not seen through the other during the call; a
  plain (unregistered) attribute the forward stores keeps the device tensor.
* **Windows.** With ``Policy.eager_windows`` (default True) the call runs in
  the device's adaptive eager mode (:mod:`tn.device.windows`): its ops are
  gathered into windows compiled as one program each and cached by the
  window's signature, so an eager region that recurs (a decode step, a
  training step) hits the cache, and the modelled time has no HBM round trip
  per op. Its backward runs in windows too: the backward of a result's move
  to the host (:class:`_Download`) switches the device to adaptive eager
  mode for the rest of that backward pass (autograd's end-of-pass callback
  switches it back and runs what is queued), so a region's backward is
  typically one program instead of one per op. (The mode is process-wide:
  device ops other threads issue meanwhile are windowed too, which keeps
  their results.)
* **Fallback.** A call that raises on the device is run again on the host
  (its side effects stay on the mirrors and proxies until it succeeds, so the
  host sees none); if the host call succeeds, the region stays on the host
  for good and the report says why, else the host's error is the user's.

The report shows, per region, where eager calls ran (``eager_on``) and the
modelled µs of the programs that ran during its eager calls on the device
(``eager_device_us``, child regions' programs included; windows run lazily,
so a program is counted in the region whose op flushed it).
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.utils._pytree as _pytree
from torch.nn.utils.stateless import _reparametrize_module

from ..profile import Profile
from .. import config
from ..device import windows as _windows
from ..device.allocator import cpu_alias
from ..device.eager import to_device
from ..pytree import module_state
from . import state as _state

__all__ = ["Placement", "Mirrors", "eager_on"]

log = logging.getLogger("tn")

Tensor = torch.Tensor
_NEURON = torch.device("neuron")
_CPU = torch.device("cpu")


def eager_on(policy: Any, backend: str) -> str:
    """Where eager calls of a host model run under ``policy``: ``"neuron"`` or ``"host"`` (see module doc)."""
    choice = policy.eager_on
    if choice is None:
        return "neuron" if backend == "neuron" else "host"
    return choice


class _Entry:
    """One mirror: the host tensor (weakly), what it looked like when copied, and its device copy."""

    __slots__ = ("ref", "version", "ptr", "shape", "stride", "dtype", "dev", "dev_version")

    def __init__(self, t: Tensor, dev: Tensor, ref: Any):
        self.ref = ref
        self.dev = dev
        self.mark(t)

    def mark(self, t: Tensor) -> None:
        """Record ``t`` (the host tensor) and the device copy as in step now."""
        self.version = t._version
        self.ptr = t.data_ptr()
        self.shape = tuple(t.shape)
        self.stride = t.stride()
        self.dtype = t.dtype
        self.dev_version = self.dev._version

    def fresh(self, t: Tensor) -> bool:
        """Whether the device copy still holds ``t``'s values (nothing wrote either since they were in step)."""
        return (self.ref() is t and self.version == t._version and self.ptr == t.data_ptr()
                and self.shape == tuple(t.shape) and self.stride == t.stride() and self.dtype == t.dtype
                and self.dev_version == self.dev._version)


class Mirrors:
    """Device copies of host tensors, reused while the host tensor is unchanged (see module doc).

    Entries are keyed by the host tensor's identity and dropped when it dies.
    ``uploads``/``reuses`` count copies made and copies reused.
    """

    def __init__(self) -> None:
        self._m: Dict[int, _Entry] = {}
        self.uploads = 0
        self.reuses = 0

    def __len__(self) -> int:
        return len(self._m)

    def _drop(self, key: int, entry: _Entry) -> Callable[[Any], None]:
        def gone(_ref: Any, key: int = key, entry: _Entry = entry, m: Dict[int, _Entry] = self._m) -> None:
            if m.get(key) is entry:
                del m[key]
        return gone

    def upload(self, t: Tensor) -> Tensor:
        """The device copy of host tensor ``t`` (no autograd history), made now unless a fresh one exists."""
        e = self._m.get(id(t))
        if e is not None and e.fresh(t):
            self.reuses += 1
            return e.dev
        with torch.no_grad():
            dev = to_device(t.detach())
        self.uploads += 1
        self.note(t, dev)
        return dev

    def note(self, t: Tensor, dev: Tensor) -> None:
        """Remember ``dev`` (a device tensor without history) as holding host tensor ``t``'s values."""
        e = _Entry.__new__(_Entry)
        e.dev = dev
        e.ref = weakref.ref(t, self._drop(id(t), e))
        e.mark(t)
        self._m[id(t)] = e

    def written(self, t: Tensor) -> Optional[Tensor]:
        """The device copy of ``t`` if the device side was written since they were in step (else None)."""
        e = self._m.get(id(t))
        if e is None or e.ref() is not t or e.dev._version == e.dev_version:
            return None
        return e.dev

    def resync(self, t: Tensor) -> None:
        """``t`` and its device copy hold the same values again (after a write-back)."""
        e = self._m.get(id(t))
        if e is not None:
            e.mark(t)


class _Upload(torch.autograd.Function):
    """A host parameter as its device mirror, differentiably: the gradient goes back to the host tensor."""

    @staticmethod
    def forward(ctx, host: Tensor, dev: Tensor) -> Tensor:  # type: ignore[override]
        ctx.dtype = host.dtype
        return dev.detach()

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        return (None if g is None else g.to(_CPU, ctx.dtype)), None


_BACKWARD: Dict[str, Any] = {"saved": None}  # the device's eager mode a windowed backward pass replaced


def _end_windowed_backward() -> None:
    """Leave the adaptive eager mode a backward pass entered (running what it queued); idempotent."""
    saved = _BACKWARD["saved"]
    if saved is not None:
        _BACKWARD["saved"] = None
        _windows.set_mode(saved)


def _windowed_backward() -> None:
    """Run the rest of this backward pass's device ops in windows: the device's adaptive eager mode until the
    pass ends (autograd's end-of-pass callback restores the mode; so does the next eager call if the pass
    failed before its end)."""
    if _BACKWARD["saved"] is not None or _windows.mode() == "adaptive":
        return
    _BACKWARD["saved"] = _windows.mode()
    _windows.set_mode("adaptive")
    torch.autograd.Variable._execution_engine.queue_callback(_end_windowed_backward)


class _Download(torch.autograd.Function):
    """A device result on the host, differentiably; with ``windows`` its backward runs the region's backward
    ops in the device's windows (see :func:`_windowed_backward`)."""

    @staticmethod
    def forward(ctx, dev: Tensor, windows: bool) -> Tensor:  # type: ignore[override]
        ctx.windows = windows
        return dev.to(_CPU)

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        if ctx.windows:
            _windowed_backward()
        return (None if g is None else g.to(_NEURON)), None


def _spec_on_host(spec: tuple) -> tuple:
    """A state spec (:mod:`tn.adaptive.state`) with every static ``torch.device("neuron")`` made the CPU (a
    device the forward recorded in a proxy, ``self.device = keys.device``, is the host's for the caller)."""
    tag = spec[0]
    if tag == "s":
        v = spec[1]
        return ("s", _CPU) if type(v) is torch.device and v.type == "neuron" else spec
    if tag == "seq":
        return ("seq", spec[1], tuple(_spec_on_host(c) for c in spec[2]))
    if tag == "d":
        return ("d", spec[1], tuple(_spec_on_host(c) for c in spec[2]))
    if tag == "o":
        return ("o", spec[1], spec[2], tuple(_spec_on_host(c) for c in spec[3]))
    return spec


class _Call:
    """One eager call moved to the device: what went up, so that results and writes come back."""

    def __init__(self, mirrors: Mirrors, windows: bool = False):
        self.mirrors = mirrors
        self.windows = windows
        self.grad = torch.is_grad_enabled()
        self.back: Dict[int, Tensor] = {}     # id(device tensor) -> the host tensor it stands for
        self.synced: List[Tensor] = []        # host tensors sent through the mirrors (checked for writes)
        self.states: List[tuple] = []         # (caller's object, spec, host tensors, device tensors, proxy)
        self.proxies: Dict[int, Any] = {}     # id(proxy) -> caller's object
        self.compared: List[tuple] = []       # (host buffer, device copy): written back when their values differ

    def up(self, t: Tensor, param: bool = False) -> Tensor:
        """Host tensor ``t`` on the device (a parameter that requires grad through :class:`_Upload`)."""
        if self.grad and t.requires_grad:
            if param or t.is_leaf and isinstance(t, torch.nn.Parameter):
                d = _Upload.apply(t, self.mirrors.upload(t))
                self.synced.append(t)
            else:
                d = t.to(_NEURON)
        else:
            d = self.mirrors.upload(t)
            self.synced.append(t)
        self.back[id(d)] = t
        return d

    def arg(self, x: Any) -> Any:
        """A leaf of the arguments on the device (a state object as a proxy holding device tensors)."""
        if isinstance(x, Tensor):
            return self.up(x) if x.device.type == "cpu" else x
        if _state.is_state(x):
            tensors: List[Tensor] = []
            spec = _state.flatten(x, tensors)
            devs = [self.up(t) if t.device.type == "cpu" else t for t in tensors]
            proxy = _state.build(spec, iter(devs), device=_NEURON)
            self.states.append((x, spec, tensors, devs, proxy))
            self.proxies[id(proxy)] = x
            return proxy
        return x

    def down(self, o: Any) -> Any:
        """A device tensor of the results on the host (a state object converted, or the caller's own)."""
        if isinstance(o, Tensor):
            if o.device.type != "neuron":
                return o
            h = self.back.get(id(o))
            if h is not None:
                return h
            if o.requires_grad:
                return _Download.apply(o, self.windows)
            h = o.to(_CPU)
            self.mirrors.note(h, o.detach())
            return h
        if _state.is_state(o):
            mine = self.proxies.get(id(o))
            if mine is not None:
                return mine
            tensors: List[Tensor] = []
            spec = _state.flatten(o, tensors)
            _state.write_back(o, _spec_on_host(spec), iter([self.down(t) for t in tensors]), [])
            return o
        return o

    def finish(self) -> None:
        """Write back what the forward did to the caller's state objects and to mirrored host tensors."""
        for obj, spec, tensors, devs, proxy in self.states:
            new: List[Tensor] = []
            post = _state.flatten(proxy, new, devs)
            if not _state.unchanged(spec, post):
                _state.write_back(obj, _spec_on_host(post), iter([self.down(t) for t in new]), tensors)
        m = self.mirrors
        for t, d in self.compared:  # kernels that update running statistics do not bump the version counter
            view = cpu_alias(d)
            if not torch.equal(view, t):
                with torch.no_grad():
                    t.copy_(view)
                m.resync(t)
        seen = set()
        for t in self.synced:
            if id(t) in seen:
                continue
            seen.add(id(t))
            d = m.written(t)
            if d is not None:
                with torch.no_grad():
                    t.copy_(d.to(_CPU))
                m.resync(t)


def _is_state_leaf(x: Any) -> bool:
    return _state.is_state(x)


class Placement:
    """Runs a region's eager calls where the policy says (see module doc); one per adaptive model."""

    def __init__(self, policy: Any, backend: str):
        self.where = eager_on(policy, backend)
        self.windows = bool(policy.eager_windows)
        self.mirrors = Mirrors()
        self._told = False

    def label(self, region: Any) -> str:
        """Where ``region``'s eager calls run, for the report."""
        if region.eager_host is not None:
            return f"host (fell back: {region.eager_host})"
        if self.where == "host":
            return "host"
        return "neuron (windows)" if self.windows else "neuron (op by op)"

    def on_device(self, region: Any) -> bool:
        """Whether ``region``'s eager calls of a host model are moved to the device (cold ones compile there)."""
        return self.where == "neuron" and region.eager_host is None

    def wants_device(self, region: Any, module: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
        """Whether this call is a host call to move to the device: every tensor of the module and of the
        arguments is on the CPU (and the region has not fallen back)."""
        if self.where != "neuron" or region.eager_host is not None:
            return False
        ms = module_state(module)
        found = False
        for d, k in ms.refs:
            if d[k].device.type != "cpu":
                return False
            found = True
        for leaf in _pytree.tree_leaves((args, kwargs), is_leaf=_is_state_leaf):
            if isinstance(leaf, Tensor):
                if leaf.device.type != "cpu":
                    return False
                found = True
            elif _state.is_state(leaf):
                tensors: List[Tensor] = []
                try:
                    _state.flatten(leaf, tensors)
                except _state.StateError:
                    return False
                if any(t.device.type != "cpu" for t in tensors):
                    return False
        return found

    def run(self, region: Any, base_forward: Any, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """One eager call of ``region``: on the device when the model and arguments live on the host (else as
        given); a device failure is retried on the host (see module doc)."""
        if not self.wants_device(region, module, args, kwargs):
            return base_forward(module, *args, **kwargs)
        if not self._told:
            self._told = True
            if config.log_enabled("adaptive"):
                log.warning("tn.adaptive: the model lives on the CPU: eager calls run on the neuron device (%s), "
                            "parameters mirrored there", "windows" if self.windows else "op by op")
        try:
            return self._on_device(region, base_forward, module, args, kwargs)
        except Exception as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            why = f"{type(e).__name__}: {msg[:200]}"
        out = base_forward(module, *args, **kwargs)  # the user's error, if it is one, is raised here
        region.eager_host = why
        region._decide(f"eager calls run on the host for good: on the device they raised {why}")
        return out

    def _on_device(self, region: Any, base_forward: Any, module: torch.nn.Module, args: tuple,
                   kwargs: dict) -> Any:
        _end_windowed_backward()  # a backward pass that failed before its end left windows on
        call = _Call(self.mirrors, self.windows)
        ms = module_state(module)
        params = {}
        training = any(m.training for m in ms.mods)
        for n, (d, k) in zip(ms.names, ms.refs):
            t = d[k]
            params[n] = dt = call.up(t, param=True)
            if training and not isinstance(t, torch.nn.Parameter):
                call.compared.append((t, dt))
        dargs, dkwargs = _pytree.tree_map(call.arg, (args, kwargs), is_leaf=_is_state_leaf)
        mode = _windows.eager_mode("adaptive") if self.windows else contextlib.nullcontext()
        with Profile() as prof, mode:
            with _reparametrize_module(module, params, tie_weights=True, strict=False):
                out = base_forward(module, *dargs, **dkwargs)
                # buffers the forward reassigned (self.buf = t): the context restores the originals on exit
                moved = [(d, k, d[k]) for n, (d, k) in zip(ms.names, ms.refs)
                         if d[k] is not params[n] and not isinstance(d[k], torch.nn.Parameter)]
            out = _pytree.tree_map(call.down, out, is_leaf=_is_state_leaf)
            call.finish()
            for d, k, new in moved:
                d[k] = call.down(new) if isinstance(new, Tensor) else new
        region.eager_device_us += prof.total_us
        region.eager_device_programs += len(prof.runs)
        return out
