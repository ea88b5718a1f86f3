"""Building a group's units: one DBuffer per kind of parameter, planned identically on every rank."""

from __future__ import annotations

from enum import Enum
from typing import Any, Protocol

import torch
import torch.nn as nn

from ragged_fsdp.dbuffer import DBuffer, plan_layout
from ragged_fsdp.dbuffer.planning import parse_granularity
from ragged_fsdp.placement import RaggedShard
from ragged_fsdp.quant.mxfp8 import MXFP8
from ragged_fsdp.quant.nvfp4 import NVFP4

from ..comms.collectives import Comm
from ..comms.mx_gather import attach_mx
from ..comms.quant_gather import attach_quant, fp8_granularity
from ..comms.custom import CommHooks
from ...quant.foreign import check_extension, extension_granularity, is_extension
from .consistency import check_same_layout
from .mesh_info import DPMesh, ParamPlacement
from .sharded_param import make_sharded_param
from .subclass_unit import build_subclass_unit
from .unit import Building, ParamInfo, Unit

__all__ = ["build_units", "Gather"]


class Gather(Enum):
    """How a unit's parameters are gathered: the kind slot of a unit's key."""

    PLAIN = "plain"  # the DBuffer's own all-gather in the compute dtype
    QUANT = "quant"  # fully_shard(all_gather_quant=...): codes and scales
    SUBCLASS = "subclass"  # a tensor subclass's own fsdp_pre/post_all_gather (.subclass_unit)

    @classmethod
    def of(cls, value) -> "Gather":
        """A kind, from itself or the old spelling (False, True, "subclass")."""
        if isinstance(value, cls):
            return value
        if value == "subclass":
            return cls.SUBCLASS
        if isinstance(value, bool):
            return cls.QUANT if value else cls.PLAIN
        raise ValueError(f"fully_shard: unknown gather kind {value!r}")


def _embedding_only(owners) -> bool:
    """A parameter only one nn.Embedding registers, as its weight (not tied to a head)."""
    return len(owners) == 1 and isinstance(owners[0][0], nn.Embedding) and owners[0][1] == "weight"


def build_units(group: Building, params, placed: list[ParamPlacement], granularity_fn,
                post_forward_comm: Comm | None) -> list[Unit]:
    """The units of ``group`` holding ``params``; their sharded parameters are registered on
    the modules."""
    # One unit per (mesh, dtype, trainable, gather kind, embedding) kind. Embedding
    # weights get their own: their gradients arrive at the very end of backward (the
    # others' near the start), and their backward needs only the indices, so that buffer
    # is neither kept unsharded nor re-gathered for backward (see backward.py).
    # (A shard_placement_fn may give some parameters another data-parallel mesh, e.g.
    # experts over the dp ranks of their EP group: those get their own units.)
    # Tensor subclasses with their own all-gather (FSDP2's protocol) are a kind of their own,
    # gathered by .subclass_unit (Gather.SUBCLASS).
    kinds: dict[tuple[int, torch.dtype, bool, Gather, bool], list[int]] = {}
    quant = group.all_gather_quant
    dp_index = {id(d): k for k, d in enumerate(group.dps)}
    for i, (name, p, owners) in enumerate(params):
        if is_extension(name, placed[i].data):  # foreign quantised weights were adopted when placed
            check_extension(name, p, placed[i])
            gather = Gather.SUBCLASS
        elif quant is not None and quant.applies(name, placed[i].data):  # quantised gathers: own buffer
            gather = Gather.QUANT
        else:
            gather = Gather.PLAIN
        key = (dp_index[id(placed[i].dp)], p.dtype, p.requires_grad, gather, _embedding_only(owners))
        kinds.setdefault(key, []).append(i)
    units: list[Unit] = []
    layouts: list = [None] * len(kinds)
    for k, dp in enumerate(group.dps):
        mine = [(j, key, idx) for j, (key, idx) in enumerate(kinds.items()) if key[0] == k]
        error = None
        try:
            for j, (_, dtype, _, gather, _), idx in mine:
                layouts[j] = _plan(group, params, placed, idx, dtype, granularity_fn, dp.shard.world_size,
                                  dp.shard.rank, gather)
        except (ValueError, NotImplementedError, TypeError) as e:
            error = e
        # Every rank must have planned the same layout, or the all-gathers silently mix
        # different tensors (or hang when the sizes differ): one small all-reduce to check.
        check_same_layout(dp.shard, dp.mesh, [layouts[j] for j, _, _ in mine],
                          [params[idx[0]][1].dtype for _, _, idx in mine], error, group.describe(),
                          settings=_shared_arguments(group))
    for layout, ((dpk, dtype, _, gather, embedding), idx) in zip(layouts, kinds.items()):
        if gather is Gather.SUBCLASS:
            units.append(build_subclass_unit(
                group, len(units), group.dps[dpk], layout,
                [(*params[i], placed[i]) for i in idx], group.mp_policy, post_forward_comm))
            continue
        compute, reduce_ = _mp_dtypes(group, dtype)
        buf = DBuffer(layout, device=group.device, dtype=dtype, compute_dtype=compute, reduce_dtype=reduce_)
        if gather is Gather.QUANT:
            (attach_mx if isinstance(quant, (MXFP8, NVFP4)) else attach_quant)(buf, quant)
        index, infos = len(units), []
        for j, i in enumerate(idx):
            name, p, owners = params[i]
            pl = placed[i]
            data = pl.data.detach()
            buf.copy_full_(j, data.to(group.device) if data.device.type not in ("meta", group.device.type) else data)
            s = buf.slots[j]
            sharded = make_sharded_param(buf.sharded_view(j), pl.mesh, pl.with_ragged(RaggedShard.of(s.placement)),
                                         tuple(p.shape), p.requires_grad)
            info = ParamInfo(name, index, j, owners, sharded, unsharded_spec=pl.unsharded_spec,
                             dp_dims=pl.dp_dims)
            info.register(sharded)
            infos.append(info)
        units.append(Unit(index, buf, group.dps[dpk], infos, embedding=embedding, hooks=group.hooks,
                          post_forward_comm=post_forward_comm, group_name=group.name, after_grad=group.after_grad))
    return units


