# Collectives in compiled programs: each collective op becomes a step of the executable on the core's collective engine.
"""How the compiler runs the collective ops (:mod:`tn.ops.collective`).

A collective is not a stream of NeuronCore instructions: on Trainium it runs
on the chip's collective-communication cores, beside the engines. So the
compiler ends the current program before a collective equation and makes it
a :class:`CollectiveStep` of the :class:`~tn.lower.compiler.NeuronExecutable`
(programs before and after it are separate programs). When the executable
runs, a collective step calls :func:`tn.ops.collective.issue`: the bytes move
across the ranks over the group's transport, and the collective is placed on
the core's ``"collectives"`` resource after the work issued so far on the
current stream (:mod:`tn.distributed.compiled` decides how: the ``neuron``
backend's own clock for its groups). Its ``wait`` step is where the current
stream waits for the collective's modelled end, so programs between a
collective and its wait overlap it.

torch's tracers put ``wait_tensor`` right after the collective; the compiler
first moves each wait down to the first use of its result
(:func:`sink_waits`), so independent compute lands between them. A
collective whose result is read by anything other than a ``wait`` (or
returned directly) is waited for at once. :attr:`NeuronExecutable.last_profile`
lists the call's collectives (:class:`tn.ops.collective.CollectiveRun`).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ..ops.collective import COLLECTIVE_OPS, Pending, issue
from ..ir import IR, Eqn, Var
from .base import CannotLower, lowering

__all__ = ["CollectiveStep", "is_collective", "program_breaks", "make_step", "sink_waits"]


@lowering(*COLLECTIVE_OPS)
def _collective_engine(ctx, eqn, ins, outs):
    """Refuse as an instruction lowering: the compiler makes collectives steps of their own (:class:`CollectiveStep`)."""
    raise CannotLower(f"{eqn.op.name} runs on the collective engine as a step of the executable, not as "
                      f"NeuronCore instructions")


def is_collective(eqn: Eqn) -> bool:
    """Whether ``eqn`` is a collective op the compiler runs as a :class:`CollectiveStep`."""
    return eqn.op.category == "collective"


def program_breaks(ir: IR) -> Dict[int, str]:
    """``{equation index: reason}`` of the collective equations of ``ir``: the compiler's planners treat them as
    the ends of programs (no fused group, SBUF hand-off or prologue reaches across one)."""
    return {k: "a collective runs on the collective engine between programs"
            for k, e in enumerate(ir.eqns) if is_collective(e)}


def sink_waits(ir: IR) -> IR:
    """``ir`` with every ``wait`` moved down to just before the first equation that reads its result (to the end
    when only the outputs do): the programs between a collective and its wait overlap it. Collectives keep their
    order (every rank issues them alike); nothing else moves. Returns ``ir`` itself when nothing moves."""
    eqns = ir.eqns
    if not any(e.op.name == "wait" and is_collective(e) for e in eqns):
        return ir
    first_read: Dict[Var, int] = {}
    for k, e in enumerate(eqns):
        for a in e.inputs:
            if isinstance(a, Var) and a not in first_read:
                first_read[a] = k
    n = len(eqns)
    keys = []
    for k, e in enumerate(eqns):
        if e.op.name == "wait" and is_collective(e):
            keys.append((first_read.get(e.outputs[0], n) - 0.5, k))
        else:
            keys.append((float(k), k))
    order = [k for _, k in sorted(keys)]
    if order == list(range(n)):
        return ir
    return ir.replace(eqns=[eqns[k] for k in order])


class CollectiveStep:
    """A collective equation of a :class:`~tn.lower.compiler.NeuronExecutable`, run between its programs.

    Shaped like the compiler's host steps (``k``, ``impl``, ``ins``, ``attrs``, ``outs``, ``name``), so the
    executable's call loop runs it the same way: ``impl(*values, **attrs)`` issues the collective (or waits for
    one). ``waits_for`` (a ``wait`` step) is the collective step whose end it waits for; ``sync`` makes a
    collective wait for itself at once. ``pending`` is the collective in flight during a call; ``last`` the
    :class:`~tn.ops.collective.CollectiveRun` of the latest call.
    """

    __slots__ = ("k", "name", "is_wait", "ins", "attrs", "outs", "sync", "waits_for", "pending", "last")

    def __init__(self, k: int, eqn: Eqn, ins: List[Tuple[bool, Any]], outs: List[int], sync: bool,
                 waits_for: Optional["CollectiveStep"] = None):
        self.k = k
        self.name = eqn.op.name
        self.is_wait = eqn.op.name == "wait"
        self.ins = ins
        self.attrs = dict(eqn.attrs)
        self.outs = outs
        self.sync = sync
        self.waits_for = waits_for
        self.pending: Optional[Pending] = None
        self.last = None

    def impl(self, *args: Any, **attrs: Any) -> Any:
        """Issue the collective (its result is final; the modelled time is placed) or wait for it."""
        if self.is_wait:
            src = self.waits_for
            if src is not None and src.pending is not None:
                src.pending.wait()
                src.pending = None
            return args[0]
        pending = issue(self.name, args[0], attrs, timed=True)
        self.last = pending.run
        if self.sync:
            return pending.wait()
        self.pending = pending
        return pending.result

    def __repr__(self) -> str:
        return f"<CollectiveStep {self.name} eqn {self.k}, group {self.attrs.get('group')!r}>"


def make_step(k: int, eqn: Eqn, ins: List[Tuple[bool, Any]], outs: List[int], ir: IR,
              made_by: Dict[Var, CollectiveStep]) -> CollectiveStep:
    """The step of collective equation ``k`` of ``ir``; ``made_by`` maps Vars to the collective step that made
    them (filled here, read by the ``wait`` steps)."""
    if eqn.op.name == "wait":
        src = eqn.inputs[0]
        return CollectiveStep(k, eqn, ins, outs, sync=False,
                              waits_for=made_by.get(src) if isinstance(src, Var) else None)
    out = eqn.outputs[0]
    readers = [e for e in ir.eqns if any(a is out for a in e.inputs)]
    sync = any(a is out for a in ir.outputs) or any(e.op.name != "wait" for e in readers)
    step = CollectiveStep(k, eqn, ins, outs, sync=sync)
    made_by[out] = step
    return step
