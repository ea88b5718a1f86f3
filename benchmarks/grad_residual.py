"""Error feedback's residual storage (``GradientReduce(residual_dtype=...)``) against fp32
storage, in one process::

    python benchmarks/grad_residual.py --world 4 --steps 300 --json docs/data/grad_residual_w4.json

Runs :func:`~ragged_fsdp.quant.grad_wire.reference_reduce` (the engine's block math, equal to
the engine's collective bit for bit: tests/test_gradient_reduce.py) for ``--steps`` steps on
the layout of the shrunk demo model's parameter shapes (the docs' training runs) planned over
``--world`` ranks. Rank ``k``'s gradient at step ``t`` is a shared signal plus its own noise,
``m_t + n_k,t``, both with per-element magnitudes spread over four decades; ``m_t`` follows an
AR(1) process (correlation 0.9 from step to step), so errors that do not cancel accumulate as
they would in training. Per wire and residual storage: the mean over the steps of the reduced
gradient's error ``||g - g_exact|| / ||g_exact||``, the accumulated error
``||sum_t (g_t - g_exact_t)||`` (relative to ``||sum_t g_exact_t||``) and the residual's bytes
per element of the unsharded buffer on one rank. A synthetic stream, not training: it isolates
what the storage changes, with everything else equal.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from ragged_fsdp import GradientReduce
from ragged_fsdp.dbuffer.planning import plan_layout
from ragged_fsdp.quant.grad_wire import DEFAULT_BLOCK, reference_reduce, wire_blocks
from ragged_fsdp.quant.wire_residual import Residual

from ragged_fsdp.bench.meta import run_meta

# the shrunk demo model (dim 64, 2 layers, FFN hidden 176, byte vocabulary 256): one block's
# matrices and norms, the embedding and the head, default (row) granularity
SHAPES = ([("emb", (256, 64), None), ("head", (256, 64), None), ("norm", (64,), None)]
          + [(f"l{i}.{n}", s, None) for i in range(2)
             for n, s in (("wq", (64, 64)), ("wk", (32, 64)), ("wv", (32, 64)), ("wo", (64, 64)),
                          ("w1", (176, 64)), ("w3", (176, 64)), ("w2", (64, 176)), ("n1", (64,)), ("n2", (64,)))])

CASES = [("int8", None), ("int8", torch.float32), ("int8", torch.bfloat16), ("int8", torch.int8),
         ("fp8", None), ("fp8", torch.float32), ("fp8", torch.bfloat16)]
_WIRE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _stream(n: int, world: int, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    mag = torch.logspace(-4, 0, n)[torch.randperm(n, generator=g)]
    m = torch.randn(n, generator=g)
    for _ in range(steps):
        m = 0.9 * m + (1 - 0.9 ** 2) ** 0.5 * torch.randn(n, generator=g)
        yield [(m + torch.randn(n, generator=g)) * mag for _ in range(world)]


def measure(world: int, steps: int, seed: int = 0, block_size: int = DEFAULT_BLOCK) -> list[dict]:
    lay = plan_layout(SHAPES, world, 0, itemsize=4)  # the blocks are every rank's
    blocks = wire_blocks(lay, block_size)
    S = lay.segment
    rows = []
    for wire, store in CASES:
        fmt = GradientReduce(_WIRE[wire], error_feedback=store is not None, residual_dtype=store,
                             block_size=block_size)
        res = [Residual(blocks, k, fmt) for k in range(world)] if fmt.error_feedback else None
        acc = acc_ref = None
        errs = []
        for grads in _stream(lay.total, world, steps, seed):
            got = torch.cat(reference_reduce(grads, lay, fmt, None, residuals=res))
            exact = torch.stack(grads).sum(0) / world
            d = got - exact
            errs.append(float(d.norm() / exact.norm()))
            acc = d if acc is None else acc + d
            acc_ref = exact if acc_ref is None else acc_ref + exact
        rows.append({"wire": wire, "residual": "none" if store is None else str(store).removeprefix("torch."),
                     "grad_rel_err_mean": sum(errs) / len(errs),
                     "accumulated_rel_err": float(acc.norm() / acc_ref.norm()),
                     "residual_bytes_per_element": 0.0 if res is None else res[0].nbytes / (world * S)})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=DEFAULT_BLOCK,
                    help=f"elements per scale block (GradientReduce.block_size; default {DEFAULT_BLOCK})")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.world < 1 or args.steps < 1 or args.block_size < 1:
        ap.error("--world, --steps and --block-size must be >= 1")
    torch.set_num_threads(1)
    rows = measure(args.world, args.steps, args.seed, args.block_size)
    base = {r["wire"]: r for r in rows if r["residual"] == "float32"}
    for r in rows:
        b = base[r["wire"]]
        r["accumulated_vs_fp32_residual"] = r["accumulated_rel_err"] / b["accumulated_rel_err"]
    print(f"W={args.world}, {args.steps} steps: {'wire':5s} {'residual':>9s} {'grad err':>9s} {'accumulated':>12s} "
          f"{'vs fp32 res':>11s} {'bytes/elem':>10s}")
    for r in rows:
        print(f"{'':22s}{r['wire']:5s} {r['residual']:>9s} {r['grad_rel_err_mean']:9.2e} "
              f"{r['accumulated_rel_err']:12.2e} {r['accumulated_vs_fp32_residual']:11.2f} "
              f"{r['residual_bytes_per_element']:10.3f}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": run_meta(), "world": args.world, "steps": args.steps, "seed": args.seed,
                       "block_size": args.block_size, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
