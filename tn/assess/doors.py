# One step of the model through each of tn's doors (and on the CPU), measured: numbers, times, host ops, a profile.
"""The measurements of one door, made inside the process that runs it.

A *step* is one inference call (``torch.no_grad()``) or one training step
(forward, loss, ``backward``: the loss and every parameter's gradient are
compared; the optimizer step, elementwise, is left out). With ``dtype="bf16"``
the step runs under ``torch.autocast`` on the inputs' device.

Doors (:data:`DOORS`): ``eager`` (``model.to("neuron")``, op by op on the
device), ``compile`` (``torch.compile(model, backend="neuron")``), ``jit``
(``tn.jit``) and ``adaptive`` (``tn.adaptive(model)``). :func:`run_door`
returns a plain dict (see :class:`tn.assess.report.DoorResult` for the fields)
and reports its stages through ``progress(stage, fraction)``.
"""
from __future__ import annotations

import contextlib
import statistics
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import torch

import tn

from ..device import tracking
from ..errors import ArgumentTypeError
from ..neuron.arch import NUM_ENGINES
from ..neuron.runtime import add_listener, remove_listener
from .html import runs_data
from .target import Target, user_frame

__all__ = ["DOORS", "DOOR_TITLES", "Options", "named_leaves", "reference", "run_door", "compare", "TOLERANCES",
           "error_info"]

DOORS = ("eager", "compile", "jit", "adaptive")
DOOR_TITLES = {"cpu": "CPU (torch, reference)", "eager": 'device eager: model.to("neuron")',
               "compile": 'torch.compile(backend="neuron")', "jit": "tn.jit(model)", "adaptive": "tn.adaptive(model)"}

#: (rtol, atol) per compared dtype; atol is scaled by max(1, max |reference|) of the output (see :func:`compare`).
TOLERANCES = {"fp32": (1e-4, 1e-5), "bf16": (1.6e-2, 1e-2)}
#: Looser rule for gradients: they sum over the batch and every later layer.
GRAD_TOLERANCES = {"fp32": (1e-3, 1e-4), "bf16": (5e-2, 3e-2)}


@dataclass
class Options:
    """How to run each step: ``dtype`` (fp32/bf16 autocast), ``train``, ``repeats`` of the steady step, ``seed``."""

    dtype: str = "fp32"
    train: bool = False
    repeats: int = 2
    seed: int = 0


