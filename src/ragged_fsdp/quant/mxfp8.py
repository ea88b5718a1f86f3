"""MXFP8 (OCP Microscaling): the policy, and the quantise math of its two planes.

Pure tensor math, no process groups. An MX block is 32 consecutive elements along one dim
with one E8M0 scale (a biased power-of-two exponent, one byte); its elements become E4M3
codes. A weight ``W`` (``x @ W.T``, as ``nn.Linear`` and ``F.linear`` use it; fused experts
``(E, out, in)`` the same per expert) is needed in two orientations:

* the **row plane**: blocks along the last dim (the forward contracts over it, ``x @ W.T``);
  codes ``(…, R, C)``, scales ``(…, R, ceil(C/32))``;
* the **column plane**: blocks along dim -2 (the input gradient contracts over it,
  ``dy @ W``); codes ``(…, R, C)`` stored at the weight's own element positions, scales
  ``(…, ceil(R/32), C)`` (the transpose of what ``to_mx(W.t())`` returns).

The layout keeps 32x32 tiles whole on one rank (granularity ``rows:32``, or whole expert
matrices when ``R`` is not a multiple of 32, as :class:`~.blockfp8.TileGeometry` decides), so
every block of either plane lies inside one rank's piece: each rank quantises its own piece
and the pieces' codes and scale grids concatenate, in rank order, into the full tensor's.

Rounding is torchao's ``to_mx`` (``torchao.prototype.mx_formats``), re-derived from the OCP
MX spec's rules: ``floor`` (the default, the spec's): the scale exponent is
``floor(log2(amax)) - 8`` (8 = log2 of E4M3's largest power of two, 256), read from amax's
fp32 exponent bits, and clamped to E8M0's range; ``rceil``: ``ceil(log2(amax / 448))``.
Codes are ``clamp(x / scale, ±448)`` cast to E4M3 (round to nearest even, in fp32).
**Tail blocks**: torchao's ``to_mx`` requires the blocked dim to be a multiple of 32; here a
dim that is not has a partial last block whose scale is the amax of its real elements, which
is exactly ``to_mx`` of the weight zero-padded to the next multiple of 32 (zeros raise no
max), cropped back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .blockfp8 import codes_to_float
from .tiled_policy import TiledPolicy, quantize_plane

__all__ = ["MXFP8", "PLANES", "mx_quantize_piece", "mx_dequantize_piece", "mx_quantize", "mx_dequantize",
           "mx_scale_shape", "e8m0_to_float"]

BLOCK = 32
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
E4M3_MAX_POW2 = 8  # 256 = 2**8, the largest power of two E4M3 holds
E8M0_BIAS = 127
PLANES = ("rows", "cols")  # forward (x @ W.T) needs rows, the input gradient (dy @ W) cols


@dataclass(frozen=True)
class MXFP8(TiledPolicy):
    """All-gather policy for ``fully_shard(all_gather_quant=MXFP8())``: weights gathered as
    MXFP8 (E4M3 codes + one E8M0 scale per 32 elements), the forward's gather moving the
    row plane, the backward's re-gather the column plane (see ``docs/fp8.md``).

    Applies to floating tensors with >= 2 dims and at least ``min_numel`` elements (default:
    one 32x32 tile) whose name does not end in ``bias``, and for which ``param_filter(name,
    param)`` (if given) is true; the rest gather in ``param_dtype`` as usual. ``scaling`` is
    torchao's ``ScaleCalculationMode``: ``"floor"`` (OCP's) or ``"rceil"``.
    ``on_gathered(name, plane, codes, scales)``, if given, is called after each gather with
    the full tensor's codes (``uint8`` holding E4M3, the weight's shape) and scales (``uint8``
    E8M0) of the plane that moved: to check them, e.g. against torchao.
    """

    scaling: str = "floor"

    BLOCK = BLOCK
    NAME = "MXFP8"

    def __post_init__(self):
        super().__post_init__()
        if self.scaling not in ("floor", "rceil"):
            raise ValueError(f"MXFP8: scaling={self.scaling!r} must be 'floor' (OCP MX) or 'rceil'")

    def scale_shape(self, piece: tuple[int, int, int], plane: str) -> tuple[int, int, int]:
        return mx_scale_shape(piece, plane)

    def __repr__(self) -> str:
        return f"MXFP8(scaling={self.scaling!r})"


# -- the math --------------------------------------------------------------------------------
def _exponents(amax: torch.Tensor, scaling: str) -> torch.Tensor:
    """Biased E8M0 exponents (``uint8``) of blocks with fp32 ``amax``."""
    if scaling == "floor":
        pow2 = torch.bitwise_right_shift(amax.view(torch.int32), 23).bitwise_and(0xFF) - E8M0_BIAS
        e = (pow2 - E4M3_MAX_POW2).clamp(-E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS
        return torch.where(torch.isnan(amax), 255, e).to(torch.uint8)
    descale = amax / E4M3_MAX
    e = (torch.ceil(torch.log2(descale)).clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)
    return torch.where(torch.isnan(descale), 255, torch.where(torch.isinf(descale), 254, e)).to(torch.uint8)


def _quantize_last(x: torch.Tensor, scaling: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of 32 along the last dim of ``x`` (…, K): codes ``uint8`` (…, K) and exponents
    ``uint8`` (…, ceil(K/32)); a partial last block as if zero-padded."""
    K = x.shape[-1]
    nb = -(-K // BLOCK)
    xf = x.float()
    if K % BLOCK:
        xf = torch.nn.functional.pad(xf, (0, nb * BLOCK - K))
    xb = xf.unflatten(-1, (nb, BLOCK))
    amax = xb.abs().amax(-1, keepdim=True)
    e = _exponents(amax, scaling)
    if scaling == "floor":
        # 2**(e-127) from its bits; e = 0 would be 2**-127, a subnormal: torchao uses the
        # smallest normal, 2**-126, instead (then every code of that block is 0 anyway)
        scale = torch.bitwise_left_shift(e.to(torch.int32), 23).view(torch.float32)
        q = xb / scale.clamp(min=torch.finfo(torch.float32).tiny)
    else:
        rcp = torch.where(e == 255, amax / E4M3_MAX, torch.where(
            e == 254, 2.0**-127, torch.where(e == 0, 1.0, torch.exp2(E8M0_BIAS - e.to(torch.float32)))))
        q = xb * rcp
    codes = q.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).view(torch.uint8).flatten(-2)[..., :K]
    return codes, e.squeeze(-1)


