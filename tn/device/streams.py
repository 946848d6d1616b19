# Streams and events of the neuron devices (torch.neuron.Stream/Event): ordered queues on each core's modelled timeline.
"""``torch.neuron.Stream``, ``Event`` and the stream functions, as PyTorch's device-generic code expects.

The model (stable; the device's lazy windows will use the same streams):

* Ops run **synchronously on the host**, in program order: a result is
  always ready when the op returns, whatever stream is current. Streams only
  decide *when the modelled machine* runs each program
  (:mod:`tn.neuron.timeline`).
* A stream is a queue on one core. A program put on stream ``s`` of core
  ``c`` starts when the work before it on ``s`` has ended, when ``c``'s
  engines are free (one program at a time per core, whatever its stream), and
  after the host's last wait on ``c``; it then takes the program's modelled
  time. Collectives use the chip's collective cores instead of the engines,
  so a collective on one stream overlaps compute on another.
* ``event.record(s)`` notes the time ``s`` is done with the work queued so
  far; ``s2.wait_event(e)`` / ``e.wait(s2)`` makes later work on ``s2``
  start no earlier than that; ``s2.wait_stream(s)`` is record + wait;
  ``e.elapsed_time(e2)`` is the modelled time between two records, in ms.
* ``query()`` is always True (the host already did the work);
  ``synchronize()`` (device, stream or event) moves the core's host point to
  the awaited time: work queued after it starts no earlier (the host waited).
* The current stream is thread-local and per device, as on CUDA;
  ``torch.neuron.stream(s)`` also makes ``s``'s device current inside the block.

Device-to-device copies (``t.to("neuron:1")``) are counted and timed here
(:func:`device_to_device`): the machine's link between the two cores
(latency + bytes over bandwidth, :meth:`tn.neuron.machine.Machine.link`), on
the source's current stream, with the destination's current stream waiting
for the transfer.
"""
from __future__ import annotations

import threading
from typing import Dict, Optional, Tuple

import torch

from ..errors import ArgumentValueError, DeviceError
from ..neuron import timeline as _tl
from ..neuron.machine import machine
from ..profile import add_record
from . import allocator, windows
from .registry import install_kernels

__all__ = ["Stream", "Event", "StreamContext", "stream", "current_stream", "default_stream", "set_stream",
           "synchronize", "device_to_device", "transfer_stats", "reset_transfer_stats", "stream_of"]

_DEVICE_TYPE = int(torch._C._autograd.DeviceType.PrivateUse1)
_LOCK = threading.Lock()
#: (core, queue id) -> the Stream object standing for that queue (one object per queue: equality and dict keys)
_BY_QUEUE: Dict[Tuple[int, int], "Stream"] = {}


def _wrap(q: _tl.Queue) -> "Stream":
    s = _BY_QUEUE.get((q.core, q.id))
    if s is None:
        with _LOCK:
            s = _BY_QUEUE.get((q.core, q.id))
            if s is None:
                s = Stream._of_queue(q)
    return s


def stream_of(s) -> "Stream":
    """The :class:`Stream` for a ``torch.Stream`` of the neuron device (e.g. one torch hands to a kernel)."""
    if isinstance(s, Stream):
        return s
    if s is None:
        return current_stream()
    if s.device_type != _DEVICE_TYPE:
        raise ArgumentValueError(f"{s} is not a neuron stream")
    q = _tl.queue(s.device_index, s.stream_id)
    if q is None:
        raise ArgumentValueError(f"{s}: no such neuron stream (streams are made with torch.neuron.Stream())")
    return _wrap(q)


