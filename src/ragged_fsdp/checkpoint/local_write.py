"""Writing a local save: each rank's part (``part_meta``), the agreement before writing
(directory, lock, keys, equal plain values, save id) and after (every rank wrote), the
atomic writes. See :mod:`.local_save` for the design."""

from __future__ import annotations

import os
import uuid
import warnings
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ragged_fsdp.agreement import agree, agree_flags

from . import lock
from .integrity import crc32
from .local_format import (
    _MASK62, FORMAT, HEADER_KEY, LocalCheckpointError, _agree, _existing, _meta_bytes, _names, _ragged, _world_rank,
)
from .local_layout import encode_runs
from .local_tree import _flat

__all__ = ["save_local", "part_meta"]

def part_meta(state_dict: Mapping[str, Any], rank: int, world: int) -> tuple[dict, dict]:
    """``(meta, data)`` this rank writes for a flat state dict, before the ranks compare
    their plain values: pure given the state dict (the bench plans it at W=16,384 with shapes
    only). Plain tensors and values are in ``data`` on every rank here; ``save_local`` keeps
    rank 0's where every rank holds the same."""
    entries, data = {}, {}
    for key, value in state_dict.items():
        if isinstance(value, DTensor):
            pl, mesh_rank = _ragged(key, value, world)
            if mesh_rank != rank:
                raise LocalCheckpointError(f"save_local: {key!r}: this rank is {rank} but its mesh position is {mesh_rank}")
            entries[key] = {"kind": "ragged", "shape": tuple(value.shape), "dtype": str(value.dtype),
                            "dims": tuple(pl.dims), "unit": pl.unit, "runs": encode_runs(pl.local_units)}
            local = value.to_local()
            if local.numel():
                data[key] = local.detach().reshape(-1).cpu().clone()
        elif isinstance(value, torch.Tensor):
            entries[key] = {"kind": "full", "shape": tuple(value.shape), "dtype": str(value.dtype)}
            data[key] = value.detach().cpu().contiguous().clone()
        else:
            entries[key] = {"kind": "object"}
            data[key] = value
    return {"format": FORMAT, "rank": rank, "world": world, "entries": entries}, data


def _digest(value) -> int:
    """62 bits that differ when two ranks' plain values differ (shape, dtype and bytes)."""
    if isinstance(value, torch.Tensor):
        c = crc32(value)
        h = zlib.crc32(repr((tuple(value.shape), str(value.dtype))).encode())
    else:
        try:
            text = repr(value).encode()
        except Exception:  # pragma: no cover - a value whose repr raises: treat as per rank
            return uuid.uuid4().int & _MASK62
        c, h = zlib.crc32(text), len(text)
    return ((h << 32) | c) & _MASK62


def _fingerprint(entries: dict) -> int:
    """Keys, kinds and layouts (not plain values): must be equal on every rank."""
    text = repr(sorted((k, sorted(e.items())) for k, e in entries.items())).encode()
    return int.from_bytes(zlib.crc32(text).to_bytes(4, "little") + zlib.adler32(text).to_bytes(4, "little"),
                          "little") & _MASK62


def _write_atomic(path: str, write) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def save_local(state_dict: Mapping[str, Any], path: str | os.PathLike, *, node_local: bool = False) -> str:
    """Write this rank's part of a checkpoint into directory ``path`` (created if needed; on a
    file system every rank sees). Call on every rank; four all-reduces of a few integers, no
    gather. A directory that already holds any part of a save is refused on every rank
    (nothing written); a write that fails on any rank raises on every rank, and every rank
    removes its own files. Returns the ``.meta`` path written.

    ``node_local=True``: each node saves into its own directory (node-local memory such as
    ``/dev/shm``; the path may differ between nodes), so the ranks' directories are not
    compared; the caller gathers the parts before a load (``checkpoint.Snapshots`` does)."""
    world, rank = _world_rank()
    path = os.fspath(path)
    held = _Held(path)
    try:
        return _save(state_dict, path, world, rank, held, node_local)
    finally:
        held.release()


@dataclass
class _Held:
    """Rank 0's lock on the save's directory (as ``checkpoint.save`` locks its root): a second
    job saving into the same directory is refused instead of silently replacing this save."""

    path: str
    token: str | None = None
    made: bool = False  # rank 0 created the directory: removed again if nothing was saved

    def take(self, world: int) -> None:
        self.made = not os.path.isdir(self.path)
        os.makedirs(self.path, exist_ok=True)
        token = uuid.uuid4().hex
        for note in lock.acquire(self.path, lock.holder_record(token, self.path, world)):
            warnings.warn(note, stacklevel=4)
        self.token = token

    def release(self) -> None:
        if self.token is not None:
            lock.release(self.path, self.token)
            self.token = None
        if self.made:
            try:
                os.rmdir(self.path)  # only if empty: nothing was saved
            except OSError:
                pass


