# tn.device.name: PrivateUse1 renamed to "neuron" when this module loads, before any module of the device names it.
"""The device's name: torch's PrivateUse1 backend renamed to ``neuron``.

Importing this module renames the backend (idempotent) and generates
``Tensor.neuron()`` / ``is_neuron``; every module that builds
``torch.device("neuron")`` when it loads imports it first (the allocator
does), so the rename precedes them by the import graph rather than by the
order of statements in :func:`tn.device.register`.
"""
from __future__ import annotations

import torch

from ..errors import DeviceError

__all__ = ["DEVICE_TYPE", "rename"]

#: The device type tn registers PrivateUse1 as.
DEVICE_TYPE = "neuron"


def rename() -> None:
    """Rename PrivateUse1 to ``neuron`` and generate its tensor methods (idempotent).

    Raises :class:`tn.errors.DeviceError` when another package already renamed PrivateUse1."""
    name = torch._C._get_privateuse1_backend_name()
    if name not in ("privateuseone", DEVICE_TYPE):
        raise DeviceError(f"tn: PrivateUse1 is already registered as {name!r} by another package; tn needs it "
                          f"as {DEVICE_TYPE!r}")
    if name != DEVICE_TYPE:
        # the first steps of torch.utils.backend_registration._setup_privateuseone_for_python_backend; the device
        # module (tn.device.backend) is registered by tn.device.register once it is imported
        torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
        torch.utils.generate_methods_for_privateuse1_backend()


rename()
