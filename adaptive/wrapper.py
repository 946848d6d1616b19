# tn.adaptive.wrapper: tn.adaptive(model) itself: finds the regions, swaps their forward, and reports.
"""The adaptive wrapper and its report.

:func:`adaptive` patches the chosen modules of the model in place: each
region module's class is swapped for a subclass whose ``forward`` asks the
region's controller (:class:`tn.adaptive.region.Region`) how to run. The
model keeps working everywhere it is called from (``model(...)``, HF
``generate``, hooks); the returned :class:`AdaptiveModel` forwards every
attribute to it and adds :meth:`AdaptiveModel.report`.
"""
from __future__ import annotations

import importlib
import inspect
import threading
from typing import Any, Dict, List, Optional

import torch

from ..errors import ArgumentTypeError, ArgumentValueError
from ..jit import default_backend
from .placement import Placement
from .policy import Policy, make_policy
from .region import Group, Region, fingerprint, gc_seconds, install_gc_clock

__all__ = ["adaptive", "adaptive_report", "AdaptiveModel", "default_regions"]

_SWAPPED: Dict[type, type] = {}


def _region_class(cls: type) -> type:
    """The subclass of ``cls`` whose forward dispatches through the instance's region."""
    sub = _SWAPPED.get(cls)
    if sub is None:
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            """Adaptive forward: the region decides eager or compiled (see tn.adaptive)."""
            return self.__dict__["_tn_region"].dispatch(self, args, kwargs)

        # callers inspect forward's parameters (HF generate passes position_ids only to a forward that
        # names them, and left-padded batches then get wrong positions): keep the original signature
        try:
            forward.__signature__ = inspect.signature(cls.forward)
        except (TypeError, ValueError):  # a builtin or otherwise unintrospectable forward
            pass
        forward.__wrapped__ = cls.forward

        sub = type(cls.__name__, (cls,), {"forward": forward, "_tn_adaptive_base": cls,
                                           "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        _SWAPPED[cls] = sub
    return sub


def default_regions(model: torch.nn.Module) -> List[str]:
    """Names of the default regions: every block of the first ModuleList/Sequential of same-type blocks, and the root.

    The root (``""``, the "remainder") is a region too: when it compiles, the
    whole model is one program and its blocks are inlined.
    """
    names: List[str] = []
    queue = [("", model)]
    while queue and not names:
        nxt = []
        for prefix, mod in queue:
            if not prefix and isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)):
                kids = list(mod.named_children())
                if len(kids) >= 2 and len({type(c) for _, c in kids}) == 1:
                    names += [k for k, _ in kids]
                    break
            for cname, child in mod.named_children():
                full = f"{prefix}.{cname}" if prefix else cname
                if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)):
                    kids = list(child.named_children())
                    types = {type(c) for _, c in kids}
                    if len(kids) >= 2 and len(types) == 1 and any(True for _ in kids[0][1].parameters()):
                        names += [f"{full}.{k}" for k, _ in kids]
                        continue
                nxt.append((full, child))
        queue = nxt
    return names + [""]


