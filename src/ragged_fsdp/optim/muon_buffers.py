"""The buffers of Muon's bounded step, when each is made and when it goes: one record, read by
the executor (:mod:`.muon_exec`), the memory model (:func:`wave_rank_bytes`, which
:func:`.muon_plan.schedule` budgets with) and ``ragged_fsdp.sim.muon_step``.

Per wave, on one rank (bf16 throughout):

* ``send``: this rank's Nesterov-blended pieces of other ranks' matrices, filled chunk by chunk
  (one fp32 blend chunk alive: :func:`blend_bytes`); goes once the forward all-to-all landed.
* ``recv`` (owner): the pieces of its matrices from other ranks. An owner of **one** matrix of
  the wave lets it go once the matrix is assembled and gets a results buffer made after
  Newton-Schulz; an owner of several keeps it, writing each result into the slots its pieces
  came from (:func:`frees_received_early`).
* the assembled matrix: handed over to Newton-Schulz (no other reference), so its storage goes
  after the first iteration; Newton-Schulz then holds the next iterate and one Gram product
  (:func:`ns_hold_bytes`). torch's own loop holds one product more (:func:`ns_floor_bytes`).
* the results buffer: sent back by the return all-to-all, released when that launch is done;
  what lands (``res``) goes once this rank's pieces are updated.
* in flight beside an orthogonalisation: the next wave's ``send`` and ``recv``, and the
  previous wave's results (:func:`.muon_plan.schedule` decides which, by this record's bytes).

The one-wave step (``wave_bytes=None``) keeps every local piece in bf16, and an owner every
received piece and every result, until the return trip, which has its own buffers:
:func:`one_wave_bytes`.
"""

from __future__ import annotations

__all__ = ["BF16", "BLEND_CHUNK", "blend_chunk", "blend_bytes", "frees_received_early", "ns_workspace_bytes",
           "ns_hold_bytes", "ns_floor_bytes", "assembly_bytes", "wave_rank_bytes", "in_flight_bytes",
           "one_wave_bytes"]

BF16 = 2
# Elements of the Nesterov blend computed at once (its fp32 temporary: at most 16 KiB, at
# most a quarter of the matrix's bf16 bytes), so the blend stays small beside a matrix's
# Newton-Schulz workspace. Multiples of 64: of every SIMD width.
BLEND_CHUNK = 4096


def blend_chunk(rows: int, cols: int) -> int:
    """Elements of a ``rows x cols`` matrix's Nesterov blend computed at once."""
    return max(64, min(BLEND_CHUNK, rows * cols // 512 * 64))


def blend_bytes(n: int, rows: int, cols: int) -> int:
    """The fp32 temporary of blending ``n`` elements of a ``rows x cols`` matrix."""
    return 4 * min(n, blend_chunk(rows, cols))


def frees_received_early(owned: int) -> bool:
    """Whether an owner of ``owned`` matrices of a wave lets its received pieces go before
    Newton-Schulz (one matrix: it is assembled, the results get a buffer of their own)."""
    return owned == 1


def ns_workspace_bytes(rows: int, cols: int) -> int:
    """Peak bytes Newton-Schulz allocates on a ``rows x cols`` matrix given as a bf16 buffer it
    may overwrite: the next iterate (``rows*cols``) and the two ``m x m`` Gram products, bf16."""
    m = min(rows, cols)
    return BF16 * (rows * cols + 2 * m * m)


def ns_hold_bytes(rows: int, cols: int) -> int:
    """Peak bytes of the optimizer's Newton-Schulz on a ``rows x cols`` bf16 input handed
    over to it, the input included: the input (freed after the first iteration), the next
    iterate and one ``m x m`` product (each Gram product is dropped once used). torch's loop
    holds one ``m x m`` more: :func:`ns_floor_bytes`."""
    m = min(rows, cols)
    return BF16 * (2 * rows * cols + m * m)


def ns_floor_bytes(rows: int, cols: int) -> int:
    """One ``torch.optim.Muon`` Newton-Schulz on the matrix with its bf16 input: what an
    implementation that orthogonalises whole matrices with torch's operations holds at least
    (torchtitan's DistMuon's step transient on the docs' model). The bounded step keeps its
    transient at or below this for the optimizer's largest matrix (:func:`.muon_plan.schedule`)."""
    return BF16 * rows * cols + ns_workspace_bytes(rows, cols)


def assembly_bytes(rows: int, cols: int, own: int) -> int:
    """An owner assembling a matrix: the whole bf16 matrix and the blend of its own piece."""
    return BF16 * rows * cols + blend_bytes(own, rows, cols)


def wave_rank_bytes(wave, world: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per rank: bytes it sends (its pieces of others' matrices, later their results), bytes
    it receives as owner, the bytes it holds while orthogonalising (the largest of its
    matrices' Newton-Schulz hold and their assembly, plus the received pieces where it keeps
    them), and its largest blend temporary while it fills its send buffer."""
    send, recv, ns, blend = [0] * world, [0] * world, [0] * world, [0] * world
    owned = [0] * world
    for m in wave.matrices:
        o = m.owner
        owned[o] += 1
        for r in range(world):
            n = m.held(r)
            if n and r != o:
                send[r] += BF16 * n
                recv[o] += BF16 * n
                blend[r] = max(blend[r], blend_bytes(n, m.rows, m.cols))
        ns[o] = max(ns[o], ns_hold_bytes(m.rows, m.cols), assembly_bytes(m.rows, m.cols, m.held(o)))
    hold = [ns[r] + (0 if frees_received_early(owned[r]) or not owned[r] else recv[r]) for r in range(world)]
    return send, recv, hold, blend


def in_flight_bytes(wave_whole_bytes: float, world: int) -> float:
    """A rank's share of one wave in flight beside an orthogonalisation, ranks balanced: its
    send and receive buffers, ``1 / world`` of the wave's whole bf16 bytes each."""
    return 2 * wave_whole_bytes / world


def one_wave_bytes(local_bf16: float, moves: bool) -> float:
    """The one-wave step's buffers on a rank holding ``local_bf16`` bytes of pieces: the bf16
    pieces and what an owner receives, and, when pieces move, the return trip's own send and
    receive buffers (the largest Newton-Schulz workspace comes on top)."""
    return (4 if moves else 2) * local_bf16
