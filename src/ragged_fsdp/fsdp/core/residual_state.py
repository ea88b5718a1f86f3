"""Error feedback's residual in the model's state dict.

The residual is training state: a resume without it sends the next step's gradient without
the rounding debt of the step before. So ``fully_shard(gradient_reduce=GradientReduce(...,
error_feedback=True))`` puts it in the wrapped module's ``state_dict()``, one entry per
DBuffer that reduces gradients, under ``<module>._wire_residual_<buffer index>`` (and, for
int8 storage, ``<module>._wire_residual_scales_<buffer index>``). Each is a DTensor over the
mesh the buffer's parameters live on: on a 1-D mesh a RaggedShard DTensor of ``W * n``
elements, ``n`` per rank (the parameters' layout, so the local saves carry it too); on more
dims sharded on every dim, global shape ``mesh.shape + (n,)``: every rank (HSDP replicas and
TP ranks too) holds a residual of its own. ``n`` is a rank's stored values (the other ranks' segments, ``(W - 1) * S``, in
``residual_dtype``) or its scales (padded to the largest count of any rank). DCP, the
``get_*_state_dict`` functions and ``TrainState`` carry it as any other sharded tensor.

Loading (``load_state_dict``, strict or not): an entry whose global shape and dtype are this
model's is this rank's residual, bit for bit. Anything else (a checkpoint without one, saved
by a model without error feedback, at another world size or with another residual storage)
leaves a zero residual and a :class:`ResidualWarning` saying so; the entry is never reported
as missing or unexpected. Why not reshard: a rank's residual is what the wire dropped from
the pieces *it* sent of *its* local gradient, against the block scales of the layout at that
``W``; at another ``W`` the senders, their data and the blocks are others, and a residual is
at most half a wire step per element (int8 wire), so a zero residual costs one step's
quantisation error, as a step without error feedback. A model without error feedback drops
residual entries it is given, with the same warning.
"""

from __future__ import annotations

import re
import warnings
from typing import Protocol

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from ragged_fsdp.placement import RaggedShard, from_local
from ragged_fsdp.quant.grad_wire import GradientReduce

from .unit import UnitGroup

__all__ = ["ResidualWarning", "is_residual_key", "register_residual_state"]

_KEY = "_wire_residual_{}"
_SCALES = "_wire_residual_scales_{}"
_PATTERN = re.compile(r"^_wire_residual(_scales)?_\d+$")


class ResidualWarning(UserWarning):
    """A loaded state dict gave no usable error-feedback residual (error feedback starts
    from zero), or gave one to a model without error feedback (ignored)."""


def is_residual_key(key: str) -> bool:
    """Whether a (dotted) state-dict key is an error-feedback residual entry."""
    return bool(_PATTERN.match(key.rsplit(".", 1)[-1]))


def _mesh_of(unit):
    return unit.infos[0].sharded.device_mesh


def _global_shape(mesh, n: int) -> tuple[int, ...]:
    # a 1-D mesh: one run of n per rank, RaggedShard as the parameters (so the local saves,
    # which take fully_shard's 1-D layout, carry it too); more dims: one row per rank
    return (mesh.size() * n,) if mesh.ndim == 1 else tuple(mesh.shape) + (n,)


def _as_dtensor(local: torch.Tensor, mesh) -> DTensor:
    n = local.numel()
    if mesh.ndim == 1:
        pl = RaggedShard((0,), (n,) * mesh.size())
        return from_local(local, mesh, (pl,), (mesh.size() * n,))
    shape = _global_shape(mesh, n)
    stride, k = [], 1
    for d in reversed(shape):
        stride.insert(0, k)
        k *= d
    return DTensor.from_local(local.reshape((1,) * mesh.ndim + (n,)), mesh, [Shard(i) for i in range(mesh.ndim)],
                              run_check=False, shape=torch.Size(shape), stride=tuple(stride))