class Stream(torch.Stream):
    """A stream of a neuron device: an ordered queue on that core's modelled timeline (see the module docstring).

    ``torch.neuron.Stream(device=None, priority=0)``: a new stream on ``device`` (default: the current one).
    """

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        index = allocator.device_index(device)
        return cls._of_queue(_tl.new_queue(index, priority))

    def __init__(self, device=None, priority: int = 0, **kwargs):
        pass

    @classmethod
    def _of_queue(cls, q: _tl.Queue) -> "Stream":
        self = torch.Stream.__new__(cls, stream_id=q.id, device_index=q.core, device_type=_DEVICE_TYPE)
        self._queue = q
        _BY_QUEUE[(q.core, q.id)] = self
        return self

    @property
    def priority(self) -> int:
        """The priority given at creation (kept; the model does not reorder by priority)."""
        return self._queue.priority

    @property
    def ready_ns(self) -> float:
        """Modelled time (ns) at which the work queued on this stream so far ends."""
        windows.flush("stream sync")
        return self._queue.ready_ns

    def wait_event(self, event: "Event") -> None:
        """Later work on this stream starts after ``event``'s recorded time."""
        event.wait(self)

    def wait_stream(self, stream: "Stream") -> None:
        """Later work on this stream starts after the work queued so far on ``stream``."""
        windows.flush("stream sync")
        _tl.wait_until(self._queue, stream_of(stream)._queue.ready_ns)

    def record_event(self, event: Optional["Event"] = None) -> "Event":
        """Record ``event`` (a new one if None) on this stream; returns it."""
        event = Event() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        """True: the host ran every op queued on the stream (adaptive eager: the queued ops run now)."""
        windows.flush("stream sync")
        return True

    def synchronize(self) -> None:
        """The host waits for the stream: work queued later on this core starts after it."""
        windows.flush("stream sync")
        _tl.host_sync(self._queue.core, self._queue.ready_ns)

    def __enter__(self):
        self._ctx = StreamContext(self)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        return False

    def __eq__(self, other):
        return isinstance(other, torch.Stream) and other.device_type == _DEVICE_TYPE and \
            (other.stream_id, other.device_index) == (self.stream_id, self.device_index)

    def __hash__(self):
        return hash((self.device_index, self.stream_id))

    def __repr__(self):
        return f"torch.neuron.Stream(device=neuron:{self.device_index}, stream_id={self.stream_id})"


class Event(torch.Event):
    """An event of the neuron devices: a point on a stream's modelled timeline (see the module docstring).

    ``torch.neuron.Event(enable_timing=False, blocking=False, interprocess=False)``; ``elapsed_time`` needs
    ``enable_timing=True`` on both events, as on CUDA.
    """

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **kwargs):
        self = torch.Event.__new__(cls, device="neuron", enable_timing=enable_timing)
        return self

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **kwargs):
        self._timing = bool(enable_timing)
        self._time_ns: Optional[float] = None
        self._core: Optional[int] = None

    @property
    def time_ns(self) -> Optional[float]:
        """The modelled time of the last record (None before the first)."""
        return self._time_ns

    def record(self, stream=None) -> None:
        """Note the time ``stream`` (default: the current stream) is done with the work queued on it so far."""
        s = stream_of(stream)
        windows.flush("stream sync")    # ops queued in an adaptive eager window are part of "so far"
        self._time_ns = s._queue.ready_ns
        self._core = s._queue.core

    def wait(self, stream=None) -> None:
        """Later work on ``stream`` (default: the current stream) starts after this event (nothing if unrecorded)."""
        if self._time_ns is not None:
            _tl.wait_until(stream_of(stream)._queue, self._time_ns)

    def query(self) -> bool:
        """True: the recorded work already ran on the host (it was flushed when the event was recorded)."""
        return True

    def synchronize(self) -> None:
        """The host waits for the event: work queued later on its core starts after it."""
        if self._time_ns is not None:
            _tl.host_sync(self._core, self._time_ns)

    def elapsed_time(self, end_event: "Event") -> float:
        """Modelled milliseconds from this event's record to ``end_event``'s."""
        if not (self._timing and getattr(end_event, "_timing", False)):
            raise DeviceError("Both events must be created with argument 'enable_timing=True'.")
        if self._time_ns is None or end_event._time_ns is None:
            raise DeviceError("Both events must be recorded before calculating elapsed time.")
        return (end_event._time_ns - self._time_ns) / 1e6

    def __repr__(self):
        t = "unrecorded" if self._time_ns is None else f"neuron:{self._core} at {self._time_ns:.1f} ns"
        return f"torch.neuron.Event({t})"


