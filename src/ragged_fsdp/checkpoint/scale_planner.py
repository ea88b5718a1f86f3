"""``ScaleSavePlanner``: DCP's default save planner with a coordinator check that stays
O(n log n) in the chunks of a tensor.

DCP's coordinator checks that no two saved chunks of a tensor overlap with a sweep over the
tensor's *longest* dim. Row-shaped chunks (FSDP2's ``Shard(0)``, our RaggedShard boxes) span
all of a wide tensor's longest dim (``down_proj`` is 8,192 x 28,672), so every chunk is
active at once and the sweep compares every pair: at W=16,384 that is ~10^7 box checks per
wide tensor, most of the coordinator's planning time (measured by ``bench.scale``).

A chunk that is a contiguous run of the tensor's row-major flattening (ones on the leading
dims, any extent on one dim, full extent on the rest, which is every RaggedShard box and
every ``Shard(0)`` chunk) is an interval of flat element indices, and disjointness of
intervals is one sort. Tensors with any other chunk get DCP's own check, unchanged; so do the
bounds and the "chunks cover the tensor" checks, which are linear already.

It is the default planner of ``ragged_fsdp.checkpoint.save`` (so of ``TrainState`` saves),
``async_save`` and ``torch_save_to_dcp``; with plain DCP pass it yourself:
``dcp.save(state, checkpoint_id=..., planner=ScaleSavePlanner())``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import ChainMap
from collections.abc import Sequence

from torch.distributed.checkpoint import default_planner as _dp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_global_save_plan
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

__all__ = ["ScaleSavePlanner", "default_save_planner", "flat_interval", "overlapping_intervals", "planner_error"]


def flat_interval(size: Sequence[int], offsets: Sequence[int], sizes: Sequence[int],
                  strides: Sequence[int] | None = None) -> tuple[int, int] | None:
    """``[start, end)`` in the row-major flattening of a tensor of shape ``size`` if the box
    ``(offsets, sizes)`` is one contiguous run of it, else None. An empty box is the empty
    interval at its start. ``strides``: the row-major strides of ``size`` (computed once per
    tensor by callers that check many chunks)."""
    n = len(size)
    if strides is None:
        strides = [math.prod(size[d + 1:]) for d in range(n)]
    start = sum(o * st for o, st in zip(offsets, strides))
    if 0 in sizes:
        return start, start
    k = 0
    while k < n - 1 and sizes[k] == 1:
        k += 1
    for d in range(k + 1, n):
        if sizes[d] != size[d] or offsets[d] != 0:
            return None
    return start, start + sizes[k] * strides[k]


def overlapping_intervals(intervals: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """Indices of two intervals that overlap (empty ones never do), or None."""
    order = sorted((iv for iv in enumerate(intervals) if iv[1][1] > iv[1][0]), key=lambda iv: iv[1])
    for (i, (_, e0)), (j, (s1, _)) in zip(order, order[1:]):
        if s1 < e0:
            return i, j
    return None


def _check_tensor(key, value, several_ranks: bool) -> list[str]:
    """DCP's checks for one tensor's chunks, the overlap one by sorting flat intervals."""
    strides = [math.prod(value.size[d + 1:]) for d in range(len(value.size))]
    intervals = [flat_interval(value.size, c.offsets, c.sizes, strides) for c in value.chunks]
    if any(iv is None for iv in intervals):  # a box that is not a run: DCP's own sweep
        return _dp._validate_global_plan([None, None] if several_ranks else [], Metadata({key: value}))
    errors = []
    volume = 0
    for c in value.chunks:
        if not _dp._check_box_bounds(value.size, c):
            errors.append(f"key:{key} has out of bounds chunk: tensor-size:{value.size} chunk: {c}")
        volume += math.prod(c.sizes)
    pair = overlapping_intervals(intervals)
    if pair is not None:
        errors.append(f"key:{key} has overlapping chunks: {value.chunks[pair[0]]} {value.chunks[pair[1]]}")
    if several_ranks and volume != math.prod(value.size):  # DCP checks the fill only then, too
        errors.append(f"key:{key} invalid fill tensor-volume: {math.prod(value.size)} chunks-volume: {volume}")
    return errors


class ScaleSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` (same options, same plans and metadata) whose coordinator check
    sorts flat intervals instead of sweeping boxes (see the module docstring)."""

    def _create_global_plan(self, all_plans):
        deduped = self._dedup_save_plans(all_plans)
        global_plan, metadata = create_default_global_save_plan(deduped)
        if self.flatten_state_dict:
            merged = dict(ChainMap(*[p.planner_data for p in global_plan]))
            metadata = dataclasses.replace(metadata, planner_data=merged)
        errors = []
        for key, value in metadata.state_dict_metadata.items():
            if isinstance(value, BytesStorageMetadata) or len(value.size) == 0:
                continue
            errors += _check_tensor(key, value, len(global_plan) > 1)
        if errors:
            summary = "; ".join(errors)
            raise ValueError(f"Failed to validate global plan: {summary[:500]}")
        return global_plan, metadata


def default_save_planner() -> ScaleSavePlanner:
    """The planner our save functions use when the caller passes none (DCP's defaults:
    ``flatten_state_dict=True``, ``flatten_sharded_tensors=True``, no dedup to lowest rank)."""
    return ScaleSavePlanner()


def planner_error(fn: str, planner) -> str | None:
    """Why ``planner`` cannot be a save planner (a planner class instead of an instance, a
    load planner, anything else), or None."""
    from torch.distributed.checkpoint.planner import SavePlanner

    if planner is None or isinstance(planner, SavePlanner):
        return None
    if isinstance(planner, type) and issubclass(planner, SavePlanner):
        return (f"{fn}: planner={planner.__name__} is a class; pass an instance, "
                f"planner={planner.__name__}(), or leave it out for ScaleSavePlanner()")
    return (f"{fn}: planner must be a torch.distributed.checkpoint SavePlanner instance "
            f"(e.g. ScaleSavePlanner() or DefaultSavePlanner()), got {type(planner).__name__}; "
            "leave it out for the default ScaleSavePlanner()")
