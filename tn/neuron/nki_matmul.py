# The four kernels of AWS's NKI matrix-multiplication tutorial, written as tn.neuron programs (fidelity anchors).
"""The NKI matmul tutorial's kernels on the software NeuronCore.

AWS's NKI tutorial "Matrix multiplication" (aws-neuron-sdk,
``nki/tutorials/matrix_multiplication.rst`` and
``nki/examples/matrix_multiplication/matrix_multiplication_nki_kernels.py``,
SDK 2.26) optimises ``result[M, N] = lhsT[K, M]^T @ rhs[K, N]`` in four steps
and publishes their measured latency on trn1 for ``K, M, N = 8192, 4096,
8192`` in bf16: 51.80 / 42.96 / 22.07 / 6.97 ms. :func:`build` writes each
version with :class:`tn.neuron.Program`, following the tutorial's loop
structure, tile shapes and DMA shapes:

``tiled`` (v1, ``nki_matmul_tiled_``)
    for each 128 x 512 output tile, for each K-tile: load a ``[128, 128]``
    lhsT tile and a ``[128, 512]`` rhs tile, matmul into one PSUM bank; copy
    PSUM -> SBUF (bf16), store.
``hoist_load`` (v2, ``nki_matmul_hoist_load_``)
    the lhsT column of an M-tile (all K-tiles) is loaded once per M-tile;
    rhs tiles are still loaded for every (M-tile, N-tile).
``block_free`` (v3, ``nki_matmul_block_free_dimension_``)
    2 M-tiles x 2 N-tiles per block: each loaded tile serves two matmuls.
``fully_optimized`` (v4, ``nki_matmul_fully_optimized_``)
    blocks of 16 M-tiles, 2 N-tiles, 8 K-tiles; rhs loaded as ``[128, 1024]``
    and lhsT as ``[128, 2048]`` per K-tile (large DMAs); every block's PSUM
    result is added into a bf16 SBUF accumulator (VectorE ``tensor_tensor``),
    accumulators zeroed with ``memset`` and stored as ``[128, 1024]`` rows.

What the tutorial leaves to the Neuron compiler (*assumption*, stated here
because it changes the timing): how many SBUF/PSUM buffers back a tile
allocated inside an ``affine_range`` loop. tn gives every such tile a ring of
``bufs`` buffers (default 4; the big v2/v3/v4 tile sets get as many as
fit SBUF, see :data:`RING_DEPTH`), so loads of later iterations overlap the
compute of earlier ones as far as the ring allows.

DMA queues (one rule for every version, trn1 and trn2: :data:`IO_QUEUE_RULE`).
The NKI docs tie a transfer's queue to who triggers it and how its
descriptors are made, not to the statement that issues it ([dma]
``nki/get-started/about/nki-dma-overview.rst``: "There are 16 DMA queues per
DMA engine ... A given DMA transfer can be submitted to a single queue ID
across all 16x DMA engines ... The queue ID is typically tied to the trigger
engine and the method of descriptor generation. DMA transfers within a queue
on the same DMA engine are executed in order"). The tutorials' kernels issue
all their IO one way, so all of it is on one queue: on trn1 ``nl.load`` /
``nl.store`` run on static descriptors triggered by the Sync engine, the
queue ``qSyncIO0`` of the published trn1 profiles (``nki_perf_guide.rst``
"Opt #4", ``fused_mamba.rst``); on trn2 the guide's own profile summaries
show every packet as a software-DGE one ("Hardware Dynamic Dma Packet Count
0", "Dynamic Dma Packet Percent 100.00 %", figures ``v2-dma`` ... ``v5-dma``):
descriptors made by GpSimd, whose queue [dma] example 2 shows as
``qGpSimdDynamic``. tn therefore puts every load and store of every version
on :data:`IO_QUEUE`: one in-order stream, so the DMA engines' per-transfer
minimum (:attr:`tn.neuron.arch.Arch.dma_transfer_min_ns`) bounds the rate of
the small transfers of v1-v3. ``io_queues=2`` moves the rhs loads to a
second queue, to compare only: no source puts them there.

trn2: :func:`build_trn2` writes the four kernels of the NKI guide "Introduction
to NKI kernel optimization" (aws-neuron-sdk
``nki/guides/tutorials/kernel-optimization.rst``, 2025-12-02), which profiles
them on trn2 with fp32 inputs (``lhs [4096, 8192]``, ``rhs [8192, 8192]``
from ``np.float32``, no casts: fp32 matmuls, fp32 PSUM copies and result) and
publishes neuron-profile busy shares, not latencies (:data:`TRN2_VERSIONS`):
``tiled`` (the tutorial's v1 loop nest), ``hoist_load`` (lhsT K-column per
m, rhs K-column per n), ``block_free`` (2 x 2 tiles per block, K unblocked)
and ``block_k`` (16 x 2 x 8 tiles per block: ``[128, 1024]`` rhs and
``[128, 2048]`` lhsT loads, fp32 SBUF accumulators zeroed with ``memset``,
``tensor_tensor`` adds from PSUM, ``[128, 1024]`` packed stores). All DMAs
are ``nisa.dma_copy`` on :data:`IO_QUEUE` (the queue rule above). What the
guide leaves to the compiler, and
tn assumes (*assumptions*): loop-local tiles get a ring of
:data:`RING_DEPTH` buffers where they fit; at fp32 the big tile sets do not
all fit trn2's SBUF (224 KiB per partition in :mod:`tn.neuron.arch`), so
``hoist_load`` keeps one rhs K-column (128 KiB) besides two lhsT K-columns,
``block_free`` (whose published live set is 320 KiB) loads each rhs K-column
right before the ``bn`` iteration that reads it (an ``affine_range``
reorder), and ``block_k`` (64 fp32 accumulators 128 KiB + rhs block 32 KiB +
lhsT block 64 KiB: exactly 224 KiB) single-buffers its blocks, allocating
them per iteration; PSUM -> SBUF copies run on :data:`TRN2_COPY_ENGINE`.
"""
from __future__ import annotations

