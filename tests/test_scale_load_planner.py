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


def test_planner_argument_is_checked():
    from ragged_fsdp.checkpoint import load, load_latest
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    with pytest.raises(ValueError, match=r"load: planner=DefaultLoadPlanner is a class; pass an instance"):
        load({}, "/nonexistent", planner=DefaultLoadPlanner)
    with pytest.raises(ValueError, match=r"planner must be a torch.distributed.checkpoint LoadPlanner.*DefaultSavePlanner"):
        load({}, "/nonexistent", planner=DefaultSavePlanner())
    with pytest.raises(ValueError, match=r"load_latest: planner must be .* got str"):
        load_latest("/nonexistent", {}, planner="fast")


# -- distributed: real models, saved at W = 4, planned and loaded at W = 4, 3 and 2 ----------
import os  # noqa: E402

import torch.distributed as dist  # noqa: E402

from _dist import run_cases  # noqa: E402

ENV = "RAGGED_SCALE_LOAD_TEST_DIR"


def _cuts(n, world):
    """Counts summing to ``n`` with rank 1 (a middle rank when world > 2) holding nothing."""
    base = [n // world + (r < n % world) for r in range(world)]
    if world > 2:
        base[0] += base[1]
        base[1] = 0
    return tuple(base)


def _llama(mesh, seed):
    from ragged_fsdp import fully_shard
    from ragged_fsdp.models.llama import Llama, LlamaConfig

    torch.manual_seed(seed)
    m = Llama(LlamaConfig.tiny(tie_embeddings=True))
    gran = (lambda n, p: "row") if seed == 3 else (lambda n, p: None)  # loaded into another granularity
    for block in m.layers:
        fully_shard(block, mesh=mesh, granularity_fn=gran)
    fully_shard(m, mesh=mesh, granularity_fn=gran)
    return m


def _state(world, saving: bool):
    """What is saved at W = 4 (``saving``) or loaded into at ``world``: a tied LLaMA with AdamW
    state (through TrainState), odd RaggedShard tensors (rank 1 holds none), a torch
    ``Shard(1)`` tensor (column boxes: DCP's matching), a plain value; an HSDP 2 x 2 model and
    tensor at W = 4, the same keys on a 1-D mesh at other W."""
    from ragged_fsdp import RaggedShard, distribute_tensor
    from ragged_fsdp.checkpoint import TrainState
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    seed = 3 if saving else 5
    mesh = init_device_mesh("cpu", (world,))
    m = _llama(mesh, seed)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    if saving:  # optimizer state with values worth checking
        m.loss(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))).backward()
        opt.step()
    g = torch.Generator().manual_seed(11 if saving else 12)
    one_row = tuple(int(r == world - 1) for r in range(world))
    odd = {
        "t3": (torch.randn(5, 4, 3, generator=g), RaggedShard((0, 1, 2), _cuts(60, world))),
        "rows_u4": (torch.randn(29, 7, generator=g), RaggedShard((0,), _cuts(8, world), 4)),
        "flat_u64": (torch.randn(300, generator=g), RaggedShard((0,), _cuts(5, world), 64)),
        "scalar": (torch.randn((), generator=g), RaggedShard((), tuple(int(r == 0) for r in range(world)))),
        "empty": (torch.zeros(0, 4), RaggedShard((0,), (0,) * world)),
        "int8": (torch.randint(-100, 100, (40, 3), generator=g, dtype=torch.int8), RaggedShard((0, 1), _cuts(120, world))),
        "one_row": (torch.randn(1, 9, generator=g), RaggedShard((0,), one_row)),
    }
    state = {"train": TrainState(m, opt), "odd": {k: distribute_tensor(t, mesh, [p]) for k, (t, p) in odd.items()},
             "cols": torch_distribute(torch.randn(6, 10, generator=g), mesh, [Shard(1)]),
             "step": 7 if saving else 0}
    t = torch.arange(29 * 7, dtype=torch.float32).reshape(29, 7) * (1 if saving else -1)
    if world == 4:
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        state["hsdp"] = TrainState(_llama(hsdp, seed))
        state["hsdp_tensor"] = distribute_tensor(t, hsdp, [Replicate(), RaggedShard((0, 1), (150, 53))])
    else:
        state["hsdp"] = TrainState(_llama(mesh, seed))
        state["hsdp_tensor"] = distribute_tensor(t, mesh, [RaggedShard((0, 1), _cuts(29 * 7, world))])
    return state


