"""benchmarks/scale.py: its layout math against what DCP really gets, the planner it times, and its
report. No timing is asserted (the machine is shared): only that the numbers agree.
"""

from __future__ import annotations

import math

import pytest
import torch

import _benchmarks  # noqa: F401  (benchmarks/ on sys.path)
from scale_layout import (
    fsdp2_chunk, items_per_rank, loglog_exponent, module_order, ragged_chunks, ragged_plans, subset_model, wrap_groups,
)
from ragged_fsdp.run_counts import RunCounts

W = 64


@pytest.fixture(scope="module")
def two_layers():
    groups = wrap_groups(subset_model("llama3-70b", [0, 1]))
    return groups, {g: ragged_plans(groups, W, g) for g in ("row", "rows:128", None)}


def test_wrap_groups_follow_named_parameters_order():
    assert module_order(["b.x.w", "a", "b.y", "b.x.v", "c.w"]) == ["a", "b.y", "b.x.w", "b.x.v", "c.w"]
    groups = wrap_groups(subset_model("deepseek-v3", [0, 3], experts=2))
    assert [g.prefix for g in groups] == ["model.layers.0", "model.layers.3", ""]
    assert groups[-1].names == ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
    assert sum(1 for n in groups[1].names if ".experts." in n) == 2 * 3


def test_items_per_rank_is_the_chunks_and_plans_match_placements(two_layers):
    groups, plans = two_layers
    for gran, ps in plans.items():
        chunks = ragged_chunks(groups, ps, W)
        assert items_per_rank(groups, ps, W) == [len(chunks[r]) for r in range(W)]
        for wg, p in zip(groups, ps):  # the bench's span-only placement is the planner's one
            for n, s in zip(wg.names, wg.shapes):
                full = p.placement(n)
                assert isinstance(full.local_units, RunCounts)
                assert [full.local_boxes(s, r) for r in range(W)] == \
                    [[(o, z) for f, o, z in chunks[r] if f == wg.fqn(n)] for r in range(W)]
    assert items_per_rank(groups, None, W) == [sum(len(g.names) for g in groups)] * W


def test_fsdp2_chunk_is_torch_chunk():
    for d0, w in ((10, 4), (3, 8), (8192, 16384), (7, 7)):
        rows = torch.arange(d0).chunk(w)
        for r in range(w):
            off, size = fsdp2_chunk((d0, 5), w, r)
            want = rows[r] if r < len(rows) else torch.empty(0)
            assert size == (len(want), 5)
            if len(want):
                assert off == (int(want[0]), 0)


def test_metadata_covers_every_element_once(two_layers):
    import scale_dcp
    from ragged_fsdp.checkpoint.scale_planner import ScaleSavePlanner, flat_interval
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    groups, plans = two_layers
    shapes = {wg.fqn(n): s for wg in groups for n, s in zip(wg.names, wg.shapes)}
    for gran, ps in plans.items():
        local = scale_dcp.save_plans(ragged_chunks(groups, ps, W), shapes)
        ours = ScaleSavePlanner(flatten_state_dict=False).create_global_plan(local)
        theirs = DefaultSavePlanner(flatten_state_dict=False).create_global_plan(local)
        assert ours == theirs  # same global plans, same metadata
        md = ours[1].state_dict_metadata
        assert set(md) == set(shapes)
        for fqn, v in md.items():
            ivs = sorted(flat_interval(v.size, c.offsets, c.sizes) for c in v.chunks)
            assert ivs[0][0] == 0 and ivs[-1][1] == math.prod(shapes[fqn])
            assert all(a[1] == b[0] for a, b in zip(ivs, ivs[1:])), fqn  # no gap, no overlap


