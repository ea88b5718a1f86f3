"""The peer-memory snapshot priced at 1k-16k GPUs by ``simulate --snapshot-every 1`` (the step
model's own per-rank state and step time; sim/snapshot.py's formula), as a table and JSON.

    PYTHONPATH=src python benchmarks/simulate_snapshot.py --out docs/data/simulate_snapshot.json

Each row is what ``python -m ragged_fsdp simulate --model M --gpus G --mesh MESH --frameworks
ragged --snapshot-every 1`` prints for ragged_fsdp on H100 (seq 4096, micro-batch 1, AdamW,
full activation checkpointing).
"""

from __future__ import annotations

import argparse
import json

from ragged_fsdp.bench.meta import run_meta
from ragged_fsdp.sim.mesh import parse_mesh
from ragged_fsdp.sim.profiles import get_profile
from ragged_fsdp.sim.simulate import Scenario, simulate
from ragged_fsdp.sim.snapshot import snapshot_cost

CASES = [  # model, mesh template (G: the GPU count)
    ("llama3-70b", "dp={G}"),
    ("llama3-405b", "tp=8,dp={D8}"),
    ("deepseek-v3", "ep=8,dp={D8}"),
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", default="1024,4096,16384")
    p.add_argument("--out", default="docs/data/simulate_snapshot.json")
    a = p.parse_args()
    prof = get_profile("h100")
    rows = []
    for model, tmpl in CASES:
        for g in (int(x) for x in a.gpus.split(",")):
            mesh = tmpl.format(G=g, D8=g // 8)
            sc = Scenario(model, g, prof, parse_mesh(mesh, g), "adamw", "bf16", 4096, 1, "full", None)
            r = next(x for x in simulate(sc, ["ragged"]))
            c = snapshot_cost(r, prof, 1)
            rows.append({"model": model, "gpus": g, "mesh": mesh, "step_s": r.step_s, "fits": r.fits,
                         "command": f"python -m ragged_fsdp simulate --model {model} --gpus {g} --mesh {mesh} "
                                    "--frameworks ragged --snapshot-every 1", **c})
    print("| model | GPUs | mesh | step (s) | snapshot per rank (GiB) | device->host (s) | to the peer (s) | "
          "share of a step if not overlapped | host memory per node (GiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['gpus']:,} | {r['mesh']} | {r['step_s']:.2f} | {r['bytes_per_rank'] / 2**30:.3f} | "
              f"{r['d2h_s']:.4f} | {r['send_s']:.4f} | {r['step_fraction']:.2%} | "
              f"{r['host_bytes_per_node'] / 2**30:.1f} |")
    with open(a.out, "w") as f:
        json.dump({"command": "PYTHONPATH=src python benchmarks/simulate_snapshot.py", "assumed": rows[0]["assumed"],
                   "rows": rows, "meta": run_meta("PYTHONPATH=src python benchmarks/simulate_snapshot.py")}, f, indent=1)


if __name__ == "__main__":
    main()
