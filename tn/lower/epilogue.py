# Matmul/conv/reduction epilogues: the elementwise equations after a head applied to its output tiles in SBUF.
"""Epilogues: a run of elementwise equations applied inside the head's stores.

After a matmul/conv/reduction/pool equation (the *head*), a run of
elementwise equations of its output's shape is applied inside ``ctx.store``
(see :mod:`tn.lower.base`): each output tile goes through the chain on chip
(tile rules on SBUF/PSUM tiles, the chain's other operands loaded for the same
region) and only the chain's results are stored. A leading ``+ bias`` of a
matmul may be added in PSUM by the matmul itself (:attr:`EpilogueGroup.bias`).
:func:`tn.lower.fusion.plan` proposes the epilogues.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..ir import Eqn, Literal, Var
from ..neuron import isa
from ..neuron.program import HbmTensor, HbmView
from .base import NEURON_DTYPES, HandoffError, handoff_shape, resident_view, store_tile
from ..shapes import contiguous_strides, numel
from .tile import _broadcastable, _lstrip1, _space_strides, is_alias_reshape

__all__ = ["EpilogueGroup", "EPILOGUE_CACHE_BYTES", "EPILOGUE_RING_BYTES"]

#: Bytes per partition an epilogue may keep loaded across output tiles (row-invariant operands: biases).
EPILOGUE_CACHE_BYTES = 16 * 1024
#: Bytes per partition an epilogue may keep as double buffers of its values across output tiles.
EPILOGUE_RING_BYTES = 24 * 1024


def _map_view(dst: Any, out_shape: Sequence[int], op_strides: Sequence[int]) -> Optional[Tuple[int, list]]:
    """The region of a value with ``op_strides`` (in the output's index space) matching the output view ``dst``.

    Returns ``(element offset, [(num, stride), ...])`` or None if some axis of
    ``dst`` cannot be expressed for that value.
    """
    out_shape = tuple(out_shape) or (1,)
    op_strides = list(op_strides) or [0]
    cs = list(contiguous_strides(out_shape))
    nd = len(out_shape)

    def unravel(lin: int) -> List[int]:
        idx = []
        for c in cs:
            idx.append(lin // c)
            lin %= c
        return idx

    base = unravel(dst.offset)
    off = sum(i * s for i, s in zip(base, op_strides))
    dims = []
    for n, s in dst.dims:
        if n == 1 or s == 0:
            dims.append((n, 0))
            continue
        d = next((j for j in range(nd) if cs[j] <= s and s % cs[j] == 0 and out_shape[j] > 1), None)
        if d is None:
            return None
        c = s // cs[d]
        if base[d] + (n - 1) * c >= out_shape[d]:
            # spans outer axes: fine only if the value is contiguous across them
            span_end = base[d] + (n - 1) * c
            j = d
            while span_end >= out_shape[j] and j > 0:
                if op_strides[j - 1] != op_strides[j] * out_shape[j]:
                    return None
                span_end //= out_shape[j]
                j -= 1
        dims.append((n, c * op_strides[d]))
    return off, dims


def is_regroup(e: Eqn, hv: Var, made: Any) -> bool:
    """Whether ``e`` is a reshape of a value in ``made`` (an epilogue's head ``hv`` and its chain values, all
    of the head's size) that keeps the last axis and only regroups the leading ones (``[B * S, F]`` <->
    ``[B, S, F]``): the same elements at the same flat places, so in the epilogue the same tile, and a view
    of the head's layout for its stores."""
    if e.op.name != "reshape" or len(e.outputs) != 1 or not isinstance(e.inputs[0], Var) or e.inputs[0] not in made:
        return False
    x, y = e.inputs[0], e.outputs[0]
    return x.dtype == y.dtype and bool(y.shape) and bool(hv.shape) and y.numel == hv.numel and \
        y.shape[-1] == hv.shape[-1] and x.shape[-1] == hv.shape[-1]


class EpilogueGroup:
    """Elementwise equations applied to the output tiles of ``head`` inside ``ctx.store``."""

    def __init__(self, head: Eqn, eqns: List[Eqn], inputs: List[Var], outputs: List[Var]):
        self.head = head
        self.eqns = eqns
        self.inputs = inputs      # external Vars of the chain (not the head's output)
        self.outputs = outputs    # Vars stored (may include the head's output)
        self.covered = 0
        self._cache: Dict[Any, Any] = {}
        self._cached_bytes = 0
        self._rings: Dict[Any, Any] = {}
        self._ring_bytes = 0
        #: ``(bias Var, add Eqn)`` when the chain starts with ``head + bias`` (a row vector of the head's dtype)
        #: that the head matmul may add in PSUM instead (set ``absorbed`` when it does)
        self.bias = self._bias_candidate()
        self.absorbed = False
        made = {head.outputs[0]}
        #: the chain's reshapes that are the same tile (leading size-1 axes, or the head's leading axes regrouped)
        self.aliases = set()
        for e in eqns:
            if is_alias_reshape(e) or is_regroup(e, head.outputs[0], made):
                self.aliases.add(id(e))
            made.update(e.outputs)

    def _bias_candidate(self, any_dtype: bool = False) -> Optional[Tuple[Var, Eqn]]:
        hv = self.head.outputs[0]
        if self.head.op.name != "matmul" or hv.ndim != 2 or not self.eqns or hv in self.outputs or \
                (hv.dtype not in (torch.bfloat16, torch.float16) and not any_dtype):
            return None
        e0 = self.eqns[0]
        if e0.op.name != "add" or len(e0.inputs) != 2:
            return None
        a, b = e0.inputs
        if b is hv:
            a, b = b, a
        if a is not hv or not isinstance(b, Var) or b is hv or b.dtype != hv.dtype or \
                _lstrip1(b.shape) != (int(hv.shape[-1]),) or e0.outputs[0].dtype != hv.dtype:
            return None
        if any(hv in ee.inputs for ee in self.eqns[1:]):
            return None
        return b, e0

    def finish(self, prog: Any, ctx: Any = None) -> None:
        """Free the operand tiles kept across tiles of the head lowering (call after it returns); hand the
        whole-value tiles of outputs left in SBUF to ``ctx`` (freed when not complete)."""
        for v, (pv, t, _) in getattr(self, "_pub", {}).items():
            numel = max(1, self.head.outputs[0].numel)
            if ctx is not None and self.covered == numel:
                ctx.publish(pv, t)
            else:
                prog.free(t)
        self._pub = {}
        for t in self._cache.values():
            prog.free(t)
        self._cache.clear()
        self._cached_bytes = 0
        for tiles, _ in self._rings.values():
            for t in tiles:
                prog.free(t)
        self._rings.clear()
        self._ring_bytes = 0

    def _row_operand(self, ctx: Any, v: Var, off: int, dims: list, tshape: tuple, in_hbm: Any) -> Any:
        """A row-invariant operand (a bias: the same for every partition) as a view of the whole of ``v``,
        loaded once per head lowering into one partition and broadcast to all on GpSimd
        (``partition_shuffle``): a DMA broadcasting it would move it once per partition. None when ``v`` is
        not row-invariant here, too large to keep, or the region is not a view of it."""
        if dims[0][1] != 0 or len(dims) != len(tshape) or any(n != m for (n, _), m in zip(dims[1:], tshape[1:])):
            return None
        n = max(1, v.numel)
        isz = isa.DTYPE_SIZES[isa.dtype_code(NEURON_DTYPES[v.dtype])]
        key = (v, "row")
        whole = self._cache.get(key)
        if whole is None:
            if tshape[0] < 2:
                return None
            whole = self._load_row(ctx, v, in_hbm)
            if whole is None:
                return None
        if any(s < 0 for _, s in dims[1:]) or off + sum((m - 1) * s for m, s in dims[1:]) >= n:
            return None
        return whole[:tshape[0]]._derive(offset=whole.offset + off * isz, dims=[(m, s) for m, s in dims[1:]])

    def _load_row(self, ctx: Any, v: Var, in_hbm: Any) -> Any:
        """All of ``v`` in every partition (one-partition DMA + GpSimd broadcast), cached; None if too large."""
        prog = ctx.prog
        P = ctx.arch.partitions
        n = max(1, v.numel)
        isz = isa.DTYPE_SIZES[isa.dtype_code(NEURON_DTYPES[v.dtype])]
        if self._cached_bytes + n * isz > EPILOGUE_CACHE_BYTES:
            return None
        whole = prog.sbuf((P, n), NEURON_DTYPES[v.dtype])
        stage = prog.sbuf((P, n), NEURON_DTYPES[v.dtype])
        prog.dma_copy(stage[0:1, :], HbmView(in_hbm(v), 0, [(1, 0), (n, 1)]))
        prog.partition_shuffle(whole, stage, [0] * P)
        prog.free(stage)
        self._cache[(v, "row")] = whole
        self._cached_bytes += n * isz
        return whole

    def preload(self, ctx: Any, in_hbm: Any) -> None:
        """Load the chain's row-invariant operands (biases: constant along every axis but the last) now,
        before the head lowering's own DMAs (the DMA pipe serves transfers in program order)."""
        shape = self.head.outputs[0].shape or (1,)
        for v in self.inputs:
            if self.bias is not None and v is self.bias[0] and not any(v in ee.inputs for ee in self.eqns[1:]):
                continue
            if v.dtype == torch.int64 or not _broadcastable(v.shape, shape) or len(shape) < 2:
                continue
            st = _space_strides(v.shape, shape)
            if st[-1] == 1 and all(x == 0 for x in st[:-1]) and shape[-1] > 1:
                self._load_row(ctx, v, in_hbm)

    def make_hook(self, ctx: Any, head_out: Any, in_hbm: Any, out_hbm: Any):
        """The ``ctx.unit.store_hook`` applying this chain to tiles written into ``head_out``.

        ``in_hbm(v)`` / ``out_hbm(v)`` return the HbmTensor of a chain input /
        stored output (declared on first use).
        """
        hv = self.head.outputs[0]
        shape = hv.shape or (1,)
        prog = ctx.prog
        self.covered = 0
        # SBUF hand-off: outputs the next lowerings read from SBUF are written into whole-value tiles (the
        # value computing them writes there directly; aliases resolved) and not stored
        root: Dict[Var, Var] = {}
        for e in self.eqns:
            if id(e) in self.aliases:
                root[e.outputs[0]] = root.get(e.inputs[0], e.inputs[0])
        wants = ctx.wants
        pub: Dict[Var, Any] = {}          # computed Var -> (published Var, whole tile, cols)
        for v in self.outputs:
            if wants(v) and handoff_shape(v) == (handoff_shape(hv)[0], shape[-1]):
                rows, cols = handoff_shape(v)
                t = prog.sbuf((rows, cols), NEURON_DTYPES[v.dtype])
                pub[root.get(v, v)] = (v, t, cols)
        self._pub = pub

        def handed_off(v: Var) -> bool:
            # only the published Var itself skips its HBM store: another output sharing its storage (the head
            # a published reshape aliases, needed as a program result) is still stored
            ent = pub.get(root.get(v, v))
            return ent is not None and ent[0] is v

        def pub_view(v: Var, dst: Any) -> Any:
            ent = pub.get(v)
            return None if ent is None else resident_view(ent[1], ent[2], dst)

        def hook(dst: Any, tile: Any) -> bool:
            self.absorbed = self.bias is not None and ctx.unit.bias_added
            if isinstance(dst, HbmTensor):
                dst = dst.view()
            if not isinstance(dst, HbmView) or dst.tensor is not head_out:
                return False
            if dst.dims and not all(n == 1 for n, _ in dst.dims) and dst.dims[0][1] == 0 and dst.dims[0][0] > 1:
                return False
            maps = {}
            for v in self.inputs:
                m = _map_view(dst, shape, _space_strides(v.shape, shape) if v.shape else [0] * len(shape))
                if m is None:
                    return False
                maps[v] = m
            tshape = tile.shape
            p = tshape[0]
            allocated = []
            env: Dict[Var, Any] = {}

            def tmp(key: Any, dtype: str) -> Any:
                # two buffers per value kept across stores (the next tile's epilogue need not wait for this
                # tile's store to read its buffer), within EPILOGUE_RING_BYTES; beyond, one buffer per store
                k = (key, tuple(tshape), dtype)
                ring = self._rings.get(k)
                if ring is None:
                    nbytes = 2 * isa.DTYPE_SIZES[isa.dtype_code(dtype)] * max(1, numel(tshape[1:]))
                    if self._ring_bytes + nbytes <= EPILOGUE_RING_BYTES:
                        ring = self._rings[k] = [[prog.sbuf(tshape, dtype) for _ in range(2)], 0]
                        self._ring_bytes += nbytes
                if ring is None:
                    t = prog.sbuf(tshape, dtype)
                    allocated.append(t)
                    return t
                ring[1] += 1
                return ring[0][ring[1] % 2]

            views = {v: pub_view(v, dst) for v in pub}
            for v, t in views.items():
                if t is None:
                    raise HandoffError(pub[v][0], "epilogue: an output tile is not a row block of the SBUF hand-off")
            # compute engines may only start at partition 0, 32, 64 or 96: a hand-off row block starting
            # elsewhere (one row per batch of a small batched matmul) is computed in a scratch tile and moved
            # into place by DMA, which has no such rule
            moved = {v: t for v, t in views.items() if t.pstart % 32}
            for v in moved:
                views[v] = tmp(("moved", v), NEURON_DTYPES[v.dtype])
            src = tile
            hv_pub = hv if hv in views else (self.bias[1].outputs[0] if self.absorbed else None)
            if hv_pub is not None and hv_pub in views:
                # the head's tile is (or, with the bias added in PSUM, the first value is) left in SBUF
                src = views[hv_pub]
                prog.tensor_copy(src, tile, engine="scalar" if tile.mem == isa.MEM_PSUM else "vector")
            elif tile.mem == isa.MEM_PSUM and tile.dtype != NEURON_DTYPES[hv.dtype] or \
                    tile.dtype != NEURON_DTYPES[hv.dtype]:
                src = tmp(hv, NEURON_DTYPES[hv.dtype])
                prog.tensor_copy(src, tile, engine="scalar" if tile.mem == isa.MEM_PSUM else "vector")
            env[hv] = src
            if hv in self.outputs and not handed_off(hv):
                store_tile(prog, dst, src)
            for v, (off, dims) in maps.items():
                if self.absorbed and v is self.bias[0] and not any(v in ee.inputs for ee in self.eqns[1:]):
                    continue            # added in PSUM by the head matmul
                row = self._row_operand(ctx, v, off, dims, tshape, in_hbm)
                if row is not None:
                    env[v] = row
                    continue
                # stride-0 free axes are loaded once and broadcast by a stride-0 tile view
                lshape = (p,) + tuple(n if s != 0 else 1 for n, s in dims[1:])
                ldims = [dims[0]] + [(n, s) if s != 0 else (1, 0) for n, s in dims[1:]]
                key = (v, off, tuple(ldims))
                t = self._cache.get(key)
                if t is None:
                    t = prog.sbuf(lshape, NEURON_DTYPES[v.dtype])
                    nbytes = t.itemsize * max(1, numel(lshape[1:]))
                    if ldims[0][1] == 0 and self._cached_bytes + nbytes <= EPILOGUE_CACHE_BYTES:
                        # the same for every row tile (a bias): loaded once for the whole head lowering
                        self._cache[key] = t
                        self._cached_bytes += nbytes
                    else:
                        allocated.append(t)
                    prog.dma_copy(t, HbmView(in_hbm(v), off, ldims))
                env[v] = t.broadcast_to(tshape) if lshape != tuple(tshape) else t
            for e in self.eqns:
                if id(e) in self.aliases:
                    env[e.outputs[0]] = env[e.inputs[0]]
                    continue
                if self.absorbed and e is self.bias[1]:
                    env[e.outputs[0]] = env[hv]     # the head's tile already holds head + bias
                    continue
                outs = []
                for v in e.outputs:
                    t = views[v] if v in views else tmp(v, NEURON_DTYPES[v.dtype])
                    env[v] = t
                    outs.append(t)
                args = [a.value if isinstance(a, Literal) else env[a] for a in e.inputs]
                e.op.tile_rule(ctx, e, outs[0] if len(outs) == 1 else outs, args)
            for v in self.outputs:
                if v is hv or handed_off(v):
                    continue
                prog.dma_copy(HbmView(out_hbm(v), dst.offset, dst.dims), env[v])
            for v, t in moved.items():
                prog.dma_copy(t, views[v])
            for t in allocated:
                prog.free(t)
            n = 1
            for d in tshape:
                n *= d
            self.covered += n
            return True

        return hook

    def __repr__(self) -> str:
        return f"<EpilogueGroup {self.head.op.name} -> {[e.op.name for e in self.eqns]}>"
