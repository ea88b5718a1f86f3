"""``ScaleSavePlanner``: DCP's default save planner with a coordinator check that stays
O(n log n) in the chunks of a tensor.

DCP's coordinator checks that no two saved chunks of a tensor overlap with a sweep over the
tensor's *longest* dim. Row-shaped chunks (FSDP2's ``Shard(0)``, our RaggedShard boxes) span
all of a wide tensor's longest dim (``down_proj`` is 8,192 x 28,672), so every chunk is
active at once and the sweep compares every pair: at W=16,384 that is ~10^7 box checks per
wide tensor, most of the coordinator's planning time (measured by ``benchmarks/scale.py``).

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

__all__ = ["ScaleSavePlanner", "ScaleLoadPlanner", "default_save_planner", "default_load_planner", "flat_interval",
           "load_planner_error", "local_load_plan", "overlapping_intervals", "planner_error",
           "read_items_for_chunk_list", "saved_run_index"]


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

    return _planner_error(fn, planner, SavePlanner, "ScaleSavePlanner", "DefaultSavePlanner")


def _planner_error(fn: str, planner, base: type, ours: str, dcps: str) -> str | None:
    if planner is None or isinstance(planner, base):
        return None
    if isinstance(planner, type) and issubclass(planner, base):
        return (f"{fn}: planner={planner.__name__} is a class; pass an instance, "
                f"planner={planner.__name__}(), or leave it out for {ours}()")
    return (f"{fn}: planner must be a torch.distributed.checkpoint {base.__name__} instance "
            f"(e.g. {ours}() or {dcps}()), got {type(planner).__name__}; "
            f"leave it out for the default {ours}()")


# -- load ----------------------------------------------------------------------------------
# DCP's ``create_read_items_for_chunk_list`` sweeps the tensor's longest dim with an active
# list of saved chunks. A row chunk of a wide tensor spans all of that dim, so every saved
# chunk of the tensor stays active and every local chunk is compared with all of them:
# O(local x saved) per tensor, and a tensor of a group sharded over W ranks has O(W) saved
# chunks. When every saved chunk of a tensor is a contiguous run of its row-major flattening
# (every RaggedShard box, every Shard(0) chunk) and the runs are disjoint, the saved chunks
# sorted by flat start form an index: the only saved chunks a local box can overlap are the
# runs that meet the flat range from its first to its last element, found by two bisections
# (every element two boxes share has its flat index in both ranges).
# Each candidate still goes through DCP's own overlap test and read-item construction, and
# the items come out in DCP's order (local chunks by start along DCP's sweep dim, then saved
# chunks by end along it, then by index), so the plan is the one DCP makes. Any other tensor
# (TP/HSDP boxes cut along other dims, overlapping saved chunks, 0-d) goes to DCP's function.

_MIN_VECTOR = 48  # saved chunks from which the index is built with tensor ops


def _row_major_strides(size) -> list[int]:
    strides, acc = [0] * len(size), 1
    for d in range(len(size) - 1, -1, -1):
        strides[d] = acc
        acc *= size[d]
    return strides


def _run_index_small(size, chunks, strides):
    nd = len(size)
    maxend = [0] * nd
    runs = []
    for i, c in enumerate(chunks):
        if len(c.offsets) != nd or len(c.sizes) != nd:
            return None
        for d in range(nd):
            e = c.offsets[d] + c.sizes[d]
            if e > maxend[d]:
                maxend[d] = e
        iv = flat_interval(size, c.offsets, c.sizes, strides)
        if iv is None or iv[1] == iv[0]:
            return None
        runs.append((iv[0], iv[1], i))
    runs.sort()
    return [r[0] for r in runs], [r[1] for r in runs], [r[2] for r in runs], maxend, 1


def _run_index_vector(size, chunks, strides):
    import torch
    from array import array
    from itertools import chain

    nd, n = len(size), len(chunks)
    offs = array("q", chain.from_iterable(c.offsets for c in chunks))
    szs = array("q", chain.from_iterable(c.sizes for c in chunks))
    if len(offs) != n * nd or len(szs) != n * nd:
        return None
    o = torch.frombuffer(offs, dtype=torch.int64).view(n, nd)
    z = torch.frombuffer(szs, dtype=torch.int64).view(n, nd)
    if bool((z <= 0).any()):
        return None
    maxend = (o + z).amax(0).tolist()
    # a box is a run iff, for some k, its sizes are 1 on the dims before k and it spans the
    # whole tensor on the dims after k
    ones = (z == 1).to(torch.int8)
    full = ((z == torch.tensor(list(size), dtype=torch.int64)) & (o == 0)).to(torch.int8)
    pre = torch.ones((n, nd), dtype=torch.int8)
    suf = torch.ones((n, nd), dtype=torch.int8)
    if nd > 1:
        pre[:, 1:] = ones[:, :-1].cumprod(1)
        suf[:, :-1] = full[:, 1:].flip(1).cumprod(1).flip(1)
    if not bool((pre & suf).any(1).all()):
        return None
    start = (o * torch.tensor(strides, dtype=torch.int64)).sum(1)
    end = start + z.prod(1)
    order = torch.sort(start, stable=True).indices
    return start[order].tolist(), end[order].tolist(), order.tolist(), maxend, 1


def _row_index(size, chunks):
    """The index for saved chunks that are all whole rows (cut along dim 0 only, the full
    extent of every other dim: row-granular RaggedShard, ``Shard(0)``), or None. Row runs
    sort by their first row; one pass of C-level maps over the chunks, no arithmetic in
    Python per chunk."""
    from itertools import islice
    from operator import add, attrgetter, itemgetter, le

    nd = len(size)
    offs = list(map(attrgetter("offsets"), chunks))
    szs = list(map(attrgetter("sizes"), chunks))
    if nd > 1:
        tail = itemgetter(*range(1, nd))
        want_o, want_s = tail((0,) * nd), tail(tuple(size))
        if set(map(tail, offs)) != {want_o} or set(map(tail, szs)) != {want_s}:
            return None
        if 0 in size[1:]:
            return None
    if set(map(len, offs)) != {nd} or set(map(len, szs)) != {nd}:
        return None
    starts = list(map(itemgetter(0), offs))
    rows = list(map(itemgetter(0), szs))
    if min(rows) <= 0:
        return None
    ends = list(map(add, starts, rows))
    indices = range(len(chunks))
    if not all(map(le, ends, islice(starts, 1, None))):
        indices = sorted(indices, key=starts.__getitem__)
        starts = [starts[i] for i in indices]
        ends = [ends[i] for i in indices]
        if not all(map(le, ends, islice(starts, 1, None))):
            return None
    return starts, ends, list(indices), [max(ends), *size[1:]], math.prod(size[1:])


def saved_run_index(md):
    """``(starts, ends, indices, max_end_per_dim, unit)``: the saved chunks of the tensor
    metadata ``md`` as flat runs sorted by start (``indices`` into ``md.chunks``; starts and
    ends in units of ``unit`` elements: a row when every chunk is whole rows), and the
    largest ``offset + size`` of any saved chunk along each dim; or None when some saved
    chunk is not a run, is empty (DCP's overlap test does not treat an empty box as
    overlapping nothing) or two runs overlap: then DCP's matching is used."""
    size, chunks = tuple(md.size), md.chunks
    if not size or not chunks:
        return None
    index = _row_index(size, chunks)
    if index is not None:
        return index
    strides = _row_major_strides(size)
    build = _run_index_vector if len(chunks) >= _MIN_VECTOR else _run_index_small
    index = build(size, chunks, strides)
    if index is None:
        return None
    starts, ends = index[0], index[1]
    for k in range(1, len(starts)):
        if starts[k] < ends[k - 1]:
            return None
    return index


