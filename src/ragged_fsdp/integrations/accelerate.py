"""Hugging Face accelerate (1.15, 1.16) trains with ragged_fsdp through its FSDP2 path.

    import ragged_fsdp.integrations.accelerate as ragged_accelerate
    ragged_accelerate.enable()                       # before Accelerator(...)

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, ...)
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)   # cpu=True on a machine without GPUs
    model, optimizer = accelerator.prepare(model, optimizer)

After :func:`enable`, ``accelerator.prepare`` runs accelerate's own ``fsdp2_prepare_model``
(auto-wrap policy, embedding and ``[final norm, lm_head]`` groups, root, mixed precision,
``cpu_ram_efficient_loading``) with ragged_fsdp's ``fully_shard``. Our wrapped modules are
instances of torch's ``FSDPModule``, so accelerate's ``no_sync``
(``set_requires_gradient_sync``), DTensor-aware clipping, ``get_state_dict`` and
``save_state``/``load_state`` take their FSDP2 branches unchanged.

Two torch functions accelerate calls do not know the RaggedShard placement:

- ``torch.distributed.tensor.distribute_tensor`` (full-state loading after
  ``cpu_ram_efficient_loading``): inside accelerate's FSDP2 functions it resolves to
  ``ragged_fsdp.distribute_tensor``, which hands every other placement to torch's.
- ``torch.distributed.checkpoint.state_dict.set_model_state_dict`` with
  ``full_state_dict=True`` (``load_state`` of a full state dict): computes torch's local
  shard offsets, which RaggedShard does not have. Inside accelerate's FSDP loading it is
  replaced by a loader that broadcasts each full tensor from rank 0 (when asked) and copies
  this rank's ragged piece out of it; sharded state dicts go through DCP unchanged.
- torch's ``_distribute_tensors`` (full optimizer state broadcast from rank 0 in
  ``set_optimizer_state_dict``) computes ``Shard`` offsets; ragged entries copy their piece
  out of the full tensor instead.

The swaps last only while accelerate's own functions run; :func:`disable` undoes ``enable``.

On a machine without an accelerator, accelerate 1.15 never takes its FSDP path: with
``Accelerator(cpu=True)`` on several processes it picks ``MULTI_CPU`` and wraps the model in
DDP, and ``mixed_precision`` never reaches the FSDP plugin. After :func:`enable`, an
``AcceleratorState`` built with an FSDP plugin on ``MULTI_CPU`` takes the branch accelerate
takes on GPUs instead: distributed type ``FSDP``, and ``mixed_precision`` mapped onto the
plugin by the plugin's own ``set_mixed_precision`` (``"bf16"`` ->
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16, output_dtype=bf16)``; an explicit
``mixed_precision_policy`` on the plugin wins, as on GPU). An FSDP1 plugin there is refused
(accelerate's own FSDP1 plugin already refuses to be built without an accelerator when
``sync_module_states`` is on, with "no available devices found"; after :func:`enable` that
refusal is a :class:`RaggedAccelerateError` too). Both name ``FSDP_VERSION=2``: transformers'
``Trainer`` (4.57) builds the plugin from ``FSDP_*`` environment variables and ignores
``fsdp_config["fsdp_version"]``.

Without ``cpu=True`` a CPU machine gives accelerate's distributed type ``NO`` even under
torchrun: accelerate drops the FSDP plugin and every process trains its own unsharded copy,
without a word (and ``accelerate launch --num_processes N`` starts one process there). After
:func:`enable`, an FSDP plugin with distributed type ``NO`` is refused
(:class:`RaggedAccelerateError`) with ``Accelerator(cpu=True, ...)`` and torchrun as the fix.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ragged_fsdp.fsdp import fully_shard as _ragged_fully_shard
from ragged_fsdp.placement import RaggedDTensor
from ragged_fsdp.placement import distribute_tensor as _ragged_distribute_tensor

__all__ = ["enable", "disable", "is_enabled", "set_model_state_dict", "RaggedAccelerateError"]


class RaggedAccelerateError(ValueError):
    """An accelerate setting this integration cannot run; the message says what to do."""

# (module, attribute) pairs in accelerate that name the FSDP2 entry points we wrap
_WRAPPED = {
    "fsdp2_prepare_model": ("accelerate.utils.fsdp_utils", "accelerate.utils", "accelerate.accelerator"),
    "fsdp2_load_full_state_dict": ("accelerate.utils.fsdp_utils", "accelerate.utils"),
    "load_fsdp_model": ("accelerate.utils.fsdp_utils", "accelerate.utils", "accelerate.accelerator",
                        "accelerate.checkpointing"),
    "load_fsdp_optimizer": ("accelerate.utils.fsdp_utils", "accelerate.utils", "accelerate.accelerator",
                            "accelerate.checkpointing"),
}
_originals: dict[tuple[str, str], Any] = {}


def set_model_state_dict(model: nn.Module, model_state_dict: dict, *, options=None):
    """torch's ``set_model_state_dict`` for models with RaggedShard parameters.

    A full state dict (``options.full_state_dict``) is loaded tensor by tensor: with
    ``broadcast_from_rank0`` rank 0's tensor is broadcast first; each ragged parameter then
    copies its own piece (``copy_`` from the full tensor), plain tensors are copied whole.
    Sharded state dicts go to torch's function."""
    from torch.distributed.checkpoint import state_dict as sd_mod

    torch_fn = _originals.get(("torch.distributed.checkpoint.state_dict", "set_model_state_dict"),
                              sd_mod.set_model_state_dict)
    if options is None or not getattr(options, "full_state_dict", False):
        return torch_fn(model, model_state_dict, options=options)
    broadcast = getattr(options, "broadcast_from_rank0", False) and dist.is_initialized()
    strict = getattr(options, "strict", True)
    current = model.state_dict()
    missing = [k for k in current if k not in model_state_dict] if (not broadcast or dist.get_rank() == 0) else []
    if broadcast:
        box = [missing]
        dist.broadcast_object_list(box, src=0)
        missing = box[0]
    if strict and missing:
        raise RuntimeError(f"set_model_state_dict: missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}")
    unexpected = [k for k in model_state_dict if k not in current]
    with torch.no_grad():
        for key, target in current.items():
            if key in missing:
                continue
            local_shape = target.shape
            if broadcast:
                if dist.get_rank() == 0:
                    full = model_state_dict[key].detach().to(device=_local(target).device, dtype=target.dtype)
                    full = full.contiguous()
                else:
                    full = torch.empty(local_shape, dtype=target.dtype, device=_local(target).device)
                dist.broadcast(full, src=0)
            else:
                full = model_state_dict[key].detach()
            if isinstance(target, RaggedDTensor):
                target.copy_(full.to(dtype=target.dtype, device=_local(target).device))
            elif isinstance(target, torch.distributed.tensor.DTensor):
                target.copy_(torch.distributed.tensor.distribute_tensor(full, target.device_mesh, target.placements))
            else:
                target.copy_(full)
    from torch.nn.modules.module import _IncompatibleKeys

    return _IncompatibleKeys(missing, unexpected)


