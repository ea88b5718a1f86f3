"""What ``ragged_fsdp.global_order`` costs, side by side in one launch.

    torchrun --nproc_per_node 2 benchmarks/global_order_cost.py --out docs/data/global_order_w2.json
    torchrun --nproc_per_node 4 benchmarks/global_order_cost.py --out docs/data/global_order_w4.json

For the small dense Llama and the MoE model, one optimizer step of V micro-batches
(V / W micro-steps per rank) in three ways, the same data:

* ``global``: ``global_order(model, V)``: every micro-step reduces (fp32 pieces by
  all-to-all, folded in micro-batch order);
* ``regular``: ragged_fsdp's own reduction, gradient sync off until the last micro-step
  (local accumulation, one reduce-scatter per step: what users run);
* ``fsdp2``: torch's ``fully_shard``, the same accumulation, fp32 reduce.

Rounds alternate the three (one step each, after warm-up steps); the step-time ratio against
``global`` is the median over rounds of per-round ratios. Bytes: what one rank sends for the
gradient reduction per step (nominal: (W-1)/W of the fp32 gradient buffer per reduction).
The fp32 accumulator is one segment per trainable buffer, held from a step's first
micro-step to its last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

MODES = ("global", "regular", "fsdp2")


def build(model_name: str, mode: str, mesh, V: int):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from ragged_fsdp import fully_shard, global_order

    torch.manual_seed(0)
    if model_name == "llama":
        from ragged_fsdp.models.llama import Llama, LlamaConfig

        m = Llama(LlamaConfig(vocab_size=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=256,
                              max_seq_len=64))
    else:
        from ragged_fsdp.models.moe import MoE, MoEConfig

        m = MoE(MoEConfig(vocab_size=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, n_experts=16, top_k=2,
                          expert_hidden=128, max_seq_len=64, fused_experts=True))
    if mode == "fsdp2":
        mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        for b in m.layers:
            torch_fully_shard(b, mesh=mesh, mp_policy=mp)
        torch_fully_shard(m, mesh=mesh, mp_policy=mp)
    else:
        for b in m.layers:
            fully_shard(b, mesh=mesh)
        fully_shard(m, mesh=mesh)
        if mode == "global":
            global_order(m, micro_batches=V)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


def batch(step: int, j: int, mb: int, seq: int):
    g = torch.Generator().manual_seed(1000 * step + j)
    data = torch.randint(0, 512, (mb, seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def step(m, opt, mode: str, k: int, V: int, mb: int, seq: int) -> None:
    W, r = dist.get_world_size(), dist.get_rank()
    js = list(range(r, V, W))
    for i, j in enumerate(js):
        if mode != "global":
            m.set_requires_gradient_sync(i == len(js) - 1)
        m.loss(*batch(k, j, mb, seq)).backward()
    opt.step()
    opt.zero_grad()


def sent_bytes(m, mode: str, V: int) -> int:
    """Bytes one rank sends per step for the gradient reduction (nominal)."""
    W = dist.get_world_size()
    n = sum(p.numel() for p in m.parameters() if p.requires_grad)  # global elements
    per_reduction = (W - 1) * n * 4 // W
    return per_reduction * (V // W if mode == "global" else 1)


def accumulator_bytes(m) -> int:
    """The global order's fp32 accumulator on this rank: one segment per trainable buffer."""
    from ragged_fsdp.fsdp import FSDPModule

    total = 0
    for mod in m.modules():
        if isinstance(mod, FSDPModule):
            total += sum(buf.segment * 4 for buf in mod.dbuffers if buf.dtype.is_floating_point)
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    W = dist.get_world_size()
    mesh = init_device_mesh("cpu", (W,))
    V = args.micro_batches
    rows = []
    for name in ("llama", "moe"):
        built = {mode: build(name, mode, mesh, V) for mode in MODES}
        for k in range(args.warmup):
            for mode in MODES:
                step(*built[mode], mode, k, V, args.micro_batch, args.seq)
        times = {mode: [] for mode in MODES}
        for k in range(args.rounds):
            for mode in MODES:
                dist.barrier()
                t0 = time.perf_counter()
                step(*built[mode], mode, k, V, args.micro_batch, args.seq)
                dist.barrier()
                times[mode].append(time.perf_counter() - t0)
        for mode in MODES:
            ratio = statistics.median(g / t for g, t in zip(times["global"], times[mode]))
            rows.append({"model": name, "W": W, "V": V, "mode": mode,
                         "step_s_median": round(statistics.median(times[mode]), 4),
                         "global_over_this": round(ratio, 3),
                         "sent_MiB_per_step": round(sent_bytes(built[mode][0], mode, V) / 2**20, 3),
                         "accumulator_MiB": round(accumulator_bytes(built["global"][0]) / 2**20, 3)
                         if mode == "global" else 0.0})
    if dist.get_rank() == 0:
        for row in rows:
            print(json.dumps(row))
        if args.out:
            from ragged_fsdp.bench.meta import run_meta

            cmd = f"torchrun --nproc_per_node {W} benchmarks/global_order_cost.py --out {args.out}"
            with open(args.out, "w") as f:
                json.dump({"meta": run_meta(cmd), "rows": rows}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
