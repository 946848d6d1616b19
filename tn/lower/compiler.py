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

import logging
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import config
from ..errors import ArgumentValueError, CompileError, ExecutionError, TnError
from ..ir import IR, Var
from ..neuron import get_arch, isa, simulate_timing
from ..ops.collective import COLLECTIVE_OPS
from ..profile import Profile, note_host_op
from ..reference import run_ir
from . import collective, complex_pairs, layout, matmul, status_checks
from .base import NEURON_DTYPES, dataflow
from .emit import Emitted, _HostStep, _ProgStep, emit, unsupported_error
from .schedule import (LaidOutOperand, Schedule, UnitFailed, Vetoes, hoist_gathers, hoist_past_weight_casts,
                       host_reason, plan, plan_transposed, row_any_from_max,
                       sink_casts_past_views, sink_head_splits)

__all__ = ["compile_ir", "NeuronExecutable", "ExecProfile", "StepTiming", "strict_default"]

log = logging.getLogger("tn")

#: The executable's attribute holding each field of :class:`tn.lower.emit.Emitted`.
_EMITTED_FIELDS = (("_nslots", "nslots"), ("_init", "init"), ("_in_slots", "in_slots"), ("_steps", "steps"),
                   ("_frees", "frees"), ("_out", "out"), ("_copy_outs", "copy_outs"), ("_lit_outs", "lit_outs"),
                   ("_host_counts", "host_counts"), ("_collective_steps", "collective_steps"),
                   ("_n_instr", "instructions"), ("_n_fused", "fused"))

#: The debug log line of each kind of veto (a unit that could not be emitted as planned).
_VETO_LOG = {"no_prologue": "prologue of {var} not applied; lowered as equations",
             "no_handoff": "SBUF hand-off of {var} not taken; stored to HBM",
             "nofuse": "fused group at equation {k} not emitted; lowering unfused"}


def strict_default() -> bool:
    """Strict mode from the environment: ``TN_STRICT=1`` turns host fallbacks into errors."""
    return config.get("strict")


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
        prof = Profile()
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
        ir = _collective().sink_waits(ir)   # programs between a collective and its wait overlap it
        ir = hoist_gathers(ir)              # embedding lookups before the adds that sum them (one row group)
        ir = hoist_past_weight_casts(ir)    # an activation's cast next to its producer's group, not after casts
        ir = sink_head_splits(ir)           # q/k/v head splits next to attention (its views, no copies)
        ir = sink_casts_past_views(ir)      # their casts after the splits, next to attention (its prologue)
        ir = row_any_from_max(ir)           # softmax's all-masked-row check from the row max (no score passes)
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
                    raise unsupported_error(ir.eqns[veto.at], veto.reason) from None
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
    def _plan_layouts(self, vetoes: Vetoes) -> Any:
        """The :class:`tn.lower.layout.LayoutPolicy` of this executable, or None.

        Candidates are 2-D program inputs ``W`` read by matmuls only as ``B = W^T``
        (``permute(W, (1, 0))`` used by that matmul alone, the pattern of ``nn.Linear``),
        not written back by the program (mutations) and of a TensorE dtype. The laid-out
        variant reads them from their cached layout instead of transposing them on chip.
        """
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
        self._use(emit(sched, name=self.name, arch=self.arch, strict=self.strict, debug=self.debug,
                       laid_out=self._laid_out))
        self.schedule = sched

    def _use(self, emitted: Emitted) -> None:
        """Keep the steps and value slots :func:`tn.lower.emit.emit` made (what a call runs)."""
        for attr, field in _EMITTED_FIELDS:
            setattr(self, attr, getattr(emitted, field))
        self._plans = None      # per step, its _StepPlan (or None), made by the first call

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
    def model_timing(self, steady_weights: bool = False) -> StepTiming:
        """Time one call on the chip model without computing any value (:func:`tn.neuron.simulate_timing` of
        each program; no input is needed and nothing is allocated): a :class:`StepTiming` with when each input is
        read and each output is ready. For programs too large to run with values (a whole training step of a
        big model); the engine's timing does not depend on data.

        By default this times the plain program, which lays weights out on chip every call: what a call runs
        the first time, or when its weights change every call (a training step). A call whose ``nn.Linear``-style
        weights stay the same between calls runs the laid-out variant instead (weights read from a cached
        layout, see :meth:`_plan_layouts`), which can be much faster (BERT-base inference: ~2.6x);
        ``steady_weights=True`` times that variant (the plain program when there is none)."""
        if steady_weights and self._layout is not None:
            child = self._laid_out_variant()
            if child is not None:
                return child.model_timing()
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

    def __call__(self, tensors: Sequence[torch.Tensor], out: Optional[Sequence[Any]] = None) -> List[Any]:
        """Run on the flat input tensors (``ir.inputs`` order); returns the values of ``ir.outputs``.

        ``out`` (optional, one entry per output, None for most): a contiguous CPU tensor of the output's dtype and
        element count, memory no input shares, that the program computing that output writes instead of a tensor
        the call allocates (the returned value is then that tensor, or a view of it of the output's shape; an
        output not written by a program, or a tensor that does not fit, is allocated as usual)."""
        if self._layout is not None:      # weights read from their cached layout (tn.lower.layout)
            laid = self._call_laid_out(tensors)
            if laid is not None:
                return laid
        dest = None
        if out is not None:
            dest = {}
            for s, t in zip(self._out, out):
                if t is not None and s not in dest:
                    dest[s] = t
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
        plans = self._plans
        if plans is None:
            plans = self._plans = tuple(_step_plan(st) if type(st) is _ProgStep else None for st in self._steps)
        tensor = torch.Tensor
        for st, frees, sp in zip(self._steps, self._frees, plans):
            if sp is not None:          # a program: its values and their addresses in the plan's order
                run = sp.run
                vals = []
                ptrs = []
                for s, tdt, nbytes in sp.ins:
                    t = env[s]
                    if type(t) is tensor and t.dtype is tdt and t.is_cpu and t.is_contiguous() and t.nbytes == nbytes:
                        ptrs.append(t.data_ptr())
                    else:
                        if not t.is_contiguous():
                            t = t.contiguous()
                        ptrs.append(run.address(len(ptrs), t))
                    vals.append(t)
                for s, size, dtype, shape, numel in sp.alloc:   # the HBM tensor's dtype and size (_step_plan)
                    t = dest.get(s) if dest else None
                    if t is not None:       # shape and element count precomputed by _step_plan
                        t = _out_buffer(t, shape, numel, dtype)
                    if t is None:
                        t = empty(*size, dtype=dtype)
                    env[s] = t
                    vals.append(t)
                    ptrs.append(t.data_ptr())
                res = run(vals, ptrs)
                runs.append(res)
                if sp.flag is not None and run.first(res, sp.flag) != 0:
                    return self._recompute_on_host(tensors, runs)
            elif type(st) is _ProgStep:
                vals = st.blank.copy()
                for idx, s in st.ins:
                    t = env[s]
                    if not t.is_contiguous():
                        t = t.contiguous()
                    vals[idx] = t
                for idx, s, size, dtype in st.alloc:
                    t = dest.get(s) if dest else None
                    if t is not None:
                        t = _out_buffer(t, *_out_shape(size), dtype)
                    env[s] = vals[idx] = t if t is not None else empty(*size, dtype=dtype)
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
                    if isinstance(e, torch.linalg.LinAlgError) or getattr(e, "tn_eager_error", False):
                        raise       # eager's own error (torch's SVD of non-finite values, a linalg_check): as is
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


