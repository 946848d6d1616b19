# The NeuronCore instruction set of tn (modelled on nki.isa): opcodes, dtypes, ALU/activation enums, the encoded record layout, costs.
"""Instruction set of the software NeuronCore.

Instructions (modelled on ``nki.isa``), the engine that runs them and what
they compute. ``P`` is an operand's partition count, ``N`` its free size
(elements per partition); "tile" means an SBUF or PSUM operand.

==================  =========  ================================================================
opcode              engine     semantics
==================  =========  ================================================================
dma_copy            DMA queue  ``dst = src``; HBM<->SBUF or SBUF<->SBUF, access patterns on
                               both sides, same dtype and shape.
dma_gather          DMA queue  ``dst[p, :] = table[idx[p], :]`` (indirect rows; embeddings);
                               ``idx`` an int32/int64 SBUF tile ``[P, 1]``, every index checked.
dma_scatter         DMA queue  ``table[idx[p], :] = src[p, :]`` (or ``+=`` with accumulate, in
                               partition order: embedding gradients); HBM table.
matmul              TensorE    ``psum[M, N] (+)= stat[K, M]^T @ mov[K, N]``; K, M <= 128,
                               N <= 512, result fp32 inside one PSUM bank.
transpose           TensorE    ``psum[F, P] = in[P, F]^T`` (P, F <= 128).
activation          ScalarE    ``out = f(in * scale + bias)``; scale/bias immediates or
                               per-partition ``[P, 1]`` tiles; optional fused free-axis
                               reduce into a ``[P, 1]`` tile.
tensor_tensor       VectorE    ``out = a <op> b`` (:data:`ALU_OPS`).
tensor_scalar       VectorE    ``out = (in <op0> s0) <op1> s1``; s immediates or ``[P, 1]`` tiles.
tensor_reduce       VectorE    reduce along the innermost free axes (:data:`REDUCE_OPS`).
tensor_copy         VectorE    copy with dtype cast (also PSUM -> SBUF); ScalarE/GpSimd allowed.
select              VectorE    ``out = pred != 0 ? a : b``.
bn_stats            VectorE    per partition ``[count, mean, var]`` of ``in[P, N<=512]``.
bn_aggr             VectorE    combine ``G`` bn_stats triples ``in[P, 3G]`` into ``[mean, var]``.
iota                GpSimd     ``out = base + cm * p + sum_d m_d * i_d`` (p relative to the tile).
affine_select       GpSimd     ``out = (base + cm*p + sum_d m_d*i_d) <cmp> 0 ? in : fill``
                               (causal / band masks).
memset              GpSimd     ``out = value`` (VectorE allowed).
partition_reduce    GpSimd     ``out[p, f] = reduce_q in[q, f]`` for every out partition.
partition_shuffle   GpSimd     ``out[p, :] = in[perm[p], :]``.
==================  =========  ================================================================

Arithmetic on Vector/Scalar/GpSimd engines is done in fp32 and rounded to the
output dtype (bf16 round-to-nearest-even, fp16 IEEE, integers by C
truncation toward zero after saturating, bool/uint8 as 0/1 or 0..255).
The integer ALU ops (:data:`INT_ALU_OPS`: ``bitwise_and``, ``bitwise_or``,
``bitwise_xor``, ``left_shift``, ``arith_shift_right``, as the hardware's
bitwise ALU ops) are the exception: they work on the operands' integer values
as int32 words (two's complement), every operand and the output int32, uint8
or bool, immediates integers in the int32 range, results stored by
truncation (uint8 keeps the low 8 bits, bool is ``!= 0``); shift amounts
outside 0..31 give 0 (left) or the sign fill (right), as torch's int32
shifts. A ``tensor_scalar`` does not mix them with fp32 ALU ops.

Rules (checked before every instruction runs; a violation raises
:class:`tn.NeuronError` naming the instruction, the operand and the limit):

* partition count 1..128; compute-engine operands start at partition
  0/32/64/96 with at most 128/32/64/32 partitions from there (quadrants);
* every operand inside its memory (SBUF partition bytes, PSUM 16 KiB, the
  bound HBM buffer); byte offsets aligned to the element size;
* matmul: stationary/moving in SBUF, same dtype (fp32/bf16/fp16), same
  partitions (K); M <= 128, N <= 512; output fp32 in PSUM inside one bank;
  no instruction may write a PSUM bank region a live accumulation group owns;
* Vector/Scalar free size <= 64K elements; GpSimd cannot access PSUM; DMA
  cannot access PSUM; int64 only on DMA; operands of one instruction have the
  same partition count and free shape (use stride-0 broadcast views).

Encoding
--------
A program is encoded as an int64 numpy array of shape ``(n, REC_WIDTH)``
plus an int64 ``deps`` array and an int64 ``aux`` array. A record:
``[opcode, queue, subop, flags, dep_start, dep_count, aux_start, aux_count,
imm0..imm7, operand0 .. operand4]``; immediates are float64 bit patterns;
each operand is ``OPERAND_WIDTH`` int64: ``[mem, buf, dtype, part_start,
part_count, part_stride, offset, 0, num0, stride0, ..., num3, stride3]``
(dims outer to inner, strides in elements; for SBUF/PSUM ``offset`` is the
byte offset inside a partition, for HBM the element offset and
``part_stride`` the element stride of the partition dim). Operand slots:
0 = out, 1.. = inputs in the order of the table above. ``deps[dep_start:
dep_start+dep_count]`` are indices of earlier instructions this one waits for
(semaphore waits).
"""
from __future__ import annotations

