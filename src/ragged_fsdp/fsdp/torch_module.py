"""Make ragged_fsdp's wrapped modules instances of torch's own ``FSDPModule`` too.

Trainers written for FSDP2 test ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` with
torch's class (torchtitan's chunked loss, accelerate's prepare/save/clip paths, torch's
pipelining schedules), so renaming imports is not enough. Our ``FSDPModule`` therefore
derives from :class:`TorchFSDPBase`, which derives from torch's class and overrides every
method torch's class has: the ones the engine implements are defined on
``ragged_fsdp.fsdp.api.FSDPModule``; the rest are defined here, either as the same behaviour
(where ragged_fsdp already does what the call asks) or as a clear refusal. No method of
torch's class can run on our modules, since each reaches into FSDP2's private state.

Torch internals that touch an ``FSDPModule`` (checked in torch 2.13):

- ``register_fsdp_forward_method`` calls ``_get_fsdp_state()._pre_forward(module, args,
  kwargs)`` and ``._post_forward(module, args, out)``: our FSDPState has both with the same
  signatures, so it works.
- ``share_comm_ctx`` touches ``_comm_ctx`` (CUDA streams shared across PP roots): refused by
  :meth:`TorchFSDPBase._get_fsdp_state` not having it (an AttributeError naming it).
- ``torch.distributed.pipelining`` (``stage.py``, ``schedules.py``, ``_backward.py``) tests
  ``isinstance(stage.submod, FSDPModule)`` and then calls, per stage:

  - before every backward call (full, input-gradient or weight-gradient pass, one per
    micro-batch): ``set_is_last_backward(False)``, ``set_reshard_after_backward(False)``,
    ``set_requires_gradient_sync(False)``: gradients accumulate unreduced in the groups'
    gradient buffers, parameters stay gathered;
  - at the end of the step (``perform_reduce_grad``): the same three with True, then
    ``fully_shard.state(m)._state_ctx.all_states[*]._fsdp_param_groups[*].post_backward()``
    and ``fully_shard.state(m)._root_post_backward_final_callback()``: answered by
    :mod:`.torch_state` (reduce what accumulated, then the engine's end of backward), then
    ``p.grad.div_(n_microbatches)`` on the sharded grads (a local op);
  - after the first step's metadata inference: ``reshard()`` on every FSDPModule and
    ``param.grad = None``;
  - the multi-stage runtime's UNSHARD / RESHARD actions: ``unshard(async_op=True)`` and the
    handle's ``wait()``, ``reshard()``;
  - split backward (zero-bubble schedules): ``p.view_as(p)`` on every parameter the stage
    module holds (an identity view, local on RaggedShard) and ``weight.grad = dw`` /
    ``weight.grad += dw`` on the unsharded parameters, outside autograd's hooks (folded into
    the gradient buffer when the group reduces). On a *sharded* parameter (a block with
    ``reshard_after_forward=True``) that view raises: the graph holds the unsharded one, so
    the weight gradient would be lost, as it is with FSDP2.
- ``torch._dynamo`` pickling of compiled packages looks up ``type.__mro__[2]`` in FSDP2's
  class table; compiled-package saving of a wrapped module is not supported.
"""

from __future__ import annotations

import inspect

try:  # torch >= 2.6 exports it here; the private path is the fallback
    from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._composable.fsdp import FSDPModule as _TorchFSDPModule

__all__ = ["TorchFSDPBase", "refuse_unknown_torch_methods", "TORCH_FSDP_MODULE"]

TORCH_FSDP_MODULE = _TorchFSDPModule


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
        unsharded parameters and clear the per-iteration trackers of every group under
        this root (the failed step's gradients are lost, as in torch)."""
        st = self._fsdp_state()
        ctx = st.ctx
        ctx.reductions.clear()
        states = ctx.all_states or [st]
        for s in states:
            if s.group is not None:
                s.group.reshard()
        ctx.reset(states, aborted=True)

    def _get_fsdp_state(self):
        """ragged_fsdp's FSDPState (torch's ``register_fsdp_forward_method`` calls its
        ``_pre_forward``/``_post_forward``, which have torch's signatures)."""
        return self._fsdp_state()

    def _apply(self, *args, **kwargs):
        # The engine's FSDPModule._apply re-points parameters itself and calls super():
        # skip torch's FSDPModule._apply (it reads FSDP2 state) and go to nn.Module's.
        return super(_TorchFSDPModule, self)._apply(*args, **kwargs)

    # -- refused, with the reason ----------------------------------------------------------
    def set_custom_all_gather(self, comm) -> None:
        _refuse("set_custom_all_gather", "custom all-gather comms are not supported; ragged_fsdp "
                "all-gathers each group's DBuffer segment with one collective")

    def set_custom_reduce_scatter(self, comm) -> None:
        _refuse("set_custom_reduce_scatter", "custom reduce-scatter comms are not supported")

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        _refuse("set_all_reduce_hook", "gradient all-reduce hooks (HSDP / custom replicate "
                "reduction) are not supported on ragged_fsdp's 1-D meshes")

    def set_post_optim_event(self, event) -> None:
        _refuse("set_post_optim_event", "not supported; ragged_fsdp orders the next all-gather "
                "after the optimizer step on the current stream")

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
