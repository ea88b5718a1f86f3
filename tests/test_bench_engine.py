"""`python -m ragged_fsdp bench --quick` runs end to end (one W=2 launch, tiny models): every
framework and workload is timed and measured, the memory composition at each peak sums to the
peak, and the JSON and PNG are written. No timing is asserted."""
import json

from ragged_fsdp.bench.engine import MEM_KINDS, VARIANTS, WORKLOADS
from ragged_fsdp.cli import main


def test_bench_quick_end_to_end(tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench", "--quick", "--world", "2", "--out", str(out), "--png", str(png)]) == 0
    saved = json.loads(out.read_text())
    report = saved["by_world"]["2"]
    assert saved["report"] == report  # the per-workload shape earlier readers expect
    assert set(report) == set(WORKLOADS)
    for kind, r in report.items():
        assert set(r["step_s"]) == set(VARIANTS)
        assert all(t > 0 for ts in r["step_s"].values() for t in ts)
        for v, comp in r["peak_composition"].items():
            assert comp["Total"] > 0 and sum(comp[k] for k in MEM_KINDS) == comp["Total"], (kind, v, comp)
            assert r["peak_bytes"][v] == comp["Total"]
            assert comp["Parameter"] > 0 and comp["Optstate"] > 0, (kind, v, comp)
        # ragged_fsdp's all-gather output is the parameters: it copies nothing itself
        assert sum(r["copy_bytes"]["ragged_fsdp"].values()) <= sum(r["copy_bytes"]["local"].values())
    printed = capsys.readouterr().out
    assert "memory live at the peak" in printed and "fsdp1" in printed and "ddp" in printed
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert png.stat().st_size > 1000
