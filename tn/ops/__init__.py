# The op table as one package: ``import tn.ops`` gives the Op class, the OPS/FROM_ATEN/DECOMPOSITIONS tables, the decorators and every core op.
"""tn's core op set.

Every equation of a :class:`tn.ir.IR` names one :class:`Op` from :data:`OPS`.
The tracer (:mod:`tn.trace`) maps the aten ops PyTorch dispatches onto these
ops through :data:`FROM_ATEN` (one converter per aten overload) and, for
everything else, through decompositions (:data:`DECOMPOSITIONS` here, then
``torch._decomp.decomposition_table``). Views and in-place ops never reach
the table: the tracer functionalises them into the ops below.

An :class:`Op` has

- ``name``: printed in the IR;
- ``category``: what kind of work it is, for the compiler (see below);
- ``aten``: the aten overloads it stands for;
- ``impl(*inputs, **attrs)``: the torch reference (inputs are tensors or
  Python scalars in ``Eqn.inputs`` order; returns a tensor, or a tuple of
  tensors for multi-output ops);
- ``shape_rule(*avals, **attrs) -> [(shape, dtype), ...]``: by default the
  impl run on meta tensors;
- ``lowering``: ``None`` until the NeuronCore compiler registers one;
  ``tile_rule``: ``None`` until the compiler registers an SBUF tile rule
  (elementwise ops the tile engine computes in SBUF);
- ``random``: draws random numbers; ``effectful``: has an effect beyond its
  outputs; ``impure`` is either (never merged, folded or duplicated);
- ``reduce_alu`` and ``reduce_identity`` (reductions that combine elements
  with one associative ALU op: sum, prod, amax, amin, any): the VectorE ALU
  op and the value that leaves it unchanged (``None`` for other ops).

Passes and the compiler read these facts from the op; they never key tables
by op name.

The core op set (attributes in brackets):

==============  ==========================================================================
category        ops
==============  ==========================================================================
elementwise     unary: neg abs exp exp2 expm1 log log2 log1p sqrt rsqrt reciprocal sin cos
                tan asin acos atan sinh cosh tanh asinh acosh atanh sigmoid erf erfinv
                relu gelu[approximate] sign floor ceil trunc round logical_not bitwise_not
                isnan isinf conj (complex conjugate);
                binary (either input may be a Literal): add sub mul div[rounding_mode]
                pow maximum minimum eq ne lt le gt ge logical_and logical_or logical_xor
                bitwise_and bitwise_or bitwise_xor bitwise_left_shift bitwise_right_shift
                remainder fmod atan2;
                ternary: where; cast: convert[dtype]
reduction       sum[dims keepdim dtype] prod[dims keepdim dtype] amax[dims keepdim]
                amin[dims keepdim] argmax[dim keepdim] argmin[dim keepdim] any[dims keepdim]
scan            cumsum[dim dtype] cummax[dim] cummin[dim] (values, int64 indices) logcumsumexp[dim]
sort            sort[dim descending stable] topk[k dim largest sorted] (values, int64 indices)
matmul          matmul (``[..., M, K] @ [..., K, N]``, equal batch dims: aten mm and bmm)
conv            convolution[stride padding dilation transposed output_padding groups]
                convolution_backward[... output_mask]
pool            avg_pool2d[...] avg_pool2d_backward[...]
shape           reshape[shape] permute[dims] expand[shape] slice[dim start end step]
                slice_scatter[dim start end step] cat[dim] pad[pad value] flip[dims]
                as_strided[size stride offset] as_strided_scatter[size stride offset]
                view_as_real view_as_complex (complex64 ``[..]`` <-> its float32 ``(re, im)`` pairs
                ``[.., 2]``: the same bytes; :mod:`tn.ops.fft`)
index           gather[dim] scatter[dim] scatter_add[dim] scatter_reduce[dim reduce
                include_self] index[dims] index_put[dims accumulate]
creation        full[shape value dtype] iota[length start step dtype]
random          rand[shape dtype] randn[shape dtype]
host            host[fn ...]: an aten op of :data:`HOST_OVERLOADS` (eigen/SVD, non-float32 linear algebra and FFTs, hash_tensor) run by torch
                on the host, its non-tensor arguments as attributes (no NeuronCore lowering);
                linalg_check[api_name is_matrix where]: a ``torch.linalg.*_ex`` status check, effectful
                (kept with no result), raising eager's ``torch.linalg.LinAlgError`` at run time
collective      all_reduce[reduce_op group] all_gather[group_size group]
                reduce_scatter[reduce_op group_size group]
                all_to_all[output_split_sizes input_split_sizes group] broadcast[src group] wait:
                torch's functional collectives (:mod:`tn.ops.collective`; effectful, run by the compiler
                on the core's collective engine)
==============  ==========================================================================

Unary functions stay ops rather than formulas (``asinh`` as a log/sqrt
expression loses accuracy): the compiler maps them to ScalarE activation
functions or runs them on the host. Everything else (softmax, layer/batch
norm, linear, mean, var, dropout, embedding, losses, backward ops, 3-d and
adaptive pooling, 3-d convolutions and their gradients (one 2-d convolution
over depth-stacked channels), ``cat`` whose empty operands promote the dtype,
embedding_bag, median/kthvalue/mode from ``sort``,
searchsorted, distances ...) is decomposed into these by
:data:`DECOMPOSITIONS` or ``torch._decomp``; special functions (erfcx,
lgamma, digamma, zeta, Bessel functions, ndtri ...) by :mod:`tn.ops.special`,
in elementwise ops. ``slice`` always has a
non-negative ``start <= end`` within bounds and ``step >= 1``; ``dims`` of
reductions are sorted and non-negative and list every reduced dimension.

Register a new op with :func:`register` (a decorator on its reference
implementation) and map aten overloads to it with :func:`from_aten`.

The package's files:

- :mod:`tn.ops.table`: :class:`Op`, the tables and the decorators that fill them;
- :mod:`tn.ops.core`: the core ops above and the aten/prims converters onto them;
- :mod:`tn.ops.decompositions`: tn's decompositions of aten ops (arithmetic, factories, random draws,
  means/variances/norms, selections from sort, searching, indexing forms, counting, float representation);
- :mod:`tn.ops.nn_layers`: decompositions of layer ops (3-d convolutions, 3-d/adaptive pooling,
  antialiased resampling, embedding_bag, distances, the multi-label margin loss);
- :mod:`tn.ops.special`: special functions in elementwise core ops;
- :mod:`tn.ops.linear_cross_entropy`: torch's fused chunked ``F.linear_cross_entropy`` custom op (loss and its
  closed-form gradients) as one linear and a cross-entropy;
- :mod:`tn.ops.resample`: gradients of ``interpolate``'s separable modes (nearest, linear, bilinear, bicubic,
  trilinear) as per-axis transposed weight matrices taken from torch's own forward kernels;
- :mod:`tn.ops.collective`: the collective ops (functional collectives) and how they reach a process group;
- :mod:`tn.ops.attention_grad`: the CPU flash-attention backward (``nn.Transformer*`` trained through
  ``torch.compile``) in matmuls and a softmax;
- :mod:`tn.ops.linalg`: float32 Cholesky, triangular solves, LU with LAPACK's pivoting, Householder QR (and the solves,
  inverses and determinants built on them), unrolled over the matrix size; other dtypes stay ``host`` ops;
- :mod:`tn.ops.fft`: the complex views and float32/complex64 FFTs (``aten._fft_r2c/_fft_c2c/_fft_c2r``) as
  DFT matmuls on the (re, im) pairs; other dtypes stay ``host`` ops;
- :mod:`tn.ops.grouped_mm`: grouped matmul (MoE experts: ``aten._grouped_mm`` and Hugging Face's
  ``transformers::grouped_mm_fallback`` ops, by name) as dense masked matmuls;
- :mod:`tn.ops.ctc`: the CTC loss and its gradient (``aten._ctc_loss``, ``_ctc_loss_backward``), torch's CPU
  alpha/beta recursions unrolled over time with the lengths as masks;
- :mod:`tn.ops.segment_reduce_grad`: ``aten._segment_reduce_backward`` (sum, mean, max, min, prod; lengths or
  offsets) as torch's CPU kernel defines it, elementwise on the rows of each segment;
- :mod:`tn.ops.ldl`: float32 ``L D L^T`` with LAPACK's Bunch-Kaufman pivots (``linalg_ldl_factor_ex``,
  ``linalg_ldl_solve``), one masked step per column; other dtypes and large matrices the ``host`` op;
- :mod:`tn.ops.histogram`: ``histogram`` / ``histogramdd`` of float32 data (edges from the data's range in the
  program, torch's bin search, a ``scatter_add``).
- :mod:`tn.ops.low_precision`: the bf16/fp16 tests the files share (``is_low_precision``, ``acc_dtype``) and the
  ops whose 16-bit gradient every door computes in float32 and rounds once (``linalg_vector_norm``, ``div`` by a
  tensor that needs a gradient), installed above autograd by the doors.
"""
from __future__ import annotations

