"""What is alive at the peak of one Muon optimizer step, per rank (issue 46): a dispatch
mode (``ragged_fsdp.bench.live_bytes.LiveBytes``) counts every tensor storage the step
creates until it is freed and lists those alive at the largest total, with the op and the
code that made each. The second step is traced (the first creates the momentum).

    PYTHONPATH=src python benchmarks/muon_live_trace.py --world 2 --impls "ragged whole, bounded;ragged no policy, bounded"

Same model, gradients and builders as ``benchmarks/muon_peers.py`` (the DistMuon row imports
torchtitan); ``--world 1`` runs the ragged rows in this process.
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

NAMES = "ragged whole, bounded;ragged no policy, bounded;FSDP2 + DistMuon"


def _trace(name, mesh) -> dict:
    from ragged_fsdp.bench.live_bytes import LiveBytes

    impl = mp_bench._build(name, mesh)
    impl.set_grads(0)
    impl.step()
    impl.set_grads(1)
    with LiveBytes(frames=2) as lb:
        impl.opts[0].step()
    return {"peak": lb.peak, "after": lb.current, "report": lb.report()}


def _worker(rank, world, port, names, q):
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    out = {name: _trace(name, mesh) for name in names}
    g = [None] * world
    dist.all_gather_object(g, out)
    if rank == 0:
        q.put(g)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--impls", default=NAMES)
    ap.add_argument("--out", default=None, help="JSON of the per-rank traces")
    a = ap.parse_args()
    names = [n.strip() for n in a.impls.split(";") if n.strip()]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = mp_bench._free_port()
    ps = [ctx.Process(target=_worker, args=(r, a.world, port, names, q)) for r in range(a.world)]
    for p in ps:
        p.start()
    per_rank = q.get()
    for p in ps:
        p.join()
    for name in names:
        for r, pr in enumerate(per_rank):
            t = pr[name]
            print(f"== W={a.world} {name}, rank {r}: peak {t['peak'] / 2**20:.4f} MiB above entry, "
                  f"{t['after'] / 2**20:.4f} MiB left after")
            print(t["report"])
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": "PYTHONPATH=src python " + " ".join(sys.argv), "world": a.world,
                       "per_rank": per_rank}, f, indent=1)


if __name__ == "__main__":
    main()
