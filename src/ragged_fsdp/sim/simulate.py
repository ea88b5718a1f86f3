"""One simulated configuration: per-rank memory, step time, MFU and tokens/s per framework.

Everything is computed from shapes: the layouts come from the real planner (ragged_fsdp)
and the planner's baselines (the others), memory from :mod:`.memory` with each framework's
buffer lifetimes (:mod:`.buffers`), time from :mod:`.timing`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import fitted
from .arch import Arch, resolve_model
from .breakdown import breakdown
from .buffers import DIFFERENCES
from .activations import saved_bytes_per_token
from .mx_gather import gather_itemsize
from .compute import _is_routed, attention_rate, compute_times, group_flops, is_fp8_linear, tp_feed
from .moe import DEFAULT_IMBALANCE, a2a_calls, deepep_buffer_bytes, moe_layer_cost
from .context import ring_exposed
from .host import host_costs
from .layout import GroupLayout, group_layouts, split_for_mesh
from .memory import MemoryInputs, step_memory
from .mesh import Mesh, candidate_meshes
from .options import (AC_MODES, BLACKWELL_RECIPES, MAX_GPUS, WIRE_LOCAL_BYTES, Recipe, feedback_bytes, residual_bytes_per_element,
                      wire_bytes_per_element)
from .pipeline import bubble, in_flight, stage_layers
from .profiles import HOST_LINK_BW, HOST_LINK_DEFAULT, GPUProfile
from .tensor_parallel import tp_block_comm
from .timing import TimeInputs, newton_schulz_flops, step_time
from .uncertainty import uncertainty

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
# built-in profiles without MXFP8 / NVFP4 tensor cores (custom JSON profiles are trusted)
NO_BLOCK_SCALED = {"h100", "h100-gt", "h200", "a100", "mi300x", "mi325x"}
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# bytes per logit element at the loss: bf16 logits, their fp32 copy, log-softmax output and
# its gradient; MemTracker measured 11.7 here (bf16, N=2048, V=8192, torch 2.13 CPU)
LOSS_BYTES_PER_LOGIT = 12
# compiled cross-entropy (inductor fuses upcast, log-softmax and the NLL into one kernel
# each way, keeping a per-row logsumexp): the bf16 logits, kept for backward, and their bf16
# gradient; nothing of vocabulary size in fp32
LOSS_BYTES_PER_LOGIT_COMPILED = 4
# under TP torchtitan's loss is DTensor's loss_parallel (vocab-sharded logits): its
# log-softmax is decomposed (amax, shift, exp, sum, each an fp32 tensor of the local logits'
# size, with two all-reduces between), so more fp32 copies are alive at once; MemTracker
# measured 15.9 per local logit (bf16, N=1024, V=8192, 1 and 2 ranks, torch 2.13 CPU)
LOSS_BYTES_PER_LOGIT_PARALLEL = 16


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
    recipe: Recipe = field(default_factory=Recipe)


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
    comm_phases: dict = field(default_factory=dict)
    peak_stage: int = 0
    vs_ragged: dict = field(default_factory=dict)  # the difference from ragged_fsdp by cause
    host: dict = field(default_factory=dict)  # start-up / checkpoint planning CPU (sim/host.py)
    # the shard dim's gradient reduction: format, bytes one rank sends per step, seconds of
    # the wire format's local work (quantise, error feedback, dequantise + fp32 sum)
    grad_reduce: dict = field(default_factory=dict)
    # what the prediction rests on: each term calibrated (on which point), cited or assumed,
    # and the validation's error band for runs of this kind (sim/uncertainty.py)
    uncertainty: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return dict(self.__dict__)


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


def _stages(arch: Arch, pp: int) -> list[tuple[int, list]]:
    """(stage index, its groups) for each distinct stage: the first (embedding), the last
    (norm + head) and one of each middle size; all stages when pp == 1 is one stage."""
    if pp == 1:
        return [(0, arch.groups)]
    layers = [g for g in arch.groups if g[0].startswith("layers")]
    pre = [g for g in arch.groups[:1] if not g[0].startswith("layers")]
    post = [g for g in arch.groups[1:] if not g[0].startswith("layers")]
    sizes = stage_layers(len(layers), pp)
    out, seen, start = [], set(), 0
    for s, k in enumerate(sizes):
        key = (s == 0, s == pp - 1, k)
        chunk = layers[start:start + k]
        start += k
        if key in seen:
            continue
        seen.add(key)
        out.append((s, (pre if s == 0 else []) + chunk + (post if s == pp - 1 else [])))
    return out


def _fp8_fraction(tensors) -> float:
    tot = sum(math.prod(s) for _, s in tensors)
    return sum(math.prod(s) for n, s in tensors if is_fp8_linear(n, s)) / tot if tot else 0.0


def check_scenario(sc: Scenario, arch: Arch) -> None:
    if sc.act_ckpt not in AC_MODES:
        raise ValueError(f"--act-ckpt {sc.act_ckpt!r}: choose one of {', '.join(AC_MODES)}")
    if sc.dtype not in DTYPE_BYTES:
        raise ValueError(f"--dtype {sc.dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
    if not 1 <= sc.gpus <= MAX_GPUS:
        raise ValueError(f"--gpus {sc.gpus}: must be between 1 and {MAX_GPUS:,} (as `plan`)")
    if sc.mesh.gpus != sc.gpus:
        raise ValueError(f"--mesh {sc.mesh} uses {sc.mesh.gpus} GPUs but --gpus is {sc.gpus}; make them agree")
    if sc.mesh.ep > 1 and not arch.experts:
        raise ValueError(f"--mesh {sc.mesh}: ep needs an MoE model; {arch.name} is dense")
    if sc.mesh.cp > 1 and sc.seq % (2 * sc.mesh.cp):
        raise ValueError(f"--mesh cp={sc.mesh.cp}: --seq {sc.seq} must be a multiple of 2 x cp = "
                         f"{2 * sc.mesh.cp} (load-balanced causal sharding cuts it into 2 x cp chunks)")
    if sc.mesh.tp > 1 and arch.heads % sc.mesh.tp:
        raise ValueError(f"--mesh tp={sc.mesh.tp}: {arch.name} has {arch.heads} heads, not divisible by tp")
    sc.recipe.check(sc.mesh.tp, sc.mesh.pp, sc.micro_batch)
    if sc.recipe.float8 in BLACKWELL_RECIPES and sc.profile.name in NO_BLOCK_SCALED:
        raise ValueError(f"--float8 {sc.recipe.float8}: block-scaled GEMMs need Blackwell tensor cores; --gpu "
                         f"{sc.profile.name} has none. Use --gpu b200 / gb200, or --float8 tensorwise / rowwise")
    if sc.mesh.pp > 1:
        stage_layers(arch.layers, sc.mesh.pp)


def _stage_result(fw: str, sc: Scenario, arch: Arch, stage: int, groups, gran, m_count: int, ctx: dict):
    """(memory result, time result, layouts) of one pipeline stage (the whole model without PP)."""
    mesh, prof, rc = sc.mesh, sc.profile, sc.recipe
    cb, pb, rb, gb = DTYPE_BYTES[sc.dtype], 4, 4, 4
    pp = mesh.pp
    L: list[GroupLayout] = group_layouts(groups, fw, mesh.shard, mesh.tp, mesh.ep, itemsize=pb,
                                         granularity=gran if fw == "ragged" else None)
    split = split_for_mesh(groups, 1, mesh.ep)  # full (pre-TP) tensors of each layout group
    assert [g.name for g in L] == [n for n, _, _ in split]
    mb_seqs = sc.micro_batch / m_count
    tokens = mb_seqs * sc.seq / mesh.cp  # per rank and microbatch, before TP
    first_layer = ctx["first_layer"][stage]
    saved, comp_f, comp_b, gcb = [], [], [], []
    work = tp_exp = tp_tot = cp_exp = cp_tot = 0.0
    layer_idx = first_layer
    fp8_gather = gather_itemsize(fw, rc.float8_allgather, rc.mxfp8_allgather)
    imb = rc.moe_imbalance if rc.moe_imbalance is not None else DEFAULT_IMBALANCE
    moe_layers_here = 0
    mc = moe_layer_cost(prof, tokens, arch.top_k, arch.experts, arch.hidden, cb, mesh.ep, rc.moe_dispatcher, imb) \
        if arch.experts else None
    for (name, tensors, is_exp), g in zip(split, L):
        is_layer = name.startswith("layers")
        gf = group_flops(arch, name, tensors, tokens, sc.seq, mesh.cp, mesh.tp, mesh.ep, imb,
                         sc.recipe.low_precision_layers)
        # the MoE layer's permutation and router run with its routed experts (one group per
        # layer: the experts' own group under EP, else the layer)
        routed = mc is not None and is_layer and any(_is_routed(n) for n, _ in tensors)
        moe_layers_here += routed
        f, b = compute_times(gf, prof, rc, sc.act_ckpt if is_layer else "none", mesh.tp, fp32=(cb == 4), seq=sc.seq,
                             cp=mesh.cp, extra_f=mc.permute_f if routed else 0.0,
                             extra_b=mc.permute_b if routed else 0.0)
        comp_f.append(f)
        comp_b.append(b)
        frac = _fp8_fraction(tensors) if fp8_gather else 0.0
        gcb.append(cb * (1 - frac) + (fp8_gather or cb) * frac)
        if not is_layer or is_exp:
            saved.append(0.0)
            continue
        moe = bool(arch.moe_layers) and layer_idx >= arch.layers - arch.moe_layers
        saved.append(saved_bytes_per_token(arch, tensors, moe, sc.act_ckpt, layer_idx, cb, mesh.tp, rc.compile)
                     * tokens)
        if rc.act_offload:  # the copy out (forward) and back (backward) waits where it outlasts the block
            move = saved[-1] / HOST_LINK_BW.get(prof.name, HOST_LINK_DEFAULT)
            comp_f[-1] += max(0.0, move - f)
            comp_b[-1] += max(0.0, move - b)
        work = max(work, saved_bytes_per_token(arch, tensors, moe, "none", layer_idx, cb, mesh.tp, rc.compile)
                   * tokens)
        att_f = gf.attention / mesh.tp / attention_rate(prof, sc.seq, mesh.cp, cb == 4) if gf.attention else 0.0
        mm_f = f - att_f
        e, t = tp_block_comm(prof, mesh.tp, 1, tokens, arch.hidden, cb, 1.0 if rc.float8 == "tensorwise" else cb,
                             sc.act_ckpt, rc.async_tp, mm_f, tp_feed(gf, prof, rc, fp32=(cb == 4)))
        tp_exp, tp_tot = tp_exp + e, tp_tot + t
        e, t = ring_exposed(prof, mesh.cp, mesh.tp, arch.kv_dim // mesh.tp if arch.kv_dim >= mesh.tp else 1,
                            tokens, cb, att_f, sc.act_ckpt == "full")
        cp_exp, cp_tot = cp_exp + e, cp_tot + t
        layer_idx += 1
    has_head = stage == pp - 1
    held = in_flight(rc.pp_schedule, pp, rc.pp_virtual, stage, m_count)
    if pp > 1:
        saved = [x * held for x in saved]
    if rc.act_offload:  # on the device: the block being copied and the one prefetched, as working memory
        work += 2 * max(saved, default=0.0)
        saved = [0.0] * len(saved)
    per_logit = (LOSS_BYTES_PER_LOGIT_COMPILED if rc.loss_compiled else
                 LOSS_BYTES_PER_LOGIT_PARALLEL if mesh.tp > 1 else LOSS_BYTES_PER_LOGIT)
    loss = tokens / rc.loss_chunks * arch.vocab / mesh.tp * (per_logit - 2 + cb) if has_head else 0.0
    kept = {len(L) - 1} if has_head else set()  # norm + head: not resharded after forward (torchtitan)
    reshard = sc.reshard_after_forward and pp == 1  # torchtitan keeps PP stages unsharded across microbatches
    mi = MemoryInputs(layouts=L, kept=kept, root=None, act_saved=saved, act_work=work, loss_bytes=loss,
                      pb=pb, cb=cb, rb=rb, gb=gb, optimizer=sc.optimizer, matrix_frac=ctx["matrix_frac"],
                      backend="nccl", reshard_after_forward=reshard, gather_cb=gcb, accumulate_grads=pp > 1)
    mem = step_memory(fw, mi, largest_matrix=ctx["largest"])
    opt_elems = sum(g.segment + g.persistent for g in L)
    moe_here = moe_layers_here
    ep_bytes = mc.a2a_bytes * a2a_calls(sc.act_ckpt) * moe_here if (mc and mesh.ep > 1) else 0.0
    ep_s = mc.a2a_call * a2a_calls(sc.act_ckpt) * moe_here if (mc and mesh.ep > 1) else 0.0
    ns_a2a = 0.0
    if sc.optimizer == "muon" and fw == "ragged":
        # one owner per matrix, flops balanced; pieces travel to owners and back (all-to-all)
        # unless the layout keeps matrices whole
        ns_world, ns_gather = mesh.shard * mesh.ep, 0.0
        ns_a2a = 0.0 if gran == "matrix" else 2 * 4.0 * sum(g.segment for g in L)
    else:  # torch.optim.Muon on sharded params: every rank assembles and orthogonalises all
        ns_world, ns_gather = 1, ctx["matrix_elems"] * 4 / mesh.tp / pp
    p2p = 0.0
    if pp > 1:
        inner = mesh.gpus // pp
        bw, lat = (prof.nvlink_bw, prof.alpha_intra) if inner < prof.gpus_per_node else (prof.net_bw, prof.alpha_inter)
        p2p = 2 * (pp - 1) * (lat + tokens * arch.hidden * cb / mesh.tp / bw)
    wire = rc.grad_wire if fw == "ragged" else None  # the option is ragged_fsdp's
    wkw = {}
    if wire is not None:
        loc = WIRE_LOCAL_BYTES[wire]
        wkw = dict(wire_bytes=wire_bytes_per_element(wire, rc.grad_wire_block), wire_sum_bytes=loc["sum"],
                   wire_sender_bytes=loc["quantise"] + (feedback_bytes(wire, rc.residual_storage) if rc.grad_wire_ef
                                                        else 0.0))
    ti = TimeInputs(layouts=L, comp_f=comp_f, comp_b=comp_b, cb=cb, rb=rb, replicate=mesh.replicate,
                    kept=kept, reshard_after_forward=reshard, opt_elems=opt_elems,
                    optimizer=sc.optimizer, ns_flops=ctx["ns_total"] / mesh.tp / pp, ns_world=ns_world,
                    ns_gather_bytes=ns_gather, ns_a2a_bytes=ns_a2a, ep_bytes=ep_bytes, ep_world=mesh.ep, ep_s=ep_s,
                    tp_exposed=tp_exp, tp_total=tp_tot, cp_exposed=cp_exp, cp_total=cp_tot, gather_cb=gcb,
                    microbatches=m_count, bubble=bubble(rc.pp_schedule, pp, rc.pp_virtual), p2p_fill=p2p, **wkw)
    return mem, step_time(fw, prof, ti), L


def _grad_reduce(fw: str, sc: Scenario, arch: Arch, per_stage, s_time: int) -> dict:
    """The gradient reduction of the slowest stage: its format, the bytes one rank sends per
    step (shard dim), the wire's local seconds, and the error-feedback residual's bytes per
    rank: the pieces this rank sends, (W - 1) / W of each group's unsharded gradient, in the
    residual's storage (the own segment is summed exact and has none)."""
    rc = sc.recipe
    wire = rc.grad_wire if fw == "ragged" else None
    _, _, tr, L = next(x for x in per_stage if x[0] == s_time)
    fmt = "fp32 reduce-scatter" if wire is None else f"{wire} wire, fp32 sum" + (", error feedback" if rc.grad_wire_ef
                                                                               else "")
    if wire is not None and rc.grad_wire_block is not None:
        fmt += f", {rc.grad_wire_block}-element blocks"
    store = rc.residual_storage if wire is not None else None
    ef = (residual_bytes_per_element(store, rc.grad_wire_block) * sum((g.shard_world - 1) * g.segment for g in L)
          if store else 0.0)
    if store:
        fmt += f", {store} residual"
    return {"format": fmt, "sent_bytes": tr.reduce_sent_bytes, "wire_local_s": tr.wire_local_s,
            "feedback_bytes": ef, "residual": store,
            # per element of this rank's unsharded gradient ((W-1)/W of the storage's bytes)
            "feedback_bytes_per_element": ef / max(1, sum(g.gathered for g in L))}


