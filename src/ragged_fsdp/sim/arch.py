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
    def layer_act_bytes(self, moe: bool, cb: int, compiled: bool = False) -> tuple[float, float]:
        """(split, gathered) bytes one transformer block saves for backward per token with no
        checkpointing, in compute dtype ``cb``; under TP with sequence parallelism the first
        part divides by ``tp`` and the second does not.

        What autograd keeps in a Llama block (``tests/test_sim_activations.py`` checks it
        against MemTracker on the reference block, alone and under TP 2 + SP): each RMSNorm
        its input upcast to fp32, the normalised result in the compute dtype and the fp32
        1/rms (torchtitan's own RMSNorm through December 2024 and Hugging Face's do this;
        ``nn.RMSNorm``'s composite, torchtitan's block in 2025, keeps a second fp32 copy
        instead of the compute-dtype one: measured on torchtitan 820504e's block, not
        modelled); SDPA q, the expanded k and v (``repeat_kv``: every head), its output
        (the o projection's input, the same storage) and the fp32 log-sum-exp; SwiGLU gate,
        up, the activation and their product. MoE layers (counted, not measured): per routed
        token its input copy and output (2h) and 4*moe_inter, the router's probabilities
        (E), the shared expert 4*shared_inter. Gathered: the two norm outputs, which under SP
        are all-gathered over the sequence before the column-parallel linears that save them.

        ``compiled`` (the block under ``torch.compile``; measured on CPU inductor): the
        partitioner keeps each norm's input in the compute dtype and its 1/rms and recomputes
        the fp32 copies, and recomputes SwiGLU's activation from the saved gate."""
        h, H = self.hidden, self.heads
        norms = 2 * (h * (cb if compiled else 4 + cb) + 4)  # two norms, each with its fp32 1/rms per token
        attn = (2 * H * self.qk_dim + 2 * H * self.v_dim) * cb + 4 * H
        if moe:
            mlp = (self.top_k * (2 * h + 4 * self.moe_inter) + self.experts + 4 * self.shared_inter) * cb
        else:
            mlp = (3 if compiled else 4) * self.inter * cb
        return float(norms + attn + mlp), float(2 * h * cb)


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
    if fam == "llama4":
        return Arch(**common, qk_dim=c["head_dim"], v_dim=c["head_dim"], kv_dim=kv, inter=c["dense_intermediate"],
                    moe_inter=c["intermediate"], experts=c["experts"], top_k=c["experts_per_token"],
                    shared_inter=c["intermediate"], moe_layers=c["layers"] // c["moe_step"])
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
