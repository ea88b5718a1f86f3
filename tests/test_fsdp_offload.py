"""Offload per state (``ragged_fsdp.OffloadPolicy``) and the phase switch
(``offload_to_host`` / ``load_to_device``), gloo W = 2, host copies forced.

On a CPU mesh host and device are the same memory, so every case first calls
``force_host_copies()``: the host buffers are then separate CPU storages and each copy
really runs through the device seam. Checked:

* each policy (all three = torch's ``CPUOffloadPolicy``, grads, optimizer states, grads +
  states) trains bitwise like the same W = 2 model without a policy (4 AdamW steps; the
  no-policy run is itself checked against one process elsewhere, tests/test_fsdp_numerics.py);
* where each buffer lives (storage identity) and, from the trace, that each host segment is
  copied to the device right before its all-gather and that copy freed once it was waited
  for; grads copied to the host after their reduction, one host segment per buffer;
* the optimizer-state policy streams one bucket per DBuffer; a torch optimizer is refused;
* ``offload_to_host`` / ``load_to_device``: everything moves (old storages freed), the model
  refuses to run in between, DCP saves the right values from the host, and training then
  continues bitwise as if nothing happened (ragged AdamW and torch AdamW).
"""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.fsdp import OffloadPolicy as TorchOffloadPolicy

from _dist import check_case, cpu_mesh, global_batch, run_cases
from _patterns import _ce, _tiny, _wrap_blocks

import ragged_fsdp
from ragged_fsdp import OffloadPolicy, load_to_device, offload_to_host
from ragged_fsdp.fsdp import trace
from ragged_fsdp.fsdp.offload.policy import force_host_copies, resolve_offload
from ragged_fsdp.models.llama import Llama
from ragged_fsdp.optim import AdamW

ENV = "RAGGED_TEST_OFFLOAD_DIR"
STEPS = 4


def _build(world, policy, seed=0):
    torch.manual_seed(seed)
    model = Llama(_tiny())
    kw = {} if policy is None else {"offload_policy": policy}
    return _wrap_blocks(model, cpu_mesh(world), **kw)


def _units(model):
    from ragged_fsdp.fsdp.core.init import state_of

    out = []
    for m in model.modules():
        st = state_of(m)
        if st is not None and st.group is not None and st.group.units and all(u not in out for u in st.group.units):
            out.extend(st.group.units)
    return out


def _locals(model):
    return [p.to_local().detach().clone() for p in model.parameters()]


def _train(model, opt, rank, world, steps, start=0, between=None):
    losses = []
    for s in range(start, start + steps):
        t, y = global_batch(s, 2 * world, 12, 96)
        t, y = t[2 * rank: 2 * rank + 2], y[2 * rank: 2 * rank + 2]
        loss = _ce(model(t), y)
        loss.backward()
        if between is not None:
            between()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def _same(a, b, what):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what} {i} differs: max |diff| {(x.float() - y.float()).abs().max()}"


# -- each policy against no policy ------------------------------------------------------------
POLICIES = {
    "all": CPUOffloadPolicy(pin_memory=False),
    "grads": OffloadPolicy(grads=True),
    "states": OffloadPolicy(optimizer_states=True),
    "grads+states": OffloadPolicy(grads=True, optimizer_states=True),
}


