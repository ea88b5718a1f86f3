"""FSDP2's protocol for parameters whose data is a tensor subclass with its own all-gather
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, torch 2.13 signatures), as far as it
needs no engine state: recognising such a parameter, the rows the planner must keep whole
(its ``ragged_granularity`` spec; torchao's NF4Tensor: ``block_size * scaler_block_size``
values; anything else: whole rows), what this engine refuses for it, taking foreign 4-bit
types in (bitsandbytes' ``Params4bit`` as :class:`~ragged_fsdp.quant.bnb4.BnB4Weight`,
torchao's ``NF4Tensor`` as :class:`~ragged_fsdp.quant.nf4.NF4Weight`: their ops split only
into equal pieces, which pieces of different sizes do not fit), a rank's rows of a value and
the call of ``fsdp_pre_all_gather`` with the arity FSDP2 accepts.

The unit kind that gathers such parameters is ``fsdp/core/subclass_unit.py``; checkpoints
(``checkpoint/subclass_values.py``) call the helpers here too. It lives below the engine
because it needs no engine state and both of them read it.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn as nn

from ragged_fsdp.planner.granularity import Granularity

__all__ = ["is_extension", "extension_granularity", "check_extension", "call_pre_all_gather", "adopt_foreign",
           "rows_of"]


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
    """The rows the planner keeps whole for a subclass parameter."""
    spec = getattr(data, "ragged_granularity", None)
    if spec is None and hasattr(data, "block_size") and hasattr(data, "scaler_block_size"):
        # torchao's NF4Tensor: double quantisation spans block_size * scaler_block_size values
        span = int(data.block_size) * int(data.scaler_block_size)
        cols = math.prod(data.shape[1:]) if data.dim() > 1 else 1
        spec = f"rows:{span // math.gcd(span, cols)}"
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
    """torchao's ``NF4Tensor`` as an :class:`~ragged_fsdp.quant.nf4.NF4Weight` (see the module
    docstring); any other tensor as it is. Matched by name: torchao is not a dependency."""
    t = type(data)
    if t.__name__ == "Params4bit" and t.__module__.startswith("bitsandbytes"):
        from ragged_fsdp.quant.bnb4 import BnB4Weight

        return BnB4Weight.from_params4bit(data)
    if t.__name__ == "NF4Tensor" and t.__module__.startswith("torchao."):
        from ragged_fsdp.quant.nf4 import NF4Weight

        return NF4Weight.from_torchao(data)
    return data


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
