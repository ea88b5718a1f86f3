"""Distributed Muon that gives the same bits as single-device ``torch.optim.Muon``.

Muon (Jordan et al., 2024) orthogonalises the momentum of each hidden weight matrix with a
few Newton-Schulz iterations. Newton-Schulz needs the *whole* matrix, so on sharded
parameters this optimizer picks one **owner rank per matrix**, moves the pieces of the
(momentum-updated) gradient to the owner, runs Newton-Schulz there once, and sends each rank
its slice of the result:

1. momentum (``buf.lerp_(grad, 1 - momentum)``) and the Nesterov blend are pointwise, so each
   rank does them on its own elements;
2. owners are chosen once per layout (:mod:`.muon_plan`): a matrix that the layout keeps
   whole on one rank is owned by that rank and never moves; the others balance
   Newton-Schulz flops first and then the memory each rank holds during the step;
3. the matrices are moved and orthogonalised in **waves** of at most ``wave_bytes`` of whole
   bf16 matrices (the bounded step): per wave one all-to-all carries every piece to its owner
   (in bf16: torch's Newton-Schulz starts by casting to bf16, so casting first is exact and
   halves the bytes), owners run Newton-Schulz, one all-to-all carries the results back.
   The next wave's pieces travel while the current wave is orthogonalised (the device
   seam's ``"muon"`` lane: a side stream on CUDA; on gloo the issue order), so the step
   holds about one wave and one matrix's workspace, not bf16 copies of all local matrices.
   A wave whose matrices are all whole on their owners has no collective at all;
4. the decoupled weight decay and the update are pointwise again.

The owner runs the same operations as ``torch.optim.Muon`` on the same full matrix, and the
pointwise steps give the same bits on any slice, so parameters match single-device Muon bit
for bit at every world size (``tests/test_optim_dist.py``). Bitwise equality also assumes the
same CPU kernels and thread count on both sides (the bf16 matmuls of Newton-Schulz must take
the same path); across machines expect rounding-level differences.

On n-D meshes (:mod:`._gather`) the owner gathers the whole *global* matrix: with tensor
parallelism (a ``Shard`` on one of the last two dims next to the RaggedShard) from the ranks
of the RaggedShard dim and of the TP dims, assembling the TP tiles in place, and sends every
rank its piece of its tile back; with expert parallelism (``Shard`` on a leading dim of
stacked experts) each expert stays on its EP rank's RaggedShard ranks; with HSDP every
replica does the same work on the same numbers. Parameters still match single-device
``torch.optim.Muon`` bit for bit (``tests/test_optim_nd.py``).

Tensors with more than two dims (fused experts ``(E, H, I)``) are a batch of matrices over the
leading dims; each ``(H, I)`` matrix is orthogonalised on its own (with its own owner) and the
learning-rate adjustment uses ``(H, I)``. 1-D tensors are rejected in Muon groups.

Routing is explicit: a param group with ``use_muon=False`` runs AdamW (torch's own AdamW
math on each rank's elements, with AdamW's defaults for keys the group leaves out).
:func:`ragged_fsdp.optim.muon_param_groups` builds the usual split.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

import torch
from torch.optim import Optimizer

from ragged_fsdp.agreement import agree
from ragged_fsdp.device import device_for

from ._gather import gather_set
from ._grouped import adamw_grouped, flat_states, restore_flat_views
from ._layout import Layout, layout_of, load_scalars, local_of, param_name, place_state
from ._state_check import MARK, check_layout, check_state_dict, layout_record
from .muon_buffers import ns_workspace_bytes
from .muon_exec import WaveRun, _scalar, adjust_lr
from .muon_plan import DEFAULT_NS_STEPS, newton_schulz_flops, per_rank, plan_step
from .routing import check_finite, muon_granularity

__all__ = ["Muon", "newton_schulz", "newton_schulz_flops", "ns_workspace_bytes", "adjust_lr", "ADAMW_DEFAULTS",
           "DEFAULT_WAVE_BYTES"]

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_EPS = 1e-7
# Whole bf16 matrices moved and orthogonalised per wave (see muon_plan): "auto" is the
# optimizer's largest whole bf16 matrix, which keeps the step's live bytes within one torch
# Newton-Schulz of that matrix with its input (torchtitan's DistMuon's step transient;
# docs/optimizers.md, "Muon beside its peers"). A matrix larger than the cap is a wave alone.
DEFAULT_WAVE_BYTES = "auto"
ADAMW_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
_ADJUST_FNS = (None, "original", "match_rms_adamw")


def newton_schulz(
    matrix: torch.Tensor,
    coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    steps: int = DEFAULT_NS_STEPS,
    eps: float = DEFAULT_EPS,
) -> torch.Tensor:
    """Approximately orthogonalise a 2-D matrix with ``steps`` quintic Newton-Schulz iterations
    in bf16 (the operation sequence of ``torch.optim.Muon``, so results match it bitwise).

    Works on the wide orientation (``rows <= cols``): ``X <- a X + (b A + c A A) X`` with
    ``A = X X^T`` after scaling ``X`` to unit Frobenius norm. Returns a bf16 tensor of the input's
    shape (possibly a transposed view). The input is not modified.
    """
    if matrix.dim() != 2:
        raise ValueError(f"newton_schulz: expected a matrix, got shape {tuple(matrix.shape)}")
    if steps >= 100:
        raise ValueError("newton_schulz: ns_steps must be < 100")
    x = matrix.bfloat16()
    if x is matrix:  # already bf16: work on a copy, never on the caller's tensor
        x = x.clone()
    return _newton_schulz_(x, coefficients, steps, eps)


def _newton_schulz_(x, coefficients, steps: int, eps: float) -> torch.Tensor:
    """:func:`newton_schulz` on a bf16 matrix it may overwrite (no copy of the input: the
    step's workspace is the next iterate and the two Gram products, as in the docs).

    ``x`` may be a one-element list holding the matrix: it is taken out of the list, so a
    caller that keeps no other reference lets the input's storage go after the first
    iteration."""
    if isinstance(x, list):
        x = x.pop()
    a, b, c = coefficients
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        # each product dropped once used: never more than two m x m products and two
        # iterates alive (x, poly, next x), one Gram less than torch's loop holds
        del gram
        x = torch.addmm(x, poly, x, beta=a)
        del poly
    return x.T if tall else x


# -- the optimizer -----------------------------------------------------------------------

class Muon(Optimizer):
    """Muon for hidden matrices, AdamW for groups with ``use_muon=False``; sharding-aware.

    Arguments and defaults are those of ``torch.optim.Muon``:

    Args:
        params: parameters or param groups (named parameters give better error messages).
            A group uses Muon unless it sets ``use_muon=False``.
        lr: learning rate of Muon groups (default 1e-3).
        weight_decay: decoupled weight decay of every group that does not set its own, Muon
            and AdamW (``use_muon=False``) groups alike. Default (None): 0.1 for Muon groups
            (``torch.optim.Muon``'s) and ``adamw_defaults["weight_decay"]`` (0.01,
            ``torch.optim.AdamW``'s) for AdamW groups.
        momentum: momentum factor (default 0.95).
        nesterov: Nesterov momentum (default True).
        ns_coefficients: quintic Newton-Schulz coefficients ``(a, b, c)``.
        eps: floor of the Frobenius norm before Newton-Schulz (default 1e-7).
        ns_steps: Newton-Schulz iterations (default 5).
        adjust_lr_fn: ``None``/``"original"`` or ``"match_rms_adamw"``.
        adamw_defaults: defaults for ``use_muon=False`` groups; keys ``lr``, ``betas``, ``eps``,
            ``weight_decay``, default ``torch.optim.AdamW``'s (1e-3, (0.9, 0.999), 1e-8, 1e-2).
            An AdamW group's key comes from the group, else ``adamw_defaults``, else (for
            ``weight_decay`` only) the ``weight_decay`` argument, else AdamW's default.
        wave_bytes: the bounded step's workspace: matrices are moved to their owners and
            orthogonalised in waves of at most this many bytes of whole bf16 matrices (a
            larger matrix is a wave alone), the pieces of the next wave travelling while the
            current one is orthogonalised where that fits (:func:`.muon_plan.schedule`).
            Default ``"auto"``: the largest whole bf16 matrix of the optimizer, which keeps
            every rank's step transient within one ``torch.optim.Muon`` Newton-Schulz of that
            matrix with its input (torchtitan DistMuon's); ``None``: one wave (every local
            matrix in bf16 at once: the fewest collectives, the most memory). Must be the same
            on every rank (checked). Results do not depend on it.

    Valid ranges (a ValueError names the argument otherwise): ``lr``, ``weight_decay`` >= 0;
    ``0 <= momentum < 1``; ``eps > 0``; ``1 <= ns_steps < 100``; ``nesterov`` a bool;
    ``ns_coefficients`` three finite numbers; ``wave_bytes`` an integer >= 1 or None; the
    AdamW groups' ``betas`` in [0, 1), ``eps`` >= 0.

    After each step ``last_step_stats`` holds this rank's Newton-Schulz flops, the flops of
    every rank, the bytes this rank sent, what an all-gather-everything design would send,
    the number of waves, and the plan's estimate of each rank's bytes during the step
    (``step_bytes_per_rank``: persistent parameter + gradient + momentum bytes of its Muon
    pieces, plus its worst wave).
    """

    granularity: Callable = staticmethod(muon_granularity)

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float | None = None,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = DEFAULT_EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        adamw_defaults: dict | None = None,
        wave_bytes: int | None = DEFAULT_WAVE_BYTES,
    ) -> None:
        if wave_bytes is not None and wave_bytes != "auto" and (
                isinstance(wave_bytes, bool) or not isinstance(wave_bytes, numbers.Integral) or wave_bytes < 1):
            raise ValueError(f"Muon: wave_bytes={wave_bytes!r} must be an integer >= 1 (bytes of whole bf16 "
                             "matrices per wave), 'auto' (the largest matrix) or None (one wave)")
        self.wave_bytes = wave_bytes if wave_bytes in (None, "auto") else int(wave_bytes)
        self._agreed: set = set()  # process groups whose ranks agreed on wave_bytes
        self._adamw_defaults = dict(ADAMW_DEFAULTS)
        if adamw_defaults:
            unknown = set(adamw_defaults) - set(ADAMW_DEFAULTS)
            if unknown:
                raise ValueError(f"Muon: adamw_defaults has unknown keys {sorted(unknown)}; "
                                 f"known: {sorted(ADAMW_DEFAULTS)}")
            self._adamw_defaults.update(adamw_defaults)
        if weight_decay is None:
            weight_decay = 0.1
        elif "weight_decay" not in (adamw_defaults or {}):
            # An explicit weight_decay is the model's decay, not Muon's alone.
            self._adamw_defaults["weight_decay"] = weight_decay
        defaults = {
            "lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients), "eps": eps, "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn, "use_muon": True,
        }
        self._plan_cache: tuple | None = None
        self._views: dict = {}  # AdamW-group param -> {key: view of a flat state buffer}
        self.ns_calls = 0  # Newton-Schulz runs on this rank since construction
        self.last_step_stats: dict = {}
        super().__init__(params, defaults)

    # -- groups ----------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        group = dict(param_group)
        use_muon = group.get("use_muon", self.defaults.get("use_muon", True))
        if not isinstance(use_muon, bool):
            raise ValueError(f"Muon: use_muon={use_muon!r} must be True or False")
        group["use_muon"] = use_muon
        if not use_muon:
            for k, v in self._adamw_defaults.items():
                group.setdefault(k, v)
        super().add_param_group(group)
        group = self.param_groups[-1]
        gi = len(self.param_groups) - 1
        self._check_group(group, gi)
        for i, p in enumerate(group["params"]):
            if torch.is_complex(p):
                raise ValueError(f"Muon: parameter {param_name(group, i, p, gi)} is complex; "
                                 "Muon and its AdamW groups support real tensors only")
            if use_muon and p.dim() < 2:
                raise ValueError(
                    f"Muon: parameter {param_name(group, i, p, gi)} is {p.dim()}-D (shape "
                    f"{tuple(p.shape)}); Newton-Schulz needs matrices. Put it in a param group "
                    "with use_muon=False (AdamW), e.g. with ragged_fsdp.optim.muon_param_groups(model)"
                )
            lay = layout_of(p, f"Muon parameter {param_name(group, i, p, gi)}")
            if use_muon:
                # creates the process groups a TP layout needs now: collective, and every rank
                # adds the same parameters in the same order
                gather_set(lay)
        if not use_muon:  # AdamW states in flat buffers: the step runs over contiguous runs
            fresh = [p for p in group["params"] if p.requires_grad and len(self.state[p]) == 0]
            for p, views in zip(fresh, flat_states(fresh, ("exp_avg", "exp_avg_sq"))):
                self.state[p].update(step=torch.tensor(0.0, dtype=torch.float32), **views)
                self._views[p] = views
        for p in group["params"]:
            if p.requires_grad:
                self._init_state(p, use_muon)

    def _init_state(self, p, use_muon: bool) -> None:
        """States are made when the parameter joins (zeros, step 0), not at its first step:
        checkpoint loaders (DCP) need them to exist, and an engine that pre-assigns ``.grad``
        buffers defeats torch's "initialise by a zero-lr step" heuristic."""
        state = self.state[p]
        if use_muon:
            state.setdefault("momentum_buffer", torch.zeros_like(p, memory_format=torch.preserve_format))
        elif len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _check_group(self, group: dict, gi: int) -> None:
        where = f"Muon param group {gi}"
        if group["use_muon"]:
            check_finite(where, lr=group["lr"], weight_decay=group["weight_decay"],
                         momentum=group["momentum"], eps=group["eps"])
            if not _scalar(group["momentum"]) < 1.0:
                raise ValueError(f"{where}: momentum={group['momentum']!r} must be in [0, 1) (at 1 the "
                                 "momentum buffer never sees a gradient); torch's default is 0.95")
            if not _scalar(group["eps"]) > 0.0:
                raise ValueError(f"{where}: eps={group['eps']!r} must be > 0 (the floor of the norm Newton-Schulz "
                                 "divides by: a zero gradient would give NaN); torch's default is 1e-7")
            if not isinstance(group["nesterov"], bool):
                raise ValueError(f"{where}: nesterov={group['nesterov']!r} must be True or False")
            coeffs = group["ns_coefficients"]
            if len(coeffs) != 3:
                raise ValueError(f"{where}: ns_coefficients={coeffs} must be three numbers (a, b, c)")
            check_finite(where, **{f"ns_coefficients[{i}]": c for i, c in enumerate(coeffs)})
            steps = group["ns_steps"]
            if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps < 100:
                raise ValueError(f"{where}: ns_steps={steps!r} must be an integer in [1, 100) (0 would skip "
                                 "orthogonalisation: the update is the normalised momentum, not Muon's); "
                                 "torch's default is 5")
            if group["adjust_lr_fn"] not in _ADJUST_FNS:
                raise ValueError(f"{where}: adjust_lr_fn={group['adjust_lr_fn']!r} must be one of {_ADJUST_FNS}")
        else:
            betas = group["betas"]
            if len(betas) != 2:
                raise ValueError(f"{where} (AdamW): betas={betas} must be two numbers")
            check_finite(where + " (AdamW)", lr=group["lr"], eps=group["eps"],
                         weight_decay=group["weight_decay"], **{"betas[0]": betas[0], "betas[1]": betas[1]})
            for i, b in enumerate(betas):
                if not 0.0 <= _scalar(b) < 1.0:
                    raise ValueError(f"{where} (AdamW): betas[{i}]={b} must be in [0, 1)")

    # -- step ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
        for gi, group in enumerate(self.param_groups):
            self._check_group(group, gi)
            if not group["use_muon"]:
                self._adamw_group(group, gi)
                continue
            items = []
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                lay = layout_of(p, f"Muon parameter {param_name(group, i, p, gi)}")
                self._check_grad(p, lay, group, i, gi)
                items.append((i, p, lay))
            work.append((gi, group, items))
        plan = self._plan(work)
        stats = {"ns_flops": 0, "ns_matrices": 0, "bytes_sent": plan.bytes_sent,
                 "bytes_recv": plan.bytes_recv, "allgather_bytes_sent": plan.allgather_bytes_sent,
                 "ns_flops_per_rank": per_rank(plan.loads), "waves": plan.waves,
                 "step_bytes_per_rank": per_rank(plan.peaks)}
        for (gi, group, items), batches in zip(work, plan.batches):
            self._muon_group(group, items, batches, stats)
        self.last_step_stats = stats
        return loss

    def _check_grad(self, p, lay: Layout, group, i, gi):
        g = p.grad
        if g.is_sparse:
            raise RuntimeError(f"Muon: parameter {param_name(group, i, p, gi)} has a sparse gradient")
        if tuple(g.shape) != tuple(p.shape):
            raise ValueError(f"Muon: gradient of {param_name(group, i, p, gi)} has shape "
                             f"{tuple(g.shape)}, the parameter {tuple(p.shape)}")
        if lay.kind != "plain":
            glay = layout_of(g, "gradient")
            if (glay.ranges, glay.outer, glay.outer_offset) != (lay.ranges, lay.outer, lay.outer_offset) or (
                    lay.kind == "ragged" and tuple(g.placements[i] for i in range(len(lay.placements))
                                                   if i != lay.mesh_dim)
                    != tuple(q for i, q in enumerate(lay.placements) if i != lay.mesh_dim)):
                where = getattr(g, "placements", None)
                raise ValueError(
                    f"Muon: gradient of {param_name(group, i, p, gi)} is laid out {glay.ranges} "
                    f"(placements {where}), the parameter {lay.ranges} (placements "
                    f"{getattr(p, 'placements', None)}); redistribute the gradient to the parameter's layout"
                )

    def _plan(self, work):
        key = tuple(
            (gi, group["ns_steps"], tuple((i, id(p), lay.key()) for i, p, lay in items))
            for gi, group, items in work
        )
        key = (self.wave_bytes, key)
        if self._plan_cache is not None and self._plan_cache[0] == key:
            return self._plan_cache[1]

        def state_bytes(p):
            st = self.state[p]
            return (2 * p.element_size() + st["momentum_buffer"].element_size() if "momentum_buffer" in st
                    else 3 * p.element_size())

        plan = plan_step(work, state_bytes, self.wave_bytes, self._agree)
        self._plan_cache = (key, plan)
        return plan

    def _agree(self, group) -> None:
        """Every rank of ``group`` must cut the same waves (they run collectives per wave)."""
        if id(group) in self._agreed:
            return
        agree("Muon: wave_bytes", self.wave_bytes, group=group)
        self._agreed.add(id(group))

    def _muon_group(self, group, items, batches, stats):
        momentum = group["momentum"]
        # 1. momentum on local elements, in place (no temporary)
        for i, p, lay in items:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            local_of(state["momentum_buffer"]).lerp_(local_of(p.grad), 1 - momentum)
        # 2.-4. per wave: the Nesterov blend of the wave's pieces (bf16), to the owners,
        # Newton-Schulz, back, weight decay and update; pointwise steps on slices give the
        # same bits as on whole tensors
        for batch in batches:
            if batch.waves:
                WaveRun(self, batch, items, group, stats, self._device(items), _newton_schulz_).run()

    def _device(self, items):
        """The device seam of the items' device, made once (looked up here, at call time)."""
        dev = self.__dict__.setdefault("_devices", {})
        device = local_of(items[0][1]).device
        if device not in dev:
            dev[device] = device_for(device)
        return dev[device]


    # -- AdamW groups ----------------------------------------------------------------
    def _adamw_group(self, group, gi):
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"Muon (AdamW group): parameter {param_name(group, i, p, gi)} has a sparse gradient")
            state = self.state[p]
            if len(state) == 0:
                self._init_state(p, False)
            params.append(local_of(p))
            grads.append(local_of(p.grad))
            exp_avgs.append(local_of(state["exp_avg"]))
            exp_avg_sqs.append(local_of(state["exp_avg_sq"]))
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        # torch's single-tensor AdamW arithmetic over contiguous runs of the flat states
        adamw_grouped(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, beta1=beta1,
                      beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                      maximize=False)

    # -- state dict ------------------------------------------------------------------
    _MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")
    _ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")

    @classmethod
    def _group_keys(cls, saved: dict, group: dict):
        use = saved.get("use_muon", True)  # torch.optim.Muon's groups have no use_muon: Muon
        if use != group["use_muon"]:
            raise ValueError(
                f"Muon.load_state_dict: a param group is {'Muon' if group['use_muon'] else 'AdamW (use_muon=False)'} "
                f"here but {'Muon' if use else 'AdamW (use_muon=False)'} in the state dict; build the param "
                "groups as they were when it was saved (e.g. muon_param_groups with the same model). "
                "Nothing was loaded")
        return cls._MUON_KEYS if use else cls._ADAMW_KEYS

    @staticmethod
    def _state_keys(saved: dict, p):
        keys = {"momentum_buffer"} if saved.get("use_muon", True) else {"step", "exp_avg", "exp_avg_sq"}
        return keys, keys.__contains__

    def state_dict(self) -> dict:
        """torch's, plus the layout fingerprint that per-rank files are checked against."""
        sd = super().state_dict()
        sd[MARK] = layout_record(self)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict whose tensors may be full tensors (any world size) or DTensors of
        any layout on the parameters' meshes: each is laid out like the parameter here.
        Another optimizer's state dict, and a per-rank one saved under another world size, rank
        or layout, are refused before anything is loaded (:mod:`._state_check`)."""
        check_state_dict(self, state_dict, group_keys=self._group_keys, state_keys=self._state_keys)
        check_layout(self, state_dict)
        views = {p: dict(v) for p, v in self._views.items()}
        _load_resharded(self, state_dict, lambda key: None)
        restore_flat_views(self, views)


def _load_resharded(opt: Optimizer, state_dict: dict, per_block_of: Callable[[str], int | None]) -> None:
    """Shared by both optimizers: load scalars through torch, then lay out every tensor state
    (except ``step``) like its parameter, keeping the saved dtype."""
    from itertools import chain

    held, saved_ids = load_scalars(opt, state_dict)
    names = chain.from_iterable(
        [(g, i) for i in range(len(g["params"]))] for g in opt.param_groups
    )
    params = chain.from_iterable(g["params"] for g in opt.param_groups)
    for sid, p, (g, i) in zip(saved_ids, params, names):
        if sid not in held:
            continue
        lay = layout_of(p)
        name = param_name(g, i, p)
        for k, v in held[sid].items():
            opt.state[p][k] = place_state(v, p, lay, name, k, per_block_of(k))
