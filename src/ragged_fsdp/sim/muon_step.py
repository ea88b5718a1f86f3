"""ragged_fsdp's Muon step at scale, with and without the bounded step, from matrix shapes.

``simulate`` costs Muon's Newton-Schulz time and counts one matrix's workspace as the step's
temporaries; this module models the step itself, per rank, for the two ways
``ragged_fsdp.optim.Muon`` can run it (``wave_bytes``):

* **one wave** (``wave_bytes=None``, the step before issue 46): every rank casts all its
  local pieces to bf16 at once, owners receive all their pieces, keep every owned result
  until the return all-to-all, and the return trip has its own send and receive buffers:
  ``4 x 2 x E / W`` bytes (``E`` matrix elements, ``W`` ranks; ``2 x 2 x E / W`` when the
  layout keeps matrices whole and nothing moves) plus the largest matrix's Newton-Schulz
  workspace. Time: every piece travels, then every matrix is orthogonalised, then every
  result travels: ``comm + compute``.
* **bounded** (waves of at most ``wave_bytes`` of whole bf16 matrices): the owner of a wave
  holds the assembled matrix and its Newton-Schulz workspace (the next iterate and two Gram
  products, :func:`~ragged_fsdp.optim.muon_plan.ns_workspace_bytes`), and the next wave's
  pieces are in flight (send and receive, ``2 x max(wave, largest matrix) / W``).
  Time: wave ``k + 1`` travels while wave ``k`` is orthogonalised: per wave
  ``max(compute, comm)``, plus two all-to-all latencies per wave.

The buffers and when each goes are the optimizer's own record
(:mod:`ragged_fsdp.optim.muon_buffers`), and the waves are cut by its own rule
(:func:`ragged_fsdp.optim.muon_plan.cut_waves`).

Owners balance flops, so compute is ``flops / W / rate`` in both. The all-to-all moves
``(W - 1) / W`` of each rank's pieces out and the results back. The transient of the
largest matrix is what the bounded step cannot go below: an owner needs the whole matrix.

    python -m ragged_fsdp.sim.muon_step [--model llama3-70b] [--gpus 256] [--profile h100]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass

from ragged_fsdp.optim.muon_buffers import BF16, in_flight_bytes, ns_floor_bytes, ns_workspace_bytes, one_wave_bytes
from ragged_fsdp.optim.muon_plan import cut_waves, newton_schulz_flops

from .comm import alltoall_time

__all__ = ["MuonStep", "muon_step", "matrices_of_arch", "main"]


@dataclass
class MuonStep:
    mode: str  # "one wave" | "bounded"
    world: int
    waves: int
    transient_bytes: float  # per rank (the worst rank for the bounded step)
    compute_s: float
    comm_s: float
    step_s: float


def matrices_of_arch(arch) -> list[tuple[int, int]]:
    """Muon's matrices of a catalog architecture: 2-D hidden weights and each expert of a
    3-D tensor; not the embedding, the head, or tensors below 2-D."""
    out = []
    for _, tensors in arch.groups:
        for name, shape in tensors:
            if "embed_tokens" in name or "lm_head" in name or len(shape) < 2:
                continue
            if len(shape) == 3:
                out.extend([(shape[1], shape[2])] * shape[0])
            else:
                out.append((shape[0], math.prod(shape[1:])))
    return out


def muon_step(matrices: list[tuple[int, int]], world: int, profile, wave_bytes: int | None,
              whole: bool = False) -> MuonStep:
    """Per-rank transient bytes and seconds of one Muon step over ``matrices`` on ``world``
    ranks of ``profile`` (a :class:`~ragged_fsdp.sim.profiles.GPUProfile`); ``whole``: the
    layout keeps every matrix on one rank (``Muon.granularity``), so nothing moves."""
    rate = profile.flops * profile.efficiency
    elems = sum(r * c for r, c in matrices)
    largest = max(((r, c) for r, c in matrices), key=lambda s: s[0] * s[1], default=(0, 0))
    ws_max = max((ns_workspace_bytes(r, c) for r, c in matrices), default=0)
    waves = cut_waves(matrices, lambda s: BF16 * s[0] * s[1], wave_bytes)
    if wave_bytes is None:
        local = BF16 * elems / world
        transient = one_wave_bytes(local, moves=not whole) + ws_max
        compute = sum(newton_schulz_flops(r, c) for r, c in matrices) / world / rate
        comm = 0.0 if whole else 2 * alltoall_time(profile, local, world)
        return MuonStep("one wave", world, 1, transient, compute, comm, compute + comm)
    big = BF16 * largest[0] * largest[1]
    in_flight = 0.0 if whole else in_flight_bytes(max(wave_bytes, big), world)
    transient = max(ns_floor_bytes(r, c) for r, c in matrices) + in_flight if matrices else 0.0
    compute = comm = step = 0.0
    for wave in waves:
        c_k = sum(newton_schulz_flops(r, c) for r, c in wave) / world / rate
        t_k = 0.0 if whole else 2 * alltoall_time(profile, BF16 * sum(r * c for r, c in wave) / world, world)
        compute += c_k
        comm += t_k
        step += max(c_k, t_k)
    if waves and not whole:  # the first wave's pieces and the last wave's results are not hidden
        first = BF16 * sum(r * c for r, c in waves[0]) / world
        step += alltoall_time(profile, first, world)
    return MuonStep("bounded", world, len(waves), transient, compute, comm, step)


def main(argv=None) -> int:

    from .arch import resolve_model
    from .profiles import get_profile

    ap = argparse.ArgumentParser(description="Muon's step per rank, one wave vs bounded")
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--gpus", type=int, default=256)
    ap.add_argument("--profile", default="h100")
    ap.add_argument("--wave-bytes", default=f"{2**18},{2**30}",
                    help="comma-separated wave sizes of the bounded step (default: 256 KiB and 1 GiB)")
    a = ap.parse_args(argv)
    mats = matrices_of_arch(resolve_model(a.model))
    prof = get_profile(a.profile)
    print(f"{a.model}: {len(mats)} Muon matrices, {sum(r * c for r, c in mats) / 1e9:.1f}B elements, "
          f"{a.gpus} x {a.profile}")
    print("| layout | step | wave_bytes | waves | transient GiB | Newton-Schulz s | all-to-all s | step s |")
    print("|---|---|---|---|---|---|---|---|")
    for whole in (False, True):
        for wb in [None] + [int(x) for x in a.wave_bytes.split(",")]:
            s = muon_step(mats, a.gpus, prof, wb, whole)
            d = asdict(s)
            print(f"| {'whole' if whole else 'element cuts'} | {s.mode} | {'-' if wb is None else wb} | {s.waves} "
                  f"| {d['transient_bytes'] / 2**30:.2f} | {s.compute_s:.3f} | {s.comm_s:.3f} | {s.step_s:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
