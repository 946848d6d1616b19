# tn.lower: the NeuronCore compiler (IR -> tn.neuron programs); importing it registers the lowerings on the op table.
"""The compiler from tn's IR to NeuronCore programs.

* :mod:`tn.lower.base`: the contract every lowering codes against
  (:class:`CannotLower`, :class:`LowerCtx`, :func:`lowering`, fusion hooks).
* :mod:`tn.lower.schedule`: :func:`~tn.lower.schedule.plan` -> :class:`~tn.lower.schedule.Schedule`, the
  lowering units and programs of an IR (``print(exe.schedule)``), re-planned under vetoes when a unit fails.
* :mod:`tn.lower.emit`: :func:`~tn.lower.emit.emit` a schedule as programs, host steps and collective steps.
* :mod:`tn.lower.compiler`: :func:`compile_ir` -> :class:`NeuronExecutable`
  (plans and emits, vetoes and re-plans; binding, runs, profiles).
* :mod:`tn.lower.fusion`: the fusion planner (elementwise chains, row reductions and epilogues kept in SBUF),
  emitted by the tile engine :mod:`tn.lower.tile` and :mod:`tn.lower.epilogue`.
* lowerings by kind: ``elementwise``, ``matmul``, ``conv``, ``reduce``, ``shape``, ``index``, ``scan``;
  ``host`` (FFTs, linear algebra) refuses every call: those run on the host;
  ``collective``: collectives become steps on the core's collective engine (:class:`tn.lower.collective.CollectiveStep`).
* :mod:`tn.lower.testing`: :func:`check_lowering` for unit tests.

Importing this package registers every lowering on its :mod:`tn.ops` entry. The ``"neuron"`` backend of
:func:`tn.jit` is :func:`compile_ir`, registered from above (``tn.jit`` imports this package the first time
the backend is asked for): the compiler never imports a door.
"""
import importlib as _importlib

from .base import CannotLower, LowerCtx, lowering
from .compiler import ExecProfile, NeuronExecutable, StepTiming, compile_ir

__all__ = ["CannotLower", "LowerCtx", "lowering", "compile_ir", "NeuronExecutable", "ExecProfile", "StepTiming",
           "LOWERING_MODULES", "loaded_modules"]

#: Modules holding lowerings, imported in this order (a module that does not exist yet is skipped).
LOWERING_MODULES = ("elementwise", "matmul", "conv", "reduce", "shape", "index", "scan", "host", "collective")

_loaded = []
for _name in LOWERING_MODULES:
    try:
        _importlib.import_module(f"{__name__}.{_name}")
    except ModuleNotFoundError as _e:
        if _e.name != f"{__name__}.{_name}":
            raise
    else:
        _loaded.append(_name)


def loaded_modules():
    """Names of the lowering modules that were found and imported."""
    return list(_loaded)


