"""MoE costed as it runs, GEMMs by shape, block-scaled recipes, new hardware and
models, and the validation against published points recomputed from the data file (so a
change to the model that moves any prediction fails here until docs/data/sim_validation.json
is rewritten by ``python -m ragged_fsdp.sim.validate``)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from ragged_fsdp.models.catalog import get_model
from ragged_fsdp.sim import validate
from ragged_fsdp.sim.arch import arch_from_shapes
from ragged_fsdp.sim import fitted
from ragged_fsdp.sim.compute import GroupFlops, Linear, _is_routed, compute_times, group_flops, grouped_mxfp8_speedup, linear_times
from ragged_fsdp.sim.hf_config import hf_to_catalog
from ragged_fsdp.sim.layout import split_for_mesh
from ragged_fsdp.sim.mesh import parse_mesh
from ragged_fsdp.sim.moe import moe_layer_cost
from ragged_fsdp.sim.options import Recipe
from ragged_fsdp.sim.profiles import PROFILES, GPUProfile
from ragged_fsdp.sim.simulate import Scenario, simulate

RECORD = Path(__file__).resolve().parents[1] / "docs" / "data" / "sim_validation.json"


@pytest.fixture(scope="module")
def rows():
    return validate.evaluate(validate.load_points()["points"])


def test_validation_matches_record_and_targets(rows):
    rec = {r["id"]: r for r in json.loads(RECORD.read_text())["rows"]}
    assert set(rec) == {r["id"] for r in rows}, "points file and record differ: rerun sim.validate"
    for r in rows:
        want = rec[r["id"]]
        assert math.isclose(r["tokens_per_s_predicted"], want["tokens_per_s_predicted"], rel_tol=2e-3), r["id"]
        assert math.isclose(r["memory_gib_predicted"], want["memory_gib_predicted"], rel_tol=2e-3), r["id"]
    # the fit points are reproduced (the constants in fitted.py are their fit)
    for r in rows:
        if r["role"] == "fit":
            assert abs(r["tokens_per_s_error"]) < 5e-3, r["id"]
    # the targets on published_points.json's points not fitted (issue 56 made two of its 50 the
    # fit points of their own GPU): the medians are met, the maximum is not (docs/simulate.md
    # lists the misses); these bounds are the measured values rounded up
    val = [r for r in rows if r["role"] == "validate" and r["added"] != "issue 56"]
    err = [abs(r["tokens_per_s_error"]) for r in val]
    mem = [abs(r["memory_error"]) for r in val if r["memory_error"] is not None]
    assert len(val) == 48
    assert statistics.median(err) <= 0.10
    assert max(err) <= 0.50
    assert statistics.median(mem) <= 0.10
    # issue 56's points (each GPU on its own evidence): measured median 12.6%, max 30.4%
    new = [abs(r["tokens_per_s_error"]) for r in rows if r["role"] == "validate" and r["added"] == "issue 56"]
    assert len(new) == 15 and statistics.median(new) <= 0.15 and max(new) <= 0.35


def _expert_flops_on_rank(model, ep, imbalance, tokens=4096.0):
    arch = arch_from_shapes(get_model(model))
    groups = arch.groups[1:2]  # the first block (an MoE block in qwen3)
    total = 0.0
    for name, tensors, _ in split_for_mesh(groups, 1, ep):
        gf = group_flops(arch, name, tensors, tokens, 4096, 1, 1, ep, imbalance)
        total += sum(lin.flops for lin in gf.linears if _is_routed(lin.name))
    return arch, total


@pytest.mark.parametrize("ep", [1, 2, 8])
def test_expert_flops_per_rank_independent_of_ep(ep):
    # hand count: each of the rank's tokens goes to top_k experts; an expert is gate, up
    # (h -> inter) and down (inter -> h): 3 GEMMs of 2 h inter flops per routed token. Under
    # EP the rank runs E/ep experts on the copies of all ep ranks: the same count on average
    # (not on its own tokens' share only, 1/ep of it)
    imb = 1.25
    arch, got = _expert_flops_on_rank("qwen3-30b-a3b:fused", ep, imb)
    want = 4096 * arch.top_k * 3 * 2 * arch.hidden * arch.moe_inter * (imb if ep > 1 else 1.0)
    assert math.isclose(got, want, rel_tol=1e-9)


def test_alltoall_hand_computed():
    prof = GPUProfile("t", 80e9, 1e15, 2e12, 100e9, 10e9, 8, alpha_intra=1e-6, alpha_inter=2e-6)
    # DeepEP sends a token once per rank holding one of its experts: 8 experts, 2 per rank at
    # EP 4, top-2: a rank misses both with probability 6/8 x 5/7, so 4 x (1 - 30/56) ranks
    ranks = 4 * (1 - 30 / 56)
    nbytes = 1024 * ranks * 64 * 2 * 1.5  # tokens x ranks per token x hidden x bf16 x imbalance
    c = moe_layer_cost(prof, 1024, 2, 8, 64, 2, 4, "deepep", 1.5)
    assert math.isclose(c.a2a_bytes, nbytes, rel_tol=1e-12)
    # the default dispatcher sends every routed copy (top_k per token)
    assert moe_layer_cost(prof, 1024, 2, 8, 64, 2, 4, "standard", 1.5).a2a_bytes == 1024 * 2 * 64 * 2 * 1.5
    assert math.isclose(c.a2a_call, (3 * 1e-6 + 3 / 4 * nbytes / 100e9) / 0.95, rel_tol=1e-12)
    # 16 ranks over two 8-GPU nodes: each rank's own NIC, latency 7 NVLink steps + 1 tree level
    c = moe_layer_cost(prof, 1024, 2, 8, 64, 2, 16, "deepep", 1.5)
    nbytes16 = 1024 * 2 * 64 * 2 * 1.5  # more ranks than experts: each copy to a rank of its own
    assert math.isclose(c.a2a_bytes, nbytes16, rel_tol=1e-12)
    assert math.isclose(c.a2a_call, (7e-6 + 2e-6 + 15 / 16 * nbytes16 / 10e9) / 0.95, rel_tol=1e-12)
    # permutation: 4 x routed copies (top_k per token) read + written each way forward, plus
    # the router's scores
    assert math.isclose(c.permute_f, (4 * 1024 * 2 * 64 * 2 * 1.5 + 6 * 1024 * 8 * 4) / 2e12, rel_tol=1e-12)
    assert c.permute_b == 2 * c.permute_f


def _qwen(imbalance=1.0, dispatcher="standard", gpus=16, ac="full"):
    sc = Scenario("qwen3-30b-a3b:fused", gpus, PROFILES["b200"], parse_mesh(f"ep=8,dp={gpus // 8}", gpus), "adamw",
                  "bf16", 4096, 2, ac, None, recipe=Recipe(compile=True, moe_dispatcher=dispatcher,
                                                           moe_imbalance=imbalance))
    return {r.framework: r for r in simulate(sc)}


def test_step_alltoall_part_and_imbalance_monotonic():
    r = _qwen(1.0)["fsdp2"]
    c = moe_layer_cost(PROFILES["b200"], 8192, 8, 128, 2048, 2, 8, "standard", 1.0)
    # 48 MoE layers x (dispatch + combine) x (forward, backward, full AC's recomputation)
    assert math.isclose(r.time_parts["ep all-to-all"], 48 * 6 * c.a2a_call, rel_tol=1e-9)
    runs = [_qwen(i) for i in (1.0, 1.1, 1.3, 2.0)]
    for fw in ("ragged", "fsdp2", "fsdp1", "deepspeed", "megatron"):
        steps = [x[fw].step_s for x in runs]
        assert all(a < b for a, b in zip(steps, steps[1:])), (fw, steps)
    deep = _qwen(1.0, "deepep")
    assert deep["ragged"].step_s < runs[0]["ragged"].step_s
    # DeepEP's NVLink buffer, hand-counted from DeepEP's Config: 64 channels (128 SMs) x 8
    # peers x 256 slots x (2,048 x 2 hidden bytes + 128 x (8 + 4 + 4) top-k / scale bytes)
    buf = 64 * 8 * 256 * (2048 * 2 + 128 * 16)
    for fw in ("ragged", "fsdp2"):
        assert math.isclose(deep[fw].memory_bytes - runs[0][fw].memory_bytes, buf, rel_tol=1e-9)
        assert deep[fw].memory_items["DeepEP buffer"] == buf


def test_gemm_rate_by_shape():
    prof = PROFILES["b200"]
    big = Linear("x", 8192, 4096, 4096, 1, False, False, False)
    small = Linear("x", 64, 4096, 4096, 1, False, False, False)
    per_flop = [linear_times(lin, prof, Recipe())[0] / lin.flops for lin in (big, small)]
    assert per_flop[1] > 1.5 * per_flop[0]  # the 64-row GEMM reaches well under half the large one's rate


def test_grouped_mxfp8_gain_from_torchao_microbenchmark():
    # torchao's grouped-GEMM table (B200, forward + backward, casts included), medians over
    # G = 1, 2, 4, 8 worked out by hand: DeepSeek-V3 (1.321 + 1.440) / 2, Scout (1.690 + 1.700) / 2
    assert math.isclose(grouped_mxfp8_speedup(2048, 7168), 1.3805)
    assert math.isclose(grouped_mxfp8_speedup(8192, 5120), 1.695)
    assert grouped_mxfp8_speedup(768, 2048) == grouped_mxfp8_speedup(2048, 7168)  # clamped, not extrapolated
    assert grouped_mxfp8_speedup(16384, 16384) == grouped_mxfp8_speedup(8192, 5120)
    mid = grouped_mxfp8_speedup(4096, 7168)
    assert 1.3805 < mid < 1.695
    # a routed expert's GEMM under MXFP8 runs at the table's gain, a dense linear at the fitted one,
    # and the routed one carries no separate cast time (the table's times include the casts)
    prof = PROFILES["b200"]
    bf16, mx = Recipe(), Recipe(compile=True, float8="mxfp8")
    routed = Linear("layers.0.moe.experts.w1", 65536, 5120, 8192, 4, True, False, False)
    dense = Linear("layers.0.attention.wq", 65536, 5120, 8192, 1, True, False, False)
    for lin, gain in ((routed, 1.695), (dense, fitted.FLOAT8_SPEEDUP["mxfp8"])):
        t16, t8 = linear_times(lin, prof, bf16)[0], linear_times(lin, prof, mx)[0]
        assert math.isclose(t16 / t8, gain, rel_tol=1e-9)
    nv = Recipe(compile=True, float8="nvfp4")  # NVFP4 on experts: the table's gain x 2, as dense
    assert math.isclose(linear_times(routed, prof, bf16)[0] / linear_times(routed, prof, nv)[0], 2 * 1.695,
                        rel_tol=1e-9)
    gf = GroupFlops(0.0, 0.0, 0.0, linears=[routed])
    f16, b16 = compute_times(gf, prof, bf16, "none", 1)
    f8, b8 = compute_times(gf, prof, mx, "none", 1)
    assert math.isclose((f16 + b16) / (f8 + b8), 1.695, rel_tol=1e-9)


def test_block_scaled_recipes():
    def tok(gpu, f8):
        sc = Scenario("llama3-8b", 8, PROFILES[gpu], parse_mesh("dp=8", 8), "adamw", "bf16", 8192, 1, "op", None,
                      recipe=Recipe(compile=True, float8=f8))
        return simulate(sc, ("fsdp2",))[0].tokens_per_s_per_gpu

    assert tok("b200", None) < tok("b200", "mxfp8") < tok("b200", "nvfp4")
    with pytest.raises(ValueError, match="--float8 mxfp8.*Blackwell"):
        tok("h100", "mxfp8")
    with pytest.raises(ValueError, match="--float8-allgather"):
        Recipe(float8="mxfp8", float8_allgather=True).check(1, 1, 1)
    with pytest.raises(ValueError, match="--moe-imbalance"):
        Recipe(moe_imbalance=0.5).check(1, 1, 1)
    with pytest.raises(ValueError, match="--moe-dispatcher"):
        Recipe(moe_dispatcher="nccl").check(1, 1, 1)


def test_llama4_from_hf_config_hand_counted():
    # Scout's text_config (meta-llama/Llama-4-Scout-17B-16E); counted by hand below
    h, inter, mlp, E, L, V, q, kv = 5120, 8192, 16384, 16, 48, 202048, 40 * 128, 8 * 128
    cfg = {"model_type": "llama4_text", "vocab_size": V, "hidden_size": h, "num_hidden_layers": L,
           "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": inter,
           "intermediate_size_mlp": mlp, "num_local_experts": E, "num_experts_per_tok": 1,
           "interleave_moe_layer_step": 1}
    from ragged_fsdp.models.catalog import model_from_config

    m = model_from_config("scout", hf_to_catalog(cfg))
    attn = 2 * q * h + 2 * kv * h
    moe_layer = attn + E * h + E * 3 * h * inter + 3 * h * inter + 2 * h
    assert m.num_params == 2 * V * h + L * moe_layer + h
    a = arch_from_shapes(m)
    assert a.active_params == m.num_params - L * (E - 1) * 3 * h * inter
    assert a.moe_layers == 48
    # Maverick: 128 experts, every second layer MoE (1, 3, ...), the others dense (mlp)
    mv = model_from_config("mav", hf_to_catalog({**cfg, "num_local_experts": 128, "interleave_moe_layer_step": 2}))
    dense_layer = attn + 3 * h * mlp + 2 * h
    moe128 = attn + 128 * h + 128 * 3 * h * inter + 3 * h * inter + 2 * h
    assert mv.num_params == 2 * V * h + 24 * dense_layer + 24 * moe128 + h
    assert arch_from_shapes(get_model("llama4-maverick")).moe_layers == 24


def test_prediction_carries_what_it_rests_on():
    ids = {p["id"] for p in validate.load_points()["points"]}
    r = _qwen(None)["ragged"]
    terms = r.uncertainty["terms"]
    assert terms["routing imbalance"].startswith("assumed")
    assert "tt-deepep-qwen3-default-8" in terms["EP all-to-all"]
    assert "cross-validation" in r.uncertainty["validated_error_band"] and r.uncertainty["band"]["low"] < 1
    for v in terms.values():  # every point named as a fit exists in the points file
        if "published point" in v:
            assert v.split("published point ")[1].split()[0] in ids
    assert "DeepEP" in _qwen(1.0, "deepep")["ragged"].uncertainty["terms"]["EP all-to-all"]
    sc = Scenario("llama3-8b", 8, PROFILES["mi300x"], parse_mesh("dp=8", 8), "adamw", "bf16", 4096, 1, "full", None)
    u = simulate(sc, ("fsdp2",))[0].uncertainty
    # MI300X's efficiency is fitted on a run of its own; its band says it cannot be
    # cross-validated on MI300X alone (one source)
    assert "ao-mi300x-8b-bf16" in u["terms"]["GEMM efficiency"] and "too few points" in u["validated_error_band"]


def test_megatron_chunks_experts_as_megatron_core_holds_them():
    # Megatron-FSDP pads a bucket to dp x LCM(shape[1:]) of its weights; Megatron-Core keeps
    # one 2-D weight per expert (TE GroupedLinear), so the chunk factor is a row of 2,880,
    # not a whole 5,760 x 2,880 expert (which padded 16 experts over 128 ranks to 128 experts)
    from ragged_fsdp.sim.layout import group_layouts
    groups = [("layers.0", [("layers.0.mlp.experts.gate_up_proj", (128, 5760, 2880))])]
    (g,) = [x for x in group_layouts(groups, "megatron", 128, ep=8) if x.expert]
    numel = 16 * 5760 * 2880
    row = 2880
    assert g.segment == -(-numel // (128 * row)) * row  # ceil to a whole row per rank
    assert g.segment * 128 < 1.01 * numel  # the fused reading gave 128 x 5760 x 2880 = 8 x numel
