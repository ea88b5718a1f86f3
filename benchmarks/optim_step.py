"""Optimizer step time on ragged_fsdp-sharded parameters: grouped kernels vs per-parameter.

On W gloo ranks, each bench model (``ragged_fsdp.bench.engine.build``) is wrapped with
``ragged_fsdp.fully_shard`` and runs one forward/backward, so the gradients are views of the
reduce-scatter output as in training. Then, on those same sharded parameters and gradients,
each variant's ``step()`` is timed; rounds alternate the order of the variants and the
figures are medians (per-round ratios against torch's foreach AdamW):

* ``torch foreach`` / ``torch single``: ``torch.optim.AdamW(foreach=True / False)`` — one
  dispatch through RaggedDTensor per parameter and op (foreach: per op and list);
* ``torch single, local``: torch's single-tensor AdamW called on the local tensors (no
  DTensor dispatch, still one op per parameter): what per-parameter costs without dispatch;
* ``ragged AdamW``: ``ragged_fsdp.optim.AdamW`` (flat states, contiguous runs, chunks);
  ``... fused``: the same with ``fused=True`` (one ``_fused_adamw_`` per chunk);
  ``... chunk 2^k``: the chunk-size sweep (first model only);
* ``AdamW8bit per-param`` / ``AdamW8bit grouped``: the 8-bit optimizer with ``grouped``
  off/on (a model wrapped with ``granularity_fn=AdamW8bit.granularity``);
* ``Muon AdamW groups``: ``Muon`` whose groups are all ``use_muon=False``.

Also per variant: the peak of tensor bytes allocated *during* one step (MemTracker peak minus
what was live before), i.e. the step's temporaries.

    python benchmarks/optim_step.py [--world 2] [--rounds 7] [--steps 3] [--models dense,moe,dense-1024]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from ragged_fsdp.bench.meta import run_meta
from ragged_fsdp.models.workloads import build


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _variants(model, model8, mesh, sweep: bool):
    from torch.optim.adamw import adamw as torch_adamw

    from ragged_fsdp.optim import AdamW, AdamW8bit, Muon

    params = list(model.parameters())
    lr = 1e-5  # parameters drift little over many timed steps
    out = {
        "torch foreach": torch.optim.AdamW(params, lr=lr, foreach=True),
        "torch single": torch.optim.AdamW(params, lr=lr, foreach=False),
    }

    class LocalSingle:  # torch's per-tensor arithmetic on local tensors, states made like torch's
        def __init__(self):
            self.locals = [p._local_tensor for p in params]
            self.m = [torch.zeros_like(t) for t in self.locals]
            self.v = [torch.zeros_like(t) for t in self.locals]
            self.steps = [torch.tensor(0.0) for _ in self.locals]

        @torch.no_grad()
        def step(self):
            torch_adamw(self.locals, [p.grad._local_tensor for p in params], self.m, self.v, [], self.steps,
                        foreach=False, fused=False, amsgrad=False, beta1=0.9, beta2=0.999, lr=lr,
                        weight_decay=1e-2, eps=1e-8, maximize=False)

    out["torch single, local"] = LocalSingle()
    out["ragged AdamW"] = AdamW(params, lr=lr)
    out["ragged AdamW fused"] = AdamW(params, lr=lr, fused=True)
    for k in (12, 14, 18, 20, 22, 24) if sweep else ():
        out[f"ragged AdamW chunk 2^{k}"] = AdamW(params, lr=lr, chunk_size=1 << k)
    out["Muon AdamW groups"] = Muon([{"params": params, "use_muon": False, "lr": lr}])
    p8 = list(model8.parameters())
    per = AdamW8bit(p8, lr=lr)
    per.grouped = False
    out["AdamW8bit per-param"] = per
    out["AdamW8bit grouped"] = AdamW8bit(p8, lr=lr)
    return out


def _step_temporaries(opt, model) -> int:
    """Peak bytes allocated during one step beyond what was live before it (parameters,
    gradients and states are tracked first, so views of them do not count as new memory)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(model, opt)
    with mt:
        before = sum(d.get("Total", 0) for d in mt.get_tracker_snapshot("current").values())
        opt.step()
        peak = sum(d.get("Total", 0) for d in mt.get_tracker_snapshot("peak").values())
    return int(peak - before)


