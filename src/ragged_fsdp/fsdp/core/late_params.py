"""Refuse parameters that appear in a wrapped module after ``fully_shard``.

An adapter added after wrapping (LoRA's ``lora_A``/``lora_B`` set on a wrapped block) is a
plain parameter no group manages: autograd gives it a local gradient that no reduction
takes, so every rank steps it with its own data and the ranks diverge, with no error
(torch's FSDP2 does the same). The root's forward refuses it, naming the parameter and the
fix (add the adapters, then wrap).

Walking the model every forward would cost a pass over every parameter per micro-step, so
two global torch hooks (a parameter or a submodule registered on any module) bump a counter,
and a root walks its wrapped modules only when the counter moved since its last walk. The
engine's own parameter swaps write ``module._parameters`` directly and do not fire them.
"""

from __future__ import annotations

from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

from .init import walk

__all__ = ["LateParameterError", "watch", "generation", "check_no_late_params"]

_generation = 1
_handles: list = []


class LateParameterError(RuntimeError):
    """A parameter appeared in a wrapped module after ``fully_shard``; no group reduces it."""


def _bump(*args) -> None:
    global _generation
    _generation += 1


def watch() -> None:
    """Install the two registration hooks (once per process)."""
    if not _handles:
        _handles.append(register_module_parameter_registration_hook(_bump))
        _handles.append(register_module_module_registration_hook(_bump))


def generation() -> int:
    """Changes whenever a parameter or a submodule was registered on any module."""
    return _generation


def check_no_late_params(states) -> None:
    """Raise :class:`LateParameterError` if a module wrapped by one of ``states`` (the
    FSDPStates under one root) registers a parameter that its group did not shard and that
    was not in ``ignored_params``."""
    for st in states:
        g = st.group
        known = {id(p) for p in st.ignored}
        if g is not None:
            for info in g.infos:
                known.add(id(info.sharded))
                if info.unsharded is not None:
                    known.add(id(info.unsharded))
        for root in st.modules:
            for mod_name, sub in walk(root):
                for pname, p in sub._parameters.items():
                    if p is None or id(p) in known:
                        continue
                    where = ".".join(x for x in (g.fqn if g is not None else "", mod_name, pname) if x)
                    raise LateParameterError(
                        f"ragged_fsdp: parameter {where!r} (shape {tuple(p.shape)}) appeared in "
                        f"{type(root).__name__} after fully_shard wrapped it (e.g. a LoRA adapter added later): no "
                        "group sharded it, so its gradient would never be reduced and every rank would train its "
                        "own copy. Add the adapters first and then call fully_shard (blocks, then the root), or "
                        "pass the parameter in ignored_params at fully_shard and reduce its gradient yourself")
