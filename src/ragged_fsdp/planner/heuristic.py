"""The layout heuristic: pick the least segment size ``S`` that some packing order fits.

For a given ``S`` a *packing* lays the structured tensors (those whose cuts are restricted)
one after another, each at its earliest valid offset, which may leave gaps before a tensor
that had to start on a block edge; then it drops the flexible tensors (element-granular ones,
biases, norms) and other small ones into those gaps, best fit first, and appends what is left.
Several orders are tried (structured tensors by block size, or in model order, or everything
in model order as the published heuristic does); ``S`` is feasible when one of them ends
within ``W * S``.

The search walks ``S`` upward from the structural lower bound over the sizes every tensor's
own condition allows (see :mod:`.bound`), jumping by the shortfall of the best packing
divided by ``W``, then bisects back between the last failure and the first success. Each
packing costs O(n log n) for n tensors and never loops over the W segments, so huge W is as
fast as small W.
"""

from __future__ import annotations

import time
from bisect import bisect_left, insort
from collections.abc import Sequence

from .bound import Conditions
from .granularity import TensorSpec
from .plan import Plan
from .problem import Problem, earliest_start

__all__ = ["plan_group"]

_MAX_STEPS = 200  # candidate sizes tried before giving up on finesse (never reached in practice)
_REFINE_STEPS = 10


def plan_group(specs: Sequence[TensorSpec], world_size: int, align_bytes: int = 16) -> Plan:
    """Lay ``specs`` into one buffer of ``world_size`` equal segments; minimise ``W * S``."""
    t0 = time.perf_counter()
    specs = list(specs)
    prob = Problem.build(specs, world_size, align_bytes)
    cond = Conditions(prob)
    s_lb = cond.next_candidate(0)
    W, a = prob.world_size, prob.a
    packer = _Packer(prob)

    if prob.padded_sum == 0:  # nothing to lay out
        seg, offs, name = 0, [0] * prob.n, "empty"
    else:
        seg, offs, name = _search(packer, cond, s_lb, W, a)

    offsets = {prob.names[i]: offs[i] for i in range(prob.n)}
    order = [prob.names[i] for i in sorted(range(prob.n), key=lambda i: (offs[i], i))]
    return Plan(
        world_size=W, segment=seg, offsets=offsets, order=order,
        specs={s.name: s for s in specs}, align_bytes=align_bytes,
        lower_bound=W * s_lb, plan_seconds=time.perf_counter() - t0, strategy=name,
    )


def _search(packer: "_Packer", cond: Conditions, s_lb: int, W: int, a: int):
    S, lo_fail, fails = s_lb, None, 0
    while True:
        found, end = packer.pack(S)
        if found is not None:
            break
        lo_fail, fails = S, fails + 1
        short = end - W * S if end is not None else W * S
        jump = max(a, -(-short // W))
        if fails > 3:  # the packings do not converge: grow geometrically
            jump = max(jump, S >> max(0, 8 - fails))
        if fails > _MAX_STEPS:
            jump = max(jump, S)
        S = cond.next_candidate(S + jump)
    best = (S, found)
    if lo_fail is not None:  # the first success may have jumped past a smaller feasible S
        hi = S
        for _ in range(_REFINE_STEPS):
            cand = cond.next_candidate((lo_fail + hi) // 2 + 1)
            if cand >= hi:
                cand = cond.next_candidate(lo_fail + 1)
                if cand >= hi:
                    break
            got, _ = packer.pack(cand)
            if got is not None:
                hi, best = cand, (cand, got)
            else:
                lo_fail = cand
    S, (offs, name) = best[0], best[1]
    return S, offs, name


class _Packer:
    """Packings of one problem for a given S; tries several orders, returns the first that fits."""

    def __init__(self, prob: Problem):
        self.prob = prob
        n, e, L, a = prob.n, prob.e, prob.L, prob.a
        idx = range(n)
        structured = [i for i in idx if L[i] > a and e[i] > 0]
        flexible = sorted((i for i in idx if L[i] == a or e[i] == 0), key=lambda i: (-e[i], i))
        by_block = sorted(structured, key=lambda i: (-L[i], -e[i], i))
        self.by_block = by_block
        self.orders = [
            ("block-order+fill", by_block, flexible),
            ("model-order+fill", structured, flexible),
            ("model-order", list(idx), []),
        ]

    def pack(self, S: int):
        """``((offsets, strategy), end)`` for the first packing that fits in ``W*S``, else
        ``(None, least end seen)`` (end None when no packing could place every tensor)."""
        cap = self.prob.world_size * S
        best_end = None
        orders = list(self.orders)
        # small structured tensors can fill gaps too: a variant that treats them as fillers
        e = self.prob.e
        big = [i for i in self.by_block if e[i] > S // 4]
        if len(big) < len(self.by_block):
            small = sorted((i for i in range(self.prob.n) if i not in set(big)), key=lambda i: (-e[i], i))
            orders.insert(1, ("block-order+small-fill", big, small))
        for name, main, fillers in orders:
            offs, end = self._pack_order(S, main, fillers, cap)
            if offs is not None and end <= cap:
                return (offs, name), end
            if end is not None and (best_end is None or end < best_end):
                best_end = end
        return None, best_end

    def _pack_order(self, S, main, fillers, cap):
        prob = self.prob
        e, L, a = prob.e, prob.L, prob.a
        offs = [0] * prob.n
        gaps: list[tuple[int, int, int]] = []  # (size, start, end), sorted
        pos = 0
        for i in main:
            ei, Li = e[i], L[i]
            # earliest_start, inlined for speed on the common paths
            r = S - pos % S
            if ei <= r:
                l = pos
            elif S % Li == 0:
                l = pos + r % Li
            else:
                l = earliest_start(pos, ei, Li, S)
                if l is None:
                    return None, None
            if l > pos:
                insort(gaps, (l - pos, pos, l))
            offs[i] = l
            pos = -(-(l + ei) // a) * a
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
                return None, None
            if l > pos:
                insort(gaps, (l - pos, pos, l))
            offs[i] = l
            pos = -(-(l + ei) // a) * a
        return offs, pos
