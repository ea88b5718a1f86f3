"""Gradients on the wire in fewer bytes, summed in fp32: the block math (pure, no process group).

A DBuffer's unsharded gradient (``W*S`` elements in the reduce dtype) is cut into blocks:
each tensor's granularity units (the planner's blocks, whole inside one rank's segment by
construction), merged into runs of at least ``block_size`` elements when the units are
small (a bias or a norm weight has one-element units), cut into consecutive blocks of
``block_size`` elements (the last of a unit shorter) when a unit is larger (a row group of
``rows:128``, a matrix placed whole), and the padding between tensors as blocks of its own.
The blocks tile ``[0, W*S)`` in order, and every segment boundary is a block boundary, so
the blocks of segment ``k`` are a contiguous run of the list: they travel to rank ``k`` with
their codes and scales together, and no block has two owners.

Formats (:class:`GradientReduce`'s ``wire_dtype``):

* ``torch.bfloat16``: every element rounded to bf16; no scales;
* ``torch.int8``: ``code = round(x / scale)`` with ``scale = absmax(block) / 127``;
* ``torch.float8_e4m3fn``: ``code = fp8(x / scale)`` with ``scale = absmax(block) / 448``.

One fp32 scale per block. The receiver dequantises every other rank's piece of its segment
in the reduce dtype, takes its own piece exact (it never travels, so it is never quantised:
every format, whatever ``W``) and sums the ``W`` pieces in rank order (:func:`sum_pieces`),
so the sum is fp32 whatever the wire carried. The same functions run in the engine and in a
single-process reference. Error feedback's residual is :mod:`.wire_residual`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GradientReduce", "WireBlocks", "wire_blocks", "quantize", "dequantize", "sum_pieces",
           "wire_bytes", "reference_reduce", "unit_elements", "WIRE_DTYPES", "RESIDUAL_DTYPES", "DEFAULT_BLOCK"]

WIRE_DTYPES = (torch.bfloat16, torch.int8, torch.float8_e4m3fn)
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
RESIDUAL_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
# error feedback's residual storage when residual_dtype is left out: the cheapest that keeps
# the accumulated error at fp32 storage's (docs/gradient-reduce.md, "Residual storage")
_DEFAULT_RESIDUAL = {torch.int8: torch.int8, torch.bfloat16: torch.bfloat16, torch.float8_e4m3fn: torch.bfloat16}
# GradientReduce.block_size's default: small units are merged until a block has this many
# elements, larger units cut into blocks of this many (scale overhead 4 bytes per block)
DEFAULT_BLOCK = 128


def check_block_size(where: str, block_size) -> int:
    """``block_size`` as an int >= 1, or a ValueError naming it and the fix (``True`` is an
    int to Python, and a mistake here)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{where}: block_size={block_size!r}; pass an int >= 1, the elements per scale block "
                         f"(default {DEFAULT_BLOCK})")
    return block_size


@dataclass(frozen=True)
class GradientReduce:
    """How ``fully_shard`` sends gradients to their owners: ``wire_dtype`` on the wire, the
    sum in ``MixedPrecisionPolicy.reduce_dtype`` (which must then be fp32) on the rank that
    owns the segment. ``error_feedback``: keep what the quantisation dropped from the pieces
    this rank sent and add it to the next step's gradient before quantising again.
    ``residual_dtype``: that residual's storage (:mod:`.wire_residual`): ``torch.float32``,
    ``torch.bfloat16`` or, for the int8 wire, ``torch.int8`` (codes against each block's wire
    scale); left out, int8 for the int8 wire and bf16 for the others. It holds ``(W - 1) / W``
    of the unsharded gradient per DBuffer per rank. ``block_size``: the elements per scale
    block of the int8 and fp8 wires (:func:`wire_blocks`): one fp32 scale, 4 bytes, per
    block; smaller blocks follow the gradient's magnitudes more closely at more bytes."""

    wire_dtype: torch.dtype = torch.bfloat16
    error_feedback: bool = False
    residual_dtype: torch.dtype | None = None
    block_size: int = DEFAULT_BLOCK

    def __post_init__(self):
        if self.wire_dtype not in WIRE_DTYPES:
            names = ", ".join(str(d) for d in WIRE_DTYPES)
            raise ValueError(f"GradientReduce: wire_dtype={self.wire_dtype!r}; choose one of {names}")
        check_block_size("GradientReduce", self.block_size)
        if not isinstance(self.error_feedback, bool):
            raise TypeError(f"GradientReduce: error_feedback must be a bool, got {self.error_feedback!r}")
        res = self.residual_dtype
        if res is None:
            if self.error_feedback:  # resolved here, so equal formats compare equal
                object.__setattr__(self, "residual_dtype", _DEFAULT_RESIDUAL[self.wire_dtype])
            return
        if not self.error_feedback:
            raise ValueError(f"GradientReduce: residual_dtype={res} is the error-feedback residual's storage, and "
                             "error_feedback is False; pass error_feedback=True or leave residual_dtype out")
        if res not in RESIDUAL_DTYPES:
            names = ", ".join(str(d) for d in RESIDUAL_DTYPES)
            raise ValueError(f"GradientReduce: residual_dtype={res!r}; choose one of {names}")
        if res is torch.int8 and self.wire_dtype is not torch.int8:
            raise ValueError(
                f"GradientReduce: residual_dtype=torch.int8 keeps the residual as codes of the int8 wire's block "
                f"scale (|r| <= scale / 2); the {self.wire_dtype} wire's rounding error is bounded per element, not "
                "by a block scale: use residual_dtype=torch.bfloat16 (or torch.float32), or wire_dtype=torch.int8")

    @property
    def scaled(self) -> bool:
        return self.wire_dtype in _QMAX


