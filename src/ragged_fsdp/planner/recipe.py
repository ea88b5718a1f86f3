"""The DeviceMesh and ``fully_shard`` calls that realise a plan, as Python a user can paste.

A plan (or one of ``plan --suggest``'s ways out) is a world size ``W``, tensor and expert
parallel degrees ``T`` and ``E``, optionally an HSDP shard group of ``D`` dense ranks
(``W/T/D`` replicas) and optionally ``k`` consecutive FSDP groups merged into one. The code
uses torch's FSDP2 call shapes (``ragged_fsdp.fully_shard`` has the same signature) on a
Hugging Face causal LM (``model.model.embed_tokens``, ``model.model.layers``,
``model.model.norm``, ``model.lm_head``):

* mesh dims outermost first: ``replicate`` (HSDP), ``dp``/``shard``, ``ep``, ``tp``;
* TP first (``parallelize_module`` on ``mesh["tp"]``), then FSDP on the TP-local tensors;
* with EP the experts are wrapped first, on ``mesh["dp"]`` (the dp ranks of their EP group),
  with ``set_gradient_divide_factor(W/T)``: tokens from all ``W/T`` dense ranks reach them, so
  their gradient is a sum over that many batches, not over ``W/(T*E)``; everything else goes
  on ``mesh["dp", "ep"]`` flattened;
* per-block groups, the embedding, the final norm + LM head as one group, then the root.

Pure string building; :func:`mesh_layout` is the mesh alone, for tests and JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ModuleMap", "MeshLayout", "mesh_layout", "recipe"]


@dataclass(frozen=True)
class ModuleMap:
    """Where a model's FSDP groups and TP-split modules live (attribute paths)."""

    family: str
    blocks: int
    tied: bool = False
    moe_layers: tuple[int, ...] = ()
    experts_attr: str | None = None  # relative to a block, e.g. "mlp.experts"
    experts_separate: bool = False  # one module per expert (a ModuleList) vs stacked tensors
    dense_plan: dict = field(default_factory=dict)  # block-relative module -> ParallelStyle text
    moe_plan: dict = field(default_factory=dict)
    top_plan: dict = field(default_factory=dict)  # model-relative module -> ParallelStyle text
    tp_notes: tuple[str, ...] = ()  # TP-split parameters no ParallelStyle covers


@dataclass(frozen=True)
class MeshLayout:
    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    dense_mesh: str  # expression for the mesh dense groups are sharded over
    expert_mesh: str | None  # expression for the experts' mesh (EP only)
    dense_dp: int  # ranks the dense groups are sharded over (x replicas under HSDP)
    expert_dp: int
    replicas: int

    def as_dict(self) -> dict:
        return {"shape": list(self.shape), "dim_names": list(self.dim_names), "dense_mesh": self.dense_mesh,
                "expert_mesh": self.expert_mesh, "dense_shard_ranks": self.dense_dp,
                "expert_shard_ranks": self.expert_dp, "replicas": self.replicas}


