"""Checksums for DCP checkpoints: one CRC-32 per write item, verified on every read.

DCP stores each write item (a tensor box, or a pickled object) as one byte range of a
``.distcp`` file and, when it reshards, reads whole items and narrows them in memory. So a
checksum per item is the right grain: it is computed as the item's bytes go to the file
(no second pass over the data), and checking it on a read touches only bytes DCP reads
anyway. A whole-file checksum would force every load to read every file in full.

* :class:`ChecksummedWriter` (a ``dcp.FileSystemWriter``) hashes the bytes of each item on
  their way into the file and records ``crc32`` on the item's storage entry, which DCP
  gathers into ``.metadata``; the checkpoint stays a plain DCP checkpoint that torch's own
  reader loads (it ignores the extra field).
* ``.metadata`` itself is sealed with a SHA-256 (:mod:`.metadata_seal`) that the writer
  writes after it and the reader checks before unpickling it.
* :class:`ChecksummedReader` (a ``dcp.FileSystemReader``) reads each item's byte range,
  checks it and raises :class:`CheckpointCorruptError` naming the file, byte range and key
  before a damaged tensor reaches the model. Items without a recorded checksum (checkpoints
  written by torch's writer) are read as torch reads them.

The local save (:mod:`.local_save`) checks its parts with the same :func:`crc32` /
:func:`check_crc32`, one CRC-32 per stored tensor.

``ragged_fsdp.checkpoint.save`` / ``load`` / ``load_latest`` / ``async_save`` / ``read_full``
and ``ckpt convert`` use these; with plain ``dcp.save`` / ``dcp.load`` pass
``storage_writer=ChecksummedWriter(path)`` / ``storage_reader=ChecksummedReader(path)``.
"""

from __future__ import annotations

import io
import json
import warnings
import os
import pickle
import zlib

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.futures import Future

from . import metadata_seal
from .listing import MARKER

__all__ = ["CheckpointCorruptError", "ChecksummedWriter", "ChecksummedReader", "CRC_FIELD", "count_checksums", "crc32",
           "check_crc32"]

CRC_FIELD = "ragged_crc32"  # attribute added to DCP's per-item storage entry
SEALED_FIELD = "ragged_sealed"  # set on DCP's Metadata by ChecksummedWriter: a missing seal file means it was lost


class CheckpointCorruptError(ValueError):
    """A checkpoint's bytes are not what was written (damaged, truncated, edited)."""


class _CrcStream(io.RawIOBase):
    """Passes writes through to ``raw`` and keeps a running CRC-32 of them."""

    def __init__(self, raw, errors: list | None = None):
        super().__init__()
        self.raw = raw
        self.crc = 0
        self.nbytes = 0
        self.errors = errors if errors is not None else []

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.nbytes += view.nbytes
        try:
            return self.raw.write(b)
        except OSError as e:  # torch.save's zip writer turns it into "unexpected pos": keep it
            self.errors.append(e)
            raise

    def flush(self) -> None:
        self.raw.flush()

    def tell(self) -> int:
        return self.raw.tell()

    def close(self) -> None:  # the file is closed by its owner, after every item
        self.flush()


class _ItemEnd(io.RawIOBase):
    """The item's (possibly transformed) write stream; when DCP closes it, the item's bytes
    are all in the file, so its checksum is final."""

    def __init__(self, inner, on_close):
        super().__init__()
        self.inner = inner
        self.on_close = on_close

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        return self.inner.write(b)

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        if not self.closed:
            self.inner.close()
            self.on_close()
        super().close()


class _HashingTransforms:
    """Wraps DCP's per-item stream factory so every item is hashed as it is written. The
    hash covers the bytes that land in the file (after any stream extension)."""

    def __init__(self, inner, sink: dict, errors: list):
        self.inner = inner
        self.sink = sink
        self.errors = errors

    def transform_save_stream(self, write_item, raw_stream):
        crc = _CrcStream(raw_stream, self.errors)
        stream, descriptors = self.inner.transform_save_stream(write_item, crc)

        def done():
            self.sink[write_item.index] = (crc.crc, crc.nbytes)

        return _ItemEnd(stream, done), descriptors

    def __getattr__(self, name):
        return getattr(self.inner, name)


class ChecksummedWriter(dcp.FileSystemWriter):
    """``dcp.FileSystemWriter`` that records a CRC-32 per write item (same arguments)."""

    def __init__(self, path, *args, **kwargs):
        super().__init__(path, *args, **kwargs)
        self._crcs: dict = {}
        self._io_errors: list = []  # OSErrors of the file writes, for the error report
        inner = getattr(self, "transforms", None)
        # The per-item stream hook exists in every torch this package supports (2.11+); if a
        # future torch drops it, items are written without checksums and read unchecked.
        self._hashing = inner is not None and hasattr(inner, "transform_save_stream")
        if self._hashing:
            self.transforms = _HashingTransforms(inner, self._crcs, self._io_errors)

    def write_data(self, plan, planner):
        try:
            results = super().write_data(plan, planner).wait()
        except Exception as e:
            # a full disk under torch.save's zip writer surfaces as "unexpected pos"; the
            # OSError underneath (ENOSPC, EFBIG) is what the caller needs to see
            if self._io_errors and not isinstance(e, OSError):
                raise self._io_errors[0] from e
            raise
        for wr in results:
            got = self._crcs.pop(wr.index, None)
            info = wr.storage_data
            if got is not None and got[1] == getattr(info, "length", None):
                setattr(info, CRC_FIELD, got[0])
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _metadata_file(self) -> str:
        per_rank = not getattr(self, "use_collectives", True) and getattr(self, "rank", None) is not None
        return os.fspath(self._get_metadata_path(self.rank if per_rank else None))

    def finish(self, metadata, results) -> None:
        md_path = self._metadata_file()
        metadata_seal.remove_seal(md_path)
        setattr(metadata, SEALED_FIELD, True)  # so a reader knows a missing seal was lost, not never written
        super().finish(metadata, results)
        metadata_seal.write_seal(md_path)  # only now is .metadata complete and in place


