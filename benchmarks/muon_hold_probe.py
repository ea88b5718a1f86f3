"""What ragged_fsdp's bounded Muon step and torchtitan's DistMuon hold between steps vs during
them (issue 46): MemTracker's live tensor bytes at the Muon optimizer's step entry, its peak
and the live bytes after it, for the first and the second step, and the optimizer's own state
(momentum) bytes. What a step leaves behind beyond its state is what it keeps reserved.

    PYTHONPATH=src python benchmarks/muon_hold_probe.py --world 2

Same model, gradients and builders as ``benchmarks/muon_peers.py`` (imports torchtitan).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import muon_peers as mp_bench  # noqa: E402

NAMES = ("ragged whole, bounded", "ragged no policy, bounded", "FSDP2 + DistMuon")


def _state_bytes(opt) -> int:
    n = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                t = v.to_local() if hasattr(v, "to_local") else v
                n += t.numel() * t.element_size()
    return n


def _worker(rank, world, port, q):
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    out = {}
    for name in NAMES:
        impl = mp_bench._build(name, mesh)
        rows = []
        for s in range(2):
            impl.set_grads(s)
            mt = MemTracker()
            mt.track_external(impl.model, *impl.opts)
            with mt:
                tot = lambda k: sum(d.get("Total", 0) for d in mt.get_tracker_snapshot(k).values())  # noqa: E731
                entry = tot("current")
                impl.opts[0].step()
                rows.append({"entry": entry, "peak": tot("peak"), "after": tot("current")})
            impl.opts[1].step()
        out[name] = {"steps": rows, "state": _state_bytes(impl.opts[0])}
    g = [None] * world
    dist.all_gather_object(g, out)
    if rank == 0:
        q.put(g)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default="docs/data/muon_hold.json")
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = mp_bench._free_port()
    ps = [ctx.Process(target=_worker, args=(r, a.world, port, q)) for r in range(a.world)]
    for p in ps:
        p.start()
    per_rank = q.get()
    for p in ps:
        p.join()
    mib = 2 ** 20
    print("| implementation | rank | step | live at entry | peak | live after | peak - entry | after - entry | Muon state |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in NAMES:
        for r, pr in enumerate(per_rank):
            for i, s in enumerate(pr[name]["steps"]):
                print(f"| {name} | {r} | {i + 1} | {s['entry'] / mib:.2f} | {s['peak'] / mib:.2f} | {s['after'] / mib:.2f} "
                      f"| {(s['peak'] - s['entry']) / mib:.2f} | {(s['after'] - s['entry']) / mib:.2f} "
                      f"| {pr[name]['state'] / mib:.2f} |")
    with open(a.out, "w") as f:
        json.dump({"command": "PYTHONPATH=src python " + " ".join(sys.argv), "world": a.world, "per_rank": per_rank}, f, indent=1)


if __name__ == "__main__":
    main()
