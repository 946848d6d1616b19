# The NeuronCore compiler driver: splits an IR into device programs and host fallbacks, binds tensors, runs, profiles.
"""Compile a :class:`tn.ir.IR` into NeuronCore programs (the ``"neuron"`` jit backend).

:func:`compile_ir` plans a :class:`tn.lower.schedule.Schedule` (the lowering units, ``print(exe.schedule)``)
and emits it in equation order. Each stretch of equations
that have a lowering becomes one :class:`tn.neuron.Program`: its inputs are
the program inputs / constants / values made earlier, its outputs the values
used later (or returned), everything else lives in HBM scratch (or, when
fused by :mod:`tn.lower.fusion`, only in SBUF). An equation whose op has no
lowering, whose dtypes the chip lacks, or whose lowering raised
:class:`~tn.lower.base.CannotLower` runs on the host through ``op.impl``
between programs, counted per op in :attr:`NeuronExecutable.stats`; in strict
mode (``strict=True`` or ``TN_STRICT=1``) that is a
:class:`tn.UnsupportedOpError` naming the op, its input avals and the reason.

Calling the :class:`NeuronExecutable` binds the input tensors to the
programs' HBM tensors by pointer (no copy unless a tensor is not contiguous),
allocates the outputs as torch tensors of the IR's dtypes, runs every program
on the software NeuronCore (each run reports to :func:`tn.profile`), and
keeps the merged profile of the call in :attr:`NeuronExecutable.last_profile`.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import config
from ..errors import ArgumentValueError, CompileError, ExecutionError, NeuronError, TnError, UnsupportedOpError
from ..ops.collective import COLLECTIVE_OPS
from ..ir import IR, Eqn, Literal, Var
from .base import NEURON_DTYPES, CannotLower, HandoffError, LowerCtx, dataflow
from .epilogue import EpilogueGroup
from .fusion import Group
from .schedule import (ZERO_SIZE_REASON, LaidOutOperand, Schedule, Unit, UnitFailed, Veto, Vetoes, has_zero_size,
                       host_reason, plan, plan_transposed, program_name)

__all__ = ["compile_ir", "NeuronExecutable", "ExecProfile", "StepTiming", "strict_default"]

log = logging.getLogger("tn")

#: The debug log line of each kind of veto (a unit that could not be emitted as planned).
_VETO_LOG = {"no_prologue": "prologue of {var} not applied; lowered as equations",
             "no_handoff": "SBUF hand-off of {var} not taken; stored to HBM",
             "nofuse": "fused group at equation {k} not emitted; lowering unfused"}


def strict_default() -> bool:
    """Strict mode from the environment: ``TN_STRICT=1`` turns host fallbacks into errors."""
    return config.get("strict")


def _avals(eqn: Eqn) -> str:
    return ", ".join(a.aval if isinstance(a, Var) else f"{a.value!r}" for a in eqn.inputs)


class ExecProfile:
    """The merged profile of one call of a :class:`NeuronExecutable`.

    Attributes:
        runs: the :class:`tn.neuron.RunResult` of every program run, in order.
        host_ops: equations run on the host during the call, counted per op name.
        collectives: the call's collectives on the collective engine (:mod:`tn.lower.collective`).
    """

    def __init__(self, runs: list, host_ops: Dict[str, int], collectives: Sequence[Any] = ()):
        self.runs = runs
        self.host_ops = dict(host_ops)
        #: :class:`tn.lower.collective.CollectiveRun` of every collective of the call, in order
        self.collectives = list(collectives)

    @property
    def total_ns(self) -> float:
        """Modelled device time of all programs, back to back, in ns."""
        return float(sum(r.total_ns for r in self.runs))

    @property
    def total_us(self) -> float:
        """Modelled device time in µs."""
        return self.total_ns / 1e3

    def _per_queue(self, field: str, zero: Any) -> Dict[str, Any]:
        """The RunResults' ``field`` (queue name -> number) summed over programs (``zero``: the start value)."""
        out: Dict[str, Any] = {}
        for r in self.runs:
            for k, v in getattr(r, field).items():
                out[k] = out.get(k, zero) + v
        return out

    @property
    def busy_ns(self) -> Dict[str, float]:
        """Busy ns per engine/DMA queue, summed over programs."""
        return self._per_queue("busy_ns", 0.0)

    @property
    def utilisation(self) -> Dict[str, float]:
        """Busy fraction per queue over the total modelled time."""
        t = self.total_ns or 1.0
        return {k: v / t for k, v in self.busy_ns.items()}

    @property
    def hbm_read_bytes(self) -> int:
        """HBM bytes read by all programs."""
        return int(sum(r.hbm_read_bytes for r in self.runs))

    @property
    def hbm_write_bytes(self) -> int:
        """HBM bytes written by all programs."""
        return int(sum(r.hbm_write_bytes for r in self.runs))

    @property
    def hbm_bytes(self) -> int:
        """HBM bytes read plus written."""
        return self.hbm_read_bytes + self.hbm_write_bytes

    @property
    def sbuf_peak_bytes(self) -> int:
        """Largest SBUF use per partition of any program."""
        return max((r.sbuf_peak_bytes for r in self.runs), default=0)

    @property
    def psum_peak_bytes(self) -> int:
        """Largest PSUM use per partition of any program."""
        return max((r.psum_peak_bytes for r in self.runs), default=0)

    @property
    def instructions(self) -> int:
        """Instructions run, all programs."""
        return int(sum(len(r.opcodes) for r in self.runs))

    @property
    def counts(self) -> Dict[str, int]:
        """Instructions per queue, summed."""
        return self._per_queue("counts", 0)

    @property
    def matmul_flops(self) -> int:
        """Matmul FLOPs of all programs."""
        return int(sum(r.matmul_flops for r in self.runs))

    @property
    def tensor_utilisation(self) -> float:
        """Matmul FLOPs / (TensorE bf16 peak x total modelled time)."""
        if not self.runs or self.total_ns <= 0:
            return 0.0
        peak = self.runs[0].arch.peak_flops_bf16
        return self.matmul_flops / (peak * self.total_ns * 1e-9)

    @property
    def wall_s(self) -> float:
        """Host seconds spent simulating the programs."""
        return float(sum(r.wall_s for r in self.runs))

    def summary(self) -> Dict[str, Any]:
        """Flat dict of the headline numbers."""
        d = {"programs": len(self.runs), "instructions": self.instructions, "time_us": self.total_us,
             "hbm_read": self.hbm_read_bytes, "hbm_write": self.hbm_write_bytes,
             "sbuf_peak": self.sbuf_peak_bytes, "psum_peak": self.psum_peak_bytes,
             "tensor_util": self.tensor_utilisation, "host_ops": dict(self.host_ops)}
        for k, v in self.utilisation.items():
            if v > 0:
                d[f"util_{k}"] = v
        return d

    def table(self, print_it: bool = True) -> str:
        """The per-program table of :meth:`tn.profile.Profile.table` for these runs, plus host fallbacks."""
        import importlib

        prof = importlib.import_module("tn.profile").Profile()
        prof.runs = list(self.runs)
        text = prof.table(print_it=False)
        if self.host_ops:
            text += "\nhost fallbacks: " + ", ".join(f"{k} x{v}" for k, v in sorted(self.host_ops.items()))
        if print_it:
            print(text)
        return text

    def __repr__(self) -> str:
        return (f"<ExecProfile {len(self.runs)} program(s), {self.total_us:.3f} us modelled, "
                f"{self.hbm_bytes} HBM bytes, host ops {self.host_ops}>")


