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

from collections.abc import Callable
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from ragged_fsdp.agreement import agree
from ragged_fsdp.quant import MXFP8, NVFP4, BlockFP8

from ..device import device_for
from .core.init import (
    collect_params, ignored_names, mark_managed, mark_sharded, move_buffers, node_comm, param_device,
    resolve_reshard_after_forward, set_state, state_of,
)
from .compat.torch_module import (
    TORCH_FSDP_MODULE, TORCH_REDUCTION_HANDLE, TorchFSDPBase, refuse_unknown_torch_methods,
)
from .compat.torch_state import register_torch_state
from .core.consistency import check_same_answers
from .core.residual_state import register_residual_state
from .core.mesh_info import place_params, resolve_mesh
from .core.param_group import ParamGroup
from .core.sharded_param import local_of
from .core.state import FSDPState
from .torch_private import in_backward
from .core.stale_optimizer import remember_replaced
from .offload.optimizers import require_streaming_optimizers
from .offload.policy import resolve_offload
from .offload.staging import attach as attach_offload

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "GradientReductionHandle", "state_of"]

_fsdp_classes: dict[type, type] = {}


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
    all_gather_quant: Any = None,
    gradient_reduce: Any = None,
):
    """Shard ``module``'s parameters (those not already in a group below it) over ``mesh``.

    Apply bottom-up: blocks first, then the root. Returns the module, now an instance of
    :class:`FSDPModule`. See torch's ``fully_shard`` for ``reshard_after_forward``,
    ``mp_policy``, ``offload_policy`` and ``ignored_params``.

    Meshes, as torch's: 1-D (FSDP), 2-D ``(replicate, shard)`` (HSDP), TP/EP DTensor
    parameters on a sibling mesh, ``shard_placement_fn`` returning torch's
    ``ShardPlacementResult`` (a per-parameter data-parallel mesh; a plain ``Shard`` leaves the
    layout to the planner) and ``dp_mesh_dims`` with the full SPMD mesh (``fsdp/core/mesh_info.py``).

    ``all_gather_quant=ragged_fsdp.BlockFP8(tile=(128, 128), dtype=torch.float8_e4m3fn)``
    gathers the eligible weights (floating, >= 2 dims, at least one tile, not biases) as fp8
    codes plus one fp32 scale per tile: each rank quantises its own whole tiles of the
    full-precision sharded weights (the layout never cuts a tile: granularity ``rows:128``
    for 2-D weights, whole expert matrices for fused experts whose rows are not a multiple of
    128), and the gathered weights are dequantised into ``mp_policy.param_dtype`` for compute.
    Gradients and optimizer states are unchanged. The result is the same at every world size.
    ``all_gather_quant=ragged_fsdp.MXFP8()`` gathers them as MXFP8 (E4M3 codes, one E8M0 scale
    per 32 elements, in whole 32x32 tiles): the forward's gather moves the row-wise plane, a
    re-gather in backward the column-wise plane (``docs/fp8.md``). ``ragged_fsdp.NVFP4()`` does
    the same in NVFP4 (E2M1 codes two per byte, one E4M3 scale per 16 elements, one fp32 scale
    per tensor from an amax agreed across ranks, whole 16x16 tiles). Every rank must pass the
    same ``all_gather_quant`` (agreed at the call; a mismatch raises on every rank).

    ``gradient_reduce=ragged_fsdp.GradientReduce(wire_dtype=torch.int8, error_feedback=True)``
    sends each rank's gradient pieces to their owners in ``wire_dtype`` (bf16; int8 or fp8
    e4m3 codes with one fp32 scale per block, the blocks being the layout's, never cut) and
    sums them in ``mp_policy.reduce_dtype``, which must be fp32; see ``docs/gradient-reduce.md``.

    ``offload_policy``: torch's ``CPUOffloadPolicy`` (everything on the host, the optimizer
    steps there), torch's ``OffloadPolicy()`` (nothing), or ``ragged_fsdp.OffloadPolicy(params=,
    grads=, optimizer_states=)`` per state; see ``docs/offload.md``. On a CPU mesh host and
    device are the same memory and a policy moves nothing.
    """
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(f"fully_shard: shard_placement_fn must be callable, got {type(shard_placement_fn).__name__}")
    if all_gather_quant is not None and not isinstance(all_gather_quant, (BlockFP8, MXFP8, NVFP4)):
        raise TypeError(
            f"fully_shard: all_gather_quant must be a ragged_fsdp.BlockFP8, MXFP8 or NVFP4 policy or None, "
            f"got {type(all_gather_quant).__name__}"
        )
    modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    if not modules:
        raise ValueError("fully_shard: got an empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard: expected nn.Module(s), got {type(m).__name__}")
        if state_of(m) is not None:
            raise ValueError(f"fully_shard: {type(m).__name__} is already wrapped; apply fully_shard once per module")
    call_mesh = resolve_mesh(mesh, dp_mesh_dims)
    mesh, dp, device = call_mesh.mesh, call_mesh.dp, call_mesh.device
    offload = resolve_offload(offload_policy, device)
    if offload is not None and device.type not in ("cpu", "cuda"):
        raise NotImplementedError(
            f"fully_shard: offload_policy on a {device.type} mesh is not implemented (host copies "
            "are written for CUDA streams); pass OffloadPolicy()")
    # every rank gathers the same format, or every rank raises here (not a garbled gather)
    agree("fully_shard: all_gather_quant", None if all_gather_quant is None else repr(all_gather_quant),
          group=[dp.shard.group] + ([dp.replicate.group] if dp.replicate is not None else []),
          fix="pass the same all_gather_quant (or None) on every rank")
    raf = resolve_reshard_after_forward(reshard_after_forward, dp.shard.world_size)
    ignored = set(ignored_params or ())
    params = collect_params(modules, ignored)
    where = param_device(params, device)  # the mesh's device, or meta
    move_buffers(modules, device, where)
    state = FSDPState(modules, mp_policy, auto_reshard=reshard_after_forward is None, ignored=ignored)
    if params:
        placed, answers, error = place_params(params, shard_placement_fn, dp)
        if shard_placement_fn is not None:  # per-parameter meshes: every rank must pick the same
            check_same_answers(mesh, answers, error, type(modules[0]).__name__)
        elif error is not None:
            raise error
        if not isinstance(raf, bool) and (
            any(pl.dp is not dp for pl in placed) or dp.replicate is not None or dp.spmd_mesh is not None
        ):
            # node groups are made by every rank for every node of one 1-D mesh
            raise NotImplementedError(
                f"fully_shard: reshard_after_forward={raf} (an int) works on a 1-D data-parallel "
                "mesh; with HSDP, dp_mesh_dims or per-parameter meshes pass True or False"
            )
        group = ParamGroup(
            params, modules, placed, where, device_for(device), mp_policy,
            granularity_fn, raf, all_gather_quant=all_gather_quant,
            post_forward_comm=None if isinstance(raf, bool) else node_comm(mesh, raf),
            gradient_reduce=gradient_reduce, ignored_params=ignored_names(modules, ignored),
        )
        state.attach_group(group)
        if offload is not None:
            attach_offload(group, offload)
            if not offload.params:
                require_streaming_optimizers()
        root_name = type(modules[0]).__name__
        for fqn, p, owners in params:
            mark_managed(p)
            owner, attr = owners[0]
            if owner._parameters.get(attr) is not p:  # an optimizer built before now holds p
                remember_replaced(p, f"{fqn!r} of the {root_name} given to fully_shard (shape {tuple(p.shape)})")
        mark_sharded(group)
        _register_state_dict_hooks(group)
        register_residual_state(group, modules[0])
    for m in modules:
        set_state(m, state)
        register_torch_state(m, state)
        _swap_class(m)
    return module


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
        st.group.adopt_registered()


