# `tn assess` / tn.assess(): will a model run on Trainium, how fast, what breaks: every door measured, one report.
"""Assess a model on the software NeuronCore through each of tn's doors.

::

    result = tn.assess(model, example_inputs)          # CPU reference, then every door in its own process
    print(result.summary())                             # tables + one verdict line per question
    result.save_html("report.html")                     # self-contained page: timeline, modules, fallbacks
    result.ok                                           # every door ran and matched the CPU

    python -m tn assess path/to/file.py:factory --html report.html
    python -m tn assess GPT2LMHeadModel --hf-config config.json --seq 128 --json out.json

Pieces: :mod:`tn.assess.target` (TARGET -> model and inputs),
:mod:`tn.assess.doors` (one door's measurements), :mod:`tn.assess.runner`
(a process per door, timeout, progress bars), :mod:`tn.assess.report`
(result, verdicts, terminal summary, JSON), :mod:`tn.assess.html` (pages),
:mod:`tn.assess.cli` (the command).
"""
from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
import traceback
import types
from typing import Any, Optional, Sequence

import torch

from .. import config
from ..neuron.machine import machine
from . import scaling
from .doors import DOOR_TITLES, DOORS, Options, reference, run_door
from .report import AssessResult
from .runner import run_in_child
from .scaling import SIMULATE_MAX_RANKS
from .target import AssessError, Target, check_inputs, user_frame

__all__ = ["assess", "assess_target", "AssessResult", "AssessError", "DOORS"]


def _doors(doors: Optional[Sequence[str]]) -> list:
    if doors is None:
        return list(DOORS)
    if isinstance(doors, str):
        doors = [d.strip() for d in doors.split(",") if d.strip()]
    bad = [d for d in doors if d not in DOORS]
    if bad or not doors:
        raise AssessError(f"unknown door(s) {', '.join(bad) or '(none given)'}: choose from {', '.join(DOORS)}")
    return list(dict.fromkeys(doors))


def _door_entry(progress, door, target, opts, ref, overrides):
    """A door process's work: :func:`run_door` under the chip settings of the assessment (a spawned process
    does not inherit the parent's ``tn.config`` overrides)."""
    with config.override(**overrides) if overrides else contextlib.nullcontext():
        return run_door(door, target, opts, ref, progress)


def _simulated_ranks(cores: int, requested: Optional[int], mach) -> int:
    """Ranks to simulate for ``--cores``: ``requested`` checked (0, or 2 up to the cores of one instance), else
    ``min(cores, SIMULATE_MAX_RANKS, cores of one instance)``."""
    top = min(cores, mach.device_count)
    if requested is None:
        return min(top, SIMULATE_MAX_RANKS)
    k = int(requested)
    if k != 0 and not 2 <= k <= top:
        raise AssessError(f"--simulate-ranks {k}: 0 (model only) or 2..{top} (--cores {cores}, "
                          f"{mach.device_count} cores in one {mach.name})")
    return k


