# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# The Cython engine of the software NeuronCore: validates, executes and times a whole encoded instruction stream.
"""Native runner of encoded NeuronCore programs.

:func:`run` walks an encoded program (see :mod:`tn.neuron.isa` for the record
layout) once, in program order. For every instruction it

1. decodes and checks every operand against its memory (SBUF/PSUM geometry,
   the bound HBM buffer) and the instruction's rules, raising
   :class:`tn.NeuronError` with the instruction, operand and limit on a
   violation (a malformed stream raises, it never reads or writes out of bounds);
2. calls the C kernel that computes it (``kernels.c``, ``matmul.c``);
3. times it: start = max(its queue is free, every dependency has ended);
   end = start + issue interval + result latency (compute engines) or when the
   data has landed (DMA: latency, per-engine bandwidth, HBM bandwidth); see
   :mod:`tn.neuron.arch` for the model and its sources.

:func:`check` runs step 1 alone on one record (the builder calls it as each
instruction is emitted).
"""
from libc.stdint cimport int64_t, int32_t, uint16_t
from libc.stdlib cimport malloc, calloc, free, realloc
from libc.string cimport memcpy
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

import numpy as np

cdef extern from "kernels.h":
    int tn_abi_version()
    ctypedef struct tn_ap:
        char *base
        int64_t pstride
        int64_t num[4]
        int64_t stride[4]
        int32_t dtype
        int32_t esize
    int tn_copy_bytes(const tn_ap *dst, const tn_ap *src, int64_t nparts) nogil
    int tn_tensor_copy(const tn_ap *out, const tn_ap *inp, int64_t nparts) nogil
    int tn_gather_rows(const tn_ap *dst, const tn_ap *table, int64_t table_rows, const tn_ap *idx,
                       int64_t nparts, int64_t *bad_index) nogil
    int tn_tensor_tensor(int op, const tn_ap *out, const tn_ap *a, const tn_ap *b, int64_t nparts) nogil
    int tn_tensor_scalar(const tn_ap *out, const tn_ap *inp, int op0, const tn_ap *s0, double imm0,
                         int op1, const tn_ap *s1, double imm1, int flags, int64_t nparts) nogil
    int tn_activation(int func, const tn_ap *out, const tn_ap *inp, const tn_ap *bias, double bias_imm,
                      const tn_ap *scale, double scale_imm, int reduce_op, const tn_ap *reduce_out,
                      int64_t nparts) nogil
    int tn_tensor_reduce(int op, const tn_ap *out, const tn_ap *inp, int nred, int64_t nparts) nogil
    int tn_select(const tn_ap *out, const tn_ap *pred, const tn_ap *a, const tn_ap *b, int64_t nparts) nogil
    int tn_iota(const tn_ap *out, const double *coef, int64_t nparts) nogil
    int tn_affine_select(int cmp, const tn_ap *out, const tn_ap *inp, const double *coef, double fill,
                         int64_t nparts) nogil
    int tn_memset(const tn_ap *out, double value, int64_t nparts) nogil
    int tn_bn_stats(const tn_ap *out, const tn_ap *inp, int64_t nparts) nogil
    int tn_bn_aggr(const tn_ap *out, const tn_ap *inp, int64_t nparts) nogil
    int tn_partition_reduce(int op, const tn_ap *out, const tn_ap *inp, int64_t nparts_out,
                            int64_t nparts_in) nogil
    int tn_partition_shuffle(const tn_ap *out, const tn_ap *inp, const int64_t *perm, int64_t nparts_out) nogil
    int tn_transpose(const tn_ap *out, const tn_ap *inp, int64_t nparts_in) nogil
    int tn_scatter_rows(const tn_ap *table, int64_t table_rows, const tn_ap *src, const tn_ap *idx,
                        int64_t nparts, int accumulate, int64_t *bad_index) nogil
    int tn_matmul_ap(const tn_ap *psum, const tn_ap *stat, const tn_ap *mov, int64_t K, int accumulate) nogil
    int tn_matmul_set_isa(const char *name)
    const char *tn_matmul_isa()
    const char *tn_native_isa()
    const char *tn_native_clones()


def set_matmul_isa(name):
    """Choose the matmul kernel code path the engine uses ("auto", "generic", "avx2", "avx512", "amx").

    The engine links its own copy of the kernels, so this is separate from
    ``tn._native._kernels.lib.tn_matmul_set_isa``. Returns False if this CPU lacks the path.
    """
    return tn_matmul_set_isa(str(name).encode()) == 0


def matmul_isa():
    """The matmul kernel code path the engine's own copy of the kernels takes ("amx", "avx512", "avx2", "generic")."""
    return tn_matmul_isa().decode()


def native_build():
    """(TN_NATIVE_ISA, clone set) the engine's copy of the C kernels was built with (see tn._native.build_info)."""
    return tn_native_isa().decode(), tn_native_clones().decode()


def abi_version():
    """The C kernels' ABI version, as seen from the Cython engine (must match the cffi module's)."""
    return tn_abi_version()


# ---------------------------------------------------------------- layout (mirrors tn.neuron.isa)
DEF REC_WIDTH = 96
DEF OPERAND_BASE = 16
DEF OPERAND_WIDTH = 16
DEF N_OPERANDS = 5
DEF H_OPCODE = 0
DEF H_QUEUE = 1
DEF H_SUBOP = 2
DEF H_FLAGS = 3
DEF H_DEP_START = 4
DEF H_DEP_COUNT = 5
DEF H_AUX_START = 6
DEF H_AUX_COUNT = 7
DEF H_IMM = 8
DEF O_MEM = 0
DEF O_BUF = 1
DEF O_DTYPE = 2
DEF O_PSTART = 3
DEF O_PCOUNT = 4
DEF O_PSTRIDE = 5
DEF O_OFFSET = 6
DEF O_NUM0 = 8

DEF MEM_NONE = 0
DEF MEM_HBM = 1
DEF MEM_SBUF = 2
DEF MEM_PSUM = 3

DEF OP_DMA_COPY = 1
DEF OP_DMA_GATHER = 2
DEF OP_MATMUL = 3
DEF OP_TRANSPOSE = 4
DEF OP_ACTIVATION = 5
DEF OP_TENSOR_TENSOR = 6
DEF OP_TENSOR_SCALAR = 7
DEF OP_TENSOR_REDUCE = 8
DEF OP_TENSOR_COPY = 9
DEF OP_SELECT = 10
DEF OP_BN_STATS = 11
DEF OP_BN_AGGR = 12
DEF OP_IOTA = 13
DEF OP_AFFINE_SELECT = 14
DEF OP_MEMSET = 15
DEF OP_PARTITION_REDUCE = 16
DEF OP_PARTITION_SHUFFLE = 17
DEF OP_DMA_SCATTER = 18
DEF N_OPCODES = 19

DEF Q_PE = 0
DEF Q_ACT = 1
DEF Q_DVE = 2
DEF Q_POOL = 3
DEF N_ENGINES = 4

DEF F32 = 0
DEF BF16 = 1
DEF F16 = 2
DEF I32 = 3
DEF I64 = 4
DEF U8 = 5
DEF BOOL = 6

# ALU ops: 0..18 compute in fp32; 19..23 (bitwise and/or/xor, shifts) on integer words
DEF ALU_LAST = 23
DEF ALU_FIRST_INT = 19

DEF FLAG_ACCUMULATE = 1
DEF FLAG_STOP = 8
DEF FLAG_ALL = 15

DEF MAX_BANKS = 64
DEF PIPE_MAX = 512

# limits vector (tn.neuron.arch.Arch.limits_vector)
DEF L_PARTITIONS = 0
DEF L_SBUF_BYTES = 1
DEF L_PSUM_BYTES = 2
DEF L_BANK_BYTES = 3
DEF L_QUEUES = 4
DEF L_MM_K = 5
DEF L_MM_M = 6
DEF L_MM_N = 7
DEF L_MAX_FREE = 8
DEF L_BN_MAX = 9
# timing vector (tn.neuron.arch.Arch.timing_vector)
DEF T_CLK_PE = 0
DEF T_HBM_BW = 4
DEF T_DMA_FIXED = 5
DEF T_DMA_CHUNK = 6
DEF T_ACCESS = 7
DEF T_ACT_TABLE = 8
DEF T_DMA_ENGINES = 9
DEF T_DMA_ENGINE_BW = 10
DEF T_DMA_ISSUE = 11
DEF T_STATIC = 12
DEF T_FAST = 13
DEF T_SHARED_PORTS = 14
DEF T_DMA_MIN = 15
DEF N_TIMING = 16
DEF MAX_DMA_ENGINES = 32

LAYOUT = {"REC_WIDTH": REC_WIDTH, "OPERAND_BASE": OPERAND_BASE, "OPERAND_WIDTH": OPERAND_WIDTH,
          "N_OPERANDS": N_OPERANDS, "N_OPCODES": N_OPCODES}

OPCODE_NAMES = ["nop", "dma_copy", "dma_gather", "matmul", "transpose", "activation", "tensor_tensor",
                "tensor_scalar", "tensor_reduce", "tensor_copy", "select", "bn_stats", "bn_aggr", "iota",
                "affine_select", "memset", "partition_reduce", "partition_shuffle", "dma_scatter"]