class _StepPlan:
    """How a call binds one program step: its :class:`tn.neuron.runtime.BoundPlan` (the step's inputs, then its
    outputs, every other HBM tensor allocated by the run, the range-check flag too), ``ins`` as (slot, torch
    dtype, nbytes) of the HBM tensor, ``alloc`` as (slot, ``torch.empty`` size arguments, dtype, shape, element
    count) and ``flag`` (the flag's HBM index or None)."""

    __slots__ = ("run", "ins", "alloc", "flag")

    def __init__(self, run: Any, ins: tuple, alloc: tuple, flag: Optional[int]):
        self.run = run
        self.ins = ins
        self.alloc = alloc
        self.flag = flag


def _step_plan(st: _ProgStep) -> Optional[_StepPlan]:
    """The :class:`_StepPlan` of program step ``st``, or None when the step binds in a way a plan does not take
    (an HBM tensor bound twice, an input left unbound, an output whose dtype or size is not its HBM tensor's):
    the call then binds it value by value, with the runtime's checks and errors."""
    idx = [i for i, _ in st.ins] + [i for i, _, _, _ in st.alloc]
    if st.flag is not None and st.flag in idx:
        return None
    try:
        run = st.call.plan(idx)
    except TnError:
        return None
    fast = run.fast
    ins = tuple((s,) + fast[k] for k, (_, s) in enumerate(st.ins))
    alloc = []
    for k, (_, s, size, dtype) in enumerate(st.alloc, len(st.ins)):
        tdt, nbytes = fast[k]
        shape, numel = _out_shape(size)
        if dtype is not tdt or numel * dtype.itemsize != nbytes:
            return None
        alloc.append((s, size, dtype, shape, numel))
    return _StepPlan(run, ins, tuple(alloc), st.flag)


def _out_shape(size: tuple) -> Tuple[tuple, int]:
    """``(shape, element count)`` of a program output from its ``torch.empty`` size arguments ``size``."""
    shape = () if size == ((),) else size
    return shape, math.prod(shape)


def _out_buffer(t: Any, shape: tuple, numel: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``t`` (or its view of ``shape``, with ``numel`` elements: :func:`_out_shape` of a program output) when it can
    be that output's memory: a contiguous CPU tensor of ``dtype`` and the same element count; else None."""
    if type(t) is not torch.Tensor or t.dtype is not dtype or not t.is_cpu or not t.is_contiguous() or \
            t.numel() != numel:
        return None
    return t if t.shape == shape else t.view(shape)


def _collective() -> Any:
    """:mod:`tn.lower.collective` (imported late: it registers lowerings)."""
    return collective


def _note_host_ops(counts: Dict[str, int]) -> None:
    """Tell active ``tn.profile()`` blocks about host fallbacks."""
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
    (:func:`tn.lower.schedule.program_name`). complex64 values are carried as their float32 (re, im) pairs
    (:mod:`tn.lower.complex_pairs`; the executable then takes and returns complex tensors as views of pairs).
    ``torch.linalg`` error checks are read back as a status after the run, not run as host ops inside it
    (:mod:`tn.lower.status_checks`).
    """
    checked, checks = status_checks.hoist_checks(ir)
    pairs, cin, cout = complex_pairs.to_pairs(checked)
    exe = NeuronExecutable(pairs, arch=arch, strict=strict, debug=debug, fuse=fuse,
                           name=name if name is not None else ir.name)
    if pairs is not checked:
        exe = complex_pairs.PairsExecutable(exe, checked, cin, cout)
    return status_checks.CheckedExecutable(exe, len(ir.outputs), checks) if checks else exe