def _rank(rank: int, world: int, port: int, models, rounds: int, steps: int, queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_fsdp import fully_shard
    from ragged_fsdp.optim import AdamW8bit

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,))
    report = {}
    for kind in models:
        batch, seq = (1, 32) if kind in ("dense-wide", "dense-1024") else (2, 64)
        g = torch.Generator().manual_seed(rank)
        x = torch.randint(0, 2048, (batch, seq), generator=g)

        def wrapped(granularity_fn=None):
            m = build(kind, 128)
            for b in m.layers:
                fully_shard(b, mesh=mesh, granularity_fn=granularity_fn)
            fully_shard(m, mesh=mesh, granularity_fn=granularity_fn)
            logits = m(x)
            F.cross_entropy(logits.reshape(-1, logits.size(-1)), x.reshape(-1)).backward()
            return m

        model, model8 = wrapped(), wrapped(AdamW8bit.granularity)
        opts = _variants(model, model8, mesh, sweep=kind == models[0])
        names = list(opts)
        for n in names:  # warm-up
            opts[n].step()
        times = {n: [] for n in names}
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for n in order:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(steps):
                    opts[n].step()
                times[n].append((time.perf_counter() - t0) / steps)
        base = times["torch foreach"]
        res = {
            "params": sum(1 for _ in model.parameters()),
            "local_elements": sum(p._local_tensor.numel() for p in model.parameters()),
            "step_ms": {n: statistics.median(t) * 1e3 for n, t in times.items()},
            "vs_torch_foreach": {n: statistics.median(a / b for a, b in zip(t, base)) for n, t in times.items()},
            "temporaries_bytes": {n: _step_temporaries(opts[n], model8 if "8bit" in n else model)
                                  for n in names if hasattr(opts[n], "param_groups")},
            "stats": {n: dict(getattr(opts[n], "last_step_stats", {}) or {}) for n in names},
        }
        report[kind] = res
        del opts, model, model8
    if rank == 0:
        queue.put(report)
    dist.barrier()
    dist.destroy_process_group()


def run(world: int = 2, models=("dense", "moe", "dense-1024"), rounds: int = 7, steps: int = 3) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, tuple(models), rounds, steps, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    report = queue.get()
    for p in procs:
        p.join()
    return report


def print_report(world: int, report: dict) -> None:
    for kind, r in report.items():
        print(f"\n{kind}: {r['params']} parameters, {r['local_elements']:,} local elements on rank 0, W={world}")
        w = max(len(n) for n in r["step_ms"])
        print(f"{'variant':<{w}}  {'step ms':>8}  {'vs torch foreach':>16}  {'step temporaries MiB':>20}  runs")
        for n, ms in r["step_ms"].items():
            tmp = r["temporaries_bytes"].get(n)
            tmp_s = f"{tmp / 2**20:.2f}" if tmp is not None else "-"
            runs = r["stats"].get(n, {}).get("runs", "")
            print(f"{n:<{w}}  {ms:8.2f}  {r['vs_torch_foreach'][n]:16.2f}  {tmp_s:>20}  {runs}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--models", default="dense,moe,dense-1024")
    ap.add_argument("--out", default="out/bench_optim_step.json")
    a = ap.parse_args(argv)
    report = run(a.world, a.models.split(","), a.rounds, a.steps)
    print_report(a.world, report)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    # one flat row per workload and variant (what print_report shows), for renderers
    rows = [{"workload": kind, "params": r["params"], "local_elements": r["local_elements"], "variant": n,
             "step_ms": ms, "vs_torch_foreach": r["vs_torch_foreach"][n],
             "temporaries_bytes": r["temporaries_bytes"].get(n), "runs": r["stats"].get(n, {}).get("runs")}
            for kind, r in report.items() for n, ms in r["step_ms"].items()]
    Path(a.out).write_text(json.dumps({"meta": run_meta(), "world": a.world, "rounds": a.rounds, "steps": a.steps,
                                       "rows": rows, "report": report}, indent=1))
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
