"""Activations one block saves for backward, per token, under each checkpointing mode and
tensor/sequence parallelism: what the memory model's "saved activations" and "block working
activations" are made of (:meth:`.arch.Arch.layer_act_bytes` holds the per-block count).

Under TP with sequence parallelism (torchtitan's plan) a block's residual stream and norms
are split over the sequence and its heads and MLP columns over ``tp``; what a linear saves
in its all-gathered form (the column-parallel linears' input) or as a full-size partial sum
(a row-parallel linear's output, which per-op SAC keeps) is not split.
"""

from __future__ import annotations

from .arch import Arch
from .compute import op_sac_split

__all__ = ["saved_bytes_per_token"]


def saved_bytes_per_token(arch: Arch, tensors, moe: bool, mode: str, layer_idx: int, cb: int,
                          tp: int, compiled: bool = False) -> float:
    """Bytes one block saves for backward per token of the rank's (pre-TP) tokens under
    ``mode``. Sequence parallelism splits everything over ``tp`` except what is saved in
    its all-gathered (full-sequence) or partial-sum form. ``compiled``: the block under
    ``torch.compile``."""
    split, gathered = arch.layer_act_bytes(moe, cb, compiled)
    whole = split / tp + gathered
    block_input = arch.hidden * cb / tp  # the residual stream, sequence-parallel
    if mode == "none":
        return whole
    if mode == "full":
        return block_input
    if mode == "selective":  # torchtitan's per-layer SAC: every 2nd block checkpointed
        return whole if layer_idx % 2 else block_input
    # per-op SAC (torchtitan's save list: mm, sdpa, reduce_scatter_tensor, max): the block
    # input, every other matmul output (a row-parallel linear's is its full-size partial sum
    # before the reduce-scatter), the attention output and its fp32 log-sum-exp, and under
    # TP the two reduce-scatter outputs (sequence-sharded). Compiled, the partitioner drops
    # the saved outputs backward never reads: the row-parallel linears' and the
    # reduce-scatters' (they feed only the residual adds)
    col, row = op_sac_split(tensors, arch.top_k / arch.experts if arch.experts else 1.0)
    attn = arch.heads * arch.v_dim * cb + 4 * arch.heads
    scattered = 2 * arch.hidden * cb if tp > 1 and not compiled else 0.0
    if compiled:
        row = 0.0
    return block_input + (col * cb + attn + scattered) / tp + row * cb
