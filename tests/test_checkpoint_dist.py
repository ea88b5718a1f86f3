"""Checkpoints of fully_shard models on gloo ranks: reshard across W, resume, state dicts.

One module fixture runs five launches in order (each launch runs many cases):

A. W=4: train the tiny LLaMA a few steps with torch AdamW, Muon and AdamW8bit; save model
   and optimizer with plain ``dcp.save`` (and the full tensors, as the reference to compare
   with); atomic ``save`` twice.
B. W=3, another granularity: ``dcp.load`` the W=4 checkpoints, every tensor bitwise equal;
   ``get_/set_*_state_dict`` sharded, full and ``broadcast_from_rank0``; mismatch errors;
   ``load_latest`` of the atomic root.
C. W=2: load through ``TrainState`` (fresh optimizers); resume part 1: N+M uninterrupted steps,
   and N steps then an atomic save; an HF model loaded from ``save_pretrained`` files
   (``broadcast_from_rank0``) and saved with ``dcp.save``.
D. W=2, new processes: resume part 2 (load, M steps): losses and parameters bitwise equal.
E. W=1: load the W=4 checkpoints again, and the HF one.
Then, in this process: the same checkpoints into plain unsharded models with ``dcp.load``.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from _dist import run_cases
from _dist import assert_same as _assert_same, snapshot as _snapshot

ENV = "RAGGED_CKPT_TEST_DIR"
HAS_HF = importlib.util.find_spec("transformers") is not None
OPTIMIZERS = ("adamw", "muon", "adamw8bit")
N_STEPS, M_STEPS = 3, 2


# -- helpers (run inside the workers) ------------------------------------------------------
def _d(*parts):
    return os.path.join(os.environ[ENV], *parts)


_MESH = {}


def _mesh(world):
    if world not in _MESH:
        from torch.distributed.device_mesh import init_device_mesh

        _MESH[world] = init_device_mesh("cpu", (world,))
    return _MESH[world]


def _granularity(opt_name, variant):
    """A granularity policy per optimizer; ``variant`` changes the layout (save vs load)."""
    from ragged_fsdp.optim import AdamW8bit, muon_granularity

    if opt_name == "adamw8bit":  # blocks of 64 must stay whole; 128 keeps them whole too
        return AdamW8bit.granularity_for(64 if variant == 0 else 128, 1024)
    if opt_name == "muon":
        return muon_granularity if variant == 0 else (lambda n, p: "rows:4" if p.dim() == 2 else None)
    return None if variant == 0 else (lambda n, p: "rows:3" if p.dim() == 2 else None)


def _optimizer(opt_name, model):
    from ragged_fsdp.optim import AdamW8bit, Muon, muon_param_groups

    if opt_name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    if opt_name == "muon":
        return Muon(muon_param_groups(model, muon={"lr": 0.02}, adamw={"lr": 3e-3}))
    return AdamW8bit(model.parameters(), lr=1e-2, block_size=64, min_8bit_size=1024)


def _build(world, opt_name, variant, cfg=None):
    from ragged_fsdp.fsdp import fully_shard
    from ragged_fsdp.models.llama import Llama, LlamaConfig

    mesh = _mesh(world)
    torch.manual_seed(0)
    model = Llama(cfg or LlamaConfig.tiny())
    gran = _granularity(opt_name, variant)
    for block in model.layers:
        fully_shard(block, mesh=mesh, granularity_fn=gran)
    fully_shard(model, mesh=mesh, granularity_fn=gran)
    return model, _optimizer(opt_name, model)


def _batch(step, rank, world, per_rank=2, seq=12, vocab=96):
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, vocab, (per_rank * world, seq + 1), generator=g)
    lo = rank * per_rank
    return data[lo:lo + per_rank, :-1], data[lo:lo + per_rank, 1:]


def _train(model, opt, start, steps, rank, world):
    losses = []
    for step in range(start, start + steps):
        t, y = _batch(step, rank, world)
        loss = model.loss(t, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses


def _warm_state(model, opt):
    """Give a fresh optimizer state (one step on zero data) so opt.state_dict() has slots."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad()


def _hf_config():
    from transformers import LlamaConfig as HFConfig

    return HFConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)


