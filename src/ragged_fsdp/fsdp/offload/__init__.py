"""Host memory: ``OffloadPolicy``, the per-unit host segments and their copies, the optimizers
that cannot step on host state, and the whole-model ``offload_to_host`` / ``load_to_device``."""
