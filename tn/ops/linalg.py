# Dense linear algebra (Cholesky, triangular solves, LU with partial pivoting, Householder QR and what follows) as core ops.
"""Decompositions of the LAPACK-backed ``torch.linalg`` factorizations and solves into core ops.

The NeuronCore has no LAPACK: a compiler for it runs these as ordinary tensor
programs. tn does the same. The matrix size ``n`` is static in a traced
program, so each algorithm is unrolled over its ``n`` columns at trace time;
every step is a handful of batched core ops (slices, a matmul, elementwise
ops, an ``argmax`` and a row gather for pivoting), so batch dimensions cost
nothing extra and 0-size matrices trace to empty loops.

* Cholesky (``linalg_cholesky_ex``, ``cholesky``): column by column,
  ``L[:, j] = (A[:, j] - L[:, :j] L[j, :j]^T) / sqrt(d_j)``; ``info`` is the
  first ``j`` (1-based) whose ``d_j`` is not positive (or NaN), as LAPACK's
  ``potrf`` reports it; ``upper`` reads the upper triangle (``A^T``'s lower).
* Triangular solves (``linalg_solve_triangular``, ``triangular_solve``):
  forward or backward substitution one row at a time, one ``[1, i] @ [i, k]``
  matmul per row; ``left=False`` / ``transpose`` are the transposed system.
* LU (``linalg_lu_factor_ex``): right-looking elimination with LAPACK's
  partial pivoting (the pivot is the first entry of largest magnitude at or
  below the diagonal: ``argmax``), the row swap a ``gather``; a zero pivot
  leaves its column unscaled and sets ``info`` to the first such column
  (1-based), as ``getrf`` does, so ``torch.linalg`` raises eager's exact
  ``LinAlgError`` through the ``linalg_check`` op.
* From LU: ``lu_unpack``, ``linalg_lu``, ``linalg_lu_solve``,
  ``_linalg_solve_ex``, ``linalg_inv_ex``, ``_linalg_det`` and
  ``_linalg_slogdet`` (sign from the pivots' parity and the diagonal's signs);
  from Cholesky: ``cholesky_solve`` and ``cholesky_inverse``.
* QR (``geqrf``, ``linalg_householder_product``, ``ormqr``, ``linalg_qr`` in
  modes reduced/complete/r): Householder reflectors in LAPACK's convention
  (``dlarfg``: ``beta = -sign(alpha) * norm``, ``v[0] = 1``), so ``Q`` and ``R``
  have LAPACK's signs; ``Q`` is the reflectors applied to the identity.

Only float32 runs natively (the chip has no float64 or complex arithmetic),
and only calls that do not ask the op itself to raise (``check_errors=True``):
for everything else these overloads stay the counted ``host`` op
(``host[fn=...]``, as :data:`tn.ops.HOST_OVERLOADS`). The choice is made by
the converter (:data:`NATIVE_OVERLOADS`): it returns ``None`` (decompose) for
native calls and the host form for the others (``geqrf`` has no meta kernel,
so no host form: other dtypes are refused while tracing, as before). The
eigenvalue family and the SVD stay on the host: their vectors are unique only
up to sign/phase, so a different algorithm gives a different, equally valid
answer.
"""
from __future__ import annotations

from typing import Any, Callable, List, Tuple

import torch

from .core import _host_conv, host
from .table import decomposition, from_aten

aten = torch.ops.aten
Tensor = torch.Tensor


def _is_native(*tensors: Any) -> bool:
    """Whether every floating or complex tensor argument is float32 (the dtype these decompositions run
    natively; integer pivots go along)."""
    ts = [t for t in tensors if isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())]
    return bool(ts) and all(t.dtype == torch.float32 for t in ts)


def _gated_conv(ov: Any) -> Callable[..., Any]:
    """The converter of ``ov``: ``None`` (use tn's decomposition) for a float32 call that does not ask the op
    to raise itself (``check_errors``), else the ``host`` op's form."""
    host_form = _host_conv(ov)

    def conv(*args: Any, **kwargs: Any) -> Any:
        if _is_native(*args, *kwargs.values()) and not kwargs.get("check_errors", False):
            return None
        return host_form(*args, **kwargs)

    conv.__doc__ = f"{ov}: tn's decomposition for float32, the host op for other dtypes."
    return conv


