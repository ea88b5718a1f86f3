"""Atomic checkpoints: a save is either whole and visible, or invisible.

``dcp.save(state, checkpoint_id=d)`` writes into ``d`` in place, so a crash part-way
leaves ``d`` half old, half new. Here every save goes to a fresh hidden directory under a
root and is published by one rename once every rank has finished::

    root/
      .ragged_fsdp_lock     held by the writer's rank 0 during a save (names it)
      step-0000000100/      published: DCP files + .ragged_fsdp_complete
      step-0000000200/
      .partial-step-0000000300-<token>/   a save in progress, or one that died

Publishing is done by the coordinator (rank 0 of the process group) after ``dcp.save``
returned on every rank (DCP gathers every rank's write results before it writes
``.metadata``, and we add a barrier): it writes a marker into the directory, fsyncs it,
renames the directory to its final name and fsyncs the root. A directory counts as a
checkpoint only if its name is ``step-<n>`` *and* it holds the marker and ``.metadata``, so
``load_latest`` skips anything a dead save left (and says which directory it skipped).

One writer per root: the lock (:mod:`.lock`) makes a second writer fail before it writes or
deletes anything. A failed save removes its own partial directory; leftovers of writers that
died are removed by the next save, once their death is certain (same host, process gone).
Retention (``keep_last``) never deletes the checkpoint just written.
"""

from __future__ import annotations

import json
import numbers
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ragged_fsdp.agreement import agree, first_line

from . import lock
from .errors import CheckpointLockedError, CheckpointSaveError, CheckpointWarning, describe_failures
from .integrity import ChecksummedWriter
from .listing import _DELETING, _PARTIAL, MARKER, Checkpoint, _name, latest_checkpoint, list_checkpoints
from .scale_planner import default_save_planner, planner_error
from .strict import quiet_single_process

