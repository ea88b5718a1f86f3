"""How DCP sees a RaggedDTensor whose local tensor is a tensor subclass (the pieces of
``fully_shard``'s subclass parameters: NF4 weights, float8 training weights).

Two kinds, told apart by the subclass's ``__tensor_flatten__``:

* **a wrapper of its values**: exactly one inner tensor, a plain one of the subclass's own
  shape and dtype (torchao's float8 training weight keeps its fp32 master so; the float8 is
  made only for the all-gather). DCP gets that plain tensor: the checkpoint holds ordinary
  values, which any model loads, and loading writes into the master's storage.
* **a quantised tensor** (anything else: NF4 codes + scalers + factors): the checkpoint holds
  the subclass itself, pickled per box by torch.save, as it is (nothing is dequantised).
  Boxes are whole rows (these pieces are sharded by whole rows), so a box is
  ``local.narrow(0, ...)``, a value of the same subclass whose inner tensors are views into
  the piece's: loading ``copy_``-s into them, and DCP's resharding (narrowing a saved box to
  the rows another world size needs) asks the subclass for ``narrow`` on dim 0 only.
"""

from __future__ import annotations

import math

import torch

__all__ = ["is_subclass_local", "values_of", "row_views"]


def is_subclass_local(local: torch.Tensor) -> bool:
    return type(local) is not torch.Tensor and hasattr(local, "__tensor_flatten__")


def values_of(local: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor holding a value wrapper's values, or None for a quantised tensor."""
    names, _ = local.__tensor_flatten__()
    if len(names) != 1:
        return None
    inner = getattr(local, names[0])
    if type(inner) is torch.Tensor and inner.shape == local.shape and inner.dtype == local.dtype:
        return inner
    return None


def row_views(local: torch.Tensor, boxes, fqn: str = "") -> list[torch.Tensor]:
    """One ``narrow`` of ``local`` per box (boxes of whole rows, in storage order)."""
    cols = math.prod(local.shape[1:])
    out, row = [], 0
    for offsets, sizes in boxes:
        if tuple(sizes[1:]) != tuple(local.shape[1:]):
            raise RuntimeError(
                f"ragged_fsdp checkpoint: {fqn!r}: a {type(local).__name__} piece is stored by whole rows, "
                f"but its box {tuple(offsets)} + {tuple(sizes)} is not (row length {cols})"
            )
        view = local.narrow(0, row, sizes[0])
        if type(view) is not type(local):
            raise TypeError(
                f"ragged_fsdp checkpoint: {fqn!r}: narrow of a {type(local).__name__} returned a "
                f"{type(view).__name__}; its __torch_dispatch__ must keep its type under aten.slice on dim 0"
            )
        out.append(view)
        row += sizes[0]
    if row != local.shape[0]:
        raise RuntimeError(
            f"ragged_fsdp checkpoint: {fqn!r}: boxes {boxes} cover {row} rows but the local piece has "
            f"{local.shape[0]}; the placement and the local tensor disagree"
        )
    return out
