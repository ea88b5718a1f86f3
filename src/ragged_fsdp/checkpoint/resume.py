"""``load_latest``: resume from the newest published checkpoint under a root."""

from __future__ import annotations

import os
import warnings
from typing import Any

from .atomic import _bcast, _rank, _use_dist
from .convert import read_full
from .errors import CheckpointWarning
from .listing import _PARTIAL, Checkpoint, scan
from .scale_planner import load_planner_error
from .strict import load as _strict_load

__all__ = ["load_latest"]

_ATTEMPTS = 5  # listings tried when the chosen checkpoint keeps vanishing mid-read


def load_latest(
    root: str | os.PathLike,
    state: dict[str, Any] | None = None,
    *,
    strict: bool = True,
    missing_ok: bool = False,
    process_group=None,
    planner=None,
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
    run of a job that resumes when it can).

    A reader may run while another job saves with ``keep_last``: retention renames a
    checkpoint out of the listing before deleting it, and a checkpoint that vanishes while
    it is read is retried from a fresh listing (single process, ``state`` None or
    ``strict``; up to 5 listings). Otherwise that case raises ``FileNotFoundError`` saying
    so; never an error from inside DCP.

    ``planner``: a DCP ``LoadPlanner`` for loading into ``state``; default
    :class:`ScaleLoadPlanner` (see :func:`ragged_fsdp.checkpoint.load`)."""
    err = load_planner_error("load_latest", planner)
    if err:
        raise ValueError(err)
    root = os.fspath(root)
    for _ in range(_ATTEMPTS):
        found = _locate(root, missing_ok, process_group)
        if found is None:
            return None
        try:
            if state is None:
                found.state = read_full(found.path)
            else:
                _strict_load(state, found.path, strict=strict, process_group=process_group, planner=planner)
                found.state = state
            return found
        except Exception as e:
            if os.path.isdir(found.path):
                raise
            # Retention of a concurrent save renamed it away (atomically: the listing never
            # shows a half-deleted checkpoint) after it was chosen; what the state holds now
            # is partly from it. A single process lists again and reloads the newer one, which
            # overwrites every entry only when strict (strict=False may skip some). Ranks of a
            # group would each have to agree to retry, which needs a collective that the
            # failed ranks may not all reach, so they raise instead.
            vanished = e
            if _use_dist(process_group) or (state is not None and not strict):
                raise FileNotFoundError(
                    f"load_latest: {found.path} was removed while it was being read (a concurrent save's "
                    f"keep_last retention, or by hand); the state is partly loaded from it. Call "
                    f"load_latest again: it loads the newest checkpoint under {root}") from e
    raise FileNotFoundError(
        f"load_latest: the newest checkpoint under {root} was removed while it was being read "
        f"{_ATTEMPTS} times in a row (saves with keep_last delete checkpoints faster than this reader "
        f"loads them; save with a higher keep_last); the state is partly loaded: load again") from vanished


def _locate(root: str, missing_ok: bool, process_group) -> Checkpoint | None:
    """Rank 0's choice of checkpoint, on every rank, with its skipped-step warnings."""
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
    if found is not None and found.skipped and _rank(process_group) == 0:
        for p, why in found.skipped:
            warnings.warn(f"load_latest: skipped {p}, newer than the step {found.step} it loads: {why}",
                          CheckpointWarning, stacklevel=3)
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
    for _ in range(_ATTEMPTS):
        published, bad = scan(root)
        # a concurrent save can publish step n+1 just after the directory was listed and
        # retire step n before it was looked at: nothing seen published, an entry gone. List again.
        if published or all(os.path.lexists(p) for _, p, _ in bad):
            break
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
