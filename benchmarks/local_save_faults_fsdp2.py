"""What FSDP2's usual saves do with the faults tests/test_local_save_integrity.py gives the
local save (printed, not asserted: torch's behaviour, recorded in docs/reliability-checkpoints.md).

    torchrun --nproc_per_node 2 benchmarks/local_save_faults_fsdp2.py /tmp/fsdp2_probe

FSDP2 (``torch.distributed.fsdp.fully_shard``) on the tiny LLaMA, gloo, W=2; per-rank
``torch.save(model.state_dict())`` files (the no-collective save) and ``dcp.save`` with torch's
own writer. Each fault is made by rank 0 on rank 1's file, then both ranks load.
"""

from __future__ import annotations

import os
import shutil
import sys
import zipfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ragged_fsdp.models.llama import Llama, LlamaConfig


def model(seed):
    torch.manual_seed(seed)
    m = Llama(LlamaConfig.tiny(n_layers=1))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(m, mesh=mesh)
    return m


def full(m):
    return {k: v.full_tensor() for k, v in m.state_dict().items()}


def flip_largest_record(path):
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(30)
    off = info.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")
    with open(path, "r+b") as f:
        f.seek(off + info.file_size // 2)
        b = f.read(1)
        f.seek(off + info.file_size // 2)
        f.write(bytes([b[0] ^ 0x40]))


def report(what, fn):
    rank = dist.get_rank()
    try:
        out = fn()
        line = f"loaded, {out}"
    except BaseException as e:  # noqa: BLE001 - recorded as it is
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        line = f"{type(e).__name__}: {text[:150]}"
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, line)
    if rank == 0:
        print(f"{what}:")
        for r, ln in enumerate(lines):
            print(f"  rank {r}: {ln}")


def per_rank_file(root, name, rank):
    return os.path.join(root, name, f"rank{rank}.pt")


def main(root):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    a, b = model(1), model(2)
    ref_a = full(a)
    for name, m in (("a", a), ("b", b)):
        os.makedirs(os.path.join(root, name), exist_ok=True)
        torch.save(m.state_dict(), per_rank_file(root, name, rank))
    for name in ("flip", "trunc", "mix"):
        if rank == 0:
            shutil.copytree(os.path.join(root, "a"), os.path.join(root, name), dirs_exist_ok=True)
    dist.barrier()
    if rank == 0:
        flip_largest_record(per_rank_file(root, "flip", 1))
        p = per_rank_file(root, "trunc", 1)
        os.truncate(p, os.path.getsize(p) // 2)
        shutil.copyfile(per_rank_file(root, "b", 1), per_rank_file(root, "mix", 1))
    dist.barrier()

    mine = {k: v.to_local().clone() for k, v in a.state_dict().items()}

    def load_per_rank(name):
        # no collective after the load: a rank that raised must not leave the other in one
        # (with full_tensor() here, the truncated case aborts both processes in gloo)
        m = model(3)
        m.load_state_dict(torch.load(per_rank_file(root, name, rank), weights_only=False))
        got = {k: v.to_local() for k, v in m.state_dict().items()}
        return f"max |diff| of this rank's shards to the saved ones {max((got[k] - mine[k]).abs().max().item() for k in got):.3g}"

    for name, what in (("flip", "torch.save per rank, one flipped byte in rank 1's file"),
                       ("trunc", "torch.save per rank, rank 1's file truncated to half"),
                       ("mix", "torch.save per rank, rank 1's file from another save")):
        report(what, lambda: load_per_rank(name))
        dist.barrier()

    d = os.path.join(root, "dcp")
    dcp.save({"model": a.state_dict()}, checkpoint_id=d)
    dist.barrier()
    if rank == 0:
        flip_largest_record_raw(os.path.join(d, "__1_0.distcp"))
    dist.barrier()

    def load_dcp():
        m = model(3)
        sd = {"model": m.state_dict()}
        dcp.load(sd, checkpoint_id=d)
        got = full(m)
        return f"max |diff| to the saved state {max((got[k] - ref_a[k]).abs().max().item() for k in got):.3g}"

    report("dcp.save / dcp.load (torch's writer), one flipped byte in __1_0.distcp", load_dcp)
    dist.destroy_process_group()


def flip_largest_record_raw(path):
    """A .distcp is not a zip: flip the byte in the middle of the file (tensor bytes)."""
    n = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(n // 2)
        b = f.read(1)
        f.seek(n // 2)
        f.write(bytes([b[0] ^ 0x40]))


if __name__ == "__main__":
    main(sys.argv[1])
