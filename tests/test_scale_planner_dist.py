"""``ScaleSavePlanner`` is the default planner of ``checkpoint.save`` (``TrainState`` saves),
``async_save`` and ``torch_save_to_dcp``: on gloo at W = 2, 3 and 4 it plans and writes what
DCP's ``DefaultSavePlanner`` does, and it refuses what DCP's overlap check refuses.

One launch per W. The state saved: a tiny LLaMA with tied embeddings, ``fully_shard``-ed by
rows, with its AdamW state through ``TrainState``; odd RaggedShard tensors (3-D runs, 4-row
units with a partial last one, 64-element blocks, a 0-d tensor, an empty one, int8, a
one-row tensor), cut so that a middle rank holds zero units of them; a plain value; and at
W = 4 an HSDP (2 x 2) ``fully_shard``-ed model and an HSDP tensor (replicas are deduplicated).

* the local plans of both planners (their local side is DCP's), gathered, give equal
  global plans and metadata on every rank;
* ``dcp.save(planner=DefaultSavePlanner())``, ``checkpoint.save`` and ``async_save`` (our
  defaults, counted to be ScaleSavePlanner on the coordinator) write the same data files,
  byte for byte, and the same metadata (chunks, planner data, storage index; the file itself
  and its seal differ only in the directory it names);
* two ranks that write overlapping rows of one tensor (each built its DTensor from its own,
  different, placement) are refused by the coordinator, with either planner, and nothing is
  published; through ``fully_shard`` the same disagreement cannot get that far: its layout
  agreement refuses it on every rank at set-up.
"""

from __future__ import annotations

import filecmp
import os

import pytest
import torch
import torch.distributed as dist

from _dist import check_case, run_cases

ENV = "RAGGED_SCALE_PLANNER_TEST_DIR"
WORLDS = (2, 3, 4)


def _d(world, *parts):
    return os.path.join(os.environ[ENV], f"w{world}", *parts)


def _llama(mesh):
    from ragged_fsdp import fully_shard
    from ragged_fsdp.models.llama import Llama, LlamaConfig

    torch.manual_seed(3)
    m = Llama(LlamaConfig.tiny(tie_embeddings=True))
    for block in m.layers:
        fully_shard(block, mesh=mesh, granularity_fn=lambda n, p: "row")
    fully_shard(m, mesh=mesh, granularity_fn=lambda n, p: "row")
    return m


