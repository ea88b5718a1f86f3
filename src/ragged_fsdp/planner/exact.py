"""Exact minimum ``W * S`` for small groups, to measure the heuristic against.

For a fixed ``S`` and a fixed order of tensors, placing each at its earliest valid offset is
optimal (the valid offsets of a tensor do not depend on the others, so starting later never
helps). Hence the least end reachable after placing a *set* of tensors is a function of the
set alone, and a dynamic program over sets decides whether ``S`` is feasible. Identical
tensors (same size and block) are interchangeable, so a set is just how many of each kind
are placed: ``prod(count_k + 1)`` states, which keeps e.g. 128 identical experts cheap.
The segment sizes are walked upward from the structural lower bound over the candidates
every necessary condition allows, so the first feasible one is optimal.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from .bound import Conditions
from .granularity import TensorSpec
from .plan import Plan
from .problem import Problem, earliest_start

__all__ = ["solve_exact", "exact_segment", "feasible_end", "exact_below", "MAX_EXACT_STATES"]

MAX_EXACT_STATES = 2_000_000


def _kinds(prob: Problem) -> list[tuple[int, int, list[int]]]:
    kinds: dict[tuple[int, int], list[int]] = {}
    for i in range(prob.n):
        kinds.setdefault((prob.e[i], prob.L[i]), []).append(i)
    return [(e, L, members) for (e, L), members in kinds.items()]


class _OutOfBudget(Exception):
    pass


def feasible_end(prob: Problem, S: int, kinds=None, budget: list[int] | None = None):
    """Least aligned end of any layout of all tensors with segment ``S`` that stays within
    ``W*S``, and the parent links to rebuild it; ``(None, None)`` when there is none.
    ``budget`` (a one-item list) counts down per state expanded; at zero the walk stops
    with :class:`_OutOfBudget`."""
    kinds = kinds or _kinds(prob)
    a, cap = prob.a, prob.world_size * S
    counts = tuple(len(m) for _, _, m in kinds)
    start = (0,) * len(kinds)
    layer = {start: 0}
    parent: dict[tuple, tuple] = {}
    for _ in range(sum(counts)):
        nxt: dict[tuple, int] = {}
        if budget is not None:
            budget[0] -= len(layer) * len(kinds)
            if budget[0] < 0:
                raise _OutOfBudget
        for state, p in layer.items():
            for k, (e, L, _) in enumerate(kinds):
                if state[k] == counts[k]:
                    continue
                l = earliest_start(p, e, L, S)
                if l is None or l + e > cap:
                    continue
                end = -(-(l + e) // a) * a
                ns = state[:k] + (state[k] + 1,) + state[k + 1:]
                if end < nxt.get(ns, cap + a + 1):
                    nxt[ns] = end
                    parent[ns] = (state, k, l)
        if not nxt:
            return None, None
        layer = nxt
    return layer[counts], parent


def _offsets(prob: Problem, kinds, parent) -> list[int]:
    offs = [0] * prob.n
    state = tuple(len(m) for _, _, m in kinds)
    while any(state):
        prev, k, l = parent[state]
        offs[kinds[k][2][prev[k]]] = l
        state = prev
    return offs


def exact_below(prob: Problem, cond: Conditions, s_from: int, s_to: int,
                budget: int, max_candidates: int = 32,
                spent: list[int] | None = None) -> tuple[int, list[int]] | None:
    """The least feasible segment in ``[s_from, s_to)`` and its offsets, walking the
    admissible candidates upward; None when there is none below ``s_to`` or when the walk
    would cost more than ``budget`` state expansions or ``max_candidates`` segment sizes
    (then nothing is claimed). ``spent`` (a one-item list) gets the expansions used added.

    The planner calls this after the heuristic (``s_to`` = its segment) on groups where the
    walk is cheap: few tensors or few distinct kinds, and a short way from the bound."""
    kinds = _kinds(prob)
    left = [budget]
    S = cond.next_candidate(s_from)
    try:
        for _ in range(max_candidates):
            if S >= s_to:
                return None
            end, parent = feasible_end(prob, S, kinds, left)
            if end is not None:
                return S, _offsets(prob, kinds, parent)
            S = cond.next_candidate(S + 1)
    except _OutOfBudget:
        return None
    finally:
        if spent is not None:
            spent[0] += min(budget, budget - left[0])  # an overrun stops before that layer
    return None


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
    kinds = _kinds(prob)
    states = 1
    for _, _, members in kinds:
        states *= len(members) + 1
    if states > MAX_EXACT_STATES:
        raise ValueError(f"solve_exact: {states} states (product of kind counts + 1) exceed "
                         f"{MAX_EXACT_STATES}; the instance is too large to solve exactly")
    cond = Conditions(prob)
    s_lb = cond.next_candidate(0)
    offs = [0] * prob.n
    if prob.padded_sum == 0:
        S = 0
    else:
        S = s_lb
        while True:
            end, parent = feasible_end(prob, S, kinds)
            if end is not None:
                break
            if s_max is not None and S >= s_max:
                raise RuntimeError(f"no layout found up to S={s_max}; s_max is not feasible")
            S = cond.next_candidate(S + 1)
        offs = _offsets(prob, kinds, parent)
    names = prob.names
    return Plan(
        world_size=prob.world_size, segment=S,
        offsets={names[i]: offs[i] for i in range(prob.n)},
        order=[names[i] for i in sorted(range(prob.n), key=lambda i: (offs[i], i))],
        specs={s.name: s for s in specs}, align_bytes=align_bytes,
        lower_bound=prob.world_size * s_lb, plan_seconds=time.perf_counter() - t0, strategy="exact",
    )
