"""Context parallelism: ring attention over ``cp`` ranks (torchtitan's CP with load-balanced
causal sharding).

Each rank keeps ``seq / cp`` tokens of every sequence; parameters are sharded over dp x cp.
In every attention layer the ranks pass K and V around the ring: ``cp - 1`` steps, each
sending the local K and V (``2 x kv_dim x seq/cp`` elements in the compute dtype) while the
attention of the previous chunk computes. Backward sends K, V and their gradients (fp32
accumulators: twice the bytes again). A step's transfer that is longer than its chunk of
attention is exposed. The ring stays on NVLink while the CP group fits in a node.
"""

from __future__ import annotations

from .comm import _bw_lat
from .profiles import GPUProfile

__all__ = ["ring_exposed"]


def ring_exposed(prof: GPUProfile, cp: int, stride: int, kv_dim: int, local_tokens: float, cb: int,
                 attn_fwd_s: float, recompute: bool) -> tuple[float, float]:
    """(exposed seconds, total transfer seconds) of one layer's ring, forward + backward."""
    if cp <= 1:
        return 0.0, 0.0
    bw, lat = _bw_lat(prof, cp, stride)
    step_lat = lat / max(1, cp - 1)
    kv_bytes = 2 * kv_dim * local_tokens * cb
    fwd_step = step_lat + kv_bytes / bw
    bwd_step = step_lat + (kv_bytes + 2 * kv_bytes * 4 / cb) / bw
    att_step = attn_fwd_s / cp
    passes_f = 2 if recompute else 1
    exposed = (cp - 1) * (passes_f * max(0.0, fwd_step - att_step) + max(0.0, bwd_step - 2.5 * att_step))
    total = (cp - 1) * (passes_f * fwd_step + bwd_step)
    return exposed, total
