"""Collective cost: alpha-beta over the node topology, or a measured table.

Ring all-gather / reduce-scatter of an output of ``B`` bytes over ``W`` ranks moves
``(W-1)/W * B`` bytes through each rank's slowest link: NVLink inside a node; across nodes
the node's NICs together (one ring channel per rail, see :func:`_bw_lat`). Latency: ring steps inside the node plus a tree (log2) across nodes,
which is how NCCL keeps large-W latency bounded. A calibrated profile (CPU, gloo) instead
interpolates the measured seconds per size at the calibration world size.
"""

from __future__ import annotations

import bisect
import math

from .profiles import GPUProfile

__all__ = ["collective_time", "alltoall_time", "allreduce_time"]


def _measured(prof: GPUProfile, op: str, nbytes: float) -> float | None:
    ab = (prof.alpha_beta or {}).get(op)
    if ab:  # the calibrated alpha-beta line
        return ab[0] + nbytes / ab[1]
    table = (prof.collectives or {}).get(op)
    if not table:
        return None
    xs = [b for b, _ in table]
    ys = [t for _, t in table]
    if nbytes <= xs[0]:
        return ys[0]
    i = bisect.bisect_left(xs, nbytes)
    if i >= len(xs):  # extrapolate with the last segment's bandwidth
        bw = (xs[-1] - xs[-2]) / max(1e-12, ys[-1] - ys[-2])
        return ys[-1] + (nbytes - xs[-1]) / bw
    f = (nbytes - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[i - 1] + f * (ys[i] - ys[i - 1])


def _bw_lat(prof: GPUProfile, world: int, stride: int = 1, ring: bool = True) -> tuple[float, float]:
    """Bandwidth and latency for a group of ``world`` ranks spaced ``stride`` apart (inner
    mesh dims such as TP or EP take the ranks in between): NVLink when the whole group fits
    in one node. Across nodes a ring collective runs one channel per rail: each of the
    group's ``k`` ranks in a node carries its share over its own NIC, so a rank's traffic
    moves at ``k x net_bw`` (capped by NVLink). This is what nccl-tests measure: bus bandwidth
    across nodes close to the node's aggregate NIC bandwidth (NVIDIA/nccl-tests#119: 85-96 GB/s
    on A100 nodes with 4 x 200 Gb/s; NVIDIA/nccl#1218: ~200 GB/s all-gather on 256 H100 with
    8 x 400 Gb/s per node). An all-to-all (``ring=False``) goes through each rank's own NIC."""
    gpn = max(1, prof.gpus_per_node // max(1, stride))
    if world <= gpn:
        return prof.nvlink_bw, prof.alpha_intra * (world - 1)
    nodes = math.ceil(world / gpn)
    bw = min(prof.nvlink_bw, prof.net_bw * gpn) if ring else prof.net_bw
    return bw, prof.alpha_intra * (gpn - 1) + prof.alpha_inter * math.ceil(math.log2(nodes))


def collective_time(prof: GPUProfile, op: str, out_bytes: float, world: int, stride: int = 1) -> float:
    """All-gather (``op="all_gather"``, ``out_bytes`` = gathered size) or reduce-scatter
    (``"reduce_scatter"``, ``out_bytes`` = the unsharded input size)."""
    if world <= 1 or out_bytes <= 0:
        return 0.0
    got = _measured(prof, op, out_bytes)
    if got is not None:
        return got
    bw, lat = _bw_lat(prof, world, stride)
    return lat + (world - 1) / world * out_bytes / bw


def allreduce_time(prof: GPUProfile, nbytes: float, world: int, stride: int = 1) -> float:
    if world <= 1 or nbytes <= 0:
        return 0.0
    got = _measured(prof, "all_reduce", nbytes)
    if got is not None:
        return got
    bw, lat = _bw_lat(prof, world, stride)
    return 2 * lat + 2 * (world - 1) / world * nbytes / bw


def alltoall_time(prof: GPUProfile, nbytes: float, world: int, stride: int = 1) -> float:
    """All-to-all where each rank sends ``nbytes`` in total (spread over the others; its own
    share, ``1/world`` of it, stays local)."""
    if world <= 1 or nbytes <= 0:
        return 0.0
    got = _measured(prof, "all_to_all", nbytes)
    if got is not None:
        return got
    bw, lat = _bw_lat(prof, world, stride, ring=False)
    return lat + (world - 1) / world * nbytes / bw
