"""Report on the structure-aware optimizers, on the demo's reference LLaMA-style model.

    python benchmarks/optim_report.py [--world 4] [--steps 300] [--out out/optim_report]

Part 1 (``--world`` gloo ranks, the model wrapped with ``fully_shard``):

* Muon, per step: Newton-Schulz flops per rank (max / mean), bytes each rank sends (pieces to
  owners and results back) against an all-gather-everything design (every rank gathers every
  matrix: ``(W - 1) x`` its local elements, counted in the same bf16), and the optimizer step
  time against ``torch.optim.AdamW`` on the same sharded model. Two layouts: matrices kept
  whole (``granularity_fn=combined_granularity(model)``: Muon's ``"tensor"`` for hidden
  matrices) and element granularity (no policy: matrices are split and owners are chosen).
* AdamW8bit: optimizer-state bytes (all ranks) against ``torch.optim.AdamW``'s, and step time.
* Shampoo (the demo's settings, ``granularity_fn=Shampoo.granularity_for(128)``): step time
  against AdamW without and with a root recomputation (and amortised over the demo's
  ``precondition_frequency``), eigh flops of one recomputation per rank (max / mean), state
  bytes against AdamW's, and how many tiles FSDP2's equal ``Shard(0)`` chunks would cut.

Part 2 (one process; the per-element math is the same at any world size): the demo's training
recipe (data, warmup, clipping, weight decay 0.1, betas (0.9, 0.95)) for ``--steps`` steps with
fp32 AdamW and with AdamW8bit (and Muon with ``--muon-loss``, Shampoo with ``--shampoo-loss``);
final losses compared.

Writes ``report.json`` and ``report.md`` under ``--out`` (``--json PATH`` moves the JSON) and
prints the tables. Besides the nested results the JSON has flat ``rows`` (``rows.muon``,
``rows.adamw8bit``, ``rows.shampoo_steps``, ``rows.shampoo_ranks``, ``rows.shampoo``,
``rows.loss``) that ``python benchmarks/render.py`` turns into the tables of
``docs/optimizers.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from ragged_fsdp.bench.meta import run_meta


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_cfg(args):
    from ragged_fsdp.train import TrainConfig

    return replace(TrainConfig(), steps=args.steps)


def _assign_grads(model, step: int):
    import ragged_fsdp as rf

    g = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        full = torch.randn(p.shape, generator=g) * 1e-2
        p.grad = rf.distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)


def _time_steps(opt, model, iters: int) -> float:
    """Median over ``iters`` of the slowest rank's optimizer step (seconds)."""
    times = []
    for i in range(iters + 2):
        _assign_grads(model, i)
        dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i >= 2:  # two warm-up steps (state allocation, plan)
            times.append(float(t))
    return statistics.median(times)


def _gather(x: float) -> list[float]:
    t = torch.zeros(dist.get_world_size(), dtype=torch.float64)
    t[dist.get_rank()] = float(x)
    dist.all_reduce(t)
    return t.tolist()