class _Controller:
    """Holds the policy, the regions and the groups of identical regions of one adaptive model."""

    def __init__(self, model: torch.nn.Module, policy: Policy):
        self.model = model
        self.policy = policy
        self.backend = policy.backend or _default_backend()
        self.placement = Placement(policy, self.backend)  # where eager calls run (tn.adaptive.placement)
        self.regions: Dict[str, Region] = {}
        self.groups: Dict[Any, Group] = {}
        self.compile_total = 0.0  # seconds spent compiling (and analysing), all regions: eager times exclude it
        self.compile_n = 0
        self.compile_rate_s = 0.0  # compile seconds and the warm eager seconds of what was compiled
        self.compile_rate_e = 0.0
        self.ratio_sum = 0.0
        self.ratio_n = 0
        self.comp_floor = 0.0  # the fastest compiled call measured (no program call is expected to be faster)
        self.analysis_s = 0.0
        self._tls = threading.local()

    def frames(self) -> list:
        """This thread's stack of running eager regions (each ``[compiled child s, eager child s]``)."""
        f = getattr(self._tls, "frames", None)
        if f is None:
            f = self._tls.frames = []
        return f

    def note_compile(self, seconds: float, warm: Optional[float]) -> None:
        """Record one compile (its time feeds the estimate of regions that have not compiled yet)."""
        self.compile_total += seconds
        self.compile_n += 1
        if warm:
            self.compile_rate_s += seconds
            self.compile_rate_e += warm

    def excluded_s(self, clock: Any) -> float:
        """Seconds (on ``clock``'s scale) that region timings leave out, so far: compiles and analyses of any region,
        and garbage collections. A measurement subtracts how much this grew while it ran."""
        return self.compile_total + gc_seconds(clock)

    def note_analysis(self, seconds: float) -> None:
        """Time spent tracing for the independence analysis (not eager time of the enclosing regions)."""
        self.compile_total += seconds
        self.analysis_s += seconds

    def compile_estimate(self, warm: float) -> float:
        """Expected compile time of a group that has not compiled: the model's compile seconds per second
        of warm eager time times ``warm``, else the prior."""
        if self.compile_rate_e > 0:
            return self.compile_rate_s / self.compile_rate_e * warm
        return self.policy.compile_time_prior

    def ratio_estimate(self) -> float:
        """Expected compiled/eager time ratio of a group that measured none: the model's mean, else the prior."""
        return self.ratio_sum / self.ratio_n if self.ratio_n else self.policy.compiled_ratio_prior

    def note_ratio(self, ratio: float) -> None:
        """Record the compiled/eager time ratio measured on one compiled call."""
        self.ratio_sum += ratio
        self.ratio_n += 1

    @staticmethod
    def tensor_index(leaves: list) -> Dict[int, int]:
        """Leaf index -> index among the tensor leaves (the program's argument inputs follow its parameters)."""
        out, k = {}, 0
        for i, l in enumerate(leaves):
            if isinstance(l, torch.Tensor):
                out[i] = k
                k += 1
        return out

    def add(self, name: str, module: torch.nn.Module) -> None:
        """Make ``module`` a region (idempotent), in the group of the regions with its structure."""
        if "_tn_region" in module.__dict__:
            return
        cls = type(module)
        base = getattr(cls, "_tn_adaptive_base", cls)
        region = Region(self, name or "<root>", module, base.forward)
        fp = (base, fingerprint(module)) if self.policy.share else ("region", region.name)
        g = self.groups.get(fp)
        if g is None or g.base_forward is not base.forward:
            g = self.groups[fp] = Group(self, region)
        g.members.append(region)
        region.group = g
        module.__dict__["_tn_region"] = region
        module.__class__ = _region_class(base)
        self.regions[region.name] = region

    def add_children(self, region: Region) -> None:
        """The children of a region that fell back for good become regions (those holding parameters)."""
        prefix = "" if region.name == "<root>" else region.name + "."
        for cname, child in region.module.named_children():
            if any(True for _ in child.parameters()) and "_tn_region" not in child.__dict__:
                if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                    for gname, gm in child.named_children():
                        if any(True for _ in gm.parameters()):
                            self.add(f"{prefix}{cname}.{gname}", gm)
                else:
                    self.add(prefix + cname, child)


def _default_backend() -> str:
    """tn.jit's default backend (``TN_BACKEND``, else ``"neuron"``), with the compiler imported so that the
    ``"neuron"`` backend is registered."""
    importlib.import_module("tn.lower")  # lazy: registers the "neuron" backend (the compiler loads on first use)
    return default_backend()


