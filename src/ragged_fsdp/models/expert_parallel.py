"""Expert parallelism for the reference MoE: ``apply_expert_parallel(model, ep_mesh)``.

After the call every ``MoELayer``'s fused expert weights ``w1/w2/w3`` are DTensors
``Shard(0)`` on ``ep_mesh`` (each EP rank holds ``n_experts / ep_size`` whole experts), and
the layer's forward dispatches tokens to the experts' ranks with an all-to-all
(``ep_dispatch``). Router, attention, norms and shared experts stay plain replicated
parameters. Apply it before ``fully_shard`` (EP first, then data parallelism), as
torchtitan does.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from .moe import FusedExperts, MoELayer

__all__ = ["apply_expert_parallel"]


def apply_expert_parallel(module: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """Shard the experts of every ``MoELayer`` in ``module`` (an ``MoE`` or one layer) over the
    1-D ``ep_mesh`` and switch their forward to token all-to-all dispatch. Returns ``module``.

    The weights are ``distribute_tensor``-ed from the full ones (scattered from the mesh's
    first rank), so with the same seed they equal the single-process model's experts. The
    layer keeps ``ep_mesh`` itself (``layer.ep_mesh``): FSDP may later replace the parameters
    by DTensors on a larger mesh, and the EP group must not be read back from them.
    """
    if not isinstance(ep_mesh, DeviceMesh):
        raise TypeError(
            f"apply_expert_parallel: ep_mesh must be a torch DeviceMesh (e.g. mesh['ep'] of "
            f"init_device_mesh(..., mesh_dim_names=('dp', 'ep'))), got {type(ep_mesh).__name__}")
    if ep_mesh.ndim != 1:
        raise ValueError(
            f"apply_expert_parallel: ep_mesh must be 1-D, got a {ep_mesh.ndim}-D mesh of shape "
            f"{tuple(ep_mesh.shape)}; pass the expert-parallel dimension, e.g. mesh['ep']")
    if not isinstance(module, nn.Module):
        raise TypeError(f"apply_expert_parallel: module must be an nn.Module, got {type(module).__name__}")
    layers = [(name, m) for name, m in module.named_modules() if isinstance(m, MoELayer)]
    if not layers:
        raise ValueError(
            f"apply_expert_parallel: {type(module).__name__} contains no MoELayer; pass an MoE "
            f"model or an MoELayer")
    size = ep_mesh.size()
    for name, layer in layers:  # check everything before changing anything
        where = f"MoELayer '{name}'" if name else "the MoELayer"
        if not isinstance(layer.experts, FusedExperts):
            raise ValueError(
                f"apply_expert_parallel: {where} has separate experts (a ModuleList); expert "
                f"parallelism shards the fused 3-D expert weights: build the model with "
                f"MoEConfig(fused_experts=True)")
        if layer.n_experts % size:
            raise ValueError(
                f"apply_expert_parallel: {where} has n_experts={layer.n_experts}, not divisible "
                f"by the ep mesh size {size}; use an ep size that divides n_experts")
        if layer.ep_mesh is not None or any(isinstance(w, DTensor) for w in _weights(layer.experts)):
            raise ValueError(f"apply_expert_parallel: {where} already has expert parallelism applied")
    for _, layer in layers:
        experts = layer.experts
        for attr in ("w1", "w2", "w3"):
            w = getattr(experts, attr)
            dt = distribute_tensor(w.detach(), ep_mesh, [Shard(0)])
            setattr(experts, attr, nn.Parameter(dt, requires_grad=w.requires_grad))
        layer.ep_mesh = ep_mesh
    return module


def _weights(experts: FusedExperts):
    return (experts.w1, experts.w2, experts.w3)
