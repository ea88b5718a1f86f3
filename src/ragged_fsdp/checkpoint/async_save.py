"""``dcp.async_save`` for state dicts holding RaggedDTensors.

torch's default stager (``DefaultStager`` -> ``StateDictStager``) copies every tensor through
``tensor.new_empty([])`` and then re-points the storage; for a DTensor subclass whose
``new_empty`` returns a plain tensor (RaggedDTensor's does) the staged copy silently loses
its layout and the checkpoint holds garbage. ``BlockingAsyncStager`` copies DTensors by their
local tensors instead, which is exact, so this ``async_save`` (same signature as torch's)
uses it unless a stager is given. The upload still runs in the background.
"""

from __future__ import annotations

import os

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager, BlockingAsyncStager

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
    return dcp.async_save(
        state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
        process_group=process_group, async_stager=async_stager, no_dist=no_dist,
        use_collectives=use_collectives, **kwargs,
    )
