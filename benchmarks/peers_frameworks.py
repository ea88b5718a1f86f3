"""How each framework of the peers bench wraps a model and takes a training step.

Every framework gets the model ``engine.build`` makes (seed 0), one FSDP unit per transformer
block plus the root, and AdamW at the same learning rate; ``setup`` returns a ``Runner`` whose
``step(x, y)`` does forward, cross-entropy, backward and the optimizer step the way that
framework's documentation says, and returns this rank's loss. The peers are imported here only,
inside ``setup``, so the rest of the bench imports without them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

FRAMEWORKS = ("ragged_fsdp", "fsdp2", "deepspeed_zero3", "megatron_fsdp")
LR = 1e-4
# peer -> (module it imports, distribution on the package index)
PEERS = {"deepspeed_zero3": ("deepspeed", "deepspeed"), "megatron_fsdp": ("megatron_fsdp", "megatron-fsdp")}


@dataclass
class Runner:
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    model: torch.nn.Module  # what MemTracker tracks as the model
    optimizer: object  # the torch optimizer MemTracker tracks (None: not a torch.optim.Optimizer)


def install_hint(framework: str) -> str:
    _, dist_name = PEERS[framework]
    return f"not installed: pip install torch==2.13.0 {dist_name} (pin torch so pip keeps the CPU build)"


def availability(framework: str) -> tuple[bool, str | None]:
    """(importable, version): a peer that is not installed is skipped, not an error."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"peers: unknown framework {framework!r}: expected one of {', '.join(FRAMEWORKS)}")
    if framework == "ragged_fsdp":
        try:
            return True, importlib.metadata.version("ragged_fsdp")
        except importlib.metadata.PackageNotFoundError:
            return True, None
    if framework == "fsdp2":
        return True, torch.__version__
    module, dist_name = PEERS[framework]
    if importlib.util.find_spec(module) is None:
        return False, None
    try:
        return True, importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return True, None


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _torch_fsdp(model, mesh, framework: str) -> Runner:
    from ragged_fsdp.bench.engine import make_optimizer, wrap

    model = wrap(model, framework, mesh)
    opt = make_optimizer(model, framework)

    def step(x, y):
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return Runner(step, model, opt)


def _deepspeed(model, mesh, batch: int) -> Runner:
    # DeepSpeed picks its accelerator when first asked; "cpu" uses torch's gloo backend.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # reuses the process group already up
    # Client optimizer: torch's AdamW (DeepSpeed's fused/CPU Adam would need compiled ops).
    client = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    # Buckets sized to the model the way Hugging Face's "auto" ZeRO-3 config sizes them
    # (hidden^2, 0.9 hidden^2, 10 hidden): DeepSpeed's own default reduce bucket is 5e8 fp32
    # elements, a 1.9 GiB buffer per rank, larger than these models.
    hidden = model.layers[0].attention_norm.weight.numel()
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "reduce_bucket_size": hidden * hidden,
                              "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
                              "stage3_param_persistence_threshold": 10 * hidden},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config)

    def step(x, y):
        loss = _loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    inner = getattr(ds_opt, "optimizer", ds_opt)
    return Runner(step, engine.module, inner if isinstance(inner, torch.optim.Optimizer) else None)


def _megatron_fsdp(model, world: int) -> Runner:
    from megatron_fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    # its documented mesh: a data-parallel shard dim and a (size 1) tensor-parallel dim
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("fsdp", "tp"))
    block = type(model.layers[0])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    wrapped, opt = fully_shard(model, opt, device_mesh=mesh, dp_shard_dim="fsdp", tp_dim="tp", fsdp_unit_modules=[block],
                               zero_dp_strategy=3, device=torch.device("cpu"))

    def step(x, y):
        loss = _loss(wrapped(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return Runner(step, wrapped, opt)


def setup(framework: str, model: torch.nn.Module, mesh, batch: int) -> Runner:
    if framework in ("ragged_fsdp", "fsdp2"):
        return _torch_fsdp(model, mesh, framework)
    if framework == "deepspeed_zero3":
        return _deepspeed(model, mesh, batch)
    if framework == "megatron_fsdp":
        return _megatron_fsdp(model, mesh.size())
    raise ValueError(f"peers: unknown framework {framework!r}: expected one of {', '.join(FRAMEWORKS)}")


def reference_losses(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """One process, the whole global batch of each step, torch AdamW: what every framework's
    mean-over-ranks loss should follow."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    out = []
    for x, y in batches:
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out
