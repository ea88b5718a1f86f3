"""NVFP4: the policy, and the quantise math of its two planes.

Pure tensor math, no process groups. An NVFP4 block is 16 consecutive elements along one
dim; its elements become FP4 E2M1 codes (4 bits: sign, 2 exponent bits, 1 mantissa bit;
magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) under two scales: one E4M3 byte per block and one
fp32 scale per tensor, ``amax / (448 * 6)`` of the whole tensor (so a block scale of 448
reaches the tensor's largest element). The planes are MXFP8's (:mod:`.mxfp8`): **rows**
(blocks along the last dim, the forward's ``x @ W.T``) and **cols** (blocks along dim -2,
the input gradient's ``dy @ W``), codes at the weight's own element positions, scales
``(…, R, ceil(C/16))`` and ``(…, ceil(R/16), C)``. Fused experts ``(E, R, C)`` share one
per-tensor scale (the parameter's amax), as torchao's scalar ``per_tensor_scale`` does.

Rounding is torchao's ``nvfp4_quantize`` (``torchao.prototype.mx_formats.nvfp4_tensor``,
0.18) with a per-tensor scale, re-derived from its definition: block scale
``e4m3(clamp(amax_block / 6 / s_t, [2**-6, 448]))``, codes ``e2m1(clamp(x * ((1 / s_t) /
s_block), ±6))`` rounded to nearest, ties to the even code (the sign bit kept, also on a
zero). **Tail blocks**: torchao requires the blocked dim to be a multiple of 16; a partial
last block here is exactly torchao's quantisation of the weight zero-padded to the next
multiple of 16, cropped back (zeros raise neither the block's nor the tensor's amax).
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import torch

from .blockfp8 import codes_to_float
from .tiled_policy import TiledPolicy, quantize_plane

__all__ = ["NVFP4", "nv_per_tensor_scale", "nv_quantize_piece", "nv_dequantize_piece", "nv_quantize",
           "nv_dequantize", "nv_scale_shape", "pack_nibbles", "unpack_nibbles", "e2m1_encode", "E2M1_VALUES"]

BLOCK = 16
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
E4M3_TINY = torch.finfo(E4M3).tiny  # 2**-6: the smallest normal E4M3, the block scale's floor
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# the midpoints between neighbouring E2M1 magnitudes; a tie goes to the even code, so a
# midpoint rounds up (">=") where the code above is even, down (">") where it is odd
_UP = (0.75, 1.75, 3.5)
_DOWN = (0.25, 1.25, 2.5, 5.0)


@dataclass(frozen=True)
class NVFP4(TiledPolicy):
    """All-gather policy for ``fully_shard(all_gather_quant=NVFP4())``: weights gathered as
    NVFP4 (E2M1 codes packed two per byte, one E4M3 scale per 16 elements, one fp32 scale per
    tensor agreed across ranks), the forward's gather moving the row plane, the backward's
    re-gather the column plane (see ``docs/fp8.md``).

    Applies to floating tensors with >= 2 dims and at least ``min_numel`` elements (default:
    one 16x16 tile) whose name does not end in ``bias``, and for which ``param_filter(name,
    param)`` (if given) is true (e.g. the MoE experts only); the rest gather in
    ``param_dtype``. ``on_gathered(name, plane, codes, scales, per_tensor_scale)``, if given,
    is called after each gather with the full tensor's E2M1 codes (``uint8``, one per element,
    the weight's shape), E4M3 block scales (``uint8``) and the fp32 per-tensor scale (0-dim).
    """

    BLOCK = BLOCK
    NAME = "NVFP4"

    def scale_shape(self, piece: tuple[int, int, int], plane: str) -> tuple[int, int, int]:
        return nv_scale_shape(piece, plane)

    def __repr__(self) -> str:
        return "NVFP4()"


def nv_per_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """The fp32 per-tensor scale of a tensor whose largest magnitude is ``amax``."""
    return amax.float() / (E4M3_MAX * E2M1_MAX)


def e2m1_encode(q: torch.Tensor) -> torch.Tensor:
    """fp32 values already within ±6 as E2M1 codes (``uint8`` 0..15), nearest, ties even."""
    a = q.abs()
    m = torch.zeros(q.shape, dtype=torch.uint8, device=q.device)
    for t in _DOWN:
        m += a > t
    for t in _UP:
        m += a >= t
    return m | (torch.signbit(q).to(torch.uint8) << 3)


_VALUES: dict[torch.device, torch.Tensor] = {}


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (``uint8`` 0..15) as fp32, exactly."""
    lut = _VALUES.get(codes.device)
    if lut is None:
        lut = _VALUES[codes.device] = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES),
                                                   dtype=torch.float32, device=codes.device)
    return torch.index_select(lut, 0, codes.reshape(-1).int()).view(codes.shape)


