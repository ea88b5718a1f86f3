"""Muon's step plan: which rank orthogonalises each matrix, and in which waves.

Newton-Schulz needs a whole matrix, so each matrix gets one **owner** that gathers its
pieces, orthogonalises it and sends the pieces of the result back. The plan is pure (the
same on every rank: it reads only layouts, which every rank knows for every rank) and has
two parts:

* **Waves.** The matrices of one process group are cut, in order, into waves of at most
  ``wave_bytes`` bytes of whole bf16 matrices (a larger matrix is a wave of its own). The
  step moves and orthogonalises one wave at a time, so what a rank holds beyond its
  persistent state is about one wave plus one matrix's Newton-Schulz workspace, not bf16
  copies of all its matrices. ``wave_bytes=None`` makes one wave of everything.
* **Owners.** A matrix held whole by one rank is owned there (nothing moves). The others
  go, largest first within each wave, to one of the ranks whose Newton-Schulz flops so far
  are within ``FLOPS_SLACK`` (5%) of the mean above the least-loaded rank's, and among
  those to the one holding the least memory during the step: its pieces of every matrix
  (parameter + gradient + momentum bytes) plus the whole matrices it already owns in this
  wave. Flops alone (the plan before waves) break ties by who holds most of the matrix,
  which piles owned matrices onto the rank that already holds the most.

:func:`plan_step` makes a step's whole plan (batches, waves, owners, splits, schedule); the
optimizer caches it per layout and reports its per-rank estimates in ``last_step_stats``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ._gather import GatherSet, gather_set
from ._layout import Layout
from .muon_buffers import (BF16, BLEND_CHUNK, blend_chunk, ns_floor_bytes, ns_hold_bytes, ns_workspace_bytes,
                           wave_rank_bytes)

__all__ = ["Matrix", "Wave", "Batch", "newton_schulz_flops", "ns_workspace_bytes", "ns_hold_bytes", "ns_floor_bytes",
           "matrices_of", "make_waves", "assign_owners", "finish_wave", "schedule", "DEFAULT_NS_STEPS", "BLEND_CHUNK",
           "blend_chunk", "auto_wave_bytes", "cut_waves", "StepPlan", "plan_step", "per_rank"]

DEFAULT_NS_STEPS = 5
# A rank whose Newton-Schulz flops are within this fraction of the mean of the least-loaded
# rank's may take a matrix; among those, the one holding the least memory does.
FLOPS_SLACK = 0.05


def newton_schulz_flops(rows: int, cols: int, steps: int = DEFAULT_NS_STEPS) -> int:
    """Multiply-add flops (2 per MAC) of Newton-Schulz on a ``rows x cols`` matrix."""
    m, n = min(rows, cols), max(rows, cols)
    # X X^T: m*m*n MACs; A A: m^3; (.) X: m*m*n.
    return steps * 2 * (2 * m * m * n + m * m * m)


@dataclass
class Matrix:
    slot: int  # index of the parameter in the group's list of params with grads
    start: int  # element range of the matrix's tile inside the flat outer-local tensor
    end: int
    rows: int  # of the global matrix
    cols: int
    flops: int
    owner: int = 0
    # per member of the gather set: (start, end) of the tile held by it, clipped to the tile
    pieces: tuple = ()
    gs: GatherSet | None = None  # who holds the tiles (and where each tile sits)
    state_bytes: int = 12  # bytes per element held during the step: param + grad + momentum

    @property
    def whole_bytes(self) -> int:
        return BF16 * self.rows * self.cols

    def held(self, r: int) -> int:
        a, b = self.pieces[r]
        return b - a


@dataclass
class Wave:
    """Matrices moved and orthogonalised together; the same cut on every rank."""

    matrices: list = field(default_factory=list)
    needs_comm: bool = False
    send_split: list = field(default_factory=list)  # elements this rank sends to each rank
    recv_split: list = field(default_factory=list)
    # the same on every rank (:func:`schedule`): the next wave's pieces travel while this one
    # is orthogonalised; the previous wave's results travel while this one is orthogonalised
    overlap_next: bool = True
    overlap_prev: bool = True


@dataclass
class Batch:
    """The matrices of one param group that share one process group (or none: unsharded)."""

    group: object | None
    rank: int
    world: int
    matrices: list = field(default_factory=list)
    waves: list = field(default_factory=list)


def matrices_of(slot: int, lay: Layout, gs: GatherSet, steps: int, state_bytes: int = 12) -> list[Matrix]:
    """The matrices of one parameter: the ``k``-th matrix of the outer-local tensor is the same
    global matrix on every member (TP never cuts the leading dims), each member holding its
    RaggedShard rank's run of its own tile."""
    rows, cols = lay.shape[-2], lay.shape[-1]
    h, w = gs.tile
    size = h * w
    count = math.prod(lay.outer_shape[:-2])
    if size == 0 or rows * cols == 0:
        return []
    flops = newton_schulz_flops(rows, cols, steps)
    runs = [lay.ranges[r] for r in gs.ragged]
    out = []
    for k in range(count):
        s, e = k * size, (k + 1) * size
        pieces = tuple((max(s, a), min(e, b)) if min(e, b) > max(s, a) else (s, s) for a, b in runs)
        out.append(Matrix(slot, s, e, rows, cols, flops, pieces=pieces, gs=gs, state_bytes=state_bytes))
    return out


