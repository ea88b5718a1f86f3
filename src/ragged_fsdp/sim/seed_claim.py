"""The seed's claim re-derived: ragged_fsdp against FSDP2, FSDP1, DeepSpeed and Megatron-FSDP
for GPT-OSS-120B and a DeepSeek-V3-class MoE at 1,024 GPUs, with MoE costed as it runs
(:mod:`.moe`) and GEMMs by shape (:mod:`.gemm`); every difference split by cause
(:mod:`.breakdown`), and the spread over what is not calibrated (routing imbalance, the
dispatcher). ``python -m ragged_fsdp.sim.seed_claim [JSON]`` (default
``docs/sim/seed_claim.json``) prints the markdown tables of ``docs/simulate.md``."""

from __future__ import annotations

import json
import sys

from .mesh import parse_mesh
from .options import Recipe
from .profiles import get_profile
from .simulate import FRAMEWORKS, Scenario, simulate

__all__ = ["CASES", "rows", "markdown"]

GiB = 2**30
# model, mesh: the fastest of ep = 8, 16, 32, 64 for ragged_fsdp at 1,024 H100s, sequence 8192,
# batch 1, full AC (EP inside the node: across nodes the all-to-all goes through one NIC per
# rank and dominates the step once MoE is costed as it runs)
CASES = (("gpt-oss-120b", "ep=8,dp=128"), ("deepseek-v3", "ep=8,dp=128"))
GPUS = 1024
# the inputs not calibrated on a published point, each at its default and at both ends
SPREAD = {"imbalance": (1.0, 1.1, 1.3), "dispatcher": ("standard", "deepep")}


def _run(model, mesh, gpu, imbalance, dispatcher):
    sc = Scenario(model, GPUS, get_profile(gpu), parse_mesh(mesh, GPUS), "adamw", "bf16", 8192, 1, "full", "auto",
                  recipe=Recipe(moe_dispatcher=dispatcher, moe_imbalance=imbalance))
    return {r.framework: r for r in simulate(sc, FRAMEWORKS)}


def rows(gpus=("h100", "b200")) -> list[dict]:
    out = []
    for gpu in gpus:
        for model, mesh in CASES:
            base = _run(model, mesh, gpu, 1.1, "standard")
            spread = {}
            for imb in SPREAD["imbalance"]:
                for disp in SPREAD["dispatcher"]:
                    r = _run(model, mesh, gpu, imb, disp)
                    spread[f"{imb}/{disp}"] = {fw: r["ragged"].tokens_per_s_per_gpu / r[fw].tokens_per_s_per_gpu - 1
                                               for fw in FRAMEWORKS if fw != "ragged"}
            out.append({"model": model, "mesh": mesh, "gpus": GPUS, "gpu": gpu, "seq": 8192, "local_batch": 1,
                        "act_ckpt": "full", "imbalance": 1.1, "dispatcher": "standard",
                        "results": {fw: {"tokens_per_s": r.tokens_per_s_per_gpu, "memory_gib": r.memory_bytes / GiB,
                                         "fits": r.fits, "status": r.status,
                                         "time_parts": r.time_parts,
                                         "vs_ragged": r.vs_ragged} for fw, r in base.items()},
                        "ragged_speedup_spread": spread})
            print(json.dumps({"model": model, "gpu": gpu}), file=sys.stderr, flush=True)
    return out


def markdown(data: list[dict]) -> str:
    lines = ["| GPU, model, mesh | framework | tok/s/GPU | GiB | ragged_fsdp faster by | by cause (step) | "
             "memory vs ragged, by cause (GiB) | spread over imbalance 1.0-1.3, standard/DeepEP |",
             "|---|---|---|---|---|---|---|---|"]
    for r in data:
        rg = r["results"]["ragged"]
        lines.append(f"| {r['gpu']}, {r['model']}, {r['mesh']} | ragged | {rg['tokens_per_s']:,.0f} | "
                     f"{rg['memory_gib']:.1f} | - | - | - | - |")
        for fw in FRAMEWORKS:
            if fw == "ragged":
                continue
            x = r["results"][fw]
            d = x["vs_ragged"]
            t = "; ".join(f"{k} {v:+.1%}" for k, v in d["step_frac"].items() if abs(v) >= 5e-4) or "same"
            m = "; ".join(f"{k} {v / GiB:+.2f}" for k, v in d["memory_bytes"].items() if abs(v) >= GiB / 100) or "same"
            sp = [s[fw] for s in r["ragged_speedup_spread"].values()]
            lines.append(f"| | {fw} ({x['status']}) | {x['tokens_per_s']:,.0f} | {x['memory_gib']:.1f}"
                         f"{'' if x['fits'] else ' (does not fit)'} | "
                         f"{rg['tokens_per_s'] / x['tokens_per_s'] - 1:+.1%} | {t} | {m} | "
                         f"{min(sp):+.1%} to {max(sp):+.1%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else "docs/sim/seed_claim.json"
    data = rows()
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.write("\n")
    print(markdown(data))
