# Self-contained HTML pages: the assessment report and any tn.profile()'s timeline (plotly figures, jinja2 template).
"""HTML pages with pictures, viewable offline.

* :func:`assessment_page` writes the report of :func:`tn.assess.assess`:
  verdicts, the doors table, failures, host fallbacks with source lines, a
  timeline of one step on the chip, bars of modelled time per module.
* :func:`profile_page` writes the timeline page of any ``tn.profile()``
  (``prof.save_html(path)``).

The timeline has one lane per engine and DMA queue (per core when runs carry
a core index) plus a lane of the programs, boxes coloured by opcode,
zoomable (drag on the time axis; double-click resets). A step has tens of
thousands of instructions, so :func:`timeline_boxes` merges, per lane,
neighbouring instructions into one box while the box is shorter than
``span / resolution``; the box takes the colour of the opcode that filled most
of it, its hover text lists what was merged, and the page says how many
instructions became how many boxes.

Figures are made with plotly (its JavaScript embedded once, so the file needs
no network) and the page with a jinja2 template (``report.html.j2`` beside
this module). Both come with ``pip install 'tn[report]'``.
"""
from __future__ import annotations

import datetime
import os
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ..errors import MissingDependencyError
from ..neuron.isa import OPCODE_NAMES
from ..profile import set_html_renderer

__all__ = ["runs_data", "timeline_boxes", "timeline_figure", "modules_figure", "scaling_figure", "assessment_page",
           "profile_page"]

#: One colour per opcode (stable across pages).
OPCODE_COLOURS = {
    "matmul": "#1f77b4", "transpose": "#aec7e8", "activation": "#ff7f0e", "tensor_tensor": "#2ca02c",
    "tensor_scalar": "#98df8a", "tensor_reduce": "#d62728", "tensor_copy": "#9467bd", "select": "#c5b0d5",
    "bn_stats": "#8c564b", "bn_aggr": "#c49c94", "iota": "#e377c2", "affine_select": "#f7b6d2",
    "memset": "#7f7f7f", "partition_reduce": "#bcbd22", "partition_shuffle": "#dbdb8d", "dma_copy": "#17becf",
    "dma_gather": "#9edae5", "dma_scatter": "#393b79", "program": "#cfcfcf",
}


def _need_libs():
    try:
        import jinja2  # lazy: optional dependency (the report extra)
        import plotly  # lazy: optional dependency (the report extra)
    except ImportError as e:
        raise MissingDependencyError(f"HTML reports need plotly and jinja2 ({e.name} is missing): pip install 'tn[report]' "
                                     f"(or pip install plotly jinja2)") from None
    return jinja2, plotly


def runs_data(runs: Sequence[Any]) -> List[Dict[str, Any]]:
    """What the timeline needs of each :class:`tn.neuron.RunResult` (plain values and numpy arrays)."""
    out = []
    for r in runs:
        out.append({"name": r.name, "arch": r.arch.name, "total_ns": float(r.total_ns),
                    "core": int(getattr(r, "core", 0) or 0), "start_ns": getattr(r, "start_ns", None),
                    "queues": r.queues, "opcodes": r.opcodes,
                    "times": r.times, "queue_names": [r.arch.queue_name(q) for q in range(r.arch.num_queues)]})
    return out


