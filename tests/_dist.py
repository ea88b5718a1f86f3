"""Run many test cases on W gloo ranks with one process launch.

Starting a process group costs seconds, so each test module starts W workers once (a
module-scoped fixture calls ``run_cases``) and every case function runs inside them in turn.
A case is a module-level function ``case(rank, world)``; it raises to fail. A barrier
after each case keeps ranks in step, and a collective timeout turns a hang into an error.

Workers are spawned (fresh interpreters). A forkserver that had imported torch once cut
each launch's start-up by seconds, but one CI run lost a rank to SIGABRT mid-collective
with it (never with spawn), so it is not used. Each worker takes the launching process's
environment as it is at launch time.
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback

import torch.multiprocessing as mp


def case_timeout_s() -> int:
    return int(os.environ.get("RAGGED_TEST_COLLECTIVE_TIMEOUT", "120"))


def worker_context():
    """The multiprocessing context test workers start from."""
    return mp.get_context("spawn")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, cases, queue, env):
    os.environ.clear()
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if os.environ.get("RAGGED_FSDP_CHECK_ORDER") == "1":
        from _checking_device import install

        install()
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=case_timeout_s())
    )
    for fn in cases:
        name = f"{fn.__module__}.{fn.__name__}"
        try:
            fn(rank, world)
            queue.put((name, rank, None))
        except BaseException as e:  # also pytest.fail/skip (BaseExceptions): report, keep going
            if isinstance(e, KeyboardInterrupt):
                raise
            queue.put((name, rank, traceback.format_exc()))
        try:
            dist.barrier()
        except Exception:
            queue.put((name, rank, "barrier after case failed:\n" + traceback.format_exc()))
            return
    dist.barrier()
    dist.destroy_process_group()


def check_case(results: dict[str, str | None], case, world: int | None = None) -> None:
    """Fail the calling pytest test with the ranks' tracebacks if ``case`` failed."""
    import pytest

    err = results[f"{case.__module__}.{case.__name__}"]
    if err:
        pytest.fail(f"W={world}:\n{err}" if world is not None else err, pytrace=False)


def run_cases(world: int, cases, timeout: float = 900) -> dict[str, str | None]:
    """Run ``cases`` on ``world`` ranks; map each case name to None (passed) or the errors."""
    ctx = worker_context()
    queue = ctx.Queue()
    port = _free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world, port, list(cases), queue, env)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[str, list[str]] = {f"{c.__module__}.{c.__name__}": [] for c in cases}
    reports = dict.fromkeys(results, 0)
    pending = len(cases) * world
    import queue as _q
    import time

    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        try:
            name, rank, err = queue.get(timeout=2.0)
        except _q.Empty:
            # every worker gone with reports missing (a crash, or a rank that left after a
            # failed barrier): nothing more can arrive, so stop waiting for the deadline
            if not any(p.is_alive() for p in procs):
                break
            continue
        pending -= 1
        reports[name] += 1
        if err is not None:
            results[name].append(f"[rank {rank}] {err}")
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    out = {}
    for name, errs in results.items():
        out[name] = "\n".join(errs) if errs else None
    for name, n in reports.items():
        if n < world and not out[name]:
            out[name] = f"{world - n} rank(s) did not report (crash or timeout); exit codes {[p.exitcode for p in procs]}"
    return out


# -- training comparisons (used by tests/test_fsdp_*.py) ----------------------------------

def cpu_mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def global_batch(step: int, batch: int, seq: int, vocab: int, seed: int = 1234):
    """The same (tokens, targets) on every rank for a given step."""
    import torch

    g = torch.Generator().manual_seed(seed + step)
    data = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def full(p):
    """A parameter or gradient as a full plain tensor (gathers DTensors)."""
    from torch.distributed.tensor import DTensor

    return p.full_tensor() if isinstance(p, DTensor) else p


