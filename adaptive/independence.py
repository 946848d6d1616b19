# tn.adaptive.independence: proves from a traced IR that no op mixes positions along a dimension (so padding it is exact).
"""Dimension independence analysis on :class:`tn.ir.IR`.

:func:`independent_axes` follows one symbolic dimension (e.g. the batch)
from the inputs that carry it through every equation. It answers with the
axis of each output that carries the dimension (or None), or raises
:class:`Mixed` naming the first equation that mixes positions along it: a
reduction, scan, sort or contraction over it, a slice/cat/pad/flip along it,
an elementwise op with a fixed-size tensor along it, or an op the analysis
does not know. Only a proof lets the controller pad a call to a bucket and
slice the results back: padded positions can then never reach real ones.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ..errors import TnError
from ..ir import IR, Var

__all__ = ["Mixed", "independent_axes"]


class Mixed(TnError):
    """An equation mixes positions along the followed dimension (the message names it)."""


def _shape(v) -> tuple:
    return tuple(getattr(v, "shape", ()) or ())


def _where(eqn) -> str:
    src = f" at {eqn.source}" if getattr(eqn, "source", None) else ""
    return f"{_opname(eqn.op)}{src}"


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def _reshape_axis(src: tuple, dst: tuple, a: int, t: int, inner: int) -> Optional[Tuple[int, int, int]]:
    """Where the dimension (factor ``t`` of axis ``a`` of ``src``, ``inner`` below it) lands in ``dst``.

    Returns ``(axis, outer, inner)`` of ``dst`` or None when the reshape splits the dimension itself.
    """
    s = inner * _prod(src[a + 1:])  # flat stride of the dimension
    for j in range(len(dst)):
        r = _prod(dst[j + 1:])
        if s % r == 0 and dst[j] % ((s // r) * t) == 0:
            return j, dst[j] // ((s // r) * t), s // r
    return None


def independent_axes(ir: IR, input_axes: Dict[int, int]) -> List[Optional[Tuple[int, int]]]:
    """Follow a dimension through ``ir``; returns ``(axis, inner)`` per output (None: not carried).

    ``input_axes`` maps an input index of ``ir.inputs`` to the axis that holds the
    dimension. An output axis of size ``n * inner`` holds the dimension as its
    outer factor (``inner > 1`` when a reshape merged it with inner axes, as a
    Linear on a 3-d input does): the first ``n * inner`` positions are the
    first ``n`` of the dimension. Raises :class:`Mixed` when an equation mixes
    positions along it.
    """
    if ir.mutations:
        raise Mixed("the region writes back into its inputs or buffers (mutations): padded positions would be stored")
    lab: Dict[int, Tuple[int, int, int]] = {}
    size = None
    for i, a in input_axes.items():
        v = ir.inputs[i]
        lab[id(v)] = (a, 1, 1)
        size = _shape(v)[a]
    if not size or size < 2:
        raise Mixed("the dimension has size < 2 in this trace: nothing to prove from it")

    def get(v) -> Optional[Tuple[int, int, int]]:
        return lab.get(id(v)) if isinstance(v, Var) else None

    for eqn in ir.eqns:
        ins = list(eqn.inputs)
        full = [get(v) for v in ins]
        if all(l is None for l in full):
            continue  # does not touch the dimension
        factors = {l[1:] for l in full if l is not None}
        if len(factors) != 1:
            raise Mixed(f"{_where(eqn)} combines the dimension merged with different axes")
        outer, inner = factors.pop()
        labels = [None if l is None else l[0] for l in full]
        op = _opname(eqn.op)
        cat = _category(op)
        a = eqn.attrs
        outs = eqn.outputs
        res: Optional[int] = None
        if cat == "elementwise":
            r = len(_shape(outs[0]))
            pos = {l + r - len(_shape(v)) for v, l in zip(ins, labels) if l is not None}
            if len(pos) != 1:
                raise Mixed(f"{_where(eqn)} combines the dimension at different axes")
            res = pos.pop()
            for v, l in zip(ins, labels):
                if l is None and isinstance(v, Var):
                    sh = _shape(v)
                    k = res - (r - len(sh))
                    if 0 <= k < len(sh) and sh[k] != 1:
                        raise Mixed(f"{_where(eqn)} combines it with a fixed tensor of shape {list(sh)} along it")
        elif cat in ("reduction", "scan", "sort"):
            (l,) = [l for l in labels if l is not None]
            dims = a.get("dims")
            if dims is None:
                dims = (a.get("dim"),) if a.get("dim") is not None else tuple(range(len(_shape(ins[0]))))
            dims = tuple(d % max(1, len(_shape(ins[0]))) for d in dims)
            if l in dims:
                raise Mixed(f"{_where(eqn)} reduces/scans along it")
            res = l if (cat != "reduction" or a.get("keepdim")) else l - sum(1 for d in dims if d < l)
        elif op == "matmul":
            A, B = ins
            ra, rb, r = len(_shape(A)), len(_shape(B)), len(_shape(outs[0]))
            la, lb = labels
            cand = set()
            if la is not None:
                if la == ra - 1:
                    raise Mixed(f"{_where(eqn)} contracts over it")
                cand.add(r - 2 if la == ra - 2 else la + r - ra)
            if lb is not None:
                if lb == rb - 2:
                    raise Mixed(f"{_where(eqn)} contracts over it")
                cand.add(r - 1 if lb == rb - 1 else lb + r - rb)
            if len(cand) != 1:
                raise Mixed(f"{_where(eqn)} meets it on both operands at different axes")
            res = cand.pop()
            if res < r - 2:
                for v, l in ((A, la), (B, lb)):
                    sh = _shape(v)
                    k = res - (r - len(sh))
                    if l is None and 0 <= k < len(sh) - 2 and sh[k] != 1:
                        raise Mixed(f"{_where(eqn)} batches it with a fixed tensor")
        elif op == "reshape":
            if any(l is not None for l in labels[1:]):
                raise Mixed(f"{_where(eqn)} takes it as a shape")
            hit = _reshape_axis(_shape(ins[0]), _shape(outs[0]), labels[0], size, inner)
            if hit is None:
                raise Mixed(f"{_where(eqn)} merges or splits it")
            res, outer, inner = hit
        elif op == "permute":
            res = list(a["dims"]).index(labels[0])
        elif op == "expand":
            res = labels[0] + len(_shape(outs[0])) - len(_shape(ins[0]))
        elif op in ("slice", "cat", "slice_scatter", "flip"):
            dims = a.get("dims", (a.get("dim"),))
            r = len(_shape(outs[0]))
            dims = tuple(d % r for d in dims)
            ls = {l for l in labels if l is not None}
            if len(ls) != 1 or ls & set(dims):
                raise Mixed(f"{_where(eqn)} cuts, joins or reverses along it")
            res = ls.pop()
            for v, l in zip(ins, labels):
                if l is None and isinstance(v, Var) and _shape(v)[res] != 1:
                    raise Mixed(f"{_where(eqn)} joins it with a fixed tensor")
        elif op == "pad":
            l = labels[0]
            pad = list(a.get("pad", ()))
            r = len(_shape(ins[0]))
            k = r - 1 - l
            if 2 * k + 1 < len(pad) and (pad[2 * k] or pad[2 * k + 1]):
                raise Mixed(f"{_where(eqn)} pads along it")
            res = l
        elif op == "index":
            dims = tuple(a.get("dims", ()))
            idx = ins[1:]
            lx, lidx = labels[0], labels[1:]
            if len(dims) != 1 or len(idx) != 1:
                raise Mixed(f"{_where(eqn)}: advanced indexing over several axes is not analysed")
            d, ni = dims[0], len(_shape(idx[0]))
            if lx is not None and lidx[0] is None and lx != d:
                res = lx if lx < d else lx + ni - 1
            elif lx is None and lidx[0] is not None:
                res = d + lidx[0]
            else:
                raise Mixed(f"{_where(eqn)} indexes along it")
        elif op == "convolution" and labels[0] == 0 and inner == 1 and outer == 1 and all(l is None for l in labels[1:]):
            res = 0
        else:
            raise Mixed(f"{_where(eqn)} is not analysed for independence (treated as mixing)")
        for o in outs:
            if _shape(o) and res is not None and res < len(_shape(o)) and _shape(o)[res] == outer * size * inner:
                lab[id(o)] = (res, outer, inner)
            else:
                raise Mixed(f"{_where(eqn)}: output {list(_shape(o))} does not carry the dimension")
    result: List[Optional[Tuple[int, int]]] = []
    for v in ir.outputs:
        l = get(v)
        if l is not None and l[1] != 1:
            raise Mixed(f"an output {list(_shape(v))} holds the dimension inside a merged axis: it cannot be sliced back")
        result.append(None if l is None else (l[0], l[2]))
    return result


def _opname(op) -> str:
    return getattr(op, "name", op)


def _category(name: str) -> str:
    from .. import ops
    op = ops.OPS.get(name)
    return op.category if op is not None else ""