def _check_params_trace(log, model):
    """Every all-gather of a host segment follows its h2d copy; the copy is freed (unstage)
    before the buffer is staged again, and nothing stays staged."""
    for u in _units(model):
        assert u.buf.host_sharded and u.buf.staged is None
        name = f"{u.group_name()}#{u.index}"
        kinds = [e.kind for e in log.of(buffer=name) if e.kind in ("h2d", "all_gather", "unstage")]
        assert kinds and len(kinds) % 3 == 0, kinds
        assert kinds == ["h2d", "all_gather", "unstage"] * (len(kinds) // 3), kinds
        for info in u.infos:  # the parameters are views of the host segment
            assert info.sharded.to_local().untyped_storage().data_ptr() == u.buf.sharded.untyped_storage().data_ptr()


def case_policies_bitwise(rank, world):
    force_host_copies(True)
    try:
        ref = _build(world, None)
        ref_opt = AdamW(ref.parameters(), lr=1e-2)
        want = _train(ref, ref_opt, rank, world, STEPS)
        for name, policy in POLICIES.items():
            model = _build(world, policy)
            opt = AdamW(model.parameters(), lr=1e-2)
            grads_seen = []

            def look():  # after backward, before the step
                for u in _units(model):
                    gs = [i.sharded.grad for i in u.infos if i.sharded.grad is not None]
                    grads_seen.append({g.to_local().untyped_storage().data_ptr() for g in gs})

            with trace() as log:
                got = _train(model, opt, rank, world, STEPS, between=look)
            _same(got, want, f"{name}: loss")
            _same(_locals(model), _locals(ref), f"{name}: parameter")
            moved_grads = name != "states"
            if name == "all":
                _check_params_trace(log, model)
            else:
                assert not log.of("h2d") and all(not u.buf.host_sharded for u in _units(model))
            d2h = [e for e in log.of("d2h") if e.backward]
            if moved_grads:
                # one host gradient segment per trainable buffer and backward, after its reduction
                n = sum(1 for u in _units(model) if u.trainable)
                assert len(d2h) == n * STEPS, (len(d2h), n)
                for e in d2h:
                    ev = log.events
                    k = ev.index(e)
                    assert any(x.kind == "reduce_scatter" and x.buffer == e.buffer for x in ev[:k])
                assert all(len(s) == 1 for s in grads_seen), "a buffer's grads span more than one storage"
            else:
                assert not d2h
            stats = opt.last_step_stats
            if name in ("states", "grads", "grads+states"):
                assert stats["streamed_buckets"] == sum(1 for u in _units(model) if u.trainable), stats
                assert stats["streamed_bytes_in"] > 0
            if name in ("states", "grads+states"):
                # the states are host buffers: not the device's; one per state key and kind
                st = [opt.state[p]["exp_avg"].to_local() for p in model.parameters()]
                assert len({t.untyped_storage().data_ptr() for t in st}) == 1
                assert stats["streamed_bytes_out"] == stats["streamed_bytes_in"] - (
                    0 if name == "states" else sum(u.buf.segment * 4 for u in _units(model) if u.trainable))
    finally:
        force_host_copies(False)


def case_torch_optimizer_refused(rank, world):
    force_host_copies(True)
    try:
        model = _build(world, OffloadPolicy(optimizer_states=True))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        t, _ = global_batch(0, 2, 12, 96)
        model(t).sum().backward()
        with pytest.raises(TypeError, match=r"ragged_fsdp\.optim\.AdamW"):
            opt.step()
        # with everything offloaded a torch optimizer steps on the host, bitwise as without
        ref = _build(world, None)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        model = _build(world, CPUOffloadPolicy(pin_memory=False))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        _same(_train(model, opt, rank, world, 2), _train(ref, ref_opt, rank, world, 2), "torch AdamW loss")
        _same(_locals(model), _locals(ref), "torch AdamW parameter")
    finally:
        force_host_copies(False)


def case_bad_input(rank, world):
    mesh = cpu_mesh(world)
    with pytest.raises(TypeError, match="offload_policy must be"):
        ragged_fsdp.fully_shard(Llama(_tiny()), mesh=mesh, offload_policy="cpu")
    with pytest.raises(ValueError, match="pin_memory=False"):
        ragged_fsdp.fully_shard(Llama(_tiny()), mesh=mesh, offload_policy=OffloadPolicy(grads=True, pin_memory=True))
    with pytest.raises(ValueError, match="load_to_device|no fully_shard"):
        offload_to_host(Llama(_tiny()))
    model = _build(world, None)
    with pytest.raises(RuntimeError, match="offload_to_host first"):
        load_to_device(model)


# -- the phase switch -------------------------------------------------------------------------
def _storages(ts):
    return {t.untyped_storage().data_ptr() for t in ts if t.untyped_storage().nbytes()}


def _switch_case(rank, world, make_opt, policy=None):
    force_host_copies(True)
    try:
        ref = _build(world, policy)
        ref_opt = make_opt(ref)
        want = _train(ref, ref_opt, rank, world, 2 * 2)
        model = _build(world, policy)
        opt = make_opt(model)
        got = _train(model, opt, rank, world, 2)
        params_before = _locals(model)
        states = lambda: [v.to_local() for s in opt.state.values() for k, v in s.items() if k != "step"]  # noqa: E731
        state_vals = [t.clone() for t in states()]
        state_ptrs, n_state_storages = _storages(states()), len(_storages(states()))
        units = _units(model)
        old_bufs = [weakref.ref(u.buf.sharded) for u in units if not u.buf.host_sharded]
        old_ptrs = _storages([p.to_local() for p in model.parameters()])
        with trace() as log:
            offload_to_host(model, opt)
        gc.collect()
        assert all(r() is None for r in old_bufs), "a device segment is still referenced after offload_to_host"
        if policy is None:
            assert not (_storages([p.to_local() for p in model.parameters()]) & old_ptrs)
            assert len(log.of("d2h")) == len(units)  # one copy per buffer
        if policy is None:
            # the flat state buffers moved whole: as many storages as before, none of the old ones
            assert len(_storages(states())) == n_state_storages and not (_storages(states()) & state_ptrs)
        else:  # the policy keeps them on the host already: they stay
            assert _storages(states()) == state_ptrs
        _same(_locals(model), params_before, "parameter after offload")
        _same(states(), state_vals, "state after offload")
        t, _ = global_batch(0, 2, 12, 96)
        with pytest.raises(RuntimeError, match="load_to_device"):
            model(t)
        # DCP sees the host tensors' values
        import torch.distributed.checkpoint as dcp

        path = os.path.join(os.environ[ENV], f"switch_{type(opt).__name__}_{policy is not None}")
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
        other = _build(world, None, seed=1)
        other_opt = make_opt(other)
        _train(other, other_opt, rank, world, 1)  # states exist, with other values
        sd = {"model": other.state_dict(), "optim": other_opt.state_dict()}
        dcp.load(sd, checkpoint_id=path)
        other.load_state_dict(sd["model"])
        other_opt.load_state_dict(sd["optim"])
        _same(_locals(other), params_before, "parameter loaded from the offloaded save")
        other_states = [v.to_local() for s in other_opt.state.values() for k, v in s.items() if k != "step"]
        _same(other_states, state_vals, "state loaded from the offloaded save")
        load_to_device(model, opt)
        got += _train(model, opt, rank, world, 2, start=2)
        _same(got, want, "loss")
        _same(_locals(model), _locals(ref), "parameter")
    finally:
        force_host_copies(False)


def case_switch_ragged_adamw(rank, world):
    _switch_case(rank, world, lambda m: AdamW(m.parameters(), lr=1e-2))


def case_switch_torch_adamw(rank, world):
    _switch_case(rank, world, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False))


