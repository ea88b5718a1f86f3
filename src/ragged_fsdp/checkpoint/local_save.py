"""A checkpoint that saves with no coordinator and still loads at any world size.

    from ragged_fsdp.checkpoint import save_local, load_local

    save_local(model.state_dict(), "ckpt/step-1000")      # every rank
    load_local(model.state_dict(), "ckpt/step-1000")      # any world size, in place

``dcp.save`` gathers every rank's plan on a coordinator, builds the global metadata and
scatters it back: O(W x tensors) objects on one rank. Here each rank writes two files into
the (shared) directory, and the ranks exchange only a few integers (all-reduces, below):

* ``part-{r}-of-{W}.pt``: its local pieces (``torch.save``; a RaggedShard DTensor as its flat
  local run; a plain tensor only from rank 0 when it is equal on every rank, from every rank
  when it is not), plus a header: the save id, rank, W and a CRC-32 per stored tensor;
* ``part-{r}-of-{W}.meta``: what they are: per key the global shape, dtype and, for
  RaggedShard values, the layout as runs of equal per-rank counts (``local_layout.RunLayout``),
  a few numbers per tensor whatever W is; the plain Python values; the save id. It is
  ``torch.save`` bytes behind one header line carrying their length and CRC-32, so a
  truncated, edited or foreign ``.meta`` is refused before it is unpickled.

Nested state (``{"model": model.state_dict(), "optim": opt.state_dict()}``) is flattened into
DCP's dotted keys (``optim.state.0.exp_avg``), so every DTensor inside it is stored by the
rank that holds it.

Agreement. A save costs three all-reduces of a few int64s (no gather, nothing O(W) on any
rank; ``ragged_fsdp.agreement``): before writing, the ranks agree that every rank could
prepare its part, that they name one directory (resolved; a different one per rank is refused
on every rank), that the directory holds no part of another save (if any rank sees one, every
rank refuses: two saves never mix and nothing is overwritten; rank 0 holds the directory's
lock, as ``checkpoint.save`` holds its root's, from before it looks until every rank wrote, so
a second job saving there is refused too), on the keys, on which plain values are equal on every
rank, and on a random save id from rank 0; after writing, that every rank wrote its part (if
one failed, every rank removes its own files and raises). A load costs one all-reduce: every
rank first checks what it will read (the ``.meta`` headers, the save id in every part it reads
and in every ``.meta`` assigned to it, the CRC-32 of every stored tensor it reads from) and
only if every rank found everything sound does any rank copy anything; otherwise every rank
raises the first failing rank's error, naming the file and the saved rank.

Each file is written to a temporary name and renamed, the ``.meta`` after the ``.pt``, so a
part is either there whole or not at all, and a save counts as complete only when all W
``.meta`` files are there: a save interrupted on any rank never looks complete (``load_local``
names the missing parts).

Loading reads one ``.meta`` in full (every part describes every RaggedShard layout) and then
only the ``.pt`` files of the saved ranks whose pieces overlap what this rank holds, memory
mapped, copying element ranges straight into the local shards. Bitwise: no dtype conversion
(a dtype or shape mismatch is an error naming the key). A stored tensor is checked whole, so
a rank that needs part of a saved rank's piece reads all of it (as DCP's reader does).

Scope: values that are RaggedShard DTensors on a 1-D mesh over every rank (what
``fully_shard`` makes for FSDP), plain tensors and plain Python values, nested in dicts and
lists. Other DTensors (HSDP, TP, FSDP2's ``Shard(0)``) are refused by name: use
``ragged_fsdp.checkpoint.save`` (DCP) for those. Plain values that differ per rank load only
at the saving world size.
"""

from __future__ import annotations

import io
import os
import re
import uuid
import warnings
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ragged_fsdp.agreement import agree, agree_flags, first_line
from ragged_fsdp.placement import RaggedDTensor

from . import lock
from ._tree import flatten
from .integrity import CheckpointCorruptError, check_crc32, crc32
from .local_layout import RunLayout, encode_runs

