"""Where a step's memory peak is, for ragged_fsdp and torch's FSDP2, read off MemTracker.

One training step per framework on W gloo ranks (rank 0 reports), after one warm-up step
(optimizer states exist). MemTracker counts live tensor bytes by kind (parameter, gradient,
optimizer state, activation, temporary, buffer); we snapshot it at labelled points and take
its peak with the breakdown at the peak:

    python benchmarks/memory_timeline.py [--world 2] [--models dense,moe,dense-wide,dense-1024]

Points: ``forward done`` (loss computed), ``loss grad`` (a hook on the logits' gradient: the
loss's own backward has run, no parameter gradient yet), ``backward done``, ``step done``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from ragged_fsdp.bench.engine import wrap
from ragged_fsdp.models.workloads import build
from ragged_fsdp.bench.meta import run_meta

MiB = 2**20


def _total(snap: dict) -> int:
    return int(sum(d.get("Total", 0) for d in snap.values()))


def _kinds(snap: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in snap.values():
        for k, v in d.items():
            if k != "Total" and v:
                out[str(k).split(".")[-1]] = out.get(str(k).split(".")[-1], 0) + v / MiB
    return out


def timeline(kind: str, framework: str, mesh, batch: int, seq: int, grouped: bool = False) -> dict:
    from torch.distributed._tools.mem_tracker import MemTracker

    model = wrap(build(kind, seq), framework, mesh)
    if grouped and framework == "ragged_fsdp":  # the grouped, chunked kernels (issue 10, item 3)
        from ragged_fsdp.optim import AdamW

        opt = AdamW(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    vocab = model.cfg.vocab_size
    g = torch.Generator().manual_seed(dist.get_rank())
    data = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    points: list[tuple[str, float]] = []
    mt = MemTracker()

    def mark(label):
        points.append((label, _total(mt.get_tracker_snapshot()) / MiB))

    def step(track: bool):
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), data[:, 1:].flatten())
        if track:
            mark("forward done")
            logits.register_hook(lambda gr: (mark("loss grad"), gr)[1])
        loss.backward()
        if track:
            mark("backward done")
        opt.step()
        opt.zero_grad()
        if track:
            mark("step done")

    step(False)
    mt.track_external(model, opt)
    with mt:
        step(True)
    peak = mt.get_tracker_snapshot("peak")
    return {"points": points, "peak_mib": _total(peak) / MiB, "peak_by_kind_mib": _kinds(peak)}


def _worker(rank, world, port, models, batch, seq, queue, grouped=False):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for kind in models:
        b, s = batch.get(kind, (4, 128))
        out[kind] = {fw: timeline(kind, fw, mesh, b, s, grouped) for fw in ("ragged_fsdp", "fsdp2")}
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, models: list[str], grouped: bool = False) -> dict:
    batch = {"dense-wide": (1, 32), "dense-1024": (1, 32)}
    with socket.socket() as sck:
        sck.bind(("127.0.0.1", 0))
        port = sck.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, models, batch, 128, q, grouped)) for r in range(world)]
    for p in procs:
        p.start()
    out = q.get(timeout=1800)
    for p in procs:
        p.join()
    return out


def print_report(report: dict, world: int) -> None:
    print(f"memory timeline, W={world}, rank 0, MiB of live tensors (MemTracker)")
    for kind, res in report.items():
        print(f"\n{kind}")
        labels = [lab for lab, _ in res["ragged_fsdp"]["points"]]
        print(f"{'':>22}" + "".join(f"{fw:>14}" for fw in res))
        for i, lab in enumerate(labels):
            print(f"{lab:>22}" + "".join(f"{res[fw]['points'][i][1]:14.2f}" for fw in res))
        print(f"{'peak':>22}" + "".join(f"{res[fw]['peak_mib']:14.2f}" for fw in res))
        kinds = sorted({k for fw in res for k in res[fw]["peak_by_kind_mib"]})
        for k in kinds:
            print(f"{'  at peak: ' + k:>22}" + "".join(f"{res[fw]['peak_by_kind_mib'].get(k, 0):14.2f}" for fw in res))
        print(f"{'ragged / fsdp2':>22}{res['ragged_fsdp']['peak_mib'] / res['fsdp2']['peak_mib']:14.3f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--models", default="dense,moe,dense-wide,dense-1024")
    p.add_argument("--json", default="out/memory_timeline.json")
    p.add_argument("--grouped-adamw", action="store_true",
                   help="ragged_fsdp steps with ragged_fsdp.optim.AdamW (FSDP2 keeps torch's foreach AdamW)")
    a = p.parse_args(argv)
    report = run(a.world, a.models.split(","), a.grouped_adamw)
    print_report(report, a.world)
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as f:
        json.dump({"meta": run_meta(), "world": a.world, "workloads": report}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
