"""What a prediction rests on: for one scenario, each cost term that enters it and whether
it is calibrated on a published point (which), taken from a spec sheet or a cited
measurement, or assumed; and the error band the validation (docs/simulate.md) measured for
runs of that kind. Printed by ``simulate`` and carried in its JSON."""

from __future__ import annotations

from . import fitted
from .options import Recipe

__all__ = ["EFF_FAMILY", "uncertainty"]

# which fitted efficiency a built-in profile uses, and whether it was fitted on that GPU
EFF_FAMILY = {"h100": ("h100", False), "h100-gt": ("h100", True), "h200": ("h100", False),
              "a100": ("a100", True), "b200": ("b200", True), "gb200": ("b200", False),
              "mi300x": ("h100", False)}


def _fit(key: str) -> str:
    return f"fitted on published point {fitted.FIT_POINTS[key]}"


def uncertainty(profile_name: str, recipe: Recipe, moe: bool, ep: int) -> dict:
    terms: dict[str, str] = {}
    fam = EFF_FAMILY.get(profile_name)
    if fam is None:
        terms["GEMM efficiency"] = f"from the profile {profile_name!r} (not fitted here)"
    else:
        key = f"efficiency:{fam[0]}"
        terms["GEMM efficiency"] = _fit(key) + ("" if fam[1] else f" (borrowed from {fam[0]}; unvalidated on "
                                                                f"{profile_name})")
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
        terms["nvfp4 GEMM gain"] = "assumed: MXFP8's fitted gain x 2 (data sheet ratio); no published NVFP4 point"
        if moe:
            terms["nvfp4 grouped-GEMM gain (routed experts)"] = (
                "assumed: torchao's MXFP8 grouped-GEMM microbenchmark gain x 2; no published NVFP4 point")
    if moe and ep > 1:
        terms["EP all-to-all"] = (_fit("a2a_efficiency:standard") if recipe.moe_dispatcher == "standard" else
                                  "DeepEP: a token once per destination rank, at DeepEP's published bandwidth (0.95 of "
                                  "the link; 0.557 on Blackwell NVLink, torchtitan's B200 tuning), not fitted here")
        terms["routing imbalance"] = ("given" if recipe.moe_imbalance is not None else
                                      "assumed 1.1 (default; not calibrated)")
    terms["allocator reserve (memory)"] = _fit("allocator_reserve")
    if moe:
        band = ("MoE with EP on Blackwell: validation points -18% to -28% (predicted too slow; B200 efficiency fitted on power-limited parts; published MXFP8 ratios put the routed GEMMs at >= 64% of a step the model gives 14%); memory of "
                "DeepEP runs: resident routed activations not modelled (-47% to -70%)")
    elif profile_name in ("mi300x", "gb200") or recipe.float8 == "nvfp4":
        band = "no validation point for this GPU / recipe"
    else:
        band = "dense runs on fitted GPU families: validation median 6%, most within 10%; TP 8 of a small model and long-context CP up to +30-47%; memory median 2-5%"
    return {"terms": terms, "validated_error_band": band}
