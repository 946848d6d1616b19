# Hand-written NeuronCore programs (tiled bf16 matmul, fused layer norm): references for the compiler and the bench.
"""Hand-written NeuronCore programs, built with :class:`tn.neuron.Program`.

They show what a good schedule for the software NeuronCore looks like, and
they are what ``bench/neuroncore.py`` runs.

:func:`tiled_matmul`
    ``c[M, N] = aT[K, M]^T @ b[K, N]``: the left operand is given transposed
    (``aT = A.T``, K on partitions), the stationary layout TensorE wants, as in
    NKI's matmul tutorial. Schedule:

    * the output is cut into 128 x ``ntile`` blocks (``ntile`` = 512, one PSUM
      bank); a *wave* is a set of m-blocks of one column block, each
      accumulating over K in its own PSUM bank (``accumulate`` after the first
      K-tile, ``stop`` on the last). The first wave takes 8 m-blocks, so one
      moving tile feeds 8 matmuls and the cold start is compute-bound; the
      others take 4;
    * the first two waves sweep K outside the blocks, so they start as soon as
      the first K-tiles land; later waves, whose operands were loaded ahead,
      finish one block at a time so its evacuation overlaps the next block;
    * ``aT`` stays resident in SBUF once loaded (the first pass over column
      blocks streams it in); moving blocks live in a ring of SBUF buffers and
      the next one is prefetched during the last wave of the current one
      (double buffering). Loads are throttled to about two waves ahead so the
      shared DMA bandwidth goes to what TensorE needs next;
    * PSUM banks rotate over all 8 banks, so TensorE starts the next block
      while VectorE and ScalarE (alternating) evacuate finished banks to SBUF
      (casting to the output dtype) and DMA writes them to HBM;
    * loads and stores use separate DMA queues, so a store waiting for its
      evacuation never holds up a load behind it. The loads are spread over
      12 queues and the stores over 4: tn's choice for the software core.
      An NKI kernel cannot ask for that: the docs tie a transfer's queue to
      its trigger engine and descriptor generation (see
      :data:`tn.neuron.nki_matmul.IO_QUEUE_RULE`), and under the per-queue
      DMA minimum (an *assumption* in :mod:`tn.neuron.arch`) the spread lets
      small transfers go faster than one queue would.

:func:`layer_norm`
    ``y = (x - mean) / sqrt(var + eps) * gamma + beta`` over the last axis,
    rows on partitions (128 rows per tile): ``bn_stats``/``bn_aggr`` on
    VectorE, ``rsqrt`` and the normalisation ``x * rstd + (-mean * rstd)`` on
    ScalarE, ``* gamma`` split between VectorE and GpSimd (balanced by the cost
    formulas) and ``+ beta`` on GpSimd, with a ring of
    tiles so the DMA of the next row tile overlaps the current one.

:func:`run_matmul` and :func:`run_layer_norm` build (cached per shape), bind
host arrays and run them, returning the output and the
:class:`~tn.neuron.runtime.RunResult`.
"""
from __future__ import annotations

import functools

import numpy as np

from ..errors import NeuronError
from .program import Program
from .runtime import from_bf16, run, to_bf16

__all__ = ["tiled_matmul", "layer_norm", "run_matmul", "run_layer_norm", "matmul_flops", "layer_norm_flops"]

P = 128            # partitions; K tile and m-block height
MAX_NTILE = 512    # moving free size: one PSUM bank of fp32
GROUPS = 4         # m-blocks (PSUM banks) of a wave after the first
LOAD_QUEUES = 12   # DMA queues 0..11 load, 12..15 store
KT_OUTER_WAVES = 1  # waves (after the first) of the first pass that also sweep K outside


def matmul_flops(M: int, K: int, N: int) -> int:
    """FLOPs of an ``M x K @ K x N`` matmul (2 per multiply-add)."""
    return 2 * M * K * N


def layer_norm_flops(rows: int, dim: int) -> int:
    """Nominal FLOPs of a layer norm: mean, variance, normalise, scale, shift (~8 per element)."""
    return 8 * rows * dim


