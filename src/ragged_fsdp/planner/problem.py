"""The layout problem in plain integers, and where one tensor may start.

Every solver (bound, heuristic, exact) works on :class:`Problem`: per tensor its size ``e``,
its block ``g`` and ``L = lcm(g, a)`` where ``a`` is the alignment in elements. Offsets and
segment boundaries are multiples of ``a``, so a boundary may cut a tensor only at a distance
from its start that is a multiple of ``L``.

:func:`earliest_start` is the one piece of constraint math the solvers share: the first
aligned offset ``>= p`` at which a tensor can sit given the segment size ``S``. Because the
set of valid offsets of a tensor does not depend on the other tensors, placing tensors in a
fixed order, each at its earliest valid offset, packs that order as tightly as possible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .granularity import TensorSpec

__all__ = ["Problem", "align_elems", "roundup", "earliest_start"]


def roundup(x: int, m: int) -> int:
    return -(-x // m) * m


def align_elems(align_bytes: int, itemsize: int) -> int:
    """Alignment in elements: ``align_bytes // itemsize`` (at least 1)."""
    if align_bytes < 1:
        raise ValueError(f"align_bytes must be >= 1 (got {align_bytes})")
    return max(1, align_bytes // itemsize)


@dataclass(frozen=True)
class Problem:
    names: tuple[str, ...]
    e: tuple[int, ...]  # elements per tensor
    g: tuple[int, ...]  # block size in elements
    L: tuple[int, ...]  # lcm(g, a): cut offsets must be multiples of this
    a: int  # alignment in elements
    world_size: int

    @classmethod
    def build(cls, specs: Sequence[TensorSpec], world_size: int, align_bytes: int = 16) -> "Problem":
        if int(world_size) < 1:
            raise ValueError(f"world_size must be >= 1 (got {world_size})")
        names = tuple(s.name for s in specs)
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"tensor names must be unique within a group; repeated: {dup}")
        sizes = {s.itemsize for s in specs}
        if len(sizes) > 1:
            raise ValueError(
                f"a group is planned per dtype, but its tensors have itemsizes {sorted(sizes)}; "
                "split the group by dtype"
            )
        a = align_elems(align_bytes, sizes.pop() if sizes else 4)
        e = tuple(s.numel for s in specs)
        g = tuple(max(1, s.block_elems) for s in specs)
        L = tuple(gi * a // math.gcd(gi, a) for gi in g)
        return cls(names, e, g, L, a, int(world_size))

    @property
    def n(self) -> int:
        return len(self.e)

    @property
    def padded_sum(self) -> int:
        """Sum of the sizes rounded up to the alignment: the least buffer that can hold them."""
        a = self.a
        return sum(-(-x // a) * a for x in self.e)


def earliest_start(p: int, e: int, L: int, S: int) -> int | None:
    """First offset ``l >= p`` (``p`` aligned) where a tensor of ``e`` elements whose cuts must
    fall at multiples of ``L`` from its start can sit when segments have ``S`` elements.

    Returns None when no offset works for this ``S`` at all (then every segment fails alike).
    """
    if e == 0:
        return p
    r = S - p % S  # room up to the next boundary B = p + r
    if e <= r:
        return p
    d = r - r % L  # the largest cut distance <= r that falls on a block edge
    if S % L == 0:  # any number of cuts is fine once the first one is
        return p + r - d
    # L does not divide S: the tensor may hold exactly one boundary, at distance d
    if d and e - d <= S:
        return p + r - d
    if e <= S:  # no cut: start at the next boundary
        return p + r
    d = S - S % L  # one cut, in the next segment, as early as possible
    if d and e - d <= S:
        return p + r + S - d
    return None