def mesh_layout(world: int, tp: int = 1, ep: int = 1, hsdp: int | None = None) -> MeshLayout:
    """The mesh for ``world`` ranks with TP ``tp``, EP ``ep`` and, if ``hsdp``, shard groups of
    ``hsdp`` dense ranks (a multiple of ``ep`` dividing ``world/tp``)."""
    if world % tp or (world // tp) % ep:
        raise ValueError(f"world {world} is not divisible by tp={tp} x ep={ep}")
    wd = world // tp
    if hsdp is not None and (wd % hsdp or hsdp % ep):
        raise ValueError(f"HSDP shard group {hsdp} must divide world/tp={wd} and be a multiple of ep={ep}")
    shard = hsdp or wd
    replicas = wd // shard
    dp = "shard" if hsdp else "dp"
    dims = ([("replicate", replicas)] if hsdp else []) + [(dp, shard // ep)]
    if ep > 1:
        dims.append(("ep", ep))
    if tp > 1:
        dims.append(("tp", tp))
    names = tuple(n for n, _ in dims)
    if ep > 1:
        dense = 'mesh["replicate", "shard_ep"]' if hsdp else "dp_ep"
        expert = 'mesh["replicate", "shard"]' if hsdp else 'mesh["dp"]'
    else:
        expert = None
        if len(dims) == 1 or (hsdp and tp == 1):
            dense = "mesh"
        else:
            dense = 'mesh["replicate", "shard"]' if hsdp else 'mesh["dp"]'
    return MeshLayout(tuple(s for _, s in dims), names, dense, expert, shard, shard // ep, replicas)


def _dict_text(d: dict, indent: str) -> str:
    items = [f'{indent}    "{k}": {v},' for k, v in d.items()]
    return "{\n" + "\n".join(items) + f"\n{indent}}}"


def _span(idx: tuple[int, ...]) -> str:
    if idx and list(idx) == list(range(idx[0], idx[-1] + 1)):
        return f"range({idx[0]}, {idx[-1] + 1})"
    return repr(list(idx))


def recipe(mm: ModuleMap, world: int, tp: int = 1, ep: int = 1, hsdp: int | None = None,
           merge: int = 1, title: str = "", brief: bool = False) -> str:
    """Python code that builds the mesh and wraps ``model`` as the plan says. ``brief`` leaves
    out the imports and the tensor-parallel plan (for a listing that printed them once)."""
    ml = mesh_layout(world, tp, ep, hsdp)
    L: list[str] = []
    add = L.append
    add(f"# {title}" if title else "# ragged_fsdp plan")
    add(f"# model: a Hugging Face {mm.family} causal LM (model.model.layers); W={world}, tp={tp}, ep={ep}")
    if not brief:
        add("from torch.distributed.device_mesh import init_device_mesh")
        add("from ragged_fsdp import fully_shard  # same signature as torch.distributed.fsdp.fully_shard")
    if tp > 1 and not brief:
        add("from torch.distributed.tensor import Replicate")
        add("from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module")
    add("")
    add(f'mesh = init_device_mesh("cuda", {ml.shape!r}, mesh_dim_names={ml.dim_names!r})')
    if ep > 1:
        if hsdp:
            add('mesh["shard", "ep"]._flatten("shard_ep")  # dense shard groups: shard x ep ranks')
            add("# (torch 2.13 warns that slicing this flattened dim from the root mesh, as below, will be")
            add("# deprecated; it still works there)")
        else:
            add('dp_ep = mesh["dp", "ep"]._flatten("dp_ep")  # the dense data-parallel ranks: dp x ep')
    add("m = model.model")
    moe = mm.moe_layers
    if moe and (tp > 1 or ep > 1):
        add(f"moe_layers = {_span(moe)}")
    if tp > 1 and brief:
        add("# tensor parallel first, on mesh[\"tp\"]: the same parallelize_module calls as above")
    elif tp > 1:
        add("")
        add("# tensor parallel first: FSDP then shards the TP-local tensors (norms and routers stay")
        add("# whole; routed experts are not tensor-parallel in this plan)")
        add(f'parallelize_module(model, mesh["tp"], {_dict_text(mm.top_plan, "")})')
        if moe and mm.dense_plan and len(moe) < mm.blocks and mm.dense_plan != mm.moe_plan:
            add(f"dense_plan = {_dict_text(mm.dense_plan, '')}")
            add(f"moe_plan = {_dict_text(mm.moe_plan, '')}")
            add("for i, block in enumerate(m.layers):")
            add('    parallelize_module(block, mesh["tp"], moe_plan if i in moe_layers else dense_plan)')
        else:
            add(f"layer_plan = {_dict_text(mm.moe_plan if moe else mm.dense_plan, '')}")
            add("for block in m.layers:")
            add('    parallelize_module(block, mesh["tp"], layer_plan)')
        for note in mm.tp_notes:
            add(f"# also: {note}")
        if mm.tied:  # parallelize_module gave the embedding a new (DTensor) parameter
            add("model.lm_head.weight = m.embed_tokens.weight  # tie again: TP replaced the embedding's weight")
    if ep > 1:
        add("")
        add(f"# expert parallelism: each ep rank keeps 1/{ep} of every MoE block's experts and routes")
        add('# tokens to them (e.g. torchtitan\'s ExpertParallel on mesh["ep"]; not shown). The experts')
        add(f"# go first, on the {ml.expert_dp} dp ranks of their EP group; their gradient sums tokens")
        add(f"# from all {world // tp} dense ranks, hence the divide factor.")
        unit = f"list(m.layers[i].{mm.experts_attr})" if mm.experts_separate else f"[m.layers[i].{mm.experts_attr}]"
        if merge > 1:
            add(f"expert_units = [{unit} for i in moe_layers]")
            add(f"for j in range(0, len(expert_units), {merge}):  # {merge} consecutive expert groups as one")
            add(f"    group = [mod for unit in expert_units[j:j + {merge}] for mod in unit]")
            add(f"    fully_shard(group, mesh={ml.expert_mesh})")
            add(f"    group[0].set_gradient_divide_factor({world // tp})")
        else:
            add("for i in moe_layers:")
            add(f"    experts = {unit}")
            add(f"    fully_shard(experts, mesh={ml.expert_mesh})")
            add(f"    experts[0].set_gradient_divide_factor({world // tp})")
    add("")
    # tied: the LM head shares the embedding's weight, so both modules go in the embedding's call
    # (FSDP2 swaps a shared parameter only in the modules of one call)
    head = "[m.norm]" if mm.tied else "[m.norm, model.lm_head]"
    emb = "[m.embed_tokens, model.lm_head]" if mm.tied else "m.embed_tokens"
    dm = ml.dense_mesh
    if merge > 1:
        add("units = [" + (emb if mm.tied else "[m.embed_tokens]") + "] + [[block] for block in m.layers] + ["
            + head + "]")
        add(f"for j in range(0, len(units), {merge}):  # {merge} consecutive FSDP groups as one")
        add(f"    fully_shard([mod for unit in units[j:j + {merge}] for mod in unit], mesh={dm})")
    else:
        add(f"fully_shard({emb}, mesh={dm})")
        add("for block in m.layers:")
        add(f"    fully_shard(block, mesh={dm})")
        add(f"fully_shard({head}, mesh={dm})")
    add(f"fully_shard(model, mesh={dm})  # the root: whatever is left")
    return "\n".join(L) + "\n"
