"""torchtitan (0.3.0) trains with ragged_fsdp by changing ``--module``.

    torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module ragged_fsdp.integrations.torchtitan --config llama3_8b

This module exposes every zero-argument config function of torchtitan's ``llama3``,
``qwen3``, ``deepseek_v3`` and ``gpt_oss`` config registries under its own name
(``llama3_debugmodel``, ``llama3_8b``, ``qwen3_0_6b``, ``deepseek_v3_16b``, ``gpt_oss_20b``,
...). Each returns torchtitan's config unchanged except for the SPMD backend
(``partial_dtensor`` instead of the default ``spmd_types``, said once at start-up: see
:func:`~ragged_fsdp.integrations.torchtitan.support.backend_notice`) and the model spec,
whose ``parallelize_fn`` runs torchtitan's own parallelize function (TP, EP, CP,
activation checkpointing, compile) while torchtitan's FSDP helper
(``torchtitan/distributed/fsdp.py``) calls ragged_fsdp's ``fully_shard``
(:mod:`.shard`) and sees ragged_fsdp's ``FSDPModule``. :func:`ragged_model_spec` does the
same for any other model spec.

HSDP, TP, EP (torchtitan's ``ep``/``efsdp`` sub-meshes), CP (FSDP over the flattened
``fsdp`` mesh) and the ``full_dtensor`` backend run; what does not is refused before
anything is built, in one line naming the setting (:mod:`.support`). ``python -m
ragged_fsdp.integrations.torchtitan.cpu`` runs torchtitan on CPU gloo ranks (:mod:`.cpu`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from dataclasses import replace
from typing import Any

import torch.nn as nn

from ragged_fsdp.fsdp import FSDPModule

from .shard import fully_shard_for_torchtitan
from .support import Refused, backend_notice, check_supported, install_excepthook, torchtitan_missing

__all__ = ["ragged_model_spec", "fully_shard_for_torchtitan", "check_supported", "Refused", "MODELS", "CONFIGS"]

MODELS = ("llama3", "qwen3", "deepseek_v3", "gpt_oss")
# set by a config function of this module that replaced torchtitan's default backend
_switched_backend = False
_noticed = False
install_excepthook()


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


def _notice_once(parallelism) -> None:
    global _noticed
    line = backend_notice(parallelism, _switched_backend)
    if line is None or _noticed:
        return
    _noticed = True
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        from torchtitan.tools.logging import logger

        logger.warning(line)


def _ragged_parallelize(parallelize_fn):
    @functools.wraps(parallelize_fn)
    def parallelize(model: nn.Module, *args, parallel_dims, parallelism, **kwargs):
        check_supported(parallel_dims, parallelism)
        _notice_once(parallelism)
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
        global _switched_backend
        cfg = fn()
        if getattr(cfg, "model_spec", None) is not None:
            cfg.model_spec = ragged_model_spec(cfg.model_spec)
        parallelism = getattr(cfg, "parallelism", None)
        if parallelism is not None and getattr(parallelism, "spmd_backend", None) == "spmd_types":
            # torchtitan's default fails in torch 2.13's fully_shard (FSDP2's too); the
            # command line still wins, and parallelize says which backend runs
            parallelism.spmd_backend = "partial_dtensor"
            _switched_backend = True
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


# without torchtitan the package still imports (its commands answer --help and name the
# extra); a config function asked for then raises the same sentence
_MISSING = torchtitan_missing()
CONFIGS = _register_configs() if _MISSING is None else {}
globals().update(CONFIGS)


def __getattr__(name: str):
    if _MISSING is not None and not name.startswith("__"):
        raise ModuleNotFoundError(f"{name}: {_MISSING}", name="torchtitan")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