def _scaling(target, opts, ref, cores, simulate_ranks: int, timeout, over, mach, result, progress, stream):
    """The ``--cores`` section of a training assessment: DDP simulated on real ranks and modelled per core
    count (see :mod:`tn.assess.scaling`)."""
    k = simulate_ranks
    out = {"mode": "DDP (weak scaling: every core runs the example batch; gradients all-reduced in buckets)",
           "cores": cores, "rows": [], "simulated": None, "notes": []}
    if k >= 2:
        if progress:
            stream.write(f"tn assess: {target.label}: DDP on {k} simulated ranks ...\n")
            stream.flush()
        out["simulated"] = scaling.simulate(target, opts, ref, k, timeout, over, import_file=target.source_file,
                                            show=progress, stream=stream)
    sim = out["simulated"] or {}
    eager = result.doors.get("eager") or {}
    if sim.get("status") in ("ok", "mismatch"):
        fwd, bwd, src = sim["forward_ns"], sim["backward_ns"], f"rank 0 of the {k}-rank simulation"
    elif eager.get("status") in ("ok", "mismatch") and eager.get("device_us"):
        total = eager["device_us"] * 1e3
        bwd = min(total, (eager.get("modules_us") or {}).get("(backward)", 0.0) * 1e3)
        fwd, src = total - bwd, "the eager door's profiled step"
    else:
        out["notes"].append("no modelled rows: neither the simulated ranks nor the eager door produced a step time")
        return out
    grads = [t.numel() * t.element_size() for n, t in ref if n.startswith("grad ")]
    out["gradient_bytes"] = sum(grads)
    out["compute_source"] = src
    out["rows"] = scaling.modelled_rows(cores, fwd, bwd, grads, instance=mach.name, lnc=mach.lnc)
    if sim.get("step_ns"):
        row = {"cores": k, "kind": "simulated", "instances": 1, "efficiency": None, "busbw_GBps": None,
               "link_GBps": None, **{key: sim[key] for key in ("compute_ns", "collective_ns", "step_ns",
                                                               "exposed_ns", "buckets")}}
        one = next((r["step_ns"] for r in out["rows"] if r["cores"] == 1), None)
        row["efficiency"] = one / row["step_ns"] if one else None
        mod = next((r for r in out["rows"] if r["cores"] == k), None)
        if mod:
            out["simulated_vs_modelled"] = (row["step_ns"] - mod["step_ns"]) / mod["step_ns"]
        out["rows"].append(row)
        out["rows"].sort(key=lambda r: (r["cores"], r["kind"] != "simulated"))
    out["notes"].append(f"one core's compute from {src}; modelled rows: DDP buckets (1 MiB first, then 25 MiB) "
                        f"ready at an even rate through the backward, each all-reduce on the ring of the first n "
                        f"cores ({mach.name}, lnc {mach.lnc}; past {mach.device_count} cores several instances over "
                        f"EFA); the optimizer step is not included")
    if cores > mach.device_count:
        out["notes"].append(f"{cores} cores span {math.ceil(cores / mach.device_count)} {mach.name} instances "
                            f"(EFA between them); --instance names a larger instance (trn2.48xlarge: 64 cores at "
                            f"lnc 2, 128 at lnc 1) to keep them on NeuronLink")
    return out


