"""Step time of one rank: compute per group (:mod:`.compute`), the collectives of every
group with alpha-beta costs, overlapped per phase one group ahead, framework copies, the
optimizer step (memory-bound; Muon's Newton-Schulz on each matrix's owner), TP and CP
collectives (:mod:`.tensor_parallel`, :mod:`.context`), and the pipeline bubble
(:mod:`.pipeline`).

Under PP the FSDP collectives run once per step (torchtitan keeps a stage's parameters
unsharded across its microbatches and reduces the gradients after the last one), so their
exposure is that of one microbatch's compute; the step is ``(microbatches + bubble) x``
the per-microbatch stage time plus that exposure, the copies and the optimizer.

Overlap: the all-gather of the next group runs while the current group computes (forward
and backward), the reduce-scatter of a group while the next group's backward computes. A
fraction ``profile.overlap`` of a collective can hide under that compute; what does not is
exposed. The first all-gather and the last reduce-scatter are always exposed. Copies
(copy-out/copy-in) run on the compute stream, so they add to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .buffers import LIFETIMES
from .comm import allreduce_time, alltoall_time, collective_time
from .layout import GroupLayout
from .profiles import GPUProfile

__all__ = ["TimeInputs", "TimeResult", "step_time", "newton_schulz_flops"]


@dataclass
class TimeInputs:
    layouts: list[GroupLayout]
    comp_f: list[float]  # seconds of each group's forward, one microbatch, this rank (:mod:`.compute`)
    comp_b: list[float]  # seconds of each group's backward incl. recomputation
    cb: int
    rb: int
    replicate: int = 1  # HSDP replicas (all-reduce of the sharded gradient across them)
    kept: set = field(default_factory=set)
    root: int | None = None
    reshard_after_forward: bool = True
    opt_elems: float = 0.0  # sharded elements the optimizer updates
    optimizer: str = "adamw"
    ns_flops: float = 0.0  # Muon: Newton-Schulz flops of all matrices (whole model)
    ns_world: int = 1  # ranks sharing the Newton-Schulz work (ragged: owners; others: none)
    ns_gather_bytes: float = 0.0  # Muon: bytes of whole matrices each rank assembles (all-gather)
    ns_a2a_bytes: float = 0.0  # Muon: bytes each rank sends to / receives from owners (all-to-all)
    ep_bytes: float = 0.0  # EP all-to-all bytes per rank per microbatch (dispatch + combine, fwd + bwd)
    ep_world: int = 1
    ep_s: float | None = None  # EP dispatch + combine seconds per microbatch (sim/moe.py); None: from ep_bytes
    tp_exposed: float = 0.0  # seconds of TP collectives on the critical path per microbatch
    tp_total: float = 0.0
    cp_exposed: float = 0.0  # seconds of the CP ring not hidden under attention per microbatch
    cp_total: float = 0.0
    gather_cb: list[float] | None = None  # all-gather bytes per element per group (float8 all-gather)
    microbatches: int = 1  # PP: microbatches per step (FSDP gathers once per step under PP)
    bubble: float = 0.0  # PP: idle time in microbatch units
    p2p_fill: float = 0.0  # PP: warm-up + cool-down transfer seconds on the critical path
    extra_compute: float = 0.0  # seconds of non-matmul work (calibrated CPU profiles)
    # ragged_fsdp's gradient_reduce: bytes per element on the wire (None: the fp32
    # reduce-scatter) and the local work's memory traffic per unsharded gradient element:
    # sender-side (quantise, error feedback; on the compute stream, never hidden) and the
    # receiver's dequantise + fp32 sum (on the reduction's lane, hidden like the collective)
    wire_bytes: float | None = None
    wire_sender_bytes: float = 0.0
    wire_sum_bytes: float = 0.0


@dataclass
class TimeResult:
    step: float
    compute: float
    exposed_comm: float
    total_comm: float
    copies: float
    optimizer: float
    parts: dict  # additive: they sum to ``step``
    comm_phases: dict = field(default_factory=dict)  # exposed FSDP comm per phase, and totals
    reduce_sent_bytes: float = 0.0  # bytes one rank sends per step for the shard dim's gradient reduction
    wire_local_s: float = 0.0  # seconds of the wire format's local work (sender + receiver), per step


def newton_schulz_flops(m: int, n: int, steps: int = 5) -> float:
    """Flops of ``steps`` quintic Newton-Schulz iterations on an ``m x n`` matrix (m <= n):
    A = X X^T (2 m^2 n), B = b A + c A A (2 m^3), X = a X + B X (2 m^2 n)."""
    m, n = min(m, n), max(m, n)
    return steps * (4.0 * m * m * n + 2.0 * m ** 3)


def step_time(framework: str, prof: GPUProfile, t: TimeInputs) -> TimeResult:
    life = LIFETIMES[framework]
    L = t.layouts
    n = len(L)
    rate = ((prof.fp32_flops or prof.flops) if t.cb == 4 and prof.fp32_flops else prof.flops) * prof.efficiency
    comp_f, comp_b = list(t.comp_f), list(t.comp_b)
    gcb = t.gather_cb or [float(t.cb)] * n
    ag = [collective_time(prof, "all_gather", g.gathered * gcb[i], g.shard_world, g.stride) for i, g in enumerate(L)]
    if t.wire_bytes is None:
        rs = [collective_time(prof, "reduce_scatter", g.gathered * t.rb, g.shard_world, g.stride) for g in L]
        sent = sum((g.shard_world - 1) / g.shard_world * g.gathered * t.rb for g in L if g.shard_world > 1)
        sender = [0.0] * n
    else:  # all-to-all of the codes (+ scales), then the receiver's dequantise + fp32 sum
        rs = [alltoall_time(prof, g.gathered * t.wire_bytes, g.shard_world, g.stride)
              + g.gathered * t.wire_sum_bytes / prof.mem_bw for g in L]
        sent = sum((g.shard_world - 1) / g.shard_world * g.gathered * t.wire_bytes for g in L if g.shard_world > 1)
        sender = [g.gathered * t.wire_sender_bytes / prof.mem_bw for g in L]
    # HSDP: the replicate dim's all-reduce of the segment, fp32 in every mode
    rs = [x + allreduce_time(prof, g.segment * t.rb, t.replicate, g.stride * g.shard_world) for x, g in zip(rs, L)]
    o = prof.overlap

    def hide(comm, comp):
        return max(comm - o * comp, (1 - o) * comm)

    # per phase: each group's all-gather hides under the previous group's forward, each
    # reduce-scatter (and the re-gather for backward) under the next group's backward
    order = ([t.root] if t.root is not None else []) + [i for i in range(n) if i != t.root]
    exposed = ag[order[0]] if order else 0.0
    kept = set(t.kept) | ({t.root} if t.root is not None else set())
    phases = {"all-gather (forward)": exposed}
    for pos, i in enumerate(order[:-1]):
        exposed += hide(ag[order[pos + 1]], comp_f[i])
    phases["all-gather (forward)"] = exposed
    back = [i for i in reversed(range(n)) if i != t.root]
    regather = [ag[i] if (t.reshard_after_forward and i not in kept) else 0.0 for i in range(n)]
    bwd_exposed = regather[back[0]] if back else 0.0
    for pos, i in enumerate(back):
        comm = (regather[back[pos + 1]] if pos + 1 < len(back) else 0.0) + (rs[back[pos - 1]] if pos else 0.0)
        bwd_exposed += hide(comm, comp_b[i])
    if back:
        bwd_exposed += rs[back[-1]]
    if t.root is not None:
        bwd_exposed += rs[t.root]
    phases["all-gather + reduce-scatter (backward)"] = bwd_exposed
    exposed += bwd_exposed
    total_comm = sum(ag) + sum(regather) + sum(rs)
    gathers = [1 + (1 if regather[i] else 0) for i in range(n)]
    copy_bytes = sum(life.copy_out(g, gcb[i]) * gathers[i] + life.copy_in(g, t.rb) for i, g in enumerate(L))
    copies = 2 * copy_bytes / prof.mem_bw  # read + write
    wire_sender = sum(sender)  # once per step, as the reduction (under PP too)
    # optimizer: AdamW reads p, g, m, v and writes p, m, v (+ one temporary): 9 fp32 passes
    if t.optimizer == "adamw":
        opt = t.opt_elems * 36 / prof.mem_bw
    elif t.optimizer == "adamw8bit":
        opt = t.opt_elems * (4 * 3 + 2 * 2 + 8) / prof.mem_bw
    else:
        opt = t.opt_elems * 24 / prof.mem_bw + t.ns_flops / max(1, t.ns_world) / rate
        opt += collective_time(prof, "all_gather", t.ns_gather_bytes, max(2, t.ns_world)) if t.ns_gather_bytes else 0.0
        opt += alltoall_time(prof, t.ns_a2a_bytes, t.ns_world) if t.ns_a2a_bytes else 0.0
    ep = t.ep_s if t.ep_s is not None else alltoall_time(prof, t.ep_bytes, t.ep_world)
    per_mb = sum(comp_f) + sum(comp_b) + t.extra_compute
    compute = per_mb * t.microbatches
    bubble = (per_mb + ep + t.tp_exposed + t.cp_exposed) * t.bubble + t.p2p_fill
    step = (compute + bubble + exposed + copies + opt + wire_sender
            + (ep + t.tp_exposed + t.cp_exposed) * t.microbatches)
    parts = {"compute": compute, "exposed comm": exposed, "copies": copies, "optimizer": opt,
             "gradient wire quantise": wire_sender,
             "ep all-to-all": ep * t.microbatches, "tp collectives (exposed)": t.tp_exposed * t.microbatches,
             "cp ring (exposed)": t.cp_exposed * t.microbatches, "pp bubble": bubble}
    phases["FSDP total (hidden or not)"] = total_comm
    phases["TP total (hidden or not)"] = t.tp_total * t.microbatches
    phases["CP ring total (hidden or not)"] = t.cp_total * t.microbatches
    wire_local = wire_sender + (sum(g.gathered for g in L) * t.wire_sum_bytes / prof.mem_bw
                                if t.wire_bytes is not None else 0.0)
    return TimeResult(step, compute, exposed, total_comm, copies, opt, parts, phases, sent, wire_local)