__all__ = ["save_local", "load_local", "local_parts", "LocalCheckpointError", "LocalCheckpointCorruptError",
           "part_meta", "is_local_save", "describe_local", "read_local_full"]

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


# -- the state dict, flattened as DCP flattens it ---------------------------------------------
def _flat(state_dict, who: str, lists: set | None = None) -> dict[str, tuple[Any, tuple]]:
    """``{dotted key: (value, object path with the original key types)}``; ``lists``
    collects the paths of the lists walked (so a reader can rebuild lists, not dicts)."""
    if not isinstance(state_dict, Mapping):
        raise LocalCheckpointError(f"{who}: state_dict must be a dict (nested dicts and lists are fine), got "
                                   f"{type(state_dict).__name__}")
    try:
        flat, mapping = flatten(dict(state_dict))
    except ValueError as e:  # DCP: "duplicated flatten key"
        raise LocalCheckpointError(f"{who}: {e}: two paths of the state dict flatten to one dotted key") from None
    out = {}
    for key, value in flat.items():
        if key == HEADER_KEY:
            raise LocalCheckpointError(f"{who}: the key {HEADER_KEY!r} is reserved for the part header; rename it")
        if not isinstance(value, torch.Tensor) and _holds_tensor(value):
            raise LocalCheckpointError(
                f"{who}: {key!r} is a {type(value).__name__} holding tensors; the local save walks dicts and "
                "lists (as DCP does) and stores other containers whole from one rank: use a list or a dict")
        out[key] = (value, _original_path(state_dict, mapping[key], lists))
    return out


def _holds_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_tensor(v) for v in value)
    return False


def _original_path(root, path: tuple, lists: set | None = None) -> tuple:
    """DCP's object path with each dict key as the dict has it (``0``, not ``"0"``)."""
    out, obj = [], root
    for p in path:
        if isinstance(obj, Mapping):
            k = p if p in obj else next(k for k in obj if str(k) == str(p))
        else:
            k = int(p)
            if lists is not None:
                lists.add(tuple(out))
        out.append(k if isinstance(k, (int, str)) and not isinstance(k, bool) else str(k))
        obj = obj[k]
    return tuple(out)


def _container(root, path: tuple):
    obj = root
    for p in path[:-1]:
        obj = obj[p]
    return obj, path[-1]


# -- save ------------------------------------------------------------------------------------
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


def _existing(path: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(path) if _ANY_PART.match(n))
    except (FileNotFoundError, NotADirectoryError):
        return []


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


