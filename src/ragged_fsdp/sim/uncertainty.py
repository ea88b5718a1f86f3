"""What a prediction rests on, and how far off it may be: for one scenario, each cost term
that enters it and where its number comes from (fitted on which published point, a spec
sheet, a cited measurement, or assumed), and the tokens/s error band that leave-one-source-
out cross-validation earned for runs of its kind (:mod:`.crossval`, ``data/error_bands.json``).
Printed by ``simulate`` with every prediction and carried in its JSON."""

from __future__ import annotations

import math

from . import fitted
from .bands import MIN_GROUP, band_for, groups_of, load_bands
from .options import Recipe

__all__ = ["uncertainty", "band"]

_BANDS: dict = {}


def _bands() -> dict:
    if not _BANDS:
        _BANDS.update(load_bands())
    return _BANDS


def _fit(key: str) -> str:
    return f"fitted on published point {fitted.FIT_POINTS[key]}"


def band(profile_name: str, efficiency: float, recipe: Recipe, moe: bool, mesh: dict) -> dict:
    """The cross-validated tokens/s band of a run: ``low`` / ``high`` are factors on the
    prediction; ``None`` factors where no band applies (and ``why``)."""
    doc = _bands()
    fit_eff = fitted.EFFICIENCY.get(profile_name)
    if fit_eff is None:
        return {"low": None, "high": None, "why": f"{profile_name}: not a calibrated built-in profile (its efficiency "
                "is supplied or measured, not fitted on published runs), so no cross-validated band applies"}
    if not math.isclose(efficiency, fit_eff, rel_tol=1e-3):
        return {"low": None, "high": None, "why": f"efficiency overridden ({efficiency:g}, fitted {fit_eff:g}): the "
                "cross-validated band is of the fitted profile"}
    if not doc:
        return {"low": None, "high": None, "why": "no error_bands.json (run python -m ragged_fsdp.sim.crossval)"}
    mesh_s = ",".join(f"{k}={v}" for k, v in mesh.items())
    groups = groups_of(profile_name, {"float8": recipe.float8}, mesh_s)
    q, src = band_for(groups, doc["bands"])
    own = doc["bands"].get(f"gpu:{profile_name}", {"n": 0})
    note = (f"{profile_name}: {own['n']} cross-validated points" if own["n"] >= MIN_GROUP else
            f"{profile_name}: too few points from a second source to cross-validate on this GPU alone "
            f"({own['n']}); band from the feature groups and all GPUs")
    return {"low": math.exp(-q), "high": math.exp(q), "from": src, "level": doc["level"],
            "coverage": doc["coverage"]["fraction"], "groups": groups, "why": note}


def uncertainty(profile_name: str, recipe: Recipe, moe: bool, ep: int, efficiency: float | None = None,
                mesh: dict | None = None) -> dict:
    terms: dict[str, str] = {}
    key = f"efficiency:{profile_name}"
    if key in fitted.FIT_POINTS:
        terms["GEMM efficiency"] = _fit(key) + f" (a run on {profile_name} itself)"
    else:
        terms["GEMM efficiency"] = (f"from the profile {profile_name!r}: supplied or measured, not fitted on a "
                                    "published run (uncalibrated)")
    terms["GEMM shape saturation"] = "assumed (half rate at a 64-element dim)"
    terms["attention rate"] = _fit("attention_rate")
    terms["peaks, bandwidths, latencies"] = "spec sheets; NCCL latency orders of magnitude (assumed)"
    if recipe.compile:
        terms["compile"] = _fit("compile_speedup")
    if recipe.float8 in ("tensorwise", "rowwise", "mxfp8"):
        terms[f"{recipe.float8} GEMM gain"] = _fit(f"float8_speedup:{recipe.float8}")
        if recipe.float8 == "mxfp8" and moe:
            terms["mxfp8 grouped-GEMM gain (routed experts)"] = (
                "torchao's B200 microbenchmark of its MXFP8 grouped GEMM, casts included (1.38x at "
                "DeepSeek-V3's expert shape, 1.70x at Scout's), by the expert's smaller dim; not fitted")
    elif recipe.float8 == "nvfp4":
        terms["nvfp4 GEMM gain"] = ("assumed: MXFP8's fitted gain x 2 (data sheet ratio); not fitted (torchtitan's "
                                    "NVFP4 points validate it: see docs/simulate.md)")
        if moe:
            terms["nvfp4 grouped-GEMM gain (routed experts)"] = (
                "assumed: torchao's MXFP8 grouped-GEMM microbenchmark gain x 2; no published NVFP4 MoE point")
    if recipe.low_precision_layers is not None:
        terms["low-precision layers"] = (f"the first {recipe.low_precision_layers} decoder layers in {recipe.float8}, "
                                         "the rest and the head in bf16 (given)")
    if moe and ep > 1:
        terms["EP all-to-all"] = (_fit("a2a_efficiency:standard") if recipe.moe_dispatcher == "standard" else
                                  "DeepEP: a token once per destination rank, at DeepEP's published bandwidth (0.95 of "
                                  "the link; 0.557 on Blackwell NVLink, torchtitan's B200 tuning), not fitted here")
        terms["routing imbalance"] = ("given" if recipe.moe_imbalance is not None else
                                      "assumed 1.1 (default; not calibrated)")
    terms["allocator reserve (memory)"] = _fit("allocator_reserve")
    eff = fitted.EFFICIENCY.get(profile_name, float("nan")) if efficiency is None else efficiency
    b = band(profile_name, eff, recipe, moe, mesh or {"ep": ep})
    if b["low"] is None:
        text = f"none: {b['why']}"
    else:
        text = (f"tokens/s x{b['low']:.2f} .. x{b['high']:.2f} of the prediction (leave-one-source-out cross-"
                f"validation; widest of its groups: {b['from']}; covers {b['coverage']:.0%} of published points "
                f"whose source the band never saw); {b['why']}")
    return {"terms": terms, "validated_error_band": text, "band": b}
