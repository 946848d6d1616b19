# tn.adaptive.region: one region of a model: records signatures, runs eager or compiled (padded to buckets), under autograd too.
"""A region: a module whose ``forward`` the adaptive controller dispatches.

Each call computes the abstract signature of the arguments (tensor shapes,
dtypes, devices, ``requires_grad``; other leaves by value; grad mode; the
module's training flag), then either

* runs eager (:func:`run_eager`: the module's own PyTorch code, op by op, on
  the device the inputs are on: the ``neuron`` device when they are there),
  measuring the time per call, or
* runs the :func:`tn.jit` program of the signature (or of its bucket, with
  inputs padded along the bucketed dimension and results sliced back), or
* compiles the signature because the cost model of :mod:`tn.adaptive.policy`
  says it pays back.

Under autograd a compiled call goes through :class:`_RegionFunction`: the
forward is the jitted forward, the backward a jitted vjp that recomputes the
forward and calls ``torch.autograd.grad`` inside the program.
"""
from __future__ import annotations

import collections
import logging
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.utils._pytree as _pytree

from . import independence
from .policy import Policy, bucket_size, expected_future, should_compile

__all__ = ["Region", "run_eager"]

log = logging.getLogger("tn")

_PRIMITIVE = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.memory_format,
              torch.layout, slice, type(Ellipsis))


def _jit_module():
    return sys.modules["tn.jit"]


def _tracing() -> bool:
    """True while tn.jit traces (regions met inside a trace are inlined)."""
    return bool(_jit_module()._tls.depth)


def log_enabled() -> bool:
    """True when ``TN_LOG`` names ``adaptive`` (or ``all``): decisions are logged to logger ``"tn"``."""
    v = os.environ.get("TN_LOG", "")
    flags = set(v.replace(",", " ").lower().split())
    return "adaptive" in flags or "all" in flags


def run_eager(base_forward, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """Eager execution of a region: its PyTorch code op by op.

    This is the one place that decides what "eager" means: the code runs on
    the device its inputs are on (op by op on the ``neuron`` device when the
    inputs and parameters are there, each op a one-op NeuronCore program;
    torch CPU eager otherwise).
    """
    return base_forward(module, *args, **kwargs)


class _Unsupported(Exception):
    pass


class SigStats:
    """Statistics of one signature (or bucket) of a region."""

    __slots__ = ("count", "eager_n", "eager_s", "comp_n", "comp_s", "state", "reason")

    def __init__(self) -> None:
        self.count = 0
        self.eager_n = 0
        self.eager_s = 0.0
        self.comp_n = 0
        self.comp_s = 0.0
        self.state = "eager"  # eager | compiled | slower | failed
        self.reason = ""


class _Bucketing:
    """How a region pads: the independent groups of (leaf, axis) and the output axes carrying each."""

    def __init__(self, pattern: Any, groups: List[Tuple[Tuple[int, int], ...]], out_axes: List[List[Optional[int]]]):
        self.pattern = pattern
        self.groups = groups
        self.out_axes = out_axes


class _RegionFunction(torch.autograd.Function):
    """Autograd through a compiled region: jitted forward, jitted vjp (recomputing the forward) as backward."""

    @staticmethod
    def forward(ctx, region, call, *tensors):  # type: ignore[override]
        out = region._jitted()(*call["args"], **call["kwargs"])
        leaves, spec = _pytree.tree_flatten(out)
        call["spec"] = spec
        call["leaves"] = leaves
        ctx.region = region
        ctx.call = call
        touts = tuple(l for l in leaves if isinstance(l, torch.Tensor))
        ctx.mark_non_differentiable(*[t for t in touts if not (t.is_floating_point() or t.is_complex())])
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in touts]
        return touts

    @staticmethod
    def backward(ctx, *gys):  # type: ignore[override]
        call = ctx.call
        gys = [g if g is not None else torch.zeros(s, dtype=d, device=dev)
               for g, (s, d, dev) in zip(gys, ctx.shapes)]
        grads = ctx.region._vjp()(ctx.region.module, call["args"], call["kwargs"], gys)
        return (None, None) + tuple(grads)


def _bucket_shapes(key) -> list:
    return [list(p[0]) for p in key[1] if p[0] != "v"]