import numpy as np

from ..errors import NeuronError

__all__ = [
    "DTYPES", "DTYPE_CODES", "DTYPE_SIZES", "OPCODES", "OPCODE_NAMES", "ALU_OPS", "INT_ALU_OPS", "ACT_FUNCS",
    "REDUCE_OPS", "CMP_OPS", "MEM_NONE", "MEM_HBM", "MEM_SBUF", "MEM_PSUM", "REC_WIDTH",
    "OPERAND_WIDTH", "cost_cycles", "numpy_dtype", "dtype_code",
]

# ----- memories -----
MEM_NONE, MEM_HBM, MEM_SBUF, MEM_PSUM = 0, 1, 2, 3
MEM_NAMES = {MEM_NONE: "none", MEM_HBM: "HBM", MEM_SBUF: "SBUF", MEM_PSUM: "PSUM"}

# ----- dtypes -----
#: dtype name -> code (as encoded).
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "int32": 3, "int64": 4, "uint8": 5, "bool": 6}
#: code -> name.
DTYPES = {v: k for k, v in DTYPE_CODES.items()}
#: code -> bytes per element.
DTYPE_SIZES = {0: 4, 1: 2, 2: 2, 3: 4, 4: 8, 5: 1, 6: 1}
_ALIASES = {
    "fp32": "float32", "f32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
    "f16": "float16", "half": "float16", "i32": "int32", "int": "int32", "i64": "int64", "u8": "uint8",
    "bool_": "bool",
}


def dtype_code(dtype) -> int:
    """Encoded code of ``dtype`` (a name like ``"bf16"``/``"float32"``, a numpy or torch dtype, or a code)."""
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        if dtype in DTYPES:
            return dtype
    else:
        name = str(dtype).replace("torch.", "")
        name = _ALIASES.get(name, name)
        if name in DTYPE_CODES:
            return DTYPE_CODES[name]

    raise NeuronError(f"unsupported NeuronCore dtype {dtype!r}: use one of {', '.join(DTYPE_CODES)}")


def numpy_dtype(code: int):
    """The numpy dtype storing a NeuronCore dtype (bfloat16 is stored as raw ``uint16`` bits)."""
    return {0: np.float32, 1: np.uint16, 2: np.float16, 3: np.int32, 4: np.int64, 5: np.uint8, 6: np.bool_}[code]


# ----- opcodes -----
OPCODES = {
    "dma_copy": 1, "dma_gather": 2, "matmul": 3, "transpose": 4, "activation": 5, "tensor_tensor": 6,
    "tensor_scalar": 7, "tensor_reduce": 8, "tensor_copy": 9, "select": 10, "bn_stats": 11, "bn_aggr": 12,
    "iota": 13, "affine_select": 14, "memset": 15, "partition_reduce": 16, "partition_shuffle": 17,
    "dma_scatter": 18,
}
#: opcode -> name.
OPCODE_NAMES = {v: k for k, v in OPCODES.items()}

