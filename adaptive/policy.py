# tn.adaptive.policy: the knobs of the adaptive controller and its explicit compile-or-not cost model.
"""Policy and cost model of :func:`tn.adaptive`.

The controller compiles a signature (or a bucket of signatures) of a region
when the compile is expected to pay back::

    future * (t_eager - t_compiled) >= t_compile     and   seen >= min_calls
    future = seen * r / (1 - r)

* ``seen``: how often the signature occurred so far (its count in the
  region's bounded signature table).
* ``r``: the region's recurrence rate, the share of its last
  ``churn_window`` calls whose signature (or bucket) it had seen before,
  capped at ``max_recurrence``. A region in a stable phase has ``r`` near 1
  and a hot signature is expected to keep coming (``future`` grows like
  ``seen**2``: it compiles after a few calls); a churning region has ``r``
  near 0 and even a signature seen twice is not expected back.
* ``t_eager``: mean measured eager time per call of this signature (else of
  the region).
* ``t_compiled``: ``t_eager`` times the compiled/eager ratio measured on
  this region's compiled calls, else on the model's, else
  ``compiled_ratio_prior``.
* ``t_compile``: mean measured compile time of this region, else of the
  model's regions, else ``compile_time_prior`` seconds.

A compiled signature whose measured compiled time is not below its eager
time goes back to eager ("compiled slower"). Every time comes from
``Policy.clock`` unless ``Policy.costs`` injects it (tests use both).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Dict, Optional, Sequence, Union

from ..errors import TnError

__all__ = ["Policy", "make_policy", "should_compile", "expected_future", "bucket_size"]


@dataclasses.dataclass
class Policy:
    """Knobs of :func:`tn.adaptive` (every keyword of ``tn.adaptive(model, **policy)`` is a field).

    Attributes:
        min_calls: a signature is compiled only after it was seen this many times (default 2).
        compile_time_prior: assumed compile time in seconds before any region measured one (0.3).
        compiled_ratio_prior: assumed compiled/eager time ratio before any region measured one (0.2).
        max_recurrence: cap of the recurrence rate ``r`` of the cost model (0.97: ``future <= 32*seen``).
        churn_window: calls remembered per region to judge churn (32).
        churn_distinct: distinct signatures within the window that make a region "churning" (4);
            a churning region tries bucketing.
        bucket: ``"pow2"`` (round a bucketed size up to a power of two) or a sorted sequence of
            sizes (round up to the next listed size; larger sizes are not bucketed); ``None`` disables.
        max_bucket: largest bucket size for ``"pow2"`` (4096); larger sizes run unbucketed.
        cache_size: compiled programs kept per region (LRU, 16).
        max_signatures: signature statistics kept per region (LRU, 256): memory stays flat.
        backend: the :func:`tn.jit` backend (``"neuron"`` when the compiler is importable).
        regions: module names (``"transformer.h.0"``) or module types overriding the default regions.
        autograd: compile regions that run under autograd through a ``torch.autograd.Function``
            whose backward is a jitted vjp (True); False keeps such calls eager.
        clock: ``() -> seconds`` used to measure (``time.perf_counter``).
        costs: injected times replacing measurements: a dict with any of ``"eager"``,
            ``"compiled"``, ``"compile"`` (seconds), or ``callable(kind, region_name) -> seconds | None``.
    """

    min_calls: int = 2
    compile_time_prior: float = 0.3
    compiled_ratio_prior: float = 0.2
    max_recurrence: float = 0.97
    churn_window: int = 32
    churn_distinct: int = 4
    bucket: Union[str, Sequence[int], None] = "pow2"
    max_bucket: int = 4096
    cache_size: int = 16
    max_signatures: int = 256
    backend: Optional[str] = None
    regions: Optional[Sequence[Any]] = None
    autograd: bool = True
    clock: Callable[[], float] = time.perf_counter
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
    """A :class:`Policy` from keywords; an unknown keyword is a TnError listing the known ones."""
    names = {f.name for f in dataclasses.fields(Policy)}
    bad = sorted(set(kw) - names)
    if bad:
        raise TnError(f"tn.adaptive: unknown policy keyword(s) {bad}; known: {sorted(names)}")
    p = Policy(**kw)
    if p.min_calls < 1 or p.cache_size < 1 or p.max_signatures < 1 or p.churn_window < 1:
        raise TnError("tn.adaptive: min_calls, cache_size, max_signatures and churn_window must be >= 1")
    if p.bucket is not None and p.bucket != "pow2":
        try:
            sizes = sorted(int(s) for s in p.bucket)
        except TypeError:
            raise TnError(f"tn.adaptive: bucket must be 'pow2', None or a sequence of sizes, got {p.bucket!r}")
        p.bucket = tuple(sizes)
    return p


def bucket_size(policy: Policy, n: int) -> Optional[int]:
    """The bucket a size ``n`` is padded to, or None when ``n`` is not bucketed."""
    b = policy.bucket
    if b is None or n < 1:
        return None
    if b == "pow2":
        s = 1
        while s < n:
            s *= 2
        return s if s <= policy.max_bucket else None
    for s in b:
        if s >= n:
            return s
    return None


def expected_future(policy: Policy, seen: int, recurrence: float) -> float:
    """Expected further calls of a signature seen ``seen`` times in a region with recurrence rate ``recurrence``."""
    r = min(max(recurrence, 0.0), policy.max_recurrence)
    return seen * r / (1.0 - r)


def should_compile(policy: Policy, seen: int, recurrence: float, t_eager: float, t_compiled: float,
                   t_compile: float) -> bool:
    """The cost model: ``seen >= min_calls`` and ``expected_future * (t_eager - t_compiled) >= t_compile``."""
    if seen < policy.min_calls:
        return False
    return expected_future(policy, seen, recurrence) * (t_eager - t_compiled) >= t_compile