def _cuts(n, world):
    """Counts summing to ``n`` with rank 1 (a middle rank when world > 2) holding nothing."""
    base = [n // world + (r < n % world) for r in range(world)]
    if world > 2:
        base[0] += base[1]
        base[1] = 0
    return tuple(base)


def _odd(world):
    from ragged_fsdp import RaggedShard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(11)
    one_row = tuple(int(r == world - 1) for r in range(world))
    spec = {
        "t3": (torch.randn(5, 4, 3, generator=g), RaggedShard((0, 1, 2), _cuts(60, world))),
        "rows_u4": (torch.randn(29, 7, generator=g), RaggedShard((0,), _cuts(8, world), 4)),
        "flat_u64": (torch.randn(300, generator=g), RaggedShard((0,), _cuts(5, world), 64)),
        "scalar": (torch.randn((), generator=g), RaggedShard((), tuple(int(r == 0) for r in range(world)))),
        "empty": (torch.zeros(0, 4), RaggedShard((0,), (0,) * world)),
        "int8": (torch.randint(-100, 100, (40, 3), generator=g, dtype=torch.int8), RaggedShard((0, 1), _cuts(120, world))),
        "one_row": (torch.randn(1, 9, generator=g), RaggedShard((0,), one_row)),
    }
    return {k: distribute_tensor(t, mesh, [p]) for k, (t, p) in spec.items()}


def _state(world):
    from ragged_fsdp.checkpoint import TrainState
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    m = _llama(mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    state = {"train": TrainState(m, opt), "odd": _odd(world), "step": 7}
    if world == 4:
        from ragged_fsdp import RaggedShard, distribute_tensor
        from torch.distributed.tensor import Replicate

        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        state["hsdp"] = TrainState(_llama(hsdp))
        t = torch.arange(29 * 7, dtype=torch.float32).reshape(29, 7)
        state["hsdp_tensor"] = distribute_tensor(t, hsdp, [Replicate(), RaggedShard((0, 1), (150, 53))])
    return state


def _plans(planner_cls, state, rank):
    from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict

    planner = planner_cls()
    planner.set_up_planner(_stateful_to_state_dict(state), storage_meta=None, is_coordinator=rank == 0)
    local = planner.create_local_plan()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return everyone


def case_global_plans_and_metadata_are_dcp_defaults(rank, world):
    from ragged_fsdp.checkpoint import ScaleSavePlanner
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    state = _state(world)
    theirs_local = _plans(DefaultSavePlanner, state, rank)
    ours_local = _plans(ScaleSavePlanner, state, rank)
    assert ours_local == theirs_local
    theirs = DefaultSavePlanner().create_global_plan(theirs_local)
    ours = ScaleSavePlanner().create_global_plan(ours_local)
    assert ours == theirs  # (global plans, Metadata): every chunk, the planner data
    md = ours[1].state_dict_metadata
    assert "train.model.output.weight" in md and "train.model.tok_embeddings.weight" in md  # tied: both keys
    if world > 2:  # rank 1 holds no unit of the odd tensors: no item of them in its plan
        assert not [i.index.fqn for i in ours_local[1].items if i.index.fqn.startswith("odd.")]
    many = [k for k, v in md.items() if hasattr(v, "chunks") and len(v.chunks) > 1]
    assert len(many) > 10, many  # the comparison covers tensors cut over several ranks
    if world == 4:
        chunks = md["hsdp_tensor"].chunks  # each replica's boxes once: the volumes add up to the tensor
        assert len(chunks) == 4 and sum(c.sizes[0] * c.sizes[1] for c in chunks) == 29 * 7


class _Counting:
    """Counts the coordinator's ``ScaleSavePlanner._create_global_plan`` calls."""

    def __init__(self):
        from ragged_fsdp.checkpoint import scale_planner

        self.cls, self.calls = scale_planner.ScaleSavePlanner, 0
        self.saved = self.cls._create_global_plan

    def __enter__(self):
        def counted(planner, all_plans):
            self.calls += 1
            return self.saved(planner, all_plans)

        self.cls._create_global_plan = counted
        return self

    def __exit__(self, *exc):
        self.cls._create_global_plan = self.saved


def _files(root):
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, root)] = p
    return out


def case_saved_files_are_dcp_defaults(rank, world):
    import torch.distributed.checkpoint as dcp
    from ragged_fsdp.checkpoint import ChecksummedWriter, async_save, read_metadata, save
    from ragged_fsdp.checkpoint.atomic import MARKER
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    state = _state(world)
    dcp.save(state, storage_writer=ChecksummedWriter(_d(world, "dcp_default")), planner=DefaultSavePlanner())
    with _Counting() as count:
        ckpt = save(state, _d(world, "ours"), step=0)
        async_save(state, checkpoint_id=_d(world, "ours_async")).result()
    assert count.calls == (2 if rank == 0 else 0)  # the coordinator planned both with ScaleSavePlanner
    dist.barrier()
    if rank != 0:
        return
    ref = _files(_d(world, "dcp_default"))
    ref_md = read_metadata(_d(world, "dcp_default"))
    for target in (ckpt.path, _d(world, "ours_async")):
        got = _files(target)
        got.pop(MARKER, None)
        assert sorted(got) == sorted(ref), (sorted(got), sorted(ref))
        for name, path in ref.items():  # .metadata names its directory (and its seal hashes it): fields below
            if not name.startswith(".metadata"):
                assert filecmp.cmp(path, got[name], shallow=False), name
        md = read_metadata(target)
        assert md.state_dict_metadata == ref_md.state_dict_metadata
        assert md.planner_data == ref_md.planner_data
        assert md.storage_data == ref_md.storage_data


