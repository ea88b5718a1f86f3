"""RaggedShard: the placement (pure math) and its DTensor subclass (ops, redistribute)."""
import torch.optim.optimizer as _optim
import torch.serialization as _serialization
import torch.utils._foreach_utils as _foreach_utils

from . import binding  # noqa: F401 - completes RaggedDTensor (dispatch, redistribute, DCP hooks)
from .api import distribute_tensor, from_local
from .dtensor import RaggedDTensor, rebuild_ragged
from .ragged_shard import RaggedShard, even_units, same_layout
from .redistribute import redistribute

# torch picks foreach/fused optimizer kernels only for tensor types it lists.
for _types in (_optim._foreach_supported_types, _foreach_utils._foreach_supported_types):
    if RaggedDTensor not in _types:
        _types.append(RaggedDTensor)

# torch.load(weights_only=True), torch's default, refuses classes and functions it has not
# been told are safe; torch lists DTensor's own at import, we list ours (pure data types
# and the rebuild function of RaggedDTensor.__reduce_ex__).
_serialization.add_safe_globals([RaggedDTensor, RaggedShard, rebuild_ragged])

__all__ = [
    "RaggedShard", "RaggedDTensor", "from_local", "distribute_tensor", "redistribute",
    "even_units", "same_layout",
]