def auto_wave_bytes(matrices) -> int:
    """The default workspace: the largest whole bf16 matrix, so a wave is at most one largest
    matrix and an owner's received pieces plus one Newton-Schulz fit in one torch
    Newton-Schulz of the largest matrix (:func:`ns_floor_bytes`)."""
    return max((m.whole_bytes for m in matrices), default=1)


def cut_waves(items: list, whole_bytes, wave_bytes: int | None) -> list[list]:
    """Consecutive ``items``, at most ``wave_bytes`` of ``whole_bytes(item)`` per wave (one item
    at least); ``None``: one wave. The optimizer cuts its matrices with it, and
    ``ragged_fsdp.sim.muon_step`` its matrix shapes."""
    if wave_bytes is None:
        return [list(items)] if items else []
    waves, cur, size = [], [], 0
    for m in items:
        b = whole_bytes(m)
        if cur and size + b > wave_bytes:
            waves.append(cur)
            cur, size = [], 0
        cur.append(m)
        size += b
    if cur:
        waves.append(cur)
    return waves


def make_waves(matrices: list[Matrix], wave_bytes: int | None) -> list[Wave]:
    """Consecutive matrices, at most ``wave_bytes`` of whole bf16 matrices per wave (one
    matrix at least); ``None``: one wave."""
    return [Wave(w) for w in cut_waves(matrices, lambda m: m.whole_bytes, wave_bytes)]


def _holders(m: Matrix) -> list[int]:
    return [r for r in range(len(m.pieces)) if m.held(r) > 0]


def assign_owners(batches: list[Batch]) -> dict:
    """Owners for every matrix (see the module docstring); returns ``{"flops": {id(group):
    per-rank flops}, "peak": {id(group): per-rank estimated step bytes}}``."""
    flops: dict = {}
    persist: dict = {}
    totals: dict = {}
    for batch in batches:
        key = id(batch.group)
        world = batch.world
        load = flops.setdefault(key, [0] * world)
        held = persist.setdefault(key, [0] * world)
        tot = totals.setdefault(key, [0, 0])  # flops of every matrix, workspace bytes of every matrix
        for m in batch.matrices:
            for r in range(world):
                held[r] += m.held(r) * m.state_bytes
            tot[0] += m.flops
            tot[1] += m.whole_bytes
    peaks = {key: list(v) for key, v in persist.items()}  # persistent + the worst wave
    for batch in batches:
        key = id(batch.group)
        world = batch.world
        load, held, peak = flops[key], persist[key], peaks[key]
        mean_flops = max(1.0, totals[key][0] / world)
        for wave in batch.waves:
            owned = [0] * world  # bytes each rank holds for this wave as owner
            free = []
            for m in wave.matrices:
                hs = _holders(m)
                if batch.group is None or len(hs) == 1:
                    m.owner = hs[0] if batch.group is not None else 0
                    load[m.owner] += m.flops
                    owned[m.owner] += m.whole_bytes
                else:
                    free.append(m)
            for m in sorted(free, key=lambda x: -x.flops):  # stable: ties keep matrix order
                # flops first (within FLOPS_SLACK of the least-loaded rank), then memory
                least = min(load)
                near = [r for r in range(world) if load[r] <= least + FLOPS_SLACK * mean_flops]
                m.owner = min(near, key=lambda r, m=m: (held[r] + owned[r] + m.whole_bytes, -m.held(r), r))
                load[m.owner] += m.flops
                owned[m.owner] += m.whole_bytes
            big = [0] * world  # the largest Newton-Schulz workspace each rank needs in this wave
            for m in wave.matrices:
                big[m.owner] = max(big[m.owner], ns_workspace_bytes(m.rows, m.cols))
            for r in range(world):
                # pieces of the wave (bf16, out and back) + owned whole matrices + one workspace
                mine = sum(m.held(r) for m in wave.matrices) * BF16
                peak[r] = max(peak[r], held[r] + mine + owned[r] + big[r])
    return {"flops": flops, "peak": peaks}


def finish_wave(wave: Wave, me: int, world: int, grouped: bool, elem_bytes: int = BF16) -> tuple[int, int]:
    """Fill the wave's all-to-all splits for rank ``me``; returns ``(bytes sent, bytes an
    all-gather of every local piece would send)``."""
    send = [0] * world
    recv = [0] * world
    moved = False
    for m in wave.matrices:
        for r in range(world):
            n = m.held(r)
            if n and r != m.owner:
                moved = True
                if r == me:
                    send[m.owner] += n
                if m.owner == me:
                    recv[r] += n
    wave.send_split, wave.recv_split, wave.needs_comm = send, recv, moved
    # this rank's bytes: pieces out + results in, and (as owner) pieces in + results out
    sent = (sum(send) + sum(recv)) * elem_bytes
    local_total = sum(m.held(me) for m in wave.matrices) if grouped else 0
    return sent, (world - 1) * local_total * elem_bytes


