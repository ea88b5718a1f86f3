"""Error feedback's residual for the gradient wire (pure, no process group).

A rank's residual is what quantisation dropped from the pieces it *sent*: the other ranks'
segments of its unsharded gradient. Its own segment never travels and is summed exact
(:func:`~ragged_fsdp.quant.grad_wire.reference_reduce`), so it has no residual. The residual
has to stay on the sender: it is a function of this rank's local gradient, which is freed
after the reduction and which no other rank ever sees (the owner receives only the codes).
So it is ``(W - 1) * S`` elements per DBuffer per rank, ``(W - 1) / W`` of the unsharded
gradient, whatever the storage.

Storage (``GradientReduce.residual_dtype``), bytes per residual element:

* ``torch.float32``: 4, exact;
* ``torch.bfloat16``: 2; one bf16 rounding of the residual (relative 2**-9 of it);
* ``torch.int8`` (int8 wire only): 1 plus one fp32 per block (``block_size`` elements). Rounding to nearest gives
  ``|r| <= scale / 2`` for every element of a block whose wire scale is ``scale``, so
  ``r`` is kept as ``round(r / (scale / 254))`` in ``[-127, 127]`` with that scale: an error
  of at most ``scale / 508`` per element, 1/254 of the wire's own step. The fp8 and bf16
  wires' rounding errors are bounded per element (relative to the element), not by a
  block's scale, so int8 storage is refused for them.

What storage drops is not fed back: it is the part of the error that accumulates.
"""

from __future__ import annotations

import torch

from .grad_wire import GradientReduce, WireBlocks, dequantize

__all__ = ["Residual", "RESIDUAL_STEPS", "residual_bytes_per_element"]

RESIDUAL_STEPS = 254.0  # int8 storage: the residual step is scale / 254 (|r| <= scale / 2 = 127 steps)


def residual_bytes_per_element(fmt: GradientReduce) -> float:
    """Bytes of storage per residual element (int8: the codes plus one fp32 per block of the
    format's ``block_size`` elements)."""
    if not fmt.error_feedback:
        return 0.0
    if fmt.residual_dtype is torch.int8:
        return 1.0 + 4.0 / fmt.block_size
    return float(torch.empty((), dtype=fmt.residual_dtype).element_size())


class Residual:
    """The residual of rank ``rank`` for one DBuffer's blocks, stored as ``fmt.residual_dtype``:
    two pieces, the segments before this rank's and those after it (element range and
    block range of each)."""

    def __init__(self, blocks: WireBlocks, rank: int, fmt: GradientReduce, device=None):
        if not fmt.error_feedback:
            raise ValueError("Residual: the format has error_feedback=False")
        W, S = blocks.world_size, blocks.segment
        first, n = blocks.starts[rank], blocks.per_segment[rank]
        self.fmt, self.lengths = fmt, blocks.lengths
        spans = ((0, rank * S, 0, first), ((rank + 1) * S, W * S, first + n, int(blocks.lengths.numel())))
        self.spans = [s for s in spans if s[1] > s[0]]
        store = fmt.residual_dtype
        self.values = [torch.zeros(b - a, dtype=store, device=device) for a, b, _, _ in self.spans]
        # int8 storage: the wire scale each piece's codes were taken against
        self.scales = ([torch.zeros(hi - lo, dtype=torch.float32, device=device) for _, _, lo, hi in self.spans]
                       if store is torch.int8 else None)

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.values) + sum(s.nbytes for s in self.scales or ())

    def _decoded(self, i: int, dtype: torch.dtype) -> torch.Tensor:
        v = self.values[i]
        if self.scales is None:
            return v.to(dtype)
        _, _, lo, hi = self.spans[i]
        step = self.scales[i] / RESIDUAL_STEPS
        return v.to(dtype) * torch.repeat_interleave(step, self.lengths[lo:hi], output_size=v.numel()).to(dtype)

    def add_into(self, x: torch.Tensor) -> None:
        """``x += residual`` at the other ranks' segments (``x``: the unsharded gradient)."""
        for i, (a, b, _, _) in enumerate(self.spans):
            x[a:b].add_(self._decoded(i, x.dtype))

    def keep(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None) -> None:
        """Store what the wire drops from ``x`` (``codes``, ``scale``: its quantisation) at
        the other ranks' segments."""
        for i, (a, b, lo, hi) in enumerate(self.spans):
            sc = None if scale is None else scale[lo:hi]
            r = x[a:b] - dequantize(codes[a:b], sc, self.lengths[lo:hi], x.dtype, self.fmt)
            if self.scales is None:
                self.values[i].copy_(r)
                continue
            self.scales[i].copy_(sc)
            step = torch.where(sc > 0, sc, torch.ones_like(sc)) / RESIDUAL_STEPS
            y = r.float() / torch.repeat_interleave(step, self.lengths[lo:hi], output_size=r.numel())
            self.values[i].copy_(y.round_().clamp_(-127, 127))
