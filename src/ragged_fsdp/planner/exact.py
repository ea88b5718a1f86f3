"""Exact minimum ``W * S`` for small groups, to measure the heuristic against.

For a fixed ``S`` and a fixed order of tensors, placing each at its earliest valid offset is
optimal (the valid offsets of a tensor do not depend on the others, so starting later never
helps). Hence the least end reachable after placing a *set* of tensors is a function of the
set alone, and a dynamic program over subsets (``2^n * n`` steps) decides whether ``S`` is
feasible. The segment sizes are walked upward from the structural lower bound over the
candidates every tensor's own condition allows, so the first feasible one is optimal.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from .bound import Conditions
from .granularity import TensorSpec
from .plan import Plan
from .problem import Problem, earliest_start

__all__ = ["solve_exact", "exact_segment", "MAX_EXACT_TENSORS"]

MAX_EXACT_TENSORS = 14


def _pack_subsets(prob: Problem, S: int):
    """Least aligned end over all orders of every subset; returns (ends, parent)."""
    n, e, L, a = prob.n, prob.e, prob.L, prob.a
    cap = prob.world_size * S
    inf = cap + 1
    full = (1 << n) - 1
    best = [inf] * (full + 1)
    parent: list[tuple[int, int] | None] = [None] * (full + 1)  # (tensor, its offset)
    best[0] = 0
    for mask in range(full + 1):
        p = best[mask]
        if p >= inf:
            continue
        for t in range(n):
            bit = 1 << t
            if mask & bit:
                continue
            l = earliest_start(p, e[t], L[t], S)
            if l is None or l + e[t] > cap:
                continue
            end = -(-(l + e[t]) // a) * a
            nxt = mask | bit
            if end < best[nxt]:
                best[nxt] = end
                parent[nxt] = (t, l)
    return best, parent


def exact_segment(specs: Sequence[TensorSpec], world_size: int, align_bytes: int = 16,
                  s_max: int | None = None) -> int:
    """The least feasible segment size S (elements)."""
    return solve_exact(specs, world_size, align_bytes, s_max).segment


def solve_exact(specs: Sequence[TensorSpec], world_size: int, align_bytes: int = 16,
                s_max: int | None = None) -> Plan:
    """An optimal plan. ``s_max`` (e.g. the heuristic's S, known feasible) caps the walk."""
    t0 = time.perf_counter()
    specs = list(specs)
    prob = Problem.build(specs, world_size, align_bytes)
    if prob.n > MAX_EXACT_TENSORS:
        raise ValueError(f"solve_exact handles at most {MAX_EXACT_TENSORS} tensors (got {prob.n})")
    cond = Conditions(prob)
    s_lb = cond.next_candidate(0)
    full = (1 << prob.n) - 1
    if prob.padded_sum == 0:
        S, offs = 0, [0] * prob.n
    else:
        S = s_lb
        while True:
            best, parent = _pack_subsets(prob, S)
            if best[full] <= prob.world_size * S:
                break
            if s_max is not None and S >= s_max:
                raise RuntimeError(f"no layout found up to S={s_max}; s_max is not feasible")
            S = cond.next_candidate(S + 1)
        offs = [0] * prob.n
        mask = full
        while mask:
            t, l = parent[mask]
            offs[t] = l
            mask &= ~(1 << t)
    names = prob.names
    return Plan(
        world_size=prob.world_size, segment=S,
        offsets={names[i]: offs[i] for i in range(prob.n)},
        order=[names[i] for i in sorted(range(prob.n), key=lambda i: (offs[i], i))],
        specs={s.name: s for s in specs}, align_bytes=align_bytes,
        lower_bound=prob.world_size * s_lb, plan_seconds=time.perf_counter() - t0, strategy="exact",
    )
