"""TP-local and EP-local shapes of a catalog model: what each FSDP group holds per dp rank.

With ``W`` ranks, tensor parallel degree ``T`` and expert parallel degree ``E`` (mesh
``(W/(T*E), E, T)``, dims ``("dp", "ep", "tp")``, tp innermost):

* tensor parallelism is applied first (torch's ``parallelize_module(model, mesh["tp"], plan)``
  with the standard Llama/torchtitan plan, see ``catalog``): a tensor with ``tp_dim = d`` keeps
  ``shape[d] / T`` of that dim on each TP rank; norms, routers and replicated projections stay
  whole. FSDP then shards the TP-local tensors, exactly what ``fully_shard(block,
  mesh=mesh["dp"])`` sees.
* dense tensors (everything but routed experts) are sharded over the ``W/T`` ranks of one TP
  coordinate (``mesh["dp", "ep"]`` flattened when ``E > 1``).
* routed experts are **not** tensor-parallel in this plan (every TP rank holds the same
  experts). Expert parallelism gives each EP rank ``n_experts / E`` experts (stacked tensors:
  dim 0 divided by ``E``; one module per expert: the first ``n_experts / E`` of them, which
  have the shapes of any other EP rank's), and FSDP shards them over the ``W/(T*E)`` ranks
  of ``mesh["dp"]``. With ``E > 1`` each MoE block therefore becomes two FSDP groups, the
  dense part (``layers.i``) and its experts (``layers.i.experts``); with ``E = 1`` the experts
  stay in their block's group.

Pure shape math: no process groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .catalog import STACKED, Group, ModelShapes, Tensor

__all__ = ["ParallelDims", "LocalGroup", "local_groups", "expert_count", "valid_degrees", "module_map"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """World size and TP/EP degrees; ``dense_dp`` and ``expert_dp`` are the FSDP group sizes."""

    world: int
    tp: int = 1
    ep: int = 1

    def __post_init__(self):
        for flag, v in (("--world", self.world), ("--tp", self.tp), ("--ep", self.ep)):
            if type(v) is not int or v < 1:
                raise ValueError(f"{flag} must be a positive integer (got {v!r})")
        W, T, E = self.world, self.tp, self.ep
        if W % T:
            raise ValueError(
                f"--world {W} is not divisible by --tp {T}: dense tensors are sharded over world/tp "
                f"data-parallel ranks; use a world size that is a multiple of {T} "
                f"(e.g. {max(T, W - W % T)}) or a --tp among {_divisors(W)[:12]}")
        if W % (T * E):
            raise ValueError(
                f"--world {W} is not divisible by --tp x --ep = {T * E}: experts are sharded over "
                f"world/(tp*ep) data-parallel ranks; use a world size that is a multiple of {T * E} "
                f"or an --ep among {_divisors(W // T)[:12]}")

    @property
    def dense_dp(self) -> int:
        return self.world // self.tp

    @property
    def expert_dp(self) -> int:
        return self.world // (self.tp * self.ep)

    @property
    def trivial(self) -> bool:
        return self.tp == 1 and self.ep == 1


@dataclass(frozen=True)
class LocalGroup:
    """One FSDP group with TP-/EP-local shapes, sharded over ``dp`` data-parallel ranks."""

    name: str  # "embed", "layers.3", "layers.3.experts", "head"
    kind: str  # "dense" or "experts"
    dp: int
    tensors: list[Tensor]
    block: int | None = None  # transformer block index, None for embed/head


def expert_count(group: Group) -> int:
    """Routed experts in a block (0 for a dense block)."""
    n = 0
    for t in group.tensors:
        if t.expert is not None:
            n = max(n, t.shape[0] if t.expert == STACKED else t.expert + 1)
    return n


def valid_degrees(model: ModelShapes) -> tuple[list[int], list[int]]:
    """The ``--tp`` values every split of ``model`` allows, and the ``--ep`` values (divisors of
    the routed-expert count; ``[1]`` for a dense model)."""
    fields = {t.tp_field for g in model.groups for t in g.tensors if t.tp_dim is not None}
    g = math.gcd(*(int(model.config[f]) for f in fields)) if fields else 1
    n = math.gcd(*(expert_count(gr) for gr in model.groups)) if _has_experts(model) else 1
    return _divisors(g), _divisors(n)


def _has_experts(model: ModelShapes) -> bool:
    return any(expert_count(g) for g in model.groups)


def _tp_local(t: Tensor, tp: int, model: ModelShapes) -> Tensor:
    if tp == 1 or t.tp_dim is None:
        return t
    count = int(model.config[t.tp_field])
    if count % tp:
        ok, _ = valid_degrees(model)
        raise ValueError(
            f"--tp {tp} does not divide {t.tp_field}={count} of {model.id} ({t.name} {t.shape} is split "
            f"on dim {t.tp_dim} by tensor parallelism); use --tp among {ok}")
    shape = list(t.shape)
    assert shape[t.tp_dim] % tp == 0, (t, tp)  # the dim is a multiple of the counted field
    shape[t.tp_dim] //= tp
    return t._replace(shape=tuple(shape))


def _ep_local(t: Tensor, ep: int, n: int) -> Tensor | None:
    """The EP rank 0 view of an expert tensor (None: another EP rank's expert)."""
    if t.expert == STACKED:
        return t._replace(shape=(t.shape[0] // ep, *t.shape[1:]))
    return t if t.expert < n // ep else None


def local_groups(model: ModelShapes, dims: ParallelDims) -> list[LocalGroup]:
    """The model's FSDP groups with TP-/EP-local shapes, each with its data-parallel size."""
    T, E = dims.tp, dims.ep
    if E > 1 and not _has_experts(model):
        raise ValueError(f"--ep {E}: {model.id} is dense (no routed experts); use --ep 1")
    out = []
    for g in model.groups:
        block = int(g.name.split(".")[1]) if g.name.startswith("layers.") else None
        n = expert_count(g)
        if n and n % E:
            _, ok = valid_degrees(model)
            raise ValueError(
                f"--ep {E} does not divide the {n} routed experts of {model.id} ({g.name}); use --ep among {ok}")
        dense = [_tp_local(t, T, model) for t in g.tensors if t.expert is None]
        experts = [x for t in g.tensors if t.expert is not None and (x := _ep_local(t, E, n)) is not None]
        if E == 1:  # experts stay in their block's group, in catalog order
            keep = {t.name for t in experts}
            tensors = [_tp_local(t, T, model) for t in g.tensors if t.expert is None or t.name in keep]
            out.append(LocalGroup(g.name, "dense", dims.dense_dp, tensors, block))
            continue
        out.append(LocalGroup(g.name, "dense", dims.dense_dp, dense, block))
        if experts:
            out.append(LocalGroup(g.name + ".experts", "experts", dims.expert_dp, experts, block))
    return out


def _block_rel(name: str, block: int) -> str:
    return name[len(f"model.layers.{block}."):]


def _layer_plan(group: Group, block: int) -> tuple[dict, list[str]]:
    """ParallelStyle per TP-split Linear of a block (biases follow their module), and notes
    for TP-split parameters that are not a Linear's (gpt-oss's per-head attention sinks)."""
    plan, notes = {}, []
    for t in group.tensors:
        if t.tp_dim is None:
            continue
        rel = _block_rel(t.name, block)
        mod, _, leaf = rel.rpartition(".")
        if leaf == "weight":
            plan[mod] = "ColwiseParallel()" if t.tp_dim == 0 else "RowwiseParallel()"
        elif leaf != "bias":
            notes.append(f"{rel} is split on dim {t.tp_dim} over tp with the heads; no ParallelStyle covers "
                         f"a bare parameter: distribute_tensor it with Shard({t.tp_dim}) on mesh[\"tp\"]")
    return plan, notes


def module_map(model: ModelShapes):
    """Attribute paths of the model's FSDP groups and TP-split modules, for
    :func:`ragged_fsdp.planner.recipe.recipe`."""
    from ..planner.recipe import ModuleMap

    blocks = [(int(g.name.split(".")[1]), g) for g in model.groups if g.name.startswith("layers.")]
    moe = tuple(i for i, g in blocks if expert_count(g))
    dense_plan = moe_plan = {}
    notes: list[str] = []
    attr, separate = None, False
    for i, g in blocks:
        plan, n = _layer_plan(g, i)
        if i in moe:
            if not moe_plan:
                moe_plan, notes = plan, notes + n
            first = next(t for t in g.tensors if t.expert is not None)
            parts = _block_rel(first.name, i).split(".")
            attr = ".".join(parts[:parts.index("experts") + 1])
            separate = first.expert != STACKED
        elif not dense_plan:
            dense_plan, notes = plan, notes + n
    # tied embeddings: the LM head still needs ColwiseParallel's hooks; the recipe ties the
    # weight again afterwards (both styles split it on dim 0, so the tie is consistent)
    top = {"model.embed_tokens": "RowwiseParallel(input_layouts=Replicate())",
           "lm_head": "ColwiseParallel(output_layouts=Replicate())"}
    return ModuleMap(model.config["family"], len(blocks), bool(model.config.get("tied_embeddings")), moe,
                     attr, separate, dense_plan, moe_plan, top, tuple(dict.fromkeys(notes)))
