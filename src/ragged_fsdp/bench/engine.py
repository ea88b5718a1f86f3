"""ragged_fsdp beside torch's FSDP2, FSDP1 and DDP, side by side in one launch per world size.

For each workload (small dense LLaMA, MoE with 32 fused experts per layer, a parameter-dominated
dense LLaMA; the targets table of issue 10) every framework trains the same per-rank batch:
ragged_fsdp (with ``ragged_fsdp.optim.AdamW``), torch's FSDP2 ``fully_shard``, FSDP1
(``FullyShardedDataParallel``, one unit per block, flat parameters), DDP, and a plain local
model with no communication (the floor); the torch frameworks use ``torch.optim.AdamW(foreach=
True)``. Rounds alternate the order of the frameworks; each round times a few steps of each,
and ratios are medians over rounds of the per-round ratio against FSDP2. Also measured per
framework: peak tracked memory (torch's MemTracker, model and optimizer tracked) over one step
and its composition at that peak by MemTracker's reference types (parameters, gradients,
optimizer state, activations, temporaries, ...), the forward+backward peak, and the bytes
written by copy/cast ops in one step beyond what the local model copies.

    python -m ragged_fsdp bench [--world 2,4] [--rounds 7] [--steps 3] [--png out/bench_engine.png]
    python -m ragged_fsdp bench --quick      # tiny models, one round: checks it runs end to end
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

VARIANTS = ("ragged_fsdp", "fsdp2", "fsdp1", "ddp", "local")
WORKLOADS = ("dense", "moe", "dense-1024")
MEM_KINDS = ("Parameter", "Buffer", "Gradient", "Optstate", "Activation", "Temp", "Other")


@dataclass
class BenchConfig:
    world: int = 2
    worlds: tuple[int, ...] = (2, 4)
    rounds: int = 7
    steps: int = 3
    models: tuple[str, ...] = WORKLOADS
    frameworks: tuple[str, ...] = VARIANTS
    batch: int = 4
    seq_len: int = 128
    profile: bool = False
    quick: bool = False  # tiny models, for tests
    out: str = "out/bench_engine.json"
    png: str | None = "out/bench_engine.png"


def batch_shape(kind: str, cfg: BenchConfig) -> tuple[int, int]:
    if cfg.quick:
        return 2, 16
    return (1, 32) if kind in ("dense-wide", "dense-1024") else (cfg.batch, cfg.seq_len)


def build(kind: str, seq_len: int, quick: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    if quick:  # the same architectures, tiny
        from ragged_fsdp.models.llama import Llama, LlamaConfig
        from ragged_fsdp.models.moe import MoE, MoEConfig

        if kind == "moe":
            return MoE(MoEConfig(vocab_size=2048, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=8,
                                 top_k=2, expert_hidden=16, max_seq_len=seq_len, fused_experts=True))
        if kind in ("dense", "dense-wide", "dense-1024"):
            return Llama(LlamaConfig(vocab_size=2048, dim=32 if kind == "dense" else 64, n_layers=2,
                                     n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=seq_len))
    if kind == "dense":
        from ragged_fsdp.models.llama import Llama, LlamaConfig

        return Llama(LlamaConfig(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=4,
                                 ffn_hidden=704, max_seq_len=seq_len))
    if kind in ("dense-wide", "dense-1024"):
        # Parameters and gradients dominate (as with activation checkpointing at scale):
        # this is where what the framework does with parameter memory shows. dense-1024 is the
        # issue-10 target workload; dense-wide (dim 512) is what earlier reports measured.
        from ragged_fsdp.models.llama import Llama, LlamaConfig

        if kind == "dense-wide":
            return Llama(LlamaConfig(vocab_size=2048, dim=512, n_layers=4, n_heads=8, n_kv_heads=4,
                                     ffn_hidden=1408, max_seq_len=seq_len))
        return Llama(LlamaConfig(vocab_size=2048, dim=1024, n_layers=4, n_heads=16, n_kv_heads=8,
                                 ffn_hidden=2816, max_seq_len=seq_len))
    if kind == "moe":
        # Fused 3-D experts: with separate expert modules, an expert that gets no token on
        # one rank has no gradient there, and FSDP2 then reduce-scatters a different set
        # of tensors on each rank (a collective mismatch; ragged_fsdp handles it).
        from ragged_fsdp.models.moe import MoE, MoEConfig

        return MoE(MoEConfig(vocab_size=2048, dim=128, n_layers=4, n_heads=4, n_kv_heads=2,
                             n_experts=32, top_k=2, expert_hidden=128, max_seq_len=seq_len,
                             fused_experts=True))
    raise ValueError(f"unknown model kind {kind!r}: expected dense, moe, dense-1024 or dense-wide")


def wrap(model: torch.nn.Module, variant: str, mesh) -> torch.nn.Module:
    if variant == "local":
        return model
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if variant == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        block = type(model.layers[0])
        # FSDP1's default flat parameters (use_orig_params=False): MemTracker cannot hook the
        # non-leaf views use_orig_params=True registers
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({block}),
                                        device_id=torch.device("cpu"))
    if variant == "ragged_fsdp":
        from ragged_fsdp import fully_shard
    elif variant == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        raise ValueError(f"unknown framework {variant!r}: expected one of {VARIANTS}")
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_optimizer(model: torch.nn.Module, variant: str):
    if variant == "ragged_fsdp":
        from ragged_fsdp.optim import AdamW

        return AdamW(model.parameters(), lr=1e-4)
    return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, cfg: BenchConfig, port: int, queue) -> None:
    try:
        _bench_rank(rank, cfg, port, queue)
    except BaseException:
        import traceback

        queue.put(("error", rank, traceback.format_exc()))
        raise


def _bench_rank(rank: int, cfg: BenchConfig, port: int, queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from .copies import CopyCounter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=cfg.world, timeout=datetime.timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (cfg.world,))
    report = {}
    variants = tuple(cfg.frameworks)
    for kind in cfg.models:
        g = torch.Generator().manual_seed(1000 + rank)
        batch, seq = batch_shape(kind, cfg)
        x = torch.randint(0, 2048, (batch, seq), generator=g)
        y = torch.randint(0, 2048, (batch, seq), generator=g)
        runs, passes = {}, {}
        for v in variants:
            model = wrap(build(kind, cfg.seq_len, cfg.quick), v, mesh)
            opt = make_optimizer(model, v)

            def fwd_bwd(model=model):
                logits = model(x)
                F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).backward()

            def step(model=model, opt=opt, fwd_bwd=fwd_bwd):
                fwd_bwd()
                opt.step()
                opt.zero_grad(set_to_none=True)

            runs[v] = step
            passes[v] = (model, fwd_bwd, opt)
            for _ in range(1 if cfg.quick else 2):  # warm-up: optimizer state, allocator
                step()
        times = {v: [] for v in variants}
        for r in range(cfg.rounds):
            k = r % len(variants)
            order = variants[k:] + variants[:k]
            for v in order:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(cfg.steps):
                    runs[v]()
                dist.barrier()
                times[v].append((time.perf_counter() - t0) / cfg.steps)
        res = {"step_s": times, "batch": [batch, seq]}
        base = "fsdp2" if "fsdp2" in variants else variants[0]
        res["vs_fsdp2"] = {v: statistics.median(a / b for a, b in zip(times[v], times[base])) for v in variants}
        if "ragged_fsdp" in variants and "fsdp2" in variants:
            res["ratio_vs_fsdp2"] = res["vs_fsdp2"]["ragged_fsdp"]
        if "local" in variants:
            res["vs_local"] = {v: statistics.median(a / b for a, b in zip(times[v], times["local"])) for v in variants}
        res["peak_bytes"] = {}
        res["peak_composition"] = {}
        res["copy_bytes"] = {}
        res["peak_bytes_fwd_bwd"] = {}
        for v in variants:
            model, fwd_bwd, opt = passes[v]
            comp = _peak_composition(runs[v], model, opt)
            res["peak_composition"][v] = comp
            res["peak_bytes"][v] = comp["Total"]
            # Forward + backward only (the optimizer step's states and temporaries differ
            # only by the optimizer).
            res["peak_bytes_fwd_bwd"][v] = _peak_composition(fwd_bwd, model, opt)["Total"]
            opt.zero_grad(set_to_none=True)
            with CopyCounter() as c:
                runs[v]()
            res["copy_bytes"][v] = dict(c.by_op)
        if cfg.profile and rank == 0:
            res["profile"] = {v: _profile(runs[v]) for v in ("ragged_fsdp", "fsdp2") if v in variants}
        elif cfg.profile:
            for v in ("ragged_fsdp", "fsdp2"):
                if v in variants:
                    _profile(runs[v])
        report[kind] = res
        del runs, passes
    if rank == 0:
        queue.put(("ok", rank, report))
    dist.barrier()
    dist.destroy_process_group()


def _peak_composition(step, model, opt) -> dict[str, int]:
    """Peak live tensor bytes of ``step`` (torch's MemTracker, model and optimizer tracked)
    and what was live at that peak, by MemTracker's reference type; the kinds sum to Total."""
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(model, opt)
    with mt:
        step()
    snap = mt.get_tracker_snapshot("peak")
    out = {k: 0 for k in MEM_KINDS}
    total = 0
    for dev in snap.values():
        for k, b in dev.items():
            if k == "Total":
                total += int(b)
            else:
                out[k] = out.get(k, 0) + int(b)
    out["Total"] = total
    return out


def _profile(step) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


def run(cfg: BenchConfig) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, cfg, port, queue)) for r in range(cfg.world)]
    for p in procs:
        p.start()
    status, rank, report = queue.get()
    if status != "ok":
        for p in procs:
            p.kill()
        raise RuntimeError(f"bench rank {rank} failed:\n{report}")
    for p in procs:
        p.join()
    return report


