"""torchtitan (0.3.0) trains with ragged_fsdp by changing ``--module``.

    torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module ragged_fsdp.integrations.torchtitan --config llama3_8b

This module exposes every zero-argument config function of torchtitan's ``llama3``,
``qwen3``, ``deepseek_v3`` and ``gpt_oss`` config registries under its own name
(``llama3_debugmodel``, ``llama3_8b``, ``qwen3_0_6b``, ``deepseek_v3_16b``, ``gpt_oss_20b``,
...). Each returns torchtitan's config unchanged except for the SPMD backend (``partial_dtensor``
instead of the default ``spmd_types``, which hands ``fully_shard`` whole-mesh DTensors) and
the model spec, whose
``parallelize_fn`` runs torchtitan's own parallelize function while torchtitan's FSDP helper
(``torchtitan/distributed/fsdp.py``) calls ragged_fsdp's ``fully_shard`` and sees
ragged_fsdp's ``FSDPModule``. Activation checkpointing, per-block compile, mixed precision,
the chunked loss, gradient clipping and DCP checkpoints then run as torchtitan wrote them.
:func:`ragged_model_spec` does the same for any other model spec.

What the engine cannot do yet is refused before anything is built, naming the option:
HSDP (``data_parallel_replicate_degree > 1``), tensor, context, expert and pipeline
parallelism, the ``full_dtensor`` / ``spmd_types`` SPMD backends (``dp_mesh_dims``),
symmetric-memory comms, and quantized-weight converters whose weights are tensor
subclasses with their own all-gather (float8 / MX / NVFP4).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import math
from dataclasses import replace
from typing import Any

import torch.nn as nn

from ragged_fsdp.fsdp import FSDPModule
from ragged_fsdp.fsdp import fully_shard as _ragged_fully_shard

__all__ = ["ragged_model_spec", "fully_shard_for_torchtitan", "check_supported", "MODELS", "CONFIGS"]

MODELS = ("llama3", "qwen3", "deepseek_v3", "gpt_oss")
_REFUSE = "ragged_fsdp.integrations.torchtitan"


# -- what ragged_fsdp does not do yet ---------------------------------------------------------
def check_supported(parallel_dims: Any, parallelism: Any) -> None:
    """Raise NotImplementedError naming every torchtitan option ragged_fsdp cannot run yet."""
    problems = []
    degrees = (
        ("dp_replicate", "data_parallel_replicate_degree", "HSDP (a replicate mesh dim)"),
        ("tp", "tensor_parallel_degree", "tensor parallelism (parameters that are DTensors on a tp mesh)"),
        ("cp", "context_parallel_degree", "context parallelism"),
        ("ep", "expert_parallel_degree", "expert parallelism (per-parameter meshes)"),
        ("pp", "pipeline_parallel_degree", "pipeline parallelism"),
    )
    for attr, flag, what in degrees:
        n = int(getattr(parallel_dims, attr, 1) or 1)
        if n > 1:
            problems.append(f"--parallelism.{flag}={n}: {what}")
    backend = getattr(parallelism, "spmd_backend", None)
    if backend in ("full_dtensor", "spmd_types"):
        problems.append(
            f"--parallelism.spmd_backend={backend}: multi-dimensional SPMD meshes with dp_mesh_dims"
        )
    if getattr(parallelism, "enable_fsdp_symm_mem", False):
        problems.append("--parallelism.enable_fsdp_symm_mem: symmetric-memory FSDP comms")
    if problems:
        raise NotImplementedError(
            f"{_REFUSE}: ragged_fsdp does not support yet: " + "; ".join(problems)
            + ". It shards over one 1-D data-parallel mesh (--parallelism.data_parallel_shard_degree); "
            "drop these options or use torchtitan's own module for this run"
        )


def _granularity_from_placement(param: nn.Parameter, placement: Any, name: str):
    """torchtitan asks FSDP2 for ``Shard(k)`` to avoid padding (MoE experts when the mesh is
    larger than the expert count). A rank's ``Shard(k)`` piece is made of whole
    ``shape[k+1:]`` slices, so ask the planner to keep those slices whole; the planner pads
    at most between tensors anyway."""
    from torch.distributed.tensor import Shard

    if placement is None:
        return None
    if type(placement).__name__ == "ShardPlacementResult":
        raise NotImplementedError(
            f"{_REFUSE}: parameter {name!r} asks for its own mesh ({placement!r}), as torchtitan "
            "does for expert parallelism; ragged_fsdp shards every parameter of a group over one "
            "mesh. Use --parallelism.expert_parallel_degree=1"
        )
    if not isinstance(placement, Shard):
        raise NotImplementedError(
            f"{_REFUSE}: shard_placement_fn returned {placement!r} for {name!r}; only Shard(k) "
            "requests can be translated into a ragged_fsdp granularity"
        )
    dim = placement.dim % max(param.ndim, 1)
    block = math.prod(param.shape[dim + 1:])
    if param.ndim >= 1 and block == param.shape[-1] and param.ndim >= 2:
        return "row"
    return f"block:{block}" if block > 1 else None


def fully_shard_for_torchtitan(module, *, shard_placement_fn=None, dp_mesh_dims=None, **kwargs):
    """ragged_fsdp's ``fully_shard`` with torchtitan's extra arguments translated or refused."""
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            f"{_REFUSE}: fully_shard(dp_mesh_dims={dp_mesh_dims!r}) comes from the full_dtensor / "
            "spmd_types SPMD backend; ragged_fsdp needs the 1-D data-parallel mesh"
        )
    modules = module if isinstance(module, (list, tuple)) else [module]
    for m in modules:
        for name, p in m.named_parameters():
            if hasattr(type(p.data), "fsdp_pre_all_gather") or hasattr(type(p), "fsdp_pre_all_gather"):
                raise NotImplementedError(
                    f"{_REFUSE}: parameter {name!r} of {type(m).__name__} is a {type(p.data).__name__} "
                    "with its own FSDP all-gather (float8 / MX / NVFP4 converters); ragged_fsdp does "
                    "not run those yet. Remove the converter from the model config"
                )
    if shard_placement_fn is not None:
        user_fn = kwargs.pop("granularity_fn", None)

        def granularity_fn(name: str, p: nn.Parameter):
            g = _granularity_from_placement(p, shard_placement_fn(p), name)
            if g is None and user_fn is not None:
                return user_fn(name, p)
            return g

        kwargs["granularity_fn"] = granularity_fn
    return _ragged_fully_shard(module, **kwargs)


@contextlib.contextmanager
def _torchtitan_calls_ragged():
    """Point the names torchtitan's FSDP helper looks up at call time to ragged_fsdp."""
    tt_fsdp = importlib.import_module("torchtitan.distributed.fsdp")
    saved = {k: tt_fsdp.__dict__[k] for k in ("fully_shard", "FSDPModule")}
    tt_fsdp.fully_shard = fully_shard_for_torchtitan
    tt_fsdp.FSDPModule = FSDPModule
    try:
        yield
    finally:
        tt_fsdp.__dict__.update(saved)


