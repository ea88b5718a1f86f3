"""A seal on DCP's ``.metadata``: its SHA-256, written once the file is complete.

The per-item CRC-32s (:mod:`.integrity`) are stored inside ``.metadata``, together with every
item's file, offset and length and every chunk's size, so they cannot vouch for it: an
edited chunk size loads "successfully" and leaves part of a tensor at its old value. The seal
is a small JSON file next to it (``.metadata.sha256``) holding the digest and length of the
metadata file's bytes. :class:`ChecksummedWriter` writes it after DCP renamed ``.metadata``
into place (so it never describes a half-written file) and :class:`ChecksummedReader` checks
it before DCP unpickles anything.

A directory without a seal is accepted only if nothing says it should have one: torch's own
writer seals nothing and records no item CRC-32s. A checkpoint whose items carry CRC-32s, or
that ``save`` published with a marker recording the seal, was written by our writer, which
always seals: a missing seal there means the seal or ``.metadata`` was replaced or lost.
"""

from __future__ import annotations

import hashlib
import json
import os

from .listing import _NAME, list_checkpoints

__all__ = ["SEAL_SUFFIX", "seal_name", "write_seal", "remove_seal", "check_seal", "missing_seal_message",
           "previous_hint"]

SEAL_SUFFIX = ".sha256"


def seal_name(metadata_name: str) -> str:
    return metadata_name + SEAL_SUFFIX


def _digest(data: bytes) -> tuple[str, int]:
    return hashlib.sha256(data).hexdigest(), len(data)


def remove_seal(metadata_path: str) -> None:
    """Drop an old seal before ``.metadata`` is rewritten in place: a crash in between then
    leaves a missing seal (refused) rather than one that vouches for the previous file."""
    try:
        os.unlink(seal_name(metadata_path))
    except FileNotFoundError:
        pass


def write_seal(metadata_path: str) -> None:
    with open(metadata_path, "rb") as f:
        digest, size = _digest(f.read())
    seal = seal_name(metadata_path)
    tmp = f"{seal}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"file": os.path.basename(metadata_path), "sha256": digest, "bytes": size}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, seal)


def check_seal(metadata_path: str, data: bytes, corrupt) -> bool:
    """Raise ``corrupt(message)`` unless ``data`` (the bytes read from ``metadata_path``, the
    very bytes the caller will unpickle) matches its seal. Returns whether there was a seal
    (False: the caller decides if one was required)."""
    seal = seal_name(metadata_path)
    try:
        with open(seal) as f:
            text = f.read()
    except FileNotFoundError:
        return False
    where = os.path.dirname(metadata_path)
    try:
        rec = json.loads(text)
        want, want_size = rec["sha256"], rec["bytes"]
    except (ValueError, KeyError, TypeError):
        raise corrupt(f"{seal} (the SHA-256 seal of {metadata_path}) is damaged and cannot vouch for it; "
                      f"nothing was loaded. {previous_hint(where)}") from None
    got, size = _digest(data)
    if isinstance(want_size, int) and size < want_size:
        raise corrupt(f"{metadata_path} cannot be read: the file is truncated ({size} of the {want_size} bytes "
                      f"its seal {seal} records); nothing was loaded. {previous_hint(where)}")
    if (got, size) != (want, want_size):
        raise corrupt(
            f"{metadata_path} fails its SHA-256 check against {seal} (recorded {str(want)[:16]}... over "
            f"{want_size} bytes, read {got[:16]}... over {size} bytes): the file changed after it was "
            f"written, so the item offsets, lengths and chunk sizes in it cannot be trusted; nothing was "
            f"loaded. {previous_hint(where)}")
    return True


def missing_seal_message(metadata_path: str, why: str) -> str:
    return (f"{metadata_path} has no SHA-256 seal ({seal_name(os.path.basename(metadata_path))}) although "
            f"{why}, and that writer seals what it writes: the seal was lost, .metadata was replaced, or "
            f"it predates seals; it cannot be trusted; nothing was loaded. {previous_hint(os.path.dirname(metadata_path))}")


def previous_hint(checkpoint_dir: str) -> str:
    """What to load instead of a damaged checkpoint: the newest older one under its root."""
    d = os.path.abspath(checkpoint_dir)
    m = _NAME.match(os.path.basename(d))
    if m:
        older = [c for c in list_checkpoints(os.path.dirname(d)) if c.step < int(m.group(1))]
        if older:
            return (f"Load the previous checkpoint with ragged_fsdp.checkpoint.load(state, '{older[-1].path}') "
                    f"(or move {d} out of {os.path.dirname(d)}, and load_latest loads that one)")
    return "Load another checkpoint (or write this one again)"
