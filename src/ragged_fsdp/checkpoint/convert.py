"""Between DCP directories and plain ``torch.save`` files, in one process, no process group.

A DCP checkpoint written by any number of ranks with any RaggedShard layout is a set of
boxes per tensor; reading it whole just means asking DCP for every tensor at full size.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ._tree import set_element
from .atomic import save
from .errors import CheckpointWarning
from .scale_planner import default_load_planner, default_save_planner
from .integrity import ChecksummedWriter
from .listing import scan
from .local_save import is_local_save, read_local_full
from .strict import dcp_load_verified, quiet_single_process, read_metadata

__all__ = ["resolve", "read_full", "dcp_to_torch_save", "torch_save_to_dcp", "local_to_torch_save"]


def resolve(path: str | os.PathLike) -> str:
    """A DCP directory itself, or the newest published checkpoint under a root written by
    :func:`ragged_fsdp.checkpoint.save`."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path
    if os.path.isdir(path):
        published, bad = scan(path)
        if published:
            found = published[-1]
            for n, p, why in bad:
                if n > found.step:
                    warnings.warn(f"skipped {p}, newer than {found.path}: {why}", CheckpointWarning, stacklevel=2)
            return found.path
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist")
    if is_local_save(path):
        raise FileNotFoundError(
            f"{path} is a local save (written by save_local), not a DCP checkpoint: load it with "
            "ragged_fsdp.checkpoint.load_local, or write it as one torch.save file with "
            f"`python -m ragged_fsdp ckpt convert {path} OUT.pt`")
    raise FileNotFoundError(
        f"{path} is neither a DCP checkpoint directory (no .metadata) nor a root holding "
        "published checkpoints (step-<n>/ directories)"
    )


def read_full(path: str | os.PathLike, key: str | None = None, *, progress: bool = False) -> dict[str, Any]:
    """The whole checkpoint (or only its top-level entry ``key``, e.g. ``"model"``) as a
    nested dict of plain CPU tensors and Python values, nested as it was saved.

    Optimizer state dicts get their integer parameter ids back (DCP stores dict keys as
    strings), so ``optimizer.load_state_dict`` accepts them. ``progress``: read in pieces of
    about :data:`PIECE_BYTES` (DCP loads any subset of keys) behind a bar with the bytes read
    and an estimate, on a terminal (``ckpt convert`` turns it on)."""
    path = resolve(path)
    md = read_metadata(path)
    paths = md.planner_data or {}
    flat: dict[str, Any] = {}
    for k, m in md.state_dict_metadata.items():
        obj_path = tuple(paths.get(k, (k,)))
        if key is not None and str(obj_path[0]) != key:
            continue
        if isinstance(m, TensorStorageMetadata):
            flat[k] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
        else:
            flat[k] = None  # bytes entries: DCP puts the unpickled object here
    if not flat:
        tops = sorted({str(tuple(paths.get(k, (k,)))[0]) for k in md.state_dict_metadata})
        raise KeyError(f"{path} has no top-level key {key!r}; it has {tops}")
    for piece in _pieces(flat, progress):
        dcp_load_verified(piece, path, planner=default_load_planner(allow_partial_load=True), no_dist=True)
        flat.update(piece)  # bytes entries come back in the piece's dict
    nested: dict[str, Any] = {}
    for k, v in flat.items():
        set_element(nested, tuple(paths.get(k, (k,))), v)
    _restore_optimizer_ids(nested)
    return nested if key is None else nested[key]


PIECE_BYTES = 256 * 2**20  # one DCP load per piece: large enough that its planning is noise


def _nbytes(v: Any) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _pieces(flat: dict[str, Any], progress: bool):
    """``flat`` as one dict, or (``progress``) as dicts of about ``PIECE_BYTES`` each, in key
    order, advancing a bar by each piece's bytes once it has been read."""
    if not progress:
        yield flat
        return
    from tqdm import tqdm  # a bar on a terminal only (disable=None): pipes and tests see none

    total = sum(_nbytes(v) for v in flat.values())
    with tqdm(total=total, desc="reading", unit="B", unit_scale=True, disable=None) as bar:
        piece: dict[str, Any] = {}
        size = 0
        for k, v in flat.items():
            piece[k] = v
            size += _nbytes(v)
            if size >= PIECE_BYTES:
                yield piece
                bar.update(size)
                piece, size = {}, 0
        if piece:
            yield piece
            bar.update(size)


def _restore_optimizer_ids(obj: Any) -> None:
    """``{"state": {"0": ...}, "param_groups": [{"params": [0, ...]}]}`` -> int state keys."""
    if isinstance(obj, dict):
        groups, state = obj.get("param_groups"), obj.get("state")
        if isinstance(groups, list) and isinstance(state, dict):
            ids = {p for g in groups if isinstance(g, dict) for p in g.get("params", []) if isinstance(p, int)}
            for k in list(state):
                if isinstance(k, str) and k.isdigit() and int(k) in ids:
                    state[int(k)] = state.pop(k)
        for v in obj.values():
            _restore_optimizer_ids(v)
    elif isinstance(obj, list):
        for v in obj:
            _restore_optimizer_ids(v)


