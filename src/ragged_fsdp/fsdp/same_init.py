"""Ranks start from the same values: a check, and the copy that makes it true.

``fully_shard`` keeps each rank's own slice of the tensors it is given, so a model whose
ranks built different values (a LoRA adapter or a new head initialised from each rank's own
random state, a rank that loaded another checkpoint) trains a model nobody built, silently.
torch's FSDP1 had ``sync_module_states=True`` (broadcast rank 0's parameters and buffers
before sharding); FSDP2, and so ``fully_shard``, has none. Call these before ``fully_shard``:

* :func:`check_same_init` compares a 64-bit fingerprint (BLAKE2b of the bytes) of every
  parameter and buffer across the ranks: one ``all_gather_object`` through
  ``ragged_fsdp.agreement``, so a difference raises on every rank, naming the tensors;
* :func:`sync_module_states` copies rank ``src``'s values to every rank (one broadcast per
  tensor), FSDP1's ``sync_module_states`` for modules that ``fully_shard`` has not sharded yet.

Tensors already sharded (DTensors: their pieces differ by design) and meta tensors (no values
yet) are skipped by both.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..agreement import DisagreementError, agree

__all__ = ["check_same_init", "sync_module_states"]

FIX = ("build the model from the same seed on every rank (torch.manual_seed(s) before building or "
       "adding adapters), or copy rank 0's values before fully_shard with "
       "ragged_fsdp.sync_module_states(model) (FSDP1's sync_module_states=True)")


def _tensors(module: torch.nn.Module):
    """(name, tensor) of every parameter and buffer that has values of its own on this rank."""
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t is None or isinstance(t, DTensor) or t.is_meta:
            continue
        yield name, t


def _group(mesh):
    """The one process group to broadcast over: the world, a group, or a DeviceMesh's ranks."""
    if mesh is None or not hasattr(mesh, "get_group"):
        return mesh
    if mesh.ndim == 1:
        return mesh.get_group(0)
    if mesh.size() == dist.get_world_size():
        return None  # an n-D mesh over every rank: the world group holds the same ranks
    raise ValueError(f"sync_module_states(mesh=...): a {mesh.ndim}-D mesh of {mesh.size()} of "
                     f"{dist.get_world_size()} ranks; pass a 1-D mesh, a process group, or None (the world)")


def _fingerprint(t: torch.Tensor) -> str:
    raw = torch.Tensor.detach(t)  # the plain tensor's method: a weight subclass may override its own
    if raw.device.type != "cpu":
        raw = raw.to("cpu")
    raw = raw.contiguous().reshape(-1)
    return hashlib.blake2b(raw.view(torch.uint8).numpy().tobytes(), digest_size=8).hexdigest()


def check_same_init(module: torch.nn.Module, mesh=None, *, show: int = 5) -> int:
    """Raise ``DisagreementError`` on every rank if any parameter or buffer of ``module``
    differs between ranks (of ``mesh``, a DeviceMesh or process group; default: the world),
    naming up to ``show`` of them and the fix. Returns how many tensors it compared.

    Collective: call it on every rank, before ``fully_shard``."""
    prints = {name: (tuple(t.shape), str(t.dtype), _fingerprint(t)) for name, t in _tensors(module)}
    every = agree("the parameter and buffer fingerprints", prints, group=mesh, same=False)
    differ = [name for name in prints if any(r.get(name) != prints[name] for r in every)]
    names = set(prints)
    missing = sorted({n for r in every for n in set(r) ^ names})
    if missing:
        raise DisagreementError(
            f"ragged_fsdp.check_same_init: ranks hold different parameter and buffer names (e.g. "
            f"{', '.join(missing[:show])}); build the same model on every rank")
    if differ:
        more = f" and {len(differ) - show} more" if len(differ) > show else ""
        raise DisagreementError(
            f"ragged_fsdp.check_same_init: {len(differ)} of {len(prints)} parameters and buffers start from "
            f"different values on different ranks: {', '.join(differ[:show])}{more}. fully_shard would keep "
            f"each rank's own slice of them (a model no rank built). Fix: {FIX}")
    return len(prints)


@torch.no_grad()
def sync_module_states(module: torch.nn.Module, mesh=None, *, src: int = 0) -> int:
    """Copy rank ``src``'s parameters and buffers to every rank of ``mesh`` (a DeviceMesh or
    process group; default: the world), in place. Returns how many tensors it copied.

    Collective: call it on every rank, after the model is built and before ``fully_shard``
    (tensors ``fully_shard`` already sharded are skipped). ``src`` is a global rank."""
    group = _group(mesh)
    tensors = list(_tensors(module))
    agree("sync_module_states' tensor names", [n for n, _ in tensors], group=group,
          fix="build the same model (same parameter and buffer names) on every rank")
    for _, t in tensors:
        dist.broadcast(t.data, src=src, group=group)
    return len(tensors)