def current_stream(device=None) -> Stream:
    """This thread's current stream on ``device`` (default: the current device)."""
    return _wrap(_tl.current_queue(allocator.device_index(device)))


def default_stream(device=None) -> Stream:
    """The default stream (id 0) of ``device`` (default: the current device)."""
    return _wrap(_tl.default_queue(allocator.device_index(device)))


def set_stream(stream) -> None:
    """Make ``stream`` the current stream of its device for this thread."""
    if stream is None:
        return
    _tl.set_current_queue(stream_of(stream)._queue)


class StreamContext:
    """``with torch.neuron.stream(s):`` ``s`` is the current stream of its device, and its device the current
    device, inside the block (None: no change)."""

    def __init__(self, stream):
        self.stream = None if stream is None else stream_of(stream)

    def __enter__(self):
        s = self.stream
        if s is None:
            return None
        self._prev_index = allocator.set_current_index(s.device_index)
        self._prev_queue = _tl.set_current_queue(s._queue)
        return s

    def __exit__(self, *exc):
        if self.stream is None:
            return False
        _tl.set_current_queue(self._prev_queue)
        allocator.set_current_index(self._prev_index)
        return False


def stream(stream) -> StreamContext:
    """Context manager selecting ``stream`` (see :class:`StreamContext`)."""
    return StreamContext(stream)


def synchronize(device=None) -> None:
    """The host waits for every stream of ``device`` (default: the current one): later work starts after it."""
    core = allocator.device_index(device)
    windows.flush("synchronize")
    _tl.host_sync(core, _tl.core_time_ns(core))


_TRANSFERS = {"count": 0, "bytes": 0, "time_ns": 0.0}


def device_to_device(src: int, dst: int, nbytes: int) -> Tuple[float, float]:
    """Count and time a copy of ``nbytes`` from device ``src`` to device ``dst``: on ``src``'s current stream,
    over the machine's link between the two cores (latency + bytes / bandwidth), with ``dst``'s current stream
    waiting for it. Returns the modelled ``(start_ns, end_ns)``; active profiles get a ``transfers`` record."""
    link = machine().link(src, dst)
    ns = link.latency_ns + (nbytes / link.bytes_per_s * 1e9 if link.bytes_per_s else 0.0)
    start, end = _tl.advance(ns, queue=_tl.current_queue(src), resource="transfers")
    _tl.wait_until(_tl.current_queue(dst), end)
    with _LOCK:
        _TRANSFERS["count"] += 1
        _TRANSFERS["bytes"] += int(nbytes)
        _TRANSFERS["time_ns"] += ns
    add_record(src, f"neuron:{src} -> neuron:{dst}", start, end, nbytes=nbytes, track="transfers",
               args={"link": link.kind, "hops": link.hops})
    return start, end


def transfer_stats() -> dict:
    """Device-to-device copies since start or the last reset: ``count``, ``bytes``, modelled ``time_ns``."""
    return dict(_TRANSFERS)


def reset_transfer_stats() -> None:
    """Zero :func:`transfer_stats`."""
    with _LOCK:
        _TRANSFERS.update(count=0, bytes=0, time_ns=0.0)


def _record_stream(self, s) -> None:
    # memory is freed when its storage dies and every op already ran: nothing to defer
    return None


_LIBS: list = []


def register() -> None:
    """Install the neuron kernel of ``aten::record_stream`` (a no-op: see :func:`_record_stream`)."""
    if _LIBS:
        return
    install_kernels(_LIBS, {"record_stream": _record_stream})
