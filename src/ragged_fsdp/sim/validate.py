"""Validation against published runs: ``python -m ragged_fsdp.sim.validate``.

Reads ``data/published_points.json`` (each point names its source: URL, table, row), refits
the constants of :mod:`.fitted` on the points marked ``fit`` (and only those), checks that
the values in ``fitted.py`` are the refit ones, predicts every point with FSDP2's model (the
published runs are torchtitan, FSDP2), and prints the table of the points marked
``validate`` with the median and largest |error|. ``--json PATH`` writes everything
(default ``docs/data/sim_validation.json``); ``--fit`` only prints the refit constants.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import re
import statistics
import sys
from pathlib import Path

from . import fitted
from .mesh import parse_mesh
from .options import Recipe
from .profiles import PROFILES
from .simulate import Scenario, simulate

__all__ = ["load_points", "predict", "fit", "evaluate", "summary", "markdown", "main"]

POINTS_PATH = Path(__file__).parent / "data" / "published_points.json"
# points collected for issue 56 (published runs the first file lacked: torchao's H100 / MI300X /
# B200 tables, torchtitan's GB200 NVFP4 page, 405B on 128 H100, PR #1196's B200 log)
ISSUE56_PATH = Path(__file__).parent / "data" / "published_points_issue56.json"
GiB = 2**30


def load_points(path: Path | None = None) -> dict:
    """Both points files merged (``path``: one file only). Each point keeps its own source."""
    paths = [Path(path)] if path else [POINTS_PATH, ISSUE56_PATH]
    data = {"points": [], "assumptions": [], "models": {}}
    for f in paths:
        d = json.loads(f.read_text())
        data["points"] += d["points"]
        data["assumptions"] += d.get("assumptions", [])
        data["models"].update(d.get("models", {}))
    _MODELS.update(data["models"])
    return data


def _scenario(pt: dict) -> Scenario:
    prof = PROFILES[pt["gpu"]].with_overrides(efficiency=fitted.EFFICIENCY[pt["gpu"]],
                                              alloc_reserve=fitted.ALLOCATOR_RESERVE)
    r = dict(pt["recipe"])
    return Scenario(pt["model"], pt["gpus"], prof, parse_mesh(pt["mesh"], pt["gpus"]), "adamw", "bf16", pt["seq"],
                    pt["local_batch"], pt["act_ckpt"], None, recipe=Recipe(**r))


_MODELS: dict = {}  # models the points define inline (Hugging Face configs), by name


def _arch(name: str):
    if name not in _MODELS:
        return None
    from ..models.catalog import model_from_config
    from .arch import arch_from_shapes, check_arch
    from .hf_config import hf_to_catalog

    return check_arch(arch_from_shapes(model_from_config(name, hf_to_catalog(_MODELS[name]))))


def predict(pt: dict):
    return simulate(_scenario(pt), ("fsdp2",), _arch(pt["model"]))[0]


@contextlib.contextmanager
def constants(values: dict):
    """Temporarily set the fitted constants (keys as in ``fitted.FIT_POINTS``)."""
    saved = (dict(fitted.EFFICIENCY), fitted.COMPILE_SPEEDUP, dict(fitted.FLOAT8_SPEEDUP), fitted.ATTENTION_RATE,
             fitted.ALLOCATOR_RESERVE, dict(fitted.A2A_EFFICIENCY))
    try:
        _apply(values)
        yield
    finally:
        (fitted.EFFICIENCY, fitted.COMPILE_SPEEDUP, fitted.FLOAT8_SPEEDUP, fitted.ATTENTION_RATE,
         fitted.ALLOCATOR_RESERVE, fitted.A2A_EFFICIENCY) = saved


def _apply(values: dict) -> None:
    for k, v in values.items():
        kind, _, sub = k.partition(":")
        if kind == "efficiency":
            fitted.EFFICIENCY = {**fitted.EFFICIENCY, sub: v}
        elif kind == "compile_speedup":
            fitted.COMPILE_SPEEDUP = v
        elif kind == "float8_speedup":
            fitted.FLOAT8_SPEEDUP = {**fitted.FLOAT8_SPEEDUP, sub: v}
        elif kind == "attention_rate":
            fitted.ATTENTION_RATE = v
        elif kind == "a2a_efficiency":
            fitted.A2A_EFFICIENCY = {**fitted.A2A_EFFICIENCY, sub: v}
        elif kind == "allocator_reserve":
            fitted.ALLOCATOR_RESERVE = v
        else:
            raise KeyError(k)


def value(key: str) -> float:
    kind, _, sub = key.partition(":")
    table = {"efficiency": fitted.EFFICIENCY, "float8_speedup": fitted.FLOAT8_SPEEDUP,
             "a2a_efficiency": fitted.A2A_EFFICIENCY}
    if kind in table:
        return table[kind][sub]
    return {"compile_speedup": fitted.COMPILE_SPEEDUP, "attention_rate": fitted.ATTENTION_RATE,
            "allocator_reserve": fitted.ALLOCATOR_RESERVE}[kind]


def current() -> dict:
    """Every fitted constant, keyed as ``fitted.FIT_POINTS``."""
    return {k: value(k) for k in fitted.FIT_POINTS}


_RANGE = {"efficiency": (0.05, 1.0), "compile_speedup": (0.5, 20.0), "float8_speedup": (0.3, 3.0),
          "attention_rate": (0.05, 2.0), "allocator_reserve": (0.0, 2.0), "a2a_efficiency": (0.02, 1.0)}


def fit(points: list[dict], rounds: int = 12, iters: int = 30, tol: float = 1e-4) -> dict:
    """Each constant bisected so that its point's predicted tokens/s equals the published
    one, the others held; repeated ``rounds`` times since they interact (attention rate and
    efficiency share the 8B points) until no constant moves by more than ``tol`` (relative).
    Only points whose ``role`` is ``fit`` are read."""
    by_id = {p["id"]: p for p in points}
    vals = current()
    for _ in range(rounds):
        before = dict(vals)
        for key, pid in fitted.FIT_POINTS.items():
            pt = by_id[pid]
            if pt["role"] != "fit":
                raise ValueError(f"{pid} fits {key} but is not marked role 'fit' in {POINTS_PATH.name}")
            lo, hi = _RANGE[key.partition(":")[0]]
            on_memory = key == "allocator_reserve"
            want = pt["memory_gib"] * GiB if on_memory else pt["tokens_per_s"]
            for _ in range(iters):
                mid = (lo + hi) / 2
                with constants({**vals, key: mid}):
                    r = predict(pt)
                got = r.memory_bytes if on_memory else r.tokens_per_s_per_gpu
                if got < want:
                    lo = mid
                else:
                    hi = mid
            vals[key] = (lo + hi) / 2
        if all(abs(vals[k] - before[k]) <= tol * max(abs(before[k]), 1e-3) for k in vals):
            break
    return vals


def evaluate(points: list[dict]) -> list[dict]:
    rows = []
    for pt in points:
        r = predict(pt)
        err = r.tokens_per_s_per_gpu / pt["tokens_per_s"] - 1
        mem = r.memory_bytes / GiB
        rows.append({"id": pt["id"], "role": pt["role"], "added": pt.get("added"), "source": pt["source"],
                     "table": pt["table"],
                     "row": pt["row"], "model": pt["model"], "gpu": pt["gpu"], "gpus": pt["gpus"], "mesh": pt["mesh"],
                     "seq": pt["seq"], "local_batch": pt["local_batch"], "act_ckpt": pt["act_ckpt"],
                     "recipe": pt["recipe"], "tokens_per_s_published": pt["tokens_per_s"],
                     "tokens_per_s_predicted": r.tokens_per_s_per_gpu, "tokens_per_s_error": err,
                     "memory_gib_published": pt["memory_gib"], "memory_gib_predicted": mem,
                     "memory_error": (mem / pt["memory_gib"] - 1) if pt["memory_gib"] else None,
                     "peak_at": r.peak_phase, "time_parts": r.time_parts})
    return rows


def summary(rows: list[dict]) -> dict:
    """All validation points, and apart: those of published_points.json and issue 56's."""
    out = _summary(rows)
    out["before_issue_56"] = _summary([r for r in rows if r.get("added") != "issue 56"])
    out["issue_56"] = _summary([r for r in rows if r.get("added") == "issue 56"])
    return out


