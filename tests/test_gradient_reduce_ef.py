"""Error feedback's residual as training state (issue 41), on 4 gloo ranks, one launch:

* a non-finite step does not poison it: a NaN loss on rank 1 at step 1 (the step skipped on
  every rank) leaves no non-finite gradient element in the later steps, as without error
  feedback, for every wire format and residual storage, on a 1-D mesh and HSDP (2, 2); with
  ``torch.amp.GradScaler`` the scale drops once and training goes on, as without it;
* a backward that raises (``RuntimeError``, ``KeyboardInterrupt``) after some buffers were
  reduced leaves the residual of the last completed backward: the run that catches it and
  goes on equals, bit for bit, a run that never saw that batch (SGD and AdamW);
* ``gradient_reduce`` is agreed across ranks at ``fully_shard``: a mismatch raises on every
  rank, naming the setting, the field and each rank's value (also between HSDP replicas);
* ``trace()``'s ``sent`` is what each reduction puts on the wire, against a hand count of
  codes and scales.

The references are plain single-process computations (counts of non-finite elements, a run
without the bad batch, block counts from the layout's tensor stretches), not the engine's
helpers.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from _dist import check_case, run_cases

from ragged_fsdp import GradientReduce

WIRES = [GradientReduce(torch.int8, True), GradientReduce(torch.int8, True, torch.bfloat16),
         GradientReduce(torch.int8, True, torch.float32), GradientReduce(torch.float8_e4m3fn, True),
         GradientReduce(torch.float8_e4m3fn, True, torch.float32), GradientReduce(torch.bfloat16, True),
         GradientReduce(torch.bfloat16, True, torch.float32)]


class Boom(torch.autograd.Function):
    """Identity whose backward raises ``fault[0]`` when it is set (a fault in backward after
    the blocks above it were reduced)."""

    fault: list = [None]

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if Boom.fault[0] is not None:
            raise Boom.fault[0]("simulated fault in backward")
        return g


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lo = nn.Linear(24, 37)
        self.hi = nn.Linear(37, 5)

    def forward(self, x):
        return self.hi(Boom.apply(torch.tanh(self.lo(x))))


def _batch(dp_rank, step):
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    return torch.randn(3, 24, generator=g), torch.randn(3, 5, generator=g)


def _mesh(world, hsdp):
    from torch.distributed.device_mesh import init_device_mesh

    if hsdp:
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def _model(mesh, fmt):
    from ragged_fsdp.fsdp import fully_shard

    torch.manual_seed(0)
    m = Net()
    fully_shard(m.lo, mesh=mesh, gradient_reduce=fmt)
    fully_shard(m.hi, mesh=mesh, gradient_reduce=fmt)
    fully_shard(m, mesh=mesh, gradient_reduce=fmt)
    return m


def _nonfinite(model) -> int:
    """Non-finite sharded-gradient elements over every rank."""
    n = sum(int((~torch.isfinite(p.grad.to_local())).sum()) for p in model.parameters() if p.grad is not None)
    t = torch.tensor([n])
    dist.all_reduce(t)
    return int(t)


# -- 1: a non-finite step ------------------------------------------------------------------

def _nan_run(rank, world, hsdp, fmt):
    mesh = _mesh(world, hsdp)
    m = _model(mesh, fmt)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    counts = []
    for step in range(5):
        x, y = _batch(rank, step)
        loss = nn.functional.mse_loss(m(x), y)
        if step == 1 and rank == 1:
            loss = loss * float("nan")
        loss.backward()
        bad = _nonfinite(m)
        counts.append(bad)
        if not bad:  # skipped on every rank (the count is global)
            opt.step()
        opt.zero_grad()
    return counts, m


def case_nonfinite_step_does_not_poison_the_residual(rank, world):
    failed = []
    for hsdp in (False, True):
        plain, _ = _nan_run(rank, world, hsdp, None)
        assert plain[0] == 0 and plain[1] > 0 and plain[2:] == [0, 0, 0], plain
        for fmt in WIRES:
            got, m = _nan_run(rank, world, hsdp, fmt)
            if got != plain:
                failed.append(f"hsdp={hsdp} {fmt}: non-finite gradient elements per step {got}, without error "
                              f"feedback {plain}")
            dropped = torch.tensor([m.residual_dropped()])
            everyone = [torch.zeros_like(dropped) for _ in range(world)]
            dist.all_gather(everyone, dropped)
            # only rank 1's residual met the NaN (its own step-1 gradient): the others sent finite pieces
            d = [int(t) for t in everyone]
            if not (d[1] > 0 and d[0] == d[2] == d[3] == 0):
                failed.append(f"hsdp={hsdp} {fmt}: residual_dropped per rank {d}")
    assert not failed, "\n".join(failed)


def _scaler_run(rank, world, fmt):
    mesh = _mesh(world, False)
    m = _model(mesh, fmt)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    scales, weights = [], []
    for step in range(6):
        x, y = _batch(rank, step)
        loss = nn.functional.mse_loss(m(x), y)
        if step == 1 and rank == 1:
            loss = loss * float("nan")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        weights.append(m.hi.weight.full_tensor().clone())
    return scales, weights


def case_grad_scaler_recovers(rank, world):
    plain, _ = _scaler_run(rank, world, None)
    assert plain == [1024.0, 512.0, 512.0, 512.0, 512.0, 512.0], plain
    for fmt in (GradientReduce(torch.int8, True), GradientReduce(torch.bfloat16, True, torch.float32)):
        scales, weights = _scaler_run(rank, world, fmt)
        assert scales == plain, f"{fmt}: scales {scales}, without error feedback {plain}"
        for a, b in zip(weights[2:], weights[3:]):  # every step after the skipped one moved the weights
            assert torch.isfinite(b).all() and not torch.equal(a, b), fmt


# -- 3: a backward that raises ------------------------------------------------------------

def _recovery_run(rank, world, opt_kind, fault, skip_bad):
    fmt = GradientReduce(torch.int8, True)
    m = _model(_mesh(world, False), fmt)
    opt = (torch.optim.SGD(m.parameters(), lr=0.05) if opt_kind == "sgd"
           else torch.optim.AdamW(m.parameters(), lr=1e-2))
    losses = []
    for step in range(5):
        if step == 2 and skip_bad:
            continue
        x, y = _batch(rank, step)
        Boom.fault[0] = fault if step == 2 else None
        try:
            loss = nn.functional.mse_loss(m(x), y)
            loss.backward()
        except (RuntimeError, KeyboardInterrupt) as e:
            assert step == 2 and "simulated fault" in str(e), e
            opt.zero_grad()
            continue
        finally:
            Boom.fault[0] = None
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, {n: p.full_tensor() for n, p in m.named_parameters()}


def case_recovery_after_backward_fault_is_exact(rank, world):
    for opt_kind in ("sgd", "adamw"):
        clean_losses, clean = _recovery_run(rank, world, opt_kind, None, skip_bad=True)
        for fault in (RuntimeError, KeyboardInterrupt):
            losses, got = _recovery_run(rank, world, opt_kind, fault, skip_bad=False)
            assert losses == clean_losses, (opt_kind, fault, losses, clean_losses)
            for n in clean:
                assert torch.equal(got[n], clean[n]), (
                    f"{opt_kind} {fault.__name__} {n}: {(got[n] - clean[n]).abs().max().item():.3e} off the run "
                    "that skipped the batch")


# -- 7: agreement ---------------------------------------------------------------------------

def case_gradient_reduce_agreed_across_ranks(rank, world):
    from ragged_fsdp.fsdp import fully_shard
    from ragged_fsdp.fsdp.core.consistency import SettingMismatchError

    cases = [
        # (mesh kind, this rank's gradient_reduce, what the message must say)
        ("1d", GradientReduce(torch.int8) if rank == 0 else GradientReduce(torch.bfloat16),
         ["gradient_reduce", "wire_dtype", "rank 0: gradient_reduce=GradientReduce(wire_dtype=torch.int8",
          "rank 1: gradient_reduce=GradientReduce(wire_dtype=torch.bfloat16"]),
        ("1d", GradientReduce(torch.int8, True) if rank != 3 else None,
         ["rank 3: gradient_reduce=None", "rank 2: gradient_reduce=GradientReduce(wire_dtype=torch.int8, "
          "error_feedback=True, residual_dtype=torch.int8, block_size=128)"]),
        ("1d", GradientReduce(torch.int8, block_size=32 if rank == 2 else 128), ["block_size", "block_size=32"]),
        ("1d", GradientReduce(torch.int8, True, torch.float32 if rank == 1 else torch.int8),
         ["residual_dtype", "error_feedback"][:1]),
        # HSDP: the replicas (ranks 0-1 and 2-3) disagree, each shard group agrees within itself
        ("hsdp", GradientReduce(torch.int8) if rank < 2 else GradientReduce(torch.float8_e4m3fn),
         ["wire_dtype", "rank 2: gradient_reduce=GradientReduce(wire_dtype=torch.float8_e4m3fn"]),
    ]
    for kind, fmt, says in cases:
        m = Net()
        with pytest.raises(SettingMismatchError) as e:
            fully_shard(m, mesh=_mesh(world, kind == "hsdp"), gradient_reduce=fmt)
        for s in says:
            assert s in str(e.value), (s, str(e.value))
        assert "Pass the same gradient_reduce on every rank" in str(e.value)
    # the same setting everywhere: accepted, and a backward runs
    m = _model(_mesh(world, True), GradientReduce(torch.int8, True))
    x, y = _batch(rank, 0)
    nn.functional.mse_loss(m(x), y).backward()


# -- 12b: the bytes trace() reports ---------------------------------------------------------

def _hand_blocks(layout, seg: int, block: int) -> int:
    """Blocks of segment ``seg`` for a layout of one-element units: each tensor's stretch in
    the segment is ceil(len / block) blocks, each stretch of padding one."""
    S = layout.segment
    lo, hi = seg * S, (seg + 1) * S
    n, covered = 0, 0
    for s in layout.slots:
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        if b > a:
            n += -(-(b - a) // block)
            covered += b - a
    spans = sorted((max(lo, s.offset), min(hi, s.offset + s.numel)) for s in layout.slots
                   if min(hi, s.offset + s.numel) > max(lo, s.offset))
    pos, gaps = lo, 0
    for a, b in spans:
        gaps += a > pos
        pos = b
    gaps += hi > pos
    return n + gaps


def case_trace_reports_the_bytes_sent(rank, world):
    from ragged_fsdp.fsdp import fully_shard, trace

    mesh = _mesh(world, False)
    for fmt, code_bytes, scaled in ((None, 4, False), (GradientReduce(torch.bfloat16), 2, False),
                                    (GradientReduce(torch.int8, True), 1, True),
                                    (GradientReduce(torch.float8_e4m3fn), 1, True)):
        torch.manual_seed(0)
        m = Net()
        fully_shard(m, mesh=mesh, gradient_reduce=fmt)
        x, y = _batch(rank, 0)
        with trace() as t:
            nn.functional.mse_loss(m(x), y).backward()
        ev = t.of("reduce_scatter")
        assert len(ev) == 1, t.table()
        lay = m.dbuffers[0].layout
        want = (world - 1) * lay.segment * code_bytes
        if scaled:
            want += 4 * sum(_hand_blocks(lay, k, 128) for k in range(world) if k != rank)
        assert ev[0].sent == want, (fmt, ev[0].sent, want)
        assert f"{want / 2**20:.3f}" in t.table()


CASES = [case_nonfinite_step_does_not_poison_the_residual, case_grad_scaler_recovers,
         case_recovery_after_backward_fault_is_exact, case_gradient_reduce_agreed_across_ranks,
         case_trace_reports_the_bytes_sent]


@pytest.fixture(scope="module")
def results():
    return run_cases(4, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.removeprefix("case_"))
def test_gradient_reduce_ef_w4(results, case):
    check_case(results, case, 4)
