"""Where every tensor of a DBuffer lives: the planner's layout, resolved for one rank.

The planner places tensors in a flat buffer of ``W * S`` elements so that rank ``r`` owns the
segment ``[r*S, (r+1)*S)``. A :class:`BufferLayout` turns such a plan into the numbers the
DBuffer needs: for each tensor its offset in the full buffer (the unsharded views) and the
run of this rank's segment it occupies (the sharded views), plus the ``RaggedUnits`` that
describes that run. It is pure: no process group, no tensor data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ragged_fsdp.ragged_units import RaggedUnits
from ragged_fsdp.run_counts import RunCounts

__all__ = ["Plan", "TensorSlot", "BufferLayout"]


class Plan(Protocol):
    """What a layout needs from a planner result (``ragged_fsdp.planner.plan_group``)."""

    segment: int
    offsets: dict[str, int]

    def placement(self, name: str) -> RaggedUnits: ...


@dataclass(frozen=True)
class TensorSlot:
    """One tensor of the buffer.

    ``offset`` is the element offset in the full ``W*S`` buffer; ``local_offset`` and
    ``local_numel`` give the run of this rank's segment the tensor occupies (``local_numel``
    may be 0); ``local_shape`` is the shape of that run as the placement shows it.
    """

    key: str
    shape: tuple[int, ...]
    offset: int
    placement: RaggedUnits
    local_offset: int
    local_numel: int
    local_shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BufferLayout:
    world_size: int
    rank: int
    segment: int  # S: elements per rank
    slots: tuple[TensorSlot, ...]

    @property
    def total(self) -> int:
        return self.world_size * self.segment

    @property
    def used(self) -> int:
        return sum(s.numel for s in self.slots)

    def index(self, key: str) -> int:
        for i, s in enumerate(self.slots):
            if s.key == key:
                return i
        raise KeyError(key)

    @classmethod
    def from_plan(
        cls,
        plan: Plan,
        tensors: Sequence[tuple[str, Sequence[int]]],
        world_size: int,
        rank: int,
    ) -> "BufferLayout":
        """Resolve ``plan`` for ``rank``; ``tensors`` gives ``(key, shape)`` in slot order.

        Checks what the rest of the engine relies on: tensors are disjoint and inside the
        buffer, and each placement hands every rank exactly the elements of its segment.
        """
        S = int(plan.segment)
        if S < 0:
            raise ValueError(f"plan segment {S} must be >= 0")
        total = world_size * S
        slots = []
        spans = []
        for key, shape in tensors:
            shape = tuple(int(d) for d in shape)
            n = math.prod(shape)
            off = int(plan.offsets[key])
            if off < 0 or off + n > total:
                raise ValueError(
                    f"plan puts {key!r} ({n} elements) at offset {off}, outside the buffer of "
                    f"{world_size} x {S} elements"
                )
            placement = plan.placement(key)
            placement.check(shape, world_size)
            # Every rank's range is checked, but only the ranks whose segment the tensor
            # overlaps can hold any of it: the others must hold no unit, which one sum over
            # the counts outside that span says (a Python loop over all W ranks per tensor was
            # most of fully_shard's set-up at W=4,096 for DeepSeek-V3's 782-tensor layers).
            m, inner, unit = placement.axis_len(shape), placement.inner(shape), placement.unit
            counts = placement.local_units
            first, last = (off // S, min(world_size, -(-(off + n) // S))) if S and n else (0, world_size)
            outside = placement._start(world_size) - (placement._start(last) - placement._start(first))
            if outside and n:
                r = next(r for r, c in enumerate(counts) if c and not first <= r < last)
                raise ValueError(
                    f"plan for {key!r}: {placement} gives rank {r} {counts[r]} units but the "
                    f"tensor [{off}, {off + n}) does not reach that rank's segment"
                )
            # An empty tensor gives every rank the empty range, which is what its segments
            # hold: nothing to check. Otherwise only a few ranks need checking: see _ranks_to_check.
            for r in (_ranks_to_check(counts, first, last) if n else ()):
                want = _overlap(off, n, r * S, S)
                a0 = placement._start(r) * unit
                a, b = min(a0, m) * inner, min(a0 + counts[r] * unit, m) * inner
                if (b - a) != want[1] - want[0] or (b > a and a != want[0]):
                    raise ValueError(
                        f"plan for {key!r}: {placement} gives rank {r} elements [{a}, {b}) but "
                        f"the buffer segment covers [{want[0]}, {want[1]})"
                    )
            lo, hi = _overlap(off, n, rank * S, S)
            slots.append(
                TensorSlot(
                    key=key,
                    shape=shape,
                    offset=off,
                    placement=placement,
                    local_offset=(off + lo - rank * S) if hi > lo else 0,
                    local_numel=hi - lo,
                    local_shape=tuple(placement.local_shape(shape, rank)),
                )
            )
            spans.append((off, off + n, key))
        spans.sort()
        for (a0, a1, ka), (b0, b1, kb) in zip(spans, spans[1:]):
            if b0 < a1:
                raise ValueError(f"plan overlaps {ka!r} [{a0}, {a1}) and {kb!r} [{b0}, {b1})")
        return cls(world_size=world_size, rank=rank, segment=S, slots=tuple(slots))


def _ranks_to_check(counts, first: int, last: int):
    """The ranks of ``[first, last)`` (the segments a tensor reaches) whose range check
    implies the others'. Every rank's for a tuple of counts; for ``RunCounts``, the two end
    ranks (partial segments) and, inside, each run's first and last rank: on the inner ranks
    the segment ranges are ``[r S - off, (r+1) S - off)``, and across a run of equal counts
    ``c`` the placement's ranges are ``[s + (r - r0) c u, ...)`` as long as they are not
    clipped at the tensor's end. A rank of a run that passes the check is not clipped (a
    clipped inner rank would end at the tensor's end, which only the last segment reaches),
    so passing at both ends of a run makes both ranges linear in ``r`` with equal values at
    two points: equal on the whole run. O(runs) per tensor instead of O(ranks spanned): the
    loop over the spanned ranks added up to about W per group (W^0.7 growth of set-up)."""
    if not isinstance(counts, RunCounts) or last - first <= 4:
        return range(first, last)
    inner_lo, inner_hi = first + 1, last - 1
    out = {first, last - 1}
    start = 0
    for _, repeat in counts.runs():
        a, b = max(start, inner_lo), min(start + repeat, inner_hi)
        if a < b:
            out.update((a, b - 1))
        start += repeat
    return sorted(out)


def _overlap(offset: int, numel: int, seg_start: int, seg_len: int) -> tuple[int, int]:
    """The part of the tensor ``[offset, offset+numel)`` inside a segment, in tensor coordinates."""
    lo = max(offset, seg_start)
    hi = min(offset + numel, seg_start + seg_len)
    if hi <= lo:
        return (0, 0)
    return (lo - offset, hi - offset)
