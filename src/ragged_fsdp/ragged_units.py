"""The pure layout math of the RaggedShard placement (no torch.distributed, no tensor data).

A RaggedShard flattens the leading ``dims`` of a tensor (a prefix ``(0, ..., k-1)``) into one
axis of ``M = prod(shape[:k])`` entries, each entry carrying the trailing dims. The axis is cut
into units of ``unit`` entries (the last unit may be partial) and rank ``r`` holds the
contiguous run of ``local_units[r]`` units that follows the units of ranks ``0..r-1``.

:class:`RaggedUnits` is what the planner and the DBuffer layout speak;
``ragged_fsdp.placement.RaggedShard`` is the same thing as a DTensor ``Placement``.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence

from .run_counts import RunCounts, total as _total

__all__ = ["RaggedUnits", "Box", "same_layout", "even_units"]

# A box of a global tensor: (offsets, sizes), one entry per dim.
Box = tuple[tuple[int, ...], tuple[int, ...]]


class RaggedUnits:
    """Uneven, block-granular sharding on one mesh dimension.

    Args:
        dims: a prefix ``(0, ..., k-1)`` of the tensor dims flattened into the sharded axis;
            ``()`` makes the whole tensor a single unit.
        local_units: units held by each rank of the mesh dimension (zeros allowed).
        unit: entries of the flattened axis per unit (the block size along that axis); the
            last unit of the axis may be partial.

    Two placements are *structurally* equal when all three fields match. Whether two
    placements give every rank the same element range also depends on the tensor shape;
    ``same_layout(a, b, shape)`` answers that, and DTensor specs compare that way.
    """

    def __init__(self, dims: Sequence[int], local_units: Sequence[int], unit: int = 1):
        dims = _ints("dims", dims)
        if dims != tuple(range(len(dims))):
            raise ValueError(
                f"RaggedShard: dims={dims} must be a prefix (0, 1, ..., k-1) of the tensor dims; "
                "reorder the tensor (permute) so the sharded dims come first"
            )
        units = _ints("local_units", local_units)
        if not units or (units.minimum() if isinstance(units, RunCounts) else min(units)) < 0:
            raise ValueError(
                f"RaggedShard: local_units={units} must be one non-negative count per rank"
            )
        unit = _int("unit", unit)
        if unit < 1:
            raise ValueError(f"RaggedShard: unit={unit} must be >= 1 entries of the flattened axis")
        self.dims = dims
        self.local_units = units
        self.unit = unit

    # -- identity ----------------------------------------------------------------------
    def _key(self):
        return (self.dims, self.local_units, self.unit)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RaggedUnits) and self._key() == other._key()

    def __hash__(self) -> int:
        # (length, sum) instead of the counts: equal placements agree on both, and hashing W
        # numbers per tensor would undo RunCounts (local_units may be a tuple or RunCounts)
        lu = self.local_units
        return hash(("RaggedShard", self.dims, len(lu), _total(lu), self.unit))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dims={self.dims}, local_units={self.local_units}, unit={self.unit})"

    __str__ = __repr__

    def __reduce__(self):
        # plain ints on disk (RunCounts is an in-memory form): torch.load(weights_only=True)
        # rebuilds a placement only from types it allows
        return (type(self), (self.dims, tuple(int(n) for n in self.local_units), self.unit))

    # -- pure layout math --------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.local_units)

    def axis_len(self, shape: Sequence[int]) -> int:
        """M: entries of the flattened axis."""
        return math.prod(shape[: len(self.dims)])

    def inner(self, shape: Sequence[int]) -> int:
        """Elements carried by one axis entry."""
        return math.prod(shape[len(self.dims):])

    def num_units(self, shape: Sequence[int]) -> int:
        return -(-self.axis_len(shape) // self.unit)

    def check(self, shape: Sequence[int], world_size: int | None = None) -> None:
        """Raise a ValueError naming the problem if this placement cannot describe ``shape``."""
        if len(self.dims) > len(shape):
            raise ValueError(
                f"RaggedShard: dims={self.dims} has more dims than the tensor shape {tuple(shape)}"
            )
        if world_size is not None and len(self.local_units) != world_size:
            raise ValueError(
                f"RaggedShard: local_units has {len(self.local_units)} entries but the mesh "
                f"dimension has {world_size} ranks; give one count per rank"
            )
        total = _total(self.local_units)
        need = self.num_units(shape)
        if total != need:
            raise ValueError(
                f"RaggedShard: local_units={self.local_units} sum to {total} units but the tensor "
                f"of shape {tuple(shape)} with dims={self.dims} and unit={self.unit} has {need}; "
                "the counts must cover the tensor exactly"
            )

    def axis_range(self, shape: Sequence[int], rank: int) -> tuple[int, int]:
        """[start, end) of the flattened axis held by ``rank`` (clipped to the axis length)."""
        m = self.axis_len(shape)
        start = self._start(rank) * self.unit
        end = start + self.local_units[rank] * self.unit
        return min(start, m), min(end, m)

    def _start(self, rank: int) -> int:
        """Units held by ranks ``0..rank-1``. A planned placement's counts are ``RunCounts``
        (O(log runs)); a tuple's prefix sums are computed once, because summing the prefix on
        each call made a layout's per-rank check O(W^2) per tensor. Both are immutable."""
        lu = self.local_units
        if isinstance(lu, RunCounts):
            return lu.prefix(rank)
        starts = self.__dict__.get("_starts_cache")
        if starts is None:
            starts = tuple(itertools.accumulate(lu, initial=0))
            self.__dict__["_starts_cache"] = starts
        return starts[rank]

    def element_range(self, shape: Sequence[int], rank: int) -> tuple[int, int]:
        """[start, end) in the row-major flattening of the whole tensor."""
        a, b = self.axis_range(shape, rank)
        inner = self.inner(shape)
        return a * inner, b * inner

    def element_ranges(self, shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
        return tuple(self.element_range(shape, r) for r in range(self.world_size))

    def local_numel(self, shape: Sequence[int], rank: int) -> int:
        a, b = self.element_range(shape, rank)
        return b - a

    def local_shape(self, shape: Sequence[int], rank: int) -> tuple[int, ...]:
        """Shape of the local tensor: ``(entries, *shape[k:])``; for ``dims=()`` the owner
        holds ``shape`` and other ranks an empty ``(0, *shape[1:])``."""
        shape = tuple(shape)
        k = len(self.dims)
        a, b = self.axis_range(shape, rank)
        if k == 0:
            return shape if b > a else (0,) + shape[1:]
        return (b - a,) + shape[k:]

    def local_boxes(self, shape: Sequence[int], rank: int) -> list[Box]:
        """The local run as rectangular boxes of the global tensor (for checkpoints).

        The run ``[a, b)`` of the flattened prefix is split mixed-radix style: a ragged head
        up to the next boundary of each dim, full middle blocks, and a ragged tail, giving at
        most ``2k-1`` boxes. A rank that holds nothing gets no box.
        """
        shape = tuple(shape)
        k = len(self.dims)
        a, b = self.axis_range(shape, rank)
        if b <= a:
            return []
        if k == 0:
            return [((0,) * len(shape), shape)]
        return [
            (off + (0,) * (len(shape) - k), size + shape[k:])
            for off, size in _split_run(shape[:k], a, b)
        ]


def _int(name: str, value) -> int:
    """``value`` as an int, refusing what ``int()`` would silently coerce (2.5, "12", True):
    a layout that rounds a count is a different layout, so it must be the caller's choice."""
    if isinstance(value, bool) or isinstance(value, str):
        raise TypeError(f"RaggedShard: {name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"RaggedShard: {name} must be an integer, got {value!r} ({type(value).__name__}); "
            "pass whole counts (e.g. int(x) if you mean to round)"
        ) from None


def _ints(name: str, values) -> tuple[int, ...]:
    if isinstance(values, RunCounts):  # validated when built; kept compact
        return values
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) and not hasattr(values, "__iter__"):
        raise TypeError(
            f"RaggedShard: {name} must be a sequence of integers (one per "
            f"{'rank' if name == 'local_units' else 'dim'}), got {values!r}"
        )
    if isinstance(values, (tuple, list)):
        # Fast path for plain ints (what the planner and every copy of a placement pass):
        # a placement holds one count per rank, so the per-element check below ran
        # W x tensors times per rank during fully_shard (most of its set-up at W=4,096).
        out = tuple(values)
        if set(map(type, out)) <= {int}:
            return out
    return tuple(_int(f"{name}[{i}]", v) for i, v in enumerate(values))


