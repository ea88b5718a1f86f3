"""Integrations with training frameworks (optional extras).

- ``ragged_fsdp.integrations.torchtitan``: ``--module ragged_fsdp.integrations.torchtitan``
  (``pip install ragged_fsdp[torchtitan]``)
- ``ragged_fsdp.integrations.accelerate``: ``enable()`` before ``Accelerator(fsdp_version=2)``
  (``pip install ragged_fsdp[accelerate]``)

Each is imported on demand, so ``import ragged_fsdp`` never needs the frameworks.
"""
