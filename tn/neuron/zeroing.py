# Which bytes of a program's runtime-allocated HBM tensors (outputs, scratch) must start as zeros: the rest is written first.
"""Zero only what a program could see unzeroed.

The runtime's contract for an output or scratch HBM tensor it allocates (left
unbound by the caller, see :class:`tn.neuron.runtime.PreparedCall`) is "it
starts as zeros". Zeroing a compiled training step's ~10 MB of scratch on every
call costs most of the call's host set-up, while the program writes those bytes
with a DMA before anything reads them. :func:`zero_ranges` walks a program
once, in program order (the engine executes records in that order), over the
DMA accesses to those tensors, and returns per tensor (:class:`Ranges`):

* ``read_first``: bytes a DMA may read before a DMA has certainly written them
  (a read of an unwritten byte must see 0), and
* ``unwritten``: bytes no DMA certainly writes (whoever looks at the tensor
  after the run must see 0 there).

Every other byte is written by the program before it can be read, so neither
the run nor its results depend on what the memory held before. The runtime
zeroes ``read_first`` and the outputs' ``unwritten`` before a run, and a
scratch tensor's ``unwritten`` only when someone makes arrays of the run's
allocated tensors (``RunResult.outputs``): a compiled program declares scratch
tensors for values it keeps on chip and never touches in HBM.

Only DMA instructions address HBM (compute engines cannot). A ``dma_copy``
writes exactly the elements of its destination pattern, so those count as
written; a read counts its exact source pattern. Accesses that cannot be
bounded exactly are conservative: a ``dma_gather`` may read any row of its
table view, an accumulating ``dma_scatter`` may read any row, and a scatter
writes only where its indices point, so it never counts as writing. An access
pattern that does not fit its tensor (the engine rejects it when it runs)
marks the whole tensor. The walk is done once per program and cached by the
runtime.

Example (y's right half is never written, s never at all)::

    prog = Program("p")
    x = prog.hbm("x", (4, 8))
    y = prog.hbm("y", (4, 8), kind="output")
    prog.hbm("s", (4, 8), kind="scratch")
    t = prog.sbuf((4, 8))
    prog.dma_copy(t, x)
    prog.dma_copy(y[:, :4], t[:, :4])
    enc = prog.build()
    zero_ranges(enc.records, enc.hbm)
    # {1: Ranges(read_first=(), unwritten=((16, 32), (48, 64), (80, 96), (112, 128))),
    #  2: Ranges(read_first=(), unwritten=((0, 128),))}
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from . import isa

__all__ = ["zero_ranges", "block_ranges", "Ranges"]

_as_strided = np.lib.stride_tricks.as_strided
_COPY, _GATHER, _SCATTER = isa.OPCODES["dma_copy"], isa.OPCODES["dma_gather"], isa.OPCODES["dma_scatter"]
_W = isa.OPERAND_WIDTH
_B = isa.OPERAND_BASE


def _field(slot: int, f: int) -> int:
    return _B + slot * _W + f


class Ranges(NamedTuple):
    """What one output/scratch tensor needs zeroed, as two tuples of sorted, disjoint ``(start, stop)`` byte ranges
    relative to the tensor: ``read_first``, bytes the program may read before it has certainly written them (they
    must be zero before it runs), and ``unwritten``, bytes it certainly never writes (zero when anyone looks at the
    tensor after the run). The two may overlap."""

    read_first: tuple = ()
    unwritten: tuple = ()


def zero_ranges(records, hbm) -> dict:
    """``{HBM tensor index: Ranges}`` for every output and scratch tensor of an encoded program (its ``records``
    and ``hbm`` tensors, as in :class:`tn.neuron.program.Encoded`): which of its bytes may be read before the
    program writes them, and which it never writes (see the module docstring). Zeroing both before the run
    reproduces a run on an all-zero tensor exactly; a tensor with two empty tuples is written everywhere before
    anything reads it."""
    cand = {t.index: t for t in hbm if t.kind in ("output", "scratch")}
    if not cand:
        return {}
    recs = np.asarray(records, dtype=np.int64)
    accesses = []   # (instruction, slot, read, write) in program order, reads of one instruction first
    if len(recs):
        ops = recs[:, isa.H_OPCODE]
        keys = np.fromiter(cand, np.int64, len(cand))
        hit = [(recs[:, _field(s, isa.O_MEM)] == isa.MEM_HBM) & np.isin(recs[:, _field(s, isa.O_BUF)], keys)
               for s in (0, 1)]
        dma = (ops == _COPY) | (ops == _GATHER) | (ops == _SCATTER)
        for i in np.flatnonzero(dma & (hit[0] | hit[1])).tolist():
            op = int(ops[i])
            if op == _COPY:
                if hit[1][i]:
                    accesses.append((i, 1, True, False))
                if hit[0][i]:
                    accesses.append((i, 0, False, True))
            elif op == _GATHER:
                if hit[1][i]:
                    accesses.append((i, 1, True, False))     # any row of the table view may be read
            elif hit[0][i]:                                   # scatter: written only where indices point
                accesses.append((i, 0, bool(recs[i, isa.H_FLAGS] & isa.FLAG_ACCUMULATE), False))
    # the unit of a tensor's maps: the gcd of its element size and every access's (bytes if they differ)
    unit = {b: isa.DTYPE_SIZES[isa.dtype_code(t.dtype)] for b, t in cand.items()}
    for i, slot, _, _ in accesses:
        b = int(recs[i, _field(slot, isa.O_BUF)])
        es = isa.DTYPE_SIZES.get(int(recs[i, _field(slot, isa.O_DTYPE)]), 1)
        unit[b] = math.gcd(unit[b], es)
    written = {}
    need = {}
    whole = set()
    for i, slot, read, write in accesses:
        b = int(recs[i, _field(slot, isa.O_BUF)])
        if b in whole:
            continue
        t = cand[b]
        w = written.get(b)
        if w is None:
            w = written[b] = np.zeros(t.nbytes // unit[b], np.bool_)
        pat = _pattern(recs[i], slot, unit[b], t.nbytes)
        if pat is None:
            whole.add(b)
            continue
        if read:
            nd = need.get(b)
            if nd is None:
                nd = need[b] = np.zeros(len(w), np.bool_)
            if type(pat) is slice:
                np.logical_or(nd[pat], ~w[pat], out=nd[pat])
            else:
                rv = _as_strided(nd[pat[0]:], pat[1], pat[2])
                rv[~_as_strided(w[pat[0]:], pat[1], pat[2])] = True
        if write:
            if type(pat) is slice:
                w[pat] = True
            else:
                _as_strided(w[pat[0]:], pat[1], pat[2])[...] = True
    out = {}
    for b, t in cand.items():
        if b in whole:
            out[b] = Ranges(((0, t.nbytes),), ((0, t.nbytes),))
        elif b not in written:
            out[b] = Ranges((), ((0, t.nbytes),))
        else:
            nd = need.get(b)
            out[b] = Ranges(() if nd is None else _runs(nd, unit[b]), _runs(~written[b], unit[b]))
    return out


def _runs(mask: np.ndarray, unit: int) -> tuple:
    """The ``(start, stop)`` byte ranges of the True runs of ``mask`` (one entry per ``unit`` bytes)."""
    if not mask.any():
        return ()
    edges = np.flatnonzero(np.diff(mask.view(np.int8), prepend=0, append=0))
    edges *= unit
    return tuple(zip(edges[0::2].tolist(), edges[1::2].tolist()))


def _pattern(rec, slot: int, unit: int, nbytes: int):
    """The elements operand ``slot`` of record ``rec`` (an HBM access) touches, in ``unit``-byte cells of its
    tensor: a ``slice`` when they are one contiguous range, else ``(start, shape, strides)`` for ``as_strided``
    over a one-byte-per-cell map sliced from ``start``; None when the pattern does not fit the tensor."""
    base = _B + slot * _W
    es = isa.DTYPE_SIZES.get(int(rec[base + isa.O_DTYPE]))
    if es is None or es % unit:
        return None
    k = es // unit
    dims = [(int(rec[base + isa.O_PCOUNT]), int(rec[base + isa.O_PSTRIDE]))]
    dims += [(int(rec[base + isa.O_NUM0 + 2 * d]), int(rec[base + isa.O_NUM0 + 2 * d + 1])) for d in range(4)]
    off = int(rec[base + isa.O_OFFSET])
    lo = hi = 0
    for n, s in dims:
        if n < 1:
            return None
        if s >= 0:
            hi += (n - 1) * s
        else:
            lo += (n - 1) * s
    if off + lo < 0 or (off + hi + 1) * es > nbytes:
        return None
    # one contiguous range: the axes of size > 1 nest exactly (strides 1, n1, n1*n2, ... in some order)
    live = sorted((abs(s), n) for n, s in dims if n > 1)
    step = 1
    for s, n in live:
        if s != step:
            break
        step *= n
    else:
        return slice((off + lo) * k, (off + hi + 1) * k)
    shape = tuple(n for n, _ in dims) + (k,)
    strides = tuple(s * k for _, s in dims) + (1,)
    return off * k, shape, strides


def block_ranges(ranges: dict, carve, offsets, merge_gap: int = 0) -> tuple:
    """The byte ranges to zero in a block holding the tensors ``carve`` (HBM indices) at byte ``offsets``:
    ``ranges[i]`` are tensor ``i``'s ``(start, stop)`` ranges relative to the tensor (any order, may overlap; a
    tensor missing from ``ranges`` needs none). Returns them sorted and disjoint, two ranges less than
    ``merge_gap`` bytes apart merged into one (zeroing a short gap the program writes anyway costs less than
    one more call)."""
    out = []
    for i, o in sorted(zip(carve, offsets), key=lambda p: p[1]):
        for s, e in sorted(ranges.get(i, ())):
            if e <= s:
                continue
            s += o
            e += o
            if out and s - out[-1][1] < merge_gap:
                out[-1][1] = max(out[-1][1], e)
            else:
                out.append([s, e])
    return tuple((s, e) for s, e in out)
