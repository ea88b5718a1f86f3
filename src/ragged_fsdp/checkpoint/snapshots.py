"""Snapshots in node memory with one peer's copy: lose a node, lose no step.

    snaps = Snapshots(model, opt, dir=f"/dev/shm/{job}", every=1)
    start, extra = snaps.restore(), snaps.extra          # 0 and None on a fresh start
    for step in range(start, steps):
        train_one_step(step)
        snaps.snapshot(step + 1, extra={"data": loader_position})

``snapshot(n)`` (collective; ``n``: steps done, i.e. the step to run next) keeps this rank's
shard of the model and optimizer state (error-feedback residuals included: they are in the
model's state dict) with ``save_local`` in the node-local ``dir``, and sends a byte copy of
its part to a rank on another node (:mod:`.snapshot_peers`). It counts only once every rank
has written its part and its copy (an agreement, then a marker per rank): a crash in the
middle leaves the previous snapshot, which is kept until the next one is committed.

``restore()`` (collective, after ``fully_shard``, ``global_order`` and the optimizer are
built at the new world size ``W'``) agrees with every rank on what each node holds, picks
the newest committed snapshot, fetches each part a rank needs from the rank that holds it
(its own or a peer's copy) and loads through ``load_local``, which reshards ``W -> W'``. It
returns the step to run next; ``extra`` is the ``extra`` of that snapshot.

What cannot be recovered raises on every rank (:class:`SnapshotLostError`: two nodes that
held the same part lost together; :class:`SnapshotMismatchError`: ``dir`` holds snapshots of
another run or configuration; :class:`SnapshotRestoreError`: a rank lost while restoring).
With ``fallback=root`` a lost snapshot falls back to the newest DCP checkpoint that
:meth:`Snapshots.checkpoint` saved under ``root``, with a warning naming the steps lost.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
import zlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ragged_fsdp.agreement import agree, agree_flags, first_line, raise_everywhere

from .errors import CheckpointWarning
from .local_save import LocalCheckpointError, load_local, save_local
from .snapshot_peers import node_key, peer_of, send_files
from .snapshot_store import (copy_dir, info_path, mark_committed, own_dir, part_names, remove_steps, scan, snap_dir,
                             staging_dir, write_atomic)
from .state_dict import get_state_dict, set_state_dict

__all__ = ["Snapshots", "SnapshotError", "SnapshotLostError", "SnapshotMismatchError", "SnapshotRestoreError",
           "choose_snapshot"]

_MASK62 = (1 << 62) - 1


class SnapshotError(LocalCheckpointError):
    """A snapshot could not be taken or restored."""


class SnapshotLostError(SnapshotError):
    """The newest committed snapshot (``step``) has parts that no surviving rank holds."""

    def __init__(self, step: int, message: str):
        super().__init__(message)
        self.step = step


class SnapshotMismatchError(SnapshotError):
    """The snapshot directory holds snapshots of another run or configuration."""


class SnapshotRestoreError(SnapshotError):
    """A collective failed while restoring (a rank lost during the recovery itself)."""


def _at_step_boundary(model: nn.Module) -> str | None:
    """Why this is not a step boundary, or None. A stand-in for the step-boundary check of
    the reliability issue (a public one is coming on another branch; point this at it): a
    gradient still held means the snapshot is taken between backward and ``zero_grad``."""
    held = [n for n, p in model.named_parameters() if p.grad is not None]
    if held:
        return (f"Snapshots.snapshot: {len(held)} parameters still hold gradients ({held[0]!r}, ...): a snapshot "
                "is taken at a step boundary, after opt.step() and opt.zero_grad(); partial gradients would "
                "not be in it")
    return None


def _digest(value: Any) -> int:
    buf = io.BytesIO()
    torch.save(value, buf)
    return zlib.crc32(buf.getvalue()) | (len(buf.getvalue()) << 32) & _MASK62


def choose_snapshot(reports: list[dict], run: int) -> tuple[int, dict[int, int], int] | None:
    """Pure: from every rank's report (``scan`` of its node directory plus ``node``), the
    newest committed snapshot as ``(step, {saved rank: holder rank}, saved W)``, or None when
    no rank holds a committed one. Raises :class:`SnapshotMismatchError` for a snapshot of
    another run and :class:`SnapshotLostError` when a part of the newest has no holder."""
    steps: dict[int, dict] = {}
    for rank, rep in enumerate(reports):
        for step, s in rep["steps"].items():
            info = s["info"]
            if info is not None and info["run"] != run:
                raise SnapshotMismatchError(
                    f"Snapshots.restore: the snapshot directory of rank {rank} ({rep['dir']}) holds a snapshot of "
                    f"another run or configuration (step {step}, run fingerprint {info['run']:x}, this run "
                    f"{run:x}: another model, optimizer or run id). Delete it or pass another dir; nothing was "
                    "loaded")
            e = steps.setdefault(step, {"marked": False, "holders": {}, "world": None, "ids": set()})
            e["marked"] |= s["marked"]
            if info is not None:
                e["world"] = info["world"]
                e["ids"].add(info["id"])
            for kind in ("own", "copy"):
                for r, w in s[kind].items():
                    e["holders"].setdefault((r, w), []).append(rank)
    committed = sorted((s for s, e in steps.items() if e["marked"] and e["world"] is not None), reverse=True)
    if not committed:
        return None
    step = committed[0]
    e = steps[step]
    if len(e["ids"]) != 1:
        raise SnapshotMismatchError(f"Snapshots.restore: step {step} exists as {len(e['ids'])} different snapshots "
                                    "on different nodes (directories reused across jobs?); delete them")
    world = e["world"]
    holders = {r: min(e["holders"][(r, world)]) for r in range(world) if (r, world) in e["holders"]}
    lost = sorted(set(range(world)) - set(holders))
    if lost:
        raise SnapshotLostError(step, 
            f"Snapshots.restore: the newest committed snapshot (step {step}, W = {world}) has lost part(s) {lost}: "
            "the node that held each and the node that held its copy were both lost. It cannot be restored; "
            "restart from a DCP checkpoint (Snapshots(..., fallback=root) does that with a warning)")
    return step, holders, world


class Snapshots:
    """Snapshots of ``model`` and ``optimizers`` every ``every`` steps in the node-local
    directory ``dir`` (default ``/dev/shm/ragged_fsdp-<TORCHELASTIC_RUN_ID>``; the same path
    string on every node of a cluster, a directory of its own per node). ``run``: a name that
    tells runs sharing a directory apart (default ``TORCHELASTIC_RUN_ID``). ``fallback``: a
    root of DCP checkpoints written by :meth:`checkpoint`, loaded when a snapshot is lost."""

    def __init__(self, model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (), *,
                 dir: str | os.PathLike | None = None, every: int = 1, run: str | None = None,
                 fallback: str | os.PathLike | None = None):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"Snapshots: every must be a positive int (steps between snapshots), got {every!r}")
        run_id = run if run is not None else os.environ.get("TORCHELASTIC_RUN_ID", "none")
        self.model = model
        self.optimizers = (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)
        self.dir = os.fspath(dir) if dir is not None else f"/dev/shm/ragged_fsdp-{run_id}"
        self.every = every
        self.fallback = None if fallback is None else os.fspath(fallback)
        self.extra: Any = None
        self.restored_from: int | None = None
        self.last_committed: int | None = None
        self.run = self._fingerprint(run_id)
        # the host group: these exchanges carry host bytes and objects (NCCL takes device
        # tensors only, so on NCCL a gloo group over the same ranks)
        self.group = dist.new_group(backend="gloo") if "nccl" in str(dist.get_backend()) else None
        agree("Snapshots(every=...)", every, group=self.group)

    # -- what a snapshot holds ----------------------------------------------------------------
    def _fingerprint(self, run_id: str) -> int:
        """The run and its configuration, not ``W``: state keys, global shapes and dtypes
        (error feedback's residuals excluded: their shape is ``W``'s), optimizer types."""
        rows = [run_id] + [type(o).__name__ for o in self.optimizers]
        for k, v in self.model.state_dict().items():
            if "_wire_residual" not in k and isinstance(v, torch.Tensor):
                rows.append((k, tuple(v.shape), str(v.dtype)))
        text = repr(rows).encode()
        return (zlib.crc32(text) << 31 | zlib.adler32(text)) & _MASK62

    def _state(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers)
        return {"model": model_sd, "optim": optim_sd}

    # -- taking one ---------------------------------------------------------------------------
    def snapshot(self, step: int, extra: Any = None) -> bool:
        """Keep the state after ``step`` steps (the step to run next) if ``step`` is a multiple
        of ``every``; ``extra`` (the data position, ...) must be equal on every rank. Collective.
        Returns whether a snapshot was committed."""
        if step % self.every:
            return False
        rank, world = dist.get_rank(), dist.get_world_size()
        why = _at_step_boundary(self.model)
        err = SnapshotError(why) if why else None
        _rm(snap_dir(self.dir, step))  # a torn attempt at this step (from before a restore)
        d = _digest(extra)
        keys = agree("Snapshots.snapshot", node_key(), error=err, same=False, group=self.group)
        snap_id, hi, neg = agree_flags([(int.from_bytes(os.urandom(8), "little") & _MASK62) | 1 if rank == 0 else 0,
                                        d, -d], self.group)
        if hi != -neg:
            raise SnapshotError("Snapshots.snapshot: extra differs between ranks; pass the same value on every "
                                "rank (a global data position, not a per-rank one); nothing was saved")
        save_local(self._state(), own_dir(self.dir, step))
        err = None
        try:
            info = {"run": self.run, "id": snap_id, "world": world, "step": step, "extra": extra,
                    "rng": torch.get_rng_state()}
            buf = io.BytesIO()
            torch.save(info, buf)
            write_atomic(info_path(self.dir, step, rank), buf.getvalue())
        except Exception as e:
            err = e
        raise_everywhere("Snapshots.snapshot", err, self.group)
        peers = peer_of(keys)
        plan = []
        for src, dst in enumerate(peers):
            if dst is not None:
                for name in part_names(src, world):  # .meta last: it marks a whole part
                    plan.append((src, dst, os.path.join(own_dir(self.dir, step), name),
                                 os.path.join(copy_dir(self.dir, step), name)))
        err = None
        try:
            send_files(plan, self.group)
        except Exception as e:
            err = e
        raise_everywhere("Snapshots.snapshot (peer copy)", err, self.group)
        mark_committed(self.dir, step, rank)
        # every rank reached this snapshot's collectives, so the previous one is committed on
        # every rank: keep it (until this one is marked everywhere) and this one
        keep = {step} | ({self.last_committed} if self.last_committed is not None else set())
        remove_steps(self.dir, keep)
        self.last_committed = step
        return True

    # -- restoring ----------------------------------------------------------------------------
    def restore(self) -> int:
        """Load the newest committed snapshot (resharded to this world size) and return the
        step to run next; 0 when there is none (and no fallback checkpoint). Collective."""
        rank = dist.get_rank()
        report = {"dir": self.dir, "node": node_key(), "steps": scan(self.dir)}
        for s in report["steps"].values():
            if s["info"] is not None:
                s["info"] = {k: s["info"][k] for k in ("run", "id", "world", "step")}
        reports = agree("Snapshots.restore", report, same=False, group=self.group)
        try:
            chosen = choose_snapshot(reports, self.run)
        except SnapshotLostError as e:
            if self.fallback is None:
                raise
            return self._fall_back(e)
        if chosen is None:
            return self._fall_back(None) if self.fallback is not None else 0
        step, holders, world = chosen
        try:
            self._load(step, holders, world, reports)
        except SnapshotError:
            raise
        except Exception as e:
            raise SnapshotRestoreError(
                f"Snapshots.restore: restoring step {step} failed on rank {rank} ({type(e).__name__}: {first_line(e)}); "
                "if a rank was lost during the recovery, torchrun's next restart restores again (the snapshots are "
                "kept)") from e
        finally:
            _rm(staging_dir(self.dir, rank))
        remove_steps(self.dir, {step})
        self.restored_from = self.last_committed = step
        return step

    def _load(self, step: int, holders: dict[int, int], world: int, reports: list[dict]) -> None:
        rank = dist.get_rank()
        stage = staging_dir(self.dir, rank)
        _rm(stage)
        os.makedirs(stage)
        mine = reports[rank]["steps"].get(step, {"own": {}, "copy": {}})

        def local(r: int, name: str) -> str | None:
            for kind, d in (("own", own_dir), ("copy", copy_dir)):
                if mine[kind].get(r) == world:
                    return os.path.join(d(self.dir, step), name)
            return None

        def where(r: int, name: str) -> str:  # on the holder's node
            kind = "own" if reports[holders[r]]["steps"][step]["own"].get(r) == world else "copy"
            return os.path.join((own_dir if kind == "own" else copy_dir)(reports[holders[r]]["dir"], step), name)

        def fetch(wanted, what: str) -> None:
            err, missing = None, []
            try:  # a local failure travels in the agreement: no rank is left waiting in a collective
                for r, n in wanted():
                    src = local(r, n)
                    if src is None:
                        missing.append((r, n))
                    else:
                        os.symlink(src, os.path.join(stage, n))
            except Exception as e:
                err = e
            needs = agree(f"Snapshots.restore ({what})", missing, error=err, same=False, group=self.group)
            send_files([(holders[r], dst, where(r, n), os.path.join(staging_dir(reports[dst]["dir"], dst), n))
                        for dst, rows in enumerate(needs) for r, n in rows], self.group)

        # every rank reads every .meta (a few numbers per tensor), then only the parts whose
        # pieces overlap what it holds at W'
        fetch(lambda: [(r, part_names(r, world)[1]) for r in range(world)], "metadata")
        state = self._state()
        fetch(lambda: [(r, part_names(r, world)[0]) for r in sorted(_needed_parts(state, stage, world))], "parts")
        try:
            load_local(state, stage)
        except LocalCheckpointError as e:
            if "_wire_residual" in str(e):
                raise SnapshotError(f"Snapshots.restore: {first_line(e)}; error feedback's residual is laid out for "
                                    f"the W = {world} it was saved at, so it restores only at that W") from e
            raise
        set_state_dict(self.model, self.optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
        # ranks are numbered anew after a restart: any info file of this node carries the step's
        # extra (equal on every rank); the global RNG only from the file of this rank's number
        mine = scan(self.dir).get(step, {}).get("info")
        own = info_path(self.dir, step, rank)
        rng = torch.load(own, weights_only=False)["rng"] if world == dist.get_world_size() and os.path.exists(own) else None
        # the extra: from the lowest rank whose node holds an info file of the step (the node
        # that kept a commit marker does, so some rank has one)
        (have,) = agree_flags([dist.get_world_size() - rank if mine is not None else 0], self.group)
        if have == 0:
            raise SnapshotError(f"Snapshots.restore: no surviving node holds the info file of step {step}; the "
                                "snapshot directories were changed by hand")
        src = dist.get_world_size() - have
        box = [mine["extra"] if rank == src else None]
        dist.broadcast_object_list(box, src=src, group=self.group)
        self.extra = box[0]
        if rng is not None:
            torch.set_rng_state(rng)  # same W: the global RNG of the rank that had this number

    # -- the fallback ---------------------------------------------------------------------------
    def checkpoint(self, step: int, extra: Any = None, keep_last: int | None = 2) -> None:
        """A DCP checkpoint under ``fallback`` (shared storage), the one ``restore`` falls back
        to when a snapshot is lost. Collective."""
        from .atomic import save
        from .train_state import TrainState

        if self.fallback is None:
            raise ValueError("Snapshots.checkpoint: pass fallback=<root on shared storage> to Snapshots first")
        # extra as pickled bytes: DCP would flatten a dict into keys the restoring side cannot name
        save({"train": TrainState(self.model, self.optimizers), "snapshot": {"step": step, "extra": pickle.dumps(extra)}},
             self.fallback, step=step, keep_last=keep_last)

    def _fall_back(self, lost: SnapshotLostError | None) -> int:
        from .resume import load_latest
        from .train_state import TrainState

        state = {"train": TrainState(self.model, self.optimizers), "snapshot": {"step": 0, "extra": b""}}
        found = load_latest(self.fallback, state, missing_ok=lost is None)
        if found is None:
            return 0
        step = int(state["snapshot"]["step"])
        self.extra = pickle.loads(state["snapshot"]["extra"])
        if lost is not None and dist.get_rank() == 0:
            warnings.warn(f"{first_line(lost)}. Fell back to the DCP checkpoint {found.path} (step {step}): steps "
                          f"{step} to {lost.step - 1} are lost and run again", CheckpointWarning, stacklevel=3)
        remove_steps(self.dir, set())
        self.restored_from = step
        return step


def _needed_parts(state: dict, stage: str, world: int) -> set[int]:
    """The saved ranks whose ``.pt`` ``load_local`` will read to fill this rank's ``state``:
    part 0 (plain values are stored there), this rank's own at an unchanged ``W`` (values
    stored per rank), and every part a RaggedShard value's pieces overlap."""
    from torch.distributed.tensor import DTensor

    from ._tree import flatten
    from .local_layout import RunLayout
    from .local_save import describe_local

    entries = describe_local(stage)["entries"]
    rank = dist.get_rank()
    need = {0} | ({rank} if world == dist.get_world_size() else set())
    flat, _ = flatten(state)
    for key, value in flat.items():
        e = entries.get(key)
        if e is None or e["kind"] != "ragged" or not isinstance(value, DTensor):
            continue
        a, b = value._spec.placements[0].element_range(tuple(value.shape), value.device_mesh.get_local_rank(0))
        layout = RunLayout(tuple(e["shape"]), tuple(e["dims"]), e["unit"], tuple(map(tuple, e["runs"])))
        need.update(pc.rank for pc in layout.pieces(a, b))
    return need


def _rm(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
