"""Padding that Shampoo's granularity costs on the catalog models (shapes only, no weights).

    python benchmarks/shampoo_padding.py [--world 1024,8192] [--b 128,512,1024] [--out out/shampoo_padding]

For every catalog model (reference layouts and variants), world size and ``B``, each FSDP
group (per transformer block, embedding, head) is planned with every tensor's granularity
from ``Shampoo.granularity_for(B)`` (whole ``B``-row chunks of the merged view), and the
table gives the padding (over the parameters), the structural lower bound, and for cells
above 1% the best ways out the planner finds (``plan --suggest``): the best smaller shard
group (HSDP over D ranks) and the best merge of consecutive groups, each with its padding. It also gives the largest power-of-two
(measured, not estimated) ``B`` in 8..1024 whose planned padding stays under ``--target``
(5%): what to pick at that world size without changing the FSDP groups.

Writes ``report.json`` and ``report.md`` under ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ragged_fsdp.models.catalog import get_model, list_models
from ragged_fsdp.optim.shampoo_blocks import shampoo_specs
from ragged_fsdp.planner.model import plan_model
from ragged_fsdp.planner.suggest import suggest
from ragged_fsdp.bench.meta import run_meta


def largest_b(model_id: str, world: int, target: float, candidates=(1024, 512, 256, 128, 64, 32, 16, 8)):
    """The largest ``B`` among ``candidates`` whose planned padding is at most ``target``, and
    that padding; ``(None, padding at the smallest candidate)`` when none is."""
    pad = None
    for b in candidates:
        pad = plan_model(shampoo_specs(get_model(model_id).groups, b), world).padding_ratio
        if pad <= target:
            return b, pad
    return None, pad


def cell(model_id: str, world: int, b: int, want_suggest: bool) -> dict:
    model = get_model(model_id)
    groups = shampoo_specs(model.groups, b)
    t0 = time.perf_counter()
    mp = plan_model(groups, world)
    out = {"model": model.id, "world": world, "B": b, "padding_ratio": mp.padding_ratio,
           "lower_bound_ratio": mp.lower_bound_ratio, "plan_seconds": time.perf_counter() - t0,
           "valid": not mp.validate()}
    if want_suggest and mp.padding_ratio > 0.01:
        for s in suggest(groups, world, current=mp):  # best first: keep the best of each kind
            out.setdefault(f"best_{s.kind}", {"description": s.describe(), "padding_ratio": s.padding_ratio,
                                              "gathered_gib": s.gathered_bytes / 2**30})
    return out


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%" if x < 10 else f"{x * 100:,.0f}%"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=",".join(list_models(True)))
    p.add_argument("--world", default="1024,8192")
    p.add_argument("--b", default="128,512,1024")
    p.add_argument("--no-suggest", action="store_true", help="skip the ways out (faster)")
    p.add_argument("--target", type=float, default=0.05, help="padding target for the largest-B column (default 0.05)")
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
            fb, fpad = largest_b(m, w, a.target)
            fits.append({"model": get_model(m).id, "world": w, "B": fb, "padding_ratio": fpad})
    report = {"cells": cells, "largest_b": fits, "target": a.target}
    md = _markdown(report, worlds, bs, a.target)
    print(md)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps({"meta": run_meta(), **report}, indent=1))
    (out / "report.md").write_text(md)
    print(f"wrote {out / 'report.md'} and {out / 'report.json'}")
    return report


def _markdown(report: dict, worlds, bs, target: float) -> str:
    by = {(c["model"], c["world"], c["B"]): c for c in report["cells"]}
    fit = {(f["model"], f["world"]): f for f in report["largest_b"]}
    models = list(dict.fromkeys(c["model"] for c in report["cells"]))
    head = (["model", "W"] + [f"B={b}" for b in bs] + [f"largest B <= {target:.0%}", "its padding"]
            + [f"{kind} at B={b}" for b in (bs[0], bs[-1]) for kind in ("HSDP", "merged groups")])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in models:
        for w in worlds:
            row = [m, str(w)]
            for b in bs:
                row.append(_pct(by[(m, w, b)]["padding_ratio"]))
            f = fit[(m, w)]
            row += [str(f["B"]) if f["B"] else "none >= 8", _pct(f["padding_ratio"])]
            for b in (bs[0], bs[-1]):
                for kind in ("hsdp", "merge"):
                    way = by[(m, w, b)].get(f"best_{kind}")
                    if way is None:
                        row.append("-")
                    elif kind == "hsdp":
                        row.append(f"{way['description'].split(' (')[0].replace('shard over ', '')}: "
                                   f"{_pct(way['padding_ratio'])}")
                    else:
                        row.append(f"{way['description'].replace(' consecutive groups', '')}: {_pct(way['padding_ratio'])}")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
