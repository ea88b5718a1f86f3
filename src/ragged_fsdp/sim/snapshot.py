"""What a peer-memory snapshot costs per rank and per step (``simulate --snapshot-every K``).

A snapshot (docs/surviving-failures.md) keeps each rank's shard of everything a step depends
on in host memory on its node, and a copy of it on one peer's node. Per rank and snapshot
that is the rank's sharded parameters, its optimizer state and (with error feedback) its
residuals, the ``S`` bytes the step model already counts. The rank copies ``S`` device to
host (its own copy) and sends ``S`` over the network to its peer, which receives ``S`` from
another rank: ``2 S`` of host memory per rank, on its node.

Time, per snapshot, each an upper bound of the copy's own cost, not a measured overlap:

* device to host: ``S / HOST_LINK_BW`` (one PCIe Gen5 x16 link per GPU, taken at
  ``HOST_LINK_BW``, an assumed effective rate: not measured on this project's machines);
* to the peer: ``S / net_bw`` (the profile's per-GPU network bandwidth, shared with the
  step's own collectives, which this does not model).

Both run beside the next step's compute (a side stream for the copy, the NIC for the send),
so the cost is hidden when ``(d2h + send) / K`` is below the step time minus the step's own
exposed communication; ``exposed_s`` is what is left when it is not. On CPU (this project's
tests) nothing overlaps: ``benchmarks/snapshot_cost.py`` measures that case.
"""

from __future__ import annotations

__all__ = ["HOST_LINK_BW", "snapshot_cost", "format_snapshot"]

# Assumed effective device-to-host rate of pinned copies on one GPU's PCIe Gen5 x16 link
# (64 GB/s per direction on paper); an assumption, printed as such with every estimate.
HOST_LINK_BW = 50e9


def snapshot_cost(result, profile, every: int) -> dict:
    """The snapshot's cost for one simulated framework ``result`` (a ``FrameworkResult``)
    on ``profile``, one snapshot every ``every`` steps."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"--snapshot-every {every!r} must be an int >= 1 (steps between snapshots)")
    shard = result.sharded_params + result.optimizer_states + result.memory_items.get("error-feedback residuals", 0.0)
    d2h = shard / HOST_LINK_BW
    send = shard / profile.net_bw
    per_step = (d2h + send) / every
    spare = max(0.0, result.step_s - result.time_parts.get("exposed comm", 0.0))
    return {
        "every": every,
        "bytes_per_rank": shard,
        "host_bytes_per_node": 2 * shard * profile.gpus_per_node,
        "d2h_s": d2h,
        "send_s": send,
        "per_step_s": per_step,
        "step_fraction": per_step / result.step_s,
        "exposed_s": max(0.0, per_step - spare),
        "assumed": f"device-to-host {HOST_LINK_BW / 1e9:.0f} GB/s per GPU (assumed), network {profile.net_bw / 1e9:.0f} "
                   "GB/s per GPU (profile), no contention with the step's collectives",
    }


def format_snapshot(costs: dict[str, dict]) -> str:
    """A few lines for the simulate CLI, one per framework."""
    lines = []
    for fw, c in costs.items():
        lines.append(f"  {fw}: {c['bytes_per_rank'] / 2**30:.2f} GiB per rank every {c['every']} step(s); "
                     f"device->host {c['d2h_s']:.3f}s, to the peer {c['send_s']:.3f}s; "
                     f"{c['step_fraction']:.1%} of a step if not overlapped, {c['exposed_s']:.3f}s exposed "
                     f"beside compute; host memory {c['host_bytes_per_node'] / 2**30:.1f} GiB per node")
    if costs:
        lines.insert(0, "peer-memory snapshot (" + next(iter(costs.values()))["assumed"] + "):")
    return "\n".join(lines)
