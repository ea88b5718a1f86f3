"""Error feedback's residual as training state, on 4 gloo ranks, one launch:

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
  codes and scales;
* the residual in ``state_dict()`` is the live one: in-place ``load_local`` and ``dcp.load``
  resume bitwise; a load without one zeroes it with a warning; ``rescale_residual``
  refuses a non-finite, non-positive or rank-dependent factor on every rank; a residual a
  raised backward staged is refused at the optimizer step.

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


def _growing_scaler_run(rank, world, fmt, rescale):
    """SGD under a GradScaler whose scale doubles every step (2**4 .. 2**8), calling
    ``rescale_residual`` after each change when ``rescale``; ``None``: no scaler."""
    m = _model(_mesh(world, False), fmt)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    scaler = None if rescale is None else torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=1)
    for step in range(5):
        x, y = _batch(rank, step)
        loss = nn.functional.mse_loss(m(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            old = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if rescale and scaler.get_scale() != old:
                m.rescale_residual(scaler.get_scale() / old)
        opt.zero_grad()
    return _full(m)


def case_grad_scaler_scale_change_rescales_the_residual(rank, world):
    """Powers of two scale every gradient exactly, so with the residual rescaled at each
    change of scale the run equals, bit for bit, the same run without a scaler; without the
    rescale it does not (the residual of the old scale is fed into the new one)."""
    for fmt in (GradientReduce(torch.int8, True), GradientReduce(torch.bfloat16, True),
                GradientReduce(torch.float8_e4m3fn, True, torch.float32)):
        want = _growing_scaler_run(rank, world, fmt, None)
        got = _growing_scaler_run(rank, world, fmt, True)
        for n in want:
            assert torch.equal(got[n], want[n]), (fmt, n, (got[n] - want[n]).abs().max().item())
        stale = _growing_scaler_run(rank, world, fmt, False)
        assert any(not torch.equal(stale[n], want[n]) for n in want), fmt


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
    from ragged_fsdp.fsdp import SettingMismatchError

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


# -- 6: the residual in checkpoints ----------------------------------------------------------

_DIRS: list[str] = []


def _shared_dir() -> str:
    import tempfile

    box = [tempfile.mkdtemp(prefix="ef_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    _DIRS.append(box[0])
    return box[0]


def _remove_dirs() -> None:
    import shutil

    dist.barrier()
    if dist.get_rank() == 0:
        for d in _DIRS:
            shutil.rmtree(d, ignore_errors=True)
    _DIRS.clear()


def _steps(m, opt, rank, a, b):
    for s in range(a, b):
        x, y = _batch(rank, s)
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()


def _full(m):
    return {n: p.full_tensor() for n, p in m.named_parameters()}


_STRAIGHT: dict = {}  # (fmt, optimizer, hsdp): the parameters after 6 steps straight


def _resume(rank, world, fmt, path, hsdp=False):
    """Parameters after 6 steps straight, and after 3 steps, a save through ``path``, a load
    into a fresh model and optimizer, and 3 more."""
    import os

    import torch.distributed.checkpoint as dcp

    from ragged_fsdp.checkpoint import (TrainState, get_model_state_dict, get_optimizer_state_dict, load_latest,
                                        load_local, save, save_local, set_state_dict)

    mesh = _mesh(world, hsdp)
    sgd = path in ("local", "local_inplace", "dcp_inplace")
    make_opt = ((lambda m: torch.optim.SGD(m.parameters(), lr=0.05)) if sgd
                else (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)))
    key = (fmt, sgd, hsdp)
    if key not in _STRAIGHT:
        m = _model(mesh, fmt)
        opt = make_opt(m)
        _steps(m, opt, rank, 0, 6)
        _STRAIGHT[key] = _full(m)
    want = _STRAIGHT[key]
    m = _model(mesh, fmt)
    opt = make_opt(m)
    _steps(m, opt, rank, 0, 3)
    d = _shared_dir()
    m2 = _model(mesh, fmt)
    opt2 = make_opt(m2)
    if path == "dcp":  # torch's DCP with the state-dict functions
        dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}, checkpoint_id=d)
        sd = {"model": get_model_state_dict(m2), "optim": get_optimizer_state_dict(m2, opt2)}
        dcp.load(sd, checkpoint_id=d)
        set_state_dict(m2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    elif path == "dcp_inplace":  # DCP writes into the state dict's tensors; no load_state_dict after
        dcp.save({"model": get_model_state_dict(m)}, checkpoint_id=d)
        dcp.load({"model": get_model_state_dict(m2)}, checkpoint_id=d)
    elif path == "local_inplace":  # the in-place resume the docs show (SGD: no optimizer state)
        save_local(m.state_dict(), os.path.join(d, "local"))
        dist.barrier()
        load_local(m2.state_dict(), os.path.join(d, "local"))
    elif path == "train_state":
        save({"train": TrainState(m, opt)}, d)
        load_latest(d, {"train": TrainState(m2, opt2)})
    else:  # the local save of the flat model state dict (SGD: no optimizer state)
        save_local(m.state_dict(), os.path.join(d, "local"))
        dist.barrier()
        sd = m2.state_dict()
        load_local(sd, os.path.join(d, "local"))
        m2.load_state_dict(sd)
    _steps(m2, opt2, rank, 3, 6)
    return want, _full(m2)


def case_resume_is_bitwise_at_the_same_world(rank, world):
    failed = []
    runs = [(fmt, path, False) for fmt in (GradientReduce(torch.int8, True), GradientReduce(torch.int8, True, torch.float32),
                                           GradientReduce(torch.bfloat16, True),
                                           GradientReduce(torch.bfloat16, True, torch.float32))
            for path in ("dcp", "train_state", "local", "local_inplace", "dcp_inplace")]
    runs.append((GradientReduce(torch.int8, True), "train_state", True))  # HSDP (2, 2): a residual per rank
    for fmt, path, hsdp in runs:
        want, got = _resume(rank, world, fmt, path, hsdp)
        for n in want:
            if not torch.equal(want[n], got[n]):
                failed.append(f"{fmt} {path} hsdp={hsdp} {n}: {(want[n] - got[n]).abs().max().item():.3e} off the "
                              "uninterrupted run")
    _remove_dirs()
    assert not failed, "\n".join(failed)


def case_resume_at_another_world_starts_from_zero(rank, world):
    """Saved at W = 4, loaded at W = 2: parameters and optimizer state reshard, the residual
    does not: a ResidualWarning, a zero residual, and the first step equals a model without
    error feedback loading the same checkpoint (which ignores the saved residual, warning)."""
    import warnings

    from torch.distributed.device_mesh import DeviceMesh

    from ragged_fsdp.checkpoint import TrainState, load_latest, save
    from ragged_fsdp.fsdp import ResidualWarning

    fmt = GradientReduce(torch.int8, True)
    m = _model(_mesh(world, False), fmt)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    _steps(m, opt, rank, 0, 3)
    saved = _full(m)
    d = _shared_dir()
    save({"train": TrainState(m, opt)}, d)
    pair = dist.new_group([0, 1])
    if rank < 2:
        mesh = DeviceMesh.from_group(pair, "cpu")
        out = {}
        for name, f in (("ef", fmt), ("plain", GradientReduce(torch.int8))):
            m2 = _model(mesh, f)
            opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                load_latest(d, {"train": TrainState(m2, opt2)}, process_group=pair)
            said = [str(w.message) for w in caught if issubclass(w.category, ResidualWarning)]
            key = "starts from a zero residual" if name == "ef" else "ignored"
            assert said and all(key in s for s in said), (name, said)
            for n, p in _full(m2).items():
                assert torch.equal(p, saved[n]), n
            if name == "ef":
                sd = m2.state_dict()
                res = [k for k in sd if "_wire_residual_" in k]
                assert res and all(not sd[k].to_local().any() for k in res), res
            _steps(m2, opt2, rank, 3, 4)
            out[name] = _full(m2)
        for n in out["ef"]:
            assert torch.equal(out["ef"][n], out["plain"][n]), n
    _remove_dirs()


def case_checkpoint_with_and_without_residual(rank, world):
    """Strict loads across the two kinds of model: an error-feedback model given a state dict
    without a residual starts from zero (warning); a model without error feedback given one
    ignores it (warning); neither raises, by load_state_dict and by the strict DCP load."""
    import warnings

    from ragged_fsdp.checkpoint import TrainState, load_latest, save
    from ragged_fsdp.fsdp import ResidualWarning

    mesh = _mesh(world, False)
    ef, plain = GradientReduce(torch.int8, True), GradientReduce(torch.int8)
    trained = {}
    for name, f in (("ef", ef), ("plain", plain), ("none", None)):
        m = _model(mesh, f)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        _steps(m, opt, rank, 0, 2)
        trained[name] = (m, opt)
    assert not [k for k in trained["none"][0].state_dict() if "_wire_residual" in k]
    assert not [k for k in trained["plain"][0].state_dict() if "_wire_residual" in k]
    for src, dst, says in (("plain", ef, "starts from a zero residual"), ("none", ef, "starts from a zero residual"),
                           ("ef", plain, "ignored"), ("ef", None, "ignored")):
        for how in ("load_state_dict", "dcp"):
            m2 = _model(mesh, dst)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if how == "load_state_dict":
                    m2.load_state_dict(trained[src][0].state_dict(), strict=True)
                else:
                    d = _shared_dir()
                    save({"train": TrainState(trained[src][0], trained[src][1])}, d)
                    load_latest(d, {"train": TrainState(m2, torch.optim.SGD(m2.parameters(), lr=0.05))})
            said = [str(w.message) for w in caught if issubclass(w.category, ResidualWarning)]
            assert said and all(says in s for s in said), (src, dst, how, said)
            want = _full(trained[src][0])
            for n, p in _full(m2).items():
                assert torch.equal(p, want[n]), (src, dst, how, n)
    _remove_dirs()


def case_load_without_residual_resets_it(rank, world):
    """Finding 8: a model that trained with error feedback, loading (strict=False) a save
    made without it: the residual is zeroed with a ResidualWarning, by ``load_local`` in
    place and by ``load_state_dict``; the next step then equals a model whose residual was
    zero (a fresh one loading the same save)."""
    import os
    import warnings

    from ragged_fsdp.checkpoint import load_local, save_local
    from ragged_fsdp.fsdp import ResidualWarning

    mesh = _mesh(world, False)
    ef = GradientReduce(torch.int8, True)
    plain = _model(mesh, GradientReduce(torch.int8))
    _steps(plain, torch.optim.SGD(plain.parameters(), lr=0.05), rank, 0, 2)
    d = os.path.join(_shared_dir(), "plain")
    save_local(plain.state_dict(), d)
    dist.barrier()
    after = {}
    for how in ("load_local", "load_state_dict", "fresh"):
        m = _model(mesh, ef)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        if how != "fresh":
            _steps(m, opt, rank, 5, 7)  # a residual of its own
            assert any(v.to_local().any() for k, v in m.state_dict().items() if "_wire_residual_" in k)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if how == "load_local":
                load_local(m.state_dict(), d, strict=False)
            else:
                sd = {k: v for k, v in m.state_dict().items() if "_wire_residual_" not in k}
                load_local(sd, d, strict=False)
                m.load_state_dict(sd, strict=False)
        said = [str(w.message) for w in caught if issubclass(w.category, ResidualWarning)]
        assert said and all("zero residual" in x for x in said), (how, said)
        res = [v for k, v in m.state_dict().items() if "_wire_residual_" in k]
        assert res and not any(v.to_local().any() for v in res), how
        _steps(m, opt, rank, 2, 3)
        after[how] = _full(m)
    for how in ("load_local", "load_state_dict"):
        for n in after["fresh"]:
            assert torch.equal(after[how][n], after["fresh"][n]), (how, n)
    _remove_dirs()


def case_rescale_residual_validates_its_factor(rank, world):
    """Finding 9: nan, inf, 1e39 (over fp32), 0, negative, a bool or a string raise a
    ValueError naming ``factor`` on every rank, before the residual changes; a factor that
    differs across ranks is a DisagreementError on every rank; 2.0 doubles it exactly."""
    from ragged_fsdp.agreement import DisagreementError

    m = _model(_mesh(world, False), GradientReduce(torch.int8, True, torch.float32))
    _steps(m, torch.optim.SGD(m.parameters(), lr=0.05), rank, 0, 2)

    def residual():
        return [v.to_local().clone() for k, v in m.state_dict().items() if "_wire_residual_" in k]

    before = residual()
    for bad in (float("nan"), float("inf"), -float("inf"), 1e39, 0.0, -2.0, True, "2"):
        with pytest.raises(ValueError, match="factor"):
            m.rescale_residual(bad)
    with pytest.raises(ValueError, match="factor"):  # only rank 1's is bad: every rank raises
        m.rescale_residual(float("nan") if rank == 1 else 2.0)
    with pytest.raises(DisagreementError, match="rescale_residual"):
        m.rescale_residual(2.0 if rank == 0 else 4.0)
    assert all(torch.equal(a, b) for a, b in zip(before, residual()))
    m.rescale_residual(2.0)
    assert all(torch.equal(a * 2, b) for a, b in zip(before, residual()))


def case_staged_residual_refused_at_the_optimizer_step(rank, world):
    """Error feedback's step-boundary check: a backward that raised after some buffers
    staged their residual, then ``opt.step()`` with no forward between: refused (naming
    reset_iter_state); after ``reset_iter_state()`` the run equals one that skipped the batch."""
    from ragged_fsdp.fsdp import StepBoundaryError

    fmt = GradientReduce(torch.int8, True)
    mesh = _mesh(world, False)
    runs = {}
    for faulty in (False, True):
        m = _model(mesh, fmt)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        _steps(m, opt, rank, 0, 1)
        if faulty:
            Boom.fault[0] = RuntimeError
            x, y = _batch(rank, 1)
            with pytest.raises(RuntimeError, match="simulated"):
                nn.functional.mse_loss(m(x), y).backward()
            Boom.fault[0] = None
            with pytest.raises(StepBoundaryError, match="reset_iter_state"):
                opt.step()
            m.reset_iter_state()
            opt.zero_grad()
        _steps(m, opt, rank, 2, 4)
        runs[faulty] = _full(m)
    for n in runs[False]:
        assert torch.equal(runs[True][n], runs[False][n]), n


CASES = [case_nonfinite_step_does_not_poison_the_residual, case_grad_scaler_recovers,
         case_grad_scaler_scale_change_rescales_the_residual,
         case_recovery_after_backward_fault_is_exact, case_gradient_reduce_agreed_across_ranks,
         case_trace_reports_the_bytes_sent, case_resume_is_bitwise_at_the_same_world,
         case_resume_at_another_world_starts_from_zero, case_checkpoint_with_and_without_residual,
         case_load_without_residual_resets_it, case_rescale_residual_validates_its_factor,
         case_staged_residual_refused_at_the_optimizer_step]


@pytest.fixture(scope="module")
def results():
    return run_cases(4, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.removeprefix("case_"))
def test_gradient_reduce_ef_w4(results, case):
    check_case(results, case, 4)