#: The overloads decomposed here for float32 (the converter picks: see :func:`_gated_conv`); for other dtypes
#: they are the ``host`` op.
NATIVE_OVERLOADS = tuple(
    getattr(getattr(aten, _p), "default") for _p in (
        "linalg_cholesky_ex", "cholesky", "cholesky_inverse", "cholesky_solve", "_cholesky_solve_helper",
        "linalg_solve_triangular", "triangular_solve", "linalg_lu_factor_ex", "lu_unpack", "linalg_lu",
        "linalg_lu_solve", "_linalg_solve_ex", "linalg_inv_ex", "_linalg_det", "_linalg_slogdet", "linalg_qr",
        "ormqr", "linalg_householder_product"))

for _ov in NATIVE_OVERLOADS:
    from_aten(host, _ov)(_gated_conv(_ov))


# --------------------------------------------------------------------------- helpers


def _batch(*ts: Tensor) -> Tuple[int, ...]:
    """The broadcast batch shape of matrices ``ts`` (all but the last two dimensions)."""
    return tuple(torch.broadcast_shapes(*[tuple(t.shape[:-2]) for t in ts]))


def _expand_batch(t: Tensor, batch: Tuple[int, ...]) -> Tensor:
    """``t`` expanded to batch dimensions ``batch`` (its matrix dimensions kept)."""
    return t.expand(batch + tuple(t.shape[-2:]))


def _first_true(flags: List[Tensor], shape: Tuple[int, ...], device: Any) -> Tensor:
    """LAPACK's ``info``: 1 + the index of the first true flag (each of ``shape``), 0 when none; int32."""
    info = torch.zeros(shape, dtype=torch.int32, device=device)
    for j in range(len(flags) - 1, -1, -1):
        info = torch.where(flags[j].reshape(shape), j + 1, info)
    return info.to(torch.int32)


def _tri_solve(a: Tensor, b: Tensor, upper: bool, unit: bool) -> Tensor:
    """``X`` with ``tri(a) @ X = b`` (``a [..., n, n]`` read only in its ``upper``/lower triangle, its diagonal
    taken as ones when ``unit``; ``b [..., n, k]`` with the same batch): substitution in BLAS ``trsm``'s
    column order (solve one row, subtract its multiples from the rows still to solve), unrolled over ``n``."""
    n = a.shape[-1]
    if n == 0:
        return b.clone()
    rows = torch.arange(n, device=a.device)[:, None]                       # [n, 1]
    for i in (range(n - 1, -1, -1) if upper else range(n)):
        x = b[..., i:i + 1, :]
        if not unit:
            x = x / a[..., i:i + 1, i:i + 1]
        todo = rows < i if upper else rows > i
        b = torch.where(rows == i, x, torch.where(todo, b - a[..., :, i:i + 1] * x, b))
    return b


def _solve_triangular(a: Tensor, b: Tensor, upper: bool, left: bool, unit: bool) -> Tensor:
    """``linalg.solve_triangular(a, b, upper=, left=, unitriangular=)`` with broadcast batch dimensions."""
    batch = _batch(a, b)
    a, b = _expand_batch(a, batch), _expand_batch(b, batch)
    if left:
        return _tri_solve(a, b, upper, unit)
    return _tri_solve(a.mT, b.mT, not upper, unit).mT          # X A = B  <=>  A^T X^T = B^T


# --------------------------------------------------------------------------- Cholesky


