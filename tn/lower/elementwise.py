# Lowerings of the elementwise ops (unary, binary, where, convert): per-op tile rules on ScalarE/VectorE, run by the tile engine.
"""Elementwise ops on the NeuronCore.

Each op has a *tile rule*, held by the op (:attr:`tn.ops.Op.tile_rule`, set by :func:`tile_rule`):
``rule(ctx, eqn, out, ins)`` computes the op on SBUF tiles of one partition
count and free shape (``ins[i]`` a Tile, maybe a stride-0 broadcast view, or
a Python scalar for a Literal). ScalarE activation functions are used where
the engine has the function (exp, log, tanh, sigmoid, gelu, sqrt, sin ...),
VectorE ALU ops otherwise; ops the engines lack are composed (floor from
``mod``, atan from a range-reduced polynomial, sinh from exp, fmod from
``mod`` of absolute values ...). Every op's lowering runs its rule through the
tile engine of :mod:`tn.lower.tile` (tiling, broadcasting by access
patterns, double buffering), which also runs the fused chains of these rules
(:mod:`tn.lower.fusion` plans them). The activation functions of
:data:`tn.lower.tile.ACT_FUNC_OF` are single-activation tile rules.

Numerics: the engines compute in fp32 and round to the output dtype, so
integer arithmetic is exact only below 2**24. ``erfinv`` is Giles' single
precision approximation (log, sqrt and two polynomials on the engines). Bitwise
ops and shifts of integers use VectorE's integer ALU ops (int32 words, exact
at any value; int64 values as their range-checked int32 words, left shifts
of int64 excepted). NaN handling follows the
engines (``maximum``/``minimum``/``relu`` do not propagate NaN).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List

import torch

from .. import ops
from ..ir import Var
from .base import CannotLower, lowering
from .tile import ACT_FUNC_OF, lower_map

__all__ = ["tile_rule", "ELEMENTWISE_OPS", "ACT_FUNC_OF", "pp_scalar"]

#: op name -> ``rule(ctx, eqn, out_tile, in_tiles)``.
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def tile_rule(*names: str, precheck: Callable[[Any], None] = None,
              temps: int = 3) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorator: register a tile rule for the ops ``names``.

    ``precheck(eqn)`` may raise CannotLower before anything is emitted;
    ``temps`` is how many fp32 scratch tiles of the output's shape the rule
    allocates at most (the tile engine budgets SBUF with it).
    """

    def deco(fn: Callable[..., None]) -> Callable[..., None]:
        if precheck is not None:
            fn.precheck = precheck
        fn.temps = temps
        for n in names:
            ops.get(n).tile_rule = fn
        return fn

    return deco


# --------------------------------------------------------------------------- helpers

class _Tmp:
    """Scratch fp32 tiles shaped like ``like``, freed together on exit."""

    def __init__(self, ctx: Any, like: Any):
        self.prog = ctx.prog
        self.shape = like.shape
        self.tiles: List[Any] = []

    def __call__(self, dtype: str = "float32") -> Any:
        t = self.prog.sbuf(self.shape, dtype)
        self.tiles.append(t)
        return t

    def const(self, value: float, dtype: str = "float32") -> Any:
        """A tile full of ``value`` (one element per partition, broadcast by a stride-0 view)."""
        t = self.prog.sbuf((self.shape[0], 1), dtype)
        self.tiles.append(t)
        self.prog.memset(t, value)
        return t.reshape((self.shape[0],) + (1,) * (len(self.shape) - 1)).broadcast_to(self.shape)

    def __enter__(self) -> "_Tmp":
        return self

    def __exit__(self, *exc: Any) -> bool:
        for t in self.tiles:
            self.prog.free(t)
        return False


def _free(t) -> int:
    n = 1
    for d in t.shape[1:]:
        n *= d
    return n


def _charge(ctx, engine: str, cycles: float) -> None:
    """Account an instruction's modelled engine time (ns) so later choices balance ScalarE and VectorE."""
    load = ctx.__dict__.setdefault("engine_load", {"act": 0.0, "dve": 0.0})
    load[engine] += cycles / ctx.arch.clock_hz[engine] * 1e9


