"""The README's users' table: four large models at 1,024 and 8,192 H100s, every framework,
each on its own fastest fitting mesh (``--mesh auto``). ``python -m ragged_fsdp.sim.readme_table``."""

from __future__ import annotations

import json
import sys

from .mesh import Mesh
from .profiles import get_profile
from .simulate import FRAMEWORKS, Scenario, simulate_auto

MODELS = ("llama3-70b", "gpt-oss-120b", "deepseek-v3", "kimi-k2")
GPUS = (1024, 8192)
GiB = 2**30


def main(seq: int = 8192, micro_batch: int = 1, act_ckpt: str = "full") -> list[dict]:
    rows = []
    prof = get_profile("h100")
    for model in MODELS:
        for g in GPUS:
            sc = Scenario(model, g, prof, Mesh(g), "adamw", "bf16", seq, micro_batch, act_ckpt, "auto")
            res, why = simulate_auto(sc, FRAMEWORKS)
            rows.append({"model": model, "gpus": g,
                         "results": {r.framework: {"mesh": r.mesh, "memory_gib": r.memory_bytes / GiB,
                                                   "fits": r.fits, "tokens_per_s": r.tokens_per_s_per_gpu,
                                                   "mfu": r.mfu, "padding": r.padding} for r in res},
                         "why": why})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(rows) -> str:
    head = "| model | GPUs | " + " | ".join(FRAMEWORKS) + " |"
    lines = [head, "|---|---|" + "---|" * len(FRAMEWORKS)]
    for r in rows:
        cells = []
        for fw in FRAMEWORKS:
            x = r["results"][fw]
            mark = "" if x["fits"] else " (does not fit)"
            cells.append(f"{x['tokens_per_s']:,.0f} tok/s, {x['memory_gib']:.0f} GiB, {x['mesh']}{mark}")
        lines.append(f"| {r['model']} | {r['gpus']:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# the meshes --mesh auto picks for ragged_fsdp at 1,024 H100s (the table above)
BREAKDOWN_CASES = (("llama3-70b", "dp=1024"), ("gpt-oss-120b", "ep=64,dp=16"), ("deepseek-v3", "ep=32,dp=32"),
                   ("kimi-k2", "ep=64,dp=16"))


def breakdown_rows(gpus: int = 1024, seq: int = 8192) -> list[dict]:
    """FSDP2 vs ragged_fsdp on one mesh per model, the difference by cause."""
    from .mesh import parse_mesh
    from .simulate import simulate

    rows = []
    for model, mesh in BREAKDOWN_CASES:
        sc = Scenario(model, gpus, get_profile("h100"), parse_mesh(mesh, gpus), "adamw", "bf16", seq, 1, "full", "auto")
        r = {x.framework: x for x in simulate(sc, ("ragged", "fsdp2"))}
        rows.append({"model": model, "mesh": mesh, "gpus": gpus, "seq": seq,
                     "ragged": {"tokens_per_s": r["ragged"].tokens_per_s_per_gpu, "memory_gib": r["ragged"].memory_bytes / GiB},
                     "fsdp2": {"tokens_per_s": r["fsdp2"].tokens_per_s_per_gpu, "memory_gib": r["fsdp2"].memory_bytes / GiB},
                     "fsdp2_vs_ragged": r["fsdp2"].vs_ragged})
    return rows


def breakdown_markdown(rows) -> str:
    lines = ["| model, mesh | ragged tok/s, GiB | FSDP2 tok/s, GiB | FSDP2 step vs ragged, by cause | "
             "FSDP2 memory vs ragged, by cause (GiB) |", "|---|---|---|---|---|"]
    for r in rows:
        d = r["fsdp2_vs_ragged"]
        t = "; ".join(f"{k} {v:+.1%}" for k, v in d["step_frac"].items() if abs(v) >= 5e-4) or "same"
        m = "; ".join(f"{k} {v / GiB:+.2f}" for k, v in d["memory_bytes"].items() if abs(v) >= GiB / 100) or "same"
        lines.append(f"| {r['model']}, {r['mesh']} | {r['ragged']['tokens_per_s']:,.0f}, {r['ragged']['memory_gib']:.1f} | "
                     f"{r['fsdp2']['tokens_per_s']:,.0f}, {r['fsdp2']['memory_gib']:.1f} | {t} | {m} |")
    return "\n".join(lines)


if __name__ == "__main__" and sys.argv[1:2] == ["--breakdown"]:
    rows = breakdown_rows()
    out = sys.argv[2] if len(sys.argv) > 2 else "docs/data/sim_breakdown.json"
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
    print(breakdown_markdown(rows))
elif __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "out/sim/readme_table.jsonl"
    rows = main()
    with open(out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(markdown(rows))