def compare_training(
    rank: int,
    world: int,
    build,
    wrap,
    *,
    steps: int = 5,
    batch_per_rank: int = 2,
    seq: int = 16,
    lr: float = 1e-2,
    micro: int = 1,
    sync_each_micro: bool = False,
    keep_unsharded_between_micro: bool = False,
    loss_rtol: float = 1e-5,
    param_atol: float = 5e-4,
    check_grad_none: bool = True,
    after_step=None,
    loss_fn=None,
    vocab: int | None = None,
):
    """Train ``wrap(build(), mesh)`` on W ranks and ``build()`` in one process on the same
    global batches with AdamW; check losses (relative) and parameters (absolute).

    ``build()`` must give identical models when called under the same seed. With
    ``micro > 1`` each step accumulates ``micro`` micro-batches (without gradient sync
    except the last unless ``sync_each_micro``; with ``keep_unsharded_between_micro`` the
    parameters also stay unsharded until the last); the reference sees one large batch.
    """
    import torch
    import torch.distributed as dist

    mesh = cpu_mesh(world)
    torch.manual_seed(0)
    ref = build()
    torch.manual_seed(0)
    model = build()
    model = wrap(model, mesh) or model
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, foreach=True)
    vocab = vocab or ref.cfg.vocab_size
    if loss_fn is None:
        def loss_fn(m, t, y):
            return m.loss(t, y)
    B = batch_per_rank * world * micro
    for step in range(steps):
        tokens, targets = global_batch(step, B, seq, vocab)
        ref_loss = loss_fn(ref, tokens, targets)
        ref_loss.backward()
        total = torch.zeros(())
        per = batch_per_rank * world
        for m in range(micro):
            lo = m * per + rank * batch_per_rank
            t, y = tokens[lo:lo + batch_per_rank], targets[lo:lo + batch_per_rank]
            if micro > 1 and not sync_each_micro:
                model.set_requires_gradient_sync(m == micro - 1)
            if micro > 1 and keep_unsharded_between_micro:  # torch's recipe: no re-gather
                model.set_reshard_after_backward(m == micro - 1)
            loss = loss_fn(model, t, y) / micro
            loss.backward()
            total += loss.detach()
        dist.all_reduce(total)
        total /= world
        rel = abs(total.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-12)
        assert rel <= loss_rtol, f"step {step}: loss {total.item()} vs reference {ref_loss.item()} (rel {rel:.2e})"
        named_ref = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            q = named_ref[name]
            if check_grad_none:
                assert (p.grad is None) == (q.grad is None), (
                    f"step {step}: {name}.grad is {'None' if p.grad is None else 'set'} but the "
                    f"reference's is {'None' if q.grad is None else 'set'}")
        if after_step is not None:
            after_step(step, model, ref)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    named_ref = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        err = (full(p).detach() - named_ref[name].detach()).abs().max().item()
        assert err <= param_atol, f"{name}: max |param - reference| = {err:.2e} > {param_atol}"
    return model, ref


def snapshot(model, opt) -> dict:
    """Every parameter and optimizer state as a full plain tensor, by parameter name
    (collective when the model is sharded: call on every rank)."""
    import torch

    names = {id(p): n for n, p in model.named_parameters()}
    params = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    states = {}
    for p, st in opt.state.items():
        states[names[id(p)]] = {k: full(v).detach().clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
    return {"model": params, "optim": states}


def assert_same(got: dict, want: dict, what: str) -> None:
    """Nested dicts of tensors equal bitwise (same keys, dtypes and shapes)."""
    import torch

    assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))[:10]}"
    for k in want:
        if isinstance(want[k], dict):
            assert_same(got[k], want[k], f"{what}.{k}")
            continue
        a, b = got[k], want[k]
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{what}.{k}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
        assert torch.equal(a, b), f"{what}.{k}: values differ (max |diff| {(a.double() - b.double()).abs().max().item():.3e})"
