"""Gradient reduction in fewer bytes (``fully_shard(gradient_reduce=...)``) against fp32
reduction and FSDP2's ``reduce_dtype=bf16``, side by side in one launch::

    torchrun --nproc_per_node 4 -m ragged_fsdp.bench.grad_wire --steps 100 --json docs/data/grad_wire_w4.json

Per mode, on a Llama (vocab 512, dim 128, 4 layers; each block and the root wrapped) with
AdamW from the same seed and the same batches: the bytes each rank sends per step for the
gradient reduction (the wire codes and scales, or what a ring reduce-scatter sends), the
first step's gradient error against fp32 reduction (same weights, same local gradients:
the error is the reduction's alone), and the loss after ``--steps`` steps.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

MODES = {
    "fp32 reduce": None,
    "bf16 wire, fp32 sum": ("bf16", False),
    "int8 + scale": ("int8", False),
    "int8 + scale, error feedback": ("int8", True),
    "fp8 e4m3 + scale": ("fp8", False),
    "fp8 e4m3 + scale, error feedback": ("fp8", True),
    "FSDP2 reduce_dtype=bf16": "fsdp2",
}
_WIRE = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _model():
    from ragged_fsdp.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=256,
                             max_seq_len=64))


def _wrap(mode, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from ragged_fsdp import GradientReduce
    from ragged_fsdp.fsdp import fully_shard

    m = _model()
    if mode == "fsdp2":
        mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
        for b in m.layers:
            torch_fully_shard(b, mesh=mesh, mp_policy=mp)
        return torch_fully_shard(m, mesh=mesh, mp_policy=mp)
    kw = {} if mode is None else {"gradient_reduce": GradientReduce(_WIRE[mode[0]], error_feedback=mode[1])}
    for b in m.layers:
        fully_shard(b, mesh=mesh, **kw)
    return fully_shard(m, mesh=mesh, **kw)


def _bytes_sent(model, mode, world: int) -> int:
    """Bytes one rank sends per step for the gradient reduction (codes + scales for the
    wire formats; a ring reduce-scatter's (W-1)/W of the buffer otherwise)."""
    from ragged_fsdp import GradientReduce
    from ragged_fsdp.fsdp import FSDPModule
    from ragged_fsdp.quant.grad_wire import wire_blocks, wire_bytes

    total = 0
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        for buf in m.dbuffers:
            if mode is None:
                total += (world - 1) * buf.segment * 4
            else:
                fmt = GradientReduce(_WIRE[mode[0]], error_feedback=mode[1])
                total += wire_bytes(wire_blocks(buf.layout), fmt, dist.get_rank())[0]
    return total


def _batch(step: int, world: int, rank: int):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 512, (2 * world, 33), generator=g)
    # a learnable signal: the next token is the current one plus one (mod vocab), half the time
    tokens[:, 1::2] = (tokens[:, 0:-1:2] + 1) % 512
    t = tokens[2 * rank:2 * rank + 2]
    return t[:, :-1], t[:, 1:]


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def run(steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    rows, ref_grads = {}, None
    for name, mode in MODES.items():
        model = _wrap(mode, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for step in range(steps):
            t, y = _batch(step, world, rank)
            loss = model.loss(t, y)
            loss.backward()
            if step == 0:
                grads = {n: _full(p.grad).float() for n, p in model.named_parameters()}
                if ref_grads is None:
                    ref_grads = grads
                num = sum(((grads[n] - ref_grads[n]) ** 2).sum() for n in grads)
                den = sum((ref_grads[n] ** 2).sum() for n in grads)
                grad_err = float((num / den).sqrt())
            opt.step()
            opt.zero_grad()
            lt = loss.detach().clone()
            dist.all_reduce(lt)
            losses.append(lt.item() / world)
        # FSDP2's modules are not ours: its bf16 reduce-scatter moves the same elements in 2
        # bytes (its per-parameter dim-0 padding is not counted)
        sent = rows["fp32 reduce"]["bytes_sent"] // 2 if mode == "fsdp2" else _bytes_sent(model, mode, world)
        rows[name] = {"bytes_sent": sent, "grad_rel_err": grad_err, "final_loss": sum(losses[-10:]) / 10,
                      "losses": losses}
    base = rows["fp32 reduce"]
    for r in rows.values():
        r["bytes_vs_fp32"] = r["bytes_sent"] / base["bytes_sent"]
        r["final_loss_vs_fp32"] = r["final_loss"] / base["final_loss"] - 1.0
    return {"world": world, "steps": steps, "torch": torch.__version__, "rows": rows}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: must be >= 1")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    out = run(args.steps)
    if dist.get_rank() == 0:
        print(f"W={out['world']}, {out['steps']} steps (final loss: mean of the last 10)")
        print(f"{'mode':34s} {'bytes/rank/step':>16s} {'vs fp32':>8s} {'grad rel err':>13s} "
              f"{'final loss':>11s} {'vs fp32':>9s}")
        for name, r in out["rows"].items():
            print(f"{name:34s} {r['bytes_sent']:16,d} {r['bytes_vs_fp32']:8.3f} {r['grad_rel_err']:13.2e} "
                  f"{r['final_loss']:11.4f} {100 * r['final_loss_vs_fp32']:+8.2f}%")
        if args.json:
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
