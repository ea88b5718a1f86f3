"""Block-wise FP8: the policy, the tile geometry of a tensor, and the quantise math.

Pure tensor math, no process groups. A weight is cut into tiles of ``tile = (tr, tc)``
elements over its last two dims (rows ``R = shape[-2]``, columns ``C = shape[-1]``); each tile
gets one fp32 scale ``amax(|tile|) / fp8_max`` and its elements become fp8 codes
``clamp(x / scale)``. Tiles at the bottom and right edges may be partial. An all-zero tile
gets scale 1 and zero codes.

Leading dims (fused experts ``(E, R, C)``) are a stack of matrices, tiled each on its own. Two
cases keep the math uniform, as one "piece" of shape ``(n, rows, C)``:

* ``R % tr == 0`` (and every 2-D weight): the stack is one tall matrix of ``E*R`` rows; a tile
  row never spans two experts. A rank's piece is a run of whole tile rows ``(1, rows, C)``
  (granularity ``rows:tr``); only the last piece of the tensor may end with a partial tile row.
* ``R % tr != 0`` with leading dims: each expert matrix ends with a partial tile row, so the
  granularity keeps whole expert matrices (``rows:R``) and a piece is ``(n, R, C)``.

Because a piece always starts on a tile-row boundary, each rank's tiles are tiles of the full
tensor, and the full tensor's scale grid (in row-major tile order) is the concatenation, in
rank order, of its pieces' grids. Every op below is elementwise or an exact max, so the codes
and scales of a tile do not depend on how the tensor is cut: quantising pieces on W ranks
gives the same bits as quantising the whole tensor in one process.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["BlockFP8", "TileGeometry", "quantize_pieces", "dequantize_pieces", "tile_amax",
           "quantize_dequantize", "per_tensor_quantize_dequantize", "FP8_DTYPES"]

# fp8 formats torch can cast to on every device (e8m0 is a scale-only format: no sign/mantissa)
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                   if hasattr(torch, n))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # True is an int to Python, not a size


@dataclass(frozen=True)
class BlockFP8:
    """All-gather quantisation policy for ``fully_shard(all_gather_quant=...)``.

    Each rank quantises its own whole ``tile`` tiles of the fp32 master weights, the
    all-gather moves 1-byte codes plus one fp32 scale per tile, and the gathered weights are
    dequantised into the ``param_dtype`` the module computes in. Applies to floating tensors
    with >= 2 dims and at least ``min_numel`` elements (default: one tile) whose name does not
    end in ``bias``, and for which ``param_filter(name, param)`` (if given) is true; the rest
    are gathered in ``param_dtype`` as usual.
    """

    tile: tuple[int, int] = (128, 128)
    dtype: torch.dtype = torch.float8_e4m3fn
    min_numel: int | None = None
    param_filter: Callable[[str, torch.Tensor], bool] | None = None

    def __post_init__(self):
        tile = tuple(self.tile) if isinstance(self.tile, (tuple, list)) else None
        if tile is None or len(tile) != 2 or not all(_is_int(t) and t >= 1 for t in tile):
            raise ValueError(f"BlockFP8: tile={self.tile!r} must be two positive ints (rows, cols), e.g. (128, 128)")
        object.__setattr__(self, "tile", tile)
        if self.dtype not in FP8_DTYPES:
            names = ", ".join(str(d) for d in FP8_DTYPES)
            raise ValueError(f"BlockFP8: dtype={self.dtype} is not an fp8 format this torch can cast to; use one of {names}")
        if self.min_numel is not None and (not _is_int(self.min_numel) or self.min_numel < 0):
            raise ValueError(f"BlockFP8: min_numel={self.min_numel!r} must be an int >= 0 (or None for one tile)")
        if self.param_filter is not None and not callable(self.param_filter):
            raise TypeError(
                f"BlockFP8: param_filter={self.param_filter!r} must be a callable (name, param) -> bool "
                "or None (every eligible weight)"
            )

    @property
    def fp8_max(self) -> float:
        return float(torch.finfo(self.dtype).max)

    def applies(self, name: str, param: torch.Tensor) -> bool:
        """Whether ``param`` is gathered as fp8."""
        if not param.dtype.is_floating_point or param.dim() < 2:
            return False
        limit = self.tile[0] * self.tile[1] if self.min_numel is None else self.min_numel
        if param.numel() < limit or name.endswith("bias"):
            return False
        return self.param_filter is None or bool(self.param_filter(name, param))

    def geometry(self, shape: Sequence[int]) -> "TileGeometry":
        return TileGeometry.of(tuple(int(s) for s in shape), self.tile)

    def __repr__(self) -> str:
        return f"BlockFP8(tile={self.tile}, dtype={self.dtype})"


@dataclass(frozen=True)
class TileGeometry:
    """How one tensor is tiled (see the module docstring)."""

    shape: tuple[int, ...]
    tile: tuple[int, int]
    per_matrix: bool  # True: whole expert matrices per piece; False: runs of tile rows

    @classmethod
    def of(cls, shape: tuple[int, ...], tile: tuple[int, int]) -> "TileGeometry":
        if len(shape) < 2:
            raise ValueError(f"block fp8 needs a tensor with >= 2 dims, got shape {shape}")
        lead = math.prod(shape[:-2])
        return cls(shape, tile, per_matrix=lead > 1 and shape[-2] % tile[0] != 0)

    @property
    def rows(self) -> int:  # R
        return self.shape[-2]

    @property
    def cols(self) -> int:  # C
        return self.shape[-1]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def granularity(self) -> str:
        """The planner granularity that keeps every tile whole on one rank."""
        return f"rows:{self.rows}" if self.per_matrix else f"rows:{self.tile[0]}"

    @property
    def block_elems(self) -> int:
        return (self.rows if self.per_matrix else self.tile[0]) * self.cols

    def piece_shape(self, start: int, end: int) -> tuple[int, int, int]:
        """``(n, rows, C)`` of the elements ``[start, end)`` of the flattened tensor; raises
        when the range does not start on a tile-row boundary (a tile would be cut)."""
        C, R, tr = self.cols, self.rows, self.tile[0]
        count = end - start
        if count == 0:
            return (0, 0, C) if not self.per_matrix else (0, R, C)
        if self.per_matrix:
            m = R * C
            if start % m or (count % m and end != self.numel):
                raise ValueError(f"elements [{start}, {end}) of a {self.shape} tensor are not whole "
                                 f"{R}x{C} expert matrices: a {tr}-row tile would be cut")
            return (count // m, R, C)
        if start % (tr * C) or (count % (tr * C) and end != self.numel):
            raise ValueError(f"elements [{start}, {end}) of a {self.shape} tensor do not start and end on "
                             f"{tr}-row tile boundaries: a tile would be cut")
        return (1, count // C, C)

    def tiles(self, start: int, end: int) -> int:
        n, rows, C = self.piece_shape(start, end)
        return n * -(-rows // self.tile[0]) * -(-C // self.tile[1]) if n and rows else 0

    def cuts(self, block_elems: int) -> bool:
        """Whether uniform blocks of ``block_elems`` elements (a granularity) put a boundary
        inside a tile, i.e. anywhere but on a tile-row boundary of one matrix."""
        g, C, R, tr = block_elems, self.cols, self.rows, self.tile[0]
        if g >= self.numel:
            return False  # no boundary inside the tensor
        if g % C:
            return True
        gr = g // C
        if not self.per_matrix and gr % tr == 0:
            return False
        for m in range(1, -(-self.numel // g)):  # every boundary strictly inside
            if ((m * gr) % R) % tr:
                return True
        return False


# -- the math, on pieces (n, rows, C) ------------------------------------------------------
def _split_cols(C: int, tc: int) -> tuple[int, int]:
    """(full column tiles, width of the partial last column tile or 0)."""
    return C // tc, C % tc


def tile_amax(x: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """Per-tile max of ``|x|`` for a piece ``(n, rows, C)``: ``(n, ceil(rows/tr), ceil(C/tc))``
    fp32. Max is exact, so the result does not depend on the order of reduction."""
    tr, tc = tile
    n, rows, C = x.shape
    a = x.abs()
    nf, edge = _split_cols(C, tc)
    parts = []
    if nf:
        parts.append(a[..., :nf * tc].unflatten(-1, (nf, tc)).amax(-1))
    if edge:
        parts.append(a[..., nf * tc:].amax(-1, keepdim=True))
    col = torch.cat(parts, -1) if len(parts) > 1 else parts[0]  # (n, rows, nC), 1/tc of x
    nR = -(-rows // tr)
    if rows % tr:
        col = torch.nn.functional.pad(col, (0, 0, 0, nR * tr - rows))  # zeros do not raise a max
    return col.view(n, nR, tr, -1).amax(2).float()


def _per_row(scales: torch.Tensor, rows: int, tr: int) -> torch.Tensor:
    """Tile scales ``(n, nR, nC)`` repeated for each row: ``(n, rows, nC)`` (1/tc of a piece)."""
    return scales.repeat_interleave(tr, dim=1)[:, :rows]


def _by_tile(x: torch.Tensor, s_rows: torch.Tensor, tc: int):
    """Pairs (column block of x, matching scales broadcastable to it)."""
    nf, edge = _split_cols(x.shape[-1], tc)
    if nf:
        yield x[..., :nf * tc].unflatten(-1, (nf, tc)), s_rows[..., :nf, None]
    if edge:
        yield x[..., nf * tc:], s_rows[..., nf:nf + 1]


@torch.no_grad()
def quantize_pieces(x: torch.Tensor, tile: tuple[int, int], dtype: torch.dtype,
                    codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantise a piece ``x`` ``(n, rows, C)`` into ``codes`` (a ``uint8`` tensor of the same
    shape) and ``scales`` (``(n, nR, nC)`` fp32), in place."""
    if x.numel() == 0:
        return
    fmax = float(torch.finfo(dtype).max)
    amax = tile_amax(x.float(), tile)
    s = amax / fmax
    # all-zero tile -> scale 1 (codes 0); also a scale that underflowed to 0 (|x| < ~1e-43)
    s = torch.where(s > 0, s, torch.ones_like(s))
    scales.copy_(s)
    out = codes.view(dtype)
    s_rows = _per_row(s, x.shape[1], tile[0])
    for (xp, sp), (op, _) in zip(_by_tile(x, s_rows, tile[1]), _by_tile(out, s_rows, tile[1])):
        q = xp.float() / sp
        op.copy_(q.clamp_(-fmax, fmax))  # clamp: x/scale may round just above fp8_max


