# Symmetric indefinite LDL^T (linalg_ldl_factor_ex, linalg_ldl_solve) for float32 with LAPACK's Bunch-Kaufman pivots (dsytf2 / dsytrs, lower), unrolled over the columns.
"""LAPACK's Bunch-Kaufman ``L D L^T`` as static programs.

``torch.linalg.ldl_factor_ex`` is LAPACK's ``?sytrf`` with ``uplo='L'``; for
the matrix sizes unrolled here its unblocked form ``?sytf2`` decides the pivots:
at column ``k``, with ``alpha = (1 + sqrt(17)) / 8``, ``absakk = |A[k, k]|``,
``colmax`` the largest ``|A[i, k]|`` below the diagonal (first at ``imax``) and
``rowmax`` the largest off-diagonal ``|A[imax, j]|`` of the trailing matrix:

- a zero (or NaN) column: no pivot, ``info = k + 1`` the first time, no update;
- ``absakk >= alpha * colmax`` or ``absakk >= alpha * colmax * (colmax / rowmax)``: a 1x1 pivot at ``k``;
- ``|A[imax, imax]| >= alpha * rowmax``: a 1x1 pivot after swapping ``k`` and ``imax``;
- else a 2x2 pivot after swapping ``k + 1`` and ``imax`` (the next column is its second half).

Every column is one static step whose choice is a mask per matrix (the data
decide the pivots; the program does not change): the swap is a gather of the
rows and columns of the trailing matrix (kept symmetric in full, so a swap is a
permutation; the finished columns of ``L`` are kept apart and never swapped, as
in ``dsytf2``), the rank-1 / rank-2 updates are ``dsyr``'s and ``dsytf2``'s
formulas in their order of operations, computed on the lower triangle and
mirrored. ``pivots`` are LAPACK's (1-based; ``-p`` on both columns of a 2x2
block). ``linalg_ldl_solve`` is ``?sytrs``: ``P L D L^T P^T x = b`` with the same
pivots, forward over the blocks then backward.

Only float32, ``n <= MAX_N`` and ``check_errors=False`` are native; other calls
stay the counted ``host`` op.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List

import torch

from .core import host
from .linalg import _gated_conv
from .table import decomposition, from_aten

aten = torch.ops.aten
Tensor = torch.Tensor

#: the largest matrix order unrolled (one step per column, each O(n^2)); larger matrices stay host ops
MAX_N = 32
_ALPHA = (1.0 + math.sqrt(17.0)) / 8.0


def _small(bound: Dict[str, Any]) -> bool:
    a = bound.get("self", bound.get("LD"))
    return a is not None and a.dim() >= 2 and int(a.shape[-1]) <= MAX_N


for _ov in (aten.linalg_ldl_factor_ex.default, aten.linalg_ldl_solve.default):
    from_aten(host, _ov)(_gated_conv(_ov, _small))


def _iota(n: int, shape: List[int]) -> Tensor:
    return aten.view.default(aten.arange.start_step(0, n, 1, dtype=torch.int64), shape)


def _col(m: Tensor, k: Any) -> Tensor:
    """Column ``k`` (an int, or ``[B]`` indices) of ``m`` ``[B, n, n]`` as ``[B, n]``."""
    if isinstance(k, int):
        return aten.select.int(m, 2, k)
    n = int(m.shape[-1])
    idx = aten.expand.default(aten.view.default(k, [-1, 1, 1]), [int(m.shape[0]), n, 1])
    return aten.view.default(aten.gather.default(m, 2, idx), [int(m.shape[0]), n])


def _at(v: Tensor, k: Any) -> Tensor:
    """``v[b, k]`` (``k`` an int or ``[B]`` indices) as ``[B]``."""
    if isinstance(k, int):
        return aten.select.int(v, 1, k)
    return aten.view.default(aten.gather.default(v, 1, aten.view.default(k, [-1, 1])), [-1])


def _mirror(u: Tensor, lower: Tensor) -> Tensor:
    """The symmetric matrix whose lower triangle is ``u``'s."""
    return aten.where.self(lower, u, aten.transpose.int(u, 1, 2))


def _b(v: Tensor) -> Tensor:
    """``[B]`` -> ``[B, 1, 1]``."""
    return aten.view.default(v, [-1, 1, 1])