from ..errors import NeuronError
from .arch import TRN2, get_arch
from .program import Program

__all__ = ["VERSIONS", "RING_DEPTH", "IO_QUEUE", "IO_QUEUE_RULE", "build", "TRN2_VERSIONS", "TRN2_COPY_ENGINE",
           "build_trn2"]

#: Tutorial versions in published order.
VERSIONS = ("tiled", "hoist_load", "block_free", "fully_optimized")
#: Buffers per tile allocated in a loop (*assumption*: the compiler's choice, see the module docstring).
RING_DEPTH = {"tile": 4, "psum": 4, "k_column": 2}

TILE_K, TILE_M, TILE_N = 128, 128, 512
#: DMA queue of every load and store of every version (see :data:`IO_QUEUE_RULE` and the module docstring).
IO_QUEUE = 0
#: The queue rule, per arch: how the published kernels trigger their IO and make its descriptors, the queue the
#: published profiles show for it, and where that is read. [dma]: "The queue ID is typically tied to the trigger
#: engine and the method of descriptor generation", so one (trigger engine, descriptor mode) pair is one queue.
IO_QUEUE_RULE = {
    "trn1": ("Sync engine", "static descriptors", "qSyncIO0",
             "nki/deep-dives/nki_perf_guide.rst Opt #4 and nki/guides/tutorials/fused_mamba.rst profiles: the "
             "nl.load transfers on qSyncIO0"),
    "trn2": ("GpSimd", "software DGE", "qGpSimdDynamic",
             "nki/guides/tutorials/kernel-optimization.rst profile summaries (figures v2-dma ... v5-dma): hardware "
             "DGE packets 0, dynamic packets 100 %; nki-dma-overview.rst example 2: dma_copy triggered from "
             "qGpSimdDynamic"),
}
#: The trn2 guide's versions in published order (its profile figures v2-full ... v5-full).
TRN2_VERSIONS = ("tiled", "hoist_load", "block_free", "block_k")
#: Engine of the trn2 versions' PSUM -> SBUF copies (``nisa.tensor_copy`` leaves the choice to the compiler):
#: the guide says VectorE was "previously unused" before the K-blocked version, so the copies ran elsewhere;
#: ScalarE (*assumption*: GpSimd would also fit the sentence).
TRN2_COPY_ENGINE = "scalar"