class AdaptiveModel:
    """A model under :func:`tn.adaptive`: behaves like the model (every attribute is the model's).

    Calling it calls the model; ``train()``/``eval()``/``to()`` return the
    wrapper; ``.module`` is the model; :meth:`report` prints and returns the
    per-region table.
    """

    _own = frozenset({"_tn_ctl"})

    def __init__(self, model: torch.nn.Module, ctl: _Controller):
        object.__setattr__(self, "_tn_ctl", ctl)

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped (patched in place) model."""
        return self._tn_ctl.model

    @property
    def regions(self) -> Dict[str, Region]:
        """The regions by name (``"<root>"`` for the whole model)."""
        return self._tn_ctl.regions

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tn_ctl.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tn_ctl.model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._tn_ctl.model, name, value)

    def __getitem__(self, i: Any) -> Any:
        return self._tn_ctl.model[i]

    def __len__(self) -> int:
        return len(self._tn_ctl.model)

    def __iter__(self):
        return iter(self._tn_ctl.model)

    def __dir__(self):
        return sorted(set(dir(self._tn_ctl.model)) | {"report", "module", "regions"})

    def train(self, mode: bool = True) -> "AdaptiveModel":
        """``model.train(mode)``; returns the wrapper."""
        self._tn_ctl.model.train(mode)
        return self

    def eval(self) -> "AdaptiveModel":
        """``model.eval()``; returns the wrapper."""
        self._tn_ctl.model.eval()
        return self

    def to(self, *args: Any, **kwargs: Any) -> "AdaptiveModel":
        """``model.to(...)`` (in place for modules); returns the wrapper."""
        self._tn_ctl.model.to(*args, **kwargs)
        return self

    def report(self, print_table: bool = True) -> List[Dict[str, Any]]:
        """Per-region rows (mode, calls, signatures, compiles, hits, padded, times, reason); prints a table."""
        return adaptive_report(self, print_table=print_table)

    def __repr__(self) -> str:
        return f"tn.adaptive({self._tn_ctl.model.__class__.__name__}, {len(self.regions)} regions)"


def adaptive(model: torch.nn.Module, **policy: Any) -> AdaptiveModel:
    """Run ``model`` adaptively: per region, eager or compiled, decided from the signatures it sees.

    Regions are by default each block of the model's first ``ModuleList``/
    ``Sequential`` of same-type blocks, plus the whole model (the remainder);
    ``regions=[...]`` (module names or types) overrides them. Regions of the
    same structure (the blocks) form a group that shares statistics and one
    compiled program per signature. Every region starts eager and records its
    signatures; a signature is compiled with :func:`tn.jit` when the compile
    is expected to pay back from measured times: a shape's first (cold) eager
    call, warm eager calls, compiled calls, compile time, and how often the
    region's signatures recur (see :mod:`tn.adaptive.policy`). A region whose
    eager time is spent in child regions leaves compiling to them. A region
    whose signatures churn is bucketed along the dimensions the traced IR
    proves may be padded at their end (the batch; a sequence under a causal
    mask): inputs padded to a power of two, results sliced back, compiled per
    bucket or, when a new shape's first eager call is dear, run eager at the
    bucket's shape. A dimension the program grows by ``cat`` (a KV cache) is
    bucketed by padding it at the *front* and masking the padded positions in
    every reduction and contraction along it (:mod:`tn.bucketing`); such
    buckets never run eager padded. Otherwise it stays eager and hands over to
    its children. Arguments that are mutable state objects (HF ``Cache`` and
    its layers, or types given to :func:`tn.adaptive.register_state_type`) are
    carried through compiled calls: their tensors are program inputs, the
    tensors the forward leaves in them are program outputs written back into
    the caller's object, and their other attributes are part of the signature
    (a counter that changes every call makes every call a new signature).
    Such regions run eager under autograd.
    A region that cannot be traced stays eager for good, and its children
    holding parameters become regions. Under autograd a compiled region runs
    as a ``torch.autograd.Function`` (jitted forward, jitted vjp).

    Policy keywords (:class:`tn.adaptive.policy.Policy`): ``min_calls`` (1),
    ``min_gain`` (0.05), ``compile_time_prior`` (0.3 s),
    ``compiled_ratio_prior`` (0.3), ``max_recurrence`` (0.8),
    ``churn_window`` (32), ``churn_distinct`` (4), ``bucket`` ("pow2", a list
    of sizes, or None), ``max_bucket`` (4096), ``masked_min_bucket`` (128),
    ``cache_size`` (16 programs per
    group), ``max_signatures`` (256 per region and group), ``share`` (True),
    ``backend`` (``TN_BACKEND``, else "neuron"), ``regions``, ``autograd``
    (True), ``eager_on`` (None: eager calls of a CPU model run on the NeuronCore
    model when the backend is "neuron"; "host" keeps them host PyTorch),
    ``eager_windows`` (True: in the device's windows), ``clock``
    (``time.process_time``), ``costs`` (injected times).
    ``TN_LOG=adaptive`` logs each decision (logger ``"tn"``).
    """
    if isinstance(model, AdaptiveModel):
        raise ArgumentValueError("tn.adaptive: the model is already adaptive; pass the original module or use it as is")
    if not isinstance(model, torch.nn.Module):
        raise ArgumentTypeError(f"tn.adaptive: expected an nn.Module, got {type(model).__name__}; wrap functions with tn.jit")
    pol = make_policy(**policy)
    for n, sub in model.named_modules():
        if "_tn_region" in sub.__dict__:
            raise ArgumentValueError(f"tn.adaptive: module {n or '<root>'!r} already belongs to an adaptive model; keep using the "
                                     f"object the first tn.adaptive call returned")
    ctl = _Controller(model, pol)
    install_gc_clock()
    if pol.regions is None:
        names = default_regions(model)
    else:
        names = []
        mods = dict(model.named_modules())
        for r in pol.regions:
            if isinstance(r, str):
                if r not in mods:
                    raise ArgumentValueError(f"tn.adaptive: regions= names {r!r}, which is not a submodule; known names "
                                             f"include {sorted(mods)[:8]}")
                names.append(r)
            elif isinstance(r, type):
                found = [n for n, m in mods.items() if isinstance(m, r)]
                if not found:
                    raise ArgumentValueError(f"tn.adaptive: regions= names type {r.__name__}, which no submodule has")
                names += found
            else:
                raise ArgumentTypeError(f"tn.adaptive: regions= takes module names or types, got {r!r}")
    mods = dict(model.named_modules())
    for n in names:
        ctl.add(n, mods[n])
    return AdaptiveModel(model, ctl)


def adaptive_report(m: Any, print_table: bool = True) -> List[Dict[str, Any]]:
    """Rows of the per-region report of an adaptive model (and print them as a table)."""
    if not isinstance(m, AdaptiveModel):
        raise ArgumentTypeError(f"tn.adaptive_report: expected a model returned by tn.adaptive, got {type(m).__name__}")
    rows = [r.row() for r in m._tn_ctl.regions.values()]
    if print_table:
        from tabulate import tabulate  # lazy: tabulate loads only when a table is printed (keeps import tn fast)
        print(tabulate(rows, headers="keys"))
    return rows
