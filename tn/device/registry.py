# How the neuron device's kernels enter torch's dispatcher: one helper every kernel group of tn/device uses.
from __future__ import annotations

import torch

__all__ = ["install_kernels"]


def install_kernels(libs: list, kernels: dict, key: str = "PrivateUse1") -> None:
    """Implement each aten op named in ``kernels`` (overload name -> kernel) for dispatch key ``key``, in a new
    ``torch.library.Library`` that ``libs`` keeps alive."""
    lib = torch.library.Library("aten", "IMPL")
    for name, kernel in kernels.items():
        lib.impl(name, kernel, key)
    libs.append(lib)
