# The host op's lowering (linear algebra, float64 FFTs): always CannotLower, so the compiler runs it on the host, saying why.
"""``host`` and ``linalg_check`` ops on the NeuronCore: none.

The ``host`` core op carries aten linear-algebra calls (:data:`tn.ops.HOST_OVERLOADS`)
and the FFTs and factorizations tn decomposes only for float32 (float64 and
complex128 calls: :mod:`tn.ops.fft`, :mod:`tn.ops.linalg`). tn has no NeuronCore
kernel for them (the chip has no float64 arithmetic; iterative eigen-solvers
have no efficient form on the tile engines), so this lowering
refuses every call with that reason: the compiler runs the equation through
torch on the host between programs, counted in ``exe.stats["host_ops"]``, and
``strict=True`` / ``TN_STRICT=1`` turns it into a :class:`tn.UnsupportedOpError`
naming the aten op.
"""
from __future__ import annotations

from .base import CannotLower, lowering


@lowering("host", "linalg_check")
def _host(ctx, eqn, ins, outs):
    """Refuse: the op runs through torch on the host."""
    if eqn.op.name == "linalg_check":
        raise CannotLower(f"the error check of {eqn.attrs['api_name']} reads the LAPACK status on the host")
    raise CannotLower(f"{eqn.attrs['fn']} has no NeuronCore kernel (linear algebra, and FFTs of other dtypes "
                      f"than float32/complex64, run on the host by design)")
