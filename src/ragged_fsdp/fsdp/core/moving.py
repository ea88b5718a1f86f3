"""Re-pointing a group's sharded parameters after they were replaced or moved
(``nn.Module._apply``: ``.to()``, ``to_empty()``, ``.half()``; ``load_state_dict(assign=True)``).
``group`` is the ParamGroup."""

from __future__ import annotations

from typing import Protocol

import torch
from torch.distributed.tensor import DTensor

from ragged_fsdp.placement import RaggedDTensor
from ragged_fsdp.placement.dtensor import my_piece, spec_mismatch

from .sharded_param import local_of, repoint
from .unit import UnitGroup


class Moving(UnitGroup, Protocol):
    """What re-pointing after ``load_state_dict(assign=True)`` reads of a group."""

    def reshard(self) -> None: ...

__all__ = ["adopt_locals", "adopt_registered"]


def adopt_locals(group: UnitGroup, locals_: list[torch.Tensor | None]) -> None:
    """Rebuild the sharded segments from new local tensors (one per info, None = keep
    the current data) and re-point the sharded parameters into them."""
    new_of = {id(info): t for info, t in zip(group.infos, locals_)}
    for u in group.units:
        buf = u.buf
        new = [new_of[id(info)] for info in u.infos]
        known = [t for t in new if t is not None]
        device = known[0].device if known else buf.device
        dtype = known[0].dtype if known else buf.dtype
        old = [local_of(info.sharded).detach() for info in u.infos]
        if device != buf.device or dtype != buf.dtype:
            buf.rebuild(device, dtype)
            for info in u.infos:
                info.forget_unsharded()
        for info, t, o in zip(u.infos, new, old):
            src = t if t is not None else o
            if src.device.type == "meta" and buf.device.type != "meta":
                pass  # no data to keep (to_empty of a list group moves its modules one by one)
            elif src.data_ptr() != buf.sharded_view(info.slot).data_ptr() or src.device != buf.device:
                buf.copy_local_(info.slot, src.to(device=buf.device, dtype=buf.dtype))
            repoint(info.sharded, buf.sharded_view(info.slot))
            info.register(info.sharded)


def adopt_registered(group: Moving) -> None:
    """After ``load_state_dict(assign=True)`` replaced registered parameters: copy their
    data into the DBuffer and point the sharded parameters back into it."""
    group.reshard()
    changed = False
    new_locals: list[torch.Tensor | None] = []
    for info in group.infos:
        mod, name = info.owners[0]
        cur = mod._parameters.get(name)
        if cur is None or cur is info.sharded:
            new_locals.append(None)
            continue
        changed = True
        if isinstance(cur, RaggedDTensor) and spec_mismatch(cur._spec, info.sharded._spec) is None:
            local = cur._local_tensor
        else:
            full = cur.full_tensor() if isinstance(cur, DTensor) else cur
            if tuple(full.shape) != tuple(info.sharded.shape):
                raise ValueError(f"load_state_dict: {info.fqn} has shape {tuple(full.shape)}, expected {tuple(info.sharded.shape)}")
            local = my_piece(full.detach(), info.sharded._spec)
        if cur.requires_grad != info.sharded.requires_grad:
            info.sharded.requires_grad_(cur.requires_grad)
        new_locals.append(local.detach())
    if changed:
        adopt_locals(group, new_locals)
