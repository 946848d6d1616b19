# complex64 values as float32 (re, im) pairs: the IR rewrite the compiler applies first, and its executable's boundary.
"""complex64 values on the NeuronCore: as their float32 ``(re, im)`` pairs.

The chip has no complex dtype, but a complex64 tensor in memory *is* float32
pairs: ``view_as_real`` and ``view_as_complex`` (core ops of
:mod:`tn.ops.fft`) reinterpret the same bytes. :func:`to_pairs` rewrites an IR
so that every complex64 value is carried as its pairs Var ``[.., 2]`` float32:

* ``view_as_real`` / ``view_as_complex`` become nothing (the result *is* the
  pairs value, or the complex value of the given pairs): free aliases;
* ops that act on pairs as they act on complex values become the same op on
  the pairs with the pair axis added to their attributes: ``reshape``,
  ``permute``, ``expand``, ``slice``, ``slice_scatter``, ``flip``, ``cat``,
  ``pad`` (zero), ``sum`` (over complex axes), ``neg``, ``add``/``sub`` of two
  complex values, ``mul``/``div`` by a real value (a Literal, or a real tensor
  broadcast over the pair axis), ``index`` (by integer index tensors), ``where``;
* ``conj`` negates the imaginary half, ``mul`` of two complex values is the
  four real products, ``div`` of two the textbook quotient (no Smith scaling), ``convert`` of a real value to complex64 appends a zero
  imaginary half, ``abs`` is ``sqrt(re^2 + im^2)``; complex128 scalars (the
  tracer's constants for Python complex numbers) are pairs rounded to float32;
* any other op reading or making a complex64 value keeps it: its complex
  inputs are made by ``view_as_complex`` of their pairs (and its complex
  results read back by ``view_as_real``); those equations stay on the host as
  before (the chip has no complex dtype), counted with their reason.

Complex64 program inputs, constants and outputs become pairs too;
:class:`PairsExecutable` wraps the executable of the rewritten IR and passes
``torch.view_as_real`` of each complex input in and ``torch.view_as_complex``
of each such output out: the same memory, no copy (a conjugate bit is
resolved first). An IR without complex64 values is returned unchanged.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..ir import IR, Eqn, Literal, Var
from ..ops import OPS
from .base import ExecutableWrapper

__all__ = ["to_pairs", "PairsExecutable"]

C64 = torch.complex64
C128 = torch.complex128
F32 = torch.float32


def _is_c(a: Any) -> bool:
    return isinstance(a, Var) and a.dtype == C64


class _Rewriter:
    """One rewrite of an IR (see :func:`to_pairs`)."""

    def __init__(self, ir: IR):
        self.ir = ir
        self.eqns: List[Eqn] = []
        self.pairs: Dict[Var, Var] = {}     # complex64 Var -> its float32 pairs Var
        self.sub: Dict[Var, Any] = {}       # real Var of the old IR -> its Var/Literal in the new one
        self.cplx: Dict[Var, Var] = {}      # complex64 Var -> a complex Var of the new IR (host fallbacks)
        # complex128 scalars (the tracer's constants for Python complex numbers, and conj of them): pairs too,
        # rounded to float32 as torch computes them with complex64 tensors; their consts kept for host uses
        self.wide: Dict[Var, Any] = {}
        self.extra_consts: List[Tuple[Var, torch.Tensor]] = []
        self.src: Optional[str] = None

    # ---------------------------------------------------------------- helpers
    def emit(self, op: str, inputs: Sequence[Any], attrs: Dict[str, Any], shape: Sequence[int],
             dtype: torch.dtype = F32) -> Var:
        v = Var(tuple(shape), dtype)
        self.eqns.append(Eqn(OPS[op], list(inputs), [v], attrs, self.src))
        return v

    def is_c(self, a: Any) -> bool:
        """Carried as pairs: a complex64 Var, or a complex128 scalar of :attr:`wide`."""
        return _is_c(a) or isinstance(a, Var) and a in self.wide

    def real(self, a: Any) -> Any:
        return self.sub.get(a, a) if isinstance(a, Var) else a

    def p(self, c: Var) -> Var:
        """The pairs Var of complex64 ``c`` (made from its complex form when only that exists)."""
        v = self.pairs.get(c)
        if v is None:
            v = self.pairs[c] = self.emit("view_as_real", [self.cplx[c]], {}, c.shape + (2,))
        return v

    def complex_of(self, c: Var) -> Var:
        """A complex64 Var of the new IR holding ``c``'s value (``view_as_complex`` of its pairs if needed)."""
        v = self.cplx.get(c)
        if v is None and c in self.wide:
            t = self.wide[c]
            if t is not None:               # a constant: its complex128 tensor, as the IR had it
                self.extra_consts.append((c, t))
                v = self.cplx[c] = c
            else:
                v64 = self.emit("view_as_complex", [self.pairs[c]], {}, c.shape, C64)
                v = self.cplx[c] = self.emit("convert", [v64], {"dtype": C128}, c.shape, C128)
        elif v is None:
            v = self.cplx[c] = self.emit("view_as_complex", [self.pairs[c]], {}, c.shape, C64)
        return v

    def half(self, p: Var, k: int) -> Var:
        """Real (``k=0``) or imaginary (``k=1``) half of pairs ``p``, keeping the pair axis (size 1)."""
        n = p.ndim - 1
        return self.emit("slice", [p], {"dim": n, "start": k, "end": k + 1, "step": 1}, p.shape[:-1] + (1,))

    def join(self, re: Var, im: Var) -> Var:
        return self.emit("cat", [re, im], {"dim": re.ndim - 1}, re.shape[:-1] + (2,))

    def widen(self, r: Any) -> Any:
        """A real tensor operand broadcast against pairs: a size-1 pair axis (Literals stay)."""
        if isinstance(r, Literal):
            return r
        r = self.real(r)
        if r.dtype != F32:
            r = self.emit("convert", [r], {"dtype": F32}, r.shape)
        return self.emit("reshape", [r], {"shape": r.shape + (1,)}, r.shape + (1,))

    def widen_cond(self, c: Any) -> Any:
        """A condition broadcast against pairs: a size-1 pair axis (Literals stay)."""
        if isinstance(c, Literal):
            return c
        c = self.real(c)
        return self.emit("reshape", [c], {"shape": c.shape + (1,)}, c.shape + (1,), c.dtype)

    # ---------------------------------------------------------------- equations
    def rewrite(self, e: Eqn) -> bool:
        """Emit ``e`` on pairs; False when it is not a form this rewrite knows (then it is kept as it is)."""
        if not self._rewrite(e):
            return False
        out = e.outputs[0]
        if out.dtype == C128:
            self.wide[out] = None
        return True

    def _rewrite(self, e: Eqn) -> bool:
        name, a, out = e.op.name, e.attrs, e.outputs[0] if len(e.outputs) == 1 else None
        if out is None or any(isinstance(x, Literal) and isinstance(x.value, complex) for x in e.inputs):
            return False
        ins = e.inputs
        cin = [self.is_c(x) for x in ins]
        # a complex128 scalar computed from complex128 scalars only (conj of a Python complex number)
        wide_out = out.dtype == C128 and out.shape == () and any(cin) and \
            all(x in self.wide for x, c in zip(ins, cin) if c)
        if name == "view_as_real" and cin[0]:
            self.sub[out] = self.p(ins[0])
            return True
        if name == "view_as_complex" and out.dtype == C64:
            self.pairs[out] = self.real(ins[0])
            return True
        if name == "abs" and cin == [True] and out.dtype == F32:
            p = self.p(ins[0])
            sq = self.emit("mul", [p, p], {}, p.shape)
            norm2 = self.emit("sum", [sq], {"dims": (p.ndim - 1,), "keepdim": False}, out.shape)
            self.sub[out] = self.emit("sqrt", [norm2], {}, out.shape)
            return True
        if out.dtype != C64 and not wide_out:
            return False
        n = out.ndim
        if name == "convert":
            x = ins[0]
            if self.is_c(x):
                self.pairs[out] = self.p(x)
                return True
            if not isinstance(x, Var) or x.dtype.is_complex:
                return False
            re = self.widen(x)
            self.pairs[out] = self.emit("pad", [re], {"pad": (0, 1), "value": 0.0}, out.shape + (2,))
            return True
        if not all(cin[i] or isinstance(ins[i], Literal) or (isinstance(ins[i], Var) and not ins[i].dtype.is_complex)
                   for i in range(len(ins))):
            return False
        shape2 = out.shape + (2,)
        if name in ("reshape", "expand") and cin == [True]:
            attrs = {**a, "shape": tuple(a["shape"]) + (2,)}
        elif name == "permute" and cin == [True]:
            attrs = {**a, "dims": tuple(int(d) % n for d in a["dims"]) + (n,)}
        elif name in ("slice", "cat", "slice_scatter") and all(cin):
            attrs = {**a, "dim": int(a["dim"]) % n}
        elif name == "flip" and cin == [True]:
            attrs = {**a, "dims": tuple(int(d) % n for d in a["dims"])}
        elif name == "pad" and cin == [True] and a.get("value", 0) == 0:
            attrs = {**a, "pad": (0, 0) + tuple(a["pad"]), "value": 0.0}
        elif name == "sum" and cin == [True] and a.get("dtype") in (None, C64):
            if not a.get("dims") or ins[0].ndim == 0:
                return False
            attrs = {**a, "dims": tuple(int(d) % ins[0].ndim for d in a["dims"])}
            if attrs.get("dtype") == C64:
                attrs["dtype"] = F32
        elif name == "neg" and cin == [True]:
            attrs = dict(a)
        elif name in ("add", "sub") and len(ins) == 2 and all(cin) and not a:
            attrs = {}
        elif name == "conj" and cin == [True]:
            p = self.p(ins[0])
            im = self.emit("neg", [self.half(p, 1)], {}, p.shape[:-1] + (1,))
            self.pairs[out] = self.join(self.half(p, 0), im)
            return True
        elif name in ("mul", "div") and len(ins) == 2 and cin[0] != cin[1] and not a and (name == "mul" or cin[0]):
            c, r = (0, 1) if cin[0] else (1, 0)
            args = [None, None]
            args[c], args[r] = self.p(ins[c]), self.widen(ins[r])
            self.pairs[out] = self.emit(name, args, {}, shape2)
            return True
        elif name == "index" and cin[0] and not any(cin[1:]):
            # the indexed axes are complex axes: the pair axis stays last, whatever the indexing's result layout
            self.pairs[out] = self.emit(name, [self.p(ins[0])] + [self.real(x) for x in ins[1:]], dict(a), shape2)
            return True
        elif name == "where" and len(ins) == 3 and not cin[0] and cin[1] and cin[2]:
            self.pairs[out] = self.emit(name, [self.widen_cond(ins[0]), self.p(ins[1]), self.p(ins[2])], {}, shape2)
            return True
        elif name == "div" and len(ins) == 2 and all(cin) and not a:
            x, y = self.p(ins[0]), self.p(ins[1])
            xr, xi, yr, yi = self.half(x, 0), self.half(x, 1), self.half(y, 0), self.half(y, 1)
            s = out.shape + (1,)
            den = self.emit("add", [self.emit("mul", [yr, yr], {}, yr.shape), self.emit("mul", [yi, yi], {}, yi.shape)],
                            {}, yr.shape)
            re = self.emit("add", [self.emit("mul", [xr, yr], {}, s), self.emit("mul", [xi, yi], {}, s)], {}, s)
            im = self.emit("sub", [self.emit("mul", [xi, yr], {}, s), self.emit("mul", [xr, yi], {}, s)], {}, s)
            self.pairs[out] = self.join(self.emit("div", [re, den], {}, s), self.emit("div", [im, den], {}, s))
            return True
        elif name == "mul" and len(ins) == 2 and all(cin) and not a:
            x, y = self.p(ins[0]), self.p(ins[1])
            xr, xi, yr, yi = self.half(x, 0), self.half(x, 1), self.half(y, 0), self.half(y, 1)
            s = out.shape + (1,)
            re = self.emit("sub", [self.emit("mul", [xr, yr], {}, s), self.emit("mul", [xi, yi], {}, s)], {}, s)
            im = self.emit("add", [self.emit("mul", [xr, yi], {}, s), self.emit("mul", [xi, yr], {}, s)], {}, s)
            self.pairs[out] = self.join(re, im)
            return True
        else:
            return False
        self.pairs[out] = self.emit(name, [self.p(x) for x in ins], attrs, shape2)
        return True

    def keep(self, e: Eqn) -> None:
        """Keep ``e`` as it is (complex inputs made from pairs; complex results known in complex form)."""
        ins = [self.complex_of(x) if self.is_c(x) else self.real(x) for x in e.inputs]
        self.eqns.append(Eqn(e.op, ins, list(e.outputs), e.attrs, e.source))
        for v in e.outputs:
            if _is_c(v):
                self.cplx[v] = v

    def run(self) -> Tuple[IR, List[int], List[int]]:
        ir = self.ir
        inputs, cin = [], []
        for i, v in enumerate(ir.inputs):
            if _is_c(v):
                self.pairs[v] = pv = Var(v.shape + (2,), F32)
                inputs.append(pv)
                cin.append(i)
            else:
                inputs.append(v)
        consts = []
        for v, t in ir.consts:
            if _is_c(v):
                self.pairs[v] = pv = Var(v.shape + (2,), F32)
                consts.append((pv, torch.view_as_real(t.resolve_conj()).clone()))
            elif v.dtype == C128 and v.shape == ():
                self.pairs[v] = pv = Var((2,), F32)
                consts.append((pv, torch.view_as_real(t.resolve_conj().to(C64)).clone()))
                self.wide[v] = t
            else:
                consts.append((v, t))
        for e in ir.eqns:
            self.src = e.source
            if not self.rewrite(e):
                self.keep(e)
        outputs, cout = [], []
        for j, o in enumerate(ir.outputs):
            if _is_c(o):
                outputs.append(self.p(o))
                cout.append(j)
            elif isinstance(o, Var) and o in self.wide:
                outputs.append(self.complex_of(o))
            else:
                outputs.append(self.real(o))
        new = IR(inputs, self.eqns, outputs, consts + self.extra_consts, ir.mutations, ir.name)
        return new, cin, cout


