"""Host costs at 1,024-16,384 ranks, measured on one machine (``python benchmarks/scale.py``).

For each model (catalog shapes, meta device) and world size W, ragged_fsdp (row and 128-row
granularity) against torch's FSDP2 on the same 1-D mesh:

1. set-up: each sampled rank (first, middle, last) runs ``fully_shard`` as rank r of W on
   torch's fake process group (one spawned process per (W, rank): DTensor caches specs whose
   meshes compare equal across worlds). Process CPU seconds per group; tracemalloc'ed memory
   held afterwards (middle rank, a second pass, since tracing slows the first); bytes the
   layout agreement's collectives were given and the CPU of the agreement checks.
   **Measured on a subset** (Llama: embedding/head + blocks 0-1; DeepSeek-V3: embedding/head,
   dense block 0 and MoE block 3 with 8 of its 256 experts) and **extrapolated** to the whole
   model: root + mean dense block x dense blocks + MoE block x (782 / its measured tensors)
   x MoE blocks. The subset's DCP chunks are checked against the layout math.
2. DCP save planning: every rank's local plan is **synthesized from the layout math**
   (``scale_layout``; checked against the real plans of the sampled ranks above) with DCP's
   own item types; the coordinator's ``create_global_plan`` runs on all W of them. With
   ``ScaleSavePlanner`` the whole model is planned when its items fit ``--cap-items`` (all of
   ours do; FSDP2's W x tensors items do not: a prefix of its tensors is planned at full W and
   **scaled by items**). DCP's default planner, whose overlap check compares every pair of a
   wide tensor's row chunks, is run on block 0 alone at full W and **scaled by items**
   (FSDP2's only up to W=4,096, then **extrapolated** with the fitted exponent: at 16,384 it
   would run for hours).
3. a load planned onto W/2 ranks from each W's metadata (``--load-to`` for the largest): each sampled rank's
   ``create_read_items_for_chunk_list`` work (DCP's) and ``ScaleLoadPlanner``'s on the same chunks
   (checked to give the same read items), its plan's bytes, and reading ``.metadata``;
   the same for ``checkpoint.load_local`` (no coordinator at all).

Everything that was extrapolated says so in its row (``measured`` / ``scaled x N`` /
``extrapolated``).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

from ragged_fsdp.bench.meta import run_meta
from scale_layout import (
    fsdp2_chunks, items_per_rank, loglog_exponent, ragged_chunks, ragged_plans, subset_model, wrap_groups,
)

__all__ = ["main", "CONFIGS", "setup_subset", "run_setup", "run_planning"]

MODELS = ("llama3-70b", "deepseek-v3")
WORLDS = (1024, 4096, 16384)
# (label, framework, granularity)
CONFIGS = (("ours-row", "ragged_fsdp", "row"), ("ours-128row", "ragged_fsdp", "rows:128"), ("fsdp2", "fsdp2", None))
SETUP_EXPERTS = 8
CAP_ITEMS = 1_500_000  # most save items built at once (about 1.5 GB of Python objects)


def setup_subset(model_id: str):
    """(subset model, {group prefix: how many groups of the full model it stands for})."""
    full = subset_model(model_id)
    if full.config.get("family") == "deepseek":
        dense = full.config["dense_layers"]
        sub = subset_model(model_id, [0, dense], experts=SETUP_EXPERTS)
        full_moe = len(next(g for g in full.groups if g.name == f"layers.{dense}").tensors)
        cut_moe = len(next(g for g in sub.groups if g.name == f"layers.{dense}").tensors)
        n_layers = full.config["layers"]
        return sub, {"model.layers.0": dense, f"model.layers.{dense}": (n_layers - dense) * full_moe / cut_moe, "": 1}
    n = full.config["layers"]
    return subset_model(model_id, [0, 1]), {"model.layers.0": n / 2, "model.layers.1": n / 2, "": 1}


def _setup_worker(world: int, rank: int, models, configs, trace: bool) -> list[dict]:
    """One (W, rank): every model and config, in a fresh process."""
    import warnings

    warnings.filterwarnings("ignore")
    from scale_setup import shard_rank, warm_up

    warm_up()
    rows = []
    for model_id in models:
        sub, weights = setup_subset(model_id)
        groups = wrap_groups(sub)
        for label, fw, gran in configs:
            try:
                st, chunks = shard_rank(sub, world, rank, fw, gran, want_chunks=True)
            except (ValueError, RuntimeError) as e:
                rows.append({"model": model_id, "config": label, "world": world, "rank": rank, "error": str(e)[:300]})
                continue
            pred = ragged_chunks(groups, ragged_plans(groups, world, gran), world, [rank])[rank] if fw == "ragged_fsdp" \
                else fsdp2_chunks(groups, world, rank)
            row = {"model": model_id, "config": label, "world": world, "rank": rank,
                   "layout_math_matches_dcp": sorted(chunks) == sorted(pred),
                   "cpu_s": sum(st.cpu_s[g] * w for g, w in weights.items()),
                   "cpu_s_subset": sum(st.cpu_s.values()),
                   "agree_sent_bytes": sum(st.sent[g] * w for g, w in weights.items()),
                   "agree_received_bytes": sum(st.received[g] * w for g, w in weights.items()),
                   "agree_collectives": sum(st.collectives[g] * w for g, w in weights.items()),
                   "agree_cpu_s": sum(st.check_cpu_s[g] * w for g, w in weights.items())}
            if trace:
                st2, _ = shard_rank(sub, world, rank, fw, gran, trace_memory=True)
                row["mem_bytes"] = sum(st2.mem_bytes[g] * w for g, w in weights.items())
            rows.append(row)
    return rows


def run_setup(models, worlds, configs, processes: int = 1) -> list[dict]:
    """Set-up rows for the first, middle and last rank of each W (see the module docstring)."""
    jobs = [(w, r, r == w // 2) for w in worlds for r in sorted({0, w // 2, w - 1})]
    ctx = mp.get_context("spawn")
    rows = []
    with cf.ProcessPoolExecutor(max_workers=processes, mp_context=ctx, max_tasks_per_child=1) as ex:
        futs = [ex.submit(_setup_worker, w, r, list(models), list(configs), trace) for w, r, trace in jobs]
        for f in futs:
            rows += f.result()
    return rows


# -- planning ---------------------------------------------------------------------------------
def _shapes(groups):
    return {wg.fqn(n): s for wg in groups for n, s in zip(wg.names, wg.shapes)}


def _chunks_for(groups, world, fw, gran, ranks=None):
    if fw == "ragged_fsdp":
        return ragged_chunks(groups, ragged_plans(groups, world, gran), world, ranks)
    return {r: fsdp2_chunks(groups, world, r) for r in (range(world) if ranks is None else ranks)}


def _tensor_subset(groups, keep: int):
    """The first ``keep`` tensors (in group order), as groups."""
    from scale_layout import WrapGroup

    out, left = [], keep
    for wg in groups:
        if left <= 0:
            break
        n = min(left, len(wg.names))
        out.append(WrapGroup(wg.prefix, wg.names[:n], wg.shapes[:n]))
        left -= n
    return out


def _coordinator(groups, world, fw, gran, planner: str, total_items: int, cap: int, subset=None):
    """create_global_plan on all ``world`` local plans of ``groups`` (or of ``subset``, or of a
    tensor prefix when the items exceed ``cap``), scaled by items to ``total_items``.
    Returns (row, metadata, the groups planned)."""
    from ragged_fsdp.checkpoint.scale_planner import ScaleSavePlanner
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    import scale_dcp

    sub = groups if subset is None else subset
    n_tensors = sum(len(wg.names) for wg in sub)
    keep, items = n_tensors, (total_items if subset is None else None)
    while True:
        part = _tensor_subset(sub, keep)
        if items is None:
            items = sum(items_per_rank(part, ragged_plans(part, world, gran) if fw == "ragged_fsdp" else None, world))
        if items <= cap or keep == 1:
            break
        keep, items = max(1, int(keep * cap / items * 0.9)), None
    chunks = _chunks_for(part, world, fw, gran)
    plans = scale_dcp.save_plans(chunks, _shapes(part))
    del chunks
    res = scale_dcp.coordinator_save(plans, ScaleSavePlanner if planner == "scale" else DefaultSavePlanner)
    measured = sum(len(p.items) for p in plans)
    del plans
    factor = total_items / measured if measured else 1.0
    md = res.pop("metadata")
    out = {k: (v * factor if k != "metadata_chunks" else v) for k, v in res.items()}
    out.update(measured_items=measured, scale=factor,
               basis="measured" if abs(factor - 1) < 1e-9 else f"scaled x {factor:.1f} by items")
    return out, md, part


def run_planning(models, worlds, configs, load_to: int | None, cap: int = CAP_ITEMS,
                 default_planner_max_world: int = 4096) -> list[dict]:
    """Save (and load) planning rows: one per (model, config, W, planner)."""
    import scale_local

    rows = []
    for model_id in models:
        groups = wrap_groups(subset_model(model_id))
        # DCP's default planner is run on block 0 alone (at full W: its cost per tensor is
        # what grows, quadratically in a wide tensor's chunks) and scaled by items
        small = wrap_groups(subset_model(model_id, [0]))[:1]
        for label, fw, gran in configs:
            for world in worlds:
                base = {"model": model_id, "config": label, "world": world}
                try:
                    plans = ragged_plans(groups, world, gran) if fw == "ragged_fsdp" else None
                except ValueError as e:
                    rows.append({**base, "error": str(e)[:300]})
                    continue
                counts = items_per_rank(groups, plans, world)
                total = sum(counts)
                pad = (sum(p.padding for p in plans) / sum(p.used for p in plans)) if plans else None
                info = {**base, "items_total": total, "items_max": max(counts),
                        "items_median": statistics.median(counts), "padding_ratio": pad}
                for planner in ("scale", "default"):
                    if planner == "default" and fw == "fsdp2" and world > default_planner_max_world:
                        rows.append({**info, "planner": planner, "basis": "extrapolated"})
                        continue
                    t0 = time.process_time()
                    # FSDP2's plans hold W x tensors items: a third of the cap keeps its runs short
                    res, md, part = _coordinator(groups, world, fw, gran, planner, total,
                                                 cap if fw == "ragged_fsdp" else cap // 3,
                                                 small if planner == "default" else None)
                    row = {**info, "planner": planner, **res}
                    if planner == "scale":
                        if load_to:  # the largest W onto load_to, every other W onto W / 2 (growth)
                            to = load_to if world == max(worlds) else max(1, world // 2)
                            row["load"] = _load_rows(groups, part, to, fw, gran, md, res)
                        if fw == "ragged_fsdp":
                            row["local_save"] = scale_local.plan_local(groups, plans, world, load_to, gran)
                    row["bench_cpu_s"] = time.process_time() - t0
                    print(f"[scale] {model_id} {label} W={world} {planner}: coordinator {row.get('cpu_s', 0):.2f} s "
                          f"({row.get('basis')})", file=sys.stderr, flush=True)
                    rows.append(row)
                    del md
                del plans
    return rows


def _load_rows(groups, part, world, fw, gran, md, saved) -> dict:
    """Per sampled rank of ``world``: DCP's load planning against the saved metadata (of
    ``part``, a tensor prefix when the save was planned on one: scaled by tensors)."""
    import scale_dcp

    factor = sum(len(wg.names) for wg in groups) / sum(len(wg.names) for wg in part)
    out = {"world": world, "ranks": {}, "scale": factor,
           "basis": "measured" if factor == 1 else f"scaled x {factor:.1f} by tensors"}
    target = ragged_plans(part, world, gran) if fw == "ragged_fsdp" else None
    for r in sorted({0, world // 2, world - 1}):
        c = ragged_chunks(part, target, world, [r])[r] if target else fsdp2_chunks(part, world, r)
        got = scale_dcp.load_plan_rank(md, c)
        out["ranks"][r] = {k: v if isinstance(v, bool) or k == "fallback_tensors" else v * factor
                           for k, v in got.items()}
    out["metadata_read_cpu_s"] = saved["metadata_read_cpu_s"]
    out["gathered_bytes"] = statistics.mean(v["plan_bytes"] for v in out["ranks"].values()) * world
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/scale.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    ap.add_argument("--configs", default=",".join(c[0] for c in CONFIGS))
    ap.add_argument("--load-to", type=int, default=None, help="plan a load onto this many ranks (default: W_max / 2)")
    ap.add_argument("--skip-setup", action="store_true", help="planning only")
    ap.add_argument("--skip-planning", action="store_true", help="set-up only")
    ap.add_argument("--keep-from", default=None, metavar="JSON",
                    help="a previous report: its rows that this run does not measure (other configs, or every "
                         "planning row with --skip-planning) are kept, and its date is recorded with them")
    ap.add_argument("--cap-items", type=int, default=CAP_ITEMS)
    ap.add_argument("--out", default="docs/data/scale.json")
    ap.add_argument("--png", default="docs/scale.png")
    ap.add_argument("--sim-out", default="src/ragged_fsdp/sim/data/host_costs.json",
                    help="the simulator's host-cost table ('' to skip)")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    worlds = sorted(int(w) for w in args.worlds.split(","))
    configs = [c for c in CONFIGS if c[0] in args.configs.split(",")]
    load_to = args.load_to or max(worlds) // 2
    t0 = time.process_time()
    setup = [] if args.skip_setup else run_setup(models, worlds, configs)
    planning = [] if args.skip_planning else run_planning(models, worlds, configs, load_to, args.cap_items)
    kept_from = None
    if args.keep_from:
        old = json.loads(Path(args.keep_from).read_text())
        kept_from = {"file": args.keep_from, "date": old.get("meta", {}).get("date")}
        measured = {(m, c[0]) for m in models for c in configs}

        def keep(rows, skipped):
            return [dict(r, kept_from=r.get("kept_from", kept_from["date"])) for r in rows  # first measured
                    if skipped or (r["model"], r["config"]) not in measured]

        setup += keep(old.get("setup", []), args.skip_setup)
        planning += keep(old.get("planning", []), args.skip_planning)
    from scale_report import plot, sim_table, summarize, table

    summary = summarize(setup, planning)
    if args.sim_out:
        Path(args.sim_out).write_text(json.dumps(sim_table(summary, run_meta()), indent=1) + "\n")
    report = {"meta": run_meta(), "worlds": worlds, "load_to": load_to, "setup": setup, "planning": planning,
              "summary": summary, "bench_cpu_s_main": time.process_time() - t0, "kept_from": kept_from}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(table(summary))
    made = plot(summary, args.png)
    print(f"wrote {args.out}" + (f" and {made}" if made else " (install matplotlib for the PNG)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
