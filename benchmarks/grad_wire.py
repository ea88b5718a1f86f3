"""Gradient reduction in fewer bytes (``fully_shard(gradient_reduce=...)``) against fp32
reduction and FSDP2's ``reduce_dtype=bf16``, side by side in one launch::

    python benchmarks/grad_wire.py --model demo --world 4 --steps 300 --grad-error \\
        --json docs/data/grad_wire_demo_w4.json --png out/grad_wire_demo_w4.png

(``--world N`` starts ``N`` CPU ranks through torchrun; under torchrun, leave it out.)
Per mode, from the same seed and the same batches: the bytes each rank sends per step for
the gradient reduction (the wire codes and scales, or what a ring reduce-scatter sends),
the first step's gradient error against fp32 reduction (same weights, same local gradients:
the error is the reduction's alone), the gradient error of every step against the exact
fp32 mean of that step's own local gradients and the accumulated error
``||sum_t (g_t - g_fp32_t)||`` (``--grad-error``; wire modes only), and the loss curve.

Models (``--model``):

* ``small``: a Llama of vocab 512, dim 128, 4 layers on synthetic tokens (batch 2 per rank),
  torch AdamW at lr 3e-3 (the first table of docs/gradient-reduce.md);
* ``demo``: ``python -m ragged_fsdp demo``'s model and recipe (byte-level Llama, dim 128,
  4 layers, hidden 352, on the embedded corpus; AdamW lr 3e-3, betas (0.9, 0.95), weight
  decay 0.1, 20 warmup steps, gradient clipping at 1.0), global batch ``--batch`` (default
  12, a multiple of 2, 3 and 4, so every world size sees the same global batches);
* ``moe``: the MoE bench model of ``bench.engine`` (dim 128, 4 layers, 32 fused experts,
  top-2, expert hidden 128) with the byte vocab, under the demo's recipe.

``--dim``, ``--layers``, ``--hidden``, ``--experts`` and ``--seq-len`` shrink a model (the
docs say when they did). With error feedback a row also has the residual's bytes on a rank,
read from the engine's storage.

A scaled wire mode with the suffix ``-b<N>`` (``int8-ef-b32``) runs with
``GradientReduce(block_size=N)``; without it, the default block size (128).

``--seeds A-B`` runs every mode once per seed (weights and batches) in one launch and writes
the runs and, per mode, the mean and standard error over the seeds of its final loss (and
its last-50-step mean) against fp32 reduction of the same seed: one run's final loss is
chaotic at these sizes, a mean over seeds is what a difference of 1% can be read from.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor. is deprecated")

# key -> (table name, wire spec): None = fp32 reduce-scatter, "fsdp2" = torch FSDP2 bf16; a
# wire spec is (wire, error feedback, residual storage: None = GradientReduce's default) and,
# for a key with the suffix -b<N> (any wire mode: int8-ef-b32), N elements per scale block
# (the block size of GradientReduce's default otherwise)
MODES = {
    "fp32": ("fp32 reduce", None),
    "bf16": ("bf16 wire, fp32 sum", ("bf16", False, None)),
    "int8": ("int8 + scale", ("int8", False, None)),
    "int8-ef": ("int8 + scale, error feedback", ("int8", True, None)),
    "fp8": ("fp8 e4m3 + scale", ("fp8", False, None)),
    "fp8-ef": ("fp8 e4m3 + scale, error feedback", ("fp8", True, None)),
    "fsdp2": ("FSDP2 reduce_dtype=bf16", "fsdp2"),
    # the control: fp32 reduction in another engine (the sum's order differs, nothing else)
    # shows how far two runs drift apart from rounding differences of fp32 size alone
    "fsdp2-fp32": ("FSDP2 reduce_dtype=fp32 (control)", "fsdp2-fp32"),
    # error feedback's residual stored other than by default (the residual-storage table)
    "int8-ef-bf16r": ("int8 + scale, error feedback, bf16 residual", ("int8", True, "bf16")),
    "int8-ef-fp32r": ("int8 + scale, error feedback, fp32 residual", ("int8", True, "fp32")),
    "fp8-ef-fp32r": ("fp8 e4m3 + scale, error feedback, fp32 residual", ("fp8", True, "fp32")),
}
DEFAULT_MODES = ("fp32", "bf16", "int8", "int8-ef", "fp8", "fp8-ef", "fsdp2")
BLOCK_SUFFIX_EXAMPLES = ("int8-ef-b32", "int8-ef-b64")


def mode_of(key: str):
    """``(table name, wire spec)`` of a mode key, ``-b<N>`` suffixes included; None if unknown."""
    if key in MODES:
        return MODES[key]
    base, sep, n = key.rpartition("-b")
    if not sep or not n.isdigit() or str(int(n)) != n or int(n) < 1 or base not in MODES:
        return None
    name, spec = MODES[base]
    if not isinstance(spec, tuple) or spec[0] == "bf16":  # only the scaled wires have blocks
        return None
    return f"{name}, {int(n)}-element blocks", (*spec, int(n))
_WIRE = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}
MODELS = ("small", "demo", "moe")


def _fmt(mode):
    from ragged_fsdp import GradientReduce

    wire, ef, res, *block = mode
    kw = {"block_size": block[0]} if block else {}
    return GradientReduce(_WIRE[wire], error_feedback=ef, residual_dtype=None if res is None else _WIRE[res], **kw)


def _model(args):
    torch.manual_seed(args.seed)
    if args.model == "small":
        from ragged_fsdp.models.llama import Llama, LlamaConfig

        return Llama(LlamaConfig(vocab_size=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=256,
                                 max_seq_len=64))
    from ragged_fsdp.data import VOCAB_SIZE

    if args.model == "demo":
        from ragged_fsdp.models.llama import Llama, LlamaConfig

        return Llama(LlamaConfig(vocab_size=VOCAB_SIZE, dim=args.dim or 128, n_layers=args.layers or 4, n_heads=4,
                                 n_kv_heads=2, ffn_hidden=args.hidden or 352, max_seq_len=args.seq_len))
    from ragged_fsdp.models.moe import MoE, MoEConfig

    return MoE(MoEConfig(vocab_size=VOCAB_SIZE, dim=args.dim or 128, n_layers=args.layers or 4, n_heads=4,
                         n_kv_heads=2, n_experts=args.experts or 32, top_k=2, expert_hidden=args.hidden or 128,
                         max_seq_len=args.seq_len, fused_experts=True))


def _wrap(args, mode, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from ragged_fsdp.fsdp import fully_shard

    m = _model(args)
    if mode in ("fsdp2", "fsdp2-fp32"):
        mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if mode == "fsdp2" else torch.float32)
        for b in m.layers:
            torch_fully_shard(b, mesh=mesh, mp_policy=mp)
        return torch_fully_shard(m, mesh=mesh, mp_policy=mp)
    kw = {} if mode is None else {"gradient_reduce": _fmt(mode)}
    for b in m.layers:
        fully_shard(b, mesh=mesh, **kw)
    return fully_shard(m, mesh=mesh, **kw)


def _bytes_sent(model, mode, world: int) -> int:
    """Bytes one rank sends per step for the gradient reduction (codes + scales for the
    wire formats; a ring reduce-scatter's (W-1)/W of the buffer otherwise)."""
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
                fmt = _fmt(mode)
                total += wire_bytes(wire_blocks(buf.layout, fmt.block_size), fmt, dist.get_rank())[0]
    return total


def _residual_bytes(model) -> int:
    """Bytes of error-feedback residual this rank holds (every wire state's storage)."""
    from ragged_fsdp.fsdp import FSDPModule

    total = 0
    for m in model.modules():
        g = m._fsdp_state().group if isinstance(m, FSDPModule) else None
        if g is not None:
            for unit in g.units:
                st = unit.wire
                if st is not None and st.residual is not None:
                    total += st.residual.nbytes
    return total


class _Batches:
    """The model's batches: step ``i``'s global batch, rank ``r``'s rows of it."""

    def __init__(self, args, world: int):
        self.args, self.world = args, world
        if args.model != "small":
            from ragged_fsdp.data import Batches, load_tokens

            self.corpus = Batches(load_tokens(None), args.seq_len, args.batch, seed=args.seed)

    def local(self, step: int, rank: int):
        if self.args.model != "small":
            return self.corpus.local_batch_at(step, rank, self.world)
        g = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, 512, (2 * self.world, 33), generator=g)
        # a learnable signal: the next token is the current one plus one (mod vocab), half the time
        tokens[:, 1::2] = (tokens[:, 0:-1:2] + 1) % 512
        t = tokens[2 * rank:2 * rank + 2]
        return t[:, :-1], t[:, 1:]


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


