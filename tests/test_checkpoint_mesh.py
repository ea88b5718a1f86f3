"""Checkpoints of models on multi-dimensional meshes: HSDP (2x2), TP x FSDP (dp 2 x tp 2, HF
Llama) and EP x FSDP (dp 2 x ep 2, the reference MoE with fused experts; ``ep``: experts on
``mesh["dp"]`` and the rest on the flattened ``dp_ep`` mesh, ``ep_fn``: torchtitan's
``shard_placement_fn`` call shape), W=4 on gloo.

One W=4 launch. Each layout trains two AdamW steps and saves model and optimizer with
``ragged_fsdp.checkpoint.save({"train": TrainState(model, opt)}, root)``; the full tensors
at save time (``full_tensor()`` of every parameter and optimizer state) are the reference.
Every load below is compared with ``torch.equal`` (bitwise: loading only moves bytes):

* into a 1-D ``fully_shard`` model at W=4 (another layout, another optimizer object), and
  the TP layout's ``async_save`` checkpoint too;
* into a 1-D ``fully_shard`` model on a 3-rank sub-mesh (ranks 0-2) in the same launch,
  with ``process_group=`` the sub-mesh's group (rank 3 sits that load out);
* on rank 0, into plain tensors with ``dcp.load(..., no_dist=True)``;
* from the other Llama layout (HSDP <-> TP);
* from a plain single-process model's checkpoint (written in this pytest process with
  ``ckpt convert IN.pt DIR``) into each layout, with ``load`` and with the full-state-dict
  path (``set_state_dict(full_state_dict=True, broadcast_from_rank0=True)``; for TP also
  with the full state dict on every rank);
* ``get_state_dict(full_state_dict=True, cpu_offload=True)`` of each layout.

Then, in this process (no process group): each layout's checkpoint into a plain model and
optimizer through ``load(TrainState)``, and through ``ckpt convert DIR OUT.pt`` (plus
``ckpt info``, and every element stored once: HSDP replicas are deduplicated).
"""

from __future__ import annotations

import math
import os

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _dist import check_case, run_cases  # noqa: E402
from _dist import assert_same as _assert_same, snapshot as _snapshot  # noqa: E402

WORLD = 4
ENV = "RAGGED_CKPT_MESH_DIR"
LAYOUTS = ("hsdp", "tp", "ep", "ep_fn")
STEPS = 2


def _d(*parts):
    return os.path.join(os.environ[ENV], *parts)


# -- models, layouts, references ----------------------------------------------------------

def _arch(layout):
    return "moe" if layout.startswith("ep") else "llama"


def _build(arch, seed=0):
    from _mesh import hf_llama, moe

    torch.manual_seed(seed)
    return moe() if arch == "moe" else hf_llama()


def _loss(arch):
    from _mesh import hf_loss, moe_loss

    return moe_loss if arch == "moe" else hf_loss


def _blocks(model):
    return model.layers if hasattr(model, "layers") else model.model.layers


