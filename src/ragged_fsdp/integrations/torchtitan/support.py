"""Which torchtitan settings the ragged_fsdp module runs, and how it says no.

A refusal is a :class:`Refused` (a ``NotImplementedError``) whose message names the setting
and what to do. Programs that call the integration get an ordinary exception; a
command-line run (``torchrun -m torchtitan.train --module ragged_fsdp.integrations.torchtitan``)
prints that message as one line per rank instead of a traceback, through a
``sys.excepthook`` that handles :class:`Refused` only and hands every other exception to
the hook it replaced. torchtitan's ``Trainer`` methods are decorated with torchelastic's
``@record``, which writes the traceback into this rank's error file for torchrun's failure
summary; for a refusal the hook rewrites that file to hold the one line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

__all__ = ["Refused", "check_supported", "backend_notice", "PREFIX", "INSTALL", "torchtitan_missing"]

PREFIX = "ragged_fsdp.integrations.torchtitan"
INSTALL = "pip install torch==2.13.0 -e '.[torchtitan]'"  # the extra that brings torchtitan (from a checkout)


def torchtitan_missing() -> str | None:
    """None when torchtitan imports; otherwise the sentence a command prints instead of a
    traceback (the package and its commands import without torchtitan, so that ``--help``
    answers and the message names the extra)."""
    try:
        import torchtitan  # noqa: F401
    except ImportError as e:  # torchtitan itself, or what it imports at start-up (triton)
        return f"{PREFIX} needs torchtitan 0.3.0, which does not import here ({e}); install the torchtitan extra: {INSTALL}"
    return None


class Refused(NotImplementedError):
    """A torchtitan setting this integration does not run; the message says what to do."""


def _excepthook(exc_type, exc, tb, _previous=sys.excepthook):
    if isinstance(exc, Refused):
        rank = _rank()
        where = f"[rank {rank}] " if rank is not None else ""
        print(f"{where}error: {exc}", file=sys.stderr, flush=True)
        _rewrite_error_file(exc)
        return
    _previous(exc_type, exc, tb)


def _rewrite_error_file(exc: Refused) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    line = f"{type(exc).__name__}: {exc}"
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the summary then shows what @record wrote; the per-rank line is printed already


def _rank() -> int | None:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def install_excepthook() -> None:
    if getattr(sys.excepthook, "__ragged_fsdp__", False):
        return
    def excepthook(exc_type, exc, tb, _previous=sys.excepthook):
        return _excepthook(exc_type, exc, tb, _previous)

    excepthook.__ragged_fsdp__ = True
    sys.excepthook = excepthook


def _schedules_take_microbatches() -> bool:
    """Whether ``pp_schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)`` (torchtitan
    0.3.0's call) works: a torch whose schedules take them, or the CPU mode's adapter.
    torchtitan's model specs import the schedules before the model is parallelised; when
    they are not loaded there is no pipeline to run, and importing them here would only
    add torch's start-up noise to a refusal."""
    import inspect

    schedules = sys.modules.get("torch.distributed.pipelining.schedules")
    if schedules is None:
        return False
    step = schedules.PipelineScheduleSingle.step
    return getattr(step, "__ragged_fsdp_cpu__", False) or "arg_mbs" in inspect.signature(step).parameters


def check_supported(parallel_dims: Any, parallelism: Any) -> None:
    """Raise :class:`Refused` for the first torchtitan setting ragged_fsdp cannot run.

    HSDP, tensor, expert and context parallelism and the ``partial_dtensor`` and
    ``full_dtensor`` backends run; what is left is refused here, before anything is built."""
    pp = int(getattr(parallel_dims, "pp", 1) or 1)
    if pp > 1 and not _schedules_take_microbatches():
        raise Refused(
            f"{PREFIX}: --parallelism.pipeline_parallel_degree={pp} is not supported yet "
            "(torchtitan 0.3.0's trainer calls pp_schedule.step(arg_mbs=..., kwarg_mbs=..., "
            "target_mbs=...), which this torch's pipeline schedules do not take, so it fails for "
            "torchtitan's own FSDP2 too; the CPU mode, python -m ragged_fsdp.integrations.torchtitan.cpu, "
            "adapts that call for both). Use --parallelism.pipeline_parallel_degree 1 here, or run "
            "through the CPU mode"
        )
    backend = getattr(parallelism, "spmd_backend", None)
    if backend == "spmd_types":
        raise Refused(
            f"{PREFIX}: --parallelism.spmd_backend=spmd_types is not supported (on torch 2.13 "
            "torchtitan's own FSDP2 fails with it too: fully_shard gets parameters that are not "
            "DTensors on the full SPMD mesh). Drop the option: this module's configs use "
            "partial_dtensor, or pass --parallelism.spmd_backend full_dtensor"
        )
    cp = int(getattr(parallel_dims, "cp", 1) or 1)
    if backend == "full_dtensor" and cp > 1:
        raise Refused(
            f"{PREFIX}: --parallelism.spmd_backend=full_dtensor with "
            f"--parallelism.context_parallel_degree={cp} asks fully_shard to shard over two "
            "mesh dims at once (dp_shard and cp); ragged_fsdp shards over one. Use "
            "--parallelism.spmd_backend partial_dtensor (the default of this module), which "
            "shards over torchtitan's flattened fsdp mesh"
        )
    if getattr(parallelism, "enable_fsdp_symm_mem", False):
        raise Refused(
            f"{PREFIX}: --parallelism.enable_fsdp_symm_mem (symmetric-memory FSDP collectives) "
            "is not supported; drop the option"
        )


def backend_notice(parallelism: Any, switched: bool) -> str | None:
    """The start-up line saying the module changed torchtitan's SPMD backend, or None."""
    if not switched or getattr(parallelism, "spmd_backend", None) != "partial_dtensor":
        return None
    return (
        f"{PREFIX}: --parallelism.spmd_backend is partial_dtensor, not torchtitan's default "
        "spmd_types: with spmd_types, torch 2.13's fully_shard gets parameters that are not "
        "DTensors on the full SPMD mesh and fails (torchtitan's own FSDP2 as well). "
        "partial_dtensor trains the same model with the same meshes; pass "
        "--parallelism.spmd_backend full_dtensor to use that backend instead"
    )
