"""The int8 wire's scale blocks on real gradients, per block size: how many elements round to
code 0, and how far below their block's step they sit. One process, under a minute::

    python benchmarks/grad_blocks.py --at-steps 0,150,299 --json docs/data/grad_wire_block_zeros.json

For each bench model (``grad_wire.py``'s shrunk demo and MoE, as the docs run them) the
parameters are grouped as the bench wraps them (each block, then the root), laid out over
``--world`` ranks with the bench's (default, element) granularity, and filled with rank 0's
local gradient (a plain model on that rank's rows: what the rank hands the wire reduction)
at each step of ``--at-steps``: the model trained that many steps with the bench's recipe on
the global batches in one process (an fp32-reduction trajectory). Per block size: the
blocks' lengths (a histogram), the fraction of the nonzero gradient elements whose int8 code
is 0 (``|g| <= absmax / 254``), and the median and 90th percentile over the nonzero elements
of ``scale / |g|`` (``scale = absmax / 127``, the wire's step). With error feedback an
element that rounds to 0 reaches its owner only once its residual has grown past
``scale / 2``, as one step of ``±scale``. Also: the largest block inside a tensor of one
Llama 3 8B block laid out with ``rows:128`` granularity, whose units (up to 1,835,008
elements) the rule before ``block_size`` kept as one block each.
"""

from __future__ import annotations

import argparse
import collections
import json
import os

import torch

from ragged_fsdp import GradientReduce
from ragged_fsdp.dbuffer.planning import plan_layout
from ragged_fsdp.quant.grad_wire import unit_elements, quantize, wire_blocks

from ragged_fsdp.bench.meta import run_meta

MODELS = {
    "moe": ["--model", "moe", "--dim", "64", "--layers", "2", "--experts", "16", "--hidden", "64", "--seq-len", "32"],
    "demo": ["--model", "demo", "--dim", "64", "--layers", "2", "--hidden", "176", "--seq-len", "64"],
}
# one Llama 3 8B transformer block (dim 4096, 8 KV heads of 128, FFN 14336) and its norms
LLAMA8B_BLOCK = [("wq", (4096, 4096)), ("wk", (1024, 4096)), ("wv", (1024, 4096)), ("wo", (4096, 4096)),
                 ("w1", (14336, 4096)), ("w3", (14336, 4096)), ("w2", (4096, 14336)), ("n1", (4096,)), ("n2", (4096,))]


def _groups(model):
    groups = [list(b.named_parameters()) for b in model.layers]
    inside = {id(p) for g in groups for _, p in g}
    groups.append([(n, p) for n, p in model.named_parameters() if id(p) not in inside])
    return groups


def _trained(bench, args, world: int, steps: int):
    """The plain model after ``steps`` steps of the bench's recipe on the global batches (the
    mean of the ranks' losses: what an fp32 reduction trains), and the batches."""
    model = bench._model(args)
    batches = bench._Batches(args, world)
    opt, sched = bench.recipe(args, model)
    for step in range(steps):
        loss = sum(model.loss(*batches.local(step, r)) for r in range(world)) / world
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, batches


def measure_model(name: str, world: int, block_sizes: list[int], at_step: int = 0) -> dict:
    import grad_wire as bench

    ap = bench._parser()
    args = ap.parse_args(MODELS[name])
    bench.check_args(ap, args)
    model, batches = _trained(bench, args, world, at_step)
    model.loss(*batches.local(at_step, 0)).backward()
    bufs = []
    for g in _groups(model):
        lay = plan_layout([(n, tuple(p.shape), None) for n, p in g], world, 0, itemsize=4)
        x = torch.zeros(lay.total)
        grads = dict(g)
        for s in lay.slots:
            x[s.offset:s.offset + s.numel] = grads[s.key].grad.reshape(-1).float()
        bufs.append((lay, x))
    out = {"model": name, "step": at_step, "argv": " ".join(MODELS[name]),
           "params": sum(p.numel() for p in model.parameters()),
           "unit_elements": sorted({unit_elements(s) for lay, _ in bufs for s in lay.slots}), "by_block": {}}
    for bs in block_sizes:
        hist = collections.Counter()
        zero = nonzero = 0
        ratios = []
        for lay, x in bufs:
            blocks = wire_blocks(lay, bs)
            hist.update(blocks.lengths.tolist())
            codes, scale = quantize(x, blocks.lengths, GradientReduce(torch.int8, block_size=bs))
            step = torch.repeat_interleave(scale, blocks.lengths)
            nz = x != 0
            zero += int((codes[nz] == 0).sum())
            nonzero += int(nz.sum())
            ratios.append(step[nz] / x[nz].abs())
        r = torch.cat(ratios)
        out["by_block"][str(bs)] = {
            "block_size": bs, "blocks": sum(hist.values()),
            "lengths": {str(k): v for k, v in sorted(hist.items())},
            "code0_fraction": zero / nonzero,
            "scale_over_abs_median": float(r.median()),
            "scale_over_abs_p90": float(r.quantile(0.9)) if r.numel() <= 16_000_000 else None,
        }
    return out


def _max_inside(lay, blocks) -> int:
    """The longest block that lies inside a tensor (padding stretches are a block each
    whatever the block size, so they are left out)."""
    ends = torch.cumsum(blocks.lengths, 0)
    starts = ends - blocks.lengths
    inside = torch.zeros(len(starts), dtype=torch.bool)
    for s in lay.slots:
        inside |= (starts >= s.offset) & (starts < s.offset + s.numel)
    return int(blocks.lengths[inside].max())


def llama_block_max(world: int, block_sizes: list[int]) -> dict:
    lay = plan_layout([(k, s, "rows:128") for k, s in LLAMA8B_BLOCK], world, 0, itemsize=4)
    return {"world": world, "unit_elements_max": max(unit_elements(s) for s in lay.slots),
            "max_block": {str(bs): _max_inside(lay, wire_blocks(lay, bs)) for bs in block_sizes}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--block-sizes", default="32,64,128")
    ap.add_argument("--at-steps", default="0", help="comma-separated steps to take the gradient at (default 0)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.block_sizes.split(",")]
    if args.world < 1 or min(sizes) < 1:
        ap.error("--world and every block size must be >= 1")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    steps = [int(x) for x in args.at_steps.split(",")]
    rows = {f"{m}@{st}": measure_model(m, args.world, sizes, st) for m in MODELS for st in steps}
    llama = llama_block_max(8, sizes)
    for m, r in rows.items():
        print(f"{r['model']} (W={args.world}, rank 0's gradient at step {r['step']}, {r['params']:,} parameters):")
        for bs, b in r["by_block"].items():
            print(f"  block {bs:>4s}: {b['blocks']:6d} blocks, lengths {b['lengths']}, code 0: "
                  f"{100 * b['code0_fraction']:.1f}% of nonzero elements, scale/|g| median "
                  f"{b['scale_over_abs_median']:.3f}")
    print(f"llama3-8b block, rows:128, W=8: units of up to {llama['unit_elements_max']:,} elements; largest block "
          f"{llama['max_block']}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": run_meta(), "world": args.world, "models": rows, "llama3_8b_block_rows128": llama,
                       "rows": [{"model": r["model"], "step": r["step"], **b} for r in rows.values()
                                for b in r["by_block"].values()]},
                      f, indent=1)


if __name__ == "__main__":
    main()