def _wrap(layout, model):
    """The layout as tests/test_fsdp_mesh.py builds it; returns (model, data-parallel index)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_fsdp.fsdp import fully_shard

    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for block in _blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, dist.get_rank()
    if layout == "tp":
        from torch.distributed.tensor.parallel import parallelize_module

        from _mesh import tp_plan

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan())
        for block in _blocks(model):
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model, mesh.get_coordinate()[0]
    if layout == "ep":
        from ragged_fsdp.models.expert_parallel import apply_expert_parallel

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        dp_ep = mesh["dp", "ep"]._flatten("dp_ep")
        apply_expert_parallel(model, mesh["ep"])
        for block in _blocks(model):
            fully_shard(block.feed_forward.experts, mesh=mesh["dp"])
            fully_shard(block, mesh=dp_ep)
        fully_shard(model, mesh=dp_ep)
        return model, dist.get_rank()
    if layout == "ep_fn":  # torchtitan 0.3.0's call shape: the experts' mesh from shard_placement_fn
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
        from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
        from torch.distributed.tensor import Shard

        from ragged_fsdp.models.expert_parallel import apply_expert_parallel

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        dp_ep = mesh["dp", "ep"]._flatten("dp_ep")
        edp, dp = _get_mesh_info(mesh["dp"]), _get_mesh_info(dp_ep)
        apply_expert_parallel(model, mesh["ep"])
        for block in _blocks(model):
            experts = set(block.feed_forward.experts.parameters())
            fully_shard(block, mesh=dp_ep, shard_placement_fn=lambda p, e=experts: ShardPlacementResult(
                placement=Shard(0), mesh_info=edp if p in e else dp))
        fully_shard(model, mesh=dp_ep)
        return model, dist.get_rank()
    raise AssertionError(layout)


def _wrap_1d(model, mesh):
    from ragged_fsdp.fsdp import fully_shard

    for block in _blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, arch, dp_index, steps=STEPS, seed=0):
    from _dist import global_batch
    from _mesh import VOCAB

    loss_fn = _loss(arch)
    for step in range(steps):
        tokens, targets = global_batch(100 * seed + step, 8, 8, VOCAB)
        lo = 2 * dp_index
        loss_fn(model, tokens[lo:lo + 2], targets[lo:lo + 2]).backward()
        opt.step()
        opt.zero_grad()


def _fresh(model):
    """A fresh AdamW with zero-filled state on ``model`` (the load must overwrite it all)."""
    from ragged_fsdp.checkpoint import TrainState

    opt = _adamw(model)
    TrainState(model, opt).state_dict()  # creates the state (torch's zero-lr step)
    return opt


def _ref(layout):
    return torch.load(_d(f"ref_{layout}.pt"))


# -- cases (W=4) ---------------------------------------------------------------------------

def case_save_layouts(rank, world):
    """Train each layout, save it, write its full tensors as the reference."""
    import ragged_fsdp.checkpoint as ck
    from ragged_fsdp import RaggedShard
    from ragged_fsdp.checkpoint import StateDictOptions

    for layout in LAYOUTS:
        arch = _arch(layout)
        model, dp = _wrap(layout, _build(arch))
        opt = _adamw(model)
        _train(model, opt, arch, dp)
        assert all(isinstance(p.placements[0], RaggedShard) or isinstance(p.placements[1], RaggedShard)
                   for p in model.parameters()), layout
        if arch == "moe":  # experts: dp x ep (2-D), the rest on the flattened dp_ep mesh
            from torch.distributed.tensor import Shard

            w1 = _blocks(model)[0].feed_forward.experts.w1
            assert isinstance(w1.placements[0], RaggedShard) and w1.placements[1] == Shard(0), (layout, w1.placements)
        snap = _snapshot(model, opt)
        ck.save({"train": ck.TrainState(model, opt), "step": STEPS}, _d(layout), step=STEPS)
        if rank == 0:
            torch.save(snap, _d(f"ref_{layout}.pt"))
        if layout == "tp":  # the background save keeps the 2-D layout too
            ck.async_save({"train": ck.TrainState(model, opt), "step": STEPS}, checkpoint_id=_d("tp_async")).result()
        # the full-state-dict getter gathers every mesh dim
        msd, osd = ck.get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            _assert_same(msd, snap["model"], f"{layout} full model state dict")
            _assert_same(osd["state"], snap["optim"], f"{layout} full optimizer state dict")
        else:
            assert msd == {}, layout
    dist.barrier()


def case_load_1d_w4(rank, world):
    import ragged_fsdp.checkpoint as ck
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for layout in LAYOUTS:
        model = _wrap_1d(_build(_arch(layout), seed=5), mesh)
        opt = _fresh(model)
        state = {"train": ck.TrainState(model, opt), "step": 0}
        ck.load_latest(_d(layout), state)
        assert state["step"] == STEPS
        _assert_same(_snapshot(model, opt), _ref(layout), f"{layout} -> 1-D W=4")
        if layout == "tp":
            model = _wrap_1d(_build("llama", seed=5), mesh)
            opt = _fresh(model)
            ck.load({"train": ck.TrainState(model, opt), "step": 0}, _d("tp_async"))
            _assert_same(_snapshot(model, opt), _ref(layout), "tp (async_save) -> 1-D W=4")


def case_load_1d_w3_submesh(rank, world):
    """A 3-rank sub-mesh of the W=4 world: only ranks 0-2 load, through its group."""
    import ragged_fsdp.checkpoint as ck
    from torch.distributed.device_mesh import DeviceMesh

    sub = DeviceMesh("cpu", torch.arange(3), mesh_dim_names=("dp",))  # every rank constructs it
    if rank >= 3:
        return
    group = sub.get_group()
    for layout in LAYOUTS:
        model = _wrap_1d(_build(_arch(layout), seed=5), sub)
        opt = _fresh(model)
        ck.load_latest(_d(layout), {"train": ck.TrainState(model, opt), "step": 0}, process_group=group)
        _assert_same(_snapshot(model, opt), _ref(layout), f"{layout} -> 1-D W=3 sub-mesh")


def case_load_plain_on_rank0(rank, world):
    """Rank 0 alone, ``no_dist=True``: the checkpoint into plain tensors."""
    import torch.distributed.checkpoint as dcp

    if rank != 0:
        return
    for layout in LAYOUTS:
        import ragged_fsdp.checkpoint as ck

        want = _ref(layout)
        path = ck.latest_checkpoint(_d(layout)).path
        plain = _build(_arch(layout), seed=5)
        state = {"train": {"model": plain.state_dict(),
                           "optim": {"state": {n: {k: torch.zeros_like(v) for k, v in st.items()}
                                               for n, st in want["optim"].items()}}}}
        dcp.load(state, checkpoint_id=path, no_dist=True,
                 planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
        plain.load_state_dict(state["train"]["model"])
        _assert_same(dict(plain.named_parameters()), want["model"], f"{layout} -> plain (rank 0, no_dist)")
        _assert_same(state["train"]["optim"]["state"], want["optim"], f"{layout} -> plain optimizer (rank 0)")


def case_cross_layout(rank, world):
    """The HSDP Llama checkpoint into the TP layout and the TP one into HSDP."""
    import ragged_fsdp.checkpoint as ck

    for src, dst in (("hsdp", "tp"), ("tp", "hsdp")):
        model, _ = _wrap(dst, _build("llama", seed=5))
        opt = _fresh(model)
        ck.load_latest(_d(src), {"train": ck.TrainState(model, opt), "step": 0})
        _assert_same(_snapshot(model, opt), _ref(src), f"{src} -> {dst}")


def case_plain_into_layouts(rank, world):
    """A plain single-process checkpoint (converted from torch.save here by ``ckpt
    convert``) into every layout: through ``load`` and through the full-state-dict path."""
    import ragged_fsdp.checkpoint as ck
    from ragged_fsdp.checkpoint import StateDictOptions

    for layout in LAYOUTS:
        arch = _arch(layout)
        want = torch.load(_d(f"plain_{arch}_ref.pt"))
        model, _ = _wrap(layout, _build(arch, seed=5))
        opt = _fresh(model)
        ck.load({"train": ck.TrainState(model, opt)}, _d(f"plain_{arch}_dcp"))
        _assert_same(_snapshot(model, opt), want, f"plain -> {layout} (load)")

        model, _ = _wrap(layout, _build(arch, seed=5))
        opt = _fresh(model)
        full = torch.load(_d(f"plain_{arch}.pt"))["train"] if rank == 0 else {"model": {}, "optim": {}}
        ck.set_state_dict(model, opt, model_state_dict=full["model"], optim_state_dict=full["optim"],
                          options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        _assert_same(_snapshot(model, opt), want, f"plain -> {layout} (broadcast_from_rank0)")
        if layout == "tp":  # every rank passes the full state dict (no broadcast)
            model, _ = _wrap(layout, _build(arch, seed=5))
            opt = _fresh(model)
            full = torch.load(_d(f"plain_{arch}.pt"))["train"]
            ck.set_state_dict(model, opt, model_state_dict=full["model"], optim_state_dict=full["optim"],
                              options=StateDictOptions(full_state_dict=True))
            _assert_same(_snapshot(model, opt), want, f"plain -> {layout} (full_state_dict on every rank)")


CASES = [case_save_layouts, case_load_1d_w4, case_load_1d_w3_submesh, case_load_plain_on_rank0,
         case_cross_layout, case_plain_into_layouts]


# -- this process: plain models (no process group) ---------------------------------------

def _plain_checkpoints(root):
    """A plain model per architecture, trained one step in this process, saved with
    torch.save (TrainState's state dict) and converted to DCP with ``ckpt convert``."""
    from ragged_fsdp.checkpoint import TrainState
    from ragged_fsdp.cli import main

    for arch in ("llama", "moe"):
        model = _build(arch, seed=11)
        opt = _adamw(model)
        _train(model, opt, arch, 0, steps=1, seed=7)
        torch.save(_snapshot(model, opt), os.path.join(root, f"plain_{arch}_ref.pt"))
        pt = os.path.join(root, f"plain_{arch}.pt")
        torch.save({"train": TrainState(model, opt).state_dict()}, pt)
        assert main(["ckpt", "convert", pt, os.path.join(root, f"plain_{arch}_dcp")]) == 0


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import sys
    import time

    root = str(tmp_path_factory.mktemp("ckpt_mesh"))
    os.environ[ENV] = root
    _plain_checkpoints(root)
    t0 = time.perf_counter()
    out = run_cases(WORLD, CASES, timeout=600)
    print(f"[checkpoint mesh] W={WORLD}: {len(CASES)} cases in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return root, out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[5:])
def test_checkpoint_mesh(results, case):
    check_case(results[1], case, WORLD)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_checkpoint_into_plain_model(results, layout):
    """No process group: ``load(TrainState)`` into a plain model and a fresh AdamW."""
    import ragged_fsdp.checkpoint as ck

    check_case(results[1], case_save_layouts, WORLD)
    os.environ[ENV] = results[0]
    model = _build(_arch(layout), seed=5)
    opt = _fresh(model)
    ck.load_latest(_d(layout), {"train": ck.TrainState(model, opt), "step": 0})
    _assert_same(_snapshot(model, opt), _ref(layout), f"{layout} -> plain model (no process group)")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ckpt_convert_layout_checkpoint(results, layout, tmp_path, capsys):
    """``ckpt convert DIR OUT.pt --key train``: a plain model and optimizer load the file."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ragged_fsdp.checkpoint import read_metadata, resolve, set_state_dict
    from ragged_fsdp.cli import main

    check_case(results[1], case_save_layouts, WORLD)
    os.environ[ENV] = results[0]
    out = tmp_path / f"{layout}.pt"
    assert main(["ckpt", "convert", _d(layout), str(out), "--key", "train"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["ckpt", "info", _d(layout)]) == 0
    info = capsys.readouterr().out
    assert "train.optim.state." in info and "train.model." in info and "stored items with a CRC-32" in info
    # every element is stored exactly once: HSDP replicas declare the same boxes, DCP keeps one
    md = read_metadata(resolve(_d(layout)))
    tensors = {k: m for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    for k, m in tensors.items():
        assert sum(math.prod(c.sizes) for c in m.chunks) == math.prod(m.size), (layout, k, m.chunks)
        assert sum(idx.fqn == k for idx in md.storage_data) == len(m.chunks), (layout, k)
    sd = torch.load(out, weights_only=True)
    model = _build(_arch(layout), seed=5)
    opt = _fresh(model)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _assert_same(_snapshot(model, opt), _ref(layout), f"{layout} -> ckpt convert -> plain model")
