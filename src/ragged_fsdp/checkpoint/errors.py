"""The errors ``save`` raises.

DCP reports a failed write as ``CheckpointException``, a ``BaseException`` (so
``except Exception`` misses it) whose text is every rank's traceback. ``save`` raises these
instead: ordinary ``Exception`` subclasses (``OSError`` ones, as the failures underneath
are: a full disk, a directory that cannot be written), with a one-paragraph message naming
the rank(s) and the underlying error.
"""

from __future__ import annotations

from ragged_fsdp.agreement import first_line

__all__ = ["CheckpointSaveError", "CheckpointLockedError", "CheckpointWarning", "describe_failures"]


class CheckpointSaveError(OSError):
    """A checkpoint could not be saved; nothing was published and this save's partial
    directory was removed. ``ranks``: the ranks that failed (when known)."""

    def __init__(self, message: str, ranks: list[int] | None = None):
        super().__init__(message)
        self.ranks = list(ranks or [])

    def __str__(self) -> str:  # OSError's str would show the args tuple for 2+ args
        return self.args[0] if self.args else ""

    def __reduce__(self):  # keeps ranks through pickling (broadcast_object_list)
        return (type(self), (self.args[0] if self.args else "", self.ranks))


class CheckpointLockedError(CheckpointSaveError):
    """Another writer holds the root's lock (or took it away during this save); nothing was
    written or deleted."""


class CheckpointWarning(UserWarning):
    """Something a save or load did that the caller should know about: a stale lock broken,
    a newer but incomplete checkpoint skipped, a step saved below the newest one."""



def describe_failures(failures: dict) -> tuple[str, list[int]]:
    """``rank(s) [0, 1]: OSError: [Errno 28] No space left on device`` for DCP's
    ``CheckpointException.failures`` (rank -> (exception, traceback)); one line per distinct
    error, so W ranks failing alike give one line, not W tracebacks."""
    by_text: dict[str, list[int]] = {}
    for rank, value in sorted(failures.items()):
        exc = value[0] if isinstance(value, tuple) else value
        by_text.setdefault(f"{type(exc).__name__}: {first_line(exc)}", []).append(rank)
    parts = [f"rank(s) {ranks}: {text}" for text, ranks in by_text.items()]
    return "; ".join(parts), sorted(failures)
