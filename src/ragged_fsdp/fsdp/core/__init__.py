"""The lifecycle of one ``fully_shard`` call: its hooks, its parameter group and units, what
backward needs from forward, and the gradient reductions (see docs/architecture.md)."""
