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
    python -m ragged_fsdp bench --quick      # tiny models at W=2, 5 rounds of 2 steps: a check
    python -m ragged_fsdp bench --world 4 --mesh 2x2   # HSDP against FSDP2's HSDP

With ``--mesh RxS`` both ragged_fsdp and FSDP2 shard over S ranks and replicate over R
(``init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))``, the same
``fully_shard(block, mesh=mesh)`` calls); FSDP1 and DDP take no 2-D mesh and are left out.
Every launch also counts, for ragged_fsdp and FSDP2, the bytes each rank sends in one step by
collective kind (``comm_bytes``: the counting rule is there).

The command line is read and checked in ``ragged_fsdp.cli.bench``; the workloads' models are
``ragged_fsdp.models.workloads``.
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from ..models.workloads import VOCAB, build
from .config import MESH_VARIANTS, VARIANTS, WORKLOADS, BenchConfig  # noqa: F401 (re-exported)
from ..fsdp import hsdp_segment_bytes  # re-exported: its old home

COUNTED = ("ragged_fsdp", "fsdp2")  # frameworks whose collectives are counted (Python calls)
MEM_KINDS = ("Parameter", "Buffer", "Gradient", "Optstate", "Activation", "Temp", "Other")


def batch_shape(kind: str, cfg: BenchConfig) -> tuple[int, int]:
    if cfg.quick or kind == "deep":
        return 2, 16
    return (1, 32) if kind in ("dense-wide", "dense-1024") else (cfg.batch, cfg.seq_len)


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


def compile_blocks(model: torch.nn.Module, backend: str) -> None:
    """``torch.compile`` each block in place after wrapping (its hooks stay on the module):
    the same for every framework, so the compiled steps compare like the eager ones."""
    for block in model.layers:
        block.compile(backend=backend)


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
    if cfg.mesh:
        mesh = init_device_mesh("cpu", tuple(cfg.mesh), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (cfg.world,))
    report = {}
    variants = tuple(cfg.frameworks)
    # rank 0's bar: per workload, each framework's build and warm-up, the timed rounds, then
    # each framework's measurements (memory, copies, bytes sent); tqdm's rate gives the estimate
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(cfg.models) * (2 * len(variants) + cfg.rounds), desc=f"bench W={cfg.world}",
                   unit="phase", dynamic_ncols=True, disable=None)

    def tick(what: str) -> None:
        if bar is not None:
            bar.set_postfix_str(what)
            bar.update()

    for kind in cfg.models:
        g = torch.Generator().manual_seed(1000 + rank)
        batch, seq = batch_shape(kind, cfg)
        vocab = VOCAB.get(kind, 2048)
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        y = torch.randint(0, vocab, (batch, seq), generator=g)
        runs, passes = {}, {}
        for v in variants:
            model = wrap(build(kind, cfg.seq_len, cfg.quick), v, mesh)
            if cfg.compile:
                compile_blocks(model, cfg.compile)
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
            for _ in range(2):  # warm-up: optimizer state, allocator
                step()
            tick(f"{kind}: {v} warm")
        times = {v: [] for v in variants}
        cpu = {v: [] for v in variants}  # this process's CPU (time.process_time): the machine may be shared
        for r in range(cfg.rounds):
            k = r % len(variants)
            order = variants[k:] + variants[:k]
            for v in order:
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(cfg.steps):
                    runs[v]()
                c1 = time.process_time()
                dist.barrier()
                times[v].append((time.perf_counter() - t0) / cfg.steps)
                cpu[v].append((c1 - c0) / cfg.steps)
            tick(f"{kind}: round {r + 1}/{cfg.rounds}")
        res = {"step_s": times, "cpu_s": cpu, "batch": [batch, seq]}
        base = "fsdp2" if "fsdp2" in variants else variants[0]
        res["vs_fsdp2"] = {v: statistics.median(a / b for a, b in zip(times[v], times[base])) for v in variants}
        # the spread of the per-round ratios: how far one round's ratio strays from the median
        res["vs_fsdp2_range"] = {v: [min(a / b for a, b in zip(times[v], times[base])),
                                     max(a / b for a, b in zip(times[v], times[base]))] for v in variants}
        res["cpu_vs_fsdp2"] = {v: statistics.median(a / b for a, b in zip(cpu[v], cpu[base])) for v in variants}
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
            comp = peak_composition(runs[v], model, opt)
            res["peak_composition"][v] = comp
            res["peak_bytes"][v] = comp["Total"]
            # the busiest rank's peak too: a ragged split need not give every rank the same bytes
            top = torch.tensor([comp["Total"]], dtype=torch.int64)
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            res.setdefault("peak_bytes_max_rank", {})[v] = int(top.item())
            # Forward + backward only (the optimizer step's states and temporaries differ
            # only by the optimizer).
            res["peak_bytes_fwd_bwd"][v] = peak_composition(fwd_bwd, model, opt)["Total"]
            opt.zero_grad(set_to_none=True)
            with CopyCounter() as c:
                runs[v]()
            res["copy_bytes"][v] = dict(c.by_op)
            tick(f"{kind}: {v} measured")
        res["comm"] = {v: count_comm(runs[v], mesh) for v in variants if v in COUNTED}
        if "ragged_fsdp" in res["comm"]:
            res["comm"]["ragged_fsdp"]["hsdp_segment_bytes"] = hsdp_segment_bytes(passes["ragged_fsdp"][0])
        if cfg.profile and rank == 0:
            res["profile"] = {v: _profile(runs[v]) for v in ("ragged_fsdp", "fsdp2") if v in variants}
        elif cfg.profile:
            for v in ("ragged_fsdp", "fsdp2"):
                if v in variants:
                    _profile(runs[v])
        report[kind] = res
        del runs, passes
    if bar is not None:
        bar.close()
    if rank == 0:
        queue.put(("ok", rank, report))
    dist.barrier()
    dist.destroy_process_group()