def _unravel(index: int, dims: Sequence[int]) -> list[int]:
    out = []
    for d in reversed(dims):
        out.append(index % d)
        index //= d
    return out[::-1]


def _split_run(dims: Sequence[int], a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Split the flat run [a, b) over a row-major grid ``dims`` into boxes."""
    if b <= a:
        return []
    if len(dims) == 1:
        return [((a,), (b - a,))]
    inner = math.prod(dims[1:])
    first, last = a // inner, (b - 1) // inner
    if first == last:  # the run stays inside one slice of dim 0
        return [((first,) + off, (1,) + size) for off, size in _split_run(dims[1:], a - first * inner, b - first * inner)]
    boxes = []
    lo = first
    if a % inner:  # ragged head inside slice `first`
        boxes += [((first,) + off, (1,) + size) for off, size in _split_run(dims[1:], a % inner, inner)]
        lo = first + 1
    hi = last + 1 if b % inner == 0 else last
    if hi > lo:
        boxes.append(((lo,) + (0,) * (len(dims) - 1), (hi - lo,) + tuple(dims[1:])))
    if b % inner:  # ragged tail inside slice `last`
        boxes += [((last,) + off, (1,) + size) for off, size in _split_run(dims[1:], 0, b % inner)]
    return boxes


def same_layout(a: RaggedUnits, b: RaggedUnits, shape: Sequence[int]) -> bool:
    """True when ``a`` and ``b`` give every rank the same element range of ``shape``."""
    if a.world_size != b.world_size:
        return False
    if a._key() == b._key():  # the common case, O(runs) for planned placements (W ranges otherwise)
        return True
    return a.element_ranges(shape) == b.element_ranges(shape)


def even_units(num_units: int, world_size: int) -> tuple[int, ...]:
    """torch.chunk-like split of ``num_units`` over ranks (earlier ranks take the extra)."""
    base, extra = divmod(num_units, world_size)
    return tuple(base + (1 if r < extra else 0) for r in range(world_size))
