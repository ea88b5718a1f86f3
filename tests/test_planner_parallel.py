"""``plan --tp/--ep``: TP-/EP-local shapes, their errors, and ``--suggest``'s mesh recipes."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from ragged_fsdp.cli import main
from ragged_fsdp.models.catalog import get_model, model_from_config
from ragged_fsdp.models.parallel import ParallelDims, local_groups, module_map, valid_degrees
from ragged_fsdp.planner.recipe import mesh_layout, recipe
from ragged_fsdp.planner.suggest import merge_groups
from ragged_fsdp.sim.hf_config import hf_to_catalog


def _shapes(group):
    return {t.name.split(".", 3)[-1] if t.name.startswith("model.layers.") else t.name: t.shape
            for t in group.tensors}


def test_llama_tp_local_shapes_by_hand():
    groups = local_groups(get_model("llama3-8b"), ParallelDims(world=8, tp=4))
    assert [g.name for g in groups] == ["embed"] + [f"layers.{i}" for i in range(32)] + ["head"]
    assert {g.dp for g in groups} == {2} and {g.kind for g in groups} == {"dense"}
    assert _shapes(groups[0]) == {"model.embed_tokens.weight": (128256 // 4, 4096)}  # rows: vocab
    assert _shapes(groups[1]) == {
        "self_attn.q_proj.weight": (4096 // 4, 4096),  # Colwise: 32 heads -> 8 per rank
        "self_attn.k_proj.weight": (1024 // 4, 4096),  # 8 kv heads -> 2
        "self_attn.v_proj.weight": (1024 // 4, 4096),
        "self_attn.o_proj.weight": (4096, 4096 // 4),  # Rowwise: the input dim
        "mlp.gate_proj.weight": (14336 // 4, 4096),
        "mlp.up_proj.weight": (14336 // 4, 4096),
        "mlp.down_proj.weight": (4096, 14336 // 4),
        "input_layernorm.weight": (4096,),  # norms whole
        "post_attention_layernorm.weight": (4096,),
    }
    assert _shapes(groups[-1]) == {"model.norm.weight": (4096,), "lm_head.weight": (32064, 4096)}


def test_llama_tp_plan_numbers(capsys):
    # element granularity: a block's TP-local elements split evenly over the 2 dp ranks.
    # 1024*4096 + 2*256*4096 + 4096*1024 + 2*3584*4096 + 4096*3584 + 2*4096 = 54,534,144
    block = 1024 * 4096 + 2 * 256 * 4096 + 4096 * 1024 + 2 * 3584 * 4096 + 4096 * 3584 + 2 * 4096
    assert block == 54_534_144
    assert main(["plan", "--model", "llama3-8b", "--world", "8", "--tp", "4", "--granularity", "element",
                 "--json"]) == 0
    (cell,) = json.loads(capsys.readouterr().out)
    assert (cell["tp"], cell["ep"], cell["dense_dp"], cell["expert_dp"]) == (4, 1, 2, 2)
    layers = next(k for k in cell["groups"] if k["group"] == "layers.0..31")
    assert layers["segment"] == block // 2 == 27_267_072 and layers["dp_ranks"] == 2
    assert layers["padding_ratio"] == 0.0
    emb = next(k for k in cell["groups"] if k["group"] == "embed")
    assert emb["segment"] == 32064 * 4096 // 2
    # the whole model over 8 ranks with tp=4 holds 1/8 of the TP-split weights and 1/2 of the norms
    full = get_model("llama3-8b").num_params
    norms = (2 * 32 + 1) * 4096
    assert cell["params"] == (full - norms) // 4 + norms
    assert cell["mesh"]["shape"] == [2, 4] and cell["mesh"]["dim_names"] == ["dp", "tp"]


def test_moe_ep_local_shapes_by_hand():
    dims = ParallelDims(world=16, tp=2, ep=4)
    assert (dims.dense_dp, dims.expert_dp) == (8, 2)
    groups = local_groups(get_model("qwen3-30b-a3b:fused"), dims)
    assert [g.name for g in groups[:4]] == ["embed", "layers.0", "layers.0.experts", "layers.1"]
    assert len(groups) == 1 + 2 * 48 + 1
    dense, experts = groups[1], groups[2]
    assert (dense.kind, dense.dp, experts.kind, experts.dp) == ("dense", 8, "experts", 2)
    assert _shapes(dense) == {
        "self_attn.q_proj.weight": (32 * 128 // 2, 2048), "self_attn.k_proj.weight": (4 * 128 // 2, 2048),
        "self_attn.v_proj.weight": (256, 2048), "self_attn.o_proj.weight": (2048, 2048),
        "self_attn.q_norm.weight": (128,), "self_attn.k_norm.weight": (128,),
        "mlp.gate.weight": (128, 2048),  # the router stays whole
        "input_layernorm.weight": (2048,), "post_attention_layernorm.weight": (2048,),
    }
    # 128 experts / ep 4 = 32 per EP rank; experts are not tensor-parallel
    assert _shapes(experts) == {"mlp.experts.gate_proj.weight": (32, 768, 2048),
                                "mlp.experts.up_proj.weight": (32, 768, 2048),
                                "mlp.experts.down_proj.weight": (32, 2048, 768)}
    sep = local_groups(get_model("qwen3-30b-a3b"), dims)[2]
    assert len(sep.tensors) == 3 * 32 and sep.tensors[-1].name == "model.layers.0.mlp.experts.31.down_proj.weight"
    assert sep.tensors[-1].shape == (2048, 768)
    # deepseek: 3 dense blocks stay one group each; 58 MoE blocks split; shared experts TP'd
    ds = local_groups(get_model("deepseek-v3"), ParallelDims(world=64, tp=8, ep=8))
    assert len(ds) == 1 + 3 + 2 * 58 + 1
    moe = {g.name: g for g in ds}["layers.3"]
    shapes = _shapes(moe)
    assert shapes["mlp.shared_experts.gate_proj.weight"] == (2048 // 8, 7168)
    assert shapes["mlp.shared_experts.down_proj.weight"] == (7168, 2048 // 8)
    assert shapes["self_attn.q_b_proj.weight"] == (128 * 192 // 8, 1536)
    assert shapes["self_attn.q_a_proj.weight"] == (1536, 7168)  # low-rank projection: whole
    assert shapes["self_attn.o_proj.weight"] == (7168, 128 * 128 // 8)
    ds_experts = {g.name: g for g in ds}["layers.3.experts"]
    assert ds_experts.dp == 1 and len(ds_experts.tensors) == 3 * 32  # 256 experts / ep 8


def test_ep_one_keeps_experts_in_their_block():
    m = get_model("gpt-oss-20b")
    groups = local_groups(m, ParallelDims(world=8, tp=2))
    assert len(groups) == len(m.groups)
    s = _shapes(groups[1])
    assert s["mlp.experts.gate_up_proj"] == (32, 2880, 5760)  # experts: not tensor-parallel
    assert s["self_attn.sinks"] == (32,)  # one per head: follows the 64 / 2 local heads
    assert s["self_attn.q_proj.bias"] == (2048,) and s["self_attn.o_proj.bias"] == (2880,)
    # tp = ep = 1: the catalog's groups unchanged
    same = local_groups(m, ParallelDims(world=8))
    assert [(g.name, g.tensors) for g in same] == [(g.name, g.tensors) for g in m.groups]


def test_tp_plan_is_the_standard_one():
    mm = module_map(get_model("llama3-8b"))
    col, row = "ColwiseParallel()", "RowwiseParallel()"
    assert mm.dense_plan == {"self_attn.q_proj": col, "self_attn.k_proj": col, "self_attn.v_proj": col,
                             "self_attn.o_proj": row, "mlp.gate_proj": col, "mlp.up_proj": col,
                             "mlp.down_proj": row}
    assert mm.top_plan == {"model.embed_tokens": "RowwiseParallel(input_layouts=Replicate())",
                           "lm_head": "ColwiseParallel(output_layouts=Replicate())"}
    mm = module_map(get_model("deepseek-v3"))
    assert mm.moe_layers == tuple(range(3, 61)) and mm.experts_attr == "mlp.experts" and mm.experts_separate
    assert mm.moe_plan == {"self_attn.q_b_proj": col, "self_attn.kv_b_proj": col, "self_attn.o_proj": row,
                           "mlp.shared_experts.gate_proj": col, "mlp.shared_experts.up_proj": col,
                           "mlp.shared_experts.down_proj": row}
    mm = module_map(get_model("gpt-oss-20b"))
    assert not mm.experts_separate and mm.tp_notes and "sinks" in mm.tp_notes[0]


def test_valid_degrees():
    assert valid_degrees(get_model("llama3-8b")) == ([1, 2, 4, 8], [1])  # kv_heads=8 bounds tp
    assert valid_degrees(get_model("qwen3-30b-a3b"))[1][-1] == 128


@pytest.mark.parametrize("argv, words", [
    (["--model", "llama3-8b", "--world", "12", "--tp", "3"], ["--tp 3 does not divide heads=32", "[1, 2, 4, 8]"]),
    (["--model", "llama3-8b", "--world", "16", "--tp", "16"], ["--tp 16 does not divide kv_heads=8"]),
    (["--model", "llama3-8b", "--world", "12", "--tp", "8"], ["--world 12 is not divisible by --tp 8"]),
    (["--model", "qwen3-30b-a3b", "--world", "16", "--tp", "2", "--ep", "16"],
     ["--world 16 is not divisible by --tp x --ep = 32"]),
    (["--model", "qwen3-30b-a3b", "--world", "12", "--ep", "3"], ["--ep 3 does not divide the 128 routed experts"]),
    (["--model", "llama3-8b", "--world", "8", "--ep", "2"], ["--ep 2", "dense", "--ep 1"]),
    (["--model", "llama3-8b", "--tp", "0"], ["--tp must be a positive integer"]),
    (["--model", "gpt-oss-20b", "--world", "16", "--tp", "16"], ["kv_heads=8"]),
])
def test_bad_splits_give_clear_errors(capsys, argv, words):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def _dims_of(mesh):
    return dict(zip(mesh["dim_names"], mesh["shape"]))


@pytest.mark.parametrize("model, world, tp, ep, gran", [
    ("llama3-70b", 1024, 1, 1, "rows:128"),
    ("llama3-8b", 64, 8, 1, "rows:128"),
    ("qwen3-30b-a3b:fused", 64, 2, 4, "rows:128"),
    ("deepseek-v3", 256, 4, 8, "rows:128"),
])
def test_suggest_recipes_compile_and_match_the_mesh(capsys, model, world, tp, ep, gran):
    assert main(["plan", "--model", model, "--world", str(world), "--tp", str(tp), "--ep", str(ep),
                 "--granularity", gran, "--suggest", "--json"]) == 0
    (cell,) = json.loads(capsys.readouterr().out)
    sugg = cell["suggestions"]
    assert {s["kind"] for s in sugg} == {"hsdp", "merge"}
    for s in [dict(cell, kind="plan", value=None, replicas=1)] + sugg:
        compile(s["recipe"], "<recipe>", "exec")  # valid Python
        mesh = s["mesh"]
        assert math.prod(mesh["shape"]) == world
        d = _dims_of(mesh)
        assert d.get("tp", 1) == tp and d.get("ep", 1) == ep
        shape_line = f'init_device_mesh("cuda", {tuple(mesh["shape"])!r}, mesh_dim_names={tuple(mesh["dim_names"])!r})'
        assert shape_line in s["recipe"]
        if s["kind"] == "hsdp":  # D dense ranks per shard group, W/T/D replicas
            assert d["replicate"] == s["replicas"] == world // tp // s["value"]
            assert d["shard"] * ep == s["value"] and mesh["dense_shard_ranks"] == s["value"]
            assert "fully_shard(block, mesh=mesh" in s["recipe"]
        else:
            assert d["dp"] * ep == world // tp and "replicate" not in d
        if s["kind"] == "merge":
            assert f"fully_shard([mod for unit in units[j:j + {s['value']}] for mod in unit]" in s["recipe"]
        if ep > 1:
            assert f"set_gradient_divide_factor({world // tp})" in s["recipe"]
            assert "_flatten(" in s["recipe"]
        if tp > 1:
            assert 'parallelize_module(model, mesh["tp"]' in s["recipe"]


def test_text_output_prints_the_recipes(capsys):
    assert main(["plan", "--model", "llama3-70b", "--world", "1024", "--granularity", "rows:128", "--suggest"]) == 0
    out = capsys.readouterr().out
    assert 'mesh = init_device_mesh("cuda", (8, 128), mesh_dim_names=(\'replicate\', \'shard\'))' in out
    assert "fully_shard(block, mesh=mesh)" in out and "# way out 1 of" in out


def test_mesh_layout_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of ep"):
        mesh_layout(16, 1, 4, hsdp=2)
    assert mesh_layout(16, 2, 2, hsdp=4).shape == (2, 2, 2, 2)


# -- the recipes, executed: real init_device_mesh and parallelize_module on tiny HF models ----
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
QWEN = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=48,
            tie_word_embeddings=False)
EXEC_CASES = [  # model_type, config, W, tp, ep, hsdp, merge
    ("llama", LLAMA, 8, 2, 1, None, 1),
    ("llama", LLAMA, 8, 2, 1, 2, 1),
    ("llama", LLAMA, 8, 1, 1, None, 2),
    ("llama", dict(LLAMA, tie_word_embeddings=True), 8, 2, 1, 2, 1),
    ("llama", dict(LLAMA, tie_word_embeddings=True), 8, 1, 1, None, 2),
    ("qwen3_moe", QWEN, 8, 2, 2, None, 1),
    ("qwen3_moe", QWEN, 8, 1, 2, 4, 1),
    ("qwen3_moe", QWEN, 8, 2, 4, None, 2),
]


def _expected_calls(model, W, T, E, hsdp, merge):
    """What each fully_shard call must take (names -> TP/EP-local shapes) and its mesh shape."""
    dims = ParallelDims(W, T, E)
    groups = local_groups(model, dims)
    out = []
    for kind, dp in (("experts", dims.expert_dp), ("dense", dims.dense_dp)):  # experts are wrapped first
        sec = [(g.name, g.tensors) for g in groups if g.kind == kind]
        if not sec:
            continue
        if hsdp:
            mesh = [dims.dense_dp // hsdp, hsdp // (dims.dense_dp // dp)]
        else:
            mesh = [dp]
        for _, tensors in merge_groups(sec, merge):
            out.append(({t.name: list(t.shape) for t in tensors}, mesh))
    return out


def test_recipes_realise_the_plan_on_hf_models():
    pytest.importorskip("transformers")
    cases, expected = [], []
    for mt, hf, W, T, E, hsdp, merge in EXEC_CASES:
        model = model_from_config(mt, hf_to_catalog(dict(hf, model_type=mt)))
        cases.append({"hf": hf, "model_type": mt, "world": W, "ep": E,
                      "recipe": recipe(module_map(model), W, T, E, hsdp=hsdp, merge=merge)})
        expected.append(_expected_calls(model, W, T, E, hsdp, merge))
    cases += [dict(c, real=True) for c in cases]  # and once more with torch's own fully_shard
    script = Path(__file__).with_name("_plan_recipe_exec.py")
    proc = subprocess.run([sys.executable, str(script)], input=json.dumps(cases), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    recorded, real = results[:len(EXEC_CASES)], results[len(EXEC_CASES):]
    for (mt, hf, W, T, E, hsdp, merge), calls, want, params in zip(EXEC_CASES, recorded, expected, real):
        label = f"{mt} W={W} tp={T} ep={E} hsdp={hsdp} merge={merge}"
        root = calls.pop()
        assert root["params"] == {}, label  # every parameter sits in a planned group
        assert [c["params"] for c in calls] == [w for w, _ in want], label
        assert [c["mesh_shape"] for c in calls] == [m for _, m in want], label
        for c in calls:
            is_expert = any(".experts." in n for n in c["params"])
            assert c["divide_factor"] == (W // T if is_expert and E > 1 else None), label
        # torch's FSDP2 took every call; each parameter ends on its group's mesh (+ tp if TP-split)
        model = model_from_config(mt, hf_to_catalog(dict(hf, model_type=mt)))
        split = {t.name for g in model.groups for t in g.tensors if t.tp_dim is not None and T > 1}
        want_mesh = {n: mesh + ([T] if n in split else []) for names, mesh in want for n in names}
        assert {n: p["mesh_shape"] for n, p in params.items()} == want_mesh, label


def test_help_names_the_flags(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "--tp" in out and "--ep" in out and "world/(tp*ep)" in out
