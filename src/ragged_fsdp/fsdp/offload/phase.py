"""``offload_to_host(model, optimizer)`` / ``load_to_device(model, optimizer)``: the whole
sharded model and its optimizer states to host memory and back, for the phase switches of
RL trainers (rollout engine in, trainer out, and back).

What moves, one copy per storage (not per tensor):

* each unit's sharded segment (the DBuffer: one copy per buffer); the sharded parameters stay
  the same objects and become views of the host copy, so the optimizer's keys and every
  reference to a parameter stay valid;
* the sharded gradients that exist (one copy per gradient segment);
* every tensor state of the optimizer (``optimizer.state``), grouped by storage: a
  ``ragged_fsdp.optim`` optimizer's flat state buffer is one copy, and its per-parameter
  views stay views of it (its ``_views`` mirror is updated with them).

What an ``offload_policy`` already keeps on the host stays where it is. Unsharded buffers are
freed first (``reshard``). Between the two calls the model refuses to run (a clear error:
call ``load_to_device``), ``state_dict()`` and DCP see the host tensors (same values), and
``load_to_device`` copies everything back into fresh device storage: training continues
with the same bits.

Copies use the device seam's ``"d2h"`` / ``"h2d"`` lanes; every copy is issued before the
first is waited for. Host buffers are pinned on a CUDA mesh.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import tracing as trace
from ..core.common import TrainingState
from ..core.init import state_of
from ..core.param_group import ParamGroup
from .staging import host_empty, policy_of
from ragged_fsdp.dbuffer import DBuffer
from ragged_fsdp.placement.dtensor import wrap

from ..core.sharded_param import local_of, make_sharded_grad, repoint

__all__ = ["offload_to_host", "load_to_device"]


def _groups(model: nn.Module) -> list[ParamGroup]:
    seen, out = set(), []
    for m in model.modules():
        st = state_of(m)
        if st is not None and st.group is not None and id(st.group) not in seen:
            seen.add(id(st.group))
            out.append(st.group)
    if not out:
        raise ValueError(f"offload_to_host/load_to_device: {type(model).__name__} has no fully_shard groups")
    return out


def _flat_of(t: torch.Tensor) -> torch.Tensor:
    """A flat tensor over the whole storage of ``t`` (in ``t``'s dtype)."""
    s = t.untyped_storage()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(s, 0, (s.nbytes() // t.element_size(),), (1,))


class _Mover:
    """Copies storages to one device, one copy per storage, all issued before any wait."""

    def __init__(self, dev, to: torch.device, pin: bool, lane: str):
        self.dev, self.to, self.pin, self.lane = dev, to, pin, lane
        self._new: dict[int, torch.Tensor] = {}
        self._copies = []

    def add(self, t: torch.Tensor) -> None:
        key = t.untyped_storage().data_ptr()
        if key in self._new or t.untyped_storage().nbytes() == 0:
            return
        src = _flat_of(t)
        if self.to.type == "cpu":
            dst = host_empty(src.numel(), src.dtype, self.pin)
        else:
            dst = torch.empty(src.numel(), dtype=src.dtype, device=self.to)
        self._new[key] = dst
        self._copies.append(self.dev.copy(self.lane, dst, src))

    def finish(self) -> None:
        for c in self._copies:
            c.wait()
        self._copies = []

    def moved(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as the same view of its storage's new copy."""
        if t.untyped_storage().nbytes() == 0:  # nothing on this rank (an empty local piece)
            return torch.empty(t.shape, dtype=t.dtype, device=self.to)
        new = self._new[t.untyped_storage().data_ptr()]
        if new.dtype != t.dtype:
            raise TypeError(f"offload: a storage viewed with two dtypes ({new.dtype}, {t.dtype})")
        return new.as_strided(t.shape, t.stride(), t.storage_offset())


def _state_tensors(optimizer, skip_param):
    """(param, key, tensor) of every tensor state worth moving (not 0-dim step counters)."""
    for p, st in optimizer.state.items():
        if skip_param(p):
            continue
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                yield p, k, v


def _replace_state(optimizer, p, k, old, new) -> None:
    optimizer.state[p][k] = new
    views = getattr(optimizer, "_views", None)
    if isinstance(views, dict) and views.get(p, {}).get(k) is old:
        views[p][k] = new


def _rewrap(old: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if hasattr(old, "_local_tensor"):
        return wrap(local, old._spec)
    return local


def _move(model: nn.Module, optimizer, to_host: bool) -> None:
    groups = _groups(model)
    for g in groups:
        if g.training_state is not TrainingState.IDLE:
            raise RuntimeError(f"offload_to_host/load_to_device: {g.describe()} is inside forward or "
                               "backward; call it between steps")
    if to_host and any(g.on_host is not None for g in groups):
        raise RuntimeError("offload_to_host: the model is already on the host; call load_to_device first")
    if not to_host and any(g.on_host is None for g in groups):
        raise RuntimeError("load_to_device: the model is not on the host; call offload_to_host first")
    device = groups[0].device
    pin = device.type == "cuda"
    dev = groups[0].dev
    mover = _Mover(dev, torch.device("cpu") if to_host else device, pin, "d2h" if to_host else "h2d")
    units, grads, states = [], [], []
    if any(not isinstance(u.buf, DBuffer) for g in groups for u in g.units):
        raise NotImplementedError(
            "offload_to_host / load_to_device: not implemented for models with tensor-subclass "
            "weights (fsdp_pre_all_gather / fsdp_post_all_gather, e.g. NF4 or float8): their gather "
            "inputs live in the subclass's own buffers, not in DBuffers")
    for g in groups:
        if to_host:
            g.reshard()
        for u in g.units:
            pol = u.offload.policy if u.offload is not None else None
            if not u.buf.host_sharded:
                units.append(u)
                mover.add(u.buf.sharded)
            if pol is None or not pol.grads:
                for info in u.infos:
                    if info.sharded.grad is not None:
                        grads.append(info)
                        mover.add(local_of(info.sharded.grad))
    if optimizer is not None:
        def on_host_by_policy(p):
            pol = policy_of(p)
            return pol is not None and pol.optimizer_states

        for p, k, v in _state_tensors(optimizer, on_host_by_policy):
            states.append((p, k, v))
            mover.add(local_of(v))
    mover.finish()
    for u in units:
        u.buf.replace_sharded(mover.moved(u.buf.sharded))
        trace.record("d2h" if to_host else "h2d", u, u.buf.sharded.numel() * u.buf.sharded.element_size())
    old_grads = {id(i): local_of(i.sharded.grad) for i in grads}
    for u in units:
        for info in u.infos:
            repoint(info.sharded, u.buf.sharded_view(info.slot))  # drops .grad when the device changes
            info.register(info.sharded)
    for info in grads:
        info.sharded.grad = make_sharded_grad(mover.moved(old_grads[id(info)]), info.sharded)
    for p, k, v in states:
        _replace_state(optimizer, p, k, v, _rewrap(v, mover.moved(local_of(v))))
    for g in groups:
        g.set_on_host(to_host)
        for u in g.units:
            u.forget_grad_segment()


def offload_to_host(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Move ``model``'s sharded parameters and gradients (every ``fully_shard`` group under
    it) and ``optimizer``'s states to host memory; device memory of the sharded state is
    released. Call between steps; the model refuses to run until :func:`load_to_device`."""
    _move(model, optimizer, to_host=True)


def load_to_device(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Undo :func:`offload_to_host`: everything it moved goes back to the mesh's device, with
    the same values and the same parameter objects."""
    _move(model, optimizer, to_host=False)
