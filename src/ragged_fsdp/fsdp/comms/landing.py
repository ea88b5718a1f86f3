"""Where a reduced gradient lands: the one function that divides, casts and writes or adds
a reduced segment into this rank's sharded gradient segment.

Every reduction path (the engine's reduce-scatter on any backend, a custom reduce-scatter,
the wire formats, the all-reduce hook's stage, HSDP's replicate sum and the global-order
fold) computes a sum over ranks in the reduce dtype and then calls :func:`land`, so the
rules below are stated once:

* the divide runs in the reduce dtype (``reduced``'s), before any cast: one rounding into a
  lower-precision gradient dtype, as FSDP2 does;
* ``accumulate``: added into gradients already in ``target`` (accumulation without
  ``zero_grad``), else written over it;
* ``cast_first``: an all-reduce hook's output, which FSDP2 casts to the gradient dtype
  before adding (its hook runs on the reduce-dtype result; the add then runs in the
  gradient dtype). Without it a mixed-dtype add runs in the wider dtype;
* ``land(t, t, False, factor)``: the divide alone, in place (``t *= 1 / factor``), for a
  sum that something else reads before it lands (HSDP's all-reduce hook sees the mean).

The one divide not here is NCCL's ``ReduceOp.AVG`` inside the collective (what it hands
over is already the mean: it lands with ``factor`` 1).
"""

from __future__ import annotations

import torch

__all__ = ["land"]


def land(reduced: torch.Tensor, target: torch.Tensor, accumulate: bool, factor: float = 1.0, *,
         scratch: bool = False, cast_first: bool = False) -> None:
    """``target (+)= reduced / factor``. ``scratch``: ``reduced`` may be overwritten (the
    divide then runs in place). ``reduced`` may be ``target`` itself (a collective that
    wrote straight into the sharded segment): then only the divide is left."""
    scale = 1.0 / factor
    if reduced.dtype == target.dtype:
        if accumulate:
            target.add_(reduced, alpha=scale)
        else:
            if reduced is not target:
                target.copy_(reduced)
            if scale != 1.0:
                target.mul_(scale)
        return
    if scale != 1.0:
        reduced = reduced.mul_(scale) if scratch else reduced * scale
    if cast_first:
        reduced = reduced.to(target.dtype)
    target.add_(reduced) if accumulate else target.copy_(reduced)
