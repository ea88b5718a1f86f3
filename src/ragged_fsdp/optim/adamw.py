"""``ragged_fsdp.optim.AdamW``: ``torch.optim.AdamW`` stepping whole flat segments.

Same arguments, defaults, param groups, ``state_dict()`` and results as
``torch.optim.AdamW(foreach=False)`` — bit for bit, at any world size — but for sharded
parameters (RaggedDTensors, e.g. from ``ragged_fsdp.fully_shard``) the step does not go
through the DTensor dispatcher once per parameter and op. Instead:

* states are flat: each state (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``) of a param
  group is one zeroed buffer per device and dtype, packed in the order the parameters sit in
  their segments; ``opt.state[p][key]`` is a RaggedDTensor view of it (so ``state_dict()``,
  DCP and resharding loads see the usual per-parameter tensors). They are made when the
  parameter joins the optimizer, not at its first step;
* a step finds the runs of parameters adjacent in the parameter segment, in the gradient
  segment (``fully_shard``'s reduce-scatter output) and in the state buffers, with equal
  hyperparameters and step count, and runs torch's single-tensor AdamW ops over each run in
  chunks of ``chunk_size`` elements (:mod:`._grouped`), on local tensors.

What falls back to torch's own code (``torch.optim.adamw.adamw`` with the group's ``foreach``
/``fused`` flags, per tensor): parameters that are not RaggedDTensors (plain tensors, torch
DTensors), gradients that are not RaggedDTensors of the parameter's local shape, groups with
``capturable``/``differentiable`` or tensor ``lr``/``betas``, and steps under a GradScaler's
``grad_scale``/``found_inf``. Gradients that are separate tensors (not views of one segment)
still take the grouped path, one run per parameter.

With ``fused=True`` each chunk is one ``torch._fused_adamw_`` call (torch's fused arithmetic,
within 1 ulp of the single-tensor result, as torch's own fused AdamW is).

``load_state_dict`` (which DCP's ``set_optimizer_state_dict`` calls) copies the loaded states
into the flat buffers, laying each out like its parameter first (a full tensor, or a DTensor
saved under another layout or world size), so the states stay views.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as _torch_adamw
from torch.optim.optimizer import _get_scalar_dtype

from ..placement.dtensor import RaggedDTensor
from ragged_fsdp.device import device_for
from ragged_fsdp.fsdp import policy_of

from ._grouped import adamw_grouped, flat_states
from ._layout import layout_of, local_of, param_name, place_state
from ._state_check import MARK, check_layout, check_state_dict, layout_record
from ._streamed import buckets_of, step_streamed
from .routing import check_int

__all__ = ["AdamW"]


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` with grouped, chunked steps over flat segments (see the module
    docstring). Extra keyword: ``chunk_size`` (elements per chunk): the bound on the step's
    temporaries; left out, 65536 on the CPU (cache-sized) and 2^24 on an accelerator (each chunk
    costs kernel launches there; 64 MiB of fp32 temporary).

    After each step ``last_step_stats`` counts ``grouped`` parameters (and the ``runs`` and
    ``chunks`` they formed) and ``fallback`` parameters stepped by torch's per-tensor code.

    Offload (``fully_shard(offload_policy=OffloadPolicy(optimizer_states=True))`` and/or
    ``grads=True``, parameters on the device): the flat states of those parameters are made
    in host memory and the step runs on the device, streaming each DBuffer's states and host
    gradients in and the states back out (:mod:`._streamed`); ``last_step_stats`` then also
    has ``streamed_buckets``, ``streamed_bytes_in`` and ``streamed_bytes_out``.
    """

    streams_host_states = True  # see ragged_fsdp.fsdp.offload.optimizers

    def __init__(self, params, lr: float | Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, chunk_size: int | None = None) -> None:
        self.chunk_size = None if chunk_size is None else check_int("AdamW", "chunk_size", chunk_size, 1)
        self._views: dict = {}  # param -> {state key: flat-buffer view} (grouped params only)
        self.last_step_stats: dict = {}
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         foreach=foreach, capturable=capturable, differentiable=differentiable,
                         fused=fused)

    # -- states ----------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self._make_states(group, [p for p in group["params"] if p.requires_grad])

    @staticmethod
    def _groupable(p) -> bool:
        return isinstance(p, RaggedDTensor) and not torch.is_complex(p) and p._local_tensor.is_contiguous()

    def _keys(self, group) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())

    def _new_step(self, group, p) -> Tensor:
        if group["capturable"] or group["fused"]:  # as torch.optim.Adam._init_group
            return torch.zeros((), dtype=_get_scalar_dtype(is_fused=group["fused"]), device=p.device)
        return torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")

    def _make_states(self, group, params) -> None:
        """Flat states for the groupable ``params`` lacking some state (fresh ones get a step)."""
        keys = self._keys(group)
        need: dict[tuple[str, ...], list] = {}
        for p in params:
            if not self._groupable(p):
                continue
            missing = tuple(k for k in keys if k not in self.state[p])
            if missing:
                need.setdefault(missing, []).append(p)
        for missing, ps in need.items():
            on_dev = [p for p in ps if _host_pin(p) is None]
            host = [p for p in ps if _host_pin(p) is not None]
            made = list(zip(on_dev, flat_states(on_dev, missing)))
            if host:
                made += list(zip(host, flat_states(host, missing, host_pin=_host_pin(host[0]))))
            for p, views in made:
                st = self.state[p]
                if "step" not in st:
                    st["step"] = self._new_step(group, p)
                st.update(views)
                self._views.setdefault(p, {}).update(views)

    # -- step --------------------------------------------------------------------------
    def _grouped_ok(self, group) -> bool:
        b1, b2 = group["betas"]
        return not (group["capturable"] or group["differentiable"] or isinstance(group["lr"], Tensor)
                    or isinstance(b1, Tensor) or isinstance(b2, Tensor)
                    or getattr(self, "grad_scale", None) is not None
                    or getattr(self, "found_inf", None) is not None)

    def step(self, closure=None):
        if any(g["differentiable"] for g in self.param_groups):
            return super().step(closure)  # torch's code, with autograd as it wants it
        with torch.no_grad():
            return self._step(closure)

    def _step(self, closure):
        check = getattr(self, "_accelerator_graph_capture_health_check", None)
        if check is not None:
            check()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stats = {"grouped": 0, "fallback": 0, "runs": 0, "chunks": 0}
        streamed_stats = {"streamed_buckets": 0, "streamed_bytes_in": 0, "streamed_bytes_out": 0}
        for group in self.param_groups:
            fast, slow = [], []
            ok = self._grouped_ok(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if ok and self._groupable(p) and _grad_fits(p):
                    fast.append(p)
                else:
                    slow.append(p)
            if slow:
                self._torch_step(group, slow)
                stats["fallback"] += len(slow)
            if fast:
                self._make_states(group, fast)  # e.g. amsgrad switched on after construction
                streamed = [p for p in fast if _streams(p)]
                here = [p for p in fast if not _streams(p)]
                if here:
                    s = self._grouped_step(group, here, [p._local_tensor for p in here],
                                           [local_of(p.grad) for p in here], self._state_locals(group, here))
                    stats["runs"] += s["runs"]
                    stats["chunks"] += s["chunks"]
                if streamed:
                    self._streamed_step(group, streamed, stats, streamed_stats)
                stats["grouped"] += len(fast)
        if streamed_stats["streamed_buckets"]:
            stats.update(streamed_stats)
        self.last_step_stats = stats
        return loss

    def _state_locals(self, group, params) -> dict[str, list[Tensor]]:
        st = [self.state[p] for p in params]
        return {k: [local_of(x[k]) for x in st] for k in self._keys(group)}

    def _grouped_step(self, group, params, p_locals, g_locals, states) -> dict:
        b1, b2 = group["betas"]
        return adamw_grouped(
            p_locals, g_locals, states["exp_avg"], states["exp_avg_sq"],
            states["max_exp_avg_sq"] if group["amsgrad"] else [],
            [self.state[p]["step"] for p in params], amsgrad=group["amsgrad"], beta1=b1, beta2=b2,
            lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
            maximize=group["maximize"], fused=bool(group["fused"]), chunk=self.chunk_size)

    def _streamed_step(self, group, params, stats, streamed_stats) -> None:
        """The grouped step on the device with host states/grads streamed in per DBuffer."""
        pols = [policy_of(p) for p in params]
        operands = {"grad": [local_of(p.grad) for p in params], **self._state_locals(group, params)}
        device = params[0]._local_tensor.device
        dev = self.__dict__.setdefault("_stream_devices", {}).get(device)
        if dev is None:
            dev = self._stream_devices[device] = device_for(device)  # its lanes, reused every step

        def step(idx, ops):
            ps = [params[i] for i in idx]
            s = self._grouped_step(group, ps, [p._local_tensor for p in ps], ops["grad"],
                                   {k: v for k, v in ops.items() if k != "grad"})
            stats["runs"] += s["runs"]
            stats["chunks"] += s["chunks"]

        # one bucket per (policy kind, storages): a bucket's host operands are one span each
        kinds: dict[tuple, list[int]] = {}
        for i, pol in enumerate(pols):
            kinds.setdefault((pol.grads, pol.optimizer_states), []).append(i)
        for (grads_host, states_host), idx in kinds.items():
            sub = {k: [v[i] for i in idx] for k, v in operands.items()}
            sub_host = {k: (grads_host if k == "grad" else states_host) for k in operands}
            buckets = buckets_of(sub, len(idx))
            s = step_streamed(dev, device, buckets, sub, sub_host,
                              write_back={k for k in operands if k != "grad"},
                              step=lambda b, ops, idx=idx: step([idx[i] for i in b], ops))
            streamed_stats["streamed_buckets"] += s["buckets"]
            streamed_stats["streamed_bytes_in"] += s["bytes_in"]
            streamed_stats["streamed_bytes_out"] += s["bytes_out"]

    def _torch_step(self, group, params) -> None:
        """torch.optim.AdamW's own step for ``params`` (what the group's flags select)."""
        sub = dict(group)
        sub["params"] = params
        lists: tuple[list, ...] = ([], [], [], [], [], [])
        has_complex = self._init_group(sub, *lists)
        b1, b2 = group["betas"]
        _torch_adamw(*lists, amsgrad=group["amsgrad"], has_complex=has_complex, beta1=b1, beta2=b2,
                     lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                     maximize=group["maximize"], foreach=group["foreach"], capturable=group["capturable"],
                     differentiable=group["differentiable"], fused=group["fused"],
                     grad_scale=getattr(self, "grad_scale", None), found_inf=getattr(self, "found_inf", None))

    # -- state dict ----------------------------------------------------------------------
    _STATE = frozenset(("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"))

    def state_dict(self) -> dict:
        """torch's, plus the layout fingerprint that per-rank files are checked against."""
        sd = super().state_dict()
        sd[MARK] = layout_record(self)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict``, then every loaded state of a grouped parameter is laid
        out like the parameter (full tensors and other layouts are resharded, the saved dtype is
        cast to the state's) and copied into its flat buffer, which stays the state.

        Refused before anything is loaded: another optimizer's state dict (other state keys or
        param-group hyperparameters), and a per-rank state dict saved under another world size,
        rank or layout (see :mod:`._state_check`)."""
        check_state_dict(
            self, state_dict, group_keys=lambda sg, g: ("lr", "betas", "eps", "weight_decay"),
            state_keys=lambda sg, p: ({"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if sg.get("amsgrad")
                                                                          else set()), self._STATE.__contains__))
        check_layout(self, state_dict)
        state_dict = {k: v for k, v in state_dict.items() if k != MARK}
        views = {p: dict(v) for p, v in self._views.items()}
        super().load_state_dict(state_dict)
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                mine = views.get(p)
                if not mine:
                    continue
                st = self.state[p]
                fresh = len(st) == 0  # nothing saved for p: a fresh state, as before any step
                for key, view in mine.items():
                    val = st.get(key)
                    if val is view:
                        continue
                    if val is None or fresh:
                        local_of(view).zero_()
                    elif isinstance(val, Tensor):
                        local_of(view).copy_(local_of(self._laid_out(val, view, p, group, gi, i, key)))
                    else:
                        raise ValueError(f"AdamW.load_state_dict: state {key!r} of parameter "
                                         f"{param_name(group, i, p, gi)} is {type(val).__name__}, not a tensor")
                    st[key] = view
                step = st.get("step")
                if fresh or step is None:
                    st["step"] = self._new_step(group, p)
                elif isinstance(step, Tensor):
                    st["step"] = step.clone()  # never shared with the caller's dict

    @staticmethod
    def _laid_out(val, view, p, group, gi, i, key):
        """``val`` in ``view``'s layout (a RaggedDTensor in the same layout is used as it is)."""
        if isinstance(val, DTensor) and not isinstance(view, DTensor):
            val = val.full_tensor()
        if (isinstance(val, RaggedDTensor) and isinstance(view, RaggedDTensor)
                and val._spec.placements == view._spec.placements and val._spec.mesh == view._spec.mesh
                and val._local_tensor.shape == view._local_tensor.shape):
            return val
        return place_state(val, p, layout_of(p), param_name(group, i, p, gi), key)


def _streams(p) -> bool:
    """``p``'s group keeps its gradients and/or states on the host, its parameters on the device."""
    pol = policy_of(p)
    return pol is not None and not pol.params and (pol.grads or pol.optimizer_states)


def _host_pin(p) -> bool | None:
    """Pin flag for host states of ``p`` (its group offloads optimizer states with the
    parameters on the device), else None: states on the parameter's device."""
    pol = policy_of(p)
    if pol is None or pol.params or not pol.optimizer_states:
        return None
    return bool(pol.pin_memory)


def _grad_fits(p) -> bool:
    g = p.grad
    return (isinstance(g, RaggedDTensor) and not g.is_sparse and g._local_tensor.shape == p._local_tensor.shape
            and g._spec.placements == p._spec.placements)
