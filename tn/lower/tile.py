# The tile engine: elementwise equations (and trailing-axes row reductions) computed tile by tile in SBUF.
"""The tile engine behind every elementwise lowering and every fused map or row group.

**Iteration space.** A *group* is a list of equations over a common shape
``S``: elementwise ops (one, for a plain lowering) and, in a *row group*,
reductions over the trailing axes of ``S`` (softmax: amax, sub, exp, sum,
div; layer/RMS norm: sum, div, sub, mul, rsqrt ...). Every value gets element
strides in ``S`` (0 on broadcast axes; a keepdim=False reduction result is
strided over the leading axes only). Adjacent axes that are contiguous (or
broadcast) for every value are merged, as PyTorch's TensorIterator does,
giving ``(outer..., R, C)``: outer axes are looped in Python, ``R`` is spread
over the 128 partitions with ``k`` consecutive rows per partition folded into
the free axis, and ``C`` is tiled to the free-size budget (never, in a row
group: a row's reduced extent stays whole in SBUF). A tile is ``[p, k, f]``;
each input is DMA'd with its own access pattern (stride-0 axes are loaded once
and broadcast in SBUF by a stride-0 tile view), the equations' tile rules
(each op's :attr:`tn.ops.Op.tile_rule`) and ``tensor_reduce`` run on SBUF
tiles, and only values used after the group are DMA'd back. Tiles of two
consecutive iterations stay allocated (double buffering), so the DMA of tile
``i+1`` overlaps the compute of tile ``i``; and the two tiles' instructions
are emitted interleaved, equation by equation (:func:`_interleave`), so that
in-order engines work on both at once.

:func:`lower_map` emits one group; :func:`row_fits` is the SBUF byte count the
planner (:mod:`tn.lower.fusion`) checks before it proposes a row group. The
shape helpers (broadcasting into a group's space, alias reshapes) are shared
with the planners.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ..ir import Eqn, Literal, Var
from ..neuron import isa
from ..neuron.program import HbmView
from .base import NEURON_DTYPES, CannotLower, handoff_shape
from ..shapes import contiguous_strides, numel

__all__ = ["lower_map", "row_fits", "check_dtypes", "is_alias_reshape", "ACT_FUNC_OF", "SBUF_BUDGET", "MAX_FREE"]

#: Bytes per partition the tile engine may use for one group (both buffers).
SBUF_BUDGET = 160 * 1024
#: Largest free size (elements per partition) of one tile.
MAX_FREE = 8192
#: Groups big enough are cut into at least this many tiles (engines overlap across tiles).
PIPELINE_TILES = 8
#: ... but tiles keep at least this many elements per partition (DMA and instruction overheads).
MIN_FREE = 512
#: Elements per partition below which a small elementwise group uses fewer partitions (the instruction floor).
SMALL_FREE = 64
#: Tiles of this many consecutive iterations stay allocated (2 = double buffering).
NBUF = 2


def _squeezed(shape: Sequence[int]) -> Tuple[int, ...]:
    return tuple(int(d) for d in shape if d != 1)


def _strip(shape: Sequence[int], space: Sequence[int]) -> Tuple[int, ...]:
    """``shape`` without the leading size-1 axes it has beyond ``space``'s rank."""
    shape = tuple(shape)
    while len(shape) > len(space) and shape[0] == 1:
        shape = shape[1:]
    return shape


def _lstrip1(shape: Sequence[int]) -> Tuple[int, ...]:
    shape = tuple(int(d) for d in shape)
    while shape and shape[0] == 1:
        shape = shape[1:]
    return shape


def is_alias_reshape(e: Eqn) -> bool:
    """A reshape that only adds or removes *leading* size-1 axes: the same elements at the same places
    under right-aligned broadcasting, so inside a group it is the same tile (no data moves)."""
    if e.op.name != "reshape" or not isinstance(e.inputs[0], Var):
        return False
    x, y = e.inputs[0], e.outputs[0]
    return x.dtype == y.dtype and _lstrip1(x.shape) == _lstrip1(y.shape)


def _broadcastable(shape: Sequence[int], space: Sequence[int]) -> bool:
    shape = _strip(shape, space)
    if len(shape) > len(space):
        return False
    for n, m in zip(reversed(tuple(shape)), reversed(tuple(space))):
        if n != 1 and n != m:
            return False
    return True


def _space_strides(shape: Sequence[int], space: Sequence[int]) -> List[int]:
    """Element strides of a contiguous tensor of ``shape`` broadcast into ``space`` (0 on broadcast axes)."""
    shape = _strip(shape, space)
    pad = len(space) - len(shape)
    full = (1,) * pad + shape
    cs = list(contiguous_strides(full))
    return [0 if (n == 1 and m != 1) else s for n, m, s in zip(full, space, cs)]


def _row_strides(space: Sequence[int], r: int) -> List[int]:
    """Strides of a keepdim=False reduction result over the last ``r`` axes of ``space``."""
    lead = list(contiguous_strides(space[:len(space) - r]))
    return lead + [0] * r


