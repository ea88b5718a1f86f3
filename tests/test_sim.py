"""The simulator's pure parts: model resolution (catalog, Kimi-K2, Hugging Face config.json),
meshes, layouts from the real planner, memory/time monotonicity, published points, the CLI."""
from __future__ import annotations

import json
import math

import pytest

from ragged_fsdp.cli import main as cli_main
from ragged_fsdp.models.catalog import get_model, model_specs
from ragged_fsdp.planner import plan_model
from ragged_fsdp.sim.arch import resolve_model
from ragged_fsdp.sim.calibrate import fit_alpha_beta
from ragged_fsdp.sim.hf_config import hf_to_catalog
from ragged_fsdp.sim.layout import group_layouts
from ragged_fsdp.sim.mesh import Mesh, parse_mesh
from ragged_fsdp.sim.profiles import PROFILES, get_profile
from ragged_fsdp.sim.simulate import Scenario, simulate


def test_kimi_k2_public_config():
    m = get_model("kimi-k2")
    assert len(m.groups) == 61 + 2
    assert abs(m.num_params / 1e12 - 1.026) < 0.01  # ~1T total (MTP layer left out)
    a = resolve_model("kimi-k2")
    assert abs(a.active_params / 1e9 - 32.9) < 0.5  # ~32B activated
    assert a.experts == 384 and a.top_k == 8 and a.moe_layers == 60


_HF = {
    "llama": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256},
    "mixtral": {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
                "num_experts_per_tok": 2},
    "qwen3_moe": {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                  "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "num_experts": 128,
                  "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    "gpt_oss": {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
                "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088,
                "num_local_experts": 128, "num_experts_per_tok": 4},
    "deepseek_v3": {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                    "vocab_size": 129280, "first_k_dense_replace": 3, "n_routed_experts": 256, "n_shared_experts": 1,
                    "num_experts_per_tok": 8, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64, "v_head_dim": 128},
}


@pytest.mark.parametrize("family", list(_HF))
def test_hf_config_families(tmp_path, family):
    path = tmp_path / family / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(_HF[family]))
    a = resolve_model(str(path))
    expect = {"llama": 8.03e9, "mixtral": 46.7e9, "qwen3_moe": 30.5e9, "gpt_oss": 116.8e9, "deepseek_v3": 671.0e9}
    assert abs(a.params / expect[family] - 1) < 0.01, a.params
    if family == "gpt_oss":  # the same shapes as the catalog entry
        assert a.params == get_model("gpt-oss-120b").num_params
    if family == "deepseek_v3":
        assert a.params == get_model("deepseek-v3").num_params


def test_hf_config_errors(tmp_path):
    with pytest.raises(ValueError, match="model_type 'bert'"):
        hf_to_catalog({"model_type": "bert", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1,
                       "vocab_size": 10})
    with pytest.raises(ValueError, match="cannot read"):
        resolve_model(str(tmp_path / "missing.json"))


def test_mesh_parsing():
    assert parse_mesh("dp=1024", 1024) == Mesh(1024)
    assert parse_mesh("hsdp=128x8", 1024) == Mesh(8, 128)
    assert parse_mesh("tp=8,dp=128", 1024) == Mesh(128, 1, 8)
    assert parse_mesh("ep=8", 1024) == Mesh(128, 1, 1, 8)
    assert parse_mesh("auto", 64) is None
    with pytest.raises(ValueError, match="uses 512 GPUs but --gpus is 1024"):
        parse_mesh("tp=4,dp=128", 1024)
    with pytest.raises(ValueError, match="not one of dp, hsdp, tp, ep, pp, cp"):
        parse_mesh("xp=2", 1024)


def test_ragged_layout_is_the_planner_s():
    groups = [(g.name, [(t.name, t.shape) for t in g.tensors]) for g in get_model("gpt-oss-120b").groups]
    L = group_layouts(groups, "ragged", 1024, itemsize=4, granularity="row")
    mp = plan_model(model_specs("gpt-oss-120b", "row"), 1024)
    assert [g.segment for g in L] == [mp.plan(i).segment for i in range(len(L))]
    # FSDP2: the fused experts' dim 0 (128) is below W, so they shard on dim 1 as torchtitan
    # does (Shard(0) would pad them 8x); what is left is per-parameter row padding
    f2 = group_layouts(groups, "fsdp2", 1024, itemsize=4)
    assert sum(g.segment for g in L) < sum(g.segment for g in f2) < 1.1 * sum(g.segment for g in L)


def test_simulate_names_differences_and_labels():
    sc = Scenario("llama3-8b", 64, get_profile("h100"), Mesh(64), seq=4096)
    res = {r.framework: r for r in simulate(sc)}
    assert res["ragged"].status == res["fsdp2"].status == "validated"
    assert {res[f].status for f in ("fsdp1", "deepspeed", "megatron")} == {"unvalidated"}
    assert any("copy-out" in d for d in res["fsdp2"].differences)
    assert res["fsdp2"].time_parts["copies"] > 0 == res["ragged"].time_parts["copies"]
    # sharded states: 8 bytes per parameter over 64 ranks (element granularity: ~no padding)
    assert abs(res["ragged"].optimizer_states / (8 * resolve_model("llama3-8b").params / 64) - 1) < 1e-3
    for r in res.values():
        assert r.fits and 0 < r.mfu < 1 and r.step_s > 0