def case_switch_with_states_policy(rank, world):
    _switch_case(rank, world, lambda m: AdamW(m.parameters(), lr=1e-2), OffloadPolicy(grads=True, optimizer_states=True))


CASES = [case_policies_bitwise, case_torch_optimizer_refused, case_bad_input, case_switch_ragged_adamw,
         case_switch_torch_adamw, case_switch_with_states_policy]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    os.environ[ENV] = str(tmp_path_factory.mktemp("offload"))
    return run_cases(2, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_w2(results, case):
    check_case(results, case, 2)


# -- the policy itself (no process group) -------------------------------------------------------
def test_policy_checks():
    with pytest.raises(TypeError, match="grads must be True or False"):
        OffloadPolicy(grads=1)
    with pytest.raises(ValueError, match="params=True, grads=True, optimizer_states=True"):
        OffloadPolicy(params=True)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_offload(TorchOffloadPolicy(), cuda) is None
    assert resolve_offload(OffloadPolicy(), cuda) is None
    assert resolve_offload(CPUOffloadPolicy(), cpu) is None  # host is the device: nothing moves
    assert resolve_offload(CPUOffloadPolicy(), cuda) == OffloadPolicy(True, True, True, pin_memory=True)
    assert resolve_offload(CPUOffloadPolicy(pin_memory=False), cuda).pin_memory is False
    with pytest.raises(ValueError, match="pin_memory=False"):
        resolve_offload(OffloadPolicy(optimizer_states=True, pin_memory=True), cpu)
    with pytest.raises(NotImplementedError, match="CPUOffloadPolicy"):
        resolve_offload(OffloadPolicy(grads=True, optimizer_states=True), cuda)
    assert resolve_offload(OffloadPolicy(optimizer_states=True), cuda) == OffloadPolicy(
        optimizer_states=True, pin_memory=True)
    force_host_copies(True)
    try:
        assert resolve_offload(OffloadPolicy(grads=True), cpu) == OffloadPolicy(grads=True, pin_memory=False)
    finally:
        force_host_copies(False)