class StepTiming:
    """Modelled time of one call of a :class:`NeuronExecutable` without computing any value
    (:meth:`NeuronExecutable.model_timing`).

    The programs are placed back to back from 0 (host equations between them take no modelled time: they are
    counted in ``host_eqns``). Attributes:

    * ``runs``: the :class:`tn.neuron.RunResult` of every program (timing only, no outputs);
    * ``starts_ns``: where each program starts;
    * ``total_ns``: when the last program ends;
    * ``host_eqns``: equations that would run on the host (untimed);
    * ``collective_steps``: collective and wait steps between the programs (untimed here: a collective's time is
      placed on the core's collectives resource when it runs, see :mod:`tn.lower.collective`);
    * ``input_reads_ns[i]``: sorted start times of the instructions that read IR input ``i`` (empty if none);
    * ``output_ready_ns[j]``: when IR output ``j`` is complete: the end of the last instruction writing it
      (0 for an output that is an input or a literal; for one made on the host, the end of the program before).
    """

    def __init__(self, runs, starts_ns, host_eqns, input_reads_ns, output_ready_ns, collective_steps=0):
        self.runs = runs
        self.starts_ns = starts_ns
        self.total_ns = float(starts_ns[-1] + runs[-1].total_ns) if runs else 0.0
        self.host_eqns = host_eqns
        self.input_reads_ns = input_reads_ns
        self.output_ready_ns = output_ready_ns
        self.collective_steps = collective_steps

    def __repr__(self) -> str:
        return (f"<StepTiming {len(self.runs)} program(s), {self.total_ns / 1e3:.1f} us modelled, "
                f"{self.host_eqns} host equation(s)>")


def _hbm_access_times(enc: Any, times: np.ndarray) -> Tuple[Dict[int, np.ndarray], Dict[int, float]]:
    """``(reads, last_write)`` of a program's HBM tensors: buffer index -> start times of the instructions
    reading it, and -> end of the last instruction writing it (only DMAs touch HBM; a DMA's operand 0 is what
    it writes, and a scatter's table is read too)."""
    from ..neuron import isa

    recs = enc.records
    reads: Dict[int, list] = {}
    writes: Dict[int, float] = {}
    for k in range(isa.N_OPERANDS):
        base = isa.OPERAND_BASE + k * isa.OPERAND_WIDTH
        hbm = np.nonzero(recs[:, base + isa.O_MEM] == isa.MEM_HBM)[0]
        if not len(hbm):
            continue
        bufs = recs[hbm, base + isa.O_BUF]
        if k == 0:
            for b in np.unique(bufs):
                writes[int(b)] = float(times[hbm[bufs == b], 1].max())
            scatter = recs[hbm, isa.H_OPCODE] == isa.OPCODES["dma_scatter"]
            hbm, bufs = hbm[scatter], bufs[scatter]
        for b in np.unique(bufs):
            reads.setdefault(int(b), []).append(times[hbm[bufs == b], 0])
    return {b: np.sort(np.concatenate(v)) for b, v in reads.items()}, writes


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


