"""Ask the planner for a layout (one place, so the engine does not care who plans)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from ragged_fsdp.placement import RaggedShard

from .layout import BufferLayout

__all__ = ["plan_layout", "parse_granularity"]

try:  # the structure-aware planner (ragged_fsdp.planner)
    if os.environ.get("RAGGED_FSDP_PLANNER", "1") == "0":
        raise ImportError
    from ragged_fsdp.planner import Granularity, TensorSpec, plan_group
except ImportError:  # pragma: no cover - only while the planner is being written
    Granularity = TensorSpec = plan_group = None


def parse_granularity(spec):
    """A granularity spec as the planner takes it (``None`` means no constraint)."""
    if spec is None or Granularity is None:
        return spec
    if isinstance(spec, Granularity):
        return spec
    return Granularity.parse(spec)


def plan_layout(
    tensors: Sequence[tuple[str, Sequence[int], object]],
    world_size: int,
    rank: int,
    itemsize: int,
    align_bytes: int = 16,
) -> BufferLayout:
    """Plan ``(key, shape, granularity)`` tensors over ``world_size`` ranks and resolve the
    layout for ``rank``."""
    if plan_group is not None:
        specs = [
            TensorSpec(key, tuple(shape), itemsize=itemsize, granularity=parse_granularity(g))
            for key, shape, g in tensors
        ]
        plan = plan_group(specs, world_size, align_bytes=align_bytes)
    else:
        if any(g is not None for _, _, g in tensors):
            raise NotImplementedError("granularity needs ragged_fsdp.planner")
        plan = _ElementPlan.pack([(k, s) for k, s, _ in tensors], world_size, max(1, align_bytes // itemsize))
    return BufferLayout.from_plan(plan, [(k, s) for k, s, _ in tensors], world_size, rank)


@dataclass
class _ElementPlan:
    """Stand-in while the planner lands: element granularity, aligned offsets."""

    segment: int
    offsets: dict[str, int]
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    world_size: int = 1

    @classmethod
    def pack(cls, tensors, world_size: int, align: int) -> "_ElementPlan":
        offsets, shapes, off = {}, {}, 0
        for key, shape in tensors:
            off = -(-off // align) * align
            offsets[key] = off
            shapes[key] = tuple(shape)
            off += math.prod(shape)
        seg = -(-off // world_size)
        seg = -(-seg // align) * align
        return cls(seg, offsets, shapes, world_size)

    def placement(self, key: str) -> RaggedShard:
        shape = self.shapes[key]
        n = math.prod(shape)
        off = self.offsets[key]
        units = []
        for r in range(self.world_size):
            lo = max(off, r * self.segment)
            hi = min(off + n, (r + 1) * self.segment)
            units.append(max(0, hi - lo))
        if len(shape) == 0:
            return RaggedShard((), [1 if u else 0 for u in units])
        return RaggedShard(tuple(range(len(shape))), units, 1)
