"""The local save's format and its shared pieces: file names, the part and ``.meta``
headers, the errors, which values it takes, and the one agreement every save and load ends
its phases with (``ragged_fsdp.agreement``). See :mod:`.local_save` for the whole design."""

from __future__ import annotations

import io
import os
import re

import torch
import torch.distributed as dist

from ragged_fsdp.agreement import agree, agree_flags
from ragged_fsdp.placement import RaggedDTensor

from .integrity import CheckpointCorruptError, crc32

__all__ = ["FORMAT", "HEADER_KEY", "LocalCheckpointError", "LocalCheckpointCorruptError"]

FORMAT = 2
_PART = re.compile(r"^part-(\d+)-of-(\d+)\.meta$")
_ANY_PART = re.compile(r"^part-(\d+)-of-(\d+)\.(pt|meta)$")
HEADER_KEY = "__ragged_fsdp_local__"  # the .pt's own header; refused as a state-dict key
_META_HEAD = re.compile(rb"ragged_fsdp local meta v(\d+) crc32=([0-9a-f]{8}) bytes=(\d+)\n")
_MASK62 = (1 << 62) - 1


class LocalCheckpointError(RuntimeError):
    """A local checkpoint that is incomplete, damaged, mixed, or does not fit the state dict."""


class LocalCheckpointCorruptError(LocalCheckpointError, CheckpointCorruptError):
    """A local checkpoint's bytes are not what was written (damaged, truncated, edited);
    also a :class:`CheckpointCorruptError`, as the DCP path raises."""


def _world_rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _names(r: int, w: int) -> tuple[str, str]:
    return f"part-{r:05d}-of-{w:05d}.pt", f"part-{r:05d}-of-{w:05d}.meta"


def _existing(path: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(path) if _ANY_PART.match(n))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _meta_bytes(meta: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(meta, buf)
    payload = buf.getvalue()
    return b"ragged_fsdp local meta v%d crc32=%08x bytes=%d\n" % (FORMAT, crc32(payload), len(payload)) + payload


def _ragged(key: str, value, world: int):
    """(RaggedShard placement, mesh-local rank) of a saveable DTensor value, or an error."""
    spec = value._spec
    mesh = value.device_mesh
    if not isinstance(value, RaggedDTensor) or mesh.ndim != 1 or mesh.size() != world:
        raise LocalCheckpointError(
            f"save_local: {key!r} is a DTensor with placements {tuple(spec.placements)} on a mesh of shape "
            f"{tuple(mesh.shape)}; the local save takes RaggedShard DTensors on a 1-D mesh over all {world} "
            "ranks (fully_shard's FSDP layout). Save this state with ragged_fsdp.checkpoint.save (DCP)")
    if mesh.mesh.flatten().tolist() != list(range(world)):
        raise LocalCheckpointError(
            f"save_local: the mesh of {key!r} lists ranks {mesh.mesh.flatten().tolist()[:8]}...; the local "
            "save numbers parts by mesh position and needs the mesh to list ranks 0..W-1 in order")
    return spec.placements[0], mesh.get_local_rank(0)


# -- agreement --------------------------------------------------------------------------------
def _agree(err: BaseException | None, what: str, values: list[int] = ()) -> list[int]:
    """One MAX all-reduce of ``[failed] + values`` (``agreement.agree_flags``). If any rank
    failed, every rank raises: its own error, or the lowest failing rank's message (one
    gather, only then). Raising alone would leave the other ranks waiting at their next
    collective."""
    world, rank = _world_rank()
    if world == 1:
        if err is not None:
            raise err
        return list(values)
    out = agree_flags([world - rank if err is not None else 0] + list(values))
    if out[0] == 0:
        return out[1:]
    src = world - out[0]
    said = agree(what, (type(err), str(err)) if err is not None else None, same=False)
    if err is not None:
        raise err
    kind, text = said[src]
    if not (isinstance(kind, type) and issubclass(kind, LocalCheckpointError)):
        kind = LocalCheckpointError
    raise kind(f"{what} failed on rank {src}, so on every rank: {text}")
