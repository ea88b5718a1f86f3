"""ragged_fsdp: fully sharded data parallelism that keeps the structure of tensors."""
from .placement import RaggedShard

__version__ = "0.1.0"
__all__ = ["RaggedShard", "__version__"]
