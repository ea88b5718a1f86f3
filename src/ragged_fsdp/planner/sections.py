"""A model planned in sections, each over its own number of data-parallel ranks.

With expert parallelism the routed experts are sharded over fewer ranks (``W/(T*E)``) than
the rest of the model (``W/T``), so a model's FSDP groups fall into sections -- ``dense`` and
``experts`` -- each planned with :func:`plan_model` at its own world size. The totals add up
what one rank holds: its segment of every group of every section.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .granularity import TensorSpec
from .model import ModelPlan, plan_model

__all__ = ["Section", "SectionedPlan", "plan_sections"]

Groups = Sequence[tuple[str, Sequence[TensorSpec]]]


@dataclass(frozen=True)
class Section:
    kind: str  # "dense" or "experts"
    world_size: int  # data-parallel ranks its groups are sharded over
    groups: Groups


@dataclass
class SectionedPlan:
    sections: list[tuple[Section, ModelPlan]]

    def _sum(self, attr: str):
        return sum(getattr(mp, attr) for _, mp in self.sections)

    @property
    def used(self) -> int:
        return self._sum("used")

    @property
    def total(self) -> int:
        return self._sum("total")

    @property
    def padding_ratio(self) -> float:
        u = self.used
        return (self.total - u) / u if u else 0.0

    @property
    def lower_bound_ratio(self) -> float:
        u = self.used
        return (self._sum("lower_bound") - u) / u if u else 0.0

    @property
    def bytes_per_rank(self) -> int:
        return self._sum("bytes_per_rank")

    @property
    def max_group_bytes(self) -> int:
        return max((mp.max_group_bytes for _, mp in self.sections), default=0)

    @property
    def plan_seconds(self) -> float:
        return self._sum("plan_seconds")

    def validate(self) -> list[str]:
        return [e for _, mp in self.sections for e in mp.validate()]


def plan_sections(sections: Sequence[Section], align_bytes: int = 16) -> SectionedPlan:
    """Plan every section's groups over that section's world size (empty sections skipped)."""
    return SectionedPlan([(s, plan_model(s.groups, s.world_size, align_bytes)) for s in sections if s.groups])