OPERAND_NAMES = [(), ("dst", "src"), ("dst", "table", "indices"), ("psum", "stationary", "moving"),
                 ("psum", "in"), ("out", "in", "bias", "scale", "reduce_out"), ("out", "in0", "in1"),
                 ("out", "in", "operand0", "operand1"), ("out", "in"), ("out", "in"),
                 ("out", "pred", "on_true", "on_false"), ("out", "in"), ("out", "in"), ("out",),
                 ("out", "in"), ("out",), ("out", "in"), ("out", "in"), ("table", "src", "indices")]
ENGINE_QUEUE_NAMES = ["TensorE", "ScalarE", "VectorE", "GpSimd"]
DTYPE_NAMES = ["float32", "bfloat16", "float16", "int32", "int64", "uint8", "bool"]
MEM_NAMES = ["none", "HBM", "SBUF", "PSUM"]
cdef int64_t DSIZE[7]
DSIZE[:] = [4, 2, 2, 4, 8, 1, 1]
# how many operand slots each opcode uses, and how many are required
cdef int NSLOTS[19]
NSLOTS[:] = [0, 2, 3, 3, 2, 5, 3, 4, 2, 2, 4, 2, 2, 1, 2, 1, 2, 2, 3]
cdef int NREQ[19]
NREQ[:] = [0, 2, 3, 3, 2, 2, 3, 2, 2, 2, 4, 2, 2, 1, 2, 1, 2, 2, 3]


def _queue_name(q):
    if 0 <= q < N_ENGINES:
        return ENGINE_QUEUE_NAMES[q]
    return f"DMA{q - N_ENGINES}"


cdef object _fail(int64_t i, const int64_t *rec, int slot, str msg):
    """Raise tn.NeuronError naming instruction i, its opcode, engine and operand slot."""
    from tn.errors import NeuronError
    op = rec[H_OPCODE]
    name = OPCODE_NAMES[op] if 0 <= op < N_OPCODES else f"opcode {op}"
    where = f"instruction #{i} {name}" if i >= 0 else f"{name}"
    q = rec[H_QUEUE]
    where += f" on {_queue_name(q)}" if 0 <= q < 64 else ""
    if slot >= 0:
        names = OPERAND_NAMES[op] if 0 <= op < N_OPCODES else ()
        oname = names[slot] if slot < len(names) else f"operand {slot}"
        where += f": operand '{oname}'"
    raise NeuronError(f"{where}: {msg}")


cdef struct Ctx:
    char *sbuf
    char *psum
    int64_t sbuf_pitch       # host bytes between partitions of the SBUF/PSUM arrays: their row length, at least
    int64_t psum_pitch       # the architecture's partition size (see run())
    const int64_t *hbm_ptr
    const int64_t *hbm_size
    int64_t nbufs
    const int64_t *lim
    int execute


cdef struct Opnd:
    int present
    int mem
    int64_t buf
    int64_t pstart
    int64_t pcount
    int64_t free
    int64_t lo_byte      # SBUF/PSUM: lowest byte touched in a partition
    int64_t hi_byte      # one past the highest
    int64_t nbytes       # total bytes moved (pcount * free * esize)
    int64_t runs         # contiguous runs (DMA efficiency)
    int64_t inner_stride # stride (elements) of the innermost dim of more than one element (1 if none)
    tn_ap ap


cdef int64_t LIM_NUM = 1 << 24
cdef int64_t LIM_STRIDE = 1 << 32
cdef int64_t LIM_TOTAL = 1 << 28
cdef int64_t LIM_OFFSET = 1 << 44


cdef int need_int(int64_t i, const int64_t *rec, int slot, Opnd *o) except -1:
    """Integer ALU ops (bitwise, shifts) read and write int32, uint8 or bool operands only."""
    if o.ap.dtype != I32 and o.ap.dtype != U8 and o.ap.dtype != BOOL:
        _fail(i, rec, slot, f"dtype {DTYPE_NAMES[o.ap.dtype]} is not an integer ALU operand (int32, uint8, bool); "
              f"integer ALU ops (bitwise, shifts) work on integer words")
    return 0


cdef int decode(int64_t i, const int64_t *rec, int slot, Ctx *c, Opnd *o) except -1:
    """Decode operand `slot` of record rec into o, checking it lies inside its memory."""
    cdef const int64_t *f = rec + OPERAND_BASE + slot * OPERAND_WIDTH
    cdef int64_t mem = f[O_MEM], dt = f[O_DTYPE], es, d, num, st, lo = 0, hi = 0, nfree = 1
    cdef int64_t parts = c.lim[L_PARTITIONS], pitch, off, expect, runs, size
    cdef char *base
    o.present = 0
    if mem == MEM_NONE:
        return 0
    if mem < 0 or mem > MEM_PSUM:
        _fail(i, rec, slot, f"unknown memory code {mem} (0 none, 1 HBM, 2 SBUF, 3 PSUM)")
    if dt < 0 or dt > BOOL:
        _fail(i, rec, slot, f"unknown dtype code {dt}: use one of {DTYPE_NAMES}")
    es = DSIZE[dt]
    o.present = 1
    o.mem = <int>mem
    o.ap.dtype = <int32_t>dt
    o.ap.esize = <int32_t>es
    for d in range(4):
        num = f[O_NUM0 + 2 * d]
        st = f[O_NUM0 + 2 * d + 1]
        if num < 1 or num > LIM_NUM:
            _fail(i, rec, slot, f"free dim {d} has size {num}: sizes must be 1..{LIM_NUM}")
        if st < -LIM_STRIDE or st > LIM_STRIDE:
            _fail(i, rec, slot, f"free dim {d} stride {st} out of range (|stride| <= {LIM_STRIDE})")
        o.ap.num[d] = num
        o.ap.stride[d] = st
        nfree *= num
        if nfree > LIM_NUM:
            _fail(i, rec, slot, f"free size {nfree} exceeds {LIM_NUM} elements")
        if st >= 0:
            hi += (num - 1) * st
        else:
            lo += (num - 1) * st
    o.free = nfree
    # contiguous runs: merge inner dims while they are contiguous
    runs = nfree
    expect = 1
    o.inner_stride = 1
    for d in range(3, -1, -1):
        if o.ap.num[d] > 1:
            o.inner_stride = o.ap.stride[d]
            break
    for d in range(3, -1, -1):
        if o.ap.num[d] == 1:
            continue
        if o.ap.stride[d] != expect:
            break
        runs = runs // o.ap.num[d]
        expect *= o.ap.num[d]
    o.pstart = f[O_PSTART]
    o.pcount = f[O_PCOUNT]
    off = f[O_OFFSET]
    if off < -LIM_OFFSET or off > LIM_OFFSET:
        _fail(i, rec, slot, f"offset {off} out of range")
    if mem == MEM_HBM:
        o.buf = f[O_BUF]
        if o.buf < 0 or o.buf >= c.nbufs:
            _fail(i, rec, slot, f"HBM buffer {o.buf} does not exist ({c.nbufs} bound); declare it with Program.hbm()")
        if o.pcount < 1 or o.pcount > LIM_NUM:
            _fail(i, rec, slot, f"partition-dim size {o.pcount} must be 1..{LIM_NUM}")
        st = f[O_PSTRIDE]
        if st < -LIM_STRIDE or st > LIM_STRIDE:
            _fail(i, rec, slot, f"partition-dim stride {st} out of range")
        if st >= 0:
            hi += (o.pcount - 1) * st
        else:
            lo += (o.pcount - 1) * st
        size = c.hbm_size[o.buf]
        if off + lo < 0 or (off + hi + 1) * es > size:
            _fail(i, rec, slot, f"elements {off + lo}..{off + hi} ({DTYPE_NAMES[dt]}) fall outside HBM buffer "
                  f"{o.buf} of {size} bytes; check the view's offset and strides")
        o.ap.base = <char *>(c.hbm_ptr[o.buf] + off * es) if c.execute else NULL
        o.ap.pstride = st * es
        o.lo_byte = (off + lo) * es
        o.hi_byte = (off + hi + 1) * es
        o.runs = runs * o.pcount
    else:
        o.buf = 0
        pitch = c.lim[L_SBUF_BYTES] if mem == MEM_SBUF else c.lim[L_PSUM_BYTES]
        if o.pcount < 1 or o.pcount > parts:
            _fail(i, rec, slot, f"partition count {o.pcount} must be 1..{parts} (the partition-count limit)")
        if o.pstart < 0 or o.pstart > parts - o.pcount:   # (no int64 overflow for a huge start)
            _fail(i, rec, slot, f"partitions {o.pstart}..{o.pstart + o.pcount - 1} fall outside the {parts} "
                  f"partitions of {MEM_NAMES[mem]}")
        if off % es != 0:
            _fail(i, rec, slot, f"byte offset {off} is not aligned to the {es}-byte {DTYPE_NAMES[dt]} element "
                  f"(alignment rule)")
        if off + lo * es < 0 or off + (hi + 1) * es > pitch:
            _fail(i, rec, slot, f"bytes {off + lo * es}..{off + (hi + 1) * es - 1} of each partition fall outside "
                  f"{MEM_NAMES[mem]} ({pitch} bytes per partition); the tile does not fit")
        base = c.sbuf if mem == MEM_SBUF else c.psum
        pitch = c.sbuf_pitch if mem == MEM_SBUF else c.psum_pitch    # host layout (bounds checked above)
        o.ap.base = (base + o.pstart * pitch + off) if c.execute else NULL
        o.ap.pstride = pitch
        o.lo_byte = off + lo * es
        o.hi_byte = off + (hi + 1) * es
        o.runs = runs * o.pcount
    if o.pcount * nfree > LIM_TOTAL:
        _fail(i, rec, slot, f"{o.pcount} x {nfree} elements exceed the per-operand limit of {LIM_TOTAL}")
    o.nbytes = o.pcount * nfree * es
    return 0


