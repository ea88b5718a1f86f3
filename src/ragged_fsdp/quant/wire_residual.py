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

Two rules keep a bad step from lasting (docs/gradient-reduce.md, "Error feedback and bad
steps"):

* a residual element that comes out non-finite (a NaN or inf gradient, or a block whose
  scale overflowed) is stored as zero and counted in :attr:`Residual.dropped`: a NaN step
  costs that step's error feedback, never the later steps' gradients;
* :meth:`Residual.keep` stages the new residual; :meth:`Residual.commit` (the end of a
  backward that completed) makes it the residual, :meth:`Residual.discard` (a backward that
  raised) drops it, so the residual is the one of the last completed backward. The staged
  copy exists from the buffer's reduction to the end of its backward.

The committed residual lives in one flat tensor (and, for int8 storage, one flat run of
scales padded to :attr:`Residual.scale_width`); its pieces are views into them, and
:meth:`Residual.commit` copies the staged residual in. So :meth:`Residual.flat` hands out
the live storage itself: the model's ``state_dict()`` entry is a view of it, and a load that
writes into the state dict in place (``load_local(model.state_dict(), d)``, ``dcp.load``)
writes the residual the next step uses.
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
        total = int(blocks.lengths.numel())
        # int8 storage: scales per rank in a state dict, the most any rank keeps (equal shapes on every rank)
        self.scale_width = max(total - k for k in blocks.per_segment) if store is torch.int8 else 0
        self._values = torch.zeros(sum(b - a for a, b, _, _ in self.spans), dtype=store, device=device)
        self.values = list(torch.split(self._values, [b - a for a, b, _, _ in self.spans]))
        # int8 storage: the wire scale each piece's codes were taken against
        self._scales = torch.zeros(self.scale_width, dtype=torch.float32, device=device) if store is torch.int8 else None
        self.scales = None
        if self._scales is not None:
            widths = [hi - lo for _, _, lo, hi in self.spans]
            self.scales = list(torch.split(self._scales, widths + [self.scale_width - sum(widths)]))[:len(widths)]
        # keep()'s result until commit() or discard() (None: nothing staged)
        self.staged: tuple[list[torch.Tensor], list[torch.Tensor] | None] | None = None
        # non-finite residual elements stored as zero so far (a device tensor: counting
        # costs no host sync; read it with int())
        self.dropped = torch.zeros((), dtype=torch.int64, device=device)

    @property
    def nbytes(self) -> int:
        """Bytes of the committed residual (a staged one, during backward, doubles it)."""
        return sum(v.nbytes for v in self.values) + sum(s.nbytes for s in self.scales or ())

    def _current(self) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        return self.staged if self.staged is not None else (self.values, self.scales)

    def _decoded(self, i: int, dtype: torch.dtype) -> torch.Tensor:
        values, scales = self._current()
        v = values[i]
        if scales is None:
            return v.to(dtype)
        _, _, lo, hi = self.spans[i]
        step = scales[i] / RESIDUAL_STEPS
        return v.to(dtype) * torch.repeat_interleave(step, self.lengths[lo:hi], output_size=v.numel()).to(dtype)

    def add_into(self, x: torch.Tensor) -> None:
        """``x += residual`` at the other ranks' segments (``x``: the unsharded gradient);
        the staged residual when one is (a second reduction of the buffer in one backward)."""
        for i, (a, b, _, _) in enumerate(self.spans):
            x[a:b].add_(self._decoded(i, x.dtype))

    def keep(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None) -> None:
        """Stage what the wire drops from ``x`` (``codes``, ``scale``: its quantisation) at
        the other ranks' segments; non-finite elements are staged as zero and counted."""
        values, scales = [], ([] if self.scales is not None else None)
        for i, (a, b, lo, hi) in enumerate(self.spans):
            sc = None if scale is None else scale[lo:hi]
            r = x[a:b] - dequantize(codes[a:b], sc, self.lengths[lo:hi], x.dtype, self.fmt)
            bad = ~torch.isfinite(r)
            self.dropped += bad.sum()
            r = r.masked_fill_(bad, 0.0)
            if scales is None:
                values.append(r.to(self.fmt.residual_dtype))
                continue
            # a block whose scale is not finite has only zeros left (masked above): keep its
            # scale at 0, or decoding 0 * inf would bring the NaN back
            sc = torch.where(torch.isfinite(sc), sc, torch.zeros_like(sc))
            step = torch.where(sc > 0, sc, torch.ones_like(sc)) / RESIDUAL_STEPS
            y = r.float() / torch.repeat_interleave(step, self.lengths[lo:hi], output_size=r.numel())
            values.append(y.round_().clamp_(-127, 127).to(torch.int8))
            scales.append(sc.clone())
        self.staged = (values, scales)

    # -- as training state (the model's state dict, fsdp/core/residual_state.py) ----------
    @property
    def numel(self) -> int:
        """Elements of the residual: the other ranks' segments, ``(W - 1) * S``."""
        return sum(b - a for a, b, _, _ in self.spans)

    @property
    def n_scales(self) -> int:
        """int8 storage: the scales kept (the other ranks' blocks); 0 for float storage."""
        return 0 if self.scales is None else sum(hi - lo for _, _, lo, hi in self.spans)

    def flat(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The committed residual's storage, not a copy: one run of ``numel`` stored values,
        the pieces in buffer order (and, for int8 storage, the ``n_scales`` scales padded
        with zeros to :attr:`scale_width`). Writing into them writes the residual."""
        return self._values, self._scales

    def load_flat(self, values: torch.Tensor | None, scales: torch.Tensor | None = None) -> None:
        """Make ``values`` (and ``scales``), as :meth:`flat` gives them, the committed
        residual; ``None``: a zero residual. Loading :meth:`flat`'s own tensors is a no-op."""
        self.staged = None
        if values is None:
            self._values.zero_()
            if self._scales is not None:
                self._scales.zero_()
            return
        for dst, src in ((self._values, values), (self._scales, scales)):
            if dst is None or src is None or src.data_ptr() == dst.data_ptr():
                continue
            dst[:min(dst.numel(), src.numel())].copy_(src.reshape(-1)[:dst.numel()])

    def rescale(self, factor: float) -> None:
        """Multiply the residual by ``factor`` (a loss scale changed: the residual is in the
        old scale's units). Exact for a power of two (int8 storage: its scales are
        multiplied, the codes stay). ``factor``: finite and positive (checked by the
        caller); an element that overflows is stored as zero and counted in :attr:`dropped`,
        as a non-finite residual from a step is."""
        values, scales = self._current()
        for t in scales if scales is not None else values:
            t.mul_(factor)
            bad = ~torch.isfinite(t)
            self.dropped += bad.sum()
            t.masked_fill_(bad, 0.0)

    def commit(self) -> None:
        """The backward that staged a residual completed: it is the residual now (copied
        into the storage :meth:`flat` hands out)."""
        if self.staged is not None:
            values, scales = self.staged
            for v, new in zip(self.values, values):
                v.copy_(new)
            for sc, new in zip(self.scales or (), scales or ()):
                sc.copy_(new)
            self.staged = None

    def discard(self) -> None:
        """The backward that staged a residual raised: back to the last committed one."""
        self.staged = None
