"""Atomic checkpoints: a save is either whole and visible, or invisible.

``dcp.save(state, checkpoint_id=d)`` writes into ``d`` in place, so a crash part-way
leaves ``d`` half old, half new. Here every save goes to a fresh hidden directory under a
root and is published by one rename once every rank has finished::

    root/
      step-0000000100/      published: DCP files + .ragged_fsdp_complete
      step-0000000200/
      .partial-step-0000000300-<token>/   a save in progress, or one that died

Publishing is done by the coordinator (rank 0 of the process group) after ``dcp.save``
returned on every rank (DCP gathers every rank's write results before it writes
``.metadata``, and we add a barrier): it writes a marker into the directory, fsyncs it,
renames the directory to its final name and fsyncs the root. A directory counts as a
checkpoint only if its name is ``step-<n>`` *and* it holds the marker, so
``load_latest`` skips anything a dead save left. The next successful save deletes those
leftovers. One writer per root at a time.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .integrity import ChecksummedWriter
from .strict import load as _strict_load
from .strict import quiet_single_process

__all__ = ["Checkpoint", "save", "load_latest", "list_checkpoints", "latest_checkpoint", "MARKER"]

MARKER = ".ragged_fsdp_complete"
_NAME = re.compile(r"^step-(\d+)$")
_PARTIAL = ".partial-"
_DELETING = ".deleting-"


@dataclasses.dataclass
class Checkpoint:
    """A published checkpoint: its directory, its step and (after ``load_latest``) the state
    it was loaded into, or the plain state read from it when no state was given."""

    path: str
    step: int
    state: Any = None


def _use_dist(process_group) -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank(pg) -> int:
    return dist.get_rank(pg) if _use_dist(pg) else 0


def _bcast(obj, pg):
    """Rank 0's ``obj`` on every rank of ``pg``."""
    if not _use_dist(pg):
        return obj
    box = [obj]
    src = dist.get_global_rank(pg, 0) if pg is not None else 0
    dist.broadcast_object_list(box, src=src, group=pg)
    return box[0]


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _name(step: int) -> str:
    return f"step-{step:010d}"


def list_checkpoints(root: str | os.PathLike) -> list[Checkpoint]:
    """Published checkpoints under ``root``, oldest first (by step). Directories left by a
    save that did not finish are not listed."""
    root = os.fspath(root)
    out = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    for n in names:
        m = _NAME.match(n)
        p = os.path.join(root, n)
        if m and os.path.isfile(os.path.join(p, MARKER)) and os.path.isfile(os.path.join(p, ".metadata")):
            out.append(Checkpoint(p, int(m.group(1))))
    return sorted(out, key=lambda c: c.step)


