"""RaggedShard next to other mesh dims (HSDP's Replicate, TP/EP's Shard), W=4 on gloo.

Every layout is checked against the global tensor: each rank's local piece is exactly the
elements the definition gives it (the RaggedShard splits the outer-local tensor that the
other placements leave), and full_tensor / redistribute / reductions / DCP round trips
reproduce the global tensor bitwise (pure data movement and float64 sums).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from _dist import check_case, run_cases
from ragged_fsdp import RaggedShard, distribute_tensor, redistribute
from ragged_fsdp.placement import from_local
from ragged_fsdp.placement.dtensor import outer_offsets, outer_shape

WORLD = 4


def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))


def _layouts():
    """(placements, shape) with the RaggedShard on either mesh dim, uneven, one rank empty."""
    return [
        ((Replicate(), RaggedShard((0,), (3, 0))), (3, 5)),  # HSDP: replicate x ragged, rank empty
        ((RaggedShard((0,), (1, 3)), Shard(0)), (8, 3)),  # ColwiseParallel: both on dim 0
        ((RaggedShard((0, 1), (5, 7), unit=1), Shard(1)), (3, 8)),  # RowwiseParallel: dim 1
        ((Shard(0), RaggedShard((0,), (2, 0))), (4, 2, 3)),  # ragged on the second dim, 3-D
        ((Shard(1), RaggedShard((), (0, 1))), (2, 4)),  # whole outer-local tensor on one rank
    ]


def _expected_piece(full, mesh, placements):
    """The definition, spelled out with torch: cut by the non-ragged placements (via torch's
    own DTensor), then take the RaggedShard rank's run of the row-major flattened result."""
    d = next(i for i, p in enumerate(placements) if isinstance(p, RaggedShard))
    outer = [Replicate() if i == d else p for i, p in enumerate(placements)]
    local = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False).redistribute(mesh, outer).to_local()
    a, b = placements[d].element_range(tuple(local.shape), mesh.get_local_rank(d))
    return local.reshape(-1)[a:b]


def case_pieces_and_round_trips(rank, world):
    mesh = _mesh()
    for placements, shape in _layouts():
        torch.manual_seed(0)
        full = torch.randn(shape)
        dt = distribute_tensor(full, mesh, placements)
        want = _expected_piece(full, mesh, placements)
        assert torch.equal(dt.to_local().reshape(-1), want), (placements, rank)
        # src_data_rank=None (no communication) gives the same piece
        assert torch.equal(distribute_tensor(full, mesh, placements, src_data_rank=None).to_local().reshape(-1), want)
        assert torch.equal(dt.full_tensor(), full), placements
        # to every torch layout the other placements allow, and back
        d = next(i for i, p in enumerate(placements) if isinstance(p, RaggedShard))
        for target in ([Replicate(), Replicate()], [p if i != d else Replicate() for i, p in enumerate(placements)]):
            moved = dt.redistribute(mesh, target)
            assert not isinstance(moved, type(dt)) and tuple(moved.placements) == tuple(target)
            assert torch.equal(moved.full_tensor(), full), (placements, target)
            back = redistribute(moved, mesh, placements)  # torch's own method knows no RaggedShard
            assert torch.equal(back.to_local(), dt.to_local()), (placements, target, back.to_local(), dt.to_local())
        # ops: pointwise keeps layout, reductions are global
        assert torch.equal((dt * 2 + 1).full_tensor(), full * 2 + 1)
        assert torch.allclose(dt.sum().full_tensor(), full.double().sum().float(), rtol=1e-6, atol=1e-6), (placements, dt.sum(), full.sum())
        assert torch.allclose(dt.norm().full_tensor(), full.norm(), rtol=1e-6)
        assert float(dt.abs().max().full_tensor()) == float(full.abs().max())
        # random fills give the global tensor's draw, whatever the layout
        torch.manual_seed(3)
        dt.normal_()
        torch.manual_seed(3)
        assert torch.equal(dt.full_tensor(), torch.randn(shape))
        # copy_ from the global tensor
        dt.copy_(full)
        assert torch.equal(dt.full_tensor(), full)
        # from_local with the exact piece
        again = from_local(want.clone(), mesh, placements, shape)
        assert torch.equal(again.full_tensor(), full)


def case_colwise_offsets(rank, world):
    """Outer offsets follow DTensor's left-to-right chunking: the outer-local tensor of
    (RaggedShard, Shard(0)) on mesh (a, b) is rows [4*b, 4*b+4) of an 8-row tensor."""
    mesh = _mesh()
    dt = distribute_tensor(torch.arange(24.0).view(8, 3), mesh, (RaggedShard((0,), (1, 3)), Shard(0)))
    b = mesh.get_coordinate()[1]
    assert outer_shape(dt._spec) == (4, 3)
    assert outer_offsets(dt._spec) == (4 * b, 0)
    rows = dt.to_local().view(-1, 3)[:, 0] // 3
    first = 4 * b + (0 if mesh.get_coordinate()[0] == 0 else 1)
    assert rows.tolist() == list(range(first, first + rows.numel())), rows


def case_dcp_reshard(rank, world):
    """Save from every layout, load into every other (and into a 1-D RaggedShard)."""
    mesh = _mesh()
    flat = init_device_mesh("cpu", (world,))
    root = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(root)
    for i, (placements, shape) in enumerate(_layouts()):
        torch.manual_seed(i)
        full = torch.randn(shape)
        path = os.path.join(root[0], f"l{i}")
        dcp.save({"w": distribute_tensor(full, mesh, placements)}, checkpoint_id=path)
        for other, oshape in _layouts():
            if oshape != shape:
                continue
            dst = distribute_tensor(torch.zeros(shape), mesh, other)
            dcp.load({"w": dst}, checkpoint_id=path)
            assert torch.equal(dst.full_tensor(), full), (placements, other)
        units = [0] * world
        units[world - 1] = shape[0]
        dst = distribute_tensor(torch.zeros(shape), flat, (RaggedShard((0,), tuple(units)),))
        dcp.load({"w": dst}, checkpoint_id=path)
        assert torch.equal(dst.full_tensor(), full)
        plain = {"w": torch.zeros(shape)}
        dcp.load(plain, checkpoint_id=path, no_dist=False)
        assert torch.equal(plain["w"], full)


def case_errors(rank, world):
    mesh = _mesh()
    with pytest.raises(NotImplementedError, match="unevenly"):
        distribute_tensor(torch.zeros(3, 2), mesh, (RaggedShard((0,), (1, 1)), Shard(0)))
    from torch.distributed.tensor import Partial

    with pytest.raises(NotImplementedError, match="Partial"):
        distribute_tensor(torch.zeros(4, 2), mesh, (RaggedShard((0,), (1, 3)), Partial()))


CASES = [case_pieces_and_round_trips, case_colwise_offsets, case_dcp_reshard, case_errors]


@pytest.fixture(scope="module")
def results():
    return run_cases(WORLD, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[5:])
def test_placement_nd(results, case):
    check_case(results, case, WORLD)