def peak_composition(step, model, opt) -> dict[str, int]:
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


def _group_labeler(mesh):
    """Names a collective's process group by the mesh dim it is (replicate / shard)."""
    dims = ("replicate", "shard") if mesh.ndim == 2 else ("shard",)
    names = {id(mesh.get_group(i)): d for i, d in enumerate(dims)}
    return lambda g: names.get(id(g), f"other{dist.get_world_size(g)}")


def count_comm(step, mesh) -> dict:
    """Bytes this rank sends in one ``step`` by collective kind (``comm_bytes``'s rule), the
    collective calls seen, and the c10d ops torch's CommDebugMode saw in the same step (a
    check that the Python-level wrappers missed no collective). Collective on every rank."""
    from .comm_bytes import CommCounter

    try:
        from torch.distributed.tensor.debug import CommDebugMode
    except ImportError:  # pragma: no cover - older torch
        CommDebugMode = None
    counter = CommCounter(_group_labeler(mesh))
    ops = CommDebugMode() if CommDebugMode is not None else None
    with counter:
        if ops is None:
            step()
        else:
            with ops:
                step()
    by_kind = counter.by_kind()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sum(by_kind.values()))
    return {
        "by_kind": by_kind,
        "float_by_kind": counter.by_kind(float_only=True),
        "total": sum(by_kind.values()),
        "total_by_rank": everyone,
        "calls": sum(c for c, _ in counter.totals.values()),
        "c10d_calls": ops.get_total_counts() if ops is not None else None,
        "rows": counter.rows(),
    }


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
    layout = f" on a {cfg.mesh[0]}x{cfg.mesh[1]} (replicate, shard) mesh (HSDP)" if cfg.mesh else ""
    if cfg.compile:
        layout += f", every block torch.compile'd (backend {cfg.compile})"
    print(f"\nW={cfg.world} gloo ranks{layout}, {cfg.rounds} rounds x {cfg.steps} steps; ratios are medians of "
          "per-round ratios against FSDP2; peak = MemTracker peak over one step, rank 0 "
          "(max-rank: the largest of any rank's)")
    head = ("workload", "framework", "step ms", "step vs FSDP2", "per-round range", "CPU vs FSDP2", "peak MiB", "peak vs FSDP2",
            "max-rank peak vs FSDP2", "fwd+bwd peak vs FSDP2", "copy bytes/step")
    rows = []
    for kind, r in report.items():
        local_copies = sum(r["copy_bytes"]["local"].values()) if "local" in r["copy_bytes"] else 0
        base = r["peak_bytes"].get("fsdp2")
        base_fb = r["peak_bytes_fwd_bwd"].get("fsdp2")
        top = r.get("peak_bytes_max_rank", {})
        for v in variants:
            ms = statistics.median(r["step_s"][v]) * 1e3
            rows.append((
                kind, v, f"{ms:.1f}", f"{r['vs_fsdp2'][v]:.2f}",
                "{:.2f}-{:.2f}".format(*r["vs_fsdp2_range"][v]) if "vs_fsdp2_range" in r else "-",
                f"{r['cpu_vs_fsdp2'][v]:.2f}" if "cpu_vs_fsdp2" in r else "-", f"{r['peak_bytes'][v] / 2**20:.1f}",
                f"{r['peak_bytes'][v] / base:.3f}" if base else "-",
                f"{top[v] / top['fsdp2']:.3f}" if top.get("fsdp2") else "-",
                f"{r['peak_bytes_fwd_bwd'][v] / base_fb:.3f}" if base_fb else "-",
                f"{max(0, sum(r['copy_bytes'][v].values()) - local_copies):,}",
            ))
    print(_table(head, rows))
    print_composition(cfg, report)
    print_comm(cfg, report)
    for kind, r in report.items():
        for v, prof in r.get("profile", {}).items():
            print(f"\n-- profile: {kind} / {v} (one step, rank 0) --\n{prof}")