def _flat_full(state):
    """The state as DCP flattens it, every DTensor gathered (plain values kept)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict
    from torch.distributed.tensor import DTensor

    flat, _ = flatten_state_dict(_stateful_to_state_dict(state))
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in flat.items()}


def _compare_plans(state, path):
    """Both planners' local load plans for ``state`` against the checkpoint: equal on every
    rank. Returns ScaleLoadPlanner's work counts."""
    from ragged_fsdp.checkpoint import ScaleLoadPlanner, read_metadata
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict

    md = read_metadata(path)
    plans, stats = [], {}
    for cls in (DefaultLoadPlanner, ScaleLoadPlanner):
        planner = cls()
        planner.set_up_planner(_stateful_to_state_dict(state), md, is_coordinator=dist.get_rank() == 0)
        plans.append(planner.create_local_plan())
        stats = getattr(planner, "stats", stats)
    theirs, ours = plans
    assert ours == theirs
    assert ours.items, "this rank reads something"
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ours)
    assert DefaultLoadPlanner().create_global_plan(everyone) == ScaleLoadPlanner().create_global_plan(everyone)
    return stats, md


class _Counting:
    """Counts ``ScaleLoadPlanner.create_local_plan`` calls."""

    def __enter__(self):
        from ragged_fsdp.checkpoint import scale_planner

        self.cls, self.calls = scale_planner.ScaleLoadPlanner, 0
        self.saved = self.cls.create_local_plan

        def counted(planner):
            self.calls += 1
            return self.saved(planner)

        self.cls.create_local_plan = counted
        return self

    def __exit__(self, *exc):
        self.cls.create_local_plan = self.saved


def _check_loaded(state, ref, what):
    got = _flat_full(state)
    assert set(got) == set(ref), (what, set(got) ^ set(ref))
    for k, v in ref.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), f"{what}: {k} differs"
        else:
            assert got[k] == v, (what, k)


def case_save_w4(rank, world):
    from ragged_fsdp.checkpoint import save

    root = os.environ[ENV]
    state = _state(world, saving=True)
    ref = _flat_full(state)
    ckpt = save(state, os.path.join(root, "ckpt"), step=0)
    if rank == 0:
        torch.save(ref, os.path.join(root, "reference.pt"))
    dist.barrier()
    # the same layout at W = 4: HSDP replicas each read their boxes
    stats, md = _compare_plans(_state(world, saving=False), ckpt.path)
    assert stats["fast"] > 10 and stats["fallback"] >= 1, stats  # "cols" (Shard(1)) went to DCP's matching
    many = [k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks") and len(v.chunks) > 1]
    assert len(many) > 10, many


def _load_phase(rank, world):
    import torch.distributed.checkpoint as dcp
    from ragged_fsdp.checkpoint import ChecksummedReader, load, load_latest, resolve
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    root = os.environ[ENV]
    path = resolve(os.path.join(root, "ckpt"))
    ref = torch.load(os.path.join(root, "reference.pt"), weights_only=False)
    state = _state(world, saving=False)
    stats, _ = _compare_plans(state, path)
    assert stats["fast"] > 10 and stats["fallback"] >= 1, stats
    with _Counting() as count:
        load(state, path)  # ScaleLoadPlanner by default
    assert count.calls == 1
    _check_loaded(state, ref, "checkpoint.load")
    # DCP's own planner loads the same values
    state2 = _state(world, saving=False)
    from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict

    sd2 = _stateful_to_state_dict(state2)
    dcp.load(sd2, storage_reader=ChecksummedReader(path), planner=DefaultLoadPlanner())
    for k in ("train", "hsdp"):
        state2[k].load_state_dict(sd2[k])
    state2["step"] = sd2["step"]
    _check_loaded(state2, ref, "dcp.load(DefaultLoadPlanner)")
    # load_latest (the resume path) uses it too, and a planner passed in is used instead
    state3 = _state(world, saving=False)
    with _Counting() as count:
        load_latest(os.path.join(root, "ckpt"), state3)
    assert count.calls == 1
    _check_loaded(state3, ref, "load_latest")
    state4 = _state(world, saving=False)
    with _Counting() as count:
        load(state4, path, planner=DefaultLoadPlanner())
    assert count.calls == 0
    _check_loaded(state4, ref, "load(planner=DefaultLoadPlanner())")


def case_load_w3(rank, world):
    _load_phase(rank, world)


def case_load_w2(rank, world):
    _load_phase(rank, world)


PHASES = [(4, [case_save_w4]), (3, [case_load_w3]), (2, [case_load_w2])]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    os.environ[ENV] = str(tmp_path_factory.mktemp("scale_load"))
    out = {}
    for world, cases in PHASES:
        res = run_cases(world, cases, timeout=400)
        out.update({k.rsplit(".", 1)[1]: v for k, v in res.items()})
    return out


@pytest.mark.parametrize("case", ["case_save_w4", "case_load_w3", "case_load_w2"])
def test_save_at_4_plan_and_load_at_4_3_2(results, case):
    if results[case]:
        pytest.fail(results[case], pytrace=False)