def timeline_boxes(runs: Sequence[Dict[str, Any]], resolution: int = 2500, max_boxes: int = 20000) -> Dict[str, Any]:
    """Boxes of the timeline of ``runs`` (:func:`runs_data`), laid back to back.

    Returns ``{"lanes": [...], "boxes": [(lane, start_ns, end_ns, opcode, n, detail)], "instructions": n,
    "min_ns": merge width, "span_ns": total}``; instructions on a lane closer together than ``min_ns`` are
    merged (``n`` > 1, ``detail`` lists the opcodes merged)."""
    several = len({r["core"] for r in runs}) > 1
    # one core: runs back to back (what the step's modelled time sums); several: where the machine's clock put them
    placed = several and all(r.get("start_ns") is not None for r in runs)
    t0 = min((r["start_ns"] for r in runs), default=0.0) if placed else 0.0
    span = (max(r["start_ns"] + r["total_ns"] for r in runs) - t0 if placed else
            sum(r["total_ns"] for r in runs)) or 1.0
    per_lane: Dict[str, list] = {}
    lane_order: Dict[str, tuple] = {}
    offset = 0.0
    n_instr = 0
    programs = []
    for r in runs:
        if placed:
            offset = r["start_ns"] - t0
        prog_lane = f"core{r['core']} programs" if several else "programs"
        lane_order.setdefault(prog_lane, (r["core"], -1))
        programs.append((prog_lane, offset, offset + r["total_ns"], r["name"]))
        t = np.asarray(r["times"], dtype=np.float64).reshape(-1, 2)
        q = np.asarray(r["queues"]).astype(np.int64)
        o = np.asarray(r["opcodes"]).astype(np.int64)
        n_instr += len(q)
        for qq in np.unique(q).tolist():
            name = r["queue_names"][qq] if qq < len(r["queue_names"]) else f"queue{qq}"
            lane = f"core{r['core']} {name}" if several else name
            lane_order.setdefault(lane, (r["core"], qq))
            sel = q == qq
            per_lane.setdefault(lane, []).append((t[sel, 0] + offset, t[sel, 1] + offset, o[sel]))
        if not placed:
            offset += r["total_ns"]
    min_ns = span / resolution
    while True:
        boxes = []
        for lane, parts in per_lane.items():
            s = np.concatenate([p[0] for p in parts])
            e = np.concatenate([p[1] for p in parts])
            o = np.concatenate([p[2] for p in parts])
            idx = np.argsort(s, kind="stable")
            s, e, o = s[idx].tolist(), e[idx].tolist(), o[idx].tolist()
            i, n = 0, len(s)
            while i < n:
                bs, be = s[i], e[i]
                dur: Dict[int, float] = {o[i]: e[i] - s[i]}
                cnt: Dict[int, int] = {o[i]: 1}
                j = i + 1
                while j < n and s[j] - bs < min_ns:
                    be = max(be, e[j])
                    dur[o[j]] = dur.get(o[j], 0.0) + (e[j] - s[j])
                    cnt[o[j]] = cnt.get(o[j], 0) + 1
                    j += 1
                top = max(dur, key=dur.get)
                detail = ", ".join(f"{OPCODE_NAMES.get(k, k)} x{v}" for k, v in sorted(cnt.items(),
                                                                                         key=lambda kv: -kv[1]))
                boxes.append((lane, bs, be, OPCODE_NAMES.get(top, str(top)), j - i, detail))
                i = j
        if len(boxes) <= max_boxes:
            break
        min_ns *= 2
    # the program lanes: merged the same way
    pboxes = []
    last_of: Dict[str, int] = {}
    for lane, s, e, name in sorted(programs, key=lambda p: (p[0], p[1])):
        k = last_of.get(lane)
        if k is not None and s - pboxes[k][1] < min_ns and pboxes[k][2] - pboxes[k][1] < min_ns:
            pboxes[k] = (lane, pboxes[k][1], max(e, pboxes[k][2]), pboxes[k][3] + [name])
        else:
            last_of[lane] = len(pboxes)
            pboxes.append((lane, s, e, [name]))
    for lane, s, e, names in pboxes:
        detail = names[0] if len(names) == 1 else f"{len(names)} programs: " + ", ".join(names[:6]) + (
            " ..." if len(names) > 6 else "")
        boxes.append((lane, s, e, "program", len(names), detail))
    lanes = sorted(lane_order, key=lambda k: lane_order[k])
    return {"lanes": lanes, "boxes": boxes, "instructions": n_instr, "min_ns": min_ns, "span_ns": span,
            "programs": len(programs), "placed": placed}


