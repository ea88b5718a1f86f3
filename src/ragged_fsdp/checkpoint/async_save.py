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
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import Future

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager, BlockingAsyncStager

from .errors import CheckpointSaveError, describe_failures
from .integrity import ChecksummedWriter

__all__ = ["async_save"]


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
    (:class:`~ragged_fsdp.checkpoint.integrity.ChecksummedWriter`)."""
    if storage_writer is None and checkpoint_id is not None:
        storage_writer = ChecksummedWriter(checkpoint_id)
    if async_stager is None and not isinstance(storage_writer, AsyncStager):
        async_stager = BlockingAsyncStager()
    kwargs = {}
    if async_checkpointer_type is not None:
        kwargs["async_checkpointer_type"] = async_checkpointer_type
    fresh = checkpoint_id is not None and not os.path.exists(checkpoint_id)
    out = dcp.async_save(
        state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
        process_group=process_group, async_stager=async_stager, no_dist=no_dist,
        use_collectives=use_collectives, **kwargs,
    )
    rank = dist.get_rank(process_group) if dist.is_available() and dist.is_initialized() and not no_dist else 0
    where = os.fspath(checkpoint_id) if checkpoint_id is not None else "the storage writer's path"
    if isinstance(out, Future):
        return _translated(out, rank, where, fresh)
    if hasattr(out, "upload_completion"):  # AsyncSaveResponse (zero-overhead staging)
        out.upload_completion = _translated(out.upload_completion, rank, where, fresh)
    return out


def _translated(fut: Future, rank: int, where: str, fresh: bool) -> Future:
    """A future with ``fut``'s result, or a :class:`CheckpointSaveError` for its failure."""
    res: Future = Future()

    def done(f: Future) -> None:
        exc = f.exception()
        if exc is None:
            res.set_result(f.result())
            return
        if fresh and where and os.path.isdir(where):  # what this call created, on every rank
            shutil.rmtree(where, ignore_errors=True)
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
