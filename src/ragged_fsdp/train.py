"""The demo: train the reference LLaMA-style model on CPU ranks with ragged_fsdp, then the
same run with torch's FSDP2, and compare. Launched by ``python -m ragged_fsdp demo``
(which calls torchrun); run directly with ``torchrun --nproc_per_node 2 -m ragged_fsdp.train``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from .data import VOCAB_SIZE, Batches, load_tokens


@dataclass
class TrainConfig:
    steps: int = 300
    seq_len: int = 128
    global_batch: int = 16
    lr: float = 3e-3
    warmup: int = 20
    dim: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    hidden: int = 352
    optimizer: str = "adamw"
    data: str | None = None
    out: str = "out/demo"
    seed: int = 0
    heldout: float = 0.0  # >0: train on the first 1-heldout of the tokens, report the loss on the rest
    frameworks: tuple[str, ...] = field(default_factory=lambda: ("ragged_fsdp", "fsdp2"))


def build_model(cfg: TrainConfig) -> torch.nn.Module:
    from .models.llama import Llama, LlamaConfig

    mcfg = LlamaConfig(
        vocab_size=VOCAB_SIZE, dim=cfg.dim, n_layers=cfg.layers, n_heads=cfg.heads,
        n_kv_heads=cfg.kv_heads, ffn_hidden=cfg.hidden, max_seq_len=cfg.seq_len,
    )
    torch.manual_seed(cfg.seed)
    return Llama(mcfg)


def shard(model: torch.nn.Module, framework: str, mesh, granularity_fn=None) -> torch.nn.Module:
    """Wrap each transformer block, then the root, as FSDP users do. ``ragged_fsdp:bf16``
    computes in bf16 (fp32 reduction); ``ragged_fsdp:fp8`` also gathers weights as block fp8."""
    framework, _, variant = framework.partition(":")
    if framework == "ragged_fsdp":
        from . import BlockFP8, fully_shard

        kw = {"granularity_fn": granularity_fn} if granularity_fn else {}
        if variant in ("bf16", "fp8"):
            from torch.distributed.fsdp import MixedPrecisionPolicy

            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if variant == "fp8":
            kw["all_gather_quant"] = BlockFP8()
        elif variant not in ("", "bf16"):
            raise ValueError(f"framework ragged_fsdp:{variant}: expected ragged_fsdp, ragged_fsdp:bf16 or ragged_fsdp:fp8")
    elif framework == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        kw = {}
    else:
        raise ValueError(f"framework={framework!r}: expected 'ragged_fsdp' or 'fsdp2'")
    for block in model.layers:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def build_optimizer(name: str, model: torch.nn.Module, lr: float, framework: str = "fsdp2"):
    from . import optim as ropt

    if name == "adamw":
        if framework == "ragged_fsdp":  # grouped steps over the flat segments, torch's arithmetic
            return ropt.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95), foreach=True)

    if name == "adamw8bit":
        return ropt.AdamW8bit(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    if name == "muon":
        groups = ropt.muon_param_groups(
            model, muon={"lr": lr, "adjust_lr_fn": "match_rms_adamw"},
            adamw={"lr": lr, "betas": (0.9, 0.95), "weight_decay": 0.1},  # as the adamw run
        )
        return ropt.Muon(groups, lr=lr, weight_decay=0.1)
    if name == "shampoo":
        return ropt.Shampoo(list(model.named_parameters()), lr=lr, **SHAMPOO_DEMO)
    raise ValueError(f"--optimizer {name!r}: expected adamw, adamw8bit, muon or shampoo")


# The demo's Shampoo: 128 x 128 tiles (the demo matrices are 128 and 352 wide), roots every
# 10 steps from step 20 (after the warmup), AdamW's betas and weight decay for the rest.
SHAMPOO_DEMO = dict(betas=(0.9, 0.95), epsilon=1e-12, weight_decay=0.1, max_preconditioner_dim=128,
                    precondition_frequency=10, start_preconditioning_step=20, grafting_type="adam",
                    grafting_beta2=0.95, grafting_epsilon=1e-8)


def granularity_for(name: str, model: torch.nn.Module):
    """What the optimizer needs kept whole; built from the unwrapped model."""
    if name == "adamw":
        return None
    from . import optim as ropt

    if name == "adamw8bit":
        return ropt.AdamW8bit.granularity
    if name == "shampoo":  # every preconditioner tile whole on one rank
        return ropt.Shampoo.granularity_for(max_preconditioner_dim=SHAMPOO_DEMO["max_preconditioner_dim"])
    # Muon's hidden matrices whole; embeddings, head and norms (plain AdamW) unconstrained.
    return ropt.combined_granularity(model, other=lambda name, param: None)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def train_one(cfg: TrainConfig, framework: str, mesh, batches: Batches, heldout: Batches | None = None) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(cfg)
    granularity = granularity_for(cfg.optimizer, model) if framework.startswith("ragged_fsdp") else None
    model = shard(model, framework, mesh, granularity)
    opt = build_optimizer(cfg.optimizer, model, cfg.lr, framework)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup))
    tokens_per_step = cfg.global_batch * cfg.seq_len
    losses, times = [], []
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, desc=f"{framework:>11}", dynamic_ncols=True)

    def step(i: int) -> float:
        x, y = batches.local_batch_at(i, rank, world)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        out = loss.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.AVG)
        return out.item()

    for i in range(cfg.steps):
        t0 = time.perf_counter()
        loss = step(i)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / times[-1]:,.0f}", rss_mib=f"{_rss_mib():.0f}")
            bar.update()
    if bar is not None:
        bar.close()
    peak = _peak_tracked_bytes(lambda: step(cfg.steps), model, opt)
    # one block's unsharded parameters (global numel of the sharded ones): the size of what
    # FSDP2 copies out of its all-gather buffer per block, and of the gradients it copies in
    block_bytes = sum(p.numel() * p.element_size() for p in model.layers[0].parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out = {"framework": framework, "losses": losses, "step_s_median": statistics.median(times[5:] or times),
           "peak_tracked_bytes": peak, "block_param_bytes": block_bytes, "model_param_bytes": model_bytes}
    if heldout is not None:
        out["heldout_loss"] = _heldout_loss(model, heldout, rank, world)
        out["heldout_loss_bf16_masters"] = _heldout_loss_plain(cfg, model, heldout)
    return out


@torch.no_grad()
def _heldout_loss(model, batches: Batches, rank: int, world: int, n: int = 8) -> float:
    """Mean loss over ``n`` fixed global batches of the held-out tokens."""
    total = torch.zeros(())
    for i in range(n):
        x, y = batches.local_batch_at(i, rank, world)
        logits = model(x)
        total += F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
    dist.all_reduce(total, op=dist.ReduceOp.AVG)
    return total.item() / n


@torch.no_grad()
def _heldout_loss_plain(cfg: TrainConfig, model, batches: Batches, n: int = 8) -> float:
    """The same held-out loss from the trained (full-precision) weights copied into a plain
    bf16 model, the same way for every framework: what training produced, apart from how
    the weights are gathered for compute."""
    from torch.distributed.tensor import DTensor

    plain = build_model(cfg).to(torch.bfloat16)
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.named_parameters()}
    for k, p in plain.named_parameters():
        p.copy_(full[k])
    total = 0.0
    for i in range(n):
        x, y = batches.global_batch_at(i)
        total += F.cross_entropy(plain(x).float().reshape(-1, VOCAB_SIZE), y.reshape(-1)).item()
    return total / n


def _peak_tracked_bytes(step_fn, model, opt) -> int:
    """Peak live tensor bytes of one step, from torch's MemTracker."""
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(model, opt)
    with mt:
        step_fn()
    snap = mt.get_tracker_snapshot("peak")
    return int(sum(dev.get("Total", 0) for dev in snap.values()))