def _summary(rows: list[dict]) -> dict:
    v = [r for r in rows if r["role"] == "validate"]
    e = [abs(r["tokens_per_s_error"]) for r in v]
    m = [abs(r["memory_error"]) for r in v if r["memory_error"] is not None]
    # a document cited at two commits (a table later removed) is one source
    docs = {re.sub(r"/blob/[^/]+/", "/blob/", r["source"]) for r in v}
    return {"points": len(v), "sources": len(docs),
            "tokens_per_s_median_abs_error": statistics.median(e) if e else None,
            "tokens_per_s_max_abs_error": max(e) if e else None,
            "within_20pct": sum(x <= 0.20 for x in e), "within_8pct": sum(x <= 0.08 for x in e),
            "memory_points": len(m), "memory_median_abs_error": statistics.median(m) if m else None,
            "memory_max_abs_error": max(m) if m else None, "memory_within_10pct": sum(x <= 0.10 for x in m)}


def _recipe_text(r: dict) -> str:
    out = []
    if r.get("compile"):
        out.append("compile" if r.get("compile_loss", True) else "compile (blocks)")
    if r.get("float8"):
        out.append(f"fp8 {r['float8']}" + (" + fp8 AG" if r.get("float8_allgather") else ""))
    if r.get("async_tp"):
        out.append("async TP")
    if r.get("moe_dispatcher"):
        out.append(("DeepEP" if r["moe_dispatcher"] == "deepep" else "default EP all-to-all")
                   + (f", imbalance {r['moe_imbalance']}" if r.get("moe_imbalance") else ""))
    if r.get("pp_schedule") and r.get("microbatches"):
        out.append(f"{r['pp_schedule']} x{r['microbatches']}")
    return ", ".join(out) or "bf16 eager"


