"""The planner's answer for one group: a segment size and one offset per tensor.

Rank ``k`` owns elements ``[k*S, (k+1)*S)`` of a buffer of ``W*S`` elements; tensor ``t`` is
the contiguous run ``[offsets[t], offsets[t] + numel)``. Each rank's share of a tensor is a
contiguous run of whole blocks, i.e. a :class:`RaggedUnits`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ragged_units import RaggedUnits
from ..run_counts import RunCounts
from .granularity import TensorSpec
from .problem import align_elems

__all__ = ["Plan"]


@dataclass
class Plan:
    world_size: int
    segment: int  # S, in elements of the group's dtype
    offsets: dict[str, int]  # name -> element offset in the W*S buffer
    order: list[str]  # names by offset
    specs: dict[str, TensorSpec]
    align_bytes: int = 16
    lower_bound: int = 0  # elements, a lower bound on W*S
    plan_seconds: float = 0.0
    strategy: str = field(default="", compare=False)  # which packing produced it
    # work done, a load-independent measure of planning cost (tests assert these, not time)
    packings: int = field(default=0, compare=False)  # segment sizes the heuristic packed
    exact_states: int = field(default=0, compare=False)  # DP states the exact walk expanded

    # -- sizes -------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return self.world_size * self.segment

    @property
    def used(self) -> int:
        return sum(s.numel for s in self.specs.values())

    @property
    def padding(self) -> int:
        return self.total - self.used

    @property
    def padding_ratio(self) -> float:
        used = self.used
        return self.padding / used if used else 0.0

    @property
    def lower_bound_ratio(self) -> float:
        """The padding ratio a layout at the lower bound would have."""
        used = self.used
        return (self.lower_bound - used) / used if used else 0.0

    @property
    def itemsize(self) -> int:
        return next(iter(self.specs.values())).itemsize if self.specs else 4

    @property
    def align(self) -> int:
        """Alignment in elements."""
        return align_elems(self.align_bytes, self.itemsize)

    # -- per tensor, per rank ----------------------------------------------------------
    def local_range(self, name: str, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``name``'s piece within ``rank``'s segment ``[0, S)``;
        ``(0, 0)`` when the rank holds none of it."""
        S, lo = self.segment, self.offsets[name]
        hi = lo + self.specs[name].numel
        seg = rank * S
        a, b = max(lo, seg), min(hi, seg + S)
        return (a - seg, b - seg) if b > a else (0, 0)

    def tensor_range(self, name: str, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``name``'s piece on ``rank`` in the tensor's flat elements."""
        lo = self.offsets[name]
        a, b = self.local_range(name, rank)
        if a == b:
            return (0, 0)
        seg = rank * self.segment
        return (seg + a - lo, seg + b - lo)

    def placement(self, name: str) -> RaggedUnits:
        """The RaggedUnits describing ``name``'s shards: ``local_units[k]`` is the number of
        blocks (a partial last one counts) inside segment ``k``."""
        spec = self.specs[name]
        dims, unit = spec.placement_dims_unit()
        probe = RaggedUnits(dims, (0,), unit)
        units_total = probe.num_units(spec.shape)
        inner = probe.inner(spec.shape)
        W, S = self.world_size, self.segment
        lo, e = self.offsets[name], spec.numel
        # Only the ranks whose segment the tensor overlaps hold units; the counts are kept as
        # runs (RunCounts), so a placement costs O(ranks spanned), not O(W), to build and hold.
        # The segments strictly inside the tensor all hold S / g units when S is a multiple
        # of the block g and the first inner boundary falls on a block boundary (what the
        # planner makes: a segment boundary never cuts a block), so those are one run and
        # the placement costs O(1) whatever W is; any other plan is counted rank by rank.
        first, span = 0, []
        if units_total:
            if e == 0 or S == 0:  # empty trailing dims: the (empty) units sit where it starts
                first, span = (min(lo // S, W - 1) if S else 0), [units_total]
            else:
                g = unit * inner
                first = lo // S
                end = min(W, -(-(lo + e) // S))

                def count(k):
                    a = max(lo, k * S) - lo
                    b = min(lo + e, (k + 1) * S) - lo
                    return -(-b // g) - a // g

                if end - first > 3 and S % g == 0 and ((first + 1) * S - lo) % g == 0:
                    runs = [(0, first), (count(first), 1), (S // g, end - first - 2), (count(end - 1), 1),
                            (0, W - end)]
                    return RaggedUnits(dims, RunCounts(runs), unit)
                span = [count(k) for k in range(first, end)]
        return RaggedUnits(dims, RunCounts.span(W, first, span), unit)

    # -- convenience -------------------------------------------------------------------
    def renamed(self, mapping: dict[str, str], specs: dict[str, TensorSpec] | None = None) -> "Plan":
        """The same layout for an identical group whose tensors have other names."""
        new_specs = specs or {mapping[n]: s for n, s in self.specs.items()}
        return Plan(
            world_size=self.world_size, segment=self.segment,
            offsets={mapping[n]: o for n, o in self.offsets.items()},
            order=[mapping[n] for n in self.order], specs=new_specs,
            align_bytes=self.align_bytes, lower_bound=self.lower_bound,
            plan_seconds=self.plan_seconds, strategy=self.strategy,
            packings=self.packings, exact_states=self.exact_states,
        )

    def summary(self) -> dict:
        return {
            "world_size": self.world_size, "segment": self.segment, "total": self.total,
            "used": self.used, "padding": self.padding, "padding_ratio": self.padding_ratio,
            "lower_bound": self.lower_bound, "lower_bound_ratio": self.lower_bound_ratio,
            "plan_seconds": self.plan_seconds, "strategy": self.strategy,
            "packings": self.packings, "exact_states": self.exact_states,
        }
