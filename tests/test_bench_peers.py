"""The peers bench without the peers: the page renders from its JSON (each error verbatim, each
skipped peer with its pip line), the loss comparison flags a step off the reference, a peer
that is not installed is skipped, and one tiny W=2 launch of ragged_fsdp and FSDP2 matches the
single-process losses (DeepSpeed and Megatron-FSDP run there too only where installed)."""
import importlib.util
import json

import pytest

import _benchmarks  # noqa: F401  (benchmarks/ on sys.path)
import peers
import peers_frameworks
from peers_render import render_page, render_table

ERR = ("builtins.AssertionError (megatron_fsdp 0.6.1):\n  File \"megatron_fsdp/megatron_fsdp.py\", line 234\n"
       "AssertionError: Torch not compiled with CUDA enabled")


def _doc():
    ok = {"world": 2, "workload": "dense", "status": "ok", "loss": [7.5, 7.25], "loss_ref": [7.5, 7.25],
          "max_rel_err": 0.0, "agrees": True, "step_ms": 12.5, "step_s": [0.010, 0.015], "vs_fsdp2": 1.0, "peak_bytes": 3 * 2**20,
          "live_bytes": 2**20, "comm_bytes": 2**19}
    rows = [dict(ok, framework="fsdp2", version="2.13.0"),
            dict(ok, framework="ragged_fsdp", version="0.1.0", vs_fsdp2=0.8, agrees=False, max_rel_err=2e-3),
            {"world": 2, "workload": "dense", "framework": "megatron_fsdp", "version": "0.6.1", "status": "error",
             "reason": ERR},
            {"world": 2, "workload": "moe", "framework": "megatron_fsdp", "version": "0.6.1", "status": "error",
             "reason": "  " + ERR.replace("\n", "\n  ")},  # the same error, indented otherwise
            {"world": 2, "workload": "dense", "framework": "deepspeed_zero3", "version": None, "status": "skipped",
             "reason": peers_frameworks.install_hint("deepspeed_zero3")}]
    meta = {"command": "python benchmarks/peers.py --world 2", "date": "2026-12-01 11:00 UTC",
            "versions": {"torch": "2.13.0", "ragged_fsdp": "0.1.0", "deepspeed_zero3": None, "megatron_fsdp": "0.6.1"},
            "machine": {"cores": 2, "gpu": None, "platform": "Linux x86_64"}, "conditions": "loaded by other work",
            "worlds": [2], "check_steps": 2, "rounds": 1, "steps": 1, "rtol": 1e-4, "lr": 1e-4}
    return {"metadata": meta, "rows": rows}


def test_render_page_has_conditions_table_and_verbatim_errors():
    page = render_page(_doc(), "# Title", "closing note")
    assert page.startswith("# Title")
    for needle in ("python benchmarks/peers.py --world 2", "2026-12-01", "torch 2.13.0", "Megatron-FSDP 0.6.1", "DeepSpeed ZeRO-3 not installed", "2 CPU cores",
                   "no GPU", "loaded by other work", "closing note"):
        assert needle in page, needle
    table = render_table(_doc())
    lines = table.splitlines()
    assert len(lines) == 2 + 5 and len({line.count("|") for line in lines}) == 1  # every row has every column
    assert "| 2 | dense | ragged_fsdp | 0.1.0 | 7.250000 / 7.250000 | NO (2.0e-03) | 12 (10-15) | 0.80 | 3.00 | 1.00 | 0.50 |" \
        in lines
    # one section per distinct reason, naming every world/workload it hit, the error verbatim
    assert page.count("### Megatron-FSDP 0.6.1: did not run (W=2 dense, W=2 moe)") == 1
    assert ERR in page
    assert "pip install torch==2.13.0 deepspeed" in page
    assert "1 of 2 runs follow the single-process losses" in page and "ragged_fsdp 2.0e-03" in page


def test_compare_flags_a_step_off_the_reference():
    assert peers.compare([1.0, 2.0], [1.0, 2.0], 1e-4) == {"max_rel_err": 0.0, "agrees": True}
    off = peers.compare([1.0, 2.001], [1.0, 2.0], 1e-4)
    assert not off["agrees"] and off["max_rel_err"] == pytest.approx(5e-4)
    with pytest.raises(ValueError, match="reference steps"):
        peers.compare([1.0], [1.0, 2.0], 1e-4)


def test_missing_peer_is_skipped_with_install_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "megatron_fsdp" else real(name, *a))
    assert peers_frameworks.availability("megatron_fsdp") == (False, None)
    assert "pip install torch==2.13.0 megatron-fsdp" in peers_frameworks.install_hint("megatron_fsdp")
    with pytest.raises(ValueError, match="unknown framework 'zero4'"):
        peers_frameworks.availability("zero4")
    with pytest.raises(SystemExit, match="--models nope"):
        peers.main(["--models", "nope"])


def test_render_only_rewrites_the_page(tmp_path):
    src, md = tmp_path / "peers.json", tmp_path / "peers.md"
    src.write_text(json.dumps(_doc()))
    assert peers.main(["--render", str(src), "--md", str(md)]) == 0
    assert md.read_text() == render_page(_doc(), peers.INTRO, peers.NOTES)


def test_quick_launch_matches_single_process(tmp_path):
    out, md = tmp_path / "p.json", tmp_path / "p.md"
    assert peers.main(["--quick", "--world", "2", "--models", "dense", "--out", str(out), "--md", str(md),
                       "--frameworks", "ragged_fsdp,fsdp2,deepspeed_zero3"]) == 0
    doc = json.loads(out.read_text())
    rows = {r["framework"]: r for r in doc["rows"]}
    for fw in ("ragged_fsdp", "fsdp2"):
        r = rows[fw]
        assert r["status"] == "ok" and r["agrees"], r
        assert len(r["loss"]) == doc["metadata"]["check_steps"] and r["step_ms"] > 0
        assert r["live_bytes"] > 0 and r["peak_bytes"] > 0
        c = r["comm_by_kind"]  # ragged_fsdp may reduce-scatter as all-to-alls
        assert c["all_gather"] > 0 and c["reduce_scatter"] + c["all_to_all"] > 0
    assert rows["fsdp2"]["vs_fsdp2"] == 1.0
    ds = rows["deepspeed_zero3"]
    if importlib.util.find_spec("deepspeed") is None:
        assert ds["status"] == "skipped" and "pip install" in ds["reason"]
    else:
        assert ds["status"] in ("ok", "error"), ds
    assert doc["metadata"]["versions"]["torch"] and doc["metadata"]["machine"]["cores"] >= 1
    assert "## Results" in md.read_text()
