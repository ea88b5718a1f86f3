"""ragged_fsdp: fully sharded data parallelism that keeps the structure of tensors."""
from .fsdp import (FSDPModule, OffloadPolicy, UnshardHandle, fully_shard, load_to_device, offload_to_host,
                   register_fsdp_forward_method)
from .quant import MXFP8, NVFP4, BlockFP8, GradientReduce
from .placement import RaggedDTensor, RaggedShard, distribute_tensor, from_local, redistribute
from .fsdp.deterministic import global_order
from . import exit as _exit  # registers the exit hook (see ragged_fsdp/exit.py)

__version__ = "0.1.0"
__all__ = [
    "fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
    "OffloadPolicy", "offload_to_host", "load_to_device",
    "RaggedShard", "RaggedDTensor", "distribute_tensor", "from_local", "redistribute",
    "BlockFP8", "MXFP8", "NVFP4", "GradientReduce", "global_order", "__version__",
]
