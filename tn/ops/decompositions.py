# tn's decompositions of aten ops into the core forms: arithmetic with alpha, factories, random draws, means/variances/norms, selections from sort, searching, indexing forms, counting, float representation.
"""Decompositions: functions over aten ops, run by the tracer on traced tensors, that bring calls into the
canonical forms of :mod:`tn.ops.core`.

The tracer tries these before ``torch._decomp.decomposition_table``. Where an
overload also has a torch decomposition, the ``@decomposition`` decorator
says in one line why tn's is used instead (:data:`tn.ops.OVERRIDE_REASONS`).
"""
from __future__ import annotations

import math
from typing import Any, Tuple

import torch

from .core import _dim, _dims, _promoted
from .low_precision import acc_dtype, is_low_precision
from .table import decomposition

aten = torch.ops.aten
prims = torch.ops.prims
Tensor = torch.Tensor


@decomposition(aten.cat.default,
               instead_of_torch="torch's ref keeps the zero-size operands (the chip never sees one) and fails to "
                                "trace when they promote the dtype")
def _cat_decomp(xs, dim=0):
    """``cat`` whose empty operands promote the dtype: the non-empty operands cast, then concatenated."""
    dt = _promoted(xs)
    full = [x if x.dtype == dt else aten._to_copy.default(x, dtype=dt) for x in xs if x.numel() > 0]
    return aten.cat.default(full, dim)


@decomposition(aten.add.Tensor, aten.add.Scalar,
               instead_of_torch="torch's ref rejects add.Scalar's positional alpha (TypeError); add.Tensor gives the "
                                "same IR (mul, add)")
def _add_alpha(x, y, alpha=1):
    """``x + alpha * y``."""
    return aten.add.Tensor(x, aten.mul.Tensor(y, alpha) if isinstance(y, Tensor) else y * alpha)


@decomposition(aten.sub.Tensor, aten.sub.Scalar,
               instead_of_torch="torch's ref rejects sub.Scalar's positional alpha (TypeError); sub.Tensor gives the "
                                "same IR (mul, sub)")
def _sub_alpha(x, y, alpha=1):
    """``x - alpha * y``."""
    return aten.sub.Tensor(x, aten.mul.Tensor(y, alpha) if isinstance(y, Tensor) else y * alpha)


@decomposition(aten.rsub.Tensor, aten.rsub.Scalar,
               instead_of_torch="none measured: for a Python y torch's ref gives mul+sub, this mul+neg+add (one equation "
                                "more); kept so programs stay the same")
def _rsub(x, y, alpha=1):
    """``y - alpha * x``."""
    if alpha != 1:
        x = aten.mul.Tensor(x, alpha)
    if isinstance(y, Tensor):
        return aten.sub.Tensor(y, x)
    return aten.add.Tensor(aten.neg.default(x), y)


@decomposition(aten.full.default,
               instead_of_torch="same IR as torch's ref; infers the dtype from the fill value as eager torch does "
                                "(bool, int64, complex64, default float)")
