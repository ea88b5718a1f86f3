"""Loading a local save in place at any world size (plan every copy, agree, then copy),
and the one-process views of it (``ckpt info`` / ``convert``)."""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ragged_fsdp.fsdp import is_residual_key, warn_zeroed_residuals

from .local_format import (
    _ANY_PART, _PART, LocalCheckpointCorruptError, LocalCheckpointError, _agree, _existing, _names, _ragged,
    _world_rank,
)
from .local_layout import RunLayout
from .local_read import _mixed, _Parts, local_parts, read_meta
from .local_tree import _container, _flat, _path, _put

__all__ = ["load_local", "describe_local", "read_local_full"]

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
            if is_residual_key(key):  # strict=False, saved without error feedback: a zero residual
                copies.append((_target_range(key, value)[2], None, key))
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
                copies.append((flat_dst, src.reshape(-1), key))
            continue
        _check_tensor(key, value, e["shape"], e["dtype"])
        a, b, dst = _target_range(key, value)
        if e["kind"] == "full":
            if b > a:
                copies.append((dst, parts.tensor(0, key).reshape(-1)[a:b], key))
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
            copies.append((dst[pc.dst_lo:pc.dst_lo + pc.src_hi - pc.src_lo], src[pc.src_lo:pc.src_hi], key))
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
        for dst, src, _ in copies:
            if src is None:
                dst.zero_()
            else:
                dst.copy_(src)
    zeroed = [key for _, src, key in copies if src is None]
    if zeroed:
        warn_zeroed_residuals(zeroed, f"load_local({os.fspath(path)!r})")
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


def read_local_full(path: str, key: str | None = None, *, progress: bool = False) -> dict[str, Any]:
    """The whole local save (or its top-level entry ``key``) as a nested dict of plain CPU
    tensors and values, nested as it was saved, every tensor checked. Values that differed
    per rank have no single full form: refused by name. ``progress``: a bar with the bytes
    assembled and an estimate, on a terminal (``ckpt convert`` turns it on)."""
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
    bar = _bar(chosen, progress)
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
            if bar is not None:
                bar.update(value.numel() * value.element_size())
        _put(out, _path(k, e), value, {tuple(x) for x in meta.get("lists", ())})
    if bar is not None:
        bar.close()
    return out if key is None else out[key]


def _bar(entries: dict[str, dict], progress: bool):
    """A tqdm bar over the tensor bytes of ``entries`` (each read whole, so it advances per
    tensor); none without ``progress``, and none off a terminal (``disable=None``)."""
    if not progress:
        return None
    from tqdm import tqdm

    total = sum(math.prod(e["shape"]) * torch.empty((), dtype=getattr(torch, e["dtype"].replace("torch.", ""))).element_size()
                for e in entries.values() if e["kind"] != "object")
    return tqdm(total=total, desc="reading", unit="B", unit_scale=True, disable=None)