# -- the module class --------------------------------------------------------------------
class UnshardHandle:
    def __init__(self, group: ParamGroup | None):
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class GradientReductionHandle(TORCH_REDUCTION_HANDLE):
    """What ``finalize_backward(async_op=True)`` returns: the step's reductions are issued;
    :meth:`wait` waits for them and hands out the sharded gradients. An instance of torch's
    ``GradientReductionHandle`` where torch has one (2.15)."""

    def __init__(self, state: FSDPState | None, token: object = None):
        self._state = state
        self._token = token

    def wait(self) -> None:
        """Wait for the reductions and hand out the gradients (once; later calls do nothing).
        Raises RuntimeError when the step was reset meanwhile (its gradients were dropped)."""
        st, self._state = self._state, None
        if st is not None:
            st.end_finalize(self._token)


class FSDPModule(TorchFSDPBase):
    """Mixed into the class of every module ``fully_shard`` wraps (as torch's FSDP2 does).

    It derives from torch's own ``torch.distributed.fsdp.FSDPModule`` (through
    :class:`~ragged_fsdp.fsdp.compat.torch_module.TorchFSDPBase`, which overrides the rest of its
    methods), so trainers that check ``isinstance(m, FSDPModule)`` with torch's class treat
    our modules as FSDP2 modules."""

    _orig_cls_mro_index = 4  # [FSDP<Orig>, FSDPModule, TorchFSDPBase, torch's FSDPModule, Orig]

    def __new__(cls, *args, **kwargs):
        # Containers re-create modules through their class (e.g. slicing a ModuleList):
        # build the original class, not the FSDP one.
        mro = cls.__mro__
        orig = mro[mro.index(TORCH_FSDP_MODULE) + 1]
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
                st.group.set_reduce_grads(requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"set_reshard_after_forward: expected a bool, got {reshard_after_forward!r}")
        for st in self._fsdp_states(recurse):
            st.pin_reshard()
            if st.group is not None:
                st.group.set_reshard_after_forward(reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for st in self._fsdp_states(recurse):
            if st.group is not None:
                st.group.set_reshard_after_backward(reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters (async) when this module's forward starts."""
        self._fsdp_state().set_forward_prefetch([_require_fsdp(m) for m in modules])

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters (async) when this module's backward starts."""
        self._fsdp_state().set_backward_prefetch([_require_fsdp(m) for m in modules])

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for torch's API (pipeline schedules call it). ragged_fsdp's final
        callback always waits for the backward's reductions and hands out the sharded
        gradients, so there is nothing to defer to a later backward."""
        if not isinstance(is_last_backward, bool):
            raise TypeError(f"set_is_last_backward: expected a bool, got {is_last_backward!r}")

    def _root_state(self, what: str) -> FSDPState:
        """This module's state, refused unless it is (or may still become) the root."""
        st = self._fsdp_state()
        if st.is_root is False:
            raise RuntimeError(
                f"{what}: {type(self).__name__} is not the root; call it on the outermost wrapped "
                "module (the one that runs forward)"
            )
        return st

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """True: the caller ends each step with :meth:`finalize_backward` (torch 2.15's
        contract; its pipeline schedules use it). Call it on the root before forward.

        ragged_fsdp's end of every backward already waits for what that backward reduced and
        hands it out, so the mode only allows :meth:`finalize_backward`: gradients that
        accumulated unreduced (``set_requires_gradient_sync(False)``) are reduced there, and
        nothing else changes. Gradient sync and resharding follow their current settings."""
        if not isinstance(enabled, bool):
            raise TypeError(f"set_manual_backward_finalization: expected a bool, got {enabled!r}")
        st = self._root_state("set_manual_backward_finalization")
        if enabled != st.ctx.manual_finalization and in_backward():
            raise RuntimeError("set_manual_backward_finalization: the mode cannot change during backward")
        st.set_manual_finalization(enabled)

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """End the step by hand (after ``set_manual_backward_finalization(True)``, once the
        step's backward passes are done): reduce what accumulated unreduced and hand out the
        sharded gradients. With ``async_op`` the reductions are issued and a
        :class:`GradientReductionHandle` is returned; its ``wait()`` hands the gradients out and
        must come before the gradients are read or this module's next forward. Before the
        root's first forward it does nothing, as in torch."""
        if not isinstance(async_op, bool):
            raise TypeError(f"finalize_backward: async_op must be a bool, got {async_op!r}")
        st = self._root_state("finalize_backward")
        if st.is_root is None:
            return GradientReductionHandle(None) if async_op else None
        if not st.ctx.manual_finalization:
            raise RuntimeError(
                "finalize_backward: manual backward finalization is off; call "
                "set_manual_backward_finalization(True) on the root before forward"
            )
        if in_backward():
            raise RuntimeError("finalize_backward: called during backward; call it after backward returns")
        handle = GradientReductionHandle(st, st.start_finalize())
        if async_op:
            return handle
        handle.wait()
        return None

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False skips the all-reduce over the replicate dim (gradient accumulation):
        the shard-dim sums accumulate and the sharded ``.grad`` stay as they are until a
        backward with True all-reduces everything accumulated since."""
        if not isinstance(requires_all_reduce, bool):
            raise TypeError(f"set_requires_all_reduce: expected a bool, got {requires_all_reduce!r}")
        for st in self._fsdp_states(recurse):
            if st.group is not None:
                st.group.set_requires_all_reduce(requires_all_reduce)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        g = self._fsdp_state().group
        if g is not None:
            g.set_unshard_in_backward(unshard_in_backward)

    def set_gradient_divide_factor(self, factor: float) -> None:
        for st in self._fsdp_states(True):
            if st.group is not None:
                st.group.set_gradient_divide_factor(factor)

    def residual_dropped(self, *, recurse: bool = True) -> int:
        """``gradient_reduce=GradientReduce(error_feedback=True)``: how many error-feedback
        residual elements came out non-finite (a NaN or inf gradient) and were stored as zero
        instead, on this rank, since ``fully_shard`` (this module's group, and with
        ``recurse`` every group below it). Reading it waits for the device."""
        n = 0
        for st in self._fsdp_states(recurse):
            for u in st.group.units if st.group is not None else ():
                if u.wire is not None and u.wire.residual is not None:
                    n += int(u.wire.residual.dropped)
        return n

    def rescale_residual(self, factor: float, *, recurse: bool = True) -> None:
        """Multiply error feedback's residual by ``factor``: the residual is in the units of
        the gradients it was taken from, so when ``torch.amp.GradScaler`` changes its scale
        from ``old`` to ``new``, call ``model.rescale_residual(new / old)`` after
        ``scaler.update()``. Exact for the scaler's powers of two. No-op without error
        feedback. ``factor`` must be finite and positive, and the same on every rank
        (checked on every rank: a ValueError everywhere otherwise)."""
        from .core.residual_state import rescale_residuals

        rescale_residuals([st.group for st in self._fsdp_states(recurse) if st.group is not None], factor)

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
        # A list group's modules are moved one at a time (each gets its own _apply): touch
        # only the parameters this module's subtree registers, keep the others as they are.
        subtree = {id(m) for m in self.modules()}
        mine = [any(id(mod) in subtree for mod, _ in info.owners) for info in g.infos]
        for info, moved in zip(g.infos, mine):
            if moved:
                info.register(nn.Parameter(local_of(info.sharded).detach(), requires_grad=info.sharded.requires_grad))
        try:
            out = super()._apply(fn, recurse)
        finally:
            new = []
            for info, moved in zip(g.infos, mine):
                mod, name = next(((m, n) for m, n in info.owners if id(m) in subtree), info.owners[0])
                new.append(mod._parameters[name].detach() if moved else None)
            g.adopt_locals(new)
        return out


refuse_unknown_torch_methods(FSDPModule)


def _require_fsdp(m) -> FSDPState:
    st = state_of(m) if isinstance(m, nn.Module) else None
    if st is None:
        raise ValueError(f"expected a module wrapped by ragged_fsdp.fully_shard, got {type(m).__name__}")
    return st