def _cost_ns(ctx, engine: str, cycles: float) -> float:
    return cycles / ctx.arch.clock_hz[engine] * 1e9


def _act(ctx, out, x, func, scale=1.0, bias=None):
    ctx.prog.activation(out, x, func, scale=scale, bias=bias)
    n = _free(out)
    _charge(ctx, "act", (8 * n if func == "reciprocal" else max(64, n)) + 60)


def pp_scalar(t):
    """The ``[p, 1]`` view of a tile whose free axes are all broadcast (a per-partition scalar), else None."""
    if not hasattr(t, "mem"):
        return None
    if all(st == 0 or n == 1 for n, st in t.dims):
        return t[(slice(None),) + (slice(0, 1),) * len(t.dims)].reshape(t.shape[0], 1)
    return None


_AFFINE = ("add", "subtract", "multiply")


def _affine(op, s, rev, a, b):
    """Compose ``y = a*x + b`` with ``y op s`` (``s op y`` when rev) into new (a, b); None if not affine."""
    if op == "multiply":
        return a * s, b * s
    if op == "add":
        return a, b + s
    if op == "subtract":
        return (-a, s - b) if rev else (a, b - s)
    return None


def _ts(ctx, out, x, op0, s0, op1=None, s1=None, rev0=False, rev1=False):
    """``out = (x op0 s0) op1 s1`` on VectorE, or as one ScalarE affine activation when that engine is less loaded.

    ``s0``/``s1`` are Python numbers or per-partition ``[p, 1]`` tiles.
    """
    n = _free(out)
    t0, t1 = hasattr(s0, "mem"), hasattr(s1, "mem")
    if not t0 and not t1 and op0 in _AFFINE and (op1 is None or op1 in _AFFINE):
        ab = _affine(op0, float(s0), rev0, 1.0, 0.0)
        if op1 is not None and ab is not None:
            ab = _affine(op1, float(s1), rev1, *ab)
        load = ctx.__dict__.setdefault("engine_load", {"act": 0.0, "dve": 0.0})
        if ab is not None and load["act"] + _cost_ns(ctx, "act", max(64, n) + 60) < \
                load["dve"] + _cost_ns(ctx, "dve", max(64, n) + 60):
            _act(ctx, out, x, "identity", scale=ab[0], bias=ab[1])
            return
    ctx.prog.tensor_scalar(out, x, op0, s0 if t0 else float(s0), op1,
                           None if s1 is None else (s1 if t1 else float(s1)), reverse0=rev0, reverse1=rev1)
    _charge(ctx, "dve", max(64, n) + 60)


def _tt(ctx, out, a, b, op):
    ctx.prog.tensor_tensor(out, a, b, op)
    _charge(ctx, "dve", max(64, 2 * _free(out)) + 60)


def _binary(ctx, out, a, b, op, *, commutative=False):
    """``out = a op b`` where either side may be a Python scalar or a per-partition scalar tile."""
    sa, sb = not hasattr(a, "mem"), not hasattr(b, "mem")
    if sa and sb:
        with _Tmp(ctx, out) as tmp:
            _ts(ctx, out, tmp.const(float(a)), op, float(b))
        return
    if sb:
        _ts(ctx, out, a, op, float(b))
        return
    if sa:
        _ts(ctx, out, b, op, float(a), rev0=not commutative)
        return
    pb, pa = pp_scalar(b), pp_scalar(a)
    if pb is not None and pa is None:
        if op == "multiply" and _out_is_float(out):
            return _act_pp(ctx, out, a, scale=pb)
        if op == "add" and _out_is_float(out):
            return _act_pp(ctx, out, a, bias=pb)
        _ts(ctx, out, a, op, pb)
        return
    if pa is not None and pb is None:
        if op == "multiply" and _out_is_float(out):
            return _act_pp(ctx, out, b, scale=pa)
        if op == "add" and _out_is_float(out):
            return _act_pp(ctx, out, b, bias=pa)
        _ts(ctx, out, b, op, pa, rev0=not commutative)
        return
    _tt(ctx, out, a, b, op)


def _out_is_float(t) -> bool:
    return t.dtype in ("float32", "bfloat16", "float16")


