"""Run torchtitan 0.3.0's own Trainer on CPU gloo ranks (test harness only).

torchtitan is not CPU-ready on torch 2.13; everything it needs for that lives here, never in
``ragged_fsdp.integrations.torchtitan``:

- device: torchtitan picks ``cuda`` when no accelerator is found; point its device names at
  a small CPU device module (memory stats are zeros).
- FlexAttention: torchtitan runs ``torch.compile(flex_attention)``, which has no CPU
  backward here. Replace the compiled call by scaled-dot-product attention with the same
  mask: the block mask's ``mask_mod`` evaluated densely (block-causal per document).
- ``torch.distributed.set_timeout`` does not exist in torch 2.13: a no-op stand-in.
- the debug configs read ``./tests/assets/tokenizer`` and ``tests/assets/c4_test`` from a
  torchtitan checkout, which the wheel does not ship: build a byte-level BPE tokenizer and a
  tiny text data set locally (deterministic, no downloads).
- rank 0 sleeps 2 s at the end of ``Trainer.train``: skipped.
"""

from __future__ import annotations

import json
import os
import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


# -- CPU stand-ins -------------------------------------------------------------------------
class _CPUDeviceModule:
    """What torchtitan calls on ``torch.cuda``, answered for the CPU."""

    def set_device(self, device):
        pass

    def current_device(self):
        return 0

    def device_count(self):
        return 1

    def synchronize(self, *a):
        pass

    def get_device_name(self, *a):
        return "cpu"

    def get_device_properties(self, *a):
        return types.SimpleNamespace(total_memory=1 << 34, name="cpu")

    def reset_peak_memory_stats(self, *a):
        pass

    def empty_cache(self):
        pass

    def memory_stats(self, *a):
        return {"active_bytes.all.peak": 0, "active_bytes.all.current": 0, "reserved_bytes.all.peak": 0,
                "num_alloc_retries": 0, "num_ooms": 0}

    def is_available(self):
        return True


def _sdpa_flex(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
               return_aux=None, kernel_options=None):
    """flex_attention(q, k, v, block_mask=...) computed by SDPA with the same dense mask."""
    if score_mod is not None:
        raise NotImplementedError("the CPU harness handles block masks, not score_mod")
    B, H, L, _ = q.shape
    S = k.shape[2]
    mask = None
    if block_mask is not None:
        b = torch.arange(B).view(B, 1, 1, 1)
        h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
        qi = torch.arange(L).view(1, 1, L, 1)
        ki = torch.arange(S).view(1, 1, 1, S)
        mask = block_mask.mask_mod(b, h, qi, ki).expand(B, 1, L, S)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )
    if return_aux is not None and getattr(return_aux, "lse", False):
        raise NotImplementedError("the CPU harness does not return the log-sum-exp")
    return out, types.SimpleNamespace(lse=None)


class _NoSleepTime:
    def __getattr__(self, name):
        import time

        return getattr(time, name)

    @staticmethod
    def sleep(seconds):
        pass


_patched = False


def patch_torchtitan_for_cpu() -> None:
    """Apply the CPU stand-ins (idempotent; call in each worker before building a trainer)."""
    global _patched
    if _patched:
        return
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.common.attention as attention
    import torchtitan.tools.utils as tt_utils
    import torchtitan.trainer as trainer

    cpu = _CPUDeviceModule()
    for mod in (tt_utils, metrics, dist_utils):
        mod.device_module = cpu
        mod.device_type = "cpu"
    parallel_dims.device_type = "cpu"
    tt_utils.get_local_device = lambda: torch.device("cpu")
    dist_utils.get_local_device = tt_utils.get_local_device
    tt_utils.get_peak_flops = lambda name: 1e12
    attention.FlexAttention._compiled_flex_attn = staticmethod(_sdpa_flex)
    # torch.compile(create_block_mask) costs ~30 s of inductor on CPU: build masks eagerly
    from torch.nn.attention.flex_attention import create_block_mask

    attention._compiled_create_block_mask = create_block_mask
    trainer.time = _NoSleepTime()
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: None
    # the loss mesh barrier passes a CUDA device id, which gloo ignores
    _patched = True


