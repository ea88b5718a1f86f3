"""Each framework's buffer lifetimes, one function per framework: what a group costs while
it is gathered, while its gradients are computed, and while they are reduced.

This is the file to change when an engine changes its buffers (e.g. ragged_fsdp's lazy
gradient storage, issue 10). Every figure is bytes on one rank for one group ``g``
(:class:`~ragged_fsdp.sim.layout.GroupLayout`), with ``cb``/``rb`` the compute and reduce
dtype sizes. Returned dicts name each buffer, so the output can say where frameworks differ.

Sources: our engine (``ragged_fsdp.dbuffer``, ``ragged_fsdp.fsdp.comms.collectives``); torch FSDP2
(``_fsdp_collectives.py``: all-gather into one flat buffer then ``split_with_sizes_copy``
into per-parameter unsharded tensors, gradients copied into a flat reduce-scatter input by
``chunk_cat``); FSDP1 (``FlatParameter``: parameters and gradients are views of one flat
padded tensor; freed through ``record_stream``, so the rate limiter keeps up to two
all-gathers live); DeepSpeed ZeRO-3 (per-parameter partitions padded to the world size,
parameters at or under ``stage3_param_persistence_threshold`` replicated, gradients copied
into a reduce bucket of ``reduce_bucket_size`` elements, fp32 master weights beside the
low-precision partition); Megatron-FSDP (flat parameter and gradient buckets, chunked at
the LCM of row sizes, double-buffered all-gather).
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import GroupLayout

__all__ = ["Lifetimes", "LIFETIMES", "DIFFERENCES"]

DS_REDUCE_BUCKET = 500_000_000  # DeepSpeed reduce_bucket_size default (elements)


@dataclass(frozen=True)
class Lifetimes:
    """What one framework allocates around one group (bytes, named)."""

    # while the group is gathered (forward, and backward if resharded after forward)
    gathered: callable
    # extra bytes that exist only while the gather completes (e.g. copy-out source)
    gather_temp: callable
    # what a prefetched gather holds before it is waited on (its output buffer)
    pending_gather: callable
    # gradients of the group while its backward runs (unsharded)
    grads: callable
    # extra bytes while the group's gradients are reduced
    reduce_temp: callable
    # all-gathers that may be live at once in forward (current + prefetched)
    live_gathers: int = 2
    # the gradients are freed once copied into the reduction input (copy-in frameworks)
    grads_freed_at_reduce: bool = False
    # bytes copied per gather / per reduction (copy-in/copy-out), for the time model
    copy_out: callable = lambda g, cb: 0
    copy_in: callable = lambda g, rb: 0
    # extra persistent bytes per sharded element (e.g. DeepSpeed's low-precision partition)
    extra_persistent: callable = lambda g, cb, pb: 0
    # untied embedding weights in a buffer of their own (GroupLayout.apart elements per
    # rank): freed after forward even in a kept group, not gathered for backward, their
    # gradients allocated only when they arrive (the end of backward)
    embedding_apart: bool = False
    # the root's other buffer (norm, head) is reduced and freed as soon as their backward
    # ran (the start of backward), not with the embedding at the end
    root_early: bool = False


def _ragged_grads(g: GroupLayout, rb: int, backend: str) -> dict:
    # one flat W*S gradient buffer from the group's first gradient until its reduction
    return {"flat grad buffer (W*S)": g.gathered * rb}


def _ragged_reduce(g: GroupLayout, rb: int, backend: str) -> dict:
    if g.shard_world == 1:
        return {}
    if backend == "gloo" and g.shard_world > 2:  # all-to-all receives (W-1)*S, summed into the sharded grad
        return {"all-to-all receive ((W-1)*S)": (g.shard_world - 1) * g.segment * rb}
    # (gloo at W = 2: the one piece received lands in the sharded gradient itself)
    return {}  # NCCL reduce_scatter_single writes straight into the sharded gradient


RAGGED = Lifetimes(
    gathered=lambda g, cb: {"unsharded flat buffer (W*S)": g.gathered * cb},
    gather_temp=lambda g, cb: {},
    pending_gather=lambda g, cb: g.gathered * cb,
    grads=_ragged_grads,
    reduce_temp=_ragged_reduce,
    embedding_apart=True,
    root_early=True,
)

FSDP2 = Lifetimes(
    gathered=lambda g, cb: {"unsharded params (per-parameter)": g.numel * cb},
    # the flat all-gather output lives until split_with_sizes_copy has copied it out
    gather_temp=lambda g, cb: {"all-gather output (copied out)": g.gathered * cb},
    pending_gather=lambda g, cb: g.gathered * cb,  # unsharded params are allocated at copy-out
    grads=lambda g, rb, backend: {"unsharded grads (per-parameter)": g.numel * rb},
    # chunk_cat copies the gradients into a padded flat reduce-scatter input
    reduce_temp=lambda g, rb, backend: ({"reduce-scatter input (copy-in)": g.gathered * rb}
                                        if g.shard_world > 1 else {}),
    copy_out=lambda g, cb: g.numel * cb,
    copy_in=lambda g, rb: g.gathered * rb if g.shard_world > 1 else 0,
    grads_freed_at_reduce=True,
)

FSDP1 = Lifetimes(
    gathered=lambda g, cb: {"unsharded flat param (padded)": g.gathered * cb},
    gather_temp=lambda g, cb: {},
    pending_gather=lambda g, cb: g.gathered * cb,
    grads=lambda g, rb, backend: {"flat grad (padded)": g.gathered * rb},
    reduce_temp=lambda g, rb, backend: {"reduce-scatter output": g.segment * rb},
    live_gathers=3,  # record_stream frees late; the rate limiter allows two in flight + current
)

DEEPSPEED = Lifetimes(
    gathered=lambda g, cb: {"gathered params": (g.numel) * cb},
    gather_temp=lambda g, cb: {"all-gather flat buffer": g.gathered * cb},
    pending_gather=lambda g, cb: g.gathered * cb,
    grads=lambda g, rb, backend: {"unsharded grads (per-parameter)": g.numel * rb},
    reduce_temp=lambda g, rb, backend: {"reduce bucket (copy-in)": min(g.gathered, DS_REDUCE_BUCKET) * rb},
    copy_out=lambda g, cb: g.numel * cb,
    copy_in=lambda g, rb: g.gathered * rb,
    grads_freed_at_reduce=True,
    # bf16 partition beside the fp32 master, when they differ
    extra_persistent=lambda g, cb, pb: (g.segment * cb if cb != pb else 0),
)

MEGATRON = Lifetimes(
    gathered=lambda g, cb: {"unsharded bucket (LCM chunks)": g.gathered * cb},
    gather_temp=lambda g, cb: {},
    pending_gather=lambda g, cb: g.gathered * cb,
    grads=lambda g, rb, backend: {"flat grad bucket": g.gathered * rb},
    reduce_temp=lambda g, rb, backend: {},
    live_gathers=2,
)

LIFETIMES = {"ragged": RAGGED, "fsdp2": FSDP2, "fsdp1": FSDP1, "deepspeed": DEEPSPEED, "megatron": MEGATRON}

# What each framework does differently from ragged_fsdp, named in the output.
DIFFERENCES = {
    "ragged": ["planner layout (no block cut, padding between tensors)", "all-gather output is the parameters (no copy-out)",
               "gradients land in one flat buffer; one reduce-scatter per group (no copy-in)"],
    "fsdp2": ["per-parameter Shard(0), dim 0 padded to W (3-D experts: Shard(1) when dim 0 < W, as torchtitan)", "copy-out of every parameter after each all-gather",
              "copy-in of every gradient before each reduce-scatter"],
    "fsdp1": ["flat parameter padded to W, blocks cut", "record_stream frees late (3 gathers live)"],
    "deepspeed": ["per-parameter flat partitions padded to W", "small parameters (<= persistence threshold) replicated",
                  "low-precision partition beside fp32 master", "gradient copy into a reduce bucket",
                  "gathered parameters copied out of the flat buffer"],
    "megatron": ["flat buckets chunked at the LCM of row sizes (padding)", "no copies (views of buckets)"],
}
