"""Which directories under a checkpoint root are published checkpoints (pure file listing).

A directory is a checkpoint when its name is ``step-<n>`` and it holds both the completion
marker :data:`MARKER` (written last, before the publishing rename) and DCP's ``.metadata``.
``step-<n>`` directories lacking either are reported with the reason, so callers that fall
back to an older step can say which one they skipped and why.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

__all__ = ["MARKER", "Checkpoint", "list_checkpoints", "latest_checkpoint", "scan"]

MARKER = ".ragged_fsdp_complete"
_NAME = re.compile(r"^step-(\d+)$")
_PARTIAL = ".partial-"
_DELETING = ".deleting-"


@dataclasses.dataclass
class Checkpoint:
    """A published checkpoint: its directory, its step and (after ``load_latest``) the state
    it was loaded into, or the plain state read from it when no state was given.
    ``skipped``: (directory, reason) of every ``step-<n>`` directory newer than this one
    that ``load_latest`` passed over because it is not a complete checkpoint."""

    path: str
    step: int
    state: Any = None
    skipped: list = dataclasses.field(default_factory=list)


def _name(step: int) -> str:
    return f"step-{step:010d}"


def list_checkpoints(root: str | os.PathLike) -> list[Checkpoint]:
    """Published checkpoints under ``root``, oldest first (by step). Directories left by a
    save that did not finish are not listed."""
    return scan(root)[0]


def scan(root: str | os.PathLike) -> tuple[list[Checkpoint], list[tuple[int, str, str]]]:
    """(published checkpoints by step, ``step-<n>`` directories that are not, with why)."""
    root = os.fspath(root)
    out, bad = [], []
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return [], []
    for n in names:
        m = _NAME.match(n)
        if not m:
            continue
        p = os.path.join(root, n)
        if not os.path.isdir(p):
            bad.append((int(m.group(1)), p, "not a directory"))
            continue
        lacks = [f for f in (MARKER, ".metadata") if not os.path.isfile(os.path.join(p, f))]
        if lacks:
            why = " and ".join({MARKER: f"the completion marker {MARKER}",
                                ".metadata": "DCP's .metadata"}[f] for f in lacks)
            bad.append((int(m.group(1)), p, f"it lacks {why} (an incomplete or damaged save)"))
        else:
            out.append(Checkpoint(p, int(m.group(1))))
    return sorted(out, key=lambda c: c.step), sorted(bad)


def latest_checkpoint(root: str | os.PathLike) -> Checkpoint | None:
    found = list_checkpoints(root)
    return found[-1] if found else None