def simulate(sc: Scenario, frameworks=FRAMEWORKS, arch: Arch | None = None) -> list[FrameworkResult]:
    arch = arch or resolve_model(sc.model)
    check_scenario(sc, arch)
    gran = DEFAULT_GRANULARITY[sc.optimizer] if sc.granularity == "auto" else sc.granularity
    mesh, prof = sc.mesh, sc.profile
    m_count = sc.recipe.n_microbatches(sc.micro_batch) if mesh.pp > 1 else 1
    matrices = list(_matrices(arch)) if sc.optimizer == "muon" else []
    stages = _stages(arch, mesh.pp)
    sizes = stage_layers(arch.layers, mesh.pp) if mesh.pp > 1 else [arch.layers]
    ctx = {"ns_total": sum(newton_schulz_flops(a, b) for a, b in matrices),
           "largest": max((a * b for a, b in matrices), default=0),
           "matrix_elems": sum(a * b for a, b in matrices), "attn_rate": fitted.ATTENTION_RATE,
           "first_layer": [sum(sizes[:s]) for s in range(len(sizes))]}
    ctx["matrix_frac"] = ctx["matrix_elems"] / max(1, arch.params)
    for fw in frameworks:
        if fw not in FRAMEWORKS:
            raise ValueError(f"--frameworks: unknown {fw!r}; known: {', '.join(FRAMEWORKS)}")
    results = []
    n_tensors = sum(len(ts) for _, ts in arch.groups)
    for fw in frameworks:
        per_stage = [(s, *_stage_result(fw, sc, arch, s, groups, gran, m_count, ctx)) for s, groups in stages]
        s_mem, mem, _, L_mem = max(per_stage, key=lambda x: x[1].peak)
        s_time, _, tr, _ = max(per_stage, key=lambda x: x[2].step)
        peak = mem.peak * (1 + prof.alloc_reserve) + prof.reserved_bytes
        # error feedback's residuals persist through the step: the sent pieces of each
        # group's unsharded gradient (quant/wire_residual.py), on top of every phase's peak
        ef = _grad_reduce(fw, sc, arch, per_stage, s_mem)["feedback_bytes"]
        peak += ef * (1 + prof.alloc_reserve)
        # DeepEP's communication buffer lives for the whole process, on top of every phase
        dbuf = (deepep_buffer_bytes(arch.hidden, DTYPE_BYTES[sc.dtype], mesh.ep, prof.gpus_per_node)
                if arch.experts and sc.recipe.moe_dispatcher == "deepep" else 0.0)
        peak += dbuf
        items = {**mem.items, **({"error-feedback residuals": ef} if ef else {}),
                 **({"DeepEP buffer": dbuf} if dbuf else {})}
        L_all = [g for _, _, _, L in per_stage for g in L]
        used = sum(g.numel * g.count for g in L_all)
        held = sum((g.segment + g.persistent) * g.shard_world for g in L_all)
        tokens_gpu = sc.micro_batch * sc.seq / (mesh.tp * mesh.pp * mesh.cp)  # per GPU per step
        mfu = tokens_gpu * arch.flops_per_token(sc.seq) / tr.step / prof.flops
        results.append(FrameworkResult(
            framework=fw, status=VALIDATED[fw], mesh=str(mesh), memory_bytes=peak, fits=peak <= prof.hbm_bytes,
            peak_phase=mem.peak_phase + (f" (stage {s_mem})" if mesh.pp > 1 else ""), memory_items=items,
            sharded_params=mem.sharded_params, sharded_grads=mem.sharded_grads, optimizer_states=mem.optimizer_states,
            padding=(held - used) / max(1, used), step_s=tr.step, mfu=mfu, tokens_per_s_per_gpu=tokens_gpu / tr.step,
            time_parts=tr.parts, differences=DIFFERENCES[fw], comm_phases=tr.comm_phases, peak_stage=s_mem,
            grad_reduce=_grad_reduce(fw, sc, arch, per_stage, s_time),
            uncertainty=uncertainty(prof.name, sc.recipe, bool(arch.experts), mesh.ep, prof.efficiency,
                                    {"tp": mesh.tp, "cp": mesh.cp, "pp": mesh.pp, "ep": mesh.ep}),
            # measured on 1-D FSDP meshes of W ranks: the set-up is taken at the shard group's
            # size and the coordinator's planning at every rank's (it gathers all plans)
            host={"startup": host_costs(sc.model, fw, mesh.dp, n_tensors),
                  "checkpoint": host_costs(sc.model, fw, sc.gpus, n_tensors)}))
    base = next((r for r in results if r.framework == "ragged"), None)
    if base is not None:
        for r in results:
            if r is not base:
                r.vs_ragged = breakdown(base, r)
    return results


def simulate_auto(sc: Scenario, frameworks=FRAMEWORKS, arch: Arch | None = None):
    """For each framework, the fastest mesh that fits among :func:`candidate_meshes`;
    returns (results, explanation per framework)."""
    arch = arch or resolve_model(sc.model)
    best: dict[str, tuple] = {}
    tried: dict[str, list] = {fw: [] for fw in frameworks}
    refused = []
    for mesh in candidate_meshes(sc.gpus, bool(arch.experts), sc.profile.gpus_per_node):
        sc2 = Scenario(**{**sc.__dict__, "mesh": mesh})
        try:  # e.g. --async-tp rules out the meshes without TP
            got = simulate(sc2, frameworks, arch)
        except ValueError as e:
            refused.append(f"{mesh}: {e}")
            continue
        for r in got:
            tried[r.framework].append(r)
            cur = best.get(r.framework)
            key = (r.fits, r.tokens_per_s_per_gpu)
            if cur is None or key > cur[0]:
                best[r.framework] = (key, r)
    if not best:
        raise ValueError("--mesh auto: no candidate mesh (FSDP, HSDP, TP 2-8, EP) accepts this recipe: "
                         + "; ".join(refused[:3]))
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