def schedule(batch: Batch, budget: int) -> None:
    """Decide, the same on every rank, which transfers overlap Newton-Schulz so that no rank's
    live bytes during the step exceed ``budget`` where that can be kept: wave ``k + 1``'s
    pieces are launched before wave ``k`` is orthogonalised (``overlap_next``) if every rank's
    hold while orthogonalising wave ``k`` plus both waves' buffers fits, and wave ``k - 1``'s
    results are received after it (``overlap_prev``) if that fits as well; otherwise the
    transfer runs between the two orthogonalisations. Results do not depend on it."""
    waves, world = batch.waves, batch.world
    if batch.group is None:
        return
    per = [wave_rank_bytes(w, world) for w in waves]

    def fits(k: int, nxt: bool, prev: bool) -> bool:
        send, recv, hold, _ = per[k]
        for r in range(world):
            extra = 0
            if nxt:
                s1, r1, _, b1 = per[k + 1]
                extra += s1[r] + r1[r]
                # the moment wave k + 1's send buffer is filled: wave k's buffers in flight
                if send[r] + recv[r] + s1[r] + r1[r] + b1[r] + (_prev(k, r) if prev else 0) > budget:
                    return False
            if prev:
                extra += _prev(k, r)
            if hold[r] + extra > budget:
                return False
        return True

    def _prev(k: int, r: int) -> int:
        s0, r0, _, _ = per[k - 1]
        return s0[r] + r0[r]

    for k, w in enumerate(waves):
        can_next = k + 1 < len(waves) and waves[k + 1].needs_comm
        can_prev = k > 0 and waves[k - 1].needs_comm and waves[k - 1].overlap_next
        for nxt, prev in ((True, True), (True, False), (False, True), (False, False)):
            if (nxt and not can_next) or (prev and not can_prev):
                continue
            if fits(k, nxt, prev) or not (nxt or prev):
                w.overlap_next, w.overlap_prev = nxt, prev
                break


@dataclass
class StepPlan:
    batches: list  # per param group: its Batches
    loads: dict  # id(group) -> per-rank Newton-Schulz flops
    peaks: dict  # id(group) -> per-rank estimated bytes during the step
    bytes_sent: int = 0
    bytes_recv: int = 0
    allgather_bytes_sent: int = 0
    waves: int = 0


def plan_step(work, state_bytes, wave_bytes, agree) -> StepPlan:
    """The plan of one step over ``work`` (``(gi, group, items)`` per Muon param group, items
    ``(i, param, layout)``): each param group's matrices batched by process group, cut into
    waves of ``wave_bytes`` (``"auto"``: :func:`auto_wave_bytes`), owners assigned, splits
    filled, overlaps scheduled. ``state_bytes(param)``: bytes per element the parameter holds
    through the step; ``agree(process_group)`` is called once per batch before its waves are
    used (every rank must cut the same waves: they run collectives per wave)."""
    all_batches = []
    for gi, group, items in work:
        by_group: dict = {}
        for slot, (i, p, lay) in enumerate(items):
            gs = gather_set(lay)
            b = by_group.get(id(gs.group))
            if b is None:
                b = by_group[id(gs.group)] = Batch(gs.group, gs.me, gs.world)
            b.matrices.extend(matrices_of(slot, lay, gs, group["ns_steps"], state_bytes(p)))
        all_batches.append(list(by_group.values()))
    flat = [b for bs in all_batches for b in bs]
    cap = wave_bytes
    if cap == "auto":
        cap = auto_wave_bytes([m for b in flat for m in b.matrices])
    for b in flat:
        b.waves = make_waves(b.matrices, cap)
        if b.group is not None:
            agree(b.group)
    owners = assign_owners(flat)
    plan = StepPlan(all_batches, owners["flops"], owners["peak"])
    for b in flat:
        for wave in b.waves:
            sent, ag = finish_wave(wave, b.rank, b.world, b.group is not None)
            plan.bytes_sent += sent
            plan.bytes_recv += sent
            plan.allgather_bytes_sent += ag
            plan.waves += 1
    if wave_bytes is not None:
        # the bounded step stays within one torch Newton-Schulz on the largest matrix
        budget = max((ns_floor_bytes(m.rows, m.cols) for b in flat for m in b.matrices), default=0)
        for b in flat:
            schedule(b, budget)
    return plan


def per_rank(loads: dict):
    """Per-rank values of the widest process group (what a report shows)."""
    if not loads:
        return []
    return list(max(loads.values(), key=len))
