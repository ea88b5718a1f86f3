"""``scale.py``'s rows -> one summary per (model, config, W), growth exponents, table, plot.

Pure apart from the optional matplotlib import. An FSDP2 default-planner cell that was not
run (too slow at that W) is filled from the power law fitted to the W that were, and marked
``extrapolated``.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

from scale_layout import loglog_exponent

__all__ = ["summarize", "table", "plot", "METRICS"]

# (key, label, unit divisor, unit)
METRICS = (
    ("setup_cpu_s", "set-up CPU/rank", 1, "s"),
    ("setup_mem_mb", "set-up mem/rank", 1, "MB"),
    ("agree_bytes", "agreement sent+recv/rank", 1, "B"),
    ("items_max", "save items/rank (max)", 1, ""),
    ("coord_cpu_s", "coordinator CPU (ScaleSavePlanner)", 1, "s"),
    ("coord_default_cpu_s", "coordinator CPU (DCP default)", 1, "s"),
    ("coord_rss_mb", "coordinator RSS growth", 1, "MB"),
    ("gathered_mb", "local plans gathered", 1, "MB"),
    ("metadata_mb", ".metadata", 1, "MB"),
    ("metadata_read_cpu_s", "reading .metadata CPU/rank", 1, "s"),
    ("load_cpu_s", "DCP load planning CPU/rank (max)", 1, "s"),
    ("load_scale_cpu_s", "ScaleLoadPlanner load planning CPU/rank (max)", 1, "s"),
    ("local_meta_kb", "local save .meta/rank", 1, "KB"),
)


def _by(rows, *keys):
    out = defaultdict(list)
    for r in rows:
        if "error" in r:
            continue
        out[tuple(r[k] for k in keys)].append(r)
    return out


def summarize(setup: list[dict], planning: list[dict]) -> dict:
    """{"cells": [...], "exponents": [...], "errors": [...]}"""
    cells: dict[tuple, dict] = {}

    def cell(model, config, world):
        return cells.setdefault((model, config, world), {"model": model, "config": config, "world": world})

    for (model, config, world), rs in _by(setup, "model", "config", "world").items():
        c = cell(model, config, world)
        c["setup_cpu_s"] = statistics.median(r["cpu_s"] for r in rs)
        c["setup_cpu_s_max"] = max(r["cpu_s"] for r in rs)
        mem = [r["mem_bytes"] for r in rs if "mem_bytes" in r]
        if mem:
            c["setup_mem_mb"] = mem[0] / 1e6
        c["agree_bytes"] = max(r["agree_sent_bytes"] + r["agree_received_bytes"] for r in rs)
        c["agree_cpu_s"] = max(r["agree_cpu_s"] for r in rs)
        c["layout_math_matches_dcp"] = all(r["layout_math_matches_dcp"] for r in rs)
        c["setup_ranks"] = sorted(r["rank"] for r in rs)
    for r in planning:
        if "error" in r:
            continue
        c = cell(r["model"], r["config"], r["world"])
        c.update(items_max=r["items_max"], items_median=r["items_median"], items_total=r["items_total"],
                 padding_ratio=r["padding_ratio"])
        if r["planner"] == "default":
            if r.get("basis") == "extrapolated":
                c["coord_default_basis"] = "extrapolated"
            else:
                c["coord_default_cpu_s"] = r["cpu_s"]
                c["coord_default_basis"] = r["basis"]
            continue
        c.update(coord_cpu_s=r["cpu_s"], coord_rss_mb=r["rss_bytes"] / 1e6, gathered_mb=r["gathered_bytes"] / 1e6,
                 metadata_mb=r["metadata_bytes"] / 1e6, metadata_read_cpu_s=r["metadata_read_cpu_s"],
                 coord_basis=r["basis"])
        if "load" in r:
            ld = r["load"]
            c["load"] = {"world": ld["world"], "basis": ld["basis"],
                         "rank_cpu_s_max": max(v["cpu_s"] for v in ld["ranks"].values()),
                         "read_items_max": max(v["read_items"] for v in ld["ranks"].values()),
                         "gathered_mb": ld["gathered_bytes"] / 1e6, "metadata_read_cpu_s": ld["metadata_read_cpu_s"]}
            c["load_cpu_s"] = c["load"]["rank_cpu_s_max"]
            ranks = ld["ranks"].values()
            if all("cpu_s_scale" in v for v in ranks):  # ScaleLoadPlanner measured too (not in older runs)
                c["load"].update(rank_cpu_s_scale_max=max(v["cpu_s_scale"] for v in ranks),
                                 pairs_scale_max=max(v["pairs_scale"] for v in ranks),
                                 same_plan=all(v["same_plan"] for v in ranks))
                c["load_scale_cpu_s"] = c["load"]["rank_cpu_s_scale_max"]
        if "local_save" in r:
            ls = r["local_save"]
            c["local_meta_kb"] = ls["meta_bytes_per_rank"] / 1e3
            c["local_meta_build_cpu_s"] = ls["meta_build_cpu_s"]
            if "load" in ls:
                c["local_load"] = {"world": ls["load"]["world"],
                                   "rank_cpu_s_max": max(v["cpu_s"] for v in ls["load"]["ranks"].values()),
                                   "parts_read_max": max(v["parts_read"] for v in ls["load"]["ranks"].values()),
                                   "meta_read_cpu_s": ls["meta_read_cpu_s"]}
    exps = []
    for (model, config), cs in _by(list(cells.values()), "model", "config").items():
        cs = sorted(cs, key=lambda c: c["world"])
        for key, *_ in METRICS:
            pts = [(c["world"], c[key]) for c in cs if c.get(key) is not None]
            e = loglog_exponent([p[0] for p in pts], [p[1] for p in pts])
            if e is None:
                continue
            exps.append({"model": model, "config": config, "metric": key, "exponent": e, "points": len(pts)})
            for c in cs:  # fill the default planner's cells that were too slow to run
                if key == "coord_default_cpu_s" and c.get(key) is None and c.get("coord_default_basis") == "extrapolated":
                    w0, y0 = pts[-1]
                    c[key] = y0 * (c["world"] / w0) ** e
    errors = [r for r in setup + planning if "error" in r]
    growth = defaultdict(dict)  # one row per (model, config): every metric's exponent
    for e in exps:
        growth[(e["model"], e["config"])][e["metric"]] = e["exponent"]
    return {"cells": sorted(cells.values(), key=lambda c: (c["model"], c["config"], c["world"])),
            "exponents": exps, "growth": [{"model": m, "config": c, **v} for (m, c), v in sorted(growth.items())],
            "errors": errors}


def _fmt(v, digits=3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v == 0:
            return "0"
        mag = math.floor(math.log10(abs(v)))
        return f"{v:.{max(0, digits - 1 - mag)}f}" if -3 < mag < 6 else f"{v:.2e}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def table(summary: dict) -> str:
    head = ["model", "config", "W", "set-up s", "mem MB", "agree B", "items/rank", "coord s",
            "coord s (DCP default)", "md MB", "load s/rank", "local .meta KB", "local load s/rank"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for c in summary["cells"]:
        dflt = _fmt(c.get("coord_default_cpu_s"))
        if c.get("coord_default_basis", "").startswith(("scaled", "extra")):
            dflt += " *" if c["coord_default_basis"] != "extrapolated" else " **"
        coord = _fmt(c.get("coord_cpu_s")) + (" *" if str(c.get("coord_basis", "")).startswith("scaled") else "")
        load = c.get("load", {})
        lines.append(" | ".join([
            c["model"], c["config"], f"{c['world']:,}", _fmt(c.get("setup_cpu_s")), _fmt(c.get("setup_mem_mb")),
            _fmt(c.get("agree_bytes")), _fmt(c.get("items_max")), coord, dflt, _fmt(c.get("metadata_mb")),
            _fmt(load.get("rank_cpu_s_max")), _fmt(c.get("local_meta_kb")),
            _fmt(c.get("local_load", {}).get("rank_cpu_s_max"))]))
    lines.append("")
    lines.append("growth with W (exponent of a log-log fit): y ~ W^e")
    metrics = [m for m, *_ in METRICS]
    ehead = ["model", "config"] + metrics
    lines += [" | ".join(ehead), " | ".join("---" for _ in ehead)]
    by = defaultdict(dict)
    for e in summary["exponents"]:
        by[(e["model"], e["config"])][e["metric"]] = e["exponent"]
    for (model, config), es in sorted(by.items()):
        lines.append(" | ".join([model, config] + [f"{es[m]:.2f}" if m in es else "-" for m in metrics]))
    return "\n".join(lines)


def plot(summary: dict, path: str) -> str | None:
    """Log-log lines of the main metrics against W, one panel per metric, a line per
    (model, config)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = [("setup_cpu_s", "fully_shard set-up CPU s / rank"), ("items_max", "DCP save items / rank (max)"),
              ("coord_cpu_s", "coordinator create_global_plan CPU s\n(ScaleSavePlanner)"),
              ("coord_default_cpu_s", "coordinator CPU s (DCP default planner)"),
              ("metadata_mb", ".metadata MB"), ("local_meta_kb", "local save .meta KB / rank")]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    series = _by(summary["cells"], "model", "config")
    for ax, (key, title) in zip(axes.flat, panels):
        for i, ((model, config), cs) in enumerate(sorted(series.items())):
            pts = sorted((c["world"], c[key]) for c in cs if c.get(key))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i}",
                        linestyle="--" if config == "fsdp2" else "-", label=f"{model} {config}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("W (ranks)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# metric in the summary -> (metric in sim/data/host_costs.json, factor to its unit)
