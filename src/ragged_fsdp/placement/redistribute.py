"""Moving tensors between RaggedShard and torch's placements.

Every RaggedShard local piece is one contiguous run of the row-major flattened tensor, and
so is every ``Shard(0)`` piece. So ragged <-> ragged and ragged <-> Shard(0) are one
``all_to_all_single`` of interval overlaps (each element moves once); ragged -> Replicate is
one all-gather of equal-size padded pieces (gloo and NCCL need equal sizes); Partial ->
ragged is a real reduce-scatter. Other layouts go through the full tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

from .dtensor import (
    RaggedDTensor, element_ranges, expected_local_shape, has_outer_shards, local_range, make_spec,
    outer_placements, outer_shape, ragged_dim, wrap,
)
from ragged_fsdp.comm import all_gather_runs, all_to_all_flat, reduce_scatter_runs
from ragged_fsdp.shapes import contiguous_stride

from .ragged_shard import RaggedShard

__all__ = ["redistribute", "overlap_splits", "chunk_ranges"]

Ranges = Sequence[tuple[int, int]]


def chunk_ranges(shape: Sequence[int], world: int) -> list[tuple[int, int]]:
    """Element ranges of torch's ``Shard(0)`` (torch.chunk: ceil-sized, trailing ranks may be empty)."""
    if not shape:
        return [(0, 1) if r == 0 else (1, 1) for r in range(world)]
    rows = shape[0]
    inner = 1
    for s in shape[1:]:
        inner *= s
    step = -(-rows // world) if rows else 0
    out = []
    for r in range(world):
        a = min(r * step, rows)
        b = min(a + step, rows)
        out.append((a * inner, b * inner))
    return out


def overlap_splits(src: Ranges, dst: Ranges, rank: int) -> tuple[list[int], list[int]]:
    """(input_split_sizes, output_split_sizes) for an all-to-all from ``src`` to ``dst`` ranges."""
    def ov(x, y):
        return max(0, min(x[1], y[1]) - max(x[0], y[0]))

    send = [ov(src[rank], d) for d in dst]
    recv = [ov(s, dst[rank]) for s in src]
    return send, recv


def _ranges_of(placements, shape, mesh_dim_size) -> list[tuple[int, int]] | None:
    """Flat element ranges of a 1-D layout, or None when it is not a contiguous layout."""
    p = placements[0]
    if isinstance(p, RaggedShard):
        return list(p.element_ranges(shape))
    if isinstance(p, Shard) and p.dim == 0:
        return chunk_ranges(shape, mesh_dim_size)
    return None


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src, mesh, placements):
        ctx.src_mesh, ctx.src_placements = src.device_mesh, tuple(src.placements)
        return _redistribute(src, mesh, tuple(placements))

    @staticmethod
    def backward(ctx, grad):
        if any(isinstance(p, Partial) for p in ctx.src_placements):
            return None, None, None
        if any(isinstance(p, Partial) for p in grad.placements):
            grad = grad.redistribute(grad.device_mesh, [Replicate()] * grad.device_mesh.ndim)
        return _redistribute(grad, ctx.src_mesh, ctx.src_placements), None, None


def redistribute(src: DTensor, mesh: DeviceMesh, placements: Sequence) -> DTensor:
    """Move ``src`` (any DTensor, RaggedShard or not) to ``placements`` on ``mesh``."""
    if not isinstance(src, DTensor):
        raise TypeError(
            "redistribute: src must be a DTensor; use ragged_fsdp.distribute_tensor for a plain tensor"
        )
    if mesh != src.device_mesh:
        raise ValueError(
            f"redistribute: target mesh {mesh} differs from the source mesh {src.device_mesh}; "
            "redistribute moves data within one mesh"
        )
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(f"redistribute: give one placement per mesh dim ({mesh.ndim}), got {placements}")
    if torch.is_grad_enabled() and src.requires_grad:
        return _Redistribute.apply(src, mesh, placements)
    return _redistribute(src, mesh, placements)


