"""Loading that never half-succeeds: compare the state with the checkpoint first.

``dcp.load`` already refuses a key the checkpoint lacks and a tensor of another size, but it
silently ignores what the checkpoint has and the state does not (a checkpoint of a bigger
model, or optimizer states that a fresh optimizer does not have yet). ``load`` here checks
both directions, and tensor shapes, before reading a byte, and names every offending key.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from ragged_fsdp.agreement import first_line
from ragged_fsdp.fsdp import ResidualWarning, is_residual_key

from ._tree import flatten
from .integrity import CheckpointCorruptError, ChecksummedReader
from .scale_planner import default_load_planner, load_planner_error

__all__ = [
    "CheckpointMismatchError", "check_state", "dcp_load_verified", "load", "read_metadata",
    "stateful_to_state_dict",
]


class CheckpointMismatchError(ValueError):
    """The state to load into and the checkpoint disagree; ``missing``, ``unexpected`` and
    ``mismatched`` hold the keys (DCP's dotted keys)."""

    def __init__(self, message: str, missing=(), unexpected=(), mismatched=()):
        super().__init__(message)
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)


def read_metadata(path: str | os.PathLike) -> Metadata:
    """The checkpoint's ``.metadata``; a missing, truncated or foreign file is one clear
    error naming it (FileNotFoundError / CheckpointCorruptError), not an unpickling trace."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        what = "does not exist" if not os.path.exists(path) else "is a file, not a directory"
        raise FileNotFoundError(f"{path} {what}; a DCP checkpoint is a directory holding .metadata")
    md_path = os.path.join(path, ".metadata")
    if not os.path.isfile(md_path):
        raise FileNotFoundError(f"{path} is not a DCP checkpoint (no .metadata file)")
    try:
        md = ChecksummedReader(path).read_metadata()
    except (CheckpointCorruptError, FileNotFoundError):  # already say which file and why
        raise
    except Exception as e:  # EOFError, UnpicklingError, ... from a damaged or foreign file
        raise CheckpointCorruptError(
            f"{md_path} cannot be read ({type(e).__name__}: {first_line(e)}); the file is "
            "truncated, damaged or not DCP metadata"
        ) from None
    if not isinstance(md, Metadata):
        raise CheckpointCorruptError(f"{md_path} holds a {type(md).__name__}, not DCP metadata")
    return md



def _listing(keys, other_tops=None, limit=50) -> str:
    """Keys, with whole top-level entries that the other side lacks folded into one item."""
    keys = list(keys)
    items, folded = [], {}
    for k in keys:
        top = k.split(".", 1)[0]
        if other_tops is not None and top not in other_tops and k != top:
            folded.setdefault(top, 0)
            folded[top] += 1
        else:
            items.append(k)
    items = [f"{t}.* ({n} entries)" for t, n in folded.items()] + items
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def check_state(
    state: dict[str, Any], metadata: Metadata, *, where: str = "the checkpoint", keys: bool = True
) -> None:
    """Raise :class:`CheckpointMismatchError` unless ``state`` (already through
    ``state_dict()`` for Stateful values) has exactly the checkpoint's keys, with tensors
    where it has tensors and of the same global shapes. With ``keys=False`` only entries on
    both sides are compared (what a non-strict load reads)."""
    flat, _ = flatten(state)
    saved = metadata.state_dict_metadata
    missing = sorted(k for k in flat if k not in saved) if keys else []
    # error feedback's residual is optional both ways (fsdp/core/residual_state.py): a model
    # without error feedback ignores a saved one, with a warning
    unexpected = sorted(k for k in saved if k not in flat and not is_residual_key(k)) if keys else []
    mismatched = []
    for k in sorted(set(flat) & set(saved)):
        v, md = flat[k], saved[k]
        if isinstance(md, TensorStorageMetadata):
            if not isinstance(v, torch.Tensor):
                mismatched.append(f"{k} (saved: tensor {tuple(md.size)}; here: {type(v).__name__})")
            elif tuple(v.shape) != tuple(md.size):
                mismatched.append(f"{k} (saved {tuple(md.size)}, here {tuple(v.shape)})")
        elif isinstance(md, BytesStorageMetadata) and isinstance(v, torch.Tensor) and v.dim() > 0:
            mismatched.append(f"{k} (saved: not a tensor; here: tensor {tuple(v.shape)})")
    if missing or unexpected or mismatched:
        state_tops = {k.split(".", 1)[0] for k in flat}
        saved_tops = {k.split(".", 1)[0] for k in saved}
        parts = []
        if missing:
            parts.append(f"keys missing from the checkpoint: {_listing(missing, saved_tops)}")
        if unexpected:
            parts.append(f"keys in the checkpoint that the state lacks: {_listing(unexpected, state_tops)}")
        if mismatched:
            parts.append(f"keys of another shape or kind: {_listing(mismatched)}")
        parts.insert(0, f"checkpoint {where}")
        hint = ""
        if any(".state." in k and k.split(".", 1)[0] in state_tops for k in unexpected):
            hint = (
                " (an optimizer that has not stepped has no state yet: load through "
                "ragged_fsdp.checkpoint.TrainState or set_optimizer_state_dict, which create it)"
            )
        raise CheckpointMismatchError(
            "ragged_fsdp: the checkpoint does not match the state to load into; nothing was "
            "loaded. " + "; ".join(parts) + hint,
            missing, unexpected, mismatched,
        )


def drop_unloadable_residuals(state: dict[str, Any], metadata: Metadata) -> list[str]:
    """Take out of ``state`` (nested, as DCP loads it) the error-feedback residual entries
    the checkpoint cannot fill: absent, or saved at another shape or dtype (another world
    size, layout or ``residual_dtype``). ``load_state_dict`` then finds none and starts
    error feedback from a zero residual, with a ``ResidualWarning``. Returns their keys."""
    flat, mapping = flatten(state)
    saved = metadata.state_dict_metadata
    drop = []
    for k, v in flat.items():
        if not is_residual_key(k):
            continue
        md = saved.get(k)
        if not (isinstance(md, TensorStorageMetadata) and isinstance(v, torch.Tensor)
                and tuple(md.size) == tuple(v.shape) and md.properties.dtype == v.dtype):
            drop.append(k)
    for k in drop:
        parent = state
        path = mapping[k]
        for step in path[:-1]:
            parent = parent[step]
        del parent[path[-1]]
    return drop


def stateful_to_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """What DCP does first: Stateful values (modules, optimizers, TrainState) become their
    ``state_dict()``."""
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}


def load(state: dict[str, Any], path: str | os.PathLike, *, strict: bool = True, process_group=None,
         planner=None) -> None:
    """``dcp.load(state, checkpoint_id=path)`` that checks keys and shapes first (both ways
    when ``strict``) and then calls ``load_state_dict`` on Stateful values, as DCP does.

    ``planner``: a DCP ``LoadPlanner``; default :class:`ScaleLoadPlanner` (DCP's
    ``DefaultLoadPlanner`` with the same plans, whose matching does not compare each local
    chunk with every saved chunk of a tensor; ``allow_partial_load=not strict``). Yours is
    used as given (with ``strict=False`` give it ``allow_partial_load=True``)."""
    err = load_planner_error("load", planner)
    if err:
        raise ValueError(err)
    path = os.fspath(path)
    sd = stateful_to_state_dict(state)
    md = read_metadata(path)
    flat_before, _ = flatten(sd)
    ignored = [k for k in md.state_dict_metadata if is_residual_key(k) and k not in flat_before]
    if ignored:
        warnings.warn(f"ragged_fsdp: {path} holds an error-feedback residual ({_listing(ignored, limit=4)}) and the "
                      "state to load into has none (a model without error feedback): ignored",
                      ResidualWarning, stacklevel=2)
    drop_unloadable_residuals(sd, md)
    # Shapes are compared either way (DCP's own complaint is a traceback inside its
    # exception message); with strict=False, keys on one side only are allowed.
    check_state(sd, md, where=path, keys=strict)
    if planner is None:
        planner = default_load_planner(allow_partial_load=not strict)
    import torch.distributed as dist

    no_dist = not (dist.is_available() and dist.is_initialized())
    dcp_load_verified(sd, path, planner=planner, process_group=process_group, no_dist=no_dist)
    for k, v in list(state.items()):
        if isinstance(v, Stateful):
            v.load_state_dict(sd[k])
        else:  # DCP replaces non-tensor leaves (ints, strings) in the dict it was given
            state[k] = sd[k]


@contextlib.contextmanager
def quiet_single_process(no_dist: bool):
    """DCP warns that it "assumes" one process even when ``no_dist=True`` says so."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def dcp_load_verified(state, path, *, planner=None, process_group=None, no_dist=False) -> None:
    """``dcp.load`` through :class:`ChecksummedReader`; a failure on any rank becomes the
    library's own error with one message (DCP raises a ``CheckpointException``, a
    BaseException whose text is every rank's traceback)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with quiet_single_process(no_dist):
            dcp.load(state, storage_reader=ChecksummedReader(path), planner=planner,
                     process_group=process_group, no_dist=no_dist)
    except CheckpointException as e:
        err = _translate(e, path)
        known = isinstance(err, (CheckpointCorruptError, CheckpointMismatchError))
        raise err from (None if known else e)  # keep DCP's traces for what we cannot name


def _translate(e, path) -> Exception:
    failures = sorted(e.failures.items())
    for cls in (CheckpointCorruptError, CheckpointMismatchError):
        for rank, (exc, _) in failures:
            if isinstance(exc, cls):
                return cls(f"{exc} (rank {rank})")
    for rank, (exc, _) in failures:
        text = first_line(exc)
        if "Size mismatch" in text or "mismatch sizes" in text:
            return CheckpointMismatchError(f"ragged_fsdp: loading {path}: {text} (rank {rank}); nothing "
                                           "of that tensor was loaded")
    rank, (exc, _) = failures[0]
    return RuntimeError(
        f"ragged_fsdp: loading {path} failed on rank(s) {[r for r, _ in failures]}: "
        f"{type(exc).__name__}: {first_line(exc)}"
    )
