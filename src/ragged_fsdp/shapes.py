"""Pure shape arithmetic shared by the layers (no torch, no process group)."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["contiguous_stride", "numel_of"]


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (zero-size dims count as 1, as torch does)."""
    stride, acc = [], 1
    for s in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


def numel_of(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)