class ChecksummedReader(dcp.FileSystemReader):
    """``dcp.FileSystemReader`` that verifies each item it reads against its recorded CRC-32."""

    def read_metadata(self, *args, **kwargs):
        md_path = os.fspath(self._get_metadata_path(kwargs.get("rank")))
        with open(md_path, "rb") as f:
            data = f.read()
        # checked on the bytes that are unpickled below, so a rewrite in between cannot slip by
        sealed = metadata_seal.check_seal(md_path, data, CheckpointCorruptError)
        try:
            md = pickle.loads(data)
        except Exception as e:
            raise CheckpointCorruptError(
                f"{md_path} cannot be read ({type(e).__name__}: {str(e).strip()[:200] or 'no message'}); the file "
                "is truncated, damaged or not DCP metadata. " + metadata_seal.previous_hint(os.path.dirname(md_path))
            ) from None
        if not sealed:
            if not os.path.exists(md_path):  # moved or deleted while being read: not damage
                raise FileNotFoundError(f"{md_path} was removed while it was being read (the checkpoint was "
                                        "moved or deleted meanwhile)")
            why = _seal_expected(md, os.path.dirname(md_path))
            if why:
                raise CheckpointCorruptError(metadata_seal.missing_seal_message(md_path, why))
        if getattr(md, "storage_meta", None) is None:  # as torch's reader leaves it
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._index_of = {id(info): index for index, info in (self.storage_data or {}).items()}

    def _slice_file(self, file, sinfo):
        want = getattr(sinfo, CRC_FIELD, None)
        if want is None:
            return super()._slice_file(file, sinfo)
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        where = os.path.join(os.fspath(self.path), sinfo.relative_path)
        index = getattr(self, "_index_of", {}).get(id(sinfo))
        key = f" ('{index.fqn}'" + (f" at offset {tuple(index.offset)})" if index is not None and index.offset is not None else ")") \
            if index is not None else ""
        if len(data) != sinfo.length:
            raise CheckpointCorruptError(
                f"{where}: item{key} needs bytes [{sinfo.offset}, {sinfo.offset + sinfo.length}) but the "
                f"file ends early ({len(data)} of {sinfo.length} bytes); the file is truncated. Entries "
                "read before it were loaded: load another checkpoint"
            )
        check_crc32(data, want, where, f"bytes [{sinfo.offset}, {sinfo.offset + sinfo.length}) of item{key}",
                    "That item was not loaded, but entries read before it were: load another checkpoint")
        return io.BytesIO(data)


def crc32(data) -> int:
    """CRC-32 of a bytes-like object, or of a CPU tensor's bytes (any dtype, any layout: its
    elements in row-major order). Both checkpoint formats hash with this one function."""
    if isinstance(data, torch.Tensor):
        flat = data.detach().reshape(-1)
        if flat.numel() == 0:
            return 0
        data = flat.view(torch.uint8).numpy()
    return zlib.crc32(data)


def check_crc32(data, want: int, where: str, what: str, then: str, error=None) -> None:
    """Raise ``error`` (default :class:`CheckpointCorruptError`, or a subclass)
    ``"{where}: {what} fail their CRC-32 check ..."`` unless ``data`` (bytes, or a tensor's
    bytes) hashes to ``want``."""
    got = crc32(data)
    if got != want:
        raise (error or CheckpointCorruptError)(
            f"{where}: {what} fail their CRC-32 check (recorded {want:08x}, read {got:08x}); the file "
            f"changed after it was written. {then}"
        )


def _seal_expected(md, directory: str) -> str | None:
    """Why an unsealed ``.metadata`` should have had a seal, or None (torch's writer)."""
    if getattr(md, SEALED_FIELD, False):
        return "its metadata records that ChecksummedWriter sealed it"
    infos = getattr(md, "storage_data", None)
    if isinstance(infos, dict) and any(getattr(i, CRC_FIELD, None) is not None for i in infos.values()):
        # written by a ragged_fsdp from before seals (CRC-32s, no seal field): still loadable,
        # its items are checked as before; only .metadata itself goes unchecked
        warnings.warn(f"{directory}: written before ragged_fsdp sealed .metadata; its items are checked against "
                      "their CRC-32s but .metadata itself cannot be; save again to seal it", stacklevel=3)
    try:
        with open(os.path.join(directory, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    if isinstance(marker, dict) and marker.get("metadata_seal"):
        return "its completion marker records that ragged_fsdp.checkpoint.save sealed it"
    return None


def count_checksums(metadata) -> tuple[int, int]:
    """(items with a checksum, items) of a checkpoint's metadata."""
    infos = list((metadata.storage_data or {}).values())
    return sum(getattr(i, CRC_FIELD, None) is not None for i in infos), len(infos)