def _shared_arguments(group: Building) -> dict[str, object]:
    """The ``fully_shard`` arguments every rank's collectives depend on (the all-gather and
    reduce dtypes and formats, when to re-gather, which parameters are sharded at all): folded
    into the layout fingerprint, so a rank-dependent one is an error naming it on every rank."""
    return {"gradient_reduce": group.gradient_reduce, "mp_policy": group.mp_policy,
            "reshard_after_forward": group.reshard_after_forward, "ignored_params": group.ignored_params}


def _plan(group: Building, params, placed, idx, dtype, granularity_fn, W, rank, fp8=Gather.PLAIN):
    """Plan one buffer over ``W`` ranks. The shapes packed are the tensors the data-
    parallel split applies to (TP/EP-local for DTensor parameters); ``granularity_fn``
    is asked about the parameter and applies to that local tensor."""
    gather = Gather.of(fp8)  # "fp8": the old name of the kind, and its False/True/"subclass" spelling
    tensors, keys = [], set()
    for j, i in enumerate(idx):
        name, p, _ = params[i]
        shape = tuple(placed[i].data.shape)
        spec = None
        if granularity_fn is not None:
            raw = granularity_fn(name, p)
            try:
                spec = parse_granularity(raw)
            except ValueError as e:
                raise ValueError(f"fully_shard: granularity_fn returned {raw!r} for {name!r}: {e}") from e
        if gather is Gather.SUBCLASS:
            spec = extension_granularity(name, placed[i].data, spec)
        elif gather is Gather.QUANT:
            spec = fp8_granularity(group.all_gather_quant, name, shape, spec)
        key = name if name not in keys else f"{name}#{j}"  # list groups may repeat names
        keys.add(key)
        tensors.append((key, shape, spec))
    try:
        return plan_layout(tensors, W, rank, itemsize=torch.empty((), dtype=dtype).element_size())
    except (ValueError, NotImplementedError) as e:
        raise ValueError(f"fully_shard: cannot lay out the parameters of {group.describe()}: {e}") from e


def _mp_dtypes(group: Building, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    if not dtype.is_floating_point:
        return dtype, dtype
    compute = group.mp_policy.param_dtype or dtype
    reduce_ = group.mp_policy.reduce_dtype or compute
    return compute, reduce_
