"""Cross-rank agreement on a group's layout.

Each rank plans its group's buffers on its own. If the inputs differ between ranks (a
``granularity_fn`` or a model whose answer depends on the rank, parameters created in another
order), the all-gathers would put one rank's tensors where another expects different ones:
silently wrong when the buffer sizes happen to match, a collective abort when they do not.
So ``fully_shard`` compares a 62-bit fingerprint of the layouts, and of its arguments that
change collectives (``mp_policy``, ``reshard_after_forward``, ``ignored_params``,
``gradient_reduce``), with one all-reduce (``agreement.agree_flags``: MAX of ``h`` and of
``-h`` agree only if every rank has the same ``h``), and only when they differ pays for
gathering the descriptions (``agreement.agree``) to say where.
"""

from __future__ import annotations

import hashlib

import torch.distributed as dist

from ragged_fsdp.agreement import DisagreementError, agree, agree_flags

__all__ = [
    "describe_layouts", "layout_fingerprint", "check_same_layout", "check_same_answers",
    "LayoutMismatchError", "SettingMismatchError",
]


class LayoutMismatchError(RuntimeError):
    """Ranks planned different layouts for the same ``fully_shard`` group."""


def describe_layouts(layouts, dtypes, per_rank: bool = True) -> list[str]:
    """One line per tensor: what must be identical on every rank (not the rank's own piece).

    ``per_rank=False`` leaves out ``local_units`` (W numbers per tensor): they follow from the
    line's other fields, since ``BufferLayout.from_plan`` checked that the placement hands
    each rank exactly its segment of ``[offset, offset + numel)`` in a buffer of ``W x S``.
    The fingerprint hashes that short form, so its cost per rank does not grow with W."""
    lines = []
    for b, (layout, dtype) in enumerate(zip(layouts, dtypes)):
        lines.append(f"buffer {b}: dtype={dtype} S={layout.segment} W={layout.world_size}")
        for s in layout.slots:
            pl = s.placement
            ranks = f" local_units={tuple(pl.local_units)}" if per_rank else ""
            lines.append(
                f"  {s.key}: shape={tuple(s.shape)} offset={s.offset} dims={tuple(pl.dims)} "
                f"unit={pl.unit}{ranks}"
            )
    return lines


