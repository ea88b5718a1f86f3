"""Compute time of one group for one microbatch on one rank, split by kind of work.

Forward flops of a group, per rank (TP splits every matmul ``tp`` ways, CP splits the tokens
``cp`` ways):

- block linears: ``2 x weight elements x tokens`` (routed experts weighted by top_k / E);
  these are what float8 accelerates;
- the output head (and a MoE router): the same formula, kept in bf16 (torchtitan's float8
  converter skips ``output``);
- attention: causal, so ``seq x heads x (d_qk + d_v)`` per token and layer (half of the
  non-causal ``2 x``); with CP the full causal attention of the sequence is split evenly
  (torchtitan's load-balanced ring).

Rates: the matmuls run at ``peak x efficiency`` (x the float8 speed-up for block linears),
attention at that rate x ``ATTENTION_RATE``; ``compile`` divides the non-attention part by
``COMPILE_SPEEDUP``. Backward costs 2 x the forward for matmuls, 2.5 x for flash attention
(it recomputes the scores). Recomputation: ``full`` reruns the whole forward; ``selective``
(torchtitan's per-layer SAC, every 2nd block) half of it on average; ``op`` (torchtitan's
per-op SAC: matmul outputs alternately saved and recomputed in each block, attention saved)
reruns every second linear of a block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .arch import Arch
from . import fitted
from .options import Recipe
from .profiles import GPUProfile

__all__ = ["GroupFlops", "group_flops", "op_sac", "compute_times", "is_fp8_linear"]


def _is_routed(name: str) -> bool:
    return ".experts." in name and "shared_expert" not in name


def is_fp8_linear(name: str, shape) -> bool:
    """A weight torchtitan's float8 converter turns into a float8 linear: a block's >= 2-D
    weight other than the router (``output`` / the head and the embedding stay bf16)."""
    return (len(shape) >= 2 and ".layers." in f".{name}" and "router" not in name and "mlp.gate.weight" not in name
            and "embed" not in name)


@dataclass
class GroupFlops:
    fp8able: float  # forward flops of linears float8 applies to
    other_mm: float  # forward flops of the other matmuls (head, router)
    attention: float  # forward attention flops (causal)
    op_recompute_mm: float = 0.0  # forward flops per-op SAC reruns in backward


def op_sac(tensors, top_k_frac: float) -> tuple[float, float, float]:
    """(saved output elements per token, recomputed weight elements, all weight elements) of
    torchtitan's per-op policy on one block: its matmuls in forward order, every second one's
    output recomputed (1st, 3rd, ... saved). Vectors are no matmuls."""
    saved = recomputed = total = 0.0
    k = 0
    for n, s in tensors:
        if len(s) < 2 or "embed" in n:
            continue
        frac = top_k_frac if _is_routed(n) else 1.0
        experts = s[0] if len(s) == 3 else 1
        out_dim = s[-2]
        el = math.prod(s) * frac
        total += el
        k += 1
        if k % 2 == 0:
            recomputed += el
        else:
            saved += out_dim * (experts * frac if len(s) == 3 else 1)
    return saved, recomputed, total


def group_flops(arch: Arch, name: str, tensors, tokens: float, seq: int, cp: int) -> GroupFlops:
    """Forward flops of one group for ``tokens`` tokens on this rank (full tensors, before TP)."""
    frac = arch.top_k / arch.experts if arch.experts else 1.0
    fp8 = other = 0.0
    for n, s in tensors:
        if len(s) < 2 or "embed" in n:
            continue
        el = math.prod(s) * (frac if _is_routed(n) else 1.0)
        if is_fp8_linear(n, s):
            fp8 += 2.0 * el * tokens
        else:
            other += 2.0 * el * tokens
    attn = 0.0
    if name.startswith("layers") and not name.endswith(".experts"):
        # causal: each token attends to seq/2 keys on average; CP splits the tokens, not the keys
        attn = arch.heads * seq * (arch.qk_dim + arch.v_dim) * tokens
    _, rec, tot = op_sac(tensors, frac)
    op_rec = (fp8 + other) * (rec / tot) if tot else 0.0
    return GroupFlops(fp8, other, attn, op_rec)


def compute_times(gf: GroupFlops, prof: GPUProfile, recipe: Recipe, act_ckpt: str, tp: int,
                  fp32: bool = False) -> tuple[float, float]:
    """(forward seconds, backward seconds incl. recomputation) of one group on one rank."""
    rate = ((prof.fp32_flops or prof.flops) if fp32 and prof.fp32_flops else prof.flops) * prof.efficiency
    c = fitted.COMPILE_SPEEDUP if recipe.compile else 1.0
    s8 = fitted.FLOAT8_SPEEDUP[recipe.float8] if recipe.float8 else 1.0
    mm = (gf.fp8able / s8 + gf.other_mm) / tp / rate / c
    att = gf.attention / tp / (rate * fitted.ATTENTION_RATE)
    fwd = mm + att
    bwd = 2 * mm + 2.5 * att
    if act_ckpt == "full":
        bwd += fwd
    elif act_ckpt == "selective":
        bwd += 0.5 * fwd
    elif act_ckpt == "op":
        tot = gf.fp8able + gf.other_mm
        bwd += mm * (gf.op_recompute_mm / tot if tot else 0.0)
    return fwd, bwd
