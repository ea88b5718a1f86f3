"""torch's own optimizers on ``fully_shard`` parameters: which run, and a refusal for those
that cannot, before their first step does any work.

A ``fully_shard`` parameter is a RaggedShard DTensor: each rank holds a run of elements that
may cut rows and matrices anywhere, so an optimizer whose step works element by element
(SGD, Adam, AdamW, Adamax, Adadelta, Adagrad, ASGD, NAdam, RAdam, RMSprop, Rprop, their
foreach and fused forms) runs on the local runs and gives the single-process result.
The optimizers below need more than one element at a time; on a ragged layout they would fail
in the middle of a step on an unsupported op (or a mixed-tensor error), after some parameters
had already moved. The global step pre-hook of ``core.stale_optimizer`` (registered by the
first ``fully_shard`` call) runs :func:`check_torch_optimizer` on an optimizer's first step,
so the refusal comes first, on every rank alike (the same classes and parameters on each),
and names the optimizer to use instead. torch.optim has no hook at construction.
"""

from __future__ import annotations

import torch

__all__ = ["NEEDS_WHOLE_TENSORS", "check_torch_optimizer"]

# torch.optim class name -> (what its step needs, the way out)
NEEDS_WHOLE_TENSORS = {
    "Muon": ("whole matrices (Newton-Schulz orthogonalisation of each update)",
             "use ragged_fsdp.optim.Muon, which gathers each matrix on one rank and is bitwise equal to "
             "torch.optim.Muon (docs/optimizers.md; build the groups with ragged_fsdp.optim.muon_param_groups)"),
    "Adafactor": ("the row and column statistics of whole matrices",
                  "use ragged_fsdp.optim.AdamW8bit (8-bit states, a quarter of AdamW's state memory) or "
                  "torch.optim.AdamW; ragged_fsdp has no sharded Adafactor"),
    "LBFGS": ("all parameters as one flat vector (its line search takes dot products of it)",
              "train the model unsharded for L-BFGS; ragged_fsdp has no sharded L-BFGS"),
    "SparseAdam": ("sparse gradients; fully_shard reduces every gradient dense",
                   "use torch.optim.Adam (or ragged_fsdp.optim.AdamW)"),
}


def _refused_class(opt: torch.optim.Optimizer) -> str | None:
    """The torch.optim class ``opt`` runs the step of, when that class is refused: a subclass
    that brings its own ``step`` has made its own choice and is left alone."""
    for name in NEEDS_WHOLE_TENSORS:
        cls = getattr(torch.optim, name, None)  # Muon and Adafactor are recent
        if cls is not None and isinstance(opt, cls) and type(opt).step is cls.step:
            return name
    return None


def check_torch_optimizer(opt: torch.optim.Optimizer) -> None:
    """Raise ``TypeError`` if ``opt`` is a torch.optim optimizer from :data:`NEEDS_WHOLE_TENSORS`
    holding RaggedShard parameters, naming the first few and the optimizer to use instead."""
    name = _refused_class(opt)
    if name is None:
        return
    from ...placement import RaggedDTensor

    ragged = [(k, i, p) for k, g in enumerate(opt.param_groups) for i, p in enumerate(g["params"])
              if isinstance(p, RaggedDTensor)]
    if not ragged:
        return
    shown = []
    for k, i, p in ragged[:3]:
        names = opt.param_groups[k].get("param_names")
        label = repr(names[i]) if names is not None and i < len(names) else f"param group {k} #{i}"
        shown.append(f"{label} {tuple(p.shape)}")
    more = f" and {len(ragged) - 3} more" if len(ragged) > 3 else ""
    needs, fix = NEEDS_WHOLE_TENSORS[name]
    raise TypeError(
        f"ragged_fsdp: torch.optim.{name} needs {needs}, and fully_shard's parameters are RaggedShard "
        f"DTensors that hold a run of elements per rank: {', '.join(shown)}{more}. Refused before its first "
        f"step changed anything; {fix}")
