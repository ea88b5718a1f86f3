"""The reduction of one micro-step in the global order (``ragged_fsdp.global_order``).

Micro-batch ``j`` of a step runs on data-parallel rank ``j mod W`` as its micro-step
``j div W``, so micro-step ``m`` holds micro-batches ``m*W .. m*W + W - 1``, one per rank,
in rank order. Each rank sends the owner of every segment its fp32 piece of it
(``all_to_all_single``, equal splits: a copy, no arithmetic on the wire), and the owner adds
the ``W`` pieces into its fp32 accumulator one at a time in rank order, i.e. in increasing
``j``. Over a step the additions into an element are micro-batches ``0, 1, ..., V - 1`` in
that order whatever ``W`` is, and each addition is one IEEE fp32 add, so the sum is the same
bits at every ``W`` (and equals autograd's own accumulation of the ``V`` backward passes on
one process). The divide comes once, when the step's last micro-step lands (:func:`land`).

HSDP (``R`` replicas x ``S`` shards): data-parallel rank ``d = replica * S + shard``. The
all-to-all runs over the shard dim (each owner gets the ``S`` pieces of its replica) and an
all-gather over the replicate dim brings every replica's ``S`` pieces, so each owner folds
all ``R * S`` pieces in the order of ``d``: the same additions as a 1-D run over ``R * S``
ranks. It moves more than reduce-scatter + all-reduce (see docs/determinism.md).

The fold is the ``post`` of the launch: on CUDA it runs on the collective's lane stream after
the collective (the device seam orders it; see :mod:`.device`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ragged_fsdp.comm import all_gather_single

from .collectives import Comm
from ...device import Device, Pending
from .landing import land

__all__ = ["ordered_reduce"]


def ordered_reduce(device: Device, shard: Comm, replicate: Comm | None, grad: torch.Tensor, acc: torch.Tensor,
                   first: bool, landing: tuple[torch.Tensor, bool, float] | None,
                   lane: str = "reduce_scatter") -> tuple[Pending, Pending | None]:
    """Fold this micro-step's pieces of this rank's segment into ``acc`` (fp32, one
    segment) in data-parallel rank order. ``first``: the step's first micro-step (the
    accumulator starts as micro-batch 0's piece, as autograd's first gradient is written,
    not added to a zero). ``landing``: ``(target, accumulate, factor)`` on the step's last
    micro-step: ``acc / factor`` lands in the sharded gradient segment ``target``.
    Returns the shard-dim launch and (HSDP) the replicate-dim one that folds."""
    S = acc.numel()
    Ws = shard.world_size
    pieces32 = grad if grad.dtype == torch.float32 else grad.to(torch.float32)  # exact: a widening cast
    recv = torch.empty(Ws * S, dtype=torch.float32, device=grad.device)
    R = replicate.world_size if replicate is not None else 1
    gathered = recv if R == 1 else torch.empty(R * Ws * S, dtype=torch.float32, device=grad.device)

    def fold() -> None:
        rows = gathered.view(R * Ws, S)
        for d in range(R * Ws):
            if d == 0 and first:
                acc.copy_(rows[0])
            else:
                acc.add_(rows[d])
        if landing is not None:
            target, accumulate, factor = landing
            land(acc, target, accumulate, factor, scratch=True)

    def issue(async_op: bool):
        if Ws == 1:
            recv.copy_(pieces32)
            return None
        return dist.all_to_all_single(recv, pieces32, group=shard.group, async_op=async_op)

    keep = (grad, pieces32, recv, acc) + (() if landing is None else (landing[0],))
    out = (recv, acc) + (() if landing is None else (landing[0],))
    if R == 1:
        return device.launch(lane, issue, post=fold, keep=keep, out=out), None
    first_launch = device.launch(lane, issue, keep=(grad, pieces32, recv), out=(recv,))

    def gather(async_op: bool):
        return all_gather_single(gathered, recv, group=replicate.group, async_op=async_op)

    second = device.launch("all_reduce", gather, post=fold, keep=keep + (gathered,), after=first_launch,
                           out=out + (gathered,))
    return first_launch, second
