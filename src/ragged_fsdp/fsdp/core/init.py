"""What ``fully_shard`` checks and collects before it builds a group.

Mesh validation, the device parameters live on, which parameters a call manages (those
of its modules not inside an already-wrapped submodule, each with every module attribute
that registers it), and the bookkeeping that catches wrapping twice, children after their
parent and tied parameters split across groups.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..comms.collectives import Comm
from .sharded_param import is_sharded_param
from .unit import UnitGroup

__all__ = [
    "state_of", "set_state", "mark_managed", "mark_sharded", "resolve_reshard_after_forward", "node_comm",
    "collect_params", "ignored_names", "walk", "param_device", "move_buffers",
]

_STATE_ATTR = "_ragged_fsdp_state"
# Both keyed by id (a weakref on a parameter makes swap_tensors, which re-points it after .to(),
# refuse it) and pruned by a weakref callback when what the entry names is gone, so an id
# that Python reuses for a new object never finds a stale entry and neither map grows.
_managed_params: dict[int, weakref.ref] = {}  # id -> original parameters a group took
_group_sharded: dict[int, weakref.ref] = {}  # id of a sharded parameter -> the group that made it


def state_of(module: nn.Module):
    """The FSDPState of a wrapped module, or None."""
    return module.__dict__.get(_STATE_ATTR)


def set_state(module: nn.Module, state) -> None:
    module.__dict__[_STATE_ATTR] = state


def _pruned(registry: dict, key: int):
    def forget(ref, registry=registry, key=key):
        if registry.get(key) is ref:
            del registry[key]
    return forget


def mark_managed(param: nn.Parameter) -> None:
    """Remember that a group took ``param`` (to catch a tied parameter split across groups)."""
    _managed_params[id(param)] = weakref.ref(param, _pruned(_managed_params, id(param)))


def mark_sharded(group: UnitGroup) -> None:
    """Remember the sharded parameters ``group`` made (weakly: the entries go with the group)."""
    keys = [id(info.sharded) for info in group.infos]

    def forget(ref, keys=keys):
        for k in keys:
            if _group_sharded.get(k) is ref:
                del _group_sharded[k]

    ref = weakref.ref(group, forget)
    for k in keys:
        _group_sharded[k] = ref


def group_of(p):
    """The live group that made sharded parameter ``p``, or None (the one map from a sharded
    parameter to its group: the offload policy is found through it too)."""
    ref = _group_sharded.get(id(p))
    group = ref() if ref is not None else None
    if group is None or not any(info.sharded is p for info in group.infos):
        return None
    return group


def _made_by_a_group(p) -> bool:
    return group_of(p) is not None


def _already_sharded(fqn: str, root: nn.Module, p) -> ValueError:
    if _made_by_a_group(p):
        return ValueError(
            f"fully_shard: parameter {fqn!r} of {type(root).__name__} is already sharded by the "
            "fully_shard of an enclosing module. Apply fully_shard bottom-up: children first, "
            "then their parents"
        )
    return ValueError(
        f"fully_shard: parameter {fqn!r} of {type(root).__name__} is a RaggedShard DTensor "
        f"(placements {tuple(p.placements)}) that no fully_shard made. fully_shard takes the full "
        "parameters and lays out the RaggedShard itself: register the full tensor instead (e.g. "
        "nn.Parameter(t.full_tensor())), or a torch DTensor for tensor/expert parallelism"
    )


def resolve_reshard_after_forward(value, W: int) -> bool | int:
    if value is None:
        return True
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        if value == 1:
            return False
        if value == W:
            return True
        if value < 1 or W % value:
            raise ValueError(
                f"fully_shard: reshard_after_forward={value} must be a bool or a divisor of the "
                f"mesh size {W} (the number of ranks to keep the parameters sharded over)"
            )
        return value
    raise TypeError(f"fully_shard: reshard_after_forward must be bool or int, got {type(value).__name__}")


_node_comms: dict[tuple, Comm] = {}


def node_comm(mesh: DeviceMesh, k: int) -> Comm:
    """The process group of this rank's 'node' (k consecutive mesh ranks) for
    reshard_after_forward=k. Every rank creates every node group, in the same order."""
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    key = (tuple(ranks), k)
    if key not in _node_comms:
        mine = None
        for start in range(0, len(ranks), k):
            g = dist.new_group(ranks[start:start + k])
            if dist.get_rank() in ranks[start:start + k]:
                mine = g
        _node_comms[key] = Comm.of(mine)
    return _node_comms[key]


def collect_params(modules, ignored) -> list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]]:
    """Parameters of ``modules`` not in an already-wrapped submodule, each with its name in
    the wrapped module and every (module, attribute) that registers it."""
    out: dict[int, tuple[str, nn.Parameter, list]] = {}
    order: list[int] = []
    for k, root in enumerate(modules):
        for mod_name, sub in walk(root):
            for pname, p in list(sub._parameters.items()):
                if p is None or p in ignored:
                    continue
                fqn = f"{mod_name}.{pname}" if mod_name else pname
                if id(p) not in out:
                    if is_sharded_param(p):
                        raise _already_sharded(fqn, root, p)
                    ref = _managed_params.get(id(p))
                    if ref is not None and ref() is p:
                        raise ValueError(
                            f"fully_shard: parameter {fqn!r} is shared (tied) with a parameter another "
                            "fully_shard group already manages. Put every module that uses it in one "
                            "group: wrap their common parent, or fully_shard([module_a, module_b])"
                        )
                    out[id(p)] = (fqn, p, [])
                    order.append(id(p))
                out[id(p)][2].append((sub, pname))
    return [out[i] for i in order]


def ignored_names(modules, ignored) -> tuple[str, ...]:
    """``ignored_params`` as ``name shape`` strings of the parameters they hide under
    ``modules``: rank-independent, so ranks can agree on them (objects cannot be compared)."""
    if not ignored:
        return ()
    out = []
    for k, root in enumerate(modules):
        for mod_name, sub in walk(root):
            for pname, p in sub._parameters.items():
                if p is not None and p in ignored:
                    out.append(f"{k}:{mod_name + '.' if mod_name else ''}{pname} {tuple(p.shape)}")
    return tuple(out)


def walk(root: nn.Module, prefix: str = ""):
    """Modules under ``root`` (duplicates included, so shared modules register every owner),
    not descending into modules another ``fully_shard`` call wrapped."""
    yield prefix, root
    for name, child in root._modules.items():
        if child is None or state_of(child) is not None:
            continue
        yield from walk(child, f"{prefix}.{name}" if prefix else name)


def param_device(params, mesh_device: torch.device) -> torch.device:
    devices = {p.device for _, p, _ in params}
    if len(devices) > 1:
        where = {}
        for name, p, _ in params:
            where.setdefault(str(p.device), name)
        raise ValueError(
            "fully_shard: parameters are on mixed devices "
            + ", ".join(f"{d} (e.g. {n})" for d, n in where.items())
            + "; move the module to one device (or build it on meta) before fully_shard"
        )
    if not devices:
        return mesh_device
    d = next(iter(devices))
    if d.type == "meta":
        return d
    if d.type != mesh_device.type:
        if mesh_device.type == "cpu":
            raise ValueError(
                f"fully_shard: parameters are on {d} but the mesh is on cpu; use a {d.type} mesh "
                "or move the module to the CPU first"
            )
        return mesh_device  # CPU parameters go to the mesh's accelerator, as in torch
    return mesh_device


def move_buffers(modules, device: torch.device, param_device: torch.device) -> None:
    if param_device.type == "meta":
        return
    for root in modules:
        for _, sub in walk(root):
            for name, b in list(sub._buffers.items()):
                if b is not None and b.device.type != "meta" and b.device != device:
                    sub._buffers[name] = b.to(device)