def _local(value, mesh, n: int, dtype: torch.dtype) -> torch.Tensor | None:
    """This rank's run of ``n`` values from a loaded entry, or None when it is not one of
    this model's (another shape: another W or layout; another dtype: another storage)."""
    if value is None or tuple(value.shape) != _global_shape(mesh, n) or value.dtype != dtype:
        return None
    if isinstance(value, DTensor):
        mine = _as_dtensor(torch.empty(n, dtype=dtype, device=value.device), mesh)
        if tuple(value.placements) != tuple(mine.placements):
            return None
        return value.to_local().reshape(-1)
    coords = mesh.get_coordinate()  # a full (gathered) state dict
    if mesh.ndim == 1:
        return value[coords[0] * n:(coords[0] + 1) * n]
    return value[tuple(coords)].reshape(-1)


def _scale_width(wire) -> int:
    """Scales per rank in the entry: the most any rank keeps (the other ranks' blocks)."""
    b = wire.blocks
    total = int(b.lengths.numel())
    return max(total - n for n in b.per_segment)


class ResidualGroup(UnitGroup, Protocol):
    """What the residual's state-dict entries read of a group."""

    gradient_reduce: GradientReduce | None


def register_residual_state(group: ResidualGroup, module: nn.Module) -> None:
    """Put the residual of ``group``'s buffers into ``module``'s state dict and take it back
    at load; for every group (with or without error feedback: a model without it drops
    residual entries it is given)."""
    fmt = group.gradient_reduce
    feedback = fmt is not None and fmt.error_feedback

    def units():
        return [u for u in group.units if u.trainable and u.buf.dtype.is_floating_point] if feedback else []

    for u in units():  # DCP's key resolution reads each key's last name as an attribute
        module.__dict__[_KEY.format(u.index)] = None
        if fmt.residual_dtype is torch.int8:
            module.__dict__[_SCALES.format(u.index)] = None

    def save(mod, state_dict, prefix, local_metadata):
        for u in units():
            res = u.wire_state(fmt).residual_on(u.buf.device)
            values, scales = res.flat()
            mesh = _mesh_of(u)
            state_dict[prefix + _KEY.format(u.index)] = _as_dtensor(values, mesh)
            if scales is not None:
                padded = torch.zeros(_scale_width(u.wire), dtype=scales.dtype, device=scales.device)
                padded[:scales.numel()] = scales
                state_dict[prefix + _SCALES.format(u.index)] = _as_dtensor(padded, mesh)

    def load(mod, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        ours = {prefix + _KEY.format(u.index) for u in units()} | {prefix + _SCALES.format(u.index) for u in units()}
        ignored = [k for k in state_dict if k.startswith(prefix) and "." not in k[len(prefix):]
                   and is_residual_key(k) and k not in ours]
        for k in ignored:
            state_dict.pop(k)
        if ignored:
            warnings.warn(f"ragged_fsdp: {', '.join(ignored)}: an error-feedback residual, and "
                          f"{group.describe()} has no such buffer with error feedback "
                          f"(gradient_reduce={fmt!r}): ignored", ResidualWarning, stacklevel=2)
        zeroed = []
        for u in units():
            res = u.wire_state(fmt).residual_on(u.buf.device)
            mesh = _mesh_of(u)
            values = _local(state_dict.pop(prefix + _KEY.format(u.index), None), mesh, res.numel, fmt.residual_dtype)
            scales = None
            if fmt.residual_dtype is torch.int8:
                scales = _local(state_dict.pop(prefix + _SCALES.format(u.index), None), mesh, _scale_width(u.wire),
                                torch.float32)
                if scales is None:
                    values = None
            if values is None:
                zeroed.append(u.index)
                res.load_flat(None)
            else:
                res.load_flat(values, None if scales is None else scales[:res.n_scales])
        if zeroed:
            warnings.warn(
                f"ragged_fsdp: the state dict has no error-feedback residual of {group.describe()} (buffers "
                f"{zeroed}) for this model's world size, layout and residual_dtype (a checkpoint saved without "
                "error feedback, or at another world size): error feedback starts from a zero residual",
                ResidualWarning, stacklevel=2)

    module.register_state_dict_post_hook(save)
    module.register_load_state_dict_pre_hook(load)
