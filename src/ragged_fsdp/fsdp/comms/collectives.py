"""The two collectives of a DBuffer, chosen per backend by the bytes each rank moves.

All-gather: ``all_gather_single`` (``all_gather_into_tensor`` before torch 2.13) straight
into the unsharded buffer. The input is the sharded segment itself when no cast is needed,
otherwise the cast written into this rank's slot of the output (an in-place all-gather).

Reduce-scatter (the mean over ranks of the unsharded gradient buffer, this rank's segment),
chosen by backend in one dispatcher, :func:`reduce_scatter`, in this order:

* ``W == 1``: no collective, one copy/add (or none: the caller may adopt the buffer);
* a custom reduce-scatter (``set_custom_reduce_scatter``): the user's ``SUM``, then the divide;
* gloo: its reduce-scatter is an all-reduce underneath (each rank moves the whole buffer
  twice); ``all_to_all_single`` moves only the pieces other ranks own, and one local
  ``mean`` over the ``W`` received pieces finishes the job;
* NCCL and other backends: ``reduce_scatter_single`` with ``AVG`` straight into the sharded
  gradient segment when dtypes allow, else into a staging segment that one op casts or adds.

Every branch ends in :func:`~.landing.land` (divide, cast, write or add); NCCL's ``AVG`` is
the one divide a collective does itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ragged_fsdp.dbuffer import DBuffer

from ..torch_private import preserve_version_counter, set_version_counter

from .custom import adopt_memory, checked_alloc, checked_work
from ...device import AllWork, Device, Pending
from .landing import land

__all__ = ["Comm", "all_gather", "reduce_scatter", "all_reduce", "backend_of"]

from ragged_fsdp.comm import Comm, backend_of  # noqa: F401 - re-exported for the engine
from ragged_fsdp.comm import all_gather_single as _all_gather_single
from ragged_fsdp.comm import reduce_scatter_single as _reduce_scatter_single


def all_gather(device: Device, comm: Comm, buf: DBuffer, inp: torch.Tensor | None = None,
               lane: str = "all_gather", custom=None, after: Pending | None = None) -> Pending | None:
    """Fill ``buf``'s unsharded buffer from every rank's segment (or, with ``inp``, from
    equal contiguous parts the ranks of ``comm`` kept). Returns None when there is nothing
    to gather (the unsharded buffer is the sharded segment). ``custom``: a comm set by
    ``set_custom_all_gather`` (see :func:`_custom_all_gather`). ``after``: the copy of a host
    segment to the device that the gather reads (offload)."""
    if buf.aliased:
        return None
    if custom is not None:
        return _custom_all_gather(device, comm, buf, inp, lane, custom, after)
    with device.allocating(lane):
        out = buf.alloc_unsharded()  # allocated in the compute stream's order (see Device.allocating)
    # The unsharded parameters are views of `out`; autograd must not see the all-gather as
    # an in-place change of tensors it saved for backward. The version moves both when the
    # op is issued and (gloo) when its work is waited on, so restore it after both.
    version = out._version

    def issue(async_op: bool):
        with preserve_version_counter(out):
            src = buf.gather_input() if inp is None else inp
            if comm.world_size == 1:
                return None
            return _all_gather_single(out, src, group=comm.group, async_op=async_op)

    def restore_version():
        set_version_counter((out,), (version,))

    src = (buf.staged if buf.host_sharded else buf.sharded) if inp is None else inp
    return device.launch(lane, issue, post=restore_version, keep=(out, src), out=(out,), after=after)


def _custom_all_gather(device: Device, comm: Comm, buf: DBuffer, inp: torch.Tensor | None, lane: str,
                       custom, after: Pending | None = None) -> Pending:
    """The all-gather through a user comm: its ``allocate`` gives the unsharded buffer's
    memory (moved into the buffer's storage, so the parameters' views see the result with
    no copy; a comm that keeps the tensor it hands out gets gathered into and copied out of),
    and ``custom(output_tensor=, input_tensor=, group=, async_op=)`` runs the collective."""
    flat = buf.unsharded
    staging = t = None
    with device.allocating(lane):
        if flat.device.type != "meta" and flat.untyped_storage().nbytes() == 0:
            t = checked_alloc(custom, "set_custom_all_gather", flat.numel(), flat.dtype, flat.device)
            if not adopt_memory(flat, t):
                staging = t
        del t
        out = buf.alloc_unsharded()
    dest = out if staging is None else staging
    version = out._version

    def issue(async_op: bool):
        with preserve_version_counter(out):
            shard = buf.staged if buf.host_sharded else buf.sharded  # staged: offloaded params
            if inp is not None:
                src = inp
            elif buf.compute_dtype == buf.dtype:
                src = shard
            else:  # the cast goes into this rank's slot of the output (an in-place all-gather)
                src = dest.narrow(0, buf.rank * buf.segment, buf.segment)
                src.copy_(shard)
            if comm.world_size == 1:
                return None
            return checked_work("set_custom_all_gather", custom(
                output_tensor=dest, input_tensor=src, group=comm.group, async_op=async_op), async_op)

    def finish():
        if staging is not None:
            with torch.no_grad(), preserve_version_counter(out):
                out.copy_(staging)
        set_version_counter((out,), (version,))

    shard = buf.staged if buf.host_sharded else buf.sharded
    keep = (out, shard if inp is None else inp) + (() if staging is None else (staging,))
    return device.launch(lane, issue, post=finish, keep=keep, out=(dest,), after=after)


# On gloo a reduction receives the W-1 other pieces of this rank's segment at once: (W-1)/W
# of the group's gradient buffer. Above this many bytes it runs as a few all-to-alls over
# column chunks of the segment instead (same sums in the same order, so the same bits).
GLOO_RECEIVE_BOUND_BYTES = 64 << 20


def _gloo_reduce_chunked(comm: Comm, grad: torch.Tensor, target: torch.Tensor, accumulate: bool,
                         factor: float) -> None:
    """The gloo reduction in column chunks of at most GLOO_RECEIVE_BOUND_BYTES received;
    synchronous (one chunk's receive buffer is reused for the next)."""
    W, r, S = comm.world_size, comm.rank, target.numel()
    chunk = max(1, GLOO_RECEIVE_BOUND_BYTES // ((W - 1) * grad.element_size()))
    rows = grad.view(W, S)
    recv = torch.empty(W * min(chunk, S), dtype=grad.dtype, device=grad.device)
    for c0 in range(0, S, chunk):
        c = min(chunk, S - c0)
        pieces = recv[: (W - 1) * c].view(W - 1, c)
        # rank k's piece of my segment goes to row k (k < r) or k-1 (k > r), as unchunked;
        # gloo's list all-to-all wants equal sizes, so my own piece goes to a spare row
        outs = [pieces[k - (k > r)] if k != r else recv[(W - 1) * c: W * c] for k in range(W)]
        ins = [rows[k, c0:c0 + c] for k in range(W)]
        dist.all_to_all(outs, ins, group=comm.group)
        _sum_pieces(pieces, rows[r, c0:c0 + c], target[c0:c0 + c], accumulate, factor)


def _sum_pieces(pieces: torch.Tensor, own: torch.Tensor, target: torch.Tensor, accumulate: bool,
                factor: float) -> None:
    """``target (+)= (sum of the received pieces + own piece) / factor``, summed in one
    fixed order (chunked or not, the same bits) and in the pieces' dtype, which is the
    reduce dtype: ``reduce_dtype=fp32`` sums in fp32 even when the sharded gradient is bf16
    (a model stored in bf16), and ``reduce_dtype=bf16`` sums in bf16 as NCCL does. The
    result is rounded to the target's dtype once, after the divide, as FSDP2 does."""
    if not accumulate and target.dtype == own.dtype:
        # straight into the sharded gradient segment: sum, add own piece, scale
        if pieces.shape[0] == 1:
            torch.add(own, pieces[0], out=target)
        else:
            torch.sum(pieces, dim=0, out=target)
            target.add_(own)
        land(target, target, False, factor)
        return
    total = pieces[0] + own if pieces.shape[0] == 1 else torch.sum(pieces, dim=0).add_(own)
    land(total, target, accumulate, factor, scratch=True)


def reduce_scatter(
    device: Device,
    comm: Comm,
    grad: torch.Tensor,
    target: torch.Tensor,
    accumulate: bool,
    divide_factor: float | None = None,
    lane: str = "reduce_scatter",
    custom=None,
) -> Pending:
    """Reduce the unsharded gradient buffer ``grad`` (``W*S``) over ranks into ``target``
    (this rank's ``S``-element sharded gradient segment): ``target = mean`` or, with
    ``accumulate``, ``target += mean``. ``divide_factor`` replaces the world size.

    The one place the collective is chosen by backend, read top to bottom: ``W == 1`` (no
    collective), the user's custom reduce-scatter, gloo (all-to-all and a local sum), then
    NCCL and every other backend (``reduce_scatter_single``). Each one ends in :func:`land`."""
    W = comm.world_size
    factor = float(divide_factor or W)
    if W == 1:
        return _reduce_alone(device, grad, target, accumulate, factor, lane)
    if custom is not None:
        return _reduce_custom(device, comm, grad, target, accumulate, factor, lane, custom)
    if comm.gloo:
        return _reduce_gloo(device, comm, grad, target, accumulate, factor, lane)
    return _reduce_native(device, comm, grad, target, accumulate, divide_factor, lane)


def _reduce_alone(device: Device, grad: torch.Tensor, target: torch.Tensor, accumulate: bool, factor: float,
                  lane: str) -> Pending:
    """``W == 1``: no collective, one copy/add (``grad`` is the whole buffer, and the caller's
    to keep: no scratch)."""
    return device.launch(lane, lambda async_op: None, post=lambda: land(grad, target, accumulate, factor),
                         keep=(grad, target), out=(target,))


def _reduce_custom(device: Device, comm: Comm, grad: torch.Tensor, target: torch.Tensor, accumulate: bool,
                   factor: float, lane: str, custom) -> Pending:
    """A comm set by ``set_custom_reduce_scatter``, called as ``custom(output_tensor=,
    input_tensor=grad, group=, op=ReduceOp.SUM, async_op=)`` into ``target`` (or a segment
    from its ``allocate`` when the result is cast or accumulated); the divide follows."""
    direct = not accumulate and grad.dtype == target.dtype
    out = target if direct else checked_alloc(custom, "set_custom_reduce_scatter", target.numel(), grad.dtype,
                                              grad.device)

    def issue(async_op: bool):
        return checked_work("set_custom_reduce_scatter", custom(
            output_tensor=out, input_tensor=grad, group=comm.group, op=dist.ReduceOp.SUM, async_op=async_op),
            async_op)

    def post():
        # not direct: the comm's own memory, left as it reduced it (no scratch)
        land(out, target, accumulate, factor, scratch=False)

    return device.launch(lane, issue, post=post, keep=(grad, out, target), out=(out, target))


def _reduce_gloo(device: Device, comm: Comm, grad: torch.Tensor, target: torch.Tensor, accumulate: bool,
                 factor: float, lane: str) -> Pending:
    """gloo: its reduce-scatter is an all-reduce underneath, so two all-to-alls move exactly
    the pieces other ranks own and the owner sums them (:func:`_sum_pieces`); above
    ``GLOO_RECEIVE_BOUND_BYTES`` received, in column chunks (same sums, same bits)."""
    W, r, S = comm.world_size, comm.rank, target.numel()
    if (W - 1) * S * grad.element_size() > GLOO_RECEIVE_BOUND_BYTES:
        return device.launch(lane, lambda async_op: _gloo_reduce_chunked(comm, grad, target, accumulate, factor),
                             keep=(grad, target), out=(target,))
    # Each rank sends the chunks before its own to the lower ranks, those after it to the
    # higher ranks, and receives the W-1 pieces of its own chunk into one (W-1)*S buffer (no
    # copy of its own piece, which stays in `grad`).
    own = grad.narrow(0, r * S, S)
    # W == 2: the one piece received can land in the target itself (own + piece is the
    # same sum either way round), so no receive buffer the size of the segment
    into_target = W == 2 and not accumulate and target.dtype == grad.dtype
    received = target if into_target else torch.empty((W - 1) * S, dtype=grad.dtype, device=grad.device)
    lower = [S] * r + [0] * (W - r)  # to / from ranks below r
    upper = [0] * (r + 1) + [S] * (W - r - 1)  # to / from ranks above r

    def issue(async_op: bool):
        w1 = dist.all_to_all_single(
            received.narrow(0, r * S, (W - 1 - r) * S), grad.narrow(0, 0, r * S),
            output_split_sizes=upper, input_split_sizes=lower, group=comm.group, async_op=async_op)
        w2 = dist.all_to_all_single(
            received.narrow(0, 0, r * S), grad.narrow(0, (r + 1) * S, (W - 1 - r) * S),
            output_split_sizes=lower, input_split_sizes=upper, group=comm.group, async_op=async_op)
        return AllWork(w1, w2)

    def post():
        if into_target:
            land(target.add_(own), target, False, factor)
        else:
            _sum_pieces(received.view(W - 1, S), own, target, accumulate, factor)

    return device.launch(lane, issue, post=post, keep=(grad, received, target), out=(received, target))


def _reduce_native(device: Device, comm: Comm, grad: torch.Tensor, target: torch.Tensor, accumulate: bool,
                   divide_factor: float | None, lane: str) -> Pending:
    """NCCL and the other backends: ``reduce_scatter_single``. Without ``divide_factor`` the
    collective averages (``AVG``: the divide is the collective's own, so what lands is
    already scaled) straight into ``target`` when dtypes allow; otherwise a ``SUM`` into a
    staging segment that :func:`land` divides, casts or adds."""
    avg = divide_factor is None
    op = dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM
    direct = not accumulate and grad.dtype == target.dtype and avg
    staging = target if direct else torch.empty(target.numel(), dtype=grad.dtype, device=grad.device)

    def issue(async_op: bool):
        return _reduce_scatter_single(staging, grad, op=op, group=comm.group, async_op=async_op)

    post: Callable[[], None] | None = None if direct else (
        lambda: land(staging, target, accumulate, 1.0 if avg else float(divide_factor), scratch=True))
    return device.launch(lane, issue, post=post, keep=(grad, staging, target), out=(staging, target))


def all_reduce(device: Device, comm: Comm, t: torch.Tensor, *, pre: Callable[[], None] | None = None,
               post: Callable[[], None] | None = None, after: Pending | None = None, keep=(), out=(),
               lane: str = "all_reduce") -> Pending:
    """In-place sum of ``t`` over ``comm`` (HSDP's replicate dim) on its own lane, after
    ``after`` (the shard-dim reduce-scatter that writes ``t``); ``pre`` runs before it and
    ``post`` after it, both in the lane's order."""

    def issue(async_op: bool):
        if comm.world_size == 1:
            return None
        return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=comm.group, async_op=async_op)

    return device.launch(lane, issue, post=post, keep=(t, *keep), after=after, pre=pre, out=(t, *out))
