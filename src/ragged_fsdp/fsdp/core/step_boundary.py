"""What a step in progress holds must be whole where a step ends.

Two modes keep state across the backward passes of one optimizer step:

* ``global_order``: each unit's fp32 running sum over the step's micro-steps, landed in the
  sharded grads after the last one (:mod:`.global_order`); the root counts the micro-steps
  whose backward completed;
* error feedback (``GradientReduce(error_feedback=True)``): the residual a backward's
  reductions staged, committed when that backward completes.

A step that stopped early (a ``break``, the end of the data), a micro-step that raised and
was skipped, or a save between micro-steps would otherwise carry half a step into the next
one, or drop it, with no error. So the places where a step ends check it, and raise
:class:`StepBoundaryError` naming the units and the fix:

* every ``torch.optim.Optimizer.step`` that holds a parameter of the model (the global
  step pre-hook :mod:`.stale_optimizer` installs); a refused step also marks the step
  broken, so a caught error cannot be stepped past;
* the next forward of a broken step;
* ``state_dict()`` of a wrapped module, and of an optimizer that stepped (what every
  checkpoint path reads first).

Between micro-steps a checkpoint is refused rather than carrying the partial sums: they are
a function of this world size's micro-step order (a rank's fold holds ``W`` pieces per
micro-step), so they could not load at another ``W``, which is what the mode is for; a
step boundary is at most ``V / W`` micro-steps away.

``abort_step()`` (``ragged_fsdp.abort_step(model)``, or ``model.reset_iter_state()``)
drops the step in progress: its running sums, its count and its staged residuals. The
check is also public (``ragged_fsdp.fsdp.deterministic.check_step_boundary``) for loops
that save or snapshot by other means.
"""

from __future__ import annotations

import weakref

import torch

from .stale_optimizer import add_step_check

__all__ = ["StepBoundaryError", "register_root", "problem", "check", "check_forward"]

_roots: weakref.WeakSet = weakref.WeakSet()  # root FSDPStates whose step state is checked


class StepBoundaryError(RuntimeError):
    """A step end (the optimizer step, a checkpoint, the next step's forward) found a step
    in progress: ``global_order``'s partial sums or error feedback's staged residual."""


def register_root(state) -> None:
    """``state`` (a root FSDPState, at lazy init) has its step checked at every optimizer step."""
    _roots.add(state)
    add_step_check(_before_optimizer_step)


def _steps(state) -> int | None:
    for st in state.ctx.all_states or [state]:
        g = st.group
        if g is not None and g.global_order is not None:
            for u in g.units:
                if u.trainable:
                    return g.global_order.micro_steps(u.dp.size)
    return None


def problem(state) -> str | None:
    """What a step end cannot pass under ``state``'s root, or None."""
    red = state.ctx.reductions
    parts = []
    if red.step.broken is not None:
        parts.append(f"global_order: the step is broken ({red.step.broken}); its partial sums were dropped")
    elif red.step.done or red.folds:
        steps = _steps(state)
        held = sorted(f"{f.name} ({f.done} folded)" for f in red.folds.values())
        listing = ", ".join(held[:6]) + (f" and {len(held) - 6} more" if len(held) > 6 else "")
        parts.append(f"global_order: the step is partial: {red.step.done} of its {steps} micro-steps per rank "
                     f"completed their backward" + (f"; units holding partial sums: {listing}" if held else ""))
    if red.staged:
        names = sorted({u.group_name() for u in red.staged.values()})
        parts.append(f"error feedback: a backward raised after {', '.join(names[:4])} staged a residual that was "
                     "never committed (its gradients were not handed out)")
    return "; ".join(parts) or None


_FIX = ("If this step is to be dropped (a break, the end of the data, an exception): call "
        "ragged_fsdp.abort_step(model) (or model.reset_iter_state()), then opt.zero_grad(), and run the next step "
        "from its first micro-step. Otherwise run the step's remaining micro-steps first (global_order: "
        "micro_batches / W backward passes per rank per step)")


def check(state, where: str) -> None:
    """Raise :class:`StepBoundaryError` if ``state``'s root is in the middle of a step."""
    what = problem(state)
    if what is not None:
        raise StepBoundaryError(f"ragged_fsdp: {where} in the middle of a step: {what}. {_FIX}")


def check_forward(state) -> None:
    """The forward that starts a micro-step: refused while the step is broken."""
    broken = state.ctx.reductions.step.broken
    if broken is not None:
        raise StepBoundaryError(
            f"ragged_fsdp: forward in a broken global_order step ({broken}); its gradients can no longer be "
            f"whole. {_FIX}")


def _holds(opt: torch.optim.Optimizer, state) -> bool:
    mine = {id(p) for st in state.ctx.all_states or [state] for m in st.modules for p in m.parameters()}
    return any(id(p) in mine for g in opt.param_groups for p in g["params"])


_HOOKED = "_ragged_fsdp_state_dict_checked"  # on an optimizer: its state_dict() checks the step


def _before_optimizer_step(opt: torch.optim.Optimizer) -> None:
    if _HOOKED not in opt.__dict__:  # an optimizer that steps has state a checkpoint saves
        opt.__dict__[_HOOKED] = opt.register_state_dict_pre_hook(check_optimizer_state_dict)
    for state in list(_roots):
        what = problem(state)
        if what is None or not _holds(opt, state):
            continue
        red = state.ctx.reductions
        if red.step.done or red.folds:
            red.step.break_(f"{type(opt).__name__}.step() ran after {red.step.done} micro-steps")
        raise StepBoundaryError(f"ragged_fsdp: {type(opt).__name__}.step() in the middle of a step: {what}; the "
                                f"optimizer did not step. {_FIX}")


def check_optimizer_state_dict(opt: torch.optim.Optimizer) -> None:
    """An optimizer's ``state_dict()`` (a checkpoint) while a model it steps is mid-step."""
    for state in list(_roots):
        if problem(state) is not None and _holds(opt, state):
            check(state, f"{type(opt).__name__}.state_dict() (a checkpoint)")
