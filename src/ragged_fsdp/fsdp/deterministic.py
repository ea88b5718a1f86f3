"""Training that gives the same bits at any world size: the user's entry points.

``global_order(model, micro_batches=V)`` (once, on the root, after every ``fully_shard``)
makes a step's gradient a function of the parameters and the ``V`` micro-batches only:
micro-batch ``j`` runs on data-parallel rank ``j mod W`` as its micro-step ``j div W``
(:func:`micro_batches` lists a rank's ``j``), each micro-step's backward reduces, and the
owner of each segment adds the pieces in increasing ``j`` into an fp32 accumulator; the
divide by ``V`` comes once, after the last micro-step (see
:mod:`.comms.ordered_reduce`, :mod:`.core.global_order`). Each micro-batch's loss is its own
mean: do not divide it by the number of micro-steps.

Why one call on the root rather than a ``fully_shard`` argument: the order is a property of
the whole step (a group left out would sum in its own order, and the clipping and loss
helpers below need the same data-parallel ranks), so it is turned on, and checked, once for
every group under the root.

``clip_grad_norm_`` / ``total_norm``: the norm of all sharded gradients as an exact sum
(:func:`exact_sum_of_squares`), the same bits at any ``W`` and any layout. ``mean_loss``:
the logged loss, the ``V`` micro-batch losses added in increasing ``j``.

``abort_step`` / ``check_step_boundary``: a step's running sums live from its first
micro-step to its last, so a step that stops early is refused where a step ends (the
optimizer step, a checkpoint, the next forward of a broken step) until ``abort_step`` drops
it; see :mod:`.core.step_boundary`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ragged_fsdp.comm import all_gather_single

from .core.global_order import GlobalOrder, check_unit
from .core.shared_settings import agree_global_order
from .core.param_group import ParamGroup
from .core.step_boundary import StepBoundaryError, check

__all__ = ["global_order", "data_rank", "micro_batches", "mean_loss", "total_norm", "clip_grad_norm_",
           "exact_sum_of_squares", "abort_step", "check_step_boundary", "StepBoundaryError"]


def _groups(model: nn.Module) -> list[ParamGroup]:
    from .api import FSDPModule

    if not isinstance(model, FSDPModule):
        raise TypeError(f"global_order: expected the root module after fully_shard, got {type(model).__name__}")
    return [st.group for st in model._fsdp_states(True) if st.group is not None]


def _dp(model: nn.Module):
    """The data-parallel mesh every trainable unit shares (the mode needs one)."""
    dps = {}
    for g in _groups(model):
        for u in g.units:
            if u.trainable:
                key = (id(u.dp.shard.group), id(u.dp.replicate.group) if u.dp.replicate is not None else None)
                dps.setdefault(key, u.dp)
    if len(dps) != 1:
        raise ValueError(f"global_order: the trainable parameters live on {len(dps)} data-parallel meshes; the mode "
                         "needs one (one micro-batch -> rank map): shard every group over the same mesh")
    return next(iter(dps.values()))


def global_order(model: nn.Module, micro_batches: int) -> GlobalOrder:
    """Turn the global order on for every group under ``model`` (the root). Raises for
    what it cannot order (see :mod:`.core.global_order`); returns the policy."""
    groups = _groups(model)
    for g in groups:  # first: an EP layout is refused by name, not as "two meshes"
        for u in g.units:
            if u.trainable:
                check_unit(u, g.gradient_reduce)
    order = _agree(_dp(model), micro_batches)
    for g in groups:
        g.set_global_order(order)
    return order


def _agree(dp, micro_batches) -> GlobalOrder:
    """Validate ``micro_batches`` on this rank, then agree on it with every data-parallel rank
    (one exchange: an invalid value on one rank raises on every rank, a different one names
    each rank's value, a rank that went on to its forward instead pairs with this exchange
    and both raise). A mismatch would deal micro-batches out differently and hang or mis-pair
    the step's collectives."""
    order, error = None, None
    try:
        order = GlobalOrder(micro_batches)
        order.micro_steps(dp.size)
    except (ValueError, TypeError) as e:
        error = e
    agree_global_order(dp, micro_batches, error)
    return order


