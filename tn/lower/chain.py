# Fused chains of Linear layers (matmul by a transposed weight + elementwise epilogue, feeding the next one), intermediates kept feature-major in SBUF.
"""Linear chains: ``x -> Linear -> act -> Linear -> act -> ... -> Linear -> epilogue``.

An MLP is a chain of matmuls by transposed weights (``h @ W^T``, ``W``
``[out, in]``), each followed by elementwise ops (bias, activation) whose
result feeds the next matmul. Lowered one equation at a time, every
intermediate goes to HBM and back, every layer starts by transposing its input
(TensorE contracts over the partitions, so it needs ``h^T``) and, with few
tokens, TensorE runs half empty (``x^T`` as the stationary operand has only
``M`` = tokens columns).

:func:`plan` finds such chains (consecutive equations: the weight permutes,
the matmuls, their elementwise epilogues) and :class:`LinearChain` lowers one
as a unit, **feature-major**:

* The chain's input ``x`` ``[M, K0]`` is transposed once (TensorE, per 128x128
  block) into ``h0^T`` ``[128 (k), KC0, M]`` in SBUF. When ``x`` is a
  per-feature ``src * scale + shift`` (LayerNorm's gamma/beta, a
  :mod:`tn.lower.prologue` offered by the compiler), ``src`` is transposed
  instead and each block's evacuation applies the per-partition scale and
  shift (rounded to the chain's dtype).
* A middle layer computes ``h_{i+1}^T = W_i h_i^T`` block by block: the
  stationary operand is a 128x128 block of ``W_i^T`` (``M = 128`` columns: the
  array is full), the moving one ``h_i^T`` with ``N = M`` tokens (up to 512 per
  instruction). The block lands in PSUM with features on the partitions, which
  is the layout the next layer contracts over: no transposes between layers.
  Its epilogue runs there with per-feature operands (the bias) as
  per-partition scalars (one ``activation``/``tensor_scalar`` each), with
  torch's rounding (the matmul result is rounded to its dtype first).
* The last layer writes the chain's result row-major through ``ctx.store``
  (so its epilogue, e.g. ``+ bias`` and a residual add, is an ordinary fused
  epilogue, :class:`tn.lower.fusion.EpilogueGroup`): either token-major
  (stationary ``h^T`` tile, moving a 512-wide weight panel; best from 128
  tokens up) or feature-major blocks transposed back on TensorE (fewer
  TensorE cycles when ``M < 128``), whichever costs fewer TensorE cycles.
* Weights stream through a ring of three SBUF buffers in one sequence across
  all layers (no pause between layers): a weight laid out by
  :mod:`tn.lower.layout` is one DMA per group of output columns; a plain
  ``[out, in]`` weight (the compiler's variant while weights change, e.g. in
  training) is loaded by rows and transposed on TensorE into the same buffers.

Requirements (else the equations are lowered one by one): 2-D matmuls of one
float dtype, every intermediate used only inside the chain, middle epilogues
using only chain values, numbers, per-feature vectors (``[N]``/``[1, N]``) and
single-element tensors, and the intermediates fitting in SBUF.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from ..ir import IR, Eqn, Literal, Var
from ..neuron import isa
from ..neuron.program import HbmView
from .base import (
    NEURON_DTYPES,
    CannotLower,
    Copier,
    HandoffError,
    Ring,
    TileScope,
    dataflow,
    stage_vector_rows,
    store_tile,
)
from .fusion import EpilogueGroup, Group, _broadcastable, _is_map, _lstrip1, is_alias_reshape
from .layout import b_layout
from .matmul import _sbuf_free
from .prologue import bank_view

__all__ = ["LinearChain", "plan"]

_P = 128
_NB = 512                  # fp32 columns of a PSUM bank: max moving free size
_HOOK_RESERVE = 48 * 1024  # SBUF bytes per partition left for the last layer's fused epilogue
_MAX_SBUF = 200 * 1024     # bytes per partition the chain's own tiles may take
_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Layer:
    """One matmul of the chain: ``out = a @ permute(w)`` and its elementwise epilogue."""

    def __init__(self, perm: Eqn, mm: Eqn):
        self.perm = perm
        self.mm = mm
        self.w: Var = perm.inputs[0]          # [N, K]
        self.a: Var = mm.inputs[0]            # [M, K]
        self.out: Var = mm.outputs[0]         # [M, N]
        self.epi: List[Eqn] = []
        self.values: Set[Var] = {self.out}    # values computed by this layer
        self.feed: Optional[Var] = None       # the value the next layer multiplies (middle layers)

    @property
    def N(self) -> int:
        return int(self.w.shape[0])

    @property
    def K(self) -> int:
        return int(self.w.shape[1])


class LinearChain(Group):
    """A chain of Linear layers lowered as one unit (see the module docstring)."""

    def __init__(self, eqns: List[Eqn], inputs: List[Var], outputs: List[Var], layers: List[_Layer],
                 laid_out: Dict[Var, Any]):
        super().__init__(eqns, inputs, outputs)
        self.layers = layers
        self.laid_out = laid_out

    def lower(self, ctx: Any, ins: List[Any], outs: List[Any]) -> None:
        """Emit the chain into ``ctx.prog`` (``ins``/``outs``: HbmTensors of ``inputs``/``outputs``)."""
        _Emitter(ctx, self, dict(zip(self.inputs, ins)), dict(zip(self.outputs, outs))).run()

    def __repr__(self) -> str:
        return f"<LinearChain {len(self.layers)} layers {[(l.K, l.N) for l in self.layers]} M={self.layers[0].a.shape[0]}>"


# --------------------------------------------------------------------------- planning

def _is_weight_permute(e: Eqn) -> bool:
    if e.op.name != "permute" or tuple(int(d) for d in e.attrs.get("dims", ())) != (1, 0):
        return False
    w = e.inputs[0]
    return isinstance(w, Var) and w.ndim == 2 and w.dtype in _MM_DTYPES and w.numel > 0


def _per_feature(v: Var, n: int) -> bool:
    """``v`` is constant along the token axis of an ``[M, n]`` value: ``[n]`` / ``[1, n]`` (or one element)."""
    s = _lstrip1(v.shape)
    return s == (n,) or v.numel == 1


def _fm_cost(M: int, K: int, N: int) -> Tuple[int, int]:
    """TensorE issue cycles (per unit dtype rate) of the last layer: (token-major, feature-major + transposes)."""
    KC = _cdiv(K, _P)
    tm = 0
    for m0 in range(0, M, _P):
        mt = min(_P, M - m0)
        for c0 in range(0, N, _NB):
            tm += KC * max(min(64, mt), min(_NB, N - c0))
    fm = 0
    if M <= _P:
        for n0 in range(0, N, _P):
            npart = min(_P, N - n0)
            fm += KC * max(min(64, npart), M) + max(min(64, M), npart)
    else:
        fm = 1 << 60
    return tm, fm


def plan(ir: IR, host: Dict[int, str], nofuse: Set[int] = frozenset(),
         laid_out: Optional[Dict[Var, Any]] = None) -> Dict[int, LinearChain]:
    """Linear chains of ``ir``: first equation index -> :class:`LinearChain` (consecutive equations)."""
    laid_out = laid_out or {}
    n = len(ir.eqns)
    _, users, outset = dataflow(ir)
    chains: Dict[int, LinearChain] = {}
    k = 0
    while k < n:
        c = None
        if k not in host and k not in nofuse and _is_weight_permute(ir.eqns[k]):
            c = _match(ir, k, host, nofuse, users, outset, laid_out)
        if c is not None:
            chains[k] = c
            k += len(c.eqns)
        else:
            k += 1
    return chains


def _match(ir: IR, k: int, host, nofuse, users, outset, laid_out) -> Optional[LinearChain]:
    n = len(ir.eqns)
    layers: List[_Layer] = []
    perms: Dict[Var, Eqn] = {}
    idx: Dict[int, int] = {}      # id(eqn) -> position
    eqns: List[Eqn] = []
    j = k
    while j < n and j not in host and (j == k or j not in nofuse):
        e = ir.eqns[j]
        if _is_weight_permute(e):
            perms[e.outputs[0]] = e
        elif e.op.name == "matmul":
            a, b = e.inputs
            pe = perms.get(b)
            if pe is None or not isinstance(a, Var) or a.ndim != 2 or a.dtype != b.dtype or \
                    e.outputs[0].dtype != a.dtype or a.dtype not in _MM_DTYPES:
                break
            if layers:
                last = layers[-1]
                if a not in last.values:
                    break
            elif any(a is p for p in perms):
                break
            layers.append(_Layer(pe, e))
        elif layers and _is_map(e) and e.outputs[0].numel == layers[-1].out.numel and \
                _lstrip1(e.outputs[0].shape) == _lstrip1(layers[-1].out.shape) and \
                any(isinstance(a, Var) and a in layers[-1].values for a in e.inputs) and \
                all(not isinstance(a, Var) or _broadcastable(a.shape, layers[-1].out.shape) for a in e.inputs):
            layers[-1].epi.append(e)
            layers[-1].values.update(e.outputs)
        else:
            break
        idx[id(e)] = j
        eqns.append(e)
        j += 1
    # the longest valid prefix of whole layers
    while layers:
        c = _validate(ir, k, eqns, layers, idx, users, outset, laid_out)
        if c is not None:
            return c
        layers.pop()
    return None


def _validate(ir, k, eqns, layers, idx, users, outset, laid_out) -> Optional[LinearChain]:
    last = layers[-1]
    end_eqn = last.epi[-1] if last.epi else last.mm
    end = idx[id(end_eqn)] + 1
    body = [e for e in eqns if idx[id(e)] < end]
    used_perms = {id(L.perm) for L in layers}
    # permutes in the range must belong to the chain's matmuls
    if any(_is_weight_permute(e) and id(e) not in used_perms for e in body):
        return None
    M = int(layers[0].a.shape[0])
    dt = layers[0].a.dtype
    inner_out: Set[Var] = set()
    for i, L in enumerate(layers):
        if int(L.a.shape[0]) != M or L.a.dtype != dt or int(L.a.shape[1]) != L.K:
            return None
        if i + 1 < len(layers):
            nxt = layers[i + 1]
            L.feed = nxt.a
            if nxt.a not in L.values or nxt.a.dtype != dt:
                return None
        for e in ([L.perm, L.mm] + L.epi):
            for v in e.outputs:
                if i + 1 < len(layers) or e is L.perm:
                    inner_out.add(v)
    produced = {v for e in body for v in e.outputs}
    # intermediates used only inside: every user within [k, end) and not a program output
    for v in inner_out:
        if v in outset or any(u >= end or u < k for u in users.get(v, ())):
            return None
    for i, L in enumerate(layers[:-1]):
        nxt = layers[i + 1]
        if set(users.get(L.feed, ())) != {idx[id(nxt.mm)]}:
            return None
        # middle epilogue operands: chain values of this layer, numbers, per-feature vectors
        for e in L.epi:
            if is_alias_reshape(e):
                continue
            for a in e.inputs:
                if isinstance(a, Literal) or a in L.values:
                    continue
                if a in produced or not _per_feature(a, L.N):
                    return None
    for e in last.epi:
        for a in e.inputs:
            if isinstance(a, Var) and a in produced and a not in last.values:
                return None      # reads a value of an earlier layer (only the feed crosses layers)
    # external inputs
    inputs: List[Var] = []
    seen: Set[Var] = set()

    def add(v):
        if v not in seen:
            seen.add(v)
            inputs.append(v)

    for i, L in enumerate(layers):
        if i == 0:
            add(L.a)
        add(laid_out[L.w][0] if L.w in laid_out else L.w)
        for e in L.epi:
            for a in e.inputs:
                if isinstance(a, Var) and a not in produced:
                    add(a)
    outputs = [v for v in ([last.out] + [v for e in last.epi for v in e.outputs])
               if v in outset or any(u >= end for u in users.get(v, ()))]
    if not outputs:
        return None
    if len(layers) == 1:
        # a lone layer only pays off with few tokens (feature-major with the result transposed back)
        tm, fm = _fm_cost(M, last.K, last.N)
        if fm >= tm:
            return None
    return LinearChain(body, inputs, outputs, list(layers), dict(laid_out))


# --------------------------------------------------------------------------- emission

class _Emitter:
    """Emission of one :class:`LinearChain`."""

    def __init__(self, ctx, chain: LinearChain, env_in: Dict[Var, Any], env_out: Dict[Var, Any]):
        self.ctx = ctx
        self.prog = ctx.prog
        self.chain = chain
        self.layers = chain.layers
        self.env_in = env_in
        self.env_out = env_out
        L0 = self.layers[0]
        self.M = int(L0.a.shape[0])
        self.dt = NEURON_DTYPES[L0.a.dtype]
        self.isz = isa.DTYPE_SIZES[isa.dtype_code(self.dt)]
        arch = self.prog.arch
        self.G = max(1, min(arch.psum_bank_bytes // (_P * self.isz), 8))
        self.copy = Copier(self.prog)   # PSUM/SBUF copies, VectorE and ScalarE in turn
        # the input's prologue (tn.lower.prologue.Bound): x = src * scale + shift, src staged in its own dtype
        self.pro = ctx.unit.prologues.get(L0.a)
        self.sdt = self.dt if self.pro is None else self.pro.dtype
        self.ssz = isa.DTYPE_SIZES[isa.dtype_code(self.sdt)]

    # ---------------------------------------------------------------- helpers
    def _wsrc(self, L: _Layer):
        laid = self.chain.laid_out.get(L.w)
        if laid is not None:
            var, lay = laid
            return "tiled", self.env_in[var], lay
        return "rows", self.env_in[L.w], b_layout(L.N, L.K, self.dt)

    def _transpose_rows(self, stage, rows, K, dst) -> None:
        """TensorE-transpose ``stage[:rows, :K]`` block by block into ``dst(kc0, kc1, kp)`` (``[kp, n, rows]``)."""
        prog = self.prog
        KC = _cdiv(K, _P)
        for q0 in range(0, KC, self.G):
            q1 = min(KC, q0 + self.G)
            tp = self.tp_ring.take()
            for q in range(q0, q1):
                kp = min(_P, K - q * _P)
                prog.transpose(tp[:kp, q - q0, :rows], stage[:rows, q * _P:q * _P + kp])
            r0 = q0
            while r0 < q1:
                kp = min(_P, K - r0 * _P)
                r1 = r0 + 1
                while r1 < q1 and min(_P, K - r1 * _P) == kp:
                    r1 += 1
                self.copy(dst(r0, r1, kp), tp[:kp, r0 - q0:r1 - q0, :rows])
                r0 = r1

    def _transpose_pro(self, stage, rows, K, dst) -> None:
        """The prologue's source rows ``stage[:rows, :K]`` (its dtype) transposed block by block into PSUM banks
        seen in that dtype; each block evacuated into ``dst(kc, kp)`` with ``* scale + shift`` per partition."""
        prog = self.prog
        KC = _cdiv(K, _P)
        gs = max(1, prog.arch.psum_bank_bytes // (_P * self.ssz))
        for q0 in range(0, KC, gs):
            q1 = min(KC, q0 + gs)
            tp = bank_view(self.tp_ring.take(), self.sdt)
            for q in range(q0, q1):
                kp = min(_P, K - q * _P)
                prog.transpose(tp[:kp, q - q0, :rows], stage[:rows, q * _P:q * _P + kp])
            for q in range(q0, q1):
                kp = min(_P, K - q * _P)
                self.pro.evacuate(prog, dst(q, kp), tp[:kp, q - q0, :rows], q, kp)

    def _stage(self, src, r0, rp, K, ring=None):
        """DMA rows ``src[r0:r0+rp, :K]`` into the next staging tile (one DMA per PSUM bank of transposes)."""
        st = (ring or self.stage_ring).take()
        step = self.G * _P
        for c0 in range(0, K, step):
            c1 = min(K, c0 + step)
            self.prog.dma_copy(st[:rp, c0:c1], src[r0:r0 + rp, c0:c1])
        return st

    # ---------------------------------------------------------------- weights
    def _weight_plan(self):
        seq = []
        for i, L in enumerate(self.layers):
            kind, t, lay = self._wsrc(L)
            for g in range(lay.NG):
                seq.append((i, g, kind, t, lay))
        return seq

    def _issue(self, s: int) -> None:
        """Start loading weight group ``s`` of the stream (DMAs; plain weights also stage their rows)."""
        if s >= len(self.wseq) or s in self.wslot:
            return
        i, g, kind, t, lay = self.wseq[s]
        slot = self.wring.take()
        view = slot[:, :lay.KC * lay.ngw].reshape(_P, lay.KC, lay.ngw)
        if kind == "tiled":
            nw = min(lay.ngw, lay.N - g * lay.ngw)
            kp = min(_P, lay.K)
            self.prog.dma_copy(view[:kp, :, :nw], t[g, :kp, :, :nw])
        self.wslot[s] = [view, kind == "tiled"]

    def _weights(self, s: int):
        """The SBUF view ``[128, KC, ngw]`` of weight group ``s``. A plain ``[N, K]`` weight is staged by rows and
        transposed on TensorE here, just in time (two row blocks in flight)."""
        view, ready = self.wslot[s]
        if not ready:
            i, g, kind, t, lay = self.wseq[s]
            n0 = g * lay.ngw
            nw = min(lay.ngw, lay.N - n0)
            blocks = [(s0, min(_P, nw - s0)) for s0 in range(0, nw, _P)]
            staged = {}
            for b in range(min(2, len(blocks))):
                staged[b] = self._stage(t, n0 + blocks[b][0], blocks[b][1], lay.K)
            for b, (s0, sp) in enumerate(blocks):
                st = staged.pop(b)
                if b + 2 < len(blocks):
                    staged[b + 2] = self._stage(t, n0 + blocks[b + 2][0], blocks[b + 2][1], lay.K)
                self._transpose_rows(st, sp, lay.K, lambda q0, q1, kp, s0=s0, sp=sp: view[:kp, q0:q1, s0:s0 + sp])
            self.wslot[s][1] = True
        return view

    # ---------------------------------------------------------------- per-feature operands
    def _load_vec(self, v: Var, N: int):
        """A per-feature vector (``[N]``) as an SBUF tile ``[128, NB]`` (feature ``nb*128 + p`` at ``[p, nb]``),
        or a one-element tensor as ``[128, 1]``: loaded contiguously, transposed on TensorE."""
        prog = self.prog
        h = self.env_in[v]
        vdt = NEURON_DTYPES[v.dtype]
        flat = h.view().reshape(v.numel)
        if v.numel == 1:
            t = self.scope.sbuf((_P, 1), vdt, "lc_scalar")
            prog.dma_copy(t, HbmView(h, 0, [(_P, 0), (1, 1)]))
            return t, True
        NB = _cdiv(N, _P)
        if NB > _P:
            raise CannotLower(f"linear chain: a per-feature vector of {N} elements (more than {_P * _P})")
        st = prog.sbuf((NB, _P), vdt, name="lc_vstage")
        stage_vector_rows(prog, st, flat, N, _P)
        tp = prog.psum((_P, NB), vdt, name="lc_vtp")
        prog.transpose(tp[:, :NB], st[:NB, :])
        t = self.scope.sbuf((_P, NB), vdt, "lc_vec")
        prog.tensor_copy(t, tp[:, :NB], engine="vector")
        prog.free(tp)
        prog.free(st)
        return t, False

    # ---------------------------------------------------------------- budget
    def _check_budget(self, wbytes: int, fm_back: bool, need_rows: bool) -> int:
        M, isz = self.M, self.isz
        hmax = 0
        for i, L in enumerate(self.layers):
            hin = _cdiv(L.K, _P) * M * isz
            hout = _cdiv(L.N, _P) * M * isz if i + 1 < len(self.layers) else 0
            hmax = max(hmax, hin + hout)
        K0 = self.layers[0].K
        osz = 4
        stage = 3 * max(K0, max(L.K for L in self.layers) if need_rows else 0) * isz
        if self.pro is not None:
            stage += 3 * K0 * self.ssz       # the prologue's source rows
        tmp = 4 * min(M, _NB) * 4
        ngw = max(w[4].ngw for w in self.wseq if w[0] == len(self.layers) - 1)
        out_t = 2 * ngw * osz + (2 * M * osz if fm_back else 0)
        vecs = sum(_cdiv(L.N, _P) * 4 + _P * 4 for L in self.layers)
        need = hmax + stage + tmp + out_t + vecs
        free = min(_sbuf_free(self.prog), _MAX_SBUF + _HOOK_RESERVE) - _HOOK_RESERVE
        for nbuf in (3, 2):     # weight buffers: triple buffering when it fits
            if need + nbuf * wbytes <= free:
                return nbuf
        if wbytes == 0 and need <= free:
            return 0
        raise CannotLower(f"linear chain needs {need + 2 * wbytes} SBUF bytes per partition, {free} available")

    # ---------------------------------------------------------------- emission
    def run(self) -> None:
        prog = self.prog
        self.wseq = self._weight_plan()
        wbytes = max(lay.KC * lay.ngw * self.isz for (_, _, _, _, lay) in self.wseq)
        last = self.layers[-1]
        tm, fm = _fm_cost(self.M, last.K, last.N)
        fm_back = fm < tm
        need_rows = any(kind == "rows" for (_, _, kind, _, _) in self.wseq)
        stream = self.ctx.weights
        # every group in the program's weight stream (laid out and planned): no buffers of our own
        self.streamed = stream is not None and not need_rows and \
            all((t.index, g) in stream.pos for (_, g, _, t, _) in self.wseq)
        nbuf = 0 if self.streamed else self._check_budget(wbytes, fm_back, need_rows)
        if self.streamed:
            self._check_budget(0, fm_back, need_rows)
        M = self.M
        with TileScope(prog) as scope:
            self.scope = scope
            self.wring = Ring(scope.sbuf((_P, wbytes // self.isz), self.dt, f"lc_w{i}") for i in range(nbuf))
            self.wslot: Dict[int, Any] = {}
            self.ahead = max(0, nbuf - 1)
            stage_k = max([self.layers[0].K] + [L.K for L in self.layers if need_rows])
            self.fm_back = fm_back
            self.stage_ring = Ring(scope.sbuf((_P, stage_k), self.dt, f"lc_stage{i}") for i in range(3))
            self.tp_ring = Ring(scope.psum((_P, self.G, _P), self.dt, f"lc_tp{i}") for i in range(2))
            self.acc_ring = Ring(scope.psum((_P, _NB), "float32", f"lc_acc{i}") for i in range(5))
            # the chain's input, transposed: h0^T [128, KC0, M]
            L0 = self.layers[0]
            x = self.env_in[L0.a]
            KC0 = _cdiv(L0.K, _P)
            hT = scope.sbuf((_P, KC0, M), self.dt, "lc_h0")
            tiles = [(m0, min(_P, M - m0)) for m0 in range(0, M, _P)]
            xring = None
            if self.pro is not None:
                # x is the prologue's result: its source is what env_in holds (read as [M, K0] rows)
                res = self.pro.take(self.ctx)
                x = x.reshape(M, L0.K)
                if res is not None and (M > _P or tuple(res.shape) != (M, L0.K)):
                    raise HandoffError(self.pro.pro.src, "linear chain prologue: the source's SBUF tile is not x's rows")
                if res is None:
                    xring = Ring(scope.sbuf((_P, L0.K), self.sdt, f"lc_xstage{i}") for i in range(3))
            else:
                res = self.ctx.resident.get(L0.a)
                if res is not None and M <= _P and tuple(res.shape) == (M, L0.K):
                    # the input left in SBUF by the previous lowering: its rows are the staging tile
                    res = self.ctx.take(L0.a)
                else:
                    res = None

            def stage_x(src, r0, rp, K, res=res):
                return self._stage(src, r0, rp, K, xring) if res is None else res[r0:r0 + rp, :K]
            staged = {b: stage_x(x, tiles[b][0], tiles[b][1], L0.K) for b in range(min(2, len(tiles)))}
            self._small_operands()
            for d in range(self.ahead):
                self._issue(d)
            for b, (m0, mt) in enumerate(tiles):
                st = staged.pop(b)
                if b + 2 < len(tiles):
                    staged[b + 2] = stage_x(x, tiles[b + 2][0], tiles[b + 2][1], L0.K)
                if self.pro is not None:
                    self._transpose_pro(st, mt, L0.K, lambda q, kp, m0=m0, mt=mt: hT[:kp, q, m0:m0 + mt])
                else:
                    self._transpose_rows(st, mt, L0.K, lambda q0, q1, kp, m0=m0, mt=mt: hT[:kp, q0:q1, m0:m0 + mt])
            s = 0
            for i, L in enumerate(self.layers):
                ngroups = sum(1 for w in self.wseq if w[0] == i)
                if i + 1 < len(self.layers):
                    hT = self._middle(i, L, hT, s, ngroups)
                else:
                    self._last(L, hT, s, ngroups, fm_back)
                s += ngroups

    def _small_operands(self) -> None:
        """Per-feature vectors of the middle layers and the last epilogue's row operands (biases), loaded
        before the weights: the DMA pipe serves transfers in program order, and these are needed early."""
        self.vecs = []
        for i, L in enumerate(self.layers[:-1]):
            vecs = {}
            for e in L.epi:
                for a in e.inputs:
                    if isinstance(a, Var) and a not in L.values and a not in vecs:
                        vecs[a] = self._load_vec(a, L.N)
            self.vecs.append(vecs)
        L = self.layers[-1]
        self.head_out = self.env_out.get(L.out)
        if self.head_out is None:
            self.head_out = self.ctx.scratch((self.M, L.N), L.out.dtype)
        self.last_group = None
        if L.epi:
            produced = {v for e in L.epi for v in e.outputs}
            ins = []
            for e in L.epi:
                for a in e.inputs:
                    if isinstance(a, Var) and a is not L.out and a not in produced and a not in ins:
                        ins.append(a)
            group = EpilogueGroup(L.mm, list(L.epi), ins, list(self.chain.outputs))
            # + bias first: added by the last layer itself (feature-major: in the evacuation, as a per-partition
            # bias; token-major: a K=1 matmul into PSUM, bf16/fp16 only); the epilogue skips it
            group.bias = group._bias_candidate(any_dtype=True)
            self.last_bias = None
            if group.bias is not None:
                tm, fm = _fm_cost(self.M, L.K, L.N)
                if fm < tm:
                    self.last_bias = ("fm", self._load_vec(group.bias[0], L.N)[0])
                elif L.out.dtype != torch.float32:
                    row = self.scope.sbuf((1, L.N), self.dt, "lc_brow")
                    ones = self.scope.sbuf((1, _P), self.dt, "lc_ones")
                    self.prog.dma_copy(row, self.env_in[group.bias[0]].view().reshape(1, L.N))
                    self.prog.memset(ones, 1.0, engine="gpsimd")
                    self.last_bias = ("tm", row, ones)
                else:
                    group.bias = None
            group.preload(self.ctx, lambda v: self.env_in[v])
            self.last_group = group

    def _next_group(self, s: int):
        stream = self.ctx.weights
        i, g, kind, t, lay = self.wseq[s]
        if self.streamed:
            stream.bind(t, t)
            view = stream.get(t, g)
            if view is None:
                raise CannotLower("linear chain: the weight stream lost its order")
            return view
        for d in range(1, self.ahead + 1):
            self._issue(s + d)
        if s not in self.wslot:
            self._issue(s)
        return self._weights(s)

    def _middle(self, i: int, L: _Layer, hT, s0: int, ngroups: int):
        """A middle layer: ``h_{i+1}^T`` block by block (feature-major), epilogue on per-partition operands."""
        prog = self.prog
        M, K, N = self.M, L.K, L.N
        KC = _cdiv(K, _P)
        NBo = _cdiv(N, _P)
        hT2 = self.scope.sbuf((_P, NBo, M), self.dt, f"lc_h{i + 1}")
        vecs = self.vecs[i]
        out_dt = NEURON_DTYPES[L.out.dtype]
        temps: Dict[Tuple[Var, int], Any] = {}
        for g in range(ngroups):
            W = self._next_group(s0 + g)
            lay = self.wseq[s0 + g][4]
            n0 = g * lay.ngw
            nw = min(lay.ngw, N - n0)
            for j0 in range(0, nw, _P):
                npart = min(_P, nw - j0)
                nb = (n0 + j0) // _P
                for c0 in range(0, M, _NB):
                    mc = min(_NB, M - c0)
                    acc = self.acc_ring.take()
                    for kc in range(KC):
                        kp = min(_P, K - kc * _P)
                        prog.matmul(acc[:npart, :mc], W[:kp, kc, j0:j0 + npart], hT[:kp, kc, c0:c0 + mc],
                                    accumulate=kc > 0, stop=kc == KC - 1)
                    dst = hT2[:npart, nb, c0:c0 + mc]
                    if not L.epi:
                        self.copy(dst, acc[:npart, :mc])
                        continue
                    env: Dict[Var, Any] = {}
                    first = self._temp(temps, L.out, out_dt, npart, mc)
                    self.copy(first, acc[:npart, :mc])
                    env[L.out] = first
                    for e in L.epi:
                        if is_alias_reshape(e):
                            env[e.outputs[0]] = env[e.inputs[0]]
                            continue
                        v = e.outputs[0]
                        out = dst if v is L.feed else self._temp(temps, v, NEURON_DTYPES[v.dtype], npart, mc)
                        args = []
                        for a in e.inputs:
                            if isinstance(a, Literal):
                                args.append(a.value)
                            elif a in env:
                                args.append(env[a])
                            else:
                                t, scalar = vecs[a]
                                col = t[:npart, 0:1] if scalar else t[:npart, nb:nb + 1]
                                args.append(col.broadcast_to((npart, mc)))
                        e.op.tile_rule(self.ctx, e, out, args)
                        env[v] = out
                    if env.get(L.feed) is not dst:
                        # the feed is the matmul output itself or an alias of an earlier value
                        self.copy(dst, env[L.feed])
        return hT2

    def _temp(self, temps, v: Var, dt: str, npart: int, mc: int):
        """A 2-deep ring of SBUF tiles per value (consecutive blocks overlap)."""
        key = (v, 0)
        ring = temps.get(key)
        if ring is None:
            ring = temps[key] = Ring(self.scope.sbuf((_P, min(self.M, _NB)), dt, "lc_tmp") for _ in range(2))
        return ring.take()[:npart, :mc]

    def _last(self, L: _Layer, hT, s0: int, ngroups: int, fm_back: bool) -> None:
        """The last layer: row-major result through ``ctx.store`` with the chain's fused epilogue."""
        prog = self.prog
        M, K, N = self.M, L.K, L.N
        KC = _cdiv(K, _P)
        ctx = self.ctx
        head_out, group = self.head_out, self.last_group
        lb = getattr(self, "last_bias", None)
        if group is not None:
            hook = group.make_hook(ctx, head_out, lambda v: self.env_in[v], lambda v: self.env_out[v])
            ctx.unit.bias_added = lb is not None
        else:
            def hook(dst, tile):
                return False

        def store(dst, tile):
            if not hook(dst, tile):
                store_tile(prog, dst, tile)

        out_dt = NEURON_DTYPES[L.out.dtype]      # == the matmul dtype (checked by the planner)
        ngw = max(w[4].ngw for w in self.wseq if w[0] == len(self.layers) - 1)
        ot_ring = Ring(self.scope.sbuf((_P, ngw), out_dt, "lc_out") for _ in range(2))
        if fm_back:
            cts = Ring(self.scope.sbuf((_P, M), out_dt, "lc_ct") for _ in range(2))
        try:
            for g in range(ngroups):
                W = self._next_group(s0 + g)
                lay = self.wseq[s0 + g][4]
                n0 = g * lay.ngw
                nw = min(lay.ngw, N - n0)
                if fm_back:
                    # feature-major blocks, rounded to the output dtype, transposed back on TensorE
                    ot = ot_ring.take()
                    blocks = list(range(0, nw, _P))
                    for q0 in range(0, len(blocks), self.G):
                        grp = blocks[q0:q0 + self.G]
                        tp = self.tp_ring.take()
                        for jj, j0 in enumerate(grp):
                            npart = min(_P, nw - j0)
                            acc = self.acc_ring.take()
                            for kc in range(KC):
                                kp = min(_P, K - kc * _P)
                                prog.matmul(acc[:npart, :M], W[:kp, kc, j0:j0 + npart], hT[:kp, kc, 0:M],
                                            accumulate=kc > 0, stop=kc == KC - 1)
                            ct = cts.take()
                            if lb is not None:
                                nb = (n0 + j0) // _P
                                prog.activation(ct[:npart, :M], acc[:npart, :M], "identity", bias=lb[1][:npart, nb:nb + 1])
                            else:
                                self.copy(ct[:npart, :M], acc[:npart, :M])
                            prog.transpose(tp[:M, jj, :npart], ct[:npart, :M])
                        j0 = grp[0]
                        if all(min(_P, nw - jb) == _P for jb in grp):
                            self.copy(ot[:M, j0:j0 + len(grp) * _P].reshape(M, len(grp), _P), tp[:M, :len(grp), :])
                        else:
                            for jj, jb in enumerate(grp):
                                npart = min(_P, nw - jb)
                                self.copy(ot[:M, jb:jb + npart], tp[:M, jj, :npart])
                    store(head_out[0:M, n0:n0 + nw], ot[:M, :nw])
                else:
                    for m0 in range(0, M, _P):
                        mt = min(_P, M - m0)
                        ot = ot_ring.take()
                        for c0 in range(0, nw, _NB):
                            cw = min(_NB, nw - c0)
                            acc = self.acc_ring.take()
                            if lb is not None:
                                prog.matmul(acc[:mt, :cw], lb[2][:1, :mt], lb[1][:1, n0 + c0:n0 + c0 + cw],
                                            accumulate=False, stop=False)
                            for kc in range(KC):
                                kp = min(_P, K - kc * _P)
                                prog.matmul(acc[:mt, :cw], hT[:kp, kc, m0:m0 + mt], W[:kp, kc, c0:c0 + cw],
                                            accumulate=kc > 0 or lb is not None, stop=kc == KC - 1)
                            self.copy(ot[:mt, c0:c0 + cw], acc[:mt, :cw])
                        store(head_out[m0:m0 + mt, n0:n0 + nw], ot[:mt, :nw])
        finally:
            ctx.unit.bias_added = False
            if group is not None:
                group.finish(prog)
        if group is not None and group.covered != M * N:
            raise CannotLower(f"linear chain: the last epilogue covered {group.covered} of {M * N} elements")