def _cholesky_lower(a: Tensor) -> Tuple[Tensor, Tensor]:
    """``(L, info)`` of ``a``'s lower triangle: ``L L^T = a``, ``info`` LAPACK's (first non-positive pivot)."""
    n = a.shape[-1]
    batch = tuple(a.shape[:-2])
    rows = torch.arange(n, device=a.device)
    cols: List[Tensor] = []
    fails: List[Tensor] = []
    for j in range(n):
        v = a[..., :, j:j + 1]                                      # [..., n, 1]
        if cols:
            lp = torch.cat(cols, -1)                                # [..., n, j]
            v = v - torch.matmul(lp, lp[..., j:j + 1, :].mT)
        d = v[..., j:j + 1, :]
        fails.append(torch.logical_not(d > 0))
        cols.append(torch.where((rows >= j)[:, None], v / torch.sqrt(d), 0.0))
    low = torch.cat(cols, -1) if cols else torch.zeros_like(a)
    return low, _first_true(fails, batch, a.device)


def _cholesky(a: Tensor, upper: bool) -> Tuple[Tensor, Tensor]:
    """``(L or U, info)`` as ``linalg_cholesky_ex(a, upper=upper)``."""
    if upper:
        low, info = _cholesky_lower(a.mT)
        return low.mT, info
    return _cholesky_lower(a)


@decomposition(aten.linalg_cholesky_ex.default)
def _linalg_cholesky_ex(a: Tensor, *, upper: bool = False, check_errors: bool = False) -> Any:
    """``torch.linalg.cholesky_ex``: unrolled column Cholesky with LAPACK's ``info``."""
    if check_errors:
        return NotImplemented
    return _cholesky(a, upper)


@decomposition(aten.cholesky.default)
def _cholesky_old(a: Tensor, upper: bool = False) -> Any:
    """``torch.cholesky`` (deprecated form): the factor only."""
    return _cholesky(a, upper)[0]


def _cholesky_solve_impl(b: Tensor, factor: Tensor, upper: bool) -> Tensor:
    """``X`` with ``A X = b`` where ``A = L L^T`` (``factor = L``) or ``U^T U`` (``factor = U``, ``upper``)."""
    batch = _batch(b, factor)
    b, f = _expand_batch(b, batch), _expand_batch(factor, batch)
    if upper:
        return _tri_solve(f, _tri_solve(f.mT, b, False, False), True, False)
    return _tri_solve(f.mT, _tri_solve(f, b, False, False), True, False)


@decomposition(aten.cholesky_solve.default, aten._cholesky_solve_helper.default)
def _cholesky_solve(b: Tensor, factor: Tensor, upper: bool = False) -> Any:
    """``torch.cholesky_solve(b, L)``: two triangular solves."""
    return _cholesky_solve_impl(b, factor, upper)


@decomposition(aten.cholesky_inverse.default)
def _cholesky_inverse(factor: Tensor, upper: bool = False) -> Any:
    """``torch.cholesky_inverse(L)``: ``(L L^T)^-1`` as a Cholesky solve of the identity."""
    n = factor.shape[-1]
    eye = torch.eye(n, dtype=factor.dtype, device=factor.device).expand(factor.shape)
    return _cholesky_solve_impl(eye, factor, upper)


# --------------------------------------------------------------------------- triangular solves


@decomposition(aten.linalg_solve_triangular.default)
def _linalg_solve_triangular(a: Tensor, b: Tensor, *, upper: bool, left: bool = True,
                             unitriangular: bool = False) -> Any:
    """``torch.linalg.solve_triangular``: substitution, unrolled over the rows."""
    return _solve_triangular(a, b, upper, left, unitriangular)


@decomposition(aten.triangular_solve.default)
def _triangular_solve(b: Tensor, a: Tensor, upper: bool = True, transpose: bool = False,
                      unitriangular: bool = False) -> Any:
    """``torch.triangular_solve(b, A)``: ``(X, A)`` with ``A X = b`` (``A^T X = b`` when ``transpose``)."""
    batch = _batch(a, b)
    a_b = _expand_batch(a, batch)
    x = _solve_triangular(a_b.mT if transpose else a_b, b, upper != transpose, True, unitriangular)
    return x, a_b.clone()


# --------------------------------------------------------------------------- LU