def _collapse(space: Sequence[int], strides: List[List[int]]) -> Tuple[List[int], List[List[int]]]:
    """Drop size-1 axes and merge neighbours that are contiguous (or both broadcast) for every value."""
    keep = [i for i, n in enumerate(space) if n != 1]
    dims = [space[i] for i in keep]
    sts = [[s[i] for i in keep] for s in strides]
    i = len(dims) - 1
    while i > 0:
        if all(st[i - 1] == st[i] * dims[i] for st in sts):
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

    def __init__(self, dims: List[int], strides: List[List[int]], max_free: int, parts: int, whole_c: bool,
                 min_parts: int = 1):
        if not dims:
            dims = [1]
            strides = [[0] for _ in strides]
        # a small elementwise space (< SMALL_FREE elements per partition over all partitions) uses only as
        # many partitions as keep SMALL_FREE elements in each: every instruction costs the same (its issue
        # interval is the 64-cycle floor either way), DMAs move fewer, longer runs, and the host simulates
        # fewer partition rows; but at least ``min_parts`` (the rows of an input left in SBUF by the previous
        # lowering, which is read in place only with one row per partition)
        n = numel(dims)
        if not whole_c and n < parts * SMALL_FREE:
            parts = min(parts, max(1, -(-n // SMALL_FREE), min_parts))
        if len(dims) == 1:
            if whole_c:
                dims = [1, dims[0]]
                strides = [[0, s[0]] for s in strides]
            else:
                dims = [dims[0], 1]
                strides = [[s[0], 0] for s in strides]
        # few rows and long rows: the row axis becomes outer and the columns become (k-folded) rows
        if not whole_c and dims[-2] < parts and dims[-1] >= 2048:
            dims = dims + [1]
            strides = [s + [0] for s in strides]
        self.outer = dims[:-2]
        self.R, self.C = dims[-2], dims[-1]
        self.strides = strides
        if whole_c and self.C > max_free:
            raise CannotLower(f"a row of {self.C} elements does not fit the SBUF budget of the fused group")
        self.f = min(self.C, max_free)
        self.kmax = max(1, min(max_free // self.f, -(-self.R // parts)))
        # values broadcast along the columns of long rows (row statistics) become per-partition scalars
        # when each partition holds one row: a tensor_scalar/activation operand instead of a tensor_tensor
        if self.C >= 256 and any(s[-2] != 0 and s[-1] == 0 for s in strides):
            self.kmax = 1
        self.parts = parts

    def tiles(self):
        """Yield ``(offsets per value, number of outer axes, r0, p, k, c0, f)``."""
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


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def check_dtypes(eqn: Eqn, allow_int64: bool = False) -> None:
    """CannotLower unless every Var of ``eqn`` has an engine dtype.

    int64 only moves by DMA: with ``allow_int64`` the tile engine carries
    int64 values as their int32 low words, range-checked (see :func:`lower_map`).
    """
    for a in list(eqn.inputs) + list(eqn.outputs):
        if isinstance(a, Var):
            if a.dtype not in NEURON_DTYPES:
                raise CannotLower(f"{eqn.op.name}: dtype {a.dtype} has no NeuronCore equivalent")
            if a.dtype == torch.int64 and not allow_int64:
                raise CannotLower(f"{eqn.op.name}: int64 values cannot be computed on the NeuronCore engines "
                                  f"(int64 is DMA-only); use int32")


def _row_reduce_r(eqn: Eqn) -> Optional[int]:
    """``r`` if ``eqn`` is a reduction over the last ``r`` axes a row group can compute, else None."""
    if eqn.op.reduce_alu is None:
        return None
    x = eqn.inputs[0]
    if not isinstance(x, Var) or x.ndim == 0:
        return None
    dims = tuple(eqn.attrs.get("dims", ()))
    r = len(dims)
    if r == 0 or dims != tuple(range(x.ndim - r, x.ndim)):
        return None
    out = eqn.outputs[0]
    if out.dtype not in (torch.float32, torch.bfloat16, torch.float16) and eqn.op.name != "any":
        return None
    if x.dtype not in NEURON_DTYPES or x.dtype == torch.int64 or out.dtype == torch.int64:
        return None
    return r


#: Elementwise ops that are exactly one ScalarE activation function (the function's name): the tile engine fuses
#: them with a following row sum or folds an affine producer into them; their tile rule is that activation.
ACT_FUNC_OF = {"exp": "exp", "log": "log", "sqrt": "sqrt", "rsqrt": "rsqrt", "sin": "sin", "cos": "cos",
               "tanh": "tanh", "sigmoid": "sigmoid", "erf": "erf"}


class _Values:
    """How the values of a group live in SBUF (see :func:`_values`)."""

    def __init__(self, **kw: Any):
        self.__dict__.update(kw)

    def resolve(self, a: Var) -> Tuple[Var, float, float]:
        """``(root, scale, bias)``: ``a`` is ``root * scale + bias`` of the value actually computed."""
        a = self.alias.get(a, a)
        return self.lazy.get(a, (a, 1.0, 0.0))


def _values(eqns: List[Eqn], in_vars: List[Var], out_vars: List[Var]) -> _Values:
    """Tile aliases, folded affine values, narrowing casts, SBUF frees and bytes per element of a group.

    Shared by :func:`lower_map` (which emits the group) and :func:`plan`
    (which checks that a row group's rows fit before proposing it).
    """
    # Affine folding: x*c, x+c, x-c, c-x, x/c (fp32, one Var and one number) are not computed on their
    # own when every consumer in the group is another such op or a ScalarE function: the consumer runs
    # one activation func(x * scale + bias) from the root value (relu(x*1.5+0.25) is one instruction).
    out_set = set(out_vars)
    users_in: Dict[Var, List[int]] = {}
    for j, e in enumerate(eqns):
        for a in e.inputs:
            if isinstance(a, Var):
                users_in.setdefault(a, []).append(j)
    alias: Dict[Var, Var] = {}
    for e in eqns:
        if is_alias_reshape(e) or (_widening(e) and e.outputs[0] not in out_set):
            # a widening float cast is the same tile for the engines (they compute in fp32 anyway)
            x = e.inputs[0]
            alias[e.outputs[0]] = alias.get(x, x)
    # Only folds that round as eager does are made (see _fold_exact): the engine computes
    # round(round(root * scale) + bias) in fp32, so (c + 1) * 1.5 stays two steps while x * 3 + 1 is one.
    lazy: Dict[Var, Tuple[Var, float, float]] = {}
    folded: Dict[Var, Tuple[float, float, bool]] = {}     # lazy value -> (scale, bias, has an add step)
    for j, e in enumerate(eqns):
        step = _affine_step(e)
        v = e.outputs[0]
        if step is None or v in out_set or not users_in.get(v):
            continue
        u0 = alias.get(step[0], step[0])
        state = _fold_exact(folded.get(u0, (1.0, 0.0, False)), step[1:])
        if state is None:
            continue
        if all(_consumer_func(eqns[u]) is not None or
               (_affine_step(eqns[u]) is not None and _fold_exact(state, _affine_step(eqns[u])[1:]) is not None)
               for u in users_in[v]):
            root = lazy[u0][0] if u0 in lazy else u0
            lazy[v] = (root, state[0], state[1])
            folded[v] = state

    # a narrowing cast of an fp32 value used by nothing else: the producer writes the cast's dtype (the
    # engine rounds its fp32 result once, as torch rounds the fp32 value), into the stored buffer if stored
    narrow: Dict[Var, Var] = {}
    for j, e in enumerate(eqns):
        if e.op.name != "convert" or not isinstance(e.inputs[0], Var):
            continue
        x, y = e.inputs[0], e.outputs[0]
        if x.dtype == torch.float32 and y.dtype in (torch.bfloat16, torch.float16) and \
                x not in out_set and x not in lazy and x not in alias and x not in in_vars and \
                users_in.get(x) == [j] and any(x in ee.outputs and ee.op.name != "convert" for ee in eqns[:j]):
            narrow[x] = y
            alias[y] = x
    for v in list(alias):           # aliases of aliases: straight to the value computed
        root = alias[v]
        while root in alias:
            root = alias[root]
        alias[v] = root
    narrow_stored = {x for x, y in narrow.items() if y in out_set}

    vals = _Values(out_set=out_set, users_in=users_in, alias=alias, lazy=lazy, narrow=narrow,
                   narrow_stored=narrow_stored)
    resolve = vals.resolve

    # SBUF liveness: inputs and stored outputs live for NBUF iterations (double buffering); pure
    # intermediates are freed right after their last use inside the iteration.
    last_use: Dict[Var, int] = {}
    for j, e in enumerate(eqns):
        for a in e.inputs:
            if isinstance(a, Var):
                last_use[resolve(a)[0]] = j
    frees_after: Dict[int, List[Var]] = {}
    live_b = peak_b = 0
    for j, e in enumerate(eqns):
        for v in e.outputs:
            if v not in out_set and v not in lazy and v not in alias and v not in narrow_stored:
                live_b += _itemsize(v.dtype)
        peak_b = max(peak_b, live_b)
        for v in e.outputs:
            if v not in out_set and v not in lazy and v not in alias and v not in narrow_stored and \
                    last_use.get(v, j) <= j:
                frees_after.setdefault(j, []).append(v)
                live_b -= _itemsize(v.dtype)
        for a in dict.fromkeys(resolve(a)[0] for a in e.inputs if isinstance(a, Var)):
            if a not in out_set and a not in in_vars and last_use.get(a) == j and a not in e.outputs and \
                    a not in narrow_stored:
                frees_after.setdefault(j, []).append(a)
                live_b -= _itemsize(a.dtype)
    temps = max([getattr(e.op.tile_rule, "temps", 3) for e in eqns] or [3])
    fixed_b = sum(_itemsize(v.dtype) for v in in_vars) + sum(_itemsize(v.dtype) for v in out_vars)
    per_elem = NBUF * fixed_b + peak_b + 4 * temps
    vals.frees_after = frees_after
    vals.per_elem = per_elem
    vals.peak_b, vals.temps = peak_b, temps
    return vals


def _max_free(per_elem: int, n_eqns: int, in_vars: List[Var], out_vars: List[Var], space: Sequence[int],
              parts: int, row: int) -> int:
    """Largest free size of a tile of a group with ``per_elem`` SBUF bytes per element.

    ``row`` is the length of the rows a row group keeps whole (0 for a map
    group); a row group whose row exceeds the result cannot be emitted.
    """
    max_free = max(64, min(MAX_FREE, SBUF_BUDGET // per_elem))
    # software pipelining: with several engines in the chain, aim at >= PIPELINE_TILES tiles (the
    # engines then work on different tiles at once), but keep >= MIN_FREE elements per partition
    per_part = -(-numel(space) // parts)
    # >= 2 KiB per partition per DMA (MIN_FREE fp32 elements; more for narrower dtypes)
    min_free = max(MIN_FREE, 4 * MIN_FREE // min([_itemsize(v.dtype) for v in in_vars + out_vars] or [4]))
    if n_eqns > 1 or per_part > 4 * min_free:
        max_free = max(min(max_free, min_free), min(max_free, per_part // PIPELINE_TILES))
    max_free = 1 << (max_free.bit_length() - 1)
    if row and row > max_free:
        max_free = min(MAX_FREE * 8, SBUF_BUDGET // per_elem)
    return max_free


def row_fits(eqns: List[Eqn], in_vars: List[Var], out_vars: List[Var], space: Sequence[int], r: int,
              parts: int) -> bool:
    """Whether the rows of row group ``eqns`` (reducing the last ``r`` axes of ``space``) fit its SBUF budget."""
    row = numel(space[len(space) - r:])
    if row <= 64:
        return True
    # quick accept: bytes per element with every value of the group live at once bound lower_map's count
    temps = max([getattr(e.op.tile_rule, "temps", 3) for e in eqns] or [3])
    upper = NBUF * sum(_itemsize(v.dtype) for v in list(in_vars) + list(out_vars)) + \
        sum(_itemsize(v.dtype) for e in eqns for v in e.outputs) + 4 * temps
    if row <= min(MAX_FREE * 8, SBUF_BUDGET // upper):
        return True
    vals = _values(eqns, in_vars, out_vars)
    return row <= _max_free(vals.per_elem, len(eqns), in_vars, out_vars, space, parts, row)


def lower_map(ctx: Any, eqns: List[Eqn], in_vars: List[Var], in_hbm: List[Any], out_vars: List[Var],
              out_hbm: List[Any], *, space: Optional[Tuple[int, ...]] = None, r: int = 0,
              rowvars: Optional[Set[Var]] = None, allow_int64: bool = False) -> None:
    """Lower ``eqns`` (elementwise, plus trailing-axes reductions when ``r > 0``) tile by tile.

    With ``allow_int64`` an int64 input is loaded as its int32 low words
    (strided DMA of the word pairs) and checked: its high word must be the
    sign extension and ``|value| < 2**24`` (exact in the engines' fp32), an
    int64 output is stored as (value, sign) word pairs and checked likewise;
    a failed check sets the program's range flag (:meth:`LowerCtx.range_check`).
    """
    rowvars = rowvars or set()
    for e in eqns:
        if e.op.reduce_alu is not None and r:
            if _row_reduce_r(e) != r:
                raise CannotLower(f"{e.op.name}: not a reduction over the last {r} axes")
            continue
        if is_alias_reshape(e):
            continue
        if e.op.tile_rule is None:
            raise CannotLower(f"{e.op.name}: no elementwise tile rule")
        check_dtypes(e, allow_int64)
        pre = getattr(e.op.tile_rule, "precheck", None)
        if pre is not None:
            pre(e)
    prog = ctx.prog
    all_vars: List[Var] = list(dict.fromkeys(list(in_vars) + [v for e in eqns for v in e.outputs]))
    if space is None:
        shapes = [v.shape for v in all_vars]
        space = tuple(torch.broadcast_shapes(*shapes)) if shapes else ()
    space = tuple(space)

    def strides_of(v: Var) -> List[int]:
        if v in rowvars:
            return _row_strides(space, r)
        if not _broadcastable(v.shape, space):
            raise CannotLower(f"value {v.aval} does not broadcast to the group's shape {space}")
        return _space_strides(v.shape, space)

    for v in out_vars:
        st = strides_of(v)
        lead = st[:len(space) - r] if r else st
        if any(s == 0 and n != 1 for s, n in zip(lead, space)):
            raise CannotLower(f"group output {v.aval} is broadcast inside the group's shape {space}")
    index = {v: i for i, v in enumerate(all_vars)}
    dims, sts = _collapse(space, [strides_of(v) for v in all_vars])
    if r:
        c_red = 1
        for n in space[len(space) - r:]:
            c_red *= n
        if c_red != 1 and (not dims or dims[-1] != c_red):
            raise CannotLower(f"the reduced axes {space[len(space) - r:]} do not form one contiguous row")
    vals = _values(eqns, in_vars, out_vars)
    out_set, alias, lazy, narrow = vals.out_set, vals.alias, vals.lazy, vals.narrow
    narrow_stored, frees_after, resolve = vals.narrow_stored, vals.frees_after, vals.resolve
    # an activation whose only consumer... or first consumer is the next equation's row sum: one ScalarE
    # instruction with a fused reduce (exp + sum in softmax, x*x + sum in norms)
    act_red: Dict[int, Tuple[str, Var]] = {}
    if r:
        for j in range(len(eqns) - 1):
            e, nx = eqns[j], eqns[j + 1]
            if nx.op.name != "sum" or nx.inputs[0] is not e.outputs[0] or nx.outputs[0].dtype != torch.float32:
                continue
            if e.outputs[0].dtype != torch.float32:
                continue
            xs = [a for a in e.inputs if isinstance(a, Var)]
            if e.op.name == "mul" and len(e.inputs) == 2 and e.inputs[0] is e.inputs[1] and \
                    isinstance(e.inputs[0], Var):
                act_red[j] = ("square", e.inputs[0])
            elif e.op.name in ACT_FUNC_OF and len(xs) == 1 and len(e.inputs) == 1:
                act_red[j] = (ACT_FUNC_OF[e.op.name], xs[0])
    max_free = _max_free(vals.per_elem, len(eqns), in_vars, out_vars, space, ctx.arch.partitions,
                         dims[-1] if (r and dims) else 0)
    resident = ctx.resident
    min_parts = max([resident[v].shape[0] for v in in_vars if v in resident] or [1])
    lay = _Layout(dims, sts, max_free, ctx.arch.partitions, whole_c=bool(r), min_parts=min_parts)
    in_index = [index[v] for v in in_vars]
    out_pos = {v: j for j, v in enumerate(out_vars)}
    red_ops = {e.op.name for e in eqns if r and e.op.reduce_alu is not None}
    nout_ = len(lay.outer)
    hoist = set()
    if lay.C <= lay.f and lay.R > lay.parts * lay.kmax:
        for i in in_index:
            st = lay.strides[i]
            if st[nout_] == 0 and all(s == 0 for s in st[:nout_]) and in_vars[in_index.index(i)].dtype != torch.int64:
                hoist.add(i)
    hoisted: Dict[Tuple[int, int, int], Any] = {}
    stages: List[Any] = []
    # inputs and stored outputs get NBUF ring buffers allocated once (never recycled by the
    # intermediates freed inside an iteration), so the DMA of the next tile overlaps this tile's compute
    rings: Dict[Var, List[Any]] = {}
    pmax = min(lay.parts, lay.R)

    def ring(v: Var, i: int, shp: Tuple[int, int, int], it: int) -> Any:
        bufs = rings.get(v)
        if bufs is None:
            st = lay.strides[i]
            full = (pmax, lay.kmax if st[nout_] != 0 else 1, lay.f if st[nout_ + 1] != 0 else 1)
            bufs = rings[v] = [prog.sbuf(full, _tdt(v)) for _ in range(NBUF)]
        b = bufs[it % NBUF]
        return b if tuple(b.shape) == tuple(shp) else b[:shp[0], :shp[1], :shp[2]]

    # SBUF hand-off (LowerCtx.publish/take): with one tile holding whole values as [rows, cols], an input left
    # in SBUF by the previous lowering is read in place and an output the next lowerings read is kept there
    tile_list = list(lay.tiles())

    def whole(v: Var) -> bool:
        if len(tile_list) != 1 or v.dtype == torch.int64 or v in rowvars:
            return False
        offs_, nout_t, r0_, p_, k_, c0_, f_ = tile_list[0]
        st_ = lay.strides[index[v]]
        return k_ == 1 and st_[nout_t + 1] == 1 and (p_ == 1 or st_[nout_t] == f_) and offs_[index[v]] == 0 and \
            r0_ == 0 and c0_ == 0 and v.numel == p_ * f_ and handoff_shape(v) == (p_, f_)

    publish = {v for v in out_vars if ctx.wants(v) and whole(v)}
    # a published alias (reshape, cast) of a value computed here: that value is computed into the buffer
    pub_root: Dict[Var, Var] = {}
    for v in list(publish):
        root = alias.get(v, v)
        if root is v:
            continue
        if root in in_vars or root in lazy or root in pub_root:
            publish.discard(v)
        else:
            pub_root[root] = v
    published: Dict[Var, int] = {}
    engines = _Pool(ctx)

    def steps(it: int, offs: list, nout: int, r0: int, p: int, k: int, c0: int, f: int):
        # one tile's instructions, yielding after its loads and after each equation (see _interleave)
        allocated = []
        env: Dict[Var, Any] = {}

        def tshape(i: int) -> Tuple[int, int, int]:
            st = lay.strides[i]
            return (p, k if st[nout] != 0 else 1, f if st[nout + 1] != 0 else 1)

        for v, i, t_hbm in zip(in_vars, in_index, in_hbm):
            st = lay.strides[i]
            sr, sc = st[nout], st[nout + 1]
            shp = tshape(i)
            res = ctx.resident.get(v)
            if res is not None and whole(v) and tuple(res.shape) == (p, f):
                env[v] = ctx.take(v).reshape(p, 1, f)       # left in SBUF by the previous lowering
                continue
            if i in hoist:
                # the same rows for every tile: loaded once into all partitions, sliced per tile
                t = hoisted.get((i, c0, f))
                if t is None:
                    hp = min(lay.parts, lay.R)
                    t = prog.sbuf((hp, 1, shp[2]), _tdt(v))
                    _bcast_load(prog, t, HbmView(t_hbm, offs[i] + c0 * sc, [(1, 0), (1, 0), (shp[2], sc)]), stages)
                    hoisted[(i, c0, f)] = t
                env[v] = t[:p]
                continue
            dims3 = [(p, sr * k), (shp[1], sr), (shp[2], sc)]
            t = ring(v, i, shp, it)
            if v.dtype == torch.int64:
                _load_i64(ctx, t, t_hbm, offs[i] + r0 * sr + c0 * sc, dims3)
            elif sr == 0 and p > 1 and p * numel(shp[1:]) * _itemsize(v.dtype) >= _BCAST_MIN_BYTES:
                # the same elements for every partition (a LayerNorm weight): one row, broadcast on chip
                _bcast_load(prog, t, HbmView(t_hbm, offs[i] + c0 * sc, [(1, 0)] + dims3[1:]), stages)
            else:
                prog.dma_copy(t, HbmView(t_hbm, offs[i] + r0 * sr + c0 * sc, dims3))
            env[v] = t
        yield
        done = -1
        for j, e in enumerate(eqns):
            if e.outputs[0] in lazy:
                continue        # folded into its consumers
            oshape = tshape(index[e.outputs[0]])
            outs = []
            if e.outputs[0] in alias:
                # a reshape that only adds/removes size-1 axes: the same tile
                src = env[alias[e.outputs[0]]]
                env[e.outputs[0]] = src.broadcast_to(oshape) if src.shape != oshape else src
            elif j != done:
                for v in e.outputs:
                    if v in pub_root:
                        t = ring(pub_root[v], index[pub_root[v]], oshape, it)
                    elif v in narrow_stored:
                        t = ring(narrow[v], index[narrow[v]], oshape, it)
                    elif v in narrow:
                        t = prog.sbuf(oshape, _tdt(narrow[v]))
                    else:
                        t = ring(v, index[v], oshape, it) if v in out_set else prog.sbuf(oshape, _tdt(v))
                    env[v] = t
                    outs.append(t)
            if j == done or e.outputs[0] in alias:
                pass  # computed by the previous equation's activation (fused reduce), or an alias
            elif j in act_red and k == 1 and env[act_red[j][1]].shape == oshape:
                # ScalarE computes the function and its row sum in one instruction
                func, x = act_red[j]
                x, sa, sb = resolve(x)
                nxt = eqns[j + 1].outputs[0]
                rshape = tshape(index[nxt])
                rt = ring(nxt, index[nxt], rshape, it) if nxt in out_set else prog.sbuf(rshape, _tdt(nxt))
                env[nxt] = rt
                prog.activation(outs[0], env[x], func, scale=sa, bias=sb, reduce_op="add", reduce_out=rt)
                done = j + 1
            elif any(isinstance(a, Var) and a in lazy for a in e.inputs) or \
                    (_affine_of(e) is not None and _affine_of(e)[0] in lazy):
                # consumer of a folded affine value: one activation from the root
                aff = _affine_of(e)
                if aff is not None:
                    u0, a0, b0 = aff
                    root, A, B = resolve(u0)
                    func, sa, sb = "identity", a0 * A, a0 * B + b0
                else:
                    u = next(a for a in e.inputs if isinstance(a, Var))
                    root, sa, sb = resolve(u)
                    func = _consumer_func(e)
                src = env[root]
                prog.activation(outs[0], src.broadcast_to(oshape) if src.shape != oshape else src, func,
                                scale=sa, bias=sb)
            elif r and e.op.name in red_ops:
                src = env[e.inputs[0]]
                if src.shape != (p, k, f):
                    src = src.broadcast_to((p, k, f))
                prog.tensor_reduce(outs[0], src, e.op.reduce_alu, axis=-1)
                engines.note_reduce(k * f)
            else:
                args = []
                for a in e.inputs:
                    if isinstance(a, Literal):
                        args.append(a.value)
                    else:
                        t = env[a]
                        args.append(t.broadcast_to(oshape) if t.shape != oshape else t)
                engines.run(e, outs[0] if len(outs) == 1 else outs, args)
            for v in e.outputs:
                if v in out_set:
                    i = index[v]
                    st = lay.strides[i]
                    sr, sc = st[nout], st[nout + 1]
                    shp = tshape(i)
                    dims3 = [(p, sr * k), (shp[1], sr), (shp[2], sc)]
                    if v in publish:
                        published[v] = it % NBUF        # stays in SBUF for the next lowerings
                    elif v.dtype == torch.int64:
                        _store_i64(ctx, out_hbm[out_pos[v]], offs[i] + r0 * sr + c0 * sc, dims3, env[v])
                    else:
                        prog.dma_copy(HbmView(out_hbm[out_pos[v]], offs[i] + r0 * sr + c0 * sc, dims3), env[v])
            for v in frees_after.get(j, ()):
                if v in pub_root:
                    continue        # computed into the published buffer
                prog.free(env.pop(v))
            yield
        for t in allocated:
            prog.free(t)

    width = _interleave(vals, f_max=lay.kmax * lay.f, n_eqns=len(eqns), n_tiles=len(tile_list))
    for w in range(0, len(tile_list), width):
        gens = [steps(it, *tile_list[it]) for it in range(w, min(w + width, len(tile_list)))]
        while gens:
            gens = [g for g in gens if next(g, _END) is not _END]
    for v, bufs in rings.items():
        for b, t in enumerate(bufs):
            if published.get(v) == b:
                _, _, _, p_, _, _, f_ = tile_list[0]
                ctx.publish(v, t[:p_].reshape(p_, f_))
            else:
                prog.free(t)
    for t in hoisted.values():
        prog.free(t)
    for t in reversed(stages):
        prog.free(t)


#: Tiles whose instructions are emitted interleaved, equation by equation (software pipelining; 1 = off).
INTERLEAVE = 2

#: A float tile rule (VectorE's by default) runs on GpSimd when GpSimd would finish it first by the work the group
#: gave each engine so far (:class:`_Pool`; False: always VectorE).
BALANCE_POOL = True


class _OnPool:
    """``ctx.prog`` as a tile rule sees it when its instructions go to GpSimd: ``tensor_tensor``,
    ``tensor_scalar`` and ``tensor_copy`` without an engine run there (both engines compute them alike, in fp32);
    everything else is the program's."""

    def __init__(self, prog: Any):
        self._prog = prog

    def tensor_tensor(self, *args: Any, **kw: Any) -> int:
        """The program's ``tensor_tensor`` on GpSimd."""
        kw.setdefault("engine", "gpsimd")
        return self._prog.tensor_tensor(*args, **kw)

    def tensor_scalar(self, *args: Any, **kw: Any) -> int:
        """The program's ``tensor_scalar`` on GpSimd."""
        kw.setdefault("engine", "gpsimd")
        return self._prog.tensor_scalar(*args, **kw)

    def tensor_copy(self, *args: Any, **kw: Any) -> int:
        """The program's ``tensor_copy`` on GpSimd."""
        kw.setdefault("engine", "gpsimd")
        return self._prog.tensor_copy(*args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._prog, name)


class _Pool:
    """Places a map group's float tile rules on VectorE or GpSimd, whichever would finish first by the work each
    was given (ns: the rules' own VectorE charges, ``ctx.engine_load["dve"]``, and the group's row reductions, by
    the ``max(64, N)`` rule of :func:`tn.neuron.isa.cost_cycles` plus the access start). GpSimd has no PSUM port:
    a rule reading or writing PSUM, a ``where`` (a VectorE select) or one with a non-float operand stays on
    VectorE. A LayerNorm row group is VectorE-bound (its residual add, gamma and beta are fp32 tensor_tensors
    at 2N cycles each) while GpSimd idles; the real compiler spreads elementwise work over both."""

    def __init__(self, ctx: Any):
        self.ctx = ctx
        self.load = {"dve": 0.0, "pool": 0.0}

    def _ns(self, engine: str, cycles: float) -> float:
        return (max(64.0, cycles) + self.ctx.arch.access_cycles) / self.ctx.arch.clock_hz[engine] * 1e9

    def note_reduce(self, n: int) -> None:
        """A row reduction of ``n`` elements per partition emitted on VectorE."""
        self.load["dve"] += self._ns("dve", n)

    def run(self, e: Eqn, out: Any, args: List[Any]) -> None:
        """Emit ``e``'s tile rule on the engine that would finish it first."""
        ctx = self.ctx
        tiles = [t for t in ([out] if not isinstance(out, (list, tuple)) else list(out)) + list(args)
                 if hasattr(t, "mem")]
        n = 1
        for x in (tiles[0].shape[1:] if tiles else ()):
            n *= int(x)
        floats = all(v.dtype.is_floating_point for v in list(e.outputs) + [a for a in e.inputs if isinstance(a, Var)])
        two = sum(isinstance(a, Var) for a in e.inputs) >= 2
        pool = BALANCE_POOL and floats and e.op.name != "where" and all(t.mem == isa.MEM_SBUF for t in tiles) and \
            self.load["pool"] + self._ns("pool", 2 * n if two else n) < self.load["dve"] + self._ns("dve", 2 * n if two else n)
        load = ctx.__dict__.setdefault("engine_load", {"act": 0.0, "dve": 0.0})
        before = load["dve"]
        prog = ctx.prog
        if pool:
            ctx.prog = _OnPool(prog)
        try:
            e.op.tile_rule(ctx, e, out, args)
        finally:
            ctx.prog = prog
        spent = load["dve"] - before
        if pool:
            # the rule charged its instructions to VectorE; they ran on GpSimd
            load["dve"] = before
            self.load["pool"] += spent * ctx.arch.clock_hz["dve"] / ctx.arch.clock_hz["pool"]
        else:
            self.load["dve"] += spent
_END = object()


def _interleave(vals: _Values, f_max: int, n_eqns: int, n_tiles: int) -> int:
    """How many consecutive tiles :func:`lower_map` emits interleaved, equation by equation.

    Every engine runs its instructions in program order. Emitted one tile
    after another, a group whose equations alternate between ScalarE and
    VectorE (a norm: reduce, scale, square-sum, rsqrt, scale ...) leaves each
    engine idle while the other works on the same tile: the next tile's first
    instruction is queued behind this tile's last one. Emitting equation ``j``
    of tiles ``i`` and ``i+1`` together lets one engine work on one tile while
    the other works on the other, as a software-pipelined kernel does. The
    cost is a second set of intermediates live at once, so tiles are
    interleaved only when that still fits the group's SBUF budget (the tile
    size was chosen for one set); ``f_max`` is the elements per partition of
    the group's largest tile.
    """
    if INTERLEAVE <= 1 or n_tiles < 2 or n_eqns < 2:
        return 1
    per_tile = vals.peak_b + 4 * vals.temps         # a tile's intermediates and its rules' temporaries
    fixed = vals.per_elem - per_tile                 # the NBUF ring buffers of inputs and stored outputs
    if f_max * (fixed + INTERLEAVE * per_tile) > SBUF_BUDGET:
        return 1
    return min(INTERLEAVE, NBUF)      # each tile in flight has its own ring buffers


#: A partition-broadcast load moving at least this many bytes is one row + a GpSimd broadcast instead.
_BCAST_MIN_BYTES = 16 * 1024


def _bcast_load(prog: Any, t: Any, row: Any, keep: Optional[list] = None) -> None:
    """``t[p] = row`` for every partition of tile ``t``: a one-partition DMA and a GpSimd ``partition_shuffle``
    (a DMA broadcasting ``row`` would move it once per partition). The staging tile goes to ``keep`` (freed
    by the caller later: freed now, the next allocation would reuse it and wait for the shuffle)."""
    p = t.shape[0]
    if p == 1:
        prog.dma_copy(t, row)
        return
    stage = prog.sbuf(t.shape, t.dtype)
    prog.dma_copy(stage[0:1], row)
    prog.partition_shuffle(t, stage, [0] * p)
    if keep is None:
        prog.free(stage)
    else:
        keep.append(stage)


def _widening(e: Eqn) -> bool:
    """A cast of a bf16/fp16 value to fp32 (exact: the same value for every engine consumer)."""
    return e.op.name == "convert" and isinstance(e.inputs[0], Var) and \
        e.inputs[0].dtype in (torch.bfloat16, torch.float16) and e.outputs[0].dtype == torch.float32


def _affine_of(e: Eqn) -> Optional[Tuple[Var, float, float]]:
    """``(x, a, b)`` when ``e`` computes ``a*x + b`` in fp32 from one Var ``x`` (and a number), else None."""
    step = _affine_step(e)
    return None if step is None else step[:3]


def _power_of_two(c: float) -> bool:
    """``c`` is +-2**k inside fp32's normal range (scaling by it is exact in fp32)."""
    if c == 0.0 or not math.isfinite(c):
        return False
    m, ex = math.frexp(abs(c))
    return m == 0.5 and -125 <= ex <= 128


def _fold_exact(state: Tuple[float, float, bool], step: Tuple[float, float, bool]
                ) -> Optional[Tuple[float, float, bool]]:
    """``state`` (value = round(round(root*A) + B), B's add present or not) followed by the affine ``step``
    ``(a, b, adds)`` as one new state, or None when the engine's one activation would round differently
    from eager's steps (an add after an add; a multiply by a non power of two after an add or after a
    non power-of-two multiply). Powers of two scale exactly (fp32 normal range; subnormals aside)."""
    A, B, added = state
    a, b, adds = step
    if not adds:                                   # x * a (mul, neg, div by a power of two)
        if _power_of_two(a) or (not added and (A == 1.0 or _power_of_two(A))):
            return A * a, B * a + 0.0, added           # + 0.0: no -0.0 bias
        return None
    if added:
        return None
    return A * a, b, True                          # x + b, or b - x (a == -1: negation is exact)


def _affine_step(e: Eqn) -> Optional[Tuple[Var, float, float, bool]]:
    """``(x, a, b, adds)`` when ``e`` computes ``a*x + b`` in fp32 from one Var ``x`` (and a number) with
    eager's rounding: one multiply (``adds`` False) or one add/subtract (``adds`` True); else None.
    ``x / c`` is a step only for a power-of-two ``c`` (eager divides; ``x * (1/c)`` rounds differently)."""
    name = e.op.name
    if name == "neg" and isinstance(e.inputs[0], Var) and e.inputs[0].dtype == torch.float32 and \
            e.outputs[0].dtype == torch.float32:
        return e.inputs[0], -1.0, 0.0, False
    if name not in ("mul", "add", "sub", "div") or len(e.inputs) != 2 or e.attrs.get("rounding_mode"):
        return None
    if e.outputs[0].dtype != torch.float32:
        return None
    x, y = e.inputs
    if isinstance(x, Var) and isinstance(y, Literal):
        u, c, left = x, y.value, False
    elif isinstance(x, Literal) and isinstance(y, Var):
        u, c, left = y, x.value, True
    else:
        return None
    if isinstance(c, bool) or not isinstance(c, (int, float)) or u.dtype != torch.float32:
        return None
    c = float(c)
    if name == "mul":
        return u, c, 0.0, False
    if name == "add":
        return u, 1.0, c, True
    if name == "sub":
        return (u, -1.0, c, True) if left else (u, 1.0, -c, True)
    if left or not _power_of_two(c):
        return None
    return u, 1.0 / c, 0.0, False


def _consumer_func(e: Eqn) -> Optional[str]:
    """The ScalarE function computing ``e`` from its single fp32 Var input, or None."""
    vins = [a for a in e.inputs if isinstance(a, Var)]
    if len(vins) != 1 or len(e.inputs) != 1 or e.outputs[0].dtype != torch.float32:
        return None
    name = e.op.name
    if name in ACT_FUNC_OF:
        return ACT_FUNC_OF[name]
    if name in ("relu", "abs", "sign"):
        return name
    if name == "gelu":
        return "gelu_tanh" if e.attrs.get("approximate", "none") == "tanh" else "gelu"
    return None


def _tdt(v: Var) -> str:
    """SBUF tile dtype of a value (int64 values are carried as int32)."""
    return "int32" if v.dtype == torch.int64 else NEURON_DTYPES[v.dtype]


_EXACT = float(1 << 24)


def _word_view(t_hbm: Any, off: int, dims: list, word: int) -> Any:
    """The int32 low (word 0) or high (word 1) words of an int64 HBM region (offset/dims in int64 elements)."""
    v = HbmView(t_hbm, 2 * off + word, [(n, 2 * s) for n, s in dims])
    v._dt = isa.dtype_code("int32")  # reinterpret the int64 words (the engine bounds-checks bytes)
    return v


def _load_i64(ctx: Any, t: Any, t_hbm: Any, off: int, dims: list) -> None:
    """Load int64 values into the int32 tile ``t`` (low words) and range-check them."""
    prog = ctx.prog
    prog.dma_copy(t, _word_view(t_hbm, off, dims, 0))
    hi = prog.sbuf(t.shape, "int32")
    prog.dma_copy(hi, _word_view(t_hbm, off, dims, 1))
    sign = prog.sbuf(t.shape, "float32")
    prog.tensor_scalar(sign, t, "is_lt", 0.0, "multiply", -1.0)     # expected high word
    prog.tensor_tensor(sign, hi, sign, "not_equal")
    big = prog.sbuf(t.shape, "float32")
    prog.tensor_scalar(big, t, "abs_max", 0.0, "is_ge", _EXACT)
    prog.tensor_tensor(sign, sign, big, "max")
    ctx.range_check(sign)
    for x in (big, sign, hi):
        prog.free(x)


def _store_i64(ctx: Any, t_hbm: Any, off: int, dims: list, t: Any) -> None:
    """Store the int32 tile ``t`` as int64 (value, sign) word pairs, range-checking the values."""
    prog = ctx.prog
    prog.dma_copy(_word_view(t_hbm, off, dims, 0), t)
    hi = prog.sbuf(t.shape, "int32")
    prog.tensor_scalar(hi, t, "is_lt", 0.0, "multiply", -1.0)
    prog.dma_copy(_word_view(t_hbm, off, dims, 1), hi)
    big = prog.sbuf(t.shape, "float32")
    prog.tensor_scalar(big, t, "abs_max", 0.0, "is_ge", _EXACT)
    ctx.range_check(big)
    prog.free(big)
    prog.free(hi)
