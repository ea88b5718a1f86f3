"""What the engine reads of a unit's storage, written down once: :class:`UnitStore`, which both
:class:`~ragged_fsdp.dbuffer.DBuffer` and the engine's store of tensor-subclass pieces
(``fsdp/core/subclass_unit.py``'s ``SubclassStore``) satisfy (``tests/test_engine_rules.py``
checks both against it); and :class:`GradientHalf`, the layout helpers and the flat gradient
buffer they share (inherited, not copied member by member).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from ragged_fsdp.shapes import contiguous_stride

from .layout import BufferLayout, TensorSlot

__all__ = ["UnitStore", "GradientHalf"]


@runtime_checkable
class UnitStore(Protocol):
    """A unit's storage as the group, the unit, the reductions, offload and moving read it."""

    layout: BufferLayout
    device: torch.device
    dtype: torch.dtype  # the sharded parameters' (and sharded gradients') dtype
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    quant: Any  # the quantised gather's state, or None
    host_sharded: bool  # the sharded segment lives on the host (offload)
    staged: torch.Tensor | None  # its device copy while a gather reads it
    grad: torch.Tensor | None  # the unsharded gradient buffer, while a backward fills it

    @property
    def slots(self) -> tuple[TensorSlot, ...]: ...

    @property
    def world_size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    @property
    def segment(self) -> int: ...

    @property
    def aliased(self) -> bool: ...

    @property
    def unsharded_allocated(self) -> bool: ...

    def local_view(self, seg: torch.Tensor, i: int) -> torch.Tensor: ...

    def sharded_view(self, i: int) -> torch.Tensor: ...

    def copy_local_(self, i: int, src: torch.Tensor) -> None: ...

    def alloc_grad(self, allocate=None) -> torch.Tensor: ...

    def grad_view(self, i: int) -> torch.Tensor: ...

    def grad_touched(self, i: int) -> bool: ...

    def take_grad(self) -> torch.Tensor | None: ...

    def new_sharded_grad(self, zero: bool = False) -> torch.Tensor: ...

    def rebuild(self, device: torch.device, dtype: torch.dtype) -> None: ...


def _alias(flat: torch.Tensor, offset: int, shape: Sequence[int]) -> torch.Tensor:
    """A tensor on ``flat``'s storage that is *not* an autograd view: it has its own
    version counter, so in-place writes through it are visible in ``_version``."""
    out = torch.empty(0, dtype=flat.dtype, device=flat.device)
    with torch.no_grad():
        out.set_(flat.untyped_storage(), flat.storage_offset() + offset, tuple(shape), contiguous_stride(shape))
    return out




class GradientHalf:
    """The layout helpers and the unsharded gradient buffer of a store laid out by a
    :class:`~ragged_fsdp.dbuffer.layout.BufferLayout`: reads ``layout``, ``device``,
    ``dtype`` and ``reduce_dtype``; owns ``grad`` and its per-slot aliases."""

    layout: BufferLayout
    device: torch.device
    dtype: torch.dtype
    reduce_dtype: torch.dtype
    grad: torch.Tensor | None
    _grad_views: list[torch.Tensor]  # per-slot aliases of grad (alloc_grad)
    _grad_versions: list[int]  # their versions when grad was zeroed

    @property
    def slots(self) -> tuple[TensorSlot, ...]:
        return self.layout.slots

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def segment(self) -> int:
        return self.layout.segment

    def local_view(self, seg: torch.Tensor, i: int) -> torch.Tensor:
        """Slot ``i``'s run of a segment-sized tensor ``seg``, in the slot's local shape."""
        s = self.slots[i]
        return seg.narrow(0, s.local_offset, s.local_numel).view(s.local_shape)


    def alloc_grad(self, allocate=None) -> torch.Tensor:
        """A zeroed unsharded gradient buffer with per-slot aliases (see :meth:`grad_view`).
        ``allocate(numel, dtype, device)``, if given, provides its memory (a custom
        reduce-scatter's ``allocate``)."""
        if self.grad is None:
            if allocate is None:
                self.grad = torch.zeros(self.layout.total, dtype=self.reduce_dtype, device=self.device)
            else:
                self.grad = allocate(self.layout.total, self.reduce_dtype, self.device)
                self.grad.zero_()
            self._grad_views = [_alias(self.grad, s.offset, s.shape) for s in self.slots]
            self._grad_versions = [v._version for v in self._grad_views]
        return self.grad

    def grad_view(self, i: int) -> torch.Tensor:
        return self._grad_views[i]

    def grad_touched(self, i: int) -> bool:
        """Whether anything was written into slot ``i`` of the gradient buffer through its
        alias (autograd accumulates in place, which bumps the alias' version)."""
        return self.grad is not None and self._grad_views[i]._version != self._grad_versions[i]

    def take_grad(self) -> torch.Tensor | None:
        """Hand over the gradient buffer (the caller reduces and drops it)."""
        g, self.grad, self._grad_views, self._grad_versions = self.grad, None, [], []
        return g

    def new_sharded_grad(self, zero: bool = False) -> torch.Tensor:
        make = torch.zeros if zero else torch.empty
        return make(self.segment, dtype=self.dtype, device=self.device)
