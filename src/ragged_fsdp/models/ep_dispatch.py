"""Expert-parallel routed experts: token all-to-all to the experts' ranks and back.

Each EP rank holds ``E_local = E / ep_size`` experts (a ``Shard(0)`` block of the fused
weights). A forward on one rank:

1. sort its (token, slot) pairs by expert (``ep_routing.sort_by_expert``);
2. exchange per-expert counts with an all-to-all, so every rank knows how many rows it will
   receive from each source for each of its local experts (the splits are uneven);
3. all-to-all the token rows to the owning ranks;
4. run each local expert on the rows it received (from all sources at once);
5. all-to-all the results back (the reverse splits);
6. weight each result by its router probability and ``index_add`` it into the token's row,
   in expert order, as the single-process loop does.

The row all-to-all is differentiable (its backward is the reverse all-to-all), so the
gradient of a token's output flows back to the expert's rank and the gradient of the
expert's input flows back to the token's rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .ep_routing import rank_splits, received_expert_ids, sort_by_expert

__all__ = ["all_to_all_rows", "expert_parallel_experts"]


class _AllToAllRows(torch.autograd.Function):
    """Rows of ``x`` split ``send`` ways out, ``recv`` ways in; backward swaps the splits.

    Written here rather than taken from ``torch.distributed.nn.functional.all_to_all_single``,
    which works (autograd, uneven splits, gloo) but warns ``FutureWarning`` on every call in
    torch 2.13 (deprecated for the private functional collectives).
    """

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        x = x.contiguous()
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAllRows.apply(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Differentiable uneven all-to-all along dim 0 (``send[s]`` rows go to rank ``s`` of
    ``group``, ``recv[s]`` rows come from it)."""
    return _AllToAllRows.apply(x, list(send), list(recv), group)


def _swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    # the same ops, in the same order, as FusedExperts.expert
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def expert_parallel_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    chosen: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    n_experts: int,
    group,
    ep_size: int,
) -> torch.Tensor:
    """The routed-experts output ``[N, D]`` for this rank's tokens ``x [N, D]``.

    ``weights``/``chosen`` ``[N, k]``: router weights (in ``x``'s dtype) and expert ids.
    ``w1/w2/w3``: this rank's local experts ``[E_local, ...]`` (plain tensors).
    """
    E_local = n_experts // ep_size
    order, rows, counts = sort_by_expert(chosen, n_experts)
    # every rank needs its recv splits before the row all-to-all: exchange the counts, chunk
    # s of `counts` (experts of rank s) goes to rank s
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    recv_counts = recv_counts.view(ep_size, E_local)
    send = rank_splits(counts, ep_size).tolist()
    recv = recv_counts.sum(1).tolist()

    received = all_to_all_rows(x[rows], send, recv, group)
    ids = received_expert_ids(recv_counts)
    y = torch.zeros_like(received)
    # every local expert runs, even on zero rows: its weights then get a (zero) gradient,
    # so a rank whose experts nobody picked still has gradients, as the fused weight has
    # without EP whenever any expert is used
    for j in range(E_local):
        sel = (ids == j).nonzero(as_tuple=True)[0]
        y = y.index_add(0, sel, _swiglu(received[sel], w1[j], w2[j], w3[j]))
    back = all_to_all_rows(y, recv, send, group)

    w_sorted = weights.reshape(-1)[order].unsqueeze(-1)
    # pairs are in expert order, so each token adds its experts' outputs in ascending expert
    # order onto zero: the single-process loop's order of additions
    return torch.zeros_like(x).index_add(0, rows, back * w_sorted)
