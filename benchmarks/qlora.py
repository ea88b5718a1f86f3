"""QLoRA with NF4 base weights: ragged_fsdp against torch's FSDP2 on the same NF4 codes.

    python benchmarks/qlora.py                      # W = 2 and 3, table + docs/data/qlora.json
    python benchmarks/qlora.py --world 2 --json out.json

One gloo launch per world size. The model is the LLaMA-style decoder with every attention
and feed-forward linear a LoRA linear (rank 8, bf16 adapters, fp32 compute) over a frozen NF4
weight quantised by torchao (``to_nf4``, 64-value blocks, scaler blocks of 256). Three runs
on the same batches (the same on every rank): the model in one process (the reference),
ragged_fsdp (the base weights as :class:`~ragged_fsdp.quant.nf4.NF4Weight` adopting torchao's
codes, scalers and factors unchanged) and FSDP2 (``torch.distributed.fsdp.fully_shard`` with
the torchao ``NF4Tensor`` weights as they are). Per run: the losses of each AdamW step, the
bytes every rank receives from all-gathers in one step (ragged_fsdp: its trace;
FSDP2: ``dist.all_gather_single``'s outputs), the peak memory of rank 0 in a step
(``torch.distributed._tools.MemTracker``), and whether the gathered base weights dequantise
to the unsharded weights bit for bit. When FSDP2 fails, the table says how.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

STEPS = 3
LR = 1e-3


def _config():
    from ragged_fsdp.models.llama import LlamaConfig

    # every linear holds a whole number of torchao scaler blocks (64 * 256 values): 256 x 256 is 4
    return LlamaConfig(vocab_size=128, dim=256, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=512, max_seq_len=32)


def _build(kind: str):
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    from ragged_fsdp.models.llama import Llama
    from ragged_fsdp.models.qlora import qlora
    from ragged_fsdp.quant.nf4 import NF4Weight

    torch.manual_seed(0)
    if kind == "torchao":
        make = lambda w: to_nf4(w.detach().float(), 64, 256)  # noqa: E731
    else:
        make = lambda w: NF4Weight.from_torchao(to_nf4(w.detach().float(), 64, 256))  # noqa: E731
    return qlora(Llama(_config()), rank=8, base=make)


def _batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        data = torch.randint(0, _config().vocab_size, (2, 17), generator=g)
        out.append((data[:, :-1], data[:, 1:]))
    return out


def _train(model, gather_bytes):
    """Losses, all-gather bytes of step 0 and the peak memory of step 0 on this rank."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class FrozenAwareTracker(MemTracker):
        # MemTracker hooks every parameter's gradient and fails on frozen ones (the NF4
        # bases); without the hooks it still counts every live tensor, only the gradients'
        # category is lost, and the bench reports the total
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, nbytes, peak = [], None, None
    for step, (tok, tgt) in enumerate(_batches()):
        if step == 0:
            tracker = FrozenAwareTracker()
            tracker.track_external(model, opt)
            with tracker, gather_bytes() as counted:
                loss = model.loss(tok, tgt)
                loss.backward()
                opt.step()
                opt.zero_grad()
            nbytes = counted[0]
            peak = int(sum(v for k, v in tracker.get_tracker_snapshot("peak").get(torch.device("cpu"), {}).items()
                           if k == "Total"))
        else:
            loss = model.loss(tok, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses, nbytes, peak


class _RaggedBytes:
    def __enter__(self):
        from ragged_fsdp.fsdp import trace

        self._ctx = trace()
        self._t = self._ctx.__enter__()
        self.counted = [0]
        return self.counted

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        self.counted[0] = sum(e.bytes for e in self._t.of("all_gather"))


class _TorchBytes:
    def __enter__(self):
        import torch.distributed as dist

        self.counted = [0]
        self._orig = dist.all_gather_single

        def counting(output, input, *a, **k):
            self.counted[0] += output.numel() * output.element_size()
            return self._orig(output, input, *a, **k)

        dist.all_gather_single = counting
        return self.counted

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.all_gather_single = self._orig


def _base_equal(model, ref) -> bool:
    from ragged_fsdp.models.qlora import LoRALinear
    from ragged_fsdp.quant.nf4 import NF4Weight

    ok = True
    for b, rb in zip(model.layers, ref.layers):
        b.unshard()
        for m, rm in zip([m for m in b.modules() if isinstance(m, LoRALinear)],
                         [m for m in rb.modules() if isinstance(m, LoRALinear)]):
            w = m.weight
            got = w.dequantize(torch.float32) if isinstance(w, NF4Weight) else w.get_original_weight()
            ok &= torch.equal(got, rm.weight.dequantize(torch.float32))
        b.reshard()
    return bool(ok)


def _blocks_whole(model) -> bool:
    """Every rank's piece of every 4-bit weight starts and ends on a quantisation block,
    read off the sharded parameters' RaggedShard placements (public: ``DTensor.placements``)."""
    span = 64 * 256
    for b in model.layers:
        for p in b.parameters():
            if not hasattr(p.to_local(), "fsdp_pre_all_gather"):
                continue  # the LoRA adapters: plain tensors
            pl, n = p.placements[0], p.numel()
            for r in range(pl.world_size):
                a, e = pl.element_range(p.shape, r)
                if a != e and (a % span or (e % span and e != n)):
                    return False
    return True


def _worker(rank, world, port, queue):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from ragged_fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (world,))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    out = {"world": world}
    ref = _build("ragged")
    out["reference"] = {"losses": _train(ref, _RaggedBytes)[0]}
    ref_fresh = _build("ragged")

    model = _build("ragged")
    for blk in model.layers:
        fully_shard(blk, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    blocks_whole = _blocks_whole(model)
    losses, nbytes, peak = _train(model, _RaggedBytes)
    out["ragged_fsdp"] = {"losses": losses, "all_gather_bytes": nbytes, "peak_bytes": peak,
                          "blocks_whole": blocks_whole, "base_bitwise": None}
    # bitwise base weights: against a fresh unsharded copy (the base weights never change)
    out["ragged_fsdp"]["base_bitwise"] = _base_equal(model, ref_fresh)

    try:
        tmodel = _build("torchao")
        for blk in tmodel.layers:
            torch_fully_shard(blk, mesh=mesh, mp_policy=mp_policy)
        torch_fully_shard(tmodel, mesh=mesh, mp_policy=mp_policy)
        losses, nbytes, peak = _train(tmodel, _TorchBytes)
        out["fsdp2"] = {"losses": losses, "all_gather_bytes": nbytes, "peak_bytes": peak,
                        "base_bitwise": _base_equal(tmodel, ref_fresh)}
    except Exception as e:  # the comparison's point: report how FSDP2 fails on these weights
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "distributed/fsdp" in f.filename]
        where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].line}" if frames else ""
        out["fsdp2"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", "where": where}
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def run(world: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    res = queue.get(timeout=1200)
    for p in procs:
        p.join(timeout=60)
    return res


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def render(rows: list[dict]) -> str:
    lines = ["| W | run | max rel. loss diff vs 1 process | all-gather bytes / rank / step | peak memory rank 0 (MiB) | base weights bitwise | blocks whole |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = r["reference"]["losses"]
        for name in ("ragged_fsdp", "fsdp2"):
            d = r[name]
            if "error" in d:
                lines.append(f"| {r['world']} | {name} | failed: `{d['error']}` (at `{d['where']}`) | | | | |")
                continue
            lines.append(
                f"| {r['world']} | {name} | {_rel(d['losses'], ref):.2e} | {d['all_gather_bytes']:,} | "
                f"{d['peak_bytes'] / 2**20:.2f} | {d['base_bitwise']} | {d.get('blocks_whole', 'n/a')} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", default="2,3")
    ap.add_argument("--json", default="docs/data/qlora.json")
    args = ap.parse_args(argv)
    try:
        import torchao.quantization.quantize_.workflows.nf4.nf4_tensor  # noqa: F401
    except ImportError:
        print("qlora.py: needs torchao (its NF4Tensor is the weight both frameworks shard): "
              "pip install torch==<your torch> torchao==0.18.0", file=sys.stderr)
        return 2
    rows = [run(int(w)) for w in args.world.split(",")]
    print(render(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": "python benchmarks/qlora.py --world " + args.world,
                                               "steps": STEPS, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