def test_memory_and_time_move_the_right_way():
    prof = get_profile("h100")
    base = Scenario("llama3-70b", 256, prof, Mesh(256), act_ckpt="full")
    full = simulate(base, ("ragged",))[0]
    none = simulate(Scenario(**{**base.__dict__, "act_ckpt": "none"}), ("ragged",))[0]
    assert none.memory_bytes > full.memory_bytes and none.step_s < full.step_s  # no recompute
    more = simulate(Scenario(**{**base.__dict__, "gpus": 1024, "mesh": Mesh(1024)}), ("ragged",))[0]
    assert more.sharded_params < full.sharded_params
    slow = simulate(Scenario(**{**base.__dict__, "profile": prof.with_overrides(net_bw=prof.net_bw / 10)}),
                    ("ragged",))[0]
    assert slow.step_s > full.step_s
    with pytest.raises(ValueError, match="unknown GPU profile field"):
        prof.with_overrides(tflops=1)


def test_plain_fsdp_published_points_stay_close():
    """Regression guard on validation points of plain FSDP (no TP/PP/CP): 128 H100 (bf16,
    compile, compile + float8) and 64 A100; the full table is `python -m ragged_fsdp.sim.validate`."""
    from ragged_fsdp.sim.validate import evaluate, load_points

    ids = {"tt-2412-t3-fsdp", "tt-2412-t3-compile", "tt-2412-t3-compile-fp8", "tt-perf-a100-l3-8b-op",
           "tt-perf-a100-l3-70b-full"}
    rows = evaluate([p for p in load_points()["points"] if p["id"] in ids])
    assert len(rows) == len(ids)
    for r in rows:
        assert r["role"] == "validate" and abs(r["tokens_per_s_error"]) <= 0.10, r


def test_alpha_beta_fit_recovers_a_line():
    rows = [[b, 1e-4 + b / 2e9] for b in (4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20, 32 << 20)]
    rows[1][1] *= 5  # one slow small transfer (a shared machine)
    alpha, beta = fit_alpha_beta(rows)
    assert abs(beta / 2e9 - 1) < 0.05 and alpha < 1e-3


def test_cli_json_and_errors(capsys):
    assert cli_main(["simulate", "--model", "llama3-8b", "--gpus", "64", "--frameworks", "ragged,fsdp2",
                     "--json", "--gpu-net-gbs", "25"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["framework"] for r in doc["results"]] == ["ragged", "fsdp2"]
    assert doc["scenario"]["profile"]["net_bw"] == 25e9
    assert cli_main(["simulate", "--model", "llama3-8b", "--gpus", "64", "--mesh", "tp=3"]) == 2
    assert "not a multiple" in capsys.readouterr().err
    assert cli_main(["simulate", "--frameworks", "ddp"]) == 2
    assert "unknown 'ddp'" in capsys.readouterr().err


def test_cli_sweep_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the plot extra (make test installs it)")
    out = tmp_path / "s.png"
    assert cli_main(["simulate", "--model", "llama3-8b", "--gpus", "64", "--sweep", "gpus=64..256",
                     "--frameworks", "ragged,fsdp2", "--plot", str(out)]) == 0
    text = capsys.readouterr().out
    assert "weak scaling" in text and "strong scaling" in text and out.stat().st_size > 1000


def test_cli_mesh_auto_says_why(capsys):
    assert cli_main(["simulate", "--model", "llama3-8b", "--gpus", "64", "--mesh", "auto",
                     "--frameworks", "ragged"]) == 0
    assert "mesh auto:" in capsys.readouterr().out


def test_profiles_cover_the_issue():
    assert set(PROFILES) >= {"h100", "h200", "a100", "b200"}
    assert all(math.isfinite(p.flops) for p in PROFILES.values())


def test_optimizers_and_meshes():
    prof = get_profile("h100")
    res = {}
    for opt in ("adamw", "adamw8bit", "muon"):
        for mesh in (Mesh(256), Mesh(8, 32), Mesh(64, 1, 4)):
            sc = Scenario("llama3-8b", 256, prof, mesh, optimizer=opt, seq=2048)
            res[opt, str(mesh)] = {r.framework: r for r in simulate(sc, ("ragged", "fsdp2"))}
    a, q = res["adamw", "dp=256"]["ragged"], res["adamw8bit", "dp=256"]["ragged"]
    assert abs(q.optimizer_states / a.optimizer_states - (2 + 8 / 256) / 8) < 1e-3
    # HSDP shards over 8 ranks: 32x the sharded state of plain FSDP over 256
    h = res["adamw", "hsdp=32x8"]["ragged"]
    assert abs(h.sharded_params / a.sharded_params - 32) < 0.05
    # Muon: ragged_fsdp spreads Newton-Schulz over owners; torch's Muon repeats it on every rank
    m = res["muon", "dp=256"]
    assert m["ragged"].time_parts["optimizer"] < m["fsdp2"].time_parts["optimizer"] / 10
