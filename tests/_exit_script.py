"""One rank of the exit test (tests/test_exit_clean.py): trains two steps with ragged_fsdp,
then ends with no barrier and no destroy_process_group (an ending that can abort a rank). argv: 'failsave ROOT' (a checkpoint save that fails on a full disk,
caught) or 'allreduce' (the loss all-reduced for printing, the script's last collective).

Two settings make the race likely (without the library's exit hook's hand-off, 1 of 3
'allreduce' launches had a rank abort with "terminate called without an active
exception"; 3 of 4 for a plain gloo script ending the same way):
``sys.setswitchinterval(100)``, so the main thread does not hand the GIL to a waiting
gloo worker thread every 5 ms while it runs Python, only when it blocks; and the process's
other threads (gloo's workers) pinned to the main thread's core at the lowest priority, so
a worker that has finished a collective reaches for the GIL late, as on a loaded
machine."""

import os
import resource
import sys
import threading

import torch
import torch.distributed as dist
import torch.nn as nn

from torch.distributed.checkpoint.state_dict import get_model_state_dict

import ragged_fsdp
import ragged_fsdp.checkpoint as ck

torch.set_num_threads(1)
dist.init_process_group("gloo")
main = threading.get_native_id()
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
for tid in map(int, os.listdir("/proc/self/task")):
    if tid != main:
        os.sched_setaffinity(tid, os.sched_getaffinity(0))
        os.setpriority(os.PRIO_PROCESS, tid, 19)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
for m in model:
    ragged_fsdp.fully_shard(m)
ragged_fsdp.fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    loss = model(torch.randn(4, 16)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
sys.setswitchinterval(100)
if sys.argv[1] == "failsave":
    state = {"model": get_model_state_dict(model)}
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
    try:
        ck.save(state, sys.argv[2], step=1)
        print("save unexpectedly succeeded", file=sys.stderr)
        sys.exit(3)
    except ck.CheckpointSaveError:
        pass
else:
    dist.all_reduce(loss.detach())