@decomposition(aten.linalg_ldl_factor_ex.default)
def _ldl_factor_ex(a: Tensor, *, hermitian: bool = False, check_errors: bool = False):
    """``(LD, pivots, info)`` of ``a`` ``[..., n, n]`` (its lower triangle), as LAPACK's ``?sytrf``."""
    if a.dtype != torch.float32 or check_errors or a.dim() < 2:
        return NotImplemented
    n = int(a.shape[-1])
    batch = [int(d) for d in a.shape[:-2]]
    nb = 1
    for d in batch:
        nb *= d
    if n == 0 or nb == 0:
        return (aten.zeros_like.default(a), aten.zeros.default(batch + [n], dtype=torch.int32),
                aten.zeros.default(batch, dtype=torch.int32))
    m = aten.reshape.default(a, [nb, n, n])
    rows, cols = _iota(n, [1, n, 1]), _iota(n, [1, 1, n])
    lower = aten.ge.Tensor(rows, cols)
    m = _mirror(m, lower)                                    # only the lower triangle is read, as LAPACK does
    out = aten.zeros_like.default(m)
    j1 = _iota(n, [1, n])
    info = aten.zeros.default([nb], dtype=torch.int64)
    second = aten.zeros.default([nb], dtype=torch.bool)      # this column is the second half of a 2x2 block
    pending = aten.zeros.default([nb], dtype=torch.int64)    # its pivot
    pivots = []
    for k in range(n):
        active = aten.logical_not.default(second)
        akk = aten.select.int(aten.select.int(m, 1, k), 1, k)
        absakk = aten.abs.default(akk)
        col = aten.abs.default(_col(m, k))
        if k < n - 1:
            below = aten.slice.Tensor(col, 1, k + 1, n)
            colmax = aten.amax.default(below, [1])
            imax = aten.add.Tensor(aten.argmax.default(below, 1), k + 1)
        else:
            colmax = aten.zeros_like.default(absakk)
            imax = aten.full.default([nb], k, dtype=torch.int64)
        zero = aten.logical_or.default(aten.eq.Scalar(aten.maximum.default(absakk, colmax), 0),
                                       aten.isnan.default(absakk))
        # rowmax: the largest |A[imax, j]|, j >= k, j != imax (the row left of the diagonal, the column below)
        row = aten.abs.default(_col(m, imax))
        keep = aten.logical_and.default(aten.ge.Scalar(j1, k), aten.ne.Tensor(j1, aten.view.default(imax, [-1, 1])))
        rowmax = aten.amax.default(aten.where.self(keep, row, aten.zeros_like.default(row)), [1])
        aimax = _at(row, imax)
        acol = aten.mul.Tensor(colmax, _ALPHA)
        c1 = aten.logical_or.default(aten.ge.Tensor(absakk, acol),
                                     aten.ge.Tensor(absakk, aten.mul.Tensor(acol, aten.div.Tensor(colmax, rowmax))))
        c1 = aten.logical_or.default(zero, c1)
        c2 = aten.logical_and.default(aten.logical_not.default(c1),
                                      aten.ge.Tensor(aimax, aten.mul.Tensor(rowmax, _ALPHA)))
        two = aten.logical_and.default(aten.logical_not.default(c1), aten.logical_not.default(c2))
        two = aten.logical_and.default(two, active)
        kp = aten.where.self(c1, aten.full.default([nb], k, dtype=torch.int64), imax)
        kk = aten.where.self(two, aten.full.default([nb], k + 1, dtype=torch.int64),
                             aten.full.default([nb], k, dtype=torch.int64))
        # the interchange of kk and kp (rows and columns of the trailing matrix)
        kkb, kpb = aten.view.default(kk, [-1, 1]), aten.view.default(kp, [-1, 1])
        perm = aten.where.self(aten.eq.Tensor(j1, kkb), kpb, aten.where.self(aten.eq.Tensor(j1, kpb), kkb, j1))
        perm = aten.where.self(aten.view.default(active, [-1, 1]), perm, aten.expand.default(j1, [nb, n]))
        pr = aten.expand.default(aten.view.default(perm, [nb, n, 1]), [nb, n, n])
        pc = aten.expand.default(aten.view.default(perm, [nb, 1, n]), [nb, n, n])
        m = aten.gather.default(aten.gather.default(m, 1, pr), 2, pc)
        # 1x1 pivot: dsyr with -1/d, then the column scaled by 1/d
        one = aten.logical_and.default(active, aten.logical_and.default(aten.logical_not.default(zero),
                                                                        aten.logical_not.default(two)))
        dkk = aten.select.int(aten.select.int(m, 1, k), 1, k)
        d11 = aten.reciprocal.default(dkk)
        x = _col(m, k)                                                     # [B, n]
        xi, xj = aten.view.default(x, [nb, n, 1]), aten.view.default(x, [nb, 1, n])
        u1 = aten.sub.Tensor(m, aten.mul.Tensor(xi, aten.mul.Tensor(_b(d11), xj)))
        r1 = aten.logical_and.default(aten.gt.Scalar(rows, k), aten.gt.Scalar(cols, k))
        l1 = aten.mul.Tensor(x, aten.view.default(d11, [-1, 1]))
        # 2x2 pivot (dsytf2's rank-2 update)
        if k < n - 1:
            a21 = aten.select.int(aten.select.int(m, 1, k + 1), 1, k)
            e11 = aten.div.Tensor(aten.select.int(aten.select.int(m, 1, k + 1), 1, k + 1), a21)
            e22 = aten.div.Tensor(dkk, a21)
            t = aten.reciprocal.default(aten.sub.Tensor(aten.mul.Tensor(e11, e22), 1.0))
            e21 = aten.div.Tensor(t, a21)
            ca, cb = x, _col(m, k + 1)
            wk = aten.mul.Tensor(aten.view.default(e21, [-1, 1]),
                                 aten.sub.Tensor(aten.mul.Tensor(aten.view.default(e11, [-1, 1]), ca), cb))
            wkp1 = aten.mul.Tensor(aten.view.default(e21, [-1, 1]),
                                   aten.sub.Tensor(aten.mul.Tensor(aten.view.default(e22, [-1, 1]), cb), ca))
            u2 = aten.sub.Tensor(aten.sub.Tensor(m, aten.mul.Tensor(aten.view.default(ca, [nb, n, 1]),
                                                                    aten.view.default(wk, [nb, 1, n]))),
                                 aten.mul.Tensor(aten.view.default(cb, [nb, n, 1]), aten.view.default(wkp1, [nb, 1, n])))
            r2 = aten.logical_and.default(aten.gt.Scalar(rows, k + 1), aten.gt.Scalar(cols, k + 1))
            upd2 = aten.logical_and.default(_b(two), r2)
        upd1 = aten.logical_and.default(_b(one), r1)
        new = aten.where.self(upd1, _mirror(u1, lower), m)
        if k < n - 1:
            new = aten.where.self(upd2, _mirror(u2, lower), new)
        # the finished columns: k (and k + 1 for a 2x2 block), rows from k down
        at_k = aten.eq.Scalar(cols, k)
        below_k = aten.gt.Scalar(rows, k)
        colk = aten.where.self(aten.view.default(one, [-1, 1]), l1, _col(m, k))     # zero column: as it is
        colk = aten.where.self(aten.eq.Scalar(j1, k), aten.view.default(dkk, [-1, 1]), colk)
        if k < n - 1:
            blk = aten.gt.Scalar(j1, k + 1)
            colk = aten.where.self(aten.logical_and.default(aten.view.default(two, [-1, 1]), blk), wk, colk)
            colk1 = aten.where.self(blk, wkp1, _col(m, k + 1))
            colk1 = aten.where.self(aten.lt.Scalar(j1, k + 1), aten.zeros_like.default(colk1), colk1)
            w1 = aten.logical_and.default(_b(two), aten.logical_and.default(aten.eq.Scalar(cols, k + 1),
                                                                           aten.ge.Scalar(rows, k + 1)))
            out = aten.where.self(w1, aten.view.default(colk1, [nb, n, 1]), out)
        wk_ = aten.logical_and.default(_b(active), aten.logical_and.default(at_k, aten.logical_or.default(
            below_k, aten.eq.Scalar(rows, k))))
        out = aten.where.self(wk_, aten.view.default(colk, [nb, n, 1]), out)
        m = new
        # pivots (1-based) and info
        piv = aten.where.self(c1, aten.full.default([nb], k + 1, dtype=torch.int64), aten.add.Tensor(imax, 1))
        piv = aten.where.self(two, aten.neg.default(aten.add.Tensor(imax, 1)), piv)
        pivots.append(aten.where.self(second, pending, piv))
        info = aten.where.self(aten.logical_and.default(aten.logical_and.default(active, zero), aten.eq.Scalar(info, 0)),
                               aten.full.default([nb], k + 1, dtype=torch.int64), info)
        pending = piv
        second = two
    ld = aten.reshape.default(out, batch + [n, n])
    piv_t = aten.reshape.default(aten._to_copy.default(aten.stack.default(pivots, 1), dtype=torch.int32), batch + [n])
    info_t = aten.reshape.default(aten._to_copy.default(info, dtype=torch.int32), batch)
    return ld, piv_t, info_t