def _table(head, rows) -> str:
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def print_report(cfg: BenchConfig, report: dict) -> None:
    """Per workload: step time and peak memory of every framework, and ratios against FSDP2."""
    variants = [v for v in cfg.frameworks]
    print(f"\nW={cfg.world} gloo ranks, {cfg.rounds} rounds x {cfg.steps} steps; ratios are medians of "
          "per-round ratios against FSDP2; peak = MemTracker peak over one step")
    head = ("workload", "framework", "step ms", "step vs FSDP2", "peak MiB", "peak vs FSDP2",
            "fwd+bwd peak vs FSDP2", "copy bytes/step")
    rows = []
    for kind, r in report.items():
        local_copies = sum(r["copy_bytes"]["local"].values()) if "local" in r["copy_bytes"] else 0
        base = r["peak_bytes"].get("fsdp2")
        base_fb = r["peak_bytes_fwd_bwd"].get("fsdp2")
        for v in variants:
            ms = statistics.median(r["step_s"][v]) * 1e3
            rows.append((
                kind, v, f"{ms:.1f}", f"{r['vs_fsdp2'][v]:.2f}", f"{r['peak_bytes'][v] / 2**20:.1f}",
                f"{r['peak_bytes'][v] / base:.3f}" if base else "-",
                f"{r['peak_bytes_fwd_bwd'][v] / base_fb:.3f}" if base_fb else "-",
                f"{max(0, sum(r['copy_bytes'][v].values()) - local_copies):,}",
            ))
    print(_table(head, rows))
    print_composition(cfg, report)
    for kind, r in report.items():
        for v, prof in r.get("profile", {}).items():
            print(f"\n-- profile: {kind} / {v} (one step, rank 0) --\n{prof}")


