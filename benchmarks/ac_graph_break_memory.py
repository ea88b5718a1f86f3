"""Does full activation checkpointing still free a block's activations when the block is
compiled and an opaque autograd Function inside it breaks the graph?

The question behind docs/simulate.md's MoE memory gap: torchtitan's DeepEP runs (full AC,
``torch.compile`` per block) keep far more memory than full AC should, and DeepEP's
dispatch is an autograd Function that Dynamo cannot trace (a graph break inside the
checkpointed block). This script measures, on this machine's CPU, the memory a forward of six
such blocks keeps for backward (resident set growth; each activation is a large allocation,
which glibc maps and unmaps on its own, so frees show at once) under: no AC, eager AC, AC with
the opaque Function, and AC + compile (AOTAutograd with eager kernels, and inductor) with and
without it.

    PYTHONPATH=src python benchmarks/ac_graph_break_memory.py [--inductor] [--out JSON]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

TOKENS, DIM, HIDDEN, BLOCKS = 16384, 512, 4096, 6


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Opaque(torch.autograd.Function):
    """Stands for DeepEP's dispatch: keeps a host value on its ctx, and Dynamo breaks the
    graph around it (as around DeepEP's C++ calls)."""

    @staticmethod
    def forward(ctx, x):
        ctx.rows = int(x.shape[0])
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return g


class Block(nn.Module):
    def __init__(self, opaque: bool):
        super().__init__()
        self.up, self.down, self.opaque = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM), opaque

    def forward(self, x):
        h = torch.relu(self.up(x))
        if self.opaque:
            h = Opaque.apply(h)
            torch._dynamo.graph_break()
        return x + torch.relu(self.down(h)) * 2


def measure(ac: bool, opaque: bool, backend: str | None) -> float:
    """MiB a forward keeps until its backward (after two warm-up steps)."""
    torch.manual_seed(0)
    blocks = []
    for _ in range(BLOCKS):
        b: nn.Module = Block(opaque)
        if ac:
            b = checkpoint_wrapper(b)  # non-reentrant, torchtitan's full AC
        if backend:
            b = torch.compile(b, backend=backend)  # per block, after AC, as torchtitan
        blocks.append(b)
    model = nn.Sequential(*blocks)
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    for _ in range(2):
        model(x).sum().backward()
    gc.collect()
    before = _rss_mib()
    y = model(x)
    gc.collect()
    kept = _rss_mib() - before
    y.sum().backward()
    return kept


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inductor", action="store_true", help="also the inductor rows (a minute or more to compile)")
    ap.add_argument("--out", default=None, help="write the rows and the run's meta as JSON")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one measurement, in a fresh process
    args = ap.parse_args()
    if args.case:
        ac, opaque, backend = args.case.split(",")
        print(measure(ac == "1", opaque == "1", backend or None))
        return 0
    cases = [("none", False, False, ""), ("eager AC", True, False, ""), ("eager AC", True, True, ""),
             ("AC + compile", True, False, "aot_eager"), ("AC + compile", True, True, "aot_eager"),
             ("compile, no AC", False, True, "aot_eager")]
    if args.inductor:
        cases += [("AC + compile", True, True, "inductor")]
    rows = []
    block_in, block_hidden = TOKENS * DIM * 4 / 2**20, TOKENS * HIDDEN * 4 / 2**20
    print(f"{BLOCKS} blocks; one block's input {block_in:.0f} MiB, one hidden activation {block_hidden:.0f} MiB\n")
    print("| AC | opaque Function (graph break) | backend | forward keeps (MiB) |\n|---|---|---|---|")
    for name, ac, opaque, backend in cases:
        # a fresh process per case: compiled code and the allocator's state do not carry over
        out = subprocess.run([sys.executable, __file__, "--case", f"{int(ac)},{int(opaque)},{backend}"],
                             check=True, capture_output=True, text=True).stdout.split()[-1]
        kept = float(out)
        rows.append({"case": name, "ac": ac, "opaque": opaque, "backend": backend or "eager", "kept_mib": kept})
        print(f"| {name} | {'yes' if opaque else 'no'} | {backend or 'eager'} | {kept:,.1f} |")
    if args.out:
        from ragged_fsdp.bench.meta import run_meta

        with open(args.out, "w") as f:
            json.dump({"meta": run_meta(), "block_input_mib": block_in, "block_hidden_mib": block_hidden,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
