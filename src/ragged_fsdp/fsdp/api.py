"""``fully_shard`` and ``FSDPModule``: the drop-in for ``torch.distributed.fsdp``.

    from ragged_fsdp import fully_shard          # instead of torch.distributed.fsdp

    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)

Same call shape and module methods as torch's FSDP2. New: ``granularity_fn(name, param)``
returns a granularity spec (``"row"``, ``"rows:16"``, ``"block:256"``, ``"tensor"``, ...) that
the planner keeps whole on one rank, or None. When ``fully_shard`` returns, the module's
parameters are RaggedShard DTensors whose local tensors are views into the group's DBuffer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.tensor
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import CPUOffloadPolicy

from .collectives import Comm
from .device import device_for
from .param_group import ParamGroup
from .sharded_param import is_sharded_param, local_of
from .state import FSDPState

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "state_of"]

_STATE_ATTR = "_ragged_fsdp_state"
_managed_params: dict[int, weakref.ref] = {}  # id -> original parameters a group took
_fsdp_classes: dict[type, type] = {}


def state_of(module: nn.Module) -> FSDPState | None:
    return module.__dict__.get(_STATE_ATTR)


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    granularity_fn: Callable[[str, nn.Parameter], Any] | None = None,
    shard_placement_fn: Any = None,
    dp_mesh_dims: Any = None,
):
    """Shard ``module``'s parameters (those not already in a group below it) over ``mesh``.

    Apply bottom-up: blocks first, then the root. Returns the module, now an instance of
    :class:`FSDPModule`. See torch's ``fully_shard`` for ``reshard_after_forward``,
    ``mp_policy``, ``offload_policy`` and ``ignored_params``.
    """
    if shard_placement_fn is not None:
        raise ValueError(
            "ragged_fsdp.fully_shard: shard_placement_fn is not supported; placements come from "
            "the planner. Use granularity_fn(name, param) -> 'row' | 'rows:N' | 'block:N' | "
            "'tensor' | None to say which blocks must stay whole on one rank"
        )
    if dp_mesh_dims is not None:
        raise ValueError(
            "ragged_fsdp.fully_shard: dp_mesh_dims is not supported yet; pass the 1-D "
            "data-parallel mesh (e.g. mesh['dp']). Multi-dimensional meshes (HSDP, TP/EP "
            "composition) are the next step; per-parameter layout is set with granularity_fn"
        )
    modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    if not modules:
        raise ValueError("fully_shard: got an empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard: expected nn.Module(s), got {type(m).__name__}")
        if state_of(m) is not None:
            raise ValueError(f"fully_shard: {type(m).__name__} is already wrapped; apply fully_shard once per module")
    mesh = mesh if mesh is not None else _default_mesh()
    _validate_mesh(mesh)
    device = _mesh_device(mesh)
    if isinstance(offload_policy, CPUOffloadPolicy) and device.type != "cpu":
        raise NotImplementedError(
            "fully_shard: CPUOffloadPolicy on an accelerator mesh is not implemented yet; "
            "on a CPU mesh parameters already live on the CPU"
        )
    W = mesh.size()
    raf = _reshard_after_forward(reshard_after_forward, W)
    ignored = set(ignored_params or ())
    params = _collect_params(modules, ignored)
    param_device = _param_device(params, device)
    _move_buffers(modules, device, param_device)
    state = FSDPState(modules, mp_policy, auto_reshard=reshard_after_forward is None)
    if params:
        comm = Comm.of(mesh.get_group())
        group = ParamGroup(
            params, modules, mesh, comm, param_device, device_for(device), mp_policy,
            granularity_fn, raf,
        )
        state.group = group
        if not isinstance(raf, bool):
            group.post_forward_comm = _node_comm(mesh, raf)
        for _, p, _ in params:
            _managed_params[id(p)] = weakref.ref(p)
        _register_state_dict_hooks(group)
    for m in modules:
        m.__dict__[_STATE_ATTR] = state
        _swap_class(m)
    state.offload_policy = offload_policy
    return module


# -- validation and collection -----------------------------------------------------------
def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError("fully_shard: initialise torch.distributed (or pass mesh=) first")
    kind = "cuda" if torch.cuda.is_available() and "nccl" in str(dist.get_backend()) else "cpu"
    return init_device_mesh(kind, (dist.get_world_size(),))


def _validate_mesh(mesh: DeviceMesh) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"fully_shard: got a {mesh.ndim}-D mesh {mesh.mesh_dim_names}; only a 1-D "
            "data-parallel mesh is supported so far (multi-dimensional meshes: HSDP and TP/EP "
            "composition come next). Pass mesh['dp']"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(f"fully_shard: this rank ({dist.get_rank()}) is not in the mesh {mesh}")
    group = mesh.get_group()
    if dist.get_world_size(group) != mesh.size():
        raise ValueError(
            f"fully_shard: the mesh has {mesh.size()} ranks but its process group has "
            f"{dist.get_world_size(group)}; build the mesh from the process group you train on"
        )
    backend = str(dist.get_backend(group)).lower()
    if mesh.device_type == "cpu" and "gloo" not in backend and "cpu:" not in backend:
        raise ValueError(
            f"fully_shard: the mesh is on cpu but its process group uses {backend!r}, which "
            "cannot move CPU tensors; use a gloo process group or a cuda mesh"
        )
    if mesh.device_type == "cuda" and "nccl" not in backend and "gloo" not in backend:
        raise ValueError(f"fully_shard: the mesh is on cuda but its process group uses {backend!r}")


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _reshard_after_forward(value, W: int) -> bool | int:
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


def _node_comm(mesh: DeviceMesh, k: int) -> Comm:
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


def _collect_params(modules, ignored) -> list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]]:
    """Parameters of ``modules`` not in an already-wrapped submodule, each with its name in
    the wrapped module and every (module, attribute) that registers it."""
    out: dict[int, tuple[str, nn.Parameter, list]] = {}
    order: list[int] = []
    multi = len(modules) > 1
    for k, root in enumerate(modules):
        for mod_name, sub in _walk(root):
            for pname, p in list(sub._parameters.items()):
                if p is None or p in ignored:
                    continue
                fqn = f"{mod_name}.{pname}" if mod_name else pname
                if multi:
                    fqn = fqn  # names as in each module's own named_parameters()
                if id(p) not in out:
                    if is_sharded_param(p):
                        raise ValueError(
                            f"fully_shard: parameter {fqn!r} of {type(root).__name__} is already sharded "
                            "by the fully_shard of an enclosing module. Apply fully_shard bottom-up: "
                            "children first, then their parents"
                        )
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


def _walk(root: nn.Module, prefix: str = "", seen=None):
    """Modules under ``root`` (duplicates included, so shared modules register every owner),
    not descending into modules another ``fully_shard`` call wrapped."""
    yield prefix, root
    for name, child in root._modules.items():
        if child is None or state_of(child) is not None:
            continue
        yield from _walk(child, f"{prefix}.{name}" if prefix else name)


def _param_device(params, mesh_device: torch.device) -> torch.device:
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


def _move_buffers(modules, device: torch.device, param_device: torch.device) -> None:
    if param_device.type == "meta":
        return
    for root in modules:
        for _, sub in _walk(root):
            for name, b in list(sub._buffers.items()):
                if b is not None and b.device.type != "meta" and b.device != device:
                    sub._buffers[name] = b.to(device)


def _register_state_dict_hooks(group: ParamGroup) -> None:
    owners = {id(m): m for info in group.infos for m, _ in info.owners}

    def to_sharded(*args, **kwargs):
        group.reshard()

    for m in owners.values():
        m.register_state_dict_pre_hook(to_sharded)
        m._register_load_state_dict_pre_hook(to_sharded)


def _swap_class(module: nn.Module) -> None:
    cls = module.__class__
    if issubclass(cls, FSDPModule):
        return
    new = _fsdp_classes.get(cls)
    if new is None:
        new = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__deepcopy__": _no_deepcopy})
        _fsdp_classes[cls] = new
    module.__class__ = new
    for m in (module,):
        m.register_load_state_dict_post_hook(_adopt_loaded)


def _no_deepcopy(self, memo):
    raise RuntimeError("ragged_fsdp: FSDP modules cannot be deep-copied; use state_dict() to copy weights")


def _adopt_loaded(module: nn.Module, incompatible_keys) -> None:
    """After ``load_state_dict(assign=True)`` replaced parameters, put their data back into
    the DBuffer and register sharded parameters that are views into it again."""
    st = state_of(module)
    if st is not None and st.group is not None:
        adopt_registered(st.group)


def adopt_registered(group: ParamGroup) -> None:
    from ragged_fsdp.placement import RaggedDTensor
    from ragged_fsdp.placement.dtensor import element_ranges

    group.reshard()
    changed = False
    new_locals: list[torch.Tensor | None] = []
    for info in group.infos:
        mod, name = info.owners[0]
        cur = mod._parameters.get(name)
        if cur is None or cur is info.sharded:
            new_locals.append(None)
            continue
        changed = True
        buf = group.buffers[info.buffer]
        slot = buf.slots[info.slot]
        if isinstance(cur, RaggedDTensor) and element_ranges(cur._spec) == element_ranges(info.sharded._spec):
            local = cur._local_tensor
        else:
            full = cur.full_tensor() if isinstance(cur, torch.distributed.tensor.DTensor) else cur
            if tuple(full.shape) != slot.shape:
                raise ValueError(f"load_state_dict: {info.fqn} has shape {tuple(full.shape)}, expected {slot.shape}")
            a, b = slot.placement.element_range(slot.shape, buf.rank)
            local = full.detach().reshape(-1)[a:b]
        if cur.requires_grad != info.sharded.requires_grad:
            info.sharded.requires_grad_(cur.requires_grad)
        new_locals.append(local.detach())
    if changed:
        group.adopt_locals(new_locals)


# -- the module class --------------------------------------------------------------------
class UnshardHandle:
    def __init__(self, group: ParamGroup | None):
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule:
    """Mixed into the class of every module ``fully_shard`` wraps (as torch's FSDP2 does)."""

    def __new__(cls, *args, **kwargs):
        # Containers re-create modules through their class (e.g. slicing a ModuleList):
        # build the original class, not the FSDP one.
        orig = cls.__mro__[2]
        self = orig.__new__(orig, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def _fsdp_state(self) -> FSDPState:
        st = state_of(self)
        if st is None:
            raise AssertionError(f"no ragged_fsdp state on {type(self).__name__}")
        return st

    def _fsdp_states(self, recurse: bool):
        if not recurse:
            return [self._fsdp_state()]
        out, seen = [], set()
        for m in self.modules():
            st = state_of(m)
            if st is not None and id(st) not in seen:
                seen.add(id(st))
                out.append(st)
        return out

    # -- explicit control ----------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters (not recursive); with ``async_op`` return a
        handle to wait on (the pre-forward waits if you do not)."""
        g = self._fsdp_state().group
        if g is not None:
            g.unshard(async_op=async_op)
        handle = UnshardHandle(g)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones (not recursive)."""
        g = self._fsdp_state().group
        if g is not None:
            g.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: accumulate unsharded gradients locally, no reduce-scatter (no_sync)."""
        for st in self._fsdp_states(recurse):
            if st.group is not None:
                st.group.reduce_grads = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"set_reshard_after_forward: expected a bool, got {reshard_after_forward!r}")
        for st in self._fsdp_states(recurse):
            st.auto_reshard = False
            if st.group is not None:
                st.group.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for st in self._fsdp_states(recurse):
            if st.group is not None:
                st.group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters (async) when this module's forward starts."""
        self._fsdp_state().forward_prefetch = [_require_fsdp(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters (async) when this module's backward starts."""
        self._fsdp_state().backward_prefetch = [_require_fsdp(m) for m in modules]

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        self._fsdp_state().ctx.is_last_backward = is_last_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        g = self._fsdp_state().group
        if g is not None:
            g.unshard_in_backward = unshard_in_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        for st in self._fsdp_states(True):
            if st.group is not None:
                st.group.gradient_divide_factor = factor

    @property
    def dbuffers(self):
        """The DBuffers of this module's group (one per parameter dtype / trainability)."""
        g = self._fsdp_state().group
        return list(g.buffers) if g is not None else []

    # -- re-pointing after nn.Module._apply (.to(), to_empty(), .half(), ...) ---------------
    def _apply(self, fn, recurse: bool = True):
        st = state_of(self)
        g = st.group if st is not None else None
        if g is None:
            return super()._apply(fn, recurse)
        g.reshard()
        plain = []
        for info in g.infos:
            local = local_of(info.sharded).detach()
            p = nn.Parameter(local, requires_grad=info.sharded.requires_grad)
            info.register(p)
            plain.append(p)
        try:
            out = super()._apply(fn, recurse)
        finally:
            new = []
            for info in g.infos:
                mod, name = info.owners[0]
                new.append(mod._parameters[name].detach())
            g.adopt_locals(new)
        return out


def _require_fsdp(m) -> FSDPState:
    st = state_of(m) if isinstance(m, nn.Module) else None
    if st is None:
        raise ValueError(f"expected a module wrapped by ragged_fsdp.fully_shard, got {type(m).__name__}")
    return st
