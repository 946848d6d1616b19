# Modelled time of every core: per-core queues (what torch calls streams), the core's engines, its collective engine.
"""The modelled clock of each core of the machine.

Programs run synchronously on the host, but each run is *placed* on a
modelled timeline, so a profile of several cores, streams and collectives
shows what the machine would have overlapped:

* every core has **queues** (torch's streams; queue 0 is the default
  stream). A queue's ``ready_ns`` is when the last work put on it ends;
* every core has **resources**: ``"compute"`` (its engines: one program at a
  time), ``"collectives"`` (the chip's collective-communication cores,
  which run beside compute) and ``"transfers"`` (copies to other devices). Work on a resource starts when the resource is
  free, its queue is ready, and after the host's last synchronisation point
  of that core (``host_ns``);
* :func:`advance` places ``ns`` of work and returns its ``(start, end)``;
  the runtime calls it for every program run (``RunResult.core`` /
  ``RunResult.start_ns`` / ``RunResult.queue``), the device's fast path for
  the programs it stands in for, the collective model for each collective.
* waiting (:func:`wait_until`) moves a queue's ``ready_ns`` forward (an event
  or another stream it waits for); :func:`host_sync` moves ``host_ns`` (the
  host waited: later work on that core starts after it).

Which core and queue a run lands on is thread-local, like CUDA's current
device and stream: :func:`current_core` / :func:`set_current_core`,
:func:`current_queue` / :func:`set_current_queue`. The device door sets them
(``torch.neuron.set_device``, ``torch.neuron.stream``, and each eager op for
the device of its inputs).

>>> from tn.neuron import timeline as tl
>>> tl.reset()
>>> q = tl.new_queue(0)
>>> tl.advance(100.0), tl.advance(50.0, queue=q)     # compute is shared: the second program waits
((0.0, 100.0), (100.0, 150.0))
>>> tl.advance(30.0, queue=q, resource="collectives")   # collectives run beside compute, after q's work
(150.0, 180.0)
"""
from __future__ import annotations

import itertools
import threading
from typing import Dict, Optional, Tuple

__all__ = ["Queue", "current_core", "set_current_core", "current_queue", "set_current_queue", "default_queue",
           "new_queue", "advance", "wait_until", "host_sync", "core_time_ns", "reset", "RESOURCES"]

#: What work can occupy on a core: its engines, the collective-communication cores beside them, and the DMA
#: engines moving data to another device (device-to-device copies).
RESOURCES = ("compute", "collectives", "transfers")


class Queue:
    """One ordered queue of work on one core (a torch stream): ``core``, ``id`` (0 = default), ``ready_ns``."""

    __slots__ = ("core", "id", "ready_ns", "priority")

    def __init__(self, core: int, qid: int, priority: int = 0):
        self.core = core
        self.id = qid
        self.ready_ns = 0.0
        self.priority = priority

    def __repr__(self):
        return f"Queue(core={self.core}, id={self.id}, ready_ns={self.ready_ns:.1f})"


class _Core:
    __slots__ = ("free", "host_ns", "queues")

    def __init__(self, core: int):
        self.free = {r: 0.0 for r in RESOURCES}
        self.host_ns = 0.0
        self.queues: Dict[int, Queue] = {0: Queue(core, 0)}


_CORES: Dict[int, _Core] = {}
_LOCK = threading.Lock()
_IDS = itertools.count(1)


class _ThreadState(threading.local):
    """Per-thread current core and queues; class-level defaults, so a thread that set neither reads them without
    the exception path of a missing attribute (``getattr(local, name, default)`` costs ~0.5 us; this is read on
    every program run)."""

    core = 0
    queues: Optional[Dict[int, Queue]] = None


_TLS = _ThreadState()


def _core(core: int) -> _Core:
    c = _CORES.get(core)
    if c is None:
        with _LOCK:
            c = _CORES.setdefault(core, _Core(core))
    return c


def current_core() -> int:
    """The core this thread's programs run on (default 0)."""
    return _TLS.core


def set_current_core(core: int) -> int:
    """Make ``core`` this thread's current core (the caller validated it); returns the previous one."""
    prev = _TLS.core
    _TLS.core = core
    return prev


def default_queue(core: Optional[int] = None) -> Queue:
    """Queue 0 (the default stream) of ``core`` (default: the current core)."""
    return _core(current_core() if core is None else core).queues[0]


def current_queue(core: Optional[int] = None) -> Queue:
    """This thread's current queue on ``core`` (default: the current core); the default queue unless set."""
    tls = _TLS
    if core is None:
        core = tls.core
    cur = tls.queues
    q = cur.get(core) if cur else None
    return q if q is not None else default_queue(core)


def set_current_queue(queue: Queue) -> Queue:
    """Make ``queue`` this thread's current queue on its core; returns the previous current queue there."""
    cur = _TLS.queues
    if cur is None:
        cur = _TLS.queues = {}
    prev = cur.get(queue.core) or default_queue(queue.core)
    cur[queue.core] = queue
    return prev


def new_queue(core: int, priority: int = 0) -> Queue:
    """A new queue on ``core`` (ids are unique in the process)."""
    q = Queue(core, next(_IDS), priority)
    c = _core(core)
    with _LOCK:
        c.queues[q.id] = q
    return q


def queue(core: int, qid: int) -> Optional[Queue]:
    """The queue ``qid`` of ``core`` (None if there is none)."""
    return _core(core).queues.get(qid)


def advance(ns: float, core: Optional[int] = None, queue: Optional[Queue] = None,
            resource: str = "compute") -> Tuple[float, float]:
    """Place ``ns`` of work on ``queue`` (default: the current queue of ``core``, default the current core) using
    ``resource``; returns its modelled ``(start_ns, end_ns)``."""
    if queue is None:
        queue = current_queue(core)
    c = _core(queue.core)
    free = c.free
    start = max(queue.ready_ns, free[resource], c.host_ns)
    end = start + ns
    queue.ready_ns = end
    free[resource] = end
    return start, end


def wait_until(queue: Queue, t_ns: float) -> None:
    """Work put on ``queue`` from now on starts at ``t_ns`` or later (an event or a stream it waits for)."""
    if t_ns > queue.ready_ns:
        queue.ready_ns = t_ns


def host_sync(core: int, t_ns: float) -> None:
    """The host waited for ``core`` until ``t_ns``: later work on that core starts at ``t_ns`` or later."""
    c = _core(core)
    if t_ns > c.host_ns:
        c.host_ns = t_ns


def core_time_ns(core: int) -> float:
    """When every queue of ``core`` is done (the latest ``ready_ns``; 0 before any work)."""
    c = _core(core)
    return max((q.ready_ns for q in list(c.queues.values())), default=0.0)


def reset() -> None:
    """Set every clock back to 0 (queues keep existing; tests and benches start from a clean machine)."""
    with _LOCK:
        for c in _CORES.values():
            c.free = {r: 0.0 for r in RESOURCES}
            c.host_ns = 0.0
            for q in c.queues.values():
                q.ready_ns = 0.0
