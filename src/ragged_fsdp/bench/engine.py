"""ragged_fsdp versus torch's FSDP2, side by side in one launch on W gloo ranks.

For each model (dense LLaMA-style, MoE with >= 32 experts per layer) three variants train
the same per-rank batch: ragged_fsdp, FSDP2, and a plain local model with no sharding (the
floor). Rounds alternate the order of the variants; each round times a few steps of each,
and the reported figure is the median over rounds of the per-round ratio. Also measured per
variant: peak tracked memory (torch's MemTracker) over one step, and the bytes written by
copy/cast ops during one step, minus what the local model copies (the user's compute).

    python -m ragged_fsdp bench [--world 2] [--rounds 7] [--steps 3] [--profile]
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

VARIANTS = ("ragged_fsdp", "fsdp2", "local")


@dataclass
class BenchConfig:
    world: int = 2
    rounds: int = 7
    steps: int = 3
    models: tuple[str, ...] = ("dense", "moe", "dense-wide")
    batch: int = 4
    seq_len: int = 128
    profile: bool = False
    out: str = "out/bench_engine.json"


def build(kind: str, seq_len: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "dense":
        from ragged_fsdp.models.llama import Llama, LlamaConfig

        return Llama(LlamaConfig(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=4,
                                 ffn_hidden=704, max_seq_len=seq_len))
    if kind == "dense-wide":
        # Parameters and gradients dominate (as with activation checkpointing at scale):
        # this is where what the framework does with parameter memory shows.
        from ragged_fsdp.models.llama import Llama, LlamaConfig

        return Llama(LlamaConfig(vocab_size=2048, dim=512, n_layers=4, n_heads=8, n_kv_heads=4,
                                 ffn_hidden=1408, max_seq_len=seq_len))
    if kind == "moe":
        # Fused 3-D experts: with separate expert modules, an expert that gets no token on
        # one rank has no gradient there, and FSDP2 then reduce-scatters a different set
        # of tensors on each rank (a collective mismatch; ragged_fsdp handles it).
        from ragged_fsdp.models.moe import MoE, MoEConfig

        return MoE(MoEConfig(vocab_size=2048, dim=128, n_layers=4, n_heads=4, n_kv_heads=2,
                             n_experts=32, top_k=2, expert_hidden=128, max_seq_len=seq_len,
                             fused_experts=True))
    raise ValueError(f"unknown model kind {kind!r}: expected dense or moe")


def wrap(model: torch.nn.Module, variant: str, mesh) -> torch.nn.Module:
    if variant == "local":
        return model
    if variant == "ragged_fsdp":
        from ragged_fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


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
    for kind in cfg.models:
        g = torch.Generator().manual_seed(1000 + rank)
        batch, seq = (1, 32) if kind == "dense-wide" else (cfg.batch, cfg.seq_len)
        x = torch.randint(0, 2048, (batch, seq), generator=g)
        y = torch.randint(0, 2048, (batch, seq), generator=g)
        runs, passes = {}, {}
        for v in VARIANTS:
            model = wrap(build(kind, cfg.seq_len), v, mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

            def fwd_bwd(model=model):
                logits = model(x)
                F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).backward()

            def step(model=model, opt=opt, fwd_bwd=fwd_bwd):
                fwd_bwd()
                opt.step()
                opt.zero_grad(set_to_none=True)

            runs[v] = step
            passes[v] = (fwd_bwd, opt)
            for _ in range(2):  # warm-up: optimizer state, allocator
                step()
        times = {v: [] for v in VARIANTS}
        for r in range(cfg.rounds):
            order = VARIANTS[r % 3:] + VARIANTS[: r % 3]
            for v in order:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(cfg.steps):
                    runs[v]()
                dist.barrier()
                times[v].append((time.perf_counter() - t0) / cfg.steps)
        res = {"step_s": times}
        res["ratio_vs_fsdp2"] = statistics.median(a / b for a, b in zip(times["ragged_fsdp"], times["fsdp2"]))
        res["fsdp2_vs_local"] = statistics.median(a / b for a, b in zip(times["fsdp2"], times["local"]))
        res["ragged_vs_local"] = statistics.median(a / b for a, b in zip(times["ragged_fsdp"], times["local"]))
        res["peak_bytes"] = {}
        res["copy_bytes"] = {}
        res["peak_bytes_fwd_bwd"] = {}
        for v in VARIANTS:
            res["peak_bytes"][v] = _peak(runs[v])
            # Forward + backward only: where FSDP frameworks differ (the optimizer step's
            # states and foreach temporaries are the same for every framework).
            fwd_bwd, opt = passes[v]
            res["peak_bytes_fwd_bwd"][v] = _peak(fwd_bwd)
            opt.zero_grad(set_to_none=True)
            with CopyCounter() as c:
                runs[v]()
            res["copy_bytes"][v] = dict(c.by_op)
        if cfg.profile and rank == 0:
            res["profile"] = {v: _profile(runs[v]) for v in ("ragged_fsdp", "fsdp2")}
        elif cfg.profile:
            for v in ("ragged_fsdp", "fsdp2"):
                _profile(runs[v])
        report[kind] = res
    if rank == 0:
        queue.put(("ok", rank, report))
    dist.barrier()
    dist.destroy_process_group()


def _peak(step) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    with mt:
        step()
    return int(sum(d.get("Total", 0) for d in mt.get_tracker_snapshot("peak").values()))


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


def print_report(cfg: BenchConfig, report: dict) -> None:
    print(f"\nragged_fsdp vs torch FSDP2, W={cfg.world} gloo ranks, {cfg.rounds} rounds x {cfg.steps} steps, "
          "medians of per-round ratios")
    head = ("model", "step ragged/FSDP2", "FSDP2/local", "ragged/local", "peak mem ragged/FSDP2",
            "fwd+bwd peak ragged/FSDP2", "framework copy bytes ragged", "FSDP2")
    rows = []
    for kind, r in report.items():
        copies = {v: sum(r["copy_bytes"][v].values()) for v in VARIANTS}
        rows.append((
            kind, f"{r['ratio_vs_fsdp2']:.2f}", f"{r['fsdp2_vs_local']:.2f}", f"{r['ragged_vs_local']:.2f}",
            f"{r['peak_bytes']['ragged_fsdp'] / r['peak_bytes']['fsdp2']:.2f}",
            f"{r['peak_bytes_fwd_bwd']['ragged_fsdp'] / r['peak_bytes_fwd_bwd']['fsdp2']:.2f}",
            f"{max(0, copies['ragged_fsdp'] - copies['local']):,}", f"{max(0, copies['fsdp2'] - copies['local']):,}",
        ))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    for kind, r in report.items():
        for v, prof in r.get("profile", {}).items():
            print(f"\n-- profile: {kind} / {v} (one step, rank 0) --\n{prof}")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="step time / memory / copies of ragged_fsdp vs torch FSDP2")
    d = BenchConfig()
    p.add_argument("--world", type=int, default=d.world)
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--models", default=",".join(d.models))
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=d.out)


def main(args) -> int:
    cfg = BenchConfig(world=args.world, rounds=args.rounds, steps=args.steps,
                      models=tuple(args.models.split(",")), profile=args.profile, out=args.out)
    report = run(cfg)
    print_report(cfg, report)
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.out).write_text(json.dumps({"config": asdict(cfg), "report": report}, indent=1, default=str))
    print(f"\nwrote {cfg.out}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="command")
    add_parser(sub)
    raise SystemExit(main(ap.parse_args(["bench"] + __import__("sys").argv[1:])))
