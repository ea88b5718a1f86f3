"""RaggedShard: the placement (pure math) and its DTensor subclass (ops, redistribute)."""
from .ragged_shard import RaggedShard, even_units, same_layout

__all__ = ["RaggedShard", "even_units", "same_layout"]
