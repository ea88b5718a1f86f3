"""The settings every rank's collectives depend on, agreed at the point they take effect.

``fully_shard``'s own arguments are agreed once, in its layout fingerprint (``consistency``).
What changes later does not go through a collective when it is set: a setter called on one
rank only would leave that rank waiting in an exchange the others never enter. So the
setters (``set_reshard_after_forward``/``_backward``, ``set_requires_gradient_sync``,
``set_requires_all_reduce``, ``set_unshard_in_backward``, ``set_gradient_divide_factor``, and
the root's ``set_manual_backward_finalization``)
and ``global_order`` only change this rank's value, and each root forward, before its first
all-gather, compares a fingerprint of every group's values in one small host all-reduce
(``agreement.agree_flags``): ranks that differ raise on every rank, naming the group, the
setting and each rank's value, before any collective pairs the wrong buffers.

``global_order`` also agrees at its call (validate locally, then agree), through the *same*
exchange with another point code: if one rank calls it while another has gone on to its
forward, the two exchanges pair with each other (same shape, same groups) and both ranks raise
"different points" instead of waiting for each other until the timeout.
"""

from __future__ import annotations

import torch.distributed as dist

from ragged_fsdp.agreement import agree, agree_flags

from .consistency import SettingMismatchError, layout_fingerprint

__all__ = ["agree_at_forward", "agree_global_order", "group_settings"]

_FORWARD, _GLOBAL_ORDER = 1, 2
_POINTS = {_FORWARD: "ran forward", _GLOBAL_ORDER: "called global_order"}


def group_settings(g) -> dict[str, str]:
    """This rank's values of ``g``'s settings that change collectives or their results, by
    the name the user sets them with."""
    order = g.global_order
    return {
        "reshard_after_forward (fully_shard / set_reshard_after_forward)": repr(g.reshard_after_forward),
        "set_reshard_after_backward": repr(g.reshard_after_backward),
        "set_requires_gradient_sync": repr(g.reduce_grads),
        "set_requires_all_reduce": repr(g.requires_all_reduce),
        "set_unshard_in_backward": repr(g.unshard_in_backward),
        "set_gradient_divide_factor": repr(g.gradient_divide_factor),
        "global_order micro_batches": repr(order.micro_batches if order is not None else None),
    }


def _host_groups(dps) -> list:
    """The gloo twins of the meshes' shard and replicate groups, each once, in first-use order."""
    out, seen = [], set()
    for dp in dps:
        for comm in (dp.shard, dp.replicate):
            if comm is not None and comm.world_size > 1 and id(comm.group) not in seen:
                seen.add(id(comm.group))
                out.append(comm.host_group)
    return out


def agree_at_forward(states) -> None:
    """At a root forward, before its first collective: every rank of every data-parallel
    mesh under the root has the same settings (one host all-reduce of 5 int64s)."""
    groups = [st.group for st in states if st.group is not None]
    dps = [u.dp for g in groups for u in g.units]
    hosts = _host_groups(dps)
    if not hosts:
        return
    root = root_settings(states[0].ctx)
    # the fingerprint is hashed once per distinct set of values (setters change them rarely)
    raw = (tuple(root.values()), *((g.describe(), *group_settings(g).values()) for g in groups))
    h = _FINGERPRINTS.get(raw)
    if h is None:
        if len(_FINGERPRINTS) > 64:
            _FINGERPRINTS.clear()
        h = _FINGERPRINTS[raw] = _fingerprint(_forward_settings(root, groups))
    _exchange(_FORWARD, lambda: _forward_settings(root, groups), hosts, None, "forward", h)


_FINGERPRINTS: dict[tuple, int] = {}


def root_settings(ctx) -> dict[str, str]:
    """This rank's values of the settings a root holds for every group under it."""
    return {"set_manual_backward_finalization (the root)": repr(ctx.manual_finalization)}


def _forward_settings(root: dict[str, str], groups) -> dict[str, str]:
    return {**root, **{f"{g.describe()}: {k}": v for g in groups for k, v in group_settings(g).items()}}


def _fingerprint(settings: dict[str, str]) -> int:
    return layout_fingerprint([f"{k}={v}" for k, v in settings.items()])


def agree_global_order(dp, micro_batches, error: BaseException | None) -> None:
    """``global_order``: every data-parallel rank passed a valid ``micro_batches`` (``error``:
    this rank's own check failed), the same one, and called it at the same point."""
    settings = {"micro_batches": repr(micro_batches)}
    _exchange(_GLOBAL_ORDER, lambda: settings, _host_groups([dp]), error, "global_order", _fingerprint(settings))


def _exchange(point: int, describe, hosts, error, what: str, h: int) -> None:
    """One all-reduce of ``[point, -point, h, -h, failed]``; only when something differs,
    ``describe()`` (this rank's settings by name) is gathered to say what."""
    if not hosts:
        if error is not None:
            raise error
        return
    h = h if error is None else 0
    got = agree_flags([point, -point, h, -h, int(error is not None)], hosts)
    if got == [point, -point, h, -h, 0]:
        return
    settings = describe()
    # Something differs: every rank saw it, so every rank takes this slower path and gathers
    # the details (the failing rank's error travels with them and is raised everywhere).
    rows = agree(what, (dist.get_rank(), point, settings), group=hosts, error=error, same=False)
    points: dict[int, list[int]] = {}
    for r, p, _ in rows:
        points.setdefault(p, []).append(r)
    if len(points) > 1:
        said = "; ".join(f"rank(s) {sorted(rs)} {_POINTS[p]}" for p, rs in sorted(points.items()))
        raise SettingMismatchError(
            f"ragged_fsdp: the data-parallel ranks are at different points ({said}): global_order(model, "
            "micro_batches=V) must be called on every rank, before the same forward")
    for key in settings:
        values: dict[str, list[int]] = {}
        for r, _, s in rows:
            values.setdefault(s.get(key, "<absent>"), []).append(r)
        if len(values) == 1:
            continue
        listing = "; ".join(f"rank(s) {sorted(rs)}: {v}" for v, rs in values.items())
        if point == _GLOBAL_ORDER:
            raise SettingMismatchError(
                f"global_order: the data-parallel ranks passed different {key} ({listing}); pass the same V on "
                "every rank")
        raise SettingMismatchError(
            f"ragged_fsdp: at this forward the ranks have different values of {key} ({listing}); it changes "
            "which collectives each rank issues, so a mismatch would hang or abort: set it to the same value "
            "on every rank")
    raise SettingMismatchError(f"ragged_fsdp: the ranks' {what} settings differ (their fingerprints disagree)")
