"""``load_latest``: resume from the newest published checkpoint under a root."""

from __future__ import annotations

import os
import warnings
from typing import Any

from .atomic import _bcast, _rank
from .convert import read_full
from .errors import CheckpointWarning
from .listing import _PARTIAL, Checkpoint, scan
from .strict import load as _strict_load

__all__ = ["load_latest"]


def load_latest(
    root: str | os.PathLike,
    state: dict[str, Any] | None = None,
    *,
    strict: bool = True,
    missing_ok: bool = False,
    process_group=None,
) -> Checkpoint | None:
    """Load the newest published checkpoint under ``root``.

    With ``state`` (what ``dcp.load`` takes) it is loaded in place, resharded to the
    current layout, after checking that keys and shapes match the checkpoint exactly (both
    ways when ``strict``; see :func:`ragged_fsdp.checkpoint.load`). Without ``state`` every
    rank reads the whole checkpoint as plain tensors (``Checkpoint.state``). Collective when
    ``state`` holds DTensors.

    A ``step-<n>`` directory newer than the one loaded that is not a complete checkpoint
    (no completion marker, no ``.metadata``) is skipped with a :class:`CheckpointWarning`
    naming it and why (on rank 0), and listed in ``Checkpoint.skipped`` on every rank.

    When there is nothing to load (``root`` does not exist, or holds no published
    checkpoint) this raises ``FileNotFoundError`` naming ``root``: a mistyped path must not
    silently restart training. Pass ``missing_ok=True`` to get ``None`` instead (the first
    run of a job that resumes when it can)."""
    root = os.fspath(root)
    if _rank(process_group) == 0:
        try:
            found = _find_latest(root, missing_ok)
        except (OSError, ValueError) as e:
            found = e
    else:
        found = None
    found = _bcast(found, process_group)
    if isinstance(found, Exception):
        raise found
    if found is None:
        return None
    if found.skipped and _rank(process_group) == 0:
        for p, why in found.skipped:
            warnings.warn(f"load_latest: skipped {p}, newer than the step {found.step} it loads: {why}",
                          CheckpointWarning, stacklevel=2)
    if state is None:
        found.state = read_full(found.path)
        return found
    _strict_load(state, found.path, strict=strict, process_group=process_group)
    found.state = state
    return found


def _find_latest(root: str, missing_ok: bool) -> Checkpoint | None:
    hint = "; pass missing_ok=True to start fresh when there is none"
    if not os.path.exists(root):
        if missing_ok:
            return None
        raise FileNotFoundError(f"load_latest: checkpoint root {root} does not exist{hint}")
    if not os.path.isdir(root):
        raise NotADirectoryError(f"load_latest: checkpoint root {root} is a file, not a directory")
    if os.path.isfile(os.path.join(root, ".metadata")):
        raise ValueError(
            f"load_latest: {root} is a checkpoint directory itself, not a root of step-<n> "
            "checkpoints; load it with ragged_fsdp.checkpoint.load(state, path)"
        )
    published, bad = scan(root)
    found = published[-1] if published else None
    skipped = [(p, why) for n, p, why in bad if found is None or n > found.step]
    if found is None and not missing_ok:
        partial = [n for n in os.listdir(root) if n.startswith(_PARTIAL)]
        extra = f" ({len(partial)} unfinished save(s) skipped)" if partial else ""
        extra += "".join(f"; skipped {p}: {why}" for p, why in skipped)
        raise FileNotFoundError(f"load_latest: no published checkpoint under {root}{extra}{hint}")
    if found is not None:
        found.skipped = skipped
    return found
