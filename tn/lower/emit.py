# The compiler's last stage: a Schedule's units emitted as NeuronCore programs, host steps and collective steps.
"""Emit a :class:`tn.lower.schedule.Schedule`.

:func:`emit` walks the schedule's units in order. Each stretch of lowered
units becomes one :class:`tn.neuron.Program` (closed by a host unit, a
collective or the end): a unit's inputs are bound to HBM tensors of the
program (``hbm_in``: program inputs, or tensors made by an earlier unit of the
same program), its outputs get HBM tensors (``hbm_out``), and a value made in
the program and used later becomes a program output. A host unit becomes a
step running ``op.impl``, a collective a :class:`tn.lower.collective.CollectiveStep`,
a folded unit a constant. Every value gets a *slot* of the executable's value
list; a slot is freed after the last step reading it.

Before a unit's lowering runs, the emitter fills the
:class:`~tn.lower.base.UnitOrders` of the program's
:class:`~tn.lower.base.LowerCtx` (``ctx.unit``) with what the schedule planned
for the unit: the values to publish in SBUF (``publish``), the prologues
offered (``prologues``), an epilogue's store hook and PSUM bias; after it, the
emitter checks the lowering's answers (``taken``, ``bias_added``). When the
unit cannot be emitted so, the emitter
raises :class:`~tn.lower.schedule.UnitFailed` with the veto the next plan obeys
(:meth:`Emitter.unit_failures` is the one place that maps errors to vetoes).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..errors import CompileError, NeuronError, UnsupportedOpError
from ..ir import Eqn, Literal, Var
from ..neuron import HbmTensor, Program
from . import chain, collective, layout, matmul, prologue
from .base import NEURON_DTYPES, CannotLower, HandoffError, LowerCtx, handoff_shape
from .epilogue import EpilogueGroup
from .fusion import Group
from .schedule import ZERO_SIZE_REASON, LaidOutOperand, Schedule, Unit, UnitFailed, Veto, has_zero_size, program_name

__all__ = ["emit", "Emitted", "Emitter", "unsupported_error"]

log = logging.getLogger("tn")


def avals_of(eqn: Eqn) -> str:
    """``eqn``'s inputs as text (avals of Vars, values of Literals), for messages."""
    return ", ".join(a.aval if isinstance(a, Var) else f"{a.value!r}" for a in eqn.inputs)


def unsupported_error(eqn: Eqn, reason: str) -> UnsupportedOpError:
    """The strict mode error of an equation that would run on the host."""
    where = f" (from {eqn.source})" if eqn.source else ""
    return UnsupportedOpError(
        f"op {eqn.op.name!r} with inputs ({avals_of(eqn)}){where} cannot run on the NeuronCore: {reason}. "
        f"Strict mode is on (strict=True or TN_STRICT=1); turn it off to run this op on the host")


class _ProgStep:
    """One built program: its encoding and which value slots bind to which HBM tensors."""

    __slots__ = ("enc", "ins", "outs", "eqns", "flag", "call", "blank", "alloc")

    def __init__(self, enc: Any, ins: List[Tuple[int, int]], outs: List[Tuple[int, int, tuple, torch.dtype]],
                 eqns: List[int], flag: Optional[int] = None):
        self.enc = enc
        self.ins = ins      # (hbm index, slot)
        self.outs = outs    # (hbm index, slot, shape, dtype)
        self.eqns = eqns
        self.flag = flag    # hbm index of the range-check flag output, or None
        # the call path: the program's prepared entry, an all-unbound value list (scratch stays None: the
        # runtime allocates it) and the outputs as (hbm index, slot, torch.empty size arguments, dtype)
        self.call = enc.prepare_call()
        self.blank = [None] * len(enc.hbm)
        self.alloc = tuple((idx, slot, tuple(shape) if len(shape) else ((),), dtype)
                           for idx, slot, shape, dtype in outs)


class _HostStep:
    """One equation run on the host through ``op.impl``."""

    __slots__ = ("k", "impl", "ins", "attrs", "outs", "name")

    def __init__(self, k: int, eqn: Eqn, ins: List[Tuple[bool, Any]], outs: List[int]):
        self.k = k
        self.impl = eqn.op.impl
        self.ins = ins      # (is_slot, slot or literal value)
        self.attrs = eqn.attrs
        self.outs = outs
        self.name = eqn.op.name


