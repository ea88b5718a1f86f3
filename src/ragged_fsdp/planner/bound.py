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

So ``S`` is feasible for tensor ``t`` iff ``S >= thr_t`` or ``L_t | S``.

A third, joint condition counts granular capacity. Take a grain ``q`` and the tensors whose
size and cut step are multiples of it (``q | e_t`` and ``q | L_t``), of total mass ``M_q``;
every piece of them inside a segment (a head ``d``, a tail ``e_t - d - jS``, a middle ``S``,
or a whole tensor) is a multiple of ``q``, so a segment holding ``o_k`` other elements holds
at most ``floor((S - o_k) / q) = m - ceil((o_k - s) / q)`` grains of them (``S = m*q + s``,
``o_k >= s``). Summing over segments: ``M_q / q + ceil((O_q - A) / q) <= W*m`` where ``O_q`` is
the mass of the other tensors and ``A >= sum_k min(o_k, s)`` is what the segments' spare
``s`` can absorb for free: at most ``W*s``, and at most ``min(e_t, c_t*s)`` per other tensor,
which touches at most ``c_t = floor((e_t - 1) / S) + 2`` segments. This is what makes, e.g.,
128 separate experts of 45 and 22.5 row blocks plus one 64-half-block o_proj at 256 ranks
cost a whole extra half block per segment.

:meth:`Conditions.next_candidate` finds the least ``S >= x`` meeting every condition; from
the capacity bound it gives the lower bound, and the heuristic walks candidates with it.
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
    """The necessary conditions of a problem, deduplicated, for fast candidate search."""

    def __init__(self, prob: Problem):
        a = self.a = prob.a
        self.W = prob.world_size
        pairs = {(_threshold(e, L, a), L) for e, L in zip(prob.e, prob.L) if e > 0}
        self.pairs = sorted(pairs, reverse=True)  # by threshold, largest first
        self.base = max(a, roundup(-(-prob.padded_sum // prob.world_size), a))
        if prob.padded_sum == 0:
            self.base = 0
        self.grains = _grains(prob)

    def next_candidate(self, x: int) -> int:
        """Least aligned ``S >= x`` that meets every condition."""
        S = self._next_per_tensor(x)
        while True:
            S2 = S
            for q, need, other in self.grains:
                S2 = max(S2, self._next_grain(S2, q, need, other))
            if S2 == S:
                return S
            S = self._next_per_tensor(S2)

    def _next_per_tensor(self, x: int) -> int:
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

    def _next_grain(self, x: int, q: int, need: int, others: tuple) -> int:
        """Least aligned S >= x passing the grain-``q`` capacity condition (see module doc)."""
        W, a = self.W, self.a
        total_other = sum(e * c for e, c in others)
        m, s = divmod(x, q)
        while True:
            slack = W * m - need
            if slack >= 0:
                target = total_other - q * slack  # what the spare s must absorb
                s_min = s if target <= 0 else None
                if s_min is None:
                    # touches per tensor from the smallest S considered: never underestimates
                    ref = max(x, m * q)
                    spans = [(e, c, ((e - 1) // ref + 2)) for e, c in others]

                    def absorb(t):
                        return min(W * t, sum(c * min(e, k * t) for e, c, k in spans))

                    if absorb(q - 1) >= target:
                        lo, hi = s, q - 1
                        while lo < hi:
                            mid = (lo + hi) // 2
                            if absorb(mid) >= target:
                                hi = mid
                            else:
                                lo = mid + 1
                        s_min = lo
                if s_min is not None:
                    S = roundup(m * q + s_min, a)
                    if S // q == m:
                        return S
            m, s = m + 1, 0


def _grains(prob: Problem) -> list[tuple[int, int, tuple]]:
    """(q, grains needed, other tensors as (size, count) pairs) for the grains worth checking:
    each structured tensor's ``gcd(e_t, L_t)`` and the gcds of those, above the alignment."""
    a = prob.a
    own = {math.gcd(e, L) for e, L in zip(prob.e, prob.L) if e > 0 and L > a}
    grains = set(own)
    for x in own:
        for y in own:
            grains.add(math.gcd(x, y))
    out = []
    for q in sorted((g for g in grains if g > a), reverse=True)[:24]:
        mass, others = 0, {}
        for e, L in zip(prob.e, prob.L):
            if e % q == 0 and L % q == 0:
                mass += e
            elif e:
                others[e] = others.get(e, 0) + 1
        if mass:
            out.append((q, mass // q, tuple(sorted(others.items()))))
    return out


def lower_bound_segment(specs: Sequence[TensorSpec] | Problem, world_size: int | None = None,
                        align_bytes: int = 16) -> int:
    """The least segment size ``S`` that passes every structural condition (elements)."""
    prob = specs if isinstance(specs, Problem) else Problem.build(specs, world_size, align_bytes)
    return Conditions(prob).next_candidate(0)


def lower_bound(specs: Sequence[TensorSpec], world_size: int, align_bytes: int = 16) -> int:
    """Lower bound on the buffer size ``W * S`` in elements, for any valid layout."""
    return int(world_size) * lower_bound_segment(specs, world_size, align_bytes)
