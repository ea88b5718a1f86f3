"""What a peer-memory snapshot every step costs: bytes each rank sends to its peer, host memory
per node, and the step time with and without snapshots, side by side with torch FSDP2 taking a
``dcp.save`` every step (the FSDP2 way to lose no step), alternating in one launch, medians.

    PYTHONPATH=src python benchmarks/snapshot_cost.py --world 2 --out docs/data/snapshot_cost_w2.json

W processes on this machine (each leg's model on its own process group), each its own "node" (``GROUP_RANK`` = rank, so every rank's
peer copy goes to another rank, as across nodes), gloo, one thread each. Two models: a small
dense Llama (dim 128, 4 layers, the demo's) and the MoE (dim 128, 4 layers, 8 experts of
hidden 128 as 3-D weights, top 2). Per round and model, four legs of ``--steps`` steps each, their order
rotating from round to round: ragged_fsdp without snapshots, ragged_fsdp with
``Snapshots(every=1)`` into ``/dev/shm`` (one directory per rank), FSDP2 without saves, FSDP2
with ``dcp.save`` every step into one directory under ``/dev/shm``. A step's time is from
before the forward to after the snapshot / save (rank 0's clock, after a barrier).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta

from ragged_fsdp.bench.meta import run_meta

LEGS = ("ragged", "ragged+snapshot", "fsdp2", "fsdp2+dcp.save")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def build(kind: str, leg: str, W: int):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from ragged_fsdp.models import Llama, LlamaConfig, MoE, MoEConfig

    torch.manual_seed(0)
    if kind == "dense":
        model = Llama(LlamaConfig(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=128))
    else:
        model = MoE(MoEConfig(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=128,
                              n_experts=8, top_k=2, expert_hidden=128,
                              # 3-D expert weights: every expert has a gradient on every rank. With one
                              # module per expert, an expert no token of a rank reached has none there,
                              # FSDP2 leaves it out of that rank's reduce-scatter and the ranks' message
                              # sizes differ (gloo: "Received data size doesn't match expected size")
                              fused_experts=True))
    if leg.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard
    else:
        from ragged_fsdp import fully_shard
    # a process group per leg: no leg's collectives (an engine's prefetch, a snapshot's
    # agreement on the default group) can pair with another leg's
    mesh = DeviceMesh.from_group(dist.new_group(list(range(W))), "cpu")
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return model, opt


def worker(a) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ragged_fsdp.checkpoint.snapshot_store import own_dir
    from ragged_fsdp.checkpoint.snapshots import Snapshots

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, W = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 256, (a.batch, 129), generator=gen)
    out = {"world": W, "models": {}}
    for kind in a.models.split(","):
        built = {leg: build(kind, leg, W) for leg in LEGS}
        root = os.path.join(a.shm, kind)
        snaps = Snapshots(*built["ragged+snapshot"], dir=os.path.join(root, f"node{rank}"), every=1, run="bench")
        times = {leg: [] for leg in LEGS}
        counter = {leg: 0 for leg in LEGS}
        for rnd in range(a.rounds):
            order = LEGS[rnd % 4:] + LEGS[:rnd % 4]
            for leg in order:
                model, opt = built[leg]
                for _ in range(a.steps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    counter[leg] += 1
                    if leg == "ragged+snapshot":
                        snaps.snapshot(counter[leg])
                    elif leg == "fsdp2+dcp.save":
                        msd, osd = get_state_dict(model, opt)
                        path = os.path.join(root, "dcp", f"step-{counter[leg]}")
                        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
                        if rank == 0:  # keep the newest two, as the snapshots do
                            shutil.rmtree(os.path.join(root, "dcp", f"step-{counter[leg] - 2}"), ignore_errors=True)
                    dist.barrier()
                    times[leg].append(time.perf_counter() - t0)
        dist.barrier()
        step_now = counter["ragged+snapshot"]
        own = du(os.path.join(root, f"node{rank}"))
        sizes = torch.tensor([own], dtype=torch.int64)
        all_sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(W)]
        dist.all_gather(all_sizes, sizes)
        # this rank's part of the newest snapshot (one rank per node here): what it sends its peer
        part = du(own_dir(os.path.join(root, f"node{rank}"), step_now))
        parts = [torch.zeros(1, dtype=torch.int64) for _ in range(W)]
        dist.all_gather(parts, torch.tensor([part], dtype=torch.int64))
        state_bytes = sum(p.to_local().numel() * p.to_local().element_size() for p in built["ragged"][0].parameters())
        state_bytes += sum(v.to_local().numel() * v.to_local().element_size() if hasattr(v, "to_local") else
                           v.numel() * v.element_size() for st in built["ragged"][1].state.values() for v in st.values())
        sb = [torch.zeros(1, dtype=torch.int64) for _ in range(W)]
        dist.all_gather(sb, torch.tensor([state_bytes], dtype=torch.int64))
        if rank == 0:
            med = {leg: statistics.median(ts[a.steps // 2:] if a.rounds == 1 else ts) for leg, ts in times.items()}
            out["models"][kind] = {
                "params": sum(p.numel() for p in built["ragged"][0].parameters()),
                "median_step_s": med,
                "ratio_snapshot": med["ragged+snapshot"] / med["ragged"],
                "ratio_dcp_save": med["fsdp2+dcp.save"] / med["fsdp2"],
                "state_bytes_per_rank": [int(x) for x in sb],
                "part_bytes_per_rank": [int(x) for x in parts],
                "host_bytes_per_node": [int(x) for x in all_sizes],
                "steps_per_leg": len(times["ragged"]),
                "step_s": times,  # every step of every leg, in the order run (rank 0's clock)
            }
        dist.barrier()
    if rank == 0:
        with open(a.result, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--models", default="dense,moe")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="steps per leg per round")
    p.add_argument("--batch", type=int, default=4, help="sequences of 128 tokens per rank")
    p.add_argument("--shm", default="/dev/shm/ragged_snapshot_cost")
    p.add_argument("--result", default="")
    p.add_argument("--out", default="docs/data/snapshot_cost.json")
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    shutil.rmtree(a.shm, ignore_errors=True)
    result = a.out + ".part"
    port = free_port()
    procs = []
    for r in range(a.world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(a.world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   GROUP_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", "--models", a.models, "--rounds",
                                       str(a.rounds), "--steps", str(a.steps), "--batch", str(a.batch), "--shm", a.shm,
                                       "--result", result], env=env))
    rc = [q.wait() for q in procs]
    shutil.rmtree(a.shm, ignore_errors=True)
    if any(rc):
        sys.exit(f"a rank failed: exit codes {rc}")
    out = json.load(open(result))
    os.remove(result)
    out["command"] = "PYTHONPATH=src python " + " ".join(sys.argv)
    out["rounds"], out["steps_per_leg_per_round"], out["batch"] = a.rounds, a.steps, a.batch
    out["meta"] = run_meta(out["command"])
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    W = out["world"]
    print(f"W={W}, {a.rounds} rounds x {a.steps} steps per leg, legs alternating; medians (rank 0's clock)\n")
    print("| model | params | ragged s/step | + snapshot | ratio | FSDP2 s/step | + dcp.save | ratio | "
          "sent per rank per step (B) | host per node (B) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kind, m in out["models"].items():
        s = m["median_step_s"]
        print(f"| {kind} | {m['params']:,} | {s['ragged']:.4f} | {s['ragged+snapshot']:.4f} | {m['ratio_snapshot']:.2f} "
              f"| {s['fsdp2']:.4f} | {s['fsdp2+dcp.save']:.4f} | {m['ratio_dcp_save']:.2f} | "
              f"{max(m['part_bytes_per_rank']):,} | {max(m['host_bytes_per_node']):,} |")


if __name__ == "__main__":
    main()
