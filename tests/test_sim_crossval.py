"""simulate honest where it was not fitted (issue 56): every GPU on its own evidence, a GPU
without evidence refused (never borrowed), the leave-one-source-out cross-validation rerun
on the stored published points and its bands' coverage, NVFP4 on the leading layers only,
and the lent-GPU calibration dry-run on CPU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ragged_fsdp.cli import main as cli_main
from ragged_fsdp.sim import crossval, fitted, validate
from ragged_fsdp.sim.bands import band_for, groups_of, load_bands
from ragged_fsdp.sim.calibrate_gpu import calibrate_device
from ragged_fsdp.sim.mesh import parse_mesh
from ragged_fsdp.sim.options import Recipe
from ragged_fsdp.sim.profiles import PROFILES, UNCALIBRATED, get_profile, profile_sources
from ragged_fsdp.sim.simulate import Scenario, simulate

RECORD = Path(__file__).resolve().parents[1] / "docs" / "data" / "sim_validation.json"


@pytest.fixture(scope="module")
def cv():
    return crossval.run()


def test_crossvalidation_reproduces_the_stored_bands(cv):
    stored = load_bands()
    assert stored["level"] == cv["level"] and stored["sources"] == cv["sources"]
    assert set(stored["bands"]) == set(cv["bands"])
    for g, st in cv["bands"].items():
        assert st["n"] == stored["bands"][g]["n"], g
        assert st["band_log"] == pytest.approx(stored["bands"][g]["band_log"], rel=1e-3), g
    # the band rule covers >= 90% of the points whose source no band saw (calibrated level)
    assert cv["coverage"]["fraction"] >= crossval.TARGET
    # every source held out once; most points predicted
    assert len(cv["sources"]) >= 10 and sum(r["error"] is not None for r in cv["rows"]) >= 60


def test_held_out_gpu_without_another_source_is_not_borrowed(cv):
    # MI300X, H200 and A100 each have one source: held out, their points are not predicted
    # from another GPU's efficiency but reported as having no evidence
    by_id = {r["id"]: r for r in cv["rows"]}
    for pid in ("ao-mi300x-8b-tensorwise", "trainy-h200-8n", "tt-perf-a100-l3-8b-op"):
        assert by_id[pid]["predicted"] is None and by_id[pid]["no_evidence"] == [f"efficiency:{by_id[pid]['gpu']}"]
    # a GPU with two sources is predicted across them
    assert by_id["tt-mx-gb200-scout-bf16"]["predicted"] is not None


def test_bands_cover_the_validation_points():
    # the production predictions of every point no constant was fitted on, against the
    # stored band of its kind: at least 9 in 10 covered (measured: 63 of 63)
    rows = [r for r in json.loads(RECORD.read_text())["rows"] if r["role"] == "validate"]
    table = load_bands()["bands"]
    hit = [abs(math.log1p(r["tokens_per_s_error"])) <= band_for(groups_of(r["gpu"], r["recipe"], r["mesh"]), table)[0]
           for r in rows]
    assert len(rows) == 63 and sum(hit) >= 0.9 * len(rows)


def test_every_builtin_gpu_has_its_own_fit_point():
    pts = {p["id"]: p for p in validate.load_points()["points"]}
    for name in PROFILES:
        pid = fitted.FIT_POINTS[f"efficiency:{name}"]
        assert pts[pid]["gpu"] == name and pts[pid]["role"] == "fit", name
        assert PROFILES[name].efficiency == fitted.EFFICIENCY[name]
        # the profile names the source of every number in it
        src = profile_sources(PROFILES[name])
        assert pid in src["efficiency"] and src["hbm_bytes, flops, mem_bw, nvlink_bw, net_bw, gpus_per_node"]


def test_gpu_without_evidence_is_refused_or_flagged(capsys):
    assert "mi325x" in UNCALIBRATED and "mi325x" not in PROFILES
    with pytest.raises(ValueError, match="--gpu mi325x: no published training run.*--efficiency"):
        get_profile("mi325x")
    assert cli_main(["simulate", "--model", "llama3-8b", "--gpus", "8", "--gpu", "mi325x"]) == 2
    assert "none is borrowed" in capsys.readouterr().err
    # with the efficiency supplied: it runs, flagged uncalibrated, and prints no band
    prof = get_profile("mi325x", efficiency=0.3)
    assert prof.efficiency == 0.3 and prof.hbm_bytes == 256e9
    assert "no evidence" in profile_sources(prof)["efficiency"]
    sc = Scenario("llama3-8b", 8, prof, parse_mesh("dp=8", 8), "adamw", "bf16", 8192, 1, "op", None)
    u = simulate(sc, ("fsdp2",))[0].uncertainty
    assert "uncalibrated" in u["terms"]["GEMM efficiency"] and u["band"]["low"] is None
    # an overridden efficiency on a calibrated profile drops the band too
    sc = Scenario("llama3-8b", 8, PROFILES["h100"].with_overrides(efficiency=0.4), parse_mesh("dp=8", 8), "adamw",
                  "bf16", 8192, 1, "op", None)
    assert simulate(sc, ("fsdp2",))[0].uncertainty["band"]["low"] is None


def test_prediction_prints_its_band(capsys):
    assert cli_main(["simulate", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100", "--compile",
                     "--frameworks", "fsdp2"]) == 0
    out = capsys.readouterr().out
    assert "cross-validated error band: tokens/s x0." in out and "tokens/s/GPU with its band: fsdp2 " in out


def test_nvfp4_on_the_leading_layers_only():
    def run(**kw):
        sc = Scenario("llama3-8b", 4, PROFILES["gb200"], parse_mesh("dp=4", 4), "adamw", "bf16", 2048, 32, "op", None,
                      recipe=Recipe(compile=True, **kw))
        return simulate(sc, ("fsdp2",))[0].tokens_per_s_per_gpu
    bf16, full, tail = run(), run(float8="nvfp4"), run(float8="nvfp4", low_precision_layers=27)
    assert bf16 < tail < full
    assert run(float8="nvfp4", low_precision_layers=32) == pytest.approx(full)
    assert run(float8="nvfp4", low_precision_layers=0) == pytest.approx(bf16, rel=1e-9)
    with pytest.raises(ValueError, match="--low-precision-layers.*add --float8"):
        Recipe(low_precision_layers=4).check(1, 1, 1)


def test_gpu_calibration_dry_run_on_cpu(tmp_path):
    path = tmp_path / "prof.json"
    doc = calibrate_device(path, "cpu", quick=True)
    assert doc["gemm"] and doc["attention"] and doc["host_op_overhead_s"] > 0 and doc["sources"]["efficiency"]
    prof = get_profile(str(path))
    assert prof.name == "measured-cpu" and 0 < prof.efficiency <= 1
    sc = Scenario("llama3-8b", 8, prof, parse_mesh("dp=8", 8), "adamw", "bf16", 1024, 1, "op", None)
    r = simulate(sc, ("fsdp2",))[0]
    assert r.tokens_per_s_per_gpu > 0 and r.uncertainty["band"]["low"] is None


def _llama_8b(**kw):
    sc = Scenario("llama3-8b", 8, PROFILES["h100"], parse_mesh("dp=8", 8), "adamw", "bf16", 8192, 2, "none", None,
                  recipe=Recipe(**kw))
    return simulate(sc, ("fsdp2",))[0]


def test_chunked_loss_and_activation_offload_memory():
    base, chunked, off = _llama_8b(), _llama_8b(loss_chunks=8), _llama_8b(act_offload=True)
    # chunked: the loss phase holds 1/8 of the logits (bf16 logits, fp32 copy, log-softmax
    # and its gradient per element: 12 bytes x 16,384 tokens x 128,256 vocab / 8)
    loss_gib = 12 * 16384 * 128256 / 2**30
    assert base.memory_items["logits and loss"] / 2**30 == pytest.approx(loss_gib, rel=1e-6)
    assert base.memory_bytes - chunked.memory_bytes >= 0.8 * loss_gib * 7 / 8 - 1e-6
    assert chunked.tokens_per_s_per_gpu == pytest.approx(base.tokens_per_s_per_gpu)
    # offload: no saved activations resident; the PCIe copy (104 GiB each way over 51 GB/s)
    # outlasts the blocks' compute, so the step waits on it
    assert "saved activations" not in off.memory_items or off.memory_items["saved activations"] == 0
    assert off.memory_bytes < 0.4 * base.memory_bytes
    saved = base.memory_items["saved activations"]
    assert off.step_s >= base.step_s and off.step_s - base.step_s <= 2 * saved / (0.8 * 64e9) + 1e-9
    with pytest.raises(ValueError, match="--loss-chunks 0"):
        Recipe(loss_chunks=0).check(1, 1, 1)
