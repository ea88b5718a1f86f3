"""``ScaleLoadPlanner`` plans what DCP's ``DefaultLoadPlanner`` plans: the same read items in
the same order, with fewer chunk comparisons.

Pure part (no process group): synthetic metadata with many saved chunks (flat runs cut
anywhere, whole rows, shuffled chunk order, N-D grid boxes that must take DCP's path, empty
chunks, out-of-order local chunks) against ``create_read_items_for_chunk_list``, and the
comparison counter (ours compares only the pairs that overlap for run-shaped chunks; DCP
compares every saved chunk of a row-cut wide tensor with every local chunk).

Distributed part (gloo, one launch at W = 4): real ``fully_shard``-ed models (tied
embeddings, odd RaggedShard tensors with a rank holding zero units, an HSDP 2 x 2 model)
saved at W = 4, then planned on W = 3 and W = 2 sub-groups with both planners: equal local
plans on every rank, and the values loaded by ``checkpoint.load`` (ScaleLoadPlanner by
default) bitwise equal to the ones ``dcp.load`` with ``DefaultLoadPlanner`` loads.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ragged_fsdp.checkpoint.scale_planner import read_items_for_chunk_list, saved_run_index


def _run_boxes(shape, a, b, prefix=()):
    """The boxes (offsets, sizes) of the flat range [a, b) of ``shape``: partial row, full
    rows, partial row, recursively."""
    if a >= b:
        return []
    if len(shape) == 1:
        return [(prefix + (a,), (1,) * len(prefix) + (b - a,))]
    inner = math.prod(shape[1:])
    pad = (1,) * len(prefix)
    r0, r1 = a // inner, b // inner
    if r0 == r1:
        return _run_boxes(shape[1:], a - r0 * inner, b - r0 * inner, prefix + (r0,))
    out = []
    if a % inner:
        out += _run_boxes(shape[1:], a % inner, inner, prefix + (r0,))
        r0 += 1
    if r1 > r0:
        out.append((prefix + (r0,) + (0,) * (len(shape) - 1), pad + (r1 - r0,) + tuple(shape[1:])))
    if b % inner:
        out += _run_boxes(shape[1:], 0, b % inner, prefix + (r1,))
    return out


def _chunk(off, size):
    return ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size))


def _cut(n, parts, rng, unit=1):
    """``parts`` flat ranges tiling [0, n) (cut at multiples of ``unit``; some may be empty)."""
    cuts = sorted(rng.randrange(0, n // unit + 1) * unit for _ in range(parts - 1))
    bounds = [0] + cuts + [n]
    return list(zip(bounds, bounds[1:]))


def _runs(shape, parts, rng, unit=1):
    return [_chunk(o, s) for a, b in _cut(math.prod(shape), parts, rng, unit) for o, s in _run_boxes(shape, a, b)]


def _grid(shape, cuts0, cuts1):
    """Boxes of a grid cut at ``cuts0`` along dim 0 and ``cuts1`` along dim 1 (TP x FSDP)."""
    b0, b1 = [0, *cuts0, shape[0]], [0, *cuts1, shape[1]]
    return [_chunk((r0, c0) + (0,) * (len(shape) - 2), (r1 - r0, c1 - c0) + tuple(shape[2:]))
            for r0, r1 in zip(b0, b0[1:]) for c0, c1 in zip(b1, b1[1:])]


def _md(shape, chunks):
    return TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size(shape),
                                 chunks=list(chunks))


def _same(shape, saved, local, fast: bool | None = None):
    md = _md(shape, saved)
    stats = {}
    ours = read_items_for_chunk_list("t", md, local, stats)
    theirs = create_read_items_for_chunk_list("t", md, local)
    assert ours == theirs, (shape, len(saved), len(local))
    if fast is not None:
        assert bool(stats.get("fast")) == fast, stats
    return ours, stats


def test_run_boxes_tile_the_tensor():
    rng = random.Random(0)
    for shape in [(7,), (5, 6), (3, 4, 5), (2, 3, 4, 5)]:
        for _ in range(20):
            seen = torch.zeros(shape, dtype=torch.int64)
            for c in _runs(shape, rng.randrange(1, 9), rng):
                seen[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))] += 1
            assert bool((seen == 1).all())


@pytest.mark.parametrize("shape", [(37,), (16, 8), (12, 3, 5), (4, 3, 2, 5), (256, 64)])
def test_flat_runs_match_dcp(shape):
    """Runs cut anywhere (partial rows), saved at one world size and loaded at another,
    saved chunks in shuffled order, local chunks in reverse order."""
    rng = random.Random(hash(shape) & 0xFFFF)
    for trial in range(25):
        saved = _runs(shape, rng.randrange(1, 80), rng)
        saved = [c for c in saved if math.prod(c.sizes)]
        if trial % 2:
            rng.shuffle(saved)
        local = _runs(shape, rng.randrange(1, 9), rng)
        local = [c for c in local if math.prod(c.sizes)]
        k = rng.randrange(len(local)) if local else 0
        local = list(reversed(local[k:k + rng.randrange(1, 6)]))
        _same(shape, saved, local, fast=bool(local))


def test_many_row_chunks_of_a_wide_tensor():
    """The case that made DCP's matching O(local x saved): rows of a wide tensor cut over
    2,000 ranks, loaded by one rank of 1,000 (the vectorised index), and by rank-sized
    pieces of 40 chunks (the small index)."""
    rng = random.Random(5)
    for shape, parts, shuffle in [((6000, 700), 2000, False), ((300, 700), 40, False), ((3000, 7, 5), 900, True)]:
        unit = math.prod(shape[1:])
        saved = [c for c in _runs(shape, parts, rng, unit=unit) if math.prod(c.sizes)]
        if shuffle:  # chunk order in .metadata is not relied on
            rng.shuffle(saved)
        rows = shape[0]
        for r in (0, 1, rows // 2, rows - 3):
            local = [_chunk((r,) + (0,) * (len(shape) - 1), (min(3, rows - r),) + shape[1:])]
            items, stats = _same(shape, saved, local, fast=True)
            assert items and stats["pairs"] == len(items)  # only the overlapping pairs are compared
            assert stats["pairs"] < len(saved) / 10  # DCP compares all len(saved) here
        # the partial-row boxes of an element-granular layout, several per local run
        local = [c for c in _runs(shape, 7, rng) if math.prod(c.sizes)][2:5]
        items, stats = _same(shape, saved, local, fast=True)
        assert stats["pairs"] == len(items)


def test_nd_boxes_take_dcp_path():
    """Saved chunks cut along dim 1 as well (TP x FSDP grids, HSDP with TP), or 2-D column
    blocks: not runs, so DCP's own matching, and the same items."""
    rng = random.Random(7)
    shape = (40, 24, 3)
    for _ in range(15):
        saved = _grid(shape, sorted(rng.sample(range(1, 40), 6)), sorted(rng.sample(range(1, 24), 3)))
        for local in ([_chunk((5, 0, 0), (20, 24, 3))], _runs(shape, 5, rng)[1:3],
                      _grid(shape, [13], [11])[1:3]):
            local = [c for c in local if math.prod(c.sizes)]
            _same(shape, saved, local, fast=False if local else None)
    # runs saved, a grid loaded (a TP layout reading an FSDP checkpoint): saved runs are an index
    saved = _runs(shape, 90, rng)
    saved = [c for c in saved if math.prod(c.sizes)]
    _same(shape, saved, _grid(shape, [9, 30], [5])[:4], fast=True)


