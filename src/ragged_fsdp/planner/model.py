"""Plans for a whole model: one plan per FSDP group, identical groups planned once.

Groups whose tensors match in order, shape, itemsize and granularity (a model's repeated
transformer blocks) share one layout; :class:`ModelPlan` keeps one plan per distinct group
kind and hands out the renamed plan of any group on demand.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from .granularity import TensorSpec
from .heuristic import plan_group
from .plan import Plan
from .validate import validate_plan

__all__ = ["ModelPlan", "GroupKind", "plan_model", "group_signature"]


def group_signature(specs: Sequence[TensorSpec]) -> tuple:
    """What a group's layout depends on: everything but the tensor names."""
    return tuple((s.shape, s.itemsize, s.granularity) for s in specs)


@dataclass
class GroupKind:
    plan: Plan  # planned for the first group of this kind
    groups: list[int] = field(default_factory=list)  # indices into ModelPlan.group_names

    @property
    def count(self) -> int:
        return len(self.groups)


@dataclass
class ModelPlan:
    world_size: int
    group_names: list[str]
    group_specs: list[list[TensorSpec]]
    kinds: list[GroupKind]
    kind_of: list[int]  # group index -> kind index
    plan_seconds: float = 0.0

    def plan(self, group: int | str) -> Plan:
        """The plan of one group, with that group's tensor names."""
        gi = self.group_names.index(group) if isinstance(group, str) else group
        kind = self.kinds[self.kind_of[gi]]
        if kind.groups[0] == gi:
            return kind.plan
        src = self.group_specs[kind.groups[0]]
        dst = self.group_specs[gi]
        mapping = {a.name: b.name for a, b in zip(src, dst)}
        return kind.plan.renamed(mapping, {s.name: s for s in dst})

    def _sum(self, attr: str) -> int:
        return sum(getattr(k.plan, attr) * k.count for k in self.kinds)

    @property
    def used(self) -> int:
        return self._sum("used")

    @property
    def total(self) -> int:
        return self._sum("total")

    @property
    def padding(self) -> int:
        return self.total - self.used

    @property
    def padding_ratio(self) -> float:
        return self.padding / self.used if self.used else 0.0

    @property
    def lower_bound(self) -> int:
        return self._sum("lower_bound")

    @property
    def lower_bound_ratio(self) -> float:
        return (self.lower_bound - self.used) / self.used if self.used else 0.0

    @property
    def bytes_per_rank(self) -> int:
        """Sharded parameter bytes each rank holds (its segment of every group)."""
        return sum(k.plan.segment * k.plan.itemsize * k.count for k in self.kinds)

    @property
    def max_group_bytes(self) -> int:
        """Bytes of the largest unsharded group buffer (``W*S`` elements) -- the all-gather peak."""
        return max((k.plan.total * k.plan.itemsize for k in self.kinds), default=0)

    def validate(self) -> list[str]:
        """Validation errors of every distinct plan (prefixed by the group name)."""
        errs = []
        for k in self.kinds:
            gi = k.groups[0]
            errs += [f"{self.group_names[gi]}: {m}" for m in validate_plan(k.plan, self.group_specs[gi])]
        return errs


def plan_model(groups: Sequence[tuple[str, Sequence[TensorSpec]]], world_size: int,
               align_bytes: int = 16) -> ModelPlan:
    """Plan every group of a model (``(name, specs)`` pairs, e.g. from ``model_specs``)."""
    t0 = time.perf_counter()
    names, specs_list, kind_of = [], [], []
    kinds: list[GroupKind] = []
    index: dict[tuple, int] = {}
    for gi, (name, specs) in enumerate(groups):
        specs = list(specs)
        names.append(name)
        specs_list.append(specs)
        sig = group_signature(specs)
        ki = index.get(sig)
        if ki is None:
            ki = index[sig] = len(kinds)
            kinds.append(GroupKind(plan_group(specs, world_size, align_bytes)))
        kinds[ki].groups.append(gi)
        kind_of.append(ki)
    return ModelPlan(world_size, names, specs_list, kinds, kind_of, time.perf_counter() - t0)
