# tn.adaptive.policy: the knobs of the adaptive controller and its explicit compile-or-not cost model.
"""Policy and cost model of :func:`tn.adaptive`.

Regions whose modules have the same structure (class, parameter shapes,
Python attributes: the blocks of a transformer) form a *group*: they share
signature statistics and compiled programs, so one compile serves every
block. For a call of signature (or bucket) ``s`` that has no program yet,
the controller compiles now when::

    t_compile <= (t_now - t_compiled) + future * (t_eager - t_compiled)
    future    = share * seen * r / (1 - r)

* ``t_now``: what running eager costs for this very call. On the neuron
  device the first eager call of a shape compiles one-op programs, so a
  shape the group never ran eager costs the group's measured *cold* eager
  time; else the *warm* time ``t_eager``.
* ``t_eager``: measured warm eager time per call of ``s`` (else estimated
  from its cold time with the group's warm/cold ratio).
* ``t_compiled``: measured compiled time of ``s``, else ``t_eager`` times
  the compiled/eager ratio measured in the group, else in the model (from
  calls at least 4x the fastest compiled call, so the fixed cost of tiny
  programs does not spread), else ``compiled_ratio_prior``; never below the
  fastest compiled call measured. A region whose eager time is partly spent in
  child regions (the root of a stack of blocks) leaves those to decide for
  themselves (identical blocks share one cheaper compile): only its own
  eager remainder is expected to speed up,
  ``t_compiled = t_children + ratio * t_own``.
* ``t_compile``: mean measured compile time of the group, else the model's
  compile time per second of warm eager time times ``t_eager``, else
  ``compile_time_prior`` (or twice the group's cold eager time when that is
  less and cold calls are dear: a cold eager call compiles each op's one-op
  program).
* ``seen``: how often this region saw ``s``; ``share``: calls of ``s`` in the
  group per call in this region (4 for four identical blocks); ``r``: the
  region's recurrence rate, the share of its last ``churn_window`` calls
  whose signature (or bucket) it had seen before, capped at
  ``max_recurrence``. A stable region has ``r`` near 1 (``future`` grows like
  ``seen**2``); a churning region has ``r`` near 0.

Which times: eager and compiled calls both run on the NeuronCore model (a
model that lives on the CPU has its eager calls moved to the device by
:mod:`tn.adaptive.placement`, unless ``eager_on="host"`` or a host backend
keeps them host PyTorch), so ``t_eager`` and ``t_compiled`` are host seconds
spent driving the same machine, like for like; the modelled chip time of both
is what ``tn.profile()`` and the report's ``eager_device_us`` show.

A compiled signature whose measured compiled time is not below its eager
time goes back to eager ("compiled slower"). Every time comes from
``Policy.clock`` unless ``Policy.costs`` injects it (tests use both); the
time spent in nested compiles and in Python's garbage collector during a
call is not counted as the call's time (a full collection in a process
holding torch takes ~100 ms and lands in whichever region is running).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Dict, Optional, Sequence, Union

from .. import bucketing
from ..errors import ArgumentTypeError, ArgumentValueError

__all__ = ["Policy", "make_policy", "should_compile", "expected_future", "bucket_size"]


@dataclasses.dataclass
class Policy:
    """Knobs of :func:`tn.adaptive` (every keyword of ``tn.adaptive(model, **policy)`` is a field).

    Attributes:
        min_calls: a signature is compiled only after a region saw it this many times (1: the cost
            model alone decides, e.g. compiling at first sight when a cold eager call costs about
            as much as a compile).
        min_gain: a compile must be expected to make a call at least this share faster (0.05): gains
            within measurement noise never pay for a compile.
        compile_time_prior: assumed compile time in seconds before any region measured one (0.3).
        compiled_ratio_prior: assumed compiled/eager time ratio before any region measured one (0.3).
        max_recurrence: cap of the recurrence rate ``r`` of the cost model (0.8: ``future <= 4*share*seen``,
            so a compile that saves little per call waits until the calls so far nearly paid for it).
        churn_window: calls remembered per region to judge churn (32).
        churn_distinct: distinct signatures within the window that make a region "churning" (4);
            a churning region tries bucketing.
        bucket: ``"pow2"`` (round a bucketed size up to a power of two) or a sorted sequence of
            sizes (round up to the next listed size; larger sizes are not bucketed); ``None`` disables.
        max_bucket: largest bucket size for ``"pow2"`` (4096); larger sizes run unbucketed.
        masked_min_bucket: smallest bucket of a dimension padded at the front with masks (a KV cache's
            length, :mod:`tn.bucketing`) (128: one SBUF partition's worth of keys costs about what a
            few do on the NeuronCore, and a generation then compiles once until its cache passes 128).
        cache_size: compiled programs kept per group of identical regions (LRU, 16).
        max_signatures: signature statistics kept per region and per group (LRU, 256): memory stays flat.
        share: regions of identical structure share statistics and programs (True).
        backend: the :func:`tn.jit` backend (``TN_BACKEND``, else ``"neuron"`` when the compiler is importable).
        regions: module names (``"transformer.h.0"``) or module types overriding the default regions.
        autograd: compile regions that run under autograd through a ``torch.autograd.Function``
            whose backward is a jitted vjp (True); False keeps such calls eager.
        eager_on: where eager calls of a model that lives on the CPU run: ``"neuron"`` (moved to the NeuronCore
            model: parameters mirrored on the device, results and in-place writes brought back), ``"host"`` (host
            PyTorch, the escape hatch) or None (default: ``"neuron"`` when ``backend`` is ``"neuron"``, else
            ``"host"``); see :mod:`tn.adaptive.placement`. A model on the ``neuron`` device runs there anyway.
        eager_windows: eager calls moved to the device run in its adaptive eager mode (ops gathered into cached
            windows, :mod:`tn.device.windows`) (True); False: op by op.
        clock: ``() -> seconds`` used to measure (``time.process_time``: the CPU time of the process, which
            another tenant taking the core does not inflate; ``time.perf_counter`` measures wall time).
        costs: injected times replacing measurements: a dict with any of ``"eager"``,
            ``"compiled"``, ``"compile"`` (seconds), or ``callable(kind, region_name) -> seconds | None``.
    """

    min_calls: int = 1
    min_gain: float = 0.05
    compile_time_prior: float = 0.3
    compiled_ratio_prior: float = 0.3
    max_recurrence: float = 0.8
    churn_window: int = 32
    churn_distinct: int = 4
    bucket: Union[str, Sequence[int], None] = "pow2"
    max_bucket: int = 4096
    masked_min_bucket: int = 128
    cache_size: int = 16
    max_signatures: int = 256
    share: bool = True
    backend: Optional[str] = None
    regions: Optional[Sequence[Any]] = None
    autograd: bool = True
    eager_on: Optional[str] = None
    eager_windows: bool = True
    clock: Callable[[], float] = time.process_time
    costs: Union[None, Dict[str, float], Callable[[str, str], Optional[float]]] = None

    def injected(self, kind: str, region: str) -> Optional[float]:
        """The injected cost of ``kind`` for ``region`` (None: measure it)."""
        c = self.costs
        if c is None:
            return None
        if callable(c):
            return c(kind, region)
        return c.get(kind)


def make_policy(**kw: Any) -> Policy:
    """A :class:`Policy` from keywords; an unknown keyword is an ArgumentTypeError (a TypeError) listing the known ones."""
    names = {f.name for f in dataclasses.fields(Policy)}
    bad = sorted(set(kw) - names)
    if bad:
        raise ArgumentTypeError(f"tn.adaptive: unknown policy keyword(s) {bad}; known: {sorted(names)}")
    p = Policy(**kw)
    if p.min_calls < 1 or p.cache_size < 1 or p.max_signatures < 1 or p.churn_window < 1 or p.masked_min_bucket < 1:
        raise ArgumentValueError("tn.adaptive: min_calls, cache_size, max_signatures, churn_window and masked_min_bucket "
                                 "must be >= 1")
    if p.eager_on not in (None, "neuron", "host"):
        raise ArgumentValueError(f"tn.adaptive: eager_on must be 'neuron', 'host' or None, got {p.eager_on!r}")
    if not 0.0 <= p.max_recurrence < 1.0:
        raise ArgumentValueError(f"tn.adaptive: max_recurrence must be in [0, 1), got {p.max_recurrence}")
    if p.bucket is not None and p.bucket != "pow2":
        try:
            sizes = sorted(int(s) for s in p.bucket)
        except TypeError:
            raise ArgumentValueError(f"tn.adaptive: bucket must be 'pow2', None or a sequence of sizes, got {p.bucket!r}")
        p.bucket = tuple(sizes)
    return p


def bucket_size(policy: Policy, n: int, masked: bool = False) -> Optional[int]:
    """The bucket a size ``n`` is padded to under ``policy``, or None when ``n`` is not bucketed (``masked``: a
    dimension padded at the front, whose buckets start at ``masked_min_bucket``): :func:`tn.bucketing.bucket_size`."""
    return bucketing.bucket_size(n, policy.bucket, policy.max_bucket, masked, policy.masked_min_bucket)


def expected_future(policy: Policy, seen: int, recurrence: float, share: float = 1.0) -> float:
    """Expected further calls of a signature in its group: ``share * seen * r / (1 - r)``, ``r`` capped."""
    r = min(max(recurrence, 0.0), policy.max_recurrence)
    return share * seen * r / (1.0 - r)


def should_compile(policy: Policy, seen: int, future: float, t_now: float, t_eager: float, t_compiled: float,
                   t_compile: float) -> bool:
    """The cost model: ``seen >= min_calls`` and
    ``t_compile <= (t_now - t_compiled) + future * (t_eager - t_compiled)``."""
    if seen < policy.min_calls:
        return False
    return t_compile <= (t_now - t_compiled) + future * (t_eager - t_compiled)
