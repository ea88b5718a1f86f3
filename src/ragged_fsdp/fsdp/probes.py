"""Public probes of the engine's insides, for benchmarks that time or check them.

:func:`probe` wraps the engine's functions behind a named point (a phase of the step's hooks,
the low-precision wire reduction, the cross-rank checks) for the duration of a ``with``
block, and puts them back after. The engine knows where each point is; a caller names only
the point, so a change inside ``fsdp/core`` changes this table and not the benchmarks. Nothing
is wrapped, and nothing costs, outside the block. Hooks are bound when ``fully_shard``
registers them: build the model inside the block to see its hooks.

:func:`hsdp_segment_bytes` reads what a model's HSDP all-reduces should send per step off its
groups.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch

from . import api
from .core import build, param_group, reduction, state, unit
from .core.init import state_of

__all__ = ["POINTS", "probe", "hsdp_segment_bytes"]

# point -> the (owner, attribute) pairs it wraps. A call inside another wrapped call of the same
# step is the caller's business (host_cost counts it in the outer one).
POINTS: dict[str, tuple[tuple[object, str], ...]] = {
    "pre_forward": ((state.FSDPState, "_pre_forward"),),
    "post_forward": ((state.FSDPState, "_post_forward"), (state.FSDPState, "_after_forward_raised")),
    "pre_backward": ((state.FSDPState, "_pre_backward"),),
    "post_backward": ((unit.Unit, "_on_grad"), (param_group.ParamGroup, "after_grad"),
                      (param_group.ParamGroup, "_post_backward_from_autograd")),
    "end_backward": ((state.FSDPState, "_final_callback"),),
    # (dev, comm, grad, target, accumulate, factor, state, ...) -> Pending: one buffer's wire reduction
    "wire_reduce_scatter": ((reduction, "wire_reduce_scatter"),),
    # the cross-rank checks of fully_shard (layout fingerprints, mesh answers)
    "cross_rank_checks": ((build, "check_same_layout"), (api, "check_same_answers")),
}

HOOK_PHASES = ("pre_forward", "post_forward", "pre_backward", "post_backward", "end_backward")


@contextlib.contextmanager
def probe(wrap: Callable[[str, Callable], Callable], points: Iterable[str] = HOOK_PHASES) -> Iterator[None]:
    """Replace each function behind ``points`` with ``wrap(point, fn)`` until the block exits."""
    points = list(points)
    unknown = [p for p in points if p not in POINTS]
    if unknown:
        raise ValueError(f"probe: unknown points {unknown}; the engine has {sorted(POINTS)}")
    saved = []
    try:
        for p in points:
            for owner, name in POINTS[p]:
                fn = owner.__dict__[name]  # the class's own function, not a bound method
                saved.append((owner, name, fn))
                setattr(owner, name, wrap(p, fn))
        yield
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


def hsdp_segment_bytes(model: torch.nn.Module) -> int:
    """Sum over the model's trainable buffers that have a replicate dim of the sharded
    segment's bytes in the reduce dtype: what its HSDP all-reduces should send per step
    (one all-reduce of the reduce-scattered segment per buffer), read off the groups."""
    total, seen = 0, set()
    for m in model.modules():
        st = state_of(m)
        g = getattr(st, "group", None)
        if g is None or id(g) in seen:
            continue
        seen.add(id(g))
        for b, buf in enumerate(g.buffers):
            rep = g.units[b].dp.replicate
            if rep is None or rep.world_size == 1:
                continue
            if any(i.buffer == b and i.sharded.requires_grad for i in g.infos):
                total += buf.segment * torch.empty((), dtype=buf.reduce_dtype).element_size()
    return total