def _overlapping(world):
    """A (2W, 6) tensor whose rank 0 believes it holds rows [0, 3) and every other rank that
    rank r holds [2r, 2r + 2): ranks 0 and 1 both write row 2."""
    from ragged_fsdp import RaggedShard, from_local
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    counts = (3, 1) + (2,) * (world - 2) if rank == 0 else (2,) * world
    full = torch.arange(2 * world * 6, dtype=torch.float32).reshape(2 * world, 6)
    start = sum(counts[:rank])
    local = full[start:start + counts[rank]].clone()
    mesh = init_device_mesh("cpu", (world,))
    return from_local(local, mesh, [RaggedShard((0,), counts)], shape=full.shape)


def case_overlapping_chunks_are_refused(rank, world):
    from ragged_fsdp.checkpoint import CheckpointSaveError, list_checkpoints, save
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    state = {"w": _overlapping(world)}
    for name, planner in (("ours", None), ("dcp_default", DefaultSavePlanner())):
        root = _d(world, f"overlap_{name}")
        with pytest.raises(CheckpointSaveError, match="overlapping chunks"):
            save(state, root, step=0, planner=planner)
        assert list_checkpoints(root) == []  # nothing published, on every rank


def case_fully_shard_refuses_the_same_disagreement(rank, world):
    """The disagreement above, through fully_shard: each rank plans its own layout (another
    granularity on rank 0) and the layout agreement refuses it on every rank."""
    from ragged_fsdp import fully_shard
    from ragged_fsdp.fsdp import LayoutMismatchError
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    m = torch.nn.Sequential(torch.nn.Linear(6, 2 * world * 3, bias=False))
    gran = "rows:5" if rank == 0 else "row"
    with pytest.raises(LayoutMismatchError, match="ranks planned different layouts"):
        fully_shard(m, mesh=mesh, granularity_fn=lambda n, p: gran)


def case_bad_planner_is_named(rank, world):
    from ragged_fsdp.checkpoint import ScaleSavePlanner, async_save, save

    with pytest.raises(ValueError, match="planner=ScaleSavePlanner is a class; pass an instance"):
        save({"x": torch.zeros(2)}, _d(world, "bad_planner"), step=0, planner=ScaleSavePlanner)
    with pytest.raises(TypeError, match="planner must be a torch.distributed.checkpoint SavePlanner"):
        async_save({"x": torch.zeros(2)}, checkpoint_id=_d(world, f"bad_async_{rank}"), planner="default")


CASES = [case_global_plans_and_metadata_are_dcp_defaults, case_saved_files_are_dcp_defaults,
         case_overlapping_chunks_are_refused, case_fully_shard_refuses_the_same_disagreement,
         case_bad_planner_is_named]


@pytest.fixture(scope="module", params=WORLDS)
def results(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"scale_planner_w{request.param}")
    os.environ[ENV] = str(root)
    try:
        return request.param, run_cases(request.param, CASES)
    finally:
        os.environ.pop(ENV, None)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[len("case_"):])
def test_scale_planner_on_gloo(results, case):
    world, res = results
    check_case(res, case, world)


def test_torch_save_to_dcp_uses_scale_planner(tmp_path, monkeypatch):
    from ragged_fsdp.checkpoint import ScaleSavePlanner, torch_save_to_dcp

    torch.save({"w": torch.randn(4, 3), "b": torch.arange(5)}, tmp_path / "in.pt")
    seen = []
    saved = ScaleSavePlanner._create_global_plan
    monkeypatch.setattr(ScaleSavePlanner, "_create_global_plan",
                        lambda self, plans: seen.append(len(plans)) or saved(self, plans))
    torch_save_to_dcp(str(tmp_path / "in.pt"), str(tmp_path / "out"))
    assert seen == [1]
