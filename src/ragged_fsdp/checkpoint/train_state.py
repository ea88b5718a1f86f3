"""A Stateful that saves a model and its optimizers the robust way.

``dcp.save({"model": model.state_dict(), "optim": opt.state_dict()})`` works, but loading
that way needs an optimizer that already has state (a fresh one has none, so its moments
would be skipped). ``TrainState`` goes through ``get_state_dict`` / ``set_state_dict``, which
create the optimizer state first and key it by parameter name, not position::

    state = {"train": TrainState(model, opt), "step": step}
    ragged_fsdp.checkpoint.save(state, root)
    ragged_fsdp.checkpoint.load_latest(root, {"train": TrainState(model, opt)}, missing_ok=True)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.distributed.checkpoint.stateful import Stateful

from ragged_fsdp.fsdp import check_optimizer

from .state_dict import StateDictOptions, get_state_dict, get_model_state_dict, set_model_state_dict, set_state_dict

__all__ = ["TrainState"]


class TrainState(Stateful):
    def __init__(
        self,
        model: nn.Module,
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (),
        *,
        options: StateDictOptions | None = None,
    ):
        self.model = model
        self.optimizers = (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)
        self.options = options

    def _check_optimizers(self) -> None:
        # an optimizer built before fully_shard holds the replaced parameters: torch's
        # get_state_dict would fail on it with a bare KeyError, and it never trained
        for opt in self.optimizers:
            check_optimizer(opt)

    def state_dict(self):
        self._check_optimizers()
        if not self.optimizers:
            return {"model": get_model_state_dict(self.model, options=self.options)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers, options=self.options)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict):
        self._check_optimizers()
        if not self.optimizers:
            set_model_state_dict(self.model, state_dict["model"], options=self.options)
            return
        set_state_dict(
            self.model, self.optimizers,
            model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"],
            options=self.options,
        )
