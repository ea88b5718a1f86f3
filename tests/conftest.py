"""``RAGGED_FSDP_CHECK_ORDER=1`` (the ordering-checking device, see ``_checking_device.py``)
runs the engine tests at W = 2 only: the module fixtures named ``results`` that take a world
size keep their W = 2 parameter (fixed-size meshes run as they are)."""

from __future__ import annotations

import os


def pytest_collection_modifyitems(config, items):
    if os.environ.get("RAGGED_FSDP_CHECK_ORDER") != "1":
        return
    kept = [it for it in items if getattr(getattr(it, "callspec", None), "params", {}).get("results", 2) == 2]
    config.hook.pytest_deselected(items=[it for it in items if it not in kept])
    items[:] = kept