class NeuronExecutable:
    """An IR compiled for the software NeuronCore; call it with the flat input tensors.

    Attributes:
        ir: the compiled IR.
        arch: the :class:`tn.neuron.Arch` targeted.
        stats: ``{"host_ops": {op: count}, "host_reasons": {op: reason}, "programs": n,
            "instructions": n, "fused_eqns": n}`` (static, per compiled program).
        last_profile: :class:`ExecProfile` of the most recent call (None before the first).
        schedule: the :class:`tn.lower.schedule.Schedule` the programs were emitted from (``print`` it).
    """

    def __init__(self, ir: IR, arch: Any = None, strict: Optional[bool] = None, debug: bool = False,
                 fuse: bool = True, _laid_out: Optional[Dict[Var, Any]] = None, name: Optional[str] = None):
        from ..neuron import get_arch

        ir = _collective().sink_waits(ir)   # programs between a collective and its wait overlap it
        self.ir = ir
        self.name = name
        self.arch = get_arch(arch)
        self.strict = strict_default() if strict is None else bool(strict)
        self.debug = debug
        self.fuse = fuse
        self.last_profile: Optional[ExecProfile] = None
        # the planners' vetoes: collectives end programs; failed units add theirs (tn.lower.schedule)
        vetoes = Vetoes(_collective().program_breaks(ir))
        # weights read laid out (tn.lower.layout): weight Var -> (extra input Var, BLayout); set in the
        # laid-out variant only. The plain executable keeps the policy and builds that variant on demand.
        self._laid_out: Dict[Var, Any] = dict(_laid_out or {})
        self._layout: Any = None
        self._layout_child: Any = None
        #: weight input index -> the Var of its convert, for weights laid out already cast (``_plan_layouts``)
        self._layout_casts: Dict[int, Var] = {}
        #: the :class:`tn.lower.schedule.Schedule` the programs were emitted from (``print(exe.schedule)``)
        self.schedule: Optional[Schedule] = None
        builds = 0
        for builds in range(1, 3 * len(ir.eqns) + 3):
            try:
                self._build(vetoes)
                break
            except UnitFailed as failed:
                veto = failed.veto
                if veto.kind == "host" and self.strict:
                    raise self._unsupported(ir.eqns[veto.at], veto.reason) from None
                if veto.kind != "host":
                    log.debug("tn.lower: %s (%s); planning again", _VETO_LOG[veto.kind].format(
                        k=veto.at, var=veto.var), veto.reason)
                vetoes.add(veto)
        else:
            raise CompileError(f"tn.lower: no schedule of {len(ir.eqns)} equations could be emitted after "
                               f"{builds} builds (vetoes: {vetoes.history}). This is a bug of a lowering")
        self.schedule.builds = builds
        host = vetoes.host
        self.stats = self._stats(host)
        if fuse and _laid_out is None:
            self._layout = self._plan_layouts(vetoes)
            if self._layout is not None:
                self.stats["layout_weights"] = len(self._layout.inputs)

    # ------------------------------------------------------------------ compile
    def _unsupported(self, eqn: Eqn, reason: str) -> UnsupportedOpError:
        where = f" (from {eqn.source})" if eqn.source else ""
        return UnsupportedOpError(
            f"op {eqn.op.name!r} with inputs ({_avals(eqn)}){where} cannot run on the NeuronCore: {reason}. "
            f"Strict mode is on (strict=True or TN_STRICT=1); turn it off to run this op on the host")

    @staticmethod
    def _lower_one(ctx: LowerCtx, k: int, eqn: Eqn, ins: list, outs: list, trans: Dict[int, Any], hbm_in: Any) -> None:
        """Call ``eqn``'s lowering (a matmul reading transposed sources when planned so)."""
        t = trans.get(k)
        if t is None:
            eqn.op.lowering(ctx, eqn, ins, outs)
            return
        from . import matmul

        def view(src: Any) -> Any:
            if src is None or isinstance(src, LaidOutOperand):
                return None
            x, dims = src
            t = hbm_in(x)
            return t if dims is None or tuple(dims) == tuple(range(len(dims))) else t.permute(*dims)

        tiled = t[1] if isinstance(t[1], LaidOutOperand) else None
        matmul.lower_matmul_transposed(ctx, eqn, ins, outs, a_t=view(t[0]), b_t=view(t[1]),
                                       b_tiled=None if tiled is None else (hbm_in(tiled.var), tiled.layout))

    def _weight_stream(self, prog: Any, k0: int, sched: Schedule, hbm_in: Any) -> Any:
        """The :class:`tn.lower.layout.WeightStream` of a program starting at equation ``k0``: the laid-out
        weight groups its Linear chains and single-row-tile matmuls will multiply by, in order (None if none)."""
        if not self._laid_out:
            return None
        from . import chain, layout, matmul

        host, groups, trans = sched.vetoes.host, sched.groups, sched.transposed
        seq = []
        k = k0
        n = len(self.ir.eqns)
        while k < n and k not in host:
            g = groups.get(k)
            if isinstance(g, chain.LinearChain):
                for L in g.layers:
                    if L.w in self._laid_out:
                        var, lay = self._laid_out[L.w]
                        seq.extend((hbm_in(var), lay, j) for j in range(lay.NG))
                k += len(g.eqns)
                continue
            t = trans.get(k)
            if t is not None and isinstance(t[1], LaidOutOperand) and matmul.streams_weight(self.ir.eqns[k]):
                seq.extend((hbm_in(t[1].var), t[1].layout, j) for j in range(t[1].layout.NG))
            k += 1 + (len(g.eqns) if isinstance(g, EpilogueGroup) else 0)
        seq = [x for x in seq if x[1].dtype == (seq[0][1].dtype if seq else None)]
        if not seq:
            return None
        return layout.WeightStream(prog, seq, 128 * 1024)

    @staticmethod
    def _bind_prologues(ctx: LowerCtx, cur: Dict[str, Any], pros: Dict[Var, Any], inputs: List[Var],
                        hbm_in: Any) -> None:
        """Offer the current unit the prologues of its inputs (``ctx.prologues``: operand -> ``prologue.Bound``)."""
        from . import prologue

        ctx.prologues = {}
        for a in inputs:
            p = pros.get(a)
            if p is None:
                continue
            b = cur["pro"].get(a)
            if b is None:
                b = cur["pro"][a] = prologue.Bound(p, None, {v: hbm_in(v) for v in p.vectors()})
            b.src_hbm = hbm_in(p.src)
            ctx.prologues[a] = b

    @staticmethod
    def _prologue_failed(ctx: LowerCtx, k: int, err: Exception) -> None:
        """A unit offered a prologue failed: rebuild without the prologue (its equations lowered as usual)."""
        for a, b in getattr(ctx, "prologues", {}).items():
            ctx.prologues = {}
            raise UnitFailed(Veto("no_prologue", k, f"with a prologue: {err}", a)) from None

    @staticmethod
    def _prologues_done(ctx: LowerCtx, cur: Dict[str, Any], k: int) -> None:
        """After a unit: every prologue offered must have been applied (else rebuild without it); free its columns."""
        pros = getattr(ctx, "prologues", {})
        ctx.prologues = {}
        for a, b in pros.items():
            if not b.taken:
                raise UnitFailed(Veto("no_prologue", k, "the consumer did not apply the prologue", a))
            b.free(ctx.prog)
            cur["pro"].pop(a, None)

    def _plan_layouts(self, vetoes: Vetoes) -> Any:
        """The :class:`tn.lower.layout.LayoutPolicy` of this executable, or None.

        Candidates are 2-D program inputs ``W`` read by matmuls only as ``B = W^T``
        (``permute(W, (1, 0))`` used by that matmul alone, the pattern of ``nn.Linear``),
        not written back by the program (mutations) and of a TensorE dtype. The laid-out
        variant reads them from their cached layout instead of transposing them on chip.
        """
        try:
            from . import layout, matmul
        except ImportError:
            return None
        host = vetoes.host
        ir = self.ir
        elide, trans = plan_transposed(ir, host, vetoes.nofuse, self._laid_out)
        index = {v: i for i, v in enumerate(ir.inputs)}
        mutated = {i for i, _ in ir.mutations}
        producer, users, outset = dataflow(ir)
        cands: Dict[Var, Any] = {}
        for k, (_, sb) in trans.items():
            if sb is None or isinstance(sb, LaidOutOperand):
                continue
            x, dims = sb
            w = x
            j = producer.get(x)
            if j is not None and ir.eqns[j].op.name == "convert" and j not in host and x not in outset and \
                    isinstance(ir.eqns[j].inputs[0], Var) and all(u in elide for u in users.get(x, ())):
                # convert(W) read only transposed by matmuls (a weight under autocast): laid out already cast
                w = ir.eqns[j].inputs[0]
                if (NEURON_DTYPES.get(w.dtype), NEURON_DTYPES.get(x.dtype)) not in layout.CAST_LAYOUTS:
                    continue
            i = index.get(w)
            if i is None or i in mutated or x.ndim != 2 or tuple(dims or (0, 1)) != (0, 1):
                continue
            a = ir.eqns[k].inputs[0]
            if x.dtype not in NEURON_DTYPES or NEURON_DTYPES[x.dtype] not in matmul.MATMUL_DTYPES or \
                    not isinstance(a, Var) or a.dtype != x.dtype or ir.eqns[k].outputs[0].ndim != 2:
                continue
            if w is not x:
                if any(c[0] == i for c in cands.values()):
                    continue     # one layout per weight input
                self._layout_casts[i] = x
            elif i in self._layout_casts:
                continue
            N, K = x.shape
            cands.setdefault(x, (i, layout.b_layout(N, K, NEURON_DTYPES[x.dtype])))
        if not cands:
            return None
        return layout.LayoutPolicy(sorted(cands.values(), key=lambda c: c[0]))

    def _laid_out_variant(self) -> Optional["NeuronExecutable"]:
        """The executable reading the policy's weights laid out (extra inputs after the IR's), built once."""
        if self._layout_child is None:
            ir = self.ir
            extra = []
            laid: Dict[Var, Any] = {}
            for i, lay in self._layout.inputs:
                w = self._layout_casts.get(i, ir.inputs[i])    # a cast weight: its convert's result is laid out
                v = Var(lay.shape, w.dtype)
                extra.append(v)
                laid[w] = (v, lay)
            ir2 = ir.replace(inputs=list(ir.inputs) + extra)
            try:
                self._layout_child = NeuronExecutable(ir2, arch=self.arch, strict=self.strict, debug=self.debug,
                                                      fuse=True, _laid_out=laid, name=self.name)
            except Exception as e:  # never worse than the plain program
                log.warning("tn.lower: the laid-out variant did not compile (%s: %s); keeping the plain program",
                            type(e).__name__, e)
                self._layout = None
                return None
        return self._layout_child

    def _call_laid_out(self, tensors: Sequence[torch.Tensor]) -> Optional[List[Any]]:
        """Run the laid-out variant when the policy says the weights are steady (else None: run the plain one)."""
        if len(tensors) != len(self._in_slots):
            return None
        choice = self._layout.choose(tensors, self.arch)
        if choice is None:
            return None
        child = self._laid_out_variant()
        if child is None:
            return None
        laid, runs = choice
        result = child(list(tensors) + laid)
        prof = child.last_profile
        self.last_profile = ExecProfile(list(runs) + list(prof.runs), prof.host_ops, prof.collectives)
        return result

    def _build(self, vetoes: Vetoes) -> None:
        """One build: plan the schedule under ``vetoes`` and emit it (:class:`UnitFailed` when a unit cannot be)."""
        sched = plan(self.ir, vetoes, fuse=self.fuse, laid_out=self._laid_out)
        self._emit(sched)
        self.schedule = sched

    @contextlib.contextmanager
    def _unit_failures(self, ctx: LowerCtx, unit: Unit) -> Iterator[None]:
        """Turn a unit's lowering errors into the veto the next plan obeys: a hand-off not taken stores the value
        to HBM; a failed prologue is not applied; a fused group or epilogue that fails is not fused; an
        equation's own lowering that cannot handle the case (or emits an invalid instruction) goes to the host."""
        k = unit.start
        try:
            yield
        except HandoffError as e:
            raise UnitFailed(Veto("no_handoff", k, str(e), e.var)) from None
        except (CannotLower, NeuronError) as e:
            self._prologue_failed(ctx, k, e)
            if unit.kind in ("map", "row", "chain", "attention"):
                raise UnitFailed(Veto("nofuse", k, f"fused group failed: {e}")) from None
            if isinstance(e, CannotLower):
                raise UnitFailed(Veto("host", k, str(e) or "the lowering cannot handle this case")) from None
            if unit.kind == "epilogue":
                raise UnitFailed(Veto("nofuse", k, f"fused epilogue failed: {e}")) from None
            eqn = self.ir.eqns[k]
            if self.strict:
                raise CompileError(f"tn.lower: the lowering of {eqn.op.name!r} ({_avals(eqn)}) emitted an invalid "
                                   f"instruction: {e}") from e
            log.warning("tn.lower: lowering of %s (%s) failed (%s); running it on the host",
                        eqn.op.name, _avals(eqn), e)
            raise UnitFailed(Veto("host", k, f"lowering error: {e}")) from None

    def _emit(self, sched: Schedule) -> None:
        """Emit ``sched``: one :class:`tn.neuron.Program` per stretch of lowered units, a host step per host
        unit, a collective step per collective; the value slots and their frees (the executable's state)."""
        from ..neuron import Program
        from . import prologue

        ir = self.ir
        host = sched.vetoes.host
        slot_of: Dict[Var, int] = {}
        nslots = 0

        def define(v: Var) -> int:
            nonlocal nslots
            slot_of[v] = nslots
            nslots += 1
            return nslots - 1

        init: List[Tuple[int, torch.Tensor]] = []
        for v, t in ir.consts:
            t = t.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            init.append((define(v), t.contiguous()))
        in_slots = [define(v) for v in ir.inputs]

        n = len(ir.eqns)
        last_use = sched.last_use
        trans, handoff, pros = sched.transposed, sched.handoff, sched.prologues
        pro_src = {a: p.src for a, p in pros.items()}
        consumers_of: Dict[int, List[Var]] = {}
        last_consumer: Dict[Var, int] = {}
        for v, (_, cons) in handoff.items():
            for c in cons:
                consumers_of.setdefault(c, []).append(v)
            last_consumer[v] = max(cons)

        def begin_unit(ctx: Any, k: int, outputs: Sequence[Var]) -> None:
            ctx.publish_vars = {v for v in outputs if v in handoff and handoff[v][0] == k}
            ctx.taken = set()

        def end_unit(ctx: Any, k: int) -> None:
            for v in consumers_of.get(k, ()):
                if v in ctx.resident and v not in ctx.taken:
                    raise UnitFailed(Veto("no_handoff", k, f"equation {k} did not read {v.aval} from SBUF", v))
            for v in list(ctx.resident):
                if last_consumer.get(v, -1) <= k and v not in ctx.publish_vars:
                    ctx.prog.free(ctx.resident.pop(v))
            ctx.publish_vars = set()

        steps: List[Any] = []

        cur: Optional[Dict[str, Any]] = None
        host_counts: Dict[str, int] = {}
        instructions = 0
        # equations not materialised (permutes read transposed, prologue equations) count as fused
        fused = len(sched.skipped)

        def close(end: int) -> None:
            nonlocal cur, instructions
            if cur is None:
                return
            prog = cur["prog"]
            prog.name = program_name(self.name, len(steps), cur["labels"])
            sched.program_names[len(steps)] = prog.name
            for b in cur["pro"].values():
                b.free(prog)
            if cur["ctx"].weights is not None:
                cur["ctx"].weights.close()
            for t in cur["ctx"].resident.values():
                prog.free(t)
            cur["ctx"].resident.clear()
            outs = []
            for v, t in cur["made"].items():
                if last_use.get(v, -1) >= end:
                    t.kind = "output"
                    outs.append((t.index, slot_of[v], v.shape, v.dtype))
            flag = None
            ctx = cur["ctx"]
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
                raise CompileError(f"tn.lower: program {prog.name!r} (equations {cur['eqns']}) failed validation: {e}. "
                                   f"This is a bug of a lowering") from e
            instructions += len(enc)
            steps.append(_ProgStep(enc, cur["ins"], outs, cur["eqns"], flag))
            cur = None

        collective = _collective()
        made_by: Dict[Var, Any] = {}
        units = sched.units
        i = 0
        while i < len(units):
            unit = units[i]
            i += 1
            k = unit.start
            eqn = ir.eqns[k]
            if unit.kind == "collective":
                # a collective: a step on the core's collective engine between programs (tn.lower.collective)
                close(k)
                ins = [(False, a.value) if isinstance(a, Literal) else (True, slot_of[a]) for a in eqn.inputs]
                steps.append(collective.make_step(k, eqn, ins, [define(v) for v in eqn.outputs], ir, made_by))
                continue
            if unit.kind == "folded":
                # nothing to compute on the chip: empty results, or results of empty inputs only
                for v, t in zip(eqn.outputs, unit.folded):
                    init.append((define(v), t))
                continue
            if unit.kind == "host":
                if has_zero_size(eqn):
                    host.setdefault(k, ZERO_SIZE_REASON)
                if self.strict:
                    raise self._unsupported(eqn, unit.reason)
                close(k)
                ins = [(False, a.value) if isinstance(a, Literal) else (True, slot_of[a]) for a in eqn.inputs]
                outs = [define(v) for v in eqn.outputs]
                steps.append(_HostStep(k, eqn, ins, outs))
                host_counts[eqn.op.name] = host_counts.get(eqn.op.name, 0) + 1
                continue
            if cur is None:
                # named when it closes, after what it holds (program_name)
                prog = Program(f"{self.name or 'tn'}_{len(steps)}", self.arch, record_sources=self.debug)
                cur = {"prog": prog, "ctx": LowerCtx(prog), "hbm": {}, "made": {}, "ins": [], "eqns": [], "pro": {},
                       "labels": []}
            prog, ctx, hbm = cur["prog"], cur["ctx"], cur["hbm"]
            group = unit.group
            cur["labels"].append(unit.label)

            def hbm_in(v: Var) -> Any:
                v = pro_src.get(v, v)   # a prologue's result is never made: its consumer reads the source
                t = hbm.get(v)
                if t is None:
                    t = prog.hbm(f"in{len(hbm)}", v.shape or (1,), NEURON_DTYPES[v.dtype], kind="input")
                    hbm[v] = t
                    cur["ins"].append((t.index, slot_of[v]))
                return t

            def hbm_out(v: Var) -> Any:
                t = prog.hbm(f"v{len(hbm)}", v.shape or (1,), NEURON_DTYPES[v.dtype], kind="scratch")
                hbm[v] = t
                cur["made"][v] = t
                define(v)
                return t

            if "stream" not in cur:
                cur["stream"] = True
                ctx.weights = self._weight_stream(prog, k, sched, hbm_in)

            for p in unit.preloads:
                # a prologue's per-feature vectors, loaded before the producer of its source
                b = cur["pro"][p.out] = prologue.Bound(p, None, {v: hbm_in(v) for v in p.vectors()})
                b.preload(prog)

            unit_in = group.inputs if isinstance(group, Group) else eqn.inputs
            self._bind_prologues(ctx, cur, pros, [v for v in unit_in if isinstance(v, Var)], hbm_in)
            if isinstance(group, Group):
                # a fused group (map, row, Linear chain, attention): equations k .. k+len-1 lowered together
                ins = [hbm_in(v) for v in group.inputs]
                outs = [hbm_out(v) for v in group.outputs]
                for e in group.eqns:
                    for v in e.outputs:
                        if v not in slot_of:
                            define(v)
                ctx.eqn = group.eqns[0]
                ctx.store_hook = None
                begin_unit(ctx, k, group.outputs)
                with self._unit_failures(ctx, unit):
                    group.lower(ctx, ins, outs)
                self._prologues_done(ctx, cur, k)
                end_unit(ctx, k)
                fused += len(group.eqns)
                cur["eqns"].extend(range(k, k + len(group.eqns)))
                continue
            ins = [a.value if isinstance(a, Literal) else (None if k in trans and trans[k][j] is not None else hbm_in(a))
                   for j, a in enumerate(eqn.inputs)]
            outs = [hbm_out(v) for v in eqn.outputs]
            ctx.eqn = eqn
            if isinstance(group, EpilogueGroup):
                # a matmul/conv/reduction/pool whose stores apply the elementwise chain after it
                ep_out: Dict[Var, Any] = {}

                def get_out(v: Var, ep_out=ep_out) -> Any:
                    if v not in ep_out:
                        ep_out[v] = hbm_out(v)
                    return ep_out[v]

                begin_unit(ctx, k, group.outputs)
                ctx.store_hook = group.make_hook(ctx, outs[0], hbm_in, get_out)
                ctx.bias_added = False
                ctx.matmul_bias = hbm_in(group.bias[0]) if group.bias is not None else None
                group.absorbed = False
                group.preload(ctx, hbm_in)
                try:
                    with self._unit_failures(ctx, unit):
                        self._lower_one(ctx, k, eqn, ins, outs, trans, hbm_in)
                finally:
                    ctx.store_hook = None
                    ctx.matmul_bias = None
                    group.finish(prog, ctx)
                    ctx.bias_added = False
                self._prologues_done(ctx, cur, k)
                numel = max(1, eqn.outputs[0].numel)
                cur["eqns"].append(k)
                if group.covered == 0:
                    if ctx.publish_vars & set(ctx.resident):
                        raise UnitFailed(Veto("no_handoff", k, "epilogue not applied", next(iter(ctx.publish_vars))))
                    end_unit(ctx, k)
                    # the lowering never called ctx.store: the chain's equations are lowered one by one
                    sched.split_epilogue(unit)
                    continue
                if group.covered != numel:
                    raise UnitFailed(Veto("nofuse", k, f"epilogue covered {group.covered} of {numel} elements"))
                for v in group.outputs:
                    if v not in hbm:
                        get_out(v)  # (a value left in SBUF has its HBM tensor too, never written)
                end_unit(ctx, k)
                for e in group.eqns:
                    for v in e.outputs:
                        if v not in slot_of:
                            define(v)
                fused += len(group.eqns) + 1
                cur["eqns"].extend(range(k + 1, k + 1 + len(group.eqns)))
                continue
            ctx.store_hook = None
            begin_unit(ctx, k, ())
            with self._unit_failures(ctx, unit):
                self._lower_one(ctx, k, eqn, ins, outs, trans, hbm_in)
            self._prologues_done(ctx, cur, k)
            end_unit(ctx, k)
            cur["eqns"].append(k)
        close(n)

        out = []
        lit_outs = []
        for j, a in enumerate(ir.outputs):
            if isinstance(a, Literal):
                lit_outs.append((j, a.value, a.dtype))
                out.append(0)
            else:
                out.append(slot_of[a])
        # free slots after their last use (never inputs/consts/outputs)
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
        self._nslots = nslots
        self._init = init
        self._in_slots = in_slots
        self._steps = steps
        self._frees = [tuple(frees.get(i, ())) for i in range(len(steps))]
        self._out = out
        fixed = set(in_slots) | {sl for sl, _ in init}
        self._copy_outs = [j for j, sl in enumerate(out) if sl in fixed and j not in {jj for jj, _, _ in lit_outs}]
        self._lit_outs = lit_outs
        self._host_counts = host_counts
        self._collective_steps = [st for st in steps if isinstance(st, collective.CollectiveStep) and not st.is_wait]
        self._n_instr = instructions
        self._n_fused = fused

    def _stats(self, host: Dict[int, str]) -> Dict[str, Any]:
        reasons: Dict[str, str] = {}
        for k, st in enumerate(self._steps):
            if isinstance(st, _HostStep):
                eqn = self.ir.eqns[st.k]
                reasons.setdefault(st.name, host.get(st.k) or host_reason(eqn) or "?")
        return {"host_ops": dict(self._host_counts), "host_reasons": reasons,
                "programs": sum(isinstance(s, _ProgStep) for s in self._steps),
                "collectives": len(self._collective_steps),
                "instructions": self._n_instr, "fused_eqns": self._n_fused}

    # ------------------------------------------------------------------ run
    def model_timing(self) -> StepTiming:
        """Time one call on the chip model without computing any value (:func:`tn.neuron.simulate_timing` of
        each program; no input is needed and nothing is allocated): a :class:`StepTiming` with when each input is
        read and each output is ready. For programs too large to run with values (a whole training step of a
        big model); the modelled time is the same as a run's (the engine's timing does not depend on data)."""
        from ..neuron import simulate_timing

        runs: List[Any] = []
        starts: List[float] = []
        t = 0.0
        host = 0
        reads: Dict[int, List[np.ndarray]] = {}
        ready: Dict[int, float] = {}
        collectives = 0
        for st in self._steps:
            if type(st) is not _ProgStep:     # a host equation or a collective step: not timed here
                if type(st) is _HostStep:
                    host += 1
                else:
                    collectives += 1
                for s in st.outs:
                    ready[s] = t
                continue
            r = simulate_timing(st.enc)
            r_reads, r_writes = _hbm_access_times(st.enc, r.times)
            for idx, s in st.ins:
                if idx in r_reads:
                    reads.setdefault(s, []).append(r_reads[idx] + t)
            for idx, s, _, _ in st.outs:
                ready[s] = t + r_writes.get(idx, r.total_ns)
            runs.append(r)
            starts.append(t)
            t += r.total_ns
        fixed = set(self._in_slots) | {s for s, _ in self._init}
        lits = {j for j, _, _ in self._lit_outs}
        in_reads = [np.sort(np.concatenate(reads[s])) if s in reads else np.zeros(0) for s in self._in_slots]
        out_ready = [0.0 if (j in lits or s in fixed) else ready.get(s, t) for j, s in enumerate(self._out)]
        return StepTiming(runs, starts, host, in_reads, out_ready, collectives)

    def __call__(self, tensors: Sequence[torch.Tensor]) -> List[Any]:
        """Run on the flat input tensors (``ir.inputs`` order); returns the values of ``ir.outputs``."""
        if self._layout is not None:      # weights read from their cached layout (tn.lower.layout)
            laid = self._call_laid_out(tensors)
            if laid is not None:
                return laid
        if len(tensors) != len(self._in_slots):
            raise ArgumentValueError(f"neuron executable: the program takes {len(self._in_slots)} input tensors, got "
                                     f"{len(tensors)}; pass the flattened inputs in ir.inputs order")
        env: List[Any] = [None] * self._nslots
        for s, v in self._init:
            env[s] = v
        for s, t in zip(self._in_slots, tensors):
            if not t.is_cpu:
                t = t.cpu()
            if t.requires_grad:
                t = t.detach()
            env[s] = t
        runs = []
        empty = torch.empty
        for st, frees in zip(self._steps, self._frees):
            if type(st) is _ProgStep:
                vals = st.blank.copy()
                for idx, s in st.ins:
                    t = env[s]
                    if not t.is_contiguous():
                        t = t.contiguous()
                    vals[idx] = t
                for idx, s, size, dtype in st.alloc:
                    env[s] = vals[idx] = empty(*size, dtype=dtype)
                if st.flag is None:
                    runs.append(st.call(vals))
                else:
                    flag = vals[st.flag] = np.zeros(1, dtype=np.int32)
                    runs.append(st.call(vals))
                    if flag[0] != 0:
                        return self._recompute_on_host(tensors, runs)
            else:
                args = [env[v] if is_s else v for is_s, v in st.ins]
                try:
                    r = st.impl(*args, **st.attrs)
                except Exception as e:
                    if isinstance(e, TnError) and st.name in COLLECTIVE_OPS:
                        raise       # a collective's own error (ranks disagree, a rank died) says what happened
                    raise ExecutionError(f"neuron executable: host fallback of {st.name!r} (equation {st.k}) failed: "
                                         f"{type(e).__name__}: {e}") from e
                if len(st.outs) == 1:
                    if isinstance(r, (tuple, list)):
                        (r,) = r
                    env[st.outs[0]] = r
                else:
                    for s, v in zip(st.outs, r):
                        env[s] = v
            for s in frees:
                env[s] = None
        result = [env[s] for s in self._out]
        for j in self._copy_outs:      # an input or constant returned as an output comes back as a copy
            result[j] = result[j].clone()
        for j, value, dtype in self._lit_outs:
            result[j] = torch.tensor(value, dtype=dtype)
        self.last_profile = ExecProfile(runs, self._host_counts,
                                        [st.last for st in self._collective_steps if st.last is not None])
        if self._host_counts:
            _note_host_ops(self._host_counts)
        return result

    def _recompute_on_host(self, tensors: Sequence[torch.Tensor], runs: list) -> List[Any]:
        """A program flagged a value outside the chip's exact range: this call runs on the host instead."""
        from ..reference import run_ir

        if self._collective_steps:
            raise ExecutionError("neuron executable: a program computed values outside the chip's exact range (int64 "
                          "beyond 2**24) in a call with collectives; it cannot be recomputed on the host (the "
                          "other ranks would not repeat the collectives). Keep int64 values small or compute "
                          "them outside the compiled region")
        if not getattr(self, "_warned_range", False):
            self._warned_range = True
            log.warning("tn.lower: a NeuronCore program computed values outside its exact range (int64 values "
                        "beyond 2**24); this call (and any later one that does so) is recomputed on the host")
        host = dict(self._host_counts)
        host["<out of range: whole call>"] = host.get("<out of range: whole call>", 0) + 1
        result = run_ir(self.ir, [t.detach().cpu() if t.requires_grad or t.device.type != "cpu" else t
                                  for t in tensors])
        self.last_profile = ExecProfile(runs, host)
        _note_host_ops({"<out of range: whole call>": 1})
        return result

    def __repr__(self) -> str:
        s = self.stats
        return (f"<NeuronExecutable {s['programs']} program(s), {s['instructions']} instructions, "
                f"host ops {s['host_ops']}>")


