"""Grouped AdamW: torch's single-tensor AdamW arithmetic over flat runs, in bounded chunks.

``torch.optim.AdamW(foreach=False)`` runs, per parameter, ``mul_`` (weight decay), ``lerp_``,
``mul_``+``addcmul_``, ``sqrt``/``div``/``add_`` (the denominator) and ``addcdiv_``. Every op is
element-wise and the scalars (bias corrections, step size) depend only on the hyperparameters
and the step count, so running the same ops over a *concatenation* of parameters that share
those scalars gives the same bits per element (CPU and CUDA element-wise kernels round each
element alike wherever it falls in a vector; the tests check this at odd offsets). Here the
concatenations are the contiguous runs of :mod:`._runs`, and each run is processed in chunks
of at most ``chunk`` elements, so the only temporary (the denominator, plus the negated
gradient with ``maximize``) is one chunk, not one parameter.

Flat states (:func:`flat_states`) make the runs long: each optimizer state is one zeroed
buffer per (param group, device, dtype), packed in the parameters' storage order, and every
parameter's state is a view of it wrapped like the parameter (a RaggedDTensor for sharded
parameters), so ``state_dict()`` and DCP see the usual per-parameter tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim.adamw import adamw as _torch_adamw

from ._layout import like_param, local_of
from ._runs import contiguous_runs, flat_view, member_of

__all__ = ["DEFAULT_CHUNK", "ACCELERATOR_CHUNK", "default_chunk", "adamw_grouped", "flat_states", "storage_order"]

# Elements per chunk on the CPU: large enough that per-op overhead is small, small enough that a
# chunk of every operand stays in cache (benchmarks/optim_step.py sweeps it).
DEFAULT_CHUNK = 1 << 16
# On an accelerator every chunk is 8 kernel launches from Python and there is no cache to stay
# in, so the chunk only bounds the temporary: 2^24 fp32 elements is 64 MiB (torch's foreach
# AdamW allocates a temporary the size of every parameter at once) and a rank holding 1e9
# elements steps in 60 chunks instead of 15,259.
ACCELERATOR_CHUNK = 1 << 24


def default_chunk(device: torch.device) -> int:
    """The chunk a step uses on ``device`` when the optimizer's ``chunk_size`` is left out."""
    return DEFAULT_CHUNK if torch.device(device).type == "cpu" else ACCELERATOR_CHUNK


def storage_order(locals_: Sequence[torch.Tensor]) -> list[int]:
    """Indices of ``locals_`` sorted by (storage, offset): the order flat states are packed in."""
    rank: dict = {}
    keys = []
    for i, t in enumerate(locals_):
        k = (t.device, t.dtype, t.untyped_storage().data_ptr())
        keys.append((rank.setdefault(k, len(rank)), t.storage_offset(), i))
    return [i for _, _, i in sorted(keys)]


def flat_states(params: Sequence[torch.Tensor], keys: Sequence[str],
                dtype: torch.dtype | None = None, host_pin: bool | None = None) -> list[dict[str, torch.Tensor]]:
    """Zeroed states ``keys`` for ``params``: one flat buffer per key and (device, dtype),
    packed in storage order (so parameters adjacent in their segment have adjacent states);
    returns per parameter ``{key: view}``, each view wrapped like its parameter. With
    ``host_pin`` (True/False) the buffers live in host memory, pinned or not (offload)."""
    locals_ = [local_of(p) for p in params]
    out: list[dict[str, torch.Tensor]] = [{} for _ in params]
    by_kind: dict = {}
    for i in storage_order(locals_):
        t = locals_[i]
        by_kind.setdefault((t.device, dtype or t.dtype), []).append(i)
    for (device, dt), idx in by_kind.items():
        total = sum(locals_[i].numel() for i in idx)
        for key in keys:
            if host_pin is None:
                flat = torch.zeros(total, dtype=dt, device=device)
            else:
                flat = torch.empty(total, dtype=dt, device="cpu", pin_memory=host_pin).zero_()
            off = 0
            for i in idx:
                n = locals_[i].numel()
                out[i][key] = like_param(flat.narrow(0, off, n).view(locals_[i].shape), params[i])
                off += n
    return out


