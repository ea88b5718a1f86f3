"""Structure-aware optimizers: distributed Muon and block-wise 8-bit AdamW.

Both work on plain modules and on modules sharded by ``ragged_fsdp.fully_shard`` (or any
layout that gives each rank one contiguous run of each parameter), and each says what the
sharding must keep whole through a ``granularity`` policy for ``fully_shard``.
"""
from .adamw8bit import AdamW8bit, state_bytes
from .muon import Muon, adjust_lr, newton_schulz, newton_schulz_flops
from .routing import (
    adamw8bit_granularity, combined_granularity, muon_granularity, muon_param_groups, split_params,
)

__all__ = [
    "Muon", "AdamW8bit", "state_bytes", "newton_schulz", "newton_schulz_flops", "adjust_lr",
    "muon_granularity", "adamw8bit_granularity", "combined_granularity", "muon_param_groups",
    "split_params",
]
