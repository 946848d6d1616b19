# tn.profile(): collects every NeuronCore program run inside a `with` block; prints tables and writes Perfetto traces.
"""Profiling of NeuronCore runs.

::

    with tn.profile() as prof:
        y = f(x)                 # any door: tn.jit, the device, tn.adaptive, Program.run
    print(prof.table())          # per program: time, engine utilisation, HBM traffic
    prof.save_trace("trace.json")  # open in ui.perfetto.dev or chrome://tracing

    with tn.profile(host_times=True) as prof:   # also time the simulator itself
        y = f(x)
    prof.table(by="host")        # host us per opcode: validation + timing model, C kernel

Profilers nest (each active one sees every run). They see runs from every
thread, like ``torch.profiler``: autograd runs a device's backward pass in a
worker thread, and ``loss.backward()`` inside the block must show up. Ops that
ran on the host instead of the NeuronCore (no lowering) are counted in
``prof.host_ops`` (see :func:`note_host_op`).

Many cores: every run carries the core (torch device index) it ran on and its
start on that core's modelled timeline (:mod:`tn.neuron.timeline`: streams,
one program at a time per core). The trace has one track group (process) per
core, ``neuron:N``, with a track per stream (one slice per program), one per
engine/DMA queue (the instructions) and tracks for timed records other parts
add with :func:`add_record` (``collectives``: the distributed backend's
collectives; ``transfers``: device-to-device copies). ``prof.table(by="core")``
sums per core. Traces of several processes (the ranks of a job, each saving
its own) merge into one Perfetto file with :func:`merge_traces`::

    prof.save_trace(f"rank{rank}.json")                 # in every rank
    tn.profile.merge_traces(["rank0.json", "rank1.json"], "job.json")
"""
from __future__ import annotations

import json

import numpy as np

from .errors import ArgumentValueError, MissingDependencyError
from .neuron.arch import NUM_ENGINES
from .neuron.isa import OPCODE_NAMES
from .neuron.machine import machine
from .neuron.runtime import HOST_TIMES, RunResult, add_listener, remove_listener

__all__ = ["profile", "Profile", "note_host_op", "add_record", "Record", "merge_traces", "set_html_renderer"]

_ACTIVE: list = []  # Profile objects inside their `with` block, any thread
#: ``[fn(profile, path, title) -> path]``: the HTML page renderer, registered from above by tn.assess (the chip
#: layer's profile imports no door)
_HTML_PAGE: list = [None]
#: Chrome-trace thread ids of the record tracks of a core (instruction queues use 0..19, streams 1000+)
_RECORD_TIDS = {"collectives": 900, "transfers": 901}
_STREAM_TID = 1000


class Record:
    """A timed span on a core's modelled timeline that is not a program run: ``core``, ``name``, ``start_ns``,
    ``end_ns``, ``nbytes``, ``track`` (``"collectives"``, ``"transfers"``, or another name), ``args`` (dict)."""

    __slots__ = ("core", "name", "start_ns", "end_ns", "nbytes", "track", "args")

    def __init__(self, core, name, start_ns, end_ns, nbytes=0, track="collectives", args=None):
        self.core = int(core)
        self.name = str(name)
        self.start_ns = float(start_ns)
        self.end_ns = float(end_ns)
        self.nbytes = int(nbytes)
        self.track = str(track)
        self.args = dict(args or {})

    @property
    def dur_ns(self) -> float:
        """``end_ns - start_ns``."""
        return self.end_ns - self.start_ns

    def __repr__(self):
        return (f"Record(core={self.core}, {self.track}: {self.name!r}, {self.start_ns:.0f}-{self.end_ns:.0f} ns, "
                f"{self.nbytes} B)")