_SIM = {"setup_cpu_s": ("startup_cpu_s", 1), "coord_cpu_s": ("save_plan_cpu_s", 1),
        "coord_default_cpu_s": ("save_plan_default_cpu_s", 1), "metadata_mb": ("metadata_bytes", 1e6),
        "local_meta_kb": ("local_meta_bytes", 1e3), "metadata_read_cpu_s": ("metadata_read_cpu_s", 1),
        "load_cpu_s": ("load_plan_cpu_s", 1)}


def sim_table(summary: dict, meta: dict | None = None) -> dict:
    """What ``sim/host.py`` reads: per model, config and metric the measured points and the
    fitted exponent."""
    from ragged_fsdp.models.catalog import get_model

    exps = {(e["model"], e["config"], e["metric"]): e["exponent"] for e in summary["exponents"]}
    models: dict = {}
    for c in summary["cells"]:
        shapes = get_model(c["model"])
        entry = models.setdefault(c["model"], {
            "family": "moe" if shapes.config.get("family") != "llama" else "dense",
            "tensors": shapes.num_tensors, "worlds": [], "configs": {}})
        if c["world"] not in entry["worlds"]:
            entry["worlds"].append(c["world"])
        cfg = entry["configs"].setdefault(c["config"], {})
        for key, (name, k) in _SIM.items():
            if key == "load_cpu_s" and c["config"].startswith("ours") and c.get("load_scale_cpu_s") is not None:
                key = "load_scale_cpu_s"  # our load functions plan with ScaleLoadPlanner
            if c.get(key) is None:
                continue
            m = cfg.setdefault(name, {"points": [], "exponent": exps.get((c["model"], c["config"], key))})
            m["points"].append([c["world"], c[key] * k])
    return {"source": (meta or {}).get("command", "python benchmarks/scale.py"),
            "date": (meta or {}).get("date"), "models": models}


def main(argv=None) -> int:
    """Re-render a scale.py JSON: table, PNG and the simulator's host-cost table."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python benchmarks/scale_report.py")
    ap.add_argument("json", nargs="?", default="docs/data/scale.json")
    ap.add_argument("--png", default="docs/scale.png")
    ap.add_argument("--sim-out", default="src/ragged_fsdp/sim/data/host_costs.json")
    args = ap.parse_args(argv)
    report = json.loads(Path(args.json).read_text())
    summary = summarize(report["setup"], report["planning"])
    report["summary"] = summary  # the summary is derived from the rows: refresh it in place
    Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    print(table(summary))
    Path(args.sim_out).write_text(json.dumps(sim_table(summary, report.get("meta")), indent=1) + "\n")
    made = plot(summary, args.png)
    print(f"wrote {args.sim_out}" + (f" and {made}" if made else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
