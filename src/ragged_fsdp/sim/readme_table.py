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


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "out/sim/readme_table.jsonl"
    rows = main()
    with open(out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(markdown(rows))