def _has_c64(ir: IR) -> bool:
    return any(_is_c(v) for v in ir.inputs) or any(_is_c(v) for v, _ in ir.consts) or \
        any(_is_c(v) for e in ir.eqns for v in list(e.inputs) + list(e.outputs))


def to_pairs(ir: IR) -> Tuple[IR, List[int], List[int]]:
    """``(new IR, complex input indices, complex output indices)``: ``ir`` with its complex64 values carried as
    float32 pairs (module docstring); the indices are the inputs/outputs that are pairs in the new IR and
    complex64 in ``ir``. An IR without complex64 values comes back as it is, with no indices."""
    if not _has_c64(ir):
        return ir, [], []
    return _Rewriter(ir).run()     # (complex and pairs forms are made only where read: nothing left dead)


def _pairs_of(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t.resolve_conj())


def _complex_of(t: Any) -> Any:
    return OPS["view_as_complex"].impl(t) if isinstance(t, torch.Tensor) else t


class PairsExecutable(ExecutableWrapper):
    """The executable of an IR rewritten by :func:`to_pairs`, called with the original IR's inputs: complex64
    inputs go in as their pairs and pairs outputs come back as complex64, both views of the same memory.
    Every other attribute is the wrapped executable's (``stats``, ``last_profile``, ``schedule`` ...), read and
    written."""

    def __init__(self, exe: Any, ir: IR, complex_inputs: Sequence[int], complex_outputs: Sequence[int]):
        self.exe = exe
        self.ir = ir
        self.complex_inputs = tuple(complex_inputs)
        self.complex_outputs = tuple(complex_outputs)

    def __call__(self, tensors: Sequence[torch.Tensor]) -> List[Any]:
        """Run on the flat inputs of the original IR; returns the values of its outputs."""
        ts = list(tensors)
        for i in self.complex_inputs:
            ts[i] = _pairs_of(ts[i])
        out = list(self.exe(ts))
        for j in self.complex_outputs:
            out[j] = _complex_of(out[j])
        return out

    _OWN = ("exe", "ir", "complex_inputs", "complex_outputs")

    def __repr__(self) -> str:
        return f"<PairsExecutable of {self.exe!r}>"
