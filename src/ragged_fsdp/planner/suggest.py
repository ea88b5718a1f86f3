"""Ways out when structure forces padding: a smaller shard group, or larger groups.

Two levers cut the padding a granularity forces at a given world size ``W``:

* ``hsdp``: shard each group over ``D`` ranks (a divisor of ``W``) and replicate across the
  ``W/D`` shard groups, as HSDP does. Segments grow, so blocks fit; each rank holds more.
* ``merge``: wrap ``k`` consecutive groups as one FSDP group. More tensors per segment
  leave more ways to fill it; the all-gather buffer grows ``k``-fold.

Each alternative is planned for real and reported with its padding and what it costs in
memory: parameter bytes per rank (the sharded segments) and the largest unsharded group
buffer (the all-gather peak). Best first = fewest bytes per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .granularity import TensorSpec
from .model import ModelPlan, plan_model

__all__ = ["Suggestion", "suggest", "shard_group_sizes", "merge_groups"]


@dataclass(frozen=True)
class Suggestion:
    kind: str  # "hsdp" or "merge"
    value: int  # shard group size D, or number of consecutive groups merged k
    padding_ratio: float
    bytes_per_rank: int
    gathered_bytes: int
    plan_seconds: float
    replicas: int = 1  # hsdp: shard groups that replicate each other

    def describe(self) -> str:
        if self.kind == "hsdp":
            return f"shard over {self.value} ranks (HSDP, {self.replicas} replicas)"
        return f"merge {self.value} consecutive groups"


def shard_group_sizes(world_size: int, limit: int = 12) -> list[int]:
    """Divisors of ``world_size`` below it, largest first (at most ``limit``)."""
    divs = [d for d in range(world_size - 1, 0, -1) if world_size % d == 0]
    return divs[:limit]


def merge_groups(groups: Sequence[tuple[str, Sequence[TensorSpec]]], k: int) -> list[tuple[str, list[TensorSpec]]]:
    """Consecutive runs of ``k`` groups as one group each (the last run may be shorter)."""
    out = []
    for i in range(0, len(groups), k):
        run = groups[i:i + k]
        name = run[0][0] if len(run) == 1 else f"{run[0][0]}..{run[-1][0]}"
        out.append((name, [s for _, specs in run for s in specs]))
    return out


def _suggestion(kind: str, value: int, mp: ModelPlan, replicas: int = 1) -> Suggestion:
    return Suggestion(kind, value, mp.padding_ratio, mp.bytes_per_rank, mp.max_group_bytes,
                      mp.plan_seconds, replicas)


def suggest(groups: Sequence[tuple[str, Sequence[TensorSpec]]], world_size: int, align_bytes: int = 16,
            current: ModelPlan | None = None, per_kind: int = 3) -> list[Suggestion]:
    """Alternatives that cut the padding of planning ``groups`` over ``world_size`` ranks:
    the best ``per_kind`` of each lever, best (fewest parameter bytes per rank) first."""
    groups = [(name, list(specs)) for name, specs in groups]
    if current is None:
        current = plan_model(groups, world_size, align_bytes)
    found = []
    for d in shard_group_sizes(world_size):
        found.append(_suggestion("hsdp", d, plan_model(groups, d, align_bytes), world_size // d))
    k = 2
    while k <= len(groups):
        found.append(_suggestion("merge", k, plan_model(merge_groups(groups, k), world_size, align_bytes)))
        k *= 2
    def rank(s: Suggestion):
        return (s.bytes_per_rank, s.padding_ratio, s.gathered_bytes)

    out = []
    for kind in ("hsdp", "merge"):
        better = [s for s in found if s.kind == kind and s.padding_ratio < current.padding_ratio]
        out += sorted(better, key=rank)[:per_kind]
    return sorted(out, key=rank)
