"""Padding that Shampoo's granularity costs on the catalog models (shapes only, no weights).

    python -m ragged_fsdp.bench.shampoo_padding [--world 1024,8192] [--b 128,512,1024] [--out out/shampoo_padding]

For every catalog model (reference layouts and variants), world size and ``B``, each FSDP
group (per transformer block, embedding, head) is planned with every tensor's granularity
from ``Shampoo.granularity_for(B)`` (whole ``B``-row chunks of the merged view), and the
table gives the padding (over the parameters), the structural lower bound, and for cells
above 1% the best way out the planner finds (``plan --suggest``: a smaller shard group (HSDP)
or merged groups). It also gives the largest power-of-two ``B`` whose row chunks fit in one
segment of every group (``B * row length <= sum(group) / W`` for every matrix) and the padding
planned at that ``B``: the rule of thumb for picking ``B``.

Writes ``report.json`` and ``report.md`` under ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from ..models.catalog import get_model, list_models
from ..optim.shampoo_blocks import merged_shape, shampoo_specs
from ..planner.model import plan_model
from ..planner.suggest import suggest


def fitting_b(model, world: int, cap: int = 8192) -> int:
    """Largest power of two ``B <= cap`` whose row chunks (``B`` merged rows) fit in the ideal
    segment of every group; 1 when even ``B = 1`` does not fit."""
    best = 1
    b = 1
    while b <= cap:
        ok = True
        for g in model.groups:
            seg = math.ceil(g.numel / world)
            for t in g.tensors:
                merged = merged_shape(t.shape, b)
                if len(merged) >= 2 and min(b, merged[0]) * math.prod(merged[1:]) > seg:
                    ok = False
                    break
                if len(merged) == 1 and min(b, merged[0]) > seg:
                    ok = False
                    break
            if not ok:
                break
        if not ok:
            break
        best = b
        b *= 2
    return best


def cell(model_id: str, world: int, b: int, want_suggest: bool) -> dict:
    model = get_model(model_id)
    groups = shampoo_specs(model.groups, b)
    t0 = time.perf_counter()
    mp = plan_model(groups, world)
    out = {"model": model.id, "world": world, "B": b, "padding_ratio": mp.padding_ratio,
           "lower_bound_ratio": mp.lower_bound_ratio, "plan_seconds": time.perf_counter() - t0,
           "valid": not mp.validate()}
    if want_suggest and mp.padding_ratio > 0.01:
        sug = suggest(groups, world, current=mp)
        if sug:
            s = sug[0]
            out["best_way_out"] = {"description": s.describe(), "padding_ratio": s.padding_ratio,
                                   "gathered_gib": s.gathered_bytes / 2**30}
    return out


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%" if x < 10 else f"{x * 100:,.0f}%"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=",".join(list_models(True)))
    p.add_argument("--world", default="1024,8192")
    p.add_argument("--b", default="128,512,1024")
    p.add_argument("--no-suggest", action="store_true", help="skip the ways out (faster)")
    p.add_argument("--out", default="out/shampoo_padding")
    a = p.parse_args(argv)
    models = [m for m in a.model.split(",") if m]
    worlds = [int(w) for w in a.world.split(",")]
    bs = [int(b) for b in a.b.split(",")]
    cells, fits = [], []
    for m in models:
        for w in worlds:
            for b in bs:
                cells.append(cell(m, w, b, not a.no_suggest))
                print(f"  {m} W={w} B={b}: {_pct(cells[-1]['padding_ratio'])}", flush=True)
            fb = fitting_b(get_model(m), w)
            fc = cell(m, w, fb, False)
            fits.append({"model": get_model(m).id, "world": w, "B": fb, "padding_ratio": fc["padding_ratio"]})
    report = {"cells": cells, "fitting_b": fits}
    md = _markdown(report, worlds, bs)
    print(md)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(md)
    print(f"wrote {out / 'report.md'} and {out / 'report.json'}")
    return report


def _markdown(report: dict, worlds, bs) -> str:
    by = {(c["model"], c["world"], c["B"]): c for c in report["cells"]}
    fit = {(f["model"], f["world"]): f for f in report["fitting_b"]}
    models = list(dict.fromkeys(c["model"] for c in report["cells"]))
    head = ["model", "W"] + [f"B={b}" for b in bs] + ["largest B that fits", "its padding", f"best way out at B={bs[0]}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in models:
        for w in worlds:
            row = [m, str(w)]
            for b in bs:
                row.append(_pct(by[(m, w, b)]["padding_ratio"]))
            f = fit[(m, w)]
            row += [str(f["B"]), _pct(f["padding_ratio"])]
            way = by[(m, w, bs[0])].get("best_way_out")
            row.append(f"{way['description']}: {_pct(way['padding_ratio'])}" if way else "-")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
