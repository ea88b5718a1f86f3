"""Find the fenced ```python blocks of the README and the docs pages, with how each is run.

A block runs in one process unless the HTML comment on the line just above its fence says
otherwise:

- ``<!-- example: skip (reason) -->``: not run (a fragment, or it needs a GPU or a cluster);
- ``<!-- example: W=2 -->``: run on each of 2 gloo ranks with the default process group
  initialised (``tests/_dist.py``), so ``init_device_mesh("cpu", (2,))`` works in it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = re.compile(r"<!--\s*example:\s*(?P<how>skip|W=(?P<w>\d+))\b.*?-->")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    code: str
    world: int | None  # None: one process
    skip: bool

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


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
        world = int(mark.group("w")) if mark and mark.group("w") else None
        out.append(Block(rel, start + 1, "\n".join(body) + "\n", world, bool(mark and mark.group("how") == "skip")))
    return out


def all_blocks() -> list[Block]:
    return [b for p in pages() for b in blocks(p)]


class DocCase:
    """A block as a ``tests/_dist.py`` case: a picklable callable with a name."""

    __module__ = __name__

    def __init__(self, block: Block):
        self.block = block
        self.__name__ = re.sub(r"\W", "_", block.id)

    def __call__(self, rank: int, world: int) -> None:
        run_block(self.block)


def run_block(block: Block) -> None:
    import torch

    torch.manual_seed(0)
    code = compile(block.code, f"{block.page}:{block.line}", "exec")
    exec(code, {"__name__": "__doc_example__"})