def _worker(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    try:
        queue.put((rank, _distributed_part(rank, world, args)))
    except Exception as e:  # report, do not hang the parent
        import traceback

        queue.put((rank, {"error": traceback.format_exc() + str(e)}))
    dist.barrier()
    dist.destroy_process_group()


def _distributed_part(rank, world, args) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_fsdp.optim import AdamW8bit, Muon, combined_granularity, muon_param_groups, state_bytes
    from ragged_fsdp.train import build_model, shard

    cfg = _train_cfg(args)
    mesh = init_device_mesh("cpu", (world,))
    out: dict = {"world": world, "muon": {}}

    def wrapped(policy):
        model = build_model(cfg)
        fn = policy(model) if policy is not None else None
        return shard(model, "ragged_fsdp", mesh, fn)

    # AdamW baseline (the demo's optimizer), element granularity
    model = wrapped(None)
    adamw = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1, betas=(0.9, 0.95), foreach=True)
    t_adamw = _time_steps(adamw, model, args.iters)
    adamw_state = sum(_gather(state_bytes(adamw)))
    out["adamw_step_s"] = t_adamw
    del model, adamw

    for label, policy in (("whole matrices (combined_granularity)", combined_granularity),
                          ("element granularity (no policy)", None)):
        model = wrapped(policy)
        groups = muon_param_groups(model, muon={"lr": cfg.lr, "adjust_lr_fn": "match_rms_adamw"},
                                   adamw={"lr": cfg.lr, "betas": (0.9, 0.95)})
        opt = Muon(groups, lr=cfg.lr, weight_decay=0.1)
        t = _time_steps(opt, model, args.iters)
        st = opt.last_step_stats
        flops = st["ns_flops_per_rank"]
        sent = _gather(st["bytes_sent"])
        ag = _gather(st["allgather_bytes_sent"])
        mean_flops = sum(flops) / len(flops)
        out["muon"][label] = {
            "ns_flops_per_rank": flops,
            "ns_flops_max_over_mean": max(flops) / mean_flops if mean_flops else 1.0,
            "bytes_sent_per_rank": sent,
            "allgather_bytes_sent_per_rank": ag,
            "bytes_ratio_vs_allgather": (sum(sent) / sum(ag)) if sum(ag) else 0.0,
            "step_s": t,
            "step_ratio_vs_adamw": t / t_adamw,
            "matrices": sum(1 for g in groups if g["use_muon"] for _ in g["params"]),
        }
        del model, opt

    model = wrapped(lambda m: AdamW8bit.granularity)
    opt8 = AdamW8bit(model.parameters(), lr=cfg.lr, weight_decay=0.1, betas=(0.9, 0.95))
    t8 = _time_steps(opt8, model, args.iters)
    s8 = sum(_gather(state_bytes(opt8)))
    out["adamw8bit"] = {"step_s": t8, "step_ratio_vs_adamw": t8 / t_adamw, "state_bytes": s8,
                        "adamw_state_bytes": adamw_state, "state_ratio": s8 / adamw_state,
                        "params": sum(p.numel() for p in model.parameters())}
    del model, opt8
    out["shampoo"] = _shampoo_part(wrapped, cfg, args, world, t_adamw, adamw_state)
    return out


def _shampoo_part(wrapped, cfg, args, world, t_adamw, adamw_state) -> dict:
    """Shampoo with the demo's settings on the sharded model: step time with and without a
    root recomputation, eigh flops per rank, state bytes, tiles FSDP2's layout would cut."""
    from ragged_fsdp.optim import Shampoo, state_bytes
    from ragged_fsdp.optim.shampoo_blocks import tiles_cut, tiles_of
    from ragged_fsdp.placement.redistribute import chunk_ranges
    from ragged_fsdp.train import SHAMPOO_DEMO

    B = SHAMPOO_DEMO["max_preconditioner_dim"]
    res = {"max_preconditioner_dim": B, "precondition_frequency": SHAMPOO_DEMO["precondition_frequency"]}
    for label, freq in (("no_root", 10**9), ("with_root", 1)):
        model = wrapped(lambda m: Shampoo.granularity_for(max_preconditioner_dim=B))
        kw = dict(SHAMPOO_DEMO, precondition_frequency=freq, start_preconditioning_step=1)
        opt = Shampoo(list(model.named_parameters()), lr=cfg.lr, **kw)
        res[f"step_s_{label}"] = _time_steps(opt, model, args.iters)
        if label == "with_root":
            flops = opt.eigh_flops_per_rank()
            mean = sum(flops) / len(flops)
            res["eigh_flops_per_rank"] = flops
            res["eigh_flops_max_over_mean"] = max(flops) / mean if mean else 1.0
            st = _gather(state_bytes(opt))
            res["state_bytes_per_rank"] = st
            res["state_bytes"] = sum(st)
            res["adamw_state_bytes"] = adamw_state
            res["state_ratio"] = sum(st) / adamw_state
            shapes = [tuple(p.shape) for p in model.parameters()]
        del model, opt
    f = res["precondition_frequency"]
    res["step_s_amortised"] = res["step_s_no_root"] + (res["step_s_with_root"] - res["step_s_no_root"]) / f
    for k in ("no_root", "with_root", "amortised"):
        res[f"step_ratio_vs_adamw_{k}"] = res[f"step_s_{k}"] / t_adamw
    res["tiles"] = sum(len(tiles_of(s, B)) for s in shapes)
    res["tiles_cut_by_fsdp2_shard0"] = sum(tiles_cut(s, B, chunk_ranges(s, world)) for s in shapes)
    return res