def print_composition(cfg: BenchConfig, report: dict) -> None:
    """What is live at each framework's peak, by MemTracker reference type (MiB)."""
    print(f"\nmemory live at the peak of one step, by kind (MiB, rank 0, W={cfg.world}; MemTracker's "
          "reference types: Temp = allocated during backward outside forward, e.g. gradient buffers "
          "a framework allocates itself and gradients of activations)")
    head = ("workload", "framework") + MEM_KINDS + ("Total",)
    rows = []
    for kind, r in report.items():
        for v, comp in r["peak_composition"].items():
            rows.append((kind, v) + tuple(f"{comp.get(k, 0) / 2**20:.2f}" for k in MEM_KINDS + ("Total",)))
    print(_table(head, rows))


def plot(reports: dict[int, dict], cfg: BenchConfig, path: str) -> str | None:
    """Bars of step time and peak memory per framework and workload, one column per world size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    worlds = sorted(reports)
    variants = list(cfg.frameworks)
    fig, axes = plt.subplots(2, len(worlds), figsize=(6 * len(worlds), 7), squeeze=False)
    width = 0.8 / len(variants)
    for c, w in enumerate(worlds):
        rep = reports[w]
        kinds = list(rep)
        for row, (metric, label) in enumerate((("step", "step time (ms)"), ("peak", "peak tracked memory (MiB)"))):
            ax = axes[row][c]
            for j, v in enumerate(variants):
                vals = [statistics.median(rep[k]["step_s"][v]) * 1e3 if metric == "step"
                        else rep[k]["peak_bytes"][v] / 2**20 for k in kinds]
                ax.bar([i + j * width for i in range(len(kinds))], vals, width, label=v)
            ax.set_xticks([i + width * (len(variants) - 1) / 2 for i in range(len(kinds))])
            ax.set_xticklabels(kinds)
            ax.set_ylabel(label)
            ax.set_title(f"W={w} gloo ranks (CPU)")
            if row == 0 and c == 0:
                ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="step time / memory / copies of ragged_fsdp vs torch FSDP2, FSDP1, DDP")
    d = BenchConfig()
    p.add_argument("--world", default=",".join(map(str, d.worlds)), help="world sizes, e.g. 2,4")
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--models", default=",".join(d.models))
    p.add_argument("--frameworks", default=",".join(d.frameworks))
    p.add_argument("--quick", action="store_true", help="tiny models, one round of one step (a smoke test)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=d.out)
    p.add_argument("--png", default=d.png)


def main(args) -> int:
    worlds = tuple(int(w) for w in str(args.world).split(","))
    base = dict(rounds=args.rounds, steps=args.steps, models=tuple(args.models.split(",")),
                frameworks=tuple(args.frameworks.split(",")), profile=args.profile, out=args.out,
                png=args.png, quick=args.quick, worlds=worlds)
    if args.quick:
        base.update(rounds=1, steps=1)
    reports, configs = {}, {}
    for w in worlds:
        cfg = BenchConfig(world=w, **base)
        reports[w] = run(cfg)
        configs[w] = cfg
        print_report(cfg, reports[w])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    # "report" keeps its shape (per workload) for readers of earlier files (sim.bench_check):
    # the W=2 launch when there is one; every launch is under "by_world".
    first = 2 if 2 in reports else worlds[0]
    Path(args.out).write_text(json.dumps({"config": asdict(configs[first]), "report": reports[first],
                                          "by_world": {str(w): r for w, r in reports.items()}},
                                         indent=1, default=str))
    print(f"\nwrote {args.out}")
    if args.png:
        made = plot(reports, configs[worlds[0]], args.png)
        print(f"wrote {made}" if made else "(install matplotlib for the PNG)")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="command")
    add_parser(sub)
    raise SystemExit(main(ap.parse_args(["bench"] + __import__("sys").argv[1:])))