def mx_scale_shape(piece: tuple[int, int, int], plane: str) -> tuple[int, int, int]:
    """Scale grid of a piece ``(n, rows, C)`` in ``plane``."""
    n, rows, C = piece
    return (n, rows, -(-C // BLOCK)) if plane == "rows" else (n, -(-rows // BLOCK), C)


@torch.no_grad()
def mx_quantize_piece(x: torch.Tensor, plane: str, scaling: str, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantise a piece ``x`` ``(n, rows, C)`` in ``plane`` into ``codes`` (``uint8``, x's
    shape) and ``scales`` (``uint8``, :func:`mx_scale_shape`), in place. A ``cols`` piece
    must start on a 32-row boundary of its matrices (the layout's rule)."""
    quantize_plane(x, plane, lambda t: _quantize_last(t, scaling), codes, scales)


_POW2: dict[torch.device, torch.Tensor] = {}


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents (``uint8``) as fp32 ``2**(e-127)`` (255: NaN), exactly."""
    lut = _POW2.get(e.device)
    if lut is None:
        vals = [2.0 ** (k - E8M0_BIAS) for k in range(255)] + [float("nan")]
        lut = _POW2[e.device] = torch.tensor(vals, dtype=torch.float32, device=e.device)
    return torch.index_select(lut, 0, e.reshape(-1).int()).view(e.shape)


@torch.no_grad()
def mx_dequantize_piece(codes: torch.Tensor, scales: torch.Tensor, plane: str, out: torch.Tensor) -> None:
    """``out (n, rows, C) = codes * 2**(e-127)``, both cast to ``out.dtype`` first, as
    torchao's ``to_dtype`` does (so the result is bitwise torchao's dequantisation)."""
    if out.numel() == 0:
        return
    n, rows, C = out.shape
    vals = codes_to_float(codes, E4M3).to(out.dtype)
    s = e8m0_to_float(scales).to(out.dtype)
    if plane == "rows":
        s = s.repeat_interleave(BLOCK, dim=2)[:, :, :C]
    else:
        s = s.repeat_interleave(BLOCK, dim=1)[:, :rows, :]
    out.copy_(vals * s)


def _as_piece(full: torch.Tensor) -> torch.Tensor:
    return full.reshape(math.prod(full.shape[:-2]), full.shape[-2], full.shape[-1])


@torch.no_grad()
def mx_quantize(full: torch.Tensor, plane: str, scaling: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """The single-process reference: ``(codes, scales)`` of a whole tensor (…, R, C) in
    ``plane`` (scales shaped as :func:`mx_scale_shape`, with the leading dims restored)."""
    x = _as_piece(full.detach())
    codes = torch.empty(x.shape, dtype=torch.uint8, device=full.device)
    scales = torch.empty(mx_scale_shape(tuple(x.shape), plane), dtype=torch.uint8, device=full.device)
    mx_quantize_piece(x, plane, scaling, codes, scales)
    return codes.view(full.shape), scales.view(*full.shape[:-2], *mx_scale_shape((1, *full.shape[-2:]), plane)[1:])


@torch.no_grad()
def mx_dequantize(codes: torch.Tensor, scales: torch.Tensor, plane: str, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`mx_quantize` into ``dtype``."""
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    p = _as_piece(out)
    mx_dequantize_piece(_as_piece(codes), scales.reshape(mx_scale_shape(tuple(p.shape), plane)), plane, p)
    return out