@torch.no_grad()
def _eval_loss(model, batches, n: int = 8) -> float:
    """Mean loss on ``n`` held-out global batches (a data seed training never uses)."""
    total = 0.0
    for i in range(n):
        x, y = batches.global_batch_at(i)
        logits = model(x)
        total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).item()
    return total / n


def _loss_run(args, name: str) -> tuple[list[float], float]:
    """The demo's recipe in one process with optimizer ``name``: per-step training losses
    and the final held-out loss."""
    from ragged_fsdp.data import Batches, load_tokens
    from ragged_fsdp.optim import AdamW8bit, Muon, Shampoo, muon_param_groups
    from ragged_fsdp.train import SHAMPOO_DEMO, build_model

    cfg = _train_cfg(args)
    model = build_model(cfg)
    if name == "shampoo":
        opt = Shampoo(list(model.named_parameters()), lr=cfg.lr, **SHAMPOO_DEMO)
    elif name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1, betas=(0.9, 0.95))
    elif name == "adamw8bit":
        opt = AdamW8bit(model.parameters(), lr=cfg.lr, weight_decay=0.1, betas=(0.9, 0.95))
    else:
        opt = Muon(muon_param_groups(model, muon={"lr": cfg.lr, "adjust_lr_fn": "match_rms_adamw"},
                                     adamw={"lr": cfg.lr, "betas": (0.9, 0.95)}), lr=cfg.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup))
    batches = Batches(load_tokens(cfg.data), cfg.seq_len, cfg.global_batch, seed=cfg.seed)
    losses = []
    for i in range(cfg.steps):
        x, y = batches.global_batch_at(i)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    held_out = Batches(batches.tokens, cfg.seq_len, cfg.global_batch, seed=cfg.seed + 999_983)
    return losses, _eval_loss(model, held_out)


