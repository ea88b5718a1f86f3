"""One simulated configuration: per-rank memory, step time, MFU and tokens/s per framework.

Everything is computed from shapes: the layouts come from the real planner (ragged_fsdp)
and the planner's baselines (the others), memory from :mod:`.memory` with each framework's
buffer lifetimes (:mod:`.buffers`), time from :mod:`.timing`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .arch import Arch, resolve_model
from .buffers import DIFFERENCES
from .layout import GroupLayout, group_layouts
from .memory import MemoryInputs, step_memory
from .mesh import Mesh, candidate_meshes
from .profiles import GPUProfile
from .timing import TimeInputs, newton_schulz_flops, step_time

__all__ = ["Scenario", "FrameworkResult", "simulate", "simulate_auto", "FRAMEWORKS", "VALIDATED",
           "DEFAULT_GRANULARITY"]

FRAMEWORKS = ("ragged", "fsdp2", "fsdp1", "deepspeed", "megatron")
# checked here against real engines (memory test, calibrated bench); the others are modelled
# from their documented buffer and collective behaviour
VALIDATED = {"ragged": "validated", "fsdp2": "validated", "fsdp1": "unvalidated",
             "deepspeed": "unvalidated", "megatron": "unvalidated"}
# what ragged_fsdp keeps whole for each optimizer (others ignore structure). Muon does not
# need whole matrices (each owner receives the pieces by all-to-all); keeping them whole
# (--granularity matrix) removes that traffic but forces S >= the largest matrix, which at
# large W costs more padding than it saves.
DEFAULT_GRANULARITY = {"adamw": None, "adamw8bit": "block:256", "muon": None}
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
AC_MODES = ("none", "selective", "full")


@dataclass
class Scenario:
    model: str
    gpus: int
    profile: GPUProfile
    mesh: Mesh
    optimizer: str = "adamw"
    dtype: str = "bf16"  # compute dtype; parameters, gradients and states stay fp32
    seq: int = 4096
    micro_batch: int = 1
    act_ckpt: str = "full"
    granularity: str | None = "auto"
    reshard_after_forward: bool = True


@dataclass
class FrameworkResult:
    framework: str
    status: str  # validated / unvalidated
    mesh: str
    memory_bytes: float
    fits: bool
    peak_phase: str
    memory_items: dict
    sharded_params: float
    sharded_grads: float
    optimizer_states: float
    padding: float
    step_s: float
    mfu: float
    tokens_per_s_per_gpu: float
    time_parts: dict
    differences: list = field(default_factory=list)

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _group_flops(arch: Arch, name: str, tensors, tokens: int, seq: int) -> float:
    """Forward matmul flops of one group for ``tokens`` tokens (full model, before TP)."""
    if name.startswith("embed"):
        return 0.0
    frac = arch.top_k / arch.experts if arch.experts else 1.0
    flops = 0.0
    for n, s in tensors:
        if len(s) < 2 or "embed_tokens" in n:
            continue
        el = math.prod(s)
        if ".experts." in n and "shared_expert" not in n:
            el *= frac
        flops += 2.0 * el * tokens
    if name.startswith("layers"):
        flops += 2.0 * arch.heads * seq * (arch.qk_dim + arch.v_dim) * tokens
    return flops


def _matrices(arch: Arch):
    """Muon's matrices: every 2-D hidden weight and each expert of a 3-D tensor (not the
    embedding or the head)."""
    for g, tensors in arch.groups:
        for n, s in tensors:
            if "embed_tokens" in n or "lm_head" in n or len(s) < 2:
                continue
            if len(s) == 3:
                for _ in range(s[0]):
                    yield s[1], s[2]
            else:
                yield s[0], math.prod(s[1:])


def _activations(arch: Arch, sc: Scenario, cb: int, n_groups: list[str]) -> tuple[list[float], float, float]:
    tokens = sc.micro_batch * sc.seq / sc.mesh.tp  # sequence parallel splits activations over TP
    saved, work = [], 0.0
    layer_idx = 0
    for name in n_groups:
        if not name.startswith("layers") or name.endswith(".experts"):
            saved.append(0.0)
            continue
        moe = arch.moe_layers and layer_idx >= arch.layers - arch.moe_layers
        full = arch.layer_act_elems(bool(moe)) * tokens * cb
        work = max(work, full)
        if sc.act_ckpt == "none":
            saved.append(full)
        elif sc.act_ckpt == "full":
            saved.append(arch.hidden * tokens * cb)
        else:  # selective: every other block checkpointed (torchtitan's layer SAC, freq 2)
            saved.append(full if layer_idx % 2 else arch.hidden * tokens * cb)
        layer_idx += 1
    # bf16 logits, their fp32 copy for the loss, and the fp32 gradient of the logits
    loss = sc.micro_batch * sc.seq * arch.vocab / sc.mesh.tp * (cb + 4 + 4)
    return saved, work, loss  # work: one block's full activations (backward / recompute)


def simulate(sc: Scenario, frameworks=FRAMEWORKS, arch: Arch | None = None) -> list[FrameworkResult]:
    arch = arch or resolve_model(sc.model)
    if sc.act_ckpt not in AC_MODES:
        raise ValueError(f"--act-ckpt {sc.act_ckpt!r}: choose one of {', '.join(AC_MODES)}")
    if sc.dtype not in DTYPE_BYTES:
        raise ValueError(f"--dtype {sc.dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
    if sc.mesh.ep > 1 and not arch.experts:
        raise ValueError(f"--mesh {sc.mesh}: ep needs an MoE model; {arch.name} is dense")
    cb, pb, rb, gb = DTYPE_BYTES[sc.dtype], 4, 4, 4
    gran = DEFAULT_GRANULARITY[sc.optimizer] if sc.granularity == "auto" else sc.granularity
    mesh, prof = sc.mesh, sc.profile
    tokens = sc.micro_batch * sc.seq
    model_flops = arch.flops_per_token(sc.seq) * tokens  # per dp replica (shared by its TP group)
    orig = {name: tensors for name, tensors in arch.groups}
    matrices = list(_matrices(arch)) if sc.optimizer == "muon" else []
    ns_total = sum(newton_schulz_flops(a, b) for a, b in matrices)
    largest = max((a * b for a, b in matrices), default=0)
    matrix_elems = sum(a * b for a, b in matrices)
    results = []
    for fw in frameworks:
        if fw not in FRAMEWORKS:
            raise ValueError(f"--frameworks: unknown {fw!r}; known: {', '.join(FRAMEWORKS)}")
        L: list[GroupLayout] = group_layouts(arch.groups, fw, mesh.dp, mesh.tp, mesh.ep, itemsize=pb,
                                             granularity=gran if fw == "ragged" else None)
        names = [g.name for g in L]
        saved, work, loss = _activations(arch, sc, cb, names)
        kept = {len(L) - 1}  # norm + head: not resharded after forward (torchtitan)
        mi = MemoryInputs(layouts=L, kept=kept, root=None, act_saved=saved, act_work=work, loss_bytes=loss,
                          pb=pb, cb=cb, rb=rb, gb=gb, optimizer=sc.optimizer,
                          matrix_frac=matrix_elems / max(1, arch.params), backend="nccl",
                          reshard_after_forward=sc.reshard_after_forward)
        mem = step_memory(fw, mi, largest_matrix=largest)
        peak = mem.peak + prof.reserved_bytes
        fwd = []
        for g in L:
            base = g.name[:-len(".experts")] if g.name.endswith(".experts") else g.name
            tensors = orig[base]
            if mesh.ep > 1 and arch.experts:
                is_exp = [(n, s) for n, s in tensors if ".experts." in n and "shared_expert" not in n]
                part = is_exp if g.name.endswith(".experts") else [t for t in tensors if t not in is_exp]
                f = _group_flops(arch, base if not g.name.endswith(".experts") else "experts", part, tokens, sc.seq)
            else:
                f = _group_flops(arch, g.name, tensors, tokens, sc.seq)
            fwd.append(f / mesh.tp)
        recompute = {"none": 0.0, "selective": 0.5, "full": 1.0}[sc.act_ckpt]
        opt_elems = sum(g.segment + g.persistent for g in L)
        ep_bytes = 4 * tokens * arch.top_k * arch.hidden * cb * arch.moe_layers if mesh.ep > 1 else 0.0
        tp_bytes = 8 * tokens * arch.hidden * cb * arch.layers if mesh.tp > 1 else 0.0
        ns_a2a = 0.0
        if sc.optimizer == "muon" and fw == "ragged":
            # one owner per matrix, flops balanced; pieces travel to owners and back (all-to-all)
            # unless the layout keeps matrices whole
            ns_world, ns_gather = mesh.dp * mesh.ep, 0.0
            ns_a2a = 0.0 if gran == "matrix" else 2 * 4.0 * sum(g.segment for g in L)
        else:  # torch.optim.Muon on sharded params: every rank assembles and orthogonalises all
            ns_world, ns_gather = 1, matrix_elems * 4 / mesh.tp
        ti = TimeInputs(layouts=L, fwd_flops=fwd, recompute=recompute, cb=cb, rb=rb, replicate=mesh.replicate,
                        kept=kept, reshard_after_forward=sc.reshard_after_forward, opt_elems=opt_elems,
                        optimizer=sc.optimizer, ns_flops=ns_total / mesh.tp, ns_world=ns_world,
                        ns_gather_bytes=ns_gather, ns_a2a_bytes=ns_a2a, ep_bytes=ep_bytes, ep_world=mesh.ep, tp_bytes=tp_bytes,
                        tp_world=mesh.tp)
        tr = step_time(fw, prof, ti)
        per_gpu_model_flops = model_flops / mesh.tp
        mfu = per_gpu_model_flops / tr.step / prof.flops
        tps = tokens / mesh.tp / tr.step
        used = sum(g.numel * g.count for g in L)
        held = sum((g.segment + g.persistent) * g.shard_world for g in L)
        results.append(FrameworkResult(
            framework=fw, status=VALIDATED[fw], mesh=str(mesh), memory_bytes=peak, fits=peak <= prof.hbm_bytes,
            peak_phase=mem.peak_phase, memory_items=mem.items, sharded_params=mem.sharded_params,
            sharded_grads=mem.sharded_grads, optimizer_states=mem.optimizer_states,
            padding=(held - used) / max(1, used), step_s=tr.step, mfu=mfu, tokens_per_s_per_gpu=tps,
            time_parts=tr.parts, differences=DIFFERENCES[fw]))
    return results


def simulate_auto(sc: Scenario, frameworks=FRAMEWORKS, arch: Arch | None = None):
    """For each framework, the fastest mesh that fits among :func:`candidate_meshes`;
    returns (results, explanation per framework)."""
    arch = arch or resolve_model(sc.model)
    best: dict[str, tuple] = {}
    tried: dict[str, list] = {fw: [] for fw in frameworks}
    for mesh in candidate_meshes(sc.gpus, bool(arch.experts), sc.profile.gpus_per_node):
        sc2 = Scenario(**{**sc.__dict__, "mesh": mesh})
        for r in simulate(sc2, frameworks, arch):
            tried[r.framework].append(r)
            cur = best.get(r.framework)
            key = (r.fits, r.tokens_per_s_per_gpu)
            if cur is None or key > cur[0]:
                best[r.framework] = (key, r)
    out, why = [], {}
    for fw in frameworks:
        r = best[fw][1]
        others = sorted(tried[fw], key=lambda x: (x.fits, x.tokens_per_s_per_gpu), reverse=True)
        runner = next((x for x in others if x.mesh != r.mesh), None)
        fit_count = sum(x.fits for x in tried[fw])
        why[fw] = (f"{r.mesh}: fastest of {fit_count} fitting meshes out of {len(tried[fw])} tried"
                   + (f"; next {runner.mesh} at {runner.tokens_per_s_per_gpu:,.0f} tok/s/GPU"
                      f"{'' if runner.fits else ' (does not fit)'}" if runner else "")
                   if r.fits else f"nothing fits; least memory at {r.mesh}")
        out.append(r)
    return out, why
