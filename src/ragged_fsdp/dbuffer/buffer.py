"""DBuffer: the flat, distributed storage of one FSDP group (one dtype).

Four flat tensors, each one allocation, all laid out by the same :class:`BufferLayout`:

``sharded``
    ``S`` elements of this rank's segment in the parameters' own dtype; persistent. The
    sharded parameters' local tensors are views into it, so the optimizer updates it in
    place.
``unsharded``
    ``W*S`` elements in the compute dtype. Its storage is allocated right before the
    all-gather and freed (resized to zero bytes) right after use, so the per-tensor views
    (the unsharded parameters the module computes with) stay valid objects. At ``W == 1``
    with no dtype change it *is* the sharded segment: nothing to gather, nothing to free.
``grad``
    ``W*S`` elements in the reduce dtype, zeroed in one op when a backward needs it. The
    unsharded parameters' ``.grad`` are aliases into it, so autograd accumulates in place;
    each alias has its own version counter, which tells whether the tensor got a gradient.
``sharded grad``
    ``S`` elements in the parameters' dtype, made by the reduce-scatter; the sharded
    parameters' ``.grad`` are views into it. Created per reduction and owned by the grads,
    so dropping the grads (``zero_grad(set_to_none=True)``) frees it.

Casts, zeroing and scaling run once over a whole flat tensor, never per parameter.
"""

from __future__ import annotations

import torch

from .layout import BufferLayout
from .store import GradientHalf

__all__ = ["DBuffer"]