@dataclass(frozen=True)
class WireBlocks:
    """The blocks of one DBuffer: ``lengths`` (int64, tiling ``[0, W*S)``) and, per segment,
    how many of them it holds (``per_segment[k]``, a contiguous run starting at
    ``starts[k]``)."""

    world_size: int
    segment: int
    lengths: torch.Tensor
    per_segment: tuple[int, ...]

    @property
    def starts(self) -> tuple[int, ...]:
        out, n = [], 0
        for c in self.per_segment:
            out.append(n)
            n += c
        return tuple(out)

    def of_segment(self, k: int) -> torch.Tensor:
        return self.lengths[self.starts[k]:self.starts[k] + self.per_segment[k]]


def unit_elements(slot) -> int:
    """Elements per granularity unit of a layout slot (its RaggedShard's unit)."""
    pl, shape = slot.placement, slot.shape
    k = len(pl.dims)
    if k == 0:
        return max(1, slot.numel)
    inner = 1
    for d in shape[k:]:
        inner *= d
    return max(1, pl.unit * inner)


def _unit_cut(g: int, block_size: int) -> list[int]:
    """The blocks one unit of ``g`` elements is cut into (a unit of at most ``block_size``
    elements is one piece)."""
    full, rest = divmod(g, block_size)
    return [block_size] * full + ([rest] if rest else [])