def summary_rows(world: int, report: dict) -> list[dict]:
    """One flat row per workload and framework: what the printed table shows, for renderers."""
    rows = []
    for kind, r in report.items():
        local_copies = sum(r["copy_bytes"]["local"].values()) if "local" in r["copy_bytes"] else None
        base = r["peak_bytes"].get("fsdp2")
        top = r.get("peak_bytes_max_rank", {})
        for v in r["step_s"]:
            comp = r["peak_composition"].get(v, {})
            comm = r.get("comm", {}).get(v, {})
            copies = sum(r["copy_bytes"][v].values())
            rows.append({
                "world": world, "workload": kind, "framework": v,
                "step_ms": statistics.median(r["step_s"][v]) * 1e3,
                "step_vs_fsdp2": r["vs_fsdp2"].get(v),
                "cpu_vs_fsdp2": r.get("cpu_vs_fsdp2", {}).get(v),
                "peak_mib": r["peak_bytes"][v] / 2**20,
                "peak_vs_fsdp2": r["peak_bytes"][v] / base if base else None,
                "max_rank_peak_vs_fsdp2": top[v] / top["fsdp2"] if top.get("fsdp2") and v in top else None,
                # the model's own copies (the local model's) are not the framework's
                "copy_bytes": max(0, copies - local_copies) if local_copies is not None else copies,
                "at_peak_mib": {k: comp.get(k, 0) / 2**20 for k in MEM_KINDS + ("Total",)},
                "comm_bytes": comm.get("by_kind"), "comm_float_bytes": comm.get("float_by_kind"),
                "comm_calls": comm.get("calls"),
            })
    return rows


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


COMM_COLUMNS = (("all-gather", ("all_gather",)), ("reduce-scatter / all-to-all", ("reduce_scatter", "all_to_all")),
                ("all-reduce", ("all_reduce",)), ("other", ("other",)))


def comm_columns(by_kind: dict[str, int]) -> dict[str, int]:
    """Bytes per reported column (a reduce-scatter done as all-to-alls counts as one)."""
    return {name: sum(by_kind.get(k, 0) for k in kinds) for name, kinds in COMM_COLUMNS}


def print_comm(cfg: BenchConfig, report: dict) -> None:
    """Bytes each rank sends in one step, by collective kind (rule: bench/comm_bytes.py)."""
    if not any(r.get("comm") for r in report.values()):
        return
    print(f"\nbytes sent per step per rank (rank 0, W={cfg.world}; all-gather: its input, reduce-scatter: input "
          "less own piece, all-to-all: splits to other ranks, all-reduce: the buffer)")
    head = ("workload", "framework") + tuple(n for n, _ in COMM_COLUMNS) + ("total", "vs FSDP2", "calls", "ranks equal")
    rows = []
    for kind, r in report.items():
        comm = r.get("comm", {})
        base = comm.get("fsdp2", {}).get("total")
        for v, c in comm.items():
            cols = comm_columns(c["by_kind"])
            rows.append((kind, v) + tuple(f"{cols[n]:,}" for n, _ in COMM_COLUMNS) + (
                f"{c['total']:,}", f"{c['total'] / base:.3f}" if base else "-", str(c["calls"]),
                "yes" if len(set(c["total_by_rank"])) == 1 else "no"))
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
    with_comm = any(r.get("comm") for rep in reports.values() for r in rep.values())
    nrows = 3 if with_comm else 2
    fig, axes = plt.subplots(nrows, len(worlds), figsize=(6 * len(worlds), 3.5 * nrows), squeeze=False)
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
            ax.set_title(f"W={w} gloo ranks (CPU)" + (f", {cfg.mesh[0]}x{cfg.mesh[1]} HSDP" if cfg.mesh else ""))
            if row == 0 and c == 0:
                ax.legend(fontsize=8)
        if with_comm:  # bytes sent per step per rank, stacked by collective kind
            ax = axes[2][c]
            counted = [v for v in variants if v in COUNTED]
            cw = 0.8 / max(1, len(counted))
            for j, v in enumerate(counted):
                bottom = [0.0] * len(kinds)
                for ci, (n, _) in enumerate(COMM_COLUMNS):
                    vals = [comm_columns(rep[k]["comm"][v]["by_kind"])[n] / 2**20 if v in rep[k].get("comm", {}) else 0
                            for k in kinds]
                    ax.bar([i + j * cw for i in range(len(kinds))], vals, cw, bottom=bottom, color=f"C{ci}",
                           label=n if j == 0 else None, hatch="//" if j else None, edgecolor="black", linewidth=0.3)
                    bottom = [b + x for b, x in zip(bottom, vals)]
            ax.set_xticks([i + cw * (len(counted) - 1) / 2 for i in range(len(kinds))])
            ax.set_xticklabels(kinds)
            ax.set_ylabel("MiB sent per step per rank")
            ax.set_title(" | ".join(f"{v}{' (hatched)' if j else ''}" for j, v in enumerate(counted)), fontsize=9)
            if c == 0:
                ax.legend(fontsize=6)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