class _ErrorProbe:
    """Per step, each wire reduction's result against the exact fp32 mean of the same local
    gradients (an extra fp32 reduce-scatter of the buffer the wire reduction got), and the
    running sum of the differences: with error feedback that sum stays bounded (it is the
    mean of the ranks' residuals), without it it grows with the steps. A bench probe: it
    wraps the engine's wire reduction (the public probe point ``wire_reduce_scatter``) and
    waits for each one."""

    def __init__(self):
        self.sq_err = self.sq_ref = 0.0
        self.acc: dict[int, torch.Tensor] = {}
        self.acc_ref: dict[int, torch.Tensor] = {}
        self.per_step, self.accumulated, self.accumulated_ref = [], [], []

    def __enter__(self):
        from ragged_fsdp.device import Pending
        from ragged_fsdp.fsdp import probe as engine_probe

        probe = self

        def wrap(point, orig):
            def wrapped(dev, comm, grad, target, accumulate, factor, state, *a, **k):
                W = comm.world_size
                exact = torch.empty(target.numel(), dtype=torch.float32)
                dist.reduce_scatter_tensor(exact, grad.float(), group=comm.group)
                exact.mul_(1.0 / float(factor or W))
                got = torch.empty_like(target)
                orig(dev, comm, grad, got, False, factor, state, *a, **k).wait()
                d = got.float() - exact
                probe.sq_err += float((d * d).sum())
                probe.sq_ref += float((exact * exact).sum())
                key = id(state)
                if key not in probe.acc:
                    probe.acc[key], probe.acc_ref[key] = torch.zeros_like(d), torch.zeros_like(d)
                probe.acc[key] += d
                probe.acc_ref[key] += exact
                target.add_(got) if accumulate else target.copy_(got)
                return Pending()  # finished: nothing left to wait for

            return wrapped

        self._probe = engine_probe(wrap, ["wire_reduce_scatter"])
        self._probe.__enter__()
        return self

    def __exit__(self, *exc):
        return self._probe.__exit__(*(exc or (None, None, None)))

    def end_step(self) -> None:
        t = torch.tensor([self.sq_err, self.sq_ref,
                          sum(float((a * a).sum()) for a in self.acc.values()),
                          sum(float((a * a).sum()) for a in self.acc_ref.values())], dtype=torch.float64)
        dist.all_reduce(t)
        self.per_step.append(float((t[0] / t[1]).sqrt()) if t[1] > 0 else 0.0)
        self.accumulated.append(float(t[2].sqrt()))
        self.accumulated_ref.append(float(t[3].sqrt()))
        self.sq_err = self.sq_ref = 0.0