def _root_state(model: nn.Module, who: str):
    from .api import FSDPModule

    if not isinstance(model, FSDPModule):
        raise TypeError(f"{who}: expected a module after fully_shard (the root), got {type(model).__name__}")
    return model._fsdp_state()


def abort_step(model: nn.Module) -> None:
    """Drop the step in progress under ``model``'s root: ``global_order``'s running sums and
    micro-step count, error feedback's staged residuals, the gradients no reduction took
    (the step's gradients are lost, as after ``zero_grad()``; the sharded grads a completed
    step handed out stay until ``zero_grad()``). Call it on every rank, then
    ``opt.zero_grad()``, when a step stops before its last micro-step (a ``break``, the end
    of the data, a micro-step that raised); the next micro-step starts a new step. The same
    as ``model.reset_iter_state()``."""
    _root_state(model, "abort_step").abort_step(drop_step=True)


def check_step_boundary(model: nn.Module, what: str = "check_step_boundary") -> None:
    """Raise :class:`StepBoundaryError` (naming ``what``, the units and the fix) if
    ``model``'s root is in the middle of a step: ``global_order`` with a partial or broken
    step, or error feedback with a residual a raised backward staged. The optimizer step and
    ``state_dict()`` run it already; call it before saving or snapshotting by other means."""
    check(_root_state(model, "check_step_boundary"), what)


def _order_of(model: nn.Module) -> GlobalOrder:
    orders = {g.global_order for g in _groups(model)}
    if len(orders) != 1 or None in orders:
        raise ValueError("global_order is not on for every group of this model: call "
                         "ragged_fsdp.global_order(model, micro_batches=V) on the root first")
    return orders.pop()


def data_rank(model: nn.Module) -> tuple[int, int]:
    """``(d, W)``: this rank's data-parallel index (``replica * S + shard`` under HSDP) and
    the data-parallel world size."""
    dp = _dp(model)
    d = dp.shard.rank + (dp.replicate.rank * dp.shard.world_size if dp.replicate is not None else 0)
    return d, dp.size


def micro_batches(model: nn.Module) -> list[int]:
    """The micro-batch indices ``j`` this rank runs, in micro-step order: ``d, d + W, ...``."""
    order = _order_of(model)
    d, W = data_rank(model)
    return list(range(d, order.micro_batches, W))


def _gather_dp(dp, t: torch.Tensor) -> torch.Tensor:
    """``t`` of every data-parallel rank, stacked in the order of ``d``."""
    out = t.unsqueeze(0)
    for comm in (dp.shard, dp.replicate):  # shard first: d = replica * S + shard
        if comm is None or comm.world_size == 1:
            continue
        big = torch.empty((comm.world_size * out.shape[0], *out.shape[1:]), dtype=t.dtype, device=t.device)
        all_gather_single(big, out.contiguous(), group=comm.group)
        out = big
    return out


def mean_loss(model: nn.Module, losses) -> torch.Tensor:
    """The step's loss: the ``V`` micro-batch losses (this rank's ``losses``, one per
    micro-step, in order) added in increasing ``j`` in fp32, divided by ``V``. The same bits
    at any ``W``; call it on every rank."""
    order = _order_of(model)
    dp = _dp(model)
    W = dp.size
    mine = torch.stack([torch.as_tensor(x).detach().to(torch.float32).reshape(()) for x in losses])
    if mine.numel() != order.micro_steps(W):
        raise ValueError(f"mean_loss: expected {order.micro_steps(W)} losses (one per micro-step), got {mine.numel()}")
    every = _gather_dp(dp, mine)  # [d, m]: micro-batch j = m * W + d
    by_j = every.t().reshape(-1)
    total = by_j[0].clone()
    for j in range(1, by_j.numel()):
        total += by_j[j]
    return total / order.micro_batches


def _local(g: torch.Tensor) -> torch.Tensor:
    return g.to_local() if isinstance(g, DTensor) else g


