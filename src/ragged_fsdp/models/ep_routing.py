"""Index arithmetic of expert-parallel token dispatch (no communication here).

A rank routes each of its N tokens to k experts. The (token, slot) pairs are put in expert
order, so that the pairs bound for EP rank ``s`` (which owns experts
``[s * E_local, (s + 1) * E_local)``) form one contiguous run: the send buffer of a token
all-to-all. The receiving rank gets, from every source rank in turn, its tokens grouped by
local expert.
"""

from __future__ import annotations

import torch

__all__ = ["sort_by_expert", "rank_splits", "received_expert_ids"]


def sort_by_expert(chosen: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``chosen [N, k]`` (expert ids) -> ``(order, rows, counts)``.

    ``order [N*k]``: flat (token, slot) ids ``token * k + slot`` sorted by expert. The sort is
    stable, so within one expert the tokens stay ascending: the row order in which the
    single-process loop (``nonzero`` of ``chosen == e``) feeds that expert.
    ``rows [N*k]``: the token of each sorted pair. ``counts [n_experts]``: pairs per expert.
    """
    flat = chosen.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    rows = torch.div(order, max(chosen.shape[-1], 1), rounding_mode="floor")
    counts = torch.bincount(flat, minlength=n_experts)
    return order, rows, counts


def rank_splits(counts: torch.Tensor, ep_size: int) -> torch.Tensor:
    """Per-expert counts ``[E]`` -> rows per EP rank ``[ep_size]`` (experts are owned in
    contiguous blocks of ``E // ep_size``, as ``Shard(0)`` lays them out)."""
    return counts.view(ep_size, -1).sum(1)


def received_expert_ids(recv_counts: torch.Tensor) -> torch.Tensor:
    """``recv_counts [S, E_local]`` (rows each source rank sends to each local expert) -> the
    local expert of every received row, in the order the all-to-all delivers them (source
    rank major, then local expert)."""
    S, E_local = recv_counts.shape
    ids = torch.arange(E_local, device=recv_counts.device).repeat(S)
    return torch.repeat_interleave(ids, recv_counts.reshape(-1))