def recipe(args, model):
    """The optimizer and lr schedule a bench model trains with (schedule None for ``small``)."""
    if args.model == "small":
        return torch.optim.AdamW(model.parameters(), lr=3e-3), None
    # the demo's recipe (ragged_fsdp.train)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), foreach=True)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))


def _train(args, name, mode, mesh, batches, ref_grads):
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _wrap(args, mode, mesh)
    opt, sched = recipe(args, model)
    probe = _ErrorProbe() if (args.grad_error and isinstance(mode, tuple)) else None
    losses, grad_err = [], None
    if probe is not None:
        probe.__enter__()
    try:
        for step in range(args.steps):
            t, y = batches.local(step, rank)
            loss = model.loss(t, y)
            loss.backward()
            if probe is not None:
                probe.end_step()
            if step == 0:
                grads = {n: _full(p.grad).float() for n, p in model.named_parameters()}
                if ref_grads is None:
                    ref_grads = grads
                num = sum(((grads[n] - ref_grads[n]) ** 2).sum() for n in grads)
                den = sum((ref_grads[n] ** 2).sum() for n in grads)
                grad_err = float((num / den).sqrt())
            if sched is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if sched is not None:
                sched.step()
            opt.zero_grad()
            lt = loss.detach().clone()
            dist.all_reduce(lt)
            losses.append(lt.item() / world)
            if rank == 0 and args.progress and (step + 1) % args.progress == 0:
                print(f"  {name}: step {step + 1}/{args.steps} loss {losses[-1]:.4f}", flush=True)
    finally:
        if probe is not None:
            probe.__exit__()
    row = {"grad_rel_err": grad_err, "final_loss": sum(losses[-10:]) / min(10, len(losses)), "losses": losses,
           "_model": model}
    if probe is not None:
        row["grad_rel_err_per_step"] = probe.per_step
        row["grad_rel_err_mean"] = sum(probe.per_step) / max(1, len(probe.per_step))
        row["accumulated_err"] = probe.accumulated
        row["accumulated_ref"] = probe.accumulated_ref
    return row, ref_grads


