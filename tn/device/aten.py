# Dedicated PrivateUse1 kernels of the neuron device: allocation, copies, metadata-only (view) ops, item().
"""Aten kernels the ``neuron`` device implements directly (everything else
goes to the boxed fallback in :mod:`tn.device.eager`).

* allocation: ``empty.memory_format``, ``empty_strided`` (the caching
  allocator; on the device named, or the current one; an index past
  ``torch.neuron.device_count()`` is a RuntimeError naming the count),
* transfers: ``_copy_from``, ``_copy_from_and_resize`` (host <-> device and
  device <-> device copies: the device memory is host memory, so a copy is a
  strided memcpy on CPU aliases; a copy between two neuron devices is also
  counted and timed as a device-to-device transfer, see
  :func:`tn.device.streams.device_to_device`),
* metadata only: ``view``, ``view.dtype``, ``as_strided``, ``_reshape_alias``,
  ``set_`` (storage variants), ``resize_``: these redispatch to torch's CPU
  kernels, which only touch sizes/strides/offset and keep the neuron storage,
  so views alias exactly as in eager PyTorch,
* ``_local_scalar_dense`` (``.item()``),
* ``_has_compatible_shallow_copy_type``: True between dense strided CPU and
  neuron tensors, as torch answers between CPU and CUDA tensors. With it
  ``module.to("neuron")`` (and back) converts parameters in place
  (``param.data = new``), as for CUDA: the Parameter objects stay, so weight
  tying (GPT-2's ``lm_head``/``wte``), optimiser references and ``.grad``
  survive, even while an autograd graph still holds the parameters.
  (torch's answer for a PrivateUse1 device is False, and ``_apply`` would then
  make new, untied Parameter objects.)
* ``convolution_overrideable`` / ``convolution_backward_overrideable``: the
  hooks torch's convolution calls for a backend that is not CPU/CUDA (their
  default kernels only raise); they run ``aten.convolution`` /
  ``aten.convolution_backward`` as eager device programs,
* ``native_layer_norm``, ``native_group_norm``: one device program (tn's fp32 decomposition) instead of torch's fallback kernel
  for other backends (``native_batch_norm`` + ``addcmul``, rounded between them in bf16),
* ``addr`` (and ``addr_``, ``addr.out``): one device program (the traced decomposition, fp32 for 16-bit inputs,
  rounded once) instead of torch's kernel for other backends (``math_addr``: an outer product, ``* alpha``,
  ``* beta`` and an add, each rounded to bf16; ``beta * M + alpha * outer`` cancels, and addr's bf16 sample with
  ``beta=0.6, alpha=0.2`` was off by 18% at an element),
* ``nonzero``, ``masked_select``, ``equal``, ``_unique2``, ``unique_dim``, ``unique_consecutive``,
  ``_index_put_impl_``, ``index.Tensor_out`` (boolean masks), ``histogram``, ``_histogramdd_*``:
  data-dependent results as padded device programs plus a count read back (:mod:`tn.device.data_dependent`),
* ``_to_copy``: torch's own kernel, except that ``non_blocking=True`` is
  dropped (the device is synchronous, and a non-blocking copy to the CPU
  would ask for pinned memory, which a Python backend cannot provide).

:func:`register` installs them; the ``Library`` objects are kept here (their
registrations vanish when they are collected).
"""
from __future__ import annotations

import torch

from ..errors import DeviceError
from . import allocator, data_dependent, tracking, windows
from .allocator import (
    DEVICE,
    alloc_storage,
    check_index,
    contiguous_strides,
    cpu_alias,
    current_index,
    new_tensor,
    resize_tensor,
)
from .eager import fallback, run_op
from .registry import install_kernels
from .streams import device_to_device

__all__ = ["register", "check_device"]

aten = torch.ops.aten
_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_LIBS: list = []


def check_device(device) -> int:
    """The index of neuron ``device`` (None or no index: the current device); a :class:`DeviceIndexError`
    (a RuntimeError naming the device count) for an index the modelled machine does not have."""
    if device is None:
        return current_index()
    if isinstance(device, int):
        return check_index(device)
    d = torch.device(device) if not isinstance(device, torch.device) else device
    if d.type != "neuron" or d.index is None:
        return current_index()
    return check_index(d.index)


