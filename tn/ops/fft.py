# FFTs as DFT matmuls on the real (re, im) pairs of complex64 values, and the complex views that expose those pairs.
"""FFTs in core ops: complex64 values as interleaved float32 pairs, DFTs as matmuls.

The NeuronCore has no complex dtype, but a complex64 tensor in HBM is just
float32 ``(re, im)`` pairs: ``torch.view_as_real`` / ``torch.view_as_complex``
reinterpret the same bytes. They are the core ops ``view_as_real``
(complex64 ``[..]`` -> float32 ``[.., 2]``) and ``view_as_complex`` (back),
category ``shape``; the tracer records them as view steps (so in-place writes
through them reach the base) and the compiler reads them as free aliases of
the same memory (:func:`tn.lower.shape.real_views`).

The three aten ops torch's FFT functions reduce to (``torch.fft.fft``, ``fft2``,
``fftn``, ``ifft*``, ``rfft*``, ``irfft*``, ``hfft*``, ``ihfft*`` and ``stft``
are pads, slices and conjugates around them) are decomposed for float32 /
complex64 as one matmul per transformed dimension on the pairs:

* ``_fft_r2c(x, dim, normalization, onesided)``: the last dim of ``dim`` by a
  ``[n, 2m]`` cos/-sin matrix (``m = n//2 + 1`` when ``onesided``), giving
  pairs; every other dim of ``dim`` as a forward ``c2c``;
* ``_fft_c2c(x, dim, normalization, forward)``: per dim, the pairs ``[.., 2n]``
  (dim moved next to the pair axis) times the ``[2n, 2n]`` real form of the
  complex DFT matrix (``[[C, -sS], [sS, C]]`` interleaved, ``s = -1`` forward);
* ``_fft_c2r(x, dim, normalization, last_dim_size)``: inverse ``c2c`` on all
  dims but the last, then the Hermitian half-spectrum ``[2m, L]`` matrix
  (weights 1 for the DC and Nyquist terms, 2 for the others; their imaginary
  parts drop out as ``sin`` vanishes there, as in pocketfft).

The matrices are built at trace time in float64 from ``(j*k) mod n`` (exact
angles) and rounded to float32 program constants; ``normalization`` (0 none,
1 ``1/sqrt(n)``, 2 ``1/n``) is folded into them per dimension. A DFT by matmul
costs ``n`` multiply-adds per output instead of ``log n`` and its error grows
like ``n * eps``: this is for the sizes programs transform on chip, not for
long signals: a transform whose DFT matrix would exceed :data:`MAX_DFT_ELEMENTS`
stays the counted ``host`` op, as do other dtypes (float64, complex128).
"""
from __future__ import annotations

import math
from typing import Any, Callable, List, Sequence

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .core import _host_conv, host
from .table import decomposition, from_aten, register

aten = torch.ops.aten
Tensor = torch.Tensor

_COMPLEX_OF = {torch.float32: torch.complex64, torch.float64: torch.complex128, torch.float16: torch.complex32}
_REAL_OF = {c: r for r, c in _COMPLEX_OF.items()}


# --------------------------------------------------------------------------- the complex views


def _view_as_real_rule(x: Any) -> List[Any]:
    """complex ``[..]`` -> real ``[.., 2]``."""
    return [(tuple(x.shape) + (2,), _REAL_OF[x.dtype])]


def _view_as_complex_rule(x: Any) -> List[Any]:
    """real ``[.., 2]`` -> complex ``[..]``."""
    return [(tuple(x.shape[:-1]), _COMPLEX_OF[x.dtype])]


@register("view_as_real", "shape", aten_ops=(aten.view_as_real.default,), shape_rule=_view_as_real_rule)
def view_as_real(x: Tensor) -> Tensor:
    """The (re, im) pairs of a complex tensor: float ``[.., 2]`` over the same memory (a conjugate bit is
    resolved first, as the bytes then hold the conjugate)."""
    return torch.view_as_real(x.resolve_conj())