def _act_pp(ctx, out, x, scale=1.0, bias=None):
    """``x * scale + bias`` with a per-partition scale or bias tile: ScalarE or VectorE, whichever is less loaded."""
    n = _free(out)
    load = ctx.__dict__.setdefault("engine_load", {"act": 0.0, "dve": 0.0})
    if load["act"] + _cost_ns(ctx, "act", max(64, n) + 60) < load["dve"] + _cost_ns(ctx, "dve", max(64, n) + 60):
        _act(ctx, out, x, "identity", scale=scale, bias=bias)
    elif bias is not None:
        _ts(ctx, out, x, "add", bias)
    else:
        _ts(ctx, out, x, "multiply", scale)


def _is_float(v: Any) -> bool:
    return isinstance(v, Var) and v.dtype in _FLOATS


def _out_float(eqn) -> bool:
    return eqn.outputs[0].dtype in _FLOATS


def _copy(ctx, out, x):
    """``out = x`` (a number: a fill). A float-to-float copy or cast goes to ScalarE when that engine would
    finish it first by the work given to each so far (the cast ending a LayerNorm row group, say, while VectorE
    computes the next rows); both engines round alike."""
    if not hasattr(x, "mem"):
        ctx.prog.memset(out, float(x))
        return
    n = _free(out)
    load = ctx.__dict__.setdefault("engine_load", {"act": 0.0, "dve": 0.0})
    if _out_is_float(out) and _out_is_float(x) and \
            load["act"] + _cost_ns(ctx, "act", max(64, n) + 60) < load["dve"] + _cost_ns(ctx, "dve", max(64, n) + 60):
        ctx.prog.tensor_copy(out, x, engine="scalar")
        _charge(ctx, "act", max(64, n) + 60)
        return
    ctx.prog.tensor_copy(out, x)
    _charge(ctx, "dve", max(64, n) + 60)


# --------------------------------------------------------------------------- unary

def _float_only(eqn):
    if not _out_float(eqn):
        raise CannotLower(f"{eqn.op.name} on {eqn.outputs[0].dtype} values is not lowered (floats only)")


@tile_rule(*ACT_FUNC_OF, precheck=_float_only)
def _act_unary(ctx, eqn, out, ins):
    _act(ctx, out, ins[0], ACT_FUNC_OF[eqn.op.name])


@tile_rule("neg")
def _neg(ctx, eqn, out, ins):
    _ts(ctx, out, ins[0], "multiply", -1.0)


@tile_rule("abs")
def _abs(ctx, eqn, out, ins):
    if _out_float(eqn):
        _act(ctx, out, ins[0], "abs")
    else:
        _ts(ctx, out, ins[0], "abs_max", 0.0)


@tile_rule("relu")
def _relu(ctx, eqn, out, ins):
    if _out_float(eqn):
        _act(ctx, out, ins[0], "relu")
    else:
        _ts(ctx, out, ins[0], "max", 0.0)


@tile_rule("gelu", precheck=_float_only)
def _gelu(ctx, eqn, out, ins):
    approx = eqn.attrs.get("approximate", "none")
    _act(ctx, out, ins[0], "gelu_tanh" if approx == "tanh" else "gelu")


@tile_rule("sign")
def _sign(ctx, eqn, out, ins):
    if eqn.outputs[0].dtype == torch.bool:
        _copy(ctx, out, ins[0])
    else:
        _act(ctx, out, ins[0], "sign")


@tile_rule("exp2", precheck=_float_only)
def _exp2(ctx, eqn, out, ins):
    _act(ctx, out, ins[0], "exp", scale=math.log(2.0))


@tile_rule("expm1", precheck=_float_only)
def _expm1(ctx, eqn, out, ins):
    with _Tmp(ctx, out) as tmp:
        t = tmp()
        _act(ctx, t, ins[0], "exp")
        _ts(ctx, out, t, "subtract", 1.0)


@tile_rule("log2", precheck=_float_only)
def _log2(ctx, eqn, out, ins):
    with _Tmp(ctx, out) as tmp:
        t = tmp()
        _act(ctx, t, ins[0], "log")
        _ts(ctx, out, t, "multiply", 1.0 / math.log(2.0))