def _redistribute(src: DTensor, mesh: DeviceMesh, placements: tuple) -> DTensor:
    shape = tuple(src.shape)
    src_ragged = isinstance(src, RaggedDTensor)
    dst_ragged = any(isinstance(p, RaggedShard) for p in placements)
    if not src_ragged and not dst_ragged:
        return src.redistribute(mesh, placements)
    if (src_ragged and has_outer_shards(src._spec)) or (
        dst_ragged and any(type(p) is Shard for p in placements)
    ):
        return _redistribute_nd(src, mesh, placements)
    # Work on the ragged mesh dim; every other dim must be Replicate on both sides.
    d = ragged_dim(src.placements if src_ragged else placements)
    group = mesh.get_group(d)
    rank = mesh.get_local_rank(d)
    world = mesh.size(d)
    local = src._local_tensor
    src_p = src.placements[d]
    dst_p = placements[d]

    if dst_ragged:
        spec = make_spec(mesh, placements, shape, src.dtype)
        dst_ranges = element_ranges(spec)
        a, b = dst_ranges[rank]
        local_shape = dst_p.local_shape(shape, rank)
        if isinstance(src_p, Replicate):
            out = local.reshape(-1)[a:b].clone()
        elif isinstance(src_p, Partial):
            avg = src_p.reduce_op == "avg"
            if src_p.reduce_op not in ("sum", "avg"):
                raise NotImplementedError(f"redistribute: Partial({src_p.reduce_op}) to RaggedShard")
            out = reduce_scatter_runs(local.reshape(-1), dst_ranges, group, avg)
        else:
            src_ranges = _ranges_of((src_p,), shape, world)
            if src_ranges is None:  # e.g. Shard(1): go through the full tensor
                full = src.full_tensor().reshape(-1)
                out = full[a:b].clone()
            else:
                send, recv = overlap_splits(src_ranges, dst_ranges, rank)
                out = all_to_all_flat(local.reshape(-1), send, recv, group)
        return wrap(out.view(local_shape), spec)

    # Ragged source to one of torch's placements.
    src_ranges = element_ranges(src._spec)
    if all(isinstance(p, Replicate) for p in placements):
        full = all_gather_runs(local.reshape(-1), src_ranges, group).view(shape)
        return DTensor.from_local(full, mesh, placements, run_check=False, shape=torch.Size(shape),
                                  stride=full.stride())
    if isinstance(dst_p, Shard) and dst_p.dim == 0 and shape:
        dst_ranges = chunk_ranges(shape, world)
        send, recv = overlap_splits(src_ranges, dst_ranges, rank)
        out = all_to_all_flat(local.reshape(-1), send, recv, group)
        rows = (dst_ranges[rank][1] - dst_ranges[rank][0]) // max(1, _inner(shape))
        out = out.view((rows,) + shape[1:])
        return DTensor.from_local(out, mesh, placements, run_check=False, shape=torch.Size(shape),
                                  stride=contiguous_stride(shape))
    full = all_gather_runs(local.reshape(-1), src_ranges, group).view(shape)
    return torch_distribute_tensor(full, mesh, placements, src_data_rank=None)


def _redistribute_nd(src: DTensor, mesh: DeviceMesh, placements: tuple) -> DTensor:
    """Layouts whose other mesh dims split the tensor too (TP/EP next to the RaggedShard):
    through the outer-local tensor, i.e. the RaggedShard dim gathered (one all-gather over
    that dim), with torch's DTensor doing whatever the other dims need."""
    shape = torch.Size(src.shape)
    if isinstance(src, RaggedDTensor):
        spec = src._spec
        d = ragged_dim(spec.placements)
        outer = all_gather_runs(src._local_tensor.reshape(-1), element_ranges(spec), mesh.get_group(d))
        src = DTensor.from_local(outer.view(outer_shape(spec)), mesh, outer_placements(spec), run_check=False,
                                 shape=shape, stride=contiguous_stride(tuple(shape)))
    if not any(isinstance(p, RaggedShard) for p in placements):
        return src if tuple(src.placements) == placements else src.redistribute(mesh, placements)
    spec = make_spec(mesh, placements, tuple(shape), src.dtype)
    moved = src.redistribute(mesh, outer_placements(spec))
    a, b = local_range(spec)
    piece = moved._local_tensor.reshape(-1)[a:b].clone()
    return wrap(piece.view(expected_local_shape(spec)), spec)


def _inner(shape):
    n = 1
    for s in shape[1:]:
        n *= s
    return n