def wire_blocks(layout, block_size: int = DEFAULT_BLOCK) -> WireBlocks:
    """The blocks of a ``BufferLayout`` (any rank's: the plan is the same on every rank).

    Inside each tensor's run in one segment: units of fewer than ``block_size`` elements
    merged, whole, into blocks of at least ``block_size`` (the run's last block may be
    shorter); a unit of more cut into consecutive blocks of ``block_size`` (its last one
    shorter). Padding: one block per stretch inside one segment. No block crosses a segment
    boundary (the planner never lets one cut a unit)."""
    check_block_size("wire_blocks", block_size)
    W, S = layout.world_size, layout.segment
    pieces: list[torch.Tensor] = []
    per = [0] * W

    def emit(seg: int, lengths: list[int] | torch.Tensor) -> None:
        t = lengths if isinstance(lengths, torch.Tensor) else torch.tensor(lengths, dtype=torch.int64)
        pieces.append(t)
        per[seg] += int(t.numel())

    def gap(a: int, b: int) -> None:
        while a < b:  # padding, cut at segment boundaries
            e = min(b, (a // S + 1) * S)
            emit(a // S, [e - a])
            a = e

    pos = 0
    for slot in sorted(layout.slots, key=lambda s: s.offset):
        gap(pos, slot.offset)
        g, n = unit_elements(slot), slot.numel
        a, end = slot.offset, slot.offset + n
        while a < end:
            seg_end = min(end, (a // S + 1) * S)  # units never straddle this (the planner's rule)
            run, seg = seg_end - a, a // S
            if g > block_size:  # each unit cut; a tensor's last unit may be shorter than g
                units, tail = divmod(run, g)
                if units:
                    emit(seg, torch.tensor(_unit_cut(g, block_size), dtype=torch.int64).repeat(units))
                if tail:
                    emit(seg, _unit_cut(tail, block_size))
            else:  # whole units merged until a block has >= block_size elements
                step = g * -(-block_size // g)
                full, rest = divmod(run, step)
                if full:
                    emit(seg, torch.full((full,), step, dtype=torch.int64))
                if rest:
                    emit(seg, [rest])
            a = seg_end
        pos = end
    gap(pos, W * S)
    lengths = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
    return WireBlocks(W, S, lengths, tuple(per))


def _safe(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize(x: torch.Tensor, lengths: torch.Tensor, fmt: GradientReduce) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` (1-D, covered by the blocks ``lengths``) as wire codes (and one fp32 scale per
    block for the scaled formats)."""
    if not fmt.scaled:
        return x.to(fmt.wire_dtype), None
    amax = torch.segment_reduce(x.abs().float(), "max", lengths=lengths, unsafe=True).clamp_min_(0.0)
    scale = amax / _QMAX[fmt.wire_dtype]
    y = x.float() / torch.repeat_interleave(_safe(scale), lengths, output_size=x.numel())
    if fmt.wire_dtype is torch.int8:
        codes = y.round_().clamp_(-127, 127).to(torch.int8)
    else:
        codes = y.to(fmt.wire_dtype)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor | None, lengths: torch.Tensor, dtype: torch.dtype,
               fmt: GradientReduce) -> torch.Tensor:
    """Codes of the blocks ``lengths`` back to ``dtype`` (the reduce dtype)."""
    if not fmt.scaled:
        return codes.to(dtype)
    return codes.to(dtype) * torch.repeat_interleave(scale, lengths, output_size=codes.numel()).to(dtype)


def sum_pieces(pieces: torch.Tensor) -> torch.Tensor:
    """The sum of the dequantised pieces, ``(W, S)`` in rank order, in their dtype: the one
    op the engine and a reference both call, so the same inputs give the same bits."""
    return pieces.sum(dim=0)


def wire_bytes(blocks: WireBlocks, fmt: GradientReduce, rank: int) -> tuple[int, int]:
    """Bytes this rank sends and receives in one reduction (codes plus scales, the pieces
    of other ranks only)."""
    W, S = blocks.world_size, blocks.segment
    item = torch.empty((), dtype=fmt.wire_dtype).element_size()
    codes = (W - 1) * S * item
    if not fmt.scaled:
        return codes, codes
    sent = 4 * (int(blocks.lengths.numel()) - blocks.per_segment[rank])
    received = 4 * (W - 1) * blocks.per_segment[rank]
    return codes + sent, codes + received


def reference_reduce(grads: list[torch.Tensor], layout, fmt: GradientReduce, rank: int | None,
                     divide_factor: float | None = None, residuals: list | None = None):
    """What rank ``rank``'s segment gets when the ranks' unsharded gradients are ``grads``,
    computed in one process with the same block math (the tests' reference): every other
    rank's piece quantised and dequantised, ``rank``'s own piece exact. ``rank=None``: every
    rank's segment, as a list (one quantisation per rank, as in the engine). ``residuals``:
    each rank's :class:`~ragged_fsdp.quant.wire_residual.Residual`, updated in place once."""
    blocks = wire_blocks(layout, fmt.block_size)
    W, S = blocks.world_size, blocks.segment
    sent = []
    for k, g in enumerate(grads):
        x = g.clone()
        if residuals is not None:
            residuals[k].add_into(x)
        codes, scale = quantize(x, blocks.lengths, fmt)
        if residuals is not None:
            residuals[k].keep(x, codes, scale)
        sent.append((x, codes, scale))
    out = []
    for r in range(W) if rank is None else (rank,):
        seg, first, n = slice(r * S, (r + 1) * S), blocks.starts[r], blocks.per_segment[r]
        if fmt.scaled:
            deq = dequantize(torch.cat([c[seg] for _, c, _ in sent]), torch.cat([sc[first:first + n] for *_, sc in sent]),
                             blocks.of_segment(r).repeat(W), grads[0].dtype, fmt).view(W, S)
        else:
            deq = torch.stack([c[seg] for _, c, _ in sent]).to(grads[0].dtype)
        deq[r].copy_(sent[r][0][seg])  # the own piece never travels
        # the divide as the engine lands it (one multiply by 1/factor, not a division)
        out.append(sum_pieces(deq).mul_(1.0 / float(divide_factor or W)))
    return out if rank is None else out[0]
