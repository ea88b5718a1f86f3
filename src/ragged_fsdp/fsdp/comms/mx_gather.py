"""The MXFP8 all-gather of a DBuffer (``fully_shard(all_gather_quant=MXFP8())``): one plane
per gather.

A quantised DBuffer holds only MXFP8-eligible tensors, laid out so that no rank cuts a 32x32
tile (the granularity rule of the block-fp8 gather, ``quant_gather.fp8_granularity``). Each
gather moves one plane (``ragged_fsdp.quant.mxfp8``): the forward's gather the **row** plane
(what ``x @ W.T`` contracts over), a gather inside backward (the re-gather after
``reshard_after_forward``) the **column** plane (what the input gradient ``dy @ W``
contracts over). Each rank quantises its own piece of the master segment in that plane: its
E4M3 codes go into its slot of a ``W*S`` ``uint8`` buffer (at the weights' own element
positions) and its E8M0 scales into its slot of a ``W*T`` ``uint8`` buffer (``T``: the most
scales of that plane any rank holds), and two in-place all-gathers fill both: ``S + T`` bytes
per rank, about ``1 + 1/32`` per element. After the wait one dequantise per tensor writes
``codes * 2**(e-127)`` into the unsharded ``param_dtype`` buffer the module computes with (the
CPU emulation of an MXFP8 GEMM: the same products, in ``param_dtype``), and the codes and
scales are dropped.
"""

from __future__ import annotations

import torch

from ragged_fsdp.comm import all_gather_single
from ragged_fsdp.dbuffer import DBuffer
from ragged_fsdp.quant import ScaleLayout
from ragged_fsdp.quant.mxfp8 import MXFP8, PLANES, mx_dequantize_piece, mx_quantize_piece, mx_scale_shape

from ..torch_private import preserve_version_counter, set_version_counter
from .collectives import Comm
from .device import AllWork, Device, Pending

__all__ = ["MXState", "attach_mx", "mx_all_gather", "mx_wire_bytes"]


class MXState:
    """What an MXFP8-gathered DBuffer needs beyond its layout: per plane, where each rank's
    scales travel (a :class:`~ragged_fsdp.quant.ScaleLayout` counting that plane's scales)."""

    def __init__(self, policy: MXFP8, buf: DBuffer):
        self.policy = policy
        lay = buf.layout
        slots = tuple(range(len(buf.slots)))
        geoms = tuple(policy.geometry(s.shape) for s in buf.slots)
        base = ScaleLayout.build(lay, slots, geoms)  # raises if a rank's piece cuts a 32x32 tile
        self.layouts: dict[str, ScaleLayout] = {}
        for plane in PLANES:
            counts = []
            for r in range(lay.world_size):
                row = []
                for i, g in zip(slots, geoms):
                    s = lay.slots[i]
                    row.append(_count(g.piece_shape(*s.placement.element_range(s.shape, r)), plane))
                counts.append(tuple(row))
            T = max((sum(row) for row in counts), default=0)
            self.layouts[plane] = ScaleLayout(lay.world_size, lay.rank, T, tuple(counts), slots, geoms,
                                              base.starts, base.pieces)
        self._index: dict[tuple[str, torch.device], torch.Tensor] = {}

    def index(self, plane: str, device: torch.device) -> torch.Tensor:
        key = (plane, device)
        if key not in self._index:
            self._index[key] = self.layouts[plane].gather_index(device)
        return self._index[key]


def _count(piece: tuple[int, int, int], plane: str) -> int:
    n, rows, _ = piece
    return 0 if not n or not rows else int(torch.Size(mx_scale_shape(piece, plane)).numel())


def attach_mx(buf: DBuffer, policy: MXFP8) -> None:
    """Mark every tensor of ``buf`` as gathered in MXFP8 (checks that no rank cuts a tile)."""
    buf.set_gather_quant(MXState(policy, buf))


def mx_wire_bytes(buf: DBuffer, plane: str) -> int:
    """Bytes one gather of ``plane`` puts into this rank (codes + scales, own share included)."""
    lay = buf.quant.layouts[plane]
    return buf.layout.world_size * buf.segment + lay.total


def mx_all_gather(device: Device, comm: Comm, buf: DBuffer, plane: str, after: Pending | None = None) -> Pending:
    """Gather ``plane`` of ``buf`` (``after``: offload's copy of the host segment to the device)."""
    q: MXState = buf.quant
    lay, pol = q.layouts[plane], q.policy
    W, r, S, T = comm.world_size, comm.rank, buf.segment, lay.per_rank
    out = buf.alloc_unsharded()
    version = out._version
    dev = buf.device
    codes = torch.empty(W * S, dtype=torch.uint8, device=dev)
    scales = torch.empty(W * T, dtype=torch.uint8, device=dev)
    offsets = lay.local_offsets()
    src = buf.staged if buf.host_sharded else buf.sharded  # offload: the device copy of the host segment

    def issue(async_op: bool):
        mine, my_scales = codes.narrow(0, r * S, S), scales.narrow(0, r * T, T)
        mine.zero_()  # padding between tensors: defined bytes on the wire
        my_scales.zero_()
        for j, i in enumerate(lay.slots):
            s = buf.slots[i]
            piece = lay.starts[j]
            if not s.local_numel:
                continue
            mx_quantize_piece(
                src.narrow(0, s.local_offset, s.local_numel).view(piece), plane, pol.scaling,
                mine.narrow(0, s.local_offset, s.local_numel).view(piece),
                my_scales.narrow(0, offsets[j], lay.tiles[r][j]).view(mx_scale_shape(piece, plane)),
            )
        if W == 1:
            return None
        w1 = all_gather_single(codes, mine, group=comm.group, async_op=async_op)
        w2 = all_gather_single(scales, my_scales, group=comm.group, async_op=async_op) if T else None
        return AllWork(w1, w2)

    def post():
        ordered = scales.index_select(0, q.index(plane, scales.device))  # tensor after tensor
        at = 0
        with torch.no_grad(), preserve_version_counter(out):
            for j, i in enumerate(lay.slots):
                s = buf.slots[i]
                piece = lay.pieces[j]
                k = _count(piece, plane) if s.numel else 0
                c = codes.narrow(0, s.offset, s.numel).view(piece)
                e = ordered.narrow(0, at, k).view(mx_scale_shape(piece, plane))
                mx_dequantize_piece(c, e, plane, out.narrow(0, s.offset, s.numel).view(piece))
                if pol.on_gathered is not None:
                    pol.on_gathered(s.key, plane, c.view(s.shape), e.view(*s.shape[:-2], *mx_scale_shape((1, *s.shape[-2:]), plane)[1:]))
                at += k
        set_version_counter((out,), (version,))

    return device.launch("all_gather", issue, post=post, keep=(out, codes, scales, src),
                         out=(out, codes, scales), after=after)