class _OpenProgram:
    """The program being emitted: its builder and context, HBM tensors by value, the values it made, the
    (hbm index, slot) pairs of its inputs, its equations, the prologues bound, its unit labels."""

    def __init__(self, prog: Any):
        self.prog = prog
        self.ctx = LowerCtx(prog)
        self.hbm: Dict[Var, Any] = {}
        self.made: Dict[Var, Any] = {}
        self.ins: List[Tuple[int, int]] = []
        self.eqns: List[int] = []
        self.pro: Dict[Var, Any] = {}
        self.labels: List[str] = []


class Emitted:
    """What :func:`emit` made, the state a :class:`tn.lower.compiler.NeuronExecutable` runs.

    Attributes: ``steps`` (programs, host steps and collective steps in order), ``nslots`` (size of the value
    list), ``init`` (``(slot, tensor)`` of constants and folded results), ``in_slots`` (the IR inputs' slots),
    ``out`` (the IR outputs' slots, 0 for a literal), ``lit_outs`` (``(output index, value, dtype)``),
    ``frees`` (slots freed after each step), ``copy_outs`` (outputs that are inputs or constants: copied),
    ``host_counts`` (host equations per op), ``collective_steps`` (collectives, not waits),
    ``instructions``, ``fused`` (equations lowered inside fused units or read around).
    """

    def __init__(self, **fields: Any):
        self.__dict__.update(fields)


