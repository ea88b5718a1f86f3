"""ragged_fsdp versus torch's FSDP2 on one CUDA device (W = 1, NCCL), side by side.

What the lent GPU machine can run (one GPU: NCCL refuses two ranks on one device). With one
rank the collectives are local, but everything else is the real GPU path: side streams and
events, the bf16 cast into the all-gather input, the per-group allocations, and the caching
allocator, whose reserved-versus-allocated gap (fragmentation) MemTracker on CPU cannot see.

    PYTHONPATH=src python3 benchmarks/gpu.py [--rounds 5] [--steps 5] [--json out.json]

Rounds alternate the framework order; the figure reported is the median of per-round
step-time ratios. Peaks are ``max_memory_allocated`` / ``max_memory_reserved`` over one step
after warm-up, each framework measured in a fresh model with the allocator's cache emptied.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ragged_fsdp.bench.meta import run_meta

WORKLOADS = {
    # name: (dim, layers, batch, seq)
    "dense-1b": (2048, 8, 4, 1024),
    "dense-wide": (4096, 4, 1, 512),
}


def _build(dim: int, layers: int, seq: int):
    from ragged_fsdp.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, dim=dim, n_layers=layers, n_heads=dim // 128, n_kv_heads=dim // 256,
                      max_seq_len=seq)
    with torch.device("cuda"):
        return Llama(cfg)


def _wrap(model, framework: str, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if framework == "ragged_fsdp":
        from ragged_fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _setup(framework: str, w, mesh):
    dim, layers, batch, seq = w
    model = _wrap(_build(dim, layers, seq), framework, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, 32000, (batch, seq + 1), device="cuda", generator=g)

    def step():
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def _time(step, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def _peaks(framework: str, w, mesh) -> dict:
    torch.cuda.empty_cache()
    model, opt, step = _setup(framework, w, mesh)
    step()  # states exist
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    s = torch.cuda.memory_stats()
    out = {
        "allocated_peak_mib": torch.cuda.max_memory_allocated() / 2**20,
        "reserved_peak_mib": torch.cuda.max_memory_reserved() / 2**20,
        "alloc_retries": s.get("num_alloc_retries", 0),
    }
    out["fragmentation"] = 1 - out["allocated_peak_mib"] / max(out["reserved_peak_mib"], 1e-9)
    del model, opt, step
    torch.cuda.empty_cache()
    return out


def run(rounds: int, steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (1,))
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "workloads": {}}
    for name, w in WORKLOADS.items():
        res = {fw: _peaks(fw, w, mesh) for fw in ("ragged_fsdp", "fsdp2")}
        runs = {fw: _setup(fw, w, mesh) for fw in ("ragged_fsdp", "fsdp2")}
        for fw in runs:
            _time(runs[fw][2], 2)  # warm-up
        times = {fw: [] for fw in runs}
        ratios = []
        for r in range(rounds):
            order = ("ragged_fsdp", "fsdp2") if r % 2 == 0 else ("fsdp2", "ragged_fsdp")
            t = {fw: _time(runs[fw][2], steps) for fw in order}
            for fw in t:
                times[fw].append(t[fw])
            ratios.append(t["ragged_fsdp"] / t["fsdp2"])
        for fw in runs:
            res[fw]["median_step_ms"] = 1000 * statistics.median(times[fw])
        res["step_ratio_median"] = statistics.median(ratios)
        res["allocated_ratio"] = res["ragged_fsdp"]["allocated_peak_mib"] / res["fsdp2"]["allocated_peak_mib"]
        res["reserved_ratio"] = res["ragged_fsdp"]["reserved_peak_mib"] / res["fsdp2"]["reserved_peak_mib"]
        report["workloads"][name] = res
        del runs
        torch.cuda.empty_cache()
    return report


def print_report(report: dict) -> None:
    print(f"{report['device']}, torch {report['torch']}, W=1, bf16 compute / fp32 reduce, AdamW")
    hdr = f"{'workload':>11} {'framework':>12} {'step ms':>8} {'alloc MiB':>10} {'reserved MiB':>13} {'frag':>6}"
    print(hdr)
    for name, res in report["workloads"].items():
        for fw in ("ragged_fsdp", "fsdp2"):
            r = res[fw]
            print(f"{name:>11} {fw:>12} {r['median_step_ms']:8.1f} {r['allocated_peak_mib']:10.0f} "
                  f"{r['reserved_peak_mib']:13.0f} {r['fragmentation']:6.1%}")
        print(f"{'':>11} {'ragged/fsdp2':>12} {res['step_ratio_median']:8.3f} {res['allocated_ratio']:10.3f} "
              f"{res['reserved_ratio']:13.3f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        report = run(a.rounds, a.steps)
        print_report(report)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"meta": run_meta(), **report}, f, indent=1)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