def read_items_for_chunk_list(fqn, md, local_chunks, stats: dict | None = None):
    """The read items DCP's ``create_read_items_for_chunk_list(fqn, md, local_chunks)``
    returns, in its order, matching each local chunk only against the saved runs its flat
    range meets (see above). ``stats``: adds ``pairs`` (saved/local chunk pairs compared),
    ``fast`` and ``fallback`` (tensors matched each way)."""
    from bisect import bisect_left, bisect_right

    from torch.distributed.checkpoint.planner_helpers import (
        _create_read_item_for_tensor,
        create_read_items_for_chunk_list,
    )
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.resharding import (
        _check_shard_metadata_pair_overlap,
        _shards_get_overlap_region_wrt_saved_tensor,
    )

    saved = md.chunks
    if not local_chunks or not saved:
        return []
    nd = len(md.size)
    index = None
    # empty local boxes go to DCP too: its test can pair an empty box with a saved chunk
    if nd and all(len(c.offsets) == nd and len(c.sizes) == nd and 0 not in c.sizes for c in local_chunks):
        index = saved_run_index(md)
    if index is None:
        if stats is not None:
            stats["fallback"] = stats.get("fallback", 0) + 1
            stats["pairs"] = stats.get("pairs", 0) + len(local_chunks) * len(saved)  # at most
        return create_read_items_for_chunk_list(fqn, md, local_chunks)
    starts, ends, indices, maxend, unit = index
    # DCP's sweep dim: the first dim with the largest offset + size over all chunks
    sweep, best = 0, 0
    for d in range(nd):
        m = max(maxend[d], max(c.offsets[d] + c.sizes[d] for c in local_chunks))
        if m > best:
            sweep, best = d, m
    strides = _row_major_strides(md.size)
    order = sorted(range(len(local_chunks)), key=lambda i: local_chunks[i].offsets[sweep])
    items, pairs = [], 0
    for li in order:
        lc = local_chunks[li]
        lo = sum(o * s for o, s in zip(lc.offsets, strides)) // unit
        hi = sum((o + z - 1) * s for o, z, s in zip(lc.offsets, lc.sizes, strides)) // unit + 1
        found = []
        for k in range(bisect_right(ends, lo), bisect_left(starts, hi)):
            si = indices[k]
            sc = saved[si]
            pairs += 1
            if _check_shard_metadata_pair_overlap(lc, sc):
                found.append((sc.offsets[sweep] + sc.sizes[sweep], si))
        found.sort()
        for _, si in found:
            sc = saved[si]
            region = _shards_get_overlap_region_wrt_saved_tensor(saved_shard=sc, current_shard=lc)
            items.append(_create_read_item_for_tensor(
                dest_index=MetadataIndex(fqn, lc.offsets, li),
                dest_offsets=[r[2] for r in region],
                storage_index=MetadataIndex(fqn, sc.offsets, si),
                storage_offsets=[r[1] for r in region],
                lengths=[r[3] for r in region],
            ))
    if stats is not None:
        stats["fast"] = stats.get("fast", 0) + 1
        stats["pairs"] = stats.get("pairs", 0) + pairs
    return items


