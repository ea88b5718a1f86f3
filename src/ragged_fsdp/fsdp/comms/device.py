"""The device seam's old path: it is :mod:`ragged_fsdp.device` now (below the engine, since
the optimizers and the exit hook launch through it too). This name is the same module object,
so code that patches it patches the seam."""

import sys

from ragged_fsdp import device as _device

sys.modules[__name__] = _device
