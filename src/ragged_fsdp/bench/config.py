"""What one `bench` launch runs (the frameworks, the workloads, rounds and steps): pure Python,
so `python -m ragged_fsdp bench --help` and the parent's argument checks need no torch import;
the launch itself is :mod:`ragged_fsdp.bench.engine`'s."""
from __future__ import annotations

from dataclasses import dataclass

VARIANTS = ("ragged_fsdp", "fsdp2", "fsdp1", "ddp", "local")
MESH_VARIANTS = ("ragged_fsdp", "fsdp2", "local")  # what runs on a (replicate, shard) mesh
WORKLOADS = ("dense", "moe", "dense-1024", "deep")


@dataclass
class BenchConfig:
    world: int = 2
    worlds: tuple[int, ...] = (2, 4)
    rounds: int = 7
    steps: int = 3
    models: tuple[str, ...] = WORKLOADS
    frameworks: tuple[str, ...] = VARIANTS
    batch: int = 4
    seq_len: int = 128
    profile: bool = False
    quick: bool = False  # tiny models, for tests
    mesh: tuple[int, int] | None = None  # (replicate, shard): HSDP on both frameworks
    compile: str | None = None  # torch.compile backend for every block (all frameworks), or None
    out: str = "out/bench_engine.json"
    png: str | None = "out/bench_engine.png"
