"""The block-fp8 all-gather of a DBuffer (``fully_shard(all_gather_quant=BlockFP8(...))``).

A quantised DBuffer holds only fp8-eligible tensors, laid out with a granularity that keeps
every tile on one rank, so each rank quantises its own tiles with no communication (no amax
all-reduce): its codes go into its slot of a ``W*S`` ``uint8`` buffer and its scales into its
slot of a ``W*T`` fp32 buffer, and two in-place all-gathers (one per kind; ``uint8`` because
gloo refuses float8 dtypes) fill both. After the wait, one dequantise per tensor writes
``codes * scale`` into the unsharded ``param_dtype`` buffer whose views the module computes
with; the code and scale buffers are dropped. Quantisation math: ``ragged_fsdp.quant``.
"""

from __future__ import annotations

import torch

from ragged_fsdp.comm import all_gather_single
from ragged_fsdp.dbuffer import DBuffer
from ragged_fsdp.planner.granularity import Granularity
from ragged_fsdp.quant import BlockFP8, ScaleLayout, dequantize_pieces, quantize_pieces

from ..torch_private import preserve_version_counter, set_version_counter
from .collectives import Comm
from ...device import AllWork, Device, Pending

__all__ = ["QuantState", "fp8_granularity", "attach_quant", "quant_all_gather"]


def fp8_granularity(policy: BlockFP8, name: str, shape, requested: Granularity | None) -> Granularity:
    """The granularity of an fp8-gathered tensor: the tile rule, or the caller's if it keeps
    tiles whole too (a coarser block); an error naming the fix otherwise."""
    g = policy.geometry(shape)
    if requested is None:
        return Granularity.parse(g.granularity)
    if g.cuts(requested.block_elems(tuple(shape))):
        raise ValueError(
            f"fully_shard: all_gather_quant={policy!r} quantises {name!r} (shape {tuple(shape)}) in "
            f"whole {policy.tile[0]}x{policy.tile[1]} tiles, but granularity_fn returned {str(requested)!r}, "
            f"which puts rank boundaries inside tiles; return {g.granularity!r} (or a multiple of it, "
            f"or 'tensor') for this parameter, or leave it out with {type(policy).__name__}(param_filter=...)"
        )
    return requested


class QuantState:
    """What a quantised DBuffer needs beyond its layout."""

    def __init__(self, policy: BlockFP8, layout: ScaleLayout):
        self.policy = policy
        self.layout = layout
        self.local_offsets = layout.local_offsets()
        self._index: torch.Tensor | None = None

    def index(self, device: torch.device) -> torch.Tensor:
        if self._index is None or self._index.device != device:
            self._index = self.layout.gather_index(device)
        return self._index


def attach_quant(buf: DBuffer, policy: BlockFP8) -> None:
    """Mark every tensor of ``buf`` as gathered in fp8 (checks that no rank cuts a tile)."""
    slots = list(range(len(buf.slots)))
    geoms = [policy.geometry(s.shape) for s in buf.slots]
    buf.set_gather_quant(QuantState(policy, ScaleLayout.build(buf.layout, slots, geoms)))


def quant_all_gather(device: Device, comm: Comm, buf: DBuffer) -> Pending:
    q: QuantState = buf.quant
    lay, pol = q.layout, q.policy
    W, r, S, T = comm.world_size, comm.rank, buf.segment, lay.per_rank
    out = buf.alloc_unsharded()
    version = out._version
    dev = buf.device
    codes = torch.empty(W * S, dtype=torch.uint8, device=dev)
    scales = torch.empty(W * T, dtype=torch.float32, device=dev)
    tr, tc = pol.tile

    def issue(async_op: bool):
        mine, my_scales = codes.narrow(0, r * S, S), scales.narrow(0, r * T, T)
        mine.zero_()  # padding between tensors: defined bytes on the wire
        my_scales.zero_()
        for j, i in enumerate(lay.slots):
            s = buf.slots[i]
            n, rows, C = lay.starts[j]
            if not s.local_numel:
                continue
            k = lay.tiles[r][j]
            quantize_pieces(
                buf.sharded.narrow(0, s.local_offset, s.local_numel).view(n, rows, C), pol.tile, pol.dtype,
                mine.narrow(0, s.local_offset, s.local_numel).view(n, rows, C),
                my_scales.narrow(0, q.local_offsets[j], k).view(n, -(-rows // tr), -(-C // tc)),
            )
        if W == 1:
            return None
        w1 = all_gather_single(codes, mine, group=comm.group, async_op=async_op)
        w2 = all_gather_single(scales, my_scales, group=comm.group, async_op=async_op) if T else None
        return AllWork(w1, w2)

    def post():
        ordered = scales.index_select(0, q.index(scales.device))  # tensor after tensor
        at = 0
        with torch.no_grad(), preserve_version_counter(out):
            for j, i in enumerate(lay.slots):
                s = buf.slots[i]
                n, rows, C = lay.pieces[j]
                k = n * -(-rows // tr) * -(-C // tc) if s.numel else 0
                dequantize_pieces(
                    codes.narrow(0, s.offset, s.numel).view(n, rows, C),
                    ordered.narrow(0, at, k).view(n, -(-rows // tr), -(-C // tc)), pol.tile, pol.dtype,
                    out.narrow(0, s.offset, s.numel).view(n, rows, C),
                )
                at += k
        set_version_counter((out,), (version,))

    return device.launch("all_gather", issue, post=post, keep=(out, codes, scales, buf.sharded),
                         out=(out, codes, scales))
