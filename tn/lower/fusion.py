# Tiled elementwise execution and fusion: chains of elementwise ops (and row reductions) computed tile by tile in SBUF.
"""The tile engine behind every elementwise lowering, and the fusion planner.

**Iteration space.** A *map group* is a list of elementwise equations (one,
for a plain lowering) over a common broadcast shape ``S``. Every value that
touches HBM (group inputs and outputs) gets element strides in ``S`` (0 on
broadcast axes). Adjacent axes that are contiguous for every such value are
merged (as PyTorch's TensorIterator does), giving ``(outer..., R, C)``: the
outer axes are looped in Python, ``R`` is spread over the 128 partitions with
``k`` consecutive rows per partition folded into the free axis, and ``C`` is
tiled to the free-size budget. A tile is ``[p, k, f]``; each input is DMA'd
with its own access pattern (stride-0 axes are loaded once and broadcast in
SBUF by a stride-0 tile view), the equations' tile rules
(:data:`tn.lower.elementwise.TILE_RULES`) run on SBUF tiles, and outputs are
DMA'd back. Tiles of two consecutive iterations are kept alive (double
buffering), so the DMA of tile ``i+1`` overlaps the compute of tile ``i``.

**Fusion.** :func:`plan` finds runs of consecutive elementwise equations
whose intermediates are used only inside the run and have the run's full
shape; such a run is lowered as one map group, so intermediates never touch
HBM (the compiler counts them in ``stats["fused_eqns"]``).
"""
from __future__ import annotations

from collections import deque
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..ir import IR, Eqn, Literal, Var
from .base import NEURON_DTYPES, CannotLower

__all__ = ["plan", "MapGroup", "lower_map", "SBUF_BUDGET", "MAX_FREE"]

#: Bytes per partition the tile engine may use for one group (both buffers).
SBUF_BUDGET = 160 * 1024
#: Largest free size (elements per partition) of one tile.
MAX_FREE = 8192
#: Tiles of this many consecutive iterations stay allocated (2 = double buffering).
NBUF = 2


def _contig_strides(shape: Sequence[int]) -> List[int]:
    st = []
    s = 1
    for n in reversed(shape):
        st.append(s)
        s *= n
    return list(reversed(st))


def _space_strides(shape: Sequence[int], space: Sequence[int]) -> List[int]:
    """Element strides of a contiguous tensor of ``shape`` broadcast into ``space`` (0 on broadcast axes)."""
    shape = tuple(shape)
    pad = len(space) - len(shape)
    full = (1,) * pad + shape
    cs = _contig_strides(full)
    return [0 if (n == 1 and m != 1) else s for n, m, s in zip(full, space, cs)]


def _collapse(space: Sequence[int], strides: List[List[int]]) -> Tuple[List[int], List[List[int]]]:
    """Drop size-1 axes and merge neighbours that are contiguous (or both broadcast) for every value."""
    keep = [i for i, n in enumerate(space) if n != 1]
    dims = [space[i] for i in keep]
    sts = [[s[i] for i in keep] for s in strides]
    i = len(dims) - 1
    while i > 0:
        ok = all(st[i - 1] == st[i] * dims[i] for st in sts)
        if ok:
            dims[i - 1] *= dims[i]
            for st in sts:
                st[i - 1] = st[i]
            del dims[i]
            for st in sts:
                del st[i]
        i -= 1
    return dims, sts