def run(args) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    batches = _Batches(args, world)
    rows, ref_grads = {}, None
    keys = ["fp32"] + [k for k in args.modes if k != "fp32"]  # fp32 first: the reference
    for key in keys:
        name, mode = mode_of(key)
        row, ref_grads = _train(args, name, mode, mesh, batches, ref_grads)
        model = row.pop("_model")
        # FSDP2's modules are not ours: its bf16 reduce-scatter moves the same elements in 2
        # bytes (its per-parameter dim-0 padding is not counted)
        fp32_bytes = rows["fp32 reduce"]["bytes_sent"] if rows else None
        row["bytes_sent"] = (fp32_bytes // 2 if mode == "fsdp2" else fp32_bytes if mode == "fsdp2-fp32"
                             else _bytes_sent(model, mode, world))
        row["mode"] = key
        if isinstance(mode, tuple) and mode[1]:  # measured from the engine's residual storage
            res = torch.tensor([float(_residual_bytes(model))])
            dist.all_reduce(res, op=dist.ReduceOp.MAX)
            row["residual_bytes"] = int(res.item())
            row["residual_bytes_per_param"] = row["residual_bytes"] / sum(p.numel() for p in model.parameters())
        rows[name] = row
        del model
    base = rows["fp32 reduce"]
    for r in rows.values():
        r["bytes_vs_fp32"] = r["bytes_sent"] / base["bytes_sent"]
        r["final_loss_vs_fp32"] = r["final_loss"] / base["final_loss"] - 1.0
        r["last50_vs_fp32"] = _tail(r["losses"]) / _tail(base["losses"]) - 1.0
    cfg = {k: getattr(args, k) for k in ("model", "steps", "batch", "seq_len", "dim", "layers", "hidden", "experts",
                                         "seed")}
    from ragged_fsdp.bench.meta import run_meta

    return {"meta": run_meta(), "world": world, "steps": args.steps, "config": cfg, "torch": torch.__version__,
            "rows": rows}


def _tail(losses: list[float], n: int = 50) -> float:
    return sum(losses[-n:]) / min(n, len(losses))


# Student's t, two-sided 95%, by degrees of freedom (1..30); beyond, the normal's 1.96 is
# within 2% of it
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The two-sided 95% quantile of Student's t with ``df`` degrees of freedom."""
    return _T975[df - 1] if 1 <= df <= len(_T975) else 1.96


def summarise(runs: list[dict]) -> dict:
    """Per mode over the seeds' runs: mean, standard error of the mean and 95% interval
    (Student's t) of (final loss vs fp32 of the same seed) and (mean of the last 50 steps vs
    fp32), and the mean of |final vs fp32|; fractions, as in the rows."""
    out = {}
    for name in runs[0]["rows"]:
        if name == "fp32 reduce":
            continue
        row = {"mode": runs[0]["rows"][name]["mode"], "seeds": len(runs)}
        for key in ("final_loss_vs_fp32", "last50_vs_fp32"):
            xs = [r["rows"][name][key] for r in runs]
            mean = sum(xs) / len(xs)
            var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) if len(xs) > 1 else 0.0
            sem = (var / len(xs)) ** 0.5
            half = t975(len(xs) - 1) * sem if len(xs) > 1 else float("nan")
            row[key] = {"mean": mean, "sem": sem, "ci95_lo": mean - half, "ci95_hi": mean + half, "per_seed": xs}
        row["abs_final_loss_vs_fp32_mean"] = sum(abs(x) for x in row["final_loss_vs_fp32"]["per_seed"]) / len(runs)
        row["bytes_vs_fp32"] = runs[0]["rows"][name]["bytes_vs_fp32"]
        out[name] = row
    return out


