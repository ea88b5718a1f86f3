"""Every rank agrees, or every rank raises: the one protocol for settings ranks must share.

Why one protocol: a rank that raises alone leaves the others waiting in their next collective
until the process-group timeout, and a value that differs between ranks makes them enter
different collectives (a size mismatch aborts gloo; NCCL hangs). So every argument that ranks
must share is first validated on each rank (``validate`` below, or the caller's own check),
then the validity *and* the value travel in one exchange: an invalid value on one rank is a
clear error on all of them, a value that differs is an error naming each rank's value, and
only then does anyone act on it.

Two forms:
- ``agree(what, value, ...)``: host objects (any picklable value). With ``same=True`` the
  common case is one all-reduce of a digest and an error flag; only when a rank failed or the
  digests differ does an ``all_gather_object`` per group bring every rank's value, to name
  them. For setup and per-call settings, never per micro-step.
- ``agree_flags(flags, ...)``: a few integers MAX-reduced in one all-reduce; for the hot path
  (end-of-backward flags), where pickling per step would cost host time.

Groups: ``group`` is one process group, or a sequence of them (HSDP's shard and replicate
groups), or a ``DeviceMesh`` (every dim); None is the default group. These exchanges are host
facts: on NCCL they run on each group's gloo twin (``Comm.host_group``).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ragged_fsdp.comm import Comm

__all__ = ["first_line", "agree", "agree_flags", "raise_everywhere", "DisagreementError"]


class DisagreementError(ValueError):
    """Ranks passed different values for a setting they must share."""


def first_line(e: BaseException | str) -> str:
    """The first line of an error's message (its type name when it has none)."""
    text = (e if isinstance(e, str) else str(e)).strip()
    if text:
        return text.splitlines()[0]
    return "no message" if isinstance(e, str) else type(e).__name__


def _groups(group) -> list:
    """The host (gloo) groups to exchange over: each group's own on gloo, its gloo twin
    (``Comm.host_group``, made on first use by the ranks that are all here anyway) on NCCL, so
    the CPU tensors below never need a device copy and NCCL groups work too."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return []
        group = dist.group.WORLD
    if hasattr(group, "get_group") and hasattr(group, "ndim"):  # a DeviceMesh
        group = [group.get_group(d) for d in range(group.ndim)]
    if not isinstance(group, (list, tuple)):
        group = [group]
    return [_host(g) for g in group if g is not None]


def _host(g):
    if dist.get_world_size(g) == 1:
        return g
    comm = Comm.of(g)
    # only an accelerator group needs a gloo twin; gloo (and test backends such as "fake")
    # exchange host tensors themselves
    return comm.host_group if "nccl" in comm.backend else g


def _digest(value: Any) -> int:
    """A 56-bit digest of a value (pickled; its repr when it cannot be pickled). Equal values
    almost always digest alike; when they do not (a set pickled in another order), the slow
    path below compares the values themselves, so a false difference costs one gather, never
    a wrong error."""
    try:
        data = pickle.dumps(value, protocol=4)
    except Exception:
        data = repr(value).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


def _size(g) -> int:
    return dist.get_world_size(g)


def _count(groups) -> int:
    n = 1
    for g in groups:
        n *= _size(g)
    return n


def _rank_label() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _rebuild(kind: Any, text: str) -> BaseException:
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(text)
        except Exception:  # an exception type that takes other arguments
            pass
    return ValueError(text)


def agree(
    what: str,
    value: Any = None,
    *,
    group=None,
    error: BaseException | str | None = None,
    validate: Callable[[Any], str | None] | None = None,
    same: bool = True,
    fix: str = "pass the same value on every rank",
) -> list[Any]:
    """Exchange ``(error, value)`` with every rank of ``group``; return every rank's value
    (in the order of the groups' ranks; replica-major for HSDP).

    ``validate(value)`` returns an error message or None. If any rank has an error, every
    rank raises: its own error if it has one (same type), else the same message prefixed by
    the failing rank. With ``same=True``, values that differ raise ``DisagreementError``
    on every rank, naming each rank's value and ``fix``."""
    if error is None and validate is not None:
        try:
            error = validate(value)
        except Exception as e:  # the validator itself choked on the value: that is the error
            error = e
    groups = [g for g in _groups(group) if _size(g) > 1]
    me = _rank_label()
    if not groups:
        if error is not None:
            raise error if isinstance(error, BaseException) else ValueError(error)
        return [value]
    if same:
        # the common case in one small all-reduce: nobody failed and every digest is equal
        h = _digest(value)
        hi, neg_lo, failed = agree_flags([h, -h, int(error is not None)], groups)
        if not failed and hi == h and -neg_lo == h:
            return [value] * _count(groups)
    kind = type(error) if isinstance(error, BaseException) else ValueError
    entry = (me, None if error is None else (kind, first_line(error) if isinstance(error, str) else str(error)), value)
    rows = [entry]
    for g in groups:
        gathered: list = [None] * _size(g)
        dist.all_gather_object(gathered, rows, group=g)
        rows = [row for part in gathered for row in part]
    bad = [(r, e) for r, e, _ in rows if e is not None]
    if bad:
        if error is not None:
            raise error if isinstance(error, BaseException) else ValueError(error)
        ranks = sorted({r for r, _ in bad})
        k, text = bad[0][1]
        raise _rebuild(k, f"{what} failed on rank(s) {ranks}, so on every rank: {first_line(text)}")
    values = [v for _, _, v in rows]
    if same and any(not _equal(v, values[0]) for v in values[1:]):
        by_value: list[tuple[Any, list[int]]] = []
        for r, _, v in rows:
            for seen, rs in by_value:
                if _equal(seen, v):
                    rs.append(r)
                    break
            else:
                by_value.append((v, [r]))
        listing = "; ".join(f"rank(s) {rs}: {v!r}" for v, rs in by_value)
        raise DisagreementError(f"{what} differs across ranks ({listing}); {fix}")
    return values


def _equal(a, b) -> bool:
    try:
        out = a == b
        return bool(out) if not isinstance(out, torch.Tensor) else bool(out.all())
    except Exception:
        return repr(a) == repr(b)


def agree_flags(flags: Sequence[int], group=None) -> list[int]:
    """MAX of each integer over every rank of ``group`` (one all-reduce per group, a CPU
    int64 tensor, on the groups' gloo twins). Encode "any rank" as a max;
    "every rank" and "all equal" as the max of ``[x, -x]``."""
    t = torch.tensor(list(flags), dtype=torch.int64)
    for g in _groups(group):
        if _size(g) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
    return [int(x) for x in t.tolist()]


def raise_everywhere(what: str, error: BaseException | None, group=None) -> None:
    """If any rank of ``group`` has an error, every rank raises (one small all-reduce when
    no rank failed; the failing message travels only when one did)."""
    groups = [g for g in _groups(group) if _size(g) > 1]
    if not groups:
        if error is not None:
            raise error
        return
    me = _rank_label()
    world = dist.get_world_size()
    (failed,) = agree_flags([world - me if error is not None else 0], group)
    if failed == 0:
        return
    agree(what, None, group=group, error=error, same=False)