def timeline_figure(tl: Dict[str, Any], title: str = ""):
    """A plotly figure of :func:`timeline_boxes` (horizontal bars: one trace per opcode colour)."""
    import plotly.graph_objects as go  # lazy: optional dependency (the report extra)

    by_kind: Dict[str, list] = {}
    for b in tl["boxes"]:
        by_kind.setdefault(b[3], []).append(b)
    fig = go.Figure()
    for kind, bs in sorted(by_kind.items(), key=lambda kv: (kv[0] == "program", kv[0])):
        fig.add_trace(go.Bar(
            orientation="h", name=kind, y=[b[0] for b in bs], base=[b[1] / 1e3 for b in bs],
            x=[max(b[2] - b[1], 1.0) / 1e3 for b in bs], marker={"color": OPCODE_COLOURS.get(kind, "#555"),
                                                                   "line": {"width": 0}},
            hovertext=[f"{b[5]}<br>{b[1] / 1e3:.3f}-{b[2] / 1e3:.3f} us" + (f" ({b[4]} merged)" if b[4] > 1 else "")
                       for b in bs], hoverinfo="text"))
    lanes = tl["lanes"]
    fig.update_layout(
        title=title, barmode="overlay", bargap=0.15, height=max(260, 24 * len(lanes) + 140),
        margin={"l": 110, "r": 20, "t": 40 if title else 20, "b": 40}, legend={"orientation": "h", "y": -0.12},
        xaxis={"title": "modelled time (us)", "rangemode": "tozero"},
        yaxis={"categoryorder": "array", "categoryarray": list(reversed(lanes)), "fixedrange": True},
        plot_bgcolor="#fafafa")
    return fig


def modules_figure(rows: List[Dict[str, Any]], title: str = ""):
    """Horizontal bars of modelled time per module (``rows`` of :meth:`AssessResult.module_rows`)."""
    import plotly.graph_objects as go  # lazy: optional dependency (the report extra)

    rows = list(reversed(rows))
    fig = go.Figure(go.Bar(orientation="h", y=[r["module"] for r in rows], x=[r["device_us"] for r in rows],
                           marker={"color": "#1f77b4"}, hovertemplate="%{y}: %{x:.4g} us<extra></extra>"))
    fig.update_layout(title=title, height=max(220, 22 * len(rows) + 100),
                      margin={"l": 220, "r": 20, "t": 40 if title else 20, "b": 40},
                      xaxis={"title": "modelled time, inclusive (us)"}, plot_bgcolor="#fafafa")
    return fig


def scaling_figure(rows: List[Dict[str, Any]]):
    """Stacked bars per core count (``rows`` of :meth:`AssessResult.scaling_rows`' source, the ``--cores``
    section): compute and all-reduce time not hidden by the backward, with the efficiency printed on each bar."""
    import plotly.graph_objects as go  # lazy: optional dependency (the report extra)

    labels = [f"{r['cores']} ({r['kind']})" for r in rows]
    compute = [r["compute_ns"] / 1e3 for r in rows]
    exposed = [r["exposed_ns"] / 1e3 for r in rows]
    eff = [f"{100 * r['efficiency']:.0f}%" if r.get("efficiency") else "" for r in rows]
    fig = go.Figure([
        go.Bar(name="compute (forward + backward)", x=labels, y=compute, marker={"color": "#1f77b4"},
               hovertemplate="%{x}: compute %{y:.4g} us<extra></extra>"),
        go.Bar(name="all-reduce not hidden", x=labels, y=exposed, marker={"color": "#d62728"}, text=eff,
               textposition="outside", hovertemplate="%{x}: exposed %{y:.4g} us<extra></extra>")])
    fig.update_layout(barmode="stack", height=340, margin={"l": 60, "r": 20, "t": 20, "b": 60},
                      xaxis={"title": "cores (how the row was obtained)"}, yaxis={"title": "modelled step (us)"},
                      plot_bgcolor="#fafafa", legend={"orientation": "h", "y": 1.12})
    return fig


