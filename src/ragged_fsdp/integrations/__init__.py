"""Integrations with training frameworks (optional extras; from a checkout:
``pip install torch==2.13.0 -e '.[torchtitan]'`` or ``-e '.[accelerate]'``).

- ``ragged_fsdp.integrations.torchtitan``: ``--module ragged_fsdp.integrations.torchtitan``;
  ``python -m ragged_fsdp.integrations.torchtitan.cpu`` runs torchtitan on CPU gloo ranks
- ``ragged_fsdp.integrations.accelerate``: ``enable()`` before ``Accelerator(fsdp_version=2)``

Each is imported on demand, so ``import ragged_fsdp`` never needs the frameworks.
See ``docs/integrations.md``.
"""
