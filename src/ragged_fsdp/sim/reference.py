"""The simulator applied to the repository's reference models (``ragged_fsdp.models``), so
its memory model can be checked against real engines on gloo.

Groups are those of the bench's wrapping (one per transformer block, the root holds the
embedding, final norm and head). :func:`exact_rank_bytes` gives the sharded parameter,
gradient and optimizer-state bytes one rank holds, exactly, for ragged_fsdp (the planner's
segment) and torch FSDP2 (per-parameter ``Shard(0)``: storage padded to ``ceil(d0/W)`` rows;
AdamW's states are ``zeros_like`` of the unpadded local piece, plus one fp32 ``step`` scalar
per parameter).
"""

from __future__ import annotations

import math

from ..planner.granularity import TensorSpec
from ..planner.model import plan_model
from .arch import Arch
from .layout import group_layouts, is_embedding_weight
from .memory import MemoryInputs, MemoryResult, step_memory

__all__ = ["reference_arch", "exact_rank_bytes", "reference_memory"]


def reference_arch(model) -> Arch:
    """An :class:`Arch` for a reference ``Llama`` / ``MoE`` module (any device, meta works)."""
    cfg = model.cfg
    layers: dict[int, list] = {}
    root = []
    for name, p in model.named_parameters():
        parts = name.split(".")
        if parts[0] == "layers":
            layers.setdefault(int(parts[1]), []).append((name, tuple(p.shape)))
        else:
            root.append((name, tuple(p.shape)))
    groups = [("root", root)] + [(f"layers.{i}", layers[i]) for i in sorted(layers)]
    moe = hasattr(cfg, "n_experts")
    return Arch(name=type(model).__name__, groups=groups, layers=cfg.n_layers, hidden=cfg.dim,
                vocab=cfg.vocab_size, heads=cfg.n_heads, qk_dim=cfg.head_dim, v_dim=cfg.head_dim,
                kv_dim=cfg.kv_heads * cfg.head_dim, inter=0 if moe else cfg.hidden,
                moe_inter=getattr(cfg, "expert_hidden", 0), experts=getattr(cfg, "n_experts", 0),
                top_k=getattr(cfg, "top_k", 0), moe_layers=cfg.n_layers if moe else 0)


def _specs(tensors, itemsize=4):
    return [TensorSpec(n, s, itemsize) for n, s in tensors]


def exact_rank_bytes(framework: str, arch: Arch, world: int, rank: int, itemsize: int = 4,
                     align_bytes: int = 16) -> dict:
    """``{"params", "grads", "optimizer"}`` bytes on ``rank`` with foreach AdamW (fp32)."""
    params = states = 0
    n_tensors = 0
    if framework == "ragged":
        groups = []  # the engine plans embedding weights in a buffer of their own
        for g, t in arch.groups:
            emb = [x for x in t if is_embedding_weight(*x)]
            rest = [x for x in t if not is_embedding_weight(*x)]
            groups += [(g, rest)] if rest else []
            groups += [(g + "#embedding", emb)] if emb else []
        mp = plan_model([(g, _specs(t, itemsize)) for g, t in groups], world, align_bytes)
        for gi, (gname, tensors) in enumerate(groups):
            plan = mp.plan(gi)
            params += plan.segment * itemsize
            for name, shape in tensors:
                a, b = plan.local_range(name, rank)
                states += (b - a) * itemsize * 2
                n_tensors += 1
        grads = params
    elif framework == "fsdp2":
        for _, tensors in arch.groups:
            for name, shape in tensors:
                d0, row = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
                c = -(-d0 // world)
                params += c * row * itemsize
                local = max(0, min(c, d0 - rank * c)) * row
                states += local * itemsize * 2
                n_tensors += 1
        grads = params
    else:
        raise ValueError(f"exact bytes are known for ragged and fsdp2, not {framework!r}")
    return {"params": params, "grads": grads, "optimizer": states + 4 * n_tensors}


def reference_memory(framework: str, arch: Arch, world: int, batch: int, seq: int,
                     backend: str = "gloo", rank: int = 0) -> MemoryResult:
    """Predicted peak of one fp32 training step (forward, backward, foreach AdamW step) on
    one rank, with the bench's wrapping: blocks resharded after forward, the root kept."""
    L = group_layouts(arch.groups, framework, world, itemsize=4)
    tokens = batch * seq
    blocks = [sum(arch.layer_act_bytes(bool(arch.moe_layers), 4)) * tokens for _ in arch.groups[1:]]
    # root: embedding output (h) and final norm + its output (2h) per token
    act_saved = [3 * arch.hidden * tokens * 4] + blocks
    # fp32 logits, log-softmax and its gradient
    loss = 3 * tokens * arch.vocab * 4
    ex = exact_rank_bytes(framework, arch, world, rank)
    m = MemoryInputs(layouts=L, kept=set(), root=0, act_saved=act_saved, act_work=max(blocks, default=0),
                     loss_bytes=loss, pb=4, cb=4, rb=4, gb=4, backend=backend)
    res = step_memory(framework, m)
    # persistent terms exactly as the engines allocate them on this rank
    return _with_exact(res, ex)


def _with_exact(res: MemoryResult, ex: dict) -> MemoryResult:
    d_params = ex["params"] - res.sharded_params
    d_states = ex["optimizer"] - res.optimizer_states
    d_grads = ex["grads"] - res.sharded_grads
    phases = {}
    for k, v in res.phases.items():
        extra = d_params + d_states + (d_grads if k == "optimizer step" else 0)
        phases[k] = v + extra
    peak_phase = max(phases, key=phases.get)
    return MemoryResult(phases[peak_phase], peak_phase, res.items if peak_phase == res.peak_phase else {},
                        ex["params"], ex["grads"], ex["optimizer"], phases)
