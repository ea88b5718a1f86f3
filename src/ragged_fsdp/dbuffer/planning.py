"""Ask the planner for a layout (one place, so the engine does not care who plans)."""

from __future__ import annotations

from collections.abc import Sequence

from ragged_fsdp.planner import Granularity, TensorSpec, plan_group

from .layout import BufferLayout

__all__ = ["plan_layout", "parse_granularity"]


def parse_granularity(spec):
    """A granularity spec as the planner takes it (``None`` means no constraint)."""
    if spec is None or isinstance(spec, Granularity):
        return spec
    return Granularity.parse(spec)


def plan_layout(
    tensors: Sequence[tuple[str, Sequence[int], object]],
    world_size: int,
    rank: int,
    itemsize: int,
    align_bytes: int = 16,
) -> BufferLayout:
    """Plan ``(key, shape, granularity)`` tensors over ``world_size`` ranks with the
    structure-aware planner and resolve the layout for ``rank``."""
    specs = [
        TensorSpec(key, tuple(shape), itemsize=itemsize, granularity=parse_granularity(g))
        for key, shape, g in tensors
    ]
    plan = plan_group(specs, world_size, align_bytes=align_bytes)
    return BufferLayout.from_plan(plan, [(k, s) for k, s, _ in tensors], world_size, rank)
