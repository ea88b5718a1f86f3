"""Tensor (sequence) parallelism: torchtitan's Llama plan, colwise q/k/v and gate/up,
rowwise o/down, sequence-parallel norms.

Per block and pass, two all-gathers (before attention and before the MLP) and two
reduce-scatters (after them) of one microbatch's activations (``tokens x hidden`` in the
compute dtype; float8 tensorwise gathers them in float8, 1 byte). Forward and backward
each run all four; full recomputation reruns the forward's; per-op SAC saves the
reduce-scatter outputs but not the all-gathers' (torchtitan's ``_save_list``: mm, sdpa,
reduce_scatter_tensor, max), so backward reruns the two all-gathers to rebuild the inputs
of the linears it recomputes and of their weight gradients. Vanilla TP runs them on the
compute stream: all exposed, and each one gathering or scattering along the sequence dim
(dim 1; the collectives work on dim 0) costs a full copy of the unsharded activation
(``torch.distributed._functional_collectives``: ``torch.cat(torch.chunk(...))`` after the
all-gather, before the reduce-scatter), memory-bound at ``mem_bw``. Async TP (collective
matmul over SymmetricMemory) splits each into ``tp`` ring steps under the matmul it feeds
(the all-gather's chunks land in place on a side stream): one step stays exposed, and
whatever the matmul is too short to hide. Its fused matmul + reduce-scatter computes all
``tp`` partial outputs, exchanges them and sums them on the compute stream
(``torch.distributed._symmetric_memory._fused_matmul_reduce_scatter_impl``: ``reduce_fn``
over the stacked partials), reading the whole unsharded output and writing its shard:
``(1 + 1/tp) x tokens x hidden`` elements per reduce-scatter, memory-bound and exposed.
"""

from __future__ import annotations

from .comm import collective_time
from .profiles import GPUProfile

__all__ = ["tp_block_comm"]


def tp_block_comm(prof: GPUProfile, tp: int, stride: int, tokens: float, hidden: int, cb: float, ag_cb: float,
                  act_ckpt: str, async_tp: bool, block_mm_fwd_s: float,
                 feed: list[float] | None = None) -> tuple[float, float]:
    """(exposed seconds, total seconds) of one block's TP collectives for one microbatch."""
    if tp <= 1:
        return 0.0, 0.0
    ag_f = collective_time(prof, "all_gather", tokens * hidden * ag_cb, tp, stride)
    ag_b = collective_time(prof, "all_gather", tokens * hidden * cb, tp, stride)
    rs = collective_time(prof, "reduce_scatter", tokens * hidden * cb, tp, stride)
    fwd = 2 * ag_f + 2 * rs
    bwd = 2 * ag_b + 2 * rs
    rec = {"full": fwd, "selective": 0.5 * fwd, "op": 2 * ag_f}.get(act_ckpt, 0.0)
    total = fwd + bwd + rec
    if not async_tp:
        # the dim-1 <-> dim-0 reshuffle copies, read + write of each unsharded tensor
        rerun = {"full": 2, "selective": 1, "op": 2}.get(act_ckpt, 0)
        n_ag_f = 2 + rerun  # forward all-gathers (and their reruns), in the gather dtype
        n_cb = 2 + 2 + 2 + (rerun if act_ckpt != "op" else 0)  # backward all-gathers, all reduce-scatters
        copies = 2 * tokens * hidden * (n_ag_f * ag_cb + n_cb * cb) / prof.mem_bw
        return total + copies, total + copies
    # each collective hides under the matmul it feeds or is fed by (forward; in backward
    # the input-gradient GEMM of the same linear, same size), not under the whole block
    passes = {"full": 1.0, "selective": 0.5}.get(act_ckpt, 0.0)  # forward reruns
    if feed:
        def hid(c, t):
            return c / tp + max(0.0, c * (tp - 1) / tp - t)
        fwd_x = sum(hid(c, t) for c, t in zip([ag_f, rs, ag_f, rs], feed))
        bwd_x = sum(hid(c, t) for c, t in zip([rs, ag_b, rs, ag_b], feed))
        exposed = fwd_x * (1 + passes) + bwd_x
        if act_ckpt == "op":  # the rerun all-gathers, under the recomputed q/k/v and gate/up
            exposed += hid(ag_f, feed[0]) + hid(ag_f, feed[2])
    else:
        mm = block_mm_fwd_s * (1 + 2 + passes)
        exposed = total / tp + max(0.0, total * (tp - 1) / tp - mm)
    n_rs = 2 + 2 + {"full": 2, "selective": 1}.get(act_ckpt, 0)
    reduce = n_rs * tokens * hidden * cb * (1 + 1 / tp) / prof.mem_bw
    exposed += reduce
    return exposed, total + reduce
