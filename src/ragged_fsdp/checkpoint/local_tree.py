"""The state dict as the local save walks it: flattened into DCP's dotted keys with each
key's original object path (so a load puts values back where they were, lists as lists), and
rebuilt nested for a full read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ._tree import flatten
from .local_format import HEADER_KEY, LocalCheckpointError

__all__: list[str] = []

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