def test_scale_planner_refuses_what_dcp_refuses():
    import scale_dcp
    from ragged_fsdp.checkpoint.scale_planner import ScaleSavePlanner

    shapes = {"w": (4, 6)}
    overlap = scale_dcp.save_plans({0: [("w", (0, 0), (3, 6))], 1: [("w", (2, 0), (2, 6))]}, shapes)
    with pytest.raises(ValueError, match="key:w has overlapping chunks"):
        ScaleSavePlanner(flatten_state_dict=False).create_global_plan(overlap)
    gap = scale_dcp.save_plans({0: [("w", (0, 0), (1, 6))], 1: [("w", (2, 0), (2, 6))]}, shapes)
    with pytest.raises(ValueError, match="invalid fill"):
        ScaleSavePlanner(flatten_state_dict=False).create_global_plan(gap)
    # boxes that are not runs of the flattening go to DCP's own check
    cols = scale_dcp.save_plans({0: [("w", (0, 0), (4, 3))], 1: [("w", (0, 2), (4, 4))]}, shapes)
    with pytest.raises(ValueError, match="overlapping"):
        ScaleSavePlanner(flatten_state_dict=False).create_global_plan(cols)


def test_loglog_exponent():
    assert loglog_exponent([1024, 4096, 16384], [2 * w ** 1.5 for w in (1024, 4096, 16384)]) == pytest.approx(1.5)
    assert loglog_exponent([1024], [1.0]) is None


def test_setup_on_the_fake_group_matches_the_layout_math():
    """W=64 fake ranks (first, middle, last; own processes) of a 2-block Llama-3-70B: the DCP
    chunks of the real fully_shard-ed state dicts are what the layout math says."""
    from scale import CONFIGS, run_setup

    rows = run_setup(["llama3-70b"], [W], CONFIGS)
    assert {(r["config"], r["rank"]) for r in rows} == {(c[0], r) for c in CONFIGS for r in (0, W // 2, W - 1)}
    for r in rows:
        assert "error" not in r, r
        assert r["layout_math_matches_dcp"], r
        if r["config"].startswith("ours"):  # one 3 x int64 all-reduce per group, whatever W is
            assert r["agree_sent_bytes"] == r["agree_received_bytes"] == 24 * r["agree_collectives"]
        else:
            assert r["agree_collectives"] == 0


def test_planning_rows_and_report():
    from scale import CONFIGS, run_planning
    from scale_report import summarize, table

    rows = run_planning(["llama3-70b"], [16, 32], CONFIGS[:1] + CONFIGS[2:], load_to=8)
    summary = summarize([], rows)
    cells = {(c["config"], c["world"]): c for c in summary["cells"]}
    assert cells[("fsdp2", 32)]["items_max"] == 723
    ours = cells[("ours-row", 32)]
    assert ours["coord_basis"] == "measured"
    assert ours["load"]["world"] == 8 and ours["local_load"]["parts_read_max"] >= 1
    assert "growth with W" in table(summary)


def test_sim_host_costs_follow_the_measured_power_law(tmp_path, monkeypatch):
    from scale_report import sim_table
    from ragged_fsdp.sim import host

    cells = [{"model": "llama3-70b", "config": "ours-row", "world": w, "setup_cpu_s": 2.0 * (w / 1024),
              "coord_cpu_s": 1.0 * (w / 1024) ** 1.5} for w in (1024, 4096, 16384)]
    exps = [{"model": "llama3-70b", "config": "ours-row", "metric": "setup_cpu_s", "exponent": 1.0},
            {"model": "llama3-70b", "config": "ours-row", "metric": "coord_cpu_s", "exponent": 1.5}]
    path = tmp_path / "host_costs.json"
    import json

    path.write_text(json.dumps(sim_table({"cells": cells, "exponents": exps})))
    monkeypatch.setattr(host, "_DATA", path)
    host._table.cache_clear()
    try:
        at = host.host_costs("llama3-70b", "ragged", 16384)
        assert at["startup_cpu_s"] == pytest.approx(32.0) and "measured on llama3-70b" in at["basis"]
        far = host.host_costs("llama3-70b", "ragged", 65536)  # beyond the bench: the fit, and it says so
        assert far["save_plan_cpu_s"] == pytest.approx(16 ** 1.5 * 4 ** 1.5) and "fit" in far["basis"]
        other = host.host_costs("llama3-8b", "ragged", 4096, tensors=723 // 2)
        assert other["startup_cpu_s"] == pytest.approx(8.0 / 2, rel=0.01) and "scaled from llama3-70b" in other["basis"]
        none = host.host_costs("llama3-70b", "fsdp1", 4096)
        assert none["startup_cpu_s"] is None and "not measured" in none["basis"]
    finally:
        host._table.cache_clear()