def _lu_factor(a: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """``(LU, pivots, info)`` of ``a [..., m, n]`` as LAPACK's ``getrf``: partial pivoting on the first entry of
    largest magnitude, pivots 1-based int32, ``info`` the first zero pivot (1-based) or 0."""
    m, n = a.shape[-2], a.shape[-1]
    batch = tuple(a.shape[:-2])
    k_max = min(m, n)
    rows = torch.arange(m, device=a.device)
    cols = torch.arange(n, device=a.device)
    pivots: List[Tensor] = []
    zeros: List[Tensor] = []
    for k in range(k_max):
        p = torch.argmax(a[..., k:, k].abs(), dim=-1, keepdim=True) + k          # [..., 1]
        swap = torch.where(rows == k, p, torch.where(rows == p, k, rows))        # [..., m]
        a = torch.gather(a, -2, swap[..., :, None].expand(a.shape))
        pivot = a[..., k:k + 1, k:k + 1]                                          # [..., 1, 1]
        zero = pivot == 0
        below = (rows > k)[:, None]                                               # [m, 1]
        low = torch.where(below, a[..., :, k:k + 1] / torch.where(zero, 1.0, pivot), 0.0)   # [..., m, 1]
        right = torch.where(cols > k, a[..., k:k + 1, :], 0.0)                   # [..., 1, n]
        a = torch.where(below & (cols == k), low, a - low * right)
        pivots.append((p + 1).to(torch.int32))
        zeros.append(zero)
    piv = torch.cat(pivots, -1) if pivots else torch.zeros(batch + (0,), dtype=torch.int32, device=a.device)
    return a.clone() if k_max == 0 else a, piv, _first_true(zeros, batch, a.device)


@decomposition(aten.linalg_lu_factor_ex.default)
def _linalg_lu_factor_ex(a: Tensor, *, pivot: bool = True, check_errors: bool = False) -> Any:
    """``torch.linalg.lu_factor_ex``: unrolled elimination with LAPACK's pivots and ``info``."""
    if not pivot or check_errors:
        return NotImplemented
    return _lu_factor(a)


def _permutation(piv: Tensor, m: int) -> Tensor:
    """``perm [..., m]`` (int64): row ``j`` of ``P^T A`` is row ``perm[j]`` of ``A``, for LAPACK pivots ``piv``
    (row ``i`` swapped with row ``piv[i] - 1``, in order)."""
    rows = torch.arange(m, device=piv.device)
    perm = rows.expand(tuple(piv.shape[:-1]) + (m,))
    for i in range(piv.shape[-1]):
        pi = piv[..., i:i + 1].to(torch.int64) - 1
        here = perm[..., i:i + 1]
        there = torch.gather(perm, -1, pi)
        perm = torch.where(rows == i, there, torch.where(rows == pi, here, perm))
    return perm


def _perm_matrix(perm: Tensor, dtype: torch.dtype) -> Tensor:
    """``P`` with ``P[perm[j], j] = 1``."""
    m = perm.shape[-1]
    return (torch.arange(m, device=perm.device)[:, None] == perm[..., None, :]).to(dtype)


def _unit_lower(lu: Tensor) -> Tensor:
    """The unit lower-trapezoidal ``L [..., m, min(m, n)]`` of a packed ``LU``."""
    m, n = lu.shape[-2], lu.shape[-1]
    k = min(m, n)
    r = torch.arange(m, device=lu.device)[:, None]
    c = torch.arange(k, device=lu.device)
    return torch.where(r > c, lu[..., :, :k], torch.where(r == c, 1.0, 0.0).to(lu.dtype))


def _upper(lu: Tensor) -> Tensor:
    """The upper-trapezoidal ``U [..., min(m, n), n]`` of a packed ``LU``."""
    m, n = lu.shape[-2], lu.shape[-1]
    k = min(m, n)
    r = torch.arange(k, device=lu.device)[:, None]
    c = torch.arange(n, device=lu.device)
    return torch.where(r <= c, lu[..., :k, :], 0.0)


@decomposition(aten.lu_unpack.default)
def _lu_unpack(lu: Tensor, piv: Tensor, unpack_data: bool = True, unpack_pivots: bool = True) -> Any:
    """``torch.lu_unpack``: ``(P, L, U)`` with ``A = P L U`` (empty tensors for the parts not asked for)."""
    m = lu.shape[-2]
    empty = lu.new_zeros((0,))
    p = _perm_matrix(_permutation(piv, m), lu.dtype) if unpack_pivots else empty
    if not unpack_data:
        return p, empty, lu.new_zeros((0,))
    return p, _unit_lower(lu), _upper(lu)


@decomposition(aten.linalg_lu.default)
def _linalg_lu(a: Tensor, *, pivot: bool = True) -> Any:
    """``torch.linalg.lu``: the factorization unpacked."""
    if not pivot:
        return NotImplemented
    lu, piv, _ = _lu_factor(a)
    return _lu_unpack(lu, piv)


def _lu_solve_left(lu: Tensor, piv: Tensor, b: Tensor, adjoint: bool) -> Tensor:
    """``X`` with ``A X = b`` (``A^T X = b`` when ``adjoint``), ``A = P L U`` given packed; batches broadcast."""
    batch = _batch(lu, b)
    n = lu.shape[-1]
    lu = _expand_batch(lu, batch)
    b = _expand_batch(b, batch)
    if n == 0:
        return b.clone()
    perm = _permutation(piv.expand(batch + (piv.shape[-1],)), n)
    if not adjoint:                                             # X = U^-1 L^-1 P^T b
        pb = torch.gather(b, -2, perm[..., :, None].expand(b.shape))
        return _tri_solve(lu, _tri_solve(lu, pb, False, True), True, False)
    z = _tri_solve(lu.mT, _tri_solve(lu.mT, b, False, False), True, True)   # L^-T U^-T b
    inv = torch.argmax(_perm_matrix(perm, torch.float32), dim=-1)          # P z: row perm[j] of X is z[j]
    return torch.gather(z, -2, inv[..., :, None].expand(z.shape))


def _lu_solve(lu: Tensor, piv: Tensor, b: Tensor, left: bool, adjoint: bool) -> Tensor:
    """``linalg.lu_solve(lu, piv, b, left=, adjoint=)``."""
    if left:
        return _lu_solve_left(lu, piv, b, adjoint)
    return _lu_solve_left(lu, piv, b.mT, not adjoint).mT        # X A = B  <=>  A^T X^T = B^T


@decomposition(aten.linalg_lu_solve.default)
def _linalg_lu_solve(lu: Tensor, piv: Tensor, b: Tensor, *, left: bool = True, adjoint: bool = False) -> Any:
    """``torch.linalg.lu_solve``: a permutation and two triangular solves."""
    return _lu_solve(lu, piv, b, left, adjoint)


@decomposition(aten._linalg_solve_ex.default)
def _linalg_solve_ex(a: Tensor, b: Tensor, *, left: bool = True, check_errors: bool = False) -> Any:
    """``torch.linalg.solve_ex``'s op: ``(X, LU, pivots, info)``; ``b`` is a (batch of) vector(s) when it has
    one dimension or the shape of ``a`` without its last (torch's rule)."""
    if check_errors:
        return NotImplemented
    vector = b.dim() == 1 or (b.dim() == a.dim() - 1 and tuple(b.shape) == tuple(a.shape[:-1]))
    lu, piv, info = _lu_factor(a)
    if vector:
        x = _lu_solve(lu, piv, b.unsqueeze(-1) if left else b.unsqueeze(-2), left, False)
        x = x.squeeze(-1) if left else x.squeeze(-2)
    else:
        x = _lu_solve(lu, piv, b, left, False)
    return x, lu, piv, info


@decomposition(aten.linalg_inv_ex.default)
def _linalg_inv_ex(a: Tensor, *, check_errors: bool = False) -> Any:
    """``torch.linalg.inv_ex``: ``(A^-1, info)`` by solving for the identity."""
    if check_errors:
        return NotImplemented
    n = a.shape[-1]
    lu, piv, info = _lu_factor(a)
    eye = torch.eye(n, dtype=a.dtype, device=a.device).expand(a.shape)
    return _lu_solve_left(lu, piv, eye, False), info


def _diagonal(lu: Tensor) -> Tensor:
    """The diagonal ``[..., min(m, n)]`` of ``lu`` (a masked sum: no strided view, so 0-size matrices trace)."""
    m, n = lu.shape[-2], lu.shape[-1]
    k = min(m, n)
    eye = torch.arange(k, device=lu.device)[:, None] == torch.arange(k, device=lu.device)
    return torch.where(eye, lu[..., :k, :k], 0.0).sum(-1)


def _pivot_sign(piv: Tensor, dtype: torch.dtype) -> Tensor:
    """``det(P)``: +1 or -1 from the number of pivots that swap a row."""
    k = piv.shape[-1]
    swaps = (piv != torch.arange(1, k + 1, device=piv.device, dtype=piv.dtype)).to(dtype).sum(-1)
    return 1.0 - 2.0 * torch.remainder(swaps, 2.0)


@decomposition(aten._linalg_det.default)
def _linalg_det(a: Tensor) -> Any:
    """``torch.linalg.det``'s op: ``(det, LU, pivots)``, the pivots' sign times the product of ``U``'s
    diagonal. As torch's CPU kernel, a row-major ``A`` is factored as ``A^T`` (same determinant; the backward
    reads ``LU`` that way)."""
    lu, piv, _ = _lu_factor(a.mT if a.is_contiguous() else a)
    diag = _diagonal(lu)
    return _pivot_sign(piv, a.dtype) * diag.prod(-1), lu, piv


@decomposition(aten._linalg_slogdet.default)
def _linalg_slogdet(a: Tensor) -> Any:
    """``torch.linalg.slogdet``'s op: ``(sign, log|det|, LU, pivots)`` from ``U``'s diagonal and the pivots
    (a row-major ``A`` factored as ``A^T``, as by torch's CPU kernel)."""
    lu, piv, _ = _lu_factor(a.mT if a.is_contiguous() else a)
    diag = _diagonal(lu)
    sign = _pivot_sign(piv, a.dtype) * torch.sign(diag).prod(-1)
    return sign, torch.log(diag.abs()).sum(-1), lu, piv


# --------------------------------------------------------------------------- QR (Householder, LAPACK's convention)


def _reflector(a: Tensor, i: int) -> Tensor:
    """The Householder vector ``v [..., m, 1]`` stored in column ``i`` of a ``geqrf`` result: 0 above row
    ``i``, 1 at row ``i``, the column's entries below it."""
    rows = torch.arange(a.shape[-2], device=a.device)[:, None]
    return torch.where(rows > i, a[..., :, i:i + 1], torch.where(rows == i, 1.0, 0.0).to(a.dtype))


def _geqrf(a: Tensor) -> Tuple[Tensor, Tensor]:
    """``(a, tau)`` as LAPACK's ``geqr2``: for each column ``i`` a reflector from ``dlarfg`` (``beta =
    -sign(alpha) * ||(alpha, x)||``, ``tau = (beta - alpha) / beta``, ``v = x / (alpha - beta)``; ``tau = 0``
    when ``x`` is zero) applied to the columns after it; ``R`` on and above the diagonal, ``v`` below."""
    m, n = a.shape[-2], a.shape[-1]
    batch = tuple(a.shape[:-2])
    rows = torch.arange(m, device=a.device)[:, None]
    cols = torch.arange(n, device=a.device)
    taus: List[Tensor] = []
    for i in range(min(m, n)):
        col = a[..., :, i:i + 1]                                          # [..., m, 1]
        alpha = a[..., i:i + 1, i:i + 1]                                  # [..., 1, 1]
        below = rows > i
        x = torch.where(below, col, 0.0)
        xsq = (x * x).sum(-2, keepdim=True)
        norm = torch.sqrt(alpha * alpha + xsq)
        beta = torch.where(alpha >= 0, -norm, norm)
        trivial = xsq == 0
        tau = torch.where(trivial, 0.0, (beta - alpha) / torch.where(trivial, 1.0, beta))
        v = torch.where(below, col / torch.where(trivial, 1.0, alpha - beta), torch.where(rows == i, 1.0, 0.0))
        applied = a - tau * v * torch.matmul(v.mT, a)                     # H = I - tau v v^T on the left
        a = torch.where(cols > i, applied, a)
        a = torch.where(cols == i, torch.where(rows == i, torch.where(trivial, alpha, beta), torch.where(below, v, col)),
                        a)
        taus.append(tau.reshape(batch + (1,)))
    tau_all = torch.cat(taus, -1) if taus else a.new_zeros(batch + (0,))
    return (a.clone() if not taus else a), tau_all


def _householder_product(v: Tensor, tau: Tensor) -> Tensor:
    """The first ``n`` columns of ``H_0 ... H_{k-1}`` for reflectors stored in ``v [..., m, n]`` (as ``orgqr``:
    applied to the identity from the last to the first)."""
    m, n = v.shape[-2], v.shape[-1]
    batch = _batch(v)
    batch = tuple(torch.broadcast_shapes(batch, tuple(tau.shape[:-1])))
    v = _expand_batch(v, batch)
    q = torch.eye(m, n, dtype=v.dtype, device=v.device).expand(batch + (m, n))
    for i in range(tau.shape[-1] - 1, -1, -1):
        r = _reflector(v, i)
        t = tau[..., i:i + 1].unsqueeze(-1)
        q = q - t * r * torch.matmul(r.mT, q)
    return q.clone() if tau.shape[-1] == 0 else q


def _upper_trapezoid(a: Tensor, rows: int) -> Tensor:
    """``triu(a[..., :rows, :])``."""
    r = torch.arange(rows, device=a.device)[:, None]
    c = torch.arange(a.shape[-1], device=a.device)
    return torch.where(r <= c, a[..., :rows, :], 0.0)


@decomposition(aten.geqrf.default)
def _geqrf_decomp(a: Tensor) -> Any:
    """``torch.geqrf``: Householder QR in LAPACK's storage (float32 only; no meta kernel, so no host form)."""
    if a.dtype != torch.float32:
        return NotImplemented
    return _geqrf(a)


@decomposition(aten.linalg_householder_product.default)
def _linalg_householder_product(v: Tensor, tau: Tensor) -> Any:
    """``torch.linalg.householder_product``: the reflectors applied to the identity."""
    return _householder_product(v, tau)


@decomposition(aten.ormqr.default)
def _ormqr(v: Tensor, tau: Tensor, other: Tensor, left: bool = True, transpose: bool = False) -> Any:
    """``torch.ormqr``: ``other`` multiplied by ``Q = H_0 ... H_{k-1}`` (or ``Q^T``) from the left or right, one
    reflector at a time."""
    batch = _batch(v, other)
    v, c = _expand_batch(v, batch), _expand_batch(other, batch)
    k = tau.shape[-1]
    tau = tau.expand(batch + (k,))
    for i in (range(k) if left == transpose else range(k - 1, -1, -1)):
        r = _reflector(v, i)
        t = tau[..., i:i + 1].unsqueeze(-1)
        c = c - t * r * torch.matmul(r.mT, c) if left else c - t * torch.matmul(c, r) * r.mT
    return c.clone() if k == 0 else c


@decomposition(aten.linalg_qr.default)
def _linalg_qr(a: Tensor, mode: str = "reduced") -> Any:
    """``torch.linalg.qr``: ``geqrf`` and ``orgqr`` (modes ``reduced``, ``complete``, ``r``)."""
    m, n = a.shape[-2], a.shape[-1]
    k = min(m, n)
    h, tau = _geqrf(a)
    if mode == "r":
        return a.new_zeros((0,)), _upper_trapezoid(h, k)
    if mode == "complete" and m > n:
        pad = torch.cat([h, h.new_zeros(tuple(h.shape[:-1]) + (m - n,))], -1)
        return _householder_product(pad, tau), _upper_trapezoid(h, m)
    return _householder_product(h[..., :, :k], tau), _upper_trapezoid(h, k)
