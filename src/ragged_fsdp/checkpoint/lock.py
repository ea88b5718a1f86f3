"""One writer per checkpoint root: an exclusive lock file that names its holder.

``save`` is collective, and its coordinator (rank 0) takes ``root/.ragged_fsdp_lock`` before
it creates anything and drops it when the save is published or has failed. The file is made
complete under a private name and then hard-linked into place, so it appears atomically,
never half-written, and only one of any number of racing writers gets it. It holds a JSON
record of the holder: host, pid, the process start time (``/proc/<pid>/stat`` and the boot
id, so a recycled pid is not mistaken for the holder), the save's token and its partial
directory.

A second writer reads the record and:

* holder alive, or on another host (its liveness cannot be checked from here):
  :class:`CheckpointLockedError` naming the holder and, for a lock that outlived its job,
  the file to remove by hand. Nothing is written or deleted;
* holder on this host and gone (no such pid, or the pid now belongs to a process started
  later, or the machine rebooted since): the lock is stale. It is renamed away (only one
  breaker wins the rename; a breaker that finds it moved a live lock puts it back) and the
  break is reported with a warning naming the dead holder; then the lock is taken.

Every ``.partial-*`` directory carries the same record (``WRITER``), which is how a save
tells debris of a dead writer (removed) from another writer's save in progress (kept).
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from .errors import CheckpointLockedError

__all__ = ["LOCK", "WRITER", "holder_record", "acquire", "release", "verify", "writer_gone", "describe"]

LOCK = ".ragged_fsdp_lock"
WRITER = ".ragged_fsdp_writer"


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (Linux), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    try:  # the command name may hold spaces and parentheses: fields start after the last ')'
        return int(text.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def holder_record(token: str, partial: str, world_size: int) -> dict[str, Any]:
    pid = os.getpid()
    return {
        "host": socket.gethostname(), "pid": pid, "start_ticks": _start_ticks(pid), "boot_id": _boot_id(),
        "since": time.time(), "token": token, "partial": partial, "world_size": world_size,
    }


def read_record(path: str) -> dict[str, Any] | None:
    """The record in ``path``; None if it does not exist; ``{}`` if it cannot be parsed."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def alive(rec: dict[str, Any]) -> bool | None:
    """Whether the process a record names still runs: True/False on this host, None when it
    cannot be told (another host, or a record without host and pid)."""
    host, pid = rec.get("host"), rec.get("pid")
    if host != socket.gethostname() or not isinstance(pid, int):
        return None
    boot = _boot_id()
    if rec.get("boot_id") and boot and rec["boot_id"] != boot:
        return False  # rebooted since: every process of then is gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    now = _start_ticks(pid)
    if rec.get("start_ticks") is not None and now is not None and now != rec["start_ticks"]:
        return False  # the pid was recycled by a later process
    return True


def writer_gone(rec: dict[str, Any] | None) -> bool:
    """True only when the writer a partial directory's record names is known to be dead."""
    return bool(rec) and alive(rec) is False


def describe(rec: dict[str, Any]) -> str:
    since = rec.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return (f"host {rec.get('host', '?')} pid {rec.get('pid', '?')} (world size {rec.get('world_size', '?')}, "
            f"holding it since {when}, writing {rec.get('partial', '?')})")


def _place(tmp: str, path: str) -> None:
    """Make ``tmp`` appear as ``path`` atomically, failing with FileExistsError if it exists."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # a filesystem without hard links: O_EXCL create, then the content
        with open(tmp, "rb") as f:
            data = f.read()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)


def acquire(root: str, record: dict[str, Any]) -> list[str]:
    """Take ``root``'s lock for ``record`` (rank 0 of a save). Returns the warnings to show
    (a stale lock broken); raises :class:`CheckpointLockedError` when another writer holds it."""
    path = os.path.join(root, LOCK)
    tmp = os.path.join(root, f"{LOCK}.{record['token']}.new")
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    notes: list[str] = []
    try:
        for _ in range(5):
            try:
                _place(tmp, path)
                return notes
            except FileExistsError:
                pass
            held = read_record(path)
            if held is None:
                continue  # released meanwhile
            state = alive(held) if held else None
            if state is not False:
                raise CheckpointLockedError(_locked_message(root, path, held, state))
            notes.append(_break(root, path, held, record["token"]))
        raise CheckpointLockedError(f"checkpoint root {root}: the lock {path} kept changing hands while this "
                                    "save tried to take it (several writers at once); nothing was written")
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _locked_message(root: str, path: str, held: dict, state: bool | None) -> str:
    if not held:
        who = "a writer whose lock record cannot be read"
    else:
        who = describe(held)
    if state is True:
        how = "wait for that save to finish, or give this job another root"
    else:
        how = (f"if no job writes under {root} any more (e.g. the holder was killed on another machine), "
               f"remove {path} by hand" + (f" and {os.path.join(root, held['partial'])}" if held.get("partial") else "")
               + "; its liveness cannot be checked from this host")
    return (f"checkpoint root {root} is locked by another writer: {who}. One writer per root at a time: "
            f"{how}. Nothing was written or deleted")


def _break(root: str, path: str, held: dict, token: str) -> str:
    """Move a stale lock away; return the warning. A breaker that finds it moved a lock other
    than the one it judged stale (another writer broke it and took it meanwhile) restores it."""
    aside = os.path.join(root, f"{LOCK}.stale-{token}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return f"checkpoint root {root}: a stale lock of {describe(held)} vanished while being broken"
    moved = read_record(aside) or {}
    if moved.get("token") != held.get("token"):
        try:
            os.link(aside, path)
        except OSError:
            pass
        os.unlink(aside)
        raise CheckpointLockedError(f"checkpoint root {root}: another writer took the lock {path} while this "
                                    "save was breaking a stale one; nothing was written")
    os.unlink(aside)
    return (f"checkpoint root {root}: broke the stale lock of {describe(held)}: that process no longer runs "
            "on this host (killed or crashed during a save); its unfinished save is removed once this one "
            "is published")


def verify(root: str, token: str) -> None:
    """Raise unless this save still holds the lock (checked before anything is deleted)."""
    held = read_record(os.path.join(root, LOCK))
    if not held or held.get("token") != token:
        who = describe(held) if held else "nobody"
        raise CheckpointLockedError(
            f"checkpoint root {root}: this save no longer holds the lock (now held by {who}; was it removed "
            "by hand?); the checkpoint was published but nothing was deleted")


def release(root: str, token: str) -> None:
    """Drop the lock if this save still holds it."""
    path = os.path.join(root, LOCK)
    held = read_record(path)
    if held and held.get("token") == token:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