class Emitter:
    """Emits one schedule (:func:`emit`); its methods are the steps of that walk."""

    def __init__(self, sched: Schedule, *, name: Optional[str], arch: Any, strict: bool, debug: bool,
                 laid_out: Dict[Var, Any]):
        self.sched = sched
        self.ir = sched.ir
        self.name = name
        self.arch = arch
        self.strict = strict
        self.debug = debug
        self.laid_out = laid_out
        self.slot_of: Dict[Var, int] = {}
        self.nslots = 0
        self.init: List[Tuple[int, torch.Tensor]] = []
        self.steps: List[Any] = []
        self.cur: Optional[_OpenProgram] = None
        self.host_counts: Dict[str, int] = {}
        self.instructions = 0
        # equations not materialised (permutes read transposed, prologue equations) count as fused
        self.fused = len(sched.skipped)
        self.made_by: Dict[Var, Any] = {}
        self.pro_src = {a: p.src for a, p in sched.prologues.items()}
        self.consumers_of: Dict[int, List[Var]] = {}
        self.last_consumer: Dict[Var, int] = {}
        for v, (_, cons) in sched.handoff.items():
            for c in cons:
                self.consumers_of.setdefault(c, []).append(v)
            self.last_consumer[v] = max(cons)

    # ------------------------------------------------------------------ values
    def define(self, v: Var) -> int:
        """A new slot for value ``v``."""
        self.slot_of[v] = self.nslots
        self.nslots += 1
        return self.nslots - 1

    def hbm_in(self, v: Var) -> Any:
        """The open program's HBM tensor holding ``v`` (a program input the first time it is read)."""
        v = self.pro_src.get(v, v)   # a prologue's result is never made: its consumer reads the source
        cur = self.cur
        t = cur.hbm.get(v)
        if t is None:
            t = cur.prog.hbm(f"in{len(cur.hbm)}", v.shape or (1,), NEURON_DTYPES[v.dtype], kind="input")
            cur.hbm[v] = t
            cur.ins.append((t.index, self.slot_of[v]))
        return t

    def hbm_out(self, v: Var) -> Any:
        """A new HBM tensor of the open program for value ``v`` made by a unit (an output if used later)."""
        cur = self.cur
        t = cur.prog.hbm(f"v{len(cur.hbm)}", v.shape or (1,), NEURON_DTYPES[v.dtype], kind="scratch")
        cur.hbm[v] = t
        cur.made[v] = t
        self.define(v)
        return t

    def slot_args(self, eqn: Eqn) -> List[Tuple[bool, Any]]:
        """``(is_slot, slot or literal value)`` of ``eqn``'s inputs, for a host or collective step."""
        return [(False, a.value) if isinstance(a, Literal) else (True, self.slot_of[a]) for a in eqn.inputs]

    # ------------------------------------------------------------------ programs
    def open_program(self, k: int) -> None:
        """Start a program at unit ``k`` (named when it closes, after what it holds: :func:`program_name`)."""
        prog = Program(f"{self.name or 'tn'}_{len(self.steps)}", self.arch, record_sources=self.debug)
        self.cur = _OpenProgram(prog)
        self.cur.ctx.weights = self.weight_stream(prog, k)

    def close(self, end: int) -> None:
        """Finish the open program before equation ``end``: free what it holds, make the values used from
        ``end`` on its outputs, add the range-check flag, build and validate it."""
        cur = self.cur
        if cur is None:
            return
        prog, ctx = cur.prog, cur.ctx
        prog.name = program_name(self.name, len(self.steps), cur.labels)
        self.sched.program_names[len(self.steps)] = prog.name
        for b in cur.pro.values():
            b.free(prog)
        if ctx.weights is not None:
            ctx.weights.close()
        for t in {id(t): t for t in ctx.resident.values()}.values():
            prog.free(t)
        ctx.resident.clear()
        outs = []
        for v, t in cur.made.items():
            if self.sched.last_use.get(v, -1) >= end:
                t.kind = "output"
                outs.append((t.index, self.slot_of[v], v.shape, v.dtype))
        flag = None
        if ctx.flag_tile is not None:
            # range-check flag: max over partitions -> one int32 output
            ft = prog.hbm("_range_flag", (1,), "int32", kind="output")
            one = prog.sbuf((1, 1), "float32")
            prog.partition_reduce(one, ctx.flag_tile, "max")
            oi = prog.sbuf((1, 1), "int32")
            prog.tensor_copy(oi, one)
            prog.dma_copy(ft.view().reshape(1, 1), oi)
            for t in (oi, one, ctx.flag_tile):
                prog.free(t)
            ctx.flag_tile = None
            flag = ft.index
        try:
            enc = prog.build(check=True)
        except NeuronError as e:
            raise CompileError(f"tn.lower: program {prog.name!r} (equations {cur.eqns}) failed validation: {e}. "
                               f"This is a bug of a lowering") from e
        self.instructions += len(enc)
        self.steps.append(_ProgStep(enc, cur.ins, outs, cur.eqns, flag))
        self.cur = None

    def weight_stream(self, prog: Any, k0: int) -> Any:
        """The :class:`tn.lower.layout.WeightStream` of a program starting at equation ``k0``: the laid-out
        weight groups its Linear chains and single-row-tile matmuls will multiply by, in order (None if none)."""
        if not self.laid_out:
            return None
        sched = self.sched
        host, groups, trans = sched.vetoes.host, sched.groups, sched.transposed
        seq = []
        k = k0
        n = len(self.ir.eqns)
        while k < n and k not in host:
            g = groups.get(k)
            if isinstance(g, chain.LinearChain):
                for L in g.layers:
                    if L.w in self.laid_out:
                        var, lay = self.laid_out[L.w]
                        seq.extend((self.hbm_in(var), lay, j) for j in range(lay.NG))
                k += len(g.eqns)
                continue
            t = trans.get(k)
            if t is not None and isinstance(t[1], LaidOutOperand) and matmul.streams_weight(self.ir.eqns[k]):
                seq.extend((self.hbm_in(t[1].var), t[1].layout, j) for j in range(t[1].layout.NG))
            k += 1 + (len(g.eqns) if isinstance(g, EpilogueGroup) else 0)
        seq = [x for x in seq if x[1].dtype == (seq[0][1].dtype if seq else None)]
        if not seq:
            return None
        return layout.WeightStream(prog, seq, 128 * 1024)

    # ------------------------------------------------------------------ what a unit is offered
    def begin_unit(self, k: int, outputs: Sequence[Var]) -> None:
        """Tell the unit at ``k`` which of its outputs to leave in SBUF (the planned hand-offs)."""
        handoff = self.sched.handoff
        ctx = self.cur.ctx
        ctx.unit.publish = {v for v in outputs if v in handoff and handoff[v][0] == k}
        ctx.unit.taken = set()

    def end_unit(self, k: int) -> None:
        """After the unit at ``k``: it must have read every value handed to it in SBUF; free the SBUF values
        whose last consumer it was."""
        ctx = self.cur.ctx
        for v in self.consumers_of.get(k, ()):
            if v in ctx.resident and v not in ctx.unit.taken:
                raise UnitFailed(Veto("no_handoff", k, f"equation {k} did not read {v.aval} from SBUF", v))
        for v in list(ctx.resident):
            if self.last_consumer.get(v, -1) <= k and v not in ctx.unit.publish:
                t = ctx.resident.pop(v)
                if not any(o is t for o in ctx.resident.values()):     # a reshape may have passed it on
                    ctx.prog.free(t)
        ctx.unit.publish = set()

    def bind_prologues(self, inputs: List[Var]) -> None:
        """Offer the current unit the prologues of its inputs (``ctx.unit.prologues``: operand -> ``prologue.Bound``)."""
        cur, pros = self.cur, self.sched.prologues
        cur.ctx.unit.prologues = {}
        for a in inputs:
            p = pros.get(a)
            if p is None:
                continue
            b = cur.pro.get(a)
            if b is None:
                b = cur.pro[a] = prologue.Bound(p, None, {v: self.hbm_in(v) for v in p.vectors()})
            b.src_hbm = self.hbm_in(p.src)
            cur.ctx.unit.prologues[a] = b

    def preload_prologues(self, unit: Unit) -> None:
        """Load the per-feature vectors of the prologues the schedule loads at ``unit`` (before the producer
        of their source)."""
        for p in unit.preloads:
            b = self.cur.pro[p.out] = prologue.Bound(p, None, {v: self.hbm_in(v) for v in p.vectors()})
            b.preload(self.cur.prog)

    @staticmethod
    def prologue_failed(ctx: LowerCtx, k: int, err: Exception) -> None:
        """A unit offered a prologue failed: plan again without the prologue (its equations lowered as usual)."""
        for a, b in ctx.unit.prologues.items():
            ctx.unit.prologues = {}
            raise UnitFailed(Veto("no_prologue", k, f"with a prologue: {err}", a)) from None

    def prologues_done(self, k: int) -> None:
        """After a unit: every prologue offered must have been applied (else plan again without it); free its
        columns."""
        ctx = self.cur.ctx
        pros = ctx.unit.prologues
        ctx.unit.prologues = {}
        for a, b in pros.items():
            if not b.taken:
                raise UnitFailed(Veto("no_prologue", k, "the consumer did not apply the prologue", a))
            b.free(ctx.prog)
            self.cur.pro.pop(a, None)

    @contextlib.contextmanager
    def unit_failures(self, unit: Unit) -> Iterator[None]:
        """Turn a unit's lowering errors into the veto the next plan obeys: a hand-off not taken stores the value
        to HBM; a failed prologue is not applied; a fused group or epilogue that fails is not fused; an
        equation's own lowering that cannot handle the case (or emits an invalid instruction) goes to the host."""
        k = unit.start
        try:
            yield
        except HandoffError as e:
            raise UnitFailed(Veto("no_handoff", k, str(e), e.var)) from None
        except (CannotLower, NeuronError) as e:
            self.prologue_failed(self.cur.ctx, k, e)
            if unit.kind in ("map", "row", "chain", "attention"):
                raise UnitFailed(Veto("nofuse", k, f"fused group failed: {e}")) from None
            if isinstance(e, CannotLower):
                raise UnitFailed(Veto("host", k, str(e) or "the lowering cannot handle this case")) from None
            if unit.kind == "epilogue":
                raise UnitFailed(Veto("nofuse", k, f"fused epilogue failed: {e}")) from None
            eqn = self.ir.eqns[k]
            if self.strict:
                raise CompileError(f"tn.lower: the lowering of {eqn.op.name!r} ({avals_of(eqn)}) emitted an "
                                   f"invalid instruction: {e}") from e
            log.warning("tn.lower: lowering of %s (%s) failed (%s); running it on the host",
                        eqn.op.name, avals_of(eqn), e)
            raise UnitFailed(Veto("host", k, f"lowering error: {e}")) from None

    # ------------------------------------------------------------------ units
    def lower_one(self, k: int, eqn: Eqn, ins: list, outs: list) -> None:
        """Call ``eqn``'s lowering (a matmul reading transposed sources when planned so)."""
        ctx = self.cur.ctx
        t = self.sched.transposed.get(k)
        if t is None:
            eqn.op.lowering(ctx, eqn, ins, outs)
            return
        def view(src: Any) -> Any:
            if src is None or isinstance(src, LaidOutOperand):
                return None
            x, dims = src
            t = self.hbm_in(x)
            return t if dims is None or tuple(dims) == tuple(range(len(dims))) else t.permute(*dims)

        tiled = t[1] if isinstance(t[1], LaidOutOperand) else None
        matmul.lower_matmul_transposed(ctx, eqn, ins, outs, a_t=view(t[0]), b_t=view(t[1]),
                                       b_tiled=None if tiled is None else (self.hbm_in(tiled.var), tiled.layout))

    def emit_group(self, unit: Unit) -> None:
        """A fused group (map, row, Linear chain, attention): its equations lowered together."""
        group, k, cur = unit.group, unit.start, self.cur
        ctx = cur.ctx
        ins = [self.hbm_in(v) for v in group.inputs]
        outs = [self.hbm_out(v) for v in group.outputs]
        for e in group.eqns:
            for v in e.outputs:
                if v not in self.slot_of:
                    self.define(v)
        ctx.eqn = group.eqns[0]
        ctx.unit.store_hook = None
        self.begin_unit(k, group.outputs)
        with self.unit_failures(unit):
            group.lower(ctx, ins, outs)
        self.prologues_done(k)
        self.end_unit(k)
        self.fused += len(group.eqns)
        cur.eqns.extend(range(k, k + len(group.eqns)))

    def operands(self, k: int, eqn: Eqn) -> Tuple[list, list]:
        """``(ins, outs)`` of an equation's lowering: HbmTensors (None for an operand read transposed) or
        literal values, and new HbmTensors of its outputs."""
        trans = self.sched.transposed
        ins = [a.value if isinstance(a, Literal) else (None if k in trans and trans[k][j] is not None
                                                       else self.hbm_in(a))
               for j, a in enumerate(eqn.inputs)]
        return ins, [self.hbm_out(v) for v in eqn.outputs]

    def emit_epilogue(self, unit: Unit) -> None:
        """A matmul/conv/reduction/pool whose stores apply the elementwise chain after it. A head lowering that
        never stores through the hook leaves the chain to be lowered equation by equation (the schedule's unit
        is split)."""
        group, k, cur = unit.group, unit.start, self.cur
        ctx, prog = cur.ctx, cur.prog
        eqn = self.ir.eqns[k]
        ins, outs = self.operands(k, eqn)
        ctx.eqn = eqn
        ep_out: Dict[Var, Any] = {}

        def get_out(v: Var) -> Any:
            if v not in ep_out:
                ep_out[v] = self.hbm_out(v)
            return ep_out[v]

        bias = group.bias[0] if group.bias is not None else None
        cast = self.sched.bias_casts.get(bias)

        def chain_in(v: Var) -> Any:
            if cast is not None and v is bias:
                # the bias's convert was not lowered (the matmul was to round the fp32 row): plan it again
                raise UnitFailed(Veto("nofuse", cast[0], "the matmul did not add the cast bias in PSUM", v))
            return self.hbm_in(v)

        self.begin_unit(k, group.outputs)
        ctx.unit.store_hook = group.make_hook(ctx, outs[0], chain_in, get_out)
        ctx.unit.bias_added = False
        ctx.unit.matmul_bias = None if bias is None else self.hbm_in(bias if cast is None else cast[1])
        group.absorbed = False
        group.preload(ctx, chain_in)
        try:
            with self.unit_failures(unit):
                self.lower_one(k, eqn, ins, outs)
            if cast is not None and (not ctx.unit.bias_added or group.covered == 0):
                raise UnitFailed(Veto("nofuse", cast[0], "the matmul did not add the cast bias in PSUM", bias))
        finally:
            ctx.unit.store_hook = None
            ctx.unit.matmul_bias = None
            group.finish(prog, ctx)
            ctx.unit.bias_added = False
        self.prologues_done(k)
        numel = max(1, eqn.outputs[0].numel)
        cur.eqns.append(k)
        if group.covered == 0:
            if ctx.unit.publish & set(ctx.resident):
                raise UnitFailed(Veto("no_handoff", k, "epilogue not applied", next(iter(ctx.unit.publish))))
            self.end_unit(k)
            # the lowering never called ctx.store: the chain's equations are lowered one by one
            self.sched.split_epilogue(unit)
            return
        if group.covered != numel:
            raise UnitFailed(Veto("nofuse", k, f"epilogue covered {group.covered} of {numel} elements"))
        for v in group.outputs:
            if v not in cur.hbm:
                get_out(v)  # (a value left in SBUF has its HBM tensor too, never written)
        self.end_unit(k)
        for e in group.eqns:
            for v in e.outputs:
                if v not in self.slot_of:
                    self.define(v)
        self.fused += len(group.eqns) + 1
        cur.eqns.extend(range(k + 1, k + 1 + len(group.eqns)))

    def program_end(self, k: int) -> int:
        """The equation before which the program holding equation ``k`` closes (a host or collective unit)."""
        for u in self.sched.units:
            if u.start > k and u.kind in ("host", "collective"):
                return u.start
        return len(self.ir.eqns)

    def alias_reshape(self, k: int, eqn: Eqn) -> bool:
        """Emit a reshape of a value already in the open program's HBM as an alias: the result is the same HBM
        buffer under the new (contiguous) shape, no instruction. Only when every reader of the result is in this
        program (not a program or IR output: those stay their own buffers) and the source is not read through a
        prologue or handed off in SBUF. The IR is functional (in-place writes are applied by the caller after
        the run), so neither buffer is written again after its producer: the alias reads what a copy would."""
        if eqn.op.name != "reshape" or len(eqn.outputs) != 1 or not isinstance(eqn.inputs[0], Var):
            return False
        x, y = eqn.inputs[0], eqn.outputs[0]
        cur = self.cur
        if (x in self.pro_src or x in cur.ctx.unit.prologues or x in cur.ctx.resident or y in self.sched.handoff
                or k in self.sched.transposed or x.dtype != y.dtype or max(1, x.numel) != max(1, y.numel)
                or self.sched.last_use.get(y, len(self.ir.eqns)) >= self.program_end(k)):
            return False
        src = self.hbm_in(x)
        cur.hbm[y] = HbmTensor(src.index, src.name, tuple(y.shape or (1,)), src.dtype, src.kind)
        self.define(y)
        return True

    def pass_reshape(self, k: int, eqn: Eqn) -> bool:
        """A reshape planned to pass a handed-off value on (:func:`tn.lower.schedule._plan_handoff`): it takes
        its input's SBUF tile and publishes the same tile as its result (rows are all axes but the last, which
        a reshape of the leading axes keeps); no instruction."""
        y = eqn.outputs[0] if eqn.op.name == "reshape" and len(eqn.outputs) == 1 else None
        plan = self.sched.handoff.get(y) if y is not None else None
        if plan is None or plan[0] != k:
            return False
        ctx = self.cur.ctx
        self.operands(k, eqn)
        self.begin_unit(k, (y,))
        t = ctx.take(eqn.inputs[0])
        if t is None or tuple(t.shape) != tuple(handoff_shape(y)):
            raise UnitFailed(Veto("no_handoff", k, "the reshape's input is not in SBUF", y))
        ctx.publish(y, t)
        self.end_unit(k)
        return True

    def emit_op(self, unit: Unit) -> None:
        """One equation's own lowering (a reshape of a value in HBM: an alias, :meth:`alias_reshape`; of a value
        handed off in SBUF: the same tile, :meth:`pass_reshape`)."""
        k, cur = unit.start, self.cur
        eqn = self.ir.eqns[k]
        if self.alias_reshape(k, eqn) or self.pass_reshape(k, eqn):
            cur.eqns.append(k)
            return
        ins, outs = self.operands(k, eqn)
        cur.ctx.eqn = eqn
        cur.ctx.unit.store_hook = None
        self.begin_unit(k, eqn.outputs)
        with self.unit_failures(unit):
            self.lower_one(k, eqn, ins, outs)
        self.prologues_done(k)
        for v in cur.ctx.unit.publish:      # (a row gather planned to hand its rows off: tn.lower.index)
            if v not in cur.ctx.resident:
                raise UnitFailed(Veto("no_handoff", k, "the lowering stored its result to HBM", v))
        self.end_unit(k)
        cur.eqns.append(k)

    def emit_lowered(self, unit: Unit) -> None:
        """A unit lowered into the open program (opened here if none is)."""
        k = unit.start
        if self.cur is None:
            self.open_program(k)
        self.cur.labels.append(unit.label)
        self.preload_prologues(unit)
        group = unit.group
        eqn = self.ir.eqns[k]
        unit_in = group.inputs if isinstance(group, Group) else eqn.inputs
        self.bind_prologues([v for v in unit_in if isinstance(v, Var)])
        if isinstance(group, Group):
            self.emit_group(unit)
        elif isinstance(group, EpilogueGroup):
            self.emit_epilogue(unit)
        else:
            self.emit_op(unit)

    def emit_between(self, unit: Unit) -> None:
        """A host equation or a collective: a step of its own between programs."""
        k = unit.start
        eqn = self.ir.eqns[k]
        if unit.kind == "collective":
            # a step on the core's collective engine between programs (tn.lower.collective)
            self.close(k)
            ins = self.slot_args(eqn)
            self.steps.append(collective.make_step(k, eqn, ins, [self.define(v) for v in eqn.outputs], self.ir,
                                                   self.made_by))
            return
        if has_zero_size(eqn):
            self.sched.vetoes.host.setdefault(k, ZERO_SIZE_REASON)
        if self.strict:
            raise unsupported_error(eqn, unit.reason)
        self.close(k)
        ins = self.slot_args(eqn)
        outs = [self.define(v) for v in eqn.outputs]
        self.steps.append(_HostStep(k, eqn, ins, outs))
        self.host_counts[eqn.op.name] = self.host_counts.get(eqn.op.name, 0) + 1

    def run(self) -> Emitted:
        """Emit every unit; the executable's steps and value slots."""
        ir = self.ir
        for v, t in ir.consts:
            t = t.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            self.init.append((self.define(v), t.contiguous()))
        in_slots = [self.define(v) for v in ir.inputs]
        units = self.sched.units
        i = 0
        while i < len(units):      # (an epilogue unit may be split into more units while emitted)
            unit = units[i]
            i += 1
            if unit.kind == "folded":
                # nothing to compute on the chip: empty results, or results of empty inputs only
                for v, t in zip(ir.eqns[unit.start].outputs, unit.folded):
                    self.init.append((self.define(v), t))
            elif unit.kind in ("host", "collective"):
                self.emit_between(unit)
            else:
                self.emit_lowered(unit)
        self.close(len(ir.eqns))
        return self.finish(in_slots)

    def finish(self, in_slots: List[int]) -> Emitted:
        """The outputs' slots and every slot's free after its last reading step (never inputs/consts/outputs)."""
        ir, steps, init = self.ir, self.steps, self.init
        out = []
        lit_outs = []
        for j, a in enumerate(ir.outputs):
            if isinstance(a, Literal):
                lit_outs.append((j, a.value, a.dtype))
                out.append(0)
            else:
                out.append(self.slot_of[a])
        keep = set(out) | set(in_slots) | {s for s, _ in init}
        frees: Dict[int, List[int]] = {}
        slot_last: Dict[int, int] = {}
        for si, st in enumerate(steps):
            used = [s for _, s in st.ins] if isinstance(st, _ProgStep) else [s for is_s, s in st.ins if is_s]
            for s in used:
                slot_last[s] = si
        for s, si in slot_last.items():
            if s not in keep:
                frees.setdefault(si, []).append(s)
        fixed = set(in_slots) | {sl for sl, _ in init}
        return Emitted(
            steps=steps, nslots=self.nslots, init=init, in_slots=in_slots, out=out, lit_outs=lit_outs,
            frees=[tuple(frees.get(i, ())) for i in range(len(steps))],
            copy_outs=[j for j, sl in enumerate(out) if sl in fixed and j not in {jj for jj, _, _ in lit_outs}],
            host_counts=self.host_counts,
            collective_steps=[st for st in steps if isinstance(st, collective.CollectiveStep) and not st.is_wait],
            instructions=self.instructions, fused=self.fused)


def emit(sched: Schedule, *, name: Optional[str], arch: Any, strict: bool, debug: bool = False,
         laid_out: Optional[Dict[Var, Any]] = None) -> Emitted:
    """Emit ``sched`` for ``arch``: programs named ``{name}_{k}_{what}``, host and collective steps. Raises
    :class:`~tn.lower.schedule.UnitFailed` when a unit cannot be emitted as planned, and in ``strict`` mode
    :class:`tn.UnsupportedOpError` at a host unit."""
    return Emitter(sched, name=name, arch=arch, strict=strict, debug=debug, laid_out=dict(laid_out or {})).run()