def _hf_sharded(world, seed, gran=None):
    from transformers import LlamaForCausalLM

    from ragged_fsdp.fsdp import fully_shard

    torch.manual_seed(seed)
    model = LlamaForCausalLM(_hf_config())
    mesh = _mesh(world)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, granularity_fn=gran)
    fully_shard(model, mesh=mesh, granularity_fn=gran)
    return model


# -- odd layouts through plain DCP: k-dim boxes, units, empty ranks, 0-d, empty, HSDP ----
def _box_tensors():
    g = torch.Generator().manual_seed(5)
    return {
        "t3": torch.randn(5, 4, 3, generator=g),          # runs over 3 flattened dims
        "t3_rows": torch.randn(4, 5, 6, generator=g),     # dims (0, 1): rows of 6
        "rows_u4": torch.randn(29, 7, generator=g),       # 4-row units, last one partial
        "flat_u64": torch.randn(300, generator=g),        # 64-element blocks
        "scalar": torch.randn((), generator=g),
        "empty": torch.zeros(0, 4),
        "int8": torch.randint(-100, 100, (40, 3), generator=g, dtype=torch.int8),
    }


def _cuts(n, world, seed):
    g = torch.Generator().manual_seed(seed)
    c = sorted(torch.randint(0, n + 1, (world - 1,), generator=g).tolist())
    counts = [b - a for a, b in zip([0] + c, c + [n])]
    if world > 2:  # a rank with nothing in the middle
        counts[0] += counts[1]
        counts[1] = 0
    return tuple(counts)


def _box_placements(world, variant):
    from ragged_fsdp import RaggedShard

    v = 100 * variant
    return {
        "t3": RaggedShard((0, 1, 2), _cuts(60, world, v + 1)),
        "t3_rows": RaggedShard((0, 1), _cuts(20, world, v + 2)),
        "rows_u4": RaggedShard((0,), _cuts(8, world, v + 3), 4),
        "flat_u64": RaggedShard((0,), _cuts(5, world, v + 4), 64),
        "scalar": RaggedShard((), tuple(int(r == (variant + 1) % world) for r in range(world))),
        "empty": RaggedShard((0,), (0,) * world),
        "int8": RaggedShard((0, 1), _cuts(120, world, v + 5)),
    }


def _box_state(world, variant, zeros=False):
    from ragged_fsdp import distribute_tensor

    mesh, pl = _mesh(world), _box_placements(world, variant)
    return {k: distribute_tensor(torch.zeros_like(t) if zeros else t, mesh, [pl[k]])
            for k, t in _box_tensors().items()}


def _hsdp_mesh():
    if "hsdp" not in _MESH:
        from torch.distributed.device_mesh import init_device_mesh

        _MESH["hsdp"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "dp"))
    return _MESH["hsdp"]


def case_a_save_boxes(rank, world):
    from torch.distributed.tensor import Replicate

    from ragged_fsdp import RaggedShard, distribute_tensor

    state = _box_state(world, 0)
    # HSDP: replicated over "rep", ragged over "dp"; DCP keeps one copy of each box
    t = _box_tensors()["rows_u4"] * 3
    state["hsdp"] = distribute_tensor(t, _hsdp_mesh(), [Replicate(), RaggedShard((0, 1), (150, 53))])
    dcp.save({"boxes": state}, checkpoint_id=_d("boxes"))
    # full and broadcast state dicts work on the 2-D mesh too
    import ragged_fsdp.checkpoint as ck

    m = torch.nn.Module()
    m.w = torch.nn.Parameter(distribute_tensor(torch.zeros_like(t), _hsdp_mesh(), state["hsdp"].placements))
    ck.set_model_state_dict(m, {"w": t} if rank == 0 else {},
                            options=ck.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    assert torch.equal(m.w.full_tensor(), t)
    got = ck.get_model_state_dict(m, options=ck.StateDictOptions(full_state_dict=True))
    assert torch.equal(got["w"], t)


def _load_boxes(rank, world):
    """The W=4 'boxes' checkpoint under other cuts."""
    state = _box_state(world, 1, zeros=True)
    want = _box_tensors()
    state["hsdp"] = _box_state(world, 1, zeros=True)["rows_u4"]
    want["hsdp"] = want["rows_u4"] * 3
    dcp.load({"boxes": state}, checkpoint_id=_d("boxes"))
    for k, t in want.items():
        got = state[k].full_tensor()
        assert got.dtype == t.dtype and torch.equal(got, t), k


def case_b_load_boxes(rank, world):
    _load_boxes(rank, world)


def case_e_load_boxes(rank, world):
    _load_boxes(rank, world)
    state = _box_state(world, 1, zeros=True)
    dcp.load({"boxes": state}, checkpoint_id=_d("boxes_async"))
    for k, t in _box_tensors().items():
        assert torch.equal(state[k].full_tensor(), t), f"async_save: {k}"


# -- phase A: W=4 saves ------------------------------------------------------------------
def case_a_save_references(rank, world):
    for name in OPTIMIZERS:
        model, opt = _build(world, name, 0)
        _train(model, opt, 0, 2, rank, world)
        ref = _snapshot(model, opt)
        if rank == 0:
            torch.save(ref, _d(f"ref_{name}_full.pt"))
        # the standard idiom, nothing ragged_fsdp-specific
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=_d(f"ref_{name}"))