def tiled_matmul(M: int = 2048, K: int = 2048, N: int = 2048, *, dtype: str = "bfloat16",
                 out_dtype: str = "bfloat16", a_layout: str = "KM", arch=None, name: str = None) -> Program:
    """Program for ``c[M, N] = A[M, K] @ b[K, N]`` (HBM tensors ``aT`` or ``a``, ``b`` inputs, ``c`` output).

    ``a_layout="KM"`` (default): the left operand is the HBM tensor ``aT``
    [K, M] (A transposed, TensorE's stationary layout). ``a_layout="MK"``: it is
    ``a`` [M, K] as stored, and TensorE transposes it block by block (into three
    PSUM banks reserved for that, then copied to SBUF by VectorE/ScalarE), which
    costs TensorE time.
    ``M`` and ``K`` must be multiples of 128; ``N`` a multiple of 512 or at
    most 512. ``dtype`` is the input dtype (``bfloat16`` or ``float32``),
    accumulation is fp32 in PSUM, ``out_dtype`` the dtype of ``c``.
    """
    if a_layout not in ("KM", "MK"):
        raise NeuronError(f"tiled_matmul: a_layout={a_layout!r} must be 'KM' (aT given) or 'MK' (A given)")
    if M < 1 or K < 1 or N < 1 or M % P or K % P:
        raise NeuronError(f"tiled_matmul: M={M} and K={K} must be positive multiples of {P} (pad the operands)")
    ntile = min(N, MAX_NTILE)
    if N % ntile:
        raise NeuronError(f"tiled_matmul: N={N} must be at most {MAX_NTILE} or a multiple of it (pad b)")
    prog = Program(name or f"tiled_matmul_{M}x{K}x{N}_{dtype}", arch)
    arch_ = prog.arch
    KT, MB, NB = K // P, M // P, N // ntile
    G = min(GROUPS, MB)
    esz = 2 if dtype in ("bfloat16", "bf16", "float16", "fp16") else 4
    osz = 2 if out_dtype in ("bfloat16", "bf16", "float16", "fp16") else 4

    mk = a_layout == "MK"
    if mk:
        a = prog.hbm("a", (M, K), dtype)
    else:
        aT = prog.hbm("aT", (K, M), dtype)
    b = prog.hbm("b", (K, N), dtype)
    c = prog.hbm("c", (M, N), out_dtype, kind="output")

    # SBUF budget per partition: resident aT (and, for MK, a ring of six A row chunks of one PSUM bank each),
    # a ring of output staging tiles, then as many moving blocks as fit
    a_bytes = KT * M * esz + (6 * arch_.psum_bank_bytes if mk else 0)
    stage_n = 8
    stage_bytes = stage_n * ntile * osz
    blk_bytes = KT * ntile * esz
    room = arch_.sbuf_partition_bytes - a_bytes - stage_bytes
    nbuf = min(NB, room // blk_bytes) if room > 0 else 0
    if nbuf < 1 or (NB > 1 and nbuf < 2):
        raise NeuronError(
            f"tiled_matmul: aT ({a_bytes} B/partition) plus two moving blocks ({blk_bytes} B each) do not fit in "
            f"{arch_.sbuf_partition_bytes} B of SBUF per partition; split M or K and run several programs")
    a_sb = prog.sbuf((P, KT, M), dtype, name="aT")
    b_sb = [prog.sbuf((P, KT, ntile), dtype, name=f"b{i}") for i in range(nbuf)]
    stage = [prog.sbuf((P, ntile), out_dtype, name=f"out{i}") for i in range(stage_n)]
    n_tbanks = 3 if mk else 0
    banks = [prog.psum((P, ntile), name=f"bank{i}") for i in range(arch_.psum_banks - n_tbanks)]
    slots = arch_.psum_bank_bytes // (P * esz)  # transposed 128x128 blocks per PSUM bank
    tbanks = [prog.psum((P, slots * P), dtype, name=f"tbank{i}") for i in range(n_tbanks)]
    a_rows = [prog.sbuf((P, slots * P), dtype, name=f"arows{i}") for i in range(6)] if mk else []

    load_q = [0]
    store_q = [0]
    n_store_q = max(1, arch_.dma_queues - LOAD_QUEUES)
    n_load_q = arch_.dma_queues - n_store_q if arch_.dma_queues > n_store_q else arch_.dma_queues

    # Loads are throttled (they wait for an earlier wave to start on TensorE) so that the shared DMA bandwidth
    # goes to what TensorE needs next, not to data for much later waves.
    throttle = []

    def load(dst, src):
        """A load on the next load queue, throttled."""
        q = load_q[0] % n_load_q
        load_q[0] += 1
        return prog.dma_copy(dst, src, queue=q, deps=throttle)

    def store(dst, src):
        """A store on the next store queue."""
        q = (n_load_q + store_q[0] % n_store_q) % arch_.dma_queues
        store_q[0] += 1
        return prog.dma_copy(dst, src, queue=q)

    def load_b(nb, kt):
        """Moving block nb, K-tile kt, into its ring buffer."""
        load(b_sb[nb % nbuf][:, kt, :], b[kt * P:(kt + 1) * P, nb * ntile:(nb + 1) * ntile])

    # waves of m-blocks: the very first wave is as wide as PSUM allows (one moving tile feeds up to 8 matmuls,
    # so the cold start is compute-bound rather than DMA-bound), the others take GROUPS blocks
    first_w = min(MB, len(banks))
    waves = [list(range(first_w))] + [list(range(m, min(MB, m + G))) for m in range(first_w, MB, G)]

    def load_a(kt, mbs):
        """KM layout: aT K-tile kt for m-blocks ``mbs`` (MK builds aT by transposes instead)."""
        if not mk:
            m0, m1 = mbs[0] * P, (mbs[-1] + 1) * P
            load(a_sb[:, kt, m0:m1], aT[kt * P:(kt + 1) * P, m0:m1])

    tcount = [0]

    def transpose_chunk(mbs, kt0):
        """MK layout: aT blocks (K-tiles kt0.., m-blocks ``mbs``) by TensorE transposes of A's row blocks."""
        n = min(slots, KT - kt0)
        for mb in mbs:
            rows = a_rows[tcount[0] % len(a_rows)]
            load(rows[:, :n * P], a[mb * P:(mb + 1) * P, kt0 * P:(kt0 + n) * P])
            tb = tbanks[tcount[0] % n_tbanks]
            for s_ in range(n):
                prog.transpose(tb[:, s_ * P:(s_ + 1) * P], rows[:, s_ * P:(s_ + 1) * P])
            prog.tensor_copy(a_sb[:, kt0:kt0 + n, mb * P:(mb + 1) * P], tb[:, :n * P].reshape(P, n, P),
                             engine="vector" if tcount[0] % 2 == 0 else "scalar")
            tcount[0] += 1

    def transpose_a(mbs):
        """MK layout: every K-tile of aT for m-blocks ``mbs``."""
        for kt0 in range(0, KT, slots):
            transpose_chunk(mbs, kt0)

    group = [0]

    def evacuate(bank, mb, nb):
        """Finished bank -> SBUF (output dtype; VectorE and ScalarE in turn) -> HBM block (mb, nb)."""
        st = stage[group[0] % stage_n]
        prog.tensor_copy(st, bank, engine="vector" if group[0] % 2 == 0 else "scalar")
        store(c[mb * P:(mb + 1) * P, nb * ntile:(nb + 1) * ntile], st)
        group[0] += 1

    bank_i = 0
    firsts = []  # first matmul of every wave so far
    if mk:
        transpose_chunk(waves[0], 0)
    for nb in range(NB):
        for w, mbs in enumerate(waves):
            # MK layout: TensorE transposes the next wave's blocks halfway through this one (first pass only)
            half = (lambda: transpose_a(waves[w + 1])) if mk and nb == 0 and w + 1 < len(waves) else (lambda: None)
            # loads for this wave are issued two waves ahead (it consumes them block by block, so they must
            # all have landed when it starts)
            throttle[:] = firsts[-2:-1]
            wave_banks = []
            for _ in mbs:
                wave_banks.append(banks[bank_i % len(banks)])
                bank_i += 1
            wave_mm = []
            bt = b_sb[nb % nbuf]
            if nb == 0 and w <= KT_OUTER_WAVES:
                # cold start: data arrives K-tile by K-tile, so sweep K outside and the blocks inside
                for kt in range(KT):
                    load_a(kt, mbs)
                    if w == 0:
                        load_b(0, kt)
                        if mk and kt % slots == 0 and kt + slots < KT:
                            transpose_chunk(mbs, kt + slots)  # one chunk ahead of the matmuls that need it
                    for j, mb in enumerate(mbs):
                        wave_mm.append(prog.matmul(wave_banks[j], a_sb[:, kt, mb * P:(mb + 1) * P], bt[:, kt, :],
                                                   accumulate=kt > 0, stop=kt == KT - 1))
                    if kt == (KT - 1) // 2:
                        half()
                for j, mb in enumerate(mbs):
                    evacuate(wave_banks[j], mb, nb)
            else:
                # operands loaded a wave ahead: finish one block at a time so its evacuation overlaps the next
                if nb == 0:
                    for kt in range(KT):
                        load_a(kt, mbs)
                for j, mb in enumerate(mbs):
                    for kt in range(KT):
                        wave_mm.append(prog.matmul(wave_banks[j], a_sb[:, kt, mb * P:(mb + 1) * P], bt[:, kt, :],
                                                   accumulate=kt > 0, stop=kt == KT - 1))
                    evacuate(wave_banks[j], mb, nb)
                    if j == (len(mbs) - 1) // 2:
                        half()
            if nb + 1 < NB and w == len(waves) - 1:
                for kt in range(KT):        # prefetch the next moving block (lands in the other buffer)
                    load_b(nb + 1, kt)
            firsts.append(wave_mm[0])
    return prog


def _stats_chunk(dim: int, limit: int) -> int:
    """Largest divisor of ``dim`` that is at most ``limit`` (bn_stats free-size limit)."""
    f = min(dim, limit)
    while dim % f:
        f -= 1
    return f


def _gamma_split(dim: int, fc: int, nch: int, arch) -> int:
    """Columns of the ``* gamma`` multiply to give VectorE (the rest go to GpSimd) so both engines finish
    together, from the cost formulas: VectorE also runs bn_stats/bn_aggr/tensor_scalar, GpSimd the ``+ beta``."""
    ac = arch.access_cycles
    v_fixed = nch * (max(64, fc) + ac) + (max(64, 3 * nch) + ac) + (64 + ac) + ac
    g_fixed = (max(64, 2 * dim) + ac) + ac
    fv, fg = arch.clock_hz["dve"], arch.clock_hz["pool"]
    # (v_fixed + 2h) / fv == (g_fixed + 2 (dim - h)) / fg
    h = (fv * (g_fixed + 2 * dim) - fg * v_fixed) / (2 * (fv + fg))
    return int(min(dim, max(0, round(h / 32) * 32)))


def layer_norm(rows: int, dim: int, *, dtype: str = "float32", eps: float = 1e-5, arch=None,
               name: str = None, bufs: int = 3) -> Program:
    """Program for a layer norm over the last axis: HBM ``x`` [rows, dim], ``gamma`` [dim], ``beta`` [dim]
    (inputs, ``dtype``) and ``y`` [rows, dim] (output, ``dtype``). Statistics are fp32."""
    if rows < 1 or dim < 1:
        raise NeuronError(f"layer_norm: rows={rows} and dim={dim} must be positive")
    prog = Program(name or f"layer_norm_{rows}x{dim}_{dtype}", arch)
    arch_ = prog.arch
    if dim > arch_.max_free_elems:
        raise NeuronError(f"layer_norm: dim={dim} exceeds the {arch_.max_free_elems}-element free-size limit of "
                          f"VectorE/ScalarE instructions; split the feature axis")
    x = prog.hbm("x", (rows, dim), dtype)
    gamma = prog.hbm("gamma", (dim,), dtype)
    beta = prog.hbm("beta", (dim,), dtype)
    y = prog.hbm("y", (rows, dim), dtype, kind="output")

    pr = min(P, rows)
    g_sb = prog.sbuf((pr, dim), dtype, name="gamma")
    b_sb = prog.sbuf((pr, dim), dtype, name="beta")
    prog.dma_copy(g_sb, gamma.reshape(1, dim).broadcast_to((pr, dim)))   # same row on every partition
    prog.dma_copy(b_sb, beta.reshape(1, dim).broadcast_to((pr, dim)))

    fc = _stats_chunk(dim, arch_.bn_stats_max_free)
    nch = dim // fc
    h = _gamma_split(dim, fc, nch, arch_)
    ring = []
    for i in range(max(1, bufs)):
        ring.append(dict(
            x=prog.sbuf((pr, dim), dtype, name=f"x{i}"),
            t=prog.sbuf((pr, dim), "float32", name=f"t{i}"),
            y=prog.sbuf((pr, dim), dtype, name=f"y{i}"),
            st=prog.sbuf((pr, nch, 3), "float32", name=f"stats{i}"),
            mv=prog.sbuf((pr, 2), "float32", name=f"mv{i}"),
            rstd=prog.sbuf((pr, 1), "float32", name=f"rstd{i}"),
            nb=prog.sbuf((pr, 1), "float32", name=f"nbias{i}"),
        ))
    for i, r0 in enumerate(range(0, rows, P)):
        n = min(P, rows - r0)
        t = ring[i % len(ring)]
        xt, tt, yt = t["x"][:n], t["t"][:n], t["y"][:n]
        prog.dma_copy(xt, x[r0:r0 + n])
        for ch in range(nch):
            prog.bn_stats(t["st"][:n, ch, :], xt[:, ch * fc:(ch + 1) * fc])
        prog.bn_aggr(t["mv"][:n], t["st"][:n].reshape(n, nch * 3))
        mean, var = t["mv"][:n, 0:1], t["mv"][:n, 1:2]
        prog.activation(t["rstd"][:n], var, "rsqrt", bias=float(eps))                 # 1/sqrt(var + eps)
        prog.tensor_scalar(t["nb"][:n], mean, "multiply", t["rstd"][:n], "multiply", -1.0)  # -mean*rstd
        prog.activation(tt, xt, "identity", scale=t["rstd"][:n], bias=t["nb"][:n])    # (x - mean) * rstd
        if 0 < h < dim:  # * gamma split between VectorE and GpSimd to balance them
            prog.tensor_tensor(tt[:, :h], tt[:, :h], g_sb[:n, :h], "multiply", engine="vector")
            prog.tensor_tensor(tt[:, h:], tt[:, h:], g_sb[:n, h:], "multiply", engine="gpsimd")
        else:
            prog.tensor_tensor(tt, tt, g_sb[:n], "multiply", engine="vector")
        prog.tensor_tensor(yt, tt, b_sb[:n], "add", engine="gpsimd")
        prog.dma_copy(y[r0:r0 + n], yt)
    return prog


# ---------------------------------------------------------------------- host helpers

@functools.lru_cache(maxsize=16)
def _built_matmul(M, K, N, dtype, out_dtype, a_layout, arch):
    return tiled_matmul(M, K, N, dtype=dtype, out_dtype=out_dtype, a_layout=a_layout, arch=arch).build()


@functools.lru_cache(maxsize=16)
def _built_layer_norm(rows, dim, dtype, eps, arch):
    return layer_norm(rows, dim, dtype=dtype, eps=eps, arch=arch).build()


def _np(x):
    """A torch tensor or array-like as a float32 numpy array."""
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float32)