def _full_infer_dtype(size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    """``full`` without a dtype: the dtype torch infers from the fill value."""
    dtype = (torch.bool if isinstance(fill_value, bool) else torch.int64 if isinstance(fill_value, int)
             else torch.complex64 if isinstance(fill_value, complex) else torch.get_default_dtype())
    return aten.full.default(size, fill_value, dtype=dtype)


@decomposition(aten.empty.memory_format)
def _empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """Uninitialised memory is zeros in tn."""
    return aten.full.default(size, 0, dtype=dtype or torch.get_default_dtype())


@decomposition(aten.empty_strided.default,
               instead_of_torch="torch's ref allocates through prims.empty_strided, which has no core op "
                                "(UnsupportedOpError)")
def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    """Uninitialised memory is zeros in tn (strides do not exist in the IR)."""
    return aten.full.default(size, 0, dtype=dtype or torch.get_default_dtype())


@decomposition(aten.empty_permuted.default)
def _empty_permuted(size, physical_layout, *, dtype=None, layout=None, device=None, pin_memory=None):
    """Uninitialised memory is zeros in tn (layouts do not exist in the IR)."""
    return aten.full.default(size, 0, dtype=dtype or torch.get_default_dtype())


@decomposition(aten.new_empty_strided.default,
               instead_of_torch="same IR as torch's ref (zeros); kept beside empty_strided, whose ref does not trace")
def _new_empty_strided(x, size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    """Uninitialised memory is zeros in tn."""
    return aten.full.default(size, 0, dtype=dtype or x.dtype)


@decomposition(aten.full_like.default)
def _full_like(x, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None,
               memory_format=None):
    """``full`` with ``x``'s shape and dtype."""
    return aten.full.default(tuple(x.shape), fill_value, dtype=dtype or x.dtype)


@decomposition(aten.rand_like.default)
def _rand_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """``rand`` with ``x``'s shape and dtype."""
    return aten.rand.default(tuple(x.shape), dtype=dtype or x.dtype)


@decomposition(aten.randn_like.default)
def _randn_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """``randn`` with ``x``'s shape and dtype."""
    return aten.randn.default(tuple(x.shape), dtype=dtype or x.dtype)


@decomposition(aten.bernoulli.p)
def _bernoulli_p(x, p=0.5, *, generator=None):
    """1 with probability ``p`` else 0, shaped like ``x``."""
    return aten._to_copy.default(aten.lt.Scalar(aten.rand.default(tuple(x.shape), dtype=torch.float32), p),
                                 dtype=x.dtype)


@decomposition(aten.bernoulli_.float)
def _bernoulli_inplace(x, p=0.5, *, generator=None):
    """In place: ``x`` becomes 1 with probability ``p`` else 0."""
    return aten.copy_.default(x, _bernoulli_p(x, p))


@decomposition(aten.bernoulli.default,
               instead_of_torch="same IR as torch's (rand < p, cast); draws in p's dtype without torch's generator "
                                "branch")
def _bernoulli(p, *, generator=None):
    """1 with probability ``p`` (elementwise) else 0."""
    r = aten.rand.default(tuple(p.shape), dtype=p.dtype)
    return aten._to_copy.default(aten.lt.Tensor(r, p), dtype=p.dtype)


@decomposition(aten.mean.dim,
               instead_of_torch="16-bit floats: one equation fewer than torch's ref (sum in fp32, one cast each way)")
def _mean_dim(x, dim=None, keepdim=False, *, dtype=None):
    """Sum (accumulated in fp32 for low-precision floats) divided by the count."""
    dims = _dims(dim, x.dim())
    n = 1
    for d in dims:
        n *= x.shape[d]
    out_dtype = dtype or x.dtype
    acc = acc_dtype(out_dtype)
    s = aten.sum.dim_IntList(x, list(dims), keepdim, dtype=acc)
    r = aten.div.Tensor(s, n)
    return aten._to_copy.default(r, dtype=out_dtype) if r.dtype != out_dtype else r


@decomposition(aten.mean.default,
               instead_of_torch="16-bit floats: one equation fewer than torch's ref (through mean.dim above)")
def _mean_all(x, *, dtype=None):
    """Mean of all elements."""
    return _mean_dim(x, None, False, dtype=dtype)


@decomposition(aten.max.dim)
def _max_dim(x, dim, keepdim=False):
    """(amax, argmax) along ``dim``."""
    return aten.amax.default(x, [dim], keepdim), aten.argmax.default(x, dim, keepdim)


@decomposition(aten.min.dim)
def _min_dim(x, dim, keepdim=False):
    """(amin, argmin) along ``dim``."""
    return aten.amin.default(x, [dim], keepdim), aten.argmin.default(x, dim, keepdim)


@decomposition(aten.clamp.default,
               instead_of_torch="two equations (maximum, minimum) where torch's ref builds eight (NaN masks and "
                                "where)")
def _clamp(x, min=None, max=None):
    """``minimum(maximum(x, min), max)`` in the result dtype of clamp."""
    out_dtype = x.dtype
    for b in (min, max):
        if b is not None:
            out_dtype = torch.promote_types(out_dtype, torch.result_type(x, b))
    y = x if x.dtype == out_dtype else aten._to_copy.default(x, dtype=out_dtype)
    if min is not None:
        y = aten.maximum.default(y, aten.scalar_tensor.default(min, dtype=out_dtype))
    if max is not None:
        y = aten.minimum.default(y, aten.scalar_tensor.default(max, dtype=out_dtype))
    return y


@decomposition(aten.clamp.Tensor,
               instead_of_torch="two equations (maximum, minimum) where torch's ref builds eight (NaN masks and "
                                "where)")
def _clamp_tensor(x, min=None, max=None):
    """``minimum(maximum(x, min), max)`` with tensor bounds."""
    y = x
    if min is not None:
        y = aten.maximum.default(y, min)
    if max is not None:
        y = aten.minimum.default(y, max)
    return y


@decomposition(aten.addmm.default,
               instead_of_torch="leaves out the multiplies by alpha or beta equal to 1, which torch's always emits")
def _addmm(bias, a, b, *, beta=1, alpha=1):
    """``beta * bias + alpha * (a @ b)``. A 16-bit call that accumulates into a full ``[M, N]`` matrix (not a
    broadcast bias) runs in float32 and is rounded once, as torch's CPU kernel does (fp32 ``beta * C + alpha *
    sum``): ``C - A @ B`` typically cancels (torch's chunked cross-entropy gradient is such an update), and the
    product rounded to bf16 before the sum lost up to 100x eager's error there."""
    low = is_low_precision(a.dtype)
    if low and beta != 0 and tuple(bias.shape) == (a.shape[0], b.shape[1]) and a.shape[0] > 1:
        f32 = torch.float32
        full = _addmm(aten._to_copy.default(bias, dtype=f32), aten._to_copy.default(a, dtype=f32),
                      aten._to_copy.default(b, dtype=f32), beta=beta, alpha=alpha)
        return aten._to_copy.default(full, dtype=a.dtype)
    out = aten.mm.default(a, b)
    if alpha != 1:
        out = aten.mul.Tensor(out, alpha)
    if beta == 0:
        return out
    if beta != 1:
        bias = aten.mul.Tensor(bias, beta)
    return aten.add.Tensor(out, bias)


@decomposition(aten.select_scatter.default,
               instead_of_torch="two equations (reshape, slice_scatter) where torch's ref builds three (expand, where "
                                "over a mask)")
def _select_scatter(x, src, dim, index):
    """slice_scatter of ``src`` unsqueezed at ``dim``."""
    dim = _dim(dim, x.dim())
    index = index % x.shape[dim]
    return aten.slice_scatter.default(x, aten.unsqueeze.default(src, dim), dim, index, index + 1, 1)


@decomposition(aten.sigmoid_backward.default,
               instead_of_torch="torch's (conj_physical and an out= wrapper) fails in the tracer (TypeError)")
def _sigmoid_backward(grad, y):
    """``grad * y * (1 - y)``."""
    return aten.mul.Tensor(grad, aten.mul.Tensor(y, aten.rsub.Scalar(y, 1)))


@decomposition(aten.tanh_backward.default,
               instead_of_torch="torch's (conj_physical and an out= wrapper) fails in the tracer (TypeError)")
def _tanh_backward(grad, y):
    """``grad * (1 - y * y)``."""
    return aten.mul.Tensor(grad, aten.rsub.Scalar(aten.mul.Tensor(y, y), 1))


@decomposition(aten.threshold_backward.default,
               instead_of_torch="same IR as torch's (le, where); the zero is made in grad's dtype")
def _threshold_backward(grad, x, threshold):
    """``grad`` where ``x > threshold`` else 0."""
    return aten.where.self(aten.le.Scalar(x, threshold), aten.scalar_tensor.default(0, dtype=grad.dtype), grad)


def _moments(x, dims, correction):
    """(var, mean), both keepdim, in the accumulation dtype (fp32 for fp16/bf16 inputs)."""
    n = 1
    for d in dims:
        n *= x.shape[d]
    acc = acc_dtype(x.dtype)
    xa = x if x.dtype == acc else aten._to_copy.default(x, dtype=acc)
    mean = aten.div.Tensor(aten.sum.dim_IntList(xa, list(dims), True), n)
    d = aten.sub.Tensor(xa, mean)
    var = aten.div.Tensor(aten.sum.dim_IntList(aten.mul.Tensor(d, d), list(dims), True), max(n - correction, 0))
    return var, mean


def _var_core(x, dims, correction, keepdim):
    """(var, mean) over ``dims``, computed in fp32 for low-precision inputs."""
    var, mean = _moments(x, dims, correction)
    if not keepdim:
        shape = [s for i, s in enumerate(x.shape) if i not in dims]
        var = aten.view.default(var, shape)
        mean = aten.view.default(mean, shape)
    if var.dtype != x.dtype:
        var = aten._to_copy.default(var, dtype=x.dtype)
        mean = aten._to_copy.default(mean, dtype=x.dtype)
    return var, mean


@decomposition(aten.native_layer_norm.default,
               instead_of_torch="four equations fewer than torch's ref (no as_strided of the statistics; fp32 for "
                                "16-bit inputs)")
def _layer_norm(x, normalized_shape, weight, bias, eps):
    """(out, mean, rstd): ``(x - mean) * rsqrt(var + eps) * weight + bias``, in fp32 for fp16/bf16; mean and rstd
    come back in the input's dtype, as torch's CPU kernel gives them."""
    axis = x.dim() - len(normalized_shape)
    dims = tuple(range(axis, x.dim()))
    var, mean = _moments(x, dims, 0)
    rstd = aten.rsqrt.default(aten.add.Tensor(var, eps))
    xa = x if x.dtype == mean.dtype else aten._to_copy.default(x, dtype=mean.dtype)
    out = aten.mul.Tensor(aten.sub.Tensor(xa, mean), rstd)
    if weight is not None:
        out = aten.mul.Tensor(out, weight)
    if bias is not None:
        out = aten.add.Tensor(out, bias)
    if out.dtype != x.dtype:
        out = aten._to_copy.default(out, dtype=x.dtype)
    if mean.dtype != x.dtype:   # torch's CPU contract: the statistics in the input's dtype (CUDA keeps fp32)
        mean = aten._to_copy.default(mean, dtype=x.dtype)
        rstd = aten._to_copy.default(rstd, dtype=x.dtype)
    return out, mean, rstd


@decomposition(torch.ops.prims.broadcast_in_dim.default)
def _broadcast_in_dim(x, shape, broadcast_dimensions):
    """prims.broadcast_in_dim: reshape to rank ``len(shape)`` with 1s, then expand."""
    mid = [1] * len(shape)
    for src, dst in enumerate(broadcast_dimensions):
        mid[dst] = x.shape[src]
    return aten.expand.default(aten.view.default(x, mid), list(shape))


def _correction(unbiased=None, correction=None):
    if correction is not None:
        return correction
    return 1 if unbiased is None or unbiased else 0


@decomposition(aten.var.correction,
               instead_of_torch="same IR as torch's ref; the two-pass form shared with var_mean and prims.var")
def _var(x, dim=None, *, correction=None, keepdim=False):
    """Two-pass variance: ``sum((x - mean)^2) / (n - correction)``."""
    return _var_core(x, _dims(dim, x.dim()), _correction(None, correction), keepdim)[0]


@decomposition(aten.var_mean.correction,
               instead_of_torch="one equation fewer than torch's ref (the mean of the two-pass variance is returned, "
                                "not recomputed)")
def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    """(variance, mean) as :func:`_var`."""
    return _var_core(x, _dims(dim, x.dim()), _correction(None, correction), keepdim)


@decomposition(torch.ops.prims.var.default)
def _prims_var(x, dims, correction, *, output_dtype=None):
    """prims.var (used by torch._refs) in core ops."""
    return _var_core(x, _dims(dims, x.dim()), correction, False)[0]


@decomposition(aten.masked_fill.Scalar, aten.masked_fill.Tensor,
               instead_of_torch="same IR as torch's ref (where in x's dtype)")
def _masked_fill(x, mask, value):
    """``where(mask, value, x)`` in ``x``'s dtype."""
    if isinstance(value, Tensor):
        if value.dtype != x.dtype:
            value = aten._to_copy.default(value, dtype=x.dtype)
    else:
        value = aten.scalar_tensor.default(value, dtype=x.dtype)
    return aten.where.self(mask, value, x)


@decomposition(aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar,
               instead_of_torch="not reached in traces today (where(cond, scalar, x) arrives as where.self); same IR "
                                "as torch's ref")
def _where_scalars(c, x, y):
    """``where`` with Python-scalar branches: the scalars become 0-d tensors of the result dtype."""
    if isinstance(x, Tensor):
        dtype = torch.result_type(x, y)
    elif isinstance(y, Tensor):
        dtype = torch.result_type(y, x)
    else:
        dtype = (torch.bool if isinstance(x, bool) and isinstance(y, bool) else
                 torch.int64 if isinstance(x, int) and isinstance(y, int) else torch.get_default_dtype())
    if not isinstance(x, Tensor):
        x = aten.scalar_tensor.default(x, dtype=dtype)
    elif x.dtype != dtype:
        x = aten._to_copy.default(x, dtype=dtype)
    if not isinstance(y, Tensor):
        y = aten.scalar_tensor.default(y, dtype=dtype)
    elif y.dtype != dtype:
        y = aten._to_copy.default(y, dtype=dtype)
    return aten.where.self(c, x, y)


@decomposition(prims.log10.default, aten.log10.default,
               instead_of_torch="16-bit floats: two equations fewer than torch's ref; fp32 gives the same IR (log, "
                                "div)")
def _log10(x):
    """``log(x) / log(10)``."""
    return aten.div.Tensor(aten.log.default(x), 2.302585092994046)


@decomposition(prims.fmax.default, aten.fmax.default,
               instead_of_torch="torch's ref only calls prims.fmax, which this same function decomposes (same IR)")
def _fmax(x, y):
    """Maximum ignoring NaN (NaN only where both are NaN)."""
    m = aten.maximum.default(x, y)
    return aten.where.self(aten.isnan.default(x), y, aten.where.self(aten.isnan.default(y), x, m))


@decomposition(prims.fmin.default, aten.fmin.default,
               instead_of_torch="torch's ref only calls prims.fmin, which this same function decomposes (same IR)")
def _fmin(x, y):
    """Minimum ignoring NaN (NaN only where both are NaN)."""
    m = aten.minimum.default(x, y)
    return aten.where.self(aten.isnan.default(x), y, aten.where.self(aten.isnan.default(y), x, m))


@decomposition(prims.signbit.default, aten.signbit.default,
               instead_of_torch="torch's ref only calls prims.signbit, which this same function decomposes (same IR)")
def _signbit(x):
    """Sign bit: ``x < 0``, or ``x`` is -0.0 (its reciprocal is -inf)."""
    if not x.is_floating_point():
        return aten.lt.Scalar(x, 0)
    neg_zero = aten.logical_and.default(aten.eq.Scalar(x, 0), aten.lt.Scalar(aten.reciprocal.default(x), 0))
    return aten.logical_or.default(aten.lt.Scalar(x, 0), neg_zero)


@decomposition(prims.copy_to.default)
def _copy_to(a, b):
    """prims.copy_to: ``a.copy_(b)``."""
    return aten.copy_.default(a, b)


@decomposition(aten.addbmm.default)
def _addbmm(x, b1, b2, *, beta=1, alpha=1):
    """``beta * x + alpha * sum_i b1[i] @ b2[i]``, accumulated batch by batch as eager does; for 16-bit
    dtypes one matmul over the batches side by side (``[n, b*m] @ [b*m, p]``: the sum stays in the fp32
    accumulator and is rounded once, where a rounding per batch lost twice eager's bf16 error)."""
    shape = list(torch.broadcast_shapes(tuple(x.shape), (b1.shape[1], b2.shape[2])))
    out = aten.expand.default(x if beta == 1 else aten.mul.Tensor(x, beta), shape)
    if beta == 0:
        out = aten.full.default(shape, 0, dtype=x.dtype)
    if is_low_precision(b1.dtype) and b1.shape[0] > 1:
        b, n, m = b1.shape
        a = aten.view.default(aten.clone.default(aten.permute.default(b1, [1, 0, 2]),
                                                 memory_format=torch.contiguous_format), [n, b * m])
        p = aten.mm.default(a, aten.view.default(aten.clone.default(b2, memory_format=torch.contiguous_format),
                                                 [b * m, b2.shape[2]]))
        return aten.add.Tensor(out, p if alpha == 1 else aten.mul.Tensor(p, alpha))
    for i in range(b1.shape[0]):
        p = aten.mm.default(aten.select.int(b1, 0, i), aten.select.int(b2, 0, i))
        out = aten.add.Tensor(out, p if alpha == 1 else aten.mul.Tensor(p, alpha))
    return out


@decomposition(aten.copysign.Tensor, aten.copysign.Scalar,
               instead_of_torch="torch's ref fails on copysign.Scalar (shape check of the 0-d sign); copysign.Tensor "
                                "gives the same IR")
def _copysign(x, y):
    """``|x|`` with the sign bit of ``y``, in the promoted floating dtype."""
    dtype = torch.result_type(x, y)
    if not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    if x.dtype != dtype:
        x = aten._to_copy.default(x, dtype=dtype)
    a = aten.abs.default(x)
    if isinstance(y, Tensor):
        return aten.where.self(_signbit(y), aten.neg.default(a), a)

    return aten.neg.default(a) if math.copysign(1.0, y) < 0 else a


@decomposition(prims.uniform.default)
def _prims_uniform(shape, *, low, high, dtype, device, stride=None, generator=None):
    """``low + (high - low) * rand``."""
    r = aten.rand.default(list(shape), dtype=dtype)
    return aten.add.Tensor(aten.mul.Tensor(r, high - low), low)


@decomposition(prims.normal.default)
def _prims_normal(shape, *, mean, std, dtype, device, requires_grad, generator=None):
    """``mean + std * randn``."""
    r = aten.randn.default(list(shape), dtype=dtype)
    return aten.add.Tensor(aten.mul.Tensor(r, std), mean)


@decomposition(aten.masked_scatter.default)
def _masked_scatter(x, mask, source):
    """Fill ``x`` where ``mask`` with consecutive elements of ``source`` (a prefix sum picks them)."""
    shape = torch.broadcast_shapes(tuple(x.shape), tuple(mask.shape))
    m = aten.expand.default(mask, list(shape))
    if source.numel() == 0:   # no element to pick: the mask is all False (torch requires it), x is unchanged
        return aten.clone.default(aten.expand.default(x, list(shape)))
    flat_m = aten.view.default(aten.clone.default(m), [-1])
    pos = aten.sub.Tensor(aten.cumsum.default(flat_m, 0, dtype=torch.int64), 1)
    pos = aten.clamp.default(pos, 0, max(source.numel() - 1, 0))
    picked = aten.view.default(aten.index.Tensor(aten.view.default(aten.clone.default(source), [-1]), [pos]),
                               list(shape))
    return aten.where.self(m, picked, aten.expand.default(x, list(shape)))


@decomposition(aten.masked_scatter_backward.default)
def _masked_scatter_backward(grad, mask, sizes):
    """The gradient of ``masked_scatter``'s source: the elements of ``grad`` where ``mask``, in order, then
    zeros, shaped ``sizes``. torch's ``masked_select`` + pad is data-dependent; the same prefix sum as the
    forward gives each selected element its place, and one scatter writes them (the rest go to a spare
    slot past the end, dropped)."""
    n = 1
    for d in sizes:
        n *= int(d)
    shape = torch.broadcast_shapes(tuple(grad.shape), tuple(mask.shape))
    g = aten.view.default(aten.clone.default(aten.expand.default(grad, list(shape))), [-1])
    flat_m = aten.view.default(aten.clone.default(aten.expand.default(mask, list(shape))), [-1])
    if n == 0 or g.numel() == 0:
        return aten.new_zeros.default(grad, list(sizes))
    pos = aten.sub.Tensor(aten.cumsum.default(flat_m, 0, dtype=torch.int64), 1)
    keep = aten.logical_and.default(flat_m, aten.lt.Scalar(pos, n))
    slot = aten.where.self(keep, pos, aten.full.default([], n, dtype=torch.int64))
    vals = aten.where.self(keep, g, aten.full.default([], 0, dtype=grad.dtype))
    out = aten.scatter_add.default(aten.new_zeros.default(grad, [n + 1]), 0, slot, vals)
    return aten.view.default(aten.slice.Tensor(out, 0, 0, n), list(sizes))


@decomposition(aten.index_put.default, aten._unsafe_index_put.default,
               instead_of_torch="torch's _unsafe_index_put forwards to index_put, whose one-value mask form this is "
                                "(same IR)")
def _index_put_mask(x, indices, values, accumulate=False):
    """``x[mask] = v`` with a one-element ``v``: ``where(mask, v, x)`` (no data-dependent indexing). An
    accumulating bf16/fp16 ``index_put`` is summed in fp32 and rounded once: torch's CPU kernel adds repeated
    indices one by one in bf16 (0.23 off fp32 on an OpInfo sample of ~8 repeats per slot) and another order of
    bf16 additions lands elsewhere (0.48 off); in fp32 the result is the fp32 sum rounded once."""
    if accumulate and is_low_precision(x.dtype):
        f32 = torch.float32
        out = aten.index_put.default(aten._to_copy.default(x, dtype=f32), indices,
                                     aten._to_copy.default(values, dtype=f32), True)
        return aten._to_copy.default(out, dtype=x.dtype)
    mask = indices[0]
    mask = aten.view.default(mask, list(mask.shape) + [1] * (x.dim() - mask.dim()))
    v = aten.view.default(values, [])
    if v.dtype != x.dtype:
        v = aten._to_copy.default(v, dtype=x.dtype)
    return aten.where.self(mask, v, x)


# --------------------------------------------------------------------------- sort-based selections
# median, kthvalue and mode pick from a stable ascending sort with NaN last (torch's order).
# The sort itself only sees NaN-free keys (NaN replaced by +inf; the sort lowering does not
# order NaN), and the NaNs are put back from their count. Indices of tied values may differ
# from torch's, whose nth_element leaves them unspecified.


def _keep(t: Tensor, dim: int, keepdim: bool) -> Tensor:
    return t if keepdim else aten.squeeze.dim(t, dim)


def _line_iota(n: int, dim: int, ndim: int) -> Tensor:
    """int64 ``0..n-1`` laid along ``dim`` of an ``ndim``-d tensor (size 1 elsewhere)."""
    shape = [1] * ndim
    shape[dim] = n
    return aten.view.default(aten.arange.start_step(0, n, 1, dtype=torch.int64), shape)


def _first_true(mask: Tensor, dim: int) -> Tensor:
    """int64 keepdim index of the first True along ``dim`` (0 when there is none)."""
    return aten.argmax.default(aten._to_copy.default(mask, dtype=torch.int32), dim, True)


def _sort_nan_last(x: Tensor, dim: int) -> Tuple[Tensor, Tensor, Any, Any]:
    """(values, indices, isnan(x), keepdim NaN count) of a stable ascending sort along ``dim`` with NaN
    last (the last two None for non-float ``x``).

    The values are exact. Inside the trailing block of +inf and NaN values an index may point at
    a NaN where torch's points at a +inf (the sort saw both as +inf); :func:`_sorted_pick` mends
    the indices it returns.
    """
    if not x.is_floating_point():
        vals, idx = aten.sort.stable(x, stable=True, dim=dim)
        return vals, idx, None, None
    n = x.shape[dim]
    isn = aten.isnan.default(x)
    nans = aten.sum.dim_IntList(isn, [dim], True, dtype=torch.int64)
    vals, idx = aten.sort.stable(aten.where.self(isn, aten.full.default([], float("inf"), dtype=x.dtype), x),
                                 stable=True, dim=dim)
    tail = aten.ge.Tensor(_line_iota(n, dim, x.dim()), aten.rsub.Scalar(nans, n))
    vals = aten.where.self(tail, aten.full.default([], float("nan"), dtype=x.dtype), vals)
    return vals, idx, isn, nans


def _sorted_pick(x: Tensor, dim: int, keepdim: bool, pos: Any) -> Tuple[Tensor, Tensor]:
    """(values, indices) at sorted position ``pos`` along ``dim``: an int, or a function of the keepdim
    NaN count giving int64 keepdim positions. A NaN result has the index of the first NaN, a +inf
    one the index of a +inf."""
    vals, idx, isn, nans = _sort_nan_last(x, dim)
    if callable(pos):
        pos = pos(nans)
    if isinstance(pos, int):
        v, i = aten.slice.Tensor(vals, dim, pos, pos + 1), aten.slice.Tensor(idx, dim, pos, pos + 1)
    else:
        v, i = aten.gather.default(vals, dim, pos), aten.gather.default(idx, dim, pos)
    if isn is not None:
        picked_nan = aten.isnan.default(aten.gather.default(x, dim, i))
        i = aten.where.self(aten.isnan.default(v), _first_true(isn, dim),
                            aten.where.self(picked_nan, _first_true(aten.eq.Scalar(x, float("inf")), dim), i))
    return _keep(v, dim, keepdim), _keep(i, dim, keepdim)


def _median_dim(x: Tensor, dim: int, keepdim: bool, ignore_nan: bool) -> Tuple[Tensor, Tensor]:
    if x.dim() == 0:
        return aten.clone.default(x), aten.full.default([], 0, dtype=torch.int64)
    d = _dim(dim, x.dim())
    n = x.shape[d]
    if not x.is_floating_point():
        return _sorted_pick(x, d, keepdim, (n - 1) // 2)
    if ignore_nan:   # the median of the non-NaN values (position 0, a NaN, when all are NaN)
        def pos(nans):
            return aten.clamp.default(aten.div.Tensor_mode(aten.rsub.Scalar(nans, n - 1), 2, rounding_mode="floor"), 0)
    else:            # a NaN makes the median NaN (sorted last, from position n - nans)
        def pos(nans):
            return aten.where.self(aten.gt.Scalar(nans, 0), aten.rsub.Scalar(nans, n),
                                   aten.full.default([], (n - 1) // 2, dtype=torch.int64))
    return _sorted_pick(x, d, keepdim, pos)


@decomposition(aten.median.dim)
def _median(x, dim, keepdim=False):
    """(lower median, its index) along ``dim``; NaN when the line holds a NaN (its first one)."""
    return _median_dim(x, dim, keepdim, ignore_nan=False)


@decomposition(aten.nanmedian.dim)
def _nanmedian(x, dim, keepdim=False):
    """(lower median of the non-NaN values, its index) along ``dim``."""
    return _median_dim(x, dim, keepdim, ignore_nan=True)


@decomposition(aten.median.default)
def _median_all(x):
    """Lower median of all elements (NaN if any is NaN or there are none)."""
    if x.numel() == 0:
        return aten.full.default([], float("nan"), dtype=x.dtype)
    return _median_dim(aten.view.default(x, [-1]), 0, False, ignore_nan=False)[0]


@decomposition(aten.nanmedian.default)
def _nanmedian_all(x):
    """Lower median of the non-NaN elements."""
    if x.numel() == 0:
        return aten.full.default([], float("nan"), dtype=x.dtype)
    return _median_dim(aten.view.default(x, [-1]), 0, False, ignore_nan=True)[0]


@decomposition(aten.kthvalue.default)
def _kthvalue(x, k, dim=-1, keepdim=False):
    """(k-th smallest value, its index) along ``dim`` (NaN sorts last)."""
    if x.dim() == 0:
        return aten.clone.default(x), aten.full.default([], 0, dtype=torch.int64)
    return _sorted_pick(x, _dim(dim, x.dim()), keepdim, int(k) - 1)


@decomposition(aten.mode.default)
def _mode(x, dim=-1, keepdim=False):
    """(most frequent value, the last index holding it) along ``dim``; the smallest such value on ties.

    On the sorted line, each element's run length is its position minus the start of its run
    (a running maximum of the run starts); the first position reaching the longest run ends the
    smallest most frequent value.
    """
    if x.dim() == 0:
        return aten.clone.default(x), aten.full.default([], 0, dtype=torch.int64)
    d = _dim(dim, x.dim())
    n = x.shape[d]
    s = _sort_nan_last(x, d)[0]
    pos = _line_iota(n, d, x.dim())
    prev = aten.cat.default([aten.slice.Tensor(s, d, 0, 1), aten.slice.Tensor(s, d, 0, n - 1)], d)
    new = aten.logical_or.default(aten.ne.Tensor(s, prev), aten.eq.Scalar(pos, 0))   # NaN != NaN: own runs
    start = aten.cummax.default(aten.where.self(new, pos, aten.full.default([], 0, dtype=torch.int64)), d)[0]
    length = aten.sub.Tensor(pos, start)
    best = aten.amax.default(length, [d], True)
    first = _first_true(aten.eq.Tensor(length, best), d)
    v = aten.gather.default(s, d, first)
    match = aten.eq.Tensor(x, v)
    if x.is_floating_point():
        match = aten.logical_or.default(match, aten.logical_and.default(aten.isnan.default(x), aten.isnan.default(v)))
    idx = aten.amax.default(aten.where.self(match, pos, aten.full.default([], -1, dtype=torch.int64)), [d], True)
    return _keep(v, d, keepdim), _keep(idx, d, keepdim)


@decomposition(aten.hardshrink_backward.default, aten.softshrink_backward.default)
def _shrink_backward(grad, x, lambd=0.5):
    """Gradient of hardshrink/softshrink: ``grad`` where ``|x| > lambd`` (outside ``[-lambd, lambd]``), else 0."""
    inside = aten.logical_and.default(aten.ge.Scalar(x, -lambd), aten.le.Scalar(x, lambd))
    return aten.where.self(inside, aten.full.default([], 0, dtype=grad.dtype), grad)


@decomposition(aten._logcumsumexp.default)
def _logcumsumexp_kernel(x, dim):
    """The CPU/CUDA kernel behind the composite ``logcumsumexp`` (no Meta kernel): the core op."""
    return aten.logcumsumexp.default(x, dim)


@decomposition(aten._cummax_helper.default)
def _cummax_helper(x, values, indices, dim):
    """The CPU/CUDA kernel ``cummax.out`` calls on other backends (the device's composite ``cummax``):
    ``values``/``indices`` written in place with the ``cummax`` core op's results."""
    v, i = aten.cummax.default(x, dim)
    aten.copy_.default(values, v)
    aten.copy_.default(indices, i)


@decomposition(aten._cummin_helper.default)
def _cummin_helper(x, values, indices, dim):
    """``cummin``'s in-place kernel helper, as :func:`_cummax_helper`."""
    v, i = aten.cummin.default(x, dim)
    aten.copy_.default(values, v)
    aten.copy_.default(indices, i)


# --------------------------------------------------------------------------- searching


@decomposition(aten.searchsorted.Tensor)
def _searchsorted(seq, values, *, out_int32=False, right=False, side=None, sorter=None):
    """How many elements of each sorted row of ``seq`` go before each value: counts of
    ``not (seq >= v)`` (left) or ``not (seq > v)`` (right), so NaN behaves as in torch's binary
    search. Compares every value with the whole row (``[..., k, m]`` booleans)."""
    right = bool(right) or side == "right"
    if sorter is not None:
        seq = aten.gather.default(seq, -1, sorter)
    m = seq.shape[-1]
    if seq.dim() == 1:
        s = aten.view.default(seq, [1] * values.dim() + [m])
    else:
        s = aten.unsqueeze.default(seq, -2)
    v = aten.unsqueeze.default(values, -1)
    after = aten.gt.Tensor(s, v) if right else aten.ge.Tensor(s, v)
    return aten.sum.dim_IntList(aten.logical_not.default(after), [-1], False,
                                dtype=torch.int32 if out_int32 else torch.int64)


@decomposition(aten.searchsorted.Scalar)
def _searchsorted_scalar(seq, value, *, out_int32=False, right=False, side=None, sorter=None):
    """searchsorted of one Python number."""
    v = aten.full.default([], value, dtype=seq.dtype)
    return _searchsorted(seq, v, out_int32=out_int32, right=right, side=side, sorter=sorter)


@decomposition(aten.bucketize.Tensor,
               instead_of_torch="torch's ref reads a traced value (TracingError); this one counts boundaries with "
                                "comparisons")
def _bucketize(x, boundaries, *, out_int32=False, right=False):
    """Bucket of each element: searchsorted of ``x`` in the 1-d ``boundaries``."""
    return _searchsorted(boundaries, x, out_int32=out_int32, right=right)


@decomposition(aten.bucketize.Scalar,
               instead_of_torch="torch's ref reads a traced value (TracingError); this one counts boundaries with "
                                "comparisons")
def _bucketize_scalar(x, boundaries, *, out_int32=False, right=False):
    """Bucket of one Python number."""
    return _searchsorted_scalar(boundaries, x, out_int32=out_int32, right=right)


# --------------------------------------------------------------------------- indexing forms


@decomposition(aten.index_reduce.default)
def _index_reduce(x, dim, index, source, reduce, *, include_self=True):
    """scatter_reduce with ``index`` laid along ``dim`` of ``source``."""
    if x.dim() == 0:
        return aten.scatter_reduce.two(x, 0, index, source, reduce, include_self=include_self)
    d = _dim(dim, x.dim())
    shape = [1] * source.dim()
    shape[d] = -1
    idx = aten.expand.default(aten.view.default(index, shape), list(source.shape))
    return aten.scatter_reduce.two(x, d, idx, source, reduce, include_self=include_self)


@decomposition(aten.scatter.reduce, aten.scatter.value_reduce)
def _scatter_legacy_reduce(x, dim, index, src, *, reduce):
    """``scatter(..., reduce='add'|'multiply')``: scatter_reduce sum/prod including ``x``."""
    if not isinstance(src, Tensor):
        src = aten.full.default(list(index.shape), src, dtype=x.dtype)
    r = {"add": "sum", "multiply": "prod"}[reduce]
    return aten.scatter_reduce.two(x, dim, index, src, r, include_self=True)


@decomposition(aten.take.default,
               instead_of_torch="same IR as torch's (flatten, index)")
def _take(x, index):
    """Elements of the flattened ``x`` at ``index`` (negative indices count from the end)."""
    return aten.index.Tensor(aten.view.default(aten.clone.default(x), [-1]), [index])


@decomposition(aten.put.default)
def _put(x, index, source, accumulate=False):
    """``x`` with its flattened elements at ``index`` replaced by (or, accumulating, added to) ``source``."""
    if index.numel() == 0:
        return aten.clone.default(x)
    flat = aten.view.default(aten.clone.default(x), [-1])
    out = aten.index_put.default(flat, [aten.view.default(index, [-1])],
                                 aten.view.default(aten.clone.default(source), [-1]), accumulate)
    return aten.view.default(out, list(x.shape))


# --------------------------------------------------------------------------- counting


@decomposition(aten.histc.default)
def _histc(x, bins=100, min=0, max=0):
    """Counts of ``x`` in ``bins`` equal bins over ``[min, max]`` (the data's range when they are equal),
    binned as torch does: ``trunc((x - min) * bins / (max - min))``, ``max`` in the last bin."""
    flat = aten.view.default(x, [-1])
    if flat.shape[0] == 0:
        return aten.full.default([bins], 0, dtype=x.dtype)
    if min == max:
        lo, hi = aten.amin.default(flat, [0], True), aten.amax.default(flat, [0], True)
        same = aten.eq.Tensor(lo, hi)
        lo = aten.where.self(same, aten.sub.Tensor(lo, 1), lo)
        hi = aten.where.self(same, aten.add.Tensor(hi, 1), hi)
    else:
        lo = aten.full.default([1], min, dtype=x.dtype)
        hi = aten.full.default([1], max, dtype=x.dtype)
    pos = aten.trunc.default(aten.div.Tensor(aten.mul.Tensor(aten.sub.Tensor(flat, lo), bins), aten.sub.Tensor(hi, lo)))
    pos = aten.clamp.default(pos, None, bins - 1)
    inside = aten.logical_and.default(aten.ge.Tensor(flat, lo), aten.le.Tensor(flat, hi))
    onehot = aten.logical_and.default(aten.unsqueeze.default(inside, 1), aten.eq.Tensor(
        aten.unsqueeze.default(pos, 1), aten.arange.start_step(0, bins, 1, dtype=x.dtype)))
    return aten.sum.dim_IntList(onehot, [0], False, dtype=x.dtype)


@decomposition(aten.nonzero_static.default)
def _nonzero_static(x, *, size, fill_value=-1):
    """Coordinates of the first ``size`` non-zero elements (row-major), rows past them ``fill_value``:
    each non-zero's rank (a prefix count) places its flat index."""
    size = int(size)
    n = x.numel()
    if n == 0:
        return aten.full.default([size, x.dim()], fill_value, dtype=torch.int64)
    nz = aten.ne.Scalar(aten.view.default(x, [-1]), 0)
    rank = aten.sub.Tensor(aten.cumsum.default(nz, 0, dtype=torch.int64), 1)
    slot = aten.where.self(aten.logical_and.default(nz, aten.lt.Scalar(rank, size)), rank,
                           aten.full.default([], size, dtype=torch.int64))
    buf = aten.scatter.src(aten.full.default([size + 1], -1, dtype=torch.int64), 0, slot,
                           aten.arange.start_step(0, n, 1, dtype=torch.int64))
    first = aten.slice.Tensor(buf, 0, 0, size)
    found = aten.ge.Scalar(first, 0)
    cols = []
    stride = n
    for d in x.shape:
        stride //= d
        c = aten.remainder.Scalar(aten.div.Tensor_mode(first, stride, rounding_mode="floor"), d)
        cols.append(aten.where.self(found, c, aten.full.default([], fill_value, dtype=torch.int64)))
    if not cols:
        return aten.full.default([size, 0], 0, dtype=torch.int64)
    return aten.stack.default(cols, 1)


@decomposition(aten.segment_reduce.default)
def _segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    """Reduction of consecutive segments along ``axis`` (``lengths``/``offsets`` batched over the axes
    before it) by scatter_reduce; an ``initial`` value takes part in every segment, as in torch (for
    ``mean`` it is added to the sum, not counted)."""
    if indices is not None:
        return NotImplemented
    if lengths is not None:
        ends = aten.cumsum.default(lengths, -1)
    elif offsets is not None:
        ends = aten.slice.Tensor(offsets, -1, 1, offsets.shape[-1])
    else:
        return NotImplemented
    axis = ends.dim() - 1
    nseg, rows = ends.shape[-1], data.shape[axis]
    r = aten.view.default(aten.arange.start_step(0, rows, 1, dtype=ends.dtype), [rows, 1])
    # segment of each row: how many segment ends lie at or before it (rows past the last end: slot nseg)
    seg = aten.sum.dim_IntList(aten.le.Tensor(aten.unsqueeze.default(ends, -2), r), [-1], False, dtype=torch.int64)
    rest = list(data.shape[axis + 1:])
    idx = aten.expand.default(aten.view.default(seg, list(seg.shape) + [1] * len(rest)), list(data.shape))
    red = {"sum": "sum", "prod": "prod", "max": "amax", "min": "amin", "mean": "sum"}[reduce]
    empty = {"sum": 0.0, "prod": 1.0, "max": -math.inf, "min": math.inf, "mean": 0.0}[reduce]
    shape = list(data.shape[:axis]) + [nseg + 1] + rest
    start = empty if initial is None else initial
    out = aten.scatter_reduce.two(aten.full.default(shape, start, dtype=data.dtype), axis, idx, data, red,
                                  include_self=True)
    out = aten.slice.Tensor(out, axis, 0, nseg)
    if reduce == "mean":
        count = aten.scatter_add.default(aten.full.default(shape, 0, dtype=data.dtype), axis, idx,
                                         aten.full.default(list(data.shape), 1, dtype=data.dtype))
        count = aten.slice.Tensor(count, axis, 0, nseg)
        if initial is None:
            out = aten.div.Tensor(out, count)                                # 0 / 0: NaN for empty segments
        else:
            out = aten.where.self(aten.gt.Scalar(count, 0), aten.div.Tensor(out, count), out)
    return out


# --------------------------------------------------------------------------- random draws from rand


def _randint(low, high, size, dtype):
    span = int(high) - int(low)
    u = aten.rand.default(list(size), dtype=torch.float32 if span <= (1 << 24) else torch.float64)
    k = aten.clamp.default(aten.floor.default(aten.mul.Tensor(u, span)), None, max(span - 1, 0))
    return aten._to_copy.default(aten.add.Tensor(k, int(low)), dtype=dtype or torch.int64)


@decomposition(aten.randint.default, aten.randint.generator)
def _randint_high(high, size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    """Uniform integers in ``[0, high)``: ``floor(rand * high)``."""
    return _randint(0, high, size, dtype)


@decomposition(aten.randint.low, aten.randint.low_generator)
def _randint_low(low, high, size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    """Uniform integers in ``[low, high)``."""
    return _randint(low, high, size, dtype)


@decomposition(aten.randint_like.default)
def _randint_like(x, high, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """randint shaped like ``x`` (its dtype by default)."""
    return _randint(0, high, tuple(x.shape), dtype or x.dtype)


@decomposition(aten.randint_like.low_dtype)
def _randint_like_low(x, low, high, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """randint in ``[low, high)`` shaped like ``x``."""
    return _randint(low, high, tuple(x.shape), dtype or x.dtype)


@decomposition(aten.multinomial.default)
def _multinomial(probs, num_samples, replacement=False, *, generator=None):
    """Category draws: with replacement by inverting the running sum of ``probs`` at uniform points,
    without by the ``num_samples`` largest of ``log(p) + Gumbel noise``."""
    n = probs.shape[-1]
    lead = list(probs.shape[:-1])
    p = probs if probs.dtype == torch.float32 else aten._to_copy.default(probs, dtype=torch.float32)
    if replacement:
        cdf = aten.cumsum.default(p, -1)
        u = aten.mul.Tensor(aten.rand.default(lead + [int(num_samples)], dtype=torch.float32),
                            aten.slice.Tensor(cdf, -1, n - 1, n))
        return aten.clamp.default(aten.searchsorted.Tensor(cdf, u, right=True), None, n - 1)
    u = aten.rand.default(lead + [n], dtype=torch.float32)
    gumbel = aten.neg.default(aten.log.default(aten.neg.default(aten.log.default(aten.clamp.default(u, 1e-38)))))
    keys = aten.add.Tensor(aten.log.default(p), gumbel)
    return aten.topk.default(keys, int(num_samples), -1)[1]


@decomposition(aten.rrelu_with_noise.default)
def _rrelu_with_noise(x, noise, lower=0.125, upper=1 / 3, training=False, generator=None):
    """Randomized leaky ReLU: in training, slopes drawn uniformly from ``[lower, upper]`` where
    ``x <= 0`` (written into ``noise``, 1 elsewhere); in eval the mean slope."""
    if not training:
        return aten.leaky_relu.default(x, (lower + upper) / 2)
    slope = aten.add.Tensor(aten.mul.Tensor(aten.rand.default(list(x.shape), dtype=x.dtype), upper - lower), lower)
    new = aten.where.self(aten.le.Scalar(x, 0), slope, aten.full.default([], 1, dtype=x.dtype))
    aten.copy_.default(noise, new)
    return aten.mul.Tensor(x, new)


# --------------------------------------------------------------------------- float representation


def _pow2(k: Tensor) -> Tensor:
    """``2**k`` for integral fp32 ``k`` in [-149, 127], exactly (pow, not exp2, which may round)."""
    return aten.pow.Scalar(2.0, k)


def _frexp32(xf: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """(mantissa, fp32 exponent, finite-and-non-zero mask) of fp32 ``xf``; the exponent from log2 is
    corrected by one either way, the scaling split in two so no factor over- or underflows."""
    a = aten.abs.default(xf)
    finite = aten.logical_and.default(aten.logical_not.default(aten.isinf.default(xf)),
                                      aten.logical_not.default(aten.isnan.default(xf)))
    ok = aten.logical_and.default(finite, aten.gt.Scalar(a, 0))
    safe = aten.where.self(ok, a, aten.full.default([], 1.0, dtype=torch.float32))
    e = aten.add.Tensor(aten.floor.default(aten.log2.default(safe)), 1)

    def scaled(e):
        h = aten.floor.default(aten.div.Tensor(e, 2))
        return aten.mul.Tensor(aten.mul.Tensor(safe, _pow2(aten.neg.default(h))),
                               _pow2(aten.neg.default(aten.sub.Tensor(e, h))))

    m = scaled(e)
    e = aten.add.Tensor(e, aten.sub.Tensor(aten._to_copy.default(aten.ge.Scalar(m, 1.0), dtype=torch.float32),
                                           aten._to_copy.default(aten.lt.Scalar(m, 0.5), dtype=torch.float32)))
    m = scaled(e)
    m = aten.where.self(ok, aten.where.self(aten.lt.Scalar(xf, 0), aten.neg.default(m), m), xf)
    e = aten.where.self(ok, e, aten.full.default([], 0.0, dtype=torch.float32))
    return m, e, ok


@decomposition(torch.ops.prims.frexp.default, aten.frexp.Tensor,
               instead_of_torch="torch's ref only calls prims.frexp, which this same function decomposes (same IR)")
def _frexp(x):
    """(mantissa in ``[0.5, 1)`` by magnitude, int32 exponent) with ``x = mantissa * 2**exponent``; zero,
    infinities and NaN keep exponent 0."""
    if not x.is_floating_point() or x.dtype == torch.float64:
        return NotImplemented
    xf = x if x.dtype == torch.float32 else aten._to_copy.default(x, dtype=torch.float32)
    m, e, _ = _frexp32(xf)
    if m.dtype != x.dtype:
        m = aten._to_copy.default(m, dtype=x.dtype)
    return m, aten._to_copy.default(e, dtype=torch.int32)


#: dtype -> (precision in bits with the implicit one, smallest normal exponent, largest finite value)
_FLOAT_FORMATS = {torch.float32: (24, -126, 3.4028234663852886e38),
                  torch.bfloat16: (8, -126, 3.3895313892515355e38),
                  torch.float16: (11, -14, 65504.0)}


@decomposition(torch.ops.prims.nextafter.default, aten.nextafter.default,
               instead_of_torch="torch's ref only calls prims.nextafter, which this same function decomposes (same "
                                "IR)")
def _nextafter(x, y):
    """The number of ``x``'s dtype after ``x`` towards ``y``: ``x`` plus or minus its ulp (``2**(e-p)`` from
    frexp with ``p`` the dtype's precision, half that stepping down from a power of two, the smallest subnormal
    ``2**(emin-p+1)`` among subnormals). bf16/fp16 are computed in fp32, where each step is exact."""
    if x.dtype != y.dtype or x.dtype not in _FLOAT_FORMATS:
        return NotImplemented
    prec, emin, biggest = _FLOAT_FORMATS[x.dtype]
    dtype = x.dtype
    if dtype != torch.float32:
        x, y = aten._to_copy.default(x, dtype=torch.float32), aten._to_copy.default(y, dtype=torch.float32)
    m, e, ok = _frexp32(x)
    ulp = _pow2(aten.clamp.default(aten.sub.Tensor(e, prec), float(emin - prec + 1)))
    up = aten.gt.Tensor(y, x)
    away = aten.eq.Tensor(up, aten.gt.Scalar(x, 0))                       # the step grows |x|
    halve = aten.logical_and.default(aten.eq.Scalar(aten.abs.default(m), 0.5), aten.gt.Scalar(e, emin + 1))
    step = aten.where.self(aten.logical_and.default(aten.logical_not.default(away), halve),
                           aten.mul.Tensor(ulp, 0.5), ulp)
    r = aten.where.self(up, aten.add.Tensor(x, step), aten.sub.Tensor(x, step))
    r = aten.where.self(aten.eq.Scalar(r, 0), aten.mul.Tensor(x, 0.0), r)   # -tiny up to 0 is -0.0, as C's nextafter
    tiny = aten.full.default([], 2.0 ** (emin - prec + 1), dtype=torch.float32)
    r = aten.where.self(aten.eq.Scalar(x, 0), aten.where.self(up, tiny, aten.neg.default(tiny)), r)
    big = aten.full.default([], biggest, dtype=torch.float32)
    r = aten.where.self(aten.isinf.default(x), aten.where.self(aten.gt.Scalar(x, 0), big, aten.neg.default(big)), r)
    r = aten.where.self(aten.eq.Tensor(x, y), y, r)
    nan = aten.logical_or.default(aten.isnan.default(x), aten.isnan.default(y))
    r = aten.where.self(nan, aten.full.default([], math.nan, dtype=torch.float32), r)
    return r if dtype == torch.float32 else aten._to_copy.default(r, dtype=dtype)


@decomposition(aten._efficientzerotensor.default)
def _efficientzerotensor(size: Any, *, dtype: Any = None, layout: Any = None, device: Any = None,
                         pin_memory: Any = None) -> Any:
    """``aten._efficientzerotensor``: autograd's zero gradient (``sgn``'s backward at 0, ``where``'s unused
    branch) as a plain zero fill; a program has no lazily-zero tensors."""
    return torch.zeros(tuple(size), dtype=dtype if dtype is not None else torch.get_default_dtype())


def _distance_grad(grad: Any, x1: Any, x2: Any, p: float, dist: Any) -> Any:
    """``sum_r grad[.., i, r] * d dist(x1_i, x2_r) / d x1_i`` for the p-norm distance, with the cases of torch's
    CPU backward kernel (zero where the distance is 0; p < 1 also where a difference is 0)."""
    diff = x1.unsqueeze(-2) - x2.unsqueeze(-3)                  # [.., P, R, M]
    g = grad.unsqueeze(-1)
    d = dist.unsqueeze(-1)
    zero = torch.zeros((), dtype=diff.dtype)
    if p == 0:
        return torch.zeros_like(x1)
    if p == 1:
        term = g * torch.sign(diff)
    elif p == 2:
        term = torch.where(d == 0, zero, g * diff / d)
    elif math.isinf(p):
        term = g * torch.sign(diff) * (diff.abs() == d).to(diff.dtype)
    elif p < 2:
        bad = (d == 0) | ((diff == 0) & (p < 1))
        term = torch.where(bad, zero, torch.sign(diff) * diff.abs().pow(p - 1) * g / d.pow(p - 1))
    else:
        term = torch.where(d == 0, zero, diff * diff.abs().pow(p - 2) * g / d.pow(p - 1))
    return term.sum(-2)


@decomposition(aten._cdist_backward.default)
def _cdist_backward(grad: Any, x1: Any, x2: Any, p: float, cdist: Any) -> Any:
    """``aten._cdist_backward``: the gradient of ``torch.cdist`` with respect to ``x1`` (torch calls it with the
    arguments swapped for ``x2``), elementwise over the ``[.., P, R, M]`` differences and summed over ``R``."""
    return _distance_grad(grad, x1, x2, float(p), cdist).to(x1.dtype)


@decomposition(aten._pdist_backward.default)
def _pdist_backward(grad: Any, x: Any, p: float, pdist: Any) -> Any:
    """``aten._pdist_backward``: the condensed pair gradient and distances spread into symmetric ``[N, N]``
    matrices (indices of the upper triangle, known while tracing), then :func:`_distance_grad` of ``x`` with
    itself: each pair adds to both of its rows, with opposite signs, as torch's kernel does."""
    n = x.shape[0]
    if n < 2 or grad.numel() == 0:
        return torch.zeros_like(x)
    iu = torch.triu_indices(n, n, 1)
    upper, lower = iu[0] * n + iu[1], iu[1] * n + iu[0]

    def symmetric(pairs: Any) -> Any:
        return torch.zeros(n * n, dtype=pairs.dtype).index_put((upper,), pairs).index_put((lower,), pairs).reshape(n, n)

    return _distance_grad(symmetric(grad), x, x, float(p), symmetric(pdist)).to(x.dtype)