def case_a_atomic_save(rank, world):
    import ragged_fsdp.checkpoint as ck

    model, opt = _build(world, "adamw", 0)
    _train(model, opt, 0, 1, rank, world)
    first = ck.save({"train": ck.TrainState(model, opt)}, _d("root_a"))
    _train(model, opt, 1, 1, rank, world)
    second = ck.save({"train": ck.TrainState(model, opt), "step": 2}, _d("root_a"), keep_last=1)
    assert (first.step, second.step) == (0, 1), (first, second)
    assert [c.step for c in ck.list_checkpoints(_d("root_a"))] == [1]
    snap = _snapshot(model, opt)
    if rank == 0:
        torch.save(snap, _d("root_a_full.pt"))
    dist.barrier()
    with pytest.raises(FileExistsError):
        ck.save({"x": torch.zeros(1)}, _d("root_a"), step=1)


def case_c_hf_save(rank, world):
    if not HAS_HF:
        return
    import ragged_fsdp.checkpoint as ck

    model = _hf_sharded(world, seed=123)  # other weights than the files
    full = {}
    if rank == 0:
        from transformers import LlamaForCausalLM

        full = LlamaForCausalLM.from_pretrained(_d("hf_pretrained")).state_dict()
    ck.set_model_state_dict(model, full, options=ck.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    dcp.save({"model": model.state_dict()}, checkpoint_id=_d("hf_dcp"))


# -- loads at W = 3, 2, 1 --------------------------------------------------------------------
def _load_plain_idiom(rank, world, variant):
    for name in OPTIMIZERS:
        model, opt = _build(world, name, variant)
        _warm_state(model, opt)
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(state, checkpoint_id=_d(f"ref_{name}"))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        got = _snapshot(model, opt)
        want = torch.load(_d(f"ref_{name}_full.pt"))
        _assert_same(got, want, f"{name} at W={world}")


def case_b_load_plain_idiom(rank, world):
    _load_plain_idiom(rank, world, 1)


def case_b_state_dict_functions(rank, world):
    import ragged_fsdp.checkpoint as ck

    opts = ck.StateDictOptions
    for name in OPTIMIZERS:
        want = torch.load(_d(f"ref_{name}_full.pt"))
        model, opt = _build(world, name, 1)
        # sharded get + dcp.load + sharded set, fresh optimizer (get creates its state)
        msd = ck.get_model_state_dict(model)
        osd = ck.get_optimizer_state_dict(model, opt)
        assert all(type(v).__name__ == "RaggedDTensor" for v in msd.values())
        sd = {"model": msd, "optim": opt.state_dict()}
        dcp.load(sd, checkpoint_id=_d(f"ref_{name}"))
        ck.set_model_state_dict(model, sd["model"])
        opt.load_state_dict(sd["optim"])
        _assert_same(_snapshot(model, opt), want, f"{name} sharded")
        del osd

        # full, gathered to rank 0 on the CPU
        full_m = ck.get_model_state_dict(model, options=opts(full_state_dict=True, cpu_offload=True))
        full_o = ck.get_optimizer_state_dict(model, opt, options=opts(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            _assert_same(full_m, want["model"], f"{name} full model")
            got_o = {k: {s: v for s, v in st.items()} for k, st in full_o["state"].items()}
            _assert_same(got_o, want["optim"], f"{name} full optim")
        else:
            assert full_m == {} and full_o == {}

        # broadcast_from_rank0 into a model with other values: only rank 0 has the dicts
        model2, opt2 = _build(world, name, 0)
        _train(model2, opt2, 5, 1, rank, world)
        o = opts(full_state_dict=True, broadcast_from_rank0=True)
        ck.set_model_state_dict(model2, full_m if rank == 0 else {}, options=o)
        ck.set_optimizer_state_dict(model2, opt2, full_o if rank == 0 else {}, options=o)
        _assert_same(_snapshot(model2, opt2), want, f"{name} broadcast_from_rank0")

        # full on every rank (no broadcast)
        full_m_all = ck.get_model_state_dict(model, options=opts(full_state_dict=True))
        full_o_all = ck.get_optimizer_state_dict(model, opt, options=opts(full_state_dict=True))
        model3, opt3 = _build(world, name, 0)
        _train(model3, opt3, 6, 1, rank, world)
        o = opts(full_state_dict=True)
        ck.set_state_dict(model3, opt3, model_state_dict=full_m_all, optim_state_dict=full_o_all, options=o)
        _assert_same(_snapshot(model3, opt3), want, f"{name} full_state_dict")


def case_b_mismatch_errors(rank, world):
    from torch.distributed.checkpoint.api import CheckpointException

    import ragged_fsdp.checkpoint as ck
    from ragged_fsdp.models.llama import LlamaConfig

    path = _d("ref_adamw")
    full = torch.load(_d("ref_adamw_full.pt"))["model"]
    cases = {  # config, keys our errors must name, the key plain dcp.load names (or None)
        "wider": (LlamaConfig.tiny(dim=64), ["tok_embeddings.weight", "layers.1.feed_forward.w2.weight"],
                  "tok_embeddings.weight"),
        "deeper": (LlamaConfig.tiny(n_layers=3), ["layers.2.attention.wq.weight", "layers.2.ffn_norm.weight"],
                   "layers.2."),
        "shallower": (LlamaConfig.tiny(n_layers=1), ["layers.1.attention.wq.weight"], None),
    }
    for label, (cfg, keys, plain_key) in cases.items():
        model, opt = _build(world, "adamw", 0, cfg)
        before = _snapshot(model, opt)["model"]
        state = {"model": model.state_dict()}
        with pytest.raises(ck.CheckpointMismatchError) as e:
            ck.load(state, path)
        for key in keys:
            assert key in str(e.value), (label, key, str(e.value))
        if plain_key is not None:
            # plain dcp.load refuses too and names a key (it ignores keys the state lacks,
            # hence no check for "shallower"); CheckpointException is a BaseException
            with pytest.raises(CheckpointException) as e2:
                dcp.load(state, checkpoint_id=path)
            assert plain_key in str(e2.value), (label, str(e2.value))
        # a full state dict of the other model
        with pytest.raises(RuntimeError) as e3:
            ck.set_model_state_dict(model, full, options=ck.StateDictOptions(full_state_dict=True))
        for key in keys:
            assert key in str(e3.value), (label, key, str(e3.value))
        _assert_same(_snapshot(model, opt)["model"], before, f"{label}: nothing loaded")


def case_b_load_latest(rank, world):
    import ragged_fsdp.checkpoint as ck

    model, opt = _build(world, "adamw", 1)
    found = ck.load_latest(_d("root_a"), {"train": ck.TrainState(model, opt), "step": 0})
    assert found is not None and found.step == 1 and found.state["step"] == 2
    _assert_same(_snapshot(model, opt), torch.load(_d("root_a_full.pt")), "load_latest")
    assert ck.load_latest(_d("no_such_root"), {"x": torch.zeros(1)}, missing_ok=True) is None


def case_e_hf_load(rank, world):
    if not HAS_HF:
        return
    import ragged_fsdp.checkpoint as ck
    from transformers import LlamaForCausalLM

    model = _hf_sharded(world, seed=7, gran=lambda n, p: "rows:2" if p.dim() == 2 else None)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=_d("hf_dcp"))
    model.load_state_dict(state["model"])
    full = ck.get_model_state_dict(model, options=ck.StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        want = LlamaForCausalLM.from_pretrained(_d("hf_pretrained")).state_dict()
        _assert_same(full, want, "hf")


def case_c_trainstate_load(rank, world):
    import ragged_fsdp.checkpoint as ck

    for name in OPTIMIZERS:
        model, opt = _build(world, name, 1)
        ts = ck.TrainState(model, opt)
        # a TrainState checkpoint keys optimizer state by name; the W=4 one by position, so
        # load the W=4 checkpoint with the plain idiom into the TrainState's dicts
        sd = ts.state_dict()
        ids = {n: i for i, n in enumerate(n for g in opt.param_groups for n in _group_names(model, g))}
        flat = {"model": sd["model"], "optim": {"state": {ids[n]: st for n, st in sd["optim"]["state"].items()}}}
        dcp.load(flat, checkpoint_id=_d(f"ref_{name}"), planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
        ts.load_state_dict(sd)
        _assert_same(_snapshot(model, opt), torch.load(_d(f"ref_{name}_full.pt")), f"{name} TrainState")


def _group_names(model, group):
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for p in group["params"]]


def case_c_async_save(rank, world):
    import ragged_fsdp.checkpoint as ck

    state = _box_state(world, 0)
    ck.async_save({"boxes": state}, checkpoint_id=_d("boxes_async")).result()


def case_c_resume_part1(rank, world):
    import ragged_fsdp.checkpoint as ck

    for name in OPTIMIZERS:
        model, opt = _build(world, name, 0)
        losses = _train(model, opt, 0, N_STEPS + M_STEPS, rank, world)
        snap = _snapshot(model, opt)
        if rank == 0:
            torch.save({"losses": losses[N_STEPS:], "state": snap}, _d(f"resume_{name}_ref.pt"))
        del model, opt
        model, opt = _build(world, name, 0)
        _train(model, opt, 0, N_STEPS, rank, world)
        ck.save({"train": ck.TrainState(model, opt), "next_step": N_STEPS}, _d(f"resume_{name}"))


def case_d_resume_part2(rank, world):
    import ragged_fsdp.checkpoint as ck

    for name in OPTIMIZERS:
        model, opt = _build(world, name, 0)
        found = ck.load_latest(_d(f"resume_{name}"), {"train": ck.TrainState(model, opt), "next_step": 0})
        start = found.state["next_step"]
        assert start == N_STEPS
        losses = _train(model, opt, start, M_STEPS, rank, world)
        ref = torch.load(_d(f"resume_{name}_ref.pt"))
        assert losses == ref["losses"], f"{name}: losses {losses} vs uninterrupted {ref['losses']}"
        _assert_same(_snapshot(model, opt), ref["state"], f"{name} resumed")


def case_d_state_dict_keeps_params_trainable(rank, world):
    model, opt = _build(world, "adamw", 0)
    model.state_dict()
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert not frozen, f"model.state_dict() left parameters with requires_grad=False: {frozen[:5]}"


def case_e_load_plain_idiom(rank, world):
    _load_plain_idiom(rank, world, 1)


PHASES = [
    (4, [case_a_save_references, case_a_atomic_save, case_a_save_boxes]),
    (3, [case_b_load_plain_idiom, case_b_state_dict_functions, case_b_mismatch_errors, case_b_load_latest,
         case_b_load_boxes]),
    (2, [case_c_trainstate_load, case_c_resume_part1, case_c_hf_save, case_c_async_save]),
    (2, [case_d_resume_part2, case_d_state_dict_keeps_params_trainable]),
    (1, [case_e_load_plain_idiom, case_e_hf_load, case_e_load_boxes]),
]


def _prepare_hf(root):
    if not HAS_HF:
        return
    from transformers import LlamaForCausalLM

    torch.manual_seed(42)
    LlamaForCausalLM(_hf_config()).save_pretrained(os.path.join(root, "hf_pretrained"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    os.environ[ENV] = root
    _prepare_hf(root)
    out = {}
    import sys
    import time

    for world, cases in PHASES:
        t0 = time.perf_counter()
        res = run_cases(world, cases, timeout=600)
        out.update({k.rsplit(".", 1)[1]: v for k, v in res.items()})
        print(f"[checkpoint] W={world}: {len(cases)} cases in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return root, out


def _check(results, name):
    err = results[1][name]
    if err:
        pytest.fail(err, pytrace=False)


# -- tests -------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["case_a_save_references", "case_b_load_plain_idiom", "case_e_load_plain_idiom"])
def test_save_w4_load_w3_w1_bitwise(results, case):
    _check(results, case)


def test_state_dict_functions_sharded_full_broadcast(results):
    _check(results, "case_b_state_dict_functions")


def test_trainstate_load_w2(results):
    _check(results, "case_c_trainstate_load")


def test_mismatch_raises_naming_keys(results):
    _check(results, "case_b_mismatch_errors")


def test_atomic_save_and_load_latest(results):
    _check(results, "case_a_atomic_save")
    _check(results, "case_b_load_latest")


def test_resume_bitwise(results):
    _check(results, "case_c_resume_part1")
    _check(results, "case_d_resume_part2")


def test_state_dict_keeps_params_trainable(results):
    _check(results, "case_d_state_dict_keeps_params_trainable")


def test_odd_layouts_and_hsdp_reshard(results):
    """3-D runs, units, empty ranks, 0-d, zero-size and int8 tensors, and a 2-D (HSDP) mesh:
    saved at W=4, loaded at W=3 and W=1 with other cuts, and into plain tensors here; the
    same tensors through ``ragged_fsdp.checkpoint.async_save`` at W=2."""
    _check(results, "case_a_save_boxes")
    _check(results, "case_c_async_save")
    _check(results, "case_b_load_boxes")
    _check(results, "case_e_load_boxes")
    want = _box_tensors()
    want["hsdp"] = want["rows_u4"] * 3
    state = {"boxes": {k: torch.full_like(t, 7) for k, t in want.items()}}
    dcp.load(state, checkpoint_id=os.path.join(results[0], "boxes"))
    for k, t in want.items():
        assert torch.equal(state["boxes"][k], t), k


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
def test_hf_round_trip(results, tmp_path):
    from transformers import LlamaForCausalLM

    import ragged_fsdp.checkpoint as ck

    _check(results, "case_c_hf_save")
    _check(results, "case_e_hf_load")
    root = results[0]
    want = LlamaForCausalLM.from_pretrained(os.path.join(root, "hf_pretrained")).state_dict()
    # the sharded W=4 checkpoint -> a plain HF model in this process (no process group)
    torch.manual_seed(1)
    plain = LlamaForCausalLM(_hf_config())
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(root, "hf_dcp"))
    plain.load_state_dict(state["model"])
    _assert_same(plain.state_dict(), want, "hf plain")
    # ... and back to HF files, then to a torch.save file
    plain.save_pretrained(tmp_path / "again")
    _assert_same(LlamaForCausalLM.from_pretrained(tmp_path / "again").state_dict(), want, "hf again")
    sd = ck.dcp_to_torch_save(os.path.join(root, "hf_dcp"), tmp_path / "hf.pt", key="model")
    _assert_same(sd, {k: v for k, v in want.items() if k in sd}, "hf torch.save")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_w4_checkpoint_into_plain_model(results, name):
    """dcp.load in one process, no process group, into an unsharded model and optimizer."""
    from ragged_fsdp.models.llama import Llama, LlamaConfig
    import ragged_fsdp.checkpoint as ck

    _check(results, "case_a_save_references")
    root = results[0]
    want = torch.load(os.path.join(root, f"ref_{name}_full.pt"))
    torch.manual_seed(3)
    model = Llama(LlamaConfig.tiny())
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(root, f"ref_{name}"))
    model.load_state_dict(state["model"])
    _assert_same(dict(model.named_parameters()), want["model"], f"{name} plain model")
    # optimizer state: the whole checkpoint read as plain tensors, into a plain optimizer
    opt = _optimizer(name, model)
    opt.load_state_dict(ck.read_full(os.path.join(root, f"ref_{name}"), key="optim"))
    names = {id(p): n for n, p in model.named_parameters()}
    got = {names[id(p)]: {k: v for k, v in st.items() if isinstance(v, torch.Tensor)} for p, st in opt.state.items()}
    _assert_same(got, want["optim"], f"{name} plain optimizer")
