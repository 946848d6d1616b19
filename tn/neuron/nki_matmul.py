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
compute of earlier ones as far as the ring allows. Every load and store goes
on one DMA queue (:data:`IO_QUEUE`), as the compiler's ``qSyncIO0`` in the
published profiles: one in-order stream, so the DMA engines' per-transfer
minimum (:attr:`tn.neuron.arch.Arch.dma_transfer_min_ns`) bounds the rate of
the small transfers of v1-v3.
"""
from __future__ import annotations

from .program import Program

__all__ = ["VERSIONS", "RING_DEPTH", "IO_QUEUE", "build"]

#: Tutorial versions in published order.
VERSIONS = ("tiled", "hoist_load", "block_free", "fully_optimized")
#: Buffers per tile allocated in a loop (*assumption*: the compiler's choice, see the module docstring).
RING_DEPTH = {"tile": 4, "psum": 4, "k_column": 2}

TILE_K, TILE_M, TILE_N = 128, 128, 512
#: DMA queue of every load and store: the NKI compiler puts a kernel's ``nl.load``/``nl.store`` transfers on one
#: queue triggered by the Sync engine (``qSyncIO0`` in the profiles of nki/deep-dives/nki_perf_guide.rst, "Opt
#: #4" and nki/guides/tutorials/fused_mamba.rst), so they run in order, one stream.
IO_QUEUE = 0


def _io(p, dst, src):
    """One kernel IO transfer (``nl.load`` / ``nl.store``) on the IO queue."""
    return p.dma_copy(dst, src, queue=IO_QUEUE)


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
            from ..errors import NeuronError

            raise NeuronError(f"nki_matmul: {name}={v} must be a multiple of {t} for this version")


def _evacuate_store(p, ring_out, psum_tile, result_view):
    """PSUM -> SBUF in the result dtype on VectorE (``nl.copy``), then SBUF -> HBM (``nl.store``)."""
    sb = ring_out.next()
    p.tensor_copy(sb, psum_tile)
    _io(p, result_view, sb)


def _tiled(p, lhsT, rhs, res, K, M, N, dt):
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
                _io(p, a, lhsT[k * TILE_K:(k + 1) * TILE_K, m * TILE_M:(m + 1) * TILE_M])
                _io(p, b, rhs[k * TILE_K:(k + 1) * TILE_K, n * TILE_N:(n + 1) * TILE_N])
                p.matmul(acc, a, b, accumulate=k > 0, stop=k == nk - 1)
            _evacuate_store(p, out, acc, res[m * TILE_M:(m + 1) * TILE_M, n * TILE_N:(n + 1) * TILE_N])


def _hoist_load(p, lhsT, rhs, res, K, M, N, dt):
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
            _io(p, a[k], lhsT[k * TILE_K:(k + 1) * TILE_K, m * TILE_M:(m + 1) * TILE_M])
        for n in range(N // TILE_N):
            b = [rcols[k].next() for k in range(nk)]
            for k in range(nk):
                _io(p, b[k], rhs[k * TILE_K:(k + 1) * TILE_K, n * TILE_N:(n + 1) * TILE_N])
            acc = ps.next()
            for k in range(nk):
                p.matmul(acc, a[k], b[k], accumulate=k > 0, stop=k == nk - 1)
            _evacuate_store(p, out, acc, res[m * TILE_M:(m + 1) * TILE_M, n * TILE_N:(n + 1) * TILE_N])


def _block_free(p, lhsT, rhs, res, K, M, N, dt, bm=2, bn=2):
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
                _io(p, lts[i][k], lhsT[k * TILE_K:(k + 1) * TILE_K, mt * TILE_M:(mt + 1) * TILE_M])
        for n in range(N // (TILE_N * bn)):
            for j in range(bn):
                nt = n * bn + j
                for k in range(nk):
                    _io(p, rts[j][k], rhs[k * TILE_K:(k + 1) * TILE_K, nt * TILE_N:(nt + 1) * TILE_N])
            for i in range(bm):
                for j in range(bn):
                    acc = ps.next()
                    for k in range(nk):
                        p.matmul(acc, lts[i][k], rts[j][k], accumulate=k > 0, stop=k == nk - 1)
                    mt, nt = m * bm + i, n * bn + j
                    _evacuate_store(p, out, acc, res[mt * TILE_M:(mt + 1) * TILE_M, nt * TILE_N:(nt + 1) * TILE_N])


def _fully_optimized(p, lhsT, rhs, res, K, M, N, dt, bm=16, bn=2, bk=8):
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
                _io(p, rt[:, j, :], rhs[k0:k0 + TILE_K, n * BN:(n + 1) * BN])
            for m in range(nbm):
                lt = lring.next()
                for j in range(bk):
                    k0 = (k * bk + j) * TILE_K
                    _io(p, lt[:, j, :], lhsT[k0:k0 + TILE_K, m * BM:(m + 1) * BM])
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
                _io(p, res[mt * TILE_M:(mt + 1) * TILE_M, n * BN:(n + 1) * BN], row)


_BUILDERS = {"tiled": _tiled, "hoist_load": _hoist_load, "block_free": _block_free,
             "fully_optimized": _fully_optimized}


def build(version: str, K: int = 8192, M: int = 4096, N: int = 8192, *, arch="trn1", dtype="bfloat16",
          **blocks) -> Program:
    """The tutorial's kernel ``version`` (one of :data:`VERSIONS`) as a :class:`Program` with HBM inputs
    ``lhsT [K, M]``, ``rhs [K, N]`` and output ``result [M, N]`` (``result = lhsT^T @ rhs``, fp32 accumulation,
    result in ``dtype``). Default shape and arch: the tutorial's benchmark. ``blocks``: the tutorial's
    meta-parameters, tiles per block (``bm``, ``bn`` for ``block_free``, default 2, 2; ``bm``, ``bn``, ``bk``
    for ``fully_optimized``, default 16, 2, 8), e.g. to check the numerics at a small shape."""
    if version not in _BUILDERS:
        from ..errors import NeuronError

        raise NeuronError(f"nki_matmul: unknown version {version!r}; use one of {', '.join(VERSIONS)}")
    p = Program(f"nki_matmul_{version}", arch=arch, record_sources=False)
    lhsT = p.hbm("lhsT", (K, M), dtype)
    rhs = p.hbm("rhs", (K, N), dtype)
    res = p.hbm("result", (M, N), dtype, kind="output")
    _BUILDERS[version](p, lhsT, rhs, res, K, M, N, dtype, **blocks)
    return p