def dcp_to_torch_save(src: str | os.PathLike, out: str | os.PathLike, *, key: str | None = None,
                      force: bool = False, progress: bool = False) -> dict:
    """Write the checkpoint ``src`` (a DCP directory or a root of published checkpoints) as
    one ``torch.save`` file; ``key`` keeps only one part (e.g. ``"model"``, giving a plain
    ``model.load_state_dict`` input). An existing ``out`` is replaced only with ``force``.
    Returns the state dict written."""
    out = os.fspath(out)
    _check_output_file(out, force)
    state = read_full(src, key, progress=progress)
    tmp = f"{out}.tmp-{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, out)
    return state


def local_to_torch_save(src: str | os.PathLike, out: str | os.PathLike, *, key: str | None = None,
                        force: bool = False, progress: bool = False) -> dict:
    """Write the local save in directory ``src`` (``save_local``, any W) as one ``torch.save``
    file of full tensors, nested as saved; ``key`` keeps one top-level entry. Every stored
    tensor is checked against its CRC-32 first. Values saved per rank (they differed between
    ranks) have no full form and are refused by name. ``progress``: a bar with the bytes
    read, on a terminal. Returns the state dict written."""
    out = os.fspath(out)
    _check_output_file(out, force)
    state = read_local_full(os.fspath(src), key, progress=progress)
    tmp = f"{out}.tmp-{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, out)
    return state


def torch_save_to_dcp(
    src: str | os.PathLike, out: str | os.PathLike, *, key: str | None = None, root: bool = False,
    step: int | None = None, force: bool = False,
) -> str:
    """Write the ``torch.save`` file ``src`` as a DCP checkpoint loadable with ``dcp.load``
    at any world size and layout. ``key`` nests it under that name (``{"model": ...}``).
    With ``root=True``, ``out`` is a root and the checkpoint is published atomically as a
    new step there (what ``load_latest`` reads). A DCP checkpoint already in ``out`` is
    replaced only with ``force`` (the new one is written beside it and swapped in, so a
    failed conversion leaves the old one). Returns the DCP directory."""
    state = _torch_load(os.fspath(src))
    if not isinstance(state, dict):
        raise ValueError(f"{src} holds a {type(state).__name__}, not a state dict")
    if key is not None:
        state = {key: state}
    out = os.fspath(out)
    if root:
        if force:
            raise ValueError("force (--force) does not apply with root (--root): a published step is "
                             "never replaced; pick a new step (--step) or leave it to the default")
        return save(state, out, step=step).path
    if os.path.exists(out) and not os.path.isdir(out):
        raise FileExistsError(f"{out} is a file; give a directory for the DCP checkpoint")
    existing = os.path.exists(os.path.join(out, ".metadata"))
    if existing and not force:
        raise FileExistsError(f"{out} already holds a DCP checkpoint; pass --force (force=True) to replace "
                              "it, or pick another directory")
    target = f"{out.rstrip(os.sep)}.tmp-{uuid.uuid4().hex[:8]}" if existing else out
    try:
        with quiet_single_process(True):
            dcp.save(state, storage_writer=ChecksummedWriter(target), no_dist=True, planner=default_save_planner())
    except BaseException:
        if existing:
            shutil.rmtree(target, ignore_errors=True)
        raise
    if existing:
        # two renames: in between, `out` is briefly absent but never half old, half new
        old = f"{out.rstrip(os.sep)}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
        os.rename(target, out)
        shutil.rmtree(old, ignore_errors=True)
    return out


def _check_output_file(out: str, force: bool) -> None:
    """Fail before reading a whole checkpoint when the output cannot (or must not) be written."""
    parent = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        raise IsADirectoryError(f"{out} is a directory; give a file name for the torch.save output")
    if os.path.lexists(out) and not force:
        raise FileExistsError(f"{out} already exists; pass --force (force=True) to overwrite it, or give "
                              "another file name")
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"output directory {parent} does not exist (for {out}); create it first")
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"output directory {parent} is not writable (for {out})")


def _torch_load(src: str):
    """``torch.load(weights_only=True)`` with one clear error for a file that is not one."""
    if not os.path.isfile(src):
        raise FileNotFoundError(f"{src} does not exist" if not os.path.exists(src) else f"{src} is not a file")
    try:
        return torch.load(src, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError, RuntimeError (zip reader), EOFError, ...
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()  # torch colours part of its message
        text = text.splitlines()[0] if text else "no message"
        raise ValueError(f"{src} cannot be read by torch.load(weights_only=True) ({type(e).__name__}: {text}); "
                         "is it a torch.save file?") from None
