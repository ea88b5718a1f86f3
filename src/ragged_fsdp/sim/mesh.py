"""Mesh specs: ``dp=1024``, ``hsdp=RxS`` (R replicas of S-rank shard groups, the torch
order ``("replicate", "shard")``), ``tp=8,dp=128``, ``ep=8,dp=128`` (experts split 8 ways and
sharded over dp; everything else sharded over dp*ep, as torchtitan does), ``pp=8,...``
(pipeline stages), ``cp=4,...`` (context parallel: the sequence split 4 ways; parameters are
sharded over dp*cp, torchtitan's ``dp_shard_cp``), or ``auto``."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Mesh", "parse_mesh", "candidate_meshes"]


@dataclass(frozen=True)
class Mesh:
    dp: int  # shard group size (FSDP)
    replicate: int = 1
    tp: int = 1
    ep: int = 1
    pp: int = 1
    cp: int = 1

    @property
    def gpus(self) -> int:
        return self.dp * self.replicate * self.tp * self.ep * self.pp * self.cp

    @property
    def shard(self) -> int:
        """Ranks a non-expert parameter is sharded over (FSDP's shard dim: dp, with CP folded in)."""
        return self.dp * self.cp

    def __str__(self) -> str:
        parts = []
        if self.replicate > 1:
            parts.append(f"hsdp={self.replicate}x{self.dp}")
        else:
            parts.append(f"dp={self.dp}")
        if self.tp > 1:
            parts.insert(0, f"tp={self.tp}")
        if self.ep > 1:
            parts.insert(0, f"ep={self.ep}")
        if self.cp > 1:
            parts.insert(0, f"cp={self.cp}")
        if self.pp > 1:
            parts.insert(0, f"pp={self.pp}")
        return ",".join(parts)


def _int(text: str, what: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--mesh: {what} {text!r} must be a positive integer")
    return int(text)


def parse_mesh(spec: str | None, gpus: int) -> Mesh | None:
    """The mesh for ``gpus`` GPUs; None for ``auto``. Omitted ``dp`` fills the rest."""
    if spec is None or spec.strip() == "":
        return Mesh(gpus)
    if spec.strip() == "auto":
        return None
    dp = rep = tp = ep = pp = cp = None
    for part in spec.split(","):
        key, sep, val = part.strip().partition("=")
        if not sep:
            raise ValueError(f"--mesh part {part!r}: expected key=value (dp=, hsdp=RxS, tp=, ep=, pp=, cp=) or auto")
        if key == "dp":
            dp = _int(val, "dp")
        elif key == "hsdp":
            r, x, s = val.partition("x")
            if not x:
                raise ValueError(f"--mesh hsdp={val!r}: expected REPLICASxSHARD, e.g. hsdp=128x8")
            rep, dp = _int(r, "hsdp replicas"), _int(s, "hsdp shard size")
        elif key == "tp":
            tp = _int(val, "tp")
        elif key == "ep":
            ep = _int(val, "ep")
        elif key == "pp":
            pp = _int(val, "pp")
        elif key == "cp":
            cp = _int(val, "cp")
        else:
            raise ValueError(f"--mesh key {key!r} is not one of dp, hsdp, tp, ep, pp, cp")
    rep, tp, ep, pp, cp = rep or 1, tp or 1, ep or 1, pp or 1, cp or 1
    rest = rep * tp * ep * pp * cp
    if dp is None:
        if gpus % rest:
            raise ValueError(f"--mesh {spec}: {gpus} GPUs are not a multiple of {rest}")
        dp = gpus // rest
    mesh = Mesh(dp, rep, tp, ep, pp, cp)
    if mesh.gpus != gpus:
        raise ValueError(f"--mesh {spec} uses {mesh.gpus} GPUs but --gpus is {gpus}; make them agree")
    return mesh


def candidate_meshes(gpus: int, moe: bool, gpus_per_node: int) -> list[Mesh]:
    """What ``--mesh auto`` searches: plain FSDP, HSDP shard groups of one node up to all,
    TP within a node, EP for MoE models (the planner's --suggest levers plus TP/EP)."""
    out = [Mesh(gpus)]
    s = gpus_per_node
    while s < gpus:
        if gpus % s == 0:
            out.append(Mesh(s, gpus // s))
        s *= 2
    for t in (2, 4, 8):
        if t <= gpus_per_node and gpus % t == 0 and gpus // t >= 1:
            out.append(Mesh(gpus // t, 1, t))
    if moe:
        for e in (2, 4, 8, 16, 32, 64):
            if gpus % e == 0 and gpus // e >= 1:
                out.append(Mesh(gpus // e, 1, 1, e))
    return out
