"""The layout heuristic: pick the least segment size ``S`` that some packing fits.

For a given ``S`` a *packing* places tensors one after another, each at its earliest valid
offset (:func:`.problem.earliest_start`), which may leave a gap before a tensor that had to
start on a block edge. Packings differ in the order:

* ``block-order`` / ``size-order`` / ``model-order``: the structured tensors (cuts restricted)
  by decreasing block, by decreasing size, or as given; then the flexible tensors
  (element-granular: biases, norms) fill the gaps, largest first into the smallest gap that
  takes them, and what is left goes at the end. ``small-fill`` also treats structured
  tensors under S/4 as fillers; plain ``model-order`` (no filling) is the published baseline.
* ``adaptive``: identical tensors form kinds; at each step take the kind that leaves no gap
  (coarsest block first), else the least gap. ``adaptive-hard`` treats small gaps as none
  and puts kinds allowed only one cut first, keeping flexible kinds for the places nothing
  else fits; ``adaptive-shim`` lets flexible tensors cross boundaries to fix the phase.

``S`` is feasible when one packing ends within ``W * S``. The search walks ``S`` upward from
the structural lower bound over sizes that pass every necessary condition (see
:mod:`.bound`), also trying at each step the next multiples of the heavy block sizes (where
identical tensors chain without gaps), jumping by the best packing's shortfall over ``W``,
then bisects back between the last failure and the first success. A packing costs
O(n log n) (adaptive: O(n * kinds)) and never loops over the ``W`` segments, so huge ``W``
costs what small ``W`` does.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left, insort
from collections.abc import Sequence

from .bound import Conditions
from .exact import exact_below
from .granularity import TensorSpec
from .plan import Plan
from .problem import Problem, earliest_start, roundup

__all__ = ["plan_group"]

_REFINE_STEPS = 10
# Exact refinement: after the heuristic, a group whose exact walk from the bound to the
# heuristic's S costs at most this many DP state expansions is solved exactly (small
# groups, or few distinct kinds). About 0.02 s of Python (quiet machine) at the limit; groups at the bound
# (or within 0.01% of it) skip it.
EXACT_BUDGET = 12_000


def plan_group(specs: Sequence[TensorSpec], world_size: int, align_bytes: int = 16) -> Plan:
    """Lay ``specs`` into one buffer of ``world_size`` equal segments; minimise ``W * S``."""
    t0 = time.perf_counter()
    specs = list(specs)
    prob = Problem.build(specs, world_size, align_bytes)
    cond = Conditions(prob)
    s_lb = cond.next_candidate(0)
    W, a = prob.world_size, prob.a
    packer = _Packer(prob)
    spent = [0]

    if prob.padded_sum == 0:  # nothing to lay out
        seg, offs, name = 0, [0] * prob.n, "empty"
    else:
        seg, offs, name = _search(packer, cond, s_lb, W, a)
        # worth it only when the gap to the bound is more than 0.01% of the elements
        if seg > s_lb and (seg - s_lb) * W * 10_000 > packer.used:
            better = exact_below(prob, cond, s_lb, seg, EXACT_BUDGET, spent=spent)
            if better is not None:
                seg, offs, name = better[0], better[1], "exact"

    offsets = {prob.names[i]: offs[i] for i in range(prob.n)}
    order = [prob.names[i] for i in sorted(range(prob.n), key=lambda i: (offs[i], i))]
    return Plan(
        world_size=W, segment=seg, offsets=offsets, order=order,
        specs={s.name: s for s in specs}, align_bytes=align_bytes,
        lower_bound=W * s_lb, plan_seconds=time.perf_counter() - t0, strategy=name,
        packings=packer.packs, exact_states=spent[0],
    )


def _search(packer: "_Packer", cond: Conditions, s_lb: int, W: int, a: int):
    """Least S (among those tried) with a packing that fits; returns (S, offsets, strategy)."""
    tried: dict[int, tuple] = {}

    def attempt(S):
        if S not in tried:
            tried[S] = packer.pack(S)
        return tried[S]

    x, fails, found = s_lb, 0, None
    while found is None:
        cands = packer.candidates(cond, x)
        for S in cands:
            got, end = attempt(S)
            if got is not None:
                found = S
                break
        if found is not None:
            break
        fails += 1
        S0 = cands[0]
        end = tried[S0][1]
        short = end - W * S0 if end is not None else W * S0
        jump = max(a, -(-short // W))
        if fails > 3:  # the packings do not converge: grow geometrically
            jump = max(jump, S0 >> max(0, 8 - fails))
        x = S0 + jump
    # the first success may have jumped past a smaller feasible S: bisect below it, unless
    # the most it could save is under 0.01% of the elements
    hi = found
    lo = max((S for S, (got, _) in tried.items() if got is None and S < hi), default=None)
    if lo is not None and (hi - lo) * W * 10_000 <= packer.used:
        lo = None
    for _ in range(_REFINE_STEPS if lo is not None else 0):
        cands = [c for c in packer.candidates(cond, (lo + hi) // 2 + 1) if lo < c < hi]
        cands = cands or [c for c in packer.candidates(cond, lo + 1) if lo < c < hi]
        if not cands:
            break
        S = cands[0]
        if attempt(S)[0] is not None:
            hi = S
        else:
            lo = S
    offs, name = tried[hi][0]
    return hi, offs, name


class _Packer:
    """Packings of one problem for a given S; tries several orders, returns the first that fits."""

    def __init__(self, prob: Problem):
        self.prob = prob
        self.used = sum(prob.e)
        self.packs = 0
        self._limit = None
        n, e, L, a = prob.n, prob.e, prob.L, prob.a
        idx = range(n)
        structured = [i for i in idx if L[i] > a and e[i] > 0]
        self.flexible = sorted((i for i in idx if L[i] == a or e[i] == 0), key=lambda i: (-e[i], i))
        self.structured = structured
        self.by_block = sorted(structured, key=lambda i: (-L[i], -e[i], i))
        self.by_size = sorted(structured, key=lambda i: (-e[i], -L[i], i))
        # identical structured tensors form kinds, for the adaptive packing
        kinds: dict[tuple[int, int], list[int]] = {}
        for i in self.by_block:
            kinds.setdefault((e[i], L[i]), []).append(i)
        self.kinds = [(ek, Lk, members) for (ek, Lk), members in kinds.items()]
        flex_kinds: dict[tuple[int, int], list[int]] = {}
        for i in self.flexible:
            flex_kinds.setdefault((e[i], L[i]), []).append(i)
        self.all_kinds = self.kinds + [(ek, Lk, members) for (ek, Lk), members in flex_kinds.items()]
        # moduli worth making S a multiple of: the block sizes that carry the most elements
        mass: dict[int, int] = {}
        for i in structured:
            mass[L[i]] = mass.get(L[i], 0) + e[i]
        heavy = sum(mass.values()) // 20
        moduli, m = set(), a
        for Lk in sorted(mass, key=lambda x: (-mass[x], x)):
            m = m * Lk // math.gcd(m, Lk)
            moduli.add(m)  # the lcm of the heaviest block sizes
            if mass[Lk] >= heavy:
                moduli.add(Lk)  # and each heavy one alone
        self.moduli = sorted(moduli)

    def candidates(self, cond: Conditions, x: int) -> list[int]:
        """The least admissible S >= x, and the least >= x that are multiples of each modulus."""
        c0 = cond.next_candidate(x)
        out = {c0}
        for M in self.moduli:
            c = roundup(c0, M)
            for _ in range(4):
                c2 = cond.next_candidate(c)
                if c2 % M == 0:
                    break
                c = roundup(c2, M)
            out.add(c2)
        return sorted(out)

    def pack(self, S: int):
        """``((offsets, strategy), end)`` for the first packing that fits in ``W*S``, else
        ``(None, least end seen)`` (end None when no packing could place every tensor)."""
        self.packs += 1
        cap = self.prob.world_size * S
        best_end = None
        self._limit = None  # a packing that passes the best end so far stops early
        for name in ("block-order+fill", "adaptive+fill", "adaptive-hard+fill", "adaptive-shim",
                     "size-order+fill", "adaptive-look+fill", "block-order+small-fill",
                     "model-order+fill", "model-order"):
            offs, end = self._run(name, S)
            if offs is not None and end <= cap:
                return (offs, name), end
            if end is not None and (best_end is None or end < best_end):
                best_end = self._limit = end
        return None, best_end

    def _run(self, name: str, S: int):
        prob = self.prob
        offs = [0] * prob.n
        gaps: list[tuple[int, int, int]] = []  # (size, start, end), sorted
        if name == "adaptive-shim":  # flexible tensors join in, as shims across boundaries
            pos, fillers = self._adaptive(S, offs, gaps, kinds=self.all_kinds), []
        elif name.startswith("adaptive"):
            pos = self._adaptive(S, offs, gaps, hard=name.startswith("adaptive-hard"),
                                 look=name.startswith("adaptive-look"))
            fillers = self.flexible
        elif name == "block-order+small-fill":
            e = prob.e
            big = [i for i in self.by_block if e[i] > S // 4]
            if len(big) == len(self.by_block):
                return None, None  # same as block-order+fill
            bigset = set(big)
            fillers = sorted((i for i in range(prob.n) if i not in bigset), key=lambda i: (-e[i], i))
            pos = self._sequence(S, big, offs, gaps)
        elif name == "block-order+fill":
            pos, fillers = self._sequence(S, self.by_block, offs, gaps), self.flexible
        elif name == "size-order+fill":
            pos, fillers = self._sequence(S, self.by_size, offs, gaps), self.flexible
        elif name == "model-order+fill":
            pos, fillers = self._sequence(S, self.structured, offs, gaps), self.flexible
        else:
            pos, fillers = self._sequence(S, range(prob.n), offs, gaps), []
        if pos is None:
            return None, None
        pos = self._fill(S, fillers, offs, gaps, pos)
        return (offs, pos) if pos is not None else (None, None)

    def _sequence(self, S, order, offs, gaps):
        """Each tensor of ``order`` at its earliest offset after the previous one."""
        e, L, a = self.prob.e, self.prob.L, self.prob.a
        pos, limit = 0, self._limit
        for i in order:
            ei, Li = e[i], L[i]
            r = S - pos % S  # earliest_start, inlined for speed on the common paths
            if ei <= r:
                l = pos
            elif S % Li == 0:
                l = pos + r % Li
            else:
                l = earliest_start(pos, ei, Li, S)
                if l is None:
                    return None
            if l > pos:
                insort(gaps, (l - pos, pos, l))
            offs[i] = l
            pos = -(-(l + ei) // a) * a
            if limit is not None and pos > limit:
                return None
        return pos

    def _adaptive(self, S, offs, gaps, hard=False, kinds=None, look=False):
        """At each step, the kind that leaves no gap (largest block first), else the least gap.

        ``hard``: any kind that can start in the current segment with a small gap (under
        S/1024) counts as gap-free, so the kinds allowed only one cut (their block does not
        divide S) and then the coarsest blocks go first, and the flexible ones are kept for
        the places where nothing else fits without skipping to the next segment.

        ``look``: among the gap-free kinds, prefer one after which filling on with the
        coarsest kind reaches the next boundary at a point some kind can cross without a gap
        (e.g. an odd-sized tensor that fixes the parity of the position in time)."""
        a = self.prob.a
        tol = S >> 10 if hard else 0
        left = [[ek, Lk, members, 0] for ek, Lk, members in (kinds or self.kinds)]
        pos, limit = 0, self._limit
        while left:
            if limit is not None and pos > limit:
                return None
            r = S - pos % S
            near = look and r < 2 * max(k[0] for k in left)  # lookahead only near a boundary
            best = None
            for k in left:
                ek, Lk = k[0], k[1]
                if ek <= r:
                    l = pos
                elif S % Lk == 0:
                    l = pos + r % Lk
                else:
                    l = earliest_start(pos, ek, Lk, S)
                    if l is None:
                        return None
                gap = l - pos
                if hard:  # no skip, small gap, then one-cut kinds and coarse blocks first
                    key = (gap >= r, gap > tol, S % Lk == 0, -Lk, gap, -ek)
                elif near and gap == 0:
                    key = (self._rollout_gap(S, a, -(-(l + ek) // a) * a, left, k), 0, -Lk, -ek)
                else:
                    key = (gap, -Lk, -ek)
                if best is None or key < best[0]:
                    best = (key, k, l)
            _, k, l = best
            ek, Lk, members, done = k
            if l > pos:
                insort(gaps, (l - pos, pos, l))
            offs[members[done]] = l
            pos = -(-(l + ek) // a) * a
            done += 1
            k[3] = done
            if done == len(members):
                left.remove(k)
        return pos

    @staticmethod
    def _rollout_gap(S, a, pos, left, taken):
        """After ``taken`` ends at ``pos``: fill the segment with the first remaining kind
        (block order) as far as it fits whole, then the least gap of a kind crossing the
        boundary. Small kinds that still fit are ignored."""
        def remaining(k):
            return len(k[2]) - k[3] - (k is taken)

        first = next((k for k in left if remaining(k) > 0), None)
        if first is None:
            return 0
        r = S - pos % S
        step = -(-first[0] // a) * a
        if step <= r:
            m = min(remaining(first), r // step)
            pos, r = pos + m * step, r - m * step
        best = None
        for k in left:
            ek, Lk = k[0], k[1]
            if ek <= r or remaining(k) <= 0:
                continue
            l = pos + r % Lk if S % Lk == 0 else earliest_start(pos, ek, Lk, S)
            if l is not None and (best is None or l - pos < best):
                best = l - pos
        return best or 0

    def _fill(self, S, fillers, offs, gaps, pos):
        """Fillers, largest first, into the smallest gap that takes them, else at the end."""
        e, L, a = self.prob.e, self.prob.L, self.prob.a
        for i in fillers:
            ei, Li = e[i], L[i]
            need = -(-ei // a) * a
            j = bisect_left(gaps, (need,))
            placed = False
            for k in range(j, min(j + 4, len(gaps))):
                size, s, t = gaps[k]
                l = s if Li == a else earliest_start(s, ei, Li, S)
                if l is not None and l + ei <= t:
                    del gaps[k]
                    if l > s:
                        insort(gaps, (l - s, s, l))
                    nxt = -(-(l + ei) // a) * a
                    if t > nxt:
                        insort(gaps, (t - nxt, nxt, t))
                    offs[i] = l
                    placed = True
                    break
            if placed:
                continue
            l = earliest_start(pos, ei, Li, S)
            if l is None:
                return None
            if l > pos:
                insort(gaps, (l - pos, pos, l))
            offs[i] = l
            pos = -(-(l + ei) // a) * a
            if self._limit is not None and pos > self._limit:
                return None
        return pos
