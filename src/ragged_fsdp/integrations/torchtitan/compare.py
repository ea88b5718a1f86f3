"""torchtitan's FSDP2 and ragged_fsdp trained from one seed checkpoint, step by step.

    python -m ragged_fsdp.integrations.torchtitan.compare --config llama3_debugmodel \\
        --nproc 2 --steps 10

launches ``--nproc`` CPU gloo ranks (torchrun, ragged_fsdp's CPU mode) that write one seed
checkpoint with torchtitan's own ``Trainer`` on FSDP2, train ``--steps`` steps from it with
torchtitan's FSDP2 (the stock config function, ``--module torchtitan.models.<model>``) and
with ragged_fsdp (``--module ragged_fsdp.integrations.torchtitan``, the config function of
the same name), same config, seed, batches and parallelism (``--parallelism.<field> VALUE``,
as on torchtitan's command line), both under the ``partial_dtensor`` SPMD backend, and
prints a table of each step's loss and gradient norm (float64 norm of the full gradients;
torchtitan's logged norm in its own column) with relative differences. ``--json PATH``
writes the same numbers. Without the shared seed the two runs start from different random
weights and differ by a few percent.

The same functions record the runs of ``tests/test_integration_torchtitan*.py``:
:func:`build_config` sizes a torchtitan config for a CPU run, :func:`train` runs it and
records each step's loss, gradient norms, step time and the final parameters,
:func:`compare_runs` bounds the differences of two runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from ragged_fsdp.integrations.torchtitan.assets import make_assets
from ragged_fsdp.integrations.torchtitan.cpu import cpu_defaults, log_on_rank_zero, patch_for_cpu
from ragged_fsdp.integrations.torchtitan.support import torchtitan_missing

__all__ = ["RunResult", "build_config", "train", "registries", "config_pair", "rel", "compare_runs",
           "compare", "format_table", "main"]


# -- one training run ----------------------------------------------------------------------
@dataclass
class RunResult:
    losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)  # what torchtitan logs
    exact_grad_norms: dict[int, float] = field(default_factory=dict)  # float64, of full grads
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    seconds: float = 0.0  # wall time of Trainer.train() after the first step


def build_config(config_fn, *, assets: str, dump: str, steps: int, seq_len: int = 64,
                 batch: int = 2, chunked_loss: bool = True, load_path: str | None = None,
                 model_only: bool = True, save_interval: int | None = None, seed: int = 0,
                 parallelism: dict | None = None, dtype: str = "float32", save: bool = True,
                 n_layers: int | None = None):
    """``config_fn()`` (torchtitan's or ragged_fsdp's) sized for a CPU test;
    ``parallelism`` sets fields of ``cfg.parallelism`` (degrees, backend). ``save=False``
    still loads ``load_path`` but writes no checkpoint; ``n_layers`` keeps the model's
    first blocks only (a debug model's first block of deepseek-v3 is dense, the rest MoE)."""
    tok_dir, data_dir = make_assets(assets)
    cfg = cpu_defaults(config_fn(), assets)
    if n_layers is not None:
        layers = cfg.model_spec.model.layers
        assert 0 < n_layers <= len(layers), (n_layers, len(layers))
        cfg.model_spec.model.layers = layers[:n_layers]
    cfg.hf_assets_path = tok_dir
    cfg.dump_folder = dump
    cfg.dataloader.dataset_path = data_dir
    cfg.dataloader.num_workers = 0
    cfg.training.steps = steps
    cfg.training.seq_len = seq_len
    cfg.training.local_batch_size = batch
    cfg.training.global_batch_size = -1
    cfg.training.mixed_precision_param = dtype
    cfg.training.mixed_precision_reduce = "float32"
    cfg.parallelism.spmd_backend = "partial_dtensor"  # what the ragged configs use
    for k, v in (parallelism or {}).items():
        assert hasattr(cfg.parallelism, k), k
        setattr(cfg.parallelism, k, v)
    cfg.debug.seed = seed
    cfg.debug.deterministic = False
    cfg.validator.enable = False
    cfg.compile.enable = False
    cfg.metrics.log_freq = 1
    cfg.metrics.enable_tensorboard = False
    cfg.lr_scheduler.warmup_steps = 1
    if not chunked_loss:
        from torchtitan.components.loss import CrossEntropyLoss

        cfg.loss = cfg.loss.loss_fn if hasattr(cfg.loss, "loss_fn") else CrossEntropyLoss.Config()
    ck = cfg.checkpoint
    ck.enable = True
    ck.folder = "checkpoint"
    ck.interval = save_interval or max(steps, 1)
    ck.last_save_model_only = False
    ck.async_mode = "disabled"
    ck.keep_latest_k = 0
    ck.load_only = not save
    if load_path is not None:
        ck.initial_load_path = load_path
        ck.initial_load_model_only = model_only
        ck.initial_load_in_hf = False
    return cfg


def train(cfg, *, save_seed: bool = False) -> RunResult:
    """Build torchtitan's Trainer from ``cfg`` and run ``Trainer.train()``; record each
    step's global loss and gradient norm (what torchtitan logs) and the final parameters."""
    from torch.distributed.tensor import DTensor
    import torchtitan.distributed.utils as dist_utils

    patch_for_cpu()  # also sets force-sum reductions on torch's FSDP2 modules (gloo)
    trainer = cfg.build()
    res = RunResult()
    clip = dist_utils.clip_grad_norm_

    def clip_and_record(params, *args, **kwargs):
        # float64 norm of the full gradients: torchtitan's fp32 norm of a 500k-element
        # embedding gradient is itself ~1e-4 off, which would hide the comparison
        params = list(params)
        sq = torch.zeros((), dtype=torch.float64)
        for p in params:
            if p.grad is not None:
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                sq += g.detach().double().pow(2).sum()
        res.exact_grad_norms[trainer.step] = sq.sqrt().item()
        return clip(params, *args, **kwargs)

    dist_utils.clip_grad_norm_ = clip_and_record
    try:
        if save_seed:
            trainer.checkpointer.save(curr_step=0, last_step=True)
        orig_log = trainer.metrics_processor.log

        t0 = [None]

        def log(step, loss, max_loss, grad_norm, **kw):
            res.losses[step] = float(loss)
            res.grad_norms[step] = float(grad_norm)
            if t0[0] is None:
                t0[0] = time.perf_counter()
            else:
                res.seconds = time.perf_counter() - t0[0]

        trainer.metrics_processor.log = log
        trainer.train()
        trainer.metrics_processor.log = orig_log
        for name, p in trainer.model_parts[0].named_parameters():
            t = p.full_tensor() if isinstance(p, DTensor) else p
            res.params[name] = t.detach().clone()
    finally:
        dist_utils.clip_grad_norm_ = clip
        trainer.close()
    return res


def registries(model: str):
    """torchtitan's debug-model config function and ragged_fsdp's twin of it."""
    reg = importlib.import_module(f"torchtitan.models.{model}.config_registry")
    ragged = importlib.import_module("ragged_fsdp.integrations.torchtitan")
    name = f"{model}_debugmodel"
    return getattr(reg, name), getattr(ragged, name)


def config_pair(name: str):
    """torchtitan's config function ``name`` (of any of the registries ragged_fsdp exposes)
    and ragged_fsdp's twin of it."""
    ragged = importlib.import_module("ragged_fsdp.integrations.torchtitan")
    fn = ragged.CONFIGS.get(name)
    if fn is None:
        raise SystemExit(f"unknown --config {name!r}; one of: {', '.join(sorted(ragged.CONFIGS))}")
    return fn.__wrapped__, fn


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare_runs(what: str, a, b, steps, *, loss_rtol: float, norm_rtol: float, logged_rtol: float,
                 param_atol: float | None = None, exact_logged_norm: bool = False) -> dict:
    """Worst relative differences of run ``b`` (ragged_fsdp) from run ``a`` (FSDP2) over
    ``steps``, asserted against the bounds; ``param_atol`` also bounds the final parameters."""
    report = {"loss_rel": 0.0, "grad_norm_rel": 0.0, "logged_norm_rel": 0.0}
    assert sorted(a.losses) == sorted(b.losses) == list(steps), (what, a.losses, b.losses)
    for s in steps:
        report["loss_rel"] = max(report["loss_rel"], rel(b.losses[s], a.losses[s]))
        report["grad_norm_rel"] = max(report["grad_norm_rel"], rel(b.exact_grad_norms[s], a.exact_grad_norms[s]))
        report["logged_norm_rel"] = max(report["logged_norm_rel"], rel(b.grad_norms[s], a.grad_norms[s]))
        if exact_logged_norm:  # ragged_fsdp's logged norm is the exact one (float64 accumulation)
            assert rel(b.grad_norms[s], b.exact_grad_norms[s]) <= 1e-6, (what, s, b.grad_norms[s], b.exact_grad_norms[s])
    assert report["loss_rel"] <= loss_rtol, (what, a.losses, b.losses)
    assert report["grad_norm_rel"] <= norm_rtol, (what, a.exact_grad_norms, b.exact_grad_norms)
    assert report["logged_norm_rel"] <= logged_rtol, (what, a.grad_norms, b.grad_norms)
    assert set(a.params) == set(b.params), (what, set(a.params) ^ set(b.params))
    if param_atol is not None:
        report["param_abs"] = max((a.params[k] - b.params[k]).abs().max().item() for k in a.params)
        assert report["param_abs"] <= param_atol, (what, report["param_abs"])
    return report


# -- the command: python -m ragged_fsdp.integrations.torchtitan.compare ---------------------------

_WORKER_ENV = "RAGGED_FSDP_TT_COMPARE_WORKER"


def _value(text: str):
    """A ``--parallelism.<field>`` value as torchtitan's command line reads it."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        return text


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ragged_fsdp.integrations.torchtitan.compare",
        description="Train torchtitan's FSDP2 and ragged_fsdp from one seed checkpoint on CPU gloo ranks "
                    "and print each step's loss and gradient norm side by side.")
    p.add_argument("--config", default="llama3_debugmodel",
                   help="a config function of torchtitan's llama3/qwen3/deepseek_v3/gpt_oss registries")
    p.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=64, help="--training.seq_len (the debug configs' 2048 is slow on CPU)")
    p.add_argument("--batch", type=int, default=2, help="--training.local_batch_size")
    p.add_argument("--seed", type=int, default=0, help="--debug.seed")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="--training.mixed_precision_param (reductions stay float32)")
    p.add_argument("--n-layers", type=int, default=None, help="keep the model's first N blocks only")
    p.add_argument("--plain-loss", action="store_true",
                   help="torchtitan's plain cross-entropy instead of its chunked loss")
    p.add_argument("--work-dir", default=None, help="seed checkpoint, assets and dumps (default: a temporary directory)")
    p.add_argument("--json", default=None, help="also write the table's numbers to this file")
    p.add_argument("--rtol", type=float, default=None,
                   help="exit with status 1 when a step's loss differs by more than this (relative)")
    p.add_argument("--quiet", action="store_true", help="torchtitan logs warnings and errors only, on every rank")
    args, rest = p.parse_known_args(argv)
    par: dict = {}
    i = 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--parallelism."):
            p.error(f"unrecognized argument {arg!r} (torchtitan settings other than --parallelism.<field> VALUE "
                    "have options of their own here)")
        key, eq, val = arg[len("--parallelism."):].partition("=")
        if not eq:
            if i + 1 >= len(rest):
                p.error(f"{arg} needs a value")
            i += 1
            val = rest[i]
        par[key.replace("-", "_")] = _value(val)
        i += 1
    args.parallelism = par
    return args


def compare(config: str = "llama3_debugmodel", *, work_dir: str, steps: int = 10, seq_len: int = 64,
            batch: int = 2, seed: int = 0, dtype: str = "float32", parallelism: dict | None = None,
            n_layers: int | None = None, chunked_loss: bool = True) -> dict:
    """On every rank of an initialised process group: one FSDP2 seed checkpoint, then
    ``steps`` steps of torchtitan's FSDP2 and of ragged_fsdp from it; returns the numbers
    (the same on every rank)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    fsdp2_fn, ragged_fn = config_pair(config)
    common = dict(assets=os.path.join(work_dir, "assets"), seq_len=seq_len, batch=batch, seed=seed,
                  chunked_loss=chunked_loss, n_layers=n_layers)
    # the seed on plain FSDP over every rank with partial_dtensor (DCP reshards it to any layout on
    # load; a second FSDP2 trainer under full_dtensor in one process fails in FSDP2's fully_shard)
    seed_dir = os.path.join(work_dir, "seed")
    t0 = time.perf_counter()
    train(build_config(fsdp2_fn, dump=seed_dir, steps=0,
                       parallelism=dict(data_parallel_shard_degree=world, spmd_backend="partial_dtensor"), **common),
          save_seed=True)
    ckpt = os.path.join(seed_dir, "checkpoint", "step-0")
    runs = {}
    for name, fn in (("fsdp2", fsdp2_fn), ("ragged", ragged_fn)):
        runs[name] = train(build_config(fn, dump=os.path.join(work_dir, name), steps=steps, load_path=ckpt,
                                        save=False, dtype=dtype, parallelism=parallelism, **common))
    a, b = runs["fsdp2"], runs["ragged"]
    rows = []
    for s in sorted(a.losses):
        rows.append({"step": s, "loss": {"fsdp2": a.losses[s], "ragged": b.losses.get(s)},
                     "grad_norm": {"fsdp2": a.exact_grad_norms.get(s), "ragged": b.exact_grad_norms.get(s)},
                     "logged_grad_norm": {"fsdp2": a.grad_norms[s], "ragged": b.grad_norms.get(s)}})
    for r in rows:
        for k in ("loss", "grad_norm", "logged_grad_norm"):
            x, y = r[k]["fsdp2"], r[k]["ragged"]
            r[k]["rel"] = None if x is None or y is None else rel(y, x)
    worst = {k: max((r[k]["rel"] for r in rows if r[k]["rel"] is not None), default=None)
             for k in ("loss", "grad_norm", "logged_grad_norm")}
    same = set(a.params) == set(b.params)
    worst["param_abs"] = (max((a.params[k] - b.params[k]).abs().max().item() for k in a.params)
                          if same and a.params else None)
    return {"config": config, "world": world, "steps": steps, "seq_len": seq_len, "local_batch_size": batch,
            "seed": seed, "dtype": dtype, "spmd_backend": "partial_dtensor", "parallelism": parallelism or {},
            "rows": rows, "max_rel": worst, "same_parameter_names": same,
            "seconds": {"fsdp2": a.seconds, "ragged": b.seconds, "total": time.perf_counter() - t0}}


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(rep: dict) -> str:
    """The per-step table (plain text) of :func:`compare`'s numbers."""
    par = " ".join(f"--parallelism.{k} {v}" for k, v in rep["parallelism"].items())
    lines = [f"{rep['config']}: {rep['world']} ranks, {rep['steps']} steps, seq {rep['seq_len']}, batch "
             f"{rep['local_batch_size']} per rank, {rep['dtype']}, seed {rep['seed']}, spmd_backend "
             f"{rep['spmd_backend']}{', ' + par if par else ''}; both from one FSDP2 seed checkpoint",
             f"{'step':>4}  {'loss FSDP2':>12} {'loss ragged':>12} {'rel':>8}  {'grad norm FSDP2':>15} "
             f"{'ragged':>12} {'rel':>8}  {'logged norm rel':>15}"]
    for r in rep["rows"]:
        lo, gn, ln = r["loss"], r["grad_norm"], r["logged_grad_norm"]
        lines.append(f"{r['step']:>4}  {_fmt(lo['fsdp2'], '12.6f')} {_fmt(lo['ragged'], '12.6f')} "
                     f"{_fmt(lo['rel'], '8.1e')}  {_fmt(gn['fsdp2'], '15.6f')} {_fmt(gn['ragged'], '12.6f')} "
                     f"{_fmt(gn['rel'], '8.1e')}  {_fmt(ln['rel'], '15.1e')}")
    w = rep["max_rel"]
    lines.append(f"max rel. diff: loss {_fmt(w['loss'], '.1e')}, grad norm (float64, full gradients) "
                 f"{_fmt(w['grad_norm'], '.1e')}, torchtitan's logged norm {_fmt(w['logged_grad_norm'], '.1e')}; "
                 f"final parameters max abs. diff {_fmt(w['param_abs'], '.1e')}")
    sec = rep["seconds"]
    lines.append(f"wall time after step 1: FSDP2 {sec['fsdp2']:.1f} s, ragged {sec['ragged']:.1f} s "
                 f"(all three runs incl. the seed: {sec['total']:.0f} s)")
    return "\n".join(lines)


def _worker(args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist
    from torchtitan.tools.logging import init_logger

    init_logger()
    log_on_rank_zero(quiet=args.quiet)

    class _NoReinitWarning(logging.Filter):  # every trainer after the first would say so
        def filter(self, record):
            return "torch.distributed is already initialized" not in record.getMessage()

    for h in logging.getLogger().handlers:
        h.addFilter(_NoReinitWarning())
    dist.init_process_group("gloo")
    try:
        rep = compare(args.config, work_dir=args.work_dir, steps=args.steps, seq_len=args.seq_len,
                      batch=args.batch, seed=args.seed, dtype=args.dtype, parallelism=args.parallelism,
                      n_layers=args.n_layers, chunked_loss=not args.plain_loss)
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(rep, f, indent=1)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    if os.environ.get(_WORKER_ENV):  # a training rank: the arguments come in the environment
        job = json.loads(os.environ[_WORKER_ENV])
        _worker(_parse(job["argv"]), job["out"])
        return 0
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    missing = torchtitan_missing()
    if missing is not None:  # before torchrun starts ranks that would each print a traceback
        print(f"compare: {missing}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ragged_tt_compare_") as tmp:
        if args.work_dir is None:
            argv += ["--work-dir", tmp]
        out = os.path.join(tmp, "report.json")
        # torchrun would read abbreviations of its own options (--nproc) among the script's
        env = {**os.environ, _WORKER_ENV: json.dumps({"argv": argv, "out": out})}
        # the package as this process found it (a checkout run with PYTHONPATH=src included)
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, os.environ.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
               "-m", "ragged_fsdp.integrations.torchtitan.compare"]
        r = subprocess.run(cmd, env=env)
        if r.returncode != 0 or not os.path.exists(out):
            print(f"compare: the training ranks failed (exit status {r.returncode})", file=sys.stderr)
            return r.returncode or 1
        with open(out) as f:
            rep = json.load(f)
    print(format_table(rep), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    if args.rtol is not None and (rep["max_rel"]["loss"] is None or rep["max_rel"]["loss"] > args.rtol):
        print(f"compare: losses differ by {rep['max_rel']['loss']} relative, more than --rtol {args.rtol}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