def _tail_mean(losses: list[float], n: int = 10) -> float:
    return sum(losses[-n:]) / len(losses[-n:])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=300, help="training steps of the loss comparison")
    p.add_argument("--iters", type=int, default=8, help="timed optimizer steps per configuration")
    p.add_argument("--muon-loss", action="store_true", help="also train with Muon in part 2")
    p.add_argument("--shampoo-loss", action="store_true", help="also train with Shampoo in part 2")
    p.add_argument("--loss-optimizers", default=None,
                   help="comma list for part 2 instead of the above (adamw first), e.g. adamw,muon,shampoo")
    p.add_argument("--skip-loss", action="store_true", help="only part 1")
    p.add_argument("--out", default="out/optim_report")
    p.add_argument("--json", default=None, help="write the JSON here instead of OUT/report.json")
    args = p.parse_args(argv)
    if args.world < 1:
        raise SystemExit(f"--world must be >= 1, got {args.world}")

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, queue)) for r in range(args.world)]
    for pr in procs:
        pr.start()
    results = dict(queue.get(timeout=3600) for _ in procs)
    for pr in procs:
        pr.join(timeout=60)
    dist_part = results[0]
    if "error" in dist_part:
        raise SystemExit(dist_part["error"])

    report = {"distributed": dist_part}
    if not args.skip_loss:
        torch.set_num_threads(max(1, os.cpu_count() or 1))
        names = ["adamw", "adamw8bit"] + (["muon"] if args.muon_loss else []) + (["shampoo"] if args.shampoo_loss else [])
        if args.loss_optimizers:
            names = [n.strip() for n in args.loss_optimizers.split(",") if n.strip()]
            if names[:1] != ["adamw"]:
                raise SystemExit("--loss-optimizers must start with adamw (the baseline)")
        runs, evals = {}, {}
        for n in names:
            t0 = time.perf_counter()
            runs[n], evals[n] = _loss_run(args, n)
            print(f"  trained {n}: {args.steps} steps in {time.perf_counter() - t0:.0f}s, "
                  f"held-out loss {evals[n]:.4f}", flush=True)
        base = evals["adamw"]
        report["loss"] = {
            "steps": args.steps,
            "held_out": evals,
            "rel_diff_vs_adamw": {n: (e - base) / base for n, e in evals.items()},
            "final_train": {n: r[-1] for n, r in runs.items()},
            "mean_last_10_train": {n: _tail_mean(r) for n, r in runs.items()},
            "losses": runs,
        }
    md = _markdown(report)
    print(md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    js = Path(args.json) if args.json else out / "report.json"
    js.parent.mkdir(parents=True, exist_ok=True)
    js.write_text(json.dumps({"meta": _meta(), **report, "rows": flat_rows(report)}, indent=1) + "\n")
    (out / "report.md").write_text(md)
    print(f"wrote {out / 'report.md'} and {js}")
    return report


def _meta() -> dict:
    meta = run_meta()
    load = meta.get("load_average")
    if load and float(load.split()[0]) > (meta.get("cpu_cores") or 1):
        # times move with the load; flops, bytes, state sizes and tile counts do not
        meta["note"] = (f"Load average above the {meta['cpu_cores']} cores: step times are noisy; "
                        "flops, bytes, state sizes and tile counts do not depend on load.")
    return meta


def flat_rows(report: dict) -> dict:
    """The report as flat rows, one list (or one object) per table, for ``render.py``."""
    d = report["distributed"]
    rows: dict = {"muon": []}
    for label, m in d["muon"].items():
        rows["muon"].append({
            "layout": label, "matrices": m["matrices"],
            "ns_flops_max_over_mean": m["ns_flops_max_over_mean"],
            "bytes_sent_max": max(m["bytes_sent_per_rank"]),
            "allgather_bytes_sent_max": max(m["allgather_bytes_sent_per_rank"]),
            "bytes_ratio_vs_allgather": m["bytes_ratio_vs_allgather"],
            "step_s": m["step_s"], "adamw_step_s": d["adamw_step_s"],
            "step_ratio_vs_adamw": m["step_ratio_vs_adamw"],
        })
    rows["adamw8bit"] = dict(d["adamw8bit"], adamw_step_s=d["adamw_step_s"])
    s = d["shampoo"]
    rows["shampoo_steps"] = [
        {"step": name, "step_s": s[f"step_s_{k}"], "step_ratio_vs_adamw": s[f"step_ratio_vs_adamw_{k}"],
         "adamw_step_s": d["adamw_step_s"]}
        for k, name in (("no_root", "without root recomputation"),
                        ("with_root", "with root recomputation (eigh)"),
                        ("amortised", f"amortised, roots every {s['precondition_frequency']} steps"))]
    rows["shampoo_ranks"] = [{"rank": r, "eigh_flops": f, "state_bytes": b}
                             for r, (f, b) in enumerate(zip(s["eigh_flops_per_rank"], s["state_bytes_per_rank"]))]
    rows["shampoo"] = {k: s[k] for k in ("max_preconditioner_dim", "precondition_frequency", "tiles",
                                          "tiles_cut_by_fsdp2_shard0", "eigh_flops_max_over_mean",
                                          "state_bytes", "adamw_state_bytes", "state_ratio")}
    rows["shampoo"]["world"] = d["world"]
    rows["shampoo"]["params"] = d["adamw8bit"]["params"]
    if "loss" in report:
        l = report["loss"]  # noqa: E741
        rows["loss"] = [{"optimizer": n, "steps": l["steps"], "held_out": l["held_out"][n],
                         "rel_diff_vs_adamw": l["rel_diff_vs_adamw"][n], "final_train": l["final_train"][n],
                         "mean_last_10_train": l["mean_last_10_train"][n]} for n in l["held_out"]]
    return rows


def _markdown(report: dict) -> str:
    d = report["distributed"]
    lines = [f"## Optimizers on the reference model, W = {d['world']} (gloo, CPU)", "",
             "| Muon layout | NS flops max/mean | bytes sent / rank (max) | all-gather design / rank (max) | ratio | step ms | vs AdamW |",
             "|---|---|---|---|---|---|---|"]
    for label, m in d["muon"].items():
        lines.append(
            f"| {label} | {m['ns_flops_max_over_mean']:.3f} | {max(m['bytes_sent_per_rank']) / 2**10:.1f} KiB | "
            f"{max(m['allgather_bytes_sent_per_rank']) / 2**10:.1f} KiB | {m['bytes_ratio_vs_allgather']:.2f} | "
            f"{m['step_s'] * 1e3:.1f} | {m['step_ratio_vs_adamw']:.2f}x |")
    a = d["adamw8bit"]
    lines += ["", f"AdamW (torch, foreach) step: {d['adamw_step_s'] * 1e3:.1f} ms", "",
              "| AdamW8bit | state bytes (all ranks) | AdamW fp32 state bytes | ratio | step ms | vs AdamW |",
              "|---|---|---|---|---|---|",
              f"| {a['params']:,} params | {a['state_bytes'] / 2**20:.2f} MiB | {a['adamw_state_bytes'] / 2**20:.2f} MiB | "
              f"{a['state_ratio']:.3f} | {a['step_s'] * 1e3:.1f} | {a['step_ratio_vs_adamw']:.2f}x |"]
    if "shampoo" in d:
        s = d["shampoo"]
        fl = s["eigh_flops_per_rank"]
        lines += ["", f"Shampoo (B = {s['max_preconditioner_dim']}, granularity_fn=Shampoo.granularity_for({s['max_preconditioner_dim']}), "
                  f"{s['tiles']} tiles; FSDP2's Shard(0) chunks would cut {s['tiles_cut_by_fsdp2_shard0']})", "",
                  "| step | ms | vs AdamW |", "|---|---|---|",
                  f"| without root recomputation | {s['step_s_no_root'] * 1e3:.1f} | {s['step_ratio_vs_adamw_no_root']:.2f}x |",
                  f"| with root recomputation (eigh) | {s['step_s_with_root'] * 1e3:.1f} | {s['step_ratio_vs_adamw_with_root']:.2f}x |",
                  f"| amortised, roots every {s['precondition_frequency']} steps | {s['step_s_amortised'] * 1e3:.1f} | "
                  f"{s['step_ratio_vs_adamw_amortised']:.2f}x |", "",
                  "| eigh GFLOP per rank (one recomputation) | max/mean | state bytes (all ranks) | AdamW state bytes | ratio |",
                  "|---|---|---|---|---|",
                  f"| {', '.join(f'{x / 1e9:.3f}' for x in fl)} | {s['eigh_flops_max_over_mean']:.3f} | "
                  f"{s['state_bytes'] / 2**20:.2f} MiB | {s['adamw_state_bytes'] / 2**20:.2f} MiB | {s['state_ratio']:.2f} |"]
    if "loss" in report:
        l = report["loss"]  # noqa: E741
        lines += ["", f"## Loss after {l['steps']} steps (demo recipe, one process)", "",
                  "| optimizer | held-out loss (8 batches) | vs AdamW | last train batch | mean of last 10 train |",
                  "|---|---|---|---|---|"]
        for n in l["held_out"]:
            lines.append(f"| {n} | {l['held_out'][n]:.4f} | {l['rel_diff_vs_adamw'][n] * 100:+.2f}% | "
                         f"{l['final_train'][n]:.4f} | {l['mean_last_10_train'][n]:.4f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
