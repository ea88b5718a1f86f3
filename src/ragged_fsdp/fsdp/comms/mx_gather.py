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

``NVFP4()`` (``ragged_fsdp.quant.nvfp4``) takes the same path with 16x16 tiles and two
differences: before quantising, one all-reduce MAX over the gather's group agrees each
tensor's amax (its fp32 per-tensor scale, so the bits do not depend on W), and each rank's
E2M1 codes travel two per byte (``ceil(S/2)`` bytes per rank): about ``0.5 + 1/16`` bytes per
element, plus 4 bytes per tensor for the amax.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ragged_fsdp.comm import all_gather_single
from ragged_fsdp.dbuffer import DBuffer
from ragged_fsdp.quant import ScaleLayout
from ragged_fsdp.quant.mxfp8 import MXFP8, PLANES, mx_dequantize_piece, mx_quantize_piece
from ragged_fsdp.quant.nvfp4 import (
    NVFP4, nv_dequantize_piece, nv_per_tensor_scale, nv_quantize_piece, pack_nibbles, unpack_nibbles,
)

from ..torch_private import preserve_version_counter, set_version_counter
from .collectives import Comm
from .device import AllWork, Device, Pending

__all__ = ["MXState", "attach_mx", "mx_all_gather", "mx_wire_bytes"]


class MXState:
    """What an MXFP8- or NVFP4-gathered DBuffer needs beyond its layout: per plane, where each
    rank's scales travel (a :class:`~ragged_fsdp.quant.ScaleLayout` counting that plane's scales)."""

    def __init__(self, policy: MXFP8 | NVFP4, buf: DBuffer):
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
                    row.append(_count(policy, g.piece_shape(*s.placement.element_range(s.shape, r)), plane))
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


def _count(pol, piece: tuple[int, int, int], plane: str) -> int:
    n, rows, _ = piece
    return 0 if not n or not rows else int(torch.Size(pol.scale_shape(piece, plane)).numel())


def attach_mx(buf: DBuffer, policy: MXFP8 | NVFP4) -> None:
    """Mark every tensor of ``buf`` as gathered in MXFP8 or NVFP4 (checks that no rank cuts a tile)."""
    buf.set_gather_quant(MXState(policy, buf))


def _code_bytes(pol, S: int) -> int:
    return -(-S // 2) if isinstance(pol, NVFP4) else S


def mx_wire_bytes(buf: DBuffer, plane: str) -> int:
    """Bytes one gather of ``plane`` puts into this rank (codes + scales, own share included;
    NVFP4: and its fp32 amax per tensor)."""
    q: MXState = buf.quant
    lay = q.layouts[plane]
    amax = 4 * len(lay.slots) if isinstance(q.policy, NVFP4) else 0
    return buf.layout.world_size * _code_bytes(q.policy, buf.segment) + lay.total + amax


def _agreed_scales(comm: Comm, buf: DBuffer, src: torch.Tensor, slots) -> torch.Tensor:
    """NVFP4: each tensor's fp32 per-tensor scale from the amax of the whole tensor (its
    pieces' amaxes, one all-reduce MAX over the ranks; max is exact, so any W agrees)."""
    amax = torch.zeros(len(slots), dtype=torch.float32, device=src.device)
    for j, i in enumerate(slots):
        s = buf.slots[i]
        if s.local_numel:
            amax[j] = src.narrow(0, s.local_offset, s.local_numel).abs().amax().float()
    if comm.world_size > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=comm.group)
    return nv_per_tensor_scale(amax)


def mx_all_gather(device: Device, comm: Comm, buf: DBuffer, plane: str, after: Pending | None = None) -> Pending:
    """Gather ``plane`` of ``buf`` (``after``: offload's copy of the host segment to the device)."""
    q: MXState = buf.quant
    lay, pol = q.layouts[plane], q.policy
    nv = isinstance(pol, NVFP4)
    W, r, S, T = comm.world_size, comm.rank, buf.segment, lay.per_rank
    P = _code_bytes(pol, S)  # bytes of one rank's codes on the wire
    out = buf.alloc_unsharded()
    version = out._version
    dev = buf.device
    codes = torch.empty(W * S, dtype=torch.uint8, device=dev)
    wire = torch.empty(W * P, dtype=torch.uint8, device=dev) if nv else codes
    scales = torch.empty(W * T, dtype=torch.uint8, device=dev)
    offsets = lay.local_offsets()
    src = buf.staged if buf.host_sharded else buf.sharded  # offload: the device copy of the host segment
    pts: list[torch.Tensor] = []  # NVFP4: the agreed per-tensor scales, for post

    def issue(async_op: bool):
        mine, my_scales = codes.narrow(0, r * S, S), scales.narrow(0, r * T, T)
        mine.zero_()  # padding between tensors: defined bytes on the wire
        my_scales.zero_()
        if nv:
            pts.append(_agreed_scales(comm, buf, src, lay.slots))
        for j, i in enumerate(lay.slots):
            s = buf.slots[i]
            piece = lay.starts[j]
            if not s.local_numel:
                continue
            x = src.narrow(0, s.local_offset, s.local_numel).view(piece)
            c = mine.narrow(0, s.local_offset, s.local_numel).view(piece)
            e = my_scales.narrow(0, offsets[j], lay.tiles[r][j]).view(pol.scale_shape(piece, plane))
            if nv:
                nv_quantize_piece(x, plane, pts[0][j], c, e)
            else:
                mx_quantize_piece(x, plane, pol.scaling, c, e)
        my_wire = wire.narrow(0, r * P, P)
        if nv:
            pack_nibbles(mine, my_wire)
        if W == 1:
            return None
        w1 = all_gather_single(wire, my_wire, group=comm.group, async_op=async_op)
        w2 = all_gather_single(scales, my_scales, group=comm.group, async_op=async_op) if T else None
        return AllWork(w1, w2)

    def post():
        if nv:  # unpack every rank's codes into its segment of ``codes``
            codes.view(W, S).copy_(torch.stack([unpack_nibbles(p, S) for p in wire.view(W, P)]))
        ordered = scales.index_select(0, q.index(plane, scales.device))  # tensor after tensor
        at = 0
        with torch.no_grad(), preserve_version_counter(out):
            for j, i in enumerate(lay.slots):
                s = buf.slots[i]
                piece = lay.pieces[j]
                k = _count(pol, piece, plane) if s.numel else 0
                c = codes.narrow(0, s.offset, s.numel).view(piece)
                e = ordered.narrow(0, at, k).view(pol.scale_shape(piece, plane))
                o = out.narrow(0, s.offset, s.numel).view(piece)
                if nv:
                    nv_dequantize_piece(c, e, pts[0][j], plane, o)
                else:
                    mx_dequantize_piece(c, e, plane, o)
                if pol.on_gathered is not None:
                    full_scales = e.view(*s.shape[:-2], *pol.scale_shape((1, *s.shape[-2:]), plane)[1:])
                    extra = (pts[0][j],) if nv else ()
                    pol.on_gathered(s.key, plane, c.view(s.shape), full_scales, *extra)
                at += k
        set_version_counter((out,), (version,))

    return device.launch("all_gather", issue, post=post, keep=(out, codes, wire, scales, src),
                         out=(out, codes, wire, scales), after=after)
