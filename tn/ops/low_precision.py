# 16-bit floats (bfloat16, float16): the one "is this low precision" test the op files share, and the ops whose gradient every door computes in float32 and rounds once.
"""bfloat16 / float16 in tn's ops.

:func:`is_low_precision` and :func:`acc_dtype` are the tests the
decompositions use to accumulate 16-bit inputs in float32 (as the
NeuronCore's PSUM does) and round once.

Gradients: autograd differentiates an op with its C++ formula, which runs op
by op in the op's dtype. For some ops that formula chains several roundings
whose errors a later step cancels against another term, so a 16-bit gradient
ends up many ulps off. ``F.normalize(x, p=0.5, dim=0)`` over a dimension of
size 1 is ``sign(x)`` and its exact gradient is 0, but the division's
gradient of the divisor (``-g * ((x / n) / n)``, three roundings) and the
norm's (``g |x|^(p-1) n^(1-p)``, a factor 1 computed as 1 - 2^-8) leave one
element 0.125 (one ulp of terms ~20) where an fp32 computation on the same
bf16 inputs gives 1e-6. For the ops in :data:`FP32_GRADIENTS` tn evaluates a
16-bit call that needs a gradient as ``op(x.float(), ...).to(x.dtype)``
*above* autograd: the forward value is the same correctly rounded result, and
autograd's formula then runs in float32 with each gradient rounded once
(``ToCopyBackward``).

The rules are one table; each door installs them where its ops meet autograd
(:func:`install` at an autograd dispatch key, falling back to torch's own
kernel whenever a rule does not apply):

* the ``neuron`` device: at ``AutogradPrivateUse1``, for good
  (:mod:`tn.device.low_precision_autograd`); ``tn.jit`` and
  ``torch.compile(backend="neuron")`` on device tensors meet the same kernels;
* ``tn.jit`` and ``torch.compile(backend="neuron")`` on CPU tensors: at
  ``AutogradCPU``, only while tn traces, only in the tracing thread
  (:func:`fp32_gradients_while_tracing`), so eager CPU PyTorch is untouched.

float32 and every other dtype never take a rule: their programs do not change.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from ..errors import UnsupportedOpError

__all__ = ["LOW_PRECISION", "is_low_precision", "acc_dtype", "FP32_GRADIENTS", "install", "uninstall",
           "fp32_gradients_while_tracing"]

aten = torch.ops.aten
Tensor = torch.Tensor

#: The 16-bit float dtypes: computed in float32 and rounded once.
LOW_PRECISION = (torch.bfloat16, torch.float16)


def is_low_precision(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is bfloat16 or float16."""
    return dtype in LOW_PRECISION


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype ``dtype`` values are accumulated in: float32 for bfloat16/float16, ``dtype`` itself otherwise."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


# --------------------------------------------------------------------------- the rules