class DBuffer(GradientHalf):
    """Flat storage of one group of tensors of one dtype (see the module docstring)."""

    def __init__(
        self,
        layout: BufferLayout,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        compute_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
    ):
        self.layout = layout
        self.device = torch.device(device)
        self.dtype = dtype
        self.compute_dtype = compute_dtype or dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        self.sharded = torch.empty(layout.segment, dtype=dtype, device=self.device)
        if self.device.type != "meta":
            self.sharded.zero_()  # padding stays zero: whole-buffer ops never see garbage
        self._unsharded: torch.Tensor | None = None
        self._unsharded_views: list[torch.Tensor] | None = None
        self.grad: torch.Tensor | None = None
        self._grad_views: list[torch.Tensor] = []
        self._grad_versions: list[int] = []
        self.quant = None  # set_gather_quant (fully_shard(all_gather_quant=...)): gathered as codes + scales
        # offload_policy(params=True): the sharded segment lives on the host; ``staged`` is its
        # device copy while an all-gather reads it (see ragged_fsdp.fsdp.offload.staging)
        self.host_sharded = False
        self.staged: torch.Tensor | None = None

    # -- where the sharded segment lives (the only writers of ``sharded``, ``host_sharded``,
    # ``staged`` and ``quant`` after construction, besides ``rebuild``) ----------------------
    def replace_sharded(self, seg: torch.Tensor) -> None:
        """Hold the sharded segment in ``seg``, a copy of it in other memory (host or device,
        e.g. ``offload_to_host``); the caller re-points the sharded parameters at the new views."""
        if seg.numel() != self.segment or seg.dtype != self.dtype:
            raise ValueError(f"{self!r}: a sharded segment is {self.segment} elements of {self.dtype}, "
                             f"got {seg.numel()} of {seg.dtype}")
        self.sharded = seg

    def keep_on_host(self, host: torch.Tensor) -> None:
        """``offload_policy(params=True)``: the segment lives in host memory ``host`` from now
        on; each all-gather reads a device copy of it (:meth:`stage`)."""
        self.replace_sharded(host)
        self.host_sharded = True

    def stage(self, staged: torch.Tensor) -> None:
        """The device copy of a host segment that the next all-gather reads."""
        self.staged = staged

    def unstage(self) -> torch.Tensor | None:
        """Drop the device copy (its all-gather was waited for); returns it, or None."""
        staged, self.staged = self.staged, None
        return staged

    def set_gather_quant(self, state) -> None:
        """``fully_shard(all_gather_quant=...)``: gather this buffer as codes + scales
        (``state``: ``fsdp/comms/quant_gather.py``'s ``QuantState``)."""
        self.quant = state

    def sharded_view(self, i: int) -> torch.Tensor:
        return self.local_view(self.sharded, i)

    # -- filling the sharded segment -----------------------------------------------------
    @torch.no_grad()
    def copy_full_(self, i: int, full: torch.Tensor) -> None:
        """Copy this rank's piece of the full (unsharded) tensor ``full`` into slot ``i``."""
        s = self.slots[i]
        if tuple(full.shape) != s.shape:
            raise ValueError(f"{s.key}: expected the full shape {s.shape}, got {tuple(full.shape)}")
        if s.local_numel == 0 or full.device.type == "meta" or self.device.type == "meta":
            return
        a, _ = s.placement.element_range(s.shape, self.rank)
        piece = full.detach().reshape(-1).narrow(0, a, s.local_numel)
        self.sharded.narrow(0, s.local_offset, s.local_numel).copy_(piece)

    @torch.no_grad()
    def copy_local_(self, i: int, local: torch.Tensor) -> None:
        """Copy this rank's piece (already sliced) into slot ``i``."""
        s = self.slots[i]
        if local.numel() != s.local_numel:
            raise ValueError(f"{s.key}: expected {s.local_numel} local elements, got {local.numel()}")
        if s.local_numel == 0 or local.device.type == "meta" or self.device.type == "meta":
            return
        self.sharded.narrow(0, s.local_offset, s.local_numel).copy_(local.detach().reshape(-1))

    # -- the unsharded buffer ------------------------------------------------------------
    @property
    def aliased(self) -> bool:
        """True when the unsharded buffer is the sharded segment itself (``W == 1``, no cast,
        no quantisation)."""
        return self.world_size == 1 and self.compute_dtype == self.dtype and self.quant is None and not self.host_sharded

    @property
    def unsharded(self) -> torch.Tensor:
        if self.aliased:
            return self.sharded
        if self._unsharded is None:
            flat = torch.empty(self.layout.total, dtype=self.compute_dtype, device=self.device)
            self._unsharded = flat
            self._unsharded_views = self._views(flat)  # made while the storage exists
            self._free(flat)
        return self._unsharded

    @property
    def unsharded_allocated(self) -> bool:
        if self.aliased:
            return True
        return self._unsharded is not None and self._unsharded.untyped_storage().nbytes() > 0

    def unsharded_views(self) -> list[torch.Tensor]:
        """Full-shape views into the unsharded buffer, one per slot (made once)."""
        flat = self.unsharded  # makes the views when it makes the buffer
        if self._unsharded_views is None:  # aliased: views of the sharded segment
            self._unsharded_views = self._views(flat)
        return self._unsharded_views

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat.narrow(0, s.offset, s.numel).view(s.shape) for s in self.slots]

    def alloc_unsharded(self) -> torch.Tensor:
        flat = self.unsharded
        if not self.aliased and self.device.type != "meta":
            want = flat.numel() * flat.element_size()
            storage = flat.untyped_storage()
            if storage.nbytes() != want:
                storage.resize_(want)
        return flat

    def free_unsharded(self) -> None:
        if not self.aliased and self._unsharded is not None:
            self._free(self._unsharded)

    @staticmethod
    def _free(t: torch.Tensor) -> None:
        if t.device.type != "meta" and t.untyped_storage().nbytes() > 0:
            t.untyped_storage().resize_(0)

    def gather_input(self) -> torch.Tensor:
        """This rank's contribution to the all-gather: the sharded segment itself, or (when
        the compute dtype differs) its cast written into this rank's slot of the output. With
        the segment on the host, its device copy ``staged``."""
        src = self.staged if self.host_sharded else self.sharded
        if src is None:
            raise RuntimeError(f"{self!r}: the sharded segment lives on the host and was not staged for the all-gather")
        if self.compute_dtype == self.dtype and not (self.world_size == 1 and self.host_sharded):
            return src
        slot = self.unsharded.narrow(0, self.rank * self.segment, self.segment)
        slot.copy_(src)
        return slot

    # -- moving ----------------------------------------------------------------------------
    def rebuild(self, device: torch.device, dtype: torch.dtype) -> None:
        """New sharded segment on ``device`` / of ``dtype`` (same layout); the caller fills it.
        Drops the unsharded and gradient buffers."""
        if dtype != self.dtype and self.compute_dtype == self.dtype:
            self.compute_dtype = dtype
        if dtype != self.dtype and self.reduce_dtype == self.dtype:
            self.reduce_dtype = dtype
        self.device = torch.device(device)
        self.dtype = dtype
        self.sharded = torch.zeros(self.segment, dtype=dtype, device=self.device)
        self._unsharded = None
        self._unsharded_views = None
        self.grad = None
        self._grad_views = []
        self._grad_versions = []

    def __repr__(self) -> str:
        return (
            f"DBuffer(tensors={len(self.slots)}, W={self.world_size}, S={self.segment}, "
            f"dtype={self.dtype}, compute={self.compute_dtype}, reduce={self.reduce_dtype}, "
            f"device={self.device})"
        )