# the loss column: the mean over this many last steps (all steps if fewer), with its spread
LAST_N = 50


def loss_summary(losses: list[float], n: int = LAST_N) -> tuple[float, float, int]:
    """(mean, sample standard deviation, steps) of the last ``n`` losses: one step's loss
    moves with its batch by about the standard deviation, so two runs' last steps can differ
    by that much while their curves overlay."""
    tail = losses[-n:]
    return statistics.fmean(tail), (statistics.stdev(tail) if len(tail) > 1 else 0.0), len(tail)


def report(cfg: TrainConfig, results: list[dict]) -> None:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    base = results[-1]
    rows = []
    n = min(LAST_N, cfg.steps)
    for r in results:
        mean, sd, _ = loss_summary(r["losses"], n)
        rows.append((
            r["framework"], f"{r['step_s_median'] * 1e3:.1f}", f"{r['step_s_median'] / base['step_s_median']:.2f}",
            f"{r['peak_tracked_bytes'] / 2**20:.1f}", f"{r['peak_tracked_bytes'] / base['peak_tracked_bytes']:.2f}",
            f"{r['losses'][0]:.3f}", f"{mean:.3f} +- {sd:.3f}",
        ) + ((f"{r['heldout_loss']:.4f}", f"{r['heldout_loss_bf16_masters']:.4f}") if "heldout_loss" in r else ()))
    head = ("framework", "median step ms", f"vs {base['framework']}", "peak tracked MiB",
            f"vs {base['framework']}", "first loss", f"loss, last {n} steps (mean +- sd)") + (
                ("held-out loss", "held-out, masters in bf16") if cfg.heldout else ())
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    print()
    print(line(head))
    for row in rows:
        print(line(row))
    for note in notes(results):
        print(note)
    (out / "results.json").write_text(json.dumps({"config": asdict(cfg), "results": results}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for r in results:
            ax.plot(r["losses"], label=r["framework"], linewidth=1)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (cross-entropy, bytes)")
        ax.set_title(f"LLaMA-style model, {dist.get_world_size()} CPU ranks, {cfg.optimizer}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "loss.png", dpi=120)
        print(f"\nwrote {out / 'loss.png'} and {out / 'results.json'}")
    except ImportError:
        print(f"\nwrote {out / 'results.json'} (install matplotlib for the loss curve)")


def notes(results: list[dict]) -> list[str]:
    """What the table's loss and memory columns mean, from this run's own numbers."""
    out = []
    if len(results) > 1:
        (ma, sa, n), (mb, _, _) = loss_summary(results[0]["losses"]), loss_summary(results[-1]["losses"])
        out.append(f"\nloss: same model, same batches; {results[0]['framework']} and {results[-1]['framework']} "
                   f"differ only by float rounding in the gradient reductions. Their means over the last {n} steps "
                   f"differ by {abs(ma - mb):.4f}; one run's loss moves by about {sa:.4f} (sd) from step to step, "
                   "so a single step's loss is not a comparison (the curves in loss.png overlay)")
    r = results[0]
    if "block_param_bytes" in r:
        mib = 2**20
        out.append(
            f"memory: the model's parameters are {r['model_param_bytes'] / mib:.2f} MiB in all (one block "
            f"{r['block_param_bytes'] / mib:.2f} MiB) against a peak of {r['peak_tracked_bytes'] / mib:.1f} MiB, "
            "most of it activations. ragged_fsdp saves FSDP2's copies of a block's parameters and gradients "
            "around its collectives, a few percent of this peak, so the ratio stays near 1.00 here; the "
            "README's 0.905x is `bench`'s dense-1024 workload (dim 1024, one sequence of 32 tokens), where a "
            "block's parameters are large against the activations")
    return out


def check_args(steps: int, batch: int, world: int) -> str | None:
    """Why the demo cannot run with these settings, or None (pure; also used by the CLI)."""
    if world < 1:
        return f"--nproc {world}: need at least one rank"
    if steps < 1:
        return f"--steps {steps}: need at least one training step"
    if batch < 1:
        return f"--batch {batch}: need at least one sequence per step"
    if batch % world:
        lo, hi = batch // world * world, -(-batch // world) * world
        near = " or ".join(str(b) for b in (lo, hi) if b > 0)
        return (f"--batch {batch} does not split evenly over {world} ranks (every rank trains on "
                f"batch/ranks sequences); use --batch {near}")
    return None


# data.load_tokens refuses fewer bytes than this (the windows need room); checked here too so
# that the refusal comes before the ranks start.
MIN_DATA_BYTES = 1024


def check_data(path: str | None) -> str | None:
    """Why ``--data path`` cannot be read as the corpus, or None (the default corpus: None)."""
    if path is None:
        return None
    if not os.path.exists(path):
        return f"--data {path}: no such file; give a text file of at least 1 KiB, or leave --data out for the embedded corpus"
    if os.path.isdir(path):
        return f"--data {path}: is a directory; give a text file of at least 1 KiB"
    if not os.access(path, os.R_OK):
        return f"--data {path}: not readable (permissions)"
    size = os.path.getsize(path)
    if size < MIN_DATA_BYTES:
        return f"--data {path}: only {size} bytes; give a text file of at least 1 KiB"
    return None


FRAMEWORKS = ("ragged_fsdp", "ragged_fsdp:bf16", "ragged_fsdp:fp8", "fsdp2")  # what shard() takes


def parse(argv=None) -> TrainConfig:
    d = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch", type=int, default=d.global_batch, help="global batch in sequences")
    p.add_argument("--data", default=None, help="any text file (default: the embedded corpus)")
    p.add_argument("--optimizer", default=d.optimizer, choices=["adamw", "adamw8bit", "muon", "shampoo"])
    p.add_argument("--out", default=d.out)
    p.add_argument("--frameworks", default=",".join(d.frameworks),
                   help="comma list of fsdp2, ragged_fsdp, ragged_fsdp:bf16 (bf16 compute), "
                        "ragged_fsdp:fp8 (bf16 compute, block-fp8 all-gather)")
    p.add_argument("--heldout", type=float, default=d.heldout,
                   help="fraction of the tokens held out of training; report the loss on them (default 0)")
    p.add_argument("--seed", type=int, default=d.seed, help="model init and data order seed (default 0)")
    a = p.parse_args(argv)
    if not 0 <= a.heldout < 1:
        p.error(f"--heldout {a.heldout}: expected a fraction in [0, 1)")
    err = check_args(a.steps, a.batch, int(os.environ.get("WORLD_SIZE", "1"))) or check_data(a.data)
    if err:
        p.error(err)
    bad = [f for f in a.frameworks.split(",") if f not in FRAMEWORKS]
    if bad:  # found now, not after training the frameworks listed before it
        p.error(f"--frameworks {a.frameworks}: unknown {', '.join(map(repr, bad))}; "
                f"expected a comma list of {', '.join(FRAMEWORKS)}")
    if a.optimizer == "shampoo" and "fsdp2" in a.frameworks.split(","):
        # FSDP2's equal row chunks cut preconditioner tiles, which Shampoo refuses (it would
        # change the math); the demo trains ragged_fsdp only.
        if os.environ.get("RANK", "0") == "0":
            print("demo: --optimizer shampoo runs ragged_fsdp only (FSDP2's Shard(0) chunks cut Shampoo's tiles)")
        a.frameworks = ",".join(f for f in a.frameworks.split(",") if f != "fsdp2") or "ragged_fsdp"
    return TrainConfig(steps=a.steps, global_batch=a.batch, data=a.data, optimizer=a.optimizer, out=a.out,
                       frameworks=tuple(a.frameworks.split(",")), heldout=a.heldout, seed=a.seed)


def main(argv=None) -> None:
    cfg = parse(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    tokens = load_tokens(cfg.data)
    heldout = None
    if cfg.heldout:
        cut = int(tokens.numel() * (1 - cfg.heldout))
        tokens, rest = tokens[:cut], tokens[cut:]
        heldout = Batches(rest, cfg.seq_len, cfg.global_batch, cfg.seed + 1)
    batches = Batches(tokens, cfg.seq_len, cfg.global_batch, cfg.seed)
    results = [train_one(cfg, fw, mesh, batches, heldout) for fw in cfg.frameworks]
    if dist.get_rank() == 0:
        report(cfg, results)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