def _meta_bytes(meta: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(meta, buf)
    payload = buf.getvalue()
    return b"ragged_fsdp local meta v%d crc32=%08x bytes=%d\n" % (FORMAT, crc32(payload), len(payload)) + payload


def save_local(state_dict: Mapping[str, Any], path: str | os.PathLike) -> str:
    """Write this rank's part of a checkpoint into directory ``path`` (created if needed; on a
    file system every rank sees). Call on every rank; three all-reduces of a few integers, no
    gather. A directory that already holds any part of a save is refused on every rank
    (nothing written); a write that fails on any rank raises on every rank, and every rank
    removes its own files. Returns the ``.meta`` path written."""
    world, rank = _world_rank()
    path = os.fspath(path)
    held = _Held(path)
    try:
        return _save(state_dict, path, world, rank, held)
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


def _save(state_dict, path: str, world: int, rank: int, held: _Held) -> str:
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
        if rank == 0:  # before looking for parts: a save that finished before it is seen whole
            held.take(world)
        found = _existing(path)
    except Exception as e:  # agreed below, so no rank goes on alone
        err = e
    plain = sorted(k for k, e in meta.get("entries", {}).items() if e["kind"] in ("full", "object"))
    fp = _fingerprint(meta["entries"]) if err is None else 0
    dh = _fingerprint({"directory": {"path": where}})
    save_id = (uuid.uuid4().int & _MASK62) | 1 if rank == 0 else 0
    existing, save_id, hi, neg_lo, n_plain, d_hi, neg_d_lo = _agree(
        err, "save_local", [int(bool(found)), save_id, fp, -fp, len(plain), dh, -dh])
    if d_hi != dh or -neg_d_lo != dh:
        dirs = agree("save_local", where, same=False)  # only now: name each rank's directory
        listing = "; ".join(f"rank {r}: {d}" for r, d in enumerate(dirs))
        raise LocalCheckpointError(
            f"save_local: the ranks passed different directories ({listing}); the parts of one save go into one "
            "directory that every rank sees: pass the same path on every rank. Nothing was written")
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


# -- reading ---------------------------------------------------------------------------------
def local_parts(path: str) -> int:
    """The saving world size if every part of the local checkpoint in ``path`` is there; else
    raise ``LocalCheckpointError`` naming what is missing."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        raise LocalCheckpointError(f"load_local: no checkpoint directory {path!r}") from None
    except NotADirectoryError:
        raise LocalCheckpointError(f"load_local: {path!r} is a file, not a local checkpoint directory") from None
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


def is_local_save(path: str) -> bool:
    """Whether directory ``path`` holds (parts of) a local save."""
    return bool(_existing(path))


def read_meta(path: str, rank: int, world: int) -> dict:
    """Saved rank ``rank``'s ``.meta``, checked against its header (length, CRC-32) before it
    is unpickled; :class:`LocalCheckpointCorruptError` naming the file otherwise."""
    p = os.path.join(path, _names(rank, world)[1])
    try:
        with open(p, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise LocalCheckpointError(f"load_local: {p} (saved rank {rank}) is missing") from None
    head = _META_HEAD.match(data[:128])
    if head is None:
        if data.startswith(b"PK"):
            raise LocalCheckpointError(
                f"load_local: {p} is a local save of format 1 (written before parts carried checksums and a "
                "save id); load it with the ragged_fsdp that wrote it and save it again")
        raise LocalCheckpointCorruptError(
            f"load_local: {p} (saved rank {rank}) is not a local-save .meta: it does not start with its header "
            f"line (it starts {data[:24]!r}); the file is damaged or was replaced. Nothing was loaded")
    version, want, size = int(head.group(1)), int(head.group(2), 16), int(head.group(3))
    payload = data[head.end():]
    if version != FORMAT:
        raise LocalCheckpointError(f"load_local: {p} is local-save format {version}; this ragged_fsdp reads "
                                   f"format {FORMAT}")
    if len(payload) != size:
        raise LocalCheckpointCorruptError(
            f"load_local: {p} (saved rank {rank}) is truncated or extended: {len(payload)} bytes after its header, "
            f"which records {size}. Nothing was loaded")
    check_crc32(payload, want, f"load_local: {p} (saved rank {rank})", "its bytes", "Nothing was loaded",
                LocalCheckpointCorruptError)
    try:
        meta = torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as e:  # pragma: no cover - a payload that matches its CRC but does not load
        raise LocalCheckpointCorruptError(f"load_local: {p} cannot be unpickled ({type(e).__name__}: "
                                          f"{first_line(e)})") from None
    if not isinstance(meta, dict) or meta.get("world") != world or meta.get("rank") != rank:
        raise LocalCheckpointCorruptError(
            f"load_local: {p} describes rank {meta.get('rank') if isinstance(meta, dict) else '?'} of world "
            f"{meta.get('world') if isinstance(meta, dict) else '?'}, not rank {rank} of {world}: the file was "
            "renamed or copied from another save. Nothing was loaded")
    return meta


def _mixed(path: str, what: str, got, want) -> LocalCheckpointError:
    return LocalCheckpointError(
        f"load_local: {what} is from another save (save id {got:016x}) than part 0's .meta (save id {want:016x}): "
        f"{path} mixes two saves. Nothing was loaded; save again into a new directory")


@dataclass
class _Parts:
    """This rank's view of the saved ``.pt`` files: each opened once (memory mapped), its
    header checked against the save, each tensor it reads checked against its CRC-32 once."""

    path: str
    world: int
    save_id: int
    opened: dict = field(default_factory=dict)
    checked: set = field(default_factory=set)

    def tensor(self, r: int, key: str) -> torch.Tensor:
        p = os.path.join(self.path, _names(r, self.world)[0])
        if r not in self.opened:
            try:
                part = torch.load(p, mmap=True, weights_only=True)
            except FileNotFoundError:
                raise LocalCheckpointError(f"load_local: {p} is missing though its .meta exists") from None
            except Exception as e:  # torch's zip reader: "PytorchStreamReader failed ..."
                raise LocalCheckpointCorruptError(
                    f"load_local: {p} (saved rank {r}) cannot be read ({type(e).__name__}: {first_line(e)[:160]}); "
                    "the file is truncated or damaged. Nothing was loaded") from None
            head = part.get(HEADER_KEY) if isinstance(part, dict) else None
            if (not isinstance(head, dict) or head.get("rank") != r or head.get("world") != self.world
                    or not isinstance(head.get("crc32"), dict)):
                raise LocalCheckpointCorruptError(f"load_local: {p} has no valid part header for saved rank {r} "
                                                  f"of {self.world} (its rank, world size and CRC-32 table); the "
                                                  "file is damaged or was replaced. Nothing was loaded")
            if head.get("save_id") != self.save_id:
                raise _mixed(self.path, f"{p} (saved rank {r})", head.get("save_id") or 0, self.save_id)
            self.opened[r] = part
        part = self.opened[r]
        if key not in part or key not in part[HEADER_KEY]["crc32"]:
            raise LocalCheckpointCorruptError(f"load_local: {p} (saved rank {r}) lacks {key!r}, which its .meta "
                                              "lists; the file is damaged. Nothing was loaded")
        t = part[key]
        if (r, key) not in self.checked:
            try:
                check_crc32(t, part[HEADER_KEY]["crc32"][key], f"load_local: {p} (saved rank {r})",
                            f"the bytes of {key!r}", "Nothing was loaded; load another checkpoint",
                            LocalCheckpointCorruptError)
            except LocalCheckpointCorruptError:
                raise
            except Exception as e:  # a damaged record header: a tensor torch built with impossible strides
                raise LocalCheckpointCorruptError(
                    f"load_local: {p} (saved rank {r}): the stored tensor {key!r} cannot be read back "
                    f"({type(e).__name__}: {first_line(e)[:160]}); the file is damaged. Nothing was loaded; load "
                    "another checkpoint") from None
            self.checked.add((r, key))
        return t


def _target_range(key: str, value) -> tuple[int, int, torch.Tensor]:
    """(flat start, flat end, flat local tensor) this rank fills for ``value``."""
    if isinstance(value, DTensor):
        pl, rank = _ragged(key, value, _world_rank()[0])
        local = value.to_local()
        if not local.is_contiguous():
            raise LocalCheckpointError(f"load_local: the local tensor of {key!r} is not contiguous")
        a, b = pl.element_range(tuple(value.shape), rank)
        return a, b, local.view(-1)
    if not value.is_contiguous():
        raise LocalCheckpointError(f"load_local: {key!r} is not contiguous; load into a contiguous tensor")
    return 0, value.numel(), value.view(-1)


def _check_tensor(key: str, value, shape, dtype: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise LocalCheckpointError(f"load_local: {key!r} was saved as a tensor but the state dict holds "
                                   f"{type(value).__name__}")
    if tuple(value.shape) != tuple(shape) or str(value.dtype) != dtype:
        raise LocalCheckpointError(
            f"load_local: {key!r} was saved with shape {tuple(shape)} {dtype}, the state dict "
            f"has {tuple(value.shape)} {value.dtype}; convert the model (or the checkpoint) first")


def _plan_load(state_dict, path: str, strict: bool, world: int, rank: int):
    """Everything ``load_local`` will copy, checked; nothing is changed yet."""
    saved_world = local_parts(path)
    meta = read_meta(path, 0, saved_world)
    save_id = meta.get("save_id")
    # every .meta is read by some rank, so a part of another save is found whatever W is
    metas = {0: meta}
    for s in range(rank, saved_world, world):
        m = meta if s == 0 else read_meta(path, s, saved_world)
        if m.get("save_id") != save_id:
            raise _mixed(path, os.path.join(path, _names(s, saved_world)[1]), m.get("save_id") or 0, save_id or 0)
        metas[s] = m
    entries = meta["entries"]
    flat = _flat(state_dict, "load_local")
    if strict:
        extra, missing = sorted(set(entries) - set(flat)), sorted(set(flat) - set(entries))
        if extra or missing:
            raise LocalCheckpointError(f"load_local: keys differ: in the checkpoint only {extra[:5]}, in the state "
                                       f"dict only {missing[:5]}; pass strict=False to load the common keys")
    per_rank = sorted(k for k in flat if k in entries and entries[k]["kind"] in ("rank", "rank_object"))
    if per_rank and saved_world != world:
        raise LocalCheckpointError(
            f"load_local: {per_rank[:5]} differed between the ranks that saved them (stored per rank at W = "
            f"{saved_world}), so they load only at that world size, not at {world}; make them equal on every rank, "
            "or load at W = {saved_world}".replace("{saved_world}", str(saved_world)))
    parts = _Parts(path, saved_world, save_id)
    copies, sets = [], []
    for key, (value, opath) in flat.items():
        if key not in entries:
            continue
        e = entries[key]
        if e["kind"] in ("object", "rank_object"):
            src = meta if e["kind"] == "object" else metas[rank]
            if key not in src.get("objects", {}):
                raise LocalCheckpointCorruptError(f"load_local: the .meta of saved rank {src['rank']} lacks the "
                                                  f"value of {key!r}; the file is damaged")
            sets.append((opath, src["objects"][key]))
            continue
        if e["kind"] == "rank":
            own = metas[rank]["own"][key]
            _check_tensor(key, value, own["shape"], own["dtype"])
            _, _, flat_dst = _target_range(key, value)
            src = parts.tensor(rank, key) if value.numel() else None
            if src is not None:
                copies.append((flat_dst, src.reshape(-1)))
            continue
        _check_tensor(key, value, e["shape"], e["dtype"])
        a, b, dst = _target_range(key, value)
        if e["kind"] == "full":
            if b > a:
                copies.append((dst, parts.tensor(0, key).reshape(-1)[a:b]))
            continue
        layout = RunLayout(tuple(e["shape"]), tuple(e["dims"]), e["unit"], tuple(map(tuple, e["runs"])))
        try:
            layout.check()
        except ValueError as ex:
            raise LocalCheckpointCorruptError(f"load_local: {key!r}: {ex}") from None
        for pc in layout.pieces(a, b):
            src = parts.tensor(pc.rank, key)
            if src.numel() < pc.src_hi or str(src.dtype) != e["dtype"]:
                raise LocalCheckpointCorruptError(
                    f"load_local: saved rank {pc.rank}'s piece of {key!r} is {src.numel()} {src.dtype} elements, "
                    f"its layout needs {pc.src_hi} {e['dtype']}; the part is damaged")
            copies.append((dst[pc.dst_lo:pc.dst_lo + pc.src_hi - pc.src_lo], src[pc.src_lo:pc.src_hi]))
    return copies, sets


def load_local(state_dict: dict[str, Any], path: str | os.PathLike, strict: bool = True) -> dict[str, Any]:
    """Fill ``state_dict`` (nested dicts and lists, as saved) in place from the local
    checkpoint in ``path``, saved at any world size. Tensors (RaggedShard DTensors or plain)
    are copied into; plain values are replaced in their dict or list. ``strict``: every key on
    both sides must match. Call on every rank (one all-reduce): if any rank finds the
    checkpoint incomplete, damaged, mixed or not fitting, every rank raises and no rank has
    changed anything. Returns ``state_dict``."""
    world, rank = _world_rank()
    plan, err = None, None
    try:
        plan = _plan_load(state_dict, os.fspath(path), strict, world, rank)
    except Exception as e:
        err = e
    _agree(err, "load_local")
    copies, sets = plan
    with torch.no_grad():
        for dst, src in copies:
            dst.copy_(src)
    for opath, value in sets:
        box, k = _container(state_dict, opath)
        box[k] = value
    return state_dict


# -- one process: inspecting and converting ----------------------------------------------------
def describe_local(path: str) -> dict:
    """What ``ckpt info`` shows: world size, save id, completeness, per key its kind, shape
    and dtype (from part 0's ``.meta``, checked). Raises when part 0's ``.meta`` is missing."""
    names = _existing(path)
    worlds = sorted({int(_ANY_PART.match(n).group(2)) for n in names})
    if len(worlds) != 1:
        raise LocalCheckpointError(f"{path}: parts of local saves at world sizes {worlds}" if worlds
                                   else f"{path} holds no local-save part")
    world = worlds[0]
    metas = {int(_PART.match(n).group(1)) for n in names if _PART.match(n)}
    missing = sorted(set(range(world)) - metas)
    meta = read_meta(path, 0, world)
    return {"world": world, "save_id": meta.get("save_id"), "missing": missing, "entries": meta["entries"],
            "own": meta.get("own", {})}


def read_local_full(path: str, key: str | None = None) -> dict[str, Any]:
    """The whole local save (or its top-level entry ``key``) as a nested dict of plain CPU
    tensors and values, nested as it was saved, every tensor checked. Values that differed
    per rank have no single full form: refused by name."""
    world = local_parts(path)
    meta = read_meta(path, 0, world)
    for s in range(1, world):
        m = read_meta(path, s, world)
        if m.get("save_id") != meta.get("save_id"):
            raise _mixed(path, os.path.join(path, _names(s, world)[1]), m.get("save_id") or 0, meta["save_id"] or 0)
    parts = _Parts(path, world, meta.get("save_id"))
    out: dict[str, Any] = {}
    chosen = {k: e for k, e in meta["entries"].items() if key is None or str(_path(k, e)[0]) == key}
    if not chosen:
        tops = sorted({str(_path(k, e)[0]) for k, e in meta["entries"].items()})
        raise KeyError(f"{path} has no top-level key {key!r}; it has {tops}")
    per_rank = sorted(k for k, e in chosen.items() if e["kind"] in ("rank", "rank_object"))
    if per_rank:
        raise LocalCheckpointError(f"{path}: {per_rank[:5]} differed per rank when saved; a single full state has "
                                   "no place for them. Load the save at its world size with load_local instead")
    for k, e in chosen.items():
        if e["kind"] == "object":
            value = meta["objects"][k]
        else:
            value = torch.empty(tuple(e["shape"]), dtype=getattr(torch, e["dtype"].replace("torch.", "")))
            flat = value.view(-1)
            if e["kind"] == "full":
                flat.copy_(parts.tensor(0, k).reshape(-1))
            else:
                layout = RunLayout(tuple(e["shape"]), tuple(e["dims"]), e["unit"], tuple(map(tuple, e["runs"])))
                layout.check()
                for pc in layout.pieces(0, flat.numel()):
                    flat[pc.dst_lo:pc.dst_lo + pc.src_hi - pc.src_lo].copy_(parts.tensor(pc.rank, k)[pc.src_lo:pc.src_hi])
        _put(out, _path(k, e), value, {tuple(x) for x in meta.get("lists", ())})
    return out if key is None else out[key]


def _path(key: str, entry: dict) -> tuple:
    return tuple(entry.get("path", (key,)))


def _put(root: dict, path: tuple, value, lists: set) -> None:
    """Set ``value`` at ``path`` under ``root``, making the dicts and lists on the way."""
    obj = root
    for i, step in enumerate(path):
        if isinstance(obj, list):
            obj.extend([None] * (step + 1 - len(obj)))
        if i == len(path) - 1:
            obj[step] = value
            return
        if (obj[step] if isinstance(obj, list) else obj.get(step)) is None:
            obj[step] = [] if path[:i + 1] in lists else {}
        obj = obj[step]