def add_record(core: int, name: str, start_ns: float, end_ns: float, nbytes: int = 0, track: str = "collectives",
               args: dict = None) -> None:
    """Add a timed span to every active profile: ``name`` on ``core``'s ``track`` from ``start_ns`` to ``end_ns``
    (modelled ns on that core's timeline, e.g. from :func:`tn.neuron.timeline.advance` with
    ``resource="collectives"``), moving ``nbytes``; ``args`` shows in the trace. Does nothing when no profile is
    active. The distributed backend records each collective with it."""
    if not _ACTIVE:
        return
    rec = Record(core, name, start_ns, end_ns, nbytes, track, args)
    for prof in tuple(_ACTIVE):
        prof.records.append(rec)


def note_host_op(name: str, n: int = 1) -> None:
    """Count ``n`` runs of op ``name`` on the host (a fallback) in every active profile."""
    for prof in tuple(_ACTIVE):
        prof.host_ops[name] = prof.host_ops.get(name, 0) + n


class Profile:
    """The runs collected by one ``tn.profile()`` block (``.runs`` is a list of :class:`RunResult`)."""

    def __init__(self, host_times: bool = False):
        self.runs: list[RunResult] = []
        self.records: list[Record] = []     # timed spans added with add_record (collectives, transfers)
        self.host_ops: dict[str, int] = {}  # op name -> calls that ran on the host instead of the chip
        self._token = None
        self._host_times = host_times
        self._host_prev = None

    def __enter__(self):
        if self._host_times:
            self._host_prev = HOST_TIMES[0]
            HOST_TIMES[0] = True
        self._token = add_listener(self.runs.append)
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc):
        remove_listener(self._token)
        self._token = None
        if self._host_times:
            HOST_TIMES[0] = self._host_prev
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        return False

    # ------------------------------------------------------------------ summaries
    @property
    def total_us(self) -> float:
        """Modelled time of all runs, back to back, in µs."""
        return sum(r.total_us for r in self.runs)

    def cores(self) -> list[int]:
        """The cores (device indices) that ran programs or have records in this profile, sorted."""
        return sorted({r.core for r in self.runs} | {rec.core for rec in self.records})

    def core_rows(self) -> list[dict]:
        """One dict per core: programs run, their modelled time, the span from the first start to the last end
        on the core's timeline, compute utilisation over that span, and the time of each record track."""
        out = []
        for core in self.cores():
            runs = [r for r in self.runs if r.core == core]
            recs = [x for x in self.records if x.core == core]
            spans = [(r.start_ns, r.start_ns + r.total_ns) for r in runs if r.start_ns is not None]
            spans += [(x.start_ns, x.end_ns) for x in recs]
            busy = sum(r.total_ns for r in runs)
            span = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0
            row = {"core": f"neuron:{core}", "runs": len(runs), "compute_us": busy / 1e3, "span_us": span / 1e3,
                   "compute %": 100.0 * busy / span if span else 0.0}
            for track in sorted({x.track for x in self.records}):
                row[f"{track}_us"] = sum(x.dur_ns for x in recs if x.track == track) / 1e3
            out.append(row)
        return out

    def rows(self) -> list[dict]:
        """One dict per (core, program name) (runs of the same program on the same core aggregated)."""
        agg = {}
        for r in self.runs:
            a = agg.setdefault((r.core, r.name), {"core": r.core, "program": r.name, "runs": 0, "time_us": 0.0, "instructions": 0,
                                        "hbm_read_MB": 0.0, "hbm_write_MB": 0.0, "_busy": {}, "_total": 0.0,
                                        "_flops": 0, "_arch": r.arch, "sbuf_peak_KiB": 0.0, "psum_peak_KiB": 0.0,
                                        "host_ms": 0.0})
            a["runs"] += 1
            a["time_us"] += r.total_us
            a["_total"] += r.total_ns
            a["instructions"] += int(len(r.opcodes))
            a["hbm_read_MB"] += r.hbm_read_bytes / 1e6
            a["hbm_write_MB"] += r.hbm_write_bytes / 1e6
            a["_flops"] += r.matmul_flops
            a["host_ms"] += r.wall_s * 1e3
            a["sbuf_peak_KiB"] = max(a["sbuf_peak_KiB"], r.sbuf_peak_bytes / 1024)
            a["psum_peak_KiB"] = max(a["psum_peak_KiB"], r.psum_peak_bytes / 1024)
            for k, v in r.busy_ns.items():
                a["_busy"][k] = a["_busy"].get(k, 0.0) + v
        out = []
        for a in agg.values():
            t = a.pop("_total") or 1.0
            busy = a.pop("_busy")
            arch = a.pop("_arch")
            flops = a.pop("_flops")
            row = dict(a)
            for q in range(NUM_ENGINES):
                nm = arch.queue_name(q)
                row[f"{nm} %"] = 100.0 * busy.get(nm, 0.0) / t
            dma = [v for k, v in busy.items() if k.startswith("DMA")]
            row["DMA busiest %"] = 100.0 * max(dma, default=0.0) / t
            row["TFLOPS"] = flops / (t * 1e-9) / 1e12
            row["HBM %"] = 100.0 * (row["hbm_read_MB"] + row["hbm_write_MB"]) * 1e6 / (arch.hbm_bytes_per_s * t * 1e-9)
            out.append(row)
        return out

    def opcode_rows(self) -> list[dict]:
        """One dict per (engine/queue kind, opcode): instruction count and busy time over all runs."""
        agg = {}
        for r in self.runs:
            dur = (r.times[:, 1] - r.times[:, 0]) if len(r.times) else np.zeros(0)
            for q, o, d in zip(r.queues.tolist(), r.opcodes.tolist(), dur.tolist()):
                eng = r.arch.queue_name(q) if q < NUM_ENGINES else "DMA"
                key = (eng, OPCODE_NAMES.get(o, str(o)))
                a = agg.setdefault(key, [0, 0.0])
                a[0] += 1
                a[1] += d
        total = sum(v[1] for v in agg.values()) or 1.0
        rows = [{"engine": e, "opcode": o, "count": c, "busy_us": b / 1e3, "avg_ns": b / c, "share %": 100 * b / total}
                for (e, o), (c, b) in agg.items()]
        return sorted(rows, key=lambda row: -row["busy_us"])

    def host_rows(self) -> list[dict]:
        """Host time the engine spent per opcode over the runs that recorded it (``tn.profile(host_times=True)``
        or ``TN_ENGINE_HOST_TIMES=1``): validation + timing model and C kernel, in us."""
        agg = {}
        for r in self.runs:
            for name, (c, v, k) in r.host_ns_by_opcode().items():
                a = agg.setdefault(name, [0, 0.0, 0.0])
                a[0] += c
                a[1] += v
                a[2] += k
        total = sum(v + k for _, v, k in agg.values()) or 1.0
        rows = [{"opcode": o, "count": c, "validate_us": v / 1e3, "kernel_us": k / 1e3, "kernel_ns/instr": k / c,
                 "share %": 100 * (v + k) / total} for o, (c, v, k) in agg.items()]
        return sorted(rows, key=lambda row: -(row["validate_us"] + row["kernel_us"]))

    def table(self, tablefmt: str = "simple", print_it: bool = True, by: str = "program") -> str:
        """A tabulate summary of the collected runs (printed unless ``print_it=False``); returns the text.

        ``by="program"`` (default): one row per program and core; ``by="core"``:
        one row per core (time, span, utilisation, collectives); ``by="opcode"``: busy
        time per engine and opcode over all runs; ``by="host"``: the simulator's
        own host time per opcode (runs recorded with ``host_times=True``).
        """
        from tabulate import tabulate  # lazy: tabulate loads only when a table is printed (keeps import tn fast)

        if by == "core":
            rows = self.core_rows()
            text = tabulate(rows, headers="keys", tablefmt=tablefmt, floatfmt=".3g") + \
                "\nmodelled on " + self.arch_line() if rows else \
                "tn.profile: no NeuronCore programs ran inside the block"
            if print_it:
                print(text)
            return text
        if by in ("opcode", "host"):
            rows = self.opcode_rows() if by == "opcode" else self.host_rows()
            text = tabulate(rows, headers="keys", tablefmt=tablefmt, floatfmt=".3g") + \
                "\nmodelled on " + self.arch_line() if rows else \
                ("tn.profile: no NeuronCore programs ran inside the block" if by == "opcode" or not self.runs else
                 "tn.profile: no host times recorded (use tn.profile(host_times=True))")
            if print_it:
                print(text)
            return text
        if by != "program":
            raise ArgumentValueError(f"profile.table(by={by!r}): use 'program', 'core', 'opcode' or 'host'")
        rows = self.rows()
        if not rows:
            text = "tn.profile: no NeuronCore programs ran inside the block"
        else:
            text = tabulate(rows, headers="keys", tablefmt=tablefmt, floatfmt=".3g")
            text += f"\ntotal modelled time: {self.total_us:.3f} us over {len(self.runs)} run(s)"
            text += "\nmodelled on " + self.arch_line()
        if self.host_ops:
            text += "\nran on the host (no NeuronCore lowering): " + ", ".join(
                f"{name} x{n}" for name, n in sorted(self.host_ops.items()))
        if print_it:
            print(text)
        return text

    def arch_line(self) -> str:
        """The architecture(s) the collected runs were modelled on, e.g. ``trn1 (NeuronCore-v2)``."""
        archs = sorted({(r.arch.name, r.arch.generation) for r in self.runs})
        return ", ".join(f"{name} ({gen})" for name, gen in archs) or "no NeuronCore runs"

    def __str__(self):
        return self.table(print_it=False)

    # ------------------------------------------------------------------ traces
    def trace_events(self) -> list[dict]:
        """Chrome trace events: one process (track group) per core ``neuron:N``; in it a track per stream with one
        slice per program, a track per engine/DMA queue with the instructions, and a track per record kind
        (collectives, transfers). Runs are placed at their modelled start on their core's timeline (runs without
        one, e.g. :func:`tn.neuron.runtime.simulate_timing` results, follow the core's previous run)."""
        events = []
        seen_threads = set()

        def thread(pid, tid, name, sort):
            if (pid, tid) not in seen_threads:
                seen_threads.add((pid, tid))
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
                events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                               "args": {"sort_index": sort}})

        devices = machine().devices
        for core in self.cores():
            pid = core + 1
            label = f"neuron:{core}"
            if core < len(devices) and devices[core] != core:   # TN_VISIBLE_CORES: name the instance's core
                label += f" (core {devices[core]})"
            events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": core}})
        cursor: dict = {}
        for r in self.runs:
            pid = r.core + 1
            start = r.start_ns if r.start_ns is not None else cursor.get(r.core, 0.0)
            cursor[r.core] = start + r.total_ns
            base_us = start / 1e3
            stid = _STREAM_TID + int(r.queue)
            thread(pid, stid, f"stream {r.queue}", -1000 + int(r.queue))
            events.append({"ph": "X", "cat": "program", "name": r.name, "pid": pid, "tid": stid, "ts": base_us,
                           "dur": max(r.total_ns / 1e3, 1e-3), "args": {"arch": r.arch.name}})
            for q in sorted(set(int(q) for q in r.queues)):
                thread(pid, q, r.arch.queue_name(q), q)
            for i, (q, (s0, e0), o) in enumerate(zip(r.queues, r.times, r.opcodes)):
                events.append({"ph": "X", "cat": "instruction", "name": OPCODE_NAMES.get(int(o), str(o)), "pid": pid,
                               "tid": int(q), "ts": base_us + float(s0) / 1e3,
                               "dur": max(float(e0 - s0) / 1e3, 1e-3), "args": {"instruction": i, "program": r.name}})
        for rec in self.records:
            pid = rec.core + 1
            tid = _RECORD_TIDS.get(rec.track)
            if tid is None:
                tid = _RECORD_TIDS.setdefault(rec.track, 902 + len(_RECORD_TIDS))
            thread(pid, tid, rec.track, 500 + tid)
            events.append({"ph": "X", "cat": rec.track, "name": rec.name, "pid": pid, "tid": tid,
                           "ts": rec.start_ns / 1e3, "dur": max(rec.dur_ns / 1e3, 1e-3),
                           "args": {"bytes": rec.nbytes, **rec.args}})
        return events

    def save_html(self, path, title: str = "tn.profile") -> str:
        """Write a self-contained HTML page of the runs: a zoomable timeline per engine/DMA queue, programs,
        opcodes, host ops (rendered by :mod:`tn.assess.html`; needs ``pip install 'tn[report]'``)."""
        if _HTML_PAGE[0] is None:
            raise MissingDependencyError("Profile.save_html: no HTML renderer is registered (tn.assess registers one "
                                         "when imported; import tn.assess)")
        return _HTML_PAGE[0](self, str(path), title)

    def save_trace(self, path) -> str:
        """Write the Chrome/Perfetto trace JSON to ``path`` (returns the path)."""
        with open(path, "w") as f:
            json.dump({"traceEvents": self.trace_events(), "displayTimeUnit": "ns"}, f)
        return str(path)


