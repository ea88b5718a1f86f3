"""``torch.distributed.checkpoint.state_dict`` for models with RaggedShard parameters.

Same names, signatures and options as torch's ``get_model_state_dict``,
``set_model_state_dict``, ``get_optimizer_state_dict``, ``set_optimizer_state_dict``,
``get_state_dict`` and ``set_state_dict``; import them from ``ragged_fsdp.checkpoint``
instead of ``torch.distributed.checkpoint.state_dict``. torch itself is not patched.

What torch already does right, and we hand straight to it:

* every ``get_*`` (sharded, ``full_state_dict=True``, ``cpu_offload=True``): full state dicts
  are gathered with ``DTensor.redistribute(..., [Replicate()])``, which RaggedDTensor
  implements, so torch's code works unchanged;
* every sharded ``set_*``: it ends in ``load_state_dict`` with DTensor values.

What torch rejects, and we do first: loading a *full* state dict
(``full_state_dict=True``, with or without ``broadcast_from_rank0``). torch turns each full
tensor into a shard with its own ``distribute_tensor`` (or slices by
``compute_local_shape_and_global_offset``), neither of which knows RaggedShard. We turn the
full tensors into RaggedShard DTensors laid out like the model's (or optimizer's) own
shards — ``broadcast_from_rank0`` scatters only each rank's piece from rank 0 when the
tensor's mesh is 1-D over the whole world, and broadcasts the whole tensor from rank 0 on any
other mesh (HSDP, TP/EP x dp), as torch does — and then call torch's sharded path. Models without a
RaggedShard tensor go to torch untouched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint import state_dict as _tsd
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import distribute_tensor as _torch_distribute_tensor

from ragged_fsdp.placement import RaggedDTensor
from ragged_fsdp.placement import distribute_tensor as _ragged_distribute_tensor

from . import subclass_values as _sub
from ._tree import flatten, unflatten

__all__ = [
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]


# -- get: torch's own code works on RaggedDTensor ----------------------------------------

def get_model_state_dict(
    model: nn.Module,
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """As ``torch.distributed.checkpoint.state_dict.get_model_state_dict``: sharded values are
    RaggedDTensors; with ``full_state_dict=True`` they are gathered (to rank 0 only when
    ``cpu_offload=True``).

    Tensor-subclass parameters (``subclass_values.py``): sharded, as they are (an NF4 weight's
    pieces are RaggedDTensors of NF4 pieces, which DCP stores as they are); full, an NF4 weight
    is the unsharded ``NF4Weight`` (``ragged_fsdp.quant.dequantized_state_dict`` turns the
    state dict into plain values) and a float8 training weight its plain master values."""
    if options is None or not options.full_state_dict or not _sub.has_subclass_values(model):
        return _tsd.get_model_state_dict(model, submodules=submodules, options=options)
    sd = _tsd.get_model_state_dict(model, submodules=submodules, options=_sharded(options))
    quantised = {k: sd.pop(k) for k in _sub.quantised_keys(sd)}
    from torch.distributed._state_dict_utils import _gather_state_dict

    # torch's own full gather (as its get_model_state_dict does it) for everything else
    use_dist = dist.is_available() and dist.is_initialized()
    ranks_only = (0,) if options.cpu_offload and use_dist else ()
    out = _gather_state_dict(_sub.as_plain_values(sd), cpu_offload=options.cpu_offload, ranks_only=ranks_only)
    keep = not ranks_only or dist.get_rank() in ranks_only
    for k, v in quantised.items():
        full = _sub.gather_quantised(v, k)
        if keep:
            out[k] = full.cpu() if options.cpu_offload else full
    return out if keep else {}


def get_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """As torch's: state keyed by parameter FQN; an optimizer with no state yet is
    initialised by a zero-learning-rate step first (torch's behaviour)."""
    return _tsd.get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options)


def get_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    if options is not None and options.full_state_dict and _sub.has_subclass_values(model):
        return (get_model_state_dict(model, submodules=submodules, options=options),
                get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options))
    return _tsd.get_state_dict(model, optimizers, submodules=submodules, options=options)


# -- set: full state dicts are resharded here, then torch loads the shards ---------------

def _is_full(options: StateDictOptions | None) -> bool:
    return bool(options is not None and (options.full_state_dict or options.broadcast_from_rank0))


