"""Argument checks shared by the subcommands that start ranks (`demo`, `bench`).

Everything here runs in the parent process, before torchrun or the bench's spawned ranks exist:
a bad value found in a rank is found N times, after N torch imports, and a world of zero ranks
is never found at all (the parent waits for ranks that were never started).
"""
from __future__ import annotations

import os


class UsageError(SystemExit):
    """A refused command line: exit code 2 (argparse's), one line on stderr.

    A ``SystemExit`` so that callers of ``cli.main`` (and ``cli.bench.run``) stop as argparse
    stops them; its text is the message, which ``cli.main`` prints before passing it on (with
    an integer code Python itself prints nothing)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message
        self.code = 2

    def __str__(self) -> str:
        return self.message


def positive_int(flag: str, value, what: str = "at least 1") -> int:
    """``value`` (an int from argparse, or text) as an integer >= 1, or a UsageError naming ``flag``."""
    if isinstance(value, str):
        value = whole_number(flag, value, value)
    if value < 1:
        raise UsageError(f"{flag} {value}: must be {what}")
    return value


def whole_number(flag: str, text: str, shown: str) -> int:
    """One whole number of a flag's (comma-separated) text; ``shown`` is the flag's whole value."""
    t = text.strip()
    # Digits only: int() would also take "1_000", and "nan", "2.5" or "inf" are refused by name
    # rather than rounded or passed on to a rank.
    if not t.lstrip("+-").isdigit():
        raise UsageError(f"{flag} {shown}: {t!r} is not a whole number; expected e.g. {flag} 2")
    return int(t)


def choices(flag: str, text: str, valid, what: str = "") -> tuple[str, ...]:
    """A comma list of names, each one of ``valid``; refused by name with the valid list."""
    names = tuple(x.strip() for x in text.split(","))
    if not text.strip() or any(not n for n in names):
        raise UsageError(f"{flag} {text!r}: expected a comma list of {what or 'names'} from {', '.join(valid)}")
    bad = [n for n in names if n not in valid]
    if bad:
        raise UsageError(f"{flag} {text}: unknown {', '.join(map(repr, bad))}; "
                         f"expected a comma list of {what or 'names'} from {', '.join(valid)}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"{flag} {text}: {', '.join(twice)} listed twice; name each once")
    return names


def output_path(flag: str, path: str) -> None:
    """A file the run writes at its end: refuse now what would fail then (a directory in its
    place, a file where a parent directory must go, a parent that cannot be written), instead
    of losing a finished run to it."""
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a directory; give a file path")
    output_dir(flag, os.path.dirname(os.path.abspath(path)), shown=path)


def output_dir(flag: str, path: str, shown: str | None = None) -> None:
    """A directory the run creates (or reuses) at its end; see output_path."""
    shown = path if shown is None else shown
    d = os.path.abspath(path)
    while not os.path.exists(d):  # the nearest existing ancestor is what must be a writable directory
        d = os.path.dirname(d)
    if not os.path.isdir(d):
        raise UsageError(f"{flag} {shown}: {d} is a file, not a directory; choose another path")
    if not os.access(d, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {shown}: {d} is not writable; choose another path")
