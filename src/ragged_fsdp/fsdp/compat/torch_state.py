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

from typing import Protocol

import torch.nn as nn
from torch.distributed.fsdp import fully_shard as _torch_fully_shard

from ragged_fsdp.placement.ops import VIEWED_SHARDED_ATTR

from ..torch_private import STATE_KEY as _STATE_KEY

_TORCH_FUNC = getattr(_torch_fully_shard, "__wrapped__", None)

__all__ = ["TorchStateView", "register_torch_state", "refuse_lost_weight_grads", "reduce_at_step_end"]


class PipelineGroup(Protocol):
    """What the pipeline schedule's end of step reads of a group (``core/param_group.py``'s
    ``ParamGroup``; this layer sits below the engine's core)."""

    infos: list  # ParamInfo: .fqn and .sharded

    def describe(self) -> str: ...

    def reduce_accumulated(self) -> None: ...


class _GroupView:
    __slots__ = ("_group",)

    def __init__(self, group: PipelineGroup) -> None:
        self._group = group

    def post_backward(self) -> None:
        reduce_at_step_end(self._group)


def reduce_at_step_end(group: PipelineGroup) -> None:
    """A pipeline step's end for one group (torch 2.13/2.14 through this view, 2.15 through
    ``finalize_backward``): refuse lost weight gradients, then reduce what accumulated."""
    refuse_lost_weight_grads(group)
    group.reduce_accumulated()


def refuse_lost_weight_grads(group: PipelineGroup) -> None:
    """Split backward (zero-bubble schedules) looked for the gradient accumulators of
    sharded parameters: their weight gradients were computed into nothing. Refused here,
    where the schedule asks each stage to reduce after its last micro-batch, so every rank
    of the pipeline has finished the step's sends and receives and none is left waiting
    (raising inside the schedule left the peer stages blocked in their receives)."""
    viewed = [i.fqn for i in group.infos if getattr(i.sharded, VIEWED_SHARDED_ATTR, False)]
    if not viewed:
        return
    for i in group.infos:
        if hasattr(i.sharded, VIEWED_SHARDED_ATTR):
            delattr(i.sharded, VIEWED_SHARDED_ATTR)
    raise RuntimeError(
        f"ragged_fsdp: {group.describe()}: the pipeline schedule's input-gradient pass looked for the "
        f"gradient accumulators of sharded parameters ({', '.join(viewed[:3])}{', ...' if len(viewed) > 3 else ''}): "
        "torch.distributed.pipelining's zero-bubble (split-backward) schedules do this, but after "
        "reshard_after_forward=True the autograd graph holds the unsharded parameters, so this step's "
        "weight gradients were lost. Pass reshard_after_forward=False to fully_shard for the modules of "
        "pipeline stages run by split-backward schedules (as torchtitan does under pipeline parallelism)"
    )


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
