# Autocast for the neuron device: torch.autocast("neuron", dtype=torch.bfloat16) with CUDA's cast policy per op.
"""``torch.autocast("neuron", dtype=torch.bfloat16)`` (or ``float16``).

torch has the ``AutocastPrivateUse1`` dispatch key and the autocast state
for the device (``torch.set_autocast_enabled("neuron", ...)``,
``torch.get_autocast_dtype("neuron")``), but registers no kernels for it:
an out-of-tree backend brings its own op list (``torch.autocast`` also asks
the device module for ``get_amp_supported_dtype``, see
:mod:`tn.device.backend`). :func:`register` installs, for that key,

* a fallthrough for every op not listed (it runs in the dtypes it is given),
* CUDA's cast policy for the listed ops, as torch 2.13's
  ``aten/src/ATen/autocast_mode.cpp`` registers it for ``AutocastCUDA``
  (the same op set, checked by a test against the dispatcher):

  - ``lower``: matmul-like ops and convolutions (``mm``, ``bmm``,
    ``addmm``, ``linear``, ``matmul``, ``conv*``, ``scaled_dot_product_attention``,
    RNN cells ...) run in the autocast dtype;
  - ``fp32``: ops that need range or precision (``exp``, ``log``, ``pow``,
    ``layer_norm``, ``group_norm``, ``rms_norm``, the losses, ``cdist`` ...)
    run in float32;
  - ``fp32_set_opt_dtype``: reductions with an optional ``dtype`` argument
    (``sum``, ``prod``, ``cumsum``, ``softmax``, ``log_softmax``, vector and
    matrix norms) get ``dtype=torch.float32`` unless the caller gave one;
  - ``fp32_append_dtype``: ``norm.Scalar`` / ``norm.ScalarOpt_dim`` run as
    their ``dtype=`` overload with float32;
  - ``promote``: ops mixing inputs (``addcmul``, ``addcdiv``, ``atan2``,
    ``dot``, ``index_put``, ``scatter_add`` ...) run in the widest dtype;
  - ``binary_cross_entropy`` is refused, as on CUDA.

Only floating-point, non-float64 neuron tensors are cast (0-dim CPU tensors
and integer tensors pass through), the casts are ordinary autograd ops (the
kernels sit in front of autograd, as torch's do), and inside a policy kernel
autocast is off, so an op's own sub-ops are not cast again. Difference from
CUDA: no cache of the casts of float32 weights within one autocast region
(a weight used twice is cast twice; the results are the same).
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from ..errors import UnsupportedOpError

__all__ = ["register", "POLICY", "policy_of"]

#: the ops of each cast policy (aten overload names), as CUDA's autocast registers them in torch 2.13
POLICY: Dict[str, Tuple[str, ...]] = {
    "lower": (
        "_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
        "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
        "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
        "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
        "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    ),
    "fp32": (
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
        "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
        "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
        "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
        "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
        "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
        "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
        "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
        "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    ),
    "fp32_set_opt_dtype": (
        "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
        "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
    ),
    "fp32_append_dtype": ("norm.Scalar", "norm.ScalarOpt_dim"),
    "promote": (
        "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put", "tensordot",
        "scatter_add",
    ),
    "banned": ("binary_cross_entropy",),
}

#: fp32_append_dtype: the overload each op runs as, with dtype=float32 appended
_APPEND_TARGET = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}

_KEY = "AutocastPrivateUse1"
_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)
_F32 = torch.float32
_LIBS: list = []


def policy_of(name: str) -> str | None:
    """The cast policy of aten overload ``name`` (``"mm"``, ``"softmax.int"``) under neuron autocast, or None."""
    for pol, names in POLICY.items():
        if name in names:
            return pol
    return None


def _overload(name: str):
    packet, _, ov = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), ov or "default")


def _eligible(t: Any) -> bool:
    return (isinstance(t, torch.Tensor) and t.device.type == "neuron" and t.is_floating_point()
            and t.dtype is not torch.float64)


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if _eligible(x) and x.dtype is not dtype else x
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(y, dtype) for y in x)
    return x


def _widest(x: Any, current: torch.dtype) -> torch.dtype:
    if isinstance(x, torch.Tensor):
        if _eligible(x) and x.dtype is not current:
            return _F32  # float32 wins over the lower dtype; two different lower dtypes also meet in float32
        return current
    if isinstance(x, (list, tuple)):
        for y in x:
            current = _widest(y, current)
    return current


def _lower(op):
    def kernel(keyset, *args, **kwargs):
        dt = torch.get_autocast_dtype("neuron")
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return op(*_cast(args, dt), **{k: _cast(v, dt) for k, v in kwargs.items()})

    return kernel


def _fp32(op):
    def kernel(keyset, *args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return op(*_cast(args, _F32), **{k: _cast(v, _F32) for k, v in kwargs.items()})

    return kernel


def _set_opt_dtype(op):
    pos = next(i for i, a in enumerate(op._schema.arguments) if a.name == "dtype")

    def kernel(keyset, *args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            if args and _eligible(args[0]):
                if pos < len(args):
                    if args[pos] is None:
                        args = args[:pos] + (_F32,) + args[pos + 1:]
                elif kwargs.get("dtype") is None:
                    kwargs = dict(kwargs, dtype=_F32)
            return op(*args, **kwargs)

    return kernel


def _append_dtype(op, target):
    def kernel(keyset, *args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            self = args[0]
            out = _F32 if _eligible(self) else self.dtype
            return target(*args, **kwargs, dtype=out)

    return kernel


def _promote(op):
    def kernel(keyset, *args, **kwargs):
        dt = torch.get_autocast_dtype("neuron")
        to = _widest(list(args) + list(kwargs.values()), dt)
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return op(*_cast(args, to), **{k: _cast(v, to) for k, v in kwargs.items()})

    return kernel


def _banned(op):
    def kernel(keyset, *args, **kwargs):
        raise UnsupportedOpError(
            "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast (neuron, as on "
            "CUDA). Many models use a sigmoid layer right before the binary cross entropy layer; combine the two "
            "with torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss, which are "
            "safe to autocast.")

    return kernel


def register() -> None:
    """Install the fallthrough and the policy kernels for ``AutocastPrivateUse1`` (idempotent)."""
    if _LIBS:
        return
    fb = torch.library.Library("_", "IMPL")
    fb.fallback(torch.library.fallthrough_kernel, _KEY)
    _LIBS.append(fb)
    lib = torch.library.Library("aten", "IMPL")
    makers = {"lower": _lower, "fp32": _fp32, "fp32_set_opt_dtype": _set_opt_dtype, "promote": _promote,
              "banned": _banned}
    for pol, names in POLICY.items():
        for name in names:
            op = _overload(name)
            if pol == "fp32_append_dtype":
                kernel = _append_dtype(op, _overload(_APPEND_TARGET[name]))
            else:
                kernel = makers[pol](op)
            kernel.__name__ = f"neuron_autocast_{pol}_{name.replace('.', '_')}"
            lib.impl(name, kernel, _KEY, with_keyset=True)
    _LIBS.append(lib)