def _rows_swap(b: Tensor, i: Tensor, j: Tensor, on: Tensor) -> Tensor:
    """``b`` ``[B, n, r]`` with rows ``i`` and ``j`` (``[B]``) exchanged where ``on`` (``[B]``)."""
    n = int(b.shape[1])
    r = _iota(n, [1, n])
    ib, jb = aten.view.default(i, [-1, 1]), aten.view.default(j, [-1, 1])
    perm = aten.where.self(aten.eq.Tensor(r, ib), jb, aten.where.self(aten.eq.Tensor(r, jb), ib, r))
    perm = aten.where.self(aten.view.default(on, [-1, 1]), perm, aten.expand.default(r, [int(b.shape[0]), n]))
    return aten.gather.default(b, 1, aten.expand.default(aten.view.default(perm, [-1, n, 1]), list(b.shape)))


@decomposition(aten.linalg_ldl_solve.default)
def _ldl_solve(ld: Tensor, pivots: Tensor, b: Tensor, *, hermitian: bool = False):
    """``x`` with ``A x = b`` from ``A``'s ``(LD, pivots)``, as LAPACK's ``?sytrs`` (lower): rows swapped and
    ``L``'s columns eliminated block by block forward, ``D``'s 1x1 / 2x2 blocks solved, then ``L^T``
    backward with the swaps undone."""
    if ld.dtype != torch.float32 or b.dtype != torch.float32 or ld.dim() < 2 or b.dim() < 2:
        return NotImplemented
    n = int(ld.shape[-1])
    batch = [int(d) for d in torch.broadcast_shapes(tuple(ld.shape[:-2]), tuple(b.shape[:-2]))]
    nrhs = int(b.shape[-1])
    nb = 1
    for d in batch:
        nb *= d
    if n == 0 or nb == 0 or nrhs == 0:
        return aten.clone.default(aten.expand.default(b, batch + [n, nrhs]))
    a = aten.reshape.default(aten.expand.default(ld, batch + [n, n]), [nb, n, n])
    piv = aten.reshape.default(aten.expand.default(aten._to_copy.default(pivots, dtype=torch.int64), batch + [n]),
                               [nb, n])
    x = aten.reshape.default(aten.clone.default(aten.expand.default(b, batch + [n, nrhs])), [nb, n, nrhs])
    rows = _iota(n, [1, n, 1])
    # the blocks, from the pivots as dsytrs reads them: a negative pivot starts a 2x2 block and covers the next
    second = aten.zeros.default([nb], dtype=torch.bool)
    starts2, seconds = [], []
    for k in range(n):
        pk = aten.select.int(piv, 1, k)
        s2 = aten.logical_and.default(aten.lt.Scalar(pk, 0), aten.logical_not.default(second))
        starts2.append(s2)
        seconds.append(second)
        second = s2
    # forward: L D y = P b
    for k in range(n):
        pk = aten.select.int(piv, 1, k)
        one = aten.logical_and.default(aten.gt.Scalar(pk, 0), aten.logical_not.default(seconds[k]))
        two = starts2[k]
        kb = aten.full.default([nb], k, dtype=torch.int64)
        # 1x1: swap k and piv - 1, b[k+1:] -= L[k+1:, k] b[k], b[k] *= 1 / D[k, k]
        x1 = _rows_swap(x, kb, aten.sub.Tensor(pk, 1), one)
        lk = aten.view.default(aten.select.int(a, 2, k), [nb, n, 1])
        xk = aten.view.default(aten.select.int(x1, 1, k), [nb, 1, nrhs])
        x1 = aten.where.self(aten.gt.Scalar(rows, k), aten.sub.Tensor(x1, aten.mul.Tensor(lk, xk)), x1)
        dk = aten.select.int(aten.select.int(a, 1, k), 1, k)
        x1 = aten.where.self(aten.eq.Scalar(rows, k), aten.mul.Tensor(x1, _b(aten.reciprocal.default(dk))), x1)
        new = aten.where.self(_b(one), x1, x)
        if k < n - 1:
            # 2x2: swap k+1 and -piv - 1, eliminate with columns k then k+1, solve the D block
            x2 = _rows_swap(x, aten.full.default([nb], k + 1, dtype=torch.int64),
                            aten.sub.Tensor(aten.neg.default(pk), 1), two)
            lk1 = aten.view.default(aten.select.int(a, 2, k + 1), [nb, n, 1])
            xk = aten.view.default(aten.select.int(x2, 1, k), [nb, 1, nrhs])
            xk1 = aten.view.default(aten.select.int(x2, 1, k + 1), [nb, 1, nrhs])
            below = aten.gt.Scalar(rows, k + 1)
            x2 = aten.where.self(below, aten.sub.Tensor(x2, aten.mul.Tensor(lk, xk)), x2)
            x2 = aten.where.self(below, aten.sub.Tensor(x2, aten.mul.Tensor(lk1, xk1)), x2)
            akm1k = _b(aten.select.int(aten.select.int(a, 1, k + 1), 1, k))
            akm1 = aten.div.Tensor(_b(dk), akm1k)
            ak = aten.div.Tensor(_b(aten.select.int(aten.select.int(a, 1, k + 1), 1, k + 1)), akm1k)
            denom = aten.sub.Tensor(aten.mul.Tensor(akm1, ak), 1.0)
            bkm1 = aten.div.Tensor(xk, akm1k)
            bk = aten.div.Tensor(xk1, akm1k)
            yk = aten.div.Tensor(aten.sub.Tensor(aten.mul.Tensor(ak, bkm1), bk), denom)
            yk1 = aten.div.Tensor(aten.sub.Tensor(aten.mul.Tensor(akm1, bk), bkm1), denom)
            x2 = aten.where.self(aten.eq.Scalar(rows, k), yk, x2)
            x2 = aten.where.self(aten.eq.Scalar(rows, k + 1), yk1, x2)
            new = aten.where.self(_b(two), x2, new)
        x = new
    # backward: L^T P^T x = y, from the last block up
    for k in range(n - 1, -1, -1):
        pk = aten.select.int(piv, 1, k)
        kb = aten.full.default([nb], k, dtype=torch.int64)
        is_second = seconds[k]                                  # (k-1, k) is a 2x2 block
        one = aten.logical_and.default(aten.gt.Scalar(pk, 0), aten.logical_not.default(is_second))
        one = aten.logical_and.default(one, aten.logical_not.default(starts2[k]))
        if k < n - 1:
            tail = aten.gt.Scalar(rows, k)
            lk = aten.where.self(tail, aten.view.default(aten.select.int(a, 2, k), [nb, n, 1]),
                                 aten.zeros.default([1, n, 1], dtype=x.dtype))
            dot = aten.sum.dim_IntList(aten.mul.Tensor(x, lk), [1], True)                    # [B, 1, nrhs]
            x1 = aten.where.self(aten.eq.Scalar(rows, k), aten.sub.Tensor(x, dot), x)
        else:
            x1 = x
        x1 = _rows_swap(x1, kb, aten.sub.Tensor(pk, 1), one)
        new = aten.where.self(_b(one), x1, x)
        if k >= 1:
            if k < n - 1:
                lkm1 = aten.where.self(tail, aten.view.default(aten.select.int(a, 2, k - 1), [nb, n, 1]),
                                       aten.zeros.default([1, n, 1], dtype=x.dtype))
                dot1 = aten.sum.dim_IntList(aten.mul.Tensor(x, lkm1), [1], True)
                x2 = aten.where.self(aten.eq.Scalar(rows, k), aten.sub.Tensor(x, dot), x)
                x2 = aten.where.self(aten.eq.Scalar(rows, k - 1), aten.sub.Tensor(x2, dot1), x2)
            else:
                x2 = x
            x2 = _rows_swap(x2, kb, aten.sub.Tensor(aten.neg.default(pk), 1), is_second)
            new = aten.where.self(_b(is_second), x2, new)
        x = new
    return aten.reshape.default(x, batch + [n, nrhs])
