"""What the checksums cost a local save and load: one process, 256 MiB of fp32 in 64 tensors.

    python benchmarks/local_save_cost.py /tmp/lsb

Prints the best of 3 wall-clock seconds of ``save_local`` and of ``load_local`` (each into a
new directory / into fresh tensors). Run it with another checkout's ``src`` to compare.
"""

import os
import shutil
import sys
import time

import torch

from ragged_fsdp.checkpoint import load_local, save_local


def main(root):
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(1 << 20) for i in range(64)}
    saves, loads = [], []
    for rep in range(3):
        d = os.path.join(root, f"rep{rep}")
        shutil.rmtree(d, ignore_errors=True)
        t = time.perf_counter()
        save_local(state, d)
        saves.append(time.perf_counter() - t)
        target = {k: torch.empty_like(v) for k, v in state.items()}
        t = time.perf_counter()
        load_local(target, d)
        loads.append(time.perf_counter() - t)
        assert all(torch.equal(target[k], v) for k, v in state.items())
        shutil.rmtree(d)
    print(f"save_local {min(saves):.3f} s, load_local {min(loads):.3f} s (best of 3, 256 MiB)")


if __name__ == "__main__":
    main(sys.argv[1])