def merge_traces(paths, out_path, labels=None) -> str:
    """Merge Chrome/Perfetto trace files (e.g. one :meth:`Profile.save_trace` per rank) into one at ``out_path``.

    Each input's track groups keep their tracks and times and are renamed ``"<label> neuron:N"`` (``labels``
    default: ``rank0``, ``rank1``, ... in the order of ``paths``); process ids are renumbered so that inputs never
    collide (input ``k``'s pid ``p`` becomes ``k * 10000 + p``). Returns ``out_path``."""
    paths = list(paths)
    labels = [f"rank{k}" for k in range(len(paths))] if labels is None else list(labels)
    if len(labels) != len(paths):
        raise ArgumentValueError(f"merge_traces: {len(paths)} traces but {len(labels)} labels")
    merged = []
    for k, (path, label) in enumerate(zip(paths, labels)):
        with open(path) as f:
            data = json.load(f)
        events = data["traceEvents"] if isinstance(data, dict) else data
        for e in events:
            e = dict(e)
            if "pid" in e:
                e["pid"] = k * 10000 + int(e["pid"])
            if e.get("ph") == "M" and e.get("name") == "process_name":
                e["args"] = {"name": f"{label} {e.get('args', {}).get('name', '')}".strip()}
            if e.get("ph") == "M" and e.get("name") == "process_sort_index":
                e["args"] = {"sort_index": k * 10000 + int(e.get("args", {}).get("sort_index", 0))}
            merged.append(e)
    with open(out_path, "w") as f:
        json.dump({"traceEvents": merged, "displayTimeUnit": "ns"}, f)
    return str(out_path)


def set_html_renderer(render) -> None:
    """Install ``render(profile, path, title) -> path`` as the renderer of :meth:`Profile.save_html`
    (tn.assess.html does when imported)."""
    _HTML_PAGE[0] = render


def profile(host_times: bool = False) -> Profile:
    """Context manager collecting every NeuronCore program run inside it: ``with tn.profile() as prof: ...``.

    ``host_times=True`` also records the engine's host time per instruction
    inside the block (``prof.table(by="host")``)."""
    return Profile(host_times)


# ``tn.profile`` is this function (the package exports it): the helpers ride on it, so
# ``tn.profile.merge_traces(...)`` and ``tn.profile.add_record(...)`` work as written in the docstring.
profile.merge_traces = merge_traces
profile.add_record = add_record
profile.Record = Record
profile.Profile = Profile