class Region:
    """One adaptive region: the module, its signature table, its compiled programs and counters."""

    def __init__(self, controller: Any, name: str, module: torch.nn.Module, base_forward: Any):
        self.ctl = controller
        self.policy: Policy = controller.policy
        self.name = name
        self.module = module
        self.base_forward = base_forward
        self.sigs: "collections.OrderedDict[Any, SigStats]" = collections.OrderedDict()
        self.compiled: "collections.OrderedDict[Any, None]" = collections.OrderedDict()
        self.window: "collections.deque" = collections.deque(maxlen=self.policy.churn_window)
        self.repeats: "collections.deque" = collections.deque(maxlen=self.policy.churn_window)
        self.n_repeats = 0
        self.dead: Optional[str] = None
        self.bucketing: Optional[_Bucketing] = None
        self.bucket_refused: Optional[str] = None
        self.reason = "new: runs eager while it records signatures"
        self.calls = self.compiles = self.hits = self.padded = self.distinct = 0
        self.eager_s = self.compiled_s = self.compile_s = 0.0
        self._jm = None
        self._vjp_fn = None
        self._raw: "collections.OrderedDict[Any, None]" = collections.OrderedDict()
        self.ratio_sum = 0.0  # measured compiled/eager time ratios of compiled calls
        self.ratio_n = 0

    def __deepcopy__(self, memo: Dict[int, Any]) -> "Region":
        # a copied model shares the region; the region inlines calls on modules other than its own
        return self

    def __copy__(self) -> "Region":
        return self

    # -- programs ---------------------------------------------------------
    def _jitted(self):
        if self._jm is None:
            from ..jit import JittedModule
            self._jm = JittedModule(self.module, backend=self.ctl.backend, cache_size=self.policy.cache_size)
        return self._jm

    def _vjp(self):
        if self._vjp_fn is None:
            from ..jit import jit
            base = self.base_forward

            def region_vjp(mod, args, kwargs, gys):
                """vjp of the region's forward at (args, kwargs) for output cotangents gys."""
                with torch.enable_grad():
                    out = base(mod, *args, **kwargs)
                outs = [t for t in _pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
                targets = [t for t in _pytree.tree_leaves((args, kwargs))
                           if isinstance(t, torch.Tensor) and t.requires_grad]
                targets += [p for p in mod.parameters() if p.requires_grad]
                pairs = [(o, g) for o, g in zip(outs, gys) if o.requires_grad]
                grads = torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs], allow_unused=True)
                return [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, targets)]

            self._vjp_fn = jit(region_vjp, backend=self.ctl.backend, cache_size=self.policy.cache_size)
        return self._vjp_fn

    # -- bookkeeping --------------------------------------------------------
    def _decide(self, msg: str) -> None:
        self.reason = msg
        if log_enabled():
            log.warning("tn.adaptive: %s: %s", self.name, msg)

    def _cost(self, kind: str, measured: float) -> float:
        c = self.policy.injected(kind, self.name)
        return measured if c is None else float(c)

    def _stats(self, key: Any) -> SigStats:
        st = self.sigs.get(key)
        if st is None:
            st = SigStats()
            self.sigs[key] = st
            if len(self.sigs) > self.policy.max_signatures:
                old, ost = self.sigs.popitem(last=False)
                self.compiled.pop(old, None)
        else:
            self.sigs.move_to_end(key)
        return st

    def signature(self, mod: torch.nn.Module, args: tuple, kwargs: dict):
        """``(key, leaves, spec)`` of a call; raises _Unsupported for a leaf tn.jit cannot take."""
        leaves, spec = _pytree.tree_flatten((args, kwargs))
        parts = []
        for i, l in enumerate(leaves):
            if isinstance(l, torch.Tensor):
                parts.append((tuple(l.shape), l.dtype, l.device.type, l.requires_grad))
            elif isinstance(l, _PRIMITIVE):
                parts.append(("v", type(l).__name__, l))
            else:
                raise _Unsupported(f"argument leaf {i} is a {type(l).__name__} (not a tensor, pytree or Python "
                                   f"constant): tn.jit cannot take it")
        return (spec, tuple(parts), torch.is_grad_enabled(), mod.training), leaves, spec

    # -- the call -----------------------------------------------------------
    def dispatch(self, mod: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """Run one call of the region: eager, compiled, padded-compiled, or compile now."""
        if mod is not self.module or _tracing():
            return self.base_forward(mod, *args, **kwargs)  # a tracing copy: inline
        self.calls += 1
        if self.dead is not None:
            return self._eager(None, args, kwargs)
        try:
            key, leaves, spec = self.signature(mod, args, kwargs)
        except _Unsupported as e:
            self._give_up(str(e))
            return self._eager(None, args, kwargs)
        self.window.append(key)
        if key in self._raw:
            self._raw.move_to_end(key)
        else:
            self._raw[key] = None
            self.distinct += 1
            if len(self._raw) > self.policy.max_signatures:
                self._raw.popitem(last=False)
        pads = None
        if self.bucketing is None and self.bucket_refused is None and self.policy.bucket is not None:
            if len(set(self.window)) >= self.policy.churn_distinct:
                self._try_bucketing(key, leaves, args, kwargs)
        bkey = key
        if self.bucketing is not None:
            pads, bkey = self._bucket_of(key)
        st = self._stats(bkey)
        rep = st.count > 0
        if len(self.repeats) == self.repeats.maxlen:
            self.n_repeats -= self.repeats[0]
        self.repeats.append(rep)
        self.n_repeats += rep
        st.count += 1
        needs_grad = torch.is_grad_enabled() and (
            any(isinstance(l, torch.Tensor) and l.requires_grad for l in leaves)
            or any(p.requires_grad for p in mod.parameters()))
        if needs_grad:
            why = self._autograd_blocker(mod)
            if why is not None:
                st.reason = self.reason = why
                return self._eager(st, args, kwargs)
        if st.state == "compiled":
            return self._compiled(bkey, st, leaves, spec, pads, needs_grad)
        if st.state == "eager" and self._pays_back(st):
            return self._compile(bkey, st, leaves, spec, pads, needs_grad, args, kwargs)
        return self._eager(st, args, kwargs)

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

    def _eager(self, st: Optional[SigStats], args: tuple, kwargs: dict) -> Any:
        clock = self.policy.clock
        c0 = self.ctl.compile_total
        t0 = clock()
        out = run_eager(self.base_forward, self.module, args, kwargs)
        # compiles of inner regions during this call are not eager time of this region
        dt = self._cost("eager", clock() - t0 - (self.ctl.compile_total - c0))
        self.eager_s += dt
        if st is not None:
            st.eager_n += 1
            st.eager_s += dt
        return out

    def _mean_eager(self, st: SigStats) -> Optional[float]:
        if st.eager_n:
            return st.eager_s / st.eager_n
        n = sum(s.eager_n for s in self.sigs.values())
        return self.eager_s / n if n else None

    def _ratio(self) -> float:
        """Compiled/eager time ratio: measured in this region, else across the model's regions, else the prior."""
        if self.ratio_n:
            return self.ratio_sum / self.ratio_n
        return self.ctl.ratio_estimate()

    def _pays_back(self, st: SigStats) -> bool:
        te = self._mean_eager(st)
        if te is None:
            return False
        tc = te * self._ratio()
        tcomp = self.compile_s / self.compiles if self.compiles else self.ctl.compile_estimate()
        r = self.recurrence()
        ok = should_compile(self.policy, st.count, r, te, tc, tcomp)
        fut = expected_future(self.policy, st.count, r)
        why = (f"seen {st.count}x, recurrence {r:.2f}: ~{fut:.3g} more calls * (eager {te * 1e3:.3g} ms - "
               f"compiled~{tc * 1e3:.3g} ms) {'>=' if ok else '<'} compile~{tcomp * 1e3:.3g} ms")
        st.reason = why
        if not ok:
            self.reason = why
        return ok

    def recurrence(self) -> float:
        """Share of the region's recent calls whose signature (or bucket) had been seen before."""
        n = len(self.repeats)
        return self.n_repeats / n if n else 0.0

    def _run_program(self, leaves, spec, pads, needs_grad) -> Any:
        """Run the jitted program (padding to the bucket first and slicing back after, when bucketed)."""
        if pads:
            leaves = list(leaves)
            for (i, d, n, b) in pads:
                x = leaves[i]
                last = x.narrow(d, n - 1, 1)
                shape = list(x.shape)
                shape[d] = b - n
                leaves[i] = torch.cat([x, last.expand(shape)], d)
        args, kwargs = _pytree.tree_unflatten(leaves, spec)
        if needs_grad:
            tensors = [l for l in leaves if isinstance(l, torch.Tensor) and l.requires_grad]
            tensors += [p for p in self.module.parameters() if p.requires_grad]
            call = {"args": args, "kwargs": kwargs}
            touts = _RegionFunction.apply(self, call, *tensors)
            it = iter(touts)
            out_leaves = [next(it) if isinstance(l, torch.Tensor) else l for l in call["leaves"]]
            ospec = call["spec"]
        else:
            out = self._jitted()(*args, **kwargs)
            out_leaves, ospec = _pytree.tree_flatten(out)
        if pads:
            by_group = {}
            for (i, d, n, b) in pads:
                by_group[self._group_of(i, d)] = n
            for g, n in by_group.items():
                for j, ax in enumerate(self.bucketing.out_axes[g]):
                    if ax is not None and isinstance(out_leaves[j], torch.Tensor):
                        out_leaves[j] = out_leaves[j].narrow(ax[0], 0, n * ax[1])
        return _pytree.tree_unflatten(out_leaves, ospec)

    def _compiled(self, key, st: SigStats, leaves, spec, pads, needs_grad) -> Any:
        clock = self.policy.clock
        self.compiled.move_to_end(key)
        t0 = clock()
        try:
            out = self._run_program(leaves, spec, pads, needs_grad)
        except Exception as e:  # the program failed: eager gives the user's result (or the user's error)
            return self._failed(st, e, leaves, spec)
        dt = self._cost("compiled", clock() - t0)
        st.comp_n += 1
        st.comp_s += dt
        self.compiled_s += dt
        self.hits += 1
        if pads:
            self.padded += 1
        te = self._mean_eager(st)
        if te:
            self.ratio_sum += dt / te
            self.ratio_n += 1
            self.ctl.note_ratio(dt / te)
        if st.comp_n >= 2 and te is not None and st.comp_s / st.comp_n >= te:
            st.state = "slower"
            self.compiled.pop(key, None)
            st.reason = (f"compiled {st.comp_s / st.comp_n * 1e3:.3g} ms/call is not faster than eager "
                         f"{te * 1e3:.3g} ms: back to eager")
            self._decide(st.reason)
        return out

    def _compile(self, key, st: SigStats, leaves, spec, pads, needs_grad, args, kwargs) -> Any:
        clock = self.policy.clock
        what = "bucket " + str(_bucket_shapes(key)) if key[-1] == "bucket" else "signature"
        self._decide(f"compiling {what} ({st.reason})")
        t0 = clock()
        try:
            out = self._run_program(leaves, spec, pads, needs_grad)
        except Exception as e:  # cannot trace or compile: eager gives the user's result (or the user's error)
            return self._failed(st, e, leaves, spec)
        dt = self._cost("compile", clock() - t0)
        self.compiles += 1
        self.compile_s += dt
        self.ctl.note_compile(dt)
        self.hits += 1
        if pads:
            self.padded += 1
        st.state = "compiled"
        self.compiled[key] = None
        while len(self.compiled) > self.policy.cache_size:
            old, _ = self.compiled.popitem(last=False)
            ost = self.sigs.get(old)
            if ost is not None:
                ost.state, ost.reason = "eager", "compiled program evicted (cache_size)"
        return out

    def _failed(self, st: SigStats, e: Exception, leaves, spec) -> Any:
        """A trace, compile or compiled run failed: eager for good (with the error as reason), this call eager."""
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        self._give_up(f"cannot be compiled ({type(e).__name__}: {msg[:300]})")
        args, kwargs = _pytree.tree_unflatten(list(leaves), spec)
        return self._eager(st, args, kwargs)

    def _give_up(self, why: str) -> None:
        if self.dead is None:
            self.dead = why
            self.compiled.clear()
            self._decide(f"eager for good: {why}; its children become regions")
            self.ctl.add_children(self)

    # -- buckets ------------------------------------------------------------
    def _group_of(self, i: int, d: int) -> int:
        for g, members in enumerate(self.bucketing.groups):
            if (i, d) in members:
                return g
        return -1

    def _pattern(self, key, positions) -> Any:
        spec, parts, grad, training = key
        parts = list(parts)
        for (i, d) in positions:
            shape = list(parts[i][0])
            shape[d] = None
            parts[i] = (tuple(shape),) + parts[i][1:]
        return (spec, tuple(parts), grad, training)

    def _bucket_of(self, key) -> Tuple[Optional[list], Any]:
        b = self.bucketing
        positions = [p for g in b.groups for p in g]
        if self._pattern(key, positions) != b.pattern:
            return None, key
        spec, parts, grad, training = key
        parts = [list(p) for p in parts]
        pads = []
        for g in b.groups:
            sizes = {key[1][i][0][d] for (i, d) in g}
            if len(sizes) != 1:
                return None, key
            n = sizes.pop()
            bs = bucket_size(self.policy, n)
            if bs is None:
                return None, key
            for (i, d) in g:
                shape = list(parts[i][0])
                shape[d] = bs
                parts[i][0] = tuple(shape)
                if bs != n:
                    pads.append((i, d, n, bs))
        return pads, (spec, tuple(tuple(p) for p in parts), grad, training, "bucket")

    def _try_bucketing(self, key, leaves, args, kwargs) -> None:
        spec, parts, grad, training = key

        def struct(k):
            return (k[0], tuple((p[1:], len(p[0])) if p[0] != "v" else p for p in k[1]), k[2], k[3])

        same = [k for k in set(self.window) if struct(k) == struct(key)]
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
        ckey = (getattr(type(self.module), "_tn_adaptive_base", type(self.module)), struct(key),
                tuple(tuple(m) for m in varying.values()),
                tuple((n, tuple(p.shape)) for n, p in self.module.named_parameters()))
        cached = self.ctl.analyses.get(ckey)
        if cached is None:
            cached = self._analyse(varying, leaves, args, kwargs)
            if cached is None:
                return
            self.ctl.remember_analysis(ckey, cached)
        groups, outs, refused = cached
        if not groups:
            self.bucket_refused = "; ".join(refused)
            self._decide(f"signatures churn; no bucketing: {self.bucket_refused}; its children become regions")
            self.ctl.add_children(self)
            return
        positions = [p for g in groups for p in g]
        self.bucketing = _Bucketing(self._pattern(key, positions), groups, outs)
        note = f" (not bucketed: {'; '.join(refused)}; its children become regions)" if refused else ""
        self._decide(f"signatures churn; bucketing (leaf, axis) groups {groups} to {self.policy.bucket}{note}")
        if refused:
            self.bucket_refused = "; ".join(refused)
            self.ctl.add_children(self)

    def _analyse(self, varying, leaves, args, kwargs):
        """Trace this call once and prove which varying groups are independent: ``(groups, out_axes, refused)``."""
        try:
            jm = self._jitted()
            core = jm._tn_core
            _, jspec, tensors = core.key_of(args, kwargs)
            ir, _out_tree, out_leaves = core.trace(jspec, tensors)
        except Exception as e:  # an untraceable region: the compile attempt will say so
            self.bucket_refused = f"cannot trace to analyse ({type(e).__name__})"
            return None
        flat_index = {id(t): j for j, t in enumerate(tensors)}
        groups, outs, refused = [], [], []
        for members in varying.values():
            try:
                axes = {flat_index[id(leaves[i])]: d for (i, d) in members}
                res = independence.independent_axes(ir, axes)
            except (independence.Mixed, KeyError) as e:
                refused.append(f"dims {members}: {e}")
                continue
            groups.append(tuple(members))
            outs.append([res[k] if isinstance(k, int) else None for k in out_leaves])
        return groups, outs, refused

    # -- report ---------------------------------------------------------------
    def mode(self) -> str:
        """``eager``, ``eager (for good)``, ``compiled``, ``bucketed`` or ``mixed`` (some signatures compiled)."""
        if self.dead is not None:
            return "eager (for good)"
        if not self.compiled:
            return "eager"
        if self.bucketing is not None:
            return "bucketed"
        hot = sum(1 for s in self.sigs.values() if s.state != "compiled")
        return "compiled" if hot == 0 else "mixed"

    def row(self) -> Dict[str, Any]:
        """One report row."""
        reason = self.dead and f"eager for good: {self.dead}" or self.reason
        if self.dead is None and self.bucket_refused and not self.compiled:
            reason = f"{reason}; no bucketing: {self.bucket_refused}"
        return {"region": self.name, "mode": self.mode(), "calls": self.calls, "signatures": self.distinct,
                "compiles": self.compiles, "hits": self.hits, "padded": self.padded,
                "eager_s": round(self.eager_s, 4), "compiled_s": round(self.compiled_s, 4),
                "compile_s": round(self.compile_s, 4), "reason": reason}
