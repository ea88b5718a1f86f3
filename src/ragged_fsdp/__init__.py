"""ragged_fsdp: fully sharded data parallelism that keeps the structure of tensors.

The public names load on first use (PEP 562 ``__getattr__``): ``import ragged_fsdp`` imports
neither torch nor any optional stack, so ``python -m ragged_fsdp --help`` (which imports this
package before its ``__main__``) answers before torch would have finished importing.
``from ragged_fsdp import fully_shard`` imports the engine as an eager import would.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for type checkers and the API reference (mkdocstrings reads these statically)
    from .fsdp import (FSDPModule, OffloadPolicy, UnshardHandle, check_same_init, fully_shard, load_to_device,
                       offload_to_host, register_fsdp_forward_method, sync_module_states)
    from .fsdp import abort_step, global_order
    from .placement import RaggedDTensor, RaggedShard, distribute_tensor, from_local, redistribute
    from .quant import MXFP8, NVFP4, BlockFP8, GradientReduce

__version__ = "0.1.0"

# public name -> the module (under ragged_fsdp) that defines it
_PUBLIC = {
    "fully_shard": ".fsdp", "FSDPModule": ".fsdp", "UnshardHandle": ".fsdp",
    "register_fsdp_forward_method": ".fsdp", "OffloadPolicy": ".fsdp", "offload_to_host": ".fsdp",
    "load_to_device": ".fsdp", "check_same_init": ".fsdp", "sync_module_states": ".fsdp",
    "RaggedShard": ".placement", "RaggedDTensor": ".placement", "distribute_tensor": ".placement",
    "from_local": ".placement", "redistribute": ".placement",
    "BlockFP8": ".quant", "MXFP8": ".quant", "NVFP4": ".quant", "GradientReduce": ".quant",
    "global_order": ".fsdp", "abort_step": ".fsdp",
}
__all__ = [
    "fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
    "OffloadPolicy", "offload_to_host", "load_to_device", "check_same_init", "sync_module_states",
    "RaggedShard", "RaggedDTensor", "distribute_tensor", "from_local", "redistribute",
    "BlockFP8", "MXFP8", "NVFP4", "GradientReduce", "global_order", "abort_step", "__version__",
]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'ragged_fsdp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
