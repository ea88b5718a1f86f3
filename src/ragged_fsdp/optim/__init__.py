"""Structure-aware optimizers: distributed Muon, block-wise 8-bit AdamW and Shampoo.

Both work on plain modules and on modules sharded by ``ragged_fsdp.fully_shard`` (or any
layout that gives each rank one contiguous run of each parameter: RaggedShard, torch's
``Shard(0)``, Replicate), and each says what the sharding must keep whole through a
``granularity`` policy for ``fully_shard``::

    from ragged_fsdp import fully_shard
    from ragged_fsdp.optim import AdamW8bit, Muon, combined_granularity, muon_param_groups

    # 8-bit AdamW: quantisation blocks must stay whole (an error names the parameter if not)
    for block in model.layers:
        fully_shard(block, mesh=mesh, granularity_fn=AdamW8bit.granularity)
    fully_shard(model, mesh=mesh, granularity_fn=AdamW8bit.granularity)
    opt = AdamW8bit(model.parameters(), lr=3e-4)

    # Muon for hidden matrices, AdamW for embeddings/head/1-D (explicit groups)
    policy = combined_granularity(model)        # build before the first fully_shard
    for block in model.layers:
        fully_shard(block, mesh=mesh, granularity_fn=policy)
    fully_shard(model, mesh=mesh, granularity_fn=policy)
    opt = Muon(muon_param_groups(model, muon={"lr": 0.02}, adamw={"lr": 3e-4}))

    # Shampoo: every B x B preconditioner tile whole on one rank, no collective in step()
    gran = Shampoo.granularity_for(max_preconditioner_dim=1024)   # = Shampoo.granularity
    for block in model.layers:
        fully_shard(block, mesh=mesh, granularity_fn=gran)
    fully_shard(model, mesh=mesh, granularity_fn=gran)
    opt = Shampoo(model.parameters(), lr=1e-2, max_preconditioner_dim=1024)

Exactness: Shampoo's parameters equal the single-process ``ReferenceShampoo`` bit for bit at
every world size (each rank preconditions the tiles it holds whole). Muon's parameters equal
single-device ``torch.optim.Muon`` bit for bit (the owner of each matrix runs the same
Newton-Schulz on the same full matrix), AdamW8bit's parameters and
states are the same bits at every world size (each rank quantises whole blocks of its own).
On n-D meshes (RaggedShard next to HSDP's Replicate or TP/EP's ``Shard(k)``): Muon stays bitwise
equal to ``torch.optim.Muon`` (an owner gathers the whole global matrix over the RaggedShard and
TP dims; an EP expert stays on its EP rank; HSDP replicas repeat the work), AdamW8bit cuts its
blocks from the TP/EP-local tensor (bitwise the same at every data-parallel size for a fixed
TP/EP layout), the AdamW steps are pointwise on local tensors, and Shampoo accepts HSDP and
refuses TP/EP layouts with an error naming the parameter.
Both expose ``state_dict()``/``load_state_dict()`` with DTensor states (codes in the parameter's
layout, absmax as a RaggedDTensor over blocks) that load under any other layout or world size
(full tensors, DTensors, or through DCP).
"""
from .adamw import AdamW
from .adamw8bit import AdamW8bit, state_bytes
from .muon import Muon, adjust_lr, newton_schulz, newton_schulz_flops
from .shampoo import Shampoo
from .shampoo_blocks import merged_shape, shampoo_granularity
from .shampoo_reference import ReferenceShampoo
from .routing import (
    adamw8bit_granularity, combined_granularity, muon_granularity, muon_param_groups, route_params, split_params,
)

__all__ = [
    "AdamW", "Muon", "AdamW8bit", "state_bytes", "newton_schulz", "newton_schulz_flops", "adjust_lr",
    "muon_granularity", "adamw8bit_granularity", "combined_granularity", "muon_param_groups",
    "split_params", "route_params", "Shampoo", "shampoo_granularity", "merged_shape", "ReferenceShampoo",
]
