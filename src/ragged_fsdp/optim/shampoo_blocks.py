"""How Shampoo cuts a parameter into preconditioner tiles (pure integer math, no torch ops).

Blocking follows Distributed Shampoo's rules, always from the parameter's *global* shape, so
tiles are the same at every world size:

1. a 0-d tensor is ``(1,)``; dims of size 1 are dropped (all ones -> ``(1,)``);
2. dims are merged from the last backwards: start a list with the last dim, and for each
   earlier dim multiply it into the list's last entry while the product stays ``<= B``, else
   append it; the reversed list is the *merged shape* (``(4, 8) -> (32,)``,
   ``(64, 3, 3) -> (64, 9)`` with B = 32);
3. the tensor is viewed row-major in the merged shape and every dim is cut into chunks of
   ``B`` (the last chunk partial); each combination of chunks is one tile, numbered row-major
   over the tile grid. Merged 1-D views are cut into ``B``-element chunks.

A tile's flat elements lie inside one *row chunk*: ``B`` consecutive indices of merged dim 0
times everything after it, i.e. ``B * prod(merged[1:])`` consecutive elements of the
row-major flattening. Keeping these row chunks whole keeps every tile whole, which is what
:func:`shampoo_granularity` asks the planner for.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "merged_shape", "Tile", "tiles_of", "row_chunk_elems", "row_chunks", "shampoo_granularity",
    "eigh_flops", "tile_eigh_flops", "tile_extent", "tiles_cut", "shampoo_specs",
]


def merged_shape(shape: Sequence[int], max_dim: int) -> tuple[int, ...]:
    """The merged shape Shampoo preconditions ``shape`` in, with ``max_dim`` = B."""
    if max_dim < 1:
        raise ValueError(f"max_preconditioner_dim={max_dim} must be >= 1")
    dims = [int(d) for d in shape if int(d) != 1]
    if not dims:
        return (1,)
    out = [dims[-1]]
    for d in reversed(dims[:-1]):
        if out[-1] * d <= max_dim:
            out[-1] *= d
        else:
            out.append(d)
    return tuple(reversed(out))


@dataclass(frozen=True)
class Tile:
    """One preconditioner tile: its row-major index over the tile grid and its half-open
    index range along each merged dim."""

    index: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def dims(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.ranges)

    @property
    def order(self) -> int:  # k: how many factors (one per merged dim)
        return len(self.ranges)

    @property
    def row_chunk(self) -> int:
        return self.ranges[0][0]


def _chunks(n: int, b: int) -> list[tuple[int, int]]:
    return [(s, min(s + b, n)) for s in range(0, n, b)]


def tiles_of(shape: Sequence[int], max_dim: int) -> list[Tile]:
    """All tiles of a tensor of ``shape`` (none when it has no elements)."""
    merged = merged_shape(shape, max_dim)
    if math.prod(merged) == 0:
        return []
    grid = [_chunks(d, max_dim) for d in merged]
    return [Tile(i, tuple(r)) for i, r in enumerate(itertools.product(*grid))]


def row_chunk_elems(shape: Sequence[int], max_dim: int) -> int:
    """Elements in one row chunk (``B`` rows of merged dim 0); the last may be shorter."""
    merged = merged_shape(shape, max_dim)
    return max_dim * math.prod(merged[1:])


def row_chunks(shape: Sequence[int], max_dim: int) -> list[tuple[int, int]]:
    """Flat element range of each row chunk, in order (empty for an empty tensor)."""
    merged = merged_shape(shape, max_dim)
    per_row = math.prod(merged[1:])
    if per_row * merged[0] == 0:
        return []
    return [(a * per_row, b * per_row) for a, b in _chunks(merged[0], max_dim)]


def shampoo_granularity(max_preconditioner_dim: int = 1024) -> Callable:
    """A ``granularity_fn`` for ``fully_shard`` that keeps every Shampoo tile whole.

    The block is one row chunk (``B`` rows of the merged view): ``"rows:K"`` when that is a
    whole number ``K`` of last-dim rows of the parameter (2-D matrices: ``rows:B``), else
    ``"block:N"`` (flat); ``"tensor"`` when one row chunk is the whole parameter; ``None``
    for tensors of at most one element."""
    if isinstance(max_preconditioner_dim, bool) or not isinstance(max_preconditioner_dim, numbers.Integral):
        raise ValueError(f"Shampoo.granularity_for: max_preconditioner_dim={max_preconditioner_dim!r} must be "
                         "an integer >= 1")
    B = int(max_preconditioner_dim)
    if B < 1:
        raise ValueError(f"Shampoo.granularity_for: max_preconditioner_dim={max_preconditioner_dim} must be >= 1")

    def granularity(name: str, param) -> str | None:
        shape = tuple(int(s) for s in param.shape)
        n = math.prod(shape)
        if n <= 1:
            return None
        block = row_chunk_elems(shape, B)
        if block >= n:
            return "tensor"
        if len(shape) >= 2 and block % shape[-1] == 0:
            return f"rows:{block // shape[-1]}"
        return f"block:{block}"

    granularity.__name__ = f"shampoo_granularity_{B}"
    granularity.__doc__ = f"Shampoo(max_preconditioner_dim={B}) granularity: whole preconditioner tiles"
    return granularity


def eigh_flops(n: int) -> int:
    """Flops of a symmetric eigendecomposition with eigenvectors of an ``n x n`` matrix, by the
    usual ~9 n^3 count (Householder tridiagonalisation plus implicit QR with accumulation)."""
    return 9 * n ** 3


def tile_eigh_flops(tile: Tile) -> int:
    """Flops of one root recomputation of a tile (one eigh per factor)."""
    return sum(eigh_flops(d) for d in tile.dims)


def tile_extent(shape: Sequence[int], tile: Tile, max_dim: int) -> tuple[int, int]:
    """First and last flat element (inclusive) of ``tile`` in the row-major flattening."""
    merged = merged_shape(shape, max_dim)
    strides = [math.prod(merged[i + 1:]) for i in range(len(merged))]
    first = sum(a * s for (a, _), s in zip(tile.ranges, strides))
    last = sum((b - 1) * s for (_, b), s in zip(tile.ranges, strides))
    return first, last


def tiles_cut(shape: Sequence[int], max_dim: int, ranges: Sequence[tuple[int, int]]) -> int:
    """How many tiles of a tensor of ``shape`` have elements on two ranks when rank ``r``
    holds the flat elements ``ranges[r]`` (e.g. FSDP2's equal dim-0 chunks)."""
    bounds = sorted({a for a, b in ranges if b > a} - {0})
    cut = 0
    for tile in tiles_of(shape, max_dim):
        first, last = tile_extent(shape, tile, max_dim)
        if any(first < x <= last for x in bounds):
            cut += 1
    return cut


def shampoo_specs(groups, max_preconditioner_dim: int, itemsize: int = 4) -> list:
    """Planner input for catalog shapes under Shampoo's policy: ``groups`` are ``(name,
    [(tensor name, shape), ...])`` (e.g. ``ModelShapes.groups``), the result is ``(name,
    [TensorSpec])`` with each tensor's granularity from :func:`shampoo_granularity`."""
    from ..planner.granularity import TensorSpec

    policy = shampoo_granularity(max_preconditioner_dim)

    class _Shape:  # what the policy reads of a parameter
        def __init__(self, shape):
            self.shape = tuple(shape)

    out = []
    for g in groups:
        name, tensors = (g.name, g.tensors) if hasattr(g, "tensors") else g
        out.append((name, [TensorSpec(t[0], tuple(t[1]), itemsize, policy(t[0], _Shape(t[1]))) for t in tensors]))
    return out
