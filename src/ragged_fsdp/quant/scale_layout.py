"""Where each tile's scale travels in the scale all-gather: pure layout math.

Rank ``r`` quantises the tiles of its segment and writes their scales, slot after slot (in
slot order), at the start of its ``T`` entries of the gathered scale buffer (``W*T`` fp32,
``T`` = the most tiles any rank holds, so the all-gather has equal parts). A tensor's full
scale grid is the concatenation, in rank order, of its pieces' grids (pieces start on tile
rows), so ``gather_index`` lists, tensor after tensor, where each tile's scale landed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ragged_fsdp.dbuffer.layout import BufferLayout

from .blockfp8 import TileGeometry

__all__ = ["ScaleLayout"]


@dataclass(frozen=True)
class ScaleLayout:
    world_size: int
    rank: int
    per_rank: int  # T: scale entries per rank in the gathered buffer
    tiles: tuple[tuple[int, ...], ...]  # tiles[r][i]: tiles of quantised slot i on rank r
    slots: tuple[int, ...]  # the quantised slots (indices into the BufferLayout)
    geometries: tuple[TileGeometry, ...]  # one per quantised slot
    starts: tuple[tuple[int, int, int], ...]  # per quantised slot on this rank: (n, rows, C)
    pieces: tuple[tuple[int, int, int], ...]  # per quantised slot: full (n, rows, C)

    @classmethod
    def build(cls, layout: BufferLayout, slots: Sequence[int], geometries: Sequence[TileGeometry]) -> "ScaleLayout":
        """Check that no rank's piece cuts a tile and count every rank's tiles."""
        W = layout.world_size
        tiles = []
        for r in range(W):
            row = []
            for i, g in zip(slots, geometries):
                s = layout.slots[i]
                a, b = s.placement.element_range(s.shape, r)
                try:
                    row.append(g.tiles(a, b))
                except ValueError as e:
                    raise ValueError(f"{s.key}: rank {r}'s piece cuts an fp8 tile: {e}") from e
            tiles.append(tuple(row))
        T = max((sum(row) for row in tiles), default=0)
        mine = []
        for i, g in zip(slots, geometries):
            s = layout.slots[i]
            mine.append(g.piece_shape(*s.placement.element_range(s.shape, layout.rank)))
        full = tuple(g.piece_shape(0, g.numel) for g in geometries)
        return cls(W, layout.rank, T, tuple(tiles), tuple(slots), tuple(geometries), tuple(mine), full)

    @property
    def total(self) -> int:
        return self.world_size * self.per_rank

    @property
    def used(self) -> int:
        return sum(sum(row) for row in self.tiles)

    def local_offsets(self) -> list[int]:
        """Per quantised slot: where its scales start within this rank's ``T`` entries."""
        out, acc = [], 0
        for k in self.tiles[self.rank]:
            out.append(acc)
            acc += k
        return out

    def gather_index(self, device=None) -> torch.Tensor:
        """For every tile of every quantised tensor (tensor order, then row-major tiles), its
        position in the gathered ``W*T`` scale buffer."""
        starts, counts = [], []
        offsets = [0] * self.world_size
        for j in range(len(self.slots)):
            for r in range(self.world_size):
                k = self.tiles[r][j]
                if k:
                    starts.append(r * self.per_rank + offsets[r])
                    counts.append(k)
                    offsets[r] += k
        if not counts:
            return torch.empty(0, dtype=torch.long, device=device)
        c = torch.tensor(counts, dtype=torch.long)
        s = torch.tensor(starts, dtype=torch.long)
        # positions = start of the run + index within the run
        run_start = torch.repeat_interleave(s - (torch.cumsum(c, 0) - c), c)
        return (run_start + torch.arange(int(c.sum()))).to(device)

    def tile_counts(self) -> list[int]:
        """Tiles of each quantised tensor (its full scale grid)."""
        return [sum(self.tiles[r][j] for r in range(self.world_size)) for j in range(len(self.slots))]
