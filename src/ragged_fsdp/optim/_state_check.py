"""What an optimizer checks in a state dict before it loads anything from it.

Two mistakes load "successfully" or fail far from their cause without these checks:

* **another optimizer's state dict** (AdamW8bit's into AdamW: zero moments and foreign keys
  carried on; Shampoo's into AdamW8bit: ``KeyError: 'block_size'`` at the first step). Each
  optimizer names the hyperparameters its param groups need and the state keys each
  parameter may have; a state dict that has others is refused, naming the parameter or
  group, the keys, and (when recognisable) the optimizer that wrote it.
* **a per-rank file from another layout** (``torch.save(opt.state_dict())`` on each rank,
  loaded at another world size or on another rank): its DTensors carry the layout of the
  run that saved them, and resharding them runs collectives over a mesh that no longer
  exists (gloo: ``invalid tensor size``), or silently loads another rank's piece.
  ``state_dict()`` records a layout fingerprint (world size, rank, each parameter's shape,
  layout kind and this rank's element range) under :data:`MARK`; a state dict whose
  DTensors are not this process's own (unpickled from a file) must match it. The check is
  local and runs before any collective, so every rank that got a mismatched file raises,
  and none is left waiting in a collective.

DCP loads are not affected: ``torch.distributed.checkpoint`` fills this process's own state
tensors in place (so the fingerprint, which DCP may carry from another rank, is not
consulted), and ``get_optimizer_state_dict`` drops the top-level :data:`MARK` key.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable
from itertools import chain

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ._layout import layout_of, param_name

__all__ = ["MARK", "layout_record", "check_state_dict", "check_layout"]

MARK = "ragged_fsdp"

# Keys that identify who wrote a state dict (for the message only).
TILE_KEY = re.compile(r"^(factor_matrix|inv_root)_\d+_\d+$")
_SIGNATURES = (
    ("AdamW8bit", {"exp_avg_codes", "exp_avg_sq_codes", "exp_avg_absmax", "exp_avg_sq_absmax"},
     {"block_size", "min_8bit_size"}),
    ("Shampoo", set(), {"max_preconditioner_dim", "precondition_frequency", "grafting_type"}),
    ("Muon", {"momentum_buffer"}, {"ns_steps", "ns_coefficients"}),
    ("an Adam-type optimizer (AdamW)", {"exp_avg", "exp_avg_sq"}, {"amsgrad"}),
)
_WAY_OUT = ("Load a state dict saved by the same optimizer with the same settings; to switch optimizers, "
            "restore the model only (e.g. ragged_fsdp.checkpoint.load(..., strict=False) with the model "
            "alone) and start the new optimizer fresh")


def _guess(state_dict: dict) -> str | None:
    mark = state_dict.get(MARK)
    if isinstance(mark, dict) and isinstance(mark.get("optimizer"), str):
        return mark["optimizer"]
    keys = set(chain.from_iterable(st.keys() for st in state_dict["state"].values() if isinstance(st, dict)))
    gkeys = set(chain.from_iterable(g.keys() for g in state_dict["param_groups"] if isinstance(g, dict)))
    if any(isinstance(k, str) and TILE_KEY.match(k) for k in keys):
        return "Shampoo"
    for name, skeys, groups in _SIGNATURES:
        if (skeys and skeys & keys) or (groups and groups <= gkeys):
            return name
    return None


def _saved_by(state_dict: dict) -> str:
    who = _guess(state_dict)
    return f" (it looks saved by {who})" if who else ""


def _pairs(opt, state_dict: dict):
    """(saved param id, saved group index, saved group, param, current group, index) for every
    parameter, in param-group order (how torch matches saved ids to parameters)."""
    for gi, (g, sg) in enumerate(zip(opt.param_groups, state_dict["param_groups"])):
        for i, (p, sid) in enumerate(zip(g["params"], sg["params"])):
            yield sid, gi, sg, p, g, i


def check_state_dict(
    opt,
    state_dict,
    *,
    group_keys: Callable[[dict, dict], Iterable[str]],
    state_keys: Callable[[dict, torch.Tensor], tuple[set, Callable[[str], bool]]],
) -> None:
    """Refuse ``state_dict`` unless it is shaped like ``opt``'s own, before anything is loaded.

    ``group_keys(saved_group, group)``: hyperparameters the saved group must have (it may
    raise a ValueError itself for a group of another kind). ``state_keys(saved_group,
    param)``: the state keys that parameter must have, and a test for the keys it may have (a
    parameter with no saved
    state at all is accepted: it starts fresh, as torch does)."""
    name = type(opt).__name__
    where = f"{name}.load_state_dict"
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) \
            or not isinstance(state_dict.get("param_groups"), list):
        got = sorted(state_dict)[:8] if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(f"{where}: expected an optimizer state dict with 'state' (a dict) and 'param_groups' "
                         f"(a list), got {got}")
    saved = state_dict["param_groups"]
    if len(saved) != len(opt.param_groups):
        raise ValueError(f"{where}: the state dict has {len(saved)} param group(s), this optimizer "
                         f"{len(opt.param_groups)}{_saved_by(state_dict)}. {_WAY_OUT}")
    for gi, (g, sg) in enumerate(zip(opt.param_groups, saved)):
        if not isinstance(sg, dict) or "params" not in sg:
            raise ValueError(f"{where}: param group {gi} of the state dict is not a dict with 'params'")
        if len(sg["params"]) != len(g["params"]):
            raise ValueError(f"{where}: param group {gi} of the state dict has {len(sg['params'])} parameters, "
                             f"this optimizer's {len(g['params'])}; it was saved for another model or grouping")
        missing = sorted(set(group_keys(sg, g)) - set(sg))
        if missing:
            raise ValueError(
                f"{where}: param group {gi} of the state dict lacks {missing}, hyperparameters {name} needs; "
                f"it has {sorted(k for k in sg if k != 'params')}{_saved_by(state_dict)}. Nothing was loaded. "
                f"{_WAY_OUT}")
    for sid, gi, sg, p, g, i in _pairs(opt, state_dict):
        st = state_dict["state"].get(sid)
        if not st:
            continue
        pname = param_name(g, i, p, gi)
        if not isinstance(st, dict):
            raise ValueError(f"{where}: the state of parameter {pname} is a {type(st).__name__}, not a dict")
        required, allowed = state_keys(sg, p)
        keys = set(st)
        extra = sorted((k for k in keys if not allowed(k)), key=str)
        lacks = sorted(required - keys)
        if extra or lacks:
            parts = ([f"keys {name} does not keep: {extra}"] if extra else []) + \
                    ([f"lacks {lacks}"] if lacks else [])
            raise ValueError(
                f"{where}: the saved state of parameter {pname} has keys {sorted(keys, key=str)} ("
                + "; ".join(parts) + f"), where {name} with these settings keeps {sorted(required)}"
                f"{_saved_by(state_dict)}. Nothing was loaded. {_WAY_OUT}")
        for k, v in st.items():
            if k != "step" and not isinstance(v, torch.Tensor):
                raise ValueError(f"{where}: state {k!r} of parameter {pname} is a {type(v).__name__}, not a "
                                 f"tensor{_saved_by(state_dict)}. Nothing was loaded. {_WAY_OUT}")


# -- per-rank files: the layout fingerprint ------------------------------------------------

def _where_am_i() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _param_layouts(opt) -> list[tuple]:
    out = []
    for p in chain.from_iterable(g["params"] for g in opt.param_groups):
        try:
            lay = layout_of(p)
        except ValueError:  # a DTensor layout only torch's per-tensor fallback steps (AdamW)
            out.append((tuple(p.shape), repr(tuple(p.placements)), (0, p.to_local().numel()), p.device_mesh.size(),
                        tuple(p.device_mesh.get_coordinate() or ())))
            continue
        out.append((tuple(lay.shape), lay.kind, tuple(lay.local_range), lay.world,
                    tuple(lay.outer_offset) if lay.outer_offset is not None else None))
    return out


def layout_record(opt) -> dict:
    """What ``state_dict()`` stores under :data:`MARK`: who saved it and this rank's layout."""
    world, rank = _where_am_i()
    params = _param_layouts(opt)
    return {"optimizer": type(opt).__name__, "world_size": world, "rank": rank,
            "layout": hashlib.sha1(repr(params).encode()).hexdigest()[:16], "params": params}


