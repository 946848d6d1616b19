# Shape arithmetic every layer needs (element counts, row-major strides), written once.
"""Element counts and row-major strides of shapes, as torch defines them.

>>> numel((2, 3, 4)), contiguous_strides((2, 3, 4))
(24, (12, 4, 1))
>>> contiguous_strides((2, 0, 3))      # a size-0 axis steps like a size-1 one, as torch's strides do
(3, 3, 1)
"""
from __future__ import annotations

from typing import Iterable, Tuple

__all__ = ["numel", "contiguous_strides"]


def numel(shape: Iterable[int]) -> int:
    """The number of elements of a tensor of ``shape`` (1 for ``()``)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n


def contiguous_strides(shape: Iterable[int]) -> Tuple[int, ...]:
    """Row-major (C-contiguous) strides of ``shape`` in elements, as ``torch.empty(shape).stride()``."""
    strides, acc = [], 1
    for d in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(strides))
