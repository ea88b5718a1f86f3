"""Where another framework's result differs from ragged_fsdp's, by cause.

Throughput: the step-time difference split into the additive time parts that differ:
copy-out / copy-in (FSDP2 and DeepSpeed copy on the compute stream), exposed collectives
(larger all-gathers and reduce-scatters from padding, and where they fall against compute),
the optimizer (it touches padded shards), and the rest. Memory: the peak difference split by
what each peak holds: padding of the sharded state (parameters, gradients, optimizer
states), copy-out and copy-in buffers, gradient buffers and their lifetimes, gathered
parameters, activations and the loss, and the allocator reserve (fragmentation and cached
blocks: a fitted fraction of the peak allocated, the same fraction for every framework, so
its share only follows the other differences; framework-specific fragmentation is not
modelled). The causes sum to the total difference.
"""

from __future__ import annotations

__all__ = ["breakdown", "memory_cause"]

_TIME = {"copies": "copy-out / copy-in", "exposed comm": "exposed FSDP collectives (padding, overlap)",
         "optimizer": "optimizer (padded shards)",
         "gradient wire quantise": "gradient wire quantise / error feedback (ragged_fsdp's gradient_reduce)"}


def memory_cause(item: str) -> str:
    k = item.lower()
    if k.startswith("error-feedback"):
        return "error-feedback residuals (gradient_reduce)"
    if k.startswith(("sharded params", "optimizer states", "sharded grad", "sharded grads")):
        return "sharded state incl. padding"
    if "copied out" in k or "copy-out" in k:
        return "copy-out buffer"
    if "copy-in" in k or "reduce bucket" in k or "reduce-scatter output" in k or "receive" in k:
        return "copy-in / reduction buffers"
    if "grad" in k:
        return "gradient buffers and lifetimes"
    if "gathered" in k or "prefetched" in k or "unsharded" in k or "bucket" in k:
        return "gathered parameters (incl. padding)"
    if "activation" in k or "logits" in k:
        return "activations and loss"
    return "other (optimizer temporaries)"


def _by_cause(items: dict) -> dict:
    out: dict[str, float] = {}
    for k, v in items.items():
        c = memory_cause(k)
        out[c] = out.get(c, 0.0) + v
    return out


def breakdown(base, other) -> dict:
    """``other`` minus ``base`` (two FrameworkResults), by cause. Time in seconds and as a
    fraction of ``base``'s step; memory in bytes; each side's causes sum to the total."""
    dt = {}
    rest = other.step_s - base.step_s
    for part, cause in _TIME.items():
        d = other.time_parts.get(part, 0.0) - base.time_parts.get(part, 0.0)
        dt[cause] = d
        rest -= d
    dt["other"] = rest
    a, b = _by_cause(base.memory_items), _by_cause(other.memory_items)
    dm = {c: b.get(c, 0.0) - a.get(c, 0.0) for c in sorted(set(a) | set(b))}
    # the rest of the total: the allocator reserve's share (a fitted fraction of the peak
    # allocated, the same for every framework) and the fixed reserve (equal on both sides)
    dm["allocator reserve / fragmentation"] = (other.memory_bytes - base.memory_bytes) - sum(dm.values())
    return {"step_s": {k: v for k, v in dt.items()},
            "step_frac": {k: v / base.step_s for k, v in dt.items()},
            "tokens_per_s_ratio": other.tokens_per_s_per_gpu / base.tokens_per_s_per_gpu,
            "memory_bytes": dm, "memory_total_bytes": other.memory_bytes - base.memory_bytes,
            "peak_phase": {"ragged": base.peak_phase, other.framework: other.peak_phase}}