def _check_directory(path: str) -> None:
    if os.path.islink(path) and not os.path.exists(path):
        raise LocalCheckpointError(
            f"save_local: {path} is a symbolic link to {os.readlink(path)!r}, which does not exist; create the "
            "link's target directory first, or pass the directory itself")
    if os.path.exists(path) and not os.path.isdir(path):
        raise LocalCheckpointError(f"save_local: {path} exists and is not a directory")


def _save(state_dict, path: str, world: int, rank: int, held: _Held, node_local: bool = False) -> str:
    err, found, flat, meta, data = None, [], {}, {}, {}
    where = os.path.realpath(path)  # a link and its target are one directory, as for checkpoint.save
    try:
        lists: set = set()
        flat = _flat(state_dict, "save_local", lists)
        meta, data = part_meta({k: v for k, (v, _) in flat.items()}, rank, world)
        for k, (_, p) in flat.items():
            if p != (k,):  # only nested keys: a flat model state dict's .meta stays as small
                meta["entries"][k]["path"] = p
        _check_directory(path)
        found = _existing(path)
    except Exception as e:  # agreed below, so no rank goes on alone
        err = e
    plain = sorted(k for k, e in meta.get("entries", {}).items() if e["kind"] in ("full", "object"))
    fp = _fingerprint(meta["entries"]) if err is None else 0
    dh = _fingerprint({"directory": {"path": "" if node_local else where}})
    save_id = (uuid.uuid4().int & _MASK62) | 1 if rank == 0 else 0
    existing, save_id, hi, neg_lo, n_plain, d_hi, neg_d_lo = _agree(
        err, "save_local", [int(bool(found)), save_id, fp, -fp, len(plain), dh, -dh])
    if d_hi != dh or -neg_d_lo != dh:
        dirs = agree("save_local", where, same=False)  # only now: name each rank's directory
        listing = "; ".join(f"rank {r}: {d}" for r, d in enumerate(dirs))
        raise LocalCheckpointError(
            f"save_local: the ranks passed different directories ({listing}); the parts of one save go into one "
            "directory that every rank sees: pass the same path on every rank. Nothing was written")
    if not existing and hi == fp and -neg_lo == fp and n_plain == len(plain):
        # Only now does anything touch the disk: rank 0 takes the directory's lock (another job
        # saving there is refused) and looks again, so a save that finished meanwhile is seen whole.
        err = None
        try:
            if rank == 0:
                held.take(world)
                found = _existing(path)
        except Exception as e:
            err = e
        (existing,) = _agree(err, "save_local", [int(bool(found))])
    if existing:
        what = (f"{os.path.join(path, found[0])} exists" if found
                else f"{path} exists; another rank saw part files there")
        more = f" ({len(found)} part files)" if len(found) > 1 else ""
        raise LocalCheckpointError(
            f"save_local: {what}; a directory holds one save{more} (parts of two saves would mix), so nothing "
            "was written on any rank. Save each step to a new directory, or remove this one first")
    if hi != fp or -neg_lo != fp or n_plain != len(plain):
        raise LocalCheckpointError(
            "save_local: the ranks' state dicts differ in their keys, kinds (DTensor, tensor, plain value) or "
            "layouts; save the same structure on every rank (nothing was written)")
    # plain values equal on every rank are stored once (rank 0); the others by every rank
    per_rank = set()
    if plain and world > 1:
        d = [_digest(data[k]) for k in plain]
        agreed = agree_flags(d + [-x for x in d])
        per_rank = {k for i, k in enumerate(plain) if agreed[i] != -agreed[len(plain) + i]}
    own: dict = {}
    objects: dict = {}
    for k in plain:
        e = meta["entries"][k]
        if k in per_rank:
            own[k] = {"shape": e.pop("shape", None), "dtype": e.pop("dtype", None)}
            e["kind"] = "rank" if e["kind"] == "full" else "rank_object"
        if e["kind"] in ("object", "rank_object"):
            v = data.pop(k)
            if e["kind"] == "rank_object" or rank == 0:
                objects[k] = v
        elif e["kind"] == "full" and rank != 0:
            del data[k]
    meta.update(save_id=save_id, objects=objects, own=own, lists=sorted(lists, key=repr))
    data[HEADER_KEY] = {"format": FORMAT, "save_id": save_id, "rank": rank, "world": world,
                        "crc32": {k: crc32(t) for k, t in data.items()}}
    pt, mt = (os.path.join(path, n) for n in _names(rank, world))
    wrote, err = [], None
    try:
        os.makedirs(path, exist_ok=True)
        blob = _meta_bytes(meta)
        _write_atomic(pt, lambda f: torch.save(data, f))
        wrote.append(pt)
        _write_atomic(mt, lambda f: f.write(blob))  # last: the part exists once its .meta does
        wrote.append(mt)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # the renames themselves survive a crash
            finally:
                os.close(fd)
        except OSError:  # not every file system lets a directory be fsynced
            pass
    except Exception as e:
        err = e
    try:
        _agree(err, "save_local")
    except BaseException:
        for p in reversed(wrote):  # .meta first: a part never looks complete without its data
            try:
                os.remove(p)
            except OSError:
                pass
        raise
    return mt