def run_seeds(args, seeds: list[int], path: str | None) -> dict:
    """``run`` once per seed (weights and batches), in one launch; the JSON is rewritten
    after every seed, so a launch cut short keeps the seeds it finished."""
    runs = []
    for seed in seeds:
        args.seed = seed
        out = run(args)
        runs.append(out)
        res = {"meta": out.pop("meta"), "world": out["world"], "steps": args.steps, "seeds": seeds[:len(runs)],
               "config": {**out["config"], "seed": None}, "torch": torch.__version__,
               "summary": summarise(runs), "runs": runs}
        if dist.get_rank() == 0:
            print(f"seed {seed} done", flush=True)
            if path:
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                with open(path, "w") as f:
                    json.dump(res, f, indent=1)
    return res


def _color(key: str) -> int:
    if key in MODES:
        return list(MODES).index(key)
    base, _, n = key.rpartition("-b")
    return (list(MODES).index(base) + len(MODES) + int(n).bit_length()) % 20


def render_png(results: list[dict], path: str, smooth: int = 10) -> None:
    """One column per result (world size): the loss curves (moving mean over ``smooth``
    steps), their difference from fp32 reduction, and, where measured (``--grad-error``),
    the accumulated gradient error ``||sum_t (g_t - g_fp32_t)||`` of the wire modes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def ma(xs):
        out, s = [], 0.0
        for i, x in enumerate(xs):
            s += x
            if i >= smooth:
                s -= xs[i - smooth]
            out.append(s / min(i + 1, smooth))
        return out

    n = len(results)
    probed = any("accumulated_err" in r for res in results for r in res["rows"].values())
    nrows = 3 if probed else 2
    fig, axes = plt.subplots(nrows, n, figsize=(5.2 * n, 3.4 * nrows), squeeze=False, sharex=True)
    for j, res in enumerate(results):
        base = ma(res["rows"]["fp32 reduce"]["losses"])
        for name, r in res["rows"].items():
            curve = ma(r["losses"])
            kw = dict(ls="--" if "FSDP2" in name else "-", label=name, lw=1.1,
                      color=f"C{_color(r.get('mode', 'fp32'))}")
            axes[0][j].plot(curve, **kw)
            axes[1][j].plot([100 * (c / b - 1) for c, b in zip(curve, base)], **kw)
            if probed and "accumulated_err" in r:
                axes[2][j].semilogy(r["accumulated_err"], **kw)
        c = res["config"]
        axes[0][j].set_title(f"{c['model']}, W={res['world']}, {res['steps']} steps")
        axes[0][j].set_ylabel(f"loss (mean of {smooth} steps)")
        axes[1][j].set_ylabel("vs fp32 reduce (%)")
        axes[1][j].axhline(0, color="k", lw=0.6)
        for y in (-1, 1):
            axes[1][j].axhline(y, color="gray", lw=0.6, ls=":")
        if probed:
            axes[2][j].set_ylabel("||sum of gradient errors||")
        axes[-1][j].set_xlabel("step")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=80)


def _parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small", help=f"one of {', '.join(MODELS)} (default small)")
    ap.add_argument("--world", type=int, default=None,
                    help="CPU ranks to start through torchrun (leave out under torchrun)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help=f"comma-separated, from {', '.join(MODES)}; a scaled wire mode with -b<N> uses N-element "
                         f"scale blocks (e.g. {', '.join(BLOCK_SUFFIX_EXAMPLES)}); fp32 always runs: it is the "
                         "reference")
    ap.add_argument("--batch", type=int, default=12, help="global batch in sequences (demo, moe; default 12)")
    ap.add_argument("--seq-len", type=int, default=128, help="sequence length (demo, moe; default 128)")
    ap.add_argument("--dim", type=int, default=None, help="shrink the model: its width")
    ap.add_argument("--layers", type=int, default=None, help="shrink the model: its depth")
    ap.add_argument("--hidden", type=int, default=None, help="shrink the model: FFN (demo) or expert (moe) hidden")
    ap.add_argument("--experts", type=int, default=None, help="shrink the moe model: experts per layer")
    ap.add_argument("--seed", type=int, default=0,
                    help="the weights' seed and (demo, moe) the batches' (default 0)")
    ap.add_argument("--seeds", default=None, metavar="A-B|A,B,...",
                    help="run every mode once per seed in this launch and write, besides the runs, the mean and "
                         "standard error over the seeds of each mode's final loss (and last-50 mean) vs fp32")
    ap.add_argument("--grad-error", action="store_true",
                    help="measure every step's gradient error and the accumulated error (wire modes)")
    ap.add_argument("--progress", type=int, default=0, help="print the loss every N steps")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None, help="plot of the loss curves")
    ap.add_argument("--plot", nargs="+", default=None, metavar="JSON",
                    help="no training: draw the curves of these result files side by side into --png")
    return ap


def _parse_seeds(ap, spec: str) -> list[int]:
    try:
        if "-" in spec:
            a, b = (int(x) for x in spec.split("-"))
            seeds = list(range(a, b + 1))
        else:
            seeds = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--seeds {spec!r}: pass a range A-B or a list A,B,... of integers >= 0")
    if len(seeds) < 2 or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        ap.error(f"--seeds {spec!r}: needs two or more distinct seeds >= 0 (one seed is --seed)")
    return seeds


def check_args(ap, args) -> None:
    if args.model not in MODELS:
        ap.error(f"--model {args.model!r}: choose one of {', '.join(MODELS)}")
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: must be >= 1")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if mode_of(m) is None]
    if bad:
        ap.error(f"--modes: unknown {', '.join(bad)}; choose from {', '.join(MODES)}, or a scaled wire mode with "
                 f"-b<N> for N-element scale blocks ({', '.join(BLOCK_SUFFIX_EXAMPLES)})")
    args.modes = modes
    if args.seed < 0:
        ap.error(f"--seed {args.seed}: must be >= 0")
    if args.seeds is not None:
        args.seeds = _parse_seeds(ap, args.seeds)
    for k in ("world", "dim", "layers", "hidden", "experts"):
        v = getattr(args, k)
        if v is not None and v < 1:
            ap.error(f"--{k} {v}: must be >= 1")
    if args.world is not None and args.batch % args.world and args.model != "small":
        ap.error(f"--batch {args.batch} is not a multiple of --world {args.world}; pass a multiple (12 fits 2, 3, 4)")
    if args.plot and not args.png:
        ap.error("--plot needs --png (where to draw)")


def _print_summary(res: dict) -> None:
    c = res["config"]
    print(f"model={c['model']} W={res['world']}, {res['steps']} steps, seeds {res['seeds']}: vs fp32 of the same "
          "seed, mean +- standard error")
    print(f"{'mode':48s} {'final loss':>18s} {'|final|':>8s} {'last 50':>18s}")
    for name, r in res["summary"].items():
        f, t = r["final_loss_vs_fp32"], r["last50_vs_fp32"]
        print(f"{name:48s} {100 * f['mean']:+8.2f}% +- {100 * f['sem']:4.2f} {100 * r['abs_final_loss_vs_fp32_mean']:7.2f}% "
              f"{100 * t['mean']:+8.2f}% +- {100 * t['sem']:4.2f}")


def main(argv=None) -> None:
    ap = _parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    if args.plot:
        results = []
        for p in args.plot:
            with open(p) as f:
                results.append(json.load(f))
        render_png(results, args.png)
        return
    if "RANK" not in os.environ:  # not under torchrun: start the ranks
        world = args.world or 2
        argv = list(sys.argv[1:] if argv is None else argv)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               os.path.relpath(__file__), *argv]
        sys.exit(subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1")))
    dist.init_process_group("gloo")
    if args.world is not None and args.world != dist.get_world_size():
        raise SystemExit(f"--world {args.world} but torchrun started {dist.get_world_size()} ranks: leave --world out "
                         "under torchrun")
    if args.model != "small" and args.batch % dist.get_world_size():
        raise SystemExit(f"--batch {args.batch} is not a multiple of the {dist.get_world_size()} ranks")
    torch.set_num_threads(1)
    if args.seeds is not None:
        res = run_seeds(args, args.seeds, args.json)
        if dist.get_rank() == 0:
            _print_summary(res)
        dist.barrier()
        dist.destroy_process_group()
        return
    out = run(args)
    if dist.get_rank() == 0:
        c = out["config"]
        print(f"model={c['model']} W={out['world']}, {out['steps']} steps (final loss: mean of the last 10)")
        print(f"{'mode':34s} {'bytes/rank/step':>16s} {'vs fp32':>8s} {'grad rel err':>13s} "
              f"{'final loss':>11s} {'vs fp32':>9s}")
        for name, r in out["rows"].items():
            print(f"{name:34s} {r['bytes_sent']:16,d} {r['bytes_vs_fp32']:8.3f} {r['grad_rel_err']:13.2e} "
                  f"{r['final_loss']:11.4f} {100 * r['final_loss_vs_fp32']:+8.2f}%")
        if args.json:
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        if args.png:
            render_png([out], args.png)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