def assess_target(target: Target, *, doors: Optional[Sequence[str]] = None, dtype: str = "fp32",
                  train: bool = False, repeats: int = 2, timeout: float = 600.0, arch: Optional[str] = None,
                  instance: Optional[str] = None, lnc: Optional[int] = None, cores: int = 1,
                  simulate_ranks: Optional[int] = None, progress: bool = True, stream: Any = None) -> AssessResult:
    """Assess a loaded :class:`tn.assess.target.Target` (see :func:`assess` for the options)."""
    t_start = time.perf_counter()
    if dtype not in ("fp32", "bf16"):
        raise AssessError(f"dtype {dtype!r}: use fp32 or bf16 (bf16 runs under torch.autocast)")
    doors = _doors(doors)
    stream = stream or sys.stderr
    over = {k: v for k, v in (("arch", arch), ("instance", instance), ("lnc", lnc)) if v is not None}
    with config.override(**over) if over else contextlib.nullcontext():
        mach = machine()
        opts = Options(dtype=dtype, train=train, repeats=max(1, int(repeats)))
        notes = []
        if cores < 1:
            raise AssessError(f"--cores {cores}: give a positive number of cores")
        sim_ranks = _simulated_ranks(cores, simulate_ranks, mach) if cores > 1 and train else 0
        if cores > 1 and not train:
            notes.append(f"--cores {cores}: inference replicated on {cores} cores needs no collectives (each core's "
                         f"step is the one-core step above); tensor-parallel inference is not assessed yet. Use "
                         f"--train for DDP scaling of a training step")
        if train:
            notes.append("training step: forward, loss, backward; the loss and every gradient compared with the CPU "
                         "(optimizer step not included); dropout set to p=0")
        if progress:
            stream.write(f"tn assess: {target.label}: CPU reference ...\n")
            stream.flush()
        try:
            ref, cpu_times = reference(target, opts)
        except Exception as e:  # noqa: BLE001  (the model's own failure)
            where = user_frame(traceback.extract_tb(e.__traceback__))
            raise AssessError(f"the model does not run on the CPU: {type(e).__name__}: {e}"
                              + (f" (at {where})" if where else "") + "; fix it there first") from None
        if not ref:
            raise AssessError("the model returned no tensor to compare (return the outputs as tensors, tuples or "
                              "dicts of tensors)")
        cpu = {"steady_ms_min": min(cpu_times) * 1e3, "steady_ms_median": statistics.median(cpu_times) * 1e3,
               "outputs": [{"output": n, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
                           for n, t in ref if not n.startswith("grad ")]}
        result = AssessResult(label=target.label, options={"dtype": dtype, "train": train, "doors": doors,
                                                           "arch": mach.arch_name, "instance": mach.name,
                                                           "lnc": mach.lnc, "devices_per_instance": mach.device_count,
                                                           "hbm_per_device_bytes": mach.hbm_bytes_per_device,
                                                           "cores": cores, "repeats": opts.repeats},
                              cpu=cpu, notes=notes)
        for door in doors:
            result.doors[door] = run_in_child(
                door, _door_entry, timeout, args=(door, target, opts, ref, over), show=progress, stream=stream,
                spawn=train, import_file=target.source_file)
            result.doors[door].setdefault("title", DOOR_TITLES[door])
            result.doors[door].setdefault("door", door)
        if cores > 1 and train:
            result.scaling = _scaling(target, opts, ref, cores, sim_ranks, timeout, over, mach, result,
                                      progress, stream)
    result.elapsed_s = time.perf_counter() - t_start
    return result


def assess(model: torch.nn.Module, example_inputs: Any, *, doors: Optional[Sequence[str]] = None,
           dtype: str = "fp32", train: bool = False, repeats: int = 2, timeout: float = 600.0,
           arch: Optional[str] = None, instance: Optional[str] = None, lnc: Optional[int] = None, cores: int = 1,
           simulate_ranks: Optional[int] = None, progress: bool = True,
           label: Optional[str] = None) -> AssessResult:
    """Run ``model`` on ``example_inputs`` on the CPU, then through each door, and return what was found.

    ``example_inputs``: a tensor, a tuple of positional arguments or a dict of keyword arguments (CPU
    tensors). ``doors``: any of ``eager``, ``compile``, ``jit``, ``adaptive`` (default all), each run in its
    own forked process with ``timeout`` seconds. ``dtype``: ``fp32`` or ``bf16`` (autocast). ``train``: a
    training step (loss and gradients compared). ``arch``/``instance``/``lnc``: the modelled chip
    (``tn.config`` settings). ``cores`` > 1 with ``train``: DDP scaling of the step (:mod:`tn.assess.scaling`):
    ``simulate_ranks`` real ranks (default ``min(cores, 4)``; 0: modelled only) and modelled rows for 1, 2, 4,
    ... ``cores`` cores; for inference a note (replicas need no collectives). Progress bars
    go to stderr unless ``progress=False``. Raises :class:`AssessError` for bad inputs or a model that
    fails on the CPU; a door's failure is a result (``result.doors[d]["status"]``)."""
    args, kwargs = check_inputs(model, example_inputs, "tn.assess")
    target = Target(model, args, kwargs, label or type(model).__name__)
    return assess_target(target, doors=doors, dtype=dtype, train=train, repeats=repeats, timeout=timeout,
                         arch=arch, instance=instance, lnc=lnc, cores=cores, simulate_ranks=simulate_ranks,
                         progress=progress)


class _CallableModule(types.ModuleType):
    """The ``tn.assess`` module, callable as ``tn.assess(model, example_inputs, ...)``."""

    def __call__(self, model, example_inputs, **options):
        return assess(model, example_inputs, **options)


sys.modules[__name__].__class__ = _CallableModule
