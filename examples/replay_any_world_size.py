"""Replay a training step on fewer ranks and get the same bits (ragged_fsdp.global_order).

Train 4 steps on 4 ranks, saving a checkpoint after step 2; then load that checkpoint on
1 rank (or 2) and run steps 3-4 again. Each run prints a SHA-256 of the final parameters and
optimizer state: the replay prints the same digest as the 4-rank run.

    torchrun --nproc_per_node 4 examples/replay_any_world_size.py --dir /tmp/replay --save-at 2
    torchrun --nproc_per_node 1 examples/replay_any_world_size.py --dir /tmp/replay
    torchrun --nproc_per_node 2 examples/replay_any_world_size.py --dir /tmp/replay

The recipe: a fixed number V of micro-batches per step (12 here: any W dividing it works),
micro-batch j on data-parallel rank j mod W (``micro_batches(model)`` lists this rank's j),
each micro-batch's loss its own mean, gradient sync on for every micro-step, the clipping
and the logged loss from ``ragged_fsdp.fsdp.deterministic``, and a checkpoint at a step
boundary (the step counter in it says which micro-batches come next).
"""

from __future__ import annotations

import argparse
import hashlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import ragged_fsdp.checkpoint as ck
from ragged_fsdp import fully_shard, global_order
from ragged_fsdp.fsdp import deterministic as det
from ragged_fsdp.models.llama import Llama, LlamaConfig

V, STEPS, MICRO_BATCH, SEQ = 12, 4, 2, 16


def micro_batch(step: int, j: int):
    """Micro-batch j of a step: the same tokens whichever rank runs it."""
    g = torch.Generator().manual_seed(10_000 * step + j)
    data = torch.randint(0, 256, (MICRO_BATCH, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def digest(model, opt) -> str:
    h = hashlib.sha256()
    tensors = [p.detach() for p in model.parameters()]
    tensors += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        full = t.full_tensor() if isinstance(t, DTensor) else t
        h.update(full.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True, help="checkpoint root")
    ap.add_argument("--save-at", type=int, default=None, help="train from scratch and save after this step")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ,
                              tie_embeddings=True))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    global_order(model, micro_batches=V)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"train": ck.TrainState(model, opt), "step": 0}
    if args.save_at is None:
        ck.load_latest(args.dir, state)
    for step in range(state["step"], STEPS):
        losses = []
        for j in det.micro_batches(model):
            loss = model.loss(*micro_batch(step, j))
            loss.backward()
            losses.append(loss.detach())
        norm = det.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        loss = det.mean_loss(model, losses)
        if dist.get_rank() == 0:
            print(f"W={dist.get_world_size()} step {step}: loss {loss.item():.6f} grad norm {norm.item():.6f}")
        if args.save_at is not None and step + 1 == args.save_at:
            state["step"] = step + 1
            ck.save(state, args.dir, step=step + 1)
    d = digest(model, opt)
    if dist.get_rank() == 0:
        print(f"W={dist.get_world_size()} final state sha256 {d}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
