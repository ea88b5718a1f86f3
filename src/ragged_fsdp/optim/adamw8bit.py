"""AdamW with block-wise 8-bit states, computed on each rank's own blocks.

States of a tensor with at least ``min_8bit_size`` elements (its *global* size, so the choice
is the same at every world size) are stored block-wise quantised (Dettmers et al., "8-bit
Optimizers via Block-wise Quantization", 2021): ``block_size``-element blocks starting at the
tensor's first element (the last block may be partial), one float32 absmax per block, a uint8
code per element; the first moment uses the signed dynamic map, the second the unsigned one
(:mod:`ragged_fsdp.optim.quant`; two shared 256-entry tables, not per-parameter state).
Smaller tensors keep float32 states.

On an n-D mesh (RaggedShard next to HSDP's Replicate or TP/EP's ``Shard(k)``) the blocks are
cut from the **outer-local** tensor, the TP/EP-local tensor the RaggedShard splits: a TP piece
of a matrix is not a contiguous run of the global tensor (``Shard(1)`` leaves row segments),
so global blocks could not be kept whole on one rank without moving states every step, while
outer-local blocks are what ``fully_shard``'s planner keeps whole (granularity applies to the
TP-local tensor). Hence parameters and states are the same bits at every data-parallel size for
a fixed TP/EP layout (and equal to one process when the outer-local blocks coincide with the
global ones: HSDP, or a ``Shard(0)`` whose pieces are whole blocks); a different TP/EP degree
cuts other blocks, so 8-bit states do not move between TP/EP degrees (the per-block state has
one row of blocks per TP/EP piece, shape ``parts + (blocks,)``, and a mismatch is refused).
HSDP replicas hold and update identical copies.

Each step, per parameter: dequantise the states of this rank's blocks, run torch's AdamW
update on this rank's elements (``torch.optim.adamw.adamw``, single-tensor path: decoupled
weight decay, bias corrections, the same rounding as ``torch.optim.AdamW``), quantise the new
states (absmax of the new values per block, nearest code). As long as the layout never cuts a
block, every block is dequantised, updated and quantised exactly as on one device: parameters
and states are the same bits at every world size. A layout that cuts a block is rejected with
an error that names the parameter and the fix (``granularity_fn=AdamW8bit.granularity``).

The step runs over contiguous runs of parameters (adjacent in the parameter, gradient, code
and absmax buffers; states are flat buffers per param group whose views are the per-parameter
states) in chunks of whole blocks (:mod:`._grouped8bit`): the same bits as the per-parameter
step (``opt.grouped = False``) with temporaries of one chunk instead of one parameter.

State (``opt.state[p]``, DTensors for sharded parameters so checkpoints can reshard them):

* ``step``: float32 scalar tensor;
* 8-bit tensors: ``exp_avg_codes`` / ``exp_avg_sq_codes`` (uint8, the parameter's layout) and
  ``exp_avg_absmax`` / ``exp_avg_sq_absmax`` (float32, one per block; a RaggedDTensor over
  blocks when sharded);
* small tensors: ``exp_avg`` / ``exp_avg_sq`` (float32, the parameter's layout).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.optim import Optimizer
from torch.optim.adamw import adamw as _torch_adamw

from ._grouped import DEFAULT_CHUNK, flat_states, restore_flat_views, storage_order
from ._grouped8bit import Item, adamw8bit_grouped
from ._layout import Layout, blocks_like, layout_of, local_of, param_name
from .muon import _load_resharded
from .quant import dequantize_blockwise, num_blocks, quantize_blockwise, signed_map, unsigned_map
from ._state_check import MARK, check_layout, check_state_dict, layout_record
from .routing import adamw8bit_granularity, check_finite, check_int

__all__ = ["AdamW8bit", "state_bytes"]

_BLOCK_KEYS = ("exp_avg_absmax", "exp_avg_sq_absmax")


class AdamW8bit(Optimizer):
    """AdamW with block-wise 8-bit first and second moments.

    Args:
        params: parameters or param groups.
        lr: learning rate (default 1e-3).
        betas: moment coefficients (default (0.9, 0.999)).
        eps: added to the denominator (default 1e-8).
        weight_decay: decoupled weight decay, as AdamW (default 1e-2).
        block_size: elements per quantisation block (default 256).
        min_8bit_size: tensors with fewer elements (global count) keep fp32 states (default 4096).

    ``AdamW8bit.granularity`` is the ``granularity_fn`` for ``fully_shard`` that keeps the
    default blocks whole (``"block:256"`` for tensors of >= 4096 elements, else ``None``);
    ``AdamW8bit.granularity_for(block_size, min_8bit_size)`` gives it for other settings.
    """

    granularity: Callable = staticmethod(adamw8bit_granularity(256, 4096))
    granularity_for = staticmethod(adamw8bit_granularity)

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, block_size: int = 256,
                 min_8bit_size: int = 4096) -> None:
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "block_size": block_size, "min_8bit_size": min_8bit_size}
        # States are flat buffers per param group (views per parameter) and the step runs over
        # contiguous runs in chunks of whole blocks (._grouped8bit); grouped=False steps per
        # parameter (the same bits; kept for comparisons).
        self._views: dict = {}
        self.grouped = True
        self.chunk_size = DEFAULT_CHUNK
        self.last_step_stats: dict = {}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[-1]
        self._check_group(group, gi)
        for i, p in enumerate(group["params"]):
            if torch.is_complex(p) or not p.is_floating_point():
                raise ValueError(f"AdamW8bit: parameter {param_name(group, i, p, gi)} has dtype "
                                 f"{p.dtype}; only real floating-point parameters are supported")
            lay = layout_of(p, f"AdamW8bit parameter {param_name(group, i, p, gi)}")
            self._check_blocks(p, lay, group, param_name(group, i, p, gi))
        # made now, not at the first step: checkpoint loaders need them to exist
        self._init_states(group, gi, [i for i, p in enumerate(group["params"])
                                      if p.requires_grad and len(self.state[p]) == 0])

    def _check_group(self, group: dict, gi: int) -> None:
        where = f"AdamW8bit param group {gi}"
        betas = group["betas"]
        if len(betas) != 2:
            raise ValueError(f"{where}: betas={betas} must be two numbers")
        check_finite(where, lr=group["lr"], eps=group["eps"], weight_decay=group["weight_decay"],
                     **{"betas[0]": betas[0], "betas[1]": betas[1]})
        for i, b in enumerate(betas):
            if not 0.0 <= float(b) < 1.0:
                raise ValueError(f"{where}: betas[{i}]={b} must be in [0, 1)")
        check_int(where, "block_size", group["block_size"], 1)
        check_int(where, "min_8bit_size", group["min_8bit_size"], 0)

    @staticmethod
    def _eight_bit(lay: Layout, group: dict) -> bool:
        return lay.numel >= group["min_8bit_size"]

    def _check_blocks(self, p, lay: Layout, group: dict, name: str) -> None:
        """Every rank's run must start on a block edge and end on one (or at the end of the
        tensor the runs cut: the TP/EP-local tensor on an n-D mesh)."""
        if not self._eight_bit(lay, group) or lay.kind in ("plain", "replicate"):
            return
        bs = group["block_size"]
        end = lay.outer_numel
        what = (f"its TP/EP-local tensor of shape {lay.outer_shape} (placements {lay.placements})"
                if lay.outer_shards else "elements")
        for r, (a, b) in enumerate(lay.ranges):
            if b <= a:
                continue
            cut = a if a % bs else (b if b % bs and b != end else None)
            if cut is not None:
                raise ValueError(
                    f"AdamW8bit: parameter {name} (shape {lay.shape}, {lay.numel} elements) is laid "
                    f"out so that rank {r} holds {what} [{a}, {b}), cutting a {bs}-element "
                    f"quantisation block at element {cut}. Shard the model with "
                    "fully_shard(..., granularity_fn=AdamW8bit.granularity) (or "
                    f"AdamW8bit.granularity_for(block_size={bs}, min_8bit_size={group['min_8bit_size']})) "
                    "so blocks stay whole, or raise min_8bit_size above this tensor's size to keep "
                    "its states in fp32"
                )

    # -- step ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        total = {"grouped": 0, "fallback": 0, "runs": 0, "chunks": 0}
        for gi, group in enumerate(self.param_groups):
            self._check_group(group, gi)
            beta1, beta2 = group["betas"]
            kw = dict(foreach=False, fused=False, amsgrad=False, beta1=beta1, beta2=beta2,
                      lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                      maximize=False)
            bs = group["block_size"]
            items = []
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                name = param_name(group, i, p, gi)
                if p.grad.is_sparse:
                    raise RuntimeError(f"AdamW8bit: parameter {name} has a sparse gradient")
                lay = layout_of(p, f"AdamW8bit parameter {name}")
                state = self.state[p]
                if len(state) == 0:
                    self._init_states(group, gi, [i])
                pl, gl = local_of(p), local_of(p.grad)
                if gl.shape != pl.shape:
                    raise ValueError(f"AdamW8bit: gradient of {name} has local shape {tuple(gl.shape)}, "
                                     f"the parameter {tuple(pl.shape)}; they must share a layout")
                if "exp_avg" in state:  # fp32 states
                    sts = (local_of(state["exp_avg"]), local_of(state["exp_avg_sq"]))
                else:
                    self._check_blocks(p, lay, group, name)
                    sts = tuple(local_of(state[k]) for k in ("exp_avg_codes", "exp_avg_sq_codes",
                                                             "exp_avg_absmax", "exp_avg_sq_absmax"))
                items.append(Item(pl, gl, sts, state["step"], "exp_avg" not in state))
            loose = items
            if self.grouped:
                loose, stats = adamw8bit_grouped(
                    items, block=bs, chunk=self.chunk_size, beta1=beta1, beta2=beta2, lr=group["lr"],
                    weight_decay=group["weight_decay"], eps=group["eps"])
                for k in ("runs", "chunks"):
                    total[k] += stats[k]
                total["grouped"] += len(items) - len(loose)
            total["fallback"] += len(loose)
            self._step_each(loose, bs, kw)
        self.last_step_stats = total
        return loss

    @staticmethod
    def _step_each(items: list, bs: int, kw: dict) -> None:
        """The per-parameter step: whole-parameter temporaries (used for tensors that are not
        one flat range, and with ``grouped=False``)."""
        small = ([], [], [], [], [])
        copy_back = []
        for it in items:
            pl, gl = it.param, it.grad
            # fp32 math (and fp32 states) for low-precision parameters, as bitsandbytes does
            p32 = pl if pl.dtype == torch.float32 else pl.float()
            g32 = gl if gl.dtype == torch.float32 else gl.float()
            if p32 is not pl:
                copy_back.append((pl, p32))
            if not it.eight_bit:
                for lst, t in zip(small, (p32, g32, it.states[0], it.states[1], it.step)):
                    lst.append(t)
                continue
            m_codes, v_codes, m_absmax, v_absmax = it.states
            smap, umap = signed_map(pl.device), unsigned_map(pl.device)
            m = dequantize_blockwise(m_codes, m_absmax, smap, bs).view(pl.shape)
            v = dequantize_blockwise(v_codes, v_absmax, umap, bs).view(pl.shape)
            _torch_adamw([p32], [g32], [m], [v], [], [it.step], **kw)
            quantize_blockwise(m, smap, bs, codes_out=m_codes, absmax_out=m_absmax)
            quantize_blockwise(v, umap, bs, codes_out=v_codes, absmax_out=v_absmax)
        if small[0]:
            _torch_adamw(*small[:4], [], small[4], **kw)
        for pl, p32 in copy_back:
            pl.copy_(p32)

    def _init_states(self, group: dict, gi: int, indices: list[int]) -> None:
        """States of ``group["params"][i]`` for ``i`` in ``indices``, in flat buffers (one per
        state and param group, packed in storage order) whose views are the states."""
        params = [group["params"][i] for i in indices]
        if not params:
            return
        lays = [layout_of(p) for p in params]
        small = [p for p, lay in zip(params, lays) if not self._eight_bit(lay, group)]
        eight = [(i, p, lay) for i, p, lay in zip(indices, params, lays) if self._eight_bit(lay, group)]
        for p in params:
            self.state[p]["step"] = torch.tensor(0.0, dtype=torch.float32)
        for p, views in zip(small, flat_states(small, ("exp_avg", "exp_avg_sq"), dtype=torch.float32)):
            self.state[p].update(views)
            self._views[p] = views
        if not eight:
            return
        for i, p, lay in eight:
            self._check_blocks(p, lay, group, param_name(group, i, p, gi))
        ps = [p for _, p, _ in eight]
        codes = flat_states(ps, ("exp_avg_codes", "exp_avg_sq_codes"), dtype=torch.uint8)
        zero_signed = int(torch.searchsorted(signed_map(), torch.tensor(0.0)))
        bs = group["block_size"]
        locals_ = [local_of(p) for p in ps]
        order = storage_order(locals_)
        nbs = [num_blocks(t.numel(), bs) for t in locals_]
        absmax = {k: torch.zeros(sum(nbs), dtype=torch.float32, device=locals_[0].device) if locals_ else None
                  for k in _BLOCK_KEYS}
        off = 0
        starts = [0] * len(ps)
        for j in order:
            starts[j] = off
            off += nbs[j]
        for j, (p, (_, _, lay)) in enumerate(zip(ps, eight)):
            views = dict(codes[j])
            local_of(views["exp_avg_codes"]).fill_(zero_signed)
            for k in _BLOCK_KEYS:
                views[k] = blocks_like(absmax[k].narrow(0, starts[j], nbs[j]), p, lay, bs)
            self.state[p].update(views)
            self._views[p] = views

    # -- state dict ------------------------------------------------------------------
    _CODES = frozenset(("step", "exp_avg_codes", "exp_avg_sq_codes") + _BLOCK_KEYS)
    _FP32 = frozenset(("step", "exp_avg", "exp_avg_sq"))

    def _state_keys(self, saved_group: dict, p) -> tuple[set, object]:
        keys = self._CODES if p.numel() >= saved_group["min_8bit_size"] else self._FP32
        return set(keys), keys.__contains__

    def state_dict(self) -> dict:
        """torch's, plus the layout fingerprint that per-rank files are checked against."""
        sd = super().state_dict()
        sd[MARK] = layout_record(self)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict whose tensors may be full tensors (any world size) or DTensors of
        any layout on the parameters' meshes; codes stay uint8, absmax stays per block.
        Another optimizer's state dict, and a per-rank one saved under another world size, rank
        or layout, are refused before anything is loaded (:mod:`._state_check`)."""
        check_state_dict(self, state_dict, state_keys=self._state_keys,
                         group_keys=lambda sg, g: ("lr", "betas", "eps", "weight_decay", "block_size",
                                                   "min_8bit_size"))
        check_layout(self, state_dict)
        block_of = {}
        for g in self.param_groups:
            block_of.setdefault("bs", g["block_size"])
        bs = block_of.get("bs", 256)
        if any(g["block_size"] != bs for g in self.param_groups):
            raise NotImplementedError("AdamW8bit.load_state_dict: groups with different block sizes")
        views = {p: dict(v) for p, v in self._views.items()}
        _load_resharded(self, state_dict, lambda key: bs if key in _BLOCK_KEYS else None)
        restore_flat_views(self, views)  # the loaded values go into the flat buffers


def state_bytes(opt: Optimizer) -> int:
    """Bytes of optimizer state tensors held by this rank (local pieces of DTensors)."""
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                t = local_of(v)
                total += t.numel() * t.element_size()
    return total
