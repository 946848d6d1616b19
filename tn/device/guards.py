# Guards for torch entry points that would crash on the neuron device (no C++ allocator): storages and torch.load.
"""Make torch's storage constructors and module conversion right for the ``neuron`` device.

torch has no C++ allocator for PrivateUse1 devices registered from Python,
so ``torch.UntypedStorage(n, device="neuron")`` (which ``torch.load(...,
map_location="neuron")`` and ``storage.to("neuron")`` use) would crash the
process. :func:`install` wraps ``torch.UntypedStorage.__new__`` so that a
neuron storage comes from tn's allocator instead.

``module.to("neuron")`` (and back): torch converts parameters in place
(``param.data = new``) only between "compatible" tensor types (CPU/CUDA);
for a PrivateUse1 device it would make *new* Parameter objects per module,
silently untying shared weights (GPT-2's ``lm_head``/``wte``). While a
module conversion involves the neuron device, :func:`install`'s wrapper of
``nn.Module._apply`` turns on torch's ``swap_module_params_on_conversion``,
which keeps every Parameter object (and so weight tying and optimiser
references), as ``.data =`` does for CUDA.
"""
from __future__ import annotations

import torch

from ..errors import TnError

__all__ = ["install"]

_INSTALLED = []


def _is_neuron(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return False
    try:
        return torch.device(device).type == "neuron"
    except (RuntimeError, TypeError):
        return False


def install() -> None:
    """Wrap ``torch.UntypedStorage.__new__`` (idempotent)."""
    if _INSTALLED:
        return
    cls = torch.UntypedStorage
    orig_new = cls.__new__

    def __new__(klass, *args, device=None, **kwargs):
        if _is_neuron(device):
            from .allocator import alloc_storage
            from .aten import check_device

            check_device(device)
            if kwargs or len(args) > 1 or (args and not isinstance(args[0], int)):
                raise TnError("torch.UntypedStorage(..., device='neuron') takes only a size in bytes; build the "
                              "storage on the CPU and move it with .to('neuron')")
            st = alloc_storage(int(args[0]) if args else 0)
            if klass is not cls:
                raise TnError(f"{klass.__name__}(device='neuron') is not supported; use torch.UntypedStorage")
            return st
        if device is not None:
            kwargs["device"] = device
        return orig_new(klass, *args, **kwargs)

    cls.__new__ = __new__
    _INSTALLED.append(orig_new)
    _wrap_module_apply()


def _involves_neuron(module, fn) -> bool:
    for t in module.parameters():
        if t.device.type == "neuron":
            return True
        break
    for t in module.buffers():
        if t.device.type == "neuron":
            return True
        break
    try:
        probe = fn(torch.empty(0))
    except Exception:
        return False
    return isinstance(probe, torch.Tensor) and probe.device.type == "neuron"


def _wrap_module_apply() -> None:
    mod = torch.nn.Module
    orig = mod._apply
    future = torch.__future__
    depth = [0]

    def _apply(self, fn, recurse=True):
        if depth[0] or future.get_swap_module_params_on_conversion() or not _involves_neuron(self, fn):
            return orig(self, fn, recurse)
        depth[0] += 1
        future.set_swap_module_params_on_conversion(True)
        try:
            return orig(self, fn, recurse)
        finally:
            future.set_swap_module_params_on_conversion(False)
            depth[0] -= 1

    _apply.__doc__ = orig.__doc__
    _apply.__wrapped__ = orig
    mod._apply = _apply
