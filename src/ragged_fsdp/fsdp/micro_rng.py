"""Randomness that depends on the micro-batch, not on the rank that runs it.

Under ``global_order(model, V)`` micro-batch ``j`` of step ``s`` runs on rank ``j mod W``, so a
dropout mask drawn from a rank's global RNG depends on ``W`` and on how many micro-batches
that rank ran before: a run restarted at another world size (or one that never failed) draws
other masks, and its bits differ. Seeding from ``(run seed, step, j)`` instead makes the mask a
function of the micro-batch alone, whatever rank runs it, and needs no RNG state in a
snapshot::

    for j in det.micro_batches(model):
        with micro_batch_rng(seed, step, j):     # dropout inside the model draws from it
            loss = model.loss(*batch(step, j))
        loss.backward()                          # the masks were saved by the forward

Backward needs no RNG (the forward saved the masks); activation checkpointing's recompute
restores the RNG state it saw at the forward (torch's default, ``preserve_rng_state=True``).
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["micro_batch_seed", "micro_batch_generator", "micro_batch_rng"]

_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    # splitmix64's finaliser: nearby (seed, step, j) give unrelated 64-bit seeds
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def micro_batch_seed(seed: int, step: int, j: int) -> int:
    """A 63-bit seed that is a function of ``(seed, step, j)`` only."""
    for name, v in (("seed", seed), ("step", step), ("j", j)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"micro_batch_seed: {name} must be a non-negative int, got {v!r}")
    return _mix(_mix(_mix(seed) ^ step) ^ j) >> 1


def micro_batch_generator(seed: int, step: int, j: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A fresh ``torch.Generator`` on ``device`` seeded by :func:`micro_batch_seed`, for calls
    that take ``generator=`` (``torch.rand``, ``torch.randperm``, a sampler)."""
    g = torch.Generator(device=device)
    g.manual_seed(micro_batch_seed(seed, step, j))
    return g


@contextlib.contextmanager
def micro_batch_rng(seed: int, step: int, j: int):
    """Inside: torch's global RNG (CPU, and the current CUDA device when there is one) seeded
    by :func:`micro_batch_seed`, for modules that draw from it (``nn.Dropout``); after: the
    global RNG as it was before, so code outside sees no difference."""
    value = micro_batch_seed(seed, step, j)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.random.default_generator.manual_seed(value)  # not torch.manual_seed: it also seeds every
        for d in devices:                                   # CUDA device, outside the fork's restore
            torch.cuda.manual_seed(value)
        yield
