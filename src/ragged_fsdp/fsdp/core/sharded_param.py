"""The sharded parameter: a RaggedShard DTensor whose local tensor is a view into a DBuffer.

Every place that makes or re-points a sharded parameter or gradient goes through here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ragged_fsdp.placement import RaggedDTensor, RaggedShard, from_local
from ragged_fsdp.placement.dtensor import wrap
from ragged_fsdp.placement.ops import SHARDED_PARAM_ATTR

__all__ = ["make_sharded_param", "make_sharded_grad", "local_of", "is_sharded_param", "repoint"]


def make_sharded_param(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence, shape: Sequence[int], requires_grad: bool
) -> nn.Parameter:
    """``nn.Parameter`` of a RaggedDTensor wrapping ``local`` (a buffer view, not copied);
    ``placements`` has one RaggedShard (a lone RaggedShard means a 1-D mesh)."""
    if isinstance(placements, RaggedShard):
        placements = (placements,)
    with torch.no_grad():
        dt = from_local(local, mesh, tuple(placements), tuple(shape))
    p = nn.Parameter(dt, requires_grad=requires_grad)
    setattr(p, SHARDED_PARAM_ATTR, True)
    return p


def make_sharded_grad(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A gradient for ``param`` with the same layout whose local tensor is ``local``."""
    return wrap(local, param._spec)


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, RaggedDTensor) else t


def is_sharded_param(t) -> bool:
    return isinstance(t, RaggedDTensor)


def repoint(param: nn.Parameter, local: torch.Tensor) -> None:
    """Make ``param`` (same object) wrap ``local``. When device or dtype change, the
    wrapper itself must change, so its contents are swapped with a fresh one."""
    old = param._local_tensor
    if old.device == local.device and old.dtype == local.dtype:
        param._local_tensor = local
        return
    fresh = make_sharded_param(local, param.device_mesh, tuple(param.placements), tuple(param.shape), param.requires_grad)
    param.grad = None
    torch.utils.swap_tensors(param, fresh)