cdef int quadrant(int64_t i, const int64_t *rec, int slot, Opnd *o) except -1:
    """Compute engines address partitions from a quadrant start: 0 (<=128), 32 (<=32), 64 (<=64), 96 (<=32)."""
    cdef int64_t s = o.pstart, lim
    if o.mem == MEM_HBM:
        _fail(i, rec, slot, "compute engines cannot address HBM; dma_copy the data into SBUF first")
    if s % 32 != 0:
        _fail(i, rec, slot, f"partition start {s} is not 0, 32, 64 or 96 (partition-start rule of compute engines)")
    lim = 128 if s == 0 else (64 if s == 64 else 32)
    if o.pcount > lim:
        _fail(i, rec, slot, f"{o.pcount} partitions from start {s}: at most {lim} may start there "
              f"(partition-start rule: 0->128, 32->32, 64->64, 96->32)")
    return 0


cdef int need_same_parts(int64_t i, const int64_t *rec, int slot, Opnd *o, int64_t p) except -1:
    if o.pcount != p:
        _fail(i, rec, slot, f"has {o.pcount} partitions but the output has {p}; operands must span the same partitions")
    return 0


cdef int need_free(int64_t i, const int64_t *rec, int slot, Opnd *o, int64_t n) except -1:
    if o.free != n:
        _fail(i, rec, slot, f"has free size {o.free} but {n} is required (shapes must match; use a broadcast "
              f"view with stride 0)")
    return 0


cdef int need_mem(int64_t i, const int64_t *rec, int slot, Opnd *o, int sb, int ps, int hbm) except -1:
    if (o.mem == MEM_SBUF and not sb) or (o.mem == MEM_PSUM and not ps) or (o.mem == MEM_HBM and not hbm):
        allowed = [n for n, ok in (("SBUF", sb), ("PSUM", ps), ("HBM", hbm)) if ok]
        _fail(i, rec, slot, f"is in {MEM_NAMES[o.mem]} but this instruction accepts {' or '.join(allowed)} here")
    return 0


cdef int no_int64(int64_t i, const int64_t *rec, int slot, Opnd *o) except -1:
    if o.ap.dtype == I64:
        _fail(i, rec, slot, "int64 is only allowed on DMA (copies and gather indices); use int32")
    return 0