#: VectorE ALU ops (tensor_tensor / tensor_scalar). ``bypass`` returns the first operand.
ALU_OPS = {
    "bypass": 0, "add": 1, "subtract": 2, "multiply": 3, "divide": 4, "max": 5, "min": 6, "pow": 7,
    "is_equal": 8, "not_equal": 9, "is_ge": 10, "is_gt": 11, "is_le": 12, "is_lt": 13,
    "logical_and": 14, "logical_or": 15, "logical_xor": 16, "abs_max": 17, "mod": 18,
    # integer ALU ops (as VectorE's bitwise ops, NKI nl.bitwise_and ...): int32/uint8/bool words, not fp32
    "bitwise_and": 19, "bitwise_or": 20, "bitwise_xor": 21, "left_shift": 22, "arith_shift_right": 23,
}
#: The integer ALU ops (see the module docstring).
INT_ALU_OPS = ("bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "arith_shift_right")
#: ScalarE activation functions.
ACT_FUNCS = {
    "identity": 0, "relu": 1, "gelu_tanh": 2, "gelu": 3, "sigmoid": 4, "tanh": 5, "exp": 6, "log": 7,
    "silu": 8, "softplus": 9, "sqrt": 10, "rsqrt": 11, "reciprocal": 12, "square": 13, "abs": 14,
    "sign": 15, "sin": 16, "cos": 17, "erf": 18, "copy": 0,
}
#: ScalarE functions computed without an activation table (*assumption*, see ``Arch.act_table_switch_cycles``):
#: switching to or from them does not reload the table; every other function has a table of its own.
ACT_TABLE_FREE = ("identity", "copy", "relu", "square", "abs", "sign")
#: Reduce ops (tensor_reduce, activation's fused reduce, partition_reduce). ``none`` = no reduce.
REDUCE_OPS = {"none": 0, "add": 1, "max": 2, "min": 3, "multiply": 4, "logical_and": 5, "logical_or": 6}
#: Comparisons of affine_select (``expr <cmp> 0``).
CMP_OPS = {"is_ge": 0, "is_gt": 1, "is_le": 2, "is_lt": 3, "is_equal": 4, "not_equal": 5}

# ----- flags -----
FLAG_ACCUMULATE = 1   # matmul: add into PSUM instead of overwriting
FLAG_REV0 = 2         # tensor_scalar: s0 <op0> in instead of in <op0> s0
FLAG_REV1 = 4         # tensor_scalar: s1 <op1> x instead of x <op1> s1
FLAG_STOP = 8         # matmul: closes the PSUM accumulation group

# ----- record layout -----
H_OPCODE, H_QUEUE, H_SUBOP, H_FLAGS, H_DEP_START, H_DEP_COUNT, H_AUX_START, H_AUX_COUNT = range(8)
H_IMM = 8
N_IMM = 8
OPERAND_BASE = 16
OPERAND_WIDTH = 16
N_OPERANDS = 5
REC_WIDTH = OPERAND_BASE + N_OPERANDS * OPERAND_WIDTH
O_MEM, O_BUF, O_DTYPE, O_PSTART, O_PCOUNT, O_PSTRIDE, O_OFFSET = range(7)
O_NUM0 = 8  # num_d at O_NUM0 + 2d, stride_d at O_NUM0 + 2d + 1

#: Names of the operand slots per opcode (used in error messages).
OPERAND_NAMES = {
    "dma_copy": ("dst", "src"),
    "dma_gather": ("dst", "table", "indices"),
    "matmul": ("psum", "stationary", "moving"),
    "transpose": ("psum", "in"),
    "activation": ("out", "in", "bias", "scale", "reduce_out"),
    "tensor_tensor": ("out", "in0", "in1"),
    "tensor_scalar": ("out", "in", "operand0", "operand1"),
    "tensor_reduce": ("out", "in"),
    "tensor_copy": ("out", "in"),
    "select": ("out", "pred", "on_true", "on_false"),
    "bn_stats": ("out", "in"),
    "bn_aggr": ("out", "in"),
    "iota": ("out",),
    "affine_select": ("out", "in"),
    "memset": ("out",),
    "partition_reduce": ("out", "in"),
    "partition_shuffle": ("out", "in"),
    "dma_scatter": ("table", "src", "indices"),
}


def cost_cycles(opcode: str, n: int, *, m: int = 0, fp32: bool = False, func: str = "identity",
                parts: int = 128, access_cycles: int = 0, dtype: str = "float32", alu: str = None,
                psum: bool = False, contiguous: bool = True, fast: float = 1.0, zero: bool = False,
                fused_reduce: bool = False, strided: bool = False, transpose_mode: bool = False) -> int:
    """Issue interval of one compute instruction in engine cycles: the cycles its queue is busy (the next
    instruction of the same engine may start after them), plus ``access_cycles`` (pass an engine's
    :meth:`tn.neuron.arch.Arch.result_latency_cycles` to get the cycles until its result is committed, which is
    what instructions waiting for it see). The native engine implements the same rules.

    ``n`` is the free size (elements per partition) of the main input (matmul: the moving free size N, ``m``
    the stationary free size M; transpose: ``n`` = partitions P, ``m`` = free size F; memset: the output).
    MIN_II = 64 cycles. Rules ([isa] = NKI ISA "Estimated instruction cost", SDK 2.25; see
    :mod:`tn.neuron.arch` for the other sources):

    * matmul ``max(min(64, M), N)``, x4 for fp32 ([isa] nc_matmul, [arch-v2] "Cost Model"). The ``min(64, M)``
      term is fast LoadStationary: loading a stationary of M columns costs at most MIN_II, up to 4x faster
      than a MultiplyMoving of the same free size ([arch-v2] "Fast LoadStationary").
    * transpose (TensorE) ``max(P, min(64, F))`` ([isa] nc_transpose), x4 for fp32, x2 with trn2's transpose
      mode (``transpose_mode``, [arch-v3] "2x speedup in FP32 transpose").
    * activation ``max(64, N)``, + 64 with a fused reduce (``fused_reduce``); scale/bias free ([isa]
      activation); ``reciprocal`` too: ``max(MIN_II, N)`` on ScalarE ([isa] engine selection table; 8N is
      VectorE's reciprocal, which tn does not emit).
    * tensor_tensor ``max(64, N)`` with an input in PSUM (``psum``) or for bf16 add/subtract/multiply on
      contiguous SBUF operands, else ``max(64, 2N)`` ([isa] tensor_tensor); select (3 inputs) 2N (*model*).
    * tensor_scalar, tensor_copy, bn_stats ``max(64, N)``; bn_aggr ``max(64, 13N/3)``; tensor_reduce
      ``max(64, N/2)`` for bf16 add/max, else ``max(64, N)``; memset ``N/2`` for a zero fill of bf16/fp16,
      else N (``zero``); iota and affine_select ``150 + N`` ([isa]).
    * ``fast``: trn2 VectorE performance-mode factor (4 or 2 for tensor_copy/tensor_scalar, 2 for
      tensor_tensor, [arch-v3] "Vector Engine Performance Mode"; the engine decides it from the operands).
    * ``strided``: an SBUF/PSUM operand of a ScalarE/VectorE/GpSimd instruction has an innermost stride over
      16 bytes: half bandwidth, 2x the N-dependent cost ([arch-v2] "Access pattern"; not applied to TensorE,
      whose costs are published as initiation intervals).
    * partition_shuffle ``150 + N`` and partition_reduce ``150 + N * ceil(log2 P)`` (*model*: GpSimd
      cross-partition work, no published cost).
    """
    if opcode == "matmul":
        return int(max(min(64, m), n) * (4 if fp32 else 1)) + access_cycles
    if opcode == "transpose":  # a matmul against the identity: stationary = in (F columns), moving N = P
        return int(max(min(64, m), n) * ((2 if transpose_mode else 4) if fp32 else 1)) + access_cycles
    if opcode == "activation":
        c = max(64, n * (2 if strided else 1)) + (64 if fused_reduce else 0)
        return int(c) + access_cycles
    if opcode in ("iota", "partition_shuffle", "affine_select"):
        return int(150 + n) + access_cycles
    if opcode == "partition_reduce":
        return int(150 + n * max(1, (parts - 1).bit_length())) + access_cycles
    if opcode == "tensor_tensor":
        one_pass = psum or (alu in ("add", "subtract", "multiply") and dtype == "bfloat16" and contiguous)
        c = n if one_pass else 2 * n
    elif opcode == "select":
        c = 2 * n
    elif opcode == "tensor_reduce":
        c = n / 2 if (dtype == "bfloat16" and alu in ("add", "max")) else n
    elif opcode == "memset":
        c = n / 2 if (zero and dtype in ("bfloat16", "float16")) else n
    elif opcode == "bn_aggr":
        c = 13 * n / 3
    elif opcode in ("tensor_scalar", "tensor_copy", "bn_stats"):
        c = n
    else:
        raise NeuronError(f"no cost formula for {opcode!r}: DMA costs are in ns (see tn.neuron.arch)")
    c = c * (2 if strided else 1) / fast
    return int(max(64, c)) + access_cycles
