"""`python -m ragged_fsdp bench --quick` runs end to end (one W=2 launch, tiny models): every
framework and workload is timed and measured, the memory composition at each peak sums to the
peak, and the JSON and PNG are written. `--mesh 2x2` runs HSDP on both ragged_fsdp and FSDP2
at W=4 and counts the bytes each rank sends. No timing is asserted."""
import json

import pytest
import torch

from ragged_fsdp.bench.comm_bytes import sent_bytes
from ragged_fsdp.bench.engine import MEM_KINDS, VARIANTS, WORKLOADS
from ragged_fsdp.cli import main


def test_bench_quick_end_to_end(tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench", "--quick", "--rounds", "1", "--steps", "1", "--world", "2", "--out", str(out), "--png", str(png)]) == 0
    saved = json.loads(out.read_text())
    report = saved["by_world"]["2"]
    assert saved["report"] == report  # the per-workload shape earlier readers expect
    assert set(report) == set(WORKLOADS)
    for kind, r in report.items():
        assert set(r["step_s"]) == set(VARIANTS)
        assert all(t > 0 for ts in r["step_s"].values() for t in ts)
        lo, hi = r["vs_fsdp2_range"]["ragged_fsdp"]
        assert lo <= r["vs_fsdp2"]["ragged_fsdp"] <= hi
        for v, comp in r["peak_composition"].items():
            assert comp["Total"] > 0 and sum(comp[k] for k in MEM_KINDS) == comp["Total"], (kind, v, comp)
            assert r["peak_bytes"][v] == comp["Total"]
            assert comp["Parameter"] > 0 and comp["Optstate"] > 0, (kind, v, comp)
        # ragged_fsdp's all-gather output is the parameters: it copies nothing itself
        assert sum(r["copy_bytes"]["ragged_fsdp"].values()) <= sum(r["copy_bytes"]["local"].values())
    printed = capsys.readouterr().out
    assert "memory live at the peak" in printed and "fsdp1" in printed and "ddp" in printed
    assert "per-round range" in printed
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert png.stat().st_size > 1000
    for r in report.values():  # 1-D: no replicate dim, so no gradient all-reduce
        assert r["comm"]["ragged_fsdp"]["hsdp_segment_bytes"] == 0
        assert r["comm"]["ragged_fsdp"]["float_by_kind"]["all_reduce"] == 0
        assert r["comm"]["fsdp2"]["by_kind"]["all_gather"] > 0


def test_bench_mesh_hsdp(tmp_path, capsys):
    """`bench --world 4 --mesh 2x2`: ragged_fsdp and FSDP2 both on HSDP, one launch, tiny
    models, one step: step times, peaks and bytes sent per kind are reported; ragged_fsdp's
    gradient all-reduce sends exactly its HSDP buffers' sharded segments (an exactness check
    of the counter), and its gloo reduce-scatter (all-to-alls) exactly S-1 times that."""
    out, png = tmp_path / "mesh.json", tmp_path / "mesh.png"
    assert main(["bench", "--quick", "--rounds", "1", "--steps", "1", "--world", "4", "--mesh", "2x2", "--frameworks", "ragged_fsdp,fsdp2",
                 "--out", str(out), "--png", str(png)]) == 0
    saved = json.loads(out.read_text())
    assert saved["config"]["mesh"] == [2, 2]
    report = saved["by_world"]["4"]
    assert set(report) == set(WORKLOADS)
    for kind, r in report.items():
        assert set(r["step_s"]) == {"ragged_fsdp", "fsdp2"} and r["ratio_vs_fsdp2"] > 0
        assert r["peak_bytes"]["ragged_fsdp"] > 0 and r["peak_bytes"]["fsdp2"] > 0
        for v, c in r["comm"].items():
            assert c["calls"] > 0 and c["calls"] == c["c10d_calls"], (kind, v, c)  # no collective missed
            assert len(set(c["total_by_rank"])) == 1, (kind, v, c["total_by_rank"])
            assert c["by_kind"]["all_gather"] > 0 and c["by_kind"]["all_reduce"] > 0, (kind, v)
            groups = {row["group"] for row in c["rows"]}
            assert groups <= {"shard", "replicate"}, groups
        rag, fs = r["comm"]["ragged_fsdp"], r["comm"]["fsdp2"]
        assert fs["by_kind"]["reduce_scatter"] > 0 and rag["by_kind"]["all_to_all"] > 0
        seg = rag["hsdp_segment_bytes"]
        assert seg > 0 and rag["float_by_kind"]["all_reduce"] == seg, (kind, rag["float_by_kind"], seg)
        assert rag["float_by_kind"]["all_to_all"] == (2 - 1) * seg, (kind, rag["float_by_kind"], seg)
        # every float all-reduce of either framework runs on the replicate dim
        for c in (rag, fs):
            assert all(row["group"] == "replicate" for row in c["rows"]
                       if row["kind"] == "all_reduce" and row["dtype"].startswith("float"))
    printed = capsys.readouterr().out
    assert "bytes sent per step per rank" in printed and "2x2" in printed and "fsdp1" not in printed
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("argv,match", [
    (["--world", "2", "--mesh", "2x2"], "needs 4 ranks"),
    (["--mesh", "2x2", "--frameworks", "ragged_fsdp,fsdp1"], "fsdp1 take no 2-D mesh"),
    (["--mesh", "2by2"], "expected RxS"),
])
def test_bench_mesh_bad_arguments(argv, match):
    with pytest.raises(SystemExit, match=match):
        main(["bench", "--quick", *argv])


def test_sent_bytes_rules():
    """The counting rule, collective by collective (W=4, this rank 1, fp32)."""
    x = torch.zeros(12)
    assert sent_bytes("all_gather_single", (torch.zeros(48), x), {}, 4, 1) == 48
    assert sent_bytes("reduce_scatter_tensor", (x, torch.zeros(48)), {}, 4, 1) == 3 * 48
    # all-to-all: splits addressed to other ranks (own split, index 1, excluded); rows of 3
    m = torch.zeros(10, 3)
    assert sent_bytes("all_to_all_single", (m, m, [1, 2, 3, 4], [4, 3, 2, 1]), {}, 4, 1) == (4 + 2 + 1) * 3 * 4
    assert sent_bytes("all_to_all_single", (m, m), {"input_split_sizes": [0, 5, 5, 0]}, 4, 1) == 5 * 3 * 4
    assert sent_bytes("all_to_all", ([x] * 4, [torch.zeros(k) for k in (1, 2, 3, 4)]), {}, 4, 1) == (1 + 3 + 4) * 4
    assert sent_bytes("all_reduce", (x,), {}, 4, 1) == 48
    assert sent_bytes("all_reduce", (x.bfloat16(),), {}, 4, 1) == 24
    assert sent_bytes("all_reduce", (x,), {}, 1, 0) == 0  # a group of one sends nothing


def test_sent_bytes_rooted_rules():
    """Rooted collectives and point-to-point, with group ranks as the root (no process group
    needed): the root of a broadcast / scatter sends, every other rank of a reduce / gather."""
    x = torch.zeros(12)
    assert sent_bytes("broadcast", (x,), {"group_src": 1}, 4, 1) == 48
    assert sent_bytes("broadcast", (x,), {"group_src": 0}, 4, 1) == 0
    assert sent_bytes("reduce", (x,), {"group_dst": 0}, 4, 1) == 48
    assert sent_bytes("gather", (x,), {"group_dst": 1}, 4, 1) == 0
    assert sent_bytes("scatter", (x, [x] * 4), {"group_src": 1}, 4, 1) == 3 * 48
    assert sent_bytes("send", (x, 0), {}, 4, 1) == 48 and sent_bytes("recv", (x, 0), {}, 4, 1) == 0