def layout_fingerprint(lines: list[str]) -> int:
    digest = hashlib.blake2b("\n".join(lines).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


def check_same_layout(comm, mesh, layouts, dtypes, error: Exception | None, what: str,
                      settings: dict[str, object] | None = None) -> None:
    """Raise on every rank if any rank failed to plan or planned something else, or passed
    other ``settings`` (``fully_shard`` arguments every rank's collectives depend on, such
    as ``gradient_reduce``: a rank sending int8 codes to a rank expecting bf16 pieces aborts
    the process in the first backward).

    ``error`` is this rank's planning failure (None if it planned): raising it before the
    collective would leave the other ranks waiting in theirs until the timeout. The
    fingerprint is compared over every rank of the data-parallel ``mesh`` (HSDP's replicas
    too), one all-reduce per mesh dim."""
    settings = settings or {}
    if mesh.size() == 1:
        if error is not None:
            raise error
        return
    said = [f"setting {k}={v!r}" for k, v in settings.items()]
    h = layout_fingerprint(describe_layouts(layouts, dtypes, per_rank=False) + said) if error is None else 0
    failed, hi, neg_lo = agree_flags([int(error is not None), h, -h], mesh)
    if error is not None:
        raise error
    if failed:
        raise ValueError(
            f"fully_shard: another rank could not lay out the parameters of {what} (see its "
            "error); every rank must pass the same parameters and granularity_fn answers"
        )
    if hi == h and -neg_lo == h:
        return
    if settings:
        _check_same_settings(mesh, settings, what)
    lines = describe_layouts(layouts, dtypes)  # the full form, only to name the difference
    everyone = agree(what, lines, group=comm.group, same=False)
    mine = everyone[comm.rank]
    diff = ""
    for r, other in enumerate(everyone):
        if other == mine:
            continue
        # name the first tensor that differs (the per-buffer header only if none does)
        for only_tensors in (True, False):
            pairs = [(a, b) for a, b in zip(_pad(mine, other), _pad(other, mine))
                     if a != b and (a.startswith("  ") or b.startswith("  ") or not only_tensors)]
            if pairs:
                a, b = pairs[0]
                diff = f"rank {comm.rank} has\n    {a.strip()}\nrank {r} has\n    {b.strip()}"
                break
        break
    if not diff:
        diff = "the replicas of the mesh (HSDP) planned different layouts"
    raise LayoutMismatchError(
        f"fully_shard: ranks planned different layouts for {what}; {diff}\n"
        "The parameters (names, shapes, dtypes, order) and the granularity_fn answers must be "
        "the same on every rank: a granularity_fn must not depend on the rank"
    )


class SettingMismatchError(DisagreementError):
    """Ranks passed different values of a ``fully_shard`` setting their collectives depend on."""


def _check_same_settings(mesh, settings: dict[str, object], what: str) -> None:
    """Only when the fingerprints differ: gather every rank's settings and raise on every
    rank, naming the setting, the field that differs and each rank's value."""
    everyone = agree(what, (dist.get_rank(), {k: repr(v) for k, v in settings.items()},
                            {k: _fields(v) for k, v in settings.items()}), group=mesh, same=False)
    for name in settings:
        values = {rank: said[name] for rank, said, _ in everyone}
        if len(set(values.values())) == 1:
            continue
        fields = [f for f in _field_names(everyone, name)
                  if len({fs[name].get(f, "<absent>") for _, _, fs in everyone}) > 1]
        which = f" (they differ in {', '.join(fields)})" if fields else ""
        per_rank = "\n".join(f"  rank {r}: {name}={v}" for r, v in sorted(values.items()))
        raise SettingMismatchError(
            f"fully_shard: ranks passed different {name} for {what}{which}:\n{per_rank}\n"
            f"Pass the same {name} on every rank: every rank's collectives depend on it (the all-gathers' "
            "and reductions' formats, which collectives run when)")


def _fields(v) -> dict[str, str]:
    import dataclasses

    if v is None or not dataclasses.is_dataclass(v):
        return {"value": repr(v)}
    return {f.name: repr(getattr(v, f.name)) for f in dataclasses.fields(v)}


def _field_names(everyone, name: str) -> list[str]:
    names: list[str] = []
    for _, _, fs in everyone:
        for f in fs[name]:
            if f not in names:
                names.append(f)
    return names


def _pad(a: list[str], b: list[str]) -> list[str]:
    return a + ["<none>"] * (len(b) - len(a))


def check_same_answers(mesh, lines: list[str], error: Exception | None, what: str) -> None:
    """Raise on every rank of ``mesh`` if any rank failed to place its parameters or placed
    them on other meshes (``lines``: one rank-independent line per parameter, see
    ``mesh_info.place_params``).

    Each rank builds its groups' buffers over the meshes its ``shard_placement_fn`` chose;
    if those differ between ranks, the ranks enter collectives on different groups and wait
    for each other until the timeout. So before any of that, every rank of the mesh passed to
    ``fully_shard`` compares a fingerprint of its answers (and its failure flag); only when they
    differ does a second all-reduce of one fingerprint per parameter find the first parameter
    whose answer differs, so that every rank names the same one."""
    if mesh.size() == 1:
        if error is not None:
            raise error
        return
    h = layout_fingerprint(lines) if error is None else 0
    n = len(lines) if error is None else 0
    failed, hi, neg_lo, n_hi, neg_n_lo = agree_flags([int(error is not None), h, -h, n, -n], mesh)
    if error is not None:
        raise error
    if failed:
        raise ValueError(
            f"fully_shard: shard_placement_fn or the parameter placement failed on another rank "
            f"for {what} (see its error); every rank must give every parameter the same answer"
        )
    if hi == h and -neg_lo == h:
        return
    fix = ("shard_placement_fn must give each parameter the same answer on every rank (the same "
           "mesh, sliced from the same root mesh by the same dim names): it must not depend on the rank")
    if n_hi != -neg_n_lo:
        raise LayoutMismatchError(
            f"fully_shard: ranks collected {-neg_n_lo} to {n_hi} parameters for {what} (this rank "
            f"{n}); every rank must wrap the same module with the same parameters")
    each = [layout_fingerprint([line]) for line in lines]
    both = agree_flags(each + [-x for x in each], mesh)
    for i, line in enumerate(lines):
        if both[i] != each[i] or -both[n + i] != each[i]:
            name, _, mine = line.partition(": ")
            raise LayoutMismatchError(
                f"fully_shard: ranks disagree on the mesh of parameter {name!r} of {what}: this "
                f"rank ({dist.get_rank()}) has {mine}, another rank of the mesh has another. {fix}")
    raise LayoutMismatchError(f"fully_shard: ranks disagree on the parameter meshes of {what}. {fix}")
