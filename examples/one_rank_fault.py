"""An exception on one rank only, in forward or backward: what the other rank sees.

    torchrun --nproc_per_node 2 examples/one_rank_fault.py --fw ragged --mode caught --where forward

Two gloo CPU ranks train a tiny Llama (each block and the root wrapped, ``--fw ragged`` or
torch's ``--fw fsdp2``). Step 0 is clean; at step 1 rank 1 raises in block 1's forward, or
when the gradient reaches block 1's output (``--where backward``). ``--mode uncaught``: the
exception leaves rank 1's script, as in a script without a handler. ``--mode caught``: rank
1 catches it, calls ``zero_grad()`` and goes on with step 2, as a loop that skips a bad batch
on the rank that saw it. Each rank prints what it raised and when, in seconds after rank 1's
raise (``--pg-timeout``: the process group's timeout, 30 s here instead of 30 minutes).
docs/reliability.md has the results.
"""

import argparse
import datetime
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ragged_fsdp.models.llama import Llama, LlamaConfig

p = argparse.ArgumentParser()
p.add_argument("--fw", choices=("ragged", "fsdp2"), default="ragged")
p.add_argument("--mode", choices=("uncaught", "caught"), default="caught")
p.add_argument("--where", choices=("forward", "backward"), default="forward")
p.add_argument("--pg-timeout", type=int, default=30)
args = p.parse_args()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
rank = dist.get_rank()
if args.fw == "ragged":
    from ragged_fsdp import fully_shard
else:
    from torch.distributed.fsdp import fully_shard

torch.manual_seed(0)
cfg = LlamaConfig.tiny()
model = Llama(cfg)
mesh = init_device_mesh("cpu", (2,))
for block in model.layers:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
if args.fw == "fsdp2":  # gloo has no PREMUL_SUM / AVG
    for m in model.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
stamp = os.path.join(tempfile.gettempdir(), f"one_rank_fault_{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}")


class Fault(RuntimeError):
    pass


step = 0


def fault() -> None:
    with open(stamp, "w") as f:
        f.write(str(time.time()))
    raise Fault(f"rank 1's fault in {args.where}")


def in_forward(module, inputs):
    if args.where == "forward" and rank == 1 and step == 1:
        fault()


def on_output(module, inputs, out):
    if args.where == "backward" and rank == 1 and step == 1 and out.requires_grad:
        out.register_hook(lambda grad: fault())


model.layers[1].register_forward_pre_hook(in_forward)
model.layers[1].register_forward_hook(on_output)
data = torch.randint(0, cfg.vocab_size, (4, 2, 17), generator=torch.Generator().manual_seed(rank))
tag = f"[{args.fw} {args.mode} {args.where}] rank {rank}"
try:
    for step in range(4):
        x, y = data[step, :, :-1], data[step, :, 1:]
        try:
            loss = model.loss(x, y)
            loss.backward()
        except Fault:
            if args.mode == "uncaught":
                raise
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
    print(f"{tag} finished 4 steps", flush=True)
except Fault:
    print(f"{tag} raised its fault", flush=True)
    raise
except Exception as e:
    t = time.time() - float(open(stamp).read()) if os.path.exists(stamp) else float("nan")
    print(f"{tag} raised {type(e).__name__} {t:.2f} s after rank 1's fault: {str(e)[:120]}", flush=True)
    raise
dist.barrier()
dist.destroy_process_group()
