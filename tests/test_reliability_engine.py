"""Faults that used to hang or fail deep inside torch, now refused on every rank, and
torch's GradScaler on sharded gradients (against torch's FSDP2 and one process).

W=4: ranks whose ``shard_placement_fn`` answers differ, ``from_local(run_check=True)`` with a
wrong piece on one rank. Each case must raise on *every* rank: a rank that raised alone
would leave the others in a collective until the timeout (the harness's barrier after the
case then fails, so a hang shows as a failure, not a pass).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

from _dist import check_case, run_cases

from ragged_fsdp.fsdp import fully_shard
from ragged_fsdp.fsdp.consistency import LayoutMismatchError
from ragged_fsdp.placement import RaggedShard, from_local


def _raises(exc, text, fn):
    with pytest.raises(exc) as info:
        fn()
    assert text in str(info.value), f"{text!r} not in: {info.value}"
    return info.value


def _fsdp_mesh_info(mesh, dim=0):
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult

    return lambda: ShardPlacementResult(placement=Shard(0), mesh_info=FSDPMeshInfo(mesh, shard_mesh_dim=dim))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))


# -- the mesh of every shard_placement_fn answer is checked across ranks -------------------

def case_mesh_answer_depends_on_rank(rank, world):
    """Ranks 0-1 keep the default 4-rank mesh for the weights, ranks 2-3 answer a 2-rank
    slice: before the check, ranks 0-1 returned from fully_shard and 2-3 hung."""
    world_mesh = init_device_mesh("cpu", (world,))
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    other = _fsdp_mesh_info(grid["b"])

    def fn(p):
        return other() if rank >= 2 and p.dim() == 2 else None

    err = _raises(LayoutMismatchError, "'0.weight'",
                  lambda: fully_shard(_model(), mesh=world_mesh, shard_placement_fn=fn))
    assert "must not depend on the rank" in str(err)


def case_mesh_answer_same_names_other_ranks(rank, world):
    """Same dim names and sizes, but the two meshes group the ranks differently: ranks 0-1
    shard over {0, 1} of one, ranks 2-3 over {0, 2} / {1, 3} of the other."""
    world_mesh = init_device_mesh("cpu", (world,))
    rows = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("x", "y"))
    cols = DeviceMesh("cpu", torch.arange(4).view(2, 2).t().contiguous(), mesh_dim_names=("x", "y"))
    mine = _fsdp_mesh_info((rows if rank < 2 else cols)["y"])

    _raises(LayoutMismatchError, "ranks disagree on the mesh of parameter '0.weight'",
            lambda: fully_shard(_model(), mesh=world_mesh, shard_placement_fn=lambda p: mine()))


def case_mesh_answer_raises_on_one_rank(rank, world):
    world_mesh = init_device_mesh("cpu", (world,))

    def fn(p):
        if rank == 3:
            raise KeyError("no answer on rank 3")
        return None

    if rank == 3:
        _raises(KeyError, "no answer on rank 3", lambda: fully_shard(_model(), mesh=world_mesh, shard_placement_fn=fn))
    else:
        _raises(ValueError, "failed on another rank",
                lambda: fully_shard(_model(), mesh=world_mesh, shard_placement_fn=fn))


def case_mesh_answer_same_slice_everywhere(rank, world):
    """The legitimate case: every rank answers its own slice grid['a'] (a different group on
    each rank, the same mesh): accepted, and the weights live on that slice."""
    world_mesh = init_device_mesh("cpu", (world,))
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    sub = _fsdp_mesh_info(grid["a"])
    ref = _model()
    m = fully_shard(_model(), mesh=world_mesh, shard_placement_fn=lambda p: sub() if p.dim() == 2 else None)
    assert m[0].weight.device_mesh == grid["a"] and m[0].bias.device_mesh == world_mesh
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)


# -- from_local(run_check=True) raises on every rank -------------------------------------

def case_run_check_wrong_piece_on_one_rank(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    p = RaggedShard((0,), (1, 2, 0, 1))
    rows = p.local_units[rank] + (1 if rank == 1 else 0)  # rank 1 passes one row too many
    local = torch.zeros(rows, 3)
    _raises(ValueError, "rank 1 holds 9 elements",
            lambda: from_local(local, mesh, [p], (4, 3), run_check=True))
    # the right pieces pass the check
    t = from_local(torch.full((p.local_units[rank], 3), float(rank)), mesh, [p], (4, 3), run_check=True)
    assert t.full_tensor()[:, 0].tolist() == [0.0, 1.0, 1.0, 3.0]


def case_run_check_wrong_piece_2d_mesh(rank, world):
    """HSDP-like (Replicate, RaggedShard): rank 3's piece is wrong; its RaggedShard group
    {2, 3} names it, and ranks 0-1 (another group) raise too instead of returning."""
    from torch.distributed.tensor import Replicate

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    p = RaggedShard((0,), (3, 1))
    r = mesh.get_local_rank(1)
    local = torch.zeros(p.local_units[r] - (1 if rank == 3 else 0), 2)
    text = "rank 1 holds 0 elements" if rank >= 2 else "another rank of the mesh"
    _raises(ValueError, text, lambda: from_local(local, mesh, [Replicate(), p], (4, 2), run_check=True))


CASES_4 = [
    case_mesh_answer_depends_on_rank, case_mesh_answer_same_names_other_ranks,
    case_mesh_answer_raises_on_one_rank, case_mesh_answer_same_slice_everywhere,
    case_run_check_wrong_piece_on_one_rank, case_run_check_wrong_piece_2d_mesh,
]


@pytest.fixture(scope="module")
def results4():
    return run_cases(4, CASES_4)


@pytest.mark.parametrize("case", CASES_4, ids=lambda c: c.__name__)
def test_w4(results4, case):
    check_case(results4, case, 4)
