"""ParamGroup: the parameters of one ``fully_shard`` call and their life in a step.

Data: one :class:`~.unit.Unit` per (mesh, dtype, trainable, fp8-gathered, embedding) kind of
parameter, each holding one :class:`DBuffer` laid out by the planner and the
:class:`~.unit.ParamInfo` of its parameters. The group keeps the lifecycle: the state
machines below, the hooks autograd calls, and the prefetch order; per-buffer work is the
units', reductions are the root's :class:`~.reduction.Reductions`', and what backward needs
from forward (early reduction, the saved-tensor watch, skipped embedding gathers) is
:mod:`.backward`'s.

Sharded state (which parameters the modules hold)::

    SHARDED --unshard()--> (all-gather in flight) --wait_for_unshard()--> UNSHARDED
    UNSHARDED --reshard()--> SHARDED

Training state (where the step is)::

    IDLE --pre_forward--> FORWARD --post_forward--> IDLE --pre_backward--> PRE_BACKWARD
    PRE_BACKWARD --post_backward (last use)--> POST_BACKWARD --final callback--> IDLE

Gradients: from a unit's first gradient in backward on, its unsharded parameters' ``.grad``
are aliases into one zeroed gradient buffer, so autograd accumulates in place (in the reduce
dtype, via ``grad_dtype``). After the group's last use in backward, one reduction per unit
produces the sharded gradient segment; the sharded parameters' ``.grad`` become views into it
when the backward ends.

Every field is written here only; the public setters (``api.py``), the root's lazy init
(``state.py``) and the offload phase switch call the methods below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.profiler import record_function

from ragged_fsdp.dbuffer import DBuffer

from ...device import Device, Pending
from ..comms.wire_reduce import check_wire_reduce_dtype
from ..comms.custom import CommHooks
from .backward import BackwardNeeds
from .build import build_units
from .common import ShardedState, TrainingState
from .mesh_info import DPMesh, ParamPlacement
from .moving import adopt_locals, adopt_registered
from .global_order import refuse
from .reduction import Settings
from .unit import ParamInfo, Unit

__all__ = ["ParamGroup", "ParamInfo", "ShardedState", "TrainingState"]


@dataclass
class _BackwardPass:
    """One backward pass (replaced by the final callback after every ``backward()``)."""

    fired: int = 0  # PostBackward nodes of this group that ran in this backward
    deferred_prefetch: ParamGroup | None = None  # the root's: issued at its first gradient
    post_forward_indices: list[int] = field(default_factory=list)  # its places in the root's post-forward order


class ParamGroup:
    def __init__(
        self,
        params: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
        modules: tuple[nn.Module, ...],
        placed: list[ParamPlacement],
        device: torch.device,
        dev: Device,
        mp_policy,
        granularity_fn: Callable[[str, nn.Parameter], Any] | None,
        reshard_after_forward: bool | int,
        all_gather_quant=None,
        post_forward_comm=None,
        gradient_reduce=None,
        ignored_params: tuple[str, ...] = (),
    ):
        self.modules = modules
        self.ignored_params = ignored_params  # names (and shapes) of fully_shard's ignored_params, for the agreement
        self.dps: list[DPMesh] = []  # the data-parallel meshes of its units, in first-use order
        for pl in placed:
            if not any(pl.dp is d for d in self.dps):
                self.dps.append(pl.dp)
        self.device = device
        self.dev = dev
        self.mp_policy = mp_policy
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.reduce_grads = True
        self.unshard_in_backward: bool | None = None  # None: skip units backward provably needs not
        self.gradient_divide_factor: float | None = None
        self.requires_all_reduce = True  # HSDP: sum over the replicate dim after the reduce-scatter
        self.fqn = ""  # module path from the root, for messages
        self.sharded_state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.ctx = None  # the root's shared context (set at lazy init)
        self._gathering: list[Pending] | None = None
        self._gathered_now: list[Unit] = []  # units the all-gathers in flight fill
        self.backward_pass = _BackwardPass()
        self.needs = BackwardNeeds(self)
        self.all_gather_quant = all_gather_quant  # a BlockFP8 policy or None
        self.gradient_reduce = gradient_reduce  # a GradientReduce (wire format, fp32 sum) or None
        self.global_order = None  # a GlobalOrder (ragged_fsdp.global_order) or None
        self.hooks = CommHooks()  # set_custom_all_gather / _reduce_scatter, set_all_reduce_hook
        self.post_optim_event = None  # set_post_optim_event: the next all-gather waits on it
        self.on_host = None  # what offload_to_host moved to the host (see offload/phase.py), until load_to_device
        self.units: list[Unit] = build_units(self, params, placed, granularity_fn, post_forward_comm)
        self.infos: list[ParamInfo] = [i for u in self.units for i in u.infos]
        for u in self.units:
            if u.embedding:
                for info in u.infos:
                    for module, _ in info.owners:
                        self.needs.hook_embedding(module)
        self.needs.hook_owner_modules()
        if gradient_reduce is not None:
            check_wire_reduce_dtype(self.describe(), [u.buf.reduce_dtype for u in self.units if u.trainable],
                                    gradient_reduce)

    @property
    def buffers(self) -> list[DBuffer]:
        return [u.buf for u in self.units]

    def settings(self) -> Settings:
        return Settings(self.gradient_divide_factor, self.requires_all_reduce, self.gradient_reduce, self.global_order)

    # -- what the public setters, the root and the phase switch change ---------------------
    def join_root(self, ctx, fqn: str) -> None:
        """The root's lazy init: its shared context (a state.RootContext) and this group's path."""
        self.ctx = ctx
        self.fqn = fqn

    def set_reshard_after_forward(self, value: bool | int) -> None:
        self.reshard_after_forward = value

    def set_reshard_after_backward(self, value: bool) -> None:
        self.reshard_after_backward = value

    def set_reduce_grads(self, value: bool) -> None:
        if not value and self.global_order is not None:
            raise refuse("set_requires_gradient_sync(False)", self.describe(),
                         "keep gradient sync on: under global order every micro-step's backward reduces, and the "
                         "step's gradients land after its last one")
        self.reduce_grads = value

    def set_requires_all_reduce(self, value: bool) -> None:
        if not value and self.global_order is not None:
            raise refuse("set_requires_all_reduce(False)", self.describe(),
                         "keep it True: under global order every micro-step reduces over all data-parallel ranks")
        self.requires_all_reduce = value

    def set_global_order(self, order) -> None:
        """Turn the global order on (a GlobalOrder) or off (None); checked by the caller."""
        if order is not None and not (self.reduce_grads and self.requires_all_reduce):
            raise refuse("gradient sync turned off (set_requires_gradient_sync / set_requires_all_reduce(False))",
                         self.describe(), "turn it back on before global_order")
        self.global_order = order

    def set_unshard_in_backward(self, value: bool | None) -> None:
        self.unshard_in_backward = value

    def set_gradient_divide_factor(self, factor: float | None) -> None:
        self.gradient_divide_factor = factor

    def set_post_optim_event(self, event) -> None:
        self.post_optim_event = event

    def set_on_host(self, on_host: bool) -> None:
        self.on_host = True if on_host else None

    def describe(self) -> str:
        return self.fqn or ", ".join(type(m).__name__ for m in self.modules)

    def name(self) -> str:
        """The group's name in traces: its module path from the root ("<root>" for the root)."""
        return self.fqn or ("<root>" if self.ctx is not None else self.describe())

    def check_on_device(self) -> None:
        if self.on_host is not None:
            raise RuntimeError(
                f"ragged_fsdp: the parameters of {self.describe()} were moved to the host by "
                "offload_to_host(); call ragged_fsdp.load_to_device(model, optimizer) before running it")

    def check_materialized(self) -> None:
        meta = [i.fqn for u in self.units if u.buf.device.type == "meta" for i in u.infos]
        if meta:
            raise RuntimeError(
                f"fully_shard: parameters of {self.describe()} are still on the meta device "
                f"({', '.join(meta[:5])}{'...' if len(meta) > 5 else ''}); materialise them first, "
                "e.g. model.to_empty(device=...) and then reset_parameters()/init_weights()"
            )

    # -- unshard / reshard -------------------------------------------------------------------
    @property
    def is_unsharded(self) -> bool:
        return self.sharded_state is ShardedState.UNSHARDED

    @property
    def holds_unsharded(self) -> bool:
        """Unsharded parameters exist or an all-gather filling them is in flight."""
        return self.is_unsharded or self._gathering is not None

    def _to_gather(self, for_backward: bool) -> list[Unit]:
        todo = [u for u in self.units if u.freed] if self.is_unsharded else list(self.units)
        if for_backward:
            skip = self.needs.skip_in_backward()
            todo = [u for u in todo if u.index not in skip]
        return todo

    def unshard(self, async_op: bool = False) -> None:
        """Start the all-gathers (no-op when unsharded or already in flight), for backward
        when the group is in its pre-backward. ``async_op=False`` (FSDP2's meaning) also
        waits for them; with True, :meth:`wait_for_unshard` (or the next pre-forward) does."""
        self._start_unshard(for_backward=self.training_state is TrainingState.PRE_BACKWARD)
        if not async_op:
            self.wait_for_unshard()

    def _start_unshard(self, for_backward: bool) -> None:
        """Issue the all-gathers; ``for_backward``: skip the units backward provably needs not
        (or everything, under ``set_unshard_in_backward(False)``)."""
        if self._gathering is not None:
            return
        if for_backward and self.unshard_in_backward is False:
            return
        todo = self._to_gather(for_backward)
        if not todo:
            return
        self.check_on_device()
        self.check_materialized()
        from_kept = self.sharded_state is ShardedState.SHARDED_POST_FORWARD
        event, self.post_optim_event = self.post_optim_event, None
        pend = []
        with record_function("ragged_fsdp::all_gather"):
            for u in todo:
                # set_post_optim_event: each buffer's gather of the sharded segment follows
                # the optimizer's event (a quantised gather allocates ahead: compute order)
                if event is not None and not from_kept and not u.buf.quant and not u.buf.aliased:
                    self.dev.order_after(event, "all_gather")
                pend.append(u.gather(self.dev, from_kept, for_backward))
        self._gathering = [p for p in pend if p is not None]
        self._gathered_now = todo

    def wait_for_unshard(self) -> None:
        if self._gathering is None:
            return
        with record_function("ragged_fsdp::wait_all_gather"):
            for p in self._gathering:
                p.wait()
        self._gathering = None
        for u in self._gathered_now:
            u.release_staged()
        gathered = {id(u) for u in self._gathered_now}
        for u in self.units:
            if id(u) in gathered:
                u.gathered()
            elif not self.is_unsharded:
                u.not_gathered()
        self.sharded_state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        if self._gathering is not None:  # never free memory a collective still writes
            for p in self._gathering:
                p.wait()
            self._gathering = None
            for u in self._gathered_now:
                u.release_staged()
            if self.sharded_state is ShardedState.SHARDED_POST_FORWARD:
                self.sharded_state = ShardedState.UNSHARDED  # the gathered data is there
        if self.sharded_state is not ShardedState.SHARDED:
            for u in self.units:
                u.register_sharded()
            self.sharded_state = ShardedState.SHARDED
        for u in self.units:
            u.free_resharded()

    def free_units(self, units: list[Unit]) -> None:
        """Free some units while the group stays unsharded (the next unshard re-gathers
        them); their parameters are registered sharded meanwhile."""
        for u in units:
            u.free_early()

    def reshard_post_forward(self) -> None:
        """Keep this rank's 1/k part of each unsharded buffer (k = reshard_after_forward),
        free the rest; the next unshard gathers within the node."""
        if not self.units or any(u.post_forward_comm is None for u in self.units):
            return self.reshard()
        if not self.is_unsharded:
            self.wait_for_unshard()
        for u in self.units:
            u.keep_part()
        for u in self.units:
            u.register_sharded()
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    # -- forward -------------------------------------------------------------------------
    def pre_forward(self, args: tuple, kwargs: dict, first_module: bool) -> tuple[tuple, dict]:
        self.training_state = TrainingState.FORWARD
        self.unshard()
        if torch.is_grad_enabled() and first_module:
            args, kwargs = self.needs.begin_forward(args, kwargs, self._post_backward_from_autograd)
        return args, kwargs

    def recompute_forward(self) -> None:
        """Forward run again inside backward (activation-checkpoint recomputation)."""
        self.needs.recompute()  # before the unshard: from now on backward gathers everything
        self.unshard()

    def post_forward(self) -> None:
        self.needs.stop()
        raf = self.reshard_after_forward
        if raf is True or (raf is not False and not torch.is_grad_enabled()):
            self.reshard()  # (no backward follows a no-grad forward: keep nothing)
        elif raf is not False:
            self.reshard_post_forward()
        elif torch.is_grad_enabled():
            skip = self.needs.skip_in_backward()  # kept for backward, which needs them not
            self.free_units([u for u in self.units if u.index in skip])
        if torch.is_grad_enabled():
            order = self.ctx.post_forward_order
            self.backward_pass.post_forward_indices.append(len(order))
            order.append(self)
        self.training_state = TrainingState.IDLE

    # -- backward ------------------------------------------------------------------------
    def pre_backward(self, implicit_prefetch: bool) -> None:
        if self.training_state is TrainingState.PRE_BACKWARD and self.is_unsharded:
            return  # another output of the same group: already prepared
        self.training_state = TrainingState.PRE_BACKWARD
        with record_function("ragged_fsdp::pre_backward"):
            self.unshard()
        if implicit_prefetch and self.backward_pass.post_forward_indices:
            i = self.backward_pass.post_forward_indices.pop()
            if i > 0:
                nxt = self.ctx.post_forward_order[i - 1]
                if self._is_root_group() and any(x.sharded.requires_grad for x in self.infos):
                    # the root's pre-backward fires on its output's gradient, while the loss's
                    # logits-sized temporaries may still be live: gather the next group once
                    # the root's first gradient is in (see after_grad)
                    self.backward_pass.deferred_prefetch = nxt
                else:
                    nxt.prefetch(for_backward=True)

    def _is_root_group(self) -> bool:
        states = self.ctx.all_states if self.ctx is not None else []
        return bool(states) and states[0].group is self

    def prefetch(self, for_backward: bool) -> None:
        """Start this group's all-gathers ahead of its use (forward or backward prefetch);
        a group inside a pass of its own gathers for that pass instead."""
        if self.is_unsharded or self._gathering is not None:
            return
        if self.training_state is not TrainingState.IDLE:
            for_backward = self.training_state is TrainingState.PRE_BACKWARD
        self._start_unshard(for_backward)

    def after_grad(self, param: torch.Tensor) -> None:
        """After autograd added a gradient into a gradient buffer: issue the backward
        prefetch this group deferred (see pre_backward)."""
        nxt, self.backward_pass.deferred_prefetch = self.backward_pass.deferred_prefetch, None
        if nxt is not None:
            nxt.prefetch(for_backward=True)

    def _post_backward_from_autograd(self) -> None:
        self.backward_pass.fired += 1
        f = self.needs.fwd
        if self.backward_pass.fired < f.calls or f.blind:
            # more uses of the group may still come in this backward (or in a later one,
            # when the step runs several): the final callback reduces what has arrived
            return
        self.post_backward()

    def has_pending_grads(self) -> bool:
        """Unsharded gradients autograd produced that no reduction has taken yet."""
        return any(u.has_pending_grads() for u in self.units)

    def end_backward(self) -> None:
        """The final callback of one ``backward()``: reduce what this backward produced and
        has not reduced yet; free what it gathered."""
        if self.training_state is TrainingState.PRE_BACKWARD or (
            self.training_state is not TrainingState.POST_BACKWARD and self.has_pending_grads()
        ):
            self.post_backward()
        elif self.reshard_after_backward and (self.sharded_state is not ShardedState.SHARDED or self._gathering is not None):
            self.reshard()
        elif self._gathering is not None:  # a prefetch nobody used: finish it, keep the result
            self.wait_for_unshard()

    def post_backward(self, again: bool = False) -> None:
        """The group's gradients are complete: reduce them (or keep accumulating). Once per
        backward, unless ``again`` (:meth:`reduce_accumulated`)."""
        if self.training_state is TrainingState.POST_BACKWARD and not again:
            return
        with record_function("ragged_fsdp::post_backward"):
            self._post_backward()

    def _post_backward(self) -> None:
        self.training_state = TrainingState.POST_BACKWARD
        self.backward_pass.deferred_prefetch = None
        for u in self.units:
            u.fold_foreign_grads()
        if not self.reduce_grads:
            if self.reshard_after_backward:
                self.reshard()
            return
        # a unit reduced early is reduced again only for gradients that arrived since
        todo = [u for u in self.units if u.buf.grad is not None or (u.trainable and not self.needs.reduced_early(u))]
        self.reduce_units(todo, self.reshard if self.reshard_after_backward else None)

    def reduce_units(self, units: list[Unit], release: Callable[[], None] | None, early: bool = False) -> None:
        """Reduce ``units`` now (Reductions.reduce_now); ``release`` frees what they gathered."""
        self.ctx.reductions.reduce_now(self.dev, units, self.settings(), release, early)

    def reduce_accumulated(self) -> None:
        """Reduce now what the step's backward passes accumulated (torch.distributed.pipelining's
        end of step, after several backward calls with gradient sync off): also the gradients a
        weight-gradient pass wrote into the unsharded parameters' ``.grad`` outside autograd's
        hooks (``_post_backward`` folds them into the gradient buffer first)."""
        if self.training_state is TrainingState.POST_BACKWARD and not (
            self.has_pending_grads() or any(u.buf.grad is not None for u in self.units)
        ):
            return  # this backward already reduced everything it had
        self.post_backward(again=True)

    def abort(self) -> None:
        """An exception stopped the step (see ``FSDPState.abort_step``): stop the saved-tensor
        watch a forward left running, free what is gathered (after any all-gather in flight)
        and drop the gradients no reduction took."""
        self.needs.stop(resume=False)
        self.reshard()
        for u in self.units:
            u.drop_grads()

    def finish_backward(self) -> None:
        self.training_state = TrainingState.IDLE
        self.backward_pass = _BackwardPass()
        self.needs.end_backward()

    # -- moving (nn.Module._apply, load_state_dict(assign=True)) ------------------------------
    def adopt_locals(self, locals_: list[torch.Tensor | None]) -> None:
        adopt_locals(self, locals_)

    def adopt_registered(self) -> None:
        adopt_registered(self)
