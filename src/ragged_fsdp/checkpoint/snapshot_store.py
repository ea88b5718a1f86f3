"""What one node keeps of the snapshots: its directory, read and written by its ranks only.

Layout, under the node-local directory ``dir`` (default ``/dev/shm/ragged_fsdp-<run id>``)::

    snap-000000012/            the snapshot taken when 12 steps were done
        own/part-r-of-W.*      save_local parts of the ranks on this node
        copy/part-r-of-W.*     a byte copy of another node's parts (its peer's), received
        info-r.pt              per rank: run fingerprint, snapshot id, W, step, extra, RNG
        committed-r            per rank: every rank finished this snapshot (the commit rule)
    restore-r<rank>/           staging while a restore runs (removed after)

Why a tmpfs directory and not shared memory segments: files in ``/dev/shm`` (or any tmpfs)
live until they are deleted, so they outlast the worker process that wrote them and the
restart torchrun gives it; Python's ``SharedMemory`` segments are unlinked by the resource
tracker when the process that made them exits, which is exactly the case to survive. A
directory also lets the snapshot be ``save_local``'s own format (atomic renames, a CRC-32 per
tensor, memory-mapped reads), so ``load_local`` reshards it and nothing here reads tensors.
"""

from __future__ import annotations

import os
import re
import shutil

import torch

__all__ = ["snap_dir", "own_dir", "copy_dir", "info_path", "staging_dir", "scan", "write_atomic", "mark_committed",
           "remove_steps", "part_names", "PART"]

PART = re.compile(r"^part-(\d+)-of-(\d+)\.(pt|meta)$")
_SNAP = re.compile(r"^snap-(\d{9})$")
_MARK = re.compile(r"^committed-(\d+)$")
_INFO = re.compile(r"^info-(\d+)\.pt$")


def snap_dir(root: str, step: int) -> str:
    return os.path.join(root, f"snap-{step:09d}")


def own_dir(root: str, step: int) -> str:
    return os.path.join(snap_dir(root, step), "own")


def copy_dir(root: str, step: int) -> str:
    return os.path.join(snap_dir(root, step), "copy")


def info_path(root: str, step: int, rank: int) -> str:
    return os.path.join(snap_dir(root, step), f"info-{rank}.pt")


def staging_dir(root: str, rank: int) -> str:
    return os.path.join(root, f"restore-r{rank}")


def part_names(r: int, w: int) -> tuple[str, str]:
    """The ``.pt`` and ``.meta`` names ``save_local`` gives saved rank ``r`` of ``w``."""
    return f"part-{r:05d}-of-{w:05d}.pt", f"part-{r:05d}-of-{w:05d}.meta"


def write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def mark_committed(root: str, step: int, rank: int) -> None:
    write_atomic(os.path.join(snap_dir(root, step), f"committed-{rank}"), b"")


def _parts(path: str) -> dict[int, int]:
    """``{saved rank: saved W}`` of the parts whose ``.pt`` and ``.meta`` are both there (the
    ``.meta`` is renamed in last, so it marks a whole part)."""
    try:
        names = set(os.listdir(path))
    except OSError:
        return {}
    out = {}
    for n in names:
        m = PART.match(n)
        if m and m.group(3) == "meta":
            r, w = int(m.group(1)), int(m.group(2))
            if part_names(r, w)[0] in names:
                out[r] = w
    return out


def scan(root: str) -> dict[int, dict]:
    """Per snapshot step in ``root``: ``marked`` (any rank's commit marker is there), the parts
    held (``own``, ``copy``: saved rank -> W) and the first readable ``info`` (or None)."""
    out: dict[int, dict] = {}
    try:
        names = os.listdir(root)
    except OSError:
        return out
    for n in names:
        m = _SNAP.match(n)
        if not m:
            continue
        step = int(m.group(1))
        d = os.path.join(root, n)
        try:
            inside = sorted(os.listdir(d))
        except OSError:
            continue
        info = None
        for f in inside:
            if _INFO.match(f):
                try:
                    info = torch.load(os.path.join(d, f), weights_only=False)
                    break
                except Exception:  # a torn info file: another rank's may still be readable
                    continue
        out[step] = {"marked": any(_MARK.match(f) for f in inside), "own": _parts(own_dir(root, step)),
                     "copy": _parts(copy_dir(root, step)), "info": info}
    return out


def remove_steps(root: str, keep) -> None:
    """Remove every snapshot directory whose step is not in ``keep`` (ranks on one node may
    race here: whoever comes second finds nothing left, which is fine)."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for n in names:
        m = _SNAP.match(n)
        if m and int(m.group(1)) not in keep:
            shutil.rmtree(os.path.join(root, n), ignore_errors=True)