def _to_device_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    return np.ascontiguousarray(to_bf16(x) if dtype in ("bfloat16", "bf16") else x.astype(np.float32))


def _from_device_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    return from_bf16(x) if dtype in ("bfloat16", "bf16") else np.asarray(x, dtype=np.float32)


def run_matmul(a, b, *, dtype: str = "bfloat16", out_dtype: str = "bfloat16", a_layout: str = "KM", arch=None):
    """``a @ b`` on the software NeuronCore with :func:`tiled_matmul`; returns ``(c as float32 numpy, RunResult)``.

    ``a`` [M, K] and ``b`` [K, N] are numpy arrays or torch tensors; they are
    rounded to ``dtype`` on the host. With ``a_layout="KM"`` the host passes
    ``a`` transposed; with ``"MK"`` the program transposes it on TensorE.
    """
    a, b = _np(a), _np(b)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise NeuronError(f"run_matmul: shapes {a.shape} @ {b.shape} do not form a matrix product")
    M, K = a.shape
    N = b.shape[1]
    enc = _built_matmul(M, K, N, dtype, out_dtype, a_layout, arch)
    left = {"aT": _to_device_dtype(np.ascontiguousarray(a.T), dtype)} if a_layout == "KM" else {
        "a": _to_device_dtype(a, dtype)}
    res = run(enc, {**left, "b": _to_device_dtype(b, dtype)})
    return _from_device_dtype(res.outputs["c"], out_dtype), res


def run_layer_norm(x, gamma, beta, *, eps: float = 1e-5, dtype: str = "float32", arch=None):
    """Layer norm of ``x`` [rows, dim] with :func:`layer_norm`; returns ``(y as float32 numpy, RunResult)``."""
    x, gamma, beta = _np(x), _np(gamma), _np(beta)
    if x.ndim != 2 or gamma.shape != (x.shape[1],) or beta.shape != (x.shape[1],):
        raise NeuronError(f"run_layer_norm: x must be [rows, dim] and gamma/beta [dim]; got {x.shape}, "
                          f"{gamma.shape}, {beta.shape}")
    enc = _built_layer_norm(x.shape[0], x.shape[1], dtype, float(eps), arch)
    res = run(enc, {"x": _to_device_dtype(x, dtype), "gamma": _to_device_dtype(gamma, dtype),
                    "beta": _to_device_dtype(beta, dtype)})
    return _from_device_dtype(res.outputs["y"], dtype), res
