"""ragged_fsdp: fully sharded data parallelism that keeps the structure of tensors."""
from .placement import RaggedDTensor, RaggedShard, distribute_tensor, from_local, redistribute

__version__ = "0.1.0"
__all__ = ["RaggedShard", "RaggedDTensor", "distribute_tensor", "from_local", "redistribute", "__version__"]