# -- local tokenizer and data --------------------------------------------------------------
_WORDS = (
    "the of and to in is was for on that with as by at from his her they which this be are "
    "an or had not but were have one all their has been first new would more two some time "
    "after other into over city world year state its school also made people may used part "
    "river music between under both three system early last where large house during game"
).split()


def make_assets(root: str, *, vocab: int = 512, docs: int = 400, seed: int = 0) -> tuple[str, str]:
    """A byte-level BPE tokenizer (``<|begin_of_text|>``/``<|end_of_text|>``) trained on a
    tiny generated corpus, and that corpus as a json-lines data set. Returns the tokenizer
    folder and the data folder."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok_dir, data_dir = os.path.join(root, "tokenizer"), os.path.join(root, "data")
    if os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        return tok_dir, data_dir
    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    rng = random.Random(seed)
    texts = []
    for _ in range(docs):
        n = rng.randint(20, 120)
        words = [rng.choice(_WORDS) for _ in range(n)]
        texts.append(" ".join(words).capitalize() + ".")
    with open(os.path.join(data_dir, "train.json"), "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[bos, eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": bos, "eos_token": eos, "add_bos_token": False, "add_eos_token": False}, f)
    return tok_dir, data_dir


# -- one training run ----------------------------------------------------------------------
@dataclass
class RunResult:
    losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)  # what torchtitan logs
    exact_grad_norms: dict[int, float] = field(default_factory=dict)  # float64, of full grads
    params: dict[str, torch.Tensor] = field(default_factory=dict)


def build_config(config_fn, *, assets: str, dump: str, steps: int, seq_len: int = 64,
                 batch: int = 2, chunked_loss: bool = True, load_path: str | None = None,
                 model_only: bool = True, save_interval: int | None = None, seed: int = 0):
    """``config_fn()`` (torchtitan's or ragged_fsdp's) sized for a CPU test."""
    tok_dir, data_dir = make_assets(assets)
    cfg = config_fn()
    cfg.hf_assets_path = tok_dir
    cfg.dump_folder = dump
    cfg.dataloader.dataset_path = data_dir
    cfg.dataloader.num_workers = 0
    cfg.training.steps = steps
    cfg.training.seq_len = seq_len
    cfg.training.local_batch_size = batch
    cfg.training.global_batch_size = -1
    cfg.training.mixed_precision_param = "float32"
    cfg.training.mixed_precision_reduce = "float32"
    cfg.training.disable_cuda_graphs = True
    cfg.parallelism.spmd_backend = "partial_dtensor"  # what the ragged configs use
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
    if load_path is not None:
        ck.initial_load_path = load_path
        ck.initial_load_model_only = model_only
        ck.initial_load_in_hf = False
    return cfg


def train(cfg, *, force_sum: bool, save_seed: str | None = None) -> RunResult:
    """Build torchtitan's Trainer from ``cfg`` and run ``Trainer.train()``; record each
    step's global loss and gradient norm (what torchtitan logs) and the final parameters."""
    from torch.distributed.tensor import DTensor
    import torchtitan.distributed.utils as dist_utils

    patch_torchtitan_for_cpu()
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
        if force_sum:  # FSDP2 on gloo: torchtitan's divide factor 1.0 needs PREMUL_SUM otherwise
            for m in trainer.model_parts[0].modules():
                if hasattr(m, "set_force_sum_reduction_for_comms"):
                    m.set_force_sum_reduction_for_comms(True)
        if save_seed is not None:
            trainer.checkpointer.save(curr_step=0, last_step=True)
        orig_log = trainer.metrics_processor.log

        def log(step, loss, max_loss, grad_norm, **kw):
            res.losses[step] = float(loss)
            res.grad_norms[step] = float(grad_norm)

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