from . import (attention_grad, collective, core, ctc, decompositions, fft, grouped_mm, histogram, ldl,  # noqa: F401
               linalg, linear_cross_entropy, low_precision, nn_layers, resample, segment_reduce_grad,
               special)  # (register them)
from .core import (  # noqa: F401  (the core ops registered by name in the module: tn.ops.matmul is OPS['matmul'])
    argmax, argmin, as_strided, as_strided_scatter, avg_pool2d, avg_pool2d_backward, cat, conj, convert,
    convolution, convolution_backward, cummax, cummin, cumsum, div, expand, flip, full, gather, gelu, host, index,
    index_put, iota, logcumsumexp, matmul, pad, permute, rand, randn, reshape, round_, scatter, scatter_add,
    scatter_reduce, slice_, slice_scatter, sort, topk, where, HOST_OVERLOADS, slice_bounds, trace_as_host)
from .table import (CATEGORIES, DECOMPOSITIONS, DECOMPOSITIONS_BY_NAME, FROM_ATEN, IDENTITY, OPS,  # noqa: F401
                    OVERRIDE_REASONS, Op, decomposition, decomposition_by_name, from_aten, get, meta_shape_rule,
                    register)

__all__ = [
    "Op", "OPS", "FROM_ATEN", "DECOMPOSITIONS", "OVERRIDE_REASONS", "IDENTITY", "register", "from_aten",
    "meta_shape_rule", "get", "DECOMPOSITIONS_BY_NAME", "decomposition_by_name",
]
