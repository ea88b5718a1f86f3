"""The training script of tests/test_snapshots_elastic.py, run by torchrun agents (one worker
each): a tiny Llama with dropout in ``global_order`` (V = 12), snapshots every step into the
node-local directory ``SNAP_DIR``, and a test-only hook that kills this node where ``DIE`` says.

Environment (set per agent by the test): ``SNAP_DIR`` (this node's directory), ``OUT`` (where
rank 0 logs; the test reads it, the library never sees it), ``STEPS``, ``NODE`` (the agent's
name), ``DIE`` (``node:where:step;...``, ``node`` an agent's name or ``r<rank>``, ``where`` in after / backward / optimizer / snapshot:
the node dies there once, its directory deleted with it), ``WAIT_AT`` (``step:W;...``: at that
step, a run with fewer than W ranks waits for nodes to join; the test always waits for 4 at
step 0, as agents start at different times), ``FALLBACK`` (a DCP root for the
double loss; a checkpoint every 2 steps).
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

V, SEED, DROPOUT = 12, 1234, 0.1


def _die(where: str, step: int) -> None:
    for spec in filter(None, os.environ.get("DIE", "").split(";")):
        node, w, s = spec.split(":")
        me = f"r{dist.get_rank()}" if node.startswith("r") else os.environ["NODE"]  # a rank, or an agent
        if node != me or w != where or int(s) != step:
            continue
        mark = os.path.join(os.environ["OUT"], f"died-{node}-{w}-{s}")
        if os.path.exists(mark):
            continue
        with open(mark, "w") as f:
            f.write(os.environ["NODE"])
        shutil.rmtree(os.environ["SNAP_DIR"], ignore_errors=True)  # the node's memory goes with it
        os.kill(os.getppid(), signal.SIGKILL)  # the agent
        os.kill(os.getpid(), signal.SIGKILL)


def _batch(step: int, j: int):
    g = torch.Generator().manual_seed(SEED * 1_000_003 + step * 1009 + j)
    tokens = torch.randint(0, 96, (2, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_fsdp import fully_shard, global_order
    from ragged_fsdp.checkpoint import Snapshots
    from ragged_fsdp.checkpoint import snapshots as snapshots_module
    from ragged_fsdp.fsdp import deterministic as det
    from ragged_fsdp.fsdp.micro_rng import micro_batch_rng
    from ragged_fsdp.models.llama import Llama, LlamaConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("PG_TIMEOUT", "30"))))
    world, rank = dist.get_world_size(), dist.get_rank()
    out, steps = os.environ["OUT"], int(os.environ["STEPS"])
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    state = {"step": -1}
    for block in model.layers:  # dropout on every block's output, drawn from the micro-batch's RNG
        block.register_forward_hook(lambda m, a, o: F.dropout(o, DROPOUT, training=True))

    def die_in_backward(module, args, out):
        if out.requires_grad:
            out.register_hook(lambda g: _die("backward", state["step"]))

    model.layers[1].register_forward_hook(die_in_backward)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    global_order(model, micro_batches=V)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    opt.register_step_post_hook(lambda o, a, k: _die("optimizer", state["step"]))
    send = snapshots_module.send_files

    def send_files(*args, **kwargs):  # inside a snapshot: this node's part is written, the copies are not
        _die("snapshot", state["step"])
        send(*args, **kwargs)

    snapshots_module.send_files = send_files
    snaps = Snapshots(model, opt, dir=os.environ["SNAP_DIR"], run="elastic-test", fallback=os.environ.get("FALLBACK"))
    start = snaps.restore()
    if rank == 0:
        with open(os.path.join(out, "events.txt"), "a") as f:
            f.write(f"start W={world} at={start} extra={snaps.extra} from={snaps.restored_from}\n")
    waits = dict(tuple(map(int, w.split(":"))) for w in filter(None, os.environ.get("WAIT_AT", "").split(";")))
    for step in range(start, steps):
        state["step"] = step
        if world < waits.get(step, 0):
            if rank == 0:
                with open(os.path.join(out, "events.txt"), "a") as f:
                    f.write(f"waiting W={world} step={step}\n")
            time.sleep(600)  # torchrun restarts this worker when the new nodes join
        losses = []
        for j in det.micro_batches(model):
            with micro_batch_rng(SEED, step, j):
                loss = model.loss(*_batch(step, j))
            loss.backward()
            losses.append(loss.detach())
        norm = det.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        logged = det.mean_loss(model, losses)
        if rank == 0:
            with open(os.path.join(out, "log.txt"), "a") as f:
                f.write(f"{step} {world} {logged.item().hex()} {norm.item().hex()}\n")
        state["step"] = step + 1
        snaps.snapshot(step + 1, extra={"data_step": step + 1})
        if os.environ.get("FALLBACK") and (step + 1) % 2 == 0:
            snaps.checkpoint(step + 1, extra={"data_step": step + 1})
        _die("after", step + 1)
    final = {"params": {k: p.detach().full_tensor().clone() for k, p in model.named_parameters()}}
    names = {id(p): k for k, p in model.named_parameters()}
    final["optim"] = {f"{names[id(p)]}.{k}": (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                      for p, st in opt.state.items() for k, v in st.items()}
    if rank == 0:
        torch.save(final, os.path.join(out, "final.pt"))
        with open(os.path.join(out, "events.txt"), "a") as f:
            f.write(f"done W={world}\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
