"""Parameter shapes of public models, grouped the way FSDP wraps them.

Shapes only (no weights): enough to plan layouts and model memory at full scale. Facts come
from the models' published configurations; weights follow the PyTorch Linear convention
``(out_features, in_features)`` and Hugging Face parameter names.

Groups: ``embed`` (the token embedding), one ``layers.{i}`` group per transformer block, and
``head`` (final norm + LM head) -- the way a per-block ``fully_shard`` plus separate embedding
and output wrapping splits a model.

Variants of the MoE models (``get_model(id, variant=...)`` or the id ``"<id>:<variant>"``):

* ``fused``: the experts of a layer stored as 3-D tensors, experts first. For gpt-oss this
  is the reference layout: ``gate_up_proj (E, hidden, 2*intermediate)`` + bias
  ``(E, 2*intermediate)``, ``down_proj (E, intermediate, hidden)`` + bias ``(E, hidden)``.
  For deepseek-v3 and qwen3 it is the grouped-GEMM layout with stacked Linear weights
  ``gate_proj/up_proj (E, inter, hidden)``, ``down_proj (E, hidden, inter)``.
* ``separate``: one module per expert with 2-D Linear weights -- the reference layout of
  deepseek-v3 and qwen3; for gpt-oss each expert gets ``gate_up_proj (2*inter, hidden)``
  + bias and ``down_proj (hidden, inter)`` + bias.

The default variant is the reference implementation's layout (``fused`` for gpt-oss,
``separate`` for deepseek-v3 and qwen3-30b-a3b). DeepSeek-V3's multi-token-prediction layer is
left out.

Each tensor also says how tensor and expert parallelism split it (``ragged_fsdp.models.parallel``
turns that into TP-/EP-local shapes): ``tp_dim`` is the dim the standard Llama/torchtitan TP
plan splits (ColwiseParallel: q/k/v, gate/up, shared experts' gate/up, LM head -> dim 0;
RowwiseParallel: attention output, down -> dim 1; the token embedding, RowwiseParallel on an
``nn.Embedding`` -> dim 0), ``tp_field`` the config field that dim counts (the split must
divide it: ``heads``, not ``heads * head_dim``, since a head is never split), and ``expert``
marks routed-expert weights (-1: all experts stacked on dim 0; ``j``: expert ``j``'s own weight).
Norms, routers and low-rank MLA projections are replicated over TP (``tp_dim=None``); routed
experts are not tensor-parallel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from ..planner.granularity import Granularity, TensorSpec

__all__ = [
    "Tensor", "Group", "ModelShapes", "MODEL_CONFIGS", "STACKED", "get_model", "list_models",
    "model_specs", "group_specs", "model_from_config",
]


STACKED = -1  # Tensor.expert of a 3-D (experts-first) tensor holding every routed expert


class Tensor(NamedTuple):
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None = None  # dim split by tensor parallelism; None: whole on every TP rank
    tp_field: str | None = None  # config field counted by that dim; tp must divide it
    expert: int | None = None  # routed expert: STACKED, or the expert's index; None: dense

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Group:
    name: str
    tensors: list[Tensor]

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)


@dataclass(frozen=True)
class ModelShapes:
    id: str  # e.g. "gpt-oss-120b:separate"
    base: str  # e.g. "gpt-oss-120b"
    variant: str | None
    config: dict
    groups: list[Group]

    @property
    def num_params(self) -> int:
        return sum(g.numel for g in self.groups)

    @property
    def num_tensors(self) -> int:
        return sum(len(g.tensors) for g in self.groups)


# Published configuration facts (see each model's config.json / technical report).
MODEL_CONFIGS: dict[str, dict] = {
    "llama3-8b": dict(family="llama", vocab=128256, hidden=4096, intermediate=14336, layers=32,
                      heads=32, kv_heads=8, head_dim=128),
    "llama3-70b": dict(family="llama", vocab=128256, hidden=8192, intermediate=28672, layers=80,
                       heads=64, kv_heads=8, head_dim=128),
    "llama3-405b": dict(family="llama", vocab=128256, hidden=16384, intermediate=53248, layers=126,
                        heads=128, kv_heads=8, head_dim=128),
    "gpt-oss-20b": dict(family="gpt-oss", vocab=201088, hidden=2880, intermediate=2880, layers=24,
                        heads=64, kv_heads=8, head_dim=64, experts=32, experts_per_token=4),
    "gpt-oss-120b": dict(family="gpt-oss", vocab=201088, hidden=2880, intermediate=2880, layers=36,
                         heads=64, kv_heads=8, head_dim=64, experts=128, experts_per_token=4),
    "deepseek-v3": dict(family="deepseek", vocab=129280, hidden=7168, layers=61, dense_layers=3,
                        dense_intermediate=18432, moe_intermediate=2048, routed_experts=256,
                        shared_experts=1, experts_per_token=8, heads=128, q_lora_rank=1536,
                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128),
    # Kimi-K2 (Moonshot AI, public config.json): DeepSeek-V3's architecture with 384 routed
    # experts, 64 heads and one dense layer.
    "kimi-k2": dict(family="deepseek", vocab=163840, hidden=7168, layers=61, dense_layers=1,
                    dense_intermediate=18432, moe_intermediate=2048, routed_experts=384,
                    shared_experts=1, experts_per_token=8, heads=64, q_lora_rank=1536,
                    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                    v_head_dim=128),
    "qwen3-30b-a3b": dict(family="qwen3-moe", vocab=151936, hidden=2048, layers=48, heads=32,
                          kv_heads=4, head_dim=128, experts=128, experts_per_token=8,
                          moe_intermediate=768),
    # Qwen/Qwen3-235B-A22B config.json
    "qwen3-235b-a22b": dict(family="qwen3-moe", vocab=151936, hidden=4096, layers=94, heads=64,
                            kv_heads=4, head_dim=128, experts=128, experts_per_token=8,
                            moe_intermediate=1536),
    # meta-llama/Llama-4-Scout-17B-16E and -Maverick-17B-128E config.json (text_config): one
    # routed expert per token plus a shared expert of the same size; Maverick alternates
    # dense (intermediate_size_mlp) and MoE layers (interleave_moe_layer_step 2)
    "llama4-scout": dict(family="llama4", vocab=202048, hidden=5120, layers=48, heads=40, kv_heads=8,
                         head_dim=128, intermediate=8192, dense_intermediate=16384, experts=16,
                         experts_per_token=1, moe_step=1),
    "llama4-maverick": dict(family="llama4", vocab=202048, hidden=5120, layers=48, heads=40, kv_heads=8,
                            head_dim=128, intermediate=8192, dense_intermediate=16384, experts=128,
                            experts_per_token=1, moe_step=2),
}

_VARIANTS = {"gpt-oss": ("fused", "separate"), "deepseek": ("separate", "fused"),
             "qwen3-moe": ("separate", "fused"), "mixtral": ("separate", "fused"), "llama4": ("fused", "separate")}
# first = the reference layout (default)


def list_models(include_variants: bool = False) -> list[str]:
    """Model ids; with ``include_variants`` also ``"<id>:<variant>"`` for each non-default
    variant of the MoE models."""
    out = []
    for mid, cfg in MODEL_CONFIGS.items():
        out.append(mid)
        if include_variants:
            out += [f"{mid}:{v}" for v in _VARIANTS.get(cfg["family"], ())[1:]]
    return out


def get_model(model_id: str, variant: str | None = None) -> ModelShapes:
    """Shapes of ``model_id`` (``"<id>"`` or ``"<id>:<variant>"``)."""
    base, _, suffix = model_id.partition(":")
    if suffix:
        if variant is not None and variant != suffix:
            raise ValueError(f"model {model_id!r} names variant {suffix!r} but variant={variant!r} was given")
        variant = suffix
    if base not in MODEL_CONFIGS:
        raise ValueError(f"unknown model {base!r}; known: {', '.join(list_models(True))}")
    return model_from_config(base, MODEL_CONFIGS[base], variant)


def model_from_config(base: str, cfg: dict, variant: str | None = None) -> ModelShapes:
    """Shapes of a model described by a catalog-style config dict (``family`` plus the
    family's fields, as in :data:`MODEL_CONFIGS`); used for catalog ids and for Hugging
    Face ``config.json`` files translated by ``ragged_fsdp.sim.hf_config``."""
    if cfg.get("family") not in _LAYERS:
        raise ValueError(f"model {base!r}: family {cfg.get('family')!r} is not one of {sorted(_LAYERS)}")
    variants = _VARIANTS.get(cfg["family"], ())
    if variant is not None and variant not in variants:
        raise ValueError(
            f"model {base!r} has no variant {variant!r}; "
            + (f"variants: {', '.join(variants)}" if variants else "it is dense (no variants)")
        )
    variant = variant or (variants[0] if variants else None)
    layer_fn = _LAYERS[cfg["family"]]
    groups = [Group("embed", [_col("model.embed_tokens.weight", (cfg["vocab"], cfg["hidden"]), "vocab")])]
    groups += [Group(f"layers.{i}", layer_fn(cfg, i, variant)) for i in range(cfg["layers"])]
    head = [Tensor("model.norm.weight", (cfg["hidden"],))]
    if not cfg.get("tied_embeddings"):  # tied: the head reuses the embedding's weight
        head.append(_col("lm_head.weight", (cfg["vocab"], cfg["hidden"]), "vocab"))
    groups.append(Group("head", head))
    mid = base if variant in (None, variants[0] if variants else None) else f"{base}:{variant}"
    return ModelShapes(mid, base, variant, dict(cfg), groups)


# -- per-family transformer blocks ---------------------------------------------------------
def _col(name: str, shape: tuple, field: str) -> Tensor:
    """A tensor TP splits on dim 0 (ColwiseParallel weight or bias; the embedding's rows)."""
    return Tensor(name, shape, 0, field)


def _row(name: str, shape: tuple, field: str) -> Tensor:
    """A RowwiseParallel weight: TP splits its input dim (its bias, if any, stays whole)."""
    return Tensor(name, shape, 1, field)


def _expert(name: str, shape: tuple, index: int = STACKED) -> Tensor:
    return Tensor(name, shape, None, None, index)


def _llama_layer(c: dict, i: int, variant):
    p, h, q, kv, inter = f"model.layers.{i}.", c["hidden"], c["heads"] * c["head_dim"], \
        c["kv_heads"] * c["head_dim"], c["intermediate"]
    return [
        _col(p + "self_attn.q_proj.weight", (q, h), "heads"),
        _col(p + "self_attn.k_proj.weight", (kv, h), "kv_heads"),
        _col(p + "self_attn.v_proj.weight", (kv, h), "kv_heads"),
        _row(p + "self_attn.o_proj.weight", (h, q), "heads"),
        *_mlp(p + "mlp.", inter, h, "intermediate"),
        Tensor(p + "input_layernorm.weight", (h,)),
        Tensor(p + "post_attention_layernorm.weight", (h,)),
    ]


def _gpt_oss_layer(c: dict, i: int, variant):
    p, h, q, kv, inter, E = f"model.layers.{i}.", c["hidden"], c["heads"] * c["head_dim"], \
        c["kv_heads"] * c["head_dim"], c["intermediate"], c["experts"]
    out = [
        _col(p + "self_attn.q_proj.weight", (q, h), "heads"), _col(p + "self_attn.q_proj.bias", (q,), "heads"),
        _col(p + "self_attn.k_proj.weight", (kv, h), "kv_heads"), _col(p + "self_attn.k_proj.bias", (kv,), "kv_heads"),
        _col(p + "self_attn.v_proj.weight", (kv, h), "kv_heads"), _col(p + "self_attn.v_proj.bias", (kv,), "kv_heads"),
        _row(p + "self_attn.o_proj.weight", (h, q), "heads"), Tensor(p + "self_attn.o_proj.bias", (h,)),
        _col(p + "self_attn.sinks", (c["heads"],), "heads"),  # one per head: follows the local heads
        Tensor(p + "mlp.router.weight", (E, h)), Tensor(p + "mlp.router.bias", (E,)),
    ]
    x = p + "mlp.experts."
    if variant == "fused":
        out += [
            _expert(x + "gate_up_proj", (E, h, 2 * inter)), _expert(x + "gate_up_proj_bias", (E, 2 * inter)),
            _expert(x + "down_proj", (E, inter, h)), _expert(x + "down_proj_bias", (E, h)),
        ]
    else:
        for j in range(E):
            out += [
                _expert(f"{x}{j}.gate_up_proj.weight", (2 * inter, h), j),
                _expert(f"{x}{j}.gate_up_proj.bias", (2 * inter,), j),
                _expert(f"{x}{j}.down_proj.weight", (h, inter), j), _expert(f"{x}{j}.down_proj.bias", (h,), j),
            ]
    out += [Tensor(p + "input_layernorm.weight", (h,)), Tensor(p + "post_attention_layernorm.weight", (h,))]
    return out


def _mlp(prefix: str, inter: int, h: int, field: str) -> list[Tensor]:
    """A dense SwiGLU MLP: gate/up ColwiseParallel, down RowwiseParallel."""
    return [_col(prefix + "gate_proj.weight", (inter, h), field), _col(prefix + "up_proj.weight", (inter, h), field),
            _row(prefix + "down_proj.weight", (h, inter), field)]


def _experts(prefix: str, E: int, inter: int, h: int, variant) -> list[Tensor]:
    if variant == "fused":  # stacked Linear weights, experts first
        return [_expert(prefix + "gate_proj.weight", (E, inter, h)), _expert(prefix + "up_proj.weight", (E, inter, h)),
                _expert(prefix + "down_proj.weight", (E, h, inter))]
    out = []
    for j in range(E):
        out += [_expert(f"{prefix}{j}.gate_proj.weight", (inter, h), j),
                _expert(f"{prefix}{j}.up_proj.weight", (inter, h), j),
                _expert(f"{prefix}{j}.down_proj.weight", (h, inter), j)]
    return out


def _deepseek_layer(c: dict, i: int, variant):
    p, h, H = f"model.layers.{i}.", c["hidden"], c["heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    a = p + "self_attn."
    out = [
        Tensor(a + "q_a_proj.weight", (c["q_lora_rank"], h)),
        Tensor(a + "q_a_layernorm.weight", (c["q_lora_rank"],)),
        _col(a + "q_b_proj.weight", (H * qk, c["q_lora_rank"]), "heads"),
        Tensor(a + "kv_a_proj_with_mqa.weight", (c["kv_lora_rank"] + c["qk_rope_head_dim"], h)),
        Tensor(a + "kv_a_layernorm.weight", (c["kv_lora_rank"],)),
        _col(a + "kv_b_proj.weight", (H * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]), "heads"),
        _row(a + "o_proj.weight", (h, H * c["v_head_dim"]), "heads"),
    ]
    if i < c["dense_layers"]:
        out += _mlp(p + "mlp.", c["dense_intermediate"], h, "dense_intermediate")
    else:
        E, inter = c["routed_experts"], c["moe_intermediate"]
        out += [Tensor(p + "mlp.gate.weight", (E, h)), Tensor(p + "mlp.gate.e_score_correction_bias", (E,))]
        out += _experts(p + "mlp.experts.", E, inter, h, variant)
        out += _mlp(p + "mlp.shared_experts.", inter * c["shared_experts"], h, "moe_intermediate")
    out += [Tensor(p + "input_layernorm.weight", (h,)), Tensor(p + "post_attention_layernorm.weight", (h,))]
    return out


def _qwen3_moe_layer(c: dict, i: int, variant):
    p, h, q, kv, E = f"model.layers.{i}.", c["hidden"], c["heads"] * c["head_dim"], \
        c["kv_heads"] * c["head_dim"], c["experts"]
    a = p + "self_attn."
    out = [
        _col(a + "q_proj.weight", (q, h), "heads"), _col(a + "k_proj.weight", (kv, h), "kv_heads"),
        _col(a + "v_proj.weight", (kv, h), "kv_heads"), _row(a + "o_proj.weight", (h, q), "heads"),
        Tensor(a + "q_norm.weight", (c["head_dim"],)), Tensor(a + "k_norm.weight", (c["head_dim"],)),
        Tensor(p + "mlp.gate.weight", (E, h)),
    ]
    out += _experts(p + "mlp.experts.", E, c["moe_intermediate"], h, variant)
    out += [Tensor(p + "input_layernorm.weight", (h,)), Tensor(p + "post_attention_layernorm.weight", (h,))]
    return out


def _mixtral_layer(c: dict, i: int, variant):
    """Mixtral: the LLaMA attention with a routed SwiGLU MoE (``w1``/``w3`` in, ``w2`` out)."""
    p, h, q, kv, E, inter = f"model.layers.{i}.", c["hidden"], c["heads"] * c["head_dim"], \
        c["kv_heads"] * c["head_dim"], c["experts"], c["intermediate"]
    a, x = p + "self_attn.", p + "block_sparse_moe."
    out = [_col(a + "q_proj.weight", (q, h), "heads"), _col(a + "k_proj.weight", (kv, h), "kv_heads"),
           _col(a + "v_proj.weight", (kv, h), "kv_heads"), _row(a + "o_proj.weight", (h, q), "heads"),
           Tensor(x + "gate.weight", (E, h))]
    if variant == "fused":
        out += [_expert(x + "experts.w1", (E, inter, h)), _expert(x + "experts.w3", (E, inter, h)),
                _expert(x + "experts.w2", (E, h, inter))]
    else:
        for j in range(E):
            out += [_expert(f"{x}experts.{j}.w1.weight", (inter, h), j),
                    _expert(f"{x}experts.{j}.w2.weight", (h, inter), j),
                    _expert(f"{x}experts.{j}.w3.weight", (inter, h), j)]
    out += [Tensor(p + "input_layernorm.weight", (h,)), Tensor(p + "post_attention_layernorm.weight", (h,))]
    return out


def llama4_is_moe(c: dict, i: int) -> bool:
    """Hugging Face's Llama 4 rule: layers step-1, 2*step-1, ... are MoE."""
    return i % c["moe_step"] == c["moe_step"] - 1


def _llama4_layer(c: dict, i: int, variant):
    p, h, q, kv = f"model.layers.{i}.", c["hidden"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    a, f = p + "self_attn.", p + "feed_forward."
    out = [_col(a + "q_proj.weight", (q, h), "heads"), _col(a + "k_proj.weight", (kv, h), "kv_heads"),
           _col(a + "v_proj.weight", (kv, h), "kv_heads"), _row(a + "o_proj.weight", (h, q), "heads")]
    if llama4_is_moe(c, i):
        E, inter = c["experts"], c["intermediate"]
        out.append(Tensor(f + "router.weight", (E, h)))
        if variant == "fused":
            out += [_expert(f + "experts.gate_up_proj", (E, h, 2 * inter)), _expert(f + "experts.down_proj", (E, inter, h))]
        else:
            out += _experts(f + "experts.", E, inter, h, variant)
        out += _mlp(f + "shared_expert.", inter, h, "intermediate")
    else:
        out += _mlp(f, c["dense_intermediate"], h, "dense_intermediate")
    out += [Tensor(p + "input_layernorm.weight", (h,)), Tensor(p + "post_attention_layernorm.weight", (h,))]
    return out


_LAYERS: dict[str, Callable] = {"llama4": _llama4_layer, "llama": _llama_layer, "gpt-oss": _gpt_oss_layer,
                                "deepseek": _deepseek_layer, "qwen3-moe": _qwen3_moe_layer,
                                "mixtral": _mixtral_layer}


# -- to planner specs ------------------------------------------------------------------
def group_specs(group: Group, granularity=None, granularity_1d=None, itemsize: int = 4) -> list[TensorSpec]:
    """TensorSpecs of one group: ``granularity`` for tensors with >= 2 dims, ``granularity_1d``
    (default element) for vectors and scalars."""
    g2 = Granularity.parse(granularity)
    g1 = Granularity.parse(granularity_1d)
    return [TensorSpec(t.name, t.shape, itemsize, g2 if len(t.shape) >= 2 else g1) for t in group.tensors]


def model_specs(model: ModelShapes | str, granularity=None, granularity_1d=None,
                itemsize: int = 4) -> list[tuple[str, list[TensorSpec]]]:
    """``(group name, specs)`` for every group of the model, in model order."""
    if isinstance(model, str):
        model = get_model(model)
    return [(g.name, group_specs(g, granularity, granularity_1d, itemsize)) for g in model.groups]