@tile_rule("log1p", precheck=_float_only)
def _log1p(ctx, eqn, out, ins):
    _act(ctx, out, ins[0], "log", bias=1.0)


@tile_rule("reciprocal", precheck=_float_only)
def _reciprocal(ctx, eqn, out, ins):
    _ts(ctx, out, ins[0], "divide", 1.0, rev0=True)


@tile_rule("tan", precheck=_float_only)
def _tan(ctx, eqn, out, ins):
    with _Tmp(ctx, out) as tmp:
        s, c = tmp(), tmp()
        _act(ctx, s, ins[0], "sin")
        _act(ctx, c, ins[0], "cos")
        _tt(ctx, out, s, c, "divide")


@tile_rule("sinh", "cosh", precheck=_float_only)
def _sinh_cosh(ctx, eqn, out, ins):
    with _Tmp(ctx, out) as tmp:
        a, b = tmp(), tmp()
        _act(ctx, a, ins[0], "exp")
        _act(ctx, b, ins[0], "exp", scale=-1.0)
        _tt(ctx, a, a, b, "subtract" if eqn.op.name == "sinh" else "add")
        _ts(ctx, out, a, "multiply", 0.5)


@tile_rule("asinh", precheck=_float_only)
def _asinh(ctx, eqn, out, ins):
    x = ins[0]
    with _Tmp(ctx, out) as tmp:
        a, t, s = tmp(), tmp(), tmp()
        _act(ctx, a, x, "abs")
        _act(ctx, t, x, "square")
        _act(ctx, t, t, "sqrt", bias=1.0)            # sqrt(x^2 + 1)
        _tt(ctx, t, t, a, "add")
        _act(ctx, t, t, "log")
        _act(ctx, s, x, "sign")
        _tt(ctx, out, t, s, "multiply")


@tile_rule("acosh", precheck=_float_only)
def _acosh(ctx, eqn, out, ins):
    x = ins[0]
    with _Tmp(ctx, out) as tmp:
        t = tmp()
        _act(ctx, t, x, "square")
        _act(ctx, t, t, "sqrt", bias=-1.0)           # sqrt(x^2 - 1)
        _tt(ctx, t, t, x, "add")
        _act(ctx, out, t, "log")


@tile_rule("atanh", precheck=_float_only)
def _atanh(ctx, eqn, out, ins):
    x = ins[0]
    with _Tmp(ctx, out) as tmp:
        a, b = tmp(), tmp()
        _ts(ctx, a, x, "add", 1.0)                   # 1 + x
        _ts(ctx, b, x, "subtract", 1.0, rev0=True)   # 1 - x
        _tt(ctx, a, a, b, "divide")
        _act(ctx, a, a, "log")
        _ts(ctx, out, a, "multiply", 0.5)


def _atan_into(ctx, tmp, out, x):
    """``out = atan(x)`` (fp32 tiles): Cephes-style range reduction to |u| <= tan(pi/8), odd polynomial."""
    a, s, big, mid, u, t, y0 = tmp(), tmp(), tmp(), tmp(), tmp(), tmp(), tmp()
    _act(ctx, a, x, "abs")
    _act(ctx, s, x, "sign")
    _ts(ctx, big, a, "is_gt", 2.414213562373095)
    _ts(ctx, mid, a, "is_gt", 0.4142135623730950)
    # candidates: u_big = -1/a, u_mid = (a-1)/(a+1), u_small = a
    _ts(ctx, u, a, "divide", -1.0, rev0=True)
    _ts(ctx, t, a, "add", 1.0)
    _ts(ctx, y0, a, "subtract", 1.0)
    _tt(ctx, t, y0, t, "divide")
    ctx.prog.select(t, mid, t, a)
    ctx.prog.select(u, big, u, t)
    # y0 = pi/4 * (mid + big)  (mid is 1 whenever big is)
    _tt(ctx, y0, mid, big, "add")
    _ts(ctx, y0, y0, "multiply", math.pi / 4)
    # polynomial: u + u*z*(((c0 z + c1) z + c2) z + c3), z = u^2
    z = mid
    _tt(ctx, z, u, u, "multiply")
    _ts(ctx, t, z, "multiply", 8.05374449538e-2, "add", -1.38776856032e-1)
    _tt(ctx, t, t, z, "multiply")
    _ts(ctx, t, t, "add", 1.99777106478e-1)
    _tt(ctx, t, t, z, "multiply")
    _ts(ctx, t, t, "add", -3.33329491539e-1)
    _tt(ctx, t, t, z, "multiply")
    _tt(ctx, t, t, u, "multiply")
    _tt(ctx, t, t, u, "add")
    _tt(ctx, t, t, y0, "add")
    _tt(ctx, out, t, s, "multiply")


