# Lowerings of the scans cummax, cummin, logcumsumexp: lines on the partitions, log-step scans on VectorE/ScalarE.
"""Associative scans on the NeuronCore.

``cummax``/``cummin`` (values and int64 indices) and ``logcumsumexp`` combine
each element with everything before it on its line by an associative
``combine(earlier, later)``:

* cummax: the later pair wins when ``later >= earlier`` or ``later`` is NaN
  (torch's rule: a NaN wins and stays, ties go to the last index); cummin the
  same with ``<=``. The winner's value and index are taken with ``select``.
* logcumsumexp: each running value is kept as a pair ``(m, s)`` meaning
  ``m + s``, ``m`` the running maximum (an input element, exact) and ``s =
  log(sum(exp(x_i - m)))`` in ``[0, log n]``; ``combine((ma, sa), (mb, sb)) =
  (m, log(exp(ma - m + sa) + exp(mb - m + sb)))`` with ``m = max(ma, mb)``
  (``exp``/``log`` on ScalarE), and the result ``m + s`` is rounded once. This
  is as accurate as eager's scan, which accumulates in double: the earlier
  ``max(a, b) + log(1 + exp(-|a - b|))`` on the rounded results rounded at the
  magnitude of the values at every step (several ulps at 1e4), which the
  gradient's ``exp(x + logcumsumexp(...))`` turned into relative errors of
  1e-3. ``ma - m`` is NaN only for equal infinities and is then taken as 0
  (the result ``m + s`` is that infinity); a NaN input starts with ``s = NaN``,
  which stays NaN and makes the result NaN.

Layout: the scanned axis lies along the free axis and up to 128 lines on the
partitions (the largest other axis, split in blocks of 128; any further axes
are looped). A line is scanned in chunks of at most :data:`CHUNK` elements
with ``ceil(log2(chunk))`` doubling steps (``out[j] = combine(in[j - s],
in[j])`` for ``j >= s``, ping-ponging between two tiles), then the carry (the
previous chunk's last result, a ``[P, 1]`` tile broadcast along the chunk) is
combined into every element. Values are computed in fp32: cummax/cummin only
move values (exact for fp32/bf16/fp16, and for integers below 2**24, which
loading range-checks), indices are fp32 iotas (exact below 2**24).
"""
from __future__ import annotations

import itertools
import math
from typing import List, Tuple

from .base import CannotLower, TileScope, lowering
from .shape import hview, load_checked_int, store_int

__all__ = ["CHUNK"]

#: Longest stretch of a line scanned in one piece (elements per partition).
CHUNK = 2048
_EXACT = 1 << 24
_FLOATS = ("float32", "bfloat16", "float16")


def _line_axes(shape, d) -> List[Tuple[int, int]]:
    """The lines of a scan along ``d`` as (extent, stride) axes: the axes before ``d`` merged, and
    those after it (size-1 axes left out)."""
    n = shape[d]
    inner = math.prod(shape[d + 1:])
    outer = math.prod(shape[:d])
    return [a for a in ((outer, n * inner), (inner, 1)) if a[0] > 1]


