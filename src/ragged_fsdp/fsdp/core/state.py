"""FSDPState: the hooks of one ``fully_shard`` call, and the context the root shares.

Each call installs a forward pre-hook and a forward hook on its module(s). The state that
runs forward first becomes the root (lazy init) and shares one :class:`RootContext` with
every state below it: the order groups ran in (for prefetching), reductions in flight, and
the once-per-backward final callback.

Per step, for one state::

    pre-forward   unshard (maybe prefetched) -> PostBackward node on the inputs ->
                  prefetch the next group (explicit list, or the previous step's order)
    post-forward  reshard (unless reshard_after_forward=False) -> pre-backward hooks on the
                  outputs
    pre-backward  unshard (maybe prefetched) -> zeroed gradient buffers -> prefetch the group
                  that ran before this one
    post-backward (the PostBackward node of the last use) reduce-scatter, reshard
    final callback (root, once per backward) finish the groups autograd could not see,
                  wait for all reductions, hand out the sharded grads
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..torch_private import in_backward, queue_callback, tree_map
from ..compat.torch_state import reduce_at_step_end
from .common import TrainingState
from .hooks import eager as _eager
from .hooks import grad_tensors
from .param_group import ParamGroup
from .reduction import Reductions
from .late_params import check_no_late_params, generation, watch
from .step_boundary import check, check_forward, register_root
from .shared_settings import agree_at_forward

__all__ = ["FSDPState", "RootContext"]


class RootContext:
    """State shared by every FSDP state under one root."""

    def __init__(self) -> None:
        self.all_states: list[FSDPState] = []  # pre-order of the root's module tree
        self.iter_forward_root: FSDPState | None = None
        self.forward_order: list[ParamGroup] = []  # groups by first pre-forward, this step
        self.last_forward_order: list[ParamGroup] = []  # ... and in the previous step
        self._last_index: dict[int, int] = {}
        self.post_forward_order: list[ParamGroup] = []  # with repeats, for backward prefetch
        self.reductions = Reductions()  # every gradient reduction under this root
        self.callback_queued = False
        self.params_seen = 0  # late_params.generation() at the last walk for late parameters
        # torch's set_manual_backward_finalization(True): the caller ends the step with
        # finalize_backward(); an async one not yet waited holds its token here
        self.manual_finalization = False
        self.pending_finalize: object | None = None

    def reset(self, states: list["FSDPState"], aborted: bool) -> None:
        """Back to the start of a step: after every backward (the final callback) and, with
        ``aborted``, after an exception stopped forward or backward (``reset_iter_state``:
        also the forward's trackers, whose forward may not have ended)."""
        for st in states:
            st.end_step(aborted)
        if aborted:
            self.iter_forward_root = None
            self.forward_order = []
        self.post_forward_order.clear()
        self.callback_queued = False
        self.reductions.forget()

    def next_in_forward(self, group: ParamGroup) -> ParamGroup | None:
        i = self._last_index.get(id(group))
        if i is None or i + 1 >= len(self.last_forward_order):
            return None
        return self.last_forward_order[i + 1]

    def end_forward(self) -> None:
        if self.forward_order:
            self.last_forward_order = list(self.forward_order)
            self._last_index = {id(g): i for i, g in enumerate(self.last_forward_order)}
        self.forward_order = []


class FSDPState:
    def __init__(self, modules: tuple[nn.Module, ...], mp_policy, auto_reshard: bool, ignored=()):
        self.modules = modules
        self.ignored = tuple(ignored)  # fully_shard(ignored_params=): not sharded, not refused as late
        watch()
        self.mp_policy = mp_policy
        self.group: ParamGroup | None = None
        self.ctx = RootContext()
        self.is_root: bool | None = None
        self.training_state = TrainingState.IDLE
        self.auto_reshard = auto_reshard  # reshard_after_forward was None: root keeps params
        self.forward_prefetch: list[FSDPState] = []
        self.backward_prefetch: list[FSDPState] = []
        self._to_run: set[int] = set()  # modules of a list group still to run this pass
        # set by the post-forward hook: the always-call hook after it tells a forward that
        # raised from one that returned (a list group's first module returns still FORWARD)
        self._forward_returned = True
        self._handles = []
        # torch.compile: the hooks run eagerly (a graph break at each), as FSDP2's do; dynamo
        # traces the module's compute between them, on the plain unsharded parameters.
        pre, post = _eager(self._pre_forward), _eager(self._post_forward)
        failed = _eager(self._after_forward_raised)
        for m in modules:
            # a checkpoint reads state_dict() first: refused in the middle of a step (step_boundary.py)
            self._handles.append(m.register_state_dict_pre_hook(self._before_state_dict))
            self._handles.append(m.register_forward_pre_hook(pre, prepend=True, with_kwargs=True))
            self._handles.append(m.register_forward_hook(post, prepend=False))
            # torch runs always_call hooks also when forward raised (the one above is skipped)
            self._handles.append(m.register_forward_hook(failed, always_call=True))

    # -- what fully_shard, the public setters and the root change ----------------------------
    def attach_group(self, group: ParamGroup | None) -> None:
        """The group ``fully_shard`` built for these modules (None: they have no parameters)."""
        self.group = group

    def pin_reshard(self) -> None:
        """``set_reshard_after_forward`` was called: the root no longer keeps its parameters by default."""
        self.auto_reshard = False

    def set_forward_prefetch(self, states: list[FSDPState]) -> None:
        self.forward_prefetch = states

    def set_backward_prefetch(self, states: list[FSDPState]) -> None:
        self.backward_prefetch = states

    def join_root(self, ctx: RootContext, is_root: bool) -> None:
        """The root's lazy init: share its context."""
        self.is_root = is_root
        self.ctx = ctx

    @property
    def _comm_ctx(self) -> RootContext:
        """torch's name for what a root's states share (FSDP2: the streams; ours: the root's
        context). torch 2.15's multi-stage pipeline schedules with ``defer_reduce_grad_wait``
        check through it that no two stages share one, which ours never do."""
        return self.ctx

    @_comm_ctx.setter
    def _comm_ctx(self, value) -> None:
        raise NotImplementedError(
            "ragged_fsdp: torch.distributed.fsdp.share_comm_ctx is not supported; each root "
            "keeps its own context (drop the call: it only shares CUDA streams between PP stages)"
        )

    def end_step(self, aborted: bool) -> None:
        """Back to the start of a step (:meth:`RootContext.reset`); with ``aborted`` also the
        list group's modules still to run."""
        self.training_state = TrainingState.IDLE
        if aborted:
            self._to_run = set()
        if self.group is not None:
            self.group.finish_backward()

    # -- lazy init -------------------------------------------------------------------------
    def lazy_init(self) -> None:
        if self.is_root is not None:
            return
        if len(self.modules) != 1:
            raise RuntimeError(
                "fully_shard: the first module to run forward must be a single wrapped root module, "
                f"but it is a list group of {len(self.modules)} modules"
            )
        from .init import state_of

        self.is_root = True
        root = self.modules[0]
        seen = set()
        for name, module in root.named_modules():
            st = state_of(module)
            if st is None or id(st) in seen:
                continue
            seen.add(id(st))
            if st is not self and st.is_root is not None:
                raise RuntimeError(
                    f"fully_shard: {name} already ran forward as a root; run forward through "
                    "the outermost wrapped module first"
                )
            if st is not self and st.ctx.manual_finalization:
                raise RuntimeError(
                    f"set_manual_backward_finalization: it was called on {name}, which is not the "
                    "root; call it on the outermost wrapped module (the one that runs forward)"
                )
            st.join_root(self.ctx, is_root=st is self)
            self.ctx.all_states.append(st)
            if st.group is not None:
                st.group.join_root(self.ctx, name)
        register_root(self)
        if self.auto_reshard and self.group is not None:
            self.group.set_reshard_after_forward(False)
        for st in self.ctx.all_states:
            if st.group is not None:
                st.group.check_materialized()

    # -- forward ---------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        recomputing = in_backward()
        if self.ctx.pending_finalize is not None and not recomputing:
            raise RuntimeError(
                "ragged_fsdp: forward started while the handle finalize_backward(async_op=True) "
                "returned was not waited on; call its wait() first (it hands out the gradients)"
            )
        if not recomputing and self.ctx.callback_queued:
            # the last backward raised before its final callback (autograd drops a failed
            # backward's callbacks): start clean, before the states it left are read
            self.abort_step()
        if not recomputing:
            check_forward(self)
        self._forward_returned = False
        if recomputing or self.training_state is TrainingState.PRE_BACKWARD:
            # activation-checkpoint recomputation inside backward: parameters only
            if self.group is not None:
                self.group.recompute_forward()
            return self._cast_inputs(args, kwargs)
        if self.group is not None:
            self.group.check_on_device()  # before any state changes: the next forward starts clean
        first = True
        if len(self.modules) > 1:
            first = not self._to_run
            if first:
                self._to_run = {id(m) for m in self.modules}
        if first:
            self.lazy_init()
            if self.ctx.iter_forward_root is None:  # the forward's root, before its first collective
                agree_at_forward(self.ctx.all_states or [self])
            self.lazy_init_from_forward()
        self.training_state = TrainingState.FORWARD
        args, kwargs = self._cast_inputs(args, kwargs)
        g = self.group
        if g is not None:
            args, kwargs = g.pre_forward(args, kwargs, first)
            if first:
                if not any(x is g for x in self.ctx.forward_order):
                    self.ctx.forward_order.append(g)
                self._forward_prefetch()
        return args, kwargs

    def lazy_init_from_forward(self) -> None:
        self.lazy_init()
        if self.ctx.iter_forward_root is None:
            ctx = self.ctx
            if ctx.params_seen != generation():  # a module or parameter was registered somewhere
                check_no_late_params(ctx.all_states or [self])
                ctx.params_seen = generation()
            ctx.iter_forward_root = self
            ctx.forward_order = []

    # -- a step stopped by an exception ------------------------------------------------------
    def _after_forward_raised(self, module: nn.Module, args: Any, output: Any = None) -> None:
        """An always-call forward hook: a no-op when forward returned (the post-forward hook
        already ran); when it raised and this is the forward's root, the step is undone
        before the exception reaches the caller, so an optimizer or a state dict made next
        sees the sharded parameters."""
        returned, self._forward_returned = self._forward_returned, True
        if not returned and self.training_state is TrainingState.FORWARD and self.ctx.iter_forward_root is self:
            self.abort_step()

    def abort_step(self, drop_step: bool = False) -> None:
        """Back to a clean start after an exception stopped forward or backward under this
        root: the collectives in flight are waited for (every rank issued them, when every
        rank raised at the same point), every group is resharded with its unreduced
        gradients dropped and its hooks re-armed, and no reduction of the failed step is
        handed out. The step's gradients are lost, as after ``zero_grad()``.

        ``drop_step`` (the user's ``abort_step()`` / ``reset_iter_state()``): also forget
        the step in progress under global order (its running sums and count). Without it
        (an exception the engine cleans up after) a step whose sums lost a piece is marked
        broken, and the step ends refuse it until the user drops it (step_boundary.py)."""
        ctx = self.ctx
        states = ctx.all_states or [self]
        ctx.pending_finalize = None  # a handle of finalize_backward(async_op=True) is void now
        ctx.reductions.clear()
        for st in states:
            if st.group is not None:
                st.group.abort()
        ctx.reset(states, aborted=True)
        if drop_step:
            ctx.reductions.drop_step()

    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        check(self, f"state_dict() of {type(module).__name__} (a checkpoint)")

    def _forward_prefetch(self) -> None:
        if self.forward_prefetch:
            for st in self.forward_prefetch:
                if st.group is not None:
                    st.group.prefetch(for_backward=False)
            return
        nxt = self.ctx.next_in_forward(self.group)
        if nxt is not None and nxt is not self.group:
            nxt.prefetch(for_backward=False)

    def _post_forward(self, module: nn.Module, input: Any, output: Any):
        self._forward_returned = True
        if in_backward() or self.training_state is TrainingState.PRE_BACKWARD:
            return self._cast_output(output)
        if len(self.modules) > 1:
            self._to_run.discard(id(module))
            if self._to_run:
                # Not all modules of the list group ran yet (torchtitan's [norm, lm_head]: the
                # head may run later, outside this forward, and be resharded explicitly):
                # this module's backward must still find the group gathered.
                return self._cast_output(self._register_pre_backward(output))
        if self.group is not None:
            self.group.post_forward()
        output = self._register_pre_backward(output)
        self.training_state = TrainingState.IDLE
        if self.ctx.iter_forward_root is self:
            self._end_of_forward()
        return self._cast_output(output)

    def _end_of_forward(self) -> None:
        ctx = self.ctx
        ctx.iter_forward_root = None
        ran = {id(g) for g in ctx.forward_order}
        for st in ctx.all_states:  # prefetched groups that did not run: free them
            g = st.group
            if g is not None and id(g) not in ran and g.holds_unsharded:
                if st.training_state is TrainingState.IDLE:
                    g.reshard()
        ctx.end_forward()

    def _register_pre_backward(self, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return output
        hook = _eager(self._pre_backward)
        for t in grad_tensors(output):
            t.register_hook(hook)
        return output

    # -- backward --------------------------------------------------------------------------
    def _pre_backward(self, grad: torch.Tensor):
        self.training_state = TrainingState.PRE_BACKWARD
        self._queue_final_callback()
        if self.group is not None:
            self.group.pre_backward(implicit_prefetch=not self.backward_prefetch)
        for st in self.backward_prefetch:
            if st.group is not None:
                st.group.prefetch(for_backward=True)
        return grad

    def _queue_final_callback(self) -> None:
        ctx = self.ctx
        if ctx.callback_queued:
            return
        ctx.callback_queued = True
        root = ctx.all_states[0] if ctx.all_states else self
        queue_callback(root._final_callback)

    def _final_callback(self) -> None:
        ctx = self.ctx
        states = ctx.all_states or [self]
        try:
            for st in reversed(states):
                if st.group is not None:
                    st.group.end_backward()
            groups = [st.group for st in states if st.group is not None]
            ctx.reductions.end_micro_step(groups)
            ctx.reductions.end_backward(groups)
        except BaseException:
            # e.g. an all-reduce hook raised on some rank: no gradient of this backward was
            # taken, so neither is the error-feedback residual its reductions staged
            ctx.reductions.discard_staged()
            raise
        finally:
            ctx.reset(states, aborted=False)

    # -- the caller's end of step (torch 2.15's manual backward finalization) ---------------
    def set_manual_finalization(self, enabled: bool) -> None:
        self.ctx.manual_finalization = enabled

    def start_finalize(self) -> object:
        """Reduce what every group under this root accumulated since its last reduction (the
        backward passes of a pipeline step, run with gradient sync off, and the gradients a
        weight-gradient pass wrote into ``.grad`` outside autograd's hooks), in the states'
        order on every rank. Returns the token :meth:`end_finalize` takes."""
        ctx = self.ctx
        if ctx.pending_finalize is not None:
            raise RuntimeError(
                "finalize_backward: the handle of the previous finalize_backward(async_op=True) "
                "was not waited on; call its wait() first"
            )
        states = ctx.all_states or [self]
        try:
            for st in states:
                if st.group is not None:
                    reduce_at_step_end(st.group)
        except BaseException:
            self.abort_step()
            raise
        ctx.pending_finalize = token = object()
        return token

    def end_finalize(self, token: object) -> None:
        """Wait for the reductions :meth:`start_finalize` issued and hand the sharded gradients
        out (the engine's end of backward)."""
        ctx = self.ctx
        if ctx.pending_finalize is not token:
            raise RuntimeError(
                "GradientReductionHandle.wait: this handle's step was reset (reset_iter_state, "
                "abort_step or an exception in forward/backward) and its gradients dropped"
            )
        ctx.pending_finalize = None
        self._final_callback()

    # -- mixed precision -------------------------------------------------------------------
    def _cast_inputs(self, args, kwargs):
        dtype = self.mp_policy.param_dtype
        if not (self.mp_policy.cast_forward_inputs and dtype):
            return args, kwargs

        def cast(x):
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
                return x.to(dtype)
            return x

        return tree_map(cast, args), tree_map(cast, kwargs)

    def _cast_output(self, output):
        dtype = self.mp_policy.output_dtype
        if dtype is None:
            return output

        def cast(x):
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
                return x.to(dtype)
            return x

        return tree_map(cast, output)
