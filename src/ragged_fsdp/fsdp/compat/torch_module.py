"""Make ragged_fsdp's wrapped modules instances of torch's own ``FSDPModule`` too.

Trainers written for FSDP2 test ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` with
torch's class (torchtitan's chunked loss, accelerate's prepare/save/clip paths, torch's
pipelining schedules), so renaming imports is not enough. Our ``FSDPModule`` therefore
derives from :class:`TorchFSDPBase`, which derives from torch's class and overrides every
method torch's class has: the ones the engine implements are defined on
``ragged_fsdp.fsdp.api.FSDPModule``; the rest are defined here, either as the same behaviour
(where ragged_fsdp already does what the call asks) or as a clear refusal. No method of
torch's class can run on our modules, since each reaches into FSDP2's private state.

Torch internals that touch an ``FSDPModule`` (checked in torch 2.13 and 2.15):

- ``register_fsdp_forward_method`` calls ``_get_fsdp_state()._pre_forward(module, args,
  kwargs)`` and ``._post_forward(module, args, out)``: our FSDPState has both with the same
  signatures, so it works.
- ``share_comm_ctx`` assigns ``_comm_ctx`` (CUDA streams shared across PP roots): the
  engine's state refuses the assignment (NotImplementedError naming ``share_comm_ctx``);
  reading it gives the root's own context, one per root.
- ``torch.distributed.pipelining`` (``stage.py``, ``schedules.py``, ``_backward.py``) tests
  ``isinstance(stage.submod, FSDPModule)`` and then calls, per stage:

  - before every backward call (full, input-gradient or weight-gradient pass, one per
    micro-batch): ``set_is_last_backward(False)``, ``set_reshard_after_backward(False)``,
    ``set_requires_gradient_sync(False)``: gradients accumulate unreduced in the groups'
    gradient buffers, parameters stay gathered;
  - at the end of the step (``perform_reduce_grad``), torch 2.13 and 2.14: the same three
    with True, then
    ``fully_shard.state(m)._state_ctx.all_states[*]._fsdp_param_groups[*].post_backward()``
    and ``fully_shard.state(m)._root_post_backward_final_callback()``: answered by
    :mod:`.torch_state` (reduce what accumulated, then the engine's end of backward), then
    ``p.grad.div_(n_microbatches)`` on the sharded grads (a local op);
  - torch 2.15 instead calls ``set_manual_backward_finalization(True)`` before each forward,
    and at the end of the step ``set_requires_gradient_sync(True)``,
    ``set_reshard_after_backward(True)``, ``finalize_backward(async_op=True)`` and the handle's
    ``wait()``, then ``set_manual_backward_finalization(False)``: implemented by the engine's
    ``FSDPModule`` (``fsdp/api.py``; the same reduction and end of backward). Its
    ``defer_reduce_grad_wait`` option (a stage's wait moved after the next stage's work)
    checks that no two stages share ``_get_fsdp_state()._comm_ctx``: ours never do;
  - after the first step's metadata inference: ``reshard()`` on every FSDPModule and
    ``param.grad = None``;
  - the multi-stage runtime's UNSHARD / RESHARD actions: ``unshard(async_op=True)`` and the
    handle's ``wait()``, ``reshard()``;
  - split backward (zero-bubble schedules): ``p.view_as(p)`` on every parameter the stage
    module holds (an identity view, local on RaggedShard) and ``weight.grad = dw`` /
    ``weight.grad += dw`` on the unsharded parameters, outside autograd's hooks (folded into
    the gradient buffer when the group reduces). On a *sharded* parameter (a block with
    ``reshard_after_forward=True``) the graph holds the unsharded one, so the weight
    gradient would be lost, as it is with FSDP2: the view marks the parameter and the
    end-of-step ``post_backward()`` refuses on every rank (:mod:`.torch_state`).
- ``torch._dynamo`` pickling of compiled packages looks up ``type.__mro__[2]`` in FSDP2's
  class table; compiled-package saving of a wrapped module is not supported.
"""

from __future__ import annotations

import inspect

import torch.distributed.fsdp as _torch_fsdp
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule

from ..comms.custom import HOOK_LANE
from .extension import check_comm, check_event, check_hook, check_stream

__all__ = ["TorchFSDPBase", "refuse_unknown_torch_methods", "TORCH_FSDP_MODULE", "TORCH_REDUCTION_HANDLE"]

TORCH_FSDP_MODULE = _TorchFSDPModule
# torch 2.15's finalize_backward(async_op=True) returns one; earlier torch has no such class
TORCH_REDUCTION_HANDLE: type = getattr(_torch_fsdp, "GradientReductionHandle", object)


def _refuse(name: str, why: str):
    raise NotImplementedError(f"ragged_fsdp FSDPModule.{name}: {why}")