@tile_rule("atan", precheck=_float_only, temps=8)
def _atan(ctx, eqn, out, ins):
    with _Tmp(ctx, out) as tmp:
        _atan_into(ctx, tmp, out, ins[0])


@tile_rule("asin", "acos", precheck=_float_only, temps=10)
def _asin_acos(ctx, eqn, out, ins):
    x = ins[0]
    with _Tmp(ctx, out) as tmp:
        r, q = tmp(), tmp()
        _act(ctx, r, x, "square")
        _act(ctx, r, r, "sqrt", scale=-1.0, bias=1.0)  # sqrt(1 - x^2)
        _tt(ctx, q, x, r, "divide")
        if eqn.op.name == "asin":
            _atan_into(ctx, tmp, out, q)
        else:
            _atan_into(ctx, tmp, r, q)
            _ts(ctx, out, r, "multiply", -1.0, "add", math.pi / 2)


@tile_rule("atan2", precheck=_float_only, temps=12)
def _atan2(ctx, eqn, out, ins):
    y, x = ins
    with _Tmp(ctx, out) as tmp:
        if not hasattr(y, "mem"):
            y = tmp.const(float(y))
        if not hasattr(x, "mem"):
            x = tmp.const(float(x))
        q, r, c = tmp(), tmp(), tmp()
        _tt(ctx, q, y, x, "divide")
        _atan_into(ctx, tmp, r, q)
        # + pi where x < 0 and y >= 0, - pi where x < 0 and y < 0
        _ts(ctx, c, y, "is_ge", 0.0, "multiply", 2.0)
        _ts(ctx, c, c, "subtract", 1.0, "multiply", math.pi)
        _ts(ctx, q, x, "is_lt", 0.0)
        _tt(ctx, c, c, q, "multiply")
        _tt(ctx, out, r, c, "add")


def _int_identity(ctx, out, x):
    ctx.prog.tensor_copy(out, x)


@tile_rule("floor")
def _floor(ctx, eqn, out, ins):
    if not _out_float(eqn):
        return _int_identity(ctx, out, ins[0])
    with _Tmp(ctx, out) as tmp:
        f = tmp()
        _ts(ctx, f, ins[0], "mod", 1.0)
        _tt(ctx, out, ins[0], f, "subtract")


@tile_rule("ceil")
def _ceil(ctx, eqn, out, ins):
    if not _out_float(eqn):
        return _int_identity(ctx, out, ins[0])
    with _Tmp(ctx, out) as tmp:
        f = tmp()
        _ts(ctx, f, ins[0], "multiply", -1.0, "mod", 1.0)
        _tt(ctx, out, ins[0], f, "add")


@tile_rule("trunc")
def _trunc(ctx, eqn, out, ins):
    if not _out_float(eqn):
        return _int_identity(ctx, out, ins[0])
    with _Tmp(ctx, out) as tmp:
        a, f, s = tmp(), tmp(), tmp()
        _act(ctx, a, ins[0], "abs")
        _ts(ctx, f, a, "mod", 1.0)
        _tt(ctx, a, a, f, "subtract")
        _act(ctx, s, ins[0], "sign")
        _tt(ctx, out, a, s, "multiply")


_MAGIC = 12582912.0  # 1.5 * 2**23: x + M - M rounds fp32 x to the nearest integer, ties to even


