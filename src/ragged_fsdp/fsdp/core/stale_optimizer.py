"""Catch an optimizer built before ``fully_shard``: it holds the parameters ``fully_shard``
replaced, whose gradients never arrive, so every step moves nothing and nothing says so
(torch's FSDP2 has the same trap).

``fully_shard`` remembers each parameter it replaced with a sharded one (weakly: the
record goes when the old parameter does) and registers, once per process, a global
optimizer step pre-hook. The hook checks an optimizer's parameters against that record the
first time it steps, and again only after another ``fully_shard`` call replaced parameters
or the optimizer's parameters changed (compared by identity: a parameter swapped in a
group, added to one, or a new group); every other step costs one attribute read and an
identity comparison per parameter. The same hook runs the checks other modules add
(:func:`add_step_check`: the step-boundary check of :mod:`.step_boundary`). :func:`check_optimizer` is the same check for callers that hold an
optimizer without stepping it (``TrainState`` before a save or load). The same first-step
check refuses torch.optim optimizers that cannot run on sharded parameters
(:mod:`.torch_optimizers`).
"""

from __future__ import annotations

import itertools
import operator

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from .torch_optimizers import check_torch_optimizer

__all__ = ["remember_replaced", "check_optimizer", "add_step_check", "StaleOptimizerError"]

_replaced = WeakIdKeyDictionary()  # an old parameter -> how to name it
_generation = 0  # bumped by every fully_shard call that replaced a parameter
_hook = None
_CHECKED = "_ragged_fsdp_checked"  # on an optimizer: (_generation, its parameters) it passed at
_step_checks: list = []  # more checks run before every optimizer step (add_step_check)


class StaleOptimizerError(RuntimeError):
    """An optimizer holds parameters that ``fully_shard`` replaced: it was built too early."""


def remember_replaced(old: torch.nn.Parameter, name: str) -> None:
    """``fully_shard`` replaced ``old`` (called ``name`` in errors) with a sharded parameter."""
    global _generation
    _replaced[old] = name
    _generation += 1
    _install()


def _install() -> None:
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_pre_step)


def add_step_check(fn) -> None:
    """Run ``fn(optimizer)`` before every optimizer step (once per ``fn``); it raises to
    stop the step."""
    if fn not in _step_checks:
        _step_checks.append(fn)
    _install()


def check_optimizer(opt: torch.optim.Optimizer) -> None:
    """Raise :class:`StaleOptimizerError` naming the first parameter of ``opt`` that a
    ``fully_shard`` call replaced."""
    if not len(_replaced):
        return
    for k, group in enumerate(opt.param_groups):
        names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            name = _replaced.get(p)
            if name is None:
                continue
            given = f" (its param group calls it {names[i]!r})" if names is not None and i < len(names) else ""
            raise StaleOptimizerError(
                f"ragged_fsdp: {type(opt).__name__} holds parameter {name}{given} in param group {k}, which "
                "fully_shard replaced with a sharded parameter: this optimizer would never see a gradient and "
                "train nothing. Build the optimizer after fully_shard (after the last call, on the root), e.g. "
                "opt = torch.optim.AdamW(model.parameters()); the same for param-group helpers such as "
                "muon_param_groups(model)")


def _same(a: tuple, b: tuple) -> bool:
    # map(operator.is_) and chain run in C: no Python frame per parameter on every step (a
    # generator here was about 700 profiled calls per step on the 48-block host-cost model)
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _pre_step(opt: torch.optim.Optimizer, args, kwargs) -> None:
    for fn in _step_checks:
        fn(opt)
    params = tuple(itertools.chain.from_iterable(g["params"] for g in opt.param_groups))
    seen = opt.__dict__.get(_CHECKED)
    if seen is not None and seen[0] == _generation and _same(seen[1], params):
        return
    if len(_replaced):  # (the old parameters may all be gone: nothing stale to find then)
        check_optimizer(opt)
    check_torch_optimizer(opt)  # not under that test: it looks at the sharded parameters themselves
    opt.__dict__[_CHECKED] = (_generation, params)
