"""Muon's executor: one batch's step, wave by wave, as :mod:`.muon_plan` cut and scheduled it.

Per wave: the Nesterov blend of this rank's pieces (bf16), the forward all-to-all to the
owners, Newton-Schulz on the owned matrices, the return all-to-all, decoupled weight decay
and the update. Which buffer lives how long is :mod:`.muon_buffers`' record (the memory
model that schedules the overlap reads the same record). The optimizer hands in the device
seam and the Newton-Schulz function, so the state and the checks stay in :mod:`.muon`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ._layout import local_of
from .muon_buffers import blend_chunk, frees_received_early

__all__ = ["WaveRun", "adjust_lr"]


def adjust_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """Muon's per-shape learning rate: ``"original"`` (default) scales by
    ``sqrt(max(1, rows/cols))``, ``"match_rms_adamw"`` by ``0.2 * sqrt(max(rows, cols))``."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio


def _scalar(x) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)



class WaveRun:
    """One batch's step, wave by wave: the forward all-to-all of wave ``k + 1`` is launched
    before wave ``k`` is orthogonalised (on CUDA it runs on the device seam's ``"muon"`` lane,
    a side stream), and wave ``k - 1``'s results travel back while wave ``k`` is
    orthogonalised, each where the plan's :func:`~.muon_plan.schedule` found that it fits
    in the step's budget (the same decision on every rank, so the collectives match).

    Buffers, each alive only while needed: the forward sends ``send`` (this rank's pieces, by
    owner then matrix order) into ``recv`` (the owner's pieces, by source then matrix order);
    ``send`` goes once the pieces landed. An owner of one matrix of the wave lets ``recv`` go
    once the matrix is assembled and puts the results in a buffer made after Newton-Schulz;
    an owner of several writes each result into the ``recv`` slots its pieces came from. The
    return trip sends that buffer into ``res``, laid out like ``send`` was."""

    def __init__(self, opt, batch, items, group, stats, dev, ns):
        self.opt, self.batch, self.items, self.group, self.stats = opt, batch, items, group, stats
        self.dev, self.ns = dev, ns  # the device seam, and Newton-Schulz on a handed-over matrix
        self.me = batch.rank
        self.local_start = [lay.local_range[0] for _, _, lay in items]
        self.lr = _scalar(group["lr"])

    def _sent_pieces(self, wave):
        """``(matrix, offset, length)`` of this rank's pieces of other ranks' matrices, in the
        order the all-to-all sends them out and the results come back (by owner, then wave)."""
        me, o = self.me, 0
        for d in range(self.batch.world):
            if d == me:
                continue
            for m in wave.matrices:
                n = m.held(me)
                if m.owner == d and n:
                    yield m, o, n
                    o += n

    def _update_piece(self, m, out: torch.Tensor) -> None:
        """This rank's piece of ``m``'s Nesterov-blended update, rounded to bf16 into ``out``
        (the rounding of ``.bfloat16()``)."""
        a, b = m.pieces[self.me]
        off = self.local_start[m.slot]
        _, p, _ = self.items[m.slot]
        g = local_of(p.grad).reshape(-1)[a - off: b - off]
        buf = local_of(self.opt.state[p]["momentum_buffer"]).view(-1)[a - off: b - off]
        if not self.group["nesterov"]:
            out.copy_(buf)
            return
        # the blend in chunks from the piece's start: a whole-piece ``g.lerp(buf)`` is a
        # full-precision copy of the piece (2x its bf16 bytes), the step's largest temporary
        # before Newton-Schulz; a pointwise op gives the same bits on any slice, and chunks
        # of a multiple of 64 elements (of every SIMD width) keep the vector/tail split
        momentum = self.group["momentum"]
        step = blend_chunk(m.rows, m.cols)
        for i in range(0, b - a, step):
            j = min(i + step, b - a)
            out[i:j].copy_(g[i:j].lerp(buf[i:j], momentum))

    def _apply(self, m, res: torch.Tensor) -> None:
        """Decoupled weight decay and the update on this rank's piece of ``m``."""
        a, b = m.pieces[self.me]
        off = self.local_start[m.slot]
        _, p, lay = self.items[m.slot]
        pl = local_of(p).view(-1)[a - off: b - off]
        pl.mul_(1 - self.lr * self.group["weight_decay"])
        pl.add_(res, alpha=-adjust_lr(self.lr, self.group["adjust_lr_fn"], m.rows, m.cols))

    def _forward(self, wave):
        """Launch the wave's pieces to their owners; ``[pending, send, recv]`` or None."""
        if not wave.needs_comm:
            return None
        ref = local_of(self.items[0][1].grad)
        send = torch.empty(sum(wave.send_split), dtype=torch.bfloat16, device=ref.device)
        for m, o, n in self._sent_pieces(wave):
            self._update_piece(m, send[o: o + n])
        recv = send.new_empty(sum(wave.recv_split))
        group = self.batch.group

        def comm(async_op, recv=recv, send=send, wave=wave):
            return _all_to_all(recv, send, wave.recv_split, wave.send_split, group, async_op)

        return [self.dev.launch("muon", comm, keep=(send, recv), out=(recv,)), send, recv]

    def _arrived(self, fwd) -> list | None:
        """Wait for a forward; its send buffer goes (the results come into a new one)."""
        if fwd is None:
            return None
        fwd[0].wait()
        recv = fwd[2]
        self.dev.release(fwd[1])  # now, not when gloo drops its reference: Newton-Schulz follows
        fwd.clear()
        return [recv]

    def _orthogonalise(self, wave, held_recv) -> torch.Tensor | None:
        """Newton-Schulz on the wave's matrices this rank owns; returns the buffer of results
        to send back (laid out like ``recv``), or None without a collective."""
        me, world = self.me, self.batch.world
        coeffs, steps, eps = self.group["ns_coefficients"], self.group["ns_steps"], self.group["eps"]
        recv = held_recv.pop() if held_recv is not None else None
        recv_off = _offsets(wave.recv_split)
        owned = [m for m in wave.matrices if m.owner == me]
        ret = recv
        for m in owned:
            gs = m.gs
            size = m.end - m.start
            h, w = gs.tile
            full = torch.empty(m.rows * m.cols, dtype=torch.bfloat16, device=self.dev.device)
            tiles = {} if gs.tiled else {(0, 0): full}  # one flat buffer per tile
            slots = []  # (tile, lo, hi, recv offset) of the pieces that came from other ranks
            for r in range(world):
                a, b = m.pieces[r]
                if b <= a:
                    continue
                dst = tiles.get(gs.offsets[r])
                if dst is None:
                    dst = tiles[gs.offsets[r]] = full.new_empty(size)
                if r == me:
                    self._update_piece(m, dst[a - m.start: b - m.start])
                else:
                    dst[a - m.start: b - m.start] = recv[recv_off[r]: recv_off[r] + (b - a)]
                    slots.append((gs.offsets[r], a, b, recv_off[r]))
                    recv_off[r] += b - a
            whole = full.view(m.rows, m.cols)
            if gs.tiled:  # TP tiles into the global matrix
                for (r0, c0), t in tiles.items():
                    whole[r0: r0 + h, c0: c0 + w] = t.view(h, w)
                tiles = None
            if frees_received_early(len(owned)) and recv is not None:
                # the only matrix of the wave here: its pieces are assembled, so the received
                # buffer goes before Newton-Schulz and the results get one made after it
                n_recv = recv.numel()
                self.dev.release(recv)
                ret = recv = None
            # hand the input over: with no reference left here its storage is freed after
            # Newton-Schulz's first iteration, so the input and the last two iterates are
            # never live at once (one matrix less at the step's peak; same operations)
            held = [whole]
            whole = full = tiles = dst = None
            out = self.ns(held, coeffs, steps, eps)

            def tile_of(o, out=out):
                return out[o[0]: o[0] + h, o[1]: o[1] + w] if gs.tiled else out

            a, b = m.pieces[me]
            if b > a:  # before the results buffer exists: one matrix less at this moment
                self._apply(m, tile_of(gs.offsets[me]).reshape(-1)[a - m.start: b - m.start])
            if slots and ret is None:
                ret = torch.empty(n_recv, dtype=torch.bfloat16, device=self.dev.device)
            for o, a, b, at in slots:  # results into the slots the pieces came from
                _copy_flat(ret[at: at + (b - a)], tile_of(o), a - m.start, b - m.start)
            del out, tile_of  # the closure holds the result too
            self.opt.ns_calls += 1
            self.stats["ns_flops"] += m.flops
            self.stats["ns_matrices"] += 1
        if ret is None and wave.needs_comm:  # nothing owned here that came from elsewhere
            ret = torch.empty(sum(wave.recv_split), dtype=torch.bfloat16, device=self.dev.device)
        return ret

    def _back(self, wave, ret):
        """Launch the results back (``ret`` -> a new ``res``)."""
        if not wave.needs_comm:
            return None
        res = ret.new_empty(sum(wave.send_split))
        group = self.batch.group

        def comm(async_op, ret=ret, res=res, wave=wave):
            return _all_to_all(res, ret, wave.send_split, wave.recv_split, group, async_op)

        return self.dev.launch("muon", comm, keep=(res, ret), out=(res,), post=lambda: self.dev.release(ret)), res

    def _finish(self, wave, back) -> None:
        if back is None:
            return
        pending, res = back
        pending.wait()
        for m, o, n in self._sent_pieces(wave):
            self._apply(m, res[o: o + n])
        self.dev.release(res)

    def run(self) -> None:
        waves = self.batch.waves
        fwd = self._forward(waves[0])
        prev = None  # (wave, back) whose results are still travelling
        for k, wave in enumerate(waves):
            last = k + 1 == len(waves)
            if prev is not None and not wave.overlap_prev:
                self._finish(*prev)
                prev = None
            nxt = self._forward(waves[k + 1]) if not last and wave.overlap_next else None
            ret = self._orthogonalise(wave, self._arrived(fwd))
            fwd = None
            back = self._back(wave, ret)
            ret = None
            if prev is not None:
                self._finish(*prev)
                prev = None
            prev, back = (wave, back), None  # one reference: finishing it frees its buffers
            if not last and not wave.overlap_next:
                self._finish(*prev)
                prev = None
                nxt = self._forward(waves[k + 1])
            fwd, nxt = nxt, None
        if prev is not None:
            self._finish(*prev)