@tile_rule("round")
def _round(ctx, eqn, out, ins):
    if not _out_float(eqn):
        return _int_identity(ctx, out, ins[0])
    if eqn.attrs.get("decimals", 0):
        raise CannotLower("round with decimals is not lowered")
    x = ins[0]
    with _Tmp(ctx, out) as tmp:
        r, small = tmp(), tmp()
        # two fp32 roundings are the point: keep it one VectorE instruction (not a folded affine)
        ctx.prog.tensor_scalar(r, x, "add", _MAGIC, "subtract", _MAGIC)
        _ts(ctx, small, x, "abs_max", 0.0, "is_lt", 4194304.0)
        ctx.prog.select(out, small, r, x)


@tile_rule("logical_not")
def _logical_not(ctx, eqn, out, ins):
    _ts(ctx, out, ins[0], "is_equal", 0.0)


def _bitwise_not_check(eqn):
    if eqn.inputs[0].dtype not in _INT_DTYPES:
        raise CannotLower(f"bitwise_not of {eqn.inputs[0].dtype} values is not lowered (integers and bool only)")


@tile_rule("bitwise_not", precheck=_bitwise_not_check)
def _bitwise_not(ctx, eqn, out, ins):
    if eqn.inputs[0].dtype == torch.bool:
        _ts(ctx, out, ins[0], "is_equal", 0.0)
    else:   # ~x = x ^ -1 (uint8 keeps the low 8 bits: 255 - x)
        ctx.prog.tensor_scalar(out, ins[0], "bitwise_xor", -1.0)
        _charge(ctx, "dve", max(64, _free(out)) + 60)


@tile_rule("isnan")
def _isnan(ctx, eqn, out, ins):
    _tt(ctx, out, ins[0], ins[0], "not_equal")


@tile_rule("isinf")
def _isinf(ctx, eqn, out, ins):
    _ts(ctx, out, ins[0], "abs_max", 0.0, "is_equal", math.inf)


# Giles, "Approximating the erfinv function" (GPU Computing Gems, 2011), single precision: with
# w = -log((1 - x)(1 + x)), erfinv(x) = x * p(w - 2.5) for w < 5 and x * q(sqrt(w) - 3) beyond.
_ERFINV_CENTRAL = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
                   -0.00125372503, -0.00417768164, 0.246640727, 1.50140941)
_ERFINV_TAIL = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
                -0.0076224613, 0.00943887047, 1.00167406, 2.83297682)


def _horner(ctx, p, w, coefs):
    """``p = ((c0 w + c1) w + c2) w + ...`` (fp32 tiles ``p``, ``w``; coefficients from the highest power)."""
    _ts(ctx, p, w, "multiply", coefs[0], "add", coefs[1])
    for c in coefs[2:]:
        _tt(ctx, p, p, w, "multiply")
        _ts(ctx, p, p, "add", c)


@tile_rule("erfinv", precheck=_float_only, temps=6)
def _erfinv(ctx, eqn, out, ins):
    x = ins[0]
    with _Tmp(ctx, out) as tmp:
        if not hasattr(x, "mem"):
            x = tmp.const(float(x))
        lg, b, w, p, q, m = tmp(), tmp(), tmp(), tmp(), tmp(), tmp()
        _ts(ctx, lg, x, "subtract", 1.0, rev0=True)        # 1 - x (exact for x >= 1/2)
        _ts(ctx, b, x, "add", 1.0)                         # 1 + x
        _tt(ctx, lg, lg, b, "multiply")
        _act(ctx, lg, lg, "log")                           # -w: -inf at |x| = 1, NaN beyond
        _ts(ctx, w, lg, "multiply", -1.0, "add", -2.5)     # w - 2.5
        _horner(ctx, p, w, _ERFINV_CENTRAL)
        _act(ctx, w, lg, "sqrt", scale=-1.0)               # sqrt(w)
        _ts(ctx, w, w, "subtract", 3.0)
        _horner(ctx, q, w, _ERFINV_TAIL)
        _ts(ctx, m, lg, "is_gt", -5.0)                     # w < 5 (false for NaN: the tail keeps it NaN)
        ctx.prog.select(p, m, p, q)
        _tt(ctx, p, p, x, "multiply")
        # |x| = 1: the tail polynomial at sqrt(inf) is not +inf; the result is x * inf
        _ts(ctx, m, x, "abs_max", 0.0, "is_equal", 1.0)
        ctx.prog.tensor_scalar(b, x, "multiply", math.inf)   # (not an affine activation: 0 * inf bias)
        _charge(ctx, "dve", max(64, _free(b)) + 60)
        ctx.prog.select(out, m, b, p)