def _sharded(options: StateDictOptions) -> StateDictOptions:
    return dataclasses.replace(options, full_state_dict=False, broadcast_from_rank0=False, cpu_offload=False)


def _check_options(options: StateDictOptions) -> None:
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError("full_state_dict must be True when broadcast_from_rank0 is True.")


def _model_is_ragged(model: nn.Module) -> bool:
    return any(isinstance(p, RaggedDTensor) for p in model.parameters()) or any(
        isinstance(b, RaggedDTensor) for b in model.buffers()
    )


def set_model_state_dict(
    model: nn.Module,
    model_state_dict: dict[str, Any],
    *,
    options: StateDictOptions | None = None,
):
    """As torch's. With ``full_state_dict=True`` every rank passes the full state dict; with
    ``broadcast_from_rank0=True`` too, only rank 0 needs it (others may pass ``{}``); on a 1-D
    mesh over the world each rank receives just its own piece of every RaggedShard tensor,
    on other meshes the whole tensor (collectives over the default group).

    Returns torch's ``_IncompatibleKeys`` (``missing_keys``, ``unexpected_keys``); with
    ``strict=True`` (the default) a mismatch raises instead, naming the keys, on every rank."""
    if not _is_full(options) or not _model_is_ragged(model):
        return _tsd.set_model_state_dict(model, model_state_dict, options=options)
    _check_options(options)
    local = _tsd.get_model_state_dict(model, options=_sharded(options))
    # quantised subclass weights (NF4): the full value is the subclass itself, cut by rows here
    quantised = {k: local.pop(k) for k in _sub.quantised_keys(local)}
    broadcast = options.broadcast_from_rank0 and dist.is_available() and dist.is_initialized()
    full = dict(model_state_dict)
    qfull = {}
    for k in quantised:
        if broadcast:
            box = [full.get(k) if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(box, src=0)  # pickled: one per tensor, at load time only
            qfull[k] = box[0]
        else:
            qfull[k] = full.get(k)
        full.pop(k, None)
    missing = [k for k, v in qfull.items() if v is None]
    if missing and options.strict:
        raise RuntimeError(f"ragged_fsdp: cannot load the full model state dict: missing keys: {_names(missing)}")
    shards = _full_to_shards(
        full, local, broadcast=options.broadcast_from_rank0, strict=options.strict,
        what="model state dict",
    )
    for k, v in qfull.items():
        if v is not None:
            shards[k] = _sub.shard_quantised(k, v, quantised[k])
    return _tsd.set_model_state_dict(model, shards, options=_sharded(options))


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    optim_state_dict: dict[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> None:
    """As torch's, including full and ``broadcast_from_rank0`` state dicts of any optimizer
    whose states are RaggedShard DTensors shaped like their parameters or by their own
    global shape (AdamW moments, Muon momentum, AdamW8bit codes and absmax)."""
    if not _is_full(options) or not _model_is_ragged(model):
        return _tsd.set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    _check_options(options)
    local = _tsd.get_optimizer_state_dict(model, optimizers, options=_sharded(options))
    shards = _full_to_shards(
        optim_state_dict, local, broadcast=options.broadcast_from_rank0, strict=options.strict,
        what="optimizer state dict",
    )
    return _tsd.set_optimizer_state_dict(model, optimizers, shards, options=_sharded(options))


def set_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any],
    options: StateDictOptions | None = None,
):
    keys = set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return keys


# -- full -> shards ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype


def _describe(flat: dict[str, Any]) -> dict[str, Any]:
    """What rank 0 tells the others: tensor shapes and dtypes, other values as they are."""
    out = {}
    for k, v in flat.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            out[k] = _TensorInfo(tuple(v.shape), v.dtype)
        elif isinstance(v, torch.Tensor):
            out[k] = v.detach().cpu()
        else:
            out[k] = v
    return out


