"""The model catalog: shapes, parameter counts, groups, variants, specs."""

import math

import pytest

from ragged_fsdp.models import get_model, group_specs, list_models, model_specs
from ragged_fsdp.planner import Granularity


@pytest.mark.parametrize("model, billions", [
    ("llama3-8b", 8.03), ("llama3-70b", 70.6), ("llama3-405b", 405.9), ("gpt-oss-20b", 20.9),
    ("gpt-oss-120b", 116.8), ("deepseek-v3", 671.0), ("qwen3-30b-a3b", 30.5), ("qwen3-235b-a22b", 235.1),
    ("llama4-maverick", 400.7),
])
def test_parameter_counts(model, billions):
    m = get_model(model)
    assert m.num_params / 1e9 == pytest.approx(billions, rel=0.01)
    for variant in list_models(include_variants=True):
        if variant.startswith(model + ":"):
            assert get_model(variant).num_params == m.num_params  # same weights, other layout


def test_ids_and_variants():
    base = list_models()
    assert base == ["llama3-8b", "llama3-70b", "llama3-405b", "gpt-oss-20b", "gpt-oss-120b",
                    "deepseek-v3", "kimi-k2", "qwen3-30b-a3b", "qwen3-235b-a22b", "llama4-scout",
                    "llama4-maverick"]
    allv = list_models(include_variants=True)
    assert {"gpt-oss-20b:separate", "gpt-oss-120b:separate", "deepseek-v3:fused", "qwen3-30b-a3b:fused"} <= set(allv)
    assert get_model("gpt-oss-120b", variant="separate").id == "gpt-oss-120b:separate"
    assert get_model("gpt-oss-120b:fused").id == "gpt-oss-120b"  # fused is its reference layout
    assert get_model("deepseek-v3").variant == "separate"
    with pytest.raises(ValueError, match="unknown model 'llama4'"):
        get_model("llama4")
    with pytest.raises(ValueError, match="no variant"):
        get_model("llama3-8b:separate")


def test_groups_follow_fsdp_wrapping():
    m = get_model("llama3-70b")
    names = [g.name for g in m.groups]
    assert names[0] == "embed" and names[-1] == "head" and names[1:-1] == [f"layers.{i}" for i in range(80)]
    layer = m.groups[1]
    shapes = {t.name: t.shape for t in layer.tensors}
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (8192, 8192)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (1024, 8192)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (8192, 28672)
    assert shapes["model.layers.0.input_layernorm.weight"] == (8192,)
    assert [t.name for t in m.groups[-1].tensors] == ["model.norm.weight", "lm_head.weight"]
    assert [t.shape for t in m.groups[0].tensors] == [(128256, 8192)]


def test_gpt_oss_fused_and_separate_experts():
    fused = {t.name: t.shape for t in get_model("gpt-oss-120b").groups[1].tensors}
    p = "model.layers.0."
    assert fused[p + "mlp.experts.gate_up_proj"] == (128, 2880, 5760)
    assert fused[p + "mlp.experts.gate_up_proj_bias"] == (128, 5760)
    assert fused[p + "mlp.experts.down_proj"] == (128, 2880, 2880)
    assert fused[p + "mlp.experts.down_proj_bias"] == (128, 2880)
    assert fused[p + "mlp.router.weight"] == (128, 2880) and fused[p + "mlp.router.bias"] == (128,)
    assert fused[p + "self_attn.sinks"] == (64,) and fused[p + "self_attn.q_proj.bias"] == (4096,)
    sep = {t.name: t.shape for t in get_model("gpt-oss-120b:separate").groups[1].tensors}
    assert sep[p + "mlp.experts.127.gate_up_proj.weight"] == (5760, 2880)
    assert sep[p + "mlp.experts.0.down_proj.bias"] == (2880,)
    assert len(sep) == len(fused) - 4 + 4 * 128


def test_deepseek_dense_then_moe_with_mla():
    m = get_model("deepseek-v3")
    assert len(m.groups) == 61 + 2
    dense = {t.name: t.shape for t in m.groups[1].tensors}
    moe = {t.name: t.shape for t in m.groups[4].tensors}
    p = "model.layers.0."
    assert dense[p + "mlp.gate_proj.weight"] == (18432, 7168)
    assert dense[p + "self_attn.q_b_proj.weight"] == (128 * 192, 1536)
    assert dense[p + "self_attn.kv_a_proj_with_mqa.weight"] == (576, 7168)
    assert dense[p + "self_attn.kv_b_proj.weight"] == (128 * 256, 512)
    assert dense[p + "self_attn.o_proj.weight"] == (7168, 128 * 128)
    p = "model.layers.3."
    assert moe[p + "mlp.gate.weight"] == (256, 7168) and moe[p + "mlp.gate.e_score_correction_bias"] == (256,)
    assert moe[p + "mlp.experts.255.down_proj.weight"] == (7168, 2048)
    assert moe[p + "mlp.shared_experts.up_proj.weight"] == (2048, 7168)
    assert sum(1 for n in moe if ".experts." in n) == 256 * 3
    fused = {t.name: t.shape for t in get_model("deepseek-v3:fused").groups[4].tensors}
    assert fused[p + "mlp.experts.gate_proj.weight"] == (256, 2048, 7168)


def test_qwen3_qk_norm_and_experts():
    layer = {t.name: t.shape for t in get_model("qwen3-30b-a3b").groups[1].tensors}
    p = "model.layers.0."
    assert layer[p + "self_attn.q_norm.weight"] == (128,) and layer[p + "self_attn.k_norm.weight"] == (128,)
    assert layer[p + "mlp.gate.weight"] == (128, 2048)
    assert layer[p + "mlp.experts.0.gate_proj.weight"] == (768, 2048)


def test_model_specs_apply_granularity_to_matrices_only():
    groups = model_specs("gpt-oss-20b", "rows:16", itemsize=2)
    specs = {s.name: s for _, ss in groups for s in ss}
    assert specs["model.layers.0.mlp.experts.gate_up_proj"].granularity == Granularity("rows", 16)
    assert specs["model.layers.0.mlp.experts.gate_up_proj"].block_elems == 16 * 5760
    assert specs["model.layers.0.self_attn.q_proj.bias"].granularity is None
    assert all(s.itemsize == 2 for s in specs.values())
    g = get_model("llama3-8b").groups[1]
    specs = group_specs(g, "row", granularity_1d="tensor")
    assert specs[-1].granularity == Granularity("tensor") and specs[-1].block_elems == 4096
    assert sum(s.numel for s in specs) == g.numel == sum(math.prod(t.shape) for t in g.tensors)