def test_empty_and_overlapping_chunks_take_dcp_path():
    """DCP's overlap test can pair an empty box with a chunk that straddles it, and saved
    chunks that overlap each other break the sorted index: both go to DCP's matching."""
    shape = (10, 10)
    saved = [_chunk((0, 0), (5, 10)), _chunk((5, 0), (5, 10))]
    _same(shape, saved, [_chunk((3, 0), (0, 10))], fast=False)  # empty local box inside chunk 0
    _same(shape, saved + [_chunk((2, 0), (0, 10))], [_chunk((0, 0), (10, 10))], fast=False)
    overlapping = [_chunk((0, 0), (6, 10)), _chunk((4, 0), (6, 10))]
    assert saved_run_index(_md(shape, overlapping)) is None
    _same(shape, overlapping, [_chunk((3, 0), (4, 10))], fast=False)
    # the same chunks through the vectorised index (many chunks)
    many = [_chunk((i, 0), (1, 10)) for i in range(10)] * 6
    assert saved_run_index(_md(shape, many)) is None
    _same(shape, many, [_chunk((3, 0), (4, 10))], fast=False)
    # 0-d and 1-element tensors
    _same((), [_chunk((), ())], [_chunk((), ())])
    _same((1,), [_chunk((0,), (1,))], [_chunk((0,), (1,))], fast=True)