def _foreign_dtensors(opt, state_dict) -> bool:
    """Whether the state dict holds DTensors that are not on this process's meshes (read back
    from a file, not this process's own state filled in place by DCP)."""
    live = {id(getattr(p, "device_mesh", None)) for g in opt.param_groups for p in g["params"]
            if isinstance(p, DTensor)}
    for st in state_dict["state"].values():
        if isinstance(st, dict):
            for v in st.values():
                if isinstance(v, DTensor) and id(v.device_mesh) not in live:
                    return True
    return False


_LAYOUT_WAY_OUT = (
    "Per-rank optimizer files (torch.save(opt.state_dict()) on each rank) load only at the world size, "
    "on the rank and with the layout they were saved with. To resume at another world size or layout, "
    "save through DCP (ragged_fsdp.checkpoint.save with TrainState, or get_optimizer_state_dict + "
    "dcp.save), or a full state dict (get_optimizer_state_dict(model, opt, "
    "options=StateDictOptions(full_state_dict=True))), which reshard on load")


def _norm(x):
    return tuple(_norm(y) for y in x) if isinstance(x, (list, tuple)) else x


def check_layout(opt, state_dict) -> None:
    """Refuse a per-rank state dict saved under another world size, rank or layout (local:
    no collective, so every rank with a mismatched file raises)."""
    if not _foreign_dtensors(opt, state_dict):
        return
    where = f"{type(opt).__name__}.load_state_dict"
    world, rank = _where_am_i()
    mark = state_dict.get(MARK)
    if not isinstance(mark, dict):
        for sid, gi, sg, p, g, i in _pairs(opt, state_dict):
            for k, v in (state_dict["state"].get(sid) or {}).items():
                mesh = getattr(p, "device_mesh", None)
                if isinstance(v, DTensor) and (mesh is None or v.device_mesh != mesh):
                    raise ValueError(
                        f"{where} (rank {rank} of {world}): state {k!r} of parameter {param_name(g, i, p, gi)} "
                        f"is a DTensor on mesh {v.device_mesh} but the parameter is on "
                        f"{mesh if mesh is not None else 'no mesh (unsharded)'}; nothing was loaded. "
                        + _LAYOUT_WAY_OUT)
        return
    diffs = []
    if mark.get("world_size") != world:
        diffs.append(f"world size {mark.get('world_size')} -> {world}")
    if mark.get("rank") != rank:
        diffs.append(f"saved by rank {mark.get('rank')}, loaded on rank {rank}")
    mine = _param_layouts(opt)
    theirs = [_norm(x) for x in mark.get("params") or []]
    if not diffs and len(theirs) != len(mine):
        diffs.append(f"{len(theirs)} parameters saved, {len(mine)} here")
    if not diffs or (len(theirs) == len(mine) and theirs != mine):
        names = [param_name(g, i, p, gi) for gi, g in enumerate(opt.param_groups) for i, p in enumerate(g["params"])]
        for n, a, b in zip(names, theirs, mine):
            if a != b:
                diffs.append(f"parameter {n}: shape {a[0]}, {a[1]} layout, elements [{a[2][0]}, {a[2][1]}) of "
                             f"{a[3]} rank(s) when saved; here shape {b[0]}, {b[1]}, [{b[2][0]}, {b[2][1]}) of {b[3]}")
                break
    if diffs:
        raise ValueError(f"{where} (rank {rank} of {world}): this per-rank state dict was saved under another "
                         f"layout: {'; '.join(diffs)}. Nothing was loaded. {_LAYOUT_WAY_OUT}")