def latest_checkpoint(root: str | os.PathLike) -> Checkpoint | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def save(
    state: dict[str, Any],
    root: str | os.PathLike,
    *,
    step: int | None = None,
    keep_last: int | None = None,
    process_group=None,
    planner=None,
) -> Checkpoint:
    """Save ``state`` (what ``dcp.save`` takes: nested dicts of tensors/DTensors and Stateful
    objects) as a new checkpoint under ``root`` and publish it once every rank is done.

    ``step`` names it (default: one more than the newest published step, or 0). Saving a
    step that is already published raises ``FileExistsError``. ``keep_last=n`` deletes all
    but the newest ``n`` published checkpoints afterwards. Collective: call on every rank of
    ``process_group`` (default: the world). Returns the published :class:`Checkpoint`."""
    _agree(_check_save_args(state, root, step, keep_last), (step, keep_last), process_group)
    root = os.path.abspath(os.fspath(root))
    rank0 = _rank(process_group) == 0
    plan = None
    if rank0:
        try:
            os.makedirs(root, exist_ok=True)
            if step is None:
                last = latest_checkpoint(root)
                step_ = 0 if last is None else last.step + 1
            else:
                step_ = int(step)
            final = os.path.join(root, _name(step_))
            if os.path.exists(final):
                plan = FileExistsError(f"checkpoint {final} already exists; pick another step")
            else:
                tmp = os.path.join(root, f"{_PARTIAL}{_name(step_)}-{uuid.uuid4().hex[:8]}")
                os.makedirs(tmp)
                plan = (step_, tmp, final)
        except OSError as e:
            plan = OSError(f"cannot prepare a checkpoint under {root}: {e}")
    plan = _bcast(plan, process_group)
    if isinstance(plan, Exception):
        raise plan
    step_, tmp, final = plan

    with quiet_single_process(not _use_dist(process_group)):
        dcp.save(state, storage_writer=ChecksummedWriter(tmp), process_group=process_group, planner=planner,
                 no_dist=not _use_dist(process_group))
    if _use_dist(process_group):
        dist.barrier(group=process_group)  # every rank's files are written and synced

    err = None
    if rank0:
        try:
            world = dist.get_world_size(process_group) if _use_dist(process_group) else 1
            marker = os.path.join(tmp, MARKER)
            with open(marker, "w") as f:
                json.dump({"step": step_, "world_size": world, "time": time.time()}, f)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            os.rename(tmp, final)
            _fsync_dir(root)
            _cleanup(root, keep_last)
        except OSError as e:
            err = f"publishing {tmp} as {final} failed: {e}"
    err = _bcast(err, process_group)
    if err:
        raise OSError(err)
    return Checkpoint(final, step_)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_save_args(state, root, step, keep_last) -> str | None:
    """Why ``save`` cannot run with these arguments, or None (pure; runs on every rank)."""
    if not isinstance(state, Mapping):
        return f"save: state must be a dict (what dcp.save takes), got {type(state).__name__}"
    if not isinstance(root, (str, os.PathLike)) or not os.fspath(root):
        return f"save: root must be a directory path, got {root!r}"
    if step is not None:
        if not _is_int(step):
            return f"save: step={step!r} must be an integer (it names the directory step-<n>)"
        if step < 0:
            return (f"save: step={step} is negative; checkpoints are named step-<n> with n >= 0, "
                    "so list_checkpoints/load_latest would never find it")
    if keep_last is not None:
        if not _is_int(keep_last):
            return f"save: keep_last={keep_last!r} must be an integer >= 1 or None"
        if keep_last < 1:
            return (f"save: keep_last={keep_last} would delete the checkpoint being written; "
                    "pass keep_last >= 1, or None to keep every checkpoint")
    return None


def _agree(err: str | None, args, pg) -> None:
    """Raise the same error on every rank if any rank's arguments are bad or the ranks
    disagree, before anything is written (a rank that raised alone would leave the others
    waiting in the save's collectives until the process-group timeout)."""
    if not _use_dist(pg):
        if err:
            raise ValueError(err)
        return
    everyone = [None] * dist.get_world_size(pg)
    dist.all_gather_object(everyone, (err, args), group=pg)
    bad = [(r, e) for r, (e, _) in enumerate(everyone) if e]
    if bad:
        ranks = [r for r, _ in bad]
        raise ValueError(f"{bad[0][1]} (on rank(s) {ranks}; nothing was written)")
    if any(a != everyone[0][1] for _, a in everyone):
        raise ValueError(
            "save: ranks passed different (step, keep_last): "
            + ", ".join(f"rank {r}: {a}" for r, (_, a) in enumerate(everyone))
            + "; pass the same values on every rank (nothing was written)"
        )


def _cleanup(root: str, keep_last: int | None) -> None:
    """Remove leftovers of dead saves and, with ``keep_last``, old checkpoints. A doomed
    checkpoint is first renamed away, so a crash mid-delete never leaves a listed
    directory with files missing."""
    doomed = [os.path.join(root, n) for n in os.listdir(root) if n.startswith(_PARTIAL)]
    if keep_last is not None:  # validated (>= 1) on every rank before the save began
        doomed += [c.path for c in list_checkpoints(root)[:-keep_last]]
    for p in doomed:
        gone = os.path.join(root, f"{_DELETING}{os.path.basename(p)}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(p, gone)
        except OSError:
            continue
        shutil.rmtree(gone, ignore_errors=True)
    for n in os.listdir(root):
        if n.startswith(_DELETING):
            shutil.rmtree(os.path.join(root, n), ignore_errors=True)


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
    if state is None:
        from .convert import read_full

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
    found = latest_checkpoint(root)
    if found is None and not missing_ok:
        partial = [n for n in os.listdir(root) if n.startswith(_PARTIAL)]
        extra = f" ({len(partial)} unfinished save(s) skipped)" if partial else ""
        raise FileNotFoundError(f"load_latest: no published checkpoint under {root}{extra}{hint}")
    return found