__all__ = ["Checkpoint", "save", "list_checkpoints", "latest_checkpoint", "MARKER"]

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
    step that is already published raises ``FileExistsError``. Collective: call on every
    rank of ``process_group`` (default: the world). Returns the published :class:`Checkpoint`.

    Retention: ``keep_last=n`` keeps the checkpoint just written plus the ``n - 1`` others
    with the highest steps and deletes the remaining published ones; the checkpoint just
    written is never deleted, whatever its step.

    One writer per root: rank 0 holds ``root/.ragged_fsdp_lock`` for the whole save; a save
    while another writer holds it raises :class:`CheckpointLockedError` before anything is
    written or deleted (a lock left by a dead process on this host is broken, with a
    warning; see :mod:`ragged_fsdp.checkpoint.lock`).

    Failures (a full disk, a rank that cannot write, a peer that died) raise
    :class:`CheckpointSaveError` (an ``OSError``) on every rank that sees them, naming the
    rank(s) and the underlying error; nothing is published, this save's partial directory
    is removed and the previous checkpoints are untouched.

    ``planner``: a DCP ``SavePlanner``; default :class:`ScaleSavePlanner` (DCP's
    ``DefaultSavePlanner`` with the same plans, files and errors, whose coordinator check
    does not compare every pair of a tensor's chunks; see ``docs/scale.md``). Pass
    ``DefaultSavePlanner()`` (or your own) to use it instead."""
    err = _check_save_args(state, root, step, keep_last) or planner_error("save", planner)
    root = os.path.abspath(os.fspath(root)) if err is None else None
    # compared resolved: a symlink and its target (or two spellings of one directory) are one root
    _agree(err, (step, keep_last), os.path.realpath(root) if root is not None else None, process_group)
    pg = process_group
    rank = _rank(pg)
    world = dist.get_world_size(pg) if _use_dist(pg) else 1
    plan = _prepare(root, step, world) if rank == 0 else None
    plan = _bcast(plan, pg)
    if isinstance(plan, BaseException):
        raise plan
    step_, tmp, final, token, notes = plan
    if rank == 0:
        _warn(notes)
    try:
        with quiet_single_process(not _use_dist(pg)):
            dcp.save(state, storage_writer=ChecksummedWriter(tmp), process_group=pg,
                     planner=default_save_planner() if planner is None else planner,
                     no_dist=not _use_dist(pg))
        if _use_dist(pg):
            dist.barrier(group=pg)  # every rank's files are written and synced
    except BaseException as e:
        consistent = isinstance(e, CheckpointException)  # every rank got it: the group still works
        _abandon(root, tmp, token, rank, pg, consistent)
        if consistent:
            text, ranks = describe_failures(e.failures)
            mine = e.failures.get(rank)
            raise CheckpointSaveError(
                f"ragged_fsdp: saving step {step_} under {root} failed on {text}. Nothing was published "
                "and the partial directory was removed; the previous checkpoints are intact", ranks,
            ) from (mine[0] if isinstance(mine, tuple) else None)
        if isinstance(e, Exception):
            raise CheckpointSaveError(
                f"ragged_fsdp: saving step {step_} under {root} failed on rank {rank}: {type(e).__name__}: "
                f"{first_line(e)}. Nothing was published and this rank removed the partial directory "
                "(if a peer died, the process group is broken: restart the job)", [rank],
            ) from e
        raise  # KeyboardInterrupt, SystemExit: after the cleanup above

    outcome = _publish(root, tmp, final, token, step_, world, keep_last) if rank == 0 else None
    err, notes = _bcast(outcome, pg)
    if rank == 0:
        _warn(notes)
    if err:
        raise CheckpointSaveError(err, [0])
    return Checkpoint(final, step_)


def _warn(notes) -> None:
    for n in notes or ():
        warnings.warn(n, CheckpointWarning, stacklevel=3)



def _prepare(root: str, step: int | None, world: int):
    """Rank 0: take the lock, pick the step, make the partial directory. Returns
    ``(step, tmp, final, token, warnings)`` or the exception every rank raises."""
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        return CheckpointSaveError(f"cannot create the checkpoint root {root}: {e}", [0])
    token = uuid.uuid4().hex[:12]
    record = lock.holder_record(token, None, world)
    try:
        notes = lock.acquire(root, record)
    except CheckpointLockedError as e:
        return e
    except OSError as e:
        return CheckpointSaveError(f"cannot take the lock of checkpoint root {root}: {e}", [0])
    tmp = None
    try:
        last = latest_checkpoint(root)
        step_ = (0 if last is None else last.step + 1) if step is None else int(step)
        final = os.path.join(root, _name(step_))
        if os.path.exists(final):
            lock.release(root, token)
            return FileExistsError(f"checkpoint {final} already exists; pick another step")
        name = f"{_PARTIAL}{_name(step_)}-{token}"
        tmp = os.path.join(root, name)
        os.makedirs(tmp)
        record["partial"] = name
        for path in (os.path.join(tmp, lock.WRITER), os.path.join(root, f"{lock.LOCK}.{token}.upd")):
            with open(path, "w") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
        os.replace(os.path.join(root, f"{lock.LOCK}.{token}.upd"), os.path.join(root, lock.LOCK))
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        lock.release(root, token)
        return CheckpointSaveError(f"cannot prepare a checkpoint under {root}: {e}", [0])
    return step_, tmp, final, token, notes


def _abandon(root: str, tmp: str, token: str, rank: int, pg, collective: bool) -> None:
    """Remove a failed save's partial directory on every rank and drop the lock. After a
    failure every rank saw (``collective``: DCP's, the group still works) rank 0 removes it
    first and the others only what their filesystem still shows (ranks on their own disks);
    otherwise each rank removes what it can, best effort."""
    def barrier():
        try:
            dist.barrier(group=pg)
        except Exception:  # pragma: no cover - a peer died during the cleanup
            pass

    if collective:
        if _use_dist(pg):
            barrier()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if _use_dist(pg):
            barrier()
    if os.path.exists(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
    if rank == 0:
        try:
            lock.release(root, token)
        except OSError:  # pragma: no cover
            pass


def _publish(root: str, tmp: str, final: str, token: str, step_: int, world: int, keep_last):
    """Rank 0: marker, rename, retention; returns ``(error or None, warnings)``."""
    try:
        marker = os.path.join(tmp, MARKER)
        with open(marker, "w") as f:
            # metadata_seal: ChecksummedWriter sealed .metadata, so a missing seal is damage
            json.dump({"step": step_, "world_size": world, "time": time.time(), "metadata_seal": True}, f)
            f.flush()
            os.fsync(f.fileno())
        os.unlink(os.path.join(tmp, lock.WRITER))  # a published checkpoint has no writer
        _fsync_dir(tmp)
        os.rename(tmp, final)
        _fsync_dir(root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        lock.release(root, token)
        return (f"ragged_fsdp: publishing {tmp} as {final} failed on rank 0: {e}. Nothing was published and the "
                "partial directory was removed; the previous checkpoints are intact"), []
    notes: list[str] = []
    try:
        lock.verify(root, token)
        notes += _cleanup(root, keep_last, final)
        newest = latest_checkpoint(root)
        if newest is not None and newest.step > step_:
            notes.append(f"saved step {step_} under {root}, below the newest published step {newest.step}: "
                         f"load_latest loads the highest step, so it will load step {newest.step}, not this "
                         "one (delete the newer checkpoints, or save with a higher step)")
    except OSError as e:  # published: a failed clean-up is reported, not raised
        notes.append(f"checkpoint {final} was published, but cleaning up {root} failed: {e}")
    finally:
        lock.release(root, token)
    return None, notes

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


def _agree(err: str | None, args, root: str | None, pg) -> None:
    """Raise the same error on every rank if any rank's arguments are bad or the ranks
    disagree, before anything is written (a rank that raised alone would leave the others
    waiting in the save's collectives until the process-group timeout). The root is
    compared with symlinks resolved (``os.path.realpath``): rank 0 alone writes the directory and publishes it, so a
    rank naming another root would be handed a checkpoint that is not where it asked."""
    if not _use_dist(pg):
        if err:
            raise ValueError(err)
        return
    everyone = agree("save", (err, args, root), group=pg, same=False)  # one exchange; the messages below
    bad = [(r, e) for r, (e, _, _) in enumerate(everyone) if e]
    if bad:
        ranks = [r for r, _ in bad]
        raise ValueError(f"{bad[0][1]} (on rank(s) {ranks}; nothing was written)")
    if any(a != everyone[0][1] for _, a, _ in everyone):
        raise ValueError(
            "save: ranks passed different (step, keep_last): "
            + ", ".join(f"rank {r}: {a}" for r, (_, a, _) in enumerate(everyone))
            + "; pass the same values on every rank (nothing was written)"
        )
    if any(p != everyone[0][2] for _, _, p in everyone):
        by_root: dict[str, list[int]] = {}
        for r, (_, _, p) in enumerate(everyone):
            by_root.setdefault(p, []).append(r)
        raise ValueError(
            "save: ranks passed different roots: "
            + ", ".join(f"rank(s) {rs}: {p}" for p, rs in by_root.items())
            + "; pass the same root on every rank (one directory that every rank names alike, "
            "on storage all of them reach), e.g. build it from a value rank 0 broadcasts "
            "(nothing was written)"
        )


def _cleanup(root: str, keep_last: int | None, keep: str) -> list[str]:
    """Remove debris of dead saves and, with ``keep_last``, old checkpoints (never ``keep``,
    the one just published). Runs under the lock. A ``.partial-*`` directory goes only when
    the writer its record names is known to be dead; others (a writer on another host, or
    one still running) are kept and reported. A doomed checkpoint is first renamed away, so a
    crash mid-delete never leaves a listed directory with files missing. Returns warnings."""
    notes = []
    doomed, kept = [], []
    for n in sorted(os.listdir(root)):
        if not n.startswith(_PARTIAL):
            continue
        p = os.path.join(root, n)
        rec = lock.read_record(os.path.join(p, lock.WRITER))
        (doomed if lock.writer_gone(rec) else kept).append((p, rec))
    if kept:
        notes.append(f"left {len(kept)} unfinished save(s) under {root} whose writer may still run: "
                     + "; ".join(f"{os.path.basename(p)} by " + (lock.describe(r) if r else "an unknown writer")
                                 for p, r in kept)
                     + ". Remove them by hand once no job writes there")
    doomed = [p for p, _ in doomed]
    if keep_last is not None:  # validated (>= 1) on every rank before the save began
        others = [c for c in list_checkpoints(root) if os.path.abspath(c.path) != os.path.abspath(keep)]
        doomed += [c.path for c in others[:max(0, len(others) - (keep_last - 1))]]
    for p in doomed:
        gone = os.path.join(root, f"{_DELETING}{os.path.basename(p)}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(p, gone)
        except OSError:
            continue
        shutil.rmtree(gone, ignore_errors=True)
    for n in os.listdir(root):
        if n.startswith(_DELETING):  # renamed away by a lock holder: never live data
            shutil.rmtree(os.path.join(root, n), ignore_errors=True)
    return notes