# --------------------------------------------------------------------------- binary

_ALU_BINARY = {"add": ("add", True), "sub": ("subtract", False), "mul": ("multiply", True),
               "maximum": ("max", True), "minimum": ("min", True), "remainder": ("mod", False),
               "eq": ("is_equal", True), "ne": ("not_equal", True), "lt": ("is_lt", False),
               "le": ("is_le", False), "gt": ("is_gt", False), "ge": ("is_ge", False),
               "logical_and": ("logical_and", True), "logical_or": ("logical_or", True),
               "logical_xor": ("logical_xor", True)}


@tile_rule(*_ALU_BINARY)
def _alu_binary(ctx, eqn, out, ins):
    op, comm = _ALU_BINARY[eqn.op.name]
    a, b = ins
    if eqn.op.name == "sub" and eqn.outputs[0].dtype == torch.bool:
        raise CannotLower("sub on bool tensors is an error in torch")
    _binary(ctx, out, a, b, op, commutative=comm)


#: dtypes the integer ALU ops read (int64 values travel as range-checked int32 words, see tn.lower.fusion)
_INT_DTYPES = (torch.int32, torch.uint8, torch.bool, torch.int64)

_BITWISE = {"bitwise_and": "logical_and", "bitwise_or": "logical_or", "bitwise_xor": "logical_xor"}

#: op -> integer ALU op of VectorE (int32 words, not fp32)
_INT_ALU = {"bitwise_and": "bitwise_and", "bitwise_or": "bitwise_or", "bitwise_xor": "bitwise_xor",
            "bitwise_left_shift": "left_shift", "bitwise_right_shift": "arith_shift_right"}


def _bitwise_check(eqn):
    name, out = eqn.op.name, eqn.outputs[0].dtype
    if out == torch.bool and name in _BITWISE:
        return      # logical ops on 0/1 values
    if out not in _INT_DTYPES or out == torch.bool:
        raise CannotLower(f"{name} with a {out} result is not lowered (integer ALU ops: int32, uint8, int64)")
    for a in eqn.inputs:
        if isinstance(a, Var):
            if a.dtype not in _INT_DTYPES:
                raise CannotLower(f"{name} on {a.dtype} values is not lowered (integers and bool only)")
        elif isinstance(a.value, float) or not -2 ** 31 <= int(a.value) < 2 ** 31:
            raise CannotLower(f"{name} with the scalar {a.value!r}: integer ALU immediates are int32")
    if name == "bitwise_left_shift" and (out == torch.int64 or
                                         any(isinstance(a, Var) and a.dtype == torch.int64 for a in eqn.inputs)):
        raise CannotLower("bitwise_left_shift of int64 values is not lowered: the engines shift the int32 words "
                          "int64 values travel as, and a shift past bit 31 would be lost without failing their "
                          "range check")


def _int_binary(ctx, out, a, b, op, *, commutative=False):
    """``out = a op b`` with an integer ALU op; either side may be a Python int or a per-partition scalar tile."""
    sa, sb = not hasattr(a, "mem"), not hasattr(b, "mem")
    n = _free(out)
    if sa and sb:
        with _Tmp(ctx, out) as tmp:
            ctx.prog.tensor_scalar(out, tmp.const(float(int(a)), "int32"), op, float(int(b)))
    elif sb or (not sa and pp_scalar(b) is not None and pp_scalar(a) is None):
        ctx.prog.tensor_scalar(out, a, op, float(int(b)) if sb else pp_scalar(b))
    elif sa or (pp_scalar(a) is not None and pp_scalar(b) is None):
        ctx.prog.tensor_scalar(out, b, op, float(int(a)) if sa else pp_scalar(a), reverse0=not commutative)
    else:
        ctx.prog.tensor_tensor(out, a, b, op)
        _charge(ctx, "dve", max(64, 2 * n) + 60)
        return
    _charge(ctx, "dve", max(64, n) + 60)


