# Input prologues of matmuls: a per-feature scale/shift of the A operand (LayerNorm's gamma/beta) applied in the evacuation of A's TensorE transposes.
"""Per-feature affine prologues of a matmul's A operand.

A pre-norm transformer computes ``LayerNorm(x) @ W^T``: the norm ends with
two full-width elementwise ops, ``y * gamma + beta`` (each a VectorE
``tensor_tensor`` over the whole ``[tokens, features]`` value, 2 cycles per
element), and the matmul then transposes its A operand on TensorE so that
features lie on the partitions. In that feature-major layout ``gamma`` and
``beta`` are *per-partition* scalars, so the evacuation copy PSUM -> SBUF of
each transposed 128x128 block can apply them for free: ScalarE
``activation(identity, scale=gamma_col, bias=beta_col)`` or VectorE
``tensor_scalar(mult gamma_col, add beta_col)``.

:func:`plan` finds, for a 2-D matmul operand ``a``, the equations before it

    src --mul(per-feature scale)?--> --add(per-feature shift)?--> --convert?--> --reshape*--> a

(at least one of mul/add; every intermediate used only by the next one) and
returns a :class:`Prologue`. The compiler then does not lower those
equations: the group producing ``src`` ends before them (``src`` is
handed off in SBUF or stored to HBM), and the consumer (a matmul lowering or
the first layer of a Linear chain) transposes ``src`` and applies the
prologue in the evacuation (``Bound.evacuate``). Rounding is torch's: the
engines compute ``src * scale`` in fp32, then ``+ shift`` in fp32 (two
roundings, no fused multiply-add), and round once to ``a``'s dtype, which is
what torch does for ``y.float() * g + b`` followed by ``.to(a.dtype)``;
patterns that would round in between (a low-precision product before the
shift) are not matched.

A bf16 matmul whose ``src`` is fp32 now transposes fp32 blocks (4x the
TensorE cycles of bf16 ones); this pays while TensorE waits for the norm
(one row tile, up to 128 tokens), so with more rows a prologue is planned
only when ``src`` already has the matmul's dtype.

A consumer must call :meth:`Bound.take` (then it reads ``src`` and applies
the prologue); the compiler rebuilds without the prologue when it did not.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Set

import torch

from ..ir import IR, Literal, Var
from ..neuron import isa
from .base import NEURON_DTYPES, dataflow, stage_vector_rows
from .fusion import _lstrip1

__all__ = ["Prologue", "Bound", "plan", "bank_view"]

_P = 128
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class Prologue:
    """``out = convert(src * scale + shift)`` (then reshapes), per feature (the last axis of ``src``).

    Attributes: ``src`` (Var the consumer reads), ``out`` (the matmul operand), ``eqns`` (indices of the
    equations it replaces), ``scale`` / ``shift`` (a per-feature Var ``[C]`` / ``[1, .., C]``, a Python
    number, or None), ``features`` (C).
    """

    def __init__(self, src: Var, out: Var, eqns: List[int], scale: Any, shift: Any):
        self.src = src
        self.out = out
        self.eqns = eqns
        self.scale = scale
        self.shift = shift
        self.features = int(src.shape[-1])

    def vectors(self) -> List[Var]:
        """The per-feature Vars among scale and shift (the program inputs the prologue reads)."""
        return [v for v in (self.scale, self.shift) if isinstance(v, Var)]

    def __repr__(self) -> str:
        return f"<Prologue {self.src.aval} -> {self.out.aval} eqns {self.eqns}>"


def _per_feature(v: Any, c: int) -> bool:
    """``v`` is a float Var constant along every axis but the last (``[C]``/``[1, .., C]``) or a Python number."""
    if isinstance(v, Literal):
        return isinstance(v.value, (int, float)) and not isinstance(v.value, bool)
    return isinstance(v, Var) and v.dtype in _FLOATS and _lstrip1(v.shape) == (c,)


def plan(ir: IR, host: Dict[int, str], skip: Set[Any] = frozenset()) -> Dict[Var, Prologue]:
    """Prologues of ``ir`` by matmul operand (``Prologue.out``); operands in ``skip`` are left alone."""
    producer, users, outset = dataflow(ir)
    found: Dict[Var, Prologue] = {}
    for k, e in enumerate(ir.eqns):
        if e.op.name != "matmul" or k in host or len(e.inputs) != 2:
            continue
        a, b = e.inputs
        if not isinstance(a, Var) or not isinstance(b, Var) or a is b or a.ndim != 2 or a in skip or \
                a.dtype not in _FLOATS or b.dtype != a.dtype or a.numel == 0:
            continue
        p = _match(ir, k, a, producer, users, outset, host)
        if p is not None:
            found[a] = p
    return found


def _match(ir: IR, k: int, a: Var, producer, users, outset, host) -> Optional[Prologue]:
    """The prologue ending in operand ``a`` of matmul ``k``, or None.

    Walks back from ``a``: reshapes keeping the feature axis and one convert to ``a``'s dtype, then an
    ``add`` of a per-feature shift, then a ``mul`` by a per-feature scale (at least one of the two)."""
    C = int(a.shape[-1])
    if C > _P * _P:
        return None         # the per-feature vectors are loaded as [KC, 128] blocks (KC <= 128)
    eqns: List[int] = []
    u, nxt = a, k
    stage = "post"          # post (reshapes, convert) -> add -> mul
    converted = False
    scale = shift = None
    arith: List[Any] = []   # the arithmetic equations, last first
    while stage != "mul":
        j = producer.get(u)
        if j is None or j in host or u in outset or list(users.get(u, ())) != [nxt]:
            break
        e = ir.eqns[j]
        x = e.inputs[0] if e.inputs else None
        if not isinstance(x, Var) and e.op.name in ("reshape", "convert"):
            break
        if stage == "post" and e.op.name == "reshape" and x.ndim and int(x.shape[-1]) == C and x.dtype == u.dtype:
            pass
        elif stage == "post" and e.op.name == "convert" and not converted and x.dtype in _FLOATS:
            converted = True
        elif e.op.name in ("add", "mul") and len(e.inputs) == 2 and (stage == "post" or e.op.name == "mul"):
            same = [t for t in e.inputs if isinstance(t, Var) and t.shape == e.outputs[0].shape]
            if not same:
                break
            x = same[0]
            other = e.inputs[1] if e.inputs[0] is x else e.inputs[0]
            if not _per_feature(other, C) or (isinstance(other, Var) and other in producer):
                break       # (a computed vector might not exist yet where the prologue loads its vectors)
            if e.op.name == "mul" and arith and e.outputs[0].dtype != torch.float32:
                break       # a product rounded below fp32 before the shift: not one instruction's fp32 x*s+b
            if e.op.name == "add":
                shift, stage = other, "add"
            else:
                scale, stage = other, "mul"
            arith.append(e)
        else:
            break
        eqns.append(j)
        nxt = j
        u = x
    if not arith:
        return None
    src = u
    if not isinstance(src, Var) or src.dtype not in _FLOATS or src.numel != a.numel or int(src.shape[-1]) != C:
        return None
    last = arith[0].outputs[0]
    if last.dtype != a.dtype and last.dtype != torch.float32:
        return None         # rounded to a low precision, then converted again
    rows = a.numel // C
    if rows > _P and src.dtype != a.dtype:
        return None         # fp32 transposes for a bf16 matmul only pay while TensorE waits (one row tile)
    return Prologue(src, a, sorted(eqns), scale, shift)


def bank_view(tile: Any, dtype: str) -> Any:
    """PSUM tile ``tile`` (one bank ``[P, G, 128]``) seen as ``[P, G', 128]`` of ``dtype`` (same bytes)."""
    isz = isa.DTYPE_SIZES[isa.dtype_code(dtype)]
    nbytes = tile.itemsize * _free_elems(tile)
    g = nbytes // (_P * isz)
    return tile._derive(dtype=dtype, dims=[(g, _P), (_P, 1)])


def _free_elems(tile: Any) -> int:
    n = 1
    for d, _ in tile.dims:
        n *= d
    return n


class Bound:
    """A :class:`Prologue` inside one program: its operands' HBM tensors, the per-partition columns and the
    consumer's state (``taken``)."""

    def __init__(self, pro: Prologue, src_hbm: Any, vec_hbm: Dict[Var, Any]):
        self.pro = pro
        self.src_hbm = src_hbm
        self.vec_hbm = vec_hbm
        self.cols = None           # SBUF fp32 [128, nvec * KC]: feature kc*128 + p of vector i at [p, i*KC + kc]
        self.col_of: Dict[str, int] = {}
        self.keep: List[Any] = []  # the vectors' staging tiles (freed with the columns)
        self.taken = False
        self.n = 0
        self.dtype = NEURON_DTYPES[pro.src.dtype]        # the transposed blocks' dtype
        self.out_dtype = NEURON_DTYPES[pro.out.dtype]

    @property
    def KC(self) -> int:
        return -(-self.pro.features // _P)

    def preload(self, prog: Any) -> None:
        """Load the per-feature vectors as per-partition columns (a contiguous DMA ``[KC, 128]`` per vector,
        one TensorE transpose each, one copy): emitted before the producer of ``src`` so they are ready early."""
        if self.cols is not None:
            return
        vecs = [(name, v) for name, v in (("scale", self.pro.scale), ("shift", self.pro.shift)) if isinstance(v, Var)]
        if not vecs:
            self.cols = ()
            return
        C, KC = self.pro.features, self.KC
        cols = prog.sbuf((_P, len(vecs) * KC), "float32", name="pro_cols")
        ps = prog.psum((_P, len(vecs) * KC), "float32", name="pro_tp")
        stages = []
        for i, (name, v) in enumerate(vecs):
            vdt = NEURON_DTYPES[v.dtype]
            flat = self.vec_hbm[v].view().reshape(v.numel)
            st = prog.sbuf((KC, _P), vdt, name="pro_vstage")
            stage_vector_rows(prog, st, flat, C, _P)
            prog.transpose(ps[:, i * KC:(i + 1) * KC], st[:KC, :])
            stages.append(st)
            self.col_of[name] = i * KC
        prog.tensor_copy(cols, ps, engine="vector")
        prog.free(ps)
        # the staging tiles live as long as the columns: freed now, the producer's next SBUF tile could take
        # their place and its load would wait for these transposes
        self.keep = stages
        self.cols = cols

    def free(self, prog: Any) -> None:
        """Free the columns (after the consumer)."""
        if self.cols is not None and self.cols != ():
            prog.free(self.cols)
            for st in reversed(self.keep):
                prog.free(st)
        self.cols = None
        self.keep = []

    def take(self, ctx: Any) -> Optional[Any]:
        """Claim the prologue for the calling consumer: returns ``src``'s SBUF hand-off tile (``[rows, C]``) or
        None (then ``src`` is read from ``self.src_hbm``)."""
        self.taken = True
        if self.cols is None:
            self.preload(ctx.prog)
        return ctx.take(self.pro.src) if self.pro.src in ctx.resident else None

    def _operand(self, name: str, kc: int, kp: int) -> Any:
        v = getattr(self.pro, name)
        if v is None:
            return None
        if isinstance(v, Literal):
            return float(v.value)
        c = self.col_of[name] + kc
        return self.cols[:kp, c:c + 1]

    def evacuate(self, prog: Any, out: Any, src: Any, kc: int, kp: int) -> None:
        """``out = src * scale + shift`` for the transposed block of features ``kc*128 .. kc*128+kp`` (``src`` a
        PSUM block ``[kp, ..]`` of :attr:`dtype`, ``out`` its SBUF destination): ScalarE and VectorE in turn."""
        s = self._operand("scale", kc, kp)
        b = self._operand("shift", kc, kp)
        self.n += 1
        if self.n % 2:
            prog.activation(out, src, "identity", scale=1.0 if s is None else s, bias=b)
            return
        if s is not None and b is not None:
            prog.tensor_scalar(out, src, "multiply", s, "add", b, engine="vector")
        elif s is not None:
            prog.tensor_scalar(out, src, "multiply", s, engine="vector")
        else:
            prog.tensor_scalar(out, src, "add", b, engine="vector")