class _Queues:
    """DMA queue of each kind of transfer of a version (trn1 and trn2 alike): every transfer on :data:`IO_QUEUE`
    (``io_queues=1``, :data:`IO_QUEUE_RULE`), or, to compare only (``io_queues=2``), rhs loads on a second one."""

    def __init__(self, io_queues):
        if io_queues not in (1, 2):
            raise NeuronError(f"nki_matmul: io_queues must be 1 or 2, not {io_queues!r}")
        self.lhs = self.out = IO_QUEUE
        self.rhs = IO_QUEUE + io_queues - 1


class _Ring:
    """``depth`` SBUF/PSUM buffers of one shape handed out in turn (a loop-allocated tile, as the compiler
    would place it): reuse waits for the last reader through the program's dependency tracking."""

    def __init__(self, prog, shape, dtype, depth, mem="sbuf"):
        alloc = prog.psum if mem == "psum" else prog.sbuf
        self.tiles = [alloc(shape, dtype) for _ in range(depth)]
        self.i = 0

    def next(self):
        """The next buffer of the ring."""
        t = self.tiles[self.i % len(self.tiles)]
        self.i += 1
        return t


def _check(K, M, N, bm=1, bn=1, bk=1):
    for name, v, t in (("K", K, TILE_K * bk), ("M", M, TILE_M * bm), ("N", N, TILE_N * bn)):
        if v % t:
            raise NeuronError(f"nki_matmul: {name}={v} must be a multiple of {t} for this version")


def _evacuate_store(p, q, ring_out, psum_tile, result_view):
    """PSUM -> SBUF in the result dtype on VectorE (``nl.copy``), then SBUF -> HBM (``nl.store``)."""
    sb = ring_out.next()
    p.tensor_copy(sb, psum_tile)
    p.dma_copy(result_view, sb, queue=q.out)


