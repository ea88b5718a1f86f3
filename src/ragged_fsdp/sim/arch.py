"""What the simulator needs to know about a model beyond its tensor shapes: flops per token,
activation bytes per token, which tensors are routed experts.

Built from the catalog's :class:`ModelShapes` (catalog ids or a Hugging Face config.json)
or from a live ``nn.Module`` (the reference models, for the measured checks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..models.catalog import ModelShapes, get_model

__all__ = ["Arch", "resolve_model", "arch_from_shapes", "check_arch"]


def _is_expert(name: str) -> bool:
    """Routed-expert weights (the shared expert and the router are dense)."""
    return ".experts." in name and "shared_expert" not in name


@dataclass
class Arch:
    name: str
    groups: list[tuple[str, list[tuple[str, tuple[int, ...]]]]]  # (group, [(tensor, shape)])
    layers: int
    hidden: int
    vocab: int
    heads: int
    qk_dim: int  # per head
    v_dim: int  # per head
    kv_dim: int  # K (and V) width per token (GQA: kv_heads * head_dim; MLA: latent + rope)
    inter: int  # dense MLP width (0 if every layer is MoE)
    moe_inter: int = 0
    experts: int = 0
    top_k: int = 0
    shared_inter: int = 0
    moe_layers: int = 0
    config: dict = field(default_factory=dict)

    # -- parameters -------------------------------------------------------------------
    @property
    def params(self) -> int:
        return sum(math.prod(s) for _, ts in self.groups for _, s in ts)

    @property
    def expert_params(self) -> int:
        return sum(math.prod(s) for _, ts in self.groups for n, s in ts if _is_expert(n))

    @property
    def active_params(self) -> int:
        """Parameters one token touches: everything but the routed experts, plus top_k/E of them
        (the embedding counts, as torchtitan's MFU does)."""
        frac = self.top_k / self.experts if self.experts else 1.0
        return self.params - self.expert_params + int(self.expert_params * frac)

    def flops_per_token(self, seq: int) -> float:
        """Training flops per token, forward + backward: 6 * active params (the embedding
        lookup is no matmul, so its params are left out) + attention 6 * L * H * T * (d_qk + d_v)
        (= torchtitan's 12 * L * H * Q * T when d_qk = d_v = Q; not halved for causality)."""
        embed = self.vocab * self.hidden
        return 6.0 * (self.active_params - embed) + 6.0 * self.layers * self.heads * seq * (self.qk_dim + self.v_dim)

    # -- activations --------------------------------------------------------------------
    def layer_act_elems(self, moe: bool) -> float:
        """Elements one transformer block saves for backward per token (no checkpointing):
        attention: two norm outputs and residual (3h), q (H*d_qk, also its RoPE'd copy), k
        and v (2*kv_dim, and RoPE'd k), attention output and o_proj input (2*H*d_v), softmax
        stats (H); MLP: gate, up, activation, product (4*inter); MoE: per routed token its
        input copy and output (2h) plus 4*moe_inter, the router's probabilities (E), and the
        shared expert (4*shared_inter)."""
        h, H = self.hidden, self.heads
        attn = 3 * h + 2 * H * self.qk_dim + 3 * self.kv_dim + 2 * H * self.v_dim + H
        if moe:
            mlp = self.top_k * (2 * h + 4 * self.moe_inter) + self.experts + 4 * self.shared_inter
        else:
            mlp = 4 * self.inter
        return float(attn + mlp)

    def act_elems_per_token(self) -> tuple[float, float]:
        """(sum over all blocks, the largest block) of saved elements per token."""
        dense = self.layers - self.moe_layers
        per = [self.layer_act_elems(False)] * dense + [self.layer_act_elems(True)] * self.moe_layers
        return sum(per), max(per) if per else 0.0


def arch_from_shapes(m: ModelShapes) -> Arch:
    c = m.config
    fam = c["family"]
    groups = [(g.name, [(t.name, tuple(t.shape)) for t in g.tensors]) for g in m.groups]
    common = dict(name=m.id, groups=groups, layers=c["layers"], hidden=c["hidden"], vocab=c["vocab"],
                  heads=c["heads"], config=dict(c))
    if fam == "deepseek":
        qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        moe_layers = c["layers"] - c["dense_layers"]
        return Arch(**common, qk_dim=qk, v_dim=c["v_head_dim"], kv_dim=c["kv_lora_rank"] + c["qk_rope_head_dim"],
                    inter=c["dense_intermediate"] if c["dense_layers"] else 0, moe_inter=c["moe_intermediate"],
                    experts=c["routed_experts"], top_k=c["experts_per_token"],
                    shared_inter=c["moe_intermediate"] * c["shared_experts"], moe_layers=moe_layers)
    kv = c["kv_heads"] * c["head_dim"]
    if fam == "llama":
        return Arch(**common, qk_dim=c["head_dim"], v_dim=c["head_dim"], kv_dim=kv, inter=c["intermediate"])
    if fam in ("gpt-oss", "mixtral"):
        return Arch(**common, qk_dim=c["head_dim"], v_dim=c["head_dim"], kv_dim=kv, inter=0,
                    moe_inter=c["intermediate"], experts=c["experts"], top_k=c["experts_per_token"],
                    moe_layers=c["layers"])
    if fam == "qwen3-moe":
        return Arch(**common, qk_dim=c["head_dim"], v_dim=c["head_dim"], kv_dim=kv, inter=0,
                    moe_inter=c["moe_intermediate"], experts=c["experts"], top_k=c["experts_per_token"],
                    moe_layers=c["layers"])
    raise ValueError(f"no architecture model for family {fam!r}")


def check_arch(a: Arch) -> Arch:
    """Sizes a step can be computed from: every count and tensor dim >= 1."""
    for f in ("layers", "hidden", "vocab", "heads", "qk_dim", "v_dim", "kv_dim"):
        v = getattr(a, f)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"--model {a.name}: {f} = {v!r} must be >= 1; fix the model's config")
    for g, ts in a.groups:
        for n, s in ts:
            if any(d < 1 for d in s):
                raise ValueError(f"--model {a.name}: tensor {n} has shape {tuple(s)} with a zero dim; "
                                 "fix the model's config (a size or count of 0)")
    return a


def resolve_model(spec: str) -> Arch:
    """A catalog id (``gpt-oss-120b``, ``deepseek-v3:fused``) or a path to a Hugging Face
    ``config.json`` (or the directory holding it)."""
    p = Path(spec)
    if spec.endswith(".json") or p.is_dir():
        from .hf_config import load_hf_config

        return check_arch(arch_from_shapes(load_hf_config(p)))
    return check_arch(arch_from_shapes(get_model(spec)))
