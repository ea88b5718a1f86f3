"""torchtitan's ``fully_shard`` calls, answered by ragged_fsdp's ``fully_shard``.

torchtitan (``torchtitan/distributed/fsdp.py``) calls FSDP2's ``fully_shard`` with
``shard_placement_fn`` and, under the ``full_dtensor`` backend, ``dp_mesh_dims``. Both reach
ragged_fsdp's ``fully_shard`` unchanged; what FSDP2 means by the *placement* half of a
``shard_placement_fn`` answer (``Shard(k)``: which tensor dim to cut, chosen by torchtitan to
avoid padding) becomes a planner granularity that keeps ``shape[k+1:]`` slices whole, and
the *mesh* half of a ``ShardPlacementResult`` (expert parallelism: experts on the ``efsdp``
mesh) is the parameter's own data-parallel mesh, as in FSDP2.
"""

from __future__ import annotations

import math
from typing import Any

import torch.nn as nn

from ragged_fsdp.fsdp import fully_shard as _ragged_fully_shard

from .support import PREFIX, Refused

__all__ = ["fully_shard_for_torchtitan", "granularity_from_placement"]


def granularity_from_placement(param: nn.Parameter, placement: Any, name: str):
    """The planner granularity that honours FSDP2's ``Shard(k)`` request for ``param``: a
    rank's ``Shard(k)`` piece is made of whole ``shape[k+1:]`` slices, so keep those whole.
    None (no request) leaves the planner free."""
    from torch.distributed.tensor import Shard

    if placement is None:
        return None
    if type(placement).__name__ == "ShardPlacementResult":
        placement = placement.placement
    if not isinstance(placement, Shard):
        raise Refused(
            f"{PREFIX}: shard_placement_fn returned {placement!r} for {name!r}; only Shard(k) "
            "(or a ShardPlacementResult holding one) can be mapped onto ragged_fsdp's layout"
        )
    shape = param.shape
    dim = placement.dim % max(len(shape), 1)
    block = math.prod(shape[dim + 1:])
    if len(shape) >= 2 and block == shape[-1]:
        return "row"
    return f"block:{block}" if block > 1 else None


def _local_shape_param(p: nn.Parameter):
    """The tensor the planner lays out: a TP/EP DTensor's local piece, else ``p``."""
    local = getattr(p, "_local_tensor", None)
    return local if local is not None else p


# trainable tensor-subclass weights trained against torch's fully_shard (module, class name)
_TESTED_TRAINABLE = {("torchao.float8.fsdp_utils", "WeightWithDynamicFloat8CastTensor")}


def fully_shard_for_torchtitan(module, *, shard_placement_fn=None, **kwargs):
    """ragged_fsdp's ``fully_shard`` taking torchtitan's arguments as FSDP2 does."""
    modules = module if isinstance(module, (list, tuple)) else [module]
    for m in modules:
        for name, p in m.named_parameters():
            # frozen subclass weights (e.g. NF4 QLoRA bases) go through fully_shard's subclass
            # all-gather, and so do the float8 converter's trainable weights (tested against
            # torch's fully_shard, see docs/quantized-weights.md); the MX / NVFP4 converters'
            # and the float8 grouped experts' weights are not tested with it
            data = p.data
            if (p.requires_grad and (hasattr(type(data), "fsdp_pre_all_gather") or hasattr(type(p), "fsdp_pre_all_gather"))
                    and (type(data).__module__, type(data).__name__) not in _TESTED_TRAINABLE):
                raise Refused(
                    f"{PREFIX}: parameter {name!r} of {type(m).__name__} is a trainable {type(data).__name__} "
                    "with its own FSDP all-gather (MX / NVFP4 converters, float8 grouped experts); ragged_fsdp "
                    "trains tensor-subclass weights through that all-gather only for the float8 Linear converter "
                    "(torchao's WeightWithDynamicFloat8CastTensor), the one tested against torch's fully_shard. "
                    "Remove the converter from --model.converters"
                )
    if shard_placement_fn is not None:
        user_fn = kwargs.pop("granularity_fn", None)

        def granularity_fn(name: str, p: nn.Parameter):
            g = granularity_from_placement(_local_shape_param(p), shard_placement_fn(p), name)
            if g is None and user_fn is not None:
                return user_fn(name, p)
            return g

        kwargs["granularity_fn"] = granularity_fn
        kwargs["shard_placement_fn"] = shard_placement_fn
    return _ragged_fully_shard(module, **kwargs)
