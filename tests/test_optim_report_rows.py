"""optim_report's flat rows: the shape docs/optimizers.md's bench blocks read (no ranks spawned)."""

import _benchmarks  # noqa: F401  (benchmarks/ on sys.path)
import render
from optim_report import flat_rows


def _report(world=2):
    muon = {"ns_flops_per_rank": [3.0, 1.0], "ns_flops_max_over_mean": 1.5,
            "bytes_sent_per_rank": [10.0, 30.0], "allgather_bytes_sent_per_rank": [100.0, 80.0],
            "bytes_ratio_vs_allgather": 40 / 180, "step_s": 0.02, "step_ratio_vs_adamw": 2.0, "matrices": 7}
    shampoo = {"max_preconditioner_dim": 128, "precondition_frequency": 10, "step_s_no_root": 0.02,
               "step_s_with_root": 0.2, "step_s_amortised": 0.038, "step_ratio_vs_adamw_no_root": 2.0,
               "step_ratio_vs_adamw_with_root": 20.0, "step_ratio_vs_adamw_amortised": 3.8,
               "eigh_flops_per_rank": [2e9, 1e9], "eigh_flops_max_over_mean": 4 / 3,
               "state_bytes_per_rank": [2**20, 2**21], "state_bytes": 3 * 2**20, "adamw_state_bytes": 2**20,
               "state_ratio": 3.0, "tiles": 65, "tiles_cut_by_fsdp2_shard0": 40}
    return {"distributed": {"world": world, "adamw_step_s": 0.01, "muon": {"whole": muon, "split": dict(muon, matrices=5)},
                            "adamw8bit": {"step_s": 0.03, "step_ratio_vs_adamw": 3.0, "state_bytes": 256.0,
                                          "adamw_state_bytes": 1024.0, "state_ratio": 0.25, "params": 1000},
                            "shampoo": shampoo}}


def test_flat_rows_cover_every_table():
    rows = flat_rows(_report())
    assert [r["layout"] for r in rows["muon"]] == ["whole", "split"]
    assert rows["muon"][0]["bytes_sent_max"] == 30.0 and rows["muon"][0]["allgather_bytes_sent_max"] == 100.0
    assert [r["rank"] for r in rows["shampoo_ranks"]] == [0, 1]
    assert rows["shampoo_ranks"][1] == {"rank": 1, "eigh_flops": 1e9, "state_bytes": 2**21}
    assert [r["step_s"] for r in rows["shampoo_steps"]] == [0.02, 0.2, 0.038]
    assert rows["shampoo"]["world"] == 2 and rows["shampoo"]["params"] == 1000
    assert rows["adamw8bit"]["state_ratio"] == 0.25
    assert "loss" not in rows  # --skip-loss: no loss rows


def test_flat_rows_render(tmp_path):
    import json

    (tmp_path / "r.json").write_text(json.dumps({"meta": {"command": "c", "date": "d", "torch": "t", "cpu_cores": 2},
                                                 "rows": flat_rows(_report())}))
    page = tmp_path / "p.md"
    page.write_text("<!-- bench: r.json rows=rows.shampoo_ranks\n| rank | GFLOP | MiB |\n"
                    "| {rank} | {eigh_flops*1e-9:.3f} | {state_bytes:mib} |\n-->\n<!-- /bench -->\n")
    out = render.render_page(page.read_text(), page)
    assert "| 0 | 2.000 | 1.00 |" in out and "| 1 | 1.000 | 2.00 |" in out
