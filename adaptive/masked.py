# tn.adaptive.masked: buckets a dimension a program joins to (a KV cache that grows by cat) by front padding + masks.
"""Masked buckets: pad a dimension at its *front* and mask what mixes it.

Prefix padding (:mod:`tn.adaptive.independence`) pads a dimension D at its
end and needs every result position to depend only on earlier ones. A KV
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
:class:`~tn.adaptive.independence.Mixed`. As with prefix padding, the caller
must also check with :func:`~tn.adaptive.independence.same_program` that
the program traced at two sizes is the same, so Python that bakes a size
into a literal is refused.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import ops
from ..ir import IR, Eqn, Var
from .independence import Mixed, _category, _opname, _reduce_dims, _reshape_axis, _shape, _where

__all__ = ["masked_axes", "masked_program"]

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

    def __init__(self, ir: IR, input_axes: Dict[int, int], pad: Optional[Var]):
        self.ir = ir
        self.pad = pad
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
            if emit:
                self.eqns.append(eqn if new_inputs is None else
                                 Eqn(eqn.op, new_inputs, eqn.outputs, eqn.attrs, eqn.source))
        return [self.get(v) for v in self.ir.outputs]

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
                    raise Mixed(f"{_where(eqn)} cuts, reverses, sorts or scans along it")
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
            if emit:
                new = [self._masked(A, ka, 0.0), self._masked(B, kb, 0.0)]
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


def _op(name: str):
    return ops.OPS[name]


def masked_axes(ir: IR, input_axes: Dict[int, int]) -> List[Optional[int]]:
    """Per output of ``ir``, the axis carrying the front-padded dimension (None: not carried).

    ``input_axes`` maps input indices of ``ir`` to the axis holding the
    dimension. Raises :class:`~tn.adaptive.independence.Mixed` when padded
    positions could reach a result position that is kept.
    """
    if ir.mutations:
        raise Mixed("the region writes back into its inputs or buffers (mutations): padded positions would be stored")
    return _Rewriter(ir, input_axes, None).run(emit=False)


def masked_program(ir: IR, input_axes: Dict[int, int], pad_input: int) -> Tuple[IR, List[Optional[int]]]:
    """``ir`` with its padded positions masked where they would mix, and the output axes carrying D.

    ``pad_input`` is the index of the program's 0-d float input holding the
    number of padded positions ``p`` at the front of each padded dimension.
    """
    if ir.mutations:
        raise Mixed("the region writes back into its inputs or buffers (mutations): padded positions would be stored")
    pad = ir.inputs[pad_input]
    if _shape(pad) != () or not pad.dtype.is_floating_point:
        raise Mixed(f"the pad-count input {pad_input} is {pad.aval}, expected a 0-d float")
    rw = _Rewriter(ir, input_axes, pad)
    out_axes = rw.run(emit=True)
    return ir.replace(consts=rw.consts, eqns=rw.eqns), out_axes

