"""The global-order mode's policy and its per-unit running sum (see
:mod:`..comms.ordered_reduce` for the order and ``ragged_fsdp.fsdp.deterministic`` for the
user's entry point).

A step is ``V`` micro-batches; rank ``d`` of ``W`` data-parallel ranks runs micro-batches
``d, d + W, ...`` as its micro-steps ``0 .. V/W - 1``, and every micro-step's backward
reduces (no ``no_sync``). The root counts the micro-steps whose backward completed
(:class:`Step`); each trainable unit keeps one :class:`Fold` while a step is running: the
fp32 accumulator of its segment, how many micro-steps it folded, and which slots got a
gradient. The step's last micro-step lands ``acc / V`` in the sharded grads and hands them
out; the earlier ones leave the sharded grads as they are (like HSDP's
``set_requires_all_reduce(False)``).

A unit whose modules did not run in a micro-step (a head used in some micro-steps only)
folds nothing for it, which is what autograd does on one process for a micro-batch that
does not reach a parameter; the count is the root's, so the step still ends after its last
micro-step and the unit's sum lands then (:meth:`..reduction.Reductions.end_micro_step`).

The step's state lives between micro-steps, so it is checked where a step ends
(:mod:`.step_boundary`): the optimizer step, a checkpoint of the model or optimizer, and
the next forward after a step was broken all raise while a step is partial, until
``abort_step()`` (or ``reset_iter_state()``) drops it.

What it refuses, and why (each raises naming the group and the fix):

* ``W`` not dividing ``V``: the micro-batch -> (rank, micro-step) map needs equal shares;
* ``set_requires_gradient_sync(False)``: a rank would sum its own micro-steps first
  (rank-major), which is the order this mode exists to avoid;
* ``set_requires_all_reduce(False)`` (HSDP): same, over the replicate dim;
* a custom reduce-scatter or an all-reduce hook: they sum (or see) a rank-order-dependent
  result; ``gradient_reduce=GradientReduce(...)``: its pieces are rounded to a wire dtype
  (the mode sends fp32 pieces);
* TP/EP layouts (parameters that are DTensors beyond the data-parallel dims, e.g. expert
  parallelism's token routing): their gradients come through collectives of their own whose
  order the mode does not control;
* gradients arriving after a unit's early reduction in the same backward (a parameter used
  after its owner module's backward): its micro-step would be folded in two parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GlobalOrder", "Fold", "Step", "check_unit", "refuse"]


@dataclass(frozen=True)
class GlobalOrder:
    """``micro_batches``: ``V``, the micro-batches per optimizer step (fixed size each)."""

    micro_batches: int

    def __post_init__(self):
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"global_order: micro_batches must be a positive int, got {self.micro_batches!r}")

    def micro_steps(self, world: int) -> int:
        """Micro-steps per step on each of ``world`` data-parallel ranks."""
        if self.micro_batches % world:
            raise ValueError(
                f"global_order(micro_batches={self.micro_batches}): the data-parallel world size {world} does not "
                f"divide it, so micro-batches cannot be dealt out equally; use a micro_batches that {world} divides "
                f"(e.g. {world * max(1, self.micro_batches // world)})")
        return self.micro_batches // world


@dataclass(eq=False)
class Fold:
    """One unit's running sum over the micro-steps of the step in progress."""

    acc: torch.Tensor  # fp32, one segment
    done: int  # micro-steps folded into it (not counting those the unit did not run in)
    touched: list[bool]  # per slot: got a gradient on this rank in any micro-step
    name: str  # the unit, for messages


@dataclass(eq=False)
class Step:
    """A root's place in the step under global order: ``done`` micro-steps of it completed
    their backward; ``broken``: why the step can no longer land (a backward that raised after
    some units folded its pieces, a refused optimizer step), until ``abort_step()``."""

    done: int = 0
    broken: str | None = None

    def break_(self, why: str) -> None:
        """Mark the step as one that can no longer land (the first reason is kept)."""
        if self.broken is None:
            self.broken = why


def refuse(what: str, group: str, fix: str) -> ValueError:
    return ValueError(f"ragged_fsdp.global_order: {what} ({group}) would make the gradient sum depend on the "
                      f"world size; {fix}")


def check_unit(unit, wire) -> None:
    """Refuse what the mode cannot order (see the module docstring)."""
    name = unit.group_name()
    hooks = unit.hooks
    if hooks.reduce_scatter is not None:
        raise refuse("set_custom_reduce_scatter", name, "remove the custom reduce-scatter")
    if hooks.all_reduce_hook is not None:
        raise refuse("set_all_reduce_hook", name, "remove the hook (or run it on the gradients after backward)")
    if wire is not None:
        raise refuse("fully_shard(gradient_reduce=...)", name, "pass gradient_reduce=None (the mode sends fp32 pieces)")
    if any(i.unsharded_spec is not None for i in unit.infos):
        raise refuse("a TP/EP layout (parameters that are DTensors beyond the data-parallel dims, e.g. expert "
                     "parallel token routing)", name, "use data parallelism only for these parameters")