class _Layout:
    """How a collapsed space ``(outer..., R, C)`` is cut into tiles ``[p, k, f]``."""

    def __init__(self, dims: List[int], strides: List[List[int]], max_free: int, parts: int):
        if not dims:
            dims = [1]
            strides = [[0] for _ in strides]
        if len(dims) == 1:
            dims = [dims[0], 1]
            strides = [[s[0], 0] for s in strides]
        # few rows and long rows: treat the row axis as outer and the columns as rows (k-folded)
        if dims[-2] < parts and dims[-1] >= 2048:
            dims = dims + [1]
            strides = [s + [0] for s in strides]
        self.outer = dims[:-2]
        self.R, self.C = dims[-2], dims[-1]
        self.strides = strides
        R, C = self.R, self.C
        self.f = min(C, max_free)
        self.kmax = max(1, min(max_free // self.f, -(-R // parts)))
        self.parts = parts

    def tiles(self):
        """Yield ``(outer offsets per value, r0, p, k, c0, f)``."""
        import itertools

        outer_iter = itertools.product(*[range(n) for n in self.outer]) if self.outer else [()]
        nout = len(self.outer)
        for oidx in outer_iter:
            offs = [sum(i * s[d] for d, i in enumerate(oidx)) for s in self.strides]
            r0 = 0
            R = self.R
            while r0 < R:
                left = R - r0
                if left >= self.parts:
                    p = self.parts
                    k = min(self.kmax, left // self.parts)
                else:
                    p, k = left, 1
                c0 = 0
                while c0 < self.C:
                    f = min(self.f, self.C - c0)
                    yield offs, nout, r0, p, k, c0, f
                    c0 += f
                r0 += p * k


class MapGroup:
    """Consecutive elementwise equations lowered together (intermediates in SBUF only).

    Attributes: ``eqns``; ``inputs`` (external Vars, loaded from HBM);
    ``outputs`` (Vars needed after the group, stored to HBM).
    """

    def __init__(self, eqns: List[Eqn], inputs: List[Var], outputs: List[Var]):
        self.eqns = eqns
        self.inputs = inputs
        self.outputs = outputs

    def lower(self, ctx: Any, ins: List[Any], outs: List[Any]) -> None:
        """Emit the group into ``ctx.prog``; ``ins``/``outs`` are the HbmTensors of inputs/outputs."""
        lower_map(ctx, self.eqns, self.inputs, ins, self.outputs, outs)

    def __repr__(self) -> str:
        return f"<MapGroup {[e.op.name for e in self.eqns]}>"


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def check_dtypes(eqn: Eqn) -> None:
    """CannotLower unless every Var of ``eqn`` has an engine dtype (int64 only moves by DMA)."""
    for a in list(eqn.inputs) + list(eqn.outputs):
        if isinstance(a, Var):
            if a.dtype not in NEURON_DTYPES:
                raise CannotLower(f"{eqn.op.name}: dtype {a.dtype} has no NeuronCore equivalent")
            if a.dtype == torch.int64:
                raise CannotLower(f"{eqn.op.name}: int64 values cannot be computed on the NeuronCore engines "
                                  f"(int64 is DMA-only); use int32")


def lower_map(ctx: Any, eqns: List[Eqn], in_vars: List[Var], in_hbm: List[Any], out_vars: List[Var],
              out_hbm: List[Any]) -> None:
    """Lower elementwise ``eqns`` tile by tile (see the module docstring)."""
    from ..neuron.program import HbmView
    from .elementwise import TILE_RULES

    for e in eqns:
        if e.op.name not in TILE_RULES:
            raise CannotLower(f"{e.op.name}: no elementwise tile rule")
        check_dtypes(e)
        pre = getattr(TILE_RULES[e.op.name], "precheck", None)
        if pre is not None:
            pre(e)
    prog = ctx.prog
    shapes = [v.shape for v in in_vars] + [v.shape for v in out_vars]
    for e in eqns:
        shapes += [v.shape for v in e.outputs]
    space = tuple(torch.broadcast_shapes(*shapes)) if shapes else ()
    hbm_vars = list(in_vars) + list(out_vars)
    hbm_tensors = list(in_hbm) + list(out_hbm)
    strides = [_space_strides(v.shape, space) for v in hbm_vars]
    for v in out_vars:
        if tuple(v.shape) != space:
            raise CannotLower(f"group output {v.aval} is smaller than the group's shape {space}")
    dims, sts = _collapse(space, strides)
    # free-size budget from the bytes per element the group keeps per iteration
    per_elem = sum(_itemsize(v.dtype) for v in in_vars)
    per_elem += sum(_itemsize(v.dtype) for e in eqns for v in e.outputs) + 12
    max_free = max(64, min(MAX_FREE, SBUF_BUDGET // (NBUF * per_elem)))
    max_free = 1 << (max_free.bit_length() - 1)
    lay = _Layout(dims, sts, max_free, ctx.arch.partitions)
    rules = [(TILE_RULES[e.op.name], e) for e in eqns]
    out_index = {v: j for j, v in enumerate(out_vars)}
    nin = len(in_vars)
    live: deque = deque()
    for offs, nout, r0, p, k, c0, f in lay.tiles():
        allocated = []
        env: Dict[Var, Any] = {}
        full = (p, k, f)
        for j, v in enumerate(in_vars):
            st = lay.strides[j]
            sr, sc = st[nout], st[nout + 1]
            kk = k if sr != 0 else 1
            pp_stride = sr * k
            ff = f if sc != 0 else 1
            view = HbmView(hbm_tensors[j], offs[j] + r0 * sr + c0 * sc,
                           [(p, pp_stride), (kk, sr), (ff, sc)])
            t = prog.sbuf((p, kk, ff), NEURON_DTYPES[v.dtype])
            allocated.append(t)
            prog.dma_copy(t, view)
            env[v] = t.broadcast_to(full) if (kk, ff) != (k, f) else t
        for rule, e in rules:
            args = [a.value if isinstance(a, Literal) else env[a] for a in e.inputs]
            outs = []
            for v in e.outputs:
                t = prog.sbuf(full, NEURON_DTYPES[v.dtype])
                allocated.append(t)
                env[v] = t
                outs.append(t)
            rule(ctx, e, outs[0] if len(outs) == 1 else outs, args)
        for v, j in out_index.items():
            st = lay.strides[nin + j]
            sr, sc = st[nout], st[nout + 1]
            view = HbmView(hbm_tensors[nin + j], offs[nin + j] + r0 * sr + c0 * sc,
                           [(p, sr * k), (k, sr), (f, sc)])
            prog.dma_copy(view, env[v])
        live.append(allocated)
        while len(live) > NBUF:
            for t in live.popleft():
                prog.free(t)
    while live:
        for t in live.popleft():
            prog.free(t)


# --------------------------------------------------------------------------- planning

def _is_map(eqn: Eqn) -> bool:
    from .elementwise import TILE_RULES

    if eqn.op.category != "elementwise" or eqn.op.name not in TILE_RULES:
        return False
    for a in list(eqn.inputs) + list(eqn.outputs):
        if isinstance(a, Var) and (a.dtype not in NEURON_DTYPES or a.dtype == torch.int64):
            return False
    pre = getattr(TILE_RULES[eqn.op.name], "precheck", None)
    if pre is not None:
        try:
            pre(eqn)
        except CannotLower:
            return False
    return True


def plan(ir: IR, host: Dict[int, str]) -> Dict[int, Any]:
    """Fused groups of ``ir``: first equation index -> :class:`MapGroup` (groups of 2+ equations only).

    A group is a run of consecutive elementwise equations with tile rules,
    none forced to the host, all of one broadcast shape for their outputs;
    values made inside and used after the run become group outputs (they
    must have the full shape, else the run is cut there).
    """
    try:
        from . import elementwise  # noqa: F401  (TILE_RULES)
    except ImportError:
        return {}
    n = len(ir.eqns)
    users: Dict[Var, List[int]] = {}
    for k, e in enumerate(ir.eqns):
        for a in e.inputs:
            if isinstance(a, Var):
                users.setdefault(a, []).append(k)
    outset = {a for a in ir.outputs if isinstance(a, Var)}
    groups: Dict[int, Any] = {}
    k = 0
    while k < n:
        e = ir.eqns[k]
        if k in host or not _is_map(e):
            k += 1
            continue
        shape = e.outputs[0].shape
        end = k + 1
        while end < n and end not in host and _is_map(ir.eqns[end]) and ir.eqns[end].outputs[0].shape == shape:
            end += 1
        # cut the run where a value escaping the run is not of the full shape (always true here: same shapes)
        if end - k >= 2:
            eqns = ir.eqns[k:end]
            made = set()
            inputs: List[Var] = []
            for ee in eqns:
                for a in ee.inputs:
                    if isinstance(a, Var) and a not in made and a not in inputs:
                        inputs.append(a)
                made.update(ee.outputs)
            outputs = [v for ee in eqns for v in ee.outputs
                       if v in outset or any(u >= end for u in users.get(v, ()))]
            groups[k] = MapGroup(list(eqns), inputs, outputs)
        k = end
    return groups
