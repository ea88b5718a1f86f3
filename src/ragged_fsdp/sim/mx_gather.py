"""What one element of a low-precision linear's weight costs in an FSDP all-gather.

Pure arithmetic for ``simulate``: FSDP2 with torchao's tensorwise float8 all-gather moves 1
byte per element (one scale per tensor, negligible); ragged_fsdp's ``BlockFP8`` 1 byte plus
an fp32 scale per 128x128 tile; its ``MXFP8()`` 1 byte plus one E8M0 byte per 32 elements,
one plane per gather (the forward's and the backward re-gather's cost the same). torchao's
MXFP8 training recipe under FSDP2 gathers in ``param_dtype`` (its ``fsdp_pre_all_gather``
casts to it), so with ``--float8 mxfp8`` FSDP2's gather is priced at the compute dtype.
"""

from __future__ import annotations

__all__ = ["BLOCK_FP8_BYTES", "MXFP8_BYTES", "gather_itemsize"]

BLOCK_FP8_BYTES = 1 + 4 / (128 * 128)
MXFP8_BYTES = 1 + 1 / 32


def gather_itemsize(fw: str, float8_allgather: bool, mxfp8_allgather: bool) -> float | None:
    """Bytes per element of the quantised linears' weights in ``fw``'s all-gather, or None
    when they travel in the compute dtype."""
    if mxfp8_allgather:
        return MXFP8_BYTES if fw == "ragged" else None
    if float8_allgather:
        return 1.0 if fw == "fsdp2" else BLOCK_FP8_BYTES if fw == "ragged" else None
    return None
