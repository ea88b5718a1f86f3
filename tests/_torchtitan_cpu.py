"""Record a torchtitan 0.3.0 ``Trainer`` run on CPU gloo ranks, for the integration tests.

The CPU stand-ins and the generated tokenizer and data set are ragged_fsdp's CPU mode
(``ragged_fsdp.integrations.torchtitan.cpu`` and ``.assets``); this file only sizes configs
for a test and records each step's loss, gradient norms, step time and the final parameters.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field

import torch

from ragged_fsdp.integrations.torchtitan.assets import make_assets
from ragged_fsdp.integrations.torchtitan.cpu import cpu_defaults, patch_for_cpu


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
