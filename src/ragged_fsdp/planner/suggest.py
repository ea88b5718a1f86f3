"""Ways out when structure forces padding: a smaller shard group, or larger groups.

Two levers cut the padding a granularity forces at a given world size ``W``:

* ``hsdp``: shard each group over ``D`` ranks (a divisor of ``W``) and replicate across the
  ``W/D`` shard groups, as HSDP does. Segments grow, so blocks fit; each rank holds more.
* ``merge``: wrap ``k`` consecutive groups as one FSDP group. More tensors per segment
  leave more ways to fill it; the all-gather buffer grows ``k``-fold.

Each alternative is planned for real and reported with its padding and what it costs in
memory: parameter bytes per rank (the sharded segments) and the largest unsharded group
buffer (the all-gather peak). Which are listed: per lever, the ``per_kind`` that cut the
padding at the least memory (bytes per rank, then the largest gather: the largest shard groups,
the fewest merged groups). Their order (:data:`ORDER`): least padding first, then least
parameter memory at the all-gather peak (bytes per rank + the largest gathered group).

With expert parallelism (:func:`suggest_sections`) the experts' section is sharded over
``1/ep`` of the dense section's ranks; an HSDP shard group of ``D`` dense ranks (``ep``
divides ``D``) shards the experts over ``D/ep`` ranks, and a merge merges ``k`` consecutive
groups within each section.
"""

from __future__ import annotations

import math

from collections.abc import Sequence
from dataclasses import dataclass

from .granularity import TensorSpec
from .model import ModelPlan
from .sections import Section, SectionedPlan, plan_sections

__all__ = ["Suggestion", "suggest", "suggest_sections", "shard_group_sizes", "merge_groups", "ORDER", "order_key"]

ORDER = "least padding first, then least parameter memory at the all-gather peak (params/rank + largest gather)"


@dataclass(frozen=True)
class Suggestion:
    kind: str  # "hsdp" or "merge"
    value: int  # shard group size D, or number of consecutive groups merged k
    padding_ratio: float
    bytes_per_rank: int
    gathered_bytes: int
    plan_seconds: float
    replicas: int = 1  # hsdp: shard groups that replicate each other
    expert_ranks: int | None = None  # hsdp with expert parallelism: the experts' shard group

    def describe(self) -> str:
        if self.kind == "hsdp":
            if self.expert_ranks is not None:
                return (f"shard over {self.value} ranks, experts over {self.expert_ranks} "
                        f"(HSDP, {self.replicas} replicas)")
            return f"shard over {self.value} ranks (HSDP, {self.replicas} replicas)"
        return f"merge {self.value} consecutive groups"


def order_key(s: "Suggestion") -> tuple:
    """The listing order (:data:`ORDER`). Padding is compared at 0.001 percentage points, so
    two plans that pad alike are ordered by memory, not by float noise."""
    return (round(s.padding_ratio, 5), s.bytes_per_rank + s.gathered_bytes, s.kind, s.value)


def shard_group_sizes(world_size: int, limit: int = 12, multiple_of: int = 1) -> list[int]:
    """Divisors of ``world_size`` below it that are multiples of ``multiple_of``, largest
    first (at most ``limit``)."""
    divs = [d for d in range(world_size - 1, 0, -1) if world_size % d == 0 and d % multiple_of == 0]
    return divs[:limit]


def merge_groups(groups: Sequence[tuple[str, Sequence[TensorSpec]]], k: int) -> list[tuple[str, list[TensorSpec]]]:
    """Consecutive runs of ``k`` groups as one group each (the last run may be shorter)."""
    out = []
    for i in range(0, len(groups), k):
        run = groups[i:i + k]
        name = run[0][0] if len(run) == 1 else f"{run[0][0]}..{run[-1][0]}"
        out.append((name, [s for _, specs in run for s in specs]))
    return out


def _suggestion(kind: str, value: int, mp: ModelPlan | SectionedPlan, replicas: int = 1,
                expert_ranks: int | None = None) -> Suggestion:
    return Suggestion(kind, value, mp.padding_ratio, mp.bytes_per_rank, mp.max_group_bytes,
                      mp.plan_seconds, replicas, expert_ranks)


def suggest(groups: Sequence[tuple[str, Sequence[TensorSpec]]], world_size: int, align_bytes: int = 16,
            current: ModelPlan | None = None, per_kind: int = 3) -> list[Suggestion]:
    """Alternatives that cut the padding of planning ``groups`` over ``world_size`` ranks:
    ``per_kind`` of each lever (those with the least memory), listed in :data:`ORDER`."""
    return suggest_sections([Section("dense", world_size, [(n, list(sp)) for n, sp in groups])],
                            align_bytes, current, per_kind)


def suggest_sections(sections: Sequence[Section], align_bytes: int = 16,
                     current: ModelPlan | SectionedPlan | None = None, per_kind: int = 3) -> list[Suggestion]:
    """:func:`suggest` for a model in sections: the first section is the dense one (sharded
    over ``W_d`` ranks); any other section's world size must divide ``W_d`` (its ratio is the
    expert-parallel degree), and shrinks with it under HSDP."""
    sections = [Section(s.kind, s.world_size, [(n, list(sp)) for n, sp in s.groups]) for s in sections]
    Wd = sections[0].world_size
    ratios = []
    for s in sections:
        if Wd % s.world_size:
            raise ValueError(f"section {s.kind!r}: its {s.world_size} ranks do not divide the first "
                             f"section's {Wd}")
        ratios.append(Wd // s.world_size)
    step = math.lcm(*ratios)
    if current is None:
        current = plan_sections(sections, align_bytes)
    found = []
    for d in shard_group_sizes(Wd, multiple_of=step):
        shrunk = [Section(s.kind, d // r, s.groups) for s, r in zip(sections, ratios)]
        experts = d // step if len(sections) > 1 else None
        found.append(_suggestion("hsdp", d, plan_sections(shrunk, align_bytes), Wd // d, experts))
    k, longest = 2, max(len(s.groups) for s in sections)
    while k <= longest:
        merged = [Section(s.kind, s.world_size, merge_groups(s.groups, k)) for s in sections]
        found.append(_suggestion("merge", k, plan_sections(merged, align_bytes)))
        k *= 2

    def cheapest(s: Suggestion):
        return (s.bytes_per_rank, s.gathered_bytes, s.padding_ratio)

    out = []
    for kind in ("hsdp", "merge"):
        # which to show: the cheapest in memory of each lever (the smallest shard groups would
        # pad least of all, by replicating the whole model)
        better = [s for s in found if s.kind == kind and s.padding_ratio < current.padding_ratio]
        out += sorted(better, key=cheapest)[:per_kind]
    return sorted(out, key=order_key)
