# The result of `tn assess`: per-door data, the four verdicts, the terminal summary (tabulate) and the JSON.
"""What an assessment found, and how it is told.

:class:`AssessResult` holds the CPU reference timing and one dict per door
(see :func:`tn.assess.doors.run_door` for the keys). It answers four
questions, one verdict line each (:meth:`AssessResult.verdicts`):

* runs natively? (every requested door ran; which ops fell back to the host)
* numerically right? (every output within its tolerance against the CPU)
* how fast? (modelled NeuronCore time of one step per door, this CPU's time)
* what needs changing? (host ops with the user's source line, failing doors,
  sharding when the footprint exceeds one core's HBM)

``ok`` is True when every requested door ran and matched (the CLI's exit code).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .html import assessment_page

__all__ = ["AssessResult", "fmt_bytes"]

_GIB = 1 << 30


def fmt_bytes(n: Optional[float]) -> str:
    """``n`` bytes as text (``1.2 GiB``, ``340 MiB``)."""
    if n is None:
        return "-"
    for unit, size in (("GiB", _GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def _fmt(x: Optional[float], spec: str = ".3g") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


@dataclass
class AssessResult:
    """Everything one assessment measured (``doors``: door name -> result dict); see the module docstring."""

    label: str
    options: Dict[str, Any]
    cpu: Dict[str, Any]
    doors: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    elapsed_s: float = 0.0
    notes: List[str] = field(default_factory=list)
    #: ``--cores`` of a training step: DDP rows (see :mod:`tn.assess.scaling`), else None.
    scaling: Optional[Dict[str, Any]] = None

    # ------------------------------------------------------------------ questions
    @property
    def ok(self) -> bool:
        """Every requested door ran and every output matched the CPU (and the simulated DDP ranks, if any)."""
        sim = (self.scaling or {}).get("simulated")
        return (bool(self.doors) and all(d.get("status") == "ok" for d in self.doors.values())
                and (sim is None or sim.get("status") == "ok"))

    def ran(self) -> List[str]:
        """Doors that produced a result (matched or not)."""
        return [k for k, d in self.doors.items() if d.get("status") in ("ok", "mismatch")]

    def best_door(self) -> Optional[str]:
        """The working door with the least modelled device time (None when none worked)."""
        ok = [k for k, d in self.doors.items() if d.get("status") == "ok" and d.get("runs")]
        if not ok:
            ok = [k for k in self.ran() if self.doors[k].get("runs")]
        return min(ok, key=lambda k: self.doors[k]["device_us"]) if ok else None

    def hbm_capacity(self) -> int:
        """HBM bytes of one device (logical core) of the modelled instance (:func:`tn.neuron.machine.machine`)."""
        return int(self.options["hbm_per_device_bytes"])

    def footprint(self) -> Optional[int]:
        """Largest HBM footprint among the doors that ran (bytes)."""
        vals = [d.get("hbm_peak_bytes") for d in self.doors.values() if d.get("hbm_peak_bytes")]
        return max(vals) if vals else None

    def verdicts(self) -> List[str]:
        """One line per question: runs natively? numerically right? how fast? what needs changing?"""
        lines = []
        doors = self.doors
        ran = self.ran()
        failed = [k for k in doors if k not in ran]
        host = {k: sum(h["count"] for h in d.get("host_ops", [])) for k, d in doors.items() if k in ran}
        hostonly = [k for k in ran if not doors[k].get("runs")]   # no NeuronCore program ran at all
        native = [k for k in ran if host[k] == 0 and k not in hostonly]
        if not ran:
            lines.append("runs natively?       NO: no door ran (" + ", ".join(
                f"{k}: {doors[k].get('status')}" for k in failed) + ")")
        elif len(native) == len(doors):
            lines.append(f"runs natively?       YES: every op on the NeuronCore through {', '.join(native)}")
        else:
            parts = [f"{k}: {host[k]} host op call(s)" for k in ran if host[k]]
            parts += [f"{k}: ran on the host only (no NeuronCore program)" for k in hostonly]
            parts += [f"{k}: {doors[k].get('status')}" for k in failed]
            lines.append(f"runs natively?       PARTLY: natively through {', '.join(native) or 'no door'}; "
                         + "; ".join(parts))
        bad = [(k, o) for k in ran for o in doors[k].get("outputs", []) if not o["ok"]]
        if not ran:
            lines.append("numerically right?   n/a: nothing ran")
        elif not bad:
            worst = max(((k, o) for k in ran for o in doors[k].get("outputs", [])),
                        key=lambda ko: ko[1]["ratio"] or 0.0, default=None)
            w = (f" (closest to its limit: {worst[0]} '{worst[1]['output']}', max error "
                 f"{_fmt(worst[1]['max_abs_err'])} = {100 * (worst[1]['ratio'] or 0):.0f}% of tolerance)"
                 if worst else "")
            lines.append(f"numerically right?   YES: every output of {', '.join(ran)} within tolerance "
                         f"({self.options.get('dtype')}){w}")
        else:
            k, o = bad[0]
            note = f" {o['note']}" if o.get("note") else ""
            lines.append(f"numerically right?   NO: {len(bad)} output(s) out of tolerance, e.g. {k} '{o['output']}' "
                         f"max error {_fmt(o['max_abs_err'])} ({_fmt(o['ratio'])}x the tolerance){note}")
        best = self.best_door()
        cpu_ms = self.cpu.get("steady_ms_median")
        if best:
            d = doors[best]
            util = d.get("utilisation", {})
            top = max(util.items(), key=lambda kv: kv[1], default=("-", 0.0))
            others = ", ".join(f"{k} {doors[k]['device_us'] / 1e3:.3g} ms" for k in ran
                               if k != best and doors[k].get("runs"))
            lines.append(f"how fast?            {d['device_us'] / 1e3:.3g} ms modelled per step on one "
                         f"{self.options.get('arch')} NeuronCore via {best} (busiest: {top[0]} {top[1]:.0f}%)"
                         + (f"; {others}" if others else "")
                         + (f"; this CPU {cpu_ms:.4g} ms" if cpu_ms else ""))
        else:
            lines.append("how fast?            n/a: no door ran")
        change = []
        for k in ran:
            for h in doors[k].get("host_ops", []):
                site = h["where"][0][0] if h.get("where") else "?"
                change.append(f"{h['op']} runs on the host ({k}, from {site})")
        for k in failed:
            e = doors[k].get("error") or {}
            change.append(f"{k} fails: {e.get('type', '')}" + (f" at {e['where']}" if e.get("where") else ""))
        fp, cap = self.footprint(), self.hbm_capacity()
        if fp and fp > cap:
            need = math.ceil(fp / cap)
            devs = self.options.get("devices_per_instance")
            change.append(f"needs sharding: {fmt_bytes(fp)} > {fmt_bytes(cap)} HBM of one core "
                          f"(>= {need} cores: tensor/pipeline parallel or FSDP"
                          + (f"; more than one {self.options.get('instance')} ({devs} cores)" if devs and need > devs
                             else "") + ")")
        sim = (self.scaling or {}).get("simulated")
        if sim and sim.get("status") != "ok":
            e = sim.get("error") or {}
            change.append(f"DDP on {sim.get('ranks_simulated')} ranks: {sim.get('status')}"
                          + (f" ({e.get('type')} at {e.get('stage')})" if e else ""))
        uniq = list(dict.fromkeys(change))
        lines.append("what needs changing? " + ("nothing found" + (f": fits one core's HBM ({fmt_bytes(fp)} of "
                                                                   f"{fmt_bytes(cap)})" if fp else "")
                                                if not uniq else "; ".join(uniq[:6])
                                                + (f"; and {len(uniq) - 6} more" if len(uniq) > 6 else "")))
        if self.scaling is not None:
            lines.append(self.scaling_verdict())
        return lines

    def scaling_verdict(self) -> str:
        """The ``--cores`` line: DDP efficiency at the most cores modelled, and what the simulated ranks showed."""
        sc = self.scaling or {}
        rows = [r for r in sc.get("rows", []) if r["kind"] == "modelled"]
        sim = sc.get("simulated")
        parts = []
        if rows:
            top = rows[-1]
            parts.append(f"DDP at {top['cores']} cores {100 * top['efficiency']:.0f}% efficient (modelled step "
                         f"{top['step_ns'] / 1e3:.4g} us, {top['exposed_ns'] / 1e3:.3g} us of all-reduce not hidden "
                         f"by the backward)")
        if sim:
            k = sim.get("ranks_simulated")
            if sim.get("status") == "ok":
                d = sc.get("simulated_vs_modelled")
                parts.append(f"{k} simulated ranks matched the CPU"
                             + (f", step {100 * d:+.1f}% vs modelled" if d is not None else ""))
            else:
                parts.append(f"{k} simulated ranks: {sim.get('status').upper()}")
        return "scales over cores?   " + ("; ".join(parts) if parts else "n/a: " + "; ".join(sc.get("notes", [])))

    def scaling_rows(self) -> List[Dict[str, Any]]:
        """The ``--cores`` table: one row per (core count, simulated/modelled)."""
        out = []
        for r in (self.scaling or {}).get("rows", []):
            out.append({"cores": r["cores"], "kind": r["kind"], "instances": r.get("instances", 1),
                        "compute us": _fmt(r["compute_ns"] / 1e3, ".4g"),
                        "all-reduce us": _fmt(r["collective_ns"] / 1e3, ".4g"),
                        "exposed us": _fmt(r["exposed_ns"] / 1e3, ".4g"), "step us": _fmt(r["step_ns"] / 1e3, ".4g"),
                        "efficiency %": _fmt(100 * r["efficiency"], ".1f") if r.get("efficiency") else "-",
                        "buckets": r.get("buckets", "-"),
                        "bus GB/s (link)": (f"{r['busbw_GBps']:.4g} ({r['link_GBps']:.4g})"
                                            if r.get("busbw_GBps") else "-")})
        return out

    # ------------------------------------------------------------------ tables
    def door_rows(self) -> List[Dict[str, Any]]:
        """One row per door (and the CPU) for the summary table."""
        rows = [{"door": "cpu", "status": "reference", "max err / tol": "-", "host ops": "-",
                 "1st call s": "-", "steady ms": _fmt(self.cpu.get("steady_ms_median"), ".4g"),
                 "device ms": "-", "HBM": "-", "TensorE %": "-", "VectorE %": "-", "ScalarE %": "-",
                 "DMA %": "-"}]
        for k, d in self.doors.items():
            outs = d.get("outputs") or []
            ratio = max((o["ratio"] for o in outs if o["ratio"] is not None), default=None)
            u = d.get("utilisation") or {}
            rows.append({"door": k, "status": d.get("status"),
                         "max err / tol": _fmt(ratio, ".2g") if outs else "-",
                         "host ops": sum(h["count"] for h in d.get("host_ops", [])) if d.get("status") in
                         ("ok", "mismatch") else "-",
                         "1st call s": _fmt(d.get("first_call_s")), "steady ms": _fmt(d.get("steady_ms_median"), ".4g"),
                         "device ms": _fmt(d["device_us"] / 1e3) if d.get("device_us") is not None else "-",
                         "HBM": fmt_bytes(d.get("hbm_peak_bytes")),
                         "TensorE %": _fmt(u.get("TensorE"), ".0f"), "VectorE %": _fmt(u.get("VectorE"), ".0f"),
                         "ScalarE %": _fmt(u.get("ScalarE"), ".0f"),
                         "DMA %": _fmt(u.get("DMA (busiest queue)"), ".0f")})
        return rows

    def host_rows(self) -> List[Dict[str, Any]]:
        """One row per (door, host op): count, the user's source lines, why."""
        rows = []
        for k, d in self.doors.items():
            for h in d.get("host_ops", []):
                rows.append({"door": k, "op": h["op"], "count": h["count"],
                             "source": "; ".join(f"{s} (x{n})" for s, n in h.get("where", [])[:3]) or "?",
                             "reason": h.get("reason", "")})
        return rows

    def module_rows(self, limit: int = 25) -> List[Dict[str, Any]]:
        """Top modules by modelled time (inclusive), from the door that saw the most modules run: tn.adaptive
        (compiled per region) or device eager (op by op); tn.jit and torch.compile run one program per step."""
        best: List[tuple] = []
        door = None
        for k in ("adaptive", "eager"):
            d = self.doors.get(k)
            times = (d or {}).get("modules_us") or {}
            total = times.get("(model)") or max(times.values(), default=0.0)
            # containers holding most of the step (GPT-2's "transformer") say little: their children are shown
            items = [(m, us) for m, us in times.items() if m != "(model)" and not (
                us > 0.8 * total and any(c.startswith(m + ".") for c in times))]
            if len(items) > len(best):
                best, door = items, k
        return [{"door": door, "module": m, "device_us": us} for m, us in best[:limit]]

    def error_rows(self) -> List[Dict[str, Any]]:
        """One row per failed door: stage, error and the user's file:line."""
        rows = []
        for k, d in self.doors.items():
            e = d.get("error")
            if e:
                rows.append({"door": k, "status": d.get("status"), "stage": e.get("stage"),
                             "error": f"{e.get('type')}: {e.get('message', '')}".splitlines()[0][:160],
                             "where": e.get("where") or "-"})
        return rows

    def summary(self) -> str:
        """The terminal summary: doors table, host ops, errors, top modules, verdict lines."""
        from tabulate import tabulate  # lazy: tabulate loads only when a table is printed (keeps import tn fast)

        o = self.options
        parts = [f"tn assess: {self.label}  ({'training step' if o.get('train') else 'inference'}, {o.get('dtype')}, "
                 f"{o.get('instance')} ({o.get('arch')}), lnc {o.get('lnc')})", ""]
        parts.append(tabulate(self.door_rows(), headers="keys", tablefmt="simple"))
        errs = self.error_rows()
        if errs:
            parts += ["", "failures:", tabulate(errs, headers="keys", tablefmt="simple", maxcolwidths=[None, None,
                                                                                                         24, 70, 50])]
        host = self.host_rows()
        if host:
            parts += ["", "ops on the host:", tabulate(host[:12], headers="keys", tablefmt="simple",
                                                       maxcolwidths=[None, 24, None, 60, 40])]
        mods = self.module_rows(6)
        if mods:
            parts += ["", f"top modules by modelled time ({mods[0]['door']}):",
                      tabulate([{"module": m["module"], "device us": f"{m['device_us']:.4g}"} for m in mods],
                               headers="keys", tablefmt="simple")]
        if self.scaling is not None:
            sc = self.scaling
            parts += ["", f"many cores: {sc['mode']}:"]
            rows = self.scaling_rows()
            if rows:
                parts.append(tabulate(rows, headers="keys", tablefmt="simple"))
            sim = sc.get("simulated")
            if sim and sim.get("error"):
                e = sim["error"]
                parts.append(f"simulated ranks failed: {e.get('type')}: {e.get('message', '')}".splitlines()[0][:300])
            elif sim:
                parts.append(f"simulated ranks: {sim['ranks_simulated']}, collectives {', '.join(sim.get('collectives', []))}"
                             f"; host step {sim['host_s_min']:.3g} s min / {sim['host_s_median']:.3g} s median")
            for n in sc.get("notes", []):
                parts.append(f"note: {n}")
        for n in self.notes:
            parts.append(f"note: {n}")
        parts += [""] + self.verdicts()
        parts.append(f"assessment took {self.elapsed_s:.1f} s; "
                     + ("every door ran and matched" if self.ok else "NOT every door ran and matched"))
        return "\n".join(parts)

    def to_dict(self) -> Dict[str, Any]:
        """Everything as plain JSON data (the per-instruction timelines left out)."""
        doors = {k: {kk: vv for kk, vv in d.items() if kk != "timeline_runs"} for k, d in self.doors.items()}
        scaling = None
        if self.scaling is not None:
            scaling = dict(self.scaling)
            if scaling.get("simulated"):
                scaling["simulated"] = {k: v for k, v in scaling["simulated"].items() if k != "timeline_runs"}
        return {"target": self.label, "options": self.options, "cpu": self.cpu, "doors": doors, "scaling": scaling,
                "verdicts": self.verdicts(), "ok": self.ok, "elapsed_s": self.elapsed_s, "notes": self.notes,
                "hbm_per_core_bytes": self.hbm_capacity()}

    def save_json(self, path: str) -> str:
        """Write :meth:`to_dict` to ``path``."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1, default=str)
        return str(path)

    def save_html(self, path: str) -> str:
        """Write the self-contained HTML report (see :mod:`tn.assess.html`)."""
        return assessment_page(self, path)

    def __str__(self) -> str:
        return self.summary()
