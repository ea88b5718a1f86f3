"""The behaviour of ``RaggedDTensor`` that lives in the modules built on it, bound to the class.

``dtensor.py`` defines the class; ``ops.py`` (its operator dispatch), ``redistribute.py``
(``full_tensor`` / ``redistribute``) and ``dcp.py`` (the checkpoint hooks) build and read
RaggedDTensors, so the class cannot import them without an import cycle. This module, run by
the package ``__init__`` before anything can use the class, attaches them.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate

from .dcp import create_chunk_list, create_write_items, get_tensor_shard
from .dtensor import RaggedDTensor
from .ops import dispatch
from .redistribute import redistribute

__all__: list[str] = []


def _torch_dispatch(cls, func, types, args=(), kwargs=None):
    return dispatch(func, args, kwargs or {})


def _full_tensor(self, *, grad_placements=None) -> torch.Tensor:
    out = redistribute(self, self.device_mesh, [Replicate()] * self.device_mesh.ndim)
    return out.to_local()


def _redistribute(self, device_mesh=None, placements=None, *, async_op=False, **kwargs):
    if placements is None:
        raise ValueError("redistribute: placements is required")
    return redistribute(self, device_mesh or self.device_mesh, placements)


def _create_write_items(self, fqn: str, object):
    return create_write_items(object, fqn)


RaggedDTensor.__torch_dispatch__ = classmethod(_torch_dispatch)
RaggedDTensor.full_tensor = _full_tensor
RaggedDTensor.redistribute = _redistribute
# torch.distributed.checkpoint hooks (the local run as a few boxes)
RaggedDTensor.__create_write_items__ = _create_write_items
RaggedDTensor.__create_chunk_list__ = create_chunk_list
RaggedDTensor.__get_tensor_shard__ = get_tensor_shard
