"""DCP's planning at W ranks, on one process: the coordinator's work on W local plans.

``dcp.save`` gathers every rank's local ``SavePlan`` on the coordinator, which runs
``create_global_plan`` (dedup, one ``TensorStorageMetadata`` per tensor with every chunk,
the overlap check) and writes the result as ``.metadata``; ``dcp.load`` makes every rank read
that file and match its own chunks against it (``create_read_items_for_chunk_list``, or
``ScaleLoadPlanner``'s index, the default of our load functions), then gathers the load plans too. All of that is pure given the chunks, so the local plans are
built here from the layout math (``scale_layout``) with DCP's own item types, and DCP's own
functions are timed on them.

What is left out, and why: DCP's default ``flatten_state_dict=True`` also puts each rank's
key mapping (one entry per tensor) into its plan, so the coordinator merges W mappings of
every key (O(W x tensors) for either framework); these plans are built with
``flatten_state_dict=False`` (what a flat model state dict needs) and that mapping's size is
reported separately (``mapping_bytes``).
"""

from __future__ import annotations

import pickle
import resource
import time
from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from scale_layout import Chunk

__all__ = ["save_plans", "coordinator_save", "load_plan_rank", "rss_bytes", "mapping_bytes"]

_PROPS = TensorProperties(dtype=torch.float32)


def rss_bytes() -> int:
    """Resident set size now (Linux ``/proc``; the peak from getrusage elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def save_plans(chunks_by_rank: dict[int, list[Chunk]], shapes: dict[str, tuple[int, ...]]) -> list[SavePlan]:
    """The local ``SavePlan`` of every rank, as ``DefaultSavePlanner.create_local_plan``
    makes them for DTensor values (one SHARD item per chunk; fp32 properties)."""
    sizes = {k: torch.Size(v) for k, v in shapes.items()}
    plans = []
    for r in sorted(chunks_by_rank):
        items = []
        for fqn, off, sz in chunks_by_rank[r]:
            o = torch.Size(off)
            items.append(WriteItem(
                index=MetadataIndex(fqn, o), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=o, sizes=torch.Size(sz)),
                                            properties=_PROPS, size=sizes[fqn])))
        plans.append(SavePlan(items))
    return plans


def coordinator_save(plans: list[SavePlan], planner_cls=DefaultSavePlanner) -> dict:
    """Run the coordinator's ``create_global_plan`` on ``plans``; CPU seconds, RSS growth while
    its result is alive, bytes of the gathered local plans and of the ``.metadata`` file."""
    gathered = sum(len(pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)) for p in plans)
    planner = planner_cls(flatten_state_dict=False)
    rss0 = rss_bytes()
    t0 = time.process_time()
    global_plan, metadata = planner.create_global_plan(plans)
    cpu = time.process_time() - t0
    rss = rss_bytes() - rss0
    md_bytes = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    t1 = time.process_time()
    pickle.loads(md_bytes)  # what every rank pays to read .metadata at load time
    read_cpu = time.process_time() - t1
    chunks = sum(len(v.chunks) for v in metadata.state_dict_metadata.values())
    del global_plan
    return {"cpu_s": cpu, "rss_bytes": max(rss, 0), "gathered_bytes": gathered, "metadata_bytes": len(md_bytes),
            "metadata_read_cpu_s": read_cpu, "metadata_chunks": chunks, "metadata": metadata}


def load_plan_rank(metadata, chunks: Sequence[Chunk]) -> dict:
    """One rank's ``create_local_plan`` for a load, both ways: DCP's matching
    (``create_read_items_for_chunk_list``: each of its chunks against every saved chunk of
    that tensor still active in DCP's sweep, all of them for row chunks of a wide tensor) and
    ``ScaleLoadPlanner``'s (a sorted index of the tensor's saved runs, bisected). CPU seconds
    of each, read items, the pickled plan's bytes (what the load gathers on the coordinator),
    the chunk pairs ours compared, and whether the two plans are equal (they must be)."""
    from ragged_fsdp.checkpoint.scale_planner import read_items_for_chunk_list

    by_fqn: dict[str, list[ChunkStorageMetadata]] = {}
    for fqn, off, sz in chunks:
        by_fqn.setdefault(fqn, []).append(ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(sz)))
    sd_md = metadata.state_dict_metadata
    t0 = time.process_time()
    items = []
    for fqn, local in by_fqn.items():
        items += create_read_items_for_chunk_list(fqn, sd_md[fqn], local)
    cpu = time.process_time() - t0
    stats: dict = {}
    t1 = time.process_time()
    ours = []
    for fqn, local in by_fqn.items():
        ours += read_items_for_chunk_list(fqn, sd_md[fqn], local, stats)
    cpu_scale = time.process_time() - t1
    return {"cpu_s": cpu, "cpu_s_scale": cpu_scale, "read_items": len(items), "pairs_scale": stats.get("pairs", 0),
            "fallback_tensors": stats.get("fallback", 0), "same_plan": ours == items,
            "plan_bytes": len(pickle.dumps(LoadPlan(items), protocol=pickle.HIGHEST_PROTOCOL))}


def mapping_bytes(fqns: Sequence[str]) -> int:
    """Bytes of the key mapping each rank adds to its plan under ``flatten_state_dict=True``."""
    return len(pickle.dumps({k: (k,) for k in fqns}, protocol=pickle.HIGHEST_PROTOCOL))
