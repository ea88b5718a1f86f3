"""``dcp.async_save`` for state dicts holding RaggedDTensors.

torch's default stager (``DefaultStager`` -> ``StateDictStager``) copies every tensor through
``tensor.new_empty([])`` and then re-points the storage; for a DTensor subclass whose
``new_empty`` returns a plain tensor (RaggedDTensor's does) the staged copy silently loses
its layout and the checkpoint holds garbage. ``BlockingAsyncStager`` copies DTensors by their
local tensors instead, which is exact, so this ``async_save`` (same signature as torch's)
uses it unless a stager is given. The upload still runs in the background.

A failed upload makes the returned future raise :class:`CheckpointSaveError` (an ``OSError``,
naming the rank(s) and the error underneath) instead of DCP's ``CheckpointException`` (a
``BaseException`` holding every rank's traceback), and removes ``checkpoint_id`` if this
call created it. ``async_save`` writes in place, not atomically: for checkpoints that are
either whole or invisible use :func:`ragged_fsdp.checkpoint.save`.

One save per target at a time, per process: while a future of this process still writes a
directory, another ``async_save`` there raises :class:`CheckpointLockedError` before it
writes anything. Writing in place, two overlapping saves can only mix their files, and the
failing one's clean-up would delete the other's; ordering them instead would hide a wait the
caller did not ask for behind a call meant not to block. The check is local, with no
collective: the previous save's upload may still run collectives on the same process group
in its thread, and a second collective from here could interleave with them. Two processes
on one target are not detected (each rank writes its own files; use ``save``, whose lock
covers the root, or one ``checkpoint_id`` per save).
"""

from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import Future

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager, BlockingAsyncStager

from .errors import CheckpointLockedError, CheckpointSaveError, describe_failures
from .integrity import ChecksummedWriter
from .scale_planner import default_save_planner, planner_error

__all__ = ["async_save"]

_busy: set[str] = set()  # targets this process is writing (real paths)
_busy_lock = threading.Lock()


def async_save(
    state_dict,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_writer=None,
    planner=None,
    process_group=None,
    async_checkpointer_type=None,
    async_stager: AsyncStager | None = None,
    no_dist: bool = False,
    use_collectives: bool = True,
):
    """As ``torch.distributed.checkpoint.async_save``; returns its future. With a
    ``checkpoint_id`` and no ``storage_writer``, items are written with CRC-32 checksums
    (:class:`~ragged_fsdp.checkpoint.integrity.ChecksummedWriter`). ``planner``: default
    :class:`~ragged_fsdp.checkpoint.ScaleSavePlanner` (DCP's default plans and files, a
    coordinator check that scales); pass ``DefaultSavePlanner()`` or your own instead."""
    err = planner_error("async_save", planner)
    if err:
        raise TypeError(err)
    if planner is None:
        planner = default_save_planner()
    if storage_writer is None and checkpoint_id is not None:
        storage_writer = ChecksummedWriter(checkpoint_id)
    if async_stager is None and not isinstance(storage_writer, AsyncStager):
        async_stager = BlockingAsyncStager()
    kwargs = {}
    if async_checkpointer_type is not None:
        kwargs["async_checkpointer_type"] = async_checkpointer_type
    target = checkpoint_id if checkpoint_id is not None else getattr(storage_writer, "path", None)
    where = os.fspath(target) if target is not None else "the storage writer's path"
    key = _claim(target, where)
    fresh = False
    try:
        # only a local filesystem writer's target is a directory of this machine to create
        fresh = _create(checkpoint_id) if isinstance(storage_writer, dcp.FileSystemWriter) else False
        out = dcp.async_save(
            state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
            process_group=process_group, async_stager=async_stager, no_dist=no_dist,
            use_collectives=use_collectives, **kwargs,
        )
    except BaseException:
        if fresh:
            shutil.rmtree(where, ignore_errors=True)
        _unclaim(key)
        raise
    rank = dist.get_rank(process_group) if dist.is_available() and dist.is_initialized() and not no_dist else 0
    if isinstance(out, Future):
        return _translated(out, rank, where, fresh, key)
    if hasattr(out, "upload_completion"):  # AsyncSaveResponse (zero-overhead staging)
        out.upload_completion = _translated(out.upload_completion, rank, where, fresh, key)
    else:  # pragma: no cover - a return type this module does not know: no future to wait on
        _unclaim(key)
    return out


def _claim(target, where: str) -> str | None:
    """Mark ``target`` as being written by this process, or refuse: see the module notes."""
    if target is None:
        return None
    key = os.path.realpath(os.fspath(target))
    with _busy_lock:
        if key in _busy:
            raise CheckpointLockedError(
                f"async_save: {key} is still being written by an earlier async_save of this process; wait "
                "for the first future (future.result()) before saving there again, or give this save another "
                "checkpoint_id. Nothing was written or deleted")
        _busy.add(key)
    return key


def _unclaim(key: str | None) -> None:
    if key is not None:
        with _busy_lock:
            _busy.discard(key)


def _create(checkpoint_id) -> bool:
    """Create ``checkpoint_id`` if it does not exist; True only when this call made it (an
    exclusive mkdir, so a directory that appeared meanwhile is never counted as ours)."""
    if checkpoint_id is None:
        return False
    try:
        os.makedirs(os.path.dirname(os.path.abspath(os.fspath(checkpoint_id))), exist_ok=True)
        os.mkdir(checkpoint_id)
    except FileExistsError:
        return False
    return True


def _translated(fut: Future, rank: int, where: str, fresh: bool, key: str | None) -> Future:
    """A future with ``fut``'s result, or a :class:`CheckpointSaveError` for its failure.
    The target is released before the caller can see the outcome, so a save started right
    after ``result()`` returns is accepted."""
    res: Future = Future()

    def done(f: Future) -> None:
        exc = f.exception()
        if exc is None:
            _unclaim(key)
            res.set_result(f.result())
            return
        if fresh and os.path.isdir(where):  # this call created it, and refused other saves of this process there
            shutil.rmtree(where, ignore_errors=True)
        _unclaim(key)
        if isinstance(exc, CheckpointException):
            text, ranks = describe_failures(exc.failures)
            err = CheckpointSaveError(f"ragged_fsdp: async_save to {where} failed on {text}"
                                      + ("; the directory was removed" if fresh else ""), ranks)
            mine = exc.failures.get(rank)
            err.__cause__ = mine[0] if isinstance(mine, tuple) else None
        elif isinstance(exc, Exception):
            err = CheckpointSaveError(f"ragged_fsdp: async_save to {where} failed on rank {rank}: "
                                      f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
                                      [rank])
            err.__cause__ = exc
        else:
            err = exc
        res.set_exception(err)

    fut.add_done_callback(done)
    return res