@register("view_as_complex", "shape", aten_ops=(aten.view_as_complex.default,), shape_rule=_view_as_complex_rule)
def view_as_complex(x: Tensor) -> Tensor:
    """Float ``[.., 2]`` pairs read as complex ``[..]`` (the same memory when it is laid out as pairs)."""
    if x.dim() == 0 or x.stride(-1) != 1 or x.storage_offset() % 2 or any(s % 2 for s in x.stride()[:-1]):
        x = x.clone(memory_format=torch.contiguous_format)
    return torch.view_as_complex(x)


def view_dtype(op_name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of a complex view's result (``view_as_real``/``view_as_complex`` of ``dtype``)."""
    return _REAL_OF[dtype] if op_name == "view_as_real" else _COMPLEX_OF[dtype]


# --------------------------------------------------------------------------- the aten FFT ops


def _native(x: Any) -> bool:
    return isinstance(x, Tensor) and x.dtype in (torch.float32, torch.complex64)


#: The largest DFT matrix (float32 elements, 32 MiB) a transformed dim may need: a complex dim of up to 1448 points,
#: a real one (rfft/irfft) of up to 2895. Longer transforms stay the ``host`` op (a DFT by matmul costs ``n``
#: multiply-adds per output and its constant grows as ``n**2``; an FFT kernel would be the way past this).
MAX_DFT_ELEMENTS = 1 << 23


def dft_elements(ov: Any, x: Any, dim: Sequence[int], arg: Any) -> int:
    """Elements of the largest DFT matrix the decomposition of ``ov(x, dim, normalization, arg)`` builds."""
    dims = [int(d) % max(1, x.dim()) for d in dim]
    if not dims:
        return 0
    sizes = [4 * x.shape[d] ** 2 for d in dims[:-1]]
    n = x.shape[dims[-1]]
    if ov is aten._fft_r2c.default:
        sizes.append(n * 2 * (n // 2 + 1 if arg else n))
    elif ov is aten._fft_c2r.default:
        sizes.append(2 * n * int(arg))
    else:
        sizes.append(4 * n * n)
    return max(sizes)


def _gated_conv(ov: Any) -> Callable[..., Any]:
    """``ov``'s converter: ``None`` (decompose here) for float32/complex64 inputs whose DFT matrices stay within
    :data:`MAX_DFT_ELEMENTS`, else the ``host`` op."""
    host_form = _host_conv(ov)
    names = [a.name for a in ov._schema.arguments]    # self, dim, normalization, onesided/forward/last_dim_size

    def conv(*args: Any, **kwargs: Any) -> Any:
        vals = {**dict(zip(names, args)), **kwargs}
        x = vals.get("self")
        if _native(x) and dft_elements(ov, x, vals["dim"], vals[names[3]]) <= MAX_DFT_ELEMENTS:
            return None
        return host_form(*args, **kwargs)

    conv.__doc__ = f"{ov}: DFT matmuls for float32/complex64 (up to a size), the host op otherwise."
    return conv


#: The FFT overloads: decomposed here for float32/complex64, the ``host`` op otherwise.
FFT_OVERLOADS = (aten._fft_r2c.default, aten._fft_c2c.default, aten._fft_c2r.default)

for _ov in FFT_OVERLOADS:
    from_aten(host, _ov)(_gated_conv(_ov))


def _scale(n: int, normalization: int) -> float:
    return 1.0 if normalization == 0 else 1.0 / math.sqrt(n) if normalization == 1 else 1.0 / n


def _angles(n_in: int, n_out: int, period: int) -> Tensor:
    """``2*pi*(j*k mod period)/period`` for ``j < n_in``, ``k < n_out`` (float64, exact reduction)."""
    j = torch.arange(n_in, dtype=torch.int64)[:, None]
    k = torch.arange(n_out, dtype=torch.int64)[None, :]
    return (j * k % period).to(torch.float64) * (2 * math.pi / period)


def _w_r2c(n: int, m: int, scale: float) -> Tensor:
    """``[n, 2m]``: real ``x[.., n] @ W`` gives the forward DFT's first ``m`` terms as (re, im) pairs."""
    with _disable_current_modes():
        a = _angles(n, m, n)
        w = torch.stack([torch.cos(a), -torch.sin(a)], -1).reshape(n, 2 * m) * scale
        return w.to(torch.float32)


def _w_c2c(n: int, forward: bool, scale: float) -> Tensor:
    """``[2n, 2n]``: pairs ``[.., 2n] @ W`` give the DFT (``exp(-i..)`` forward, ``exp(+i..)`` backward)."""
    with _disable_current_modes():
        a = _angles(n, n, n)
        c, s = torch.cos(a), torch.sin(a) * (1.0 if forward else -1.0)
        re_row = torch.stack([c, -s], -1)           # input re_j -> (re_k, im_k)
        im_row = torch.stack([s, c], -1)            # input im_j -> (re_k, im_k)
        w = torch.stack([re_row, im_row], 1).reshape(2 * n, 2 * n) * scale
        return w.to(torch.float32)


def _w_c2r(m: int, size: int, scale: float) -> Tensor:
    """``[2m, size]``: a Hermitian half spectrum's pairs ``[.., 2m] @ W`` give the real inverse DFT of length
    ``size`` (terms past ``size//2`` are the conjugates of the ones given; extra input terms are ignored)."""
    with _disable_current_modes():
        half = size // 2 + 1
        a = _angles(m, size, size)
        k = torch.arange(m)
        wk = torch.where((k == 0) | (2 * k == size), 1.0, 2.0).to(torch.float64)
        wk = torch.where(k < half, wk, torch.zeros_like(wk))[:, None]
        w = torch.stack([wk * torch.cos(a), -wk * torch.sin(a)], 1).reshape(2 * m, size) * scale
        return w.to(torch.float32)


def _along(p: Tensor, d: int, w: Tensor, pairs_in: bool, pairs_out: bool) -> Tensor:
    """Multiply dim ``d`` of ``p`` by ``w`` (with the trailing pair axis when ``pairs_in``/``pairs_out``)."""
    nd = p.dim() - (1 if pairs_in else 0)
    x = torch.movedim(p, d, nd - 1)
    if pairs_in:
        x = x.reshape(tuple(x.shape[:-2]) + (2 * x.shape[-2],))
    y = torch.matmul(x, w)
    if pairs_out:
        y = y.reshape(tuple(y.shape[:-1]) + (w.shape[1] // 2, 2))
    return torch.movedim(y, nd - 1, d)


def _dims(x: Tensor, dim: Sequence[int]) -> List[int]:
    n = x.dim()
    return [int(d) % n for d in dim]


def _c2c_dims(p: Tensor, dims: Sequence[int], normalization: int, forward: bool) -> Tensor:
    for d in dims:
        n = p.shape[d]
        p = _along(p, d, _w_c2c(n, forward, _scale(n, normalization)), True, True)
    return p


@decomposition(aten._fft_r2c.default)
def _fft_r2c(x: Tensor, dim: Sequence[int], normalization: int, onesided: bool) -> Tensor:
    """Real-to-complex DFT over ``dim`` (one-sided on its last dim when ``onesided``)."""
    if not _native(x) or not dim:
        return NotImplemented
    dims = _dims(x, dim)
    last = dims[-1]
    n = x.shape[last]
    m = n // 2 + 1 if onesided else n
    p = _along(x, last, _w_r2c(n, m, _scale(n, normalization)), False, True)
    p = _c2c_dims(p, dims[:-1], normalization, True)
    return torch.view_as_complex(p.contiguous())


@decomposition(aten._fft_c2c.default)
def _fft_c2c(x: Tensor, dim: Sequence[int], normalization: int, forward: bool) -> Tensor:
    """Complex-to-complex DFT over ``dim`` (``exp(-i..)`` when ``forward``)."""
    if not _native(x) or not dim:
        return NotImplemented
    p = _c2c_dims(torch.view_as_real(x), _dims(x, dim), normalization, forward)
    return torch.view_as_complex(p.contiguous())


@decomposition(aten._fft_c2r.default)
def _fft_c2r(x: Tensor, dim: Sequence[int], normalization: int, last_dim_size: int) -> Tensor:
    """Complex-to-real inverse DFT over ``dim``: Hermitian on the last dim, of length ``last_dim_size``."""
    if not _native(x) or not dim:
        return NotImplemented
    dims = _dims(x, dim)
    p = _c2c_dims(torch.view_as_real(x), dims[:-1], normalization, False)
    last = dims[-1]
    size = int(last_dim_size)
    w = _w_c2r(p.shape[last], size, _scale(size, normalization))
    return _along(p, last, w, True, False).contiguous()
