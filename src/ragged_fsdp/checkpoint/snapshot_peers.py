"""Which node keeps whose copy, and moving snapshot files between ranks over collectives.

Node identity. A copy on the same node is lost with the node, so the peer is chosen by node,
not by ``rank + 1``: under torchrun every worker of one agent has the same ``GROUP_RANK``
(the node's index in the rendezvous round), which is what tells four agents on one machine
apart; without it, ``rank // LOCAL_WORLD_SIZE`` (torchrun numbers ranks node by node). Nodes
are ordered by their lowest rank, and the ``i``-th rank of node ``n`` sends its part to the
``i``-th rank (mod its size) of node ``n + 1`` (mod the node count): every node's parts are
on the next node, so the loss of any one node loses no part.

Transfer. Each file travels as a ``uint8`` tensor by point-to-point ``isend``/``irecv`` on a gloo
group (the default group on CPU; ``Snapshots`` makes a gloo group over the same ranks on NCCL): first the
sizes, then the bytes, every message posted before any is waited on, so the order of the
pairs cannot deadlock.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["node_key", "peer_of", "send_files"]


def node_key() -> str:
    """This process's node, as torchrun names it (see the module docstring)."""
    if os.environ.get("GROUP_RANK") is not None:
        return f"group-{os.environ['GROUP_RANK']}"
    lws = os.environ.get("LOCAL_WORLD_SIZE")
    if lws and dist.is_initialized():
        return f"block-{dist.get_rank() // int(lws)}"
    import socket

    return f"host-{socket.gethostname()}"


def peer_of(keys: list[str]) -> list[int | None]:
    """For ranks whose nodes are ``keys`` (one per rank), the rank that keeps each one's copy:
    on the next node; None for every rank when there is one node only."""
    nodes: dict[str, list[int]] = {}
    for r, k in enumerate(keys):
        nodes.setdefault(k, []).append(r)
    order = sorted(nodes.values(), key=lambda rs: rs[0])
    if len(order) < 2:
        return [None] * len(keys)
    out: list[int | None] = [None] * len(keys)
    for n, ranks in enumerate(order):
        nxt = order[(n + 1) % len(order)]
        for i, r in enumerate(ranks):
            out[r] = nxt[i % len(nxt)]
    return out


def send_files(plan: list[tuple[int, int, str, str]], group=None) -> None:
    """Carry out ``plan``: entries ``(src rank, dst rank, src path, dst path)``, the same list
    on every rank. Each rank reads what it sends and writes what it receives (atomically: a
    file is either whole or absent). Ranks are global ranks; ``group`` a CPU-capable (gloo)
    group over every rank, or None for the default group. Raises on any failed message."""
    from .snapshot_store import write_atomic

    me = dist.get_rank()
    mine = [(i, e) for i, e in enumerate(plan) if me in (e[0], e[1]) and e[0] != e[1]]
    if not mine:
        return
    blobs, sizes, works = {}, {}, []
    for i, (src, dst, sp, _) in mine:
        if src == me:
            with open(sp, "rb") as f:
                blobs[i] = f.read()
            works.append(dist.isend(torch.tensor([len(blobs[i])], dtype=torch.int64), dst, group=group, tag=2 * i))
        else:
            sizes[i] = torch.zeros(1, dtype=torch.int64)
            works.append(dist.irecv(sizes[i], src, group=group, tag=2 * i))
    for w in works:
        w.wait()
    works, bufs = [], {}
    for i, (src, dst, _, _) in mine:
        if src == me:
            data = torch.frombuffer(bytearray(blobs[i]), dtype=torch.uint8) if blobs[i] else torch.zeros(0, dtype=torch.uint8)
            works.append(dist.isend(data, dst, group=group, tag=2 * i + 1))
        else:
            bufs[i] = torch.empty(int(sizes[i]), dtype=torch.uint8)
            works.append(dist.irecv(bufs[i], src, group=group, tag=2 * i + 1))
    for w in works:
        w.wait()
    for i, buf in bufs.items():
        dp = plan[i][3]
        os.makedirs(os.path.dirname(dp), exist_ok=True)
        write_atomic(dp, buf.numpy().tobytes())
