"""What the block-scaled weight formats gathered in whole tiles share (MXFP8, NVFP4): which
parameters they apply to, and the square tile the layout keeps whole on one rank so that no
scale block is cut in either orientation. Each format adds its block size, its name and its
scale shapes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .blockfp8 import TileGeometry, _is_int

__all__ = ["TiledPolicy", "quantize_plane"]


@dataclass(frozen=True)
class TiledPolicy:
    min_numel: int | None = None
    param_filter: Callable[[str, torch.Tensor], bool] | None = None
    on_gathered: Callable[..., None] | None = field(default=None, compare=False)

    BLOCK: ClassVar[int] = 0  # the format's scale block (and tile side), in elements
    NAME: ClassVar[str] = ""

    def __post_init__(self):
        if self.min_numel is not None and (not _is_int(self.min_numel) or self.min_numel < 0):
            raise ValueError(f"{self.NAME}: min_numel={self.min_numel!r} must be an int >= 0 (or None for one "
                             f"{self.BLOCK}x{self.BLOCK} tile)")
        for name in ("param_filter", "on_gathered"):
            f = getattr(self, name)
            if f is not None and not callable(f):
                raise TypeError(f"{self.NAME}: {name}={f!r} must be a callable or None")

    # what the gather path shares with BlockFP8: a tile that the layout keeps whole
    @property
    def tile(self) -> tuple[int, int]:
        return (self.BLOCK, self.BLOCK)

    def applies(self, name: str, param: torch.Tensor) -> bool:
        """Whether ``param`` is gathered in this format: floating point, 2-D or more, at least
        ``min_numel`` elements (one tile by default), not a bias, and ``param_filter`` agrees."""
        if not param.dtype.is_floating_point or param.dim() < 2:
            return False
        limit = self.BLOCK * self.BLOCK if self.min_numel is None else self.min_numel
        if param.numel() < limit or name.endswith("bias"):
            return False
        return self.param_filter is None or bool(self.param_filter(name, param))

    def geometry(self, shape: Sequence[int]) -> TileGeometry:
        return TileGeometry.of(tuple(int(s) for s in shape), self.tile)


def quantize_plane(x: torch.Tensor, plane: str, quantize_last: Callable, codes: torch.Tensor,
                   scales: torch.Tensor) -> None:
    """Quantise a piece ``x`` ``(n, rows, C)`` in ``plane`` with ``quantize_last`` (a format's
    blocks along the last dim: ``x -> (codes, scales)``) into ``codes`` and ``scales``, in
    place; the ``cols`` plane is the rows plane of the transposed matrices."""
    if x.numel() == 0:
        return
    if plane == "rows":
        c, e = quantize_last(x)
        codes.copy_(c)
        scales.copy_(e)
    else:
        c, e = quantize_last(x.transpose(1, 2))
        codes.copy_(c.transpose(1, 2))
        scales.copy_(e.transpose(1, 2))