def _ragged_parallelize(parallelize_fn):
    @functools.wraps(parallelize_fn)
    def parallelize(model: nn.Module, *args, parallel_dims, parallelism, **kwargs):
        check_supported(parallel_dims, parallelism)
        with _torchtitan_calls_ragged():
            return parallelize_fn(model, *args, parallel_dims=parallel_dims, parallelism=parallelism, **kwargs)

    parallelize.__ragged_fsdp__ = True
    return parallelize


def ragged_model_spec(spec):
    """A copy of torchtitan ``ModelSpec`` ``spec`` whose ``parallelize_fn`` uses ragged_fsdp."""
    if getattr(spec.parallelize_fn, "__ragged_fsdp__", False):
        return spec
    return replace(spec, parallelize_fn=_ragged_parallelize(spec.parallelize_fn))


def _ragged_config(fn):
    @functools.wraps(fn)
    def config():
        cfg = fn()
        if getattr(cfg, "model_spec", None) is not None:
            cfg.model_spec = ragged_model_spec(cfg.model_spec)
        parallelism = getattr(cfg, "parallelism", None)
        if parallelism is not None and getattr(parallelism, "spmd_backend", None) == "spmd_types":
            # torchtitan's default backend hands fully_shard DTensor parameters on the whole
            # SPMD mesh plus dp_mesh_dims; with pure data parallelism "partial_dtensor" gives
            # the same training with plain parameters on the 1-D fsdp mesh, which is what
            # ragged_fsdp shards. Setting the backend on the command line still wins.
            parallelism.spmd_backend = "partial_dtensor"
        return cfg

    config.__module__ = __name__
    return config


def _register_configs() -> dict[str, Any]:
    """Every public zero-argument function of the four models' config registries."""
    out: dict[str, Any] = {}
    for model in MODELS:
        reg = importlib.import_module(f"torchtitan.models.{model}.config_registry")
        for name, fn in vars(reg).items():
            if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != reg.__name__:
                continue
            if any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                   for p in inspect.signature(fn).parameters.values()):
                continue  # helpers such as enable_fused_swiglu(config)
            key = name if name not in out else f"{model}_{name}"
            out[key] = _ragged_config(fn)
    return out


CONFIGS = _register_configs()
globals().update(CONFIGS)
