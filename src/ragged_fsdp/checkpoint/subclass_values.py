"""Full state dicts of tensor-subclass parameters (``fully_shard``'s NF4 and float8 weights).

torch gathers a full state dict with ``DTensor.redistribute(..., [Replicate()])`` and loads
one by cutting plain tensors; neither applies to a RaggedDTensor whose local tensor is a
subclass piece. What is done instead (the kinds are ``placement/subclass_local.py``'s):

* **a value wrapper** (float8 training weight): the entry becomes a plain RaggedDTensor over
  its master values before torch gathers it, so a full state dict holds plain tensors, and a
  full load copies plain values in (the subclass's ``copy_`` writes its master).
* **a quantised tensor** (NF4): gathered through the subclass's own all-gather protocol
  (``fsdp_pre_all_gather`` on each piece, the inputs concatenated in rank order,
  ``fsdp_post_all_gather``), which gives the unsharded subclass value bit for bit; a full
  load cuts this rank's rows of the full value (a value of the same subclass), wraps them in
  the parameter's layout and lets torch's sharded path ``copy_`` them in.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ragged_fsdp.placement import RaggedDTensor
from ragged_fsdp.placement.dcp import local_box_boxes
from ragged_fsdp.placement.dtensor import wrap
from ragged_fsdp.placement.subclass_local import is_subclass_local, values_of
from ragged_fsdp.quant import nf4 as _nf4  # noqa: F401  (allow-lists NF4Weight for DCP's torch.load)

__all__ = ["has_subclass_values", "quantised_keys", "as_plain_values", "gather_quantised", "shard_quantised"]


def _kind(v) -> str | None:
    if not isinstance(v, RaggedDTensor) or not is_subclass_local(v._local_tensor):
        return None
    return "values" if values_of(v._local_tensor) is not None else "quantised"


def has_subclass_values(model) -> bool:
    return any(_kind(p) is not None for p in model.parameters())


def quantised_keys(sd: dict) -> list[str]:
    return [k for k, v in sd.items() if _kind(v) == "quantised"]


def as_plain_values(sd: dict) -> dict:
    """``sd`` with every value-wrapper entry as a plain RaggedDTensor over its values."""
    return {k: wrap(values_of(v._local_tensor), v._spec) if _kind(v) == "values" else v for k, v in sd.items()}


def _rows(dt) -> tuple[int, int]:
    boxes = local_box_boxes(dt)
    if not boxes:
        return 0, 0
    r0 = boxes[0][0][0]
    return r0, r0 + sum(sizes[0] for _, sizes in boxes)


@torch.no_grad()
def gather_quantised(dt: RaggedDTensor, key: str) -> torch.Tensor:
    """The unsharded subclass value of ``dt`` on every rank of its mesh (collective)."""
    from ragged_fsdp.quant.foreign import call_pre_all_gather

    local = dt._local_tensor
    shape = tuple(dt.shape)
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    ins, meta = call_pre_all_gather(local, dt.device_mesh, torch.Size(shape), stride, None, None)
    ins = [t.detach().cpu() for t in ins]
    group = dt.device_mesh.get_group()
    every = [None] * dist.get_world_size(group)
    # pickled per rank: pieces differ in size, and this runs once per save, not per step
    dist.all_gather_object(every, ins, group=group)
    device = local.device
    outs = tuple(torch.cat([r[i].reshape(-1) for r in every]).to(device).view(-1, *ins[i].shape[1:])
                 for i in range(len(ins)))
    full, _ = local.fsdp_post_all_gather(outs, meta, dt.dtype)
    if tuple(full.shape) != shape:
        raise RuntimeError(f"ragged_fsdp: {key!r}: the gathered {type(full).__name__} has shape "
                           f"{tuple(full.shape)}, expected {shape}")
    return full


def shard_quantised(key: str, full, like: RaggedDTensor) -> DTensor:
    """This rank's rows of the full subclass value ``full``, laid out like ``like``."""
    from ragged_fsdp.quant.foreign import adopt_foreign, rows_of

    piece_type = type(like._local_tensor)
    if not isinstance(full, torch.Tensor) or type(adopt_foreign(full)) is not piece_type:
        raise TypeError(
            f"ragged_fsdp: cannot load {key!r}: the model's parameter is a {piece_type.__name__} and the "
            f"full state dict holds a {type(full).__name__}; pass the {piece_type.__name__} itself (what "
            "get_model_state_dict(full_state_dict=True) returns); plain values would have to be "
            "quantised first (NF4Weight.from_float)")
    full = adopt_foreign(full)
    if tuple(full.shape) != tuple(like.shape):
        raise ValueError(f"ragged_fsdp: cannot load {key!r}: full shape {tuple(full.shape)}, model {tuple(like.shape)}")
    piece = rows_of(key, full.detach().to(like._local_tensor.device), *_rows(like))
    return wrap(piece, like._spec)
