"""Per-rank layout of every FSDP group for each framework, from the real planner and the
planner's baselines.

A group's numbers: ``shard_world`` (ranks it is sharded over), ``segment`` (elements each
rank holds, padding included), ``numel`` (its tensors' elements), ``n_tensors``, and ``count``
(identical groups: a model's repeated blocks are planned once). ragged_fsdp's segment comes
from :func:`ragged_fsdp.planner.plan_model` with the requested granularity; FSDP2, FSDP1,
DeepSpeed and Megatron-FSDP from :mod:`ragged_fsdp.planner.baselines` on the same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..planner.baselines import baseline
from ..planner.granularity import Granularity, TensorSpec
from ..planner.model import group_signature, plan_model

__all__ = ["GroupLayout", "group_layouts", "tensor_specs", "split_for_mesh"]

# what each framework's sharding is on the planner's baselines
_BASELINE = {"fsdp2": "fsdp2", "fsdp1": "fsdp1", "deepspeed": "deepspeed", "megatron": "megatron"}


@dataclass
class GroupLayout:
    name: str
    count: int
    shard_world: int
    segment: int  # elements per rank (the padded shard)
    numel: int  # elements of the group's tensors (unpadded)
    n_tensors: int
    expert: bool = False  # an expert-only group (EP: sharded over dp only)
    padding: float = 0.0  # padding over numel, this framework
    blocks_cut: int = 0
    # DeepSpeed ZeRO-3: tensors at or under the persistence threshold stay replicated
    persistent: int = 0
    stride: int = 1  # rank spacing of the shard group (inner TP / EP dims sit in between)
    apart: int = 0  # ragged_fsdp: segment elements of the group's separate embedding buffer

    @property
    def gathered(self) -> int:
        """Elements of the all-gather output (``W * S``)."""
        return self.shard_world * self.segment


def _granularity_for(shape: tuple[int, ...], gran: str | None) -> Granularity | None:
    """The block kept whole for a tensor: ``matrix`` keeps 2-D tensors whole and each expert
    matrix of a 3-D tensor whole (what Muon needs); other specs as the planner parses them,
    vectors element-granular."""
    if gran is None or len(shape) < 2:
        return None
    if gran == "matrix":
        return Granularity("tensor") if len(shape) == 2 else Granularity("rows", shape[1])
    return Granularity.parse(gran)


def tensor_specs(tensors, itemsize: int, gran: str | None) -> list[TensorSpec]:
    return [TensorSpec(n, s, itemsize, _granularity_for(tuple(s), gran)) for n, s in tensors]


def split_for_mesh(groups, tp: int, ep: int):
    """TP-local and EP-local tensor shapes, and the groups split into (experts, rest) when
    ``ep > 1``. TP: column-parallel weights (q/k/v, gate/up, embedding, head) split dim 0,
    row-parallel (o_proj, down_proj) the last dim, as torchtitan's plans do; experts are
    left to EP. EP: routed experts split on the expert dim (fused) or by expert (separate)."""
    out = []
    for gname, tensors in groups:
        experts, rest = [], []
        for n, s in tensors:
            s = list(s)
            is_expert = ".experts." in n and "shared_expert" not in n
            if is_expert:
                if ep > 1:
                    if len(s) == 3:
                        s[0] = -(-s[0] // ep)
                    else:  # separate experts: keep ours (expert index modulo ep == 0)
                        j = int(n.split(".experts.")[1].split(".")[0]) if n.split(".experts.")[1][0].isdigit() else 0
                        if j % ep:
                            continue
                experts.append((n, tuple(s)))
                continue
            if tp > 1 and len(s) >= 2:
                if any(k in n for k in ("o_proj", "down_proj", ".wo.", ".w2.")):
                    s[-1] = -(-s[-1] // tp)
                elif "router" not in n and "mlp.gate.weight" not in n:
                    s[0] = -(-s[0] // tp)
            rest.append((n, tuple(s)))
        if ep > 1 and experts:
            out.append((gname + ".experts", experts, True))
            if rest:
                out.append((gname, rest, False))
        else:
            out.append((gname, rest + experts, False))
    return out


def is_embedding_weight(name: str, shape) -> bool:
    """An (untied) token-embedding table, as the engine recognises nn.Embedding weights."""
    return len(shape) == 2 and name.endswith(".weight") and "embed" in name.split(".")[-2]


def group_layouts(groups, framework: str, dp: int, tp: int = 1, ep: int = 1, itemsize: int = 4,
                  granularity: str | None = None, align_bytes: int = 16,
                  persistence_threshold: int = 100_000) -> list[GroupLayout]:
    """Layouts in model order. Non-expert groups shard over ``dp * ep`` ranks (with EP the
    expert dim is already split ``ep`` ways, so experts shard over ``dp``)."""
    split = split_for_mesh(groups, tp, ep)
    out: list[GroupLayout] = []
    cache: dict[tuple, GroupLayout] = {}
    if framework == "ragged":
        for world, is_exp in ((dp * ep, False), (dp, True)):
            sel, parts = [], []  # the engine plans embedding weights in a buffer of their own
            for n, t, e in split:
                if e != is_exp:
                    continue
                emb = [x for x in t if is_embedding_weight(x[0], x[1])]
                rest = [x for x in t if not is_embedding_weight(x[0], x[1])]
                parts.append((n, len(sel), len(sel) + 1 if emb and rest else None))
                sel.append((n, tensor_specs(rest or emb, itemsize, granularity)))
                if emb and rest:
                    sel.append((n + "#embedding", tensor_specs(emb, itemsize, granularity)))
            if not sel:
                continue
            mp = plan_model(sel, world, align_bytes)
            errs = mp.validate()
            if errs:
                raise RuntimeError(f"planner produced an invalid plan: {errs[:3]}")
            for name, gi, ei in parts:
                plans = [mp.kinds[mp.kind_of[gi]].plan] + ([mp.kinds[mp.kind_of[ei]].plan] if ei is not None else [])
                specs = sel[gi][1] + (sel[ei][1] if ei is not None else [])
                numel = sum(s.numel for s in specs)
                segment = sum(p.segment for p in plans)
                cache[(name,)] = GroupLayout(name, 1, world, segment, numel, len(specs), is_exp,
                                             (segment * world - numel) / max(1, numel),
                                             stride=tp * (ep if is_exp else 1),
                                             apart=plans[1].segment if ei is not None else 0)
        return [cache[(n,)] for n, _, _ in split]
    base = _BASELINE.get(framework)
    if base is None:
        raise ValueError(f"unknown framework {framework!r}")
    for name, tensors, is_exp in split:
        world = dp if is_exp else dp * ep
        specs = tensor_specs(tensors, itemsize, granularity)
        key = (group_signature(specs), world)
        hit = cache.get(key)
        if hit is None:
            persistent = 0
            sharded = specs
            if framework == "deepspeed":  # small tensors stay whole on every rank
                persistent = sum(s.numel for s in specs if s.numel <= persistence_threshold)
                sharded = [s for s in specs if s.numel > persistence_threshold]
            if framework == "megatron":
                # Megatron-Core's experts (TEGroupedMLP: TE GroupedLinear's weight0..weightN)
                # are one 2-D weight per local expert, not a fused (E, out, in) tensor; the
                # chunk factor Megatron-FSDP pads a bucket to is the LCM of the weights'
                # shape[1:] sizes (megatron_fsdp/param_and_grad_buffer.py, "Step 3"), so a
                # fused tensor would make it a whole expert matrix
                sharded = [x for s in sharded for x in (
                    [TensorSpec(f"{s.name}.{i}", tuple(s.shape[1:]), s.itemsize, s.granularity)
                     for i in range(s.shape[0])] if len(s.shape) == 3 else [s])]
            if framework == "fsdp2":  # torchtitan shards 3-D experts on dim 1 when dim 0 < W
                sharded = [TensorSpec(s.name, (s.shape[1], s.shape[0], *s.shape[2:]), s.itemsize, s.granularity)
                           if len(s.shape) == 3 and s.shape[0] < world else s for s in sharded]
            r = baseline(base, sharded, world) if sharded else None
            numel = sum(s.numel for s in specs)
            seg = (r.per_rank if r else 0)
            hit = GroupLayout(name, 1, world, seg, numel, len(specs), is_exp,
                              ((seg * world + persistent * world) - numel) / max(1, numel) if r else 0.0,
                              r.blocks_cut if r else 0, persistent, stride=tp * (ep if is_exp else 1))
            cache[key] = hit
        out.append(GroupLayout(**{**hit.__dict__, "name": name}))
    return out

