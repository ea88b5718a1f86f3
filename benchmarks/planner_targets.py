"""Planner targets on the model catalog, and the heuristic against the exact optimum.

    python benchmarks/planner_targets.py [--quick] [--instances N] [--out PATH]

For every catalog model (expert variants included) x W in 64..16384 x granularity it plans
the whole model, validates every plan and records padding, the structural lower bound and
the planning time (best of ``--repeat`` runs: the machine is shared). Targets checked:

* every plan validates;
* whole-model padding within 0.5 percentage points of the lower bound, and at most 1%
  wherever the bound is at most 0.5%;
* planning a whole model takes at most 0.3 s.

Then it draws random small groups and compares the heuristic's ``W*S`` with the exact
optimum (:func:`ragged_fsdp.planner.solve_exact`): how often they match, and the worst gap;
and, for GPT-OSS-120B and DeepSeek-V3 at W <= 1024, compares with our reading of the
published heuristic (model order, S rounded to the LCM of the blocks of long tensors).
Prints tables; writes everything as JSON (default ``out/planner_targets.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

from ragged_fsdp.models.catalog import get_model, list_models, model_specs
from ragged_fsdp.planner import TensorSpec, plan_group, solve_exact, validate_plan
from ragged_fsdp.planner.model import plan_model
from ragged_fsdp.planner.problem import Problem, earliest_start
from ragged_fsdp.bench.meta import run_meta

WORLDS = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
GRANULARITIES = ["element", "row", "rows:16", "rows:128", "block:256"]
GAP_PP = 0.005  # padding may exceed the bound by this much (0.5 percentage points)
LOW_BOUND, LOW_PAD = 0.005, 0.01  # where the bound is <= 0.5%, padding must be <= 1%
TIME_LIMIT = 0.3


def catalog_cells(models, worlds, grans, repeat: int) -> list[dict]:
    cells = []
    for mid in models:
        model = get_model(mid)
        for gran in grans:
            groups = model_specs(model, gran)
            for w in worlds:
                best = None
                for _ in range(repeat):
                    mp = plan_model(groups, w)
                    best = mp if best is None or mp.plan_seconds < best.plan_seconds else best
                errors = best.validate()
                pad, lb = best.padding_ratio, best.lower_bound_ratio
                cell = {
                    "model": model.id, "world_size": w, "granularity": gran, "padding_ratio": pad,
                    "lower_bound_ratio": lb, "plan_seconds": best.plan_seconds, "valid": not errors,
                    "errors": errors[:3], "group_kinds": len(best.kinds),
                    "tensors": sum(len(s) for s in best.group_specs),
                }
                cell["within_gap"] = pad - lb <= GAP_PP + 1e-12
                cell["low_ok"] = lb > LOW_BOUND or pad <= LOW_PAD
                cell["fast"] = best.plan_seconds <= TIME_LIMIT
                cells.append(cell)
    return cells


def published_segment(prob: Problem) -> int:
    """Our reading of the published heuristic, for comparison: tensors in model order, each at
    its earliest valid offset (what its DP over a fixed order computes), ``S`` rounded up to a
    multiple of the LCM of the blocks of the tensors longer than a segment, binary search on
    ``S``."""
    W, a = prob.world_size, prob.a

    def rounded(S):
        step = a
        for e, L in zip(prob.e, prob.L):
            if e > S:
                step = step * L // math.gcd(step, L)
        return -(-S // step) * step

    def fits(S):
        pos = 0
        for e, L in zip(prob.e, prob.L):
            l = earliest_start(pos, e, L, S)
            if l is None:
                return False
            pos = -(-(l + e) // a) * a
        return pos <= W * S

    lo, hi = max(a, -(-prob.padded_sum // W)), max(a, prob.padded_sum)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(rounded(mid)):
            hi = mid
        else:
            lo = mid + 1
    return rounded(lo)


def published_cells(models, worlds, grans) -> list[dict]:
    cells = []
    for mid in models:
        model = get_model(mid)
        for gran in grans:
            groups = model_specs(model, gran)
            for w in worlds:
                mp = plan_model(groups, w)
                total = sum(k.count * w * published_segment(Problem.build(mp.group_specs[k.groups[0]], w))
                            for k in mp.kinds)
                cells.append({"model": model.id, "world_size": w, "granularity": gran,
                              "published_padding_ratio": (total - mp.used) / mp.used,
                              "padding_ratio": mp.padding_ratio, "lower_bound_ratio": mp.lower_bound_ratio})
    return cells


def random_instance(rng: random.Random):
    n = rng.randint(1, 6)
    itemsize = rng.choice([1, 2, 4])
    specs = []
    for i in range(n):
        nd = rng.choice([1, 2, 2, 3])
        shape = tuple(rng.randint(1, 12) for _ in range(nd))
        gran = rng.choice([None, "row", "rows:2", "rows:3", "block:5", "block:16", "tensor"])
        specs.append(TensorSpec(f"t{i}", shape, itemsize, gran))
    return specs, rng.choice([1, 2, 3, 4, 5, 8, 16]), rng.choice([1, 4, 16, 32])


def random_trials(count: int, seed: int) -> dict:
    rng = random.Random(seed)
    matches, worst, worst_case, invalid = 0, 0.0, None, 0
    t0 = time.perf_counter()
    for _ in range(count):
        specs, w, align = random_instance(rng)
        heur = plan_group(specs, w, align)
        exact = solve_exact(specs, w, align, s_max=heur.segment)
        invalid += bool(validate_plan(heur, specs)) + bool(validate_plan(exact, specs))
        if heur.total == exact.total:
            matches += 1
            continue
        gap = (heur.total - exact.total) / exact.used  # in padding-ratio points
        if gap > worst:
            worst = gap
            worst_case = {"world_size": w, "align_bytes": align, "heuristic_S": heur.segment,
                          "exact_S": exact.segment, "used": exact.used,
                          "tensors": [(s.shape, s.itemsize, str(s.granularity)) for s in specs]}
    return {"instances": count, "seed": seed, "matches": matches, "match_rate": matches / count,
            "worst_gap": worst, "worst_case": worst_case, "invalid_plans": invalid,
            "seconds": time.perf_counter() - t0}


def _pct(x: float) -> str:
    return f"{100 * x:.3f}%" if x < 10 else f"{100 * x:.0f}%"


def summarize(cells: list[dict]) -> list[dict]:
    out = []
    for mid in dict.fromkeys(c["model"] for c in cells):
        mine = [c for c in cells if c["model"] == mid]
        gaps = [(c["padding_ratio"] - c["lower_bound_ratio"], c) for c in mine]
        worst_gap, wc = max(gaps, key=lambda x: x[0])
        low = [c for c in mine if c["lower_bound_ratio"] <= LOW_BOUND]
        out.append({
            "model": mid, "cells": len(mine), "valid": sum(c["valid"] for c in mine),
            "worst_gap_pp": 100 * worst_gap,
            "worst_gap_cell": f"W={wc['world_size']} {wc['granularity']}: {_pct(wc['padding_ratio'])} vs {_pct(wc['lower_bound_ratio'])}",
            "max_pad_where_bound_low": max((c["padding_ratio"] for c in low), default=0.0),
            "max_plan_seconds": max(c["plan_seconds"] for c in mine),
            "misses": [f"W={c['world_size']} {c['granularity']}" for c in mine
                       if not (c["valid"] and c["within_gap"] and c["low_ok"] and c["fast"])],
        })
    return out


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/planner_targets.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer models, world sizes and instances")
    ap.add_argument("--models", default=None, help="comma list of model ids (default: all, with variants)")
    ap.add_argument("--instances", type=int, default=1000, help="random small instances vs the exact solver")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3, help="plan each cell this many times, keep the fastest")
    ap.add_argument("--out", default=os.path.join("out", "planner_targets.json"))
    args = ap.parse_args(argv)

    models = args.models.split(",") if args.models else list_models(include_variants=True)
    worlds, grans, count = WORLDS, GRANULARITIES, args.instances
    if args.quick:
        models, worlds, count = models[:3], [64, 1024, 16384], min(count, 200)
    t0 = time.perf_counter()
    cells = catalog_cells(models, worlds, grans, max(1, args.repeat))
    summary = summarize(cells)
    rows = [["model", "cells", "valid", "worst pad-bound", "  at", "max pad (bound<=0.5%)", "max plan s", "target misses"]]
    for s in summary:
        rows.append([s["model"], str(s["cells"]), str(s["valid"]), f"{s['worst_gap_pp']:.3f} pp", s["worst_gap_cell"],
                     _pct(s["max_pad_where_bound_low"]), f"{s['max_plan_seconds']:.4f}",
                     ", ".join(s["misses"]) or "-"])
    print(_table(rows))
    print(f"\ncatalog: {len(cells)} cells in {time.perf_counter() - t0:.1f} s; "
          f"valid {sum(c['valid'] for c in cells)}/{len(cells)}, "
          f"within 0.5 pp of the bound {sum(c['within_gap'] for c in cells)}, "
          f"<= 1% where bound <= 0.5% {sum(c['low_ok'] for c in cells)}, "
          f"<= {TIME_LIMIT} s {sum(c['fast'] for c in cells)}")
    trials = random_trials(count, args.seed)
    print(f"random small instances: {trials['matches']}/{trials['instances']} match the exact optimum "
          f"({100 * trials['match_rate']:.1f}%), worst gap {_pct(trials['worst_gap'])} of the tensor elements, "
          f"invalid plans {trials['invalid_plans']}, {trials['seconds']:.1f} s")
    pub_models = [m for m in models if m.split(":")[0] in ("gpt-oss-120b", "deepseek-v3")]
    pub_worlds = [w for w in worlds if w <= 1024]
    published = published_cells(pub_models, pub_worlds, ["row", "rows:16", "rows:128"])
    show = [w for w in (64, 256, 1024) if w in pub_worlds]
    rows = [["model", "granularity"] + [f"W={w}: published / ours / bound" for w in show]]
    for mid in dict.fromkeys(c["model"] for c in published):
        for gran in ["row", "rows:16", "rows:128"]:
            row = [mid, gran]
            for w in show:
                (c,) = [c for c in published if c["model"] == mid and c["granularity"] == gran and c["world_size"] == w]
                row.append(" / ".join(_pct(c[k]) for k in ("published_padding_ratio", "padding_ratio", "lower_bound_ratio")))
            rows.append(row)
    if published:
        print("\nvs the published heuristic (model order, S rounded to the LCM of long tensors' blocks):")
        print(_table(rows))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": run_meta(), "cells": cells, "summary": summary, "random": trials, "published": published,
                   "targets": {"gap_pp": 100 * GAP_PP, "low_bound": LOW_BOUND, "low_pad": LOW_PAD,
                               "time_limit_s": TIME_LIMIT}}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