cdef int check_record(int64_t i, const int64_t *rec, Ctx *c, Opnd *ops, int64_t ndeps, int64_t naux,
                      const int64_t *aux) except -1:
    """Validate one record: header fields, operands, and the opcode's rules. Fills ops[0..4]."""
    cdef int64_t op = rec[H_OPCODE], q = rec[H_QUEUE], sub = rec[H_SUBOP], flags = rec[H_FLAGS]
    cdef int s, nq = <int>c.lim[L_QUEUES]
    cdef int64_t P, K, M, N, bank, j, a0, ac
    cdef double nred_d
    cdef int is_dma
    if op < 1 or op >= N_OPCODES:
        _fail(i, rec, -1, f"unknown opcode {op}")
    if q < 0 or q >= nq:
        _fail(i, rec, -1, f"queue {q} does not exist (0..3 engines, 4..{nq - 1} DMA queues)")
    if flags < 0 or flags > FLAG_ALL:
        _fail(i, rec, -1, f"unknown flag bits in {flags}")
    # ranges compared without overflow (start + count could wrap int64)
    if (rec[H_DEP_COUNT] < 0 or rec[H_DEP_START] < 0 or rec[H_DEP_START] > ndeps
            or rec[H_DEP_COUNT] > ndeps - rec[H_DEP_START]):
        _fail(i, rec, -1, f"dependency range [{rec[H_DEP_START]}, +{rec[H_DEP_COUNT]}) outside the deps array ({ndeps})")
    if (rec[H_AUX_COUNT] < 0 or rec[H_AUX_START] < 0 or rec[H_AUX_START] > naux
            or rec[H_AUX_COUNT] > naux - rec[H_AUX_START]):
        _fail(i, rec, -1, f"aux range [{rec[H_AUX_START]}, +{rec[H_AUX_COUNT]}) outside the aux array ({naux})")
    is_dma = q >= N_ENGINES
    if op == OP_DMA_COPY or op == OP_DMA_GATHER or op == OP_DMA_SCATTER:
        if not is_dma:
            _fail(i, rec, -1, f"DMA instructions run on DMA queues {N_ENGINES}..{nq - 1}, not on {_queue_name(q)}")
    elif is_dma:
        _fail(i, rec, -1, "compute instructions cannot run on a DMA queue")
    elif op == OP_MATMUL or op == OP_TRANSPOSE:
        if q != Q_PE:
            _fail(i, rec, -1, "runs on TensorE only")
    elif op == OP_ACTIVATION:
        if q != Q_ACT:
            _fail(i, rec, -1, "runs on ScalarE only")
    elif op == OP_TENSOR_TENSOR or op == OP_TENSOR_SCALAR or op == OP_TENSOR_REDUCE or op == OP_MEMSET:
        if q != Q_DVE and q != Q_POOL:
            _fail(i, rec, -1, "runs on VectorE or GpSimd only")
    elif op == OP_TENSOR_COPY:
        if q == Q_PE:
            _fail(i, rec, -1, "runs on VectorE, ScalarE or GpSimd, not TensorE")
    elif op == OP_SELECT or op == OP_BN_STATS or op == OP_BN_AGGR:
        if q != Q_DVE:
            _fail(i, rec, -1, "runs on VectorE only")
    else:
        if q != Q_POOL:
            _fail(i, rec, -1, "runs on GpSimd only")
    for s in range(N_OPERANDS):
        decode(i, rec, s, c, &ops[s])
        if s < NREQ[op] and not ops[s].present:
            _fail(i, rec, s, "is required but missing")
        if s >= NSLOTS[op] and ops[s].present:
            _fail(i, rec, s, "must be empty for this opcode")
        if ops[s].present and not is_dma:
            quadrant(i, rec, s, &ops[s])
            no_int64(i, rec, s, &ops[s])
            if q == Q_POOL and ops[s].mem == MEM_PSUM:
                _fail(i, rec, s, "GpSimd cannot access PSUM; copy the tile to SBUF with VectorE/ScalarE first")
            if q != Q_PE and ops[s].free > c.lim[L_MAX_FREE]:
                _fail(i, rec, s, f"free size {ops[s].free} exceeds the engine limit of {c.lim[L_MAX_FREE]} "
                      f"elements per partition; split the instruction")
    if rec[H_AUX_COUNT] != 0 and op != OP_PARTITION_SHUFFLE:
        _fail(i, rec, -1, "only partition_shuffle takes aux data")
    P = ops[0].pcount
    if op == OP_DMA_COPY:
        need_mem(i, rec, 0, &ops[0], 1, 0, 1)
        need_mem(i, rec, 1, &ops[1], 1, 0, 1)
        if ops[0].ap.dtype != ops[1].ap.dtype:
            _fail(i, rec, 1, f"dtype {DTYPE_NAMES[ops[1].ap.dtype]} differs from dst's "
                  f"{DTYPE_NAMES[ops[0].ap.dtype]}; DMA copies bytes, cast with tensor_copy")
        need_same_parts(i, rec, 1, &ops[1], P)
        need_free(i, rec, 1, &ops[1], ops[0].free)
        if sub != 0:
            _fail(i, rec, -1, "takes no sub-operation")
    elif op == OP_DMA_GATHER:
        need_mem(i, rec, 0, &ops[0], 1, 0, 0)
        need_mem(i, rec, 1, &ops[1], 0, 0, 1)
        need_mem(i, rec, 2, &ops[2], 1, 0, 0)
        if ops[2].ap.dtype != I32 and ops[2].ap.dtype != I64:
            _fail(i, rec, 2, f"indices must be int32 or int64, not {DTYPE_NAMES[ops[2].ap.dtype]}")
        if DSIZE[ops[0].ap.dtype] != DSIZE[ops[1].ap.dtype]:
            _fail(i, rec, 1, "table and dst element sizes differ; DMA copies bytes")
        need_same_parts(i, rec, 2, &ops[2], P)
        need_free(i, rec, 2, &ops[2], 1)
        need_free(i, rec, 1, &ops[1], ops[0].free)
    elif op == OP_DMA_SCATTER:
        need_mem(i, rec, 0, &ops[0], 0, 0, 1)
        need_mem(i, rec, 1, &ops[1], 1, 0, 0)
        need_mem(i, rec, 2, &ops[2], 1, 0, 0)
        if ops[2].ap.dtype != I32 and ops[2].ap.dtype != I64:
            _fail(i, rec, 2, f"indices must be int32 or int64, not {DTYPE_NAMES[ops[2].ap.dtype]}")
        if ops[0].ap.dtype != ops[1].ap.dtype:
            _fail(i, rec, 1, f"dtype {DTYPE_NAMES[ops[1].ap.dtype]} differs from the table's "
                  f"{DTYPE_NAMES[ops[0].ap.dtype]}")
        if (flags & FLAG_ACCUMULATE) and ops[0].ap.dtype != F32 and ops[0].ap.dtype != BF16 \
                and ops[0].ap.dtype != F16:
            _fail(i, rec, 0, "accumulating scatters need a float table (fp32, bf16, fp16)")
        need_same_parts(i, rec, 2, &ops[2], ops[1].pcount)
        need_free(i, rec, 2, &ops[2], 1)
        need_free(i, rec, 1, &ops[1], ops[0].free)
        if sub != 0:
            _fail(i, rec, -1, "takes no sub-operation")
    elif op == OP_MATMUL:
        need_mem(i, rec, 0, &ops[0], 0, 1, 0)
        need_mem(i, rec, 1, &ops[1], 1, 0, 0)
        need_mem(i, rec, 2, &ops[2], 1, 0, 0)
        if ops[0].ap.dtype != F32:
            _fail(i, rec, 0, f"must be float32 (PSUM accumulates in fp32), not {DTYPE_NAMES[ops[0].ap.dtype]}")
        for s in (1, 2):
            if ops[s].ap.dtype != F32 and ops[s].ap.dtype != BF16 and ops[s].ap.dtype != F16:
                _fail(i, rec, s, f"dtype {DTYPE_NAMES[ops[s].ap.dtype]} is not a TensorE input (fp32, bf16, fp16)")
        if ops[1].ap.dtype != ops[2].ap.dtype:
            _fail(i, rec, 2, f"dtype {DTYPE_NAMES[ops[2].ap.dtype]} differs from the stationary's "
                  f"{DTYPE_NAMES[ops[1].ap.dtype]}")
        K = ops[1].pcount
        M = ops[1].free
        N = ops[2].free
        if ops[2].pstart != ops[1].pstart or ops[2].pcount != K:
            _fail(i, rec, 2, f"spans partitions {ops[2].pstart}..+{ops[2].pcount} but the stationary spans "
                  f"{ops[1].pstart}..+{K}: the contraction (K) runs over the same partitions")
        if K > c.lim[L_MM_K]:
            _fail(i, rec, 1, f"contraction K={K} exceeds {c.lim[L_MM_K]}")
        if M > c.lim[L_MM_M]:
            _fail(i, rec, 1, f"stationary free size M={M} exceeds {c.lim[L_MM_M]} (stationary <= 128x128)")
        if N > c.lim[L_MM_N]:
            _fail(i, rec, 2, f"moving free size N={N} exceeds {c.lim[L_MM_N]} (moving <= 128x512, one PSUM bank "
                  f"of fp32); split N")
        if P != M:
            _fail(i, rec, 0, f"has {P} partitions but the result has M={M} rows (the stationary's free size)")
        need_free(i, rec, 0, &ops[0], N)
        if ops[0].runs != P:
            _fail(i, rec, 0, "must be contiguous along the free axis (PSUM rows of N fp32)")
        bank = ops[0].lo_byte // c.lim[L_BANK_BYTES]
        if (ops[0].hi_byte - 1) // c.lim[L_BANK_BYTES] != bank:
            _fail(i, rec, 0, f"bytes {ops[0].lo_byte}..{ops[0].hi_byte - 1} cross a PSUM bank boundary "
                  f"(banks of {c.lim[L_BANK_BYTES]} bytes); a matmul result must lie in one bank")
        if sub != 0:
            _fail(i, rec, -1, "takes no sub-operation")
    elif op == OP_TRANSPOSE:
        need_mem(i, rec, 0, &ops[0], 0, 1, 0)
        need_mem(i, rec, 1, &ops[1], 1, 0, 0)
        if ops[1].free > c.lim[L_MM_M]:
            _fail(i, rec, 1, f"free size {ops[1].free} exceeds {c.lim[L_MM_M]} (transpose input <= 128x128)")
        if P != ops[1].free:
            _fail(i, rec, 0, f"has {P} partitions but the transposed input needs {ops[1].free}")
        need_free(i, rec, 0, &ops[0], ops[1].pcount)
        if ops[0].ap.dtype != F32 and ops[0].ap.dtype != ops[1].ap.dtype:
            _fail(i, rec, 0, "must be float32 or the input's dtype")
        if ops[1].ap.dtype != F32 and ops[1].ap.dtype != BF16 and ops[1].ap.dtype != F16:
            _fail(i, rec, 1, f"dtype {DTYPE_NAMES[ops[1].ap.dtype]} is not a TensorE input (fp32, bf16, fp16)")
        bank = ops[0].lo_byte // c.lim[L_BANK_BYTES]
        if (ops[0].hi_byte - 1) // c.lim[L_BANK_BYTES] != bank:
            _fail(i, rec, 0, "crosses a PSUM bank boundary; a TensorE result must lie in one bank")
    elif op == OP_ACTIVATION:
        if (sub & 255) > 18 or (sub >> 8) > 6 or sub < 0:
            _fail(i, rec, -1, f"unknown activation function / reduce op in sub-operation {sub}")
        need_same_parts(i, rec, 1, &ops[1], P)
        need_free(i, rec, 1, &ops[1], ops[0].free)
        for s in (2, 3, 4):
            if ops[s].present:
                need_same_parts(i, rec, s, &ops[s], P)
                need_free(i, rec, s, &ops[s], 1)
        if ops[4].present and (sub >> 8) == 0:
            _fail(i, rec, 4, "is given but no reduce op is set")
        if (sub >> 8) != 0 and not ops[4].present:
            _fail(i, rec, 4, "is required when a reduce op is set")
    elif op == OP_TENSOR_TENSOR or op == OP_SELECT:
        if op == OP_TENSOR_TENSOR and (sub < 0 or sub > ALU_LAST):
            _fail(i, rec, -1, f"unknown ALU op {sub}")
        for s in range(1, NSLOTS[op]):
            need_same_parts(i, rec, s, &ops[s], P)
            need_free(i, rec, s, &ops[s], ops[0].free)
        if op == OP_TENSOR_TENSOR and sub >= ALU_FIRST_INT:
            for s in range(3):
                need_int(i, rec, s, &ops[s])
    elif op == OP_TENSOR_SCALAR:
        if sub < 0 or (sub & 255) > ALU_LAST or (sub >> 8) > ALU_LAST:
            _fail(i, rec, -1, f"unknown ALU ops in sub-operation {sub}")
        need_same_parts(i, rec, 1, &ops[1], P)
        need_free(i, rec, 1, &ops[1], ops[0].free)
        for s in (2, 3):
            if ops[s].present:
                need_same_parts(i, rec, s, &ops[s], P)
                need_free(i, rec, s, &ops[s], 1)
        if (sub & 255) >= ALU_FIRST_INT or (sub >> 8) >= ALU_FIRST_INT:
            if (sub & 255) < ALU_FIRST_INT or ((sub >> 8) != 0 and (sub >> 8) < ALU_FIRST_INT):
                _fail(i, rec, -1, "mixes an integer ALU op (bitwise, shift) with an fp32 one; use two instructions")
            for s in range(4):
                if ops[s].present and (s != 3 or (sub >> 8) != 0):
                    need_int(i, rec, s, &ops[s])
            for j in range(2):
                if (j == 0 and not ops[2].present) or (j == 1 and (sub >> 8) != 0 and not ops[3].present):
                    nred_d = (<double *>&rec[H_IMM])[j]
                    if not (nred_d == <double>(<int64_t>nred_d) and -2147483648.0 <= nred_d <= 2147483647.0):
                        _fail(i, rec, -1, f"immediate operand{j} = {nred_d!r} of an integer ALU op must be an "
                              f"integer in the int32 range")
    elif op == OP_TENSOR_REDUCE:
        if sub < 1 or sub > 6:
            _fail(i, rec, -1, f"unknown reduce op {sub}")
        nred_d = (<double *>&rec[H_IMM])[0]
        if not (nred_d >= 1 and nred_d <= 4):
            _fail(i, rec, -1, f"number of reduced axes {nred_d} must be 1..4")
        need_same_parts(i, rec, 1, &ops[1], P)
        a0 = 1
        for j in range(4 - <int64_t>nred_d, 4):
            a0 *= ops[1].ap.num[j]
        need_free(i, rec, 0, &ops[0], ops[1].free // a0)
    elif op == OP_TENSOR_COPY or op == OP_AFFINE_SELECT:
        if op == OP_AFFINE_SELECT and (sub < 0 or sub > 5):
            _fail(i, rec, -1, f"unknown comparison {sub}")
        need_same_parts(i, rec, 1, &ops[1], P)
        need_free(i, rec, 1, &ops[1], ops[0].free)
    elif op == OP_BN_STATS:
        need_same_parts(i, rec, 1, &ops[1], P)
        if ops[1].free > c.lim[L_BN_MAX]:
            _fail(i, rec, 1, f"free size {ops[1].free} exceeds the bn_stats limit of {c.lim[L_BN_MAX]}; "
                  f"run bn_stats per chunk and combine with bn_aggr")
        need_free(i, rec, 0, &ops[0], 3)
    elif op == OP_BN_AGGR:
        need_same_parts(i, rec, 1, &ops[1], P)
        if ops[1].free % 3 != 0:
            _fail(i, rec, 1, f"free size {ops[1].free} is not a multiple of 3 (bn_stats triples)")
        need_free(i, rec, 0, &ops[0], 2)
    elif op == OP_PARTITION_REDUCE:
        if sub < 1 or sub > 6:
            _fail(i, rec, -1, f"unknown reduce op {sub}")
        need_free(i, rec, 1, &ops[1], ops[0].free)
    elif op == OP_PARTITION_SHUFFLE:
        need_free(i, rec, 1, &ops[1], ops[0].free)
        if rec[H_AUX_COUNT] != P:
            _fail(i, rec, -1, f"permutation has {rec[H_AUX_COUNT]} entries but out has {P} partitions")
        if aux != NULL:
            for j in range(P):
                a0 = aux[rec[H_AUX_START] + j]
                if a0 < 0 or a0 >= ops[1].pcount:
                    _fail(i, rec, 1, f"permutation entry {j} = {a0} is not a partition of the input (0..{ops[1].pcount - 1})")
    return 0


def check(rec, limits, hbm_sizes, aux=None):
    """Validate one encoded record (a sequence of REC_WIDTH ints) without executing it.

    ``limits`` is :meth:`Arch.limits_vector`, ``hbm_sizes`` the byte size of
    every HBM buffer. Raises :class:`tn.NeuronError` on a violation. Dependency
    and aux ranges are not checked here (the program assigns them later).
    """
    cdef const int64_t[::1] lim = np.ascontiguousarray(limits, dtype=np.int64)
    cdef int64_t nb = len(hbm_sizes)
    cdef const int64_t[::1] hs = np.ascontiguousarray(hbm_sizes if nb else [0], dtype=np.int64)
    cdef const int64_t[::1] ax
    cdef Opnd ops[N_OPERANDS]
    cdef Ctx c
    cdef int64_t tmp[REC_WIDTH]
    cdef int j
    if len(rec) != REC_WIDTH:
        from tn.errors import NeuronError
        raise NeuronError(f"an encoded record has {REC_WIDTH} fields, got {len(rec)}")
    try:
        for j in range(REC_WIDTH):
            tmp[j] = rec[j]
    except OverflowError:
        from tn.errors import NeuronError
        raise NeuronError(f"field {j} of the record ({rec[j]}) does not fit in int64; check offsets and strides") from None
    tmp[H_DEP_START] = 0
    tmp[H_DEP_COUNT] = 0
    c.sbuf = NULL
    c.psum = NULL
    c.sbuf_pitch = lim[L_SBUF_BYTES]
    c.psum_pitch = lim[L_PSUM_BYTES]
    c.hbm_ptr = &hs[0]
    c.hbm_size = &hs[0]
    c.nbufs = nb
    c.lim = &lim[0]
    c.execute = 0
    tmp[H_AUX_START] = 0
    if aux is not None and len(aux):
        ax = np.ascontiguousarray(aux, dtype=np.int64)
        check_record(-1, tmp, &c, ops, 0, ax.shape[0], &ax[0])
    else:
        check_record(-1, tmp, &c, ops, 0, tmp[H_AUX_COUNT], NULL)
    return True


# ---------------------------------------------------------------- timing helpers

cdef struct Pipe:
    int n                      # busy intervals kept (<= PIPE_MAX - 8 between calls)
    double s[2 * PIPE_MAX + 16]   # room for one call's merge of the old list and its new pieces
    double e[2 * PIPE_MAX + 16]


cdef inline void fold_oldest(Pipe *pp) noexcept nogil:
    """Bound a busy list: fold its oldest intervals into one busy block (loses their gaps: conservative)."""
    cdef int k, j = pp.n - (PIPE_MAX // 2)
    pp.e[0] = pp.e[j]
    for k in range(1, pp.n - j):
        pp.s[k] = pp.s[j + k]; pp.e[k] = pp.e[j + k]
    pp.n -= j


cdef inline int first_ending_after(Pipe *pp, double t) noexcept nogil:
    """Index of the first busy interval of pp (sorted, disjoint) that ends after t (pp.n if none): bisection."""
    cdef int lo = 0, hi = pp.n, mid
    while lo < hi:
        mid = (lo + hi) // 2
        if pp.e[mid] <= t:
            lo = mid + 1
        else:
            hi = mid
    return lo


cdef double pipe_fill(Pipe *pp, double t, double dur) noexcept nogil:
    """Move `dur` ns of transfer through a pipe (the HBM interface or one DMA engine) from time t, using its idle
    gaps in time order; return the end time. The busy list is sorted and disjoint: the intervals ending by t are
    found by bisection and kept as they are, only the tail is rebuilt."""
    cdef int k, j, k0
    cdef double gap_end, use
    cdef double ns[2 * PIPE_MAX + 8]
    cdef double ne[2 * PIPE_MAX + 8]
    cdef int nn = 0
    if dur <= 0:
        return t
    k0 = first_ending_after(pp, t)
    k = k0
    # walk the intervals from k0; emit the merged tail with the new busy pieces
    while dur > 0 or k < pp.n:
        if k < pp.n and pp.s[k] <= t:
            if pp.e[k] > t:
                t = pp.e[k]
            ns[nn] = pp.s[k]; ne[nn] = pp.e[k]; nn += 1; k += 1
            continue
        if dur > 0:
            gap_end = pp.s[k] if k < pp.n else 1e300
            use = gap_end - t
            if use > dur:
                use = dur
            ns[nn] = t; ne[nn] = t + use; nn += 1
            t += use
            dur -= use
            continue
        ns[nn] = pp.s[k]; ne[nn] = pp.e[k]; nn += 1; k += 1
    # write the tail back after the kept prefix, merging touching intervals
    pp.n = k0
    for j in range(nn):
        if pp.n > 0 and ns[j] <= pp.e[pp.n - 1] + 1e-9:
            if ne[j] > pp.e[pp.n - 1]:
                pp.e[pp.n - 1] = ne[j]
        else:
            pp.s[pp.n] = ns[j]; pp.e[pp.n] = ne[j]; pp.n += 1
    if pp.n > PIPE_MAX - 8:
        fold_oldest(pp)
    return t


cdef double dma_transfer(Pipe *hbm, Pipe *eng, double *qe_end, const double[::1] timing, Opnd *ops,
                         int64_t op, int64_t flags, double t0, int64_t partitions, double *first_start,
                         int64_t *hbm_rw) noexcept:
    """Place one DMA triggered at t0 on the HBM interface and the DMA engines it uses; return when its data
    has landed. The transfer starts moving data ``dma_fixed_ns`` after its trigger (descriptor setup and
    semaphore-to-start latency: overlapped with the transfers ahead of it on the queue, which the engines serve in
    order: ``qe_end`` holds, per engine, when this queue may start its next transfer there: when the previous one
    ended, but no sooner than ``dma_transfer_min_ns`` after it started, the per-transfer rate limit that makes
    a stream of small DMAs overhead-bound). Each engine moves its
    share of the bytes, plus ``dma_chunk_overhead_bytes`` per contiguous run, at its own bandwidth; a transfer
    touching SBUF uses the engines of its partitions (engine e serves partitions e*P/E .. (e+1)*P/E - 1), an
    HBM -> HBM copy spreads over every engine. The HBM interface carries the HBM bytes read and written (an
    HBM -> HBM copy twice). ``hbm_rw`` gets the bytes read from / written to HBM."""
    cdef int64_t nengines = <int64_t>timing[T_DMA_ENGINES], e, e0, e1, ppe, lo, hi, parts
    cdef double ebw = timing[T_DMA_ENGINE_BW], chunk = timing[T_DMA_CHUNK], moved, hbm_b, share, s_e, end, t
    cdef double tmin = timing[T_DMA_MIN], qmin
    cdef Opnd *side = NULL
    cdef int64_t acc
    if op == OP_DMA_GATHER:
        moved = ops[0].nbytes + (ops[0].pcount + ops[0].runs) * chunk
        hbm_rw[0] = ops[0].nbytes if ops[1].mem == MEM_HBM else 0
        hbm_rw[1] = 0
        side = &ops[0]
    elif op == OP_DMA_SCATTER:   # one row per index; accumulation also reads the rows
        moved = ops[1].nbytes + (ops[1].pcount + ops[1].runs) * chunk
        hbm_rw[1] = ops[1].nbytes
        hbm_rw[0] = ops[1].nbytes if flags & FLAG_ACCUMULATE else 0
        if flags & FLAG_ACCUMULATE:
            moved += ops[1].nbytes
        side = &ops[1]
    else:
        acc = ops[0].runs if ops[0].runs > ops[1].runs else ops[1].runs
        moved = ops[0].nbytes + acc * chunk
        hbm_rw[0] = ops[1].nbytes if ops[1].mem == MEM_HBM else 0
        hbm_rw[1] = ops[0].nbytes if ops[0].mem == MEM_HBM else 0
        if ops[0].mem == MEM_SBUF:
            side = &ops[0]
        elif ops[1].mem == MEM_SBUF:
            side = &ops[1]
    t = t0 + timing[T_DMA_FIXED]
    end = t
    first_start[0] = 1e300
    if side != NULL:
        ppe = (partitions + nengines - 1) // nengines     # ceil: the last engine takes any remainder
        e0 = side.pstart // ppe
        e1 = (side.pstart + side.pcount - 1) // ppe
    else:
        ppe = 0
        e0 = 0
        e1 = nengines - 1
    for e in range(e0, e1 + 1):
        if e >= nengines:
            break
        if side != NULL:
            lo = e * ppe if e * ppe > side.pstart else side.pstart
            hi = (e + 1) * ppe if (e + 1) * ppe < side.pstart + side.pcount else side.pstart + side.pcount
            parts = hi - lo
            share = <double>parts / <double>side.pcount
        else:
            share = 1.0 / <double>nengines
        s_e = t if t > qe_end[e] else qe_end[e]
        if s_e < first_start[0]:
            first_start[0] = s_e
        qmin = s_e + tmin
        s_e = pipe_fill(&eng[e], s_e, share * moved / ebw * 1e9)
        # the queue starts its next transfer on this engine no sooner than dma_transfer_min_ns after this one
        # started (per-transfer packet rate, [dma] throughput curve): the engine's bandwidth stays free for
        # the other queues meanwhile
        qe_end[e] = s_e if s_e > qmin else qmin
        if s_e > end:
            end = s_e
    hbm_b = <double>(hbm_rw[0] + hbm_rw[1])
    if hbm_b > 0:
        s_e = pipe_fill(hbm, t, hbm_b / timing[T_HBM_BW] * 1e9)
        if s_e > end:
            end = s_e
    if first_start[0] > end:
        first_start[0] = t
    return end


cdef double port_probe(Pipe *pp, double t, double dur) noexcept nogil:
    """Earliest start at or after t of an idle span of ``dur`` ns on a shared memory port (busy list sorted and
    disjoint)."""
    cdef int k = first_ending_after(pp, t)
    while k < pp.n and pp.s[k] < t + dur:      # overlaps [t, t + dur): try after it
        if pp.e[k] > t:
            t = pp.e[k]
        k += 1
    return t


cdef void port_reserve(Pipe *pp, double t, double dur) noexcept nogil:
    """Mark [t, t + dur) busy on a shared memory port (the span is idle: see port_probe). Keeps the list bounded
    by folding its oldest intervals into one busy block (loses their gaps: conservative)."""
    cdef int k, pos = 0, j, folded = 0
    if dur <= 0:
        return
    if pp.n >= PIPE_MAX - 8:
        fold_oldest(pp)
        folded = 1
    while pos < pp.n and pp.s[pos] < t:
        pos += 1
    for k in range(pp.n, pos, -1):
        pp.s[k] = pp.s[k - 1]; pp.e[k] = pp.e[k - 1]
    pp.s[pos] = t
    pp.e[pos] = t + dur
    pp.n += 1
    if folded:    # the folded block may cover the new span: merge overlapping intervals (sorted by start)
        j = 0
        for k in range(1, pp.n):
            if pp.s[k] <= pp.e[j]:
                if pp.e[k] > pp.e[j]:
                    pp.e[j] = pp.e[k]
            else:
                j += 1
                pp.s[j] = pp.s[k]; pp.e[j] = pp.e[k]
        pp.n = j + 1


cdef inline int act_table_id(int64_t func) noexcept nogil:
    """The activation table a ScalarE function needs (-1: none). *Assumption* (no published table layout):
    identity/copy, relu, square, abs and sign are computed without a table; every other function has its own."""
    if func == 0 or func == 1 or func == 13 or func == 14 or func == 15:
        return -1
    return <int>func


cdef inline int half16(Opnd *o) noexcept nogil:
    """A bf16/fp16 operand (VectorE's trn2 performance modes)."""
    return o.ap.dtype == BF16 or o.ap.dtype == F16


cdef inline int contig(Opnd *o) noexcept nogil:
    """Physically contiguous innermost free dimension."""
    return o.inner_stride == 1


cdef double vector_fast_factor(int64_t op, Opnd *ops, int nin) noexcept nogil:
    """Throughput factor of NeuronCore-v3 VectorE's performance mode (NKI Trainium2 architecture guide, "Vector
    Engine Performance Mode"): tensor_copy/tensor_scalar 4x with every operand bf16/fp16 in SBUF with a
    contiguous innermost dim, 2x with bf16/fp16 SBUF operands not all contiguous or with contiguous bf16/fp16
    operands one of them in PSUM; tensor_tensor 2x with both inputs in SBUF and every operand bf16/fp16."""
    cdef int s, all16 = 1, all_sbuf = 1, all_contig = 1, npsum = 0
    for s in range(nin + 1):
        if not half16(&ops[s]):
            all16 = 0
        if ops[s].mem != MEM_SBUF:
            all_sbuf = 0
        if ops[s].mem == MEM_PSUM:
            npsum += 1
        if not contig(&ops[s]):
            all_contig = 0
    if not all16:
        return 1.0
    if op == OP_TENSOR_TENSOR:
        return 2.0 if (ops[1].mem == MEM_SBUF and ops[2].mem == MEM_SBUF) else 1.0
    if all_sbuf:
        return 4.0 if all_contig else 2.0
    if all_contig and npsum == 1:
        return 2.0
    return 1.0


cdef inline int _strided(Opnd *ops, int nslots) noexcept nogil:
    """An SBUF/PSUM operand whose innermost stride exceeds 16 bytes: its read/write interface runs at half
    bandwidth (NKI Trainium/Inferentia2 architecture guide, "Access pattern")."""
    cdef int s
    cdef int64_t st
    for s in range(nslots):
        if ops[s].present and (ops[s].mem == MEM_SBUF or ops[s].mem == MEM_PSUM):
            st = ops[s].inner_stride
            if st < 0:
                st = -st
            if st * ops[s].ap.esize > 16:
                return 1
    return 0


cdef double cost_cycles(int64_t op, int64_t sub, int64_t q, Opnd *ops, double *imm, int fast) noexcept nogil:
    """Issue interval (engine cycles) of a compute instruction: the NKI ISA's per-instruction cost formulas
    (MIN_II = 64), mirrored by tn.neuron.isa.cost_cycles, which cites the source of each rule. ``fast``: the
    NeuronCore-v3 extras (VectorE performance modes, TensorE fp32 transpose mode)."""
    cdef double n, m, c, f = 1.0
    cdef int s, nin = 1, strided = 0
    if op == OP_MATMUL:
        m = ops[1].free
        n = ops[2].free
        c = (m if m < 64 else 64)
        c = n if n > c else c
        if ops[1].ap.dtype == F32:
            c *= 4
        return c
    if op == OP_TRANSPOSE:
        m = ops[1].free
        n = ops[1].pcount
        c = (m if m < 64 else 64)
        c = n if n > c else c
        if ops[1].ap.dtype == F32:
            c *= 2 if fast else 4
        return c
    if op == OP_TENSOR_TENSOR:
        nin = 2
        n = ops[1].free
        # N with an input in PSUM or for bf16 add/subtract/multiply on contiguous SBUF operands, else 2N
        if ops[1].mem == MEM_PSUM or ops[2].mem == MEM_PSUM or (
                (sub == 1 or sub == 2 or sub == 3) and ops[1].ap.dtype == BF16 and ops[2].ap.dtype == BF16
                and contig(&ops[0]) and contig(&ops[1]) and contig(&ops[2])):
            c = n
        else:
            c = 2.0 * n
        if fast and q == 2:
            f = vector_fast_factor(op, ops, 2)
    elif op == OP_SELECT:
        nin = 3
        c = 2.0 * ops[1].free
    elif op == OP_ACTIVATION:
        c = ops[1].free * (2.0 if _strided(ops, 5) else 1.0)
        if c < 64:
            c = 64
        if ops[4].present:     # fused free-axis reduce: + MIN_II
            c += 64
        return c
    elif op == OP_TENSOR_REDUCE:
        n = ops[1].free
        c = n / 2.0 if (ops[1].ap.dtype == BF16 and (sub == 1 or sub == 2)) else n
    elif op == OP_IOTA or op == OP_PARTITION_SHUFFLE:
        return 150 + ops[0].free
    elif op == OP_AFFINE_SELECT:
        return 150 + ops[1].free
    elif op == OP_PARTITION_REDUCE:
        n = ops[1].pcount - 1
        c = 0
        while n >= 1:
            c += 1
            n = <double>(<int64_t>n // 2)
        if c < 1:
            c = 1
        return 150 + ops[1].free * c
    elif op == OP_MEMSET:
        nin = 0
        n = ops[0].free
        c = n / 2.0 if (imm[0] == 0.0 and half16(&ops[0])) else n
    elif op == OP_BN_AGGR:
        c = 13.0 * ops[1].free / 3.0
    else:  # tensor_scalar, tensor_copy, bn_stats: N
        c = ops[1].free
        if fast and q == 2 and (op == OP_TENSOR_SCALAR or op == OP_TENSOR_COPY):
            f = vector_fast_factor(op, ops, 1)
    if _strided(ops, nin + 1):
        c *= 2.0
    c = c / f
    return c if c > 64 else 64


cdef int exec_one(int64_t op, int64_t sub, int64_t flags, Opnd *ops, double *imm, const int64_t *auxp,
                  const int64_t *rec, int64_t *bad) noexcept nogil:
    """Call the C kernel of one validated instruction; returns the kernel's code (0 = ok)."""
    cdef int rc = 0
    if op == OP_DMA_COPY:
        rc = tn_copy_bytes(&ops[0].ap, &ops[1].ap, ops[0].pcount)
    elif op == OP_DMA_GATHER:
        rc = tn_gather_rows(&ops[0].ap, &ops[1].ap, ops[1].pcount, &ops[2].ap, ops[0].pcount, bad)
    elif op == OP_MATMUL:
        rc = tn_matmul_ap(&ops[0].ap, &ops[1].ap, &ops[2].ap, ops[1].pcount, flags & FLAG_ACCUMULATE)
    elif op == OP_TRANSPOSE:
        rc = tn_transpose(&ops[0].ap, &ops[1].ap, ops[1].pcount)
    elif op == OP_ACTIVATION:
        rc = tn_activation(<int>(sub & 255), &ops[0].ap, &ops[1].ap,
                           &ops[2].ap if ops[2].present else NULL, imm[1],
                           &ops[3].ap if ops[3].present else NULL, imm[0],
                           <int>(sub >> 8), &ops[4].ap if ops[4].present else NULL, ops[0].pcount)
    elif op == OP_TENSOR_TENSOR:
        rc = tn_tensor_tensor(<int>sub, &ops[0].ap, &ops[1].ap, &ops[2].ap, ops[0].pcount)
    elif op == OP_TENSOR_SCALAR:
        rc = tn_tensor_scalar(&ops[0].ap, &ops[1].ap, <int>(sub & 255),
                              &ops[2].ap if ops[2].present else NULL, imm[0], <int>(sub >> 8),
                              &ops[3].ap if ops[3].present else NULL, imm[1], <int>flags,
                              ops[0].pcount)
    elif op == OP_TENSOR_REDUCE:
        rc = tn_tensor_reduce(<int>sub, &ops[0].ap, &ops[1].ap, <int>imm[0], ops[0].pcount)
    elif op == OP_TENSOR_COPY:
        rc = tn_tensor_copy(&ops[0].ap, &ops[1].ap, ops[0].pcount)
    elif op == OP_SELECT:
        rc = tn_select(&ops[0].ap, &ops[1].ap, &ops[2].ap, &ops[3].ap, ops[0].pcount)
    elif op == OP_BN_STATS:
        rc = tn_bn_stats(&ops[0].ap, &ops[1].ap, ops[0].pcount)
    elif op == OP_BN_AGGR:
        rc = tn_bn_aggr(&ops[0].ap, &ops[1].ap, ops[0].pcount)
    elif op == OP_IOTA:
        rc = tn_iota(&ops[0].ap, imm, ops[0].pcount)
    elif op == OP_AFFINE_SELECT:
        rc = tn_affine_select(<int>sub, &ops[0].ap, &ops[1].ap, imm, imm[6], ops[0].pcount)
    elif op == OP_MEMSET:
        rc = tn_memset(&ops[0].ap, imm[0], ops[0].pcount)
    elif op == OP_PARTITION_REDUCE:
        rc = tn_partition_reduce(<int>sub, &ops[0].ap, &ops[1].ap, ops[0].pcount, ops[1].pcount)
    elif op == OP_PARTITION_SHUFFLE:
        rc = tn_partition_shuffle(&ops[0].ap, &ops[1].ap, auxp + rec[H_AUX_START], ops[0].pcount)
    elif op == OP_DMA_SCATTER:
        rc = tn_scatter_rows(&ops[0].ap, ops[0].pcount, &ops[1].ap, &ops[2].ap, ops[1].pcount,
                             <int>(flags & FLAG_ACCUMULATE), bad)
    return rc


# ---------------------------------------------------------------- the run

cdef inline double _ns(timespec *a, timespec *b) noexcept nogil:
    return <double>(b.tv_sec - a.tv_sec) * 1e9 + <double>(b.tv_nsec - a.tv_nsec)


def run(const int64_t[:, ::1] prog, const int64_t[::1] deps, const int64_t[::1] aux,
        unsigned char[:, ::1] sbuf, unsigned char[:, ::1] psum,
        const int64_t[::1] hbm_ptrs, const int64_t[::1] hbm_sizes,
        const int64_t[::1] limits, const double[::1] timing,
        double[:, ::1] times, double[::1] busy, int64_t[::1] counts, int64_t[::1] hbm_bytes,
        int execute=1, double[:, ::1] host_ns=None):
    """Validate, execute and time every instruction of an encoded program, in order.

    ``prog`` (n, REC_WIDTH) int64; ``deps``/``aux`` int64 side arrays;
    ``sbuf``/``psum`` the memories (partitions x bytes, uint8; rows may be
    longer than the architecture's partition size: partition p is row p, so
    padded rows spread the partitions over the host's cache sets); ``hbm_ptrs``/
    ``hbm_sizes`` the address and byte size of every bound HBM buffer (the
    caller keeps them alive); ``limits``/``timing`` from :class:`Arch`.
    Outputs: ``times[i] = (start_ns, end_ns)`` (end = when the result is
    readable: the issue interval plus the result latency for compute
    engines, the data landed for DMAs), ``busy[q]`` busy ns per queue
    (compute engines: issue intervals; DMA queues: transfer spans),
    ``counts[q]`` instructions per queue, ``hbm_bytes = [read, written]``.
    Returns the total time in ns. With ``execute=0`` only validation and
    timing run. Raises :class:`tn.NeuronError` on any violation.
    Optional ``host_ns`` (n, 2) float64: filled with the host wall time (ns) each
    instruction took here, ``[i, 0]`` validation + bookkeeping + timing model,
    ``[i, 1]`` its C kernel (host-side profiling; costs two clock reads per
    instruction, so it is only done when asked).
    """
    cdef int64_t n = prog.shape[0], i, j, d, q, op, sub, flags, nq, bank, nbanks, ndeps = deps.shape[0]
    cdef int64_t naux = aux.shape[0], dstart, rc, acc
    cdef const int64_t *rec
    cdef const int64_t *auxp = &aux[0] if naux > 0 else NULL
    cdef Opnd ops[N_OPERANDS]
    cdef Ctx c
    cdef double qfree[64]
    cdef double start, end, cyc, dur, total = 0.0, bytes_eff
    cdef double clk[4]
    cdef double imm[8]
    cdef int64_t bad[2]
    cdef int64_t live_owner[MAX_BANKS]
    cdef int64_t live_p0[MAX_BANKS]
    cdef int64_t live_p1[MAX_BANKS]
    cdef int64_t live_b0[MAX_BANKS]
    cdef int64_t live_b1[MAX_BANKS]
    cdef int64_t bank_bytes, s, b, b_lo, b_hi
    cdef Pipe *pipe
    cdef Pipe *engpipes
    cdef double *qe_end
    cdef double dstart_ns
    cdef int64_t rw[2]
    cdef int64_t nengines
    cdef int fast, shared_ports, uses_sbuf, uses_psum
    cdef double t_port, t0
    cdef double *issue_end
    cdef int want_host = host_ns is not None
    cdef int act_table = -1, tid
    cdef timespec ts0, ts1, ts2, ts3
    if prog.shape[1] != REC_WIDTH:
        from tn.errors import NeuronError
        raise NeuronError(f"encoded program has {prog.shape[1]} fields per record, expected {REC_WIDTH}")
    nq = limits[L_QUEUES]
    if nq < N_ENGINES + 1 or nq > 64 or times.shape[0] < n or busy.shape[0] < nq or counts.shape[0] < nq \
            or hbm_bytes.shape[0] < 2 or hbm_ptrs.shape[0] != hbm_sizes.shape[0] \
            or (want_host and (host_ns.shape[0] < n or host_ns.shape[1] != 2)):
        from tn.errors import NeuronError
        raise NeuronError("run(): output arrays or queue count do not match the program and architecture")
    if execute and (sbuf.shape[0] < limits[L_PARTITIONS] or sbuf.shape[1] < limits[L_SBUF_BYTES]
                    or psum.shape[0] < limits[L_PARTITIONS] or psum.shape[1] < limits[L_PSUM_BYTES]):
        from tn.errors import NeuronError
        raise NeuronError("run(): SBUF/PSUM arrays are smaller than the architecture's memories")
    if timing.shape[0] < N_TIMING:
        from tn.errors import NeuronError
        raise NeuronError(f"run(): the timing vector has {timing.shape[0]} constants, expected {N_TIMING} "
                          f"(Arch.timing_vector)")
    for q in range(N_TIMING):
        if not (timing[q] >= 0 and timing[q] < 1e300) or (q < 5 and timing[q] <= 0):
            from tn.errors import NeuronError
            raise NeuronError(f"run(): timing constant {q} = {timing[q]} must be positive and finite")
    bank_bytes = limits[L_BANK_BYTES]
    nbanks = limits[L_PSUM_BYTES] // bank_bytes
    if nbanks > MAX_BANKS or nbanks < 1:
        from tn.errors import NeuronError
        raise NeuronError(f"PSUM has {nbanks} banks; the engine supports 1..{MAX_BANKS}")
    c.sbuf = <char *>&sbuf[0, 0] if execute else NULL
    c.psum = <char *>&psum[0, 0] if execute else NULL
    c.sbuf_pitch = sbuf.shape[1] if execute else limits[L_SBUF_BYTES]
    c.psum_pitch = psum.shape[1] if execute else limits[L_PSUM_BYTES]
    c.hbm_ptr = &hbm_ptrs[0] if hbm_ptrs.shape[0] else NULL
    c.hbm_size = &hbm_sizes[0] if hbm_sizes.shape[0] else NULL
    c.nbufs = hbm_ptrs.shape[0]
    c.lim = &limits[0]
    c.execute = execute
    for q in range(4):
        clk[q] = timing[T_CLK_PE + q] / 1e9   # cycles per ns
    for q in range(64):
        qfree[q] = 0.0
    for q in range(nq):
        busy[q] = 0.0
        counts[q] = 0
    hbm_bytes[0] = 0
    hbm_bytes[1] = 0
    for b in range(MAX_BANKS):
        live_owner[b] = -1
    nengines = <int64_t>timing[T_DMA_ENGINES]
    if nengines < 1 or nengines > MAX_DMA_ENGINES or timing[T_DMA_ENGINE_BW] <= 0:
        from tn.errors import NeuronError
        raise NeuronError(f"run(): {nengines} DMA engines at {timing[T_DMA_ENGINE_BW]} B/s: the engine models "
                          f"1..{MAX_DMA_ENGINES} engines of positive bandwidth")
    fast = timing[T_FAST] != 0
    shared_ports = timing[T_SHARED_PORTS] != 0
    pipe = <Pipe *>malloc(sizeof(Pipe) * (3 + nengines))
    if pipe == NULL:
        raise MemoryError("engine: cannot allocate the DMA pipe state")
    engpipes = pipe + 3       # pipe[1]: VectorE/GpSimd SBUF port, pipe[2]: ScalarE/VectorE PSUM port (NC-v2)
    qe_end = <double *>calloc(64 * nengines, sizeof(double))
    issue_end = <double *>malloc(sizeof(double) * (n if n > 0 else 1))
    if issue_end == NULL or qe_end == NULL:
        free(pipe)
        free(qe_end)
        free(issue_end)
        raise MemoryError("engine: cannot allocate the issue-time array")
    for j in range(nengines + 3):
        pipe[j].n = 0
    try:
        for i in range(n):
            if want_host:
                clock_gettime(CLOCK_MONOTONIC, &ts0)
            rec = &prog[i, 0]
            check_record(i, rec, &c, ops, ndeps, naux, auxp)
            op = rec[H_OPCODE]
            q = rec[H_QUEUE]
            sub = rec[H_SUBOP]
            flags = rec[H_FLAGS]
            memcpy(imm, &rec[H_IMM], 64)
            # ---- dependencies (semaphore waits) and start time
            start = qfree[q]
            dstart = rec[H_DEP_START]
            for j in range(rec[H_DEP_COUNT]):
                d = deps[dstart + j]
                if d < 0 or d >= i:
                    _fail(i, rec, -1, f"waits for instruction {d}, which is not an earlier instruction")
                if op == OP_MATMUL and (flags & FLAG_ACCUMULATE) and prog[d, H_OPCODE] == OP_MATMUL \
                        and prog[d, H_QUEUE] == q:
                    # accumulating into the PSUM group of an earlier matmul of the same TensorE pipeline: the
                    # partial sums stream through the PSUM adders, no round trip through memory
                    if issue_end[d] > start:
                        start = issue_end[d]
                elif times[d, 1] > start:
                    start = times[d, 1]
            # ---- PSUM accumulation-group ownership
            for s in range(N_OPERANDS):
                if not ops[s].present or ops[s].mem != MEM_PSUM:
                    continue
                b_lo = ops[s].lo_byte // bank_bytes
                b_hi = (ops[s].hi_byte - 1) // bank_bytes
                for b in range(b_lo, b_hi + 1):
                    if live_owner[b] < 0:
                        continue
                    if ops[s].pstart >= live_p1[b] or ops[s].pstart + ops[s].pcount <= live_p0[b]:
                        if not (s == 0 and op == OP_MATMUL):
                            continue
                    if s == 0 and op == OP_MATMUL:
                        if (ops[0].pstart != live_p0[b] or ops[0].pstart + ops[0].pcount != live_p1[b]
                                or ops[0].lo_byte != live_b0[b] or ops[0].hi_byte != live_b1[b]):
                            _fail(i, rec, 0, f"PSUM bank {b} is owned by a live accumulation started by instruction "
                                  f"#{live_owner[b]}; finish it (stop=True, or read its result) before writing "
                                  f"another region of the bank, or use another bank")
                    elif s == 0 or (op == OP_ACTIVATION and s == 4):
                        if 1:  # any write into the owned bank (on overlapping partitions)
                            _fail(i, rec, s, f"writes PSUM bank {b}, owned by the live accumulation started by "
                                  f"instruction #{live_owner[b]}; read or stop that accumulation first")
                    else:
                        if ops[s].lo_byte < live_b1[b] and ops[s].hi_byte > live_b0[b]:
                            live_owner[b] = -1   # reading the result ends the accumulation group
            if op == OP_MATMUL:
                b = ops[0].lo_byte // bank_bytes
                if flags & FLAG_STOP:
                    live_owner[b] = -1
                elif live_owner[b] < 0 or not (flags & FLAG_ACCUMULATE):
                    live_owner[b] = i
                    live_p0[b] = ops[0].pstart
                    live_p1[b] = ops[0].pstart + ops[0].pcount
                    live_b0[b] = ops[0].lo_byte
                    live_b1[b] = ops[0].hi_byte
            # ---- execute (large instructions release the GIL so other Python threads can run)
            rc = 0
            if want_host:
                clock_gettime(CLOCK_MONOTONIC, &ts1)
            if execute:
                if ops[0].nbytes >= 65536:
                    with nogil:
                        rc = exec_one(op, sub, flags, ops, imm, auxp, rec, bad)
                else:
                    rc = exec_one(op, sub, flags, ops, imm, auxp, rec, bad)
                if rc == -2 and (op == OP_DMA_GATHER or op == OP_DMA_SCATTER):
                    _fail(i, rec, 2, f"index {bad[1]} in partition {bad[0]} is outside the table's "
                          f"{ops[1 if op == OP_DMA_GATHER else 0].pcount} rows")
                if rc == -3:
                    raise MemoryError(f"instruction #{i}: the engine ran out of scratch memory")
                if rc != 0:
                    _fail(i, rec, -1, f"the kernel rejected its arguments (code {rc})")
            if want_host:
                clock_gettime(CLOCK_MONOTONIC, &ts2)
            # ---- timing
            if q >= N_ENGINES:
                end = dma_transfer(pipe, engpipes, qe_end + q * nengines, timing, ops, op, flags, start,
                                   limits[L_PARTITIONS], &dstart_ns, rw)
                hbm_bytes[0] += rw[0]
                hbm_bytes[1] += rw[1]
                issue_end[i] = end
                busy[q] += end - dstart_ns          # the queue's transfer span (as a profile shows DMA activity)
                qfree[q] = start + timing[T_DMA_ISSUE]   # the next DMA of the queue may be triggered after the issue
            else:
                # Engines are pipelined: the ISA formula is the issue interval (the queue is busy for it and the
                # next instruction of the queue may start after it). A result is committed later: the static
                # instruction overhead (ScalarE/VectorE/GpSimd) and the SBUF/PSUM access start-up of the read and
                # the write: latency, seen by instructions that wait for this one's result.
                cyc = cost_cycles(op, sub, q, ops, imm, fast)
                if op == OP_ACTIVATION:
                    tid = act_table_id(sub & 255)
                    if tid >= 0 and tid != act_table:   # ScalarE loads another function's table first
                        cyc += timing[T_ACT_TABLE]
                        act_table = tid
                if shared_ports and q > 0:
                    # NeuronCore-v2: VectorE and GpSimd cannot access SBUF in parallel, VectorE and ScalarE cannot
                    # access PSUM in parallel ([arch-v2] "Concurrent SBUF/PSUM accesses by engines"): the
                    # instruction waits for an idle span of the port(s) it needs and holds them while it issues
                    uses_sbuf = 0
                    uses_psum = 0
                    for s in range(N_OPERANDS):
                        if ops[s].present and ops[s].mem == MEM_SBUF:
                            uses_sbuf = 1
                        if ops[s].present and ops[s].mem == MEM_PSUM:
                            uses_psum = 1
                    uses_sbuf = uses_sbuf and (q == 2 or q == 3)
                    uses_psum = uses_psum and (q == 1 or q == 2)
                    if uses_sbuf or uses_psum:
                        t_port = start
                        while True:      # earliest span idle on every port the instruction needs
                            t0 = t_port
                            if uses_sbuf:
                                t_port = port_probe(&pipe[1], t_port, cyc / clk[q])
                            if uses_psum:
                                t_port = port_probe(&pipe[2], t_port, cyc / clk[q])
                            if t_port == t0:
                                break
                        start = t_port
                        if uses_sbuf:
                            port_reserve(&pipe[1], start, cyc / clk[q])
                        if uses_psum:
                            port_reserve(&pipe[2], start, cyc / clk[q])
                issue_end[i] = start + cyc / clk[q]
                end = issue_end[i] + ((timing[T_STATIC] if q > 0 else 0.0) + 2.0 * timing[T_ACCESS]) / clk[q]
                busy[q] += issue_end[i] - start
                qfree[q] = issue_end[i]
            times[i, 0] = start
            times[i, 1] = end
            counts[q] += 1
            if end > total:
                total = end
            if want_host:
                clock_gettime(CLOCK_MONOTONIC, &ts3)
                host_ns[i, 0] = _ns(&ts0, &ts1) + _ns(&ts2, &ts3)
                host_ns[i, 1] = _ns(&ts1, &ts2)
    finally:
        free(pipe)
        free(qe_end)
        free(issue_end)
    return total
