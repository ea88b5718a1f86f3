"""A checkpoint that saves with no collective and still loads at any world size.

    from ragged_fsdp.checkpoint import save_local, load_local

    save_local(model.state_dict(), "ckpt/step-1000")      # every rank, no collective
    load_local(model.state_dict(), "ckpt/step-1000")      # any world size, in place

``dcp.save`` gathers every rank's plan on a coordinator, builds the global metadata and
scatters it back: three collectives and O(W x tensors) objects on one rank. Here each rank
writes two files into the (shared) directory and nothing else:

* ``part-{r}-of-{W}.pt``: its local pieces (``torch.save``; a RaggedShard DTensor as its flat
  local run; plain tensors and plain values only from rank 0, which is where they are read);
* ``part-{r}-of-{W}.meta``: what they are (``torch.save`` of plain Python): per key the
  global shape, dtype and, for RaggedShard values, the layout as runs of equal per-rank
  counts (``local_layout.RunLayout``), a few numbers per tensor whatever W is.

Each file is written to a temporary name and renamed, the ``.meta`` after the ``.pt``, so a
part is either there whole or not at all, and a save counts as complete only when all W
``.meta`` files are there: a save interrupted on any rank never looks complete (``load_local``
names the missing parts). A part that already exists is refused, so two saves can never mix
in one directory: save each step to its own directory.

Loading reads one ``.meta`` (every part describes every RaggedShard layout in full) and then
only the ``.pt`` files of the saved ranks whose pieces overlap what this rank holds, memory
mapped, copying element ranges straight into the local shards. Bitwise: no dtype conversion
(a dtype or shape mismatch is an error naming the key).

Scope: values that are RaggedShard DTensors on a 1-D mesh over every rank (what
``fully_shard`` makes for FSDP), plain tensors (taken as replicated) and plain Python values.
Other DTensors (HSDP, TP, FSDP2's ``Shard(0)``) are refused by name: use
``ragged_fsdp.checkpoint.save`` (DCP) for those.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ragged_fsdp.placement import RaggedDTensor

from .local_layout import RunLayout, encode_runs

__all__ = ["save_local", "load_local", "local_parts", "LocalCheckpointError", "part_meta"]

FORMAT = 1
_PART = re.compile(r"^part-(\d+)-of-(\d+)\.meta$")


class LocalCheckpointError(RuntimeError):
    """A local checkpoint that is incomplete, damaged, or does not fit the state dict."""


def _world_rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _names(r: int, w: int) -> tuple[str, str]:
    return f"part-{r:05d}-of-{w:05d}.pt", f"part-{r:05d}-of-{w:05d}.meta"


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


def part_meta(state_dict: Mapping[str, Any], rank: int, world: int) -> tuple[dict, dict]:
    """``(meta, data)`` this rank writes: pure given the state dict (the bench plans it at
    W=16,384 with shapes only)."""
    entries, data = {}, {}
    for key, value in state_dict.items():
        if isinstance(value, DTensor):
            pl, mesh_rank = _ragged(key, value, world)
            if mesh_rank != rank:
                raise LocalCheckpointError(f"save_local: {key!r}: this rank is {rank} but its mesh position is {mesh_rank}")
            entries[key] = {"kind": "ragged", "shape": tuple(value.shape), "dtype": str(value.dtype),
                            "dims": tuple(pl.dims), "unit": pl.unit, "runs": encode_runs(pl.local_units)}
            local = value._local_tensor
            if local.numel():
                data[key] = local.detach().reshape(-1).cpu().clone()
        elif isinstance(value, torch.Tensor):
            entries[key] = {"kind": "full", "shape": tuple(value.shape), "dtype": str(value.dtype)}
            if rank == 0:
                data[key] = value.detach().cpu().clone()
        else:
            entries[key] = {"kind": "object"}
            if rank == 0:
                data[key] = value
    return {"format": FORMAT, "rank": rank, "world": world, "entries": entries}, data


def _write_atomic(path: str, obj) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def save_local(state_dict: Mapping[str, Any], path: str) -> str:
    """Write this rank's part of a checkpoint into directory ``path`` (created if needed; on a
    file system every rank sees). No collective; returns the ``.meta`` path written."""
    world, rank = _world_rank()
    meta, data = part_meta(state_dict, rank, world)
    os.makedirs(path, exist_ok=True)
    pt, mt = (os.path.join(path, n) for n in _names(rank, world))
    for p in (pt, mt):
        if os.path.exists(p):
            raise LocalCheckpointError(
                f"save_local: {p} exists; a directory holds one save (parts of two saves would mix): "
                "save each step to a new directory")
    _write_atomic(pt, data)
    _write_atomic(mt, meta)  # last: the part exists once its .meta does
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # the renames themselves survive a crash
        finally:
            os.close(fd)
    except OSError:  # not every file system lets a directory be fsynced
        pass
    return mt


def local_parts(path: str) -> int:
    """The saving world size if every part of the local checkpoint in ``path`` is there; else
    raise ``LocalCheckpointError`` naming what is missing."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        raise LocalCheckpointError(f"load_local: no checkpoint directory {path!r}") from None
    found: dict[int, set[int]] = {}
    for n in names:
        m = _PART.match(n)
        if m:
            found.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    if len(found) != 1:
        what = "no parts" if not found else f"parts of saves at world sizes {sorted(found)}"
        raise LocalCheckpointError(f"load_local: {path!r} holds {what}; it is not one complete local save")
    (world, ranks), = found.items()
    missing = sorted(set(range(world)) - ranks)
    if missing:
        raise LocalCheckpointError(
            f"load_local: {path!r} is incomplete: {len(missing)} of {world} parts missing (ranks "
            f"{missing[:10]}{'...' if len(missing) > 10 else ''}); the save was interrupted on those ranks")
    return world