def _distribute_tensors_ragged(local_state_dict, keys, device, pg=None):
    """torch's ``_distribute_tensors`` (full optimizer state -> this rank's shards, used by
    ``set_optimizer_state_dict(full_state_dict=True, broadcast_from_rank0=True)``) computes
    Shard offsets; ragged entries copy their own piece out of the full tensor instead."""
    torch_fn = _originals[("torch.distributed._state_dict_utils", "_distribute_tensors")]
    plain = []
    for key in keys:
        entry = local_state_dict.get(key)
        if entry is None or torch.is_tensor(entry) or not isinstance(entry[0], RaggedDTensor):
            plain.append(key)
            continue
        local_state, full = entry
        if local_state.is_meta:
            local_state_dict[key] = _ragged_distribute_tensor(
                full, local_state.device_mesh, local_state.placements, src_data_rank=None
            )
        else:
            local_state.copy_(full.to(device=_local(local_state).device, dtype=local_state.dtype))
            local_state_dict[key] = local_state
    return torch_fn(local_state_dict, plain, device, pg)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, torch.distributed.tensor.DTensor) else t


@contextlib.contextmanager
def _accelerate_sees_ragged():
    """While accelerate's FSDP2 functions run, the names they import at call time from torch
    resolve to ragged_fsdp's (or ragged-aware) versions."""
    fsdp = importlib.import_module("torch.distributed.fsdp")
    tensor = importlib.import_module("torch.distributed.tensor")
    sd_mod = importlib.import_module("torch.distributed.checkpoint.state_dict")
    sdu = importlib.import_module("torch.distributed._state_dict_utils")
    saved = [(fsdp, "fully_shard", fsdp.fully_shard), (tensor, "distribute_tensor", tensor.distribute_tensor),
             (sd_mod, "set_model_state_dict", sd_mod.set_model_state_dict),
             (sdu, "_distribute_tensors", sdu._distribute_tensors)]
    _originals.setdefault(("torch.distributed.checkpoint.state_dict", "set_model_state_dict"),
                          sd_mod.set_model_state_dict)
    _originals.setdefault(("torch.distributed._state_dict_utils", "_distribute_tensors"), sdu._distribute_tensors)
    fsdp.fully_shard = _ragged_fully_shard
    tensor.distribute_tensor = _ragged_distribute_tensor
    sd_mod.set_model_state_dict = set_model_state_dict
    sdu._distribute_tensors = _distribute_tensors_ragged
    try:
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