def _copy_flat(dst: torch.Tensor, mat: torch.Tensor, lo: int, hi: int) -> None:
    """``dst.copy_(mat.reshape(-1)[lo:hi])`` without the whole-matrix copy ``reshape`` makes
    of a non-contiguous ``mat`` (a tall matrix's transposed result, a TP tile): the partial
    first row, the whole rows, the partial last row."""
    if mat.is_contiguous():
        dst.copy_(mat.view(-1)[lo:hi])
        return
    cols = mat.size(1)
    r0, c0 = divmod(lo, cols)
    r1, c1 = divmod(hi, cols)
    if r0 == r1:
        dst.copy_(mat[r0, c0:c1])
        return
    o = 0
    if c0:
        dst[: cols - c0].copy_(mat[r0, c0:])
        o, r0 = cols - c0, r0 + 1
    if r1 > r0:
        dst[o: o + (r1 - r0) * cols].view(r1 - r0, cols).copy_(mat[r0:r1])
        o += (r1 - r0) * cols
    if c1:
        dst[o: o + c1].copy_(mat[r1, :c1])


def _offsets(split: list[int]) -> list[int]:
    out, acc = [], 0
    for s in split:
        out.append(acc)
        acc += s
    return out


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, out_split, in_split, group, async_op: bool = False):
    """all_to_all_single on raw bytes (gloo and NCCL move any dtype that way)."""
    esz = inp.element_size()
    return dist.all_to_all_single(
        out.view(torch.uint8), inp.contiguous().view(torch.uint8),
        [s * esz for s in out_split], [s * esz for s in in_split], group=group, async_op=async_op,
    )
