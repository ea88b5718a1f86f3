"""Achieved GEMM rate by shape: a roofline with saturation.

A GEMM of ``m x k`` by ``k x n`` on one GPU runs at
``peak(dtype) * efficiency[gpu] * s(m) * s(n) * s(k)`` flop/s, but never faster than its
bytes allow at ``mem_bw`` (the memory roof, costed in :mod:`.compute`). ``s(d) = d / (d +
D_HALF)`` is the saturation of one dim: a dim of ``D_HALF`` elements reaches half the rate,
a dim of 16 x ``D_HALF`` 94%. It stands for what the kernel cannot fill (tile
quantisation, too few tiles for the SMs) when a dim is small: the per-expert batch of a
grouped GEMM, TP-split k/v projections, small per-GPU batches.

Calibrated: ``efficiency[gpu]`` (:mod:`.fitted`, one point per GPU family). Not calibrated:
``D_HALF``, a 64-element dim, a quarter of Hopper's and Blackwell's usual 128 x 256 output
tile (an assumption; at the shapes of the published points every dim is >= 512 except the
TP-split k/v projections, so it moves no validation point by more than a few percent).
Cross-check, not a fit: torchao's grouped-GEMM microbenchmark on B200 (bf16 ``_grouped_mm``
forward + backward, ``(M, N, K) = (128000, 8192, 5120)``: 43.1 ms, 0.75 PFLOP/s, 33% of the
2.25 PFLOP/s dense peak; ``(128000, 2048, 7168)``: 13.1 ms, 38%), pytorch/ao
``torchao/prototype/moe_training/README.md`` at 36027d82.
"""

from __future__ import annotations

__all__ = ["D_HALF", "saturation", "shape_factor"]

D_HALF = 64.0


def saturation(d: float) -> float:
    return d / (d + D_HALF) if d > 0 else 0.0


def shape_factor(m: float, n: float, k: float) -> float:
    """The fraction of the GPU's large-GEMM rate a GEMM of this shape reaches (0, 1]."""
    return saturation(m) * saturation(n) * saturation(k)
