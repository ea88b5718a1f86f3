"""The pure part of the local save (``local_save.py``): describing a RaggedShard layout in a
size that does not grow with W, and finding which saved ranks hold a range of a tensor.

A RaggedShard's ``local_units`` has one count per rank, so writing it into every rank's part
would make each part O(W) per tensor. But a planned layout is a few runs of equal counts:
zeros before the tensor, its first (partial) segment, ``S / block`` units on every rank in
between, a partial last one, zeros after. ``encode_runs`` stores ``[count, repeat]`` pairs,
``RunLayout`` answers "which saved ranks hold elements ``[a, b)``" in O(runs + answers).
No torch, no files.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["encode_runs", "decode_runs", "RunLayout", "Piece"]


def encode_runs(counts: Sequence[int]) -> list[list[int]]:
    """``[[count, repeat], ...]``: run-length form of a per-rank sequence."""
    runs: list[list[int]] = []
    for c in counts:
        if runs and runs[-1][0] == c:
            runs[-1][1] += 1
        else:
            runs.append([int(c), 1])
    return runs


def decode_runs(runs: Sequence[Sequence[int]]) -> list[int]:
    return [c for c, n in runs for _ in range(n)]


@dataclass(frozen=True)
class Piece:
    """Elements ``[src_lo, src_hi)`` of saved rank ``rank``'s local run go to ``[dst_lo,
    dst_lo + src_hi - src_lo)`` of the reader's flat range."""

    rank: int
    src_lo: int
    src_hi: int
    dst_lo: int


@dataclass(frozen=True)
class RunLayout:
    """How a tensor of ``shape`` was split over the saving ranks: RaggedShard ``dims`` and
    ``unit``, the per-rank unit counts as runs."""

    shape: tuple[int, ...]
    dims: tuple[int, ...]
    unit: int
    runs: tuple[tuple[int, int], ...]

    @property
    def world_size(self) -> int:
        return sum(n for _, n in self.runs)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def _entry(self) -> tuple[int, int]:
        """(entries of the flattened axis, elements per entry)."""
        k = len(self.dims)
        return math.prod(self.shape[:k]), math.prod(self.shape[k:])

    def check(self) -> None:
        m, _ = self._entry()
        total = sum(c * n for c, n in self.runs)
        if total != -(-m // self.unit) or any(c < 0 or n < 1 for c, n in self.runs):
            raise ValueError(f"local checkpoint: runs {self.runs} do not cover a tensor of shape "
                             f"{self.shape} in units of {self.unit}; the part file is damaged")

    def pieces(self, a: int, b: int) -> list[Piece]:
        """The saved ranks' pieces covering flat elements ``[a, b)`` of the tensor, in order."""
        m, inner = self._entry()
        unit_elems = self.unit * inner
        out: list[Piece] = []
        rank, units_before = 0, 0
        for count, repeat in self.runs:
            span = count * repeat
            run_lo = min(units_before * unit_elems, m * inner)
            run_hi = min((units_before + span) * unit_elems, m * inner)
            if count and run_hi > a and run_lo < b:
                per = count * unit_elems
                first = max(0, (a - run_lo) // per)
                last = min(repeat, -(-(b - run_lo) // per))
                for j in range(first, last):
                    lo = run_lo + j * per
                    hi = min(lo + per, m * inner)
                    s, e = max(lo, a), min(hi, b)
                    if e > s:
                        out.append(Piece(rank + j, s - lo, e - lo, s - a))
            rank += repeat
            units_before += span
            if run_lo >= b:
                break
        return out