def markdown(doc: dict, role: str = "validate") -> str:
    srcs = {}
    lines = ["| point | source | model, GPUs, mesh | seq x batch, AC | recipe | tokens/s/GPU published | predicted | "
             "error | memory GiB published | predicted | error |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        if r["role"] != role:
            continue
        n = srcs.setdefault(r["source"], len(srcs) + 1)
        mp = f"{r['memory_gib_published']:.1f}" if r["memory_gib_published"] else "-"
        me = f"{r['memory_error']:+.1%}" if r["memory_error"] is not None else "-"
        lines.append(f"| {r['row']} | [{n}] | {r['model']}, {r['gpus']} x {r['gpu']}, {r['mesh']} | "
                     f"{r['seq']} x {r['local_batch']}, {r['act_ckpt']} | {_recipe_text(r['recipe'])} | "
                     f"{r['tokens_per_s_published']:,.1f} | {r['tokens_per_s_predicted']:,.1f} | "
                     f"{r['tokens_per_s_error']:+.1%} | {mp} | {r['memory_gib_predicted']:.1f} | {me} |")
    lines.append("")
    lines += [f"- [{n}] <{s}>" for s, n in srcs.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ragged_fsdp.sim.validate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="docs/data/sim_validation.json", help="where to write the results ('' = nowhere)")
    ap.add_argument("--fit", action="store_true", help="only refit the constants and print them")
    ap.add_argument("--render", default=None, metavar="JSON", help="print the tables of a written JSON and stop")
    args = ap.parse_args(argv)
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        s = doc["summary"]
        print(f"`{doc['command']}`, {doc['date']}, torch {doc['torch']}\n")
        print(markdown(doc))
        print("\nFit points (the error there is the fit's residual):\n")
        print(markdown(doc, "fit"))
        print(f"\n{s['points']} validation points, {s['sources']} sources: tokens/s median |error| "
              f"{s['tokens_per_s_median_abs_error']:.1%}, max {s['tokens_per_s_max_abs_error']:.1%}; "
              f"{s['within_8pct']} within 8%, {s['within_20pct']} within 20%. Memory ({s['memory_points']} points): "
              f"median {s['memory_median_abs_error']:.1%}, max {s['memory_max_abs_error']:.1%}, "
              f"{s['memory_within_10pct']} within 10%.")
        return 0
    data = load_points()
    pts = data["points"]
    refit = fit(pts)
    cur = current()
    drift = {k: (cur[k], refit[k]) for k in cur if abs(cur[k] - refit[k]) > 2e-3 * max(abs(refit[k]), 1e-3)}
    if args.fit:
        for k, v in refit.items():
            print(f"{k:28s} {v:.4f}   (fitted.py: {cur[k]:.4f}; on {fitted.FIT_POINTS[k]})")
        return 0
    if drift:
        print(f"fitted.py is stale: {drift} (fitted.py, refit); run with --fit and update fitted.py", file=sys.stderr)
    import torch

    rows = evaluate(pts)
    doc = {"command": "python -m ragged_fsdp.sim.validate",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "constants": cur, "fit_points": fitted.FIT_POINTS,
           "constants_match_refit": not drift, "assumptions": data["assumptions"],
           "summary": summary(rows), "rows": rows}
    print(markdown(doc))
    print()
    print("fitted on (the error there is the fit's residual):")
    print(markdown(doc, "fit"))
    s = doc["summary"]
    for name, t in (("published_points.json", s["before_issue_56"]), ("issue 56's points", s["issue_56"])):
        print(f"{name}: {t['points']} validation points, tokens/s median |error| {t['tokens_per_s_median_abs_error']:.1%}, "
              f"max {t['tokens_per_s_max_abs_error']:.1%}; memory on {t['memory_points']}: median "
              f"{t['memory_median_abs_error']:.1%}")
    print(f"\n{s['points']} validation points from {s['sources']} sources: tokens/s median |error| "
          f"{s['tokens_per_s_median_abs_error']:.1%}, max {s['tokens_per_s_max_abs_error']:.1%} "
          f"({s['within_8pct']} within 8%, {s['within_20pct']} within 20%); memory on {s['memory_points']} points: "
          f"median {s['memory_median_abs_error']:.1%}, max {s['memory_max_abs_error']:.1%} "
          f"({s['memory_within_10pct']} within 10%)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 1 if drift else 0


if __name__ == "__main__":
    sys.exit(main())
