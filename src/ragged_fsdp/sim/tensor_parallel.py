"""Tensor (sequence) parallelism: torchtitan's Llama plan, colwise q/k/v and gate/up,
rowwise o/down, sequence-parallel norms.

Per block and pass, two all-gathers (before attention and before the MLP) and two
reduce-scatters (after them) of one microbatch's activations (``tokens x hidden`` in the
compute dtype; float8 tensorwise gathers them in float8, 1 byte). Forward and backward
each run all four; full recomputation reruns the forward's; per-op SAC saves the
reduce-scatter outputs (no collectives rerun). Vanilla TP runs them on the compute stream:
all exposed. Async TP (collective matmul over SymmetricMemory) splits each into ``tp`` ring
steps under the matmul it feeds: one step stays exposed, and whatever the matmul is too
short to hide.
"""

from __future__ import annotations

from .comm import collective_time
from .profiles import GPUProfile

__all__ = ["tp_block_comm"]


def tp_block_comm(prof: GPUProfile, tp: int, stride: int, tokens: float, hidden: int, cb: float, ag_cb: float,
                  act_ckpt: str, async_tp: bool, block_mm_fwd_s: float) -> tuple[float, float]:
    """(exposed seconds, total seconds) of one block's TP collectives for one microbatch."""
    if tp <= 1:
        return 0.0, 0.0
    ag_f = collective_time(prof, "all_gather", tokens * hidden * ag_cb, tp, stride)
    ag_b = collective_time(prof, "all_gather", tokens * hidden * cb, tp, stride)
    rs = collective_time(prof, "reduce_scatter", tokens * hidden * cb, tp, stride)
    fwd = 2 * ag_f + 2 * rs
    bwd = 2 * ag_b + 2 * rs
    rec = fwd if act_ckpt == "full" else (0.5 * fwd if act_ckpt == "selective" else 0.0)
    total = fwd + bwd + rec
    if not async_tp:
        return total, total
    # the fed matmuls: forward, backward (2x), the recomputed forward
    mm = block_mm_fwd_s * (1 + 2 + (1 if act_ckpt == "full" else 0.5 if act_ckpt == "selective" else 0))
    exposed = total / tp + max(0.0, total * (tp - 1) / tp - mm)
    return exposed, total
