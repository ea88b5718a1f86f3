"""MXFP8 all-gather against FSDP2 + torchao's MXFP8 training recipe, side by side.

    torchrun --nproc_per_node 2 benchmarks/mxfp8_allgather.py --json out.json [--png curves.png]

One launch, gloo CPU ranks; three frameworks train the same model from the same init on the
same batches (byte windows of the demo corpus, global batch 8 x 32 at every W), one step
each in turn (alternating), ``reshard_after_forward=True``, bf16
compute, fp32 reduction, AdamW:

* ``ragged_fsdp:mxfp8``: ``fully_shard(all_gather_quant=MXFP8(param_filter=...))``, the
  linear weights (not the output head, as torchtitan's MXFP8 filter leaves it out; fused
  experts included) gathered as MXFP8, one plane per gather;
* ``fsdp2:torchao-mxfp8``: torch's ``fully_shard`` on a model converted by torchao's
  ``MXFP8TrainingOpConfig`` (recipe ``mxfp8_emulated_rceil``: the emulated kernels, which run
  on CPU) for the same linears; its FSDP hook gathers the weight in ``param_dtype`` and
  quantises after the gather, in every matmul;
* ``ragged_fsdp:nvfp4``: ``fully_shard(all_gather_quant=NVFP4(param_filter=...))``, the same
  linears (fused experts included) gathered as NVFP4;
* ``ragged_fsdp:bf16``: no quantisation, the bf16 baseline for the losses.

Bytes per step: what every all-gather writes on this rank (own share included), counted
at the collective (``all_gather_single`` / ``all_gather_into_tensor`` wrapped), medians over
the steps. Losses: the global mean loss per step. Peak memory: after the training steps
(warm-up), ``--peak-steps`` more steps (forward, backward, optimizer step, zero_grad), the
frameworks in turn, each under torch's MemTracker with the model and the optimizer tracked
(the bench's ``peak_composition``): the peak live tensor bytes of each rank in each step
and what was live at that peak, by MemTracker's reference type (Parameter, Buffer, Gradient,
Optstate, Activation, Temp, Other); all kept, the largest over steps and ranks reported with
its composition.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

FRAMEWORKS = ("ragged_fsdp:mxfp8", "fsdp2:torchao-mxfp8", "ragged_fsdp:nvfp4", "ragged_fsdp:bf16")
_count = [0]


def _counting(fn):
    def wrapped(out, inp, *a, **kw):
        _count[0] += out.numel() * out.element_size()
        return fn(out, inp, *a, **kw)
    return wrapped


def _install_counters():
    # Before ragged_fsdp is imported: ragged_fsdp.comm binds dist's all-gather at its import and
    # every engine module takes it from there; torch's FSDP2 looks dist's up at each call.
    for name in ("all_gather_single", "all_gather_into_tensor"):
        if getattr(dist, name, None) is not None:
            setattr(dist, name, _counting(getattr(dist, name)))


_install_counters()

from ragged_fsdp import MXFP8, NVFP4  # noqa: E402
# the bench's own MemTracker peak, so this peak means what the bench's tables mean
from ragged_fsdp.bench.engine import peak_composition
from ragged_fsdp.data import VOCAB_SIZE, Batches, load_tokens
from ragged_fsdp import fully_shard as ragged_shard
from ragged_fsdp.models import Llama, LlamaConfig
from ragged_fsdp.models.moe import MoE, MoEConfig


def _linear_filter(name: str, p: torch.Tensor) -> bool:
    # torchtitan's MXFP8 filter: not the output head, both dims multiples of 32 (torchao's
    # kernels need it: the router's 4-expert gate is left out)
    return (not name.startswith("output") and "embeddings" not in name and p.dim() >= 2
            and p.shape[-1] % 32 == 0 and p.shape[-2] % 32 == 0)


def build(model_name: str):
    torch.manual_seed(0)
    if model_name == "llama":
        return Llama(LlamaConfig.tiny(dim=128, n_heads=4, ffn_hidden=352, vocab_size=VOCAB_SIZE, max_seq_len=32))
    return MoE(MoEConfig.tiny(dim=64, n_heads=4, ffn_hidden=128, expert_hidden=96, n_experts=4, top_k=2,
                              fused_experts=True, vocab_size=VOCAB_SIZE, max_seq_len=32))


def wrap(fw: str, model, mesh):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if fw.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
        from torchao.quantization import quantize_

        cfg = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)
        quantize_(model, cfg, filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and _linear_filter(fqn, m.weight))
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        return model
    q = {"mxfp8": MXFP8(scaling="rceil", param_filter=_linear_filter),
         "nvfp4": NVFP4(param_filter=_linear_filter)}.get(fw.split(":")[1])
    for block in model.layers:
        ragged_shard(block, mesh=mesh, mp_policy=mp, all_gather_quant=q, reshard_after_forward=True)
    ragged_shard(model, mesh=mesh, mp_policy=mp, all_gather_quant=q, reshard_after_forward=True)
    return model


def run(model_name: str, steps: int, peak_steps: int = 3, seed: int = 0) -> dict:
    W, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (W,))
    models = {fw: wrap(fw, build(model_name), mesh) for fw in FRAMEWORKS}
    opts = {fw: torch.optim.AdamW(m.parameters(), lr=3e-3) for fw, m in models.items()}
    numel = sum(p.numel() for p in build(model_name).parameters())
    out = {fw: {"bytes": [], "loss": []} for fw in FRAMEWORKS}
    batches = Batches(load_tokens(), seq_len=32, global_batch=8, seed=seed)
    for step in range(steps):
        x, y = batches.local_batch_at(step, rank, W)
        for fw in FRAMEWORKS:  # alternating: each framework one step in turn
            m, opt = models[fw], opts[fw]
            _count[0] = 0
            loss = m.loss(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach().float().clone()
            dist.all_reduce(total)
            out[fw]["bytes"].append(_count[0])
            out[fw]["loss"].append(total.item() / W)
    res = {"model": model_name, "world": W, "params": numel, "steps": steps}
    for fw in FRAMEWORKS:
        res[fw] = {"bytes_per_step": statistics.median(out[fw]["bytes"]), "loss": out[fw]["loss"],
                   "final_loss_mean10": statistics.fmean(out[fw]["loss"][-10:])}
    # Peak memory: after the steps above (warm-up), peak_steps more steps under MemTracker, the
    # frameworks again in turn. Repeated because FSDP2's peak was seen to differ between two
    # launches of the same command; the largest over steps and ranks is reported, all kept.
    for fw in FRAMEWORKS:
        res[fw]["peak_composition_by_step_rank"] = []
    for k in range(peak_steps):
        x, y = batches.local_batch_at(steps + k, rank, W)
        for fw in FRAMEWORKS:
            m, opt = models[fw], opts[fw]

            def step(m=m, opt=opt):
                m.loss(x, y).backward()
                opt.step()
                opt.zero_grad()

            comp = peak_composition(step, m, opt)
            by_rank: list = [None] * W
            dist.all_gather_object(by_rank, comp)
            res[fw]["peak_composition_by_step_rank"].append(by_rank)
    for fw in FRAMEWORKS:
        every = [(c["Total"], k, r) for k, row in enumerate(res[fw]["peak_composition_by_step_rank"])
                 for r, c in enumerate(row)]
        total, k, r = max(every)
        res[fw]["peak_bytes_max_rank"] = total
        res[fw]["peak_at"] = {"step": k, "rank": r}
        res[fw]["peak_composition"] = res[fw]["peak_composition_by_step_rank"][k][r]
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama,moe")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--peak-steps", type=int, default=3, help="steps measured by MemTracker after --steps")
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None, help="loss curves (rank 0)")
    a = p.parse_args(argv)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rows = [run(m, a.steps, a.peak_steps) for m in a.models.split(",")]
    if dist.get_rank() == 0:
        for r in rows:
            base = r["ragged_fsdp:bf16"]["bytes_per_step"]
            for fw in FRAMEWORKS:
                b = r[fw]["bytes_per_step"]
                pk = r[fw]["peak_bytes_max_rank"] / r["fsdp2:torchao-mxfp8"]["peak_bytes_max_rank"]
                print(f"{r['model']:<6} W={r['world']} {fw:<22} {b / 2**20:8.3f} MiB/step  "
                      f"{b / base:5.2f} x bf16  loss(last 10) {r[fw]['final_loss_mean10']:.4f}  "
                      f"peak {r[fw]['peak_bytes_max_rank'] / 2**20:.3f} MiB {pk:.2f} x torchao's")
                comp = {k: round(v / 2**20, 3) for k, v in r[fw]["peak_composition"].items() if v}
                every = [[round(c["Total"] / 2**20, 3) for c in row] for row in r[fw]["peak_composition_by_step_rank"]]
                print(f"{'':<6}   at peak (MiB): {comp}; by step, rank: {every}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
        if a.png:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4))
            for ax, r in zip(axes if len(rows) > 1 else [axes], rows):
                for fw in FRAMEWORKS:
                    ax.plot(r[fw]["loss"], label=fw)
                ax.set_title(f"{r['model']} W={r['world']}")
                ax.set_xlabel("step")
                ax.set_ylabel("loss")
                ax.legend()
            fig.tight_layout()
            fig.savefig(a.png)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
