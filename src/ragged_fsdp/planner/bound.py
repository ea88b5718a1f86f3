"""The structural lower bound on the segment size, and the candidate segment sizes.

Any feasible segment size ``S`` (a multiple of the alignment ``a``) satisfies:

* capacity: ``W * S >= sum_t roundup(e_t, a)`` (each tensor starts aligned, so the next one
  starts at or after its rounded-up end);
* per tensor ``t`` larger than ``S``: either ``L_t = lcm(g_t, a)`` divides ``S`` (cuts every
  ``S`` elements stay on block edges), or the tensor holds exactly one boundary at a distance
  ``d`` from its start with ``L_t | d``, ``d <= S`` and ``e_t - d <= S``. The second case is
  possible exactly when ``S >= thr_t = min_d max(d, e_t - d)``. This covers the brief's two
  rules: a tensor with ``e_t >= 2S`` needs ``g_t | S``, and a block larger than ``S`` cannot be
  placed.

So ``S`` is feasible for tensor ``t`` iff ``S >= thr_t`` or ``L_t | S``. :func:`next_candidate`
finds the least ``S >= x`` meeting every tensor's condition; from the capacity bound it gives
the lower bound, and the heuristic walks candidates with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .granularity import TensorSpec
from .problem import Problem, roundup

__all__ = ["lower_bound", "lower_bound_segment", "Conditions"]


def _threshold(e: int, L: int, a: int) -> int:
    """Least S (aligned) at which a tensor of ``e`` elements fits with at most one cut."""
    best = e  # no cut: the whole tensor in one segment
    half = (e // 2) // L * L
    for d in (half, half + L):
        if 0 < d < e:
            best = min(best, max(d, e - d))
    return roundup(best, a)


class Conditions:
    """The per-tensor conditions of a problem, deduplicated, for fast candidate search."""

    def __init__(self, prob: Problem):
        self.a = prob.a
        pairs = {(_threshold(e, L, prob.a), L) for e, L in zip(prob.e, prob.L) if e > 0}
        # tensors that fit in any segment already large enough for the capacity bound
        self.pairs = sorted(pairs, reverse=True)  # by threshold, largest first
        self.base = max(prob.a, roundup(-(-prob.padded_sum // prob.world_size), prob.a))
        if prob.padded_sum == 0:
            self.base = 0

    def next_candidate(self, x: int) -> int:
        """Least aligned ``S >= x`` that meets every tensor's condition."""
        a = self.a
        S = roundup(max(x, self.base), a)
        pairs = self.pairs
        while True:
            active = [L for thr, L in pairs if thr > S]  # pairs sorted: a prefix, in effect
            if not active:
                return S
            step = a
            for L in set(active):
                step = step * L // math.gcd(step, L)
            cand = roundup(S, step)
            lowest_thr = min(thr for thr, _ in pairs[: len(active)])
            if cand < lowest_thr:
                return cand
            S = lowest_thr  # the set of constrained tensors shrinks from here on


def lower_bound_segment(specs: Sequence[TensorSpec] | Problem, world_size: int | None = None,
                        align_bytes: int = 16) -> int:
    """The least segment size ``S`` that passes every structural condition (elements)."""
    prob = specs if isinstance(specs, Problem) else Problem.build(specs, world_size, align_bytes)
    return Conditions(prob).next_candidate(0)


def lower_bound(specs: Sequence[TensorSpec], world_size: int, align_bytes: int = 16) -> int:
    """Lower bound on the buffer size ``W * S`` in elements, for any valid layout."""
    return int(world_size) * lower_bound_segment(specs, world_size, align_bytes)
