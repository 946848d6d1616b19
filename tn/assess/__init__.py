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
import statistics
import sys
import time
import types
from typing import Any, Optional, Sequence

import torch

from .doors import DOORS, DOOR_TITLES, Options, reference, run_door
from .report import AssessResult
from .runner import run_in_child
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
    from .. import config

    with config.override(**overrides) if overrides else contextlib.nullcontext():
        return run_door(door, target, opts, ref, progress)


def assess_target(target: Target, *, doors: Optional[Sequence[str]] = None, dtype: str = "fp32",
                  train: bool = False, repeats: int = 2, timeout: float = 600.0, arch: Optional[str] = None,
                  instance: Optional[str] = None, lnc: Optional[int] = None, cores: int = 1,
                  progress: bool = True, stream: Any = None) -> AssessResult:
    """Assess a loaded :class:`tn.assess.target.Target` (see :func:`assess` for the options)."""
    from .. import config
    from ..neuron.machine import machine

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
        if cores > 1:
            n = torch.neuron.device_count()
            notes.append(f"--cores {cores}: n/a: sharded runs are not part of tn assess yet (needs the many-core "
                         f"devices, {n} visible now, and a sharding plan); every door ran on one core")
        if train:
            notes.append("training step: forward, loss, backward; the loss and every gradient compared with the CPU "
                         "(optimizer step not included); dropout set to p=0")
        if progress:
            stream.write(f"tn assess: {target.label}: CPU reference ...\n")
            stream.flush()
        try:
            ref, cpu_times = reference(target, opts)
        except Exception as e:  # noqa: BLE001  (the model's own failure)
            where = user_frame(__import__("traceback").extract_tb(e.__traceback__))
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
    result.elapsed_s = time.perf_counter() - t_start
    return result


def assess(model: torch.nn.Module, example_inputs: Any, *, doors: Optional[Sequence[str]] = None,
           dtype: str = "fp32", train: bool = False, repeats: int = 2, timeout: float = 600.0,
           arch: Optional[str] = None, instance: Optional[str] = None, lnc: Optional[int] = None, cores: int = 1,
           progress: bool = True, label: Optional[str] = None) -> AssessResult:
    """Run ``model`` on ``example_inputs`` on the CPU, then through each door, and return what was found.

    ``example_inputs``: a tensor, a tuple of positional arguments or a dict of keyword arguments (CPU
    tensors). ``doors``: any of ``eager``, ``compile``, ``jit``, ``adaptive`` (default all), each run in its
    own forked process with ``timeout`` seconds. ``dtype``: ``fp32`` or ``bf16`` (autocast). ``train``: a
    training step (loss and gradients compared). ``arch``/``instance``/``lnc``: the modelled chip
    (``tn.config`` settings). ``cores``: reported as n/a while tn models one core per device. Progress bars
    go to stderr unless ``progress=False``. Raises :class:`AssessError` for bad inputs or a model that
    fails on the CPU; a door's failure is a result (``result.doors[d]["status"]``)."""
    args, kwargs = check_inputs(model, example_inputs, "tn.assess")
    target = Target(model, args, kwargs, label or type(model).__name__)
    return assess_target(target, doors=doors, dtype=dtype, train=train, repeats=repeats, timeout=timeout,
                         arch=arch, instance=instance, lnc=lnc, cores=cores, progress=progress)


class _CallableModule(types.ModuleType):
    """The ``tn.assess`` module, callable as ``tn.assess(model, example_inputs, ...)``."""

    def __call__(self, model, example_inputs, **options):
        return assess(model, example_inputs, **options)


sys.modules[__name__].__class__ = _CallableModule