def pack_nibbles(codes: torch.Tensor, out: torch.Tensor) -> None:
    """1-D codes (``uint8`` 0..15) two per byte into ``out`` (``ceil(n/2)`` bytes): element
    ``2i`` in the low nibble, ``2i+1`` in the high one (torchao's ``pack_uint4`` order)."""
    n = codes.numel()
    lo, hi = codes[0::2], codes[1::2]
    out.copy_(lo)
    out.narrow(0, 0, n // 2).bitwise_or_(hi << 4)


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`pack_nibbles`: ``n`` codes."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten()[:n]


def nv_scale_shape(piece: tuple[int, int, int], plane: str) -> tuple[int, int, int]:
    """Scale grid of a piece ``(n, rows, C)`` in ``plane``."""
    n, rows, C = piece
    return (n, rows, -(-C // BLOCK)) if plane == "rows" else (n, -(-rows // BLOCK), C)


def _quantize_last(x: torch.Tensor, pts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    K = x.shape[-1]
    nb = -(-K // BLOCK)
    xf = x.float()
    if K % BLOCK:
        xf = torch.nn.functional.pad(xf, (0, nb * BLOCK - K))
    xb = xf.unflatten(-1, (nb, BLOCK))
    block = xb.abs().amax(-1) / E2M1_MAX
    s8 = torch.clamp(block / pts, min=E4M3_TINY, max=E4M3_MAX).to(E4M3)
    recip = (1.0 / pts) / s8.float()
    q = torch.clamp(xb * recip.unsqueeze(-1), -E2M1_MAX, E2M1_MAX)
    return e2m1_encode(q).flatten(-2)[..., :K], s8.view(torch.uint8)


@torch.no_grad()
def nv_quantize_piece(x: torch.Tensor, plane: str, pts: torch.Tensor, codes: torch.Tensor,
                      scales: torch.Tensor) -> None:
    """Quantise a piece ``x`` ``(n, rows, C)`` under per-tensor scale ``pts`` (0-dim fp32) in
    ``plane`` into ``codes`` (``uint8`` E2M1, x's shape) and ``scales`` (``uint8`` E4M3,
    :func:`nv_scale_shape`), in place. A ``cols`` piece starts on a 16-row boundary."""
    quantize_plane(x, plane, lambda t: _quantize_last(t, pts), codes, scales)


@torch.no_grad()
def nv_dequantize_piece(codes: torch.Tensor, scales: torch.Tensor, pts: torch.Tensor, plane: str,
                        out: torch.Tensor) -> None:
    """``out (n, rows, C) = e2m1(codes) * (s_t * e4m3(scales))`` in fp32, then cast, as
    torchao's ``NVFP4Tensor.dequantize`` computes it (so bitwise its result)."""
    if out.numel() == 0:
        return
    n, rows, C = out.shape
    s = pts * codes_to_float(scales, E4M3)
    s = s.repeat_interleave(BLOCK, dim=2)[:, :, :C] if plane == "rows" else s.repeat_interleave(BLOCK, dim=1)[:, :rows, :]
    out.copy_(e2m1_decode(codes) * s)


def _as_piece(full: torch.Tensor) -> torch.Tensor:
    return full.reshape(math.prod(full.shape[:-2]), full.shape[-2], full.shape[-1])


@torch.no_grad()
def nv_quantize(full: torch.Tensor, plane: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The single-process reference: ``(codes, scales, per_tensor_scale)`` of a whole
    tensor (…, R, C) in ``plane``."""
    x = _as_piece(full.detach())
    pts = nv_per_tensor_scale(x.abs().amax())
    codes = torch.empty(x.shape, dtype=torch.uint8, device=full.device)
    scales = torch.empty(nv_scale_shape(tuple(x.shape), plane), dtype=torch.uint8, device=full.device)
    nv_quantize_piece(x, plane, pts, codes, scales)
    return codes.view(full.shape), scales.view(*full.shape[:-2], *nv_scale_shape((1, *full.shape[-2:]), plane)[1:]), pts


@torch.no_grad()
def nv_dequantize(codes: torch.Tensor, scales: torch.Tensor, pts: torch.Tensor, plane: str,
                  dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`nv_quantize` into ``dtype``."""
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    p = _as_piece(out)
    nv_dequantize_piece(_as_piece(codes), scales.reshape(nv_scale_shape(tuple(p.shape), plane)), pts, plane, p)
    return out
