"""What the per-item CRC-32 costs: save and load with and without checksums.

    python benchmarks/ckpt_integrity.py [--mib 256] [--tensors 64] [--repeats 5] [--json out.json]

One process, no process group: a state dict of ``--tensors`` float32 tensors totalling
``--mib`` MiB is saved with ``dcp.FileSystemWriter`` and with ``ChecksummedWriter``, and read
back with ``dcp.FileSystemReader`` and ``ChecksummedReader``, alternating, ``--repeats``
times each; the table gives medians and the ratio. The files sit in a temporary directory
(usually the page cache after the first write), so the ratio is the CPU cost of hashing
against DCP's own serialisation, an upper bound for slower disks.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from ragged_fsdp.checkpoint.integrity import ChecksummedReader, ChecksummedWriter
from ragged_fsdp.bench.meta import run_meta


def _state(mib: int, tensors: int) -> dict:
    per = mib * 2**20 // 4 // tensors
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(per, generator=g) for i in range(tensors)}


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(mib: int = 256, tensors: int = 64, repeats: int = 5) -> dict:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state = _state(mib, tensors)
    target = {k: torch.empty_like(v) for k, v in state.items()}
    times = {k: [] for k in ("save_plain", "save_crc", "load_plain", "load_crc")}
    root = tempfile.mkdtemp(prefix="ckpt_integrity_")
    try:
        for r in range(repeats):
            for kind, writer, reader in (("plain", dcp.FileSystemWriter, dcp.FileSystemReader),
                                         ("crc", ChecksummedWriter, ChecksummedReader)):
                d = f"{root}/{kind}{r}"
                times[f"save_{kind}"].append(_time(lambda: dcp.save(state, storage_writer=writer(d), no_dist=True)))
                times[f"load_{kind}"].append(_time(lambda: dcp.load(target, storage_reader=reader(d), no_dist=True)))
                assert all(torch.equal(target[k], state[k]) for k in state)
                shutil.rmtree(d)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "mib": mib, "tensors": tensors, "repeats": repeats, "median_s": med, "all_s": times,
        "save_ratio": med["save_crc"] / med["save_plain"], "load_ratio": med["load_crc"] / med["load_plain"],
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    res = run(a.mib, a.tensors, a.repeats)
    m = res["median_s"]
    print(f"{a.mib} MiB in {a.tensors} float32 tensors, median of {a.repeats}")
    print(f"{'':6}{'plain DCP s':>12}{'with CRC-32 s':>15}{'ratio':>8}")
    for op in ("save", "load"):
        print(f"{op:6}{m[op + '_plain']:>12.3f}{m[op + '_crc']:>15.3f}{res[op + '_ratio']:>8.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": run_meta(), **res}, f, indent=1)


if __name__ == "__main__":
    main()
