"""The user's custom collectives and all-reduce hook as the engine's collectives read them:
one :class:`CommHooks` per group (set by ``FSDPModule.set_custom_all_gather`` and friends,
checked in :mod:`..compat.extension`), and the checks on what a custom comm hands back
(its ``allocate``d memory, its work handle, what the hook did to the segment).

It sits in ``comms/`` because both the collectives here and ``core/`` read these records.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..torch_private import TorchPrivateMissing, has_swap_storage, storage_use_count, swap_storage

__all__ = ["CommHooks", "HOOK_LANE", "checked_alloc", "checked_work", "adopt_memory", "run_all_reduce_hook"]


HOOK_LANE = "all_reduce_hook"  # the device lane set_all_reduce_hook(stream=...) binds to the user's stream


@dataclass
class CommHooks:
    """One group's custom comms and hook (None: the engine's own)."""

    all_gather: Any = None
    reduce_scatter: Any = None
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    hook_stream: Any = None  # the stream the hook runs on (CUDA, FSDP only)

    # the setters of FSDPModule (fsdp/compat/torch_module.py) change the record through these
    def set_all_gather(self, comm) -> None:
        self.all_gather = comm

    def set_reduce_scatter(self, comm) -> None:
        self.reduce_scatter = comm

    def set_all_reduce_hook(self, hook, stream) -> None:
        self.all_reduce_hook, self.hook_stream = hook, stream

    def allocate_grad(self) -> Callable[[int, torch.dtype, torch.device], torch.Tensor] | None:
        rs = self.reduce_scatter
        if rs is None:
            return None
        return lambda n, dtype, device: checked_alloc(rs, "set_custom_reduce_scatter", n, dtype, device)


def checked_work(method: str, work, async_op: bool):
    """What a custom comm returned: for ``async_op=True`` the collective's work handle (or
    None when it finished before returning), waited for later; anything else would break
    that wait, after the unshard or reduction already started."""
    if async_op and work is not None and not callable(getattr(work, "wait", None)):
        raise TypeError(
            f"{method}: the comm returned {type(work).__name__} for async_op=True; return the collective's "
            "torch.distributed Work (what dist.all_gather_into_tensor(..., async_op=True) returns), or None "
            "if it has already finished")
    return work


def run_all_reduce_hook(hook: Callable[[torch.Tensor], None], segment: torch.Tensor) -> None:
    """Run the ``set_all_reduce_hook`` hook on a reduced segment: it works in place, so a
    hook that resizes or replaces the segment's memory is named here, not found later as a
    shape error in the copy into the gradients."""
    numel, dtype, ptr = segment.numel(), segment.dtype, segment.untyped_storage().data_ptr()
    hook(segment)
    if segment.numel() != numel or segment.dtype != dtype or segment.untyped_storage().data_ptr() != ptr:
        raise RuntimeError(
            f"set_all_reduce_hook: the hook changed the reduced gradient segment it was given ({numel} elements "
            f"of {dtype}) to {segment.numel()} elements of {segment.dtype}{' in other memory' if segment.numel() == numel else ''}; "
            "it must modify the tensor in place (e.g. dist.all_reduce(t) or t.div_(n)), keeping its size, dtype "
            "and storage")


def checked_alloc(comm, method: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = comm.allocate((n,), dtype=dtype, device=device)
    if not isinstance(t, torch.Tensor) or t.numel() != n or t.dtype != dtype or t.device != device \
            or not t.is_contiguous():
        got = (f"shape {tuple(t.shape)}, {t.dtype}, {t.device}, contiguous={t.is_contiguous()}"
               if isinstance(t, torch.Tensor) else type(t).__name__)
        raise ValueError(
            f"{method}: {type(comm).__name__}.allocate(({n},), dtype={dtype}, device={device}) must return a "
            f"contiguous tensor of {n} elements of that dtype on that device; got {got}")
    return t


def _refs(flat, t) -> tuple[int, int]:
    return sys.getrefcount(t), storage_use_count(t)


def _probe(flat, t) -> tuple[int, int]:  # the same call depth as adopt_memory's check
    return _refs(flat, t)


def _baseline() -> tuple[int, int]:
    t = torch.empty(1)  # held by one local, as adopt_memory's caller holds the comm's tensor
    return _probe(None, t)


try:
    _SOLE = _baseline()  # (references, storage uses) of a tensor only its caller holds
except TorchPrivateMissing:  # no storage count on this torch: never adopt (gather into the comm's tensor, copy out)
    _SOLE = None


def adopt_memory(flat: torch.Tensor, t: torch.Tensor) -> bool:
    """Move the memory of ``t`` (fresh from a comm's ``allocate``; the caller holds it in
    one local variable) into ``flat``'s storage, whose views the unsharded parameters are,
    so the collective writes straight into them. Only when nothing else holds ``t`` or its
    storage and it starts at its storage's first byte: a comm that hands out a persistent
    buffer of its own keeps it, and the caller gathers into it and copies out."""
    if not has_swap_storage() or _SOLE is None or t.storage_offset() != 0 or _refs(flat, t) != _SOLE:
        return False
    swap_storage(flat.untyped_storage(), t.untyped_storage())
    return True
