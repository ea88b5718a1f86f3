"""What torch's ``fully_shard.state(module)`` answers for a ragged_fsdp module.

torch.distributed.pipelining ends a step on each stage (``PipelineStage.perform_reduce_grad``,
torch 2.13) by reaching into FSDP2's composable state: ``fully_shard.state(stage_module)``,
then ``post_backward()`` on every ``_fsdp_param_groups`` entry of every state in
``_state_ctx.all_states``, then ``_root_post_backward_final_callback()``. That lookup reads
``module.__dict__[STATE_KEY][<torch's undecorated fully_shard>]``, so ``fully_shard`` puts a
:class:`TorchStateView` there for every module it wraps. The view answers exactly those
attributes, mapped onto the engine:

- ``_fsdp_param_groups[i].post_backward()``: reduce what the group accumulated over the
  step's backward passes (:meth:`ParamGroup.reduce_accumulated`), including the gradients a
  weight-gradient pass wrote into ``.grad`` outside autograd's hooks;
- ``_root_post_backward_final_callback()``: the engine's own end of backward (wait for the
  reductions, hand the sharded gradients out, reset the step's trackers).

Nothing else of FSDP2's state exists here: any other attribute raises an AttributeError
naming it.
"""

from __future__ import annotations

import torch.nn as nn

try:
    from torch.distributed._composable.contract import STATE_KEY as _STATE_KEY
    from torch.distributed.fsdp import fully_shard as _torch_fully_shard

    _TORCH_FUNC = getattr(_torch_fully_shard, "__wrapped__", None)
except ImportError:  # pragma: no cover - a torch without the composable contract
    _STATE_KEY, _TORCH_FUNC = None, None

__all__ = ["TorchStateView", "register_torch_state"]


class _GroupView:
    __slots__ = ("_group",)

    def __init__(self, group) -> None:
        self._group = group

    def post_backward(self) -> None:
        self._group.reduce_accumulated()


class _ContextView:
    __slots__ = ("_ctx",)

    def __init__(self, ctx) -> None:
        self._ctx = ctx

    @property
    def all_states(self) -> list["TorchStateView"]:
        return [TorchStateView(st) for st in self._ctx.all_states]


class TorchStateView:
    """The part of FSDP2's ``FSDPState`` that torch's pipelining schedules use."""

    __slots__ = ("_state",)

    def __init__(self, state) -> None:
        self._state = state

    @property
    def _state_ctx(self) -> _ContextView:
        st = self._state
        if not st.ctx.all_states:  # never ran forward: it is its own (uninitialised) root
            st.lazy_init()
        return _ContextView(st.ctx)

    @property
    def _fsdp_param_groups(self) -> list[_GroupView]:
        g = self._state.group
        return [_GroupView(g)] if g is not None else []

    def _root_post_backward_final_callback(self) -> None:
        self._state._final_callback()


def register_torch_state(module: nn.Module, state) -> None:
    """Make ``torch.distributed.fsdp.fully_shard.state(module)`` return a view of ``state``."""
    if _STATE_KEY is None or _TORCH_FUNC is None:
        return
    module.__dict__.setdefault(_STATE_KEY, {})[_TORCH_FUNC] = TorchStateView(state)