class _Scan:
    """One scan lowering: ``kind`` is ``cummax``, ``cummin`` or ``logcumsumexp``."""

    def __init__(self, ctx, eqn, ins, outs):
        self.ctx, self.prog, self.kind = ctx, ctx.prog, eqn.op.name
        xv = eqn.inputs[0]
        self.x_dt = ctx.neuron_dtype(xv.dtype)
        self.with_index = len(outs) == 2
        self.paired = self.with_index or self.kind == "logcumsumexp"   # (value, index) or (max, log-sum)
        if self.kind == "logcumsumexp" and self.x_dt not in _FLOATS:
            raise CannotLower(f"logcumsumexp of {self.x_dt}")
        if self.x_dt not in _FLOATS + ("int32", "int64", "uint8", "bool"):
            raise CannotLower(f"{self.kind} of {self.x_dt}")
        if self.with_index and ctx.neuron_dtype(eqn.outputs[1].dtype) != "int64":
            raise CannotLower(f"{self.kind} with {eqn.outputs[1].dtype} indices")
        self.shape = tuple(xv.shape) or (1,)
        self.d = eqn.attrs["dim"] % len(self.shape) if xv.shape else 0
        self.n = self.shape[self.d]
        if self.n >= _EXACT:
            raise CannotLower(f"{self.kind} over {self.n} elements: indices beyond 2**24 are not exact in fp32")
        self.x, self.outs = ins[0], outs
        self.cmp = {"cummax": "is_ge", "cummin": "is_le"}.get(self.kind)

    # ---- the combine step: out = combine(a (earlier), b (later)) on [p, w] views

    def combine(self, p: int, w: int, out, a, b) -> None:
        """``out[k] = combine(a[k], b[k])``; ``out``/``a``/``b`` are (value, index) view pairs ((max, log-sum)
        for logcumsumexp). ``a`` may be a broadcast carry; ``out`` aliases neither."""
        prog = self.prog
        if self.kind == "logcumsumexp":
            self._logaddexp(p, w, out, a, b)
            return
        mask, nan = self.tmp[0][:p, :w], self.tmp[1][:p, :w]
        prog.tensor_tensor(mask, b[0], a[0], self.cmp)
        prog.tensor_tensor(nan, b[0], b[0], "not_equal")
        prog.tensor_tensor(mask, mask, nan, "logical_or")
        prog.select(out[0], mask, b[0], a[0])
        if self.with_index:
            prog.select(out[1], mask, b[1], a[1])

    def _logaddexp(self, p, w, out, a, b) -> None:
        prog = self.prog
        m = out[0]
        prog.tensor_tensor(m, a[0], b[0], "max")
        terms = []
        for t, (mx, sx) in zip(self.tmp, (a, b)):
            t = t[:p, :w]
            prog.tensor_tensor(t, mx, m, "subtract")     # <= 0, exact where mx is near m
            prog.tensor_scalar(t, t, "min", 0.0)          # NaN (equal infinities) -> 0: ALU min keeps 0 for NaN
            prog.tensor_tensor(t, t, sx, "add")
            prog.activation(t, t, "exp")
            terms.append(t)
        prog.tensor_tensor(terms[0], terms[0], terms[1], "add")
        prog.activation(out[1], terms[0], "log")

    # ---- emission

    def emit(self) -> None:
        prog = self.prog
        sd = math.prod(self.shape[self.d + 1:])        # stride of the scanned axis
        lines = _line_axes(self.shape, self.d) or [(1, 0)]
        pi = max(range(len(lines)), key=lambda i: lines[i][0])
        part = lines[pi]
        loops = [a for i, a in enumerate(lines) if i != pi]
        c = min(self.n, CHUNK)
        with TileScope(prog) as tiles:
            self.tmp = [tiles.sbuf((128, c), "float32") for _ in range(2)]
            lse = self.kind == "logcumsumexp"
            if lse:
                nan0 = tiles.sbuf((128, 2), "float32")   # [NaN, 0]: a line's first log-sum
                prog.memset(nan0[:, 0:1], math.nan, engine="vector")
                prog.memset(nan0[:, 1:2], 0.0, engine="vector")
            v = [tiles.sbuf((128, c), "float32") for _ in range(2)]
            ix = [tiles.sbuf((128, c), "float32") for _ in range(2)] if self.paired else None
            raw = tiles.sbuf((128, c), "int32" if self.x_dt == "int64" else self.x_dt)
            carry_v = tiles.sbuf((128, 1), "float32")
            carry_i = tiles.sbuf((128, 1), "float32") if self.paired else None
            for combo in itertools.product(*[range(n) for n, _ in loops]):
                base = sum(k * s for k, (_, s) in zip(combo, loops))
                for p0 in range(0, part[0], 128):
                    p = min(128, part[0] - p0)
                    off = base + p0 * part[1]
                    for c0 in range(0, self.n, c):
                        w = min(c, self.n - c0)
                        src = hview(self.x, off + c0 * sd, [(p, part[1]), (w, sd)])
                        self._load(raw, v[0], src, p, w)
                        if self.with_index:
                            prog.iota(ix[0][:p, :w], base=c0, pattern=[1])
                        elif lse:   # s = 0 (NaN for a NaN element)
                            mask = self.tmp[0][:p, :w]
                            prog.tensor_tensor(mask, v[0][:p, :w], v[0][:p, :w], "not_equal")
                            prog.select(ix[0][:p, :w], mask, nan0[:p, 0:1].broadcast_to((p, w)),
                                        nan0[:p, 1:2].broadcast_to((p, w)))
                        k = 0
                        s = 1
                        while s < w:   # doubling step: out[j] = combine(in[j - s], in[j]) for j >= s
                            src_v, dst_v = v[k][:p, :w], v[1 - k][:p, :w]
                            prog.tensor_copy(dst_v[:, :s], src_v[:, :s])
                            a = (src_v[:, :w - s], ix[k][:p, :w - s] if self.paired else None)
                            b = (src_v[:, s:], ix[k][:p, s:w] if self.paired else None)
                            o = (dst_v[:, s:], ix[1 - k][:p, s:w] if self.paired else None)
                            if self.paired:
                                prog.tensor_copy(ix[1 - k][:p, :s], ix[k][:p, :s])
                            self.combine(p, w - s, o, a, b)
                            k = 1 - k
                            s *= 2
                        cur_v = v[k][:p, :w]
                        cur_i = ix[k][:p, :w] if self.paired else None
                        if c0 > 0:   # fold in everything before this chunk
                            a = (carry_v[:p].broadcast_to((p, w)),
                                 carry_i[:p].broadcast_to((p, w)) if self.paired else None)
                            o = (v[1 - k][:p, :w], ix[1 - k][:p, :w] if self.paired else None)
                            self.combine(p, w, o, a, (cur_v, cur_i))
                            k = 1 - k
                            cur_v, cur_i = o
                        if c0 + w < self.n:
                            prog.tensor_copy(carry_v[:p], cur_v[:, w - 1:w])
                            if self.paired:
                                prog.tensor_copy(carry_i[:p], cur_i[:, w - 1:w])
                        if lse:   # the value m + s, rounded once
                            prog.tensor_tensor(self.tmp[0][:p, :w], cur_v, cur_i, "add")
                            cur_v, cur_i = self.tmp[0][:p, :w], None
                        self._store(off + c0 * sd, part[1], sd, p, w, cur_v, cur_i)

    def _load(self, raw, vt, src, p, w) -> None:
        r = raw[:p, :w]
        if self.x_dt in ("int32", "int64"):
            load_checked_int(self.ctx, r, src, float(_EXACT))
        else:
            self.prog.dma_copy(r, src)
        self.prog.tensor_copy(vt[:p, :w], r)

    def _store(self, off, ps, sd, p, w, val, idx) -> None:
        dims = [(p, ps), (w, sd)]
        store_int(self.ctx, hview(self.outs[0], off, dims), val)   # a float output goes through ctx.store
        if idx is not None:
            store_int(self.ctx, hview(self.outs[1], off, dims), idx, nonneg=True)


@lowering("cummax", "cummin", "logcumsumexp")
def _scan(ctx, eqn, ins, outs):
    """Running max/min (with the index of the last element holding it) or log-sum-exp along ``dim``."""
    _Scan(ctx, eqn, ins, outs).emit()
