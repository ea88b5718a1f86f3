"""Find the fenced ```python blocks of the README and the docs pages, with how each is checked.

Every block is one of three kinds, set by the HTML comment on the line just above its fence:

- no comment: a whole program for one process. It is written to a file and run as
  ``python FILE``.
- ``<!-- example: W=2 -->``: a whole program for 2 ranks. It is written to a file and run
  literally as a reader would run it, ``torchrun --nproc_per_node 2 FILE``; the harness sets
  nothing up, so the block itself must call ``dist.init_process_group`` (torchrun only puts
  the rendezvous in the environment) and end with ``dist.barrier()`` and
  ``dist.destroy_process_group()``.
- ``<!-- example: fragment (reason) -->``: not a whole program (it continues an example
  above, or needs your model, GPUs or a cluster). Compiled, so its syntax is checked, never run.

Any other ``<!-- example: ... -->`` comment is an error (a typo would otherwise turn a
fragment or a W=2 program into a one-process program).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = re.compile(r"<!--\s*example:\s*(?P<how>fragment\b|W=(?P<w>\d+))\s*(\(.*\))?\s*-->")
ANY_MARK = re.compile(r"<!--\s*example:")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")

PROGRAM, RANKS, FRAGMENT = "program", "ranks", "fragment"  # one process, torchrun, compile only


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    code: str
    world: int | None  # ranks under torchrun; None: one process (or a fragment)
    fragment: bool

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def kind(self) -> str:
        return FRAGMENT if self.fragment else RANKS if self.world else PROGRAM

    @property
    def filename(self) -> str:
        """The file the block is run from: named after its page and line."""
        return re.sub(r"\W", "_", self.id) + ".py"

    def command(self, path: Path, python: str, torchrun: str) -> list[str]:
        """How a reader runs the block saved as ``path``."""
        if self.kind == RANKS:
            return [torchrun, "--nproc_per_node", str(self.world), str(path)]
        if self.kind == PROGRAM:
            return [python, str(path)]
        raise ValueError(f"{self.id} is a fragment: it is compiled, not run")


def pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    out, i = [], 0
    rel = str(page.relative_to(ROOT))
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group("lang"):
            i += 1
            continue
        indent, lang, start = len(m.group("indent")), m.group("lang"), i
        i += 1
        body = []
        while i < len(lines) and not FENCE.match(lines[i]):
            body.append(lines[i][indent:])
            i += 1
        i += 1  # the closing fence
        if lang != "python":
            continue
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = MARK.search(prev)
        if not mark and ANY_MARK.search(prev):
            raise ValueError(f"{rel}:{start}: unknown example marker {prev.strip()!r}; use "
                             "<!-- example: W=2 --> or <!-- example: fragment (reason) -->")
        world = int(mark.group("w")) if mark and mark.group("w") else None
        out.append(Block(rel, start + 1, "\n".join(body) + "\n", world,
                         bool(mark and mark.group("how").startswith("fragment"))))
    return out


def all_blocks() -> list[Block]:
    return [b for p in pages() for b in blocks(p)]
