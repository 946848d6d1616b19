# The compiler's middle stage: which lowering unit computes each stretch of an IR, printed like the IR.
"""The schedule: what the compiler decided before it emits an instruction.

Every stage of tn can be printed: ``print(ir)`` (the equations),
``print(exe.schedule)`` (this module: how the equations are cut into
lowering units and programs), ``enc.listing()`` (a program's instructions).

:func:`plan` ``(ir, vetoes, fuse=, laid_out=) -> Schedule`` merges the
planners' output (:mod:`tn.lower.prologue`, :mod:`tn.lower.fusion`,
:mod:`tn.lower.attention`, :mod:`tn.lower.chain`, the transposed matmul
operands and the SBUF hand-off) into a list of :class:`Unit`\\ s. A unit is a
stretch of consecutive equations lowered by one call: a fused map or row group,
a matmul/conv/reduction with its epilogue, a Linear chain, an attention, one
equation's own lowering, a host equation, a collective step, or a zero-size
equation folded at compile time. It says which values it keeps in SBUF for
later units and which it takes from there, which matmul operands it reads
transposed (skipping their permutes) or through a prologue, where a
prologue's vectors are loaded, and which values are dead after it. Units are
numbered into programs: a host equation or a collective ends the program.

The compiler (:func:`tn.lower.emit.emit`, driven by :class:`tn.lower.compiler.NeuronExecutable`) emits the
schedule. When a unit cannot be emitted as planned it raises
:class:`UnitFailed` with a :class:`Veto`: run equation ``k`` on the host, do not
fuse from ``k``, store value ``v`` to HBM instead of handing it off in SBUF, or
do not apply the prologue of operand ``v``. The veto joins :class:`Vetoes` and
the compiler plans again (every planner reads the vetoes), until a schedule
emits; the schedule it keeps lists the vetoes that shaped it.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ..ir import IR, Eqn, Literal, Var
from ..ops import OPS
from . import attention, chain, collective, fusion, prologue
from .base import NEURON_DTYPES, dataflow, handoff_shape
from .epilogue import EpilogueGroup
from .fusion import Group
from .matmul import transposed_source as find_transposed_source

__all__ = ["Schedule", "Unit", "Veto", "Vetoes", "UnitFailed", "LaidOutOperand", "plan", "plan_transposed",
           "hoist_gathers", "hoist_past_weight_casts", "sink_head_splits", "sink_casts_past_views", "row_any_from_max",
           "host_reason", "has_zero_size", "unit_label", "unit_kind", "program_name", "ZERO_SIZE_REASON"]


class Veto:
    """One thing a failed unit rules out for the next plan.

    ``kind``: ``"host"`` (equation ``at`` runs on the host), ``"nofuse"`` (no fused group starts at ``at``;
    the equation is lowered on its own), ``"no_handoff"`` (``var`` is stored to HBM, not left in SBUF) or
    ``"no_prologue"`` (matmul operand ``var`` is computed by its equations, not by a prologue). ``reason``
    says why the unit failed.
    """

    __slots__ = ("kind", "at", "reason", "var")

    KINDS = ("host", "nofuse", "no_handoff", "no_prologue")

    def __init__(self, kind: str, at: int, reason: str, var: Any = None):
        assert kind in self.KINDS, kind
        self.kind = kind
        self.at = at
        self.reason = reason
        self.var = var

    def __repr__(self) -> str:
        what = f" {self.var.aval}" if self.var is not None else ""
        return f"<Veto {self.kind}{what} at equation {self.at}: {self.reason}>"


class UnitFailed(Exception):
    """A unit could not be emitted as scheduled; ``veto`` says what the next plan must avoid."""

    def __init__(self, veto: Veto):
        super().__init__(veto.reason)
        self.veto = veto


class Vetoes:
    """What the planners must avoid: host equations (index -> reason; starts with the collectives, which end
    programs), equations no fused group starts at, values not handed off in SBUF, operands without prologue.

    ``history`` lists the :class:`Veto`\\ s added, in order (the collectives' entries are not vetoes).
    """

    def __init__(self, host: Optional[Dict[int, str]] = None):
        self.host: Dict[int, str] = dict(host or {})
        self.nofuse: Set[int] = set()
        self.no_handoff: Set[Var] = set()
        self.no_prologue: Set[Var] = set()
        self.history: List[Veto] = []

    def add(self, veto: Veto) -> None:
        """Record ``veto`` (the next :func:`plan` obeys it)."""
        self.history.append(veto)
        if veto.kind == "host":
            self.host[veto.at] = veto.reason
        elif veto.kind == "nofuse":
            self.nofuse.add(veto.at)
        elif veto.kind == "no_handoff":
            self.no_handoff.add(veto.var)
        else:
            self.no_prologue.add(veto.var)


class LaidOutOperand:
    """A matmul's B operand read from a weight's cached layout (extra input ``var``, :class:`BLayout` ``layout``)."""

    __slots__ = ("var", "layout")

    def __init__(self, var: Var, layout: Any):
        self.var = var
        self.layout = layout


class Unit:
    """Equations ``start .. stop-1`` lowered by one call (see the module docstring).

    Attributes:
        start, stop: the equation range (a unit's skipped equations, below, lie outside it).
        kind: ``map`` / ``row`` (a fused group without / with row reductions), ``epilogue`` (a matmul, conv,
            reduction or pool with the elementwise chain applied in its stores), ``chain`` (Linear layers),
            ``attention``, ``op`` (one equation's own lowering), ``host``, ``collective``, ``folded``
            (zero-size results computed at compile time).
        label: what it computes in a word or two (:func:`unit_label`; program names are made of these).
        group: the planner's object (``fusion.Group``, ``epilogue.EpilogueGroup``, ``chain.LinearChain``,
            ``attention.AttentionGroup``) or None.
        program: index of the executable's step (program, host or collective step) it belongs to; None for
            a folded unit.
        keeps: values it leaves in SBUF for later units of its program (never written to HBM).
        takes: values it reads from SBUF (left there by an earlier unit).
        prologues: ``{matmul operand: tn.lower.prologue.Prologue}`` it applies while reading the operand.
        preloads: prologues whose per-feature vectors are loaded when it starts.
        transposed: ``(operand index, source Var, dims or None)`` of matmul operands read transposed, or
            ``(1, weight Var, "layout")`` for a weight read from its cached layout.
        skipped: equations not lowered because this unit reads around them (a permute read transposed, a
            prologue's equations).
        frees: values whose last reader is this unit (dead after it).
        reason: why a host unit runs on the host.
        folded: a folded unit's result tensors.
    """

    __slots__ = ("start", "stop", "kind", "label", "group", "program", "keeps", "takes", "prologues", "preloads",
                 "transposed", "skipped", "frees", "reason", "folded")

    def __init__(self, start: int, stop: int, kind: str, label: str, group: Any = None):
        self.start = start
        self.stop = stop
        self.kind = kind
        self.label = label
        self.group = group
        self.program: Optional[int] = None
        self.keeps: List[Var] = []
        self.takes: List[Var] = []
        self.prologues: Dict[Var, Any] = {}
        self.preloads: List[Any] = []
        self.transposed: List[Tuple[int, Var, Any]] = []
        self.skipped: List[int] = []
        self.frees: List[Var] = []
        self.reason: Optional[str] = None
        self.folded: Optional[List[torch.Tensor]] = None

    @property
    def eqns(self) -> range:
        """The equation indices of the unit."""
        return range(self.start, self.stop)

    def __repr__(self) -> str:
        return f"<Unit {self.kind} {self.label} eqns {self.start}..{self.stop - 1}>"


class Schedule:
    """The units of an IR in order, the plan behind them, and the vetoes that shaped it.

    Attributes:
        ir: the IR scheduled.
        units: :class:`Unit`\\ s in equation order.
        vetoes: the :class:`Vetoes` the plan obeyed.
        builds: how many plans were made before this one emitted (1 when the first did).
        program_names: step index -> program name, filled in when the programs are emitted.
        groups: ``{first equation: planner group}`` (fused groups, epilogues, chains, attentions).
        prologues: ``{matmul operand: Prologue}``; ``prologue_eqns`` the equations they replace.
        transposed: ``{matmul equation: (A source, B source)}``, each ``(Var, dims)``, a
            :class:`LaidOutOperand` or None; ``elided`` the permutes (and reshapes, converts) read around.
        handoff: ``{value: (producer unit start, consumer unit starts)}`` of the SBUF hand-offs.
        preload_at: ``{unit start: [Prologue]}`` where prologue vectors are loaded.
        bias_casts: ``{bias Var: (convert equation, source Var)}``: a matmul epilogue's bias made by casting a
            program input (``nn.Linear``'s bias under autocast), which the matmul loads and rounds on chip
            (the convert is in ``elided``, the source is read instead).
        last_use: ``{value: index of the last equation reading it}`` (``len(ir.eqns)`` for results).
    """

    def __init__(self, ir: IR, vetoes: Vetoes):
        self.ir = ir
        self.vetoes = vetoes
        self.units: List[Unit] = []
        self.builds = 1
        self.program_names: Dict[int, str] = {}
        self.groups: Dict[int, Any] = {}
        self.prologues: Dict[Var, Any] = {}
        self.prologue_eqns: Set[int] = set()
        self.transposed: Dict[int, Any] = {}
        self.elided: Set[int] = set()
        self.handoff: Dict[Var, Any] = {}
        self.preload_at: Dict[int, List[Any]] = {}
        self.bias_casts: Dict[Var, Tuple[int, Var]] = {}
        self.last_use: Dict[Var, int] = {}
        #: equations not lowered because a unit reads around them, in order
        self.skipped: List[int] = []

    def unit_at(self, k: int) -> Optional[Unit]:
        """The unit starting at equation ``k`` (None if none does)."""
        for u in self.units:
            if u.start == k:
                return u
        return None

    def split_epilogue(self, unit: Unit) -> List[Unit]:
        """The emitter found that ``unit``'s head lowering never stored through its epilogue: the head becomes
        a unit of its own (keeping its label) and each equation of the chain one ``op`` unit. Returns the
        units now covering ``unit``'s equations."""
        i = self.units.index(unit)
        head = Unit(unit.start, unit.start + 1, "op", unit.label)
        for name in ("program", "takes", "prologues", "preloads", "transposed", "skipped"):
            setattr(head, name, getattr(unit, name))
        rest = [Unit(j, j + 1, "op", self.ir.eqns[j].op.name) for j in range(unit.start + 1, unit.stop)]
        self.units[i:i + 1] = [head] + rest
        return [head] + rest

    def programs(self) -> Dict[int, List[Unit]]:
        """Step index -> its units (a program's lowered units, or the one host / collective unit)."""
        out: Dict[int, List[Unit]] = {}
        for u in self.units:
            if u.program is not None:
                out.setdefault(u.program, []).append(u)
        return out

    def outputs_of(self, unit: Unit) -> List[Var]:
        """The values ``unit`` makes for later units or the results (a group's outputs, an equation's outputs)."""
        group = unit.group
        if group is not None and unit.kind != "op":
            return list(group.outputs)
        return [v for j in unit.eqns for v in self.ir.eqns[j].outputs]

    def pretty(self) -> str:
        """The schedule as text: one line per unit under its program, values named as ``print(ir)`` names them."""
        names = self.ir.var_names()

        def name(v: Any) -> str:
            return names.get(v, "?") if isinstance(v, Var) else repr(v)

        def names_of(vs: Sequence[Any]) -> str:
            return " ".join(name(v) for v in vs)

        def ranges(ks: Sequence[int]) -> str:
            out: List[str] = []
            for k in ks:
                if out and out[-1][1] == k - 1:
                    out[-1][1] = k
                else:
                    out.append([k, k])
            return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)

        programs = self.programs()
        nprog = sum(1 for us in programs.values() if us[0].kind not in ("host", "collective"))
        lines = [f"schedule of {self.ir.name or 'tn'}: {len(self.ir.eqns)} equations in {len(self.units)} "
                 f"unit{'s' * (len(self.units) != 1)}, {nprog} program{'s' * (nprog != 1)}, {self.builds} "
                 f"build{'s' * (self.builds != 1)}"]
        current = None
        for u in self.units:
            if u.program is not None and u.program != current:
                current = u.program
                if u.kind in ("host", "collective"):
                    lines.append(f"  step {u.program}: {u.kind}")
                else:
                    lines.append(f"  program {u.program}: {self.program_names.get(u.program, '')}".rstrip())
            notes = []
            if u.kind == "host":
                notes.append(u.reason or "")
            for i, src, dims in u.transposed:
                operand = "A" if i == 0 else "B"
                notes.append(f"{operand} = layout {name(src)}" if dims == "layout" else f"{operand} = {name(src)}^T")
            for a, p in u.prologues.items():
                notes.append(f"{name(a)} = prologue({name(p.src)})")
            for p in u.preloads:
                notes.append(f"loads prologue({name(p.src)}) vectors")
            bias = getattr(u.group, "bias", None) if u.kind == "epilogue" else None
            if bias is not None and bias[0] in self.bias_casts:
                notes.append(f"{name(bias[0])} = cast of {name(self.bias_casts[bias[0]][1])} on chip")
            if u.takes:
                notes.append(f"takes {names_of(u.takes)} from SBUF")
            if u.keeps:
                notes.append(f"keeps {names_of(u.keeps)} in SBUF")
            if u.skipped:
                notes.append(f"skips {ranges(u.skipped)}")
            if u.frees:
                notes.append(f"frees {names_of(u.frees)}")
            eqns = ranges([u.start]) if u.stop == u.start + 1 else f"{u.start}-{u.stop - 1}"
            line = f"    {eqns:>7}  {u.kind:<10} {u.label:<13} -> {names_of(self.outputs_of(u)):<6}  " + "; ".join(notes)
            lines.append(line.rstrip())
        if self.vetoes.history:
            lines.append("  vetoes:")
            for v in self.vetoes.history:
                what = f" {name(v.var)}" if v.var is not None else ""
                lines.append(f"    {v.kind}{what} at {v.at}: {v.reason}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.pretty()

    def __repr__(self) -> str:
        return f"<tn.lower.Schedule {len(self.units)} units, {len(self.vetoes.history)} vetoes>"


# --------------------------------------------------------------------------- names


def _moves_data(label: str) -> bool:
    """Whether a unit label is an op that only moves, reshapes or converts data (category ``shape``, ``convert``):
    a program's name leaves those out when it holds anything else."""
    op = OPS.get(label)
    return op is not None and (op.category == "shape" or op.name == "convert")


def unit_label(group: Any, eqn: Eqn) -> str:
    """What one lowering unit computes, in a word or two, for program names: ``attention``, ``mlp`` (a Linear
    chain of several layers) or ``linear``, ``matmul+gelu`` (a matmul and its fused epilogue), ``softmax`` /
    ``norm`` / ``sum`` (a fused row group by its reductions), ``mul+add`` or ``elementwise`` (a fused map of at
    most two ops, or more), else the op."""
    if isinstance(group, attention.AttentionGroup):
        return "attention"
    if isinstance(group, chain.LinearChain):
        return "mlp" if len(group.layers) > 1 else "linear"
    if isinstance(group, EpilogueGroup):
        tail = [e.op.name for e in group.eqns if e.op.category == "elementwise" and not _moves_data(e.op.name)
                and e.op.name not in ("add", "mul", "sub", "div")]
        return "+".join([eqn.op.name] + tail[:1])
    if isinstance(group, Group):
        names = {e.op.name for e in group.eqns}
        reductions = [e.op.name for e in group.eqns if e.op.category == "reduction"]
        if "exp" in names and reductions and ("div" in names or "reciprocal" in names):
            return "softmax"
        if "rsqrt" in names and reductions:
            return "norm"
        if reductions:
            return reductions[0]
        ops = list(dict.fromkeys(e.op.name for e in group.eqns if not _moves_data(e.op.name)))
        return "+".join(ops) if 0 < len(ops) <= 2 else "elementwise"
    return eqn.op.name


def unit_kind(group: Any) -> str:
    """The :attr:`Unit.kind` of a planner group (``op`` for None: one equation's own lowering)."""
    if isinstance(group, attention.AttentionGroup):
        return "attention"
    if isinstance(group, chain.LinearChain):
        return "chain"
    if isinstance(group, EpilogueGroup):
        return "epilogue"
    if isinstance(group, Group):
        return "row" if group.r else "map"
    return "op"


def program_name(prefix: Optional[str], index: int, labels: Sequence[str]) -> str:
    """``{prefix}_{index}_{what}``: the door's name for the code (the jitted function or module, ``tn`` when
    none), the program's place in the executable, and the distinct unit labels in order (data movement left out
    when anything else is there; at most three, then ``+N``), e.g. ``GPT2Block_0_norm+attention+linear+2``."""
    seen: List[str] = []
    for lab in labels:
        if lab not in seen:
            seen.append(lab)
    compute = [lab for lab in seen if not _moves_data(lab)]
    shown = compute or seen
    what = "+".join(shown[:3]) + (f"+{len(shown) - 3}" if len(shown) > 3 else "")
    return f"{prefix or 'tn'}_{index}_{what}" if what else f"{prefix or 'tn'}_{index}"


# --------------------------------------------------------------------------- planning


def host_reason(eqn: Eqn) -> Optional[str]:
    """Why ``eqn`` cannot run on the NeuronCore at all (no lowering, a dtype the chip lacks), else None."""
    if eqn.op.lowering is None:
        return "no lowering is registered for this op"
    for v in list(eqn.inputs) + list(eqn.outputs):
        if isinstance(v, Var) and v.dtype not in NEURON_DTYPES:
            return f"dtype {v.dtype} has no NeuronCore equivalent"
    return None


def fold_empty(eqn: Eqn) -> Optional[List[torch.Tensor]]:
    """Results of an equation whose outputs are all empty, or whose tensor inputs are all empty
    (then the results do not depend on any data: computed once, at compile time). None otherwise."""
    if all(v.numel == 0 for v in eqn.outputs):
        return [torch.empty(v.shape, dtype=v.dtype) for v in eqn.outputs]
    vins = [a for a in eqn.inputs if isinstance(a, Var)]
    if not vins or any(a.numel != 0 for a in vins) or eqn.op.random:
        return None
    args = [a.value if isinstance(a, Literal) else torch.empty(a.shape, dtype=a.dtype) for a in eqn.inputs]
    try:
        r = eqn.op.impl(*args, **eqn.attrs)
    except Exception:
        return None
    r = [r] if isinstance(r, torch.Tensor) else list(r)
    if len(r) != len(eqn.outputs):
        return None
    return [t.to(v.dtype).reshape(v.shape).contiguous() for t, v in zip(r, eqn.outputs)]


def has_zero_size(eqn: Eqn) -> bool:
    """Whether an operand or result of ``eqn`` has no elements (folded at compile time, or run on the host)."""
    return any(v.numel == 0 for v in eqn.outputs) or any(isinstance(a, Var) and a.numel == 0 for a in eqn.inputs)


#: Why a zero-size equation that cannot be folded runs on the host.
ZERO_SIZE_REASON = "an operand has no elements (zero-size tensors are not sent to the chip)"


def plan_transposed(ir: IR, host: Dict[int, str], nofuse: Set[int] = frozenset(),
                    laid_out: Optional[Dict[Var, Any]] = None, skip: Any = ()) -> Tuple[set, Dict[int, Any]]:
    """Matmuls whose operand is a permute of the last two axes used only there: read the source
    transposed (``tn.lower.matmul.lower_matmul_transposed``) and skip the permute (and reshape).

    Returns ``(elided equations, {matmul equation: (A source, B source)})``; a source is ``(X, dims)``, a
    :class:`LaidOutOperand` (a weight of ``laid_out`` read from its cached layout) or None.
    """
    laid_out = laid_out or {}
    producer, users, outset = dataflow(ir)
    elide: set = set()
    trans: Dict[int, Any] = {}
    for k, e in enumerate(ir.eqns):
        if e.op.name != "matmul" or k in host or e.op.lowering is None or k in nofuse or k in skip:
            continue
        srcs: List[Any] = [None, None]
        chains: List[List[int]] = []
        for i in (0, 1):
            v = e.inputs[i]
            if not isinstance(v, Var) or v.numel == 0:
                continue
            try:
                found = find_transposed_source(v, lambda u: ir.eqns[producer[u]] if u in producer else None)
            except Exception:
                found = None
            # (X, dims): the operand transposed is X.permute(dims); a bare X means dims = identity
            x, dims = found if isinstance(found, tuple) else (found, None)
            if x is None or not isinstance(x, Var) or x.numel == 0:
                continue
            if dims is not None and len(dims) and int(dims[-1]) != x.ndim - 1 and x.shape[-1] != 1:
                # the transposed view would be read element by element (innermost axis strided):
                # materialising the permute once is cheaper
                continue
            chain = []
            u = v
            ok = True
            while u is not x:
                j = producer.get(u)
                if j is None or j in host or u in outset or set(users.get(u, ())) != {chain[-1] if chain else k}:
                    ok = False
                    break
                chain.append(j)
                u = ir.eqns[j].inputs[0]
            if ok and chain:
                srcs[i] = (x, dims)
                if i == 1 and x in laid_out and tuple(dims or (0, 1)) == (0, 1):
                    srcs[i] = LaidOutOperand(*laid_out[x])     # the weight's cached layout
                chains.append(chain)
        if srcs[0] is None and srcs[1] is None:
            continue
        trans[k] = (srcs[0], srcs[1])
        for c in chains:
            elide.update(c)
    return elide, trans


def _unit_starts(n: int, groups: Any) -> Dict[int, int]:
    """Equation index -> index of the equation where its lowering unit (fused group, epilogue, chain) starts."""
    unit: Dict[int, int] = {}
    k = 0
    while k < n:
        g = (groups or {}).get(k)
        span = 1
        if isinstance(g, EpilogueGroup):
            span = 1 + len(g.eqns)
        elif isinstance(g, Group):
            span = len(g.eqns)
        for j in range(k, k + span):
            unit[j] = k
        k += span
    return unit


def _plan_preloads(ir: IR, host: Dict[int, str], groups: Any, pros: Dict[Var, Any]) -> Dict[int, List[Any]]:
    """Where each prologue's per-feature vectors are loaded: the unit producing its source (so they arrive
    while the source is computed), or its consumer's unit when a host equation lies in between."""
    if not pros:
        return {}
    producer, users, _ = dataflow(ir)
    unit = _unit_starts(len(ir.eqns), groups)
    at: Dict[int, List[Any]] = {}
    for a, p in pros.items():
        cons = unit.get(users[a][0], users[a][0])
        j = producer.get(p.src)
        k = cons if j is None else unit.get(j, j)
        if any(k <= h <= cons for h in host):
            k = cons
        at.setdefault(k, []).append(p)
    return at


def _plan_handoff(ir: IR, host: Dict[int, str], groups: Any, elide: set, trans: Dict[int, Any],
                  pros: Optional[Dict[Var, Any]], no_handoff: Set[Var]) -> Dict[Var, Any]:
    """Values left in SBUF by their producer for the next lowerings (``LowerCtx.publish``/``take``).

    A value qualifies when its producer is a fused group, an attention group or a matmul epilogue
    (lowerings that can publish a whole value), every consumer is a lowering that can read it from SBUF
    (a fused group reading it as an input, a Linear chain's input, an attention group's q/k/v source, a
    matmul's row-major A operand, or a reshape lowered on its own that only regroups the leading axes and
    whose result is handed off in turn: it passes the tile on, e.g. a Linear's ``[1, S, F]`` output
    reshaped to the next Linear's ``[S, F]`` rows) in the same program, it is not a program result, and it fits in one
    SBUF tile (rows = all axes but the last <= 128, <= 16 KiB per partition). Returns
    ``{var: (producer unit, consumer units)}``; units are equation indices where a lowering starts.
    """
    n = len(ir.eqns)
    unit = _unit_starts(n, groups)
    _, users, outset = dataflow(ir)
    # a prologue's equations belong to its consumer's unit, which reads the prologue's source
    pro_unit: Dict[int, int] = {}
    for a, p in (pros or {}).items():
        c = unit.get(users[a][0], users[a][0])
        for j in p.eqns:
            pro_unit[j] = c
    host_idx = sorted(host)
    pending: Dict[Var, Tuple[int, set]] = {}    # values whose consumers include a pass-through reshape

    def reshape_unit(u: int) -> bool:
        # a reshape lowered on its own that only regroups the leading axes: it can pass an SBUF value through
        e = ir.eqns[u]
        return e.op.name == "reshape" and unit.get(u) == u and (groups or {}).get(u) is None and \
            u not in host and u not in elide and isinstance(e.inputs[0], Var) and len(e.outputs) == 1 and \
            e.outputs[0] not in outset and handoff_shape(e.outputs[0]) == handoff_shape(e.inputs[0])

    def consumers(v: Var, k: int) -> Optional[set]:
        """The consumer units of ``v`` made by the unit at ``k`` when every one can read it from SBUF."""
        if v in outset or v in no_handoff or v.dtype not in NEURON_DTYPES or v.dtype == torch.int64:
            return None
        rows, cols = handoff_shape(v)
        isz = torch.empty((), dtype=v.dtype).element_size()
        if rows > 128 or cols * isz > 16 * 1024 or not users.get(v):
            return None
        cons = set()
        for u in users[v]:
            if u in pro_unit:
                if pro_unit[u] == k:
                    return None
                cons.add(pro_unit[u])
                continue
            c = unit.get(u)
            if c is None or c == k or u in elide:
                return None
            cg = (groups or {}).get(c)
            e = ir.eqns[c]
            if isinstance(cg, chain.LinearChain):
                ok = cg.layers[0].a is v and u == ir.eqns.index(cg.layers[0].mm, c)
            elif isinstance(cg, attention.AttentionGroup):
                ok = v in cg.bases
            elif isinstance(cg, EpilogueGroup) or (cg is None and e.op.name == "matmul"):
                ok = u == c and e.op.name == "matmul" and e.inputs[0] is v and e.inputs[1] is not v and \
                    v.ndim == 2 and (c not in trans or trans[c][0] is None) and \
                    not (isinstance(cg, EpilogueGroup) and v in cg.inputs)
            elif type(cg) is Group:
                ok = v in cg.inputs
            else:
                ok = reshape_unit(c)
            if not ok:
                return None
            cons.add(c)
        if not cons:
            return None
        last = max(max(users[v]), max(cons))
        if any(k < h <= last for h in host_idx):
            return None
        return cons

    plan: Dict[Var, Any] = {}
    for k, g in (groups or {}).items():
        if isinstance(g, chain.LinearChain):
            continue
        if isinstance(g, EpilogueGroup):
            produced = [v for v in g.outputs]
        elif isinstance(g, Group):
            produced = list(g.outputs)
        else:
            continue
        for v in produced:
            cons = consumers(v, k)
            if cons is None:
                continue
            if any(reshape_unit(c) for c in cons):
                pending[v] = (k, cons)
            else:
                plan[v] = (k, cons)
    # a value read by a pass-through reshape is handed off only when the reshape's result is too (the reshape
    # then moves nothing: it publishes the same tile, as it would alias the HBM buffer)
    # a row gather lowered on its own (``index``: an embedding lookup) whose rows fill one tile gathers them
    # straight into the tile it hands off (tn.lower.index.row_gather), for fused groups to read
    for k, e in enumerate(ir.eqns):
        if e.op.name != "index" or unit.get(k) != k or (groups or {}).get(k) is not None or k in host or \
                k in elide or len(e.outputs) != 1:
            continue
        v = e.outputs[0]
        cons = consumers(v, k)
        if cons is not None and all(type((groups or {}).get(c)) is Group for c in cons):
            plan[v] = (k, cons)
    for v, (k, cons) in pending.items():
        passed = {}
        for c in cons:
            if reshape_unit(c):
                w = ir.eqns[c].outputs[0]
                wc = consumers(w, c)
                if wc is None or any(reshape_unit(x) for x in wc):
                    break
                passed[w] = (c, wc)
        else:
            plan[v] = (k, cons)
            plan.update(passed)
    return plan


def _hoist_each(ir: IR, movable, passable) -> IR:
    """``ir`` with every equation ``movable(e)`` moved up, in order, before the run of equations right before
    it that are ``passable`` and make nothing it reads (a new IR; ``ir`` itself when nothing moves)."""
    eqns = list(ir.eqns)
    moved = False
    for j in range(len(eqns)):
        e = eqns[j]
        if not movable(e):
            continue
        reads = {a for a in e.inputs if isinstance(a, Var)}
        i = j
        while i > 0 and passable(eqns[i - 1]) and not reads.intersection(eqns[i - 1].outputs):
            i -= 1
        if i < j:
            eqns[i + 1:j + 1] = eqns[i:j]
            eqns[i] = e
            moved = True
    if not moved:
        return ir
    return IR(ir.inputs, eqns, ir.outputs, ir.consts, ir.mutations, ir.name)


def hoist_gathers(ir: IR) -> IR:
    """``ir`` with every row gather (``index``: embedding lookups) moved up before the elementwise equations
    right before it that it does not read (a new IR; ``ir`` itself when nothing moves).

    Tracing keeps the user's order, e.g. BERT's embeddings ``word + token_type`` then the position lookup,
    then ``+ position`` and LayerNorm: the lookup between the two adds splits them into separate units, each
    storing its result to HBM. Hoisted, the adds and the norm form one row group whose inputs are the gathers,
    which can hand their rows over in SBUF (:func:`_plan_handoff`). A gather has no side effect and reads only
    values made before the equations it passes, so the result is unchanged."""
    return _hoist_each(ir, lambda e: e.op.name == "index", fusion._is_map)


def _weight_cast(e: Eqn, inputs: Set[Var]) -> bool:
    """Whether ``e`` casts a program input or constant (a weight's bf16 copy under autocast)."""
    return e.op.name == "convert" and isinstance(e.inputs[0], Var) and e.inputs[0] in inputs


def hoist_past_weight_casts(ir: IR) -> IR:
    """``ir`` with every elementwise equation (a fusion map op) and every reshape moved up before the casts of
    program inputs right before it that it does not read (a new IR; ``ir`` itself when nothing moves).

    Under autocast each Linear casts its weight and bias where it is called, so in BERT the casts of the FFN's
    weights sit between LayerNorm and the cast of its output to bf16: the cast was a map group of its own that
    read the fp32 norm back from HBM. Hoisted, it joins the norm's row group, which hands the bf16 rows to the
    matmul in SBUF. Likewise the reshape merging attention's head axes, traced after the o-projection's weight
    casts, follows the attention group, which then absorbs it and hands its output to the o-projection in SBUF.
    The casts read only program inputs, so moving other equations before them changes no value."""
    inputs = set(ir.inputs) | {v for v, _ in ir.consts}

    def movable(e: Eqn) -> bool:
        """An elementwise equation or a reshape of a value, not itself a weight cast."""
        return (fusion._is_map(e) or (e.op.name == "reshape" and isinstance(e.inputs[0], Var))) and \
            not _weight_cast(e, inputs)

    return _hoist_each(ir, movable, lambda e: _weight_cast(e, inputs))


#: how far (in equations) :func:`sink_head_splits` moves a permute down to its first reader
SINK_REACH = 64


def sink_head_splits(ir: IR) -> IR:
    """``ir`` with every head split (a ``permute`` of a ``reshape`` right before it that only it reads, of a
    computed value, not a view) moved down to just before the permute's first reader, when that is at most
    :data:`SINK_REACH` equations on (a new IR; ``ir`` itself when nothing moves).

    BERT splits the heads of q, k and v right after each projection (``reshape`` to ``[1, S, 12, 64]``,
    ``permute`` to ``[1, 12, S, 64]``), before the next projection: the attention planner
    (:mod:`tn.lower.attention`) takes only view chains inside its run of consecutive equations, so each split
    stayed a permute copy through HBM and the projections could not hand their rows over. Sunk next to the
    scores' matmul, the splits become the attention group's views of the projections' outputs, which the
    projections leave in SBUF. A view has no side effect and its inputs are made before the equations it
    passes, which do not read it, so no value changes."""
    eqns = list(ir.eqns)
    outs = {id(v) for v in ir.outputs if isinstance(v, Var)}
    made_by = {id(v): q.op.name for q in eqns for v in q.outputs}

    def first_reader(v: Var, start: int) -> Optional[int]:
        for k in range(start, min(len(eqns), start + SINK_REACH + 1)):
            if any(a is v for a in eqns[k].inputs):
                return k
        return None

    moved = False
    done: Set[int] = set()
    j = 0
    while j < len(eqns):
        e = eqns[j]
        if e.op.name != "permute" or not isinstance(e.inputs[0], Var) or len(e.outputs) != 1 or \
                id(e.outputs[0]) in outs or id(e) in done:      # (each moves once: two splits read together)
            j += 1
            continue
        dest = first_reader(e.outputs[0], j + 1)
        if dest is None or dest == j + 1:
            j += 1
            continue
        # only a head split: the reshape right before it, read by it alone, of a value computed (a projection),
        # not a view (GPT-2's split of the fused qkv: its views of slices are planned otherwise)
        r = eqns[j - 1] if j > 0 else None
        if r is None or r.op.name != "reshape" or len(r.outputs) != 1 or r.outputs[0] is not e.inputs[0] or \
                id(r.outputs[0]) in outs or not isinstance(r.inputs[0], Var) or \
                made_by.get(id(r.inputs[0]), "") in ("reshape", "permute", "slice", "") or \
                any(a is r.outputs[0] for q in eqns[j + 1:] for a in q.inputs):
            j += 1
            continue
        lo = j - 1
        block = eqns[lo:j + 1]
        eqns[lo:dest] = eqns[j + 1:dest] + block
        done.add(id(e))
        moved = True
        j = lo
    if not moved:
        return ir
    return IR(ir.inputs, eqns, ir.outputs, ir.consts, ir.mutations, ir.name)


def sink_casts_past_views(ir: IR) -> IR:
    """``ir`` with every float cast of a permute's result moved down past the view equations (reshape, permute,
    slice) right after it that do not read it (a new IR; ``ir`` itself when nothing moves).

    At batch > 1 BERT's head splits (``[B * S, 768]`` -> ``[B, S, 12, 64]`` -> ``[B, 12, S, 64]``) are not
    one strided view of the projection once attention merges batch and heads, so the attention planner
    (:mod:`tn.lower.attention`) cuts them: each stays a permute of its own. After :func:`sink_head_splits`
    each split's fp32 cast sits between it and the next split, and the attention group, one run of
    consecutive equations, could not reach past the next (cut) split to take the cast as its prologue: the
    cast was an equation of its own writing an fp32 copy of q, k or v to HBM for the group to read. Moved
    below the splits, the casts adjoin the group, which reads the bf16 splits and converts them on chip. A
    cast has no side effect and the views it passes neither read it nor make what it reads."""
    eqns = list(ir.eqns)
    made_by = {id(v): q.op.name for q in eqns for v in q.outputs}

    def cast_of_permute(e: Eqn) -> bool:
        x = e.inputs[0] if e.inputs else None
        return e.op.name == "convert" and len(e.outputs) == 1 and isinstance(x, Var) and \
            x.dtype.is_floating_point and e.outputs[0].dtype.is_floating_point and made_by.get(id(x)) == "permute"

    moved = False
    done: Set[int] = set()
    j = 0
    while j < len(eqns):
        e = eqns[j]
        if cast_of_permute(e) and id(e) not in done:
            done.add(id(e))     # each moves once (the casts of q, k and v pass each other)
            # the run of views and casts after it that do not read it; it moves below the run's last view and
            # the casts already moved right after that view (so the casts keep their order)
            end = j
            while end + 1 < len(eqns) and end - j < SINK_REACH and \
                    (eqns[end + 1].op.name in ("reshape", "permute", "slice") or cast_of_permute(eqns[end + 1])) and \
                    not any(a is e.outputs[0] for a in eqns[end + 1].inputs):
                end += 1
            i = max((q for q in range(j + 1, end + 1) if eqns[q].op.name != "convert"), default=j)
            while i > j and i + 1 <= end and id(eqns[i + 1]) in done:
                i += 1
            if i > j:
                eqns[j:i + 1] = eqns[j + 1:i + 1] + [e]
                moved = True
                continue        # eqns[j] is the next equation now
        j += 1
    if not moved:
        return ir
    return IR(ir.inputs, eqns, ir.outputs, ir.consts, ir.mutations, ir.name)


def _is_neg_inf(a: Any) -> bool:
    return isinstance(a, Literal) and isinstance(a.value, float) and a.value == float("-inf")


def row_any_from_max(ir: IR) -> IR:
    """``ir`` with softmax's all-masked-row check read off the row maximum (a new IR; ``ir`` itself when
    nothing matches).

    torch's ``_safe_softmax`` (scaled_dot_product_attention with a mask, as BERT and every HF encoder call it)
    zeroes the rows of ``x`` that are all ``-inf``: ``any(logical_not(eq(x, -inf)), dims, keepdim)``, two
    elementwise passes and a reduction over the whole score tensor beside the softmax's own ``amax(x, dims,
    keepdim)``. A row has an element other than ``-inf`` exactly when its maximum is not ``-inf`` (a NaN
    makes both true: ``NaN != -inf`` and the maximum propagates NaN), so the check becomes ``ne(amax, -inf)``
    on the row values, as a compiler's algebraic simplifier folds it. Taken when the equality and its negation
    are read only by that ``any`` (and are not results) and an ``amax`` of the same ``x`` over the same axes
    with ``keepdim`` comes before it."""
    producer, users, outset = dataflow(ir)
    eqns = list(ir.eqns)
    drop: Set[int] = set()
    for k, e in enumerate(eqns):
        if e.op.name != "any" or not e.attrs.get("keepdim") or not isinstance(e.inputs[0], Var):
            continue
        w = e.inputs[0]
        i = producer.get(w)
        if i is None or eqns[i].op.name != "logical_not" or users.get(w) != [k] or w in outset:
            continue
        v = eqns[i].inputs[0]
        h = producer.get(v) if isinstance(v, Var) else None
        if h is None or eqns[h].op.name != "eq" or users.get(v) != [i] or v in outset:
            continue
        x, lit = eqns[h].inputs
        if _is_neg_inf(x):
            x, lit = lit, x
        if not isinstance(x, Var) or not _is_neg_inf(lit) or not x.dtype.is_floating_point:
            continue
        dims = tuple(e.attrs.get("dims") or ())
        m = next((j for j in range(k) if eqns[j].op.name == "amax" and eqns[j].inputs[0] is x and
                  tuple(eqns[j].attrs.get("dims") or ()) == dims and eqns[j].attrs.get("keepdim")), None)
        if m is None:
            continue
        eqns[k] = Eqn(OPS["ne"], [eqns[m].outputs[0], lit], list(e.outputs), source=e.source)
        drop.update((h, i))
    if not drop:
        return ir
    return IR(ir.inputs, [e for j, e in enumerate(eqns) if j not in drop], ir.outputs, ir.consts, ir.mutations,
              ir.name)


def _plan_groups(ir: IR, vetoes: Vetoes, laid_out: Dict[Var, Any], sched: Schedule) -> None:
    """The planners' groups, prologues, transposed reads and hand-offs, merged into ``sched``."""
    host = vetoes.host
    # per-feature scale/shift of a matmul operand (LayerNorm's gamma/beta) applied by the matmul in its
    # operand's transposes (tn.lower.prologue): those equations are not lowered, groups end before them
    pros = prologue.plan(ir, host, vetoes.no_prologue)
    pro_eqns = {j for p in pros.values() for j in p.eqns}
    phost = {**host, **{j: "prologue" for j in pro_eqns}} if pro_eqns else host
    groups = fusion.plan(ir, phost, vetoes.nofuse)
    in_chain: set = set()
    # attention (tn.lower.attention) and Linear chains (tn.lower.chain) replace the groups and
    # transposed reads inside them
    found = dict(attention.plan(ir, phost, vetoes.nofuse))
    for k0, c in chain.plan(ir, phost, vetoes.nofuse, laid_out).items():
        if not any(k0 <= a < k0 + len(c.eqns) or a <= k0 < a + len(g.eqns) for a, g in found.items()):
            found[k0] = c
    for k0, c in sorted(found.items()):
        rng = range(k0, k0 + len(c.eqns))
        for kk in list(groups):
            if kk in rng:
                del groups[kk]
            elif kk < k0 and kk + len(groups[kk].eqns) + isinstance(groups[kk], EpilogueGroup) > k0:
                del groups[kk]     # a group or epilogue reaching into the chain
        groups[k0] = c
        in_chain.update(rng)
    elide, trans = plan_transposed(ir, host, vetoes.nofuse, laid_out, in_chain)
    if laid_out:
        # a weight's convert whose result the matmuls read from its cast layout (and nothing else reads)
        producer, users, _ = dataflow(ir)
        for x in laid_out:
            j = producer.get(x)
            if j is not None and j not in in_chain and all(u in elide or u in in_chain for u in users.get(x, ())):
                elide.add(j)
    for kk in [kk for kk, g in groups.items() if isinstance(g, (Group, EpilogueGroup))]:
        # a group holding a permute (or its reshape) that a matmul reads transposed instead would read a value
        # that is never made: its equations are lowered one by one
        first = kk + 1 if isinstance(groups[kk], EpilogueGroup) else kk
        if kk not in in_chain and any(j in elide for j in range(first, first + len(groups[kk].eqns))):
            del groups[kk]
    sched.bias_casts = _plan_bias_casts(ir, host, vetoes.nofuse, groups, elide)
    elide.update(j for j, _ in sched.bias_casts.values())
    sched.groups = groups
    sched.prologues = pros
    sched.prologue_eqns = pro_eqns
    sched.transposed = trans
    sched.elided = elide
    sched.handoff = _plan_handoff(ir, host, groups, elide, trans, pros, vetoes.no_handoff)
    sched.preload_at = _plan_preloads(ir, host, groups, pros)


def _plan_bias_casts(ir: IR, host: Dict[int, str], nofuse: Set[int], groups: Dict[int, Any],
                     elide: Set[int]) -> Dict[Var, Tuple[int, Var]]:
    """The matmul biases cast from an fp32 program input that the matmul loads and rounds itself.

    Under autocast ``nn.Linear`` casts its bias where it is called: ``b = convert(bias)`` then
    ``matmul(x, W^T) + b``. As an equation of its own the cast loads the fp32 bias, rounds it and stores the
    bf16 copy to HBM, and the matmul waits for that store before it reads the copy back (two DMA latencies on
    the critical path before the first matmul instruction, once per Linear per call). A matmul that adds its
    epilogue's bias in PSUM (:attr:`tn.lower.epilogue.EpilogueGroup.bias`) loads the fp32 row instead and
    rounds it on chip (the same rounding as the convert), so the convert is not lowered. Taken when the cast's
    result is read by that bias add alone, is not a result, and the convert is not fused elsewhere nor
    vetoed (``nofuse`` at the convert: the matmul did not add the bias)."""
    producer, users, outset = dataflow(ir)
    inputs = set(ir.inputs)
    covered: Set[int] = set()
    for kk, g in groups.items():
        covered.update(range(kk, kk + len(g.eqns) + isinstance(g, EpilogueGroup)))
    out: Dict[Var, Tuple[int, Var]] = {}
    for kk, g in groups.items():
        if not isinstance(g, EpilogueGroup) or g.bias is None or ir.eqns[kk].op.name != "matmul":
            continue
        b = g.bias[0]
        j = producer.get(b)
        if j is None or j in host or j in nofuse or j in elide or j in covered or b in outset or \
                users.get(b) != [kk + 1]:
            continue
        e = ir.eqns[j]
        src = e.inputs[0] if e.op.name == "convert" and len(e.inputs) == 1 else None
        if not isinstance(src, Var) or src not in inputs or src.dtype != torch.float32 or src.shape != b.shape or \
                b.dtype not in (torch.bfloat16, torch.float16):
            continue
        out[b] = (j, src)
    return out


def plan(ir: IR, vetoes: Vetoes, *, fuse: bool = True, laid_out: Optional[Dict[Var, Any]] = None) -> Schedule:
    """The :class:`Schedule` of ``ir`` under ``vetoes``: the planners' groups merged, then cut into units and
    programs. ``fuse=False`` plans one unit per equation (no groups, hand-offs, prologues or transposed reads);
    ``laid_out`` maps weights read from a cached layout to ``(extra input Var, BLayout)``
    (:mod:`tn.lower.layout`). Deterministic: the same IR and vetoes give the same schedule."""
    sched = Schedule(ir, vetoes)
    n = len(ir.eqns)
    for k, e in enumerate(ir.eqns):
        for a in e.inputs:
            if isinstance(a, Var):
                sched.last_use[a] = k
    for a in ir.outputs:
        if isinstance(a, Var):
            sched.last_use[a] = n
    if fuse:
        _plan_groups(ir, vetoes, dict(laid_out or {}), sched)
    groups, trans = sched.groups, sched.transposed
    consumers: Dict[int, List[Var]] = {}
    for v, (_, cons) in sched.handoff.items():
        for c in cons:
            consumers.setdefault(c, []).append(v)

    step = 0            # the executable's step a unit belongs to (programs, host and collective steps)
    open_program = False
    skipped: List[int] = []

    def between_programs(kind: str, reason: Optional[str] = None) -> None:
        """Equation ``k`` as a step of its own (a host equation, a collective): it ends the open program."""
        nonlocal step, open_program
        u = Unit(k, k + 1, kind, ir.eqns[k].op.name)
        u.reason = reason
        step += open_program
        open_program = False
        u.program = step
        step += 1
        sched.units.append(u)

    k = 0
    while k < n:
        eqn = ir.eqns[k]
        if collective.is_collective(eqn):
            between_programs("collective")
            k += 1
            continue
        if k in sched.elided or k in sched.prologue_eqns:
            skipped.append(k)
            sched.skipped.append(k)
            k += 1
            continue
        reason = None
        if has_zero_size(eqn):
            folded = fold_empty(eqn)
            if folded is not None:
                u = Unit(k, k + 1, "folded", eqn.op.name)
                u.folded = folded
                sched.units.append(u)
                k += 1
                continue
            reason = vetoes.host.get(k, ZERO_SIZE_REASON)
        reason = reason or vetoes.host.get(k) or host_reason(eqn)
        if reason is not None:
            between_programs("host", reason)
            k += 1
            continue
        group = groups.get(k)
        span = 1 + len(group.eqns) if isinstance(group, EpilogueGroup) else \
            len(group.eqns) if isinstance(group, Group) else 1
        u = Unit(k, k + span, unit_kind(group), unit_label(group, eqn), group)
        open_program = True
        u.program = step
        u.skipped, skipped = skipped, []
        u.takes = list(consumers.get(k, ()))
        outputs = group.outputs if isinstance(group, (Group, EpilogueGroup)) else ()
        u.keeps = [v for v in outputs if v in sched.handoff and sched.handoff[v][0] == k]
        unit_in = group.inputs if isinstance(group, Group) else eqn.inputs
        u.prologues = {a: sched.prologues[a] for a in unit_in if isinstance(a, Var) and a in sched.prologues}
        u.preloads = list(sched.preload_at.get(k, ()))
        t = trans.get(k)
        if t is not None:
            for i, src in enumerate(t):
                if isinstance(src, LaidOutOperand):
                    u.transposed.append((i, src.var, "layout"))
                elif src is not None:
                    u.transposed.append((i, src[0], src[1]))
        sched.units.append(u)
        k += span
    _note_frees(sched)
    return sched


def _note_frees(sched: Schedule) -> None:
    """Fill each unit's ``frees``: the values an earlier unit made (stored or left in SBUF; not results) whose
    last reader it is. Values made and used inside one fused unit never exist outside it and are not listed."""
    ir = sched.ir
    n = len(ir.eqns)
    owner: Dict[int, Unit] = {}
    for u in sched.units:
        for j in list(u.eqns) + u.skipped:
            owner[j] = u
    made: Dict[Var, Unit] = {}
    for u in sched.units:
        if u.kind not in ("folded",):
            for v in sched.outputs_of(u):
                made[v] = u
    for v, last in sched.last_use.items():
        u = owner.get(last)
        if last < n and u is not None and v in made and made[v] is not u:
            u.frees.append(v)
