"""Translate a Hugging Face ``config.json`` into the catalog's config form.

Families: Llama (and Mistral), Llama 4 (Scout, Maverick), Mixtral, Qwen3-MoE, GPT-OSS,
DeepSeek-V3 (and Kimi-K2, which ships the DeepSeek-V3 architecture). The field names are those of the ``transformers``
config classes of these models.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..models.catalog import ModelShapes, model_from_config

__all__ = ["load_hf_config", "hf_to_catalog"]


def _get(c: dict, *keys, default=None, minimum: int = 1):
    """The first present key's value, a whole number >= ``minimum`` (sizes, counts)."""
    for k in keys:
        if k in c and c[k] is not None:
            v = c[k]
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise ValueError(f"config.json: {k} = {v!r} must be an integer >= {minimum}; fix the config")
            return v
    if default is not None:
        return default
    raise ValueError(f"config.json has none of {keys}; cannot describe this model")


def hf_to_catalog(c: dict) -> dict:
    if not isinstance(c, dict):
        raise ValueError(f"config.json must be a JSON object (a Hugging Face config), got a {type(c).__name__}")
    mt = str(c.get("model_type", "")).lower()
    archs = " ".join(c.get("architectures") or []).lower()
    h, heads = _get(c, "hidden_size"), _get(c, "num_attention_heads")
    base = dict(vocab=_get(c, "vocab_size"), hidden=h, layers=_get(c, "num_hidden_layers"), heads=heads,
                tied_embeddings=bool(c.get("tie_word_embeddings", False)))
    head_dim = _get(c, "head_dim") if c.get("head_dim") is not None else h // heads
    if head_dim < 1:
        raise ValueError(f"config.json: hidden_size {h} / num_attention_heads {heads} gives head_dim 0; set head_dim")
    kv = _get(c, "num_key_value_heads", default=heads)
    if mt in ("deepseek_v3", "kimi_k2", "deepseek_v2") or "deepseek" in archs:
        return dict(base, family="deepseek", dense_layers=_get(c, "first_k_dense_replace", default=0, minimum=0) if c.get("first_k_dense_replace") else 0,
                    dense_intermediate=_get(c, "intermediate_size"),
                    moe_intermediate=_get(c, "moe_intermediate_size"),
                    routed_experts=_get(c, "n_routed_experts"), shared_experts=_get(c, "n_shared_experts", minimum=0) if c.get("n_shared_experts") else 0,
                    experts_per_token=_get(c, "num_experts_per_tok"), q_lora_rank=_get(c, "q_lora_rank"),
                    kv_lora_rank=_get(c, "kv_lora_rank"), qk_nope_head_dim=_get(c, "qk_nope_head_dim"),
                    qk_rope_head_dim=_get(c, "qk_rope_head_dim"), v_head_dim=_get(c, "v_head_dim"))
    if mt == "gpt_oss" or "gptoss" in archs:
        return dict(base, family="gpt-oss", intermediate=_get(c, "intermediate_size"), kv_heads=kv,
                    head_dim=head_dim, experts=_get(c, "num_local_experts", "num_experts"),
                    experts_per_token=_get(c, "num_experts_per_tok", "experts_per_token"))
    if mt in ("llama4", "llama4_text") or "llama4" in archs:
        return dict(base, family="llama4", kv_heads=kv, head_dim=head_dim, intermediate=_get(c, "intermediate_size"),
                    dense_intermediate=_get(c, "intermediate_size_mlp"), experts=_get(c, "num_local_experts"),
                    experts_per_token=_get(c, "num_experts_per_tok"),
                    moe_step=_get(c, "interleave_moe_layer_step", default=1))
    if mt == "qwen3_moe" or "qwen3moe" in archs:
        return dict(base, family="qwen3-moe", kv_heads=kv, head_dim=head_dim, experts=_get(c, "num_experts"),
                    experts_per_token=_get(c, "num_experts_per_tok"),
                    moe_intermediate=_get(c, "moe_intermediate_size"))
    if mt == "mixtral" or "mixtral" in archs:
        return dict(base, family="mixtral", kv_heads=kv, head_dim=head_dim, intermediate=_get(c, "intermediate_size"),
                    experts=_get(c, "num_local_experts"), experts_per_token=_get(c, "num_experts_per_tok"))
    # dense Qwen3 is Llama-shaped (its q/k RMSNorm weights are head_dim vectors, left out)
    if mt in ("llama", "mistral", "qwen3") or "llama" in archs or "mistral" in archs:
        return dict(base, family="llama", kv_heads=kv, head_dim=head_dim, intermediate=_get(c, "intermediate_size"))
    raise ValueError(f"config.json model_type {mt!r} is not supported; supported families: Llama/Mistral/Qwen3, "
                     "Llama 4, Mixtral, Qwen3-MoE, GPT-OSS, DeepSeek-V3/Kimi-K2")


def load_hf_config(path: str | Path, variant: str | None = None) -> ModelShapes:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        raw = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--model {path}: cannot read a config.json there ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"--model {path}: config.json must be a JSON object (a Hugging Face config), "
                         f"got a {type(raw).__name__}")
    cfg = hf_to_catalog(raw.get("text_config", raw) if "hidden_size" not in raw else raw)
    return model_from_config(p.parent.name or p.stem, cfg, variant)
