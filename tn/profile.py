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
"""
from __future__ import annotations

import json

from .neuron.arch import NUM_ENGINES
from .neuron.runtime import HOST_TIMES, RunResult, add_listener, remove_listener

__all__ = ["profile", "Profile", "note_host_op"]

_ACTIVE: list = []  # Profile objects inside their `with` block, any thread


def note_host_op(name: str, n: int = 1) -> None:
    """Count ``n`` runs of op ``name`` on the host (a fallback) in every active profile."""
    for prof in tuple(_ACTIVE):
        prof.host_ops[name] = prof.host_ops.get(name, 0) + n


class Profile:
    """The runs collected by one ``tn.profile()`` block (``.runs`` is a list of :class:`RunResult`)."""

    def __init__(self, host_times: bool = False):
        self.runs: list[RunResult] = []
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

    def rows(self) -> list[dict]:
        """One dict per program name (runs of the same program aggregated)."""
        agg = {}
        for r in self.runs:
            a = agg.setdefault(r.name, {"program": r.name, "runs": 0, "time_us": 0.0, "instructions": 0,
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
        import numpy as np

        from .neuron.isa import OPCODE_NAMES

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

        ``by="program"`` (default): one row per program; ``by="opcode"``: busy
        time per engine and opcode over all runs; ``by="host"``: the simulator's
        own host time per opcode (runs recorded with ``host_times=True``).
        """
        from tabulate import tabulate

        if by in ("opcode", "host"):
            rows = self.opcode_rows() if by == "opcode" else self.host_rows()
            text = tabulate(rows, headers="keys", tablefmt=tablefmt, floatfmt=".3g") if rows else \
                ("tn.profile: no NeuronCore programs ran inside the block" if by == "opcode" or not self.runs else
                 "tn.profile: no host times recorded (use tn.profile(host_times=True))")
            if print_it:
                print(text)
            return text
        if by != "program":
            from .errors import TnError

            raise TnError(f"profile.table(by={by!r}): use 'program', 'opcode' or 'host'")
        rows = self.rows()
        if not rows:
            text = "tn.profile: no NeuronCore programs ran inside the block"
        else:
            text = tabulate(rows, headers="keys", tablefmt=tablefmt, floatfmt=".3g")
            text += f"\ntotal modelled time: {self.total_us:.3f} us over {len(self.runs)} run(s)"
        if self.host_ops:
            text += "\nran on the host (no NeuronCore lowering): " + ", ".join(
                f"{name} x{n}" for name, n in sorted(self.host_ops.items()))
        if print_it:
            print(text)
        return text

    def __str__(self):
        return self.table(print_it=False)

    # ------------------------------------------------------------------ traces
    def trace_events(self) -> list[dict]:
        """Chrome trace events: one process per run (laid out back to back), one thread per engine/DMA queue."""
        events = []
        offset_us = 0.0
        for pid, r in enumerate(self.runs, start=1):
            events.append({"ph": "M", "name": "process_name", "pid": pid,
                           "args": {"name": f"{r.name} ({r.arch.name})"}})
            used = sorted(set(int(q) for q in r.queues))
            for q in used:
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": q,
                               "args": {"name": r.arch.queue_name(q)}})
                events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": q, "args": {"sort_index": q}})
            for i, (q, (s, e), o) in enumerate(zip(r.queues, r.times, r.opcodes)):
                from .neuron.isa import OPCODE_NAMES

                events.append({"ph": "X", "name": OPCODE_NAMES.get(int(o), str(o)), "pid": pid, "tid": int(q),
                               "ts": offset_us + float(s) / 1e3, "dur": max(float(e - s) / 1e3, 1e-3),
                               "args": {"instruction": i}})
            offset_us += r.total_us
        return events

    def save_html(self, path, title: str = "tn.profile") -> str:
        """Write a self-contained HTML page of the runs: a zoomable timeline per engine/DMA queue, programs,
        opcodes, host ops (rendered by :mod:`tn.assess.html`; needs ``pip install 'tn[report]'``)."""
        from .assess.html import profile_page

        return profile_page(self, str(path), title)

    def save_trace(self, path) -> str:
        """Write the Chrome/Perfetto trace JSON to ``path`` (returns the path)."""
        with open(path, "w") as f:
            json.dump({"traceEvents": self.trace_events(), "displayTimeUnit": "ns"}, f)
        return str(path)


def profile(host_times: bool = False) -> Profile:
    """Context manager collecting every NeuronCore program run inside it: ``with tn.profile() as prof: ...``.

    ``host_times=True`` also records the engine's host time per instruction
    inside the block (``prof.table(by="host")``)."""
    return Profile(host_times)
