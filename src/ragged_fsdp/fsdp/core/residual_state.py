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

The entry is a view of the live residual (:meth:`~ragged_fsdp.quant.wire_residual.Residual.flat`),
not a copy: a load that writes into ``model.state_dict()`` in place (``load_local``, DCP's
``dcp.load``) restores the residual without a ``load_state_dict`` call, as it restores the
parameters; ``load_local(..., strict=False)`` from a save without a residual zeroes it, with
a :class:`ResidualWarning`.

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

import math
import re
import warnings
from typing import Protocol

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from ragged_fsdp.agreement import agree
from ragged_fsdp.placement import RaggedShard, from_local
from ragged_fsdp.quant.grad_wire import GradientReduce

from .unit import UnitGroup

__all__ = ["ResidualWarning", "is_residual_key", "register_residual_state", "rescale_residuals",
           "warn_zeroed_residuals"]

_KEY = "_wire_residual_{}"
_SCALES = "_wire_residual_scales_{}"
_PATTERN = re.compile(r"^_wire_residual(_scales)?_\d+$")


class ResidualWarning(UserWarning):
    """A loaded state dict gave no usable error-feedback residual (error feedback starts
    from zero), or gave one to a model without error feedback (ignored)."""


def is_residual_key(key: str) -> bool:
    """Whether a (dotted) state-dict key is an error-feedback residual entry."""
    return bool(_PATTERN.match(key.rsplit(".", 1)[-1]))


def warn_zeroed_residuals(keys: list[str], where: str) -> None:
    """An in-place load (``where``) found no residual for ``keys`` and zeroed them (the
    state dict's entries are the live residual, so the model's error feedback restarts)."""
    warnings.warn(f"ragged_fsdp: {where}: the checkpoint has no error-feedback residual for "
                  f"{', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''} (saved without error feedback): error "
                  "feedback starts from a zero residual", ResidualWarning, stacklevel=3)


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
            values, scales = res.flat()  # the live storage: an in-place load writes the residual
            mesh = _mesh_of(u)
            state_dict[prefix + _KEY.format(u.index)] = _as_dtensor(values, mesh)
            if scales is not None:
                state_dict[prefix + _SCALES.format(u.index)] = _as_dtensor(scales, mesh)

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
                scales = _local(state_dict.pop(prefix + _SCALES.format(u.index), None), mesh, res.scale_width,
                                torch.float32)
                if scales is None:
                    values = None
            if values is None:
                zeroed.append(u.index)
                res.load_flat(None)
            else:
                res.load_flat(values, scales)
        if zeroed:
            warnings.warn(
                f"ragged_fsdp: the state dict has no error-feedback residual of {group.describe()} (buffers "
                f"{zeroed}) for this model's world size, layout and residual_dtype (a checkpoint saved without "
                "error feedback, or at another world size): error feedback starts from a zero residual",
                ResidualWarning, stacklevel=2)

    module.register_state_dict_post_hook(save)
    module.register_load_state_dict_pre_hook(load)


def _check_factor(factor) -> str | None:
    is_scalar = isinstance(factor, torch.Tensor) and factor.numel() == 1
    if isinstance(factor, bool) or not (isinstance(factor, (int, float)) or is_scalar):
        return f"rescale_residual: factor must be a number, got {factor!r}"
    f = float(factor)
    big, tiny = torch.finfo(torch.float32).max, torch.finfo(torch.float32).tiny
    if not (math.isfinite(f) and tiny <= f <= big):
        return (f"rescale_residual: factor must be finite and positive (between {tiny:.3g} and {big:.3g}: it "
                f"multiplies fp32 residuals), got {factor!r}; pass new_scale / old_scale of the GradScaler, taken "
                "after scaler.update()")
    return None


def rescale_residuals(groups: list[ResidualGroup], factor) -> None:
    """``FSDPModule.rescale_residual``: validate ``factor`` on every rank, agree on it over
    the ranks that hold residuals (a NaN or inf would make every later gradient non-finite,
    a factor that differs would make the ranks' residuals inconsistent), then multiply."""
    units = [u for g in groups for u in g.units if u.wire is not None and u.wire.residual is not None]
    comms = [c for u in units[:1] for c in (u.dp.shard, u.dp.replicate) if c is not None]
    agree("rescale_residual(factor)", factor, group=[c.host_group for c in comms], validate=_check_factor,
          fix="pass the same factor on every rank (new_scale / old_scale of a GradScaler)")
    for u in units:
        u.wire.residual.rescale(float(factor))