_LUTS: dict[torch.dtype, torch.Tensor] = {}


def codes_to_float(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 codes (``uint8``) as fp32, exactly. On CPU torch converts fp8 one element at a time
    (about 2x slower than a 256-entry table lookup, which gives the same values)."""
    if codes.device.type != "cpu":
        return codes.view(dtype).float()
    lut = _LUTS.get(dtype)
    if lut is None:
        lut = _LUTS[dtype] = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return torch.index_select(lut, 0, codes.reshape(-1).int()).view(codes.shape)


@torch.no_grad()
def dequantize_pieces(codes: torch.Tensor, scales: torch.Tensor, tile: tuple[int, int],
                      dtype: torch.dtype, out: torch.Tensor) -> None:
    """``out (n, rows, C) = codes * scale`` (fp32 product, then cast to ``out.dtype``)."""
    if out.numel() == 0:
        return
    vals = codes_to_float(codes, dtype)
    s_rows = _per_row(scales, out.shape[1], tile[0])
    for vp, sp in _by_tile(vals, s_rows, tile[1]):
        vp.mul_(sp)
    out.copy_(vals)


def _as_pieces(t: torch.Tensor, g: TileGeometry) -> torch.Tensor:
    n, rows, C = g.piece_shape(0, g.numel)
    return t.reshape(n, rows, C)


@torch.no_grad()
def quantize_dequantize(full: torch.Tensor, policy: BlockFP8, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The single-process reference: what the gathered weight is, quantised per tile and
    dequantised into ``out_dtype`` (default ``full.dtype``)."""
    g = policy.geometry(full.shape)
    x = _as_pieces(full.detach(), g)
    n, rows, C = x.shape
    tr, tc = policy.tile
    codes = torch.empty(x.shape, dtype=torch.uint8, device=full.device)
    scales = torch.empty(n, -(-rows // tr), -(-C // tc), dtype=torch.float32, device=full.device)
    quantize_pieces(x, policy.tile, policy.dtype, codes, scales)
    out = torch.empty(x.shape, dtype=out_dtype or full.dtype, device=full.device)
    dequantize_pieces(codes, scales, policy.tile, policy.dtype, out)
    return out.view(full.shape)


@torch.no_grad()
def per_tensor_quantize_dequantize(full: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """One scale for the whole tensor (tensorwise dynamic scaling, as torchao's FP8
    all-gather does): the comparison for the precision argument."""
    fmax = float(torch.finfo(dtype).max)
    x = full.detach().float()
    amax = x.abs().max()
    s = amax / fmax if amax > 0 else torch.ones((), dtype=torch.float32)
    return ((x / s).clamp(-fmax, fmax).to(dtype).float() * s).to(full.dtype)