def _names(keys, limit: int = 50) -> str:
    keys = sorted(keys)
    more = f" ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _full_to_shards(full: dict, local: dict, *, broadcast: bool, strict: bool, what: str) -> dict:
    """Re-express the full state dict ``full`` in the layout of ``local`` (a sharded state
    dict of the same structure): RaggedShard / DTensor where ``local`` has them.

    With ``broadcast``, only rank 0's ``full`` is read; every rank takes part in the same
    collectives in the same order (the key order of rank 0's state dict)."""
    use_dist = dist.is_available() and dist.is_initialized()
    rank0 = not use_dist or dist.get_rank() == 0
    local_flat, _ = flatten(local)
    if broadcast and use_dist:
        if rank0:
            flat, mapping = flatten(full)
            box = [(_describe(flat), mapping)]
        else:
            box = [None]
        dist.broadcast_object_list(box, src=0)
        desc, mapping = box[0]
        if rank0:
            desc = flat  # rank 0 keeps its real tensors
    else:
        desc, mapping = flatten(full)

    tensor_keys = {k for k, v in local_flat.items() if isinstance(v, torch.Tensor)}
    missing = sorted(k for k in tensor_keys if k not in desc)
    unexpected = sorted(
        k for k, v in desc.items()
        if k not in local_flat and isinstance(v, (torch.Tensor, _TensorInfo))
    )
    wrong = []
    for k, v in desc.items():
        lv = local_flat.get(k)
        if isinstance(lv, torch.Tensor) and isinstance(v, (torch.Tensor, _TensorInfo)):
            shape = tuple(v.shape)
            if lv.dim() > 0 and shape != tuple(lv.shape):
                wrong.append(f"{k}: full {shape} vs model {tuple(lv.shape)}")
    if wrong or (strict and (missing or unexpected)):
        parts = []
        if missing:
            parts.append(f"missing keys: {_names(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {_names(unexpected)}")
        if wrong:
            parts.append(f"shape mismatches: {'; '.join(wrong[:50])}")
        raise RuntimeError(f"ragged_fsdp: cannot load the full {what}: " + "; ".join(parts))

    out: dict[str, Any] = {}
    for k, v in desc.items():
        lv = local_flat.get(k)
        if not isinstance(v, (torch.Tensor, _TensorInfo)) or (isinstance(v, torch.Tensor) and v.dim() == 0):
            out[k] = v
            continue
        if lv is None:  # only when not strict: hand the value on, torch decides
            if broadcast and use_dist:
                continue
            out[k] = v
            continue
        if not isinstance(lv, torch.Tensor):
            out[k] = v
            continue
        src = v if isinstance(v, torch.Tensor) else torch.empty(v.shape, dtype=v.dtype)
        out[k] = _shard_like(src.detach(), lv, broadcast=broadcast and use_dist)
    return unflatten(out, mapping)


def _shard_like(src: torch.Tensor, like: torch.Tensor, *, broadcast: bool) -> torch.Tensor:
    """``src`` (the full tensor; on ranks other than 0 only its shape/dtype count when
    ``broadcast``) laid out like ``like``."""
    device = like.device if not isinstance(like, DTensor) else like._local_tensor.device
    src = src.contiguous()
    if isinstance(like, RaggedDTensor):
        mesh, placements = like.device_mesh, like.placements
        if broadcast:
            if _spans_world_from_rank0(mesh):
                # scatter: each rank receives only its own run
                return _ragged_distribute_tensor(src.to(device), mesh, placements, src_data_rank=0)
            # Any other mesh (HSDP, TP/EP x dp, a dp mesh of a 2-D mesh that leaves out
            # global rank 0): every rank takes the whole tensor from global rank 0 and cuts
            # its piece locally. The choice depends only on facts every rank agrees on, so
            # all ranks enter the same collective.
            dist.broadcast(src, src=0)
        return _ragged_distribute_tensor(src.to(device), mesh, placements, src_data_rank=None)
    if isinstance(like, DTensor):
        if broadcast:
            dist.broadcast(src, src=0)
        return _torch_distribute_tensor(src.to(device), like.device_mesh, like.placements, src_data_rank=None)
    if broadcast:
        dist.broadcast(src, src=0)
    return src.to(device)


def _spans_world_from_rank0(mesh) -> bool:
    """A 1-D mesh over the whole world whose first rank is global rank 0: rank 0 can
    scatter each rank its run. Decided from the mesh's size, which is the same on every rank
    (a dp sub-mesh of a 2-D mesh is smaller than the world on every rank; testing "is global
    rank 0 in my group" instead would send the two dp groups into different collectives)."""
    return mesh.ndim == 1 and mesh.size() == dist.get_world_size() and int(mesh.mesh.reshape(-1)[0]) == 0