def named_leaves(obj: Any, prefix: str = "") -> List[Tuple[str, torch.Tensor]]:
    """The tensors in ``obj`` (tensors, tuples/lists, dicts and HF ModelOutputs) with dotted names."""
    if isinstance(obj, torch.Tensor):
        return [(prefix or "output", obj)]
    out: List[Tuple[str, torch.Tensor]] = []
    if isinstance(obj, dict) or (hasattr(obj, "keys") and hasattr(obj, "__getitem__")):
        for k in list(obj.keys()):
            out += named_leaves(obj[k], f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            out += named_leaves(v, f"{prefix}[{i}]" if prefix else f"output[{i}]")
    return out


def _loss_of(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    floats = [t for _, t in named_leaves(out) if t.is_floating_point()]
    if not floats:
        raise ArgumentTypeError("the model returned no floating-point tensor to build a training loss from")
    return sum(t.float().square().mean() for t in floats)   # synthetic loss: mean of squares of each output


def _autocast(opts: Options, device_type: str):
    if opts.dtype == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _to(tree: Any, device: str) -> Any:
    return torch.utils._pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def _cpu_leaves(leaves: List[Tuple[str, torch.Tensor]]) -> List[Tuple[str, torch.Tensor]]:
    return [(n, t.detach().to("cpu")) for n, t in leaves]


def _disable_dropout(model: torch.nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = 0.0


def _grads(model: torch.nn.Module) -> List[Tuple[str, torch.Tensor]]:
    return [(f"grad {n}", p.grad) for n, p in model.named_parameters() if p.grad is not None]


def _make_step(door: str, model: torch.nn.Module, target: Target, opts: Options) -> Callable[[], list]:
    """A no-argument function running one step through ``door``; returns the named CPU leaves to compare."""
    args, kwargs = target.inputs, target.kwargs
    dev = "cpu"
    if door in ("eager", "adaptive"):   # tn.adaptive's eager regions run on the device, as on Trainium
        model = model.to("neuron")
        args, kwargs = _to(args, "neuron"), _to(kwargs, "neuron")
        dev = "neuron"
    if door == "jit" and opts.train:
        names = [n for n, p in model.named_parameters() if p.requires_grad]

        def loss_and_grads(m, a, k):
            params = [p for p in m.parameters() if p.requires_grad]   # inside tn.jit: the traced parameters
            with _autocast(opts, "cpu"):
                loss = _loss_of(m(*a, **k))
            return loss, torch.autograd.grad(loss, params, allow_unused=True)

        jitted = tn.jit(loss_and_grads)

        def jit_train_step():
            loss, grads = jitted(model, args, kwargs)
            return _cpu_leaves([("loss", loss)] + [(f"grad {n}", g) for n, g in zip(names, grads) if g is not None])
        jit_train_step.jitted = jitted
        return jit_train_step
    if door == "jit":
        fn = tn.jit(model)
    elif door == "compile":
        from .. import dynamo_backend  # noqa: F401  # lazy: registers the backend; loads with torch.compile, not import tn

        fn = torch.compile(model, backend="neuron")
    elif door == "adaptive":
        fn = tn.adaptive(model)
    else:
        fn = model

    if opts.train:
        def train_step():
            model.zero_grad(set_to_none=True)
            torch.manual_seed(opts.seed)
            with _autocast(opts, dev):
                loss = _loss_of(fn(*args, **kwargs))
            loss.backward()
            return _cpu_leaves([("loss", loss)] + _grads(model))
        train_step.jitted = fn if door == "jit" else None
        return train_step

    def infer_step():
        torch.manual_seed(opts.seed)
        with torch.no_grad(), _autocast(opts, dev):
            out = fn(*args, **kwargs)
        return _cpu_leaves(named_leaves(out))
    infer_step.jitted = fn if door == "jit" else None
    return infer_step


def reference(target: Target, opts: Options) -> Tuple[list, List[float]]:
    """The CPU reference: ``(named leaves of one step, host seconds of each of opts.repeats steady steps)``."""
    model = target.model
    model.train(opts.train)
    if opts.train:
        _disable_dropout(model)
    step = _make_step("cpu", model, target, opts)
    leaves = step()
    times = []
    for _ in range(max(1, opts.repeats)):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    if opts.train:
        model.zero_grad(set_to_none=True)
    return leaves, times


def compare(ref: list, got: list, dtype: str) -> List[Dict[str, Any]]:
    """One row per output: name, shape, dtype, max abs error, worst error/tolerance ratio, tolerance, ok.

    An element passes when ``|got - ref| <= atol * max(1, max|ref|) + rtol * |ref|`` with ``(rtol, atol)``
    from :data:`TOLERANCES` (:data:`GRAD_TOLERANCES` for gradients); NaN/inf must sit where the reference has
    the same value. Gradients are summarised in one row (the worst tensor named)."""
    got_by = dict(got)
    rows: List[Dict[str, Any]] = []
    grad_rows: List[Dict[str, Any]] = []
    for name, r in ref:
        g = got_by.get(name)
        is_grad = name.startswith("grad ")
        rtol, atol = (GRAD_TOLERANCES if is_grad else TOLERANCES)[dtype]
        row = {"output": name, "shape": list(r.shape), "dtype": str(r.dtype).replace("torch.", ""),
               "rtol": rtol, "atol": atol}
        if g is None:
            row.update(max_abs_err=None, ratio=None, ok=False, note="missing in this door's result")
        elif tuple(g.shape) != tuple(r.shape):
            row.update(max_abs_err=None, ratio=None, ok=False, note=f"shape {list(g.shape)}")
        elif not (r.is_floating_point() or r.is_complex()):
            eq = torch.equal(g.to(r.dtype), r)
            row.update(max_abs_err=0.0 if eq else float((g.double() - r.double()).abs().max()), ratio=0.0 if eq
                       else float("inf"), ok=eq, note="" if eq else "integer values differ")
        else:
            rd, gd = r.double(), g.double()
            finite = torch.isfinite(rd)
            same_special = bool(torch.equal(torch.isfinite(gd), finite)) and bool(
                torch.equal(torch.where(finite, 0.0, torch.nan_to_num(gd)), torch.where(finite, 0.0,
                                                                                        torch.nan_to_num(rd))))
            rf, gf = torch.where(finite, rd, 0.0), torch.where(finite, gd, 0.0)
            scale = max(1.0, float(rf.abs().max())) if rf.numel() else 1.0
            err = (gf - rf).abs()
            bound = atol * scale + rtol * rf.abs()
            ratio = float((err / bound).max()) if err.numel() else 0.0
            row.update(max_abs_err=float(err.max()) if err.numel() else 0.0, ratio=ratio,
                       ok=same_special and ratio <= 1.0, note="" if same_special else "NaN/inf pattern differs")
        (grad_rows if is_grad else rows).append(row)
    if grad_rows:
        worst = max(grad_rows, key=lambda x: float("inf") if x["ratio"] is None else x["ratio"])
        rows.append({"output": f"gradients ({len(grad_rows)} tensors; worst: {worst['output'][5:]})",
                     "shape": worst["shape"], "dtype": worst["dtype"], "rtol": worst["rtol"], "atol": worst["atol"],
                     "max_abs_err": max((x["max_abs_err"] or 0.0) for x in grad_rows), "ratio": worst["ratio"],
                     "ok": all(x["ok"] for x in grad_rows), "note": worst.get("note", "")})
    return rows


def error_info(exc: BaseException, stage: str) -> Dict[str, Any]:
    """What to report of ``exc`` raised during ``stage``: type and message, the user's file:line, the traceback."""
    tb = traceback.extract_tb(exc.__traceback__)
    msg = str(exc).strip().splitlines()
    return {"stage": stage, "type": type(exc).__name__, "message": "\n".join(msg[:12])[:2000],
            "where": user_frame(tb), "traceback": "".join(traceback.format_exception(exc)[-12:])[-6000:]}


class _SourcedCounts(dict):
    """``prof.host_ops`` that also remembers the user's line each host op was counted from."""

    def __init__(self):
        super().__init__()
        self.where: Dict[str, Dict[str, int]] = {}

    def __setitem__(self, key, value):
        n = value - self.get(key, 0)
        site = user_frame(traceback.extract_stack()[:-1]) or "?"
        w = self.where.setdefault(key, {})
        w[site] = w.get(site, 0) + n
        super().__setitem__(key, value)


class _ModuleClock:
    """Charges every NeuronCore run to the modules whose forward is on the stack (inclusive modelled time)."""

    def __init__(self, model: torch.nn.Module, train: bool):
        self.stack: List[str] = []
        self.ns: Dict[str, float] = {}
        self.outside = "(backward)" if train else "(outside any module)"
        self.handles = []

        self.thread = threading.get_ident()
        for name, m in model.named_modules():
            label = name or "(model)"
            self.handles.append(m.register_forward_pre_hook(lambda mod, a, _l=label: self.stack.append(_l)))
            self.handles.append(m.register_forward_hook(lambda mod, a, o, _l=label: self._pop(_l)))

    def _pop(self, label: str) -> None:
        if self.stack and self.stack[-1] == label:
            self.stack.pop()

    def run(self, r) -> None:
        labels = self.stack if threading.get_ident() == self.thread and self.stack else [self.outside]
        for lab in set(labels):
            self.ns[lab] = self.ns.get(lab, 0.0) + r.total_ns

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _compiled_host_sources(door: str, step: Callable) -> Tuple[Dict[str, Dict[str, int]], Dict[str, str]]:
    """For tn.jit / torch.compile: ``{op: {user file:line: equations}}`` and reasons, from the compiled IRs."""
    from .. import dynamo_backend  # lazy: loads with torch.compile (its entry point), not with import tn

    jitted = []
    if door == "jit" and getattr(step, "jitted", None) is not None:
        jitted = [step.jitted]
    elif door == "compile":
        jitted = dynamo_backend.compiled_graphs()
    where: Dict[str, Dict[str, int]] = {}
    reasons: Dict[str, str] = {}
    for j in jitted:
        try:
            exes = dynamo_backend.executables_of(j)
        except Exception:  # noqa: BLE001  (not a tn.jit object: nothing to read)
            continue
        for exe in exes:
            stats = getattr(exe, "stats", None) or {}
            host = stats.get("host_ops") or {}
            for k, v in (stats.get("host_reasons") or {}).items():
                reasons.setdefault(k, v)
            ir = getattr(exe, "ir", None)
            for eqn in (ir.eqns if ir is not None else ()):
                if eqn.op.name in host:
                    w = where.setdefault(eqn.op.name, {})
                    site = eqn.source or "?"
                    w[site] = w.get(site, 0) + 1
    return where, reasons


def _profile_summary(prof: Any) -> Dict[str, Any]:
    total = sum(r.total_ns for r in prof.runs)
    busy: Dict[str, float] = {}
    for r in prof.runs:
        for k, v in r.busy_ns.items():
            busy[k] = busy.get(k, 0.0) + v
    util = {k: 100.0 * v / total for k, v in busy.items()} if total else {}
    dma = [v for k, v in util.items() if k.startswith("DMA")]
    engines = {}
    if prof.runs:
        a = prof.runs[0].arch
        engines = {a.queue_name(q): util.get(a.queue_name(q), 0.0) for q in range(NUM_ENGINES)}
    engines["DMA (busiest queue)"] = max(dma, default=0.0)
    engines["DMA (mean of queues)"] = sum(dma) / len(dma) if dma else 0.0
    programs = sorted(prof.rows(), key=lambda r: -r["time_us"])[:10]
    return {"device_us": total / 1e3, "runs": len(prof.runs),
            "instructions": int(sum(len(r.opcodes) for r in prof.runs)),
            "hbm_read_MB": sum(r.hbm_read_bytes for r in prof.runs) / 1e6,
            "hbm_write_MB": sum(r.hbm_write_bytes for r in prof.runs) / 1e6,
            "sbuf_peak_KiB": max((r.sbuf_peak_bytes for r in prof.runs), default=0) / 1024,
            "utilisation": engines, "utilisation_queues": util,
            "top_opcodes": prof.opcode_rows()[:10],
            "top_programs": [{"program": p["program"], "runs": p["runs"], "time_us": p["time_us"],
                              "instructions": p["instructions"]} for p in programs]}


def _tensor_bytes(tensors) -> int:
    seen, n = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            try:
                key = t.untyped_storage().data_ptr()
            except RuntimeError:
                key = id(t)
            if key not in seen:
                seen.add(key)
                n += t.untyped_storage().nbytes()
    return n


def run_door(door: str, target: Target, opts: Options, ref: list,
             progress: Callable[[str, float], None] = lambda s, f: None) -> Dict[str, Any]:
    """Run ``target`` through ``door`` and measure it (see the module docstring); never raises for the model's
    own failures: they come back as ``status="error"`` with the user's file:line."""
    res: Dict[str, Any] = {"door": door, "title": DOOR_TITLES[door], "status": "error", "error": None,
                           "outputs": [], "host_ops": [], "notes": []}
    stage = "prepare"
    model = target.model
    model.train(opts.train)
    if opts.train:
        _disable_dropout(model)
    weights = _tensor_bytes(list(model.parameters()) + list(model.buffers()))
    inputs_b = _tensor_bytes(torch.utils._pytree.tree_leaves((target.inputs, target.kwargs)))
    res["weights_bytes"] = weights
    res["input_bytes"] = inputs_b
    warm = 3 if door == "adaptive" else 1   # tn.adaptive compiles a region once its signature recurs
    n_steps = warm + opts.repeats + 1
    done = [0]

    def tick(name: str) -> None:
        progress(name, done[0] / n_steps)

    try:
        tick("preparing " + door)
        if door in ("eager", "adaptive"):
            torch.neuron.reset_peak_memory_stats()
            tracking.reset_op_counts()
        step = _make_step(door, model, target, opts)
        stage = "first call (trace + compile + run)"
        tick(stage)
        t0 = time.perf_counter()
        first = step()
        res["first_call_s"] = time.perf_counter() - t0
        done[0] += 1
        rows = compare(ref, first, opts.dtype)
        for i in range(1, warm):
            stage = f"warm-up call {i + 1}/{warm}"
            tick(stage)
            step()
            done[0] += 1
        times = []
        for i in range(opts.repeats):
            stage = f"steady call {i + 1}/{opts.repeats}"
            tick(stage)
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
            done[0] += 1
        stage = "profiled call"
        tick(stage)
        clock = _ModuleClock(model, opts.train) if door in ("eager", "adaptive") else None

        token = add_listener(clock.run) if clock else None
        try:
            with tn.profile() as prof:
                prof.host_ops = _SourcedCounts()
                last = step()
        finally:
            if token is not None:
                remove_listener(token)
            if clock:
                clock.close()
        done[0] += 1
        last_rows = compare(ref, last, opts.dtype)
        # report the worse of the first and the steady call for each output
        for a, b in zip(rows, last_rows):
            if (b["ratio"] or 0) > (a["ratio"] or 0) or not b["ok"]:
                a.update(b)
        res["outputs"] = rows
        res["steady_s"] = times
        res["steady_ms_min"] = min(times) * 1e3 if times else None
        res["steady_ms_median"] = statistics.median(times) * 1e3 if times else None
        res["compile_s"] = max(0.0, res["first_call_s"] - (statistics.median(times) if times else 0.0))
        res.update(_profile_summary(prof))
        res["timeline_runs"] = runs_data(prof.runs)
        res["modules_us"] = {k: v / 1e3 for k, v in sorted((clock.ns if clock else {}).items(),
                                                          key=lambda kv: -kv[1])}
        # host fallbacks: counts of the profiled step, lines from the call stack or the compiled IR
        where = dict(prof.host_ops.where)
        reasons: Dict[str, str] = {}
        if door in ("jit", "compile"):
            w2, reasons = _compiled_host_sources(door, step)
            for k, v in w2.items():
                where[k] = v
        if door in ("eager", "adaptive"):
            reasons.update(tracking.fallback_reasons())
            device_ops = "; ".join(f"{op} x{n}: {tracking.fallback_reasons().get(op, '')}"
                                   for op, n in tracking.fallback_ops().items())
            for op in prof.host_ops:
                reasons.setdefault(op, device_ops)
        res["host_ops"] = [{"op": op, "count": n, "where": sorted(where.get(op, {}).items(), key=lambda kv: -kv[1]),
                            "reason": reasons.get(op, "")} for op, n in sorted(prof.host_ops.items(),
                                                                                key=lambda kv: -kv[1])]
        if door in ("eager", "adaptive"):
            res["hbm_peak_bytes"] = int(torch.neuron.max_memory_allocated())
            res["hbm_kind"] = "measured: peak device memory of the step"
        else:
            out_b = _tensor_bytes([t for _, t in last])
            extra = weights if opts.train else 0   # gradients
            res["hbm_peak_bytes"] = weights + inputs_b + out_b + extra
            res["hbm_kind"] = "estimate: weights + inputs + results" + (" + gradients" if opts.train else "")
        res["status"] = "ok" if all(r["ok"] for r in rows) else "mismatch"
    except BaseException as e:  # noqa: BLE001  (every failure of the model is a result)
        if isinstance(e, KeyboardInterrupt):
            raise
        res["error"] = error_info(e, stage)
        res["status"] = "error"
    return res
