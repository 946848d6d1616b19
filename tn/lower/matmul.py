# Lowering of the core `matmul` op to TensorE: K-accumulation in PSUM, TensorE transposes, resident/streamed operands.
"""Matmul on the NeuronCore: ``C[..., M, N] = A[..., M, K] @ B[..., K, N]``.

TensorE computes ``psum[M, N] (+)= stat[K, M]^T @ mov[K, N]`` with K on the
partitions of both operands, so the lowering needs ``A^T`` (K on
partitions, M on the free axis) as the stationary operand and ``B`` as it
lies in HBM (K rows on partitions) as the moving one.

Plan (:func:`emit_matmul`; the fusion planner uses :func:`transposed_source`
and :func:`lower_matmul_transposed` to read a permuted operand in place):

* **A^T** is made on chip: rows of A are DMA'd into a staging tile (M on
  partitions, contiguous runs of K, one DMA per bank of blocks), each
  128x128 block goes through a TensorE transpose into PSUM (up to one bank
  of blocks per group), and one copy per group (alternating VectorE/ScalarE)
  moves it into the A^T store ``[128 (k), row tile, KC, 128 (m)]`` in SBUF,
  filled lazily per group of row tiles with the next group's rows
  prefetched. A caller that already has ``A^T`` in HBM passes it as
  ``a_t`` and it is DMA'd straight in.
* **B** is loaded in column panels ``[128, KC, ngw]`` (``ngw`` wide enough
  for >= 2 KiB contiguous DMA runs), one panel ahead of its use (double
  buffering), and stays resident for every row tile that uses it. A caller
  holding ``B^T`` (a ``Linear`` weight ``[N, K]`` behind a ``permute``)
  passes it as ``b_t``: its rows are transposed on TensorE into the panel,
  which saves the HBM round trip of a separate permute.
* **Output tiles** ``[<=128, <=512]`` accumulate over K chunks in one PSUM
  bank each (``accumulate=True`` after the first chunk, ``stop`` on the
  last); banks rotate through a ring so evacuation overlaps the next tile's
  matmuls. Groups of up to 4 row tiles share each B chunk (more matmuls per
  byte loaded while the first panels stream in).
* **Prologue** (:mod:`tn.lower.prologue`): when A is ``src * scale + shift``
  per feature (LayerNorm's gamma/beta), ``src`` is staged and transposed
  instead (in its own dtype, e.g. fp32) and each transposed block is
  evacuated by one ScalarE ``activation`` / VectorE ``tensor_scalar`` that
  applies the per-partition scale and shift and rounds to A's dtype.
* **Epilogue**: each output tile is evacuated PSUM -> SBUF with a cast to the
  output dtype (the rounding torch does) and written with ``ctx.store`` so a
  fused epilogue (bias, GELU, residual, ...) applies on chip.
* When the operands do not fit in SBUF, A^T is built per group of row tiles
  and, for very large K, K is split into panels (PSUM keeps accumulating
  across panels); everything is then reloaded as needed.
* **Streamed B** (:meth:`_Matmul.emit_streamed`, the NKI matmul tutorial's
  blocking with PSUM as the accumulator): when B cannot stay in SBUF and the
  plan above would re-read it (or A) many times, a stripe of A^T (up to one
  row tile per PSUM bank, every K chunk, as much as SBUF holds) stays
  stationary while B streams through in ``[128, kb, 512]`` blocks (>= 4 KiB
  per partition per DMA, three in flight), each block read by the matmuls of
  every row tile of the stripe. A is read once and B once per stripe; the plan
  is taken when its modelled DMA bytes are at most 0.8x the other plan's.
  ``lhsT.T @ rhs`` at the tutorial's 8192 x 4096 x 8192 bf16 on trn1: 21.4 ms
  -> 6.4 ms (the hand-written version 4: 6.6 ms modelled, 6.97 ms measured).
* Small batched matmuls (one tile group per batch, e.g. attention heads)
  move the operands of many batches in one DMA each (batch on the free axis).
* DMA priority follows program order, so the emission order is: current B
  panel, next group's A rows, next B panel, then the matmuls.

Measured (modelled trn2, bf16): 512x2048x2048 76% of TensorE peak,
2048^3 80%, 4096^3 85%; fp32 1024^3 83% of the fp32 peak.

bf16/fp16 go to TensorE as they are (fp32 accumulation); fp32 runs at the
fp32 rate (4x the cycles). Integer and float64 matmuls raise
:class:`~tn.lower.base.CannotLower`.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from ..errors import NeuronError
from ..neuron import HbmTensor, isa
from .base import CannotLower, Copier, HandoffError, Ring, TileScope, lowering
from .prologue import bank_view

__all__ = ["emit_matmul", "lower_matmul", "lower_matmul_transposed", "transposed_source", "MATMUL_DTYPES"]

#: NeuronCore dtypes TensorE multiplies.
MATMUL_DTYPES = ("float32", "bfloat16", "float16")

_P = 128            # partitions, max K and M per instruction
_NB = 512           # fp32 columns of one PSUM bank, max N per instruction
_RESERVE = 8 * 1024          # SBUF bytes per partition left free for others
_RESERVE_FUSED = 48 * 1024    # ... when a fused epilogue (ctx.unit.store_hook) allocates its operand/chain tiles per store
_RUN_BYTES = 2048   # B panels are at least this many bytes wide per partition (DMA efficiency) ...
_RUN_BYTES_FEW_ROWS = 4096  # ... and this many when A has <= 2 row tiles (B streams once: longer runs win)
_BLOCK_BYTES = 4096  # streamed plan: bytes per partition of one B block DMA (DMAs reach full rate from 2-4 KiB)
_B_RING = 3         # streamed plan: B blocks in flight (the one TensorE reads and two loading)
_STAGE_RING = 4     # streamed plan: staged pieces of A rows awaiting their TensorE transposes
_STREAM_GAIN = 0.8  # the streamed plan is taken when it moves at most this fraction of the other plan's bytes


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _sbuf_free(prog, ctx=None) -> int:
    """SBUF bytes per partition a lowering may allocate now (leaving room for a fused epilogue's tiles)."""
    alloc = getattr(prog, "_sbuf", None)
    used = alloc.in_use if alloc is not None else 0
    fused = ctx is not None and ctx.unit.store_hook is not None
    return prog.arch.sbuf_partition_bytes - used - (_RESERVE_FUSED if fused else _RESERVE)


def emit_matmul(ctx: Any, a, b, c, *, a_t=None, b_t=None, b_tiled=None,
                store: Optional[Callable[[Any, Any], None]] = None, psum_banks: Optional[int] = None,
                a_resident=None, prologue=None) -> None:
    """Emit ``c[i] = A[i] @ B[i]`` for every batch index ``i`` into ``ctx.prog``.

    Operands are HBM views (of HbmTensors, any strides a DMA can read):
    ``a`` ``[Bt, M, K]`` or, instead, ``a_t`` ``[Bt, K, M]`` (A already
    transposed: loaded directly as the stationary operand, no TensorE
    transposes); ``b`` ``[Bt, K, N]`` or, instead, ``b_t`` ``[Bt, N, K]``
    (e.g. a ``Linear`` weight, transposed on chip), or ``b_tiled`` ``(HbmTensor,
    BLayout)``: a weight laid out by :mod:`tn.lower.layout` (``Bt == 1``; its
    groups are DMA'd straight into the B panels); ``c`` ``[Bt, M, N]`` (any
    dtype; the result is cast to it). Inputs share one TensorE dtype (fp32,
    bf16, fp16). ``store(dst_view, tile)`` writes a finished output tile
    (default ``ctx.store``, which applies a fused epilogue). Every SBUF/PSUM
    tile allocated is freed on return. Raises CannotLower for other dtypes.
    ``prologue``: a :class:`tn.lower.prologue.Bound` taken by the caller; ``a`` then views its source (the
    prologue's dtype) and A is ``src * scale + shift`` in B's dtype (applied in the transposes' evacuation).
    """
    prog = ctx.prog
    if (a is None) == (a_t is None) or sum(x is not None for x in (b, b_t, b_tiled)) != 1:
        raise CannotLower("emit_matmul needs exactly one of a/a_t and one of b/b_t/b_tiled")
    Bt = (a if a is not None else a_t).shape[0]
    M, K = (a.shape[1], a.shape[2]) if a is not None else (a_t.shape[2], a_t.shape[1])
    if b_tiled is not None:
        bt_hbm, lay = b_tiled
        K2, N = lay.K, lay.N
        bsrc = bt_hbm
        if Bt != 1 or tuple(bt_hbm.shape) != tuple(lay.shape):
            raise CannotLower(f"a laid-out weight {lay} multiplies one batch (got {Bt})")
    else:
        K2, N = (b.shape[1], b.shape[2]) if b is not None else (b_t.shape[2], b_t.shape[1])
        bsrc = b if b is not None else b_t
    asrc = a if a is not None else a_t
    if (bsrc.shape[0] != Bt and b_tiled is None) or K2 != K or tuple(c.shape) != (Bt, M, N):
        raise CannotLower(f"matmul shapes do not agree: A {tuple(asrc.shape)} (transposed={a_t is not None}), "
                          f"B {tuple(bsrc.shape)} (transposed={b_t is not None}), C {tuple(c.shape)}")
    dt = asrc.dtype
    if prologue is not None:
        if a is None or Bt != 1 or prologue.dtype not in MATMUL_DTYPES or prologue.out_dtype != bsrc.dtype:
            raise CannotLower("a matmul prologue needs a row-major 2-D A source of a TensorE dtype")
        dt = bsrc.dtype
    if dt not in MATMUL_DTYPES or bsrc.dtype != dt:
        raise CannotLower(f"TensorE multiplies fp32/bf16/fp16 operands of one dtype, not {asrc.dtype} @ "
                          f"{bsrc.dtype}")
    store = ctx.store if store is None else store
    stream = ctx.weights
    if b_tiled is None or _cdiv(M, _P) != 1 or stream is None:
        stream = None
    mm = _Matmul(prog, a, a_t, b, b_t, c, Bt, M, K, N, store, psum_banks, _sbuf_free(prog, ctx), b_tiled, stream,
                 prologue)
    mm.a_res = a_resident if a is not None and Bt == 1 else None
    bg = mm._slab_size()
    bias = ctx.unit.matmul_bias
    if bias is not None and not bg and Bt == 1 and dt != "float32" and bias.dtype in (dt, "float32") and \
            bias.nbytes == N * isa.DTYPE_SIZES[isa.dtype_code(bias.dtype)] and store == ctx.store:
        # the fused epilogue starts with + bias: one K=1 matmul (ones x bias row) adds it in PSUM, in fp32
        # before the result's rounding (as a fused-bias GEMM does), instead of a VectorE pass per tile; an
        # fp32 row is the source of a bias cast to the matmul's dtype (tn.lower.schedule's bias_casts),
        # rounded on chip as it is loaded
        mm.bias = bias
        ctx.unit.bias_added = True
    if bg:
        mm.emit_slabs(bg)
    elif mm.streamed:
        if mm.bias is not None:     # the bias row and the ones column take SBUF from the stripe of A^T
            stage = 0 if mm.bias.dtype == dt else N * isa.DTYPE_SIZES[isa.dtype_code(mm.bias.dtype)]
            mm.streamed = mm._plan_streamed(mm.budget - (N + _P) * mm.isz - stage)
        if mm.streamed and mm.a_res is None:
            mm.emit_streamed()
        else:
            mm.emit()
    else:
        mm.emit()


class _Matmul:
    """Tiling plan and emission of one (batched) matmul; see the module docstring."""

    def __init__(self, prog, a, a_t, b, b_t, c, Bt, M, K, N, store, psum_banks, budget, b_tiled=None,
                 stream=None, prologue=None):
        self.prog = prog
        self.pro = prologue       # tn.lower.prologue.Bound: A = src * scale + shift, src staged in its own dtype
        self.a, self.a_t, self.b, self.b_t, self.c = a, a_t, b, b_t, c
        self.b_tiled = b_tiled
        self.stream = stream      # the program's WeightStream (a laid-out B read group by group, once)
        self.a_res = None         # A [M, K] left in SBUF by the previous lowering
        self.bias = None          # a bias row (HbmTensor, N elements) added in PSUM
        self.Bt, self.M, self.K, self.N = Bt, M, K, N
        self.store = store
        arch = prog.arch
        self.dt = (a if a is not None else a_t).dtype if prologue is None else (b if b is not None else
                                                                                (b_t if b_t is not None else b_tiled[0])).dtype
        self.isz = isa.DTYPE_SIZES[isa.dtype_code(self.dt)]
        self.sdt = self.dt if prologue is None else prologue.dtype     # A's staged rows
        self.ssz = isa.DTYPE_SIZES[isa.dtype_code(self.sdt)]
        self.osz = isa.DTYPE_SIZES[isa.dtype_code(c.dtype)]
        self.KC = _cdiv(K, _P)
        self.MT = _cdiv(M, _P)
        self.need_tr = a is not None or b_t is not None
        nbanks_total = arch.psum_partition_bytes // arch.psum_bank_bytes
        self.tbanks = 2 if self.need_tr else 0
        self.abanks = psum_banks or max(1, nbanks_total - self.tbanks)
        # B panel width: whole banks, >= 2 KiB contiguous per partition row when N allows
        run = _RUN_BYTES_FEW_ROWS if self.MT <= 2 else _RUN_BYTES
        want = max(_NB, (run // self.isz) // _NB * _NB)
        self.ngw = min(N, want) if b_tiled is None else b_tiled[1].ngw   # a laid-out weight: its groups
        self.nb = _cdiv(self.ngw, _NB)              # banks per output tile row
        self.NGn = _cdiv(N, self.ngw)
        self.MG = max(1, min(self.MT, 4 // self.nb))  # row tiles sharing each B chunk
        self.G = max(1, min(arch.psum_bank_bytes // (_P * self.isz), 8))  # transposes per PSUM bank
        self.nstage = 2 * self.MG + 1   # staged row blocks: the current group's, the next group's, one spare
        self.budget = budget
        self._plan(budget)
        self.streamed = self._plan_streamed(budget)

    # ------------------------------------------------------------------ planning
    def _plan(self, budget: int) -> None:
        isz, KC, MT, MG = self.isz, self.KC, self.MT, self.MG
        out_b = 2 * self.ngw * self.osz

        def fixed(kp):
            both = self.sdt != self.dt and self.b_t is not None
            st = self.nstage * kp * _P * (self.ssz + (isz if both else 0)) if self.need_tr else 0
            return st + out_b

        KP = KC
        while True:
            bpan = 2 * KP * self.ngw * isz
            at_min = KP * MG * _P * isz * (1 if KP == KC else 2)
            if fixed(KP) + bpan + at_min <= budget or KP == 1:
                break
            KP = _cdiv(KP, 2)
        if fixed(KP) + 2 * KP * self.ngw * isz + KP * MG * _P * isz > budget:
            raise CannotLower(f"matmul [{self.M}x{self.K}] @ [{self.K}x{self.N}] ({self.dt}) does not fit in SBUF "
                              f"even with K split into 128-row panels")
        self.KP = KP
        self.KPn = _cdiv(KC, KP)
        if self.stream is not None and (self.KPn != 1 or self.MT != 1):
            self.stream = None
        rest = budget - fixed(KP)
        b_all = KC * self.N * isz
        if self.KPn == 1:
            # B fully resident (per batch) when it fits next to at least one group of A^T
            self.b_resident = b_all + KC * MG * _P * isz <= rest and self.NGn > 1
            rest -= b_all if self.b_resident else 2 * KP * self.ngw * isz
            per_tile = KC * _P * isz
            sg = max(MG, min(MT, rest // per_tile) // MG * MG)
            self.SG = min(MT, sg)
        else:
            self.b_resident = False
            self.SG = MG
        # A^T store: [128 (k), row tiles, K chunks, 128 (m)]: each row tile's transposed blocks are contiguous
        self.at_tiles = _cdiv(min(self.M, self.SG * _P), _P)
        self.at_cols = self.at_tiles * _P
        rest2 = budget - fixed(KP) - (b_all if self.b_resident else 2 * KP * self.ngw * isz)
        self.at_bufs = 2 if 2 * KP * self.at_cols * isz <= rest2 else 1

    def _plan_streamed(self, budget: int) -> bool:
        """Whether the streamed-B plan (:meth:`emit_streamed`) moves fewer HBM bytes than :meth:`_plan`'s, and
        its blocking (``s_sg`` row tiles per A^T stripe, ``s_kb`` K chunks per B block, ``s_ks`` per staged A
        row piece, ``s_at_bufs`` stripes) when it does.

        The byte counts are the DMA engines' work in the timing model: bytes plus
        ``arch.dma_chunk_overhead_bytes`` per contiguous run (B's runs are one PSUM bank of columns)."""
        if self.b is None or self.pro is not None or self.stream is not None or self.MT < 2:
            return False
        isz, ssz, KC, MT = self.isz, self.ssz, self.KC, self.MT
        kb = max(1, min(KC, _cdiv(_BLOCK_BYTES, _NB * isz)))     # >= 4 KiB per partition per B DMA
        ks = max(1, min(KC, _cdiv(_RUN_BYTES, _P * ssz)))        # staged A rows: >= 2 KiB runs
        fixed = _B_RING * kb * _NB * isz + 2 * _NB * self.osz
        if self.need_tr:
            fixed += _STAGE_RING * ks * _P * ssz
        per_tile = KC * _P * isz
        sg = min(MT, self.abanks, (budget - fixed) // per_tile)
        if sg < 2:
            return False
        ov = self.prog.arch.dma_chunk_overhead_bytes
        a_bytes = self.M * self.K * ssz * (1 + ov / (min(self.SG, MT) * _P * isz if self.a is None else
                                                      self.KP * _P * ssz))
        b_run = lambda w: 1 + ov / (w * isz)  # noqa: E731
        now = a_bytes * (self.NGn if self.KPn > 1 else 1) + self.K * self.N * isz * b_run(self.ngw) * (
            1 if self.b_resident else _cdiv(MT, self.SG))
        streamed = a_bytes + self.K * self.N * isz * b_run(_NB) * _cdiv(MT, sg)
        if streamed > _STREAM_GAIN * now:
            return False
        self.s_sg, self.s_kb, self.s_ks = sg, kb, ks
        self.s_at_bufs = 2 if fixed + 2 * sg * per_tile <= budget else 1
        return True

    # ------------------------------------------------------------------ shared pieces
    def _transposed_in(self, count, src, kp_of, rows, dst) -> None:
        """TensorE-transpose ``count`` blocks: block ``t`` is ``src(t)`` ``[rows, kp_of(t)]`` (SBUF); its
        transpose ``[kp_of(t), rows]`` goes to ``dst(t0, t1, kp)[:, t - t0, :]`` (blocks ``t0..t1-1`` of
        equal ``kp`` are evacuated by one copy per PSUM bank)."""
        prog = self.prog
        for g0 in range(0, count, self.G):
            g1 = min(count, g0 + self.G)
            tp = self.tp_ring.take()
            for t in range(g0, g1):
                prog.transpose(tp[:kp_of(t), t - g0, :rows], src(t))
            r0 = g0
            while r0 < g1:
                kp = kp_of(r0)
                r1 = r0 + 1
                while r1 < g1 and kp_of(r1) == kp:
                    r1 += 1
                self.copy(dst(r0, r1, kp), tp[:kp, r0 - g0:r1 - g0, :rows])
                r0 = r1

    def _stage_rows(self, src, r0, rp, k0, k1, is_a=False):
        """DMA rows ``src[r0:r0+rp, k0:k1]`` into the next staging tile, one DMA per PSUM bank of transposes
        (so the first transposes start before the whole row block has arrived). Rows of A left in SBUF by
        the previous lowering (``a_res``) are used where they are."""
        if is_a and self.a_res is not None:
            return self.a_res[r0:r0 + rp, k0:k1]
        st = (self.stage_ring if is_a else self.bstage_ring).take()
        step = self.G * _P
        for c0 in range(k0, k1, step):
            c1 = min(k1, c0 + step)
            self.prog.dma_copy(st[:rp, c0 - k0:c1 - k0], src[r0:r0 + rp, c0:c1])
        return st

    def _kp(self, kc: int) -> int:
        return min(_P, self.K - kc * _P)

    # ------------------------------------------------------------------ emission
    def emit(self) -> None:
        """Allocate the rings of tiles, emit every batch, free everything."""
        prog = self.prog
        KP = self.KP
        with TileScope(prog) as scope:
            sb, ps = scope.sbuf, scope.psum
            self.at_ring = Ring(sb((_P, self.at_tiles, KP, _P), self.dt, f"mm_aT{i}") for i in range(self.at_bufs))
            if self.stream is not None:
                self.b_resident = False
                self.b_ring = None
            elif self.b_resident:
                if self.b_tiled is not None:
                    # groups side by side: each group's region is contiguous (no false overlaps between loads)
                    lay = self.b_tiled[1]
                    self.b_ring = Ring([sb((_P, lay.NG * self.KC * lay.ngw), self.dt, "mm_b")])
                else:
                    self.b_ring = Ring([sb((_P, self.KC, self.N), self.dt, "mm_b")])
            else:
                nbuf = 1 if (self.NGn == 1 and self.KPn == 1) else 2
                self.b_ring = Ring(sb((_P, KP, self.ngw), self.dt, f"mm_b{i}") for i in range(nbuf))
            self.out_ring = Ring(sb((_P, self.ngw), self.c.dtype, f"mm_out{i}") for i in range(2))
            if self.need_tr:
                self.stage_ring = Ring(sb((_P, KP * _P), self.sdt, f"mm_stage{i}") for i in range(self.nstage))
                self.bstage_ring = self.stage_ring
                if self.sdt != self.dt and self.b_t is not None:
                    # a prologue's A rows are staged in their own dtype, B rows in B's
                    self.bstage_ring = Ring(sb((_P, KP * _P), self.dt, f"mm_bstage{i}") for i in range(self.nstage))
                self.tp_ring = Ring(ps((_P, self.G, _P), self.dt, f"mm_tp{i}") for i in range(self.tbanks))
            self.acc_ring = Ring(ps((_P, _NB), "float32", f"mm_acc{i}") for i in range(self.abanks))
            self.copy = Copier(prog)
            self._load_bias_row(sb)
            for bi in range(self.Bt):
                self._emit_batch(bi)
            if getattr(self, "_own_b", None) is not None:
                prog.free(self._own_b)

    def _load_bias_row(self, sb) -> None:
        """With a bias: its row (``[1, N]``) and a row of ones in SBUF, added into PSUM by a rank-1 matmul."""
        if self.bias is not None:
            self.brow = sb((1, self.N), self.dt, "mm_bias")
            self.ones = sb((1, _P), self.dt, "mm_ones")
            if self.bias.dtype == self.dt:
                self.prog.dma_copy(self.brow, self.bias.view().reshape(1, self.N))
            else:
                # a cast bias: the source row loaded as it lies and rounded to the matmul's dtype on chip
                stage = sb((1, self.N), self.bias.dtype, "mm_bias_src")
                self.prog.dma_copy(stage, self.bias.view().reshape(1, self.N))
                self.prog.tensor_copy(self.brow, stage)
            self.prog.memset(self.ones, 1.0, engine="gpsimd")

    def emit_streamed(self) -> None:
        """Large matmuls (B too big to stay in SBUF): A^T of ``s_sg`` row tiles (every K chunk) stays in SBUF
        as the stationary stripe while B streams through in ``[128, s_kb, 512]`` blocks, each block read by
        the matmuls of every row tile of the stripe; the stripe's output tiles (one PSUM bank each) accumulate
        over all of K and are evacuated and stored before the next 512 columns. HBM reads: A once, B once per
        stripe. The A^T store is ``[128 (k), KC, s_sg * 128 (m)]`` so one K chunk of the stripe is a contiguous
        run in SBUF and in HBM (A^T given: one DMA per two chunks); a stripe's loads wait only for the matmuls
        reading the chunks they overwrite, so the next stripe loads while the last columns compute."""
        prog = self.prog
        SG, KB, KS, KC = self.s_sg, self.s_kb, self.s_ks, self.KC
        self.ngw, self.nb = _NB, 1
        with TileScope(prog) as scope:
            sb, ps = scope.sbuf, scope.psum
            at_ring = Ring(sb((_P, KC, SG * _P), self.dt, f"mm_aT{i}") for i in range(self.s_at_bufs))
            self.b_ring = Ring(sb((_P, KB, _NB), self.dt, f"mm_b{i}") for i in range(_B_RING))
            self.out_ring = Ring(sb((_P, _NB), self.c.dtype, f"mm_out{i}") for i in range(2))
            if self.need_tr:
                self.stage_ring = Ring(sb((_P, KS * _P), self.sdt, f"mm_stage{i}") for i in range(_STAGE_RING))
                self.tp_ring = Ring(ps((_P, self.G, _P), self.dt, f"mm_tp{i}") for i in range(self.tbanks))
            self.acc_ring = Ring(ps((_P, _NB), "float32", f"mm_acc{i}") for i in range(self.abanks))
            self.copy = Copier(prog)
            self._load_bias_row(sb)
            for bi in range(self.Bt):
                self._emit_streamed_batch(bi, at_ring)

    def _emit_streamed_batch(self, bi: int, at_ring) -> None:
        prog = self.prog
        SG, KB, KC, M, N = self.s_sg, self.s_kb, self.KC, self.M, self.N
        NG = _cdiv(N, _NB)
        blocks = [(sg0, ng, kb0) for sg0 in range(0, self.MT, SG) for ng in range(NG) for kb0 in range(0, KC, KB)]
        loaded, stripes = {}, {}

        def tiles_of(sg0):
            return list(range(sg0, min(self.MT, sg0 + SG)))

        def load(i):
            if i < len(blocks) and i not in loaded:
                sg0, ng, kb0 = blocks[i]
                if ng == 0 and self.a_t is not None:
                    # A^T given: the stripe's K chunks load beside the first column's B blocks that need them
                    if sg0 not in stripes:
                        stripes[sg0] = at_ring.take()
                    self._load_stripe(bi, stripes[sg0], tiles_of(sg0), kb0, min(KC, kb0 + KB))
                loaded[i] = self._load_b_block(bi, ng * _NB, kb0)

        i = 0
        for sg0 in range(0, self.MT, SG):
            tiles = tiles_of(sg0)
            if self.a_t is None:
                at = at_ring.take()
                load(i)               # the stripe's first B block goes ahead of its transposes
                self._load_stripe(bi, at, tiles, 0, KC)
            else:
                load(i)
                at = stripes.pop(sg0)
            for ng in range(NG):
                n0 = ng * _NB
                self._n0 = n0
                nw = min(_NB, N - n0)
                accs = {(mt, 0): self.acc_ring.take() for mt in tiles}
                for kb0 in range(0, KC, KB):
                    load(i)
                    bt = loaded.pop(i)
                    for j in range(1, _B_RING):
                        load(i + j)
                    i += 1
                    for kc in range(kb0, min(KC, kb0 + KB)):
                        kp = self._kp(kc)
                        for mt in tiles:
                            mp = min(_P, M - mt * _P)
                            acc = accs[(mt, 0)][:mp, :nw]
                            if kc == 0 and self.bias is not None:
                                prog.matmul(acc, self.ones[:1, :mp], self.brow[:1, n0:n0 + nw], accumulate=False,
                                            stop=False)
                            j = (mt - sg0) * _P
                            prog.matmul(acc, at[:kp, kc, j:j + mp], bt[:kp, kc - kb0, :nw],
                                        accumulate=kc > 0 or self.bias is not None, stop=kc == KC - 1)
                for mt in tiles:
                    self._evacuate(bi, mt, n0, nw, 1, accs)

    def _load_b_block(self, bi, n0, kb0):
        """DMA B rows of K chunks ``kb0 .. kb0+s_kb-1``, columns ``n0 .. n0+511`` into the next B block."""
        t = self.b_ring.take()
        kb1 = min(self.KC, kb0 + self.s_kb)
        nw = min(_NB, self.N - n0)
        src = self.b[bi]
        self._kmajor_in(lambda c0, c1: t[:, c0 - kb0:c1 - kb0, :nw], src, kb0, kb1, n0, n0 + nw)
        return t

    def _kmajor_in(self, dst, src, kc0, kc1, c0, c1) -> None:
        """DMA the K-major HBM rows of K chunks ``kc0 .. kc1-1``, columns ``c0 .. c1-1`` of ``src`` into
        ``dst(kca, kcb)`` (``[128, kcb - kca, c1 - c0]``): one DMA for the whole chunks, one for a partial last
        chunk (and one per chunk should a view refuse the split of its K axis)."""
        full = kc1 if kc1 * _P <= self.K else kc1 - 1
        if full > kc0:
            try:
                rows = src[kc0 * _P:full * _P, c0:c1].reshape(full - kc0, _P, c1 - c0).permute(1, 0, 2)
            except NeuronError:
                rows = None
            if rows is not None:
                self.prog.dma_copy(dst(kc0, full), rows)
            else:
                for kc in range(kc0, full):
                    self.prog.dma_copy(dst(kc, kc + 1)[:, 0, :], src[kc * _P:(kc + 1) * _P, c0:c1])
        if full < kc1:
            kp = self._kp(full)
            self.prog.dma_copy(dst(full, full + 1)[:kp, 0, :], src[full * _P:full * _P + kp, c0:c1])

    def _load_stripe(self, bi, at, tiles, kc0, kc1) -> None:
        """A^T of row tiles ``tiles``, K chunks ``kc0 .. kc1-1``, into the stripe ``at`` ``[128, KC, len(tiles) *
        128]`` (A^T given: DMAs of >= 4 KiB per partition; A's rows: staged pieces, TensorE transposes)."""
        m0 = tiles[0] * _P
        m1 = min(self.M, (tiles[-1] + 1) * _P)
        w = m1 - m0
        KC = kc1
        if self.a_t is not None:
            src = self.a_t[bi]
            step = max(1, _cdiv(_BLOCK_BYTES, w * self.isz))
            for c0 in range(kc0, KC, step):
                self._kmajor_in(lambda a, b: at[:, a:b, :w], src, c0, min(KC, c0 + step), m0, m1)
            return
        KS = self.s_ks
        for mt in tiles:
            r0 = mt * _P
            mp = min(_P, self.M - r0)
            j = r0 - m0
            for c0 in range(kc0, KC, KS):
                c1 = min(KC, c0 + KS)
                st = self._stage_rows(self.a[bi], r0, mp, c0 * _P, min(self.K, c1 * _P), is_a=True)
                self._transposed_in(
                    c1 - c0, lambda t, st=st, c0=c0: st[:mp, t * _P:t * _P + self._kp(c0 + t)],
                    lambda t, c0=c0: self._kp(c0 + t), mp,
                    lambda t0, t1, kp, c0=c0, j=j, mp=mp: at[:kp, c0 + t0:c0 + t1, j:j + mp])

    def _slab_size(self) -> int:
        """Batches per slab when each batch is one tile group (0: use the per-batch plan)."""
        if self.Bt < 2 or self.MT != 1 or self.NGn != 1 or self.KPn != 1:
            return 0
        if any(isinstance(v, _BatchView) for v in (self.a, self.a_t, self.b, self.b_t, self.c)):
            return 0
        if self.b_t is not None and self.N > _P:
            return 0
        isz, KC, M, N, K = self.isz, self.KC, self.M, self.N, self.K
        per = (K * isz if self.a is not None else 0) + (K * isz if self.b_t is not None else 0) + \
            KC * M * isz + KC * N * isz + N * self.osz
        budget = self.budget
        bg = min(self.Bt, 64, budget // (2 * per))
        return bg if bg >= 2 else 0

    def emit_slabs(self, bg: int) -> None:
        """Small batched matmuls: operands of ``bg`` batches move in one DMA each (batch on the free axis)."""
        prog = self.prog
        KC, M, N, K = self.KC, self.M, self.N, self.K
        with TileScope(prog) as scope:
            sb = scope.sbuf
            at_ring = Ring(sb((_P, bg * KC, M), self.dt, f"mm_aT{i}") for i in range(2))
            b_ring = Ring(sb((_P, bg * KC, N), self.dt, f"mm_b{i}") for i in range(2))
            o_ring = Ring(sb((_P, bg, N), self.c.dtype, f"mm_out{i}") for i in range(2))
            nb = _cdiv(N, _NB)
            acc_ring = Ring(scope.psum((_P, _NB), "float32", f"mm_acc{i}") for i in range(self.abanks))
            sa_ring = sb_ring = None
            if self.a is not None:
                sa_ring = Ring(sb((_P, bg, K), self.dt, f"mm_sa{i}") for i in range(2))
            if self.b_t is not None:
                sb_ring = Ring(sb((_P, bg, K), self.dt, f"mm_sb{i}") for i in range(2))
            if self.need_tr:
                self.tp_ring = Ring(scope.psum((_P, self.G, _P), self.dt, f"mm_tp{i}") for i in range(self.tbanks))
            self.copy = copy = Copier(prog)
            for b0 in range(0, self.Bt, bg):
                g = min(bg, self.Bt - b0)
                at = at_ring.take()
                self._slab_in(at, sa_ring, self.a, self.a_t, M, b0, g, bg)
                bt = b_ring.take()
                self._slab_in(bt, sb_ring, self.b_t, self.b, N, b0, g, bg)
                ot = o_ring.take()
                for j in range(g):
                    for jb in range(nb):
                        c0 = jb * _NB
                        cw = min(_NB, N - c0)
                        acc = acc_ring.take()
                        for kc in range(KC):
                            kp = self._kp(kc)
                            prog.matmul(acc[:M, :cw], at[:kp, j * KC + kc, :], bt[:kp, j * KC + kc, c0:c0 + cw],
                                        accumulate=kc > 0, stop=kc == KC - 1)
                        copy(ot[:M, j, c0:c0 + cw], acc[:M, :cw])
                    self.store(self.c[b0 + j], ot[:M, j, :])

    def _slab_in(self, dst, stage_ring, rows, kmajor, R: int, b0: int, g: int, bg: int) -> None:
        """Fill ``dst`` (``[128, bg*KC, R]``, block ``j*KC + kc`` holds K chunk ``kc`` of batch ``j``) with one
        operand of batches ``b0 .. b0+g-1``: from ``rows`` (``[B, R, K]``: one DMA into a tile of ``stage_ring``,
        then TensorE transposes) or, when ``rows`` is None, from ``kmajor`` (``[B, K, R]``: one DMA per K chunk)."""
        prog, KC = self.prog, self.KC
        if rows is not None:
            kp_flat = lambda t: self._kp(t % KC)  # noqa: E731  (flat block index j*KC + kc)
            st = stage_ring.take()
            prog.dma_copy(st[:R, :g, :], rows[b0:b0 + g].permute(1, 0, 2))
            self._transposed_in(
                g * KC, lambda t: st[:R, t // KC, (t % KC) * _P:(t % KC) * _P + kp_flat(t)], kp_flat, R,
                lambda t0, t1, kp: dst[:kp, t0:t1, :])
        else:
            dv = dst.reshape(_P, bg, KC, R)
            for kc in range(KC):
                kp = self._kp(kc)
                prog.dma_copy(dv[:kp, :g, kc, :], kmajor[b0:b0 + g, kc * _P:kc * _P + kp, :].permute(1, 0, 2))

    def _emit_batch(self, bi: int) -> None:
        MT, SG, MG, KPn = self.MT, self.SG, self.MG, self.KPn
        groups = []   # (sg0, sg_tiles, ng, mts) in emission order
        for sg0 in range(0, MT, SG):
            sg_tiles = list(range(sg0, min(MT, sg0 + SG)))
            for ng in range(self.NGn):
                for mg0 in range(sg0, sg_tiles[-1] + 1, MG):
                    groups.append((sg0, sg_tiles, ng, list(range(mg0, min(sg_tiles[-1] + 1, mg0 + MG)))))
        # the B keys in order of use: (ng, kpanel), consecutive duplicates removed, for one-ahead prefetch
        seq = []
        for _, _, ng, _ in groups:
            for kpn in range(KPn):
                if not seq or seq[-1] != (ng, kpn):
                    seq.append((ng, kpn))
        self._bseq = seq
        self._bpos = -1
        self._bloaded = {}
        self._at_key = None
        self._staged = {}
        for gi, (sg0, sg_tiles, ng, mts) in enumerate(groups):
            n0 = ng * self.ngw
            self._n0 = n0
            nw = min(self.ngw, self.N - n0)
            nb = _cdiv(nw, _NB)
            accs = {(mt, j): self.acc_ring.take() for mt in mts for j in range(nb)}
            for kpn in range(KPn):
                at = self._at_for(bi, sg0, sg_tiles, kpn, mts)
                bt, boff = self._use_b(bi, (ng, kpn))
                # DMA priority follows program order: next group's A rows, then the next B panel
                if gi + 1 < len(groups) and kpn == KPn - 1:
                    nxt = groups[gi + 1]
                    self._prefetch_rows(bi, nxt[0], nxt[3], 0 if KPn > 1 else kpn)
                self._prefetch_b(bi)
                if KPn == 1 and len(mts) == 1 and nb > 1:
                    # one row tile: bank by bank, each stored (and its epilogue run) while TensorE fills
                    # the next bank
                    for j in range(nb):
                        self._matmuls(at, sg0, bt, boff, mts, accs, kpn, nw, nb, banks=(j,))
                        self._evacuate(bi, mts[0], n0, nw, nb, accs, banks=(j,))
                    break
                self._matmuls(at, sg0, bt, boff, mts, accs, kpn, nw, nb)
            else:
                for mt in mts:
                    self._evacuate(bi, mt, n0, nw, nb, accs)

    def _at_for(self, bi, sg0, sg_tiles, kpn, mts):
        """The A^T buffer of supergroup ``sg0`` / K panel ``kpn``, with the row tiles ``mts`` filled."""
        key = (sg0, kpn)
        if self._at_key != key:
            self._at = self.at_ring.take()
            self._at_key = key
            self._filled = set()
            if self.a_t is not None:
                self._load_at_t(bi, self._at, sg_tiles, kpn)
                self._filled = set(sg_tiles)
        for mt in mts:
            if mt not in self._filled:
                self._fill_at(bi, self._at, sg0, mt, kpn)
                self._filled.add(mt)
        return self._at

    def _k_range(self, kpn):
        kc0 = kpn * self.KP
        kc1 = min(self.KC, kc0 + self.KP)
        return kc0, kc1, kc0 * _P, min(self.K, kc1 * _P)

    def _prefetch_rows(self, bi, sg0, mts, kpn) -> None:
        """Start the DMAs of A's rows for the next group early (their transposes come later, in order)."""
        if self.a is None:
            return
        for mt in mts:
            key = (sg0, kpn, mt)
            if key in self._staged or (self._at_key == (sg0, kpn) and mt in self._filled):
                continue
            _, _, k0, k1 = self._k_range(kpn)
            m0 = mt * _P
            self._staged[key] = self._stage_rows(self.a[bi], m0, min(_P, self.M - m0), k0, k1, is_a=True)

    def _load_at_t(self, bi, at, sg_tiles, kpn) -> None:
        """A^T given in HBM: DMA the supergroup's columns of every K chunk of the panel."""
        kc0, kc1, _, _ = self._k_range(kpn)
        m_base = sg_tiles[0] * _P
        m1 = min(self.M, (sg_tiles[-1] + 1) * _P)
        src = self.a_t[bi]
        for kc in range(kc0, kc1):
            kk = kc * _P
            kp = self._kp(kc)
            full = (m1 - m_base) // _P
            if full:
                self.prog.dma_copy(at[:kp, :full, kc - kc0, :],
                                   src[kk:kk + kp, m_base:m_base + full * _P].reshape(kp, full, _P))
            if m_base + full * _P < m1:
                self.prog.dma_copy(at[:kp, full, kc - kc0, :m1 - m_base - full * _P],
                                   src[kk:kk + kp, m_base + full * _P:m1])

    def _fill_at(self, bi, at, sg0, mt, kpn) -> None:
        """A^T of row tile ``mt`` (K panel ``kpn``) into ``at``: staged rows, TensorE transposes, one copy per bank."""
        kc0, kc1, k0, k1 = self._k_range(kpn)
        m0 = mt * _P
        mp = min(_P, self.M - m0)
        st = self._staged.pop((sg0, kpn, mt), None)
        if st is None:
            st = self._stage_rows(self.a[bi], m0, mp, k0, k1, is_a=True)
        j = mt - sg0
        if self.pro is not None:
            self._transposed_pro(kc0, kc1, st, mp, lambda t, kp: at[:kp, j, t, :mp])
            return
        self._transposed_in(
            kc1 - kc0, lambda t: st[:mp, t * _P:t * _P + self._kp(kc0 + t)], lambda t: self._kp(kc0 + t), mp,
            lambda t0, t1, kp: at[:kp, j, t0:t1, :mp])

    def _transposed_pro(self, kc0, kc1, st, mp, dst) -> None:
        """A's K chunks ``kc0 .. kc1-1`` from staged source rows ``st`` (``[mp, ..]``, the prologue's dtype):
        TensorE transposes into PSUM banks seen in that dtype, each block evacuated into ``dst(t, kp)`` by the
        prologue (``* scale + shift`` per partition, rounded to A's dtype)."""
        prog = self.prog
        gs = max(1, prog.arch.psum_bank_bytes // (_P * self.ssz))
        for g0 in range(kc0, kc1, gs):
            g1 = min(kc1, g0 + gs)
            tp = bank_view(self.tp_ring.take(), self.sdt)
            for kc in range(g0, g1):
                kp = self._kp(kc)
                prog.transpose(tp[:kp, kc - g0, :mp], st[:mp, (kc - kc0) * _P:(kc - kc0) * _P + kp])
            for kc in range(g0, g1):
                kp = self._kp(kc)
                self.pro.evacuate(prog, dst(kc - kc0, kp), tp[:kp, kc - g0, :mp], kc, kp)

    def _use_b(self, bi, key):
        """The SBUF tile holding B panel ``key`` = (ng, kpanel) and its column offset (loaded if needed)."""
        if self._bpos < 0 or self._bseq[self._bpos] != key:
            self._bpos += 1
        if self._bpos not in self._bloaded:
            self._bloaded[self._bpos] = self._load_b(bi, self._bseq[self._bpos])
        return self._bloaded[self._bpos]

    def _prefetch_b(self, bi) -> None:
        """Start loading the B panel used after the current one (double buffering)."""
        if self.stream is not None:
            return      # the weight stream prefetches (and must not refill a panel still in use)
        pos = self._bpos + 1
        if pos < len(self._bseq) and pos not in self._bloaded:
            self._bloaded[pos] = self._load_b(bi, self._bseq[pos])

    def _load_b(self, bi, key):
        ng, kpn = key
        prog = self.prog
        n0 = ng * self.ngw
        nw = min(self.ngw, self.N - n0)
        kc0 = kpn * self.KP
        kc1 = min(self.KC, kc0 + self.KP)
        if self.stream is not None:
            self.stream.bind(self.b_tiled[0], self.b_tiled[0])
            view = self.stream.get(self.b_tiled[0], ng)
            if view is not None:
                return view, 0
            # not the stream's next group: a buffer of our own
            self.stream = None
            self.b_ring = Ring([self.prog.sbuf((_P, self.KP, self.ngw), self.dt, name="mm_b_own")])
            self._own_b = self.b_ring.tiles[0]
        if self.b_resident:
            t = self.b_ring.tiles[0]
            off = n0
            if self.b_tiled is not None:
                lay = self.b_tiled[1]
                t = t[:, ng * self.KC * lay.ngw:(ng + 1) * self.KC * lay.ngw].reshape(_P, self.KC, lay.ngw)
                off = 0
        else:
            t = self.b_ring.take()
            off = 0
        if self.b_tiled is not None:
            # a laid-out weight: group ng is [KP, KC, ngw] as the panel wants it (padded rows and columns are
            # zeros and never read by the matmuls)
            src = self.b_tiled[0]
            kp = min(_P, self.K)
            prog.dma_copy(t[:kp, 0:kc1 - kc0, off:off + nw], src[ng, :kp, kc0:kc1, :nw])
            return t, off
        if self.b_t is not None:
            src = self.b_t[bi]
            k0, k1 = kc0 * _P, min(self.K, kc1 * _P)
            for s0 in range(0, nw, _P):
                sp = min(_P, nw - s0)
                st = self._stage_rows(src, n0 + s0, sp, k0, k1)
                c0 = off + s0
                self._transposed_in(
                    kc1 - kc0, lambda q, st=st, sp=sp: st[:sp, q * _P:q * _P + self._kp(kc0 + q)],
                    lambda q: self._kp(kc0 + q), sp, lambda q0, q1, kp, c0=c0, sp=sp: t[:kp, q0:q1, c0:c0 + sp])
            return t, off
        src = self.b[bi]
        for kc in range(kc0, kc1):
            kk = kc * _P
            kp = self._kp(kc)
            prog.dma_copy(t[:kp, kc - kc0, off:off + nw], src[kk:kk + kp, n0:n0 + nw])
        return t, off

    def _matmuls(self, at, sg0, bt, boff, mts, accs, kpn, nw, nb, banks=None) -> None:
        prog = self.prog
        M = self.M
        kc0 = kpn * self.KP
        kc1 = min(self.KC, kc0 + self.KP)
        for kc in range(kc0, kc1):
            kp = self._kp(kc)
            for mt in mts:
                m0 = mt * _P
                mp = min(_P, M - m0)
                stat = at[:kp, mt - sg0, kc - kc0, :mp]
                for j in (range(nb) if banks is None else banks):
                    c0 = j * _NB
                    cw = min(_NB, nw - c0)
                    if kc == 0 and self.bias is not None:
                        n0 = self._n0
                        prog.matmul(accs[(mt, j)][:mp, :cw], self.ones[:1, :mp],
                                    self.brow[:1, n0 + c0:n0 + c0 + cw], accumulate=False, stop=False)
                    prog.matmul(accs[(mt, j)][:mp, :cw], stat, bt[:kp, kc - kc0, boff + c0:boff + c0 + cw],
                                accumulate=kc > 0 or self.bias is not None, stop=kc == self.KC - 1)

    def _evacuate(self, bi, mt, n0, nw, nb, accs, banks=None) -> None:
        m0 = mt * _P
        mp = min(_P, self.M - m0)
        ot = self.out_ring.take()
        if banks is not None:       # some banks of the row tile, stored on their own
            for j in banks:
                c0 = j * _NB
                cw = min(_NB, nw - c0)
                self.copy(ot[:mp, c0:c0 + cw], accs[(mt, j)][:mp, :cw])
                self.store(self.c[bi, m0:m0 + mp, n0 + c0:n0 + c0 + cw], ot[:mp, c0:c0 + cw])
            return
        for j in range(nb):
            c0 = j * _NB
            cw = min(_NB, nw - c0)
            self.copy(ot[:mp, c0:c0 + cw], accs[(mt, j)][:mp, :cw])
        self.store(self.c[bi, m0:m0 + mp, n0:n0 + nw], ot[:mp, :nw])


class _BatchView:
    """A ``[lead, r, c]`` operand whose batch axes cannot merge into one strided axis (e.g. a permuted view):
    indexing with a flat batch index gives the 2-D view of that batch."""

    def __init__(self, view, lead: int, r: int, cdim: int):
        self.view = view
        self.bshape = tuple(view.shape[:-2])
        self.shape = (lead, r, cdim)
        self.dtype = view.dtype

    def __getitem__(self, idx):
        if not isinstance(idx, tuple):
            idx = (idx,)
        bi = idx[0]
        if not isinstance(bi, int):
            raise CannotLower("a batch of operands with unmergeable batch axes is indexed one batch at a time")
        multi = []
        for n in reversed(self.bshape):
            multi.append(bi % n)
            bi //= n
        return self.view[tuple(reversed(multi)) + tuple(idx[1:])]


def _as3(t, lead: int, r: int, cdim: int):
    """HBM tensor or view ``t`` of shape ``[..., r, cdim]`` as a ``[lead, r, cdim]`` batch of 2-D views."""
    try:
        return t.reshape(lead, r, cdim)
    except NeuronError:
        v = t.view() if isinstance(t, HbmTensor) else t
        if tuple(v.shape[-2:]) != (r, cdim):
            raise CannotLower(f"matmul operand view {tuple(v.shape)} cannot be read as [{lead}, {r}, {cdim}]") from None
        return _BatchView(v, lead, r, cdim)


def _check_matmul_eqn(ctx, eqn):
    """(lead, M, K, N) of a matmul equation, or CannotLower naming what is unsupported."""
    av, bv = eqn.inputs
    if not hasattr(av, "shape") or not hasattr(bv, "shape"):
        raise CannotLower("matmul of a Python scalar")
    if len(av.shape) < 2 or len(bv.shape) < 2:
        raise CannotLower(f"matmul needs operands of rank >= 2 (got {tuple(av.shape)} @ {tuple(bv.shape)}); "
                          f"vector products are reshaped to matrices by the tracer")
    if tuple(av.shape[:-2]) != tuple(bv.shape[:-2]):
        raise CannotLower(f"matmul batch dims differ: {tuple(av.shape)} @ {tuple(bv.shape)}")
    dt = ctx.neuron_dtype(av.dtype)
    if dt not in MATMUL_DTYPES:
        raise CannotLower(f"TensorE has no {av.dtype} matmul (fp32, bf16, fp16 only)")
    if bv.dtype != av.dtype:
        raise CannotLower(f"matmul of mixed dtypes {av.dtype} @ {bv.dtype}")
    M, K = av.shape[-2:]
    N = bv.shape[-1]
    lead = 1
    for s in av.shape[:-2]:
        lead *= int(s)
    return lead, int(M), int(K), int(N)


@lowering("matmul")
def lower_matmul(ctx, eqn, ins, outs) -> None:
    """``[..., M, K] @ [..., K, N]`` (equal batch dims) on TensorE; see the module docstring."""
    lead, M, K, N = _check_matmul_eqn(ctx, eqn)
    pro, a_res = _prologue_a(ctx, eqn, lead, M, K)
    emit_matmul(ctx, _as3(ins[0], lead, M, K), _as3(ins[1], lead, K, N), _as3(outs[0], lead, M, N),
                a_resident=a_res, prologue=pro)


def _prologue_a(ctx, eqn, lead: int, M: int, K: int):
    """``(prologue, resident A)``: the :class:`tn.lower.prologue.Bound` offered for operand A (taken here; its
    source is then what ``ins[0]`` holds) with the source's SBUF hand-off tile, or ``(None, resident A)``."""
    pro = ctx.unit.prologues.get(eqn.inputs[0])
    if pro is None:
        return None, _resident_a(ctx, eqn, lead, M, K)
    if lead != 1:
        raise CannotLower("a matmul prologue needs a 2-D operand")
    res = pro.take(ctx)
    if res is not None and (M > _P or tuple(res.shape) != (M, K)):
        raise HandoffError(pro.pro.src, "matmul prologue: the source's SBUF tile is not A's rows")
    return pro, res


def _resident_a(ctx, eqn, lead: int, M: int, K: int):
    """A left in SBUF (``[M, K]``) by the previous lowering (LowerCtx.take), when this matmul can read it."""
    res = ctx.resident.get(eqn.inputs[0])
    if res is None or lead != 1 or M > _P or tuple(res.shape) != (M, K):
        return None
    return ctx.take(eqn.inputs[0])


def streams_weight(eqn) -> bool:
    """Whether the lowering of matmul ``eqn`` with a laid-out B reads it from the program's weight stream
    (:class:`tn.lower.layout.WeightStream`): a 2-D matmul of one row tile (M <= 128) reads each group once."""
    av = eqn.inputs[0]
    return hasattr(av, "shape") and len(av.shape) == 2 and int(av.shape[0]) <= _P


def transposed_source(var, producer: Callable[[Any], Any]):
    """``(X, dims)`` such that ``X.permute(dims)`` is matmul operand ``var`` with its last two axes swapped, or None.

    ``var`` (``[..., R, C]``) matches when it is ``permute(X, p)`` whose last
    two output axes come from two input axes (any batch order, e.g. the
    ``k.transpose`` of attention after a head split), possibly followed by a
    ``reshape`` that only regroups the leading (batch) axes. Then
    ``X.permute(dims)`` (``dims`` = ``p`` with its last two entries swapped)
    is ``[..., C, R]``: the operand transposed, batch axes in ``var``'s
    order. ``producer(v)`` returns the equation defining ``v`` (None for
    program inputs). A fusion planner uses this to lower ``permute -> matmul``
    as one :func:`lower_matmul_transposed` reading ``X`` through that view
    (no materialised permute, no TensorE transposes for an operand that is
    already K-major).
    """
    e = producer(var)
    if e is not None and e.op.name == "reshape":
        src = e.inputs[0]
        if not hasattr(src, "shape") or len(src.shape) < 2 or tuple(src.shape[-2:]) != tuple(var.shape[-2:]):
            return None
        e = producer(src)
    if e is None or e.op.name != "permute":
        return None
    dims = tuple(int(d) for d in e.attrs["dims"])
    n = len(dims)
    if n < 2:
        return None
    x = e.inputs[0]
    rows = 1
    for d in dims[:-2]:
        rows *= int(x.shape[d])
    want = 1
    for d in var.shape[:-2]:
        want *= int(d)
    if rows != want:
        return None
    return x, dims[:-2] + (dims[-1], dims[-2])


def lower_matmul_transposed(ctx, eqn, ins, outs, a_t=None, b_t=None, b_tiled=None) -> None:
    """Lower matmul ``eqn`` reading transposed sources instead of its operands.

    ``a_t``: HbmTensor or HBM view ``[..., K, M]`` holding operand A
    transposed (then ``ins[0]`` is not read and may be None); ``b_t``:
    ``[..., N, K]`` holding B transposed (``ins[1]`` not read). With
    :func:`transposed_source` ``(X, dims)``: pass ``hbm_of(X).permute(*dims)``.
    Leading axes may be any batch axes with the operand's total batch size.
    Output and epilogue handling are as in the plain lowering.
    """
    lead, M, K, N = _check_matmul_eqn(ctx, eqn)
    a = None if a_t is not None else _as3(ins[0], lead, M, K)
    b = None if (b_t is not None or b_tiled is not None) else _as3(ins[1], lead, K, N)
    pro, a_res = _prologue_a(ctx, eqn, lead, M, K) if a is not None else (None, None)
    emit_matmul(ctx, a, b, _as3(outs[0], lead, M, N),
                a_t=None if a_t is None else _as3(a_t, lead, K, M),
                b_t=None if b_t is None else _as3(b_t, lead, N, K), b_tiled=b_tiled,
                a_resident=a_res, prologue=pro)
