"""PP 2 x FSDP 2 x TP 2 on 8 CPU gloo ranks, checked against single-process training.

    torchrun --nproc-per-node 8 examples/pp_fsdp_tp_3d.py

A 4-block LLaMA-style model (``ragged_fsdp.models.Llama``) is split into 2 pipeline stages
(``Schedule1F1B``, 4 micro-batches) and into 4 virtual stages, 2 per rank
(``ScheduleInterleavedZeroBubble``). Inside each stage the attention and feed-forward
projections are tensor-parallel on ``tp`` (column-wise q/k/v and w1/w3, row-wise wo and
w2), and every block and each stage root is ``fully_shard``-ed on ``dp``. Each schedule
trains 3 SGD steps; the script prints every step's loss next to single-process training of
the whole model on the whole batch, and the largest parameter difference at the end.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleavedZeroBubble
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ragged_fsdp import fully_shard
from ragged_fsdp.models import Llama, LlamaConfig, LlamaStage

STEPS, MICRO, SEQ, LR = 3, 4, 8, 0.5


def loss_fn(logits, targets):
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def model() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.tiny(n_layers=4))


def batch(step: int, dp_size: int):
    g = torch.Generator().manual_seed(100 + step)
    data = torch.randint(0, 96, (MICRO * dp_size, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def tensor_parallel(block, tp_mesh) -> None:
    plan = {f"attention.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")}
    plan.update({"attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()})
    plan.update({f"feed_forward.{n}": ColwiseParallel() for n in ("w1", "w3")})
    parallelize_module(block, tp_mesh, plan)
    tp = tp_mesh.size()
    block.attention.n_heads //= tp  # the local projections hold 1/tp of the heads
    block.attention.n_kv //= tp


def reference():
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, 2)
        opt.zero_grad()
        loss = loss_fn(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in m.named_parameters()}


def train(mesh, looped: bool):
    pp_mesh, dp_mesh, tp_mesh = mesh["pp"], mesh["dp"], mesh["tp"]
    pp, dp = pp_mesh.get_local_rank(), dp_mesh.get_local_rank()
    n_stages = 4 if looped else 2
    mine = [pp, pp + 2] if looped else [pp]
    whole, per = model(), 4 // n_stages
    stages, mods = [], []
    for s in mine:
        m = LlamaStage(whole, s * per, (s + 1) * per, s == 0, s == n_stages - 1)
        for block in m.layers.values():
            tensor_parallel(block, tp_mesh)
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
        fully_shard(m, mesh=dp_mesh, reshard_after_forward=False)
        mods.append(m)
        stages.append(PipelineStage(m, s, n_stages, torch.device("cpu"), group=pp_mesh.get_group()))
    cls = ScheduleInterleavedZeroBubble if looped else Schedule1F1B
    schedule = cls(stages if looped else stages[0], n_microbatches=MICRO, loss_fn=loss_fn)
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=LR)
    first, last = 0 in mine, n_stages - 1 in mine
    losses = []
    for step in range(STEPS):
        x, y = batch(step, 2)
        x, y = x[dp * MICRO:(dp + 1) * MICRO], y[dp * MICRO:(dp + 1) * MICRO]
        opt.zero_grad()
        got: list = []
        schedule.step(*((x,) if first else ()), **({"target": y, "losses": got} if last else {}))
        opt.step()
        # one mean per last-stage rank (dp x tp of them), averaged
        t = torch.tensor([sum(v.item() for v in got) / MICRO, 1.0] if last else [0.0, 0.0], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append((t[0] / t[1]).item())
    params = {}
    for m in mods:
        for n, p in m.named_parameters():
            params[n] = p.full_tensor().detach() if isinstance(p, DTensor) else p.detach()
    return losses, params


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    if dist.get_world_size() != 8:
        raise SystemExit("run with torchrun --nproc-per-node 8 (PP 2 x FSDP 2 x TP 2)")
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    ref_losses, ref_params = reference()
    for name, looped in (("Schedule1F1B, 2 stages", False), ("ScheduleInterleavedZeroBubble, 4 virtual stages", True)):
        losses, params = train(mesh, looped)
        worst = torch.tensor(max((params[n] - ref_params[n]).abs().max().item() for n in params), dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            print(f"{name}:")
            for step, (a, b) in enumerate(zip(losses, ref_losses)):
                print(f"  step {step}: loss {a:.8f}  single-process {b:.8f}  rel. diff {abs(a - b) / b:.1e}")
            print(f"  largest parameter difference after {STEPS} steps: {worst.item():.1e}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
