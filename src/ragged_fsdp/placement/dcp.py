"""How a RaggedDTensor presents itself to ``torch.distributed.checkpoint`` (DCP): part of the
placement (its DTensor dunders call this), so the placement never imports ``checkpoint``.

DCP stores every tensor as a set of rectangular chunks of the global tensor and reshards
by intersecting boxes. A RaggedShard local piece is one contiguous run of the row-major
flattened tensor, which is not a box in general, but it is always a short ordered list of
boxes (``RaggedShard.local_boxes``: partial row, full rows, partial row; up to ``2k-1``
over ``k`` flattened dims; none on a rank that holds nothing). Each box is itself a
contiguous run, and the boxes follow one another in the local storage, so every box is a
plain *view* of the local tensor: saving reads straight from it and loading writes straight
into it (DCP narrows the view and ``copy_``-s into it).

The three functions below back ``RaggedDTensor.__create_write_items__``,
``__create_chunk_list__`` and ``__get_tensor_shard__``; DCP's default planners call those
dunders for any object that defines them, so ``dcp.save`` / ``dcp.load`` need no
ragged_fsdp-specific call.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .spec import outer_offsets, outer_shape, ragged_dim
from .subclass_local import is_subclass_local, row_views, values_of

__all__ = ["local_box_views", "create_write_items", "create_chunk_list", "get_tensor_shard"]


def local_box_boxes(dt) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The (offsets, sizes) boxes of the global tensor that this rank's run covers: boxes of
    the outer-local tensor (the TP/EP-local one, or the global one), shifted by where that
    tensor sits in the global tensor. HSDP replicas declare the same boxes (DCP keeps one)."""
    spec = dt._spec
    d = ragged_dim(spec.placements)
    rank = dt.device_mesh.get_local_rank(d)
    shape = tuple(dt.shape)
    boxes = spec.placements[d].local_boxes(outer_shape(spec), rank)
    if not boxes and math.prod(shape) == 0 and all(c == 0 for c in dt.device_mesh.get_coordinate()):
        # A tensor with no elements still needs one (empty) chunk in the checkpoint, or DCP
        # would not know the key at all; the first rank declares it.
        return [((0,) * len(shape), shape)]
    base = outer_offsets(spec)
    if any(base):
        boxes = [(tuple(o + b for o, b in zip(off, base)), sizes) for off, sizes in boxes]
    return boxes


def local_box_views(dt) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]:
    """``(offsets, sizes, view)`` for every box of this rank's run, in storage order.

    Each view aliases the local tensor (no copy), so writes into it land in the shard. A
    tensor-subclass local (``subclass_local.py``): its plain values, or whole-row narrows."""
    local = _stored(dt)
    boxes = local_box_boxes(dt)
    if not boxes:
        return []
    if is_subclass_local(local):
        return [(tuple(o), tuple(sz), v) for (o, sz), v in zip(boxes, row_views(local, boxes))]
    if not local.is_contiguous():
        raise RuntimeError(
            "ragged_fsdp checkpoint: the local tensor of a RaggedShard DTensor must be "
            f"contiguous to be described as boxes (got strides {local.stride()} for shape "
            f"{tuple(local.shape)})"
        )
    flat = local.view(-1)
    out, start = [], 0
    for offsets, sizes in boxes:
        n = math.prod(sizes)
        out.append((tuple(offsets), tuple(sizes), flat[start : start + n].view(sizes)))
        start += n
    if start != flat.numel():
        raise RuntimeError(
            f"ragged_fsdp checkpoint: boxes {boxes} cover {start} elements but the local "
            f"tensor holds {flat.numel()}; the placement and the local tensor disagree"
        )
    return out


def _stored(dt) -> torch.Tensor:
    """What DCP reads and writes for ``dt``: its local tensor, or a value wrapper's values."""
    local = dt._local_tensor
    if is_subclass_local(local):
        values = values_of(local)
        return local if values is None else values
    return local


def create_write_items(dt, fqn: str) -> list[WriteItem]:
    """One SHARD write item per box (none on a rank that holds nothing)."""
    props = TensorProperties.create_from_tensor(_stored(dt))
    size = torch.Size(dt.shape)
    items = []
    for offsets, sizes in local_box_boxes(dt):
        offsets, sizes = torch.Size(offsets), torch.Size(sizes)
        items.append(
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=props,
                    size=size,
                ),
            )
        )
    return items


def create_chunk_list(dt) -> list[ChunkStorageMetadata]:
    """The boxes this rank holds, as DCP chunks (what a load must fill)."""
    return [
        ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(sz))
        for off, sz in local_box_boxes(dt)
    ]


def get_tensor_shard(dt, index: MetadataIndex) -> torch.Tensor:
    """The view of the box that starts at ``index.offset``.

    Boxes are found by offset (unique per rank because boxes are disjoint); the index hint
    is not used because DCP's save planner rewrites it to a position in the global chunk
    list, while its load planner sets it to a position in our local list."""
    views = local_box_views(dt)
    if index.offset is None:
        if len(views) == 1 and tuple(views[0][1]) == tuple(dt.shape):
            return views[0][2]
        raise ValueError(
            f"ragged_fsdp checkpoint: '{index.fqn}' is sharded into boxes; a lookup needs an offset"
        )
    want = tuple(index.offset)
    if index.index is not None and 0 <= index.index < len(views) and views[index.index][0] == want:
        return views[index.index][2]
    for offsets, _, view in views:
        if offsets == want:
            return view
    raise ValueError(
        f"ragged_fsdp checkpoint: '{index.fqn}' has no local box at offset {want} on this rank "
        f"(local boxes start at {[v[0] for v in views]})"
    )
