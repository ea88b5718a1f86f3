"""Checkpoints for RaggedShard models and optimizers.

* ``dcp.save`` / ``dcp.load`` work directly on state dicts holding RaggedDTensors: each
  rank's ragged run is described as a few rectangular boxes (``placement/dcp.py``), so a
  checkpoint saved at one world size and granularity loads at any other, and into a plain
  unsharded model.
* ``get_/set_model_state_dict``, ``get_/set_optimizer_state_dict``, ``get_/set_state_dict``:
  same signatures as ``torch.distributed.checkpoint.state_dict``; torch's own functions
  reject full state dicts for RaggedShard models (``full_state_dict=True`` loading and
  ``broadcast_from_rank0`` go through torch's ``distribute_tensor``), ours do not. torch is
  not patched.
* ``save(state, root)`` / ``load_latest(root, state)``: atomic checkpoints (a save is
  published by a rename once every rank is done; incomplete ones are skipped, with a
  warning), one writer per root (a lock file naming the holder), failures raised as
  ``CheckpointSaveError`` (an ``OSError``) naming the ranks; and ``load``:
  ``dcp.load`` that refuses any key or shape mismatch, in both directions, naming the keys.
* ``dcp_to_torch_save`` / ``torch_save_to_dcp`` (also ``python -m ragged_fsdp ckpt convert``).
* integrity: ``save``/``async_save``/``torch_save_to_dcp`` record a CRC-32 per write item
  as it is written (``ChecksummedWriter``); ``load``/``load_latest``/``read_full`` verify
  every item they read (``ChecksummedReader``) and raise ``CheckpointCorruptError``; the
  writer also seals ``.metadata`` with a SHA-256 that every read checks before using it.
* ``save_local`` / ``load_local``: a save with no coordinator (each rank writes its shard and
  its part of the metadata, a few numbers per tensor whatever W is; the ranks agree through
  all-reduces of a few integers) that loads at any world size, bitwise, checks a CRC-32 per
  stored tensor and refuses parts of two saves; ``ScaleSavePlanner``: DCP's save planner with a coordinator check that stays
  O(n log n) in a tensor's chunks (DCP's own compares every pair for row chunks of wide
  tensors); ``ScaleLoadPlanner``: DCP's load planner, the default of ``load`` /
  ``load_latest`` / ``read_full``, matching each local chunk against a sorted index of a
  tensor's saved runs instead of all of them. See ``docs/scale.md``.
* ``Snapshots``: every K steps each rank's shard in node-local memory plus one peer's copy
  from another node; ``restore()`` after a torchrun elastic restart fetches lost parts from
  the copies and reshards to the new world size (``docs/reliability.md``... see *Surviving
  failures*).
* ``async_save``: ``dcp.async_save`` with a stager that keeps RaggedShard layouts (torch's
  default stager copies through ``new_empty`` and loses them).
"""

from .async_save import async_save
from .errors import CheckpointLockedError, CheckpointSaveError, CheckpointWarning
from .atomic import save
from .listing import Checkpoint, latest_checkpoint, list_checkpoints
from .resume import load_latest
from .integrity import CheckpointCorruptError, ChecksummedReader, ChecksummedWriter, count_checksums
from .convert import dcp_to_torch_save, local_to_torch_save, read_full, resolve, torch_save_to_dcp
from .state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from .strict import CheckpointMismatchError, check_state, load, read_metadata
from .train_state import TrainState
from .local_save import LocalCheckpointCorruptError, LocalCheckpointError, load_local, local_parts, save_local
from .scale_planner import ScaleLoadPlanner, ScaleSavePlanner
from .snapshots import (SnapshotError, SnapshotLostError, SnapshotMismatchError, SnapshotRestoreError, Snapshots,
                        choose_snapshot)

__all__ = [
    "Checkpoint", "CheckpointCorruptError", "CheckpointLockedError", "CheckpointSaveError", "CheckpointWarning", "CheckpointMismatchError", "ChecksummedReader", "ChecksummedWriter",
    "count_checksums", "async_save", "StateDictOptions", "TrainState",
    "check_state", "dcp_to_torch_save", "get_model_state_dict", "get_optimizer_state_dict",
    "get_state_dict", "latest_checkpoint", "list_checkpoints", "load", "load_latest",
    "read_full", "read_metadata", "resolve", "save", "set_model_state_dict",
    "set_optimizer_state_dict", "set_state_dict", "torch_save_to_dcp",
    "LocalCheckpointError", "LocalCheckpointCorruptError", "local_to_torch_save", "load_local", "local_parts", "save_local", "ScaleLoadPlanner", "ScaleSavePlanner",
    "Snapshots", "SnapshotError", "SnapshotLostError", "SnapshotMismatchError", "SnapshotRestoreError", "choose_snapshot",
]
