"""The RaggedShard placement: :class:`~ragged_fsdp.ragged_units.RaggedUnits` as a DTensor ``Placement``.

A RaggedShard flattens the leading ``dims`` of a tensor (a prefix ``(0, ..., k-1)``) into one
axis of ``M = prod(shape[:k])`` entries, each entry carrying the trailing dims. The axis is cut
into units of ``unit`` entries (the last unit may be partial) and rank ``r`` holds the
contiguous run of ``local_units[r]`` units that follows the units of ranks ``0..r-1``.

The layout math is pure and lives in ``ragged_fsdp.ragged_units`` (the planner and the
DBuffer layout use it without loading torch.distributed); this module adds the Placement.
The DTensor side lives in ``ragged_fsdp.placement.dtensor``.
"""

from __future__ import annotations

import sys

from torch.distributed.tensor.placement_types import Placement

from ragged_fsdp.ragged_units import Box, RaggedUnits, even_units, same_layout

__all__ = ["RaggedShard", "Box", "same_layout", "even_units"]


class RaggedShard(RaggedUnits, Placement):
    """Uneven, block-granular sharding on one mesh dimension, as a DTensor placement.

    The fields (``dims``, ``local_units``, ``unit``) and their meaning are those of
    :class:`ragged_fsdp.ragged_units.RaggedUnits`, the planner's pure form of the same
    placement, which compares equal to the RaggedShard with the same fields. Whether two
    placements give every rank the same element range also depends on the tensor shape;
    ``same_layout(a, b, shape)`` answers that, and DTensor specs compare that way.
    """

    def __init__(self, dims, local_units, unit: int = 1):
        Placement.__init__(self)
        RaggedUnits.__init__(self, dims, local_units, unit)

    @classmethod
    def of(cls, units: RaggedUnits) -> "RaggedShard":
        """The placement of a planner / layout :class:`RaggedUnits`."""
        return units if isinstance(units, cls) else cls(units.dims, units.local_units, units.unit)

    __eq__ = RaggedUnits.__eq__
    __hash__ = RaggedUnits.__hash__

    def __reduce__(self):
        # plain ints on disk (RunCounts is an in-memory form): torch.load(weights_only=True)
        # rebuilds a placement only from types it allows
        return (RaggedShard, (self.dims, tuple(int(n) for n in self.local_units), self.unit))

    def __format__(self, spec: str) -> str:
        # torch's distribute_tensor knows Shard, Replicate and Partial only; it refuses any
        # other placement with an f-string holding it, and that formatting is the one call
        # it makes on ours: there the text also says which function lays a RaggedShard out
        caller = sys._getframe(1)
        if (caller.f_code.co_name == "distribute_tensor"
                and caller.f_globals.get("__name__", "").startswith("torch.distributed")):
            return (f"{self!r} (torch's distribute_tensor cannot lay out a RaggedShard: call "
                    "ragged_fsdp.distribute_tensor(tensor, mesh, placements), which takes the same arguments)")
        return format(str(self), spec)

    def __fx_repr__(self):  # torch asks placements for this when printing graphs
        return repr(self), {"RaggedShard": RaggedShard}