def exact_sum_of_squares(tensors, count: int, group=None) -> torch.Tensor:
    """The sum of squares of every element of ``tensors`` (this rank's parts) over
    ``group``, as an fp64 scalar that does not depend on how the elements are split across
    ranks or tensors. ``count``: the number of elements over all ranks.

    Each square is exact in fp64 (for fp32 and narrower values) and is split into three
    terms on fixed grids set by the global maximum ``M`` and ``count``: ``2^(e - b k)`` for
    ``k = 1, 2, 3`` with ``M < 2^e`` and ``b = 52 - ceil(log2(count + 1))``. On each grid the
    terms are integer multiples of its step whose absolute sum stays below ``2^53`` steps, so
    every fp64 addition of them, in any order and across ranks, is exact. What the third grid
    drops is below ``count * 2^(e - 3b)``: for a billion elements, ``2^-66`` of ``M``."""
    parts = [_local(t).detach() for t in tensors]
    dev = parts[0].device if parts else torch.device("cpu")
    big = torch.zeros((), dtype=torch.float64, device=dev)
    for p in parts:
        if p.numel():
            big = torch.maximum(big, p.double().square().max())
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(big, op=dist.ReduceOp.MAX, group=group)
    m = float(big)
    if m == 0.0 or not math.isfinite(m):
        return big  # 0, inf or nan: no sum to order
    e = math.frexp(m)[1]
    b = 52 - math.ceil(math.log2(count + 1))
    if b < 4:
        raise ValueError(f"exact_sum_of_squares: {count} elements is too many for fp64 grids")
    grids = [math.ldexp(1.0, e - b * k) for k in (1, 2, 3)]
    sums = torch.zeros(3, dtype=torch.float64, device=dev)
    for p in parts:
        if not p.numel():
            continue
        r = p.double().square().reshape(-1)
        for k, q in enumerate(grids):
            a = torch.round(r / q) * q
            sums[k] += a.sum()
            r = r - a
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return (sums[0] + sums[1]) + sums[2]


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def _replicated(g: torch.Tensor) -> bool:
    """Whether every data-parallel rank holds the whole of ``g`` (a plain tensor: an
    ``ignored_params`` gradient the user all-reduces; a DTensor replicated on every dim)."""
    if not isinstance(g, DTensor):
        return True
    return all(pl.is_replicate() for pl in g.placements)


def total_norm(model: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all of ``model``'s gradients (2 or inf), the same bits at any ``W`` and
    layout; an fp32 scalar. Sums run over the shard dim only (HSDP's replicas hold the same
    sharded gradients). A gradient every rank holds whole (a parameter in ``ignored_params``,
    whose gradient the user all-reduces) counts once, from shard rank 0, not once per rank;
    it must be the same on every rank, as after the user's all-reduce."""
    dp = _dp(model)
    grads = _grads(model)
    group = dp.shard.group if dp.shard.world_size > 1 else None
    if norm_type == math.inf:
        locals_ = [_local(g).detach().abs().max() for g in grads if _local(g).numel()]
        dev = grads[0].device if grads else torch.device("cpu")
        m = torch.stack(locals_).max().float() if locals_ else torch.zeros((), device=dev)
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        return m
    if float(norm_type) != 2.0:
        raise ValueError(f"total_norm: norm_type must be 2 or inf for a world-size-invariant norm, got {norm_type}")
    count = sum(g.numel() for g in grads)  # a DTensor's numel is its global one
    if dp.shard.rank != 0:  # shard rank 0 adds the replicated ones, once
        grads = [g for g in grads if not _replicated(g)]
    return exact_sum_of_squares(grads, count, group).sqrt().to(torch.float32)


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with :func:`total_norm`: every gradient is scaled
    by ``min(1, max_norm / (norm + 1e-6))`` (computed in fp32, as torch does). Returns the
    total norm."""
    norm = total_norm(model, norm_type)
    coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
    for g in _grads(model):
        local = _local(g)
        local.mul_(coef.to(local.dtype))
    return norm