def adamw_grouped(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    *,
    amsgrad: bool,
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    fused: bool = False,
    chunk: int | None = None,
) -> dict:
    """One AdamW step on *local* (plain) tensors, as ``torch.optim.adam._single_tensor_adam``
    with decoupled weight decay, over contiguous runs in chunks. ``state_steps`` are
    incremented (torch's functional ``adamw(foreach=False)`` steps the few tensors that are not one
    flat range). With ``fused=True`` each chunk is one ``torch._fused_adamw_`` call instead
    (torch's fused arithmetic: within 1 ulp of the single-tensor one). ``chunk=None``: the
    device's :func:`default_chunk`.

    Returns counts for reports: ``{"runs": ..., "loose": ..., "chunks": ...}``.
    """
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1 elements")
    stats = {"runs": 0, "loose": 0, "chunks": 0}
    if not params:
        return stats
    if chunk is None:
        chunk = default_chunk(params[0].device)
    members, loose = [], []
    for i, p in enumerate(params):
        ts = [p, grads[i], exp_avgs[i], exp_avg_sqs[i]] + ([max_exp_avg_sqs[i]] if amsgrad else [])
        m = None
        if all(t.dtype == p.dtype and t.device == p.device for t in ts) and not torch.is_complex(p):
            m = member_of(i, ts, tag=None)
        (loose if m is None else members).append(i if m is None else m)
    if loose:  # not one flat range (non-contiguous, mixed dtypes): torch's own per-tensor code
        _torch_adamw(
            [params[i] for i in loose], [grads[i] for i in loose], [exp_avgs[i] for i in loose],
            [exp_avg_sqs[i] for i in loose], [max_exp_avg_sqs[i] for i in loose] if amsgrad else [],
            [state_steps[i] for i in loose], foreach=False, fused=False, amsgrad=amsgrad,
            has_complex=any(torch.is_complex(params[i]) for i in loose), beta1=beta1, beta2=beta2,
            lr=lr, weight_decay=weight_decay, eps=eps, maximize=maximize)
        stats["loose"] = len(loose)
    if not members:
        return stats
    steps = [state_steps[m.index] for m in members]
    torch._foreach_add_(steps, 1)
    # The step decides the scalars: a run never mixes step counts (a parameter that missed a
    # step, e.g. its gradient was None, is behind the others).
    values = [s.item() for s in steps]
    members = [m.with_tag(v) for m, v in zip(members, values)]
    step_of = {m.index: (s, v) for m, s, v in zip(members, steps, values)}
    tmp: dict = {}
    for run in contiguous_runs(members):
        i0 = run.indices[0]
        n = run.numel
        p = flat_view(params[i0], n)
        g = flat_view(grads[i0], n)
        m = flat_view(exp_avgs[i0], n)
        v = flat_view(exp_avg_sqs[i0], n)
        vmax = flat_view(max_exp_avg_sqs[i0], n) if amsgrad else None
        stats["runs"] += 1
        stats["chunks"] += -(-n // chunk)
        step_t, step = step_of[i0]
        if fused:
            _fused_chunks(p, g, m, v, vmax, step_t, chunk, lr=lr, beta1=beta1, beta2=beta2,
                          weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize)
            continue
        key = (p.device, p.dtype)
        need = min(chunk, n) * (2 if maximize else 1)  # the denominator (and -grad) of one chunk
        buf = tmp.get(key)
        if buf is None or buf.numel() < need:
            buf = tmp[key] = torch.empty(need, dtype=p.dtype, device=p.device)
        _chunks(p, g, m, v, vmax, step, chunk, buf, beta1=beta1, beta2=beta2, lr=lr,
                weight_decay=weight_decay, eps=eps, maximize=maximize)
    return stats


def _chunks(p, g, m, v, vmax, step: float, chunk: int, buf: torch.Tensor, *, beta1, beta2, lr,
            weight_decay, eps, maximize) -> None:
    # the scalars exactly as torch computes them (Python floats, same expressions)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    n = p.numel()
    half = buf.numel() // 2 if maximize else buf.numel()
    for a in range(0, n, chunk):
        k = min(chunk, n - a)
        whole = k == n
        pc = p if whole else p.narrow(0, a, k)
        gc = g if whole else g.narrow(0, a, k)
        mc = m if whole else m.narrow(0, a, k)
        vc = v if whole else v.narrow(0, a, k)
        if maximize:
            gc = torch.neg(gc, out=buf.narrow(0, half, k))
        if weight_decay != 0:
            pc.mul_(1 - lr * weight_decay)
        mc.lerp_(gc, 1 - beta1)
        vc.mul_(beta2).addcmul_(gc, gc, value=1 - beta2)
        src = vc
        if vmax is not None:
            vm = vmax if whole else vmax.narrow(0, a, k)
            torch.maximum(vm, vc, out=vm)
            src = vm
        denom = torch.sqrt(src, out=buf.narrow(0, 0, k))
        denom.div_(bias_correction2_sqrt).add_(eps)
        pc.addcdiv_(mc, denom, value=-step_size)


def _fused_chunks(p, g, m, v, vmax, step_t, chunk, **kw) -> None:
    n = p.numel()
    for a in range(0, n, chunk):
        k = min(chunk, n - a)
        sl = [t.narrow(0, a, k) for t in (p, g, m, v)]
        torch._fused_adamw_([sl[0]], [sl[1]], [sl[2]], [sl[3]],
                            [vmax.narrow(0, a, k)] if vmax is not None else [], [step_t], **kw)


def restore_flat_views(opt, views: dict) -> None:
    """After a ``load_state_dict`` that replaced state tensors (``views``: param -> {key: the
    flat-buffer view it had}), copy each loaded value (already laid out like the parameter)
    into its view and make the view the state again. A parameter with no saved state keeps
    what the load gave it (an empty state: the optimizer makes a fresh one when it steps)."""
    for p, mine in views.items():
        st = opt.state.get(p)
        if not st:
            continue
        for key, view in mine.items():
            val = st.get(key)
            if val is view or not isinstance(val, torch.Tensor):
                continue
            src, dst = local_of(val), local_of(view)
            if src.shape != dst.shape:
                raise ValueError(f"load_state_dict: state {key!r} has local shape {tuple(src.shape)}, "
                                 f"the optimizer's {tuple(dst.shape)}")
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src)
            st[key] = view
