"""Kept for ``python -m ragged_fsdp.sim.published``: the published points and their fit now
live in ``data/published_points.json`` and :mod:`.validate`."""

from __future__ import annotations

import sys

from .validate import evaluate, fit, load_points, main

__all__ = ["evaluate", "fit", "load_points", "main"]

if __name__ == "__main__":
    sys.exit(main())