def local_load_plan(state_dict, metadata, strict: bool = True, stats: dict | None = None):
    """DCP's ``create_default_local_load_plan`` (same checks, errors and plan) with each
    tensor matched by :func:`read_items_for_chunk_list`."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_list, _create_read_items
    from torch.distributed.tensor import DTensor

    requests = []
    for fqn, obj in state_dict.items():
        if fqn not in metadata.state_dict_metadata:
            if strict:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            continue
        md = metadata.state_dict_metadata[fqn]
        if isinstance(md, TensorStorageMetadata) and getattr(obj, "size", None) is not None \
                and md.size != obj.size():
            raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
        if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
            continue  # this rank is not in the DTensor's mesh
        if not isinstance(md, TensorStorageMetadata):
            requests += _create_read_items(fqn, md, obj)
            continue
        try:
            local_chunks = _create_chunk_list(obj)
        except ValueError:
            requests += _create_read_items(fqn, md, obj)  # DCP's own error for it
            continue
        requests += read_items_for_chunk_list(fqn, md, local_chunks, stats)
    return LoadPlan(requests)


class ScaleLoadPlanner(_dp.DefaultLoadPlanner):
    """``DefaultLoadPlanner`` (same options, same plans) whose local plan matches each local
    chunk against a sorted index of the tensor's saved runs instead of all of its saved
    chunks (see the comment above :func:`saved_run_index`). ``stats`` counts the work of the
    last plan: ``pairs`` compared, tensors matched ``fast`` or by DCP's ``fallback``."""

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 allow_partial_load: bool = False) -> None:
        super().__init__(flatten_state_dict=flatten_state_dict, flatten_sharded_tensors=flatten_sharded_tensors,
                         allow_partial_load=allow_partial_load)
        self.stats: dict = {}

    def create_local_plan(self):
        if self.metadata is None:
            raise AssertionError("ScaleLoadPlanner: set_up_planner was not given the metadata")
        if self.flatten_state_dict:
            # As DCP's: keys the checkpoint has but the flattened state lacks may come from a
            # checkpoint written before torch 2.4, which flattened keys another way; if the
            # old flattening names them, plan with it.
            from torch.distributed.checkpoint import _version
            from torch.distributed.checkpoint._nested_dict import flatten_state_dict

            missing = set(self.metadata.state_dict_metadata) - set(self.state_dict)
            if missing:
                _version._derived_version = "2_3"
                old_sd, old_mappings = flatten_state_dict(self.original_state_dict)
                if set(old_sd) & missing:
                    self.state_dict, self.mappings = old_sd, old_mappings
                _version._derived_version = None
        self.stats = {}
        return local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load, self.stats)


def default_load_planner(allow_partial_load: bool = False) -> ScaleLoadPlanner:
    """The planner our load functions use when the caller passes none."""
    return ScaleLoadPlanner(allow_partial_load=allow_partial_load)


def load_planner_error(fn: str, planner) -> str | None:
    """Why ``planner`` cannot be a load planner, or None."""
    from torch.distributed.checkpoint.planner import LoadPlanner

    return _planner_error(fn, planner, LoadPlanner, "ScaleLoadPlanner", "DefaultLoadPlanner")
