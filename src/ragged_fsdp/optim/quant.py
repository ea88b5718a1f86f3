"""Block-wise 8-bit quantisation with the dynamic (tree) maps. Pure: no process group.

The *dynamic map* (Dettmers, "8-bit Approximations for Parallelism in Deep Learning", 2016;
used for 8-bit optimizer states since "8-bit Optimizers via Block-wise Quantization", 2021)
spends its 256 codes on values spread over many orders of magnitude. With ``E = 7``
exponent levels, level ``i`` (``i = 0 .. E-1``) covers magnitudes ``10**(i - E + 1) * f``
where ``f`` runs over the midpoints of ``n_i + 1`` evenly spaced points in ``[0.1, 1]``:

* signed map: ``n_i = 2**i`` fractions per sign, so ``2 * (1 + 2 + ... + 64) = 254`` values,
  plus ``0`` and ``1``;
* unsigned map: ``n_i = 2**(i + 1)`` non-negative fractions, ``2 + 4 + ... + 128 = 254``
  values, plus ``0`` and ``1``.

Both maps are sorted ascending and hold exactly 256 float32 values, so a code is a ``uint8``
index into the map. The float32 arithmetic below (``torch.linspace`` in float32, midpoints in
float32, the scale applied as a float32 multiply) reproduces the standard maps bit for bit;
``tests/test_optim_quant.py`` checks that against an independent implementation.

Block-wise quantisation cuts a flat tensor into ``block``-element blocks starting at its first
element (the last block may be partial), stores one float32 ``absmax`` per block and, per
element, the code nearest to ``x / absmax``. Every block is handled on its own, so quantising
any run of whole blocks gives the same codes and absmax as quantising the whole tensor: that
is what lets each rank quantise its own blocks with no communication.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "dynamic_map", "signed_map", "unsigned_map", "quantize_blockwise", "dequantize_blockwise",
    "num_blocks", "nearest_codes", "EXPONENT_LEVELS",
]

EXPONENT_LEVELS = 7


def dynamic_map(signed: bool = True, levels: int = EXPONENT_LEVELS) -> torch.Tensor:
    """The 256-entry dynamic quantisation map (float32, sorted ascending).

    Only ``levels = 7`` gives 256 values (an 8-bit map); other values are accepted for
    experiments and give ``2**levels`` entries.
    """
    if levels < 1:
        raise ValueError(f"dynamic_map: levels={levels} must be >= 1")
    values: list[torch.Tensor] = [torch.zeros(1), torch.ones(1)]
    for i in range(levels):
        count = 2 ** i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1.0, count + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        scale = 10.0 ** (i - (levels - 1))
        values.append(mids * scale)
        if signed:
            values.append(mids * -scale)
    out = torch.cat(values)
    return torch.sort(out).values.contiguous()


@functools.lru_cache(maxsize=None)
def _cached(signed: bool, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    code = dynamic_map(signed).to(device)
    bounds = ((code[:-1] + code[1:]) / 2.0).contiguous()  # decision boundaries, ascending
    return code, bounds


def signed_map(device: torch.device | str = "cpu") -> torch.Tensor:
    """The shared signed map (first moment). One tensor per device, never per parameter."""
    return _cached(True, str(torch.device(device)))[0]


def unsigned_map(device: torch.device | str = "cpu") -> torch.Tensor:
    """The shared unsigned map (second moment)."""
    return _cached(False, str(torch.device(device)))[0]


def _bounds_for(code: torch.Tensor) -> torch.Tensor:
    for signed in (True, False):
        c, b = _cached(signed, str(code.device))
        if code is c:
            return b
    return ((code[:-1] + code[1:]) / 2.0).contiguous()


@functools.lru_cache(maxsize=None)
def _lut_cached(signed: bool, device: str):
    return _build_lut(_cached(signed, device)[1])


def _build_lut(bounds: torch.Tensor):
    """Exact nearest-code lookup without a binary search.

    A float32 ``x`` falls in the bucket named by its top 16 bits (sign, exponent, 7 mantissa
    bits). ``first[k]`` counts the decision boundaries below bucket ``k``'s smallest value;
    when every bucket holds at most one boundary, ``bucketize(x) = first[k] + (x > next[k])``
    with ``next[k] = bounds[first[k]]``. Returns ``(first, next)`` or None when some bucket
    holds two boundaries (then callers fall back to ``torch.bucketize``).
    """
    device = bounds.device
    top = torch.arange(65536, dtype=torch.int64) << 16
    ends = torch.stack([top, top | 0xFFFF]).to(torch.int64)
    ends = torch.where(ends >= 2 ** 31, ends - 2 ** 32, ends).to(torch.int32).view(torch.float32)
    lo, hi = ends.amin(0), ends.amax(0)
    b = bounds.cpu()
    first = torch.bucketize(lo, b, out_int32=True)
    last = torch.bucketize(hi, b, out_int32=True)
    finite = torch.isfinite(lo) & torch.isfinite(hi)
    if bool(((last - first)[finite] > 1).any()):
        return None
    nxt = torch.cat([b, torch.tensor([float("inf")])])
    # index by the *signed* top half plus 32768 (an arithmetic shift and one add)
    first = torch.cat([first[32768:], first[:32768]])
    return first.to(device), nxt.to(device)


def _lut_for(code: torch.Tensor):
    for signed in (True, False):
        if code is _cached(signed, str(code.device))[0]:
            return _lut_cached(signed, str(code.device))
    return _build_lut(_bounds_for(code))


def nearest_codes(normed: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """int32 index of the nearest entry of ``code`` (sorted) for each value of the float32
    tensor ``normed``; ties go to the lower code (``torch.bucketize`` on the midpoints)."""
    lut = _lut_for(code)
    if lut is None or normed.dtype != torch.float32:
        return torch.bucketize(normed, _bounds_for(code), out_int32=True)
    first, nxt = lut
    flat = normed.reshape(-1)
    bucket = torch.bitwise_right_shift(flat.view(torch.int32), 16).add_(32768)
    idx = first.index_select(0, bucket)
    return idx.add_(flat > nxt.index_select(0, idx)).view(normed.shape)


def num_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def quantize_blockwise(
    x: torch.Tensor,
    code: torch.Tensor,
    block: int = 256,
    *,
    codes_out: torch.Tensor | None = None,
    absmax_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` (any shape, read flat) in ``block``-element blocks against ``code``.

    Returns ``(codes, absmax)``: ``codes`` uint8 of ``x``'s shape (written into ``codes_out``
    when given), ``absmax`` float32 of ``ceil(numel / block)`` entries (into ``absmax_out``).
    Each element gets the code nearest to ``x / absmax`` (ties go to the lower code); a block
    of zeros has absmax 0 and all codes pointing at 0.
    """
    if block < 1:
        raise ValueError(f"quantize_blockwise: block={block} must be >= 1")
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    nfull = n // block
    full = nfull * block
    nb = num_blocks(n, block)
    absmax = absmax_out if absmax_out is not None else torch.empty(nb, dtype=torch.float32, device=x.device)
    if absmax.numel() != nb:
        raise ValueError(f"quantize_blockwise: absmax_out has {absmax.numel()} entries, need {nb}")
    absmax = absmax.view(-1)
    normed = torch.empty(n, dtype=torch.float32, device=x.device)
    if nfull:
        body = flat[:full].view(nfull, block)
        torch.amax(body.abs(), dim=1, out=absmax[:nfull])
        scale = torch.where(absmax[:nfull] > 0, absmax[:nfull], torch.ones_like(absmax[:nfull]))
        torch.div(body, scale.unsqueeze(1), out=normed[:full].view(nfull, block))
    if n > full:
        tail = flat[full:]
        absmax[nfull] = tail.abs().amax()
        scale = absmax[nfull] if bool(absmax[nfull] > 0) else absmax.new_ones(())
        torch.div(tail, scale, out=normed[full:])
    normed.clamp_(-1.0, 1.0)
    idx = nearest_codes(normed, code)
    if codes_out is not None:
        if codes_out.numel() != n or codes_out.dtype != torch.uint8:
            raise ValueError("quantize_blockwise: codes_out must be uint8 with x's number of elements")
        codes_out.view(-1).copy_(idx)
        codes = codes_out
    else:
        codes = idx.to(torch.uint8).view(x.shape)
    return codes, absmax


def dequantize_blockwise(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor,
    block: int = 256,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: ``code[codes] * absmax[block of element]`` (float32)."""
    flat = codes.reshape(-1)
    n = flat.numel()
    nfull = n // block
    full = nfull * block
    if absmax.numel() != num_blocks(n, block):
        raise ValueError(
            f"dequantize_blockwise: {absmax.numel()} absmax entries for {n} codes in blocks of "
            f"{block}; expected {num_blocks(n, block)}"
        )
    res = out.view(-1) if out is not None else torch.empty(n, dtype=torch.float32, device=codes.device)
    values = code.index_select(0, flat.to(torch.int32))
    am = absmax.reshape(-1)
    if nfull:
        torch.mul(values[:full].view(nfull, block), am[:nfull].unsqueeze(1), out=res[:full].view(nfull, block))
    if n > full:
        torch.mul(values[full:], am[nfull], out=res[full:])
    return res.view(codes.shape) if out is None else out
