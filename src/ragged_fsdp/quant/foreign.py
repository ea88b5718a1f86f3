"""FSDP2's protocol for parameters whose data is a tensor subclass with its own all-gather
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, torch 2.13 signatures), as far as it
needs no engine state: recognising such a parameter, the rows the planner must keep whole
(its ``ragged_granularity`` spec, else whole rows), what this engine refuses for it, a rank's
rows of a value and the call of ``fsdp_pre_all_gather`` with the arity FSDP2 accepts.

Foreign quantised weights go through one table, :data:`ADAPTERS`: each entry says how to
**match** the foreign type (by name: neither bitsandbytes nor torchao is a dependency), how
to **adopt** it as this package's subclass (their own ops split only into equal pieces, which
pieces of different sizes do not fit), the **granularity** of the adopted value, and how to
**attach** a sharded piece to its owner modules (what the owner layer reads besides the
weight). Today: bitsandbytes' ``Params4bit`` as :class:`~ragged_fsdp.quant.bnb4.BnB4Weight`
(attached by :mod:`.bnb4_owner`), torchao's ``NF4Tensor`` as
:class:`~ragged_fsdp.quant.nf4.NF4Weight`. A parameter is adopted once, when ``fully_shard``
places it; the unit building never asks for a type.

The unit kind that gathers such parameters is ``fsdp/core/subclass_unit.py``; checkpoints
(``checkpoint/subclass_values.py``) call the helpers here too. It lives below the engine
because it needs no engine state and both of them read it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from ragged_fsdp.planner.granularity import Granularity

from .bnb4 import BnB4Weight, is_params4bit
from .bnb4_owner import attach_bnb4
from .nf4 import NF4Weight

__all__ = ["Adapter", "ADAPTERS", "is_extension", "extension_granularity", "check_extension", "call_pre_all_gather",
           "adopt_foreign", "attach_foreign", "rows_of"]


@dataclass(frozen=True)
class Adapter:
    """How one foreign quantised weight type enters the engine."""

    name: str
    match: Callable[[torch.Tensor], bool]  # is this value of the foreign type
    adopt: Callable[[torch.Tensor], torch.Tensor]  # the foreign value as our subclass
    adopted: type  # our subclass
    # the rows the planner keeps whole, as a granularity spec, of an adopted value
    granularity: Callable[[torch.Tensor], str] = lambda data: data.ragged_granularity
    # (sharded parameter, this rank's piece, layout slot, owners, mesh, world) -> None
    attach: Callable[..., None] | None = None


def _is_torchao_nf4(data) -> bool:
    t = type(data)
    return t.__name__ == "NF4Tensor" and t.__module__.startswith("torchao.")


ADAPTERS: tuple[Adapter, ...] = (
    Adapter("bitsandbytes Params4bit", is_params4bit, BnB4Weight.from_params4bit, BnB4Weight, attach=attach_bnb4),
    Adapter("torchao NF4Tensor", _is_torchao_nf4, NF4Weight.from_torchao, NF4Weight),
)


def _adapter_of_adopted(data) -> Adapter | None:
    return next((a for a in ADAPTERS if isinstance(data, a.adopted)), None)


def is_extension(name: str, data: torch.Tensor) -> bool:
    """Whether ``data`` carries its own all-gather; an error when it defines only one hook."""
    pre, post = hasattr(data, "fsdp_pre_all_gather"), hasattr(data, "fsdp_post_all_gather")
    if pre != post:
        raise TypeError(
            f"fully_shard: {name!r} is a {type(data).__name__} that defines only "
            f"{'fsdp_pre_all_gather' if pre else 'fsdp_post_all_gather'}; a tensor subclass with its own "
            "all-gather must define both (the FSDP2 protocol)"
        )
    return pre


def extension_granularity(name: str, data: torch.Tensor, requested: Granularity | None) -> Granularity:
    """The rows the planner keeps whole for a subclass parameter: an adopted foreign weight's
    by its adapter, any other subclass's ``ragged_granularity``, else whole rows."""
    adapter = _adapter_of_adopted(data)
    spec = adapter.granularity(data) if adapter is not None else getattr(data, "ragged_granularity", None)
    g = Granularity.parse(spec or "row")
    if requested is not None and str(requested) != str(g):
        raise ValueError(
            f"fully_shard: {name!r} is a {type(data).__name__} sharded in units of {str(g)!r} (its "
            f"quantisation blocks), but granularity_fn returned {str(requested)!r}; return None for it"
        )
    if data.dim() == 0:
        raise ValueError(f"fully_shard: {name!r} is a 0-d {type(data).__name__}; subclass parameters are split by rows")
    return g


def check_extension(name: str, p: nn.Parameter, pl) -> None:
    """What this engine does not do with subclass parameters, refused by name."""
    if pl.unsharded_spec is not None or pl.dp.replicate is not None or pl.dp.spmd_mesh is not None:
        raise NotImplementedError(
            f"fully_shard: {name!r} is a {type(pl.data).__name__} with its own all-gather; those are "
            "gathered on a 1-D data-parallel mesh only (no HSDP, TP/EP or dp_mesh_dims)"
        )


def adopt_foreign(data: torch.Tensor) -> torch.Tensor:
    """A foreign quantised weight as this package's subclass (the adapter that matches it);
    any other tensor as it is."""
    for a in ADAPTERS:
        if a.match(data):
            return a.adopt(data)
    return data


def attach_foreign(sharded: nn.Parameter, piece: torch.Tensor, slot, owners, mesh, world: int) -> None:
    """Wire a sharded adopted weight into its owner modules where its adapter says how."""
    adapter = _adapter_of_adopted(piece)
    if adapter is not None and adapter.attach is not None:
        adapter.attach(sharded, piece, slot, owners, mesh, world)


def rows_of(name: str, data: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Rows ``[r0, r1)`` of a subclass value, as a value of the same subclass: by
    ``split_with_sizes`` (what NF4 weights implement), else by ``slice`` (what torchao's
    float8 training weight keeps its type under; it drops it under ``split_with_sizes``)."""
    piece = torch.split(data, [r0, r1 - r0, data.shape[0] - r1], dim=0)[1]
    if type(piece) is not type(data):
        piece = data.narrow(0, r0, r1 - r0)
    if type(piece) is not type(data):
        raise TypeError(
            f"fully_shard: {name!r}: rows of a {type(data).__name__} come back as {type(piece).__name__} "
            "under both torch.split and narrow; its __torch_dispatch__ must keep its type under "
            "aten.split_with_sizes or aten.slice to be sharded by rows"
        )
    return piece


def call_pre_all_gather(local: torch.Tensor, mesh, outer_size, outer_stride, module, mp_policy):
    """``fsdp_pre_all_gather`` with the arity FSDP2 in torch 2.13 accepts (1 or 5 parameters)."""
    fn = local.fsdp_pre_all_gather
    n = len(inspect.signature(fn).parameters)
    if n == 1:
        return fn(mesh)
    if n == 5:
        return fn(mesh, outer_size, outer_stride, module, mp_policy)
    raise TypeError(
        f"{type(local).__name__}.fsdp_pre_all_gather{inspect.signature(fn)}: expected (mesh) or (mesh, "
        "outer_size, outer_stride, module, mp_policy), as torch's FSDP2 calls it"
    )
