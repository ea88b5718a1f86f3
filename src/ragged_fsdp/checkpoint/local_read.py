"""Reading a local save's files, each checked before it is used: which parts are there,
a ``.meta`` against its header line, a ``.pt`` against its part header (save id, rank, CRC-32
table) and each stored tensor against its CRC-32."""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field

import torch

from ragged_fsdp.agreement import first_line

from .integrity import check_crc32
from .local_format import (
    _META_HEAD, _PART, FORMAT, HEADER_KEY, LocalCheckpointCorruptError, LocalCheckpointError, _existing,
    _names,
)

__all__ = ["local_parts", "is_local_save", "read_meta"]

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