def _collective() -> Any:
    """:mod:`tn.lower.collective` (imported late: it registers lowerings)."""
    from . import collective

    return collective


def _note_host_ops(counts: Dict[str, int]) -> None:
    """Tell active ``tn.profile()`` blocks about host fallbacks."""
    from ..profile import note_host_op

    for name, n in counts.items():
        note_host_op(name, n)


def compile_ir(ir: IR, *, arch: Any = None, strict: Optional[bool] = None, debug: bool = False,
               fuse: bool = True, name: Optional[str] = None) -> NeuronExecutable:
    """Compile ``ir`` for the software NeuronCore (the ``"neuron"`` jit backend's ``compile_fn``).

    ``arch``: ``"trn2"`` (default) or ``"trn1"``. ``strict``: host fallbacks
    become :class:`tn.UnsupportedOpError` (default from ``TN_STRICT``).
    ``debug``: record the emitting file:line of every instruction (for error
    messages). ``fuse``: fuse elementwise chains, row reductions and
    epilogues (:mod:`tn.lower.fusion`). ``name``: the programs' name prefix (default ``ir.name``, the
    traced function or module, else ``tn``); profiles show ``{name}_{k}_{what it computes}``
    (:func:`program_name`).
    """
    return NeuronExecutable(ir, arch=arch, strict=strict, debug=debug, fuse=fuse,
                            name=name if name is not None else ir.name)
