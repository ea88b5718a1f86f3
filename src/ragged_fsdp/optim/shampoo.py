"""Shampoo whose preconditioner tiles are never cut: each rank preconditions its own tiles.

Shampoo (Gupta et al., 2018; Distributed Shampoo, Shi et al., 2023) preconditions each tile of
at most ``B x B`` of every (merged) parameter with Kronecker factors. Tiles come from the
parameter's *global* shape (:mod:`ragged_fsdp.optim.shampoo_blocks`); when the layout keeps
every tile on one rank (``fully_shard(..., granularity_fn=Shampoo.granularity_for(B))``),
that rank owns the tile: it alone keeps the tile's factors and inverse roots and updates the
tile's elements. ``step()`` runs no collective at all, and every tile sees the same
operations on the same numbers as in one process, so parameters are the same bits at every
world size (same CPU kernels and thread count assumed: eigh and matmul results depend on them).

Per step, with ``t`` the parameter's step count and ``G`` its fp32 gradient (this rank's run):

1. grafting moments, pointwise on the run: Adam ``v <- b2g v + (1 - b2g) G^2`` (AdaGrad
   ``v += G^2``), ``m <- lerp(m, G, 1 - beta1)``, ``m_hat = m / (1 - beta1^t)``,
   ``A = m_hat / (sqrt(v / (1 - b2g^t)) + eps_g)`` (AdaGrad without the correction, SGD
   ``A = m_hat``);
2. per owned tile, factors ``F_j <- beta2 F_j + (1 - beta2) O_j`` (``O_j``: the tile's
   gradient contracted with itself over every dim but ``j``, in fp32, accumulated in
   ``factor_matrix_dtype``);
3. when ``t == s`` or ``t > s`` and ``t % precondition_frequency == 0``: inverse roots from
   ``eigh(F_j / (1 - beta2^t) + eps I)``, eigenvalues shifted up to ``eps`` when the smallest
   is below it, ``P_j = Q diag(lambda^(-1/(2k))) Q^T`` symmetrised from its upper triangle;
4. direction ``D = A`` before step ``s``; then per tile ``S = m_hat x_1 P_1 ... x_k P_k`` (in
   the factor dtype) scaled to the tile's ``||A||_F`` (no grafting: ``S`` as is);
5. ``D += weight_decay X``; ``X -= lr D`` (decoupled weight decay).

Bias corrections are fp32 scalars. A root whose eigh fails or is not finite keeps its last
value (counted in ``last_step_stats["eigh_failures"]``).

State (``opt.state[p]``):

* ``step`` (fp32 scalar), ``exp_avg`` (``m``) and, for Adam/AdaGrad grafting, ``exp_avg_sq``
  (``v``): fp32, laid out like the parameter (RaggedDTensors when it is sharded);
* ``factor_matrix_{i}_{j}`` and ``inv_root_{i}_{j}`` for tile ``i`` (row-major over the
  tile grid) and merged dim ``j``, ``d_j x d_j`` in ``factor_matrix_dtype``: on a sharded
  parameter a RaggedDTensor that the tile's owner holds whole (``RaggedShard((), one-hot)``),
  an empty local tensor on the other ranks; plain tensors otherwise. Keys do not depend on
  the world size, every rank has every key (strict loaders, full state dicts and
  ``TrainState`` see the same state everywhere), and only the owner holds and writes the
  data, so DCP stores one copy of each tile and any other world size (or one process) reads
  back the tiles it owns.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.optim import Optimizer

from ._layout import Layout, layout_of, load_scalars, local_of, param_name, place_state
from ._state_check import TILE_KEY, MARK, check_layout, check_state_dict, layout_record
from .routing import check_finite
from .shampoo_blocks import Tile, merged_shape, row_chunks, shampoo_granularity, tile_eigh_flops, tiles_of

__all__ = ["Shampoo", "GRAFTING_TYPES"]

GRAFTING_TYPES = ("adam", "adagrad", "sgd", None)
# Param groups keep the factor dtype by name: torch's state-dict utilities (full state
# dicts, DCP) accept only plain values in param groups, not torch.dtype objects.
_FACTOR_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _dtype_name(dtype) -> str | None:
    if isinstance(dtype, str):
        return dtype if dtype in _FACTOR_DTYPES else None
    return next((k for k, v in _FACTOR_DTYPES.items() if v == dtype), None)


def _tile_keys(tile: Tile) -> list[tuple[str, str]]:
    return [(f"factor_matrix_{tile.index}_{j}", f"inv_root_{tile.index}_{j}") for j in range(tile.order)]


def _bias_correction(beta: float, t: int):
    """``1 - beta^t`` as an fp32 scalar (1 when ``beta == 1``: a plain sum needs none)."""
    return 1.0 - torch.tensor(beta, dtype=torch.float32) ** t if beta < 1.0 else 1.0


@dataclass
class _ParamTiles:
    """Which tiles of one parameter this rank owns, and where they sit in its run."""

    layout_key: tuple
    max_dim: int
    merged: tuple[int, ...]
    local_merged: tuple[int, ...]  # this rank's run viewed in the merged shape
    owned: list  # (Tile, local slices)
    tiles: list  # every Tile of the parameter
    owners: list[int]  # owner rank of each tile (index on the sharded mesh dim)
    flops_per_rank: list[int]  # eigh flops of one root recomputation, per rank of the layout
    layout: Layout


class Shampoo(Optimizer):
    """Distributed Shampoo with grafting; arguments as Distributed Shampoo's, flattened.

    Args:
        params: parameters or param groups (named parameters give better error messages).
        lr: learning rate (default 1e-2).
        betas: ``(beta1, beta2)``: moving average of the gradient (0 disables it) and of the
            Kronecker factors (default (0.9, 0.999)).
        epsilon: added to the factors before the root, and the floor of their eigenvalues
            (default 1e-12).
        weight_decay: decoupled weight decay (default 0).
        max_preconditioner_dim: ``B``, the largest tile side (default 1024).
        precondition_frequency: recompute the inverse roots every this many steps (default 1).
        start_preconditioning_step: first step that uses (and computes) the roots; before it
            the grafting direction is used. ``-1`` means ``precondition_frequency``.
        use_bias_correction: bias-correct ``m`` and the factors (default True).
        grafting_type: ``"adam"`` (default), ``"adagrad"``, ``"sgd"`` or ``None``.
        grafting_beta2, grafting_epsilon: Adam/AdaGrad grafting's (defaults 0.999, 1e-8).
        factor_matrix_dtype: dtype of factors, roots and the preconditioning (default fp32).

    ``Shampoo.granularity`` (B = 1024) / ``Shampoo.granularity_for(max_preconditioner_dim=B)``
    are the ``granularity_fn`` for ``fully_shard`` that keeps every tile on one rank; a
    layout that cuts a tile is rejected, naming the parameter and this fix.

    After each step ``last_step_stats`` holds this rank's eigh calls and flops and the tiles it
    preconditioned; :meth:`eigh_flops_per_rank` gives every rank's share of a root recomputation.
    """

    granularity: Callable = staticmethod(shampoo_granularity(1024))
    granularity_for = staticmethod(shampoo_granularity)

    def __init__(self, params, lr: float = 1e-2, betas: tuple[float, float] = (0.9, 0.999),
                 epsilon: float = 1e-12, weight_decay: float = 0.0, max_preconditioner_dim: int = 1024,
                 precondition_frequency: int = 1, start_preconditioning_step: int = -1,
                 use_bias_correction: bool = True, grafting_type: str | None = "adam",
                 grafting_beta2: float = 0.999, grafting_epsilon: float = 1e-8,
                 factor_matrix_dtype: torch.dtype = torch.float32) -> None:
        if _dtype_name(factor_matrix_dtype) is None:
            raise ValueError(f"Shampoo: factor_matrix_dtype={factor_matrix_dtype} must be torch.float32 or "
                             "torch.float64 (eigh needs one of them)")
        defaults = {
            "lr": lr, "betas": tuple(betas), "epsilon": epsilon, "weight_decay": weight_decay,
            "max_preconditioner_dim": max_preconditioner_dim, "precondition_frequency": precondition_frequency,
            "start_preconditioning_step": start_preconditioning_step, "use_bias_correction": use_bias_correction,
            "grafting_type": grafting_type, "grafting_beta2": grafting_beta2,
            "grafting_epsilon": grafting_epsilon, "factor_matrix_dtype": _dtype_name(factor_matrix_dtype),
        }
        self._tiles: dict[int, _ParamTiles] = {}
        self.last_step_stats: dict = {}
        super().__init__(params, defaults)

    # -- groups and layouts ----------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        param_group = dict(param_group)
        if "factor_matrix_dtype" in param_group:
            name = _dtype_name(param_group["factor_matrix_dtype"])
            if name is None:
                raise ValueError(f"Shampoo: factor_matrix_dtype={param_group['factor_matrix_dtype']} must be "
                                 "torch.float32 or torch.float64 (eigh needs one of them)")
            param_group["factor_matrix_dtype"] = name
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[-1]
        self._check_group(group, gi)
        for i, p in enumerate(group["params"]):
            name = param_name(group, i, p, gi)
            if torch.is_complex(p) or not p.is_floating_point():
                raise ValueError(f"Shampoo: parameter {name} has dtype {p.dtype}; only real "
                                 "floating-point parameters are supported")
            lay = layout_of(p, f"Shampoo parameter {name}")
            self._refuse_outer_shards(lay, name)
            self._info(p, lay, group, name)
            if p.requires_grad:
                # made now, not at the first step: checkpoint loaders need them to exist
                self._init_state(p, lay, group, name)

    def _check_group(self, group: dict, gi: int) -> None:
        where = f"Shampoo param group {gi}"
        betas = group["betas"]
        if len(betas) != 2:
            raise ValueError(f"{where}: betas={betas} must be two numbers (beta1, beta2)")
        check_finite(where, lr=group["lr"], epsilon=group["epsilon"], weight_decay=group["weight_decay"],
                     grafting_beta2=group["grafting_beta2"], grafting_epsilon=group["grafting_epsilon"],
                     **{"betas[0]": betas[0], "betas[1]": betas[1]})
        if not 0.0 <= float(betas[0]) < 1.0:
            raise ValueError(f"{where}: betas[0]={betas[0]} must be in [0, 1)")
        if not 0.0 < float(betas[1]) <= 1.0:
            raise ValueError(f"{where}: betas[1]={betas[1]} must be in (0, 1]")
        if not 0.0 < float(group["grafting_beta2"]) <= 1.0:
            raise ValueError(f"{where}: grafting_beta2={group['grafting_beta2']} must be in (0, 1]")
        if float(group["epsilon"]) <= 0.0:
            raise ValueError(f"{where}: epsilon={group['epsilon']} must be > 0 (it floors the eigenvalues)")
        B = group["max_preconditioner_dim"]
        if not isinstance(B, int) or isinstance(B, bool) or B < 1:
            raise ValueError(f"{where}: max_preconditioner_dim={B!r} must be an integer >= 1")
        f = group["precondition_frequency"]
        if not isinstance(f, int) or isinstance(f, bool) or f < 1:
            raise ValueError(f"{where}: precondition_frequency={f!r} must be an integer >= 1")
        s = group["start_preconditioning_step"]
        if not isinstance(s, int) or isinstance(s, bool) or not (s == -1 or s >= 1):
            raise ValueError(f"{where}: start_preconditioning_step={s!r} must be -1 (= precondition_frequency) "
                             "or an integer >= 1")
        if group["grafting_type"] not in GRAFTING_TYPES:
            raise ValueError(f"{where}: grafting_type={group['grafting_type']!r} must be one of {GRAFTING_TYPES}")
        if _dtype_name(group["factor_matrix_dtype"]) is None:
            raise ValueError(f"{where}: factor_matrix_dtype={group['factor_matrix_dtype']} must be "
                             "torch.float32 or torch.float64 (eigh needs one of them)")
        group["factor_matrix_dtype"] = _dtype_name(group["factor_matrix_dtype"])

    @staticmethod
    def _refuse_outer_shards(lay: Layout, name: str) -> None:
        """Tiles come from the global shape and each must sit whole on one rank; a TP/EP
        ``Shard`` next to the RaggedShard cuts the tensor into pieces on other ranks, so the
        tiles would need a collective per step. Refused (HSDP's Replicate dims are fine: each
        replica preconditions the same tiles)."""
        if lay.outer_shards:
            raise NotImplementedError(
                f"Shampoo: parameter {name} (shape {lay.shape}) has placements {lay.placements}: a "
                "Shard(k) next to the RaggedShard (tensor or expert parallelism) cuts the "
                "preconditioner tiles across ranks, and Shampoo preconditions whole tiles held by one "
                "rank. Supported: RaggedShard alone or next to Replicate() mesh dims (HSDP); give "
                "TP/EP-sharded parameters to another optimizer (e.g. Muon or AdamW param groups)"
            )

    def _info(self, p, lay: Layout, group: dict, name: str) -> _ParamTiles:
        """This rank's tiles of ``p`` under layout ``lay`` (cached; checks no tile is cut)."""
        B = group["max_preconditioner_dim"]
        info = self._tiles.get(id(p))
        key = lay.key()
        if info is not None and info.layout_key == key and info.max_dim == B:
            return info
        merged = merged_shape(lay.shape, B)
        per_row = math.prod(merged[1:])
        tiles = tiles_of(lay.shape, B)
        chunk_owner = {}
        # non-empty runs in element order: the holder of a chunk is found by bisection
        # (O(log W) per chunk; thousands of ranks times thousands of chunks otherwise)
        runs = sorted((a, b, r) for r, (a, b) in enumerate(lay.ranges) if b > a)
        starts = [a for a, _, _ in runs]
        for (s, e) in row_chunks(lay.shape, B):
            i = bisect.bisect_right(starts, s) - 1
            if i < 0 or e > runs[i][1]:
                self._cut_error(lay, name, B, merged, s, e)
            chunk_owner[s // per_row] = runs[i][2]
        a, b = lay.local_range
        row_off = a // per_row if per_row else 0
        local_rows = (b - a) // per_row if per_row else 0
        flops = [0] * lay.world
        owned, owners = [], []
        for tile in tiles:
            r = chunk_owner[tile.row_chunk]
            owners.append(r)
            flops[r] += tile_eigh_flops(tile)
            if r == lay.rank:
                (r0, r1), *rest = tile.ranges
                sl = (slice(r0 - row_off, r1 - row_off),) + tuple(slice(x, y) for x, y in rest)
                owned.append((tile, sl))
        info = _ParamTiles(key, B, merged, (local_rows,) + merged[1:], owned, tiles, owners, flops, lay)
        self._tiles[id(p)] = info
        return info

    @staticmethod
    def _cut_error(lay: Layout, name: str, B: int, merged, s: int, e: int):
        cutter = next((r for r, (a, b) in enumerate(lay.ranges) if b > a and a < e and b > s), 0)
        a, b = lay.ranges[cutter]
        per_row = math.prod(merged[1:])
        raise ValueError(
            f"Shampoo: parameter {name} (shape {lay.shape}, merged to {tuple(merged)} for "
            f"max_preconditioner_dim={B}) is laid out so that rank {cutter} holds elements [{a}, {b}), "
            f"cutting the preconditioner tiles of merged rows [{s // per_row}, {e // per_row}) "
            f"(elements [{s}, {e})). Shard the model with fully_shard(..., "
            f"granularity_fn=Shampoo.granularity_for(max_preconditioner_dim={B})) so every tile stays "
            "on one rank (Shampoo.granularity is the policy for the default B=1024)"
        )

    def _init_state(self, p, lay: Layout, group: dict, name: str) -> None:
        state = self.state[p]
        if len(state):
            return
        info = self._info(p, lay, group, name)
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        if group["grafting_type"] in ("adam", "adagrad"):
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        dtype, device = _FACTOR_DTYPES[group["factor_matrix_dtype"]], local_of(p).device
        for tile, owner in zip(info.tiles, info.owners):
            mine = owner == lay.rank
            for (fk, rk), d in zip(_tile_keys(tile), tile.dims):
                f = torch.zeros(d, d, dtype=dtype, device=device) if mine else torch.empty(0, d, dtype=dtype, device=device)
                r = torch.eye(d, dtype=dtype, device=device) if mine else torch.empty(0, d, dtype=dtype, device=device)
                state[fk] = _tile_tensor(f, lay, owner, d)
                state[rk] = _tile_tensor(r, lay, owner, d)

    def eigh_flops_per_rank(self) -> list[int]:
        """Flops of one recomputation of every inverse root, per rank of the widest sharded
        dim (pure arithmetic on the layouts, no communication)."""
        total: list[int] = []
        for info in self._tiles.values():
            if len(info.flops_per_rank) > len(total):
                total += [0] * (len(info.flops_per_rank) - len(total))
            for r, f in enumerate(info.flops_per_rank):
                total[r] += f
        return total

    # -- step ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stats = {"eigh_calls": 0, "eigh_flops": 0, "eigh_failures": 0, "tiles": 0}
        for gi, group in enumerate(self.param_groups):
            self._check_group(group, gi)
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                name = param_name(group, i, p, gi)
                if p.grad.is_sparse:
                    raise RuntimeError(f"Shampoo: parameter {name} has a sparse gradient")
                lay = layout_of(p, f"Shampoo parameter {name}")
                self._refuse_outer_shards(lay, name)
                info = self._info(p, lay, group, name)
                pl, gl = local_of(p), local_of(p.grad)
                if gl.shape != pl.shape or (lay.kind != "plain" and layout_of(p.grad, "gradient").ranges != lay.ranges):
                    raise ValueError(f"Shampoo: the gradient of {name} is laid out differently from the "
                                     "parameter; redistribute it to the parameter's layout")
                if len(self.state[p]) == 0:
                    self._init_state(p, lay, group, name)
                self._step_param(pl, gl, self.state[p], info, group, stats)
        self.last_step_stats = stats
        return loss

    def _step_param(self, pl, gl, state, info: _ParamTiles, group, stats) -> None:
        beta1, beta2 = (float(b) for b in group["betas"])
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        eps, geps, gb2 = float(group["epsilon"]), float(group["grafting_epsilon"]), float(group["grafting_beta2"])
        graft, fdt = group["grafting_type"], _FACTOR_DTYPES[group["factor_matrix_dtype"]]
        freq = group["precondition_frequency"]
        start = group["start_preconditioning_step"]
        start = freq if start == -1 else start
        state["step"] += 1
        t = int(state["step"].item())
        bc1 = _bias_correction(beta1, t) if group["use_bias_correction"] else 1.0
        bc2 = _bias_correction(beta2, t) if group["use_bias_correction"] else 1.0
        recompute = t == start or (t > start and t % freq == 0)

        shape = info.local_merged
        G = gl.float().reshape(shape)  # this rank's run in the merged view (a view when fp32)
        X = pl.float().reshape(shape)
        m = local_of(state["exp_avg"]).view(shape)
        # 1. grafting moments and direction, pointwise on the run
        if graft == "adam":
            v = local_of(state["exp_avg_sq"]).view(shape)
            v.mul_(gb2).addcmul_(G, G, value=1 - gb2)
        elif graft == "adagrad":
            v = local_of(state["exp_avg_sq"]).view(shape)
            v.addcmul_(G, G)
        m.lerp_(G, 1 - beta1)
        m_hat = m / bc1
        if graft == "adam":
            A = m_hat / ((v / _bias_correction(gb2, t)).sqrt() + geps)
        elif graft == "adagrad":
            A = m_hat / (v.sqrt() + geps)
        else:
            A = m_hat
        D = A.clone() if t < start else torch.empty_like(A)
        # 2.-4. the tiles this rank owns
        for tile, sl in info.owned:
            k = tile.order
            keys = _tile_keys(tile)
            g = G[sl].contiguous()
            for j, (fk, _) in enumerate(keys):
                rest = [x for x in range(k) if x != j]
                local_of(state[fk]).mul_(beta2).add_(torch.tensordot(g, g, (rest, rest)).to(fdt), alpha=1 - beta2)
            if recompute:
                for j, (fk, rk) in enumerate(keys):
                    root = self._inverse_root(local_of(state[fk]), bc2, eps, k, g.shape[j], fdt, stats)
                    if root is not None:
                        local_of(state[rk]).copy_(root)
            if t >= start:
                s = m_hat[sl].contiguous().to(fdt)
                for _, rk in keys:
                    s = torch.tensordot(s, local_of(state[rk]), ([0], [0]))
                s = s.float()
                if graft is not None:
                    s = s * (torch.linalg.vector_norm(A[sl].contiguous()) / (torch.linalg.vector_norm(s) + 1e-16))
                D[sl] = s
            stats["tiles"] += 1
        # 5. decoupled weight decay and the update
        D.add_(X, alpha=wd)
        X.add_(D, alpha=-lr)
        if X.data_ptr() != pl.data_ptr() or X.dtype != pl.dtype:
            pl.copy_(X.view(pl.shape))

    @staticmethod
    def _inverse_root(F, bc2, eps: float, k: int, n: int, dtype, stats) -> torch.Tensor | None:
        stats["eigh_calls"] += 1
        stats["eigh_flops"] += 9 * n ** 3
        a = F / bc2 + eps * torch.eye(n, dtype=dtype, device=F.device)
        try:
            lam, q = torch.linalg.eigh(a)
        except torch.linalg.LinAlgError:
            stats["eigh_failures"] += 1
            return None
        lmin = lam.min()
        if lmin < eps:
            lam = lam - lmin + eps
        r = (q * lam.pow(-1.0 / (2 * k)).unsqueeze(0)) @ q.T
        r = r.triu() + r.triu(1).T
        if not bool(torch.isfinite(r).all()):
            stats["eigh_failures"] += 1
            return None
        return r

    # -- state dict ------------------------------------------------------------------
    _HYPERPARAMETERS = ("lr", "betas", "epsilon", "weight_decay", "max_preconditioner_dim", "precondition_frequency",
                        "start_preconditioning_step", "use_bias_correction", "grafting_type", "grafting_beta2",
                        "grafting_epsilon", "factor_matrix_dtype")

    @staticmethod
    def _state_keys(saved: dict, p):
        need = {"step", "exp_avg"} | ({"exp_avg_sq"} if saved.get("grafting_type") in ("adam", "adagrad") else set())
        return need, lambda k: k in ("step", "exp_avg", "exp_avg_sq") or (isinstance(k, str) and bool(TILE_KEY.match(k)))

    def state_dict(self) -> dict:
        """torch's, plus the layout fingerprint that per-rank files are checked against."""
        sd = super().state_dict()
        sd[MARK] = layout_record(self)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict saved at any world size (or in one process). Per-element states
        may be full tensors or DTensors of any layout; per-tile states may be full tensors or
        DTensors held by any rank; each is laid out for this layout's owner (the tile's data
        lands on its owner only). Every tile key must be present (same keys on every rank).
        Another optimizer's state dict, and a per-rank one saved under another world size, rank
        or layout, are refused before anything is loaded (:mod:`._state_check`)."""
        from itertools import chain

        check_state_dict(self, state_dict, state_keys=self._state_keys,
                         group_keys=lambda sg, g: self._HYPERPARAMETERS)
        check_layout(self, state_dict)

        held, saved_ids = load_scalars(self, state_dict)
        where = chain.from_iterable([(gi, g, i) for i in range(len(g["params"]))]
                                    for gi, g in enumerate(self.param_groups))
        for sid, (gi, group, i) in zip(saved_ids, where):
            p = group["params"][i]
            name = param_name(group, i, p, gi)
            lay = layout_of(p, f"Shampoo parameter {name}")
            info = self._info(p, lay, group, name)
            state = self.state[p]
            saved = held.get(sid)
            if saved is None:  # never had state: start fresh
                self.state.pop(p, None)
                if p.requires_grad:
                    self._init_state(p, lay, group, name)
                continue
            need = ["exp_avg"] + (["exp_avg_sq"] if group["grafting_type"] in ("adam", "adagrad") else [])
            for key in need:
                if key not in saved:
                    raise ValueError(f"Shampoo.load_state_dict: parameter {name} has no {key!r} in the "
                                     "state dict (saved with another grafting_type?)")
                v = place_state(saved[key], p, lay, name, key)
                state[key] = v if v.dtype == torch.float32 else v.float()
            if "step" not in state:
                raise ValueError(f"Shampoo.load_state_dict: parameter {name} has no 'step' in the state dict")
            fdt = _FACTOR_DTYPES[group["factor_matrix_dtype"]]
            for tile, owner in zip(info.tiles, info.owners):  # every rank, same order (collectives)
                for (fk, rk), d in zip(_tile_keys(tile), tile.dims):
                    for key in (fk, rk):
                        v = saved.get(key)
                        if v is None:
                            raise ValueError(
                                f"Shampoo.load_state_dict: parameter {name} has no {key!r} (tile {tile.index}, "
                                f"{tile.dims}) in the state dict; it was saved with another "
                                "max_preconditioner_dim or for another model")
                        if tuple(v.shape) != (d, d):
                            raise ValueError(f"Shampoo.load_state_dict: {key!r} of parameter {name} has shape "
                                             f"{tuple(v.shape)}, expected {(d, d)} (another "
                                             "max_preconditioner_dim or model?)")
                        state[key] = _place_tile(v, lay, owner, d, fdt, local_of(p).device)


def _tile_placements(lay: Layout, owner: int) -> tuple:
    from torch.distributed.tensor import Replicate

    from ..placement.ragged_shard import RaggedShard

    placements = [Replicate()] * lay.mesh.ndim
    placements[lay.mesh_dim] = RaggedShard((), tuple(int(r == owner) for r in range(lay.world)), 1)
    return tuple(placements)


def _tile_tensor(local: torch.Tensor, lay: Layout, owner: int, d: int) -> torch.Tensor:
    """A per-tile state: a plain tensor when the parameter is not sharded, else a
    RaggedDTensor held whole by the tile's owner (``RaggedShard((), one-hot)``): every rank
    has the key, only the owner has (and writes) the data."""
    if lay.kind in ("plain", "replicate"):
        return local
    from ..placement.api import from_local

    return from_local(local, lay.mesh, _tile_placements(lay, owner), shape=(d, d))


def _place_tile(value, lay: Layout, owner: int, d: int, dtype, device) -> torch.Tensor:
    """A loaded per-tile state laid out for this rank: from a full tensor (no communication),
    a DTensor on this mesh (redistributed) or on another mesh (gathered)."""
    from torch.distributed.tensor import DTensor

    if lay.kind in ("plain", "replicate"):
        full = value.full_tensor() if isinstance(value, DTensor) else value
        return full.detach().to(dtype=dtype, device=device).clone()
    placements = _tile_placements(lay, owner)
    if isinstance(value, DTensor) and value.device_mesh == lay.mesh:
        if tuple(value.placements) != placements:
            from ..placement.redistribute import redistribute

            value = redistribute(value, lay.mesh, placements)
        local = local_of(value).detach().to(dtype=dtype, device=device).clone()
    else:
        full = value.full_tensor() if isinstance(value, DTensor) else value
        local = full if owner == lay.rank else full[:0]
        local = local.detach().to(dtype=dtype, device=device).clone()
    return _tile_tensor(local, lay, owner, d)
