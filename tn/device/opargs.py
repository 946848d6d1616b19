# The neuron device's cheap flattening of an aten call's arguments (one level of lists/tuples opened), shared by the
# op-by-op eager path (tn/device/eager.py) and the adaptive eager windows (tn/device/windows.py).
from __future__ import annotations

from typing import Tuple

__all__ = ["flatten_args", "unflatten_args"]


def flatten_args(args: tuple, kwargs: dict) -> Tuple[list, tuple]:
    """Leaves of an aten call's arguments (lists/tuples, as in ``Tensor[]`` or ``int[]``, opened one level)
    and the structure to rebuild it with :func:`unflatten_args` (cheaper than torch's pytree for these shapes)."""
    flat: list = []
    shape = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        t = type(a)
        if t is list or t is tuple or isinstance(a, (list, tuple)):
            shape.append((t, len(a)))
            flat.extend(a)
        else:
            shape.append(None)
            flat.append(a)
    return flat, (len(args), tuple(kwargs), tuple(shape))


def unflatten_args(leaves: list, spec: tuple) -> Tuple[tuple, dict]:
    """Inverse of :func:`flatten_args`: ``(args, kwargs)``."""
    nargs, keys, shape = spec
    vals = []
    i = 0
    for sh in shape:
        if sh is None:
            vals.append(leaves[i])
            i += 1
        else:
            typ, n = sh
            vals.append(typ(leaves[i:i + n]) if typ in (list, tuple) else list(leaves[i:i + n]))
            i += n
    return tuple(vals[:nargs]), dict(zip(keys, vals[nargs:]))
