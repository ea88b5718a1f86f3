"""One process as rank r of W: ``fully_shard`` set-up measured on torch's fake process group.

``fake_world(W, r)`` starts the fake group (collectives are shape-correct and move nothing)
as rank ``r`` of ``W``; ``shard_rank`` builds a catalog model (or a subset) on the meta
device, wraps it the way ``scale_layout.wrap_groups`` describes (each block, then the root)
with ragged_fsdp's or torch's ``fully_shard``, and reports per group: process CPU seconds,
the bytes the collectives were given (what the layout agreement sends and receives), the CPU
spent in ragged_fsdp's agreement checks, and the tracemalloc'ed host memory still held
afterwards. It also returns the rank's DCP save-plan chunks, so the bench can check the
layout math (``scale_layout``) against what DCP really gets.
"""

from __future__ import annotations

import contextlib
import time
import tracemalloc
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from scale_layout import Chunk, wrap_groups

__all__ = ["fake_world", "meta_module", "shard_rank", "RankSetup", "local_plan_chunks", "warm_up"]


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """The default process group as rank ``rank`` of ``world_size`` on torch's fake backend,
    and a 1-D CPU mesh over it. ``cpu:fake`` (not ``fake``) so that fully_shard's backend
    check sees a CPU-capable group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # DTensor's sharding propagation caches output specs keyed by input specs, and a spec's
    # mesh compares equal across worlds of the same size, so rank r's tensors would come out
    # with the previous world's mesh (and its coordinate): start each world with it empty.
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    dist.init_process_group("cpu:fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def meta_module(model) -> nn.Module:
    """``model``'s parameters (catalog shapes, fp32) on the meta device, in a module tree named
    like the Hugging Face model (``model.layers.3.mlp.down_proj.weight``)."""
    root = nn.Module()
    for g in model.groups:
        for t in g.tensors:
            *path, leaf = t.name.split(".")
            mod = root
            for part in path:
                if part not in mod._modules:
                    mod.add_module(part, nn.Module())
                mod = mod._modules[part]
            mod.register_parameter(leaf, nn.Parameter(torch.empty(t.shape, device="meta")))
    return root


@dataclass
class RankSetup:
    """What one rank's set-up cost, per ``fully_shard`` group (block prefixes, "" = root)."""

    cpu_s: dict[str, float] = field(default_factory=dict)
    mem_bytes: dict[str, int] = field(default_factory=dict)  # tracemalloc: held after the call
    sent: dict[str, int] = field(default_factory=dict)  # bytes the collectives were given
    received: dict[str, int] = field(default_factory=dict)
    collectives: dict[str, int] = field(default_factory=dict)
    check_cpu_s: dict[str, float] = field(default_factory=dict)  # ragged_fsdp's agreement checks


class _Counter:
    """Wraps the torch.distributed collectives fully_shard can call and adds up the bytes they
    are handed (a fake group moves nothing, so the arguments are the only measure)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
             "broadcast_object_list", "reduce_scatter_tensor", "all_to_all_single", "barrier", "gather_object")

    def __init__(self):
        self.sent = self.received = self.calls = 0

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.calls += 1
            world = dist.get_world_size(kwargs.get("group"))
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            lists = [a for a in args if isinstance(a, list)]
            if name == "all_reduce":
                self.sent += tensors[0].nbytes
                self.received += tensors[0].nbytes
            elif name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
                out, inp = tensors[0], tensors[1]
                self.sent += inp.nbytes
                self.received += out.nbytes if name == "all_gather_into_tensor" else inp.nbytes // world
            elif name == "all_gather":
                self.sent += tensors[0].nbytes
                self.received += sum(t.nbytes for t in lists[0])
            elif name == "all_gather_object":
                import pickle

                n = len(pickle.dumps(args[1]))
                self.sent += n
                self.received += n * world  # a lower bound: the others' objects can be bigger
            elif tensors:
                self.sent += sum(t.nbytes for t in tensors)
                self.received += sum(t.nbytes for t in tensors)
            return fn(*args, **kwargs)

        return counted

    @contextlib.contextmanager
    def active(self):
        saved = {n: getattr(dist, n) for n in self.NAMES}
        for n, fn in saved.items():
            setattr(dist, n, self._wrap(n, fn))
        try:
            yield self
        finally:
            for n, fn in saved.items():
                setattr(dist, n, fn)


@contextlib.contextmanager
def _timed_checks(out: list):
    """Adds the CPU seconds of ragged_fsdp's cross-rank checks (layout and mesh answers) to
    ``out[0]``, through the engine's public probe point ``cross_rank_checks``."""
    from ragged_fsdp.fsdp import probe

    def timed(point, fn):
        def run(*a, **k):
            t0 = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                out[0] += time.process_time() - t0
        return run

    with probe(timed, ["cross_rank_checks"]):
        yield


def _fully_shard(framework: str):
    if framework == "ragged_fsdp":
        from ragged_fsdp import fully_shard
    elif framework == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        raise ValueError(f"scale bench: framework {framework!r} is not 'ragged_fsdp' or 'fsdp2'")
    return fully_shard


def shard_rank(model, world_size: int, rank: int, framework: str, granularity: str | None = None,
               trace_memory: bool = False, want_chunks: bool = False):
    """Wrap ``model`` (ModelShapes) as rank ``rank`` of ``world_size``; returns
    ``(RankSetup, chunks or None)``."""
    fully_shard = _fully_shard(framework)
    kw = {}
    if framework == "ragged_fsdp" and granularity is not None:
        kw["granularity_fn"] = lambda name, p: granularity
    out = RankSetup()
    with fake_world(world_size, rank) as mesh:
        module = meta_module(model)
        for wg in wrap_groups(model):
            target = module.get_submodule(wg.prefix) if wg.prefix else module
            counter, check = _Counter(), [0.0]
            if trace_memory:
                tracemalloc.start()
            with counter.active(), _timed_checks(check):
                t0 = time.process_time()
                fully_shard(target, mesh=mesh, **kw)
                out.cpu_s[wg.prefix] = time.process_time() - t0
            if trace_memory:
                out.mem_bytes[wg.prefix] = tracemalloc.get_traced_memory()[0]
                tracemalloc.stop()
            out.sent[wg.prefix], out.received[wg.prefix] = counter.sent, counter.received
            out.collectives[wg.prefix] = counter.calls
            out.check_cpu_s[wg.prefix] = check[0]
        chunks = local_plan_chunks(module.state_dict()) if want_chunks else None
    return out, chunks


def local_plan_chunks(state_dict) -> list[Chunk]:
    """The chunks DCP's default planner writes for this rank (``create_local_plan``)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planner = DefaultSavePlanner(flatten_state_dict=False)
    planner.set_up_planner(state_dict, storage_meta=None, is_coordinator=False)
    plan = planner.create_local_plan()
    return [(i.index.fqn, tuple(i.tensor_data.chunk.offsets), tuple(i.tensor_data.chunk.sizes)) for i in plan.items]


def warm_up() -> None:
    """Import and run both frameworks once on a tiny model, so the first measured call does
    not pay for loading modules."""
    from ragged_fsdp.models.catalog import Group, ModelShapes, Tensor

    tiny = ModelShapes("tiny", "tiny", None, {}, [
        Group("embed", [Tensor("model.embed_tokens.weight", (8, 4))]),
        Group("layers.0", [Tensor("model.layers.0.mlp.up_proj.weight", (8, 4))]),
        Group("head", [Tensor("lm_head.weight", (8, 4))]),
    ])
    for fw in ("ragged_fsdp", "fsdp2"):
        shard_rank(tiny, 4, 0, fw, want_chunks=True)