def _target_range(key: str, value) -> tuple[int, int, torch.Tensor]:
    """(flat start, flat end, flat local tensor) this rank fills for ``value``."""
    if isinstance(value, DTensor):
        pl, rank = _ragged(key, value, _world_rank()[0])
        local = value._local_tensor
        if not local.is_contiguous():
            raise LocalCheckpointError(f"load_local: the local tensor of {key!r} is not contiguous")
        a, b = pl.element_range(tuple(value.shape), rank)
        return a, b, local.view(-1)
    if not value.is_contiguous():
        raise LocalCheckpointError(f"load_local: {key!r} is not contiguous; load into a contiguous tensor")
    return 0, value.numel(), value.view(-1)


def load_local(state_dict: dict[str, Any], path: str, strict: bool = True) -> dict[str, Any]:
    """Fill ``state_dict`` in place from the local checkpoint in ``path``, saved at any world
    size. Tensors (RaggedShard DTensors or plain) are copied into; plain values are replaced
    in the dict, which is returned. ``strict``: every key on both sides must match."""
    saved_world = local_parts(path)
    meta = torch.load(os.path.join(path, _names(0, saved_world)[1]), weights_only=True)
    if meta.get("format") != FORMAT or meta.get("world") != saved_world:
        raise LocalCheckpointError(f"load_local: {path!r} part 0 has format {meta.get('format')} / world "
                                   f"{meta.get('world')}; expected format {FORMAT} at world {saved_world}")
    entries = meta["entries"]
    if strict:
        extra, missing = sorted(set(entries) - set(state_dict)), sorted(set(state_dict) - set(entries))
        if extra or missing:
            raise LocalCheckpointError(f"load_local: keys differ: in the checkpoint only {extra[:5]}, in the state "
                                       f"dict only {missing[:5]}; pass strict=False to load the common keys")
    parts: dict[int, dict] = {}

    def part(r: int) -> dict:
        if r not in parts:
            p = os.path.join(path, _names(r, saved_world)[0])
            try:
                parts[r] = torch.load(p, mmap=True, weights_only=True)
            except FileNotFoundError:
                raise LocalCheckpointError(f"load_local: {p} is missing though its .meta exists") from None
        return parts[r]

    for key, value in state_dict.items():
        if key not in entries:
            continue
        e = entries[key]
        if e["kind"] == "object":
            state_dict[key] = part(0)[key]
            continue
        if not isinstance(value, torch.Tensor):
            raise LocalCheckpointError(f"load_local: {key!r} was saved as a tensor but the state dict holds "
                                       f"{type(value).__name__}")
        if tuple(value.shape) != tuple(e["shape"]) or str(value.dtype) != e["dtype"]:
            raise LocalCheckpointError(
                f"load_local: {key!r} was saved with shape {tuple(e['shape'])} {e['dtype']}, the state dict "
                f"has {tuple(value.shape)} {value.dtype}; convert the model (or the checkpoint) first")
        a, b, flat = _target_range(key, value)
        with torch.no_grad():
            if e["kind"] == "full":
                flat.copy_(part(0)[key].reshape(-1)[a:b])
                continue
            layout = RunLayout(tuple(e["shape"]), tuple(e["dims"]), e["unit"], tuple(map(tuple, e["runs"])))
            layout.check()
            for pc in layout.pieces(a, b):
                src = part(pc.rank)[key]
                flat[pc.dst_lo:pc.dst_lo + pc.src_hi - pc.src_lo].copy_(src[pc.src_lo:pc.src_hi])
    return state_dict
