# tn.bucketing: IR proofs that a dimension may be padded (at its end, or at its front with masks), and the bucket rule.
"""Bucketing a dimension that changes between calls, shared by the doors that compile programs per size.

A door that sees one program recur at many sizes of a dimension (a batch, a
sequence, a KV cache's length) can compile one program per *bucket* of sizes
and pad each call up to it, when the IR proves the padding cannot change the
real results. Both :mod:`tn.adaptive` (module regions) and the neuron
device's adaptive eager windows (:mod:`tn.device.windows`) use this module;
it reads only the IR and the op table.

* **Prefix padding** (:func:`independent_axes`, :func:`same_program`): pad
  at the end, slice the results back.
* **Masked front padding** (:func:`masked_axes`, :func:`masked_program`): pad
  at the front, mask the equations that mix positions, narrow the results
  back; for a dimension a program grows by ``cat`` (a KV cache).
* **The bucket rule** (:func:`bucket_size`): which size a size is padded to.

Prefix padding
--------------
The controller pads a call along a dimension D (the batch, or a sequence)
from its size ``n`` up to a bucket size and slices the results back to
``n``. That is exact when every result position ``i < n`` depends only on
input positions ``< n``. :func:`independent_axes` proves the stronger,
size-free property that a result position ``i`` depends only on input
positions ``<= i`` ("prefix" dependence), by following D through every
equation. Each variable that carries D gets a label:

* ``P``: D on one axis; position ``i`` depends on input positions ``<= i``
  (elementwise ops, reductions and matmuls over other axes, reshapes that
  keep D whole, prefix scans along D).
* ``PAIR``: D on two axes (``q @ k.T`` over a sequence); element ``(i, j)``
  depends on positions ``<= max(i, j)``.
* ``TRI``: D on two axes ``(q, k)`` after a causal mask; element ``(i, j)``
  depends on positions ``<= i`` and the elements with ``j > i`` are known:
  ``neginf`` (``-inf`` or below ``-1e30``, as ``masked_fill(~tril, -inf)``
  and HF's additive ``finfo.min`` masks leave them), ``zero`` (``exp`` of
  those, softmax weights), or unknown. A reduction along ``k`` is exact
  only when the known value is its identity (``amax`` of ``neginf``, ``sum``
  of ``zero``); a matmul contracting ``k`` is exact when the ``TRI`` side is
  ``zero`` there (``softmax(...) @ v``): padded keys then meet exact zero
  weights. Causal masks are recognised in constants: a bool tensor that is
  ``j > i`` (used by ``where(mask, fill, s)``) or ``j <= i`` (by
  ``where(mask, s, fill)``), or an additive tensor of 0 and ``neginf``.

Anything else that mixes positions along D (a reduction, sort or
contraction over it, a slice/cat/pad/flip along it, an elementwise op with
a fixed tensor that has D's size, an unknown op) raises :class:`Mixed`
naming the equation. Assumption, as for any padding: values computed at
real positions are finite (a zero weight times a finite padded value is
zero). :func:`same_program` compares the IR traced at one size with the IR
traced at a bucket size, so Python code that bakes a size into a literal or
an attribute (``x / x.shape[1]``) is refused too.

Masked front padding
--------------------
Prefix padding pads a dimension D at its end and needs every result position to depend only on earlier ones. A KV
cache breaks that: a decoder step does ``keys = cat([past, new], D)`` and a
softmax over all keys, so end padding would put pad keys between ``past`` and
``new`` and into the softmax.

Here the inputs are padded at the front by ``p`` positions (a runtime scalar
input of the program, so one program serves a whole bucket), and every
variable carrying D is tracked with the axis that holds it. Its first ``p``
positions are padding, the rest real: elementwise ops keep the positions
aligned, a ``cat`` along D that appends (the padded operand first) keeps the
padding in front, and each equation that *mixes* positions along D gets its
padded positions replaced first (``where(pos >= p, x, identity)``):

* a reduction along D (``sum``: 0, ``amax``: -inf, ``amin``: +inf, ``prod``:
  1, ``any``: False), so a softmax over keys ignores pad keys exactly;
* a matmul contracting D (``weights @ values``): both operands, with 0.

Results that carry D are narrowed back to their real positions
(``narrow(axis, p, size - p)``) by the caller. Anything else that touches D
(a slice, an index, a sort or scan along it, a reshape that merges it, a
fixed tensor with D's size, an unknown op) raises
:class:`Mixed`. As with prefix padding, the caller
must also check with :func:`same_program` that
the program traced at two sizes is the same, so Python that bakes a size
into a literal is refused.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from . import ops
from .errors import TnError
from .ir import IR, Eqn, Literal, Var
from .shapes import numel

__all__ = ["Mixed", "Lab", "independent_axes", "same_program", "masked_axes", "masked_program", "bucket_size",
           "NEG_BIG"]

NEG_BIG = -1e30  # values at or below this behave as -inf under exp/amax


class Mixed(TnError, ValueError):
    """An equation mixes positions along the followed dimension (the message names it)."""


class Lab(NamedTuple):
    """How a variable carries the followed dimension (see the module docstring)."""
    kind: str                                  # "P", "PAIR" or "TRI"
    axes: Tuple[Tuple[int, int, int], ...]     # (axis, outer, inner) per D axis; TRI: (q, k)
    upper: Optional[str] = None                # TRI only: "neginf", "zero" or None


def _shape(v) -> tuple:
    return tuple(getattr(v, "shape", ()) or ())


def _opname(op) -> str:
    return getattr(op, "name", op)


def _where(eqn) -> str:
    src = f" at {eqn.source}" if getattr(eqn, "source", None) else ""
    return f"{_opname(eqn.op)}{src}"


def _category(name: str) -> str:
    op = ops.OPS.get(name)
    return op.category if op is not None else ""


def _reshape_axis(src: tuple, dst: tuple, a: int, t: int, inner: int) -> Optional[Tuple[int, int, int]]:
    """Where the dimension (factor ``t`` of axis ``a`` of ``src``, ``inner`` below it) lands in ``dst``.

    Returns ``(axis, outer, inner)`` of ``dst`` or None when the reshape splits the dimension itself.
    """
    s = inner * numel(src[a + 1:])  # flat stride of the dimension
    for j in range(len(dst)):
        r = numel(dst[j + 1:])
        if s % r == 0 and dst[j] % ((s // r) * t) == 0:
            return j, dst[j] // ((s // r) * t), s // r
    return None


def _shift(lab: Optional[Lab], by: int) -> Optional[Lab]:
    if lab is None or by == 0:
        return lab
    return lab._replace(axes=tuple((a + by, o, i) for a, o, i in lab.axes))


def _with_axes(lab: Lab, axes) -> Lab:
    return lab._replace(axes=tuple(axes))


def _scalar_value(v, consts) -> Optional[float]:
    """The value of a Literal or a one-element constant, else None."""
    if isinstance(v, Literal):
        return float(v.value)
    t = consts.get(id(v)) if isinstance(v, Var) else None
    if t is not None and t.numel() == 1:
        return float(t.reshape(()).item())
    return None


def _value_class(x: Optional[float]) -> Optional[str]:
    if x is None:
        return None
    if x <= NEG_BIG:
        return "neginf"
    if x == 0.0:
        return "zero"
    return None


def _aligned(t: torch.Tensor, r: int) -> torch.Tensor:
    return t.reshape((1,) * (r - t.dim()) + tuple(t.shape))


def _causal_pattern(t: torch.Tensor, r: int, a: int, b: int, n: int) -> Optional[str]:
    """How constant ``t`` (aligned to rank ``r``) masks axes ``(a, b)``, both of size ``n``.

    Returns ``"upper"`` (``t[i, j]`` is True exactly where ``j > i``, i on ``a``),
    ``"lower"`` (True where ``j <= i``), ``"additive"`` (0 where ``j <= i``, neginf where
    ``j > i``), or None. Every other axis of ``t`` must repeat the pattern.
    """
    t = _aligned(t, r)
    if t.shape[a] != n or t.shape[b] != n:
        return None
    i = torch.arange(n).reshape([n if d == a else 1 for d in range(r)])
    j = torch.arange(n).reshape([n if d == b else 1 for d in range(r)])
    up = (j > i).expand(t.shape)
    if t.dtype == torch.bool:
        if torch.equal(t, up):
            return "upper"
        if torch.equal(t, ~up):
            return "lower"
        return None
    if t.is_floating_point():
        ok = bool(((t <= NEG_BIG) == up).all()) and bool((t[~up] == 0).all())
        return "additive" if ok else None
    return None


def _progression(t: torch.Tensor, r: int, a: int, n: int) -> bool:
    """True when constant ``t`` (aligned to rank ``r``) is an arithmetic progression of size ``n``
    along axis ``a`` (arange or constant), the same along every other axis: its first ``k``
    positions are then what the same code computes at size ``k``."""
    t = _aligned(t, r)
    if t.shape[a] != n or t.is_complex() or t.dtype == torch.bool:
        return False
    x = t.movedim(a, 0).reshape(n, -1).to(torch.float64)
    if not bool((x == x[:, :1]).all()):
        return False
    col = x[:, 0]
    if n < 2:
        return True
    step = col[1] - col[0]
    return bool((col == col[0] + step * torch.arange(n, dtype=torch.float64)).all())


def _upper_of(op: str, ins, aligned, consts, out_dtype) -> Optional[str]:
    """Value class of the masked elements of a TRI result of an elementwise op."""
    cls = [l.upper if (l is not None and l.kind == "TRI") else ("finite" if l is not None or isinstance(v, Var)
                                                                 else "lit") for v, l in zip(ins, aligned)]
    lit = [_scalar_value(v, consts) if l is None else None for v, l in zip(ins, aligned)]
    if op == "exp" and cls == ["neginf"]:
        return "zero"
    if op in ("convert", "neg") and cls[0] == "zero":
        return "zero"
    if op == "convert" and cls[0] == "neginf" and out_dtype is not None and out_dtype.is_floating_point:
        return "neginf"
    if len(cls) != 2:
        return None
    a, b = cls
    nontri = ("finite", "lit")
    if op == "add" and ((a == "neginf" and b in nontri) or (b == "neginf" and a in nontri)):
        return "neginf"
    if op == "sub" and a == "neginf" and b in nontri:
        return "neginf"
    if op == "mul":
        if (a == "zero" and b in nontri + ("zero",)) or (b == "zero" and a in nontri):
            return "zero"
        if (a == "neginf" and lit[1] is not None and lit[1] > 0) or (b == "neginf" and lit[0] is not None
                                                                      and lit[0] > 0):
            return "neginf"
    if op == "div":
        if a == "zero" and b in nontri:
            return "zero"
        if a == "neginf" and lit[1] is not None and lit[1] > 0:
            return "neginf"
    return None


def _elementwise(eqn, ins, labels, n, consts) -> Lab:
    op = _opname(eqn.op)
    out = eqn.outputs[0]
    r = len(_shape(out))
    aligned = [_shift(l, r - len(_shape(v))) for v, l in zip(ins, labels)]
    D: Dict[int, Tuple[int, int]] = {}
    for l in aligned:
        if l is None:
            continue
        for a, o, i in l.axes:
            if D.setdefault(a, (o, i)) != (o, i):
                raise Mixed(f"{_where(eqn)} combines the dimension merged with different axes")
    tri = [l for l in aligned if l is not None and l.kind == "TRI"]
    # causal masks: where(upper, fill, s), where(lower, s, fill), s + additive
    if len(D) == 2 or (len(D) == 1 and op in ("where", "add")):
        masked = _mask(op, eqn, ins, aligned, D, r, n, consts)
        if masked is not None:
            return masked
    for v, l in zip(ins, aligned):
        if l is None and isinstance(v, Var):
            sh = (1,) * (r - len(_shape(v))) + _shape(v)
            for a in D:
                if sh[a] == 1:
                    continue
                t = consts.get(id(v))
                if t is not None and D[a] == (1, 1) and _progression(t, r, a, n):
                    continue  # arange-like or constant along D: the same at every size
                raise Mixed(f"{_where(eqn)} combines it with a fixed tensor of shape {list(_shape(v))} along it")
    if len(D) == 1:
        (a, (o, i)), = D.items()
        return Lab("P", ((a, o, i),))
    if len(D) == 2:
        if tri:
            q, k = tri[0].axes
            same = all(l.kind == "P" and l.axes[0][0] == q[0] or l.kind == "TRI" and l.axes == (q, k)
                       for l in aligned if l is not None)
            if same:
                return Lab("TRI", (q, k), _upper_of(op, ins, aligned, consts, out.dtype))
        return Lab("PAIR", tuple((a, o, i) for a, (o, i) in sorted(D.items())))
    raise Mixed(f"{_where(eqn)} meets the dimension on more than two axes")


def _mask(op, eqn, ins, aligned, D, r, n, consts) -> Optional[Lab]:
    """The TRI label of a causal masking op, or None when ``eqn`` is not one."""
    if op == "where":
        c, x, y = ins
        lc, lx, ly = aligned
        if lc is not None or not isinstance(c, Var) or id(c) not in consts:
            return None
        cases = ((x, lx, y, ly, "upper"), (y, ly, x, lx, "lower"))  # (fill, its label, s, its label, pattern)
    elif op == "add":
        (p, lp), (s, ls) = zip(ins, aligned)
        if lp is None and ls is not None:
            m, s_lab = p, ls
        elif ls is None and lp is not None:
            m, s_lab = s, lp
        else:
            return None
        if not isinstance(m, Var) or id(m) not in consts:
            return None
        c = m
        cases = ((None, None, None, s_lab, "additive"),)
    else:
        return None
    t = consts[id(c)]
    for fill, lfill, s, ls, want in cases:
        if op == "where" and (lfill is not None or ls is None):
            continue
        axes = [a for a, oi in D.items() if oi == (1, 1)]
        if len(axes) == 1:  # s carries D on one axis; the mask brings the other
            a0 = axes[0]
            cand = [b for b in range(r) if b != a0 and _aligned(t, r).shape[b] == n]
            pairs = [(a0, b) for b in cand] + [(b, a0) for b in cand]
        elif len(axes) == 2:
            pairs = [(axes[0], axes[1]), (axes[1], axes[0])]
        else:
            return None
        for q, k in pairs:
            if _causal_pattern(t, r, q, k, n) != want:
                continue
            if op == "where":
                fsh = (1,) * (r - len(_shape(fill))) + _shape(fill)
                if fsh[q] != 1 or fsh[k] != 1:
                    continue
                upper = _value_class(_scalar_value(fill, consts))
            else:
                upper = "neginf"
            if ls.kind == "TRI" and ls.axes[0][0] != q:
                continue
            if ls.kind == "P" and ls.axes[0][0] not in (q, k):
                continue
            return Lab("TRI", ((q, 1, 1), (k, 1, 1)), upper)
    return None


def _reduce_dims(eqn, rank: int) -> Tuple[int, ...]:
    a = eqn.attrs
    dims = a.get("dims")
    if dims is None:
        dims = (a.get("dim"),) if a.get("dim") is not None else tuple(range(rank))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(d % max(1, rank) for d in dims)


def _reduction(eqn, lab: Lab, rank: int) -> Lab:
    op = _opname(eqn.op)
    dims = _reduce_dims(eqn, rank)
    keep = bool(eqn.attrs.get("keepdim"))
    D = [a for a, _, _ in lab.axes]
    hit = [a for a in D if a in dims]

    def moved(a):
        return a if keep else a - sum(1 for d in dims if d < a)

    if not hit:
        return _with_axes(lab, [(moved(a), o, i) for a, o, i in lab.axes])
    if lab.kind == "TRI" and hit == [lab.axes[1][0]]:
        q = lab.axes[0]
        ident = {-math.inf: "neginf", 0: "zero"}.get(eqn.op.reduce_identity)  # sum/any: 0, amax: -inf
        if ident is not None and lab.upper == ident:
            return Lab("P", ((moved(q[0]), q[1], q[2]),))
        raise Mixed(f"{_where(eqn)} reduces along the masked axis, whose masked value "
                    f"({lab.upper or 'unknown'}) is not the identity of {op}")
    raise Mixed(f"{_where(eqn)} reduces along it")


def _matmul(eqn, ins, labels) -> Lab:
    A, B = ins
    la, lb = labels
    ra, rb, r = len(_shape(A)), len(_shape(B)), len(_shape(eqn.outputs[0]))
    if ra < 2 or rb < 2:
        if (ra < 2 and la is not None) or (rb < 2 and lb is not None):
            raise Mixed(f"{_where(eqn)}: a vector operand carries it (not analysed)")
    ca, cb = ra - 1, (rb - 2 if rb >= 2 else 0)  # contracted axes

    def out_axis(x, rank, side):
        if side == "a":
            return r - 2 if x == rank - 2 else x + r - rank
        return r - 1 if x == rank - 1 else x + r - rank

    # contraction along the dimension: only through exact zeros of a causal TRI operand
    if la is not None and any(x == ca for x, _, _ in la.axes) or lb is not None and any(x == cb for x, _, _ in lb.axes):
        for tl, other, side, cx in ((la, lb, "a", ca), (lb, la, "b", cb)):
            if tl is None or tl.kind != "TRI" or tl.upper != "zero" or tl.axes[1][0] != cx:
                continue
            oc = cb if side == "a" else ca
            if other is None or other.kind != "P" or other.axes[0][0] != oc or other.axes[0][1:] != tl.axes[1][1:]:
                continue
            q = tl.axes[0]
            rank = ra if side == "a" else rb
            if side == "a" and q[0] != ra - 2 or side == "b" and q[0] != rb - 1:
                continue  # the row index must be the free matrix axis
            return Lab("P", ((out_axis(q[0], rank, side), q[1], q[2]),))
        raise Mixed(f"{_where(eqn)} contracts over it")
    D: Dict[int, Tuple[int, int]] = {}
    kinds = []
    for lab, rank, side in ((la, ra, "a"), (lb, rb, "b")):
        if lab is None:
            continue
        kinds.append(lab.kind)
        for x, o, i in lab.axes:
            y = out_axis(x, rank, side)
            if D.setdefault(y, (o, i)) != (o, i):
                raise Mixed(f"{_where(eqn)} combines the dimension merged with different axes")
    for v, lab, rank in ((A, la, ra), (B, lb, rb)):  # a batch axis of D against a fixed operand
        if lab is not None:
            continue
        sh = _shape(v)
        for y in D:
            if y < r - 2:
                k = y - (r - rank)
                if 0 <= k < rank - 2 and sh[k] != 1:
                    raise Mixed(f"{_where(eqn)} batches it with a fixed tensor")
    if len(D) == 1:
        (y, (o, i)), = D.items()
        return Lab("P", ((y, o, i),))
    if len(D) == 2:
        return Lab("PAIR", tuple((y, o, i) for y, (o, i) in sorted(D.items())))
    raise Mixed(f"{_where(eqn)} meets the dimension on more than two axes")


def independent_axes(ir: IR, input_axes: Dict[int, int]) -> List[Optional[Tuple[Tuple[int, int], ...]]]:
    """Follow a dimension through ``ir``: per output, the ``(axis, inner)`` pairs to slice back (None: not carried).

    ``input_axes`` maps an input index of ``ir.inputs`` to the axis that holds
    the dimension (several inputs may carry it). An output axis of size
    ``n * inner`` holds the dimension as its outer factor (``inner > 1`` when a
    reshape merged it with inner axes): its first ``k * inner`` positions are
    those of the first ``k`` positions. Raises :class:`Mixed` when a result
    position could depend on a later position along the dimension.
    """
    if ir.mutations:
        raise Mixed("the region writes back into its inputs or buffers (mutations): padded positions would be stored")
    consts = {id(v): t for v, t in ir.consts}
    lab: Dict[int, Lab] = {}
    size = None
    for i, a in input_axes.items():
        v = ir.inputs[i]
        lab[id(v)] = Lab("P", ((a, 1, 1),))
        s = _shape(v)[a]
        if size is not None and s != size:
            raise Mixed("the inputs disagree on the size of the dimension")
        size = s
    if not size or size < 2:
        raise Mixed("the dimension has size < 2 in this trace: nothing to prove from it")
    n = size

    def get(v) -> Optional[Lab]:
        return lab.get(id(v)) if isinstance(v, Var) else None

    for eqn in ir.eqns:
        ins = list(eqn.inputs)
        labels = [get(v) for v in ins]
        if all(l is None for l in labels):
            continue  # does not touch the dimension
        op = _opname(eqn.op)
        cat = _category(op)
        a = eqn.attrs
        outs = eqn.outputs
        res: Lab
        first = next(l for l in labels if l is not None)
        if cat == "elementwise":
            res = _elementwise(eqn, ins, labels, n, consts)
        elif cat == "reduction":
            (l,) = [l for l in labels if l is not None]
            res = _reduction(eqn, l, len(_shape(ins[0])))
        elif cat in ("scan", "sort"):
            (l,) = [l for l in labels if l is not None]
            d = _reduce_dims(eqn, len(_shape(ins[0])))
            if any(x in d for x, _, _ in l.axes):
                if not (cat == "scan" and l.kind == "P"):
                    raise Mixed(f"{_where(eqn)} sorts or scans along it")
            res = l if cat == "sort" or l.kind != "TRI" else l._replace(upper=None)
        elif op == "matmul":
            res = _matmul(eqn, ins, labels)
        elif op == "reshape":
            if any(l is not None for l in labels[1:]):
                raise Mixed(f"{_where(eqn)} takes it as a shape")
            axes = []
            for x, o, i in first.axes:
                hit = _reshape_axis(_shape(ins[0]), _shape(outs[0]), x, n, i)
                if hit is None:
                    raise Mixed(f"{_where(eqn)} merges or splits it")
                axes.append(hit)
            if len({x for x, _, _ in axes}) != len(axes):
                raise Mixed(f"{_where(eqn)} merges its two axes")
            res = _with_axes(first, axes)
        elif op == "permute":
            perm = list(a["dims"])
            res = _with_axes(first, [(perm.index(x), o, i) for x, o, i in first.axes])
        elif op == "expand":
            res = _shift(first, len(_shape(outs[0])) - len(_shape(ins[0])))
        elif op in ("slice", "cat", "slice_scatter", "flip"):
            r = len(_shape(outs[0]))
            dims = a.get("dims", (a.get("dim"),))
            dims = {d % r for d in dims}
            ls = {l for l in labels if l is not None}
            if len(ls) != 1 or dims & {x for x, _, _ in first.axes}:
                raise Mixed(f"{_where(eqn)} cuts, joins or reverses along it")
            for v, l in zip(ins, labels):
                if l is None and isinstance(v, Var) and any(_shape(v)[x] != 1 for x, _, _ in first.axes
                                                            if x < len(_shape(v))):
                    raise Mixed(f"{_where(eqn)} joins it with a fixed tensor")
            res = first
        elif op == "pad":
            r = len(_shape(ins[0]))
            pad = list(a.get("pad", ()))
            for x, _, _ in first.axes:
                k = r - 1 - x
                if 2 * k + 1 < len(pad) and (pad[2 * k] or pad[2 * k + 1]):
                    raise Mixed(f"{_where(eqn)} pads along it")
            res = first
        elif op == "index":
            dims = tuple(a.get("dims", ()))
            idx = ins[1:]
            lx, lidx = labels[0], labels[1:]
            if len(dims) != 1 or len(idx) != 1:
                raise Mixed(f"{_where(eqn)}: advanced indexing over several axes is not analysed")
            d, ni = dims[0], len(_shape(idx[0]))
            if lx is not None and lidx[0] is None and lx.kind == "P" and lx.axes[0][0] != d:
                x, o, i = lx.axes[0]
                res = Lab("P", ((x if x < d else x + ni - 1, o, i),))
            elif lx is None and lidx[0] is not None and lidx[0].kind == "P":
                x, o, i = lidx[0].axes[0]
                res = Lab("P", ((d + x, o, i),))
            else:
                raise Mixed(f"{_where(eqn)} indexes along it")
        elif (op == "convolution" and first.kind == "P" and labels[0] is first and first.axes == ((0, 1, 1),)
              and all(l is None for l in labels[1:])):
            res = first
        else:
            raise Mixed(f"{_where(eqn)} is not analysed for independence (treated as mixing)")
        for o in outs:
            sh = _shape(o)
            for x, ou, i in res.axes:
                if not (x < len(sh) and sh[x] == ou * n * i):
                    raise Mixed(f"{_where(eqn)}: output {list(sh)} does not carry the dimension")
            lab[id(o)] = res
    result: List[Optional[Tuple[Tuple[int, int], ...]]] = []
    for v in ir.outputs:
        l = get(v)
        if l is None:
            result.append(None)
            continue
        if any(o != 1 for _, o, _ in l.axes):
            raise Mixed(f"an output {list(_shape(v))} holds the dimension inside a merged axis: it cannot be sliced "
                        f"back")
        result.append(tuple((x, i) for x, _, i in l.axes))
    return result


_SHAPE_ATTRS = {"reshape": ("shape",), "expand": ("shape", "size"), "full": ("shape",), "iota": ("length",)}


def _tail_slice(eqn) -> Optional[int]:
    """The number of last positions a ``slice`` keeps when it keeps the last ones of its axis (step 1), else None."""
    a = eqn.attrs
    x = eqn.inputs[0]
    r = len(_shape(x))
    if _opname(eqn.op) != "slice" or a.get("dim") is None or a.get("step", 1) != 1 or not r:
        return None
    size = _shape(x)[a["dim"] % r]
    start, end = a.get("start", 0), a.get("end", size)
    if start is None or start < 0 or end is None or end < size or start >= size:
        return None
    return size - start


def same_program(small: IR, big: IR, sized: Sequence[Tuple[int, int]], tail_slices: bool = False) -> Optional[str]:
    """None when ``big`` is ``small`` traced at other sizes of the padded dimensions, else why not.

    ``sized`` lists ``(input index, axis)`` of the padded dimensions. The two
    programs must have the same equations, literals and attributes (shape
    attributes of reshape/expand/full/iota excepted: the analysis checks how
    those move the dimension), the same constants up to their sizes, and
    inputs that differ only along the padded axes. A size baked into a
    literal (``x / x.shape[1]``) or an attribute (a slice to the length) is
    refused here; with ``tail_slices``, a slice keeping the same number of
    last positions at both sizes (``x[..., -1:]``) is the same equation.
    """
    if len(small.inputs) != len(big.inputs) or len(small.outputs) != len(big.outputs):
        return "the program's inputs or outputs differ between sizes"
    if len(small.eqns) != len(big.eqns) or len(small.consts) != len(big.consts):
        return "the program differs between sizes (different equations or constants)"
    padded = {}
    for i, a in sized:
        padded.setdefault(i, set()).add(a)
    for k, (u, v) in enumerate(zip(small.inputs, big.inputs)):
        su, sv = _shape(u), _shape(v)
        if len(su) != len(sv) or u.dtype != v.dtype or any(
                x != y and d not in padded.get(k, ()) for d, (x, y) in enumerate(zip(su, sv))):
            return f"input {k} differs between sizes beyond the padded axes"
    for (cu, tu), (cv, tv) in zip(small.consts, big.consts):
        if tu.dtype != tv.dtype or tu.dim() != tv.dim():
            return "a constant differs between sizes"
        if tu.shape == tv.shape and not torch.equal(tu, tv):
            return "a constant's values differ between sizes"
    for eu, ev in zip(small.eqns, big.eqns):
        if _opname(eu.op) != _opname(ev.op) or len(eu.inputs) != len(ev.inputs):
            return f"{_where(ev)} differs between sizes"
        for x, y in zip(eu.inputs, ev.inputs):
            if isinstance(x, Literal) != isinstance(y, Literal) or (isinstance(x, Literal) and x != y):
                return f"{_where(ev)} uses a literal that depends on the size ({_lit(x)} vs {_lit(y)})"
        skip = _SHAPE_ATTRS.get(_opname(eu.op), ())
        if tail_slices and _tail_slice(eu) is not None and _tail_slice(eu) == _tail_slice(ev) and \
                eu.attrs.get("dim") == ev.attrs.get("dim"):
            skip = ("start", "end")
        if set(eu.attrs) != set(ev.attrs) or any(eu.attrs[k] != ev.attrs[k] for k in eu.attrs if k not in skip):
            return f"{_where(ev)} has attributes that depend on the size"
    return None


def _lit(x) -> str:
    return repr(x.value) if isinstance(x, Literal) else "a tensor"


# --------------------------------------------------------------------------- masked front padding


def _fill(op: Any, dtype: torch.dtype):
    """The value masked positions get before reduction ``op``: its identity (:attr:`tn.ops.Op.reduce_identity`)
    in ``dtype`` (bool: False for sum/amax/any, True for prod/amin; integers: the dtype's extremes for -inf/inf)."""
    v = op.reduce_identity
    if dtype == torch.bool:
        return bool(v > 0)
    if not dtype.is_floating_point and isinstance(v, float) and v in (float("inf"), float("-inf")):
        info = torch.iinfo(dtype)
        return info.max if v > 0 else info.min
    return v


class _Rewriter:
    """Follows D through the equations; with ``emit`` it also builds the masked program."""

    def __init__(self, ir: IR, input_axes: Dict[int, int], pad: Optional[Var], tail_slices: bool = False,
                 finite_padding: bool = False):
        self.ir = ir
        self.pad = pad
        self.tail_slices = tail_slices
        # ids of the variables whose padded positions still hold the inputs' padding, moved by layout ops only
        # (with finite_padding: known finite, so a matmul contracting D masks only the other operand)
        self.raw: set = {id(ir.inputs[i]) for i in input_axes} if finite_padding else set()
        self.lab: Dict[int, int] = {}  # id(var) -> axis holding D
        self.consts: List[Tuple[Var, torch.Tensor]] = list(ir.consts)
        self.const_of = {id(v): t for v, t in ir.consts}
        self.eqns: List[Eqn] = []
        self.masks: Dict[Tuple[int, int, int], Var] = {}  # (size, axis, rank) -> mask shaped for it
        self.valid: Dict[int, Var] = {}  # size -> pos >= p (computed once per size)
        self.fills: Dict[Tuple[Any, torch.dtype], Var] = {}
        for i, a in input_axes.items():
            v = ir.inputs[i]
            self.lab[id(v)] = a % max(1, len(_shape(v)))

    def get(self, v) -> Optional[int]:
        return self.lab.get(id(v)) if isinstance(v, Var) else None

    # -- building blocks of the masked program ------------------------------
    def _const(self, t: torch.Tensor) -> Var:
        v = Var(tuple(t.shape), t.dtype)
        self.consts.append((v, t))
        return v

    def _mask(self, size: int, axis: int, rank: int) -> Var:
        """``pos >= p`` along ``axis`` (a bool of rank ``rank``, size 1 elsewhere)."""
        key = (size, axis, rank)
        m = self.masks.get(key)
        if m is not None:
            return m
        flat = self.valid.get(size)
        if flat is None:
            pos = self._const(torch.arange(size, dtype=torch.float32))
            flat = self.valid[size] = Var((size,), torch.bool)
            self.eqns.append(Eqn(_op("ge"), [pos, self.pad], [flat]))
        shape = tuple(size if d == axis else 1 for d in range(rank))
        m = Var(shape, torch.bool)
        self.eqns.append(Eqn(_op("reshape"), [flat], [m], {"shape": shape}))
        self.masks[key] = m
        return m

    def _masked(self, x: Var, axis: int, fill) -> Var:
        """``where(pos >= p, x, fill)`` along ``axis`` of ``x``."""
        sh = _shape(x)
        m = self._mask(sh[axis], axis, len(sh))
        f = self.fills.get((fill, x.dtype))
        if f is None:
            f = self.fills[(fill, x.dtype)] = self._const(torch.tensor(fill, dtype=x.dtype))
        y = Var(sh, x.dtype)
        self.eqns.append(Eqn(_op("where"), [m, x, f], [y]))
        return y

    # -- the walk -------------------------------------------------------------
    def run(self, emit: bool) -> List[Optional[int]]:
        for eqn in self.ir.eqns:
            labels = [self.get(v) for v in eqn.inputs]
            if all(l is None for l in labels):
                if emit:
                    self.eqns.append(eqn)
                continue
            new_inputs = self.follow(eqn, labels, emit)
            if self.raw and self._moves_padding(eqn, labels):
                self.raw.update(id(o) for o in eqn.outputs if self.get(o) is not None)
            if emit:
                self.eqns.append(eqn if new_inputs is None else
                                 Eqn(eqn.op, new_inputs, eqn.outputs, eqn.attrs, eqn.source))
        return [self.get(v) for v in self.ir.outputs]

    def _moves_padding(self, eqn, labels) -> bool:
        """Whether the padded positions of ``eqn``'s result are padded positions of operands still holding the
        inputs' padding: a layout op of such operands (a cat along D: its first operand's, else every operand's)."""
        op = _opname(eqn.op)
        if op not in _LAYOUT_OPS or any(l is not None and id(v) not in self.raw for v, l in zip(eqn.inputs, labels)):
            return False
        if op != "cat":
            return True
        out = self.get(eqn.outputs[0])
        along = out is not None and eqn.attrs.get("dim", 0) % len(_shape(eqn.outputs[0])) == out
        return labels[0] is not None if along else all(l is not None for l in labels)

    def _fixed_along(self, eqn, v, axis_out: int, r: int) -> None:
        """An unlabelled operand ``v`` (aligned to rank ``r``) must not vary along D (size 1 there)."""
        if not isinstance(v, Var):
            return
        sh = (1,) * (r - len(_shape(v))) + _shape(v)
        if sh[axis_out] == 1:
            return
        t = self.const_of.get(id(v))
        if t is not None:
            a = axis_out - (r - t.dim())
            if a >= 0 and bool((t == t.narrow(a, 0, 1)).all()):
                return  # a constant that is the same at every position along D
        raise Mixed(f"{_where(eqn)} combines it with a fixed tensor of shape {list(_shape(v))} along it")

    def follow(self, eqn, labels, emit) -> Optional[list]:
        """Label the outputs of ``eqn``; returns its new inputs when masking changed them (else None)."""
        op = _opname(eqn.op)
        cat = _category(op)
        ins = list(eqn.inputs)
        outs = eqn.outputs
        a = eqn.attrs
        first = next(l for l in labels if l is not None)
        res: Optional[int]
        new = None
        if cat == "elementwise":
            r = len(_shape(outs[0]))
            axes = {l + r - len(_shape(v)) for v, l in zip(ins, labels) if l is not None}
            if len(axes) != 1:
                raise Mixed(f"{_where(eqn)} combines it on different axes")
            res = axes.pop()
            for v, l in zip(ins, labels):
                if l is None:
                    self._fixed_along(eqn, v, res, r)
        elif cat == "reduction":
            rank = len(_shape(ins[0]))
            dims = _reduce_dims(eqn, rank)
            if first in dims:
                if eqn.op.reduce_identity is None:
                    raise Mixed(f"{_where(eqn)} reduces along it ({op} has no identity to mask with)")
                if emit:
                    new = [self._masked(ins[0], first, _fill(eqn.op, ins[0].dtype))] + ins[1:]
                res = None
            else:
                res = first if a.get("keepdim") else first - sum(1 for d in dims if d < first)
        elif op == "matmul":
            res, new = self._matmul(eqn, ins, labels, emit)
        elif op == "reshape":
            if any(l is not None for l in labels[1:]):
                raise Mixed(f"{_where(eqn)} takes it as a shape")
            src, dst = _shape(ins[0]), _shape(outs[0])
            hit = _reshape_axis(src, dst, first, src[first], 1)
            if hit is None or hit[1] != 1 or hit[2] != 1:
                raise Mixed(f"{_where(eqn)} merges or splits it")
            res = hit[0]
        elif op == "permute":
            res = list(a["dims"]).index(first)
        elif op == "expand":
            res = first + len(_shape(outs[0])) - len(_shape(ins[0]))
        elif op == "cat":
            r = len(_shape(outs[0]))
            d = a.get("dim", 0) % r
            if d == first:
                if labels[0] is None or any(l is not None for l in labels[1:]):
                    raise Mixed(f"{_where(eqn)} joins it with the padded operand not first (the padding would "
                                f"land inside)")
                res = first
            else:
                for v, l in zip(ins, labels):
                    if l is None:
                        self._fixed_along(eqn, v, first, r)
                    elif l != first:
                        raise Mixed(f"{_where(eqn)} joins it on different axes")
                res = first
        elif op in ("slice", "flip", "pad") or cat in ("scan", "sort"):
            r = len(_shape(ins[0]))
            if op == "pad":
                pad = list(a.get("pad", ()))
                k = r - 1 - first
                if 2 * k + 1 < len(pad) and (pad[2 * k] or pad[2 * k + 1]):
                    raise Mixed(f"{_where(eqn)} pads along it")
            else:
                dims = a.get("dims", (a.get("dim"),))
                if first in {d % r for d in dims if d is not None}:
                    if not (self.tail_slices and _tail_slice(eqn)):
                        raise Mixed(f"{_where(eqn)} cuts, reverses, sorts or scans along it")
                    first = None  # the last positions: real ones (front padding), of a size that does not grow
            if any(l is not None for l in labels[1:]):
                raise Mixed(f"{_where(eqn)} takes it as an operand it does not handle")
            res = first
        elif op == "index":
            dims = tuple(a.get("dims", ()))
            idx = ins[1:]
            if len(dims) != 1 or len(idx) != 1 or labels[0] is None or labels[1] is not None or first == dims[0]:
                raise Mixed(f"{_where(eqn)} indexes along it")
            ni = len(_shape(idx[0]))
            res = first if first < dims[0] else first + ni - 1
        else:
            raise Mixed(f"{_where(eqn)} is not analysed for masked padding (treated as mixing)")
        for o in outs:
            if res is not None:
                self.lab[id(o)] = res
        return new

    def _matmul(self, eqn, ins, labels, emit):
        A, B = ins
        la, lb = labels
        ra, rb, r = len(_shape(A)), len(_shape(B)), len(_shape(eqn.outputs[0]))
        if ra < 2 or rb < 2:
            raise Mixed(f"{_where(eqn)}: a vector operand with it is not analysed")
        ka, kb = ra - 1, rb - 2  # contracted axes
        if la == ka or lb == kb:
            if la != ka or lb != kb:
                raise Mixed(f"{_where(eqn)} contracts it against a fixed tensor")
            new = None
            if emit:  # zero weights on the padded positions; an operand still holding finite padding needs none
                new = [A if id(A) in self.raw else self._masked(A, ka, 0.0),
                       B if id(B) in self.raw and id(A) not in self.raw else self._masked(B, kb, 0.0)]
            return None, new
        outs = set()
        if la is not None:
            outs.add(r - 2 if la == ra - 2 else la + r - ra)
        if lb is not None:
            outs.add(r - 1 if lb == rb - 1 else lb + r - rb)
        if len(outs) != 1:
            raise Mixed(f"{_where(eqn)} meets it on two axes")
        y = outs.pop()
        if y < r - 2:  # a batch axis: the other operand must broadcast there
            for v, l, rank in ((A, la, ra), (B, lb, rb)):
                if l is None:
                    k = y - (r - rank)
                    if 0 <= k < rank - 2 and _shape(v)[k] != 1:
                        raise Mixed(f"{_where(eqn)} batches it with a fixed tensor")
        return y, None


#: ops that only move values (the padded positions of their result are their operand's padded positions)
_LAYOUT_OPS = frozenset(("reshape", "permute", "expand", "cat", "slice"))


def _op(name: str):
    return ops.OPS[name]


def masked_axes(ir: IR, input_axes: Dict[int, int], tail_slices: bool = False) -> List[Optional[int]]:
    """Per output of ``ir``, the axis carrying the front-padded dimension (None: not carried).

    ``input_axes`` maps input indices of ``ir`` to the axis holding the
    dimension. Raises :class:`Mixed` when padded
    positions could reach a result position that is kept. ``tail_slices``:
    accept a slice along the dimension that keeps its last positions
    (``x[..., -k:]``, ``end`` at the size, step 1): front padding leaves them
    real as long as every call is at least ``k`` long, which the caller
    guarantees (the result no longer carries the dimension).
    """
    if ir.mutations:
        raise Mixed("the region writes back into its inputs or buffers (mutations): padded positions would be stored")
    return _Rewriter(ir, input_axes, None, tail_slices).run(emit=False)


def masked_program(ir: IR, input_axes: Dict[int, int], pad_input: int, tail_slices: bool = False,
                   finite_padding: bool = False) -> Tuple[IR, List[Optional[int]]]:
    """``ir`` with its padded positions masked where they would mix, and the output axes carrying D.

    ``pad_input`` is the index of the program's 0-d float input holding the
    number of padded positions ``p`` at the front of each padded dimension.
    ``tail_slices``: as in :func:`masked_axes`. ``finite_padding``: the caller
    pads with finite values (zeros), so a matmul contracting D whose operand
    still holds that padding (the inputs moved by reshape, permute, expand,
    slice or cat only: the values of a KV cache) masks only the other operand.
    """
    if ir.mutations:
        raise Mixed("the region writes back into its inputs or buffers (mutations): padded positions would be stored")
    pad = ir.inputs[pad_input]
    if _shape(pad) != () or not pad.dtype.is_floating_point:
        raise Mixed(f"the pad-count input {pad_input} is {pad.aval}, expected a 0-d float")
    rw = _Rewriter(ir, input_axes, pad, tail_slices, finite_padding)
    out_axes = rw.run(emit=True)
    return ir.replace(consts=rw.consts, eqns=rw.eqns), out_axes


# --------------------------------------------------------------------------- the bucket rule


def bucket_size(n: int, bucket: Union[str, Sequence[int], None] = "pow2", max_bucket: int = 4096,
                masked: bool = False, masked_min_bucket: int = 128) -> Optional[int]:
    """The bucket a size ``n`` is padded to, or None when ``n`` is not bucketed.

    ``bucket``: ``"pow2"`` (the next power of two, up to ``max_bucket``), a sorted sequence of sizes (the
    next listed size; larger sizes are not bucketed) or None (no bucketing). ``masked``: a dimension padded at
    the front (:func:`masked_program`), whose ``"pow2"`` buckets start at ``masked_min_bucket``.
    """
    if bucket is None or n < 1:
        return None
    if masked and bucket == "pow2" and n <= masked_min_bucket:
        return masked_min_bucket if masked_min_bucket <= max_bucket else None
    if bucket == "pow2":
        s = 1
        while s < n:
            s *= 2
        return s if s <= max_bucket else None
    for s in bucket:
        if s >= n:
            return s
    return None
