"""Unit: one DBuffer of a group at run time, with everything that is per buffer.

A group (:mod:`.param_group`) holds one unit per DBuffer. The unit holds the buffer, its
data-parallel mesh (:class:`~.mesh_info.DPMesh`), the :class:`ParamInfo` of every parameter
laid out in it, and the state of that one buffer in a step:

* ``freed``: its unsharded buffer was freed while the group still counts as unsharded (the
  next unshard gathers it again; its parameters are registered sharded meanwhile);
* ``post_forward_comm`` / ``kept``: ``reshard_after_forward=k`` keeps this rank's 1/k of the
  unsharded buffer after forward and gathers within those k ranks for backward;
* ``last_grad_seg``: the sharded gradient segment its grads point into, reused when the next
  reduction accumulates into the same grads;
* ``partial`` / ``partial_touched``: HSDP with ``set_requires_all_reduce(False)``: shard-dim
  sums waiting for a reduction that all-reduces over the replicate dim;
* ``embedding``: its parameters are untied ``nn.Embedding`` weights only (backward may skip
  gathering it, see :mod:`.backward`, which keeps what backward learns about each unit).

Every field is written here only: the group and the reductions call the methods below. It
owns what is done to that one buffer: gather (issue), register the unsharded or sharded
parameters, free, keep a part after forward, take its gradient for a reduction, keep HSDP's
partial sums and hand the reduced gradient out to the sharded parameters. When collectives
run, and in what order across units and groups, is the group's and the reduction owner's
(:mod:`.reduction`) call.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ragged_fsdp.dbuffer import DBuffer

from .. import tracing as trace
from ..comms.collectives import Comm, all_gather
from ...device import Device, Pending
from ..comms.mx_gather import MXState, mx_all_gather, mx_wire_bytes
from ..comms.quant_gather import quant_all_gather
from ..comms.wire_reduce import WireState
from ..comms.custom import CommHooks
from .mesh_info import DPMesh
from .sharded_param import local_of, make_sharded_grad

__all__ = ["ParamInfo", "Unit", "HostSide", "UnitGroup", "Building"]


class HostSide(Protocol):
    """What a unit calls of its host side under ``offload_policy`` (``offload/staging.py``'s
    ``UnitOffload``, handed in by ``attach_offload``; the offload layer sits above this one)."""

    def stage(self, unit: Unit) -> Pending | None: ...

    def release_staged(self, unit: Unit) -> None: ...

    def grads_to_host(self, unit: Unit, target: torch.Tensor) -> tuple[torch.Tensor, Pending | None]: ...


@dataclass
class ParamInfo:
    fqn: str  # as in the wrapped module's named_parameters()
    buffer: int  # index of its unit in the group
    slot: int  # index into that buffer's layout
    owners: list[tuple[nn.Module, str]]  # every (module, attribute) registering it (tied params)
    sharded: nn.Parameter
    unsharded: nn.Parameter | None = None
    unsharded_spec: Any = None  # DTensorSpec of a TP/EP parameter's unsharded DTensor, or None
    dp_dims: tuple[int, ...] = ()  # dims of that spec's mesh that are data-parallel (dp_mesh_dims)

    def register(self, param: nn.Parameter) -> None:
        for module, name in self.owners:
            module._parameters[name] = param

    # ``unsharded`` is made at the first gather and reused by every later one (its view of the
    # unsharded buffer stays a valid object across free and re-gather): these two write it.
    def set_unsharded(self, param: nn.Parameter) -> nn.Parameter:
        self.unsharded = param
        return param

    def forget_unsharded(self) -> None:
        """Its views point into storage that is gone (the buffer was rebuilt): made anew at the next gather."""
        self.unsharded = None


def _local_grad(g: DTensor, spec, dp_dims: tuple[int, ...] = ()) -> torch.Tensor:
    """A TP/EP parameter's DTensor gradient as a local tensor in the parameter's own
    placements (a Partial gradient, e.g. of a norm weight under SequenceParallel, is summed
    over its TP ranks first, as torch's FSDP2 does). Data-parallel dims are left as they
    are: a Partial there is exactly what the reduction sums."""
    with torch.no_grad():
        want = tuple(g.placements[i] if i in dp_dims else p for i, p in enumerate(spec.placements))
        if tuple(g.placements) != want:
            g = g.redistribute(g.device_mesh, want)
        local = g.to_local()
        if type(local).__name__ == "AsyncCollectiveTensor":
            local = local.wait()
    return local


class Unit:
    """One DBuffer and its per-step state (see the module docstring)."""

    reduces_early = True  # may be reduced before the group's post-backward (see .backward)

    def __init__(self, index: int, buf: DBuffer, dp: DPMesh, infos: list[ParamInfo], *, embedding: bool,
                 hooks: CommHooks, post_forward_comm: Comm | None,
                 group_name: Callable[[], str], after_grad: Callable[[torch.Tensor], None]):
        self.index = index
        self.buf = buf
        self.dp = dp
        self.infos = infos
        self.embedding = embedding
        self.freed = False
        self.post_forward_comm = post_forward_comm  # reshard_after_forward=k: the k ranks that keep parts
        self.kept: torch.Tensor | None = None
        self.last_grad_seg: weakref.ref | None = None
        self.partial: torch.Tensor | None = None
        self.partial_touched: list[bool] | None = None
        self.group_name = group_name
        self._after_grad = after_grad
        self.hooks = hooks  # the group's custom comms and hook (the group's object, shared)
        self.offload: HostSide | None = None  # fully_shard(offload_policy=...): offload/staging.py's UnitOffload
        self.wire: WireState | None = None  # fully_shard(gradient_reduce=...): blocks and residual

    def __repr__(self) -> str:
        return f"Unit({self.group_name()}#{self.index}, {len(self.infos)} tensors, {self.buf!r})"

    @property
    def comm(self) -> Comm:
        return self.dp.shard

    @property
    def trainable(self) -> bool:
        return any(i.sharded.requires_grad for i in self.infos)

    def unsharded_bytes(self) -> int:
        return self.buf.layout.total * self.buf.compute_dtype.itemsize

    # -- gather / free -----------------------------------------------------------------
    def gather(self, dev: Device, from_kept: bool, for_backward: bool = False) -> Pending | None:
        """Issue the all-gather of the unsharded buffer (None: nothing to gather, the
        unsharded buffer is the sharded segment). ``from_kept``: from the parts the ranks
        of ``post_forward_comm`` kept after forward. ``for_backward``: an MXFP8 / NVFP4 buffer then
        moves its column plane (the input gradient's), else its row plane."""
        buf = self.buf
        custom = self.hooks.all_gather
        plane = None
        if from_kept:
            p = all_gather(dev, self.post_forward_comm, buf, inp=self.kept, custom=custom)
        elif isinstance(buf.quant, MXState):  # MXFP8 / NVFP4: one plane per gather
            plane = "cols" if for_backward else "rows"
            staged = self.offload.stage(self) if self.offload is not None else None
            p = mx_all_gather(dev, self.comm, buf, plane, after=staged)
        elif buf.quant:
            p = quant_all_gather(dev, self.comm, buf)
        else:
            staged = self.offload.stage(self) if self.offload is not None else None
            p = all_gather(dev, self.comm, buf, custom=custom, after=staged)
        if p is not None:
            wire = mx_wire_bytes(buf, plane) if plane else None
            trace.record("all_gather", self, self.unsharded_bytes(), wire=wire, plane=plane)
        return p

    def attach_offload(self, offload: HostSide) -> None:
        """fully_shard(offload_policy=...): the host side of this unit (offload.staging.UnitOffload)."""
        self.offload = offload

    def release_staged(self) -> None:
        """Its all-gather was waited for: the device copy of a host segment can go."""
        if self.offload is not None:  # nothing staged otherwise (also: subclass units)
            self.offload.release_staged(self)

    def grads_to_host(self, target: torch.Tensor) -> tuple[torch.Tensor, Pending | None]:
        """Where the reduced segment ``target`` is handed out from: itself, or (grads
        offload) a host copy, with the copy to wait for first."""
        if self.offload is None:
            return target, None
        return self.offload.grads_to_host(self, target)

    def gathered(self) -> None:
        """Its all-gather was waited for: the parameters are the unsharded ones, nothing kept."""
        self.freed = False
        self.kept = None
        self.register_unsharded()

    def not_gathered(self) -> None:
        """Left out of the all-gathers that made its group unsharded (backward skips it): it
        counts as freed, so the next unshard gathers it."""
        self.freed = True
        self.kept = None

    def register_unsharded(self) -> None:
        for info in self.infos:
            info.register(self.unsharded_param(info))

    def register_sharded(self) -> None:
        for info in self.infos:
            info.register(info.sharded)

    def free(self) -> None:
        """Free the unsharded buffer (its views stay valid objects)."""
        buf = self.buf
        if not buf.aliased and buf.unsharded_allocated:
            trace.record("free", self, self.unsharded_bytes())
        buf.free_unsharded()

    def free_early(self) -> None:
        """Free it while its group stays unsharded (the next unshard gathers it again); its
        parameters are registered sharded meanwhile."""
        if not self.freed:
            self.free()
            self.register_sharded()
            self.freed = True

    def free_resharded(self) -> None:
        """The group's reshard: free the unsharded buffer and any part kept after forward."""
        self.kept = None
        self.freed = False
        self.free()

    def keep_part(self) -> None:
        """``reshard_after_forward=k``: keep this rank's 1/k of the unsharded buffer, free the rest."""
        comm, buf = self.post_forward_comm, self.buf
        part = buf.layout.total // comm.world_size
        self.kept = buf.unsharded.narrow(0, comm.rank * part, part).clone()
        trace.record("keep", self, self.kept.numel() * self.kept.element_size())
        self.free()

    def unsharded_param(self, info: ParamInfo) -> nn.Parameter:
        buf = self.buf
        p = info.unsharded
        if p is None:
            view = buf.unsharded_views()[info.slot]
            spec = info.unsharded_spec
            if spec is not None:
                # a TP/EP parameter: the module computes with a DTensor of its own mesh and
                # placements whose local tensor is the gathered view (as before fully_shard)
                view = DTensor.from_local(view, spec.mesh, spec.placements, run_check=False,
                                          shape=spec.shape, stride=spec.stride)
            p = info.set_unsharded(nn.Parameter(view, requires_grad=info.sharded.requires_grad))
            if buf.reduce_dtype != buf.compute_dtype and spec is None:
                p.grad_dtype = buf.reduce_dtype
            if p.requires_grad:
                p.register_hook(functools.partial(self._on_grad, info))
                p.register_post_accumulate_grad_hook(self._after_grad)
        elif p.requires_grad != info.sharded.requires_grad:
            p.requires_grad_(info.sharded.requires_grad)
        return p

    # -- gradients -----------------------------------------------------------------------
    def _on_grad(self, info: ParamInfo, grad: torch.Tensor) -> torch.Tensor:
        """Runs before autograd accumulates a gradient into an unsharded parameter: the
        gradient buffer exists from its first gradient on (not from pre-backward), and the
        parameter's ``.grad`` becomes an alias into it, so the accumulation that follows
        writes into the buffer in place."""
        buf = self.buf
        if buf.grad is None:
            buf.alloc_grad(self.hooks.allocate_grad())
        p = info.unsharded
        alias = buf.grad_view(info.slot)
        # a TP/EP DTensor keeps autograd's own DTensor gradient (its placements may be
        # Partial): fold_foreign_grads moves it to the parameter's placements and adds it in
        if info.unsharded_spec is None and p is not None and p.grad is not alias:
            if p.grad is None:
                p.grad = alias
            else:
                self._fold_foreign_grad(info)
        return grad

    def fold_foreign_grads(self) -> None:
        """Add into the gradient buffer every gradient autograd made on its own instead of
        accumulating into the alias."""
        buf = self.buf
        for info in self.infos:
            p = info.unsharded
            if p is None or p.grad is None:
                continue
            if buf.grad is None or info.unsharded_spec is not None or p.grad is not buf.grad_view(info.slot):
                self._fold_foreign_grad(info)

    def _fold_foreign_grad(self, info: ParamInfo) -> None:
        p, buf = info.unsharded, self.buf
        if buf.grad is None:
            buf.alloc_grad(self.hooks.allocate_grad())
        alias = buf.grad_view(info.slot)
        g = p.grad
        p.grad = None
        if isinstance(g, DTensor):
            g = _local_grad(g, info.unsharded_spec, info.dp_dims)
        with torch.no_grad():
            alias.add_(g.reshape(alias.shape).to(alias.dtype))
        if info.unsharded_spec is None:
            p.grad = alias

    def has_pending_grads(self) -> bool:
        return any(i.unsharded is not None and i.unsharded.grad is not None for i in self.infos)

    def take_grad(self) -> tuple[torch.Tensor, list[bool]]:
        """Hand over the gradient buffer to be reduced, with which slots were written; the
        unsharded parameters' ``.grad`` aliases into it are dropped."""
        buf = self.buf
        if buf.grad is None:
            buf.alloc_grad(self.hooks.allocate_grad())  # every rank reduces the same buffers, used here or not
        touched = [buf.grad_touched(i) for i in range(len(buf.slots))]
        grad = buf.take_grad()
        for info in self.infos:
            if info.unsharded is not None:
                info.unsharded.grad = None
        return grad, touched

    def wire_state(self, fmt) -> WireState:
        """The wire format's blocks of this buffer (made once) and its error-feedback residual."""
        if self.wire is None or self.wire.fmt != fmt:
            self.wire = WireState(self.buf.layout, fmt)
        return self.wire

    def commit_residual(self) -> None:
        """The backward completed: error feedback's staged residual becomes the residual."""
        if self.wire is not None and self.wire.residual is not None:
            self.wire.residual.commit()

    def discard_residual(self) -> None:
        """The backward raised before its gradients were handed out: drop the residual its
        reductions staged (error feedback resumes from the last completed backward's)."""
        if self.wire is not None and self.wire.residual is not None:
            self.wire.residual.discard()

    def take_partial(self) -> tuple[torch.Tensor | None, list[bool] | None]:
        """HSDP without the replicate all-reduce: hand over the shard-dim sums kept so far."""
        out = self.partial, self.partial_touched
        self.partial = self.partial_touched = None
        return out

    def keep_partial(self, partial: torch.Tensor, touched: list[bool]) -> None:
        self.partial, self.partial_touched = partial, touched

    def drop_grads(self) -> None:
        """Forget the gradients of a step that raised: the unsharded gradient buffer, the
        unsharded parameters' ``.grad``, HSDP's kept shard-dim sums and the residual its
        reductions staged (error feedback resumes from the last completed backward's)."""
        self.buf.take_grad()
        self.discard_residual()
        for info in self.infos:
            if info.unsharded is not None:
                info.unsharded.grad = None
        self.partial = self.partial_touched = None

    def existing_grads(self) -> tuple[list[bool], dict[int, torch.Tensor]]:
        had = [False] * len(self.buf.slots)
        existing = {}
        for info in self.infos:
            if info.sharded.grad is not None:
                had[info.slot] = True
                existing[info.slot] = info.sharded.grad
        return had, existing

    def accumulation_target(self, existing: dict[int, torch.Tensor]) -> torch.Tensor:
        """The sharded gradient segment to add into: the last one we made if every existing
        grad still lives in it, else a fresh one holding the existing grads."""
        buf = self.buf
        ref = self.last_grad_seg
        last = ref() if ref is not None else None
        if last is not None:
            ptr = last.untyped_storage().data_ptr()
            if all(local_of(g).untyped_storage().data_ptr() == ptr for g in existing.values()):
                with torch.no_grad():
                    for i in range(len(buf.slots)):
                        if i not in existing and buf.slots[i].local_numel:
                            buf.local_view(last, i).zero_()
                return last
        target = buf.new_sharded_grad(zero=True)
        with torch.no_grad():
            for i, g in existing.items():
                buf.local_view(target, i).copy_(local_of(g).reshape(buf.slots[i].local_shape))
        return target

    def forget_grad_segment(self) -> None:
        """The sharded grads moved (to the host or back): the next accumulation starts from a
        fresh segment instead of adding into the one they left."""
        self.last_grad_seg = None

    def hand_out(self, target: torch.Tensor, got_grad: list[bool], had_grad: list[bool]) -> None:
        """Point the sharded grads into the reduced segment (after the reduction finished).
        A parameter no rank produced a gradient for keeps ``.grad = None``."""
        buf = self.buf
        self.last_grad_seg = weakref.ref(target)
        for info in self.infos:
            if not info.sharded.requires_grad:
                continue
            i = info.slot
            if not (got_grad[i] or had_grad[i]):
                info.sharded.grad = None
                continue
            info.sharded.grad = make_sharded_grad(buf.local_view(target, i), info.sharded)


class UnitGroup(Protocol):
    """What the helpers of a group read of it (a :class:`~.param_group.ParamGroup`), typed
    here so they need not import ``param_group.py``, which imports them."""

    units: list[Unit]
    infos: list[ParamInfo]

    def describe(self) -> str: ...


class Building(Protocol):
    """What building units reads of the group it builds for (a :class:`~.param_group.ParamGroup`;
    ``build.py`` and ``subclass_unit.py``)."""

    all_gather_quant: Any  # a BlockFP8 policy or None
    dps: list[DPMesh]
    device: torch.device
    mp_policy: Any
    hooks: CommHooks
    gradient_reduce: Any  # a GradientReduce or None
    reshard_after_forward: bool | int
    ignored_params: tuple[str, ...]  # ``ignored_names`` of fully_shard's ignored_params

    def name(self) -> str: ...

    def after_grad(self, param: torch.Tensor) -> None: ...

    def describe(self) -> str: ...