def _tiled(p, lhsT, rhs, res, K, M, N, dt, q):
    _check(K, M, N)
    lt, rt = _Ring(p, (TILE_K, TILE_M), dt, RING_DEPTH["tile"]), _Ring(p, (TILE_K, TILE_N), dt, RING_DEPTH["tile"])
    ps = _Ring(p, (TILE_M, TILE_N), "float32", RING_DEPTH["psum"], "psum")
    out = _Ring(p, (TILE_M, TILE_N), dt, RING_DEPTH["tile"])
    nk = K // TILE_K
    for m in range(M // TILE_M):
        for n in range(N // TILE_N):
            acc = ps.next()
            for k in range(nk):
                a, b = lt.next(), rt.next()
                p.dma_copy(a, lhsT[k * TILE_K:(k + 1) * TILE_K, m * TILE_M:(m + 1) * TILE_M], queue=q.lhs)
                p.dma_copy(b, rhs[k * TILE_K:(k + 1) * TILE_K, n * TILE_N:(n + 1) * TILE_N], queue=q.rhs)
                p.matmul(acc, a, b, accumulate=k > 0, stop=k == nk - 1)
            _evacuate_store(p, q, out, acc, res[m * TILE_M:(m + 1) * TILE_M, n * TILE_N:(n + 1) * TILE_N])


def _hoist_load(p, lhsT, rhs, res, K, M, N, dt, q):
    _check(K, M, N)
    nk = K // TILE_K
    depth = RING_DEPTH["k_column"]
    lcols = [_Ring(p, (TILE_K, TILE_M), dt, depth) for _ in range(nk)]
    rcols = [_Ring(p, (TILE_K, TILE_N), dt, depth) for _ in range(nk)]
    ps = _Ring(p, (TILE_M, TILE_N), "float32", RING_DEPTH["psum"], "psum")
    out = _Ring(p, (TILE_M, TILE_N), dt, RING_DEPTH["tile"])
    for m in range(M // TILE_M):
        a = [lcols[k].next() for k in range(nk)]
        for k in range(nk):
            p.dma_copy(a[k], lhsT[k * TILE_K:(k + 1) * TILE_K, m * TILE_M:(m + 1) * TILE_M], queue=q.lhs)
        for n in range(N // TILE_N):
            b = [rcols[k].next() for k in range(nk)]
            for k in range(nk):
                p.dma_copy(b[k], rhs[k * TILE_K:(k + 1) * TILE_K, n * TILE_N:(n + 1) * TILE_N], queue=q.rhs)
            acc = ps.next()
            for k in range(nk):
                p.matmul(acc, a[k], b[k], accumulate=k > 0, stop=k == nk - 1)
            _evacuate_store(p, q, out, acc, res[m * TILE_M:(m + 1) * TILE_M, n * TILE_N:(n + 1) * TILE_N])


def _block_free(p, lhsT, rhs, res, K, M, N, dt, q, bm=2, bn=2):
    _check(K, M, N, bm, bn)
    nk = K // TILE_K
    # one buffer per (block tile, K-tile): 2 x 64 x (256 B + 1 KiB) per partition at K = 8192 already fills
    # 160 KiB of trn1's 192 KiB, so there is no second set; reuse waits for the matmuls reading a tile
    lts = [[p.sbuf((TILE_K, TILE_M), dt) for _ in range(nk)] for _ in range(bm)]
    rts = [[p.sbuf((TILE_K, TILE_N), dt) for _ in range(nk)] for _ in range(bn)]
    ps = _Ring(p, (TILE_M, TILE_N), "float32", RING_DEPTH["psum"], "psum")
    out = _Ring(p, (TILE_M, TILE_N), dt, RING_DEPTH["tile"])
    for m in range(M // (TILE_M * bm)):
        for i in range(bm):
            mt = m * bm + i
            for k in range(nk):
                p.dma_copy(lts[i][k], lhsT[k * TILE_K:(k + 1) * TILE_K, mt * TILE_M:(mt + 1) * TILE_M], queue=q.lhs)
        for n in range(N // (TILE_N * bn)):
            for j in range(bn):
                nt = n * bn + j
                for k in range(nk):
                    p.dma_copy(rts[j][k], rhs[k * TILE_K:(k + 1) * TILE_K, nt * TILE_N:(nt + 1) * TILE_N], queue=q.rhs)
            for i in range(bm):
                for j in range(bn):
                    acc = ps.next()
                    for k in range(nk):
                        p.matmul(acc, lts[i][k], rts[j][k], accumulate=k > 0, stop=k == nk - 1)
                    mt, nt = m * bm + i, n * bn + j
                    _evacuate_store(p, q, out, acc, res[mt * TILE_M:(mt + 1) * TILE_M, nt * TILE_N:(nt + 1) * TILE_N])


def _fully_optimized(p, lhsT, rhs, res, K, M, N, dt, q, bm=16, bn=2, bk=8):
    _check(K, M, N, bm, bn, bk)
    BM, BN, BK = TILE_M * bm, TILE_N * bn, TILE_K * bk
    nbm, nbn, nbk = M // BM, N // BN, K // BK
    # result accumulators of one N-block: nbm * bm tiles of [128, bn, 512] in the result dtype (bf16)
    accs = [p.sbuf((TILE_M, bn, TILE_N), dt) for _ in range(nbm * bm)]
    rring = _Ring(p, (TILE_K, bk, BN), dt, 2)
    lring = _Ring(p, (TILE_K, bk, BM), dt, 2)
    ps = _Ring(p, (TILE_M, TILE_N), "float32", RING_DEPTH["psum"], "psum")
    packed = _Ring(p, (TILE_M, BN), dt, 2)
    for n in range(nbn):
        for t in accs:
            p.memset(t, 0.0)
        for k in range(nbk):
            rt = rring.next()
            for j in range(bk):
                k0 = (k * bk + j) * TILE_K
                p.dma_copy(rt[:, j, :], rhs[k0:k0 + TILE_K, n * BN:(n + 1) * BN], queue=q.rhs)
            for m in range(nbm):
                lt = lring.next()
                for j in range(bk):
                    k0 = (k * bk + j) * TILE_K
                    p.dma_copy(lt[:, j, :], lhsT[k0:k0 + TILE_K, m * BM:(m + 1) * BM], queue=q.lhs)
                for jn in range(bn):
                    for im in range(bm):
                        acc = ps.next()
                        for j in range(bk):
                            p.matmul(acc, lt[:, j, im * TILE_M:(im + 1) * TILE_M],
                                     rt[:, j, jn * TILE_N:(jn + 1) * TILE_N], accumulate=j > 0, stop=j == bk - 1)
                        dst = accs[m * bm + im][:, jn, :]
                        p.tensor_tensor(dst, dst, acc, "add")
        for m in range(nbm):
            for im in range(bm):
                row = packed.next()
                for jn in range(bn):          # coalesce the N-tiles into one row block (nl.copy), one store
                    p.tensor_copy(row[:, jn * TILE_N:(jn + 1) * TILE_N], accs[m * bm + im][:, jn, :])
                mt = m * bm + im
                p.dma_copy(res[mt * TILE_M:(mt + 1) * TILE_M, n * BN:(n + 1) * BN], row, queue=q.out)


_BUILDERS = {"tiled": _tiled, "hoist_load": _hoist_load, "block_free": _block_free,
             "fully_optimized": _fully_optimized}


# --------------------------------------------------------------------------- trn2 (kernel-optimization guide)


def _evacuate_store_trn2(p, q, ring_out, psum_tile, result_view):
    """PSUM -> SBUF fp32 (``nisa.tensor_copy``, on :data:`TRN2_COPY_ENGINE`), then SBUF -> HBM."""
    sb = ring_out.next()
    p.tensor_copy(sb, psum_tile, engine=TRN2_COPY_ENGINE)
    p.dma_copy(result_view, sb, queue=q.out)


def _trn2_rings(p, dt):
    """The PSUM ring and the result-tile ring every trn2 version uses (:data:`RING_DEPTH`)."""
    return (_Ring(p, (TILE_M, TILE_N), "float32", RING_DEPTH["psum"], "psum"),
            _Ring(p, (TILE_M, TILE_N), dt, RING_DEPTH["tile"]))


def _trn2_tiled(p, lhsT, rhs, res, K, M, N, dt, q):
    _check(K, M, N)
    nk = K // TILE_K
    lt, rt = _Ring(p, (TILE_K, TILE_M), dt, RING_DEPTH["tile"]), _Ring(p, (TILE_K, TILE_N), dt, RING_DEPTH["tile"])
    ps, out = _trn2_rings(p, dt)
    for m in range(M // TILE_M):
        for n in range(N // TILE_N):
            acc = ps.next()
            for k in range(nk):
                a, b = lt.next(), rt.next()
                p.dma_copy(a, lhsT[k * TILE_K:(k + 1) * TILE_K, m * TILE_M:(m + 1) * TILE_M], queue=q.lhs)
                p.dma_copy(b, rhs[k * TILE_K:(k + 1) * TILE_K, n * TILE_N:(n + 1) * TILE_N], queue=q.rhs)
                p.matmul(acc, a, b, accumulate=k > 0, stop=k == nk - 1)
            _evacuate_store_trn2(p, q, out, acc, res[m * TILE_M:(m + 1) * TILE_M, n * TILE_N:(n + 1) * TILE_N])


def _trn2_hoist_load(p, lhsT, rhs, res, K, M, N, dt, q):
    _check(K, M, N)
    nk = K // TILE_K
    # lhsT column (32 KiB per partition at K = 8192 fp32) double-buffered; one rhs column (128 KiB) is all that
    # fits beside it in trn2's SBUF: each rhs tile's next load waits for the matmul reading it (module docstring)
    lcols = [_Ring(p, (TILE_K, TILE_M), dt, RING_DEPTH["k_column"]) for _ in range(nk)]
    rcol = [p.sbuf((TILE_K, TILE_N), dt) for _ in range(nk)]
    ps, out = _trn2_rings(p, dt)
    for m in range(M // TILE_M):
        a = [lcols[k].next() for k in range(nk)]
        for k in range(nk):
            p.dma_copy(a[k], lhsT[k * TILE_K:(k + 1) * TILE_K, m * TILE_M:(m + 1) * TILE_M], queue=q.lhs)
        for n in range(N // TILE_N):
            for k in range(nk):
                p.dma_copy(rcol[k], rhs[k * TILE_K:(k + 1) * TILE_K, n * TILE_N:(n + 1) * TILE_N], queue=q.rhs)
            acc = ps.next()
            for k in range(nk):
                p.matmul(acc, a[k], rcol[k], accumulate=k > 0, stop=k == nk - 1)
            _evacuate_store_trn2(p, q, out, acc, res[m * TILE_M:(m + 1) * TILE_M, n * TILE_N:(n + 1) * TILE_N])


def _trn2_block_free(p, lhsT, rhs, res, K, M, N, dt, q, bm=2, bn=2):
    _check(K, M, N, bm, bn)
    nk = K // TILE_K
    # one buffer per (block tile, K-tile) of lhsT (64 KiB per partition) and of one rhs column (128 KiB): 192 of
    # trn2's 224 KiB; reuse waits for the matmuls reading a tile
    lts = [[p.sbuf((TILE_K, TILE_M), dt) for _ in range(nk)] for _ in range(bm)]
    rt = [p.sbuf((TILE_K, TILE_N), dt) for _ in range(nk)]
    ps, out = _trn2_rings(p, dt)
    for m in range(M // (TILE_M * bm)):
        for i in range(bm):
            mt = m * bm + i
            for k in range(nk):
                p.dma_copy(lts[i][k], lhsT[k * TILE_K:(k + 1) * TILE_K, mt * TILE_M:(mt + 1) * TILE_M],
                           queue=q.lhs)
        for n in range(N // (TILE_N * bn)):
            # the published order loads both rhs columns, then runs (bm, bn) pairs; their fp32 live set does not
            # fit trn2's SBUF (see the module docstring), so each column is loaded before the bn iteration reading it
            for j in range(bn):
                nt = n * bn + j
                for k in range(nk):
                    p.dma_copy(rt[k], rhs[k * TILE_K:(k + 1) * TILE_K, nt * TILE_N:(nt + 1) * TILE_N],
                               queue=q.rhs)
                for i in range(bm):
                    acc = ps.next()
                    for k in range(nk):
                        p.matmul(acc, lts[i][k], rt[k], accumulate=k > 0, stop=k == nk - 1)
                    mt = m * bm + i
                    _evacuate_store_trn2(p, q, out, acc,
                                         res[mt * TILE_M:(mt + 1) * TILE_M, nt * TILE_N:(nt + 1) * TILE_N])


def _trn2_block_k(p, lhsT, rhs, res, K, M, N, dt, q, bm=16, bn=2, bk=8):
    _check(K, M, N, bm, bn, bk)
    BM, BN, BK = TILE_M * bm, TILE_N * bn, TILE_K * bk
    nbm, nbn, nbk = M // BM, N // BN, K // BK
    ps = _Ring(p, (TILE_M, TILE_N), "float32", RING_DEPTH["psum"], "psum")
    for n in range(nbn):
        accs = [[p.sbuf((TILE_M, TILE_N), dt) for _ in range(bn)] for _ in range(nbm * bm)]
        for row in accs:
            for t in row:
                p.memset(t, 0.0)
        for k in range(nbk):                  # sequential_range
            rts = [p.sbuf((TILE_K, BN), dt) for _ in range(bk)]
            for j in range(bk):
                k0 = (k * bk + j) * TILE_K
                p.dma_copy(rts[j], rhs[k0:k0 + TILE_K, n * BN:(n + 1) * BN], queue=q.rhs)
            for m in range(nbm):
                lts = [p.sbuf((TILE_K, BM), dt) for _ in range(bk)]
                for j in range(bk):
                    k0 = (k * bk + j) * TILE_K
                    p.dma_copy(lts[j], lhsT[k0:k0 + TILE_K, m * BM:(m + 1) * BM], queue=q.lhs)
                for jn in range(bn):
                    for im in range(bm):
                        acc = ps.next()
                        for j in range(bk):
                            p.matmul(acc, lts[j][:, im * TILE_M:(im + 1) * TILE_M],
                                     rts[j][:, jn * TILE_N:(jn + 1) * TILE_N], accumulate=j > 0, stop=j == bk - 1)
                        dst = accs[m * bm + im][jn]
                        p.tensor_tensor(dst, dst, acc, "add")
                for t in lts:
                    p.free(t)
            for t in rts:
                p.free(t)
        for m in range(nbm):
            for im in range(bm):
                row = p.sbuf((TILE_M, BN), dt)
                for jn in range(bn):          # coalesce the N-tiles of a row block (tensor_copy), one store
                    p.tensor_copy(row[:, jn * TILE_N:(jn + 1) * TILE_N], accs[m * bm + im][jn],
                                  engine=TRN2_COPY_ENGINE)
                mt = m * bm + im
                p.dma_copy(res[mt * TILE_M:(mt + 1) * TILE_M, n * BN:(n + 1) * BN], row, queue=q.out)
                p.free(row)
        for row in accs:
            for t in row:
                p.free(t)


_TRN2_BUILDERS = {"tiled": _trn2_tiled, "hoist_load": _trn2_hoist_load, "block_free": _trn2_block_free,
                  "block_k": _trn2_block_k}


def build_trn2(version: str, K: int = 8192, M: int = 4096, N: int = 8192, *, io_queues: int = 1, arch="trn2",
               **blocks) -> Program:
    """The kernel-optimization guide's trn2 kernel ``version`` (one of :data:`TRN2_VERSIONS`) as a
    :class:`Program` on trn2 with fp32 HBM inputs ``lhsT [K, M]``, ``rhs [K, N]`` and fp32 output
    ``result [M, N]`` (fp32 matmuls, no casts, as published). Default shape: the guide's profiled run.
    ``io_queues``: 1 (every transfer on :data:`IO_QUEUE`, :data:`IO_QUEUE_RULE`) or 2 (rhs loads on a second
    queue, to compare only). ``blocks``: tiles per block (``bm``, ``bn`` for ``block_free``, default
    2, 2; ``bm``, ``bn``, ``bk`` for ``block_k``, default 16, 2, 8), e.g. for a small numerics check. ``arch``:
    ``"trn2"`` or a NeuronCore-v3 :class:`tn.neuron.arch.Arch` (e.g. one with another DMA cost constant, to
    compare a cost rule: ``bench/fidelity.py``); the kernels' tile sets are sized for trn2's SBUF."""
    if version not in _TRN2_BUILDERS:
        raise NeuronError(f"nki_matmul: unknown trn2 version {version!r}; use one of {', '.join(TRN2_VERSIONS)}")
    if get_arch(arch).generation != TRN2.generation:
        raise NeuronError(f"nki_matmul: the trn2 kernels are sized for a NeuronCore-v3 (trn2), not "
                          f"{get_arch(arch).name!r}")
    p = Program(f"nki_matmul_trn2_{version}", arch=arch, record_sources=False)
    lhsT = p.hbm("lhsT", (K, M), "float32")
    rhs = p.hbm("rhs", (K, N), "float32")
    res = p.hbm("result", (M, N), "float32", kind="output")
    _TRN2_BUILDERS[version](p, lhsT, rhs, res, K, M, N, "float32", _Queues(io_queues), **blocks)
    return p


def build(version: str, K: int = 8192, M: int = 4096, N: int = 8192, *, arch="trn1", dtype="bfloat16",
          io_queues: int = 1, **blocks) -> Program:
    """The tutorial's kernel ``version`` (one of :data:`VERSIONS`) as a :class:`Program` with HBM inputs
    ``lhsT [K, M]``, ``rhs [K, N]`` and output ``result [M, N]`` (``result = lhsT^T @ rhs``, fp32 accumulation,
    result in ``dtype``). Default shape and arch: the tutorial's benchmark. ``io_queues``: 1 (every transfer on
    :data:`IO_QUEUE`, :data:`IO_QUEUE_RULE`) or 2 (rhs loads on a second queue, to compare only). ``blocks``: the
    tutorial's meta-parameters, tiles per block (``bm``, ``bn`` for ``block_free``, default 2, 2; ``bm``, ``bn``,
    ``bk`` for ``fully_optimized``, default 16, 2, 8), e.g. to check the numerics at a small shape."""
    if version not in _BUILDERS:
        raise NeuronError(f"nki_matmul: unknown version {version!r}; use one of {', '.join(VERSIONS)}")
    p = Program(f"nki_matmul_{version}", arch=arch, record_sources=False)
    lhsT = p.hbm("lhsT", (K, M), dtype)
    rhs = p.hbm("rhs", (K, N), dtype)
    res = p.hbm("result", (M, N), dtype, kind="output")
    _BUILDERS[version](p, lhsT, rhs, res, K, M, N, dtype, _Queues(io_queues), **blocks)
    return p
