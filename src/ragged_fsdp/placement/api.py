"""Constructors that accept RaggedShard (torch's own reject unknown placements)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

from ragged_fsdp.agreement import agree_flags

from .dtensor import (
    _FromLocal, element_ranges, expected_local_shape, has_outer_shards, local_range, make_spec,
    outer_placements, ragged_dim, wrap,
)
from .ragged_shard import RaggedShard

__all__ = ["from_local", "distribute_tensor"]


def _has_ragged(placements) -> bool:
    return any(isinstance(p, RaggedShard) for p in placements)


def from_local(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence,
    shape: Sequence[int] | None = None,
    *,
    stride=None,
    run_check: bool = False,
    requires_grad: bool | None = None,
) -> DTensor:
    """Wrap this rank's piece ``local`` (no copy) as a DTensor of global ``shape``.

    ``shape`` is required for RaggedShard (the local pieces do not determine it). ``local``
    must hold exactly this rank's elements; it is viewed in the placement's local shape.
    Differentiable, like ``DTensor.from_local``. Other placements go to torch.
    """
    if not _has_ragged(placements):
        return DTensor.from_local(local, mesh, placements, run_check=run_check, shape=shape, stride=stride)
    if shape is None:
        raise ValueError("from_local: shape= (the global shape) is required with a RaggedShard placement")
    spec = make_spec(mesh, placements, shape, local.dtype)
    if mesh.get_coordinate() is None:  # not in the mesh: an empty piece, as torch does
        return wrap(local.detach().new_empty(0), spec, requires_grad=bool(requires_grad))
    d = ragged_dim(spec.placements)
    rank = mesh.get_local_rank(d)
    want = expected_local_shape(spec)
    n = math.prod(want)
    if run_check:
        _check_pieces(local, spec, d)
    if local.numel() != n:
        raise ValueError(
            f"from_local: rank {rank} holds {local.numel()} elements but {spec.placements[d]} "
            f"gives it {n} of a tensor of shape {tuple(shape)}; pass this rank's exact piece"
        )
    if tuple(local.shape) != tuple(want):
        local = local.view(want)
    if torch.is_grad_enabled() and local.requires_grad:
        out = _FromLocal.apply(local, spec)
    else:
        out = wrap(local, spec)
    if requires_grad is not None:
        out.requires_grad_(requires_grad)
    return out


def _check_pieces(local: torch.Tensor, spec, d: int) -> None:
    """``run_check``: every rank of the mesh raises if any rank's piece has the wrong size.

    The sizes are gathered over the RaggedShard's mesh dim (so those ranks can name the rank
    at fault), then a failure flag is MAX-reduced over every mesh dim: a rank that raised on
    its own piece before these collectives would leave its peers waiting in them."""
    mesh = spec.mesh
    group = mesh.get_group(d)
    sizes = torch.tensor([local.numel()], dtype=torch.int64, device=local.device)
    got = [torch.zeros_like(sizes) for _ in range(mesh.size(d))]
    dist.all_gather(got, sizes, group=group)
    ranges = element_ranges(spec)
    wrong = [(r, int(g), b - a) for r, (g, (a, b)) in enumerate(zip(got, ranges)) if int(g) != b - a]
    (flag,) = agree_flags([int(bool(wrong))], mesh)
    if wrong:
        name = mesh.mesh_dim_names[d] if mesh.mesh_dim_names else d
        said = "; ".join(f"rank {r} holds {g} elements, {spec.placements[d]} gives it {w}" for r, g, w in wrong)
        raise ValueError(
            f"from_local(run_check=True): on mesh dim {name!r}, {said} (tensor shape "
            f"{tuple(spec.shape)}); every rank must pass its exact piece of the same placement"
        )
    if flag:
        raise ValueError(
            "from_local(run_check=True): another rank of the mesh found a piece of the wrong size "
            "(see its error); every rank must pass its exact piece of the same placement"
        )


def distribute_tensor(
    tensor: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Shard a full tensor. As torch's: by default rank 0's data is scattered (other ranks'
    ``tensor`` only gives shape and dtype); ``src_data_rank=None`` slices each rank's own
    copy with no communication. The result is a leaf that keeps ``tensor.requires_grad``."""
    if not _has_ragged(placements):
        return torch_distribute_tensor(tensor, mesh, placements, src_data_rank=src_data_rank)
    if isinstance(tensor, DTensor):
        raise ValueError("distribute_tensor: tensor is already a DTensor; use ragged_fsdp.redistribute")
    spec = make_spec(mesh, placements, tuple(tensor.shape), tensor.dtype)
    if mesh.get_coordinate() is None:
        # This rank is not in the mesh: it holds nothing and takes part in no collective
        # (torch's distribute_tensor does the same).
        return wrap(tensor.detach().new_empty(0), spec, requires_grad=tensor.requires_grad)
    if has_outer_shards(spec):
        # torch cuts the outer-local tensor (scattering from src_data_rank as asked); our
        # piece of it needs no communication
        outer = torch_distribute_tensor(tensor.detach(), mesh, outer_placements(spec), src_data_rank=src_data_rank)
        a, b = local_range(spec)
        piece = outer._local_tensor.reshape(-1)[a:b].clone()
        return wrap(piece.view(expected_local_shape(spec)), spec, requires_grad=tensor.requires_grad)
    d = ragged_dim(spec.placements)
    rank, group, world = mesh.get_local_rank(d), mesh.get_group(d), mesh.size(d)
    ranges = element_ranges(spec)
    flat = tensor.detach().reshape(-1)
    a, b = ranges[rank]
    if src_data_rank is None or world == 1:
        piece = flat[a:b].clone()
    else:
        longest = max(hi - lo for lo, hi in ranges)
        out = flat.new_empty(longest)
        if rank == src_data_rank:
            chunks = []
            for lo, hi in ranges:
                c = flat.new_zeros(longest)
                c[: hi - lo] = flat[lo:hi]
                chunks.append(c)
        else:
            chunks = None
        dist.scatter(out, chunks, src=dist.get_global_rank(group, src_data_rank), group=group)
        piece = out[: b - a].clone()
    local = piece.view(spec.placements[d].local_shape(spec.shape, rank))
    return wrap(local, spec, requires_grad=tensor.requires_grad)