def _vector_norm(x: Any, ord: Any = 2, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
    """``linalg_vector_norm`` of a 16-bit ``x`` that needs a gradient, in float32, rounded once."""
    if (not isinstance(x, Tensor) or x.dtype not in LOW_PRECISION or not x.requires_grad
            or dtype not in (None, x.dtype)):
        return NotImplemented
    return aten.linalg_vector_norm.default(x.float(), ord, dim, keepdim).to(x.dtype)


def _div(a: Any, b: Any) -> Any:
    """``a / b`` of 16-bit tensors of one dtype where the divisor ``b`` needs a gradient, in float32, rounded
    once: its gradient ``-g * ((a / b) / b)`` is three roundings in bf16 (the dividend's, ``g / b``, is one)."""
    if (not isinstance(b, Tensor) or not b.requires_grad or b.dtype not in LOW_PRECISION
            or not isinstance(a, Tensor) or a.dtype != b.dtype):
        return NotImplemented
    return aten.div.Tensor(a.float(), b.float()).to(b.dtype)


#: aten overload -> rule: the op's result computed in float32 and rounded once (so autograd records the
#: float32 op and its gradient is rounded once), or ``NotImplemented`` where the rule does not apply (then
#: torch's own autograd kernel runs). Called only with grad mode on.
FP32_GRADIENTS: Dict[Any, Callable[..., Any]] = {
    aten.linalg_vector_norm.default: _vector_norm,
    aten.div.Tensor: _div,
}


# --------------------------------------------------------------------------- installing them

def _kernel(op: Any, rule: Callable[..., Any], active: Optional[Callable[[], bool]]) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and (active is None or active()):
            out = rule(*args, **kwargs)
            if out is not NotImplemented:
                return out
        # torch's autograd kernel (registered at the Autograd alias key). Called through _op_dk, which turns a
        # Python number back into a wrapped-number tensor (``x / 2.0`` reaches a Python kernel as a float, and
        # a plain 0-d tensor would promote a 0-d bf16 ``x`` to float32)
        return op._op_dk(_AUTOGRAD, *args, **kwargs)

    kernel.__name__ = f"fp32_gradient_{rule.__name__.lstrip('_')}"
    return kernel


_AUTOGRAD = torch._C.DispatchKey.Autograd


def install(key: str, active: Optional[Callable[[], bool]] = None) -> torch.library.Library:
    """Register every rule of :data:`FP32_GRADIENTS` as its op's kernel at the autograd dispatch key ``key``
    (e.g. ``"AutogradPrivateUse1"``, where the op has no kernel of its own: torch's autograd formula is
    registered for every backend at the ``Autograd`` alias key, and runs whenever a rule returns
    ``NotImplemented``, grad mode is off, or ``active()`` (optional) is false). Returns the
    ``torch.library.Library`` holding the kernels (:func:`uninstall` takes them out again)."""
    lib = torch.library.Library("aten", "IMPL")
    for op, rule in FP32_GRADIENTS.items():
        name = op.name()
        if (torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
                or not torch._C._dispatch_has_kernel_for_dispatch_key(name, "Autograd")):
            raise UnsupportedOpError(f"tn.ops.low_precision: {name} has its own kernel at {key} or none at Autograd; "
                               f"the float32 gradient rule would shadow or lose it")
        lib.impl(name.split("::")[1], _kernel(op, rule, active), key)
    _forget_dispatch()
    return lib


def uninstall(lib: torch.library.Library) -> None:
    """Take out the kernels :func:`install` registered in ``lib``: torch's own autograd kernels run again."""
    lib._destroy()
    _forget_dispatch()


def _forget_dispatch() -> None:
    """Drop the Python dispatcher's cached choice of kernel for the ruled ops (AOTAutograd traces with the Python
    dispatcher on, which remembers per overload and key which kernel it resolved, e.g. ``Autograd`` for
    ``AutogradCPU``, and would keep calling that one past a new registration or a removal)."""
    for op in FP32_GRADIENTS:
        op._dispatch_cache.clear()


class _Tracing(threading.local):
    depth = 0


_tracing = _Tracing()
_lock = threading.Lock()
_users = 0
_cpu_lib: List[torch.library.Library] = []


def _tracing_here() -> bool:
    return _tracing.depth > 0


@contextlib.contextmanager
def fp32_gradients_while_tracing() -> Iterator[None]:
    """While tn traces a function (``tn.jit``) or AOTAutograd traces a graph for ``torch.compile(backend=
    "neuron")``: the :data:`FP32_GRADIENTS` rules for CPU tensors too (the ``neuron`` device has them always).
    They are registered at ``AutogradCPU`` by the first thread that enters and taken out by the last that
    leaves, and apply only in threads inside this context: eager CPU work elsewhere keeps torch's kernels.
    Nests."""
    global _users
    with _lock:
        if _users == 0:
            _cpu_lib.append(install("AutogradCPU", active=_tracing_here))
        _users += 1
    _tracing.depth += 1
    try:
        yield
    finally:
        _tracing.depth -= 1
        with _lock:
            _users -= 1
            if _users == 0:
                uninstall(_cpu_lib.pop())