def _fig_html(fig, div_id: str) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                       config={"displaylogo": False, "responsive": True, "scrollZoom": False})


def _render(template: str, path: str, **ctx) -> str:
    jinja2, plotly = _need_libs()
    from plotly.offline import get_plotlyjs  # lazy: optional dependency (the report extra)

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(os.path.dirname(os.path.abspath(__file__))),
                             autoescape=jinja2.select_autoescape(["j2", "html"]))
    page = env.get_template(template).render(plotly_js=get_plotlyjs(), generated=datetime.datetime.now(
        datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), **ctx)
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return str(path)


def _timeline_ctx(runs: Sequence[Dict[str, Any]], what: str) -> Optional[Dict[str, Any]]:
    if not runs:
        return None
    tl = timeline_boxes(runs)
    merged = tl["instructions"] - sum(1 for b in tl["boxes"] if b[3] != "program")
    note = (f"{what}: {tl['instructions']} instructions in {tl['programs']} program run(s), "
            f"{tl['span_ns'] / 1e3:.4g} us modelled, "
            + ("each core's runs where the machine's clock placed them. " if tl["placed"] else "back to back. "))
    note += (f"Drawn as {len(tl['boxes'])} boxes: on each lane, instructions starting within "
             f"{tl['min_ns']:.3g} ns of a box's start were merged into it ({merged} merged away); a merged box "
             f"has the colour of the opcode that filled most of it, and its hover text lists what it holds. "
             if merged > 0 else "Every instruction is drawn. ")
    note += "Drag across the time axis to zoom, double-click to reset."
    return {"html": _fig_html(timeline_figure(tl), "timeline"), "note": note}


def profile_page(prof: Any, path: str, title: str = "tn.profile") -> str:
    """Write the timeline page of ``prof`` (a :class:`tn.profile.Profile`): program table, timeline, opcodes."""
    runs = runs_data(prof.runs)
    rows = prof.rows()
    return _render("profile.html.j2", path, title=title, timeline=_timeline_ctx(runs, "all runs of the profile"),
                   programs=rows[:200], programs_more=max(0, len(rows) - 200), opcodes=prof.opcode_rows()[:30],
                   host_ops=sorted(prof.host_ops.items(), key=lambda kv: -kv[1]), total_us=prof.total_us,
                   n_runs=len(prof.runs))


def assessment_page(result: Any, path: str) -> str:
    """Write the report of an :class:`tn.assess.report.AssessResult`."""
    best = result.best_door()
    timeline = None
    if best:
        timeline = _timeline_ctx(result.doors[best].get("timeline_runs") or [],
                                 f"one step through {best} ({result.doors[best]['title']})")
    mods = result.module_rows()
    modules = None
    if mods:
        modules = {"html": _fig_html(modules_figure(mods), "modules"), "door": mods[0]["door"]}
    scaling = None
    if result.scaling is not None:
        sc = result.scaling
        scaling = {"mode": sc.get("mode", ""), "rows": result.scaling_rows(), "notes": sc.get("notes", []),
                   "verdict": result.scaling_verdict(), "simulated": sc.get("simulated"),
                   "html": _fig_html(scaling_figure(sc["rows"]), "scaling") if sc.get("rows") else None}
    details = []
    for k, d in result.doors.items():
        if d.get("status") in ("ok", "mismatch"):
            details.append({"door": k, "title": d.get("title", k), "outputs": d.get("outputs", []),
                            "opcodes": d.get("top_opcodes", [])[:8], "programs": d.get("top_programs", [])[:8],
                            "utilisation": d.get("utilisation", {}), "hbm_kind": d.get("hbm_kind", ""),
                            "compile_s": d.get("compile_s")})
    return _render("report.html.j2", path, r=result, verdicts=result.verdicts(), doors=result.door_rows(),
                   errors=result.error_rows(), host=result.host_rows(), timeline=timeline, modules=modules,
                   details=details, best=best, scaling=scaling)


set_html_renderer(profile_page)  # Profile.save_html renders through this module