def _wrap(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _accelerate_sees_ragged():
            return fn(*args, **kwargs)

    wrapper.__ragged_fsdp_original__ = fn
    return wrapper


def _refuse_unsharded(state, fsdp_plugin) -> None:
    """An FSDP plugin with accelerate's distributed type ``NO``: accelerate drops the plugin
    and every process trains the whole model alone, with no sharding, no gradient reduction
    and no warning. Refused rather than warned about: N full copies training apart look like
    one healthy run in the logs (each rank prints its own plausible loss), cost N times the
    memory, and write N checkpoints over one another; a warning among N ranks' output is
    easily missed, and the fix is one argument."""
    import os

    from accelerate.state import AcceleratorState

    # nothing was started (type NO joins no process group): forget the refused state, so that
    # Accelerator(cpu=True, ...) can be built next in this process
    AcceleratorState._reset_state(reset_partial_state=True)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        raise RaggedAccelerateError(
            f"ragged_fsdp.integrations.accelerate: Accelerator(fsdp_plugin=...) in one of WORLD_SIZE={world} "
            "launched processes, but accelerate chose distributed type NO (no accelerator found, and "
            "cpu=True not passed): each process would train the whole model on its own, unsharded and "
            "never synchronised. On a CPU machine pass Accelerator(cpu=True, fsdp_plugin=...): accelerate "
            "then joins the processes (gloo) and ragged_fsdp shards the model over them"
        )
    raise RaggedAccelerateError(
        "ragged_fsdp.integrations.accelerate: Accelerator(fsdp_plugin=...) in a single process "
        "(no launcher set WORLD_SIZE): accelerate chose distributed type NO and would ignore the plugin, "
        "sharding nothing. On a machine without GPUs `accelerate launch --num_processes N` starts one "
        "process only: launch the ranks with `torchrun --nproc_per_node N train.py` and build "
        "Accelerator(cpu=True, fsdp_plugin=...); to train in one process, leave fsdp_plugin out"
    )


def _take_fsdp_branch_on_cpu(state, fsdp_plugin) -> None:
    """What accelerate's ``AcceleratorState`` does for an FSDP plugin on GPUs, done on
    ``MULTI_CPU`` (where accelerate would silently use DDP); an FSDP plugin that accelerate
    would silently ignore (distributed type ``NO``) is refused."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if fsdp_plugin is None:
        return
    if state.distributed_type == DistributedType.NO:
        _refuse_unsharded(state, fsdp_plugin)
    if state.distributed_type != DistributedType.MULTI_CPU:
        return
    if getattr(fsdp_plugin, "fsdp_version", 1) != 2:
        # accelerate's FSDP1 plugin refuses a CPU machine when it is built (with
        # sync_module_states; see _wrap_plugin_post_init); one made before (and handed
        # over) would run as DDP here
        raise RaggedAccelerateError(_fsdp1_refusal(fsdp_plugin.fsdp_version, "would run as DDP (accelerate's MULTI_CPU)"))
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.distributed_type = DistributedType.FSDP
    if state._mixed_precision != "no":
        fsdp_plugin.set_mixed_precision(state._mixed_precision)
    state.fsdp_plugin = fsdp_plugin


def _fsdp1_refusal(version, what: str) -> str:
    return (
        f"ragged_fsdp.integrations.accelerate: FullyShardedDataParallelPlugin(fsdp_version={version}) on a CPU "
        f"machine {what}; ragged_fsdp runs accelerate's FSDP2 path only: pass fsdp_version=2, or set the "
        "environment variable FSDP_VERSION=2 where the plugin is built from the environment (accelerate "
        "launch's config, and transformers' Trainer: transformers 4.57 does not pass fsdp_config's "
        "'fsdp_version' on, so it needs FSDP_VERSION=2)")


def _wrap_plugin_post_init(post_init):
    """accelerate's FSDP1 plugin with ``sync_module_states`` (transformers' Trainer default)
    fails on a CPU machine while it is built, with "no available devices found": an error
    that does not say the version is what to change."""
    @functools.wraps(post_init)
    def __post_init__(self):
        try:
            post_init(self)
        except RuntimeError as e:
            if getattr(self, "fsdp_version", None) != 1 or "no available devices" not in str(e):
                raise
            raise RaggedAccelerateError(_fsdp1_refusal(1, f"fails in accelerate ({e})")) from e

    __post_init__.__ragged_fsdp_original__ = post_init
    return __post_init__


def _wrap_state_init(init):
    @functools.wraps(init)
    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        _take_fsdp_branch_on_cpu(self, fsdp_plugin)

    __init__.__ragged_fsdp_original__ = init
    return __init__


def enable() -> None:
    """Make accelerate's FSDP2 path (``fsdp_version=2``) use ragged_fsdp, on CPU machines
    too. Call once, before ``Accelerator(...)``; idempotent."""
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState

    if not hasattr(AcceleratorState.__init__, "__ragged_fsdp_original__"):
        AcceleratorState.__init__ = _wrap_state_init(AcceleratorState.__init__)
    if not hasattr(FullyShardedDataParallelPlugin.__post_init__, "__ragged_fsdp_original__"):
        FullyShardedDataParallelPlugin.__post_init__ = _wrap_plugin_post_init(FullyShardedDataParallelPlugin.__post_init__)
    for name, modules in _WRAPPED.items():
        for modname in modules:
            mod = importlib.import_module(modname)
            fn = getattr(mod, name, None)
            if fn is None or hasattr(fn, "__ragged_fsdp_original__"):
                continue
            _originals[(modname, name)] = fn
            setattr(mod, name, _wrap(fn))


def disable() -> None:
    """Undo :func:`enable` (accelerate's FSDP2 path uses torch's FSDP2 again)."""
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState

    original = getattr(AcceleratorState.__init__, "__ragged_fsdp_original__", None)
    if original is not None:
        AcceleratorState.__init__ = original
    original = getattr(FullyShardedDataParallelPlugin.__post_init__, "__ragged_fsdp_original__", None)
    if original is not None:
        FullyShardedDataParallelPlugin.__post_init__ = original
    for (modname, name), fn in list(_originals.items()):
        if modname.startswith("accelerate"):
            setattr(importlib.import_module(modname), name, fn)
            del _originals[(modname, name)]


def is_enabled() -> bool:
    fu = importlib.import_module("accelerate.utils.fsdp_utils")
    return hasattr(fu.fsdp2_prepare_model, "__ragged_fsdp_original__")