class TorchFSDPBase(_TorchFSDPModule):
    """The part of torch's ``FSDPModule`` API that ragged_fsdp answers outside the engine."""

    # -- the same behaviour, for ragged_fsdp ---------------------------------------------
    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted: ragged_fsdp always reduces with SUM and applies the gradient divide
        factor after the reduction (no PREMUL_SUM / AVG), so this changes nothing."""
        if not isinstance(enable, bool):
            raise TypeError(f"set_force_sum_reduction_for_comms: expected a bool, got {enable!r}")

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated alias of :meth:`set_gradient_divide_factor` (as in torch)."""
        self.set_gradient_divide_factor(factor)

    def reset_iter_state(self) -> None:
        """After an exception aborted forward/backward: wait for reductions in flight, free
        unsharded parameters, drop the unreduced gradients and clear the per-iteration
        trackers of every group under this root (the failed step's gradients are lost, as in
        torch). ragged_fsdp also does this itself when forward raises, and at the next
        forward after a backward that raised. Under ``global_order`` it also drops the step
        in progress (its partial sums): the same as ``ragged_fsdp.abort_step(model)``."""
        self._fsdp_state().abort_step(drop_step=True)

    def _get_fsdp_state(self):
        """ragged_fsdp's FSDPState (torch's ``register_fsdp_forward_method`` calls its
        ``_pre_forward``/``_post_forward``, which have torch's signatures)."""
        return self._fsdp_state()

    def _apply(self, *args, **kwargs):
        # The engine's FSDPModule._apply re-points parameters itself and calls super():
        # skip torch's FSDPModule._apply (it reads FSDP2 state) and go to nn.Module's.
        return super(_TorchFSDPModule, self)._apply(*args, **kwargs)

    # -- FSDP2's comm hooks, per DBuffer (see fsdp/compat/extension.py) ----------------------------
    def _hook_groups(self):
        g = self._fsdp_state().group
        return [] if g is None else [g]

    def set_custom_all_gather(self, comm) -> None:
        """Use ``comm`` (a ``torch.distributed.fsdp`` ``AllGather``: ``allocate(size, *,
        dtype, device)`` and ``__call__(output_tensor, input_tensor, group, async_op)``)
        for this module's all-gathers (not recursive, as in torch; None restores the
        engine's own).

        What the comm sees is this design's unit, the **flat DBuffer segment**: one call
        per DBuffer of the module's group per unshard (a group has one buffer per dtype /
        trainability / mesh kind), with ``input_tensor`` this rank's ``S``-element segment
        (1-D; cast to the compute dtype in place in ``output_tensor``'s slot when
        ``mp_policy.param_dtype`` differs) and ``output_tensor`` the ``W*S``-element
        unsharded buffer, padding included, whose views are the unsharded parameters.
        ``allocate((W*S,), dtype=compute dtype, device=)`` is called for that buffer's
        memory each time it is gathered: a fresh tensor is moved into the buffer (no copy);
        one the comm keeps is gathered into and copied out of. Not called when the shard
        dim has one rank (nothing is gathered), nor for ``all_gather_quant`` buffers
        (refused). With ``reshard_after_forward=k`` the backward's gather from the kept
        parts goes through it too, over the node's ranks."""
        check_comm("set_custom_all_gather", comm, "AllGather")
        for g in self._hook_groups():
            if comm is not None and any(u.buf.quant is not None for u in g.units):
                raise ValueError(
                    "set_custom_all_gather: this module's group gathers fp8 codes and scales "
                    "(fully_shard(all_gather_quant=...)), two collectives per buffer that a custom "
                    "all-gather cannot replace; drop all_gather_quant or the custom comm")
            g.hooks.set_all_gather(comm)

    def set_custom_reduce_scatter(self, comm) -> None:
        """Use ``comm`` (a ``torch.distributed.fsdp`` ``ReduceScatter``: ``allocate`` and
        ``__call__(output_tensor, input_tensor, group, op, async_op)``) for this module's
        gradient reduce-scatters (not recursive, as in torch; None restores the engine's).

        One call per DBuffer per backward (a late gradient of a buffer reduced early is a
        second reduction): ``input_tensor`` is the buffer's flat unsharded gradient
        (``W*S`` elements in the reduce dtype, padding zero), ``output_tensor`` this rank's
        ``S``-element segment, and ``op`` is always ``ReduceOp.SUM``: the engine divides by
        the data-parallel size (or ``set_gradient_divide_factor``) afterwards. ``allocate``
        gives the unsharded gradient buffer autograd accumulates into, and the output
        segment when the result is cast or added into accumulated gradients. On HSDP it is
        the shard-dim reduce-scatter (the replicate-dim all-reduce stays the engine's). Not
        called when the shard dim has one rank."""
        check_comm("set_custom_reduce_scatter", comm, "ReduceScatter")
        for g in self._hook_groups():
            g.hooks.set_reduce_scatter(comm)

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        """Call ``hook(reduce_output)`` on each of this module's reduced gradients (not
        recursive, as in torch; None removes it). The hook changes the tensor in place;
        its return value is ignored.

        ``reduce_output`` is a **flat DBuffer segment**: 1-D, ``S`` elements (this rank's
        segment of one buffer, padding included, zeros there), in the reduce dtype
        (``mp_policy.reduce_dtype``, else the parameters' dtype), holding this backward's
        gradient only (not gradients accumulated from earlier backwards, which it is added
        into afterwards). It is the reduce-scatter output on FSDP and the replicate-dim
        all-reduce output on HSDP, in both cases **after** the divide factor: the mean over
        the data-parallel ranks (or the sum over ``set_gradient_divide_factor``), as FSDP2's
        hook sees it for fp32/bf16 reductions (its AVG / PREMUL_SUM ops divide inside the
        collective). Called once per DBuffer per reduction; not on HSDP backwards with
        ``set_requires_all_reduce(False)``.

        ``stream`` (CUDA, FSDP only, as in torch): the stream the hook runs on, after the
        reduce-scatter; by default it runs on the engine's all-reduce stream. On HSDP it
        always runs on the all-reduce stream (a ``stream`` raises ValueError)."""
        check_hook(hook)
        groups = self._hook_groups()
        for g in groups:
            check_stream(stream, any(u.dp.replicate is not None for u in g.units))
        for g in groups:
            g.hooks.set_all_reduce_hook(hook, stream)
            g.dev.use_stream(HOOK_LANE, stream)

    def set_post_optim_event(self, event) -> None:
        """Make the next all-gather of every buffer under this module's root wait on
        ``event`` (recorded after the optimizer step) instead of on the compute stream, so
        work queued after the step does not delay it (as torch's: one event per step, it is
        discarded once used; call it again each iteration). Before the root's first forward
        it applies to this module's subtree. A buffer's gathered memory is then allocated on
        the all-gather stream. On a CPU mesh the host order already runs the optimizer step
        first: the event's ``synchronize()`` is called once per buffer instead."""
        check_event(event)
        st = self._fsdp_state()
        states = st.ctx.all_states or self._fsdp_states(True)
        for s in states:
            if s.group is not None:
                s.group.set_post_optim_event(event)

    # -- refused, with the reason ----------------------------------------------------------
    def set_reduce_scatter_unused_params(self, *args, **kwargs) -> None:
        _refuse("set_reduce_scatter_unused_params", "not supported; unused parameters get a "
                "zero gradient from the group's single reduce-scatter")

    def set_reduce_scatter_max_input_buffers(self, *args, **kwargs) -> None:
        _refuse("set_reduce_scatter_max_input_buffers", "not supported; each group has one "
                "gradient buffer")

    def set_separate_reduce_scatter_group(self, *args, **kwargs) -> None:
        _refuse("set_separate_reduce_scatter_group", "not supported")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        _refuse("set_allocate_memory_from_process_group_for_comm", "not supported; DBuffers "
                "allocate their own storage")

    def set_symm_mem_for_comm(self, *args, **kwargs) -> None:
        _refuse("set_symm_mem_for_comm", "symmetric-memory comms are not supported (turn off "
                "torchtitan's --parallelism.enable_fsdp_symm_mem)")

    def set_keep_unsharded_storage(self, *args, **kwargs) -> None:
        _refuse("set_keep_unsharded_storage", "not supported; a group's gathered buffer is freed "
                "at reshard (CUDA graph capture of the unshard is not supported). To keep "
                "parameters gathered, pass reshard_after_forward=False")

    def _set_unshard_async_op(self, async_op: bool) -> None:
        _refuse("_set_unshard_async_op", "not supported; use unshard(async_op=True) for "
                "explicit prefetching")


def refuse_unknown_torch_methods(cls: type) -> None:
    """Give ``cls`` a refusing stub for every method of torch's ``FSDPModule`` that neither
    ``cls`` nor :class:`TorchFSDPBase` defines (a method added in a later torch must not
    fall through to FSDP2's implementation, which would read FSDP2 state we do not have)."""
    ours = set()
    for klass in cls.__mro__:
        if klass is _TorchFSDPModule:
            break
        ours.update(vars(klass))
    for name, value in vars(_TorchFSDPModule).items():
        if name in ours or name.startswith("__") or not inspect.isfunction(value):
            continue

        def stub(self, *args, _name=name, **kwargs):
            _refuse(_name, f"torch's FSDPModule.{_name} is not implemented by ragged_fsdp")

        stub.__name__ = name
        setattr(cls, name, stub)