def _empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    index = check_device(device)
    dtype = dtype or torch.get_default_dtype()
    size = tuple(int(s) for s in size)
    if memory_format is None or memory_format in (torch.contiguous_format, torch.preserve_format):
        stride = contiguous_strides(size)
    else:
        stride = torch.empty(size, device="meta", memory_format=memory_format).stride()
    return _made_empty(new_tensor(size, stride, dtype, index))


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    index = check_device(device)
    return _made_empty(new_tensor(tuple(int(s) for s in size), tuple(int(s) for s in stride),
                                  dtype or torch.get_default_dtype(), index))


def _made_empty(t):
    """Tell an adaptive eager window about memory ``torch.empty`` made (its values are undefined until written);
    in torch's deterministic mode the memory is filled instead (NaN / the integer maximum), as on CPU and CUDA."""
    if allocator.deterministic_fill():
        allocator.fill_uninitialized(cpu_alias(t))
        return t
    hook = allocator.ON_EMPTY[0]
    if hook is not None:
        hook(t)
    return t


def _with_math_bits(alias: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``alias`` (a CPU view of ``t``'s memory, which carries no math bits) with ``t``'s lazy conjugate and
    negative bits, so torch's CPU copy applies them."""
    if t.is_conj():
        alias = alias.conj()
    if t.is_neg():
        alias = alias._neg_view()
    return alias


def _copy_from(self, dst, non_blocking=False):
    if (dst.device.type == "neuron" and self.device == dst.device and windows.active()
            and not (self.is_conj() or self.is_neg() or dst.is_conj() or dst.is_neg())):
        r = windows.record_copy(self, dst)   # adaptive eager: queued, not run now
        if r is not NotImplemented:
            return r
    tracking.count("aten::_copy_from")
    if self.device.type == "neuron" and dst.device.type == "neuron" and self.device != dst.device:
        _device_to_device(self, dst)
    # A lazily conjugated/negated tensor (x.conj(), fft results) reaches this kernel as it is: the Conjugate and
    # Negative keys fall through for _copy_from (see register), as torch's CPU copy_ takes them, and the bits are
    # put on the CPU aliases. Without the fallthrough torch's math-bit fallback resolves the bit by a clone, whose
    # copy_ lands here again: an endless recursion that overflowed the C stack (SIGSEGV in fft.ihfft(x).cpu()).
    src = _with_math_bits(cpu_alias(self), self) if self.device.type == "neuron" else self
    d = _with_math_bits(cpu_alias(dst), dst) if dst.device.type == "neuron" else dst
    if self.device.type not in ("neuron", "cpu") or dst.device.type not in ("neuron", "cpu"):
        raise DeviceError(f"copy between {self.device} and {dst.device}: the neuron device copies only to and from "
                      f"the CPU; go through .cpu() first")
    d.copy_(src)
    return dst


def _device_to_device(src, dst) -> None:
    """Count and time a copy between two neuron devices (the bytes move below, on the host)."""
    device_to_device(src.device.index, dst.device.index, src.numel() * src.element_size())


def _copy_from_and_resize(self, dst):
    if dst.device.type == "neuron":
        _resize(dst, self.shape)
    else:
        dst.resize_(self.shape)
    return _copy_from(self, dst)


def _resize(self, size, memory_format=None):
    return resize_tensor(self, size)


def _local_scalar_dense(self):
    tracking.count("aten::_local_scalar_dense")
    return cpu_alias(self).item()


def _convolution_overrideable(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    return run_op(aten.convolution.default,
                  (input, weight, bias, stride, padding, dilation, transposed, output_padding, groups), {})


def _convolution_backward_overrideable(grad_output, input, weight, stride, padding, dilation, transposed,
                                       output_padding, groups, output_mask):
    bias_sizes = [weight.shape[1] * groups if transposed else weight.shape[0]]
    return run_op(aten.convolution_backward.default,
                  (grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding,
                   groups, output_mask), {})


def _native_layer_norm(input, normalized_shape, weight, bias, eps):
    # the kernel torch picks for a backend without one (CompositeExplicitAutograd) is a batch_norm then an addcmul
    # in the input's dtype: two programs and, in bf16, a rounding between them (a bias cancelling the normalised
    # value lost its digits). As one program it runs tn's decomposition: fp32 throughout, rounded once.
    return run_op(aten.native_layer_norm.default, (input, normalized_shape, weight, bias, eps), {})


def _native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    # as native_layer_norm: torch's fallback kernel is a batch_norm then an addcmul, rounded between them in bf16
    return run_op(aten.native_group_norm.default, (input, weight, bias, N, C, HxW, group, eps), {})


def _addr(self, vec1, vec2, *, beta=1, alpha=1):
    # as native_layer_norm: torch's kernel for a backend without one (CompositeExplicitAutograd math_addr) is four
    # ops in the input's dtype, rounded between them in bf16; as one program it runs the traced decomposition
    return run_op(aten.addr.default, (self, vec1, vec2), dict(beta=beta, alpha=alpha))


def _addr_(self, vec1, vec2, *, beta=1, alpha=1):
    return run_op(aten.addr_.default, (self, vec1, vec2), dict(beta=beta, alpha=alpha))


def _addr_out(self, vec1, vec2, *, beta=1, alpha=1, out):
    return run_op(aten.addr.out, (self, vec1, vec2), dict(beta=beta, alpha=alpha, out=out))


def _to_copy(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
             memory_format=None):
    # torch's composite kernel (reached through the CPU slot, where it is registered too), made blocking
    return aten._to_copy.default.redispatch(_CPU, self, dtype=dtype, layout=layout, device=device,
                                            pin_memory=pin_memory, non_blocking=False, memory_format=memory_format)


def _has_compatible_shallow_copy_type(self, src):
    return (self.device.type in _SHALLOW and src.device.type in _SHALLOW and self.layout == torch.strided
            and src.layout == torch.strided and not self.is_quantized and not src.is_quantized)


_SHALLOW = ("cpu", "neuron")


def _redispatch(op):
    def kernel(*args, **kwargs):
        return op.redispatch(_CPU, *args, **kwargs)

    kernel.__name__ = f"neuron_{op.__name__}"
    kernel.__doc__ = f"{op}: metadata only, torch's CPU kernel on the neuron tensor."
    return kernel


def _set_source_storage(self, source):
    return aten.set_.source_Storage_storage_offset.redispatch(_CPU, self, source, 0, (source.nbytes() //
                                                                                      self.element_size(),), (1,))


def _set_source_tensor(self, source):
    return aten.set_.source_Storage_storage_offset.redispatch(_CPU, self, source.untyped_storage(),
                                                              source.storage_offset(), source.shape, source.stride())


def _set_empty(self):
    st = alloc_storage(0, self.device.index)
    return aten.set_.source_Storage_storage_offset.redispatch(_CPU, self, st, 0, (0,), (1,))


def register() -> None:
    """Install the neuron device's aten kernels and the boxed fallback (idempotent)."""
    if _LIBS:
        return
    kernels = {"empty.memory_format": _empty_memory_format, "empty_strided": _empty_strided,
               "_copy_from": _copy_from, "_copy_from_and_resize": _copy_from_and_resize, "resize_": _resize,
               "_local_scalar_dense": _local_scalar_dense, "convolution_overrideable": _convolution_overrideable,
               "convolution_backward_overrideable": _convolution_backward_overrideable, "_to_copy": _to_copy,
               "native_layer_norm": _native_layer_norm, "native_group_norm": _native_group_norm,
               "addr": _addr, "addr_": _addr_, "addr.out": _addr_out,
               "_has_compatible_shallow_copy_type": _has_compatible_shallow_copy_type}
    for name in ("view", "view.dtype", "as_strided", "_reshape_alias", "set_.source_Storage_storage_offset",
                 "unfold", "alias"):
        packet, _, ov = name.partition(".")
        op = getattr(getattr(aten, packet), ov or "default")
        kernels[name] = _redispatch(op)
    kernels.update({"set_.source_Storage": _set_source_storage, "set_.source_Tensor": _set_source_tensor,
                    "set_": _set_empty})
    kernels.update(data_dependent.kernels())   # nonzero, masked_select, unique*, equal, masks, histograms
    install_kernels(_LIBS, kernels)
    bits = torch.library.Library("aten", "IMPL")
    for key in ("Conjugate", "Negative"):
        for name in ("_copy_from", "_copy_from_and_resize"):
            bits.impl(name, torch.library.fallthrough_kernel, key)
    _LIBS.append(bits)
    fb = torch.library.Library("_", "IMPL")
    fb.fallback(fallback, "PrivateUse1")
    _LIBS.append(fb)
    assert DEVICE.index == 0
