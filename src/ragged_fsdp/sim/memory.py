"""Per-rank memory over one training step, phase by phase; the peak is the largest phase.

Phases: forward of each group, the loss, backward of each group, the optimizer step. Each
phase sums named items: persistent state (sharded parameters, optimizer states, sharded
gradients already reduced), saved activations, the groups gathered at that moment (current,
prefetched, and the kept ones: the root / last group is not resharded after forward), and
the framework's gradient and reduction buffers (:mod:`.buffers`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .buffers import LIFETIMES
from .layout import GroupLayout

__all__ = ["MemoryInputs", "MemoryResult", "optimizer_state_bytes", "step_memory"]


@dataclass
class MemoryInputs:
    layouts: list[GroupLayout]  # execution order
    kept: set[int]  # groups not resharded after forward (stay gathered until their backward ends)
    root: int | None  # a group gathered first and reduced last (FSDP's root module), or None
    act_saved: list[float]  # bytes each group saves for backward (after checkpointing)
    act_work: float  # bytes of one block's full activations (recompute / backward working set)
    loss_bytes: float  # logits and loss temporaries at the end of forward
    pb: int  # sharded parameter bytes per element
    cb: int  # compute (gather) dtype bytes
    rb: int  # reduce dtype bytes
    gb: int  # sharded gradient bytes per element
    optimizer: str = "adamw"
    matrix_frac: float = 1.0  # fraction of parameters Muon treats as matrices
    backend: str = "nccl"
    reshard_after_forward: bool = True
    foreach_temp: bool = True  # foreach AdamW allocates one state-sized temporary (sqrt)
    gather_cb: list[float] | None = None  # gathered bytes per element per group (float8 all-gather)
    accumulate_grads: bool = False  # PP: unsharded gradients of every group live until the last microbatch


@dataclass
class MemoryResult:
    peak: float
    peak_phase: str
    items: dict  # the peak phase's named items
    sharded_params: float
    sharded_grads: float
    optimizer_states: float
    phases: dict = field(default_factory=dict)  # phase -> total


def optimizer_state_bytes(elems: float, optimizer: str, matrix_frac: float = 1.0) -> float:
    """AdamW: two fp32 moments; AdamW8bit: two uint8 codes + one fp32 absmax per 256-element
    block each; Muon: one fp32 momentum for matrices, AdamW for the rest."""
    if optimizer == "adamw":
        return elems * 8.0
    if optimizer == "adamw8bit":
        return elems * (2.0 + 8.0 / 256)
    if optimizer == "muon":
        return elems * (4.0 * matrix_frac + 8.0 * (1 - matrix_frac))
    raise ValueError(f"unknown optimizer {optimizer!r}; known: adamw, adamw8bit, muon")


def _opt_temp(elems: float, optimizer: str, foreach: bool, largest_matrix: float) -> float:
    if optimizer == "adamw":
        return elems * 4.0 if foreach else 0.0  # _foreach_sqrt(exp_avg_sq) over every tensor
    if optimizer == "adamw8bit":
        return 0.0  # dequantised per chunk; bounded and small
    return largest_matrix * 4.0 * 4  # Newton-Schulz workspace on the owner (X, A, B, X@X^T)


def step_memory(framework: str, m: MemoryInputs, largest_matrix: float = 0.0) -> MemoryResult:
    life = LIFETIMES[framework]
    L = m.layouts
    n = len(L)
    seg_sum = sum(g.segment + g.persistent for g in L)
    params = seg_sum * m.pb + sum(life.extra_persistent(g, m.cb, m.pb) for g in L)
    states = optimizer_state_bytes(seg_sum, m.optimizer, m.matrix_frac)
    base = {"sharded params": params, "optimizer states": states}
    phases: dict[str, dict] = {}
    root = m.root

    gcb = m.gather_cb or [float(m.cb)] * n

    def gathered(i):
        return sum(life.gathered(L[i], gcb[i]).values())

    def apart(i, nbytes):  # the separate embedding buffer's share (gathered or gradient)
        return L[i].shard_world * L[i].apart * nbytes if life.embedding_apart else 0

    def kept_gathered(i):  # after its forward: the embedding buffer is freed
        return gathered(i) - apart(i, gcb[i])

    def gather_temp(i):
        return sum(life.gather_temp(L[i], gcb[i]).values())

    all_grads = sum(sum(life.grads(g, m.rb, m.backend).values()) for g in L) if m.accumulate_grads else 0.0

    # forward: groups gathered in order (the root first); kept groups stay gathered
    order = ([root] if root is not None else []) + [i for i in range(n) if i != root]
    acts, kept = 0.0, {}
    for pos, i in enumerate(order):
        items = dict(base)
        items.update({f"kept gathered {L[j].name}": kept_gathered(j) for j in kept if j != i})
        items["saved activations"] = acts
        if gather_temp(i):  # the copy-out instant: output buffer and unsharded params
            phases[f"unshard {L[i].name}"] = dict(items, **{f"gathered {L[i].name}": gathered(i)},
                                                  **life.gather_temp(L[i], gcb[i]))
        items[f"gathered {L[i].name}"] = gathered(i)
        for j in order[pos + 1: pos + life.live_gathers]:  # prefetched, not yet waited on
            items[f"prefetched {L[j].name}"] = life.pending_gather(L[j], gcb[j])
        items["block working activations"] = m.act_work
        phases[f"forward {L[i].name}"] = items
        acts += m.act_saved[i]
        if i in m.kept or i == root or not m.reshard_after_forward:
            kept[i] = True
    phases["loss"] = dict(base, **{f"kept gathered {L[j].name}": kept_gathered(j) for j in kept},
                          **{"saved activations": acts, "logits and loss": m.loss_bytes})
    # backward: reverse order; the root's gradients live from the first backward op to the
    # end (its reduction runs last)
    reduced = 0.0
    pending = {}
    if root is not None:
        pending = {f"{k} ({L[root].name}, pending)": v for k, v in life.grads(L[root], m.rb, m.backend).items()}
        if life.embedding_apart and L[root].apart:  # the embedding's gradients come at the very end
            pending = {k: v - apart(root, m.rb) for k, v in pending.items()}
    early = root is not None and life.root_early and life.embedding_apart and 0 < L[root].apart < L[root].segment
    if early:
        # the root's norm and head: reduced right after their backward, before any block's,
        # and their unsharded buffer freed; only the embedding's part stays for the end
        g = L[root]
        head = replace(g, segment=g.segment - g.apart, apart=0)
        red = dict(base, **{f"kept gathered {L[j].name}": kept_gathered(j) for j in kept},
                   **{"saved activations": acts, "sharded grads (reduced so far)": reduced},
                   **{f"{k} ({g.name} norm+head)": v for k, v in life.grads(head, m.rb, m.backend).items()},
                   **life.reduce_temp(head, m.rb, m.backend))
        red["sharded grad (new)"] = head.segment * m.gb
        phases[f"reduce {g.name} (norm+head, early)"] = red
        reduced += head.segment * m.gb
        pending = {}
        kept.pop(root, None)
    back = [i for i in reversed(range(n)) if i != root]
    for pos, i in enumerate(back):
        g = L[i]
        items = dict(base)
        items.update({f"kept gathered {L[j].name}": kept_gathered(j) for j in kept if j != i and (j == root or j < i)})
        if gather_temp(i) and m.reshard_after_forward and i not in kept:
            phases[f"unshard {g.name} (backward)"] = dict(
                items, **{f"gathered {g.name}": gathered(i), "saved activations": acts,
                          "sharded grads (reduced so far)": reduced}, **pending, **life.gather_temp(g, gcb[i]))
        items[f"gathered {g.name}"] = gathered(i)
        if pos + 1 < len(back) and m.reshard_after_forward and back[pos + 1] not in kept:
            j = back[pos + 1]
            items[f"prefetched {L[j].name}"] = life.pending_gather(L[j], gcb[j])
        items["saved activations"] = acts
        items["block working activations"] = m.act_work
        items.update(pending)
        items.update(life.grads(g, m.rb, m.backend))
        if m.accumulate_grads:
            items["unsharded grads of the stage's other groups (kept across microbatches)"] = \
                all_grads - sum(life.grads(g, m.rb, m.backend).values())
        items["sharded grads (reduced so far)"] = reduced
        phases[f"backward {g.name}"] = items
        red = {k: v for k, v in items.items() if k != "block working activations"}
        red.update(life.reduce_temp(g, m.rb, m.backend))
        if not life.grads_freed_at_reduce:  # else the new segment comes after the grads go
            red["sharded grad (new)"] = (g.segment + g.persistent) * m.gb
        phases[f"reduce {g.name}"] = red
        acts -= m.act_saved[i]
        reduced += (g.segment + g.persistent) * m.gb
    if early:  # the embedding's gradients, arrived at the very end
        g = L[root]
        emb = replace(g, segment=g.apart, apart=0)
        red = dict(base, **{f"{k} ({g.name} embedding)": v for k, v in life.grads(emb, m.rb, m.backend).items()})
        red["sharded grads (reduced so far)"] = reduced
        red.update(life.reduce_temp(emb, m.rb, m.backend))
        red["sharded grad (new)"] = emb.segment * m.gb
        phases[f"reduce {g.name} (embedding)"] = red
        reduced += emb.segment * m.gb
    elif root is not None:
        g = L[root]
        red = dict(base, **{f"gathered {g.name}": kept_gathered(root)},
                   **{k: v + apart(root, m.rb) for k, v in pending.items()})
        red["sharded grads (reduced so far)"] = reduced
        red.update(life.reduce_temp(g, m.rb, m.backend))
        red["sharded grad (new)"] = (g.segment + g.persistent) * m.gb
        phases[f"reduce {g.name}"] = red
        reduced += (g.segment + g.persistent) * m.gb
    opt = dict(base)
    opt["sharded grads"] = reduced
    opt["optimizer temporaries"] = _opt_temp(seg_sum, m.optimizer, m.foreach_temp, largest_matrix)
    phases["optimizer step"] = opt
    totals = {k: sum(v.values()) for k, v in phases.items()}
    peak_phase = max(totals, key=totals.get)
    return MemoryResult(totals[peak_phase], peak_phase, {k: v for k, v in phases[peak_phase].items() if v},
                        params, reduced, states, totals)
