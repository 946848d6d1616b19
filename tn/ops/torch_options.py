# Functions tn installs into torch that torch calls from inside user programs: Dynamo must trace them.
"""Policies tn puts into torch's own Python, kept out of Dynamo's skip list.

torch calls these from code ``torch.compile`` traces (``F.linear_cross_entropy`` resolving its options), so
they must be plain Python Dynamo can trace: tn's runtime packages are on Dynamo's skip list
(:func:`tn.dynamo_backend.skip_tn_runtime_in_dynamo`), and a call into a skipped file is a graph break. This
module is the one part of ``tn.ops`` left off that list; it calls nothing of tn's at run time (it reads
:data:`tn.ops.low_precision.LOW_PRECISION`, a constant).
"""
from __future__ import annotations

from typing import Any

import torch

# a constant, read (not called) while Dynamo traces the resolver: the skip list is about calls into files
from .low_precision import LOW_PRECISION

__all__ = ["install_neuron_auto_acc_policy"]


def install_neuron_auto_acc_policy() -> None:
    """``F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())`` on the ``neuron`` device resolves
    ``acc_policy='auto'`` as on the CPU: policy ``'accurate'`` with float32 accumulation for bf16/fp16 inputs.

    torch resolves ``'auto'`` per device type from a table that knows only ``cpu`` and ``cuda``
    (``linear_cross_entropy_options._AUTO_DEFAULTS``) and gives fp32 accumulation only to devices it knows to
    have a mixed-precision matmul (``_resolve_auto_acc_dtype``); any other device falls back to ``'compact'``
    in the input dtype, whose chunked input gradient (``W[t] w - P W``, a cancelling update) loses ~2x CPU
    eager's bf16 error. The NeuronCore multiplies bf16 into fp32 PSUM, the case torch's rule is written for, so
    the device gets CPU's entry (and ``tn.jit``/the device door compute the same thing). An explicit
    ``acc_policy``/``acc_dtype`` is untouched."""
    try:
        from torch.nn.modules import linear_cross_entropy_options as opts  # lazy: absent from torch before the chunked op
        table, cls = opts._AUTO_DEFAULTS, opts.LinearCrossEntropyOptions
        resolve = cls._resolve_auto_acc_dtype
    except (ImportError, AttributeError):     # a torch without the chunked op (or another layout): nothing to do
        return
    if getattr(resolve, "tn_neuron", False):
        return
    for dt in LOW_PRECISION:
        if ("cpu", dt) in table:
            table.setdefault(("neuron", dt), table[("cpu", dt)])

    def resolve_neuron(dtype: Any, device: Any) -> Any:
        """torch's ``_resolve_auto_acc_dtype``, with fp32 for bf16/fp16 on the ``neuron`` device."""
        if device is not None and device.type == "neuron" and dtype in LOW_PRECISION:
            return torch.float32
        return resolve(dtype, device)

    resolve_neuron.tn_neuron = True    # type: ignore[attr-defined]
    cls._resolve_auto_acc_dtype = staticmethod(resolve_neuron)