@tile_rule(*_INT_ALU, precheck=_bitwise_check)
def _bitwise(ctx, eqn, out, ins):
    name = eqn.op.name
    if eqn.outputs[0].dtype == torch.bool:
        _binary(ctx, out, ins[0], ins[1], _BITWISE[name], commutative=True)
    else:
        _int_binary(ctx, out, ins[0], ins[1], _INT_ALU[name], commutative=name in _BITWISE)


@tile_rule("div", temps=4)
def _div(ctx, eqn, out, ins):
    mode = eqn.attrs.get("rounding_mode")
    a, b = ins
    if mode is None:
        _binary(ctx, out, a, b, "divide")
        return
    with _Tmp(ctx, out) as tmp:
        q, f = tmp(), tmp()
        _binary(ctx, q, a, b, "divide")
        if mode == "floor":
            _ts(ctx, f, q, "mod", 1.0)
            _tt(ctx, out, q, f, "subtract")
        else:  # trunc
            s = tmp()
            _act(ctx, s, q, "sign")
            _act(ctx, q, q, "abs")
            _ts(ctx, f, q, "mod", 1.0)
            _tt(ctx, q, q, f, "subtract")
            _tt(ctx, out, q, s, "multiply")


@tile_rule("pow")
def _pow(ctx, eqn, out, ins):
    a, b = ins
    if hasattr(a, "mem") and not hasattr(b, "mem"):
        e = float(b)
        if e == 2.0:
            _tt(ctx, out, a, a, "multiply")
            return
        if e == 1.0:
            ctx.prog.tensor_copy(out, a)
            return
        if e == 0.5 and _out_float(eqn):
            _act(ctx, out, a, "sqrt")
            return
        if e == -1.0 and _out_float(eqn):
            _ts(ctx, out, a, "divide", 1.0, rev0=True)
            return
    _binary(ctx, out, a, b, "pow")


@tile_rule("fmod", temps=5)
def _fmod(ctx, eqn, out, ins):
    a, b = ins
    with _Tmp(ctx, out) as tmp:
        if not hasattr(a, "mem"):
            a = tmp.const(float(a))
        aa, s = tmp(), tmp()
        _ts(ctx, aa, a, "abs_max", 0.0)
        _ts(ctx, s, a, "is_ge", 0.0, "multiply", 2.0)
        _ts(ctx, s, s, "subtract", 1.0)
        if hasattr(b, "mem"):
            bb = tmp()
            _ts(ctx, bb, b, "abs_max", 0.0)
            _tt(ctx, aa, aa, bb, "mod")
        else:
            _ts(ctx, aa, aa, "mod", abs(float(b)))
        _tt(ctx, out, aa, s, "multiply")


# --------------------------------------------------------------------------- where, convert

@tile_rule("where")
def _where(ctx, eqn, out, ins):
    c, x, y = ins
    with _Tmp(ctx, out) as tmp:
        if not hasattr(x, "mem"):
            x = tmp.const(float(x))
        if not hasattr(y, "mem"):
            y = tmp.const(float(y))
        if not hasattr(c, "mem"):
            _copy(ctx, out, x if c else y)
            return
        ctx.prog.select(out, c, x, y)


@tile_rule("convert")
def _convert(ctx, eqn, out, ins):
    _copy(ctx, out, ins[0])


#: Every elementwise op with a tile rule.
ELEMENTWISE_OPS = tuple(sorted(name for name, op in ops.OPS.items() if op.tile_rule is not None))


@lowering(*ELEMENTWISE_OPS)
def _lower_elementwise(ctx, eqn, ins, outs):
    """One elementwise equation through the tile engine (a map group of one)."""
    in_vars = [a for a in eqn.inputs if isinstance(a, Var)]
    in_hbm = [t for a, t in zip(eqn.inputs, ins) if isinstance(a, Var)]
    # the same Var used twice is loaded once
    seen: Dict[Var, Any] = {}
    for v, t in zip(in_vars, in_hbm):
        seen.setdefault(v, t)
    lower_map(ctx, [eqn], list(seen), list(seen.values()), list(eqn.outputs), outs, allow_int64=True)
