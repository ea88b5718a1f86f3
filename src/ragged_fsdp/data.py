"""The demo's data: an embedded corpus generated locally, or any text file, as byte tokens.

The default corpus is made from a small seeded grammar (subjects, verbs, counts, places), so
it has real structure to learn, needs no download, and is the same on every machine.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

VOCAB_SIZE = 256  # bytes

_SUBJECTS = ["the fox", "a small robot", "my neighbour", "the old sailor", "every student",
             "the cat", "our teacher", "a tired engineer", "the river", "some birds"]
_VERBS = ["jumps over", "writes about", "looks at", "walks to", "dreams of", "counts",
          "paints", "follows", "builds", "forgets"]
_OBJECTS = ["the lazy dog", "a red house", "three green apples", "the quiet lake",
            "seven blue boxes", "the long road", "a bright star", "the wooden bridge"]
_PLACES = ["in the morning", "after the rain", "near the station", "before dinner",
           "under the moon", "on monday", "at the market", "by the sea"]


def default_corpus(sentences: int = 20000, seed: int = 1234) -> str:
    rng = random.Random(seed)
    lines = []
    for i in range(sentences):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}"
        if i % 3 == 0:
            a, b = rng.randint(1, 49), rng.randint(1, 49)
            s += f", and {a} plus {b} is {a + b}"
        lines.append(s + ".")
    return "\n".join(lines) + "\n"


def load_tokens(path: str | None = None) -> torch.Tensor:
    """Byte tokens of ``path`` (any text file) or of the default corpus."""
    text = Path(path).read_bytes() if path else default_corpus().encode()
    if len(text) < 1024:
        raise ValueError(f"--data {path}: only {len(text)} bytes; give a text file of at least 1 KiB")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


class Batches:
    """Deterministic random windows: step ``i`` gives the same global batch at every world
    size, and rank ``r`` takes rows ``[r*B/W, (r+1)*B/W)`` of it."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, seed: int = 0):
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (self.global_batch,), generator=g)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        win = self.tokens[idx]
        return win[:, :-1], win[:, 1:]

    def local_batch_at(self, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.global_batch % world:
            raise ValueError(f"global batch {self.global_batch} must be a multiple of the world size {world}")
        x, y = self.global_batch_at(step)
        per = self.global_batch // world
        return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
