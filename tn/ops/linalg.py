# Dense linear algebra as core ops: Cholesky, triangular solves, LU, Householder QR, Jacobi singular/symmetric eigenvalues, matrix_exp, and what follows.
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

* Singular values (``_linalg_svd``'s ``S``: ``svdvals``, ``matrix_norm(ord='nuc' or 2)``, ``cond``) by
  one-sided (Hestenes) Jacobi, symmetric eigenvalues (``_linalg_eigh``'s ``L``: ``eigvalsh``) by cyclic
  Jacobi, both in the parallel round-robin order (``n/2`` independent rotations per step) over a fixed number
  of sweeps (:func:`_jacobi_sweeps`: enough to reach float32 rounding up to ``JACOBI_MAX_N = 16`` columns;
  larger matrices stay host ops), then sorted as LAPACK returns them. ``linalg_pinv`` from the same
  rotations, ``V diag(1/s^2) (A V)^T`` (``hermitian``: ``V diag(1/l) V^T``), in which the vectors' signs
  cancel.
* ``linalg_matrix_exp`` as torch's kernel: Taylor degree chosen per matrix from its 1-norm (selects), the
  degree-18 approximant scaled and squared (Bader, Blanes and Casas).
* ``linalg_lstsq`` (every CPU driver's outputs): the minimum-norm solution from the Jacobi SVD, which is what
  each driver computes at full rank; rank and singular values from the same ``s``.
* Not here: ``linalg_ldl_factor_ex``/``linalg_ldl_solve`` (Bunch-Kaufman pivots) live in ``tn/ops/ldl.py``.

Only float32 runs natively (the chip has no float64 or complex arithmetic;
``linalg_matrix_exp`` also takes bf16/fp16, computed in float32: torch's own
bf16 kernel returns NaN where the result is finite), and only calls that do
not ask the op itself to raise (``check_errors=True``):
for everything else these overloads stay the counted ``host`` op
(``host[fn=...]``, as :data:`tn.ops.HOST_OVERLOADS`). The choice is made by
the converter (:data:`NATIVE_OVERLOADS`): it returns ``None`` (decompose) for
native calls and the host form for the others (``geqrf`` has no meta kernel,
so no host form: other dtypes are refused while tracing, as before).
Singular and eigen *vectors* stay on the host (``linalg.svd``, ``linalg.eigh``,
``linalg.eig``): they are unique only up to sign/phase, so a different
algorithm gives a different, equally valid answer. torch asks ``_linalg_svd``
for them whenever the input is a tensor subclass (so always while tracing):
the decomposition then takes ``U``/``Vh`` from a ``host`` op and ``S`` from
Jacobi, and where only ``S`` is used dead-code elimination drops the host op.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .core import _host_conv, host
from .low_precision import is_low_precision
from .table import decomposition, from_aten

aten = torch.ops.aten
Tensor = torch.Tensor


def _is_native(*tensors: Any) -> bool:
    """Whether every floating or complex tensor argument is float32 (the dtype these decompositions run
    natively; integer pivots go along)."""
    ts = [t for t in tensors if isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())]
    return bool(ts) and all(t.dtype == torch.float32 for t in ts)


def _bound(ov: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The arguments of a call of the aten overload ``ov`` by schema name, defaults filled in."""
    out: Dict[str, Any] = {}
    for i, a in enumerate(ov._schema.arguments):
        if i < len(args) and not a.kwarg_only:
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


#: ``forced`` is true while a decomposition asks for the ``host`` form of an overload it decomposes itself
_HOST = threading.local()


def _gated_conv(ov: Any, native: Optional[Callable[[Dict[str, Any]], bool]] = None) -> Callable[..., Any]:
    """The converter of ``ov``: ``None`` (use tn's decomposition) for a float32 call that does not ask the op
    to raise itself (``check_errors``) and passes ``native`` (a test of the bound arguments, when given), else
    the ``host`` op's form."""
    host_form = _host_conv(ov)

    def conv(*args: Any, **kwargs: Any) -> Any:
        tensors = (args[0],) if ov in _NATIVE_BY_INPUT else (*args, *kwargs.values())
        if (not getattr(_HOST, "forced", False)
                and (_is_native(*tensors) or ov in _NATIVE_LOW_PRECISION and _is_low_precision(*tensors))
                and not kwargs.get("check_errors", False)
                and (native is None or native(_bound(ov, args, kwargs)))):
            return None
        return host_form(*args, **kwargs)

    conv.__doc__ = (f"{ov}: tn's decomposition for float32 (and bf16/fp16 if in _NATIVE_LOW_PRECISION), the host "
                    "op for other dtypes.")
    return conv


#: the largest ``min(m, n)`` (SVD) or ``n`` (symmetric eigenvalues) decomposed natively; larger stay host ops
JACOBI_MAX_N = 16


def _jacobi_fits(a: Tensor) -> bool:
    """Whether ``a``'s matrices are small enough for the unrolled Jacobi methods (``min(m, n) <=
    JACOBI_MAX_N``)."""
    return min(a.shape[-2], a.shape[-1]) <= JACOBI_MAX_N


#: the overloads that are native only for some calls: the test of their bound arguments (besides float32)
NATIVE_WHEN: Dict[Any, Callable[[Dict[str, Any]], bool]] = {
    aten._linalg_svd.default: lambda b: _jacobi_fits(b["A"]),
    aten._linalg_eigh.default: lambda b: _jacobi_fits(b["A"]),
    aten.linalg_pinv.atol_rtol_tensor: lambda b: _jacobi_fits(b["self"]),
}


#: the overloads whose first argument alone decides native or host (``linalg.pinv``'s tolerances are float64
#: tensors when given as Python numbers: they are cast to float32, where torch compares in float64, so a
#: threshold can differ by one float32 rounding)
_NATIVE_BY_INPUT = (aten.linalg_pinv.atol_rtol_tensor,)


#: the overloads whose decomposition also takes bf16/fp16 inputs, computing in float32 and rounding the result
#: once: torch's CPU kernel of ``linalg_matrix_exp`` in bf16 evaluates the Taylor polynomial and squarings in
#: bf16 and returns NaN for matrices of 1-norm ~27 whose exponential (~9e4) bf16 represents fine
_NATIVE_LOW_PRECISION = (aten.linalg_matrix_exp.default,)


def _is_low_precision(*tensors: Any) -> bool:
    """Whether every floating tensor argument is bfloat16 or float16 (and there is one)."""
    ts = [t for t in tensors if isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())]
    return bool(ts) and all(is_low_precision(t.dtype) for t in ts)


#: The overloads decomposed here for float32 (the converter picks: see :func:`_gated_conv`); for other dtypes
#: they are the ``host`` op.
NATIVE_OVERLOADS = tuple(
    getattr(getattr(aten, _p), "default") for _p in (
        "linalg_cholesky_ex", "cholesky", "cholesky_inverse", "cholesky_solve", "_cholesky_solve_helper",
        "linalg_solve_triangular", "triangular_solve", "linalg_lu_factor_ex", "lu_unpack", "linalg_lu",
        "linalg_lu_solve", "_linalg_solve_ex", "linalg_inv_ex", "_linalg_det", "_linalg_slogdet", "linalg_qr",
        "ormqr", "linalg_householder_product", "linalg_matrix_exp")) + tuple(NATIVE_WHEN)

for _ov in NATIVE_OVERLOADS:
    from_aten(host, _ov)(_gated_conv(_ov, NATIVE_WHEN.get(_ov)))


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


# --------------------------------------------------------------------------- Jacobi: singular values, symmetric eigenvalues

def _jacobi_sweeps(n: int) -> int:
    """The fixed number of cyclic Jacobi sweeps unrolled for ``n`` columns: Jacobi converges quadratically once
    the off-diagonal part is small: on random, graded, rank-deficient and clustered matrices 4 sweeps reach
    float32 rounding for ``n <= 8`` and 5 for ``n <= 16`` (``JACOBI_MAX_N``); this unrolls two more (``3 +
    ceil(log2 n)``: 6 at ``n = 5``). Sweeps past convergence rotate by angles that round to the identity."""
    return 0 if n < 2 else 3 + (n - 1).bit_length()


def _rotation(app: Tensor, aqq: Tensor, apq: Tensor) -> Tuple[Tensor, Tensor]:
    """``(c, s)`` of the Jacobi rotation that zeroes ``apq`` of the symmetric 2x2 ``[[app, apq], [apq, aqq]]``
    (the smaller angle: ``t = sign(zeta) / (|zeta| + sqrt(1 + zeta^2))``, ``zeta = (aqq - app) / (2 apq)``);
    no rotation where ``apq`` is zero."""
    zero = apq == 0
    zeta = (aqq - app) / (2.0 * torch.where(zero, 1.0, apq))
    t = torch.where(zeta >= 0, 1.0, -1.0) / (zeta.abs() + torch.sqrt(1.0 + zeta * zeta))
    t = torch.where(zero, 0.0, t)
    c = torch.rsqrt(1.0 + t * t)
    return c, t * c


def _round_robin(order: List[int]) -> List[int]:
    """The next pairing of the parallel (round-robin) cyclic ordering: positions ``i`` and ``k + i`` are paired;
    the first position stays, the others rotate, so every pair meets once in ``len(order) - 1`` rounds."""
    k = len(order) // 2
    if k < 2:
        return list(order)
    top, bot = order[:k], order[k:]
    return [top[0], bot[0]] + top[1:k - 1] + bot[1:] + [top[k - 1]]


def _take(x: Tensor, dim: int, idx: List[int]) -> Tensor:
    """``x.index_select(dim, idx)`` for a static index list, as slices of consecutive runs and one ``cat``."""
    runs: List[Tuple[int, int]] = []
    for i in idx:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    if runs == [(0, x.shape[dim])]:
        return x
    return torch.cat([x.narrow(dim, s, ln) for s, ln in runs], dim)


def _rotate_halves(x: Tensor, c: Tensor, s: Tensor, dim: int) -> Tensor:
    """The ``k`` plane rotations of a Jacobi round applied along ``dim``: its first half ``p`` and second half
    ``q`` become ``c p - s q`` and ``s p + c q`` (``c``, ``s`` broadcast over the other axis)."""
    k = x.shape[dim] // 2
    p, q = x.narrow(dim, 0, k), x.narrow(dim, k, k)
    return torch.cat([c * p - s * q, s * p + c * q], dim)


def _jacobi_start(a: Tensor, nn: int, vectors: bool) -> Tuple[Tensor, List[int]]:
    """``(V, nxt)`` of a Jacobi method on ``nn`` (even) columns: the identity ``V`` to accumulate rotations in (an
    empty tensor unless ``vectors``) and the round-robin permutation applied after every round (the same each
    round)."""
    v = a.new_zeros((0,))
    if vectors:
        v = torch.eye(nn, dtype=a.dtype, device=a.device).expand(tuple(a.shape[:-2]) + (nn, nn))
    return v, _round_robin(list(range(nn)))


def _pad_even(a: Tensor, dims: Tuple[int, ...]) -> Tensor:
    """``a`` with one zero row/column appended along each of ``dims`` when their size is odd."""
    for d in dims:
        if a.shape[d] % 2:
            shape = list(a.shape)
            shape[d] = 1
            a = torch.cat([a, a.new_zeros(shape)], d)
    return a


def _one_sided_jacobi(a: Tensor, vectors: bool) -> Tuple[Tensor, Tensor, List[int]]:
    """Hestenes' one-sided Jacobi on the columns of ``a [..., m, n]``: ``(W, V, order)`` with ``W = A V``
    having orthogonal columns (``||W[:, j]||`` are the singular values), ``V`` the accumulated rotations (an
    empty tensor unless ``vectors``) and ``order[j]`` the original column now at position ``j`` (``n`` for the
    zero column that pads an odd ``n``). The rotations are those of the cyclic Jacobi eigenvalue method on
    ``A^T A``, in the parallel round-robin order: ``n/2`` independent rotations per round, a sweep being
    ``n - 1`` rounds."""
    n = a.shape[-1]
    w = _pad_even(a, (-1,))
    nn = w.shape[-1]
    k = nn // 2
    v, nxt = _jacobi_start(a, nn, vectors)
    order = list(range(nn))
    for _ in range(_jacobi_sweeps(n)):
        for _ in range(nn - 1):
            p, q = w[..., :, :k], w[..., :, k:]
            c, s = _rotation((p * p).sum(-2, keepdim=True), (q * q).sum(-2, keepdim=True),
                             (p * q).sum(-2, keepdim=True))
            w = _rotate_halves(w, c, s, -1)
            if vectors:
                v = _rotate_halves(v, c, s, -1)
            w = _take(w, -1, nxt)
            if vectors:
                v = _take(v, -1, nxt)
            order = [order[i] for i in nxt]
    return w, v, order


def _keep(order: List[int], n: int) -> List[int]:
    """The positions in ``order`` that hold one of the ``n`` original columns (not the padding)."""
    return [j for j, o in enumerate(order) if o < n]


def _svdvals(a: Tensor) -> Tensor:
    """The singular values ``[..., min(m, n)]`` of ``a`` in descending order, by one-sided Jacobi on the
    columns of ``a`` (``a^T`` when it is wide): column norms of the orthogonalised matrix."""
    if a.shape[-2] < a.shape[-1]:
        a = a.mT
    n = a.shape[-1]
    batch = tuple(a.shape[:-2])
    if n == 0:
        return a.new_zeros(batch + (0,))
    w, _, order = _one_sided_jacobi(a, False)
    s = _take(torch.sqrt((w * w).sum(-2)), -1, _keep(order, n))
    return torch.sort(s, dim=-1, descending=True).values


def _symmetric(a: Tensor, upper: bool) -> Tensor:
    """The symmetric matrix whose lower (``upper``: upper) triangle is ``a``'s."""
    n = a.shape[-1]
    r = torch.arange(n, device=a.device)[:, None]
    c = torch.arange(n, device=a.device)
    tri = (r <= c) if upper else (r >= c)
    return torch.where(tri, a, a.mT)


def _two_sided_jacobi(a: Tensor, vectors: bool) -> Tuple[Tensor, Tensor, List[int]]:
    """The cyclic Jacobi eigenvalue method on the symmetric ``a [..., n, n]``, parallel round-robin order:
    ``(D, V, order)`` with ``D = V^T A V`` diagonal to float32 rounding, ``V`` the accumulated rotations (an
    empty tensor unless ``vectors``) and ``order`` as in :func:`_one_sided_jacobi`."""
    n = a.shape[-1]
    d = _pad_even(a, (-2, -1))
    nn = d.shape[-1]
    k = nn // 2
    v, nxt = _jacobi_start(a, nn, vectors)
    order = list(range(nn))
    for _ in range(_jacobi_sweeps(n)):
        for _ in range(nn - 1):
            c, s = _rotation(_diagonal(d[..., :k, :k]), _diagonal(d[..., k:, k:]), _diagonal(d[..., :k, k:]))
            cr, sr = c.unsqueeze(-2), s.unsqueeze(-2)                      # [..., 1, k]: scales columns
            d = _rotate_halves(d, cr, sr, -1)
            d = _rotate_halves(d, c.unsqueeze(-1), s.unsqueeze(-1), -2)    # [..., k, 1]: scales rows
            if vectors:
                v = _rotate_halves(v, cr, sr, -1)
            d = _take(_take(d, -1, nxt), -2, nxt)
            if vectors:
                v = _take(v, -1, nxt)
            order = [order[i] for i in nxt]
    return d, v, order


def _eigvalsh(a: Tensor, upper: bool) -> Tensor:
    """The eigenvalues ``[..., n]`` of the symmetric matrix in ``a``'s lower (``upper``: upper) triangle, in
    ascending order, by cyclic Jacobi."""
    n = a.shape[-1]
    if n == 0:
        return a.new_zeros(tuple(a.shape[:-2]) + (0,))
    d, _, order = _two_sided_jacobi(_symmetric(a, upper), False)
    return torch.sort(_take(_diagonal(d), -1, _keep(order, n)), dim=-1).values


def _on_host(ov: Any, *args: Any, **kwargs: Any) -> Any:
    """``ov(*args, **kwargs)`` traced as the ``host`` op even where this module decomposes ``ov``."""
    _HOST.forced = True
    try:
        return ov(*args, **kwargs)
    finally:
        _HOST.forced = False


def _check_finite(a: Tensor) -> None:
    """LAPACK's SVD refuses non-finite input: ``info = -4`` per matrix, raised by ``linalg_check`` after the run
    with eager's message ("... the input matrix contained non-finite values")."""
    bad = torch.logical_not(torch.isfinite(a)).any(-1).any(-1)
    info = torch.where(bad, -4, 0).to(torch.int32)
    aten._linalg_check_errors.default(info, "linalg.svd", is_matrix=a.dim() == 2)


@decomposition(aten._linalg_svd.default)
def _linalg_svd(a: Tensor, full_matrices: bool = False, compute_uv: bool = True, *, driver: Any = None) -> Any:
    """``torch.linalg.svdvals``' op: ``(U, S, Vh)`` with ``S`` by one-sided Jacobi. ``U`` and ``Vh`` (when
    ``compute_uv``) come from a ``host`` op: their signs are LAPACK's choice. torch asks for them whenever the
    input may need a gradient or is a tensor subclass (so always while tracing); where only ``S`` is used, as
    in ``svdvals``, ``matrix_rank``, ``cond`` and the nuclear norm's forward, dead-code elimination drops the
    host op and the program is native."""
    _check_finite(a)
    s = _svdvals(a)
    if not compute_uv:
        return a.new_zeros((0,)), s, a.new_zeros((0,))
    u, _, vh = _on_host(aten._linalg_svd.default, a, full_matrices, True, driver=driver)
    return u, s, vh


@decomposition(aten._linalg_eigh.default)
def _linalg_eigh(a: Tensor, UPLO: str = "L", compute_v: bool = True) -> Any:  # noqa: N803  (aten's name)
    """``torch.linalg.eigvalsh``' op: ``(L, V)`` with ``L`` by cyclic Jacobi; ``V`` (when ``compute_v``)
    from a ``host`` op (eigenvector signs), dropped as dead code where only ``L`` is used (see
    :func:`_linalg_svd`)."""
    lam = _eigvalsh(a, UPLO.upper() == "U")
    if not compute_v:
        return lam, a.new_zeros((0,))
    return lam, _on_host(aten._linalg_eigh.default, a, UPLO, True)[1]


def _tolerance(a: Tensor, top: Tensor, atol: Optional[Tensor], rtol: Optional[Tensor]) -> Tensor:
    """``max(atol, rtol * top)`` ``[..., 1]`` as ``torch.linalg.pinv``/``matrix_rank`` choose it: ``atol``
    defaults to 0, ``rtol`` to ``eps * max(m, n)`` (to 0 where a given ``atol`` is positive)."""
    default = torch.finfo(a.dtype).eps * max(a.shape[-1], a.shape[-2])
    at = a.new_zeros(()) if atol is None else atol.to(a.dtype)
    if rtol is not None:
        rt = rtol.to(a.dtype)
    elif atol is not None:
        rt = torch.where(at > 0, 0.0, default)
    else:
        rt = a.new_full((), default)
    return torch.maximum(at.unsqueeze(-1), rt.unsqueeze(-1) * top)


@decomposition(aten.linalg_pinv.atol_rtol_tensor)
def _linalg_pinv(a: Tensor, *, atol: Optional[Tensor] = None, rtol: Optional[Tensor] = None,
                 hermitian: bool = False) -> Any:
    """``torch.linalg.pinv``: from the Jacobi SVD (``V diag(1/s^2) (AV)^T`` over the singular values above the
    tolerance: ``A V = U diag(s)``, so the vectors' signs cancel) or, ``hermitian``, the Jacobi eigen
    decomposition of the lower triangle (``V diag(1/l) V^T`` over ``|l|`` above it), as torch's formula."""
    m, n = a.shape[-2], a.shape[-1]
    if not _jacobi_fits(a):
        return NotImplemented
    if a.numel() == 0:
        return a.new_zeros(tuple(a.shape[:-2]) + (n, m))
    if hermitian:
        d, v, order = _two_sided_jacobi(_symmetric(a, False), True)
        keep = _keep(order, n)
        lam = _take(_diagonal(d), -1, keep)
        big = lam.abs() > _tolerance(a, lam.abs().amax(-1, keepdim=True), atol, rtol)
        inv = torch.where(big, 1.0 / torch.where(big, lam, 1.0), 0.0)
        v = _take(v[..., :n, :], -1, keep)
        return torch.matmul(v * inv.unsqueeze(-2), v.mT)
    _check_finite(a)
    wide = m < n
    w, v, order = _one_sided_jacobi(a.mT if wide else a, True)
    k = min(m, n)
    keep = _keep(order, k)
    w, v = _take(w, -1, keep), _take(v[..., :k, :], -1, keep)
    sq = (w * w).sum(-2)
    s = torch.sqrt(sq)
    big = s > _tolerance(a, s.amax(-1, keepdim=True), atol, rtol)
    inv = torch.where(big, 1.0 / torch.where(big, sq, 1.0), 0.0)
    p = torch.matmul(v[..., :k, :] * inv.unsqueeze(-2), w.mT)           # [k, rows of the tall form]
    return p.mT if wide else p


# --------------------------------------------------------------------------- matrix exponential

#: torch's float32 norm bounds of its Taylor degrees 1, 2, 4, 8, 12 and 18 (Bader, Blanes and Casas, "Computing
#: the matrix exponential with an optimized Taylor polynomial approximation", 2019), for the 1-norm
_EXP_THETAS = (1.192092800768788e-07, 5.978858893805233e-04, 5.116619363445086e-02, 5.800524627688768e-01,
               1.461661507209034e+00, 3.010066362817634e+00)
#: the paper's coefficients of degree 12 (rows: the four matrices ``B_i`` as combinations of ``I, A, A^2, A^3``)
_EXP_B12 = ((9.0198e-16, 0.46932117595418237389, -0.20099424927047284052, -0.04623946134063071740),
            (5.31597895759871264183, 1.19926790417132231573, 0.01179296240992997031, 0.01108844528519167989),
            (0.18188869982170434744, 0.05502798439925399070, 0.09351590770535414968, 0.00610700528898058230),
            (-2.0861320e-13, -0.13181061013830184015, -0.02027855540589259079, -0.00675951846863086359))
#: and of degree 18 (combinations of ``I, A, A^2, A^3, A^6``)
_EXP_B18 = ((0., -1.00365581030144618291e-01, -8.02924648241156932449e-03, -8.92138498045729985177e-04, 0.),
            (0., 3.97849749499645077844e-01, 1.36783778460411720168e+00, 4.98289622525382669416e-01,
             -6.37898194594723280150e-04),
            (-1.09676396052962061844e+01, 1.68015813878906206114e+00, 5.71779846478865511061e-02,
             -6.98210122488052056106e-03, 3.34975017086070470649e-05),
            (-9.04316832390810593223e-02, -6.76404519071381882256e-02, 6.75961301770459654925e-02,
             2.95552570429315521194e-02, -1.39180257516060693404e-05),
            (0., 0., -9.23364619367118555360e-02, -1.69364939002081722752e-02, -1.40086798182036094347e-05))
#: the most squarings unrolled: inputs whose 1-norm exceeds ``3.01 * 2**64`` get 64 (torch's kernel, more)
_EXP_MAX_SQUARINGS = 64


def _combine(mats: List[Tensor], coef: Tuple[float, ...]) -> Tensor:
    """``sum_j coef[j] * mats[j]`` (zero coefficients skipped)."""
    out = None
    for c, m in zip(coef, mats):
        if c != 0.0:
            out = m * c if out is None else out + m * c
    return out if out is not None else torch.zeros_like(mats[0])


def _exp_taylor(a: Tensor, eye: Tensor) -> List[Tensor]:
    """torch's approximants ``T_1, T_2, T_4, T_8, T_12, T_18`` of ``exp(a)`` (the paper's evaluation schemes:
    6 matrix products for all six)."""
    a2 = torch.matmul(a, a)
    t1 = eye + a
    t2 = t1 + a2 / 2.0
    t4 = t1 + torch.matmul(a2, eye / 2.0 + a / 6.0 + a2 / 24.0)
    r = 13.30413469565007072504
    x3 = 2.0 / 3.0
    x1, x2 = x3 * ((1.0 + r) / 88.0), x3 * ((1.0 + r) / 352.0)
    x4, x5 = (-271.0 + 29.0 * r) / (315.0 * x3), (-11.0 + 11.0 * r) / (1260.0 * x3)
    x6, x7 = (-99.0 + 11.0 * r) / (5040.0 * x3), (89.0 - r) / (5040.0 * x3)
    y2 = (857.0 - 58.0 * r) / 630.0
    a4 = torch.matmul(a2, x1 * a + x2 * a2)
    a8 = torch.matmul(x3 * a2 + a4, x4 * eye + x5 * a + x6 * a2 + x7 * a4)
    t8 = t1 + y2 * a2 + a8
    a3 = torch.matmul(a, a2)
    pw = [eye, a, a2, a3]
    b = [_combine(pw, row) for row in _EXP_B12]
    a6 = b[2] + torch.matmul(b[3], b[3])
    t12 = b[0] + torch.matmul(b[1] + a6, a6)
    return [t1, t2, t4, t8, t12, pw]


def _t18(a: Tensor, eye: Tensor) -> Tensor:
    """torch's degree-18 approximant of ``exp(a)`` (``B_i`` from ``I, A, A^2, A^3, A^6``; ``A_9 = B_0 B_4 +
    B_3``; ``T_18 = B_1 + (B_2 + A_9) A_9``)."""
    a2 = torch.matmul(a, a)
    a3 = torch.matmul(a, a2)
    pw = [eye, a, a2, a3, torch.matmul(a3, a3)]
    b = [_combine(pw, row) for row in _EXP_B18]
    a9 = b[3] + torch.matmul(b[0], b[4])
    return b[1] + torch.matmul(b[2] + a9, a9)


@decomposition(aten.linalg_matrix_exp.default)
def _linalg_matrix_exp(a: Tensor) -> Any:
    """``torch.linalg.matrix_exp`` as torch's kernel computes it, per matrix of the batch: the Taylor degree
    from the 1-norm (``T_1`` up to ``1.2e-7``, then ``T_2, T_4, T_8, T_12`` up to their bounds), beyond
    ``1.46`` the degree-18 approximant of ``A / 2^s`` squared ``s = max(0, ceil(log2(norm / 3.01)))`` times.
    Every candidate is computed and the matrix's own one selected (``where``); the squarings are unrolled
    ``_EXP_MAX_SQUARINGS`` times, each kept only while ``p < s``. A NaN norm gives NaN. bf16/fp16 inputs are
    computed in float32 and rounded once (:data:`_NATIVE_LOW_PRECISION`)."""
    if is_low_precision(a.dtype):
        return _linalg_matrix_exp(a.float()).to(a.dtype)
    n = a.shape[-1]
    if n == 0:
        return a.clone()
    if n == 1:
        return torch.exp(a)
    eye = torch.eye(n, dtype=a.dtype, device=a.device)
    norm = a.abs().sum(-2).amax(-1)[..., None, None]                       # [..., 1, 1]
    th = _EXP_THETAS
    s = torch.clamp(torch.ceil(torch.log2(norm / th[5])), 0.0, float(_EXP_MAX_SQUARINGS))
    m = _t18(a / torch.exp2(s), eye)
    for p in range(_EXP_MAX_SQUARINGS):
        m = torch.where(s > p, torch.matmul(m, m), m)
    t1, t2, t4, t8, t12, _ = _exp_taylor(a, eye)
    out = torch.where(norm >= th[4], m, torch.full_like(a, float("nan")))
    for t, lo, hi in ((t12, th[3], th[4]), (t8, th[2], th[3]), (t4, th[1], th[2]), (t2, th[0], th[1]),
                      (t1, -1.0, th[0])):
        out = torch.where((norm > lo) & (norm <= hi), t, out)
    return out


# --------------------------------------------------------------------------- least squares


def _lstsq_native(a: Tensor, b: Tensor) -> bool:
    """Whether a ``linalg_lstsq`` call is decomposed: float32 and within the Jacobi cap. Other calls keep what
    tn did before: ``linalg_lstsq`` has no meta kernel, so no host form; the device runs them with torch's CPU
    kernels, tracing refuses them."""
    return _is_native(a, b) and _jacobi_fits(a)


@decomposition(aten.linalg_lstsq.default)
def _linalg_lstsq(a: Tensor, b: Tensor, rcond: Optional[float] = None, *, driver: Optional[str] = None) -> Any:
    """``torch.linalg.lstsq``: ``(solution, residuals, rank, singular_values)`` as the CPU drivers return them
    (empty tensors where a driver gives none). The solution is the minimum-norm least-squares one from the
    Jacobi SVD, ``pinv(A) b`` with singular values up to ``rcond * s_max`` dropped (``gels``: none dropped), the
    one every driver computes for a full-rank ``A``; ``rank`` counts the singular values kept (``gelsy``'s
    rank-revealing QR agrees except within rounding of the threshold); residuals (tall matrices, all drivers but
    ``gelsy``) are ``||A x - b||^2`` per column. ``gelsd``/``gelss`` give residuals only when every matrix has
    full rank, an empty tensor otherwise: a shape that depends on the values, so here a rank-deficient tall
    matrix with those drivers raises ``LinAlgError`` after the run (``linalg_check``) instead."""
    driver = driver or "gelsy"
    if not _lstsq_native(a, b):
        return NotImplemented
    m, n = a.shape[-2], a.shape[-1]
    vector = b.dim() == a.dim() - 1
    rhs = b.unsqueeze(-1) if vector else b
    batch = _batch(a, rhs)
    a, rhs = _expand_batch(a, batch), _expand_batch(rhs, batch)
    k = min(m, n)
    if k == 0:
        x = a.new_zeros(batch + (n, rhs.shape[-1]))
        s = a.new_zeros(batch + (0,))
    else:
        wide = m < n
        w, v, order = _one_sided_jacobi(a.mT if wide else a, True)
        keep = _keep(order, k)
        w, v = _take(w, -1, keep), _take(v[..., :k, :], -1, keep)
        sq = (w * w).sum(-2)
        s = torch.sqrt(sq)
        cut = (torch.finfo(a.dtype).eps * max(m, n) if rcond is None or rcond < 0 else rcond)
        big = s > (0.0 if driver == "gels" else cut) * s.amax(-1, keepdim=True)
        inv = torch.where(big, 1.0 / torch.where(big, sq, 1.0), 0.0).unsqueeze(-2)
        # pinv(T) = V diag(1/s^2) W^T for T V = W (T = A, or A^T when wide: pinv(A) = W diag(1/s^2) V^T)
        pinv = torch.matmul(w * inv, v.mT) if wide else torch.matmul(v * inv, w.mT)
        x = torch.matmul(pinv, rhs)
    empty = a.new_zeros((0,))
    if m > n and driver != "gelsy":
        r = torch.matmul(a, x) - rhs
        res = (r * r).sum(-2)
        if driver != "gels":
            info = torch.where(big.to(torch.int64).sum(-1) < n, 1, 0).to(torch.int32)
            aten._linalg_check_errors.default(
                info, "linalg.lstsq (tn: the residuals of gelsd/gelss exist only at full rank)", is_matrix=a.dim() == 2)
    else:
        res = empty
    rank = (torch.zeros(batch, dtype=torch.int64, device=a.device) if k == 0
            else big.to(torch.int64).sum(-1)) if driver != "gels" else empty.to(torch.int64)
    sv = torch.sort(s, dim=-1, descending=True).values if driver in ("gelsd", "gelss") else empty
    return (x.squeeze(-1) if vector else x), res, rank, sv     # a vector b keeps its residuals' column
