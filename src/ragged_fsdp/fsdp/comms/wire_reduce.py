"""The reduce-scatter of :class:`~ragged_fsdp.quant.grad_wire.GradientReduce`: low-precision
pieces on the wire, the sum in the reduce dtype (fp32) on the segment's owner.

Each rank quantises its whole unsharded gradient block by block (the blocks of
:func:`~ragged_fsdp.quant.grad_wire.wire_blocks`, none shared by two segments), sends every
other rank the codes of that rank's segment with their scales in two ``all_to_all_single``
(equal splits for the codes, uneven for the scales: segments hold different numbers of
blocks), and dequantises the other ranks' pieces of its own segment and sums them with its
own piece, exact (it never travels, so it is never rounded), in rank order. NCCL would sum a
bf16 or int8 reduce-scatter in that dtype; this sums in fp32 whatever the wire.

Error feedback keeps, per rank, what quantisation dropped from the pieces it sent to the
other ranks (:class:`~ragged_fsdp.quant.wire_residual.Residual`, ``(W - 1) / W`` of the
unsharded gradient in ``residual_dtype``) and adds it to the next reduction's gradient first.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from ragged_fsdp.quant.grad_wire import GradientReduce, WireBlocks, dequantize, quantize, sum_pieces, wire_blocks
from ragged_fsdp.quant.wire_residual import Residual

from .collectives import Comm
from .landing import land
from ...device import AllWork, Device, Pending

__all__ = ["WireState", "wire_reduce_scatter", "check_wire_reduce_dtype"]


class WireState:
    """What one DBuffer keeps for its wire reductions: the blocks of its layout (pure, made
    once) and the error-feedback residual."""

    def __init__(self, layout, fmt: GradientReduce):
        self.fmt, self.rank = fmt, layout.rank
        self.blocks: WireBlocks = wire_blocks(layout, fmt.block_size)
        self.mine = self.blocks.of_segment(layout.rank)
        self.residual: Residual | None = None

    def residual_for(self, grad: torch.Tensor) -> Residual | None:
        return self.residual_on(grad.device)

    def residual_on(self, device) -> Residual | None:
        """The residual (made, zero, at the first reduction or state-dict access on ``device``);
        None without error feedback."""
        if not self.fmt.error_feedback:
            return None
        if self.residual is None:
            self.residual = Residual(self.blocks, self.rank, self.fmt, device=device)
        return self.residual


def _as_wire(t: torch.Tensor) -> torch.Tensor:
    # gloo has no fp8 dtype: its bytes travel as uint8 (a view, no copy)
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def wire_reduce_scatter(device: Device, comm: Comm, grad: torch.Tensor, target: torch.Tensor, accumulate: bool,
                        divide_factor: float | None, state: WireState,
                        lane: str = "reduce_scatter") -> Pending:
    """``target (+)= sum over ranks of dequant(quant(grad piece)) / factor`` for this rank's
    segment (``factor``: ``divide_factor`` or the world size)."""
    W, r, S = comm.world_size, comm.rank, target.numel()
    fmt, blocks = state.fmt, state.blocks
    factor = float(divide_factor or W)
    residual = state.residual_for(grad)
    x = grad
    if residual is not None:
        x = grad.clone()
        residual.add_into(x)  # the other ranks' segments only: this rank's own has no residual
    codes, scale = quantize(x, blocks.lengths, fmt)
    if residual is not None:  # what this step's wire dropped comes back next step
        residual.keep(x, codes, scale)
    del x
    # this rank's piece of its own segment never travels: it is summed exact (the residual
    # adds nothing there, so it is grad's own segment)
    own = grad.narrow(0, r * S, S)
    recv_codes = torch.empty_like(codes)
    n_mine = blocks.per_segment[r]
    recv_scale = None if scale is None else torch.empty(W * n_mine, dtype=scale.dtype, device=scale.device)

    def issue(async_op: bool):
        if W == 1:
            recv_codes.copy_(codes)
            if scale is not None:
                recv_scale.copy_(scale)
            return None
        w1 = dist.all_to_all_single(_as_wire(recv_codes), _as_wire(codes), group=comm.group, async_op=async_op)
        w2 = None
        if scale is not None:
            w2 = dist.all_to_all_single(recv_scale, scale, output_split_sizes=[n_mine] * W,
                                        input_split_sizes=list(blocks.per_segment), group=comm.group,
                                        async_op=async_op)
        return AllWork(w1, w2)

    def post():
        pieces = recv_codes.view(W, S)
        if scale is None:
            deq = pieces.to(grad.dtype)
        else:
            lengths = state.mine.repeat(W)
            deq = dequantize(pieces.reshape(-1), recv_scale, lengths, grad.dtype, fmt).view(W, S)
        deq[r].copy_(own)
        land(sum_pieces(deq), target, accumulate, factor, scratch=True)

    keep = (grad, codes, recv_codes, target) + (() if scale is None else (scale, recv_scale))
    return device.launch(lane, issue, post=post, keep=keep, out=(recv_codes, target))


def check_wire_reduce_dtype(what: str, reduce_dtypes: Iterable[torch.dtype], fmt: GradientReduce) -> None:
    """The wire format's sum runs in the reduce dtype, which it needs to be fp32 (a bf16 sum
    of bf16 pieces is what the plain reduce-scatter already does)."""
    if not isinstance(fmt, GradientReduce):
        raise TypeError(f"fully_shard: gradient_reduce must be a ragged_fsdp.GradientReduce or None, got "
                        f"{type(fmt).__name__}")
    for dtype in reduce_dtypes:
        if dtype.is_floating_point and dtype != torch.float32:
            raise ValueError(
                f"fully_shard: gradient_reduce=GradientReduce(wire_dtype={fmt.wire_dtype}) sums in the reduce dtype, "
                f"which is {dtype} for {what}; pass mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32, ...)")
