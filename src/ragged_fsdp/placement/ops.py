"""Operator dispatch for RaggedDTensor.

Four kinds of ops are supported, each with the rule that makes it exact:

* local ops (pointwise, ``_foreach_*``, fused optimizer kernels, ``*_like`` factories,
  clone/detach/copy/fill/zero, dtype casts): every RaggedDTensor argument at the same
  position must have the same layout, so the op on local tensors is the op on the global
  tensor restricted to this rank's elements. Scalars, 0-d plain tensors and one-element
  Replicate DTensors may join in (learning rates, clip coefficients);
* random fills (``normal_``, ``uniform_``, ...): the full tensor is drawn and sliced, so a
  seed gives the same values at every world size (the RNG advances as in one process);
* reductions (``norm``, ``sum``, ``max``, ``min``, ``_foreach_norm``): reduce locally, then
  one all-reduce over the ragged mesh dim; the result is a Replicate DTensor;
* ``copy_`` from a plain tensor of the global shape (``load_state_dict``) or a Replicate
  DTensor: copies our slice; from another DTensor layout: redistributes first.

Anything else raises an error naming the op and the way out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._pytree import tree_flatten, tree_map

from .dtensor import RaggedDTensor, my_piece, spec_mismatch, split_groups, wrap

aten = torch.ops.aten

# set (True) on the sharded parameters fully_shard makes, so an op can tell them apart
SHARDED_PARAM_ATTR = "_ragged_fsdp_sharded_param"
# set on a sharded fully_shard parameter whose identity view was taken (see _identity_view)
VIEWED_SHARDED_ATTR = "_ragged_fsdp_viewed_while_sharded"

# Ops that act element by element or only on metadata we keep, beyond those tagged pointwise.
_LOCAL_OPS = {
    aten.detach.default, aten.detach_.default, aten.alias.default, aten.clone.default,
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
    aten.full_like.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default,
    aten._to_copy.default, aten.copy_.default, aten.lerp_.Scalar, aten.lerp_.Tensor,
    aten.lerp.Scalar, aten.lerp.Tensor, aten.where.self, aten._fused_adamw_.default,
    aten._fused_adam_.default, aten._fused_sgd_.default, aten._fused_adagrad_.default,
    aten._fused_adamw_.tensor_lr, aten._fused_adam_.tensor_lr, aten._fused_sgd_.tensor_lr,
    aten.masked_fill_.Scalar, aten.masked_fill.Scalar,
}
_RANDOM_OPS = {
    aten.normal_.default, aten.uniform_.default, aten.bernoulli_.float,
    aten.exponential_.default, aten.random_.default, getattr(aten.random_, "from"), aten.random_.to,
    aten.log_normal_.default, aten.geometric_.default, aten.cauchy_.default,
    aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
    aten.randint_like.low_dtype,
}
_NEW_OPS = {aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default}
_AMP_UNSCALE = aten._amp_foreach_non_finite_check_and_unscale_.default
_BOOL_OPS = {aten.equal.default, aten.is_same_size.default}
_VIEW_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_FOREACH_NORM = {aten._foreach_norm.Scalar}
_MASKED_PUT = {aten.index_put_.default, aten.index_put.default}
_REDUCTIONS = {
    aten.linalg_vector_norm.default, aten.sum.default, aten.sum.dim_IntList,
    aten.max.default, aten.min.default, aten.amax.default, aten.amin.default,
    aten.mean.default, aten.mean.dim, aten.any.default, aten.all.default,
}


def _is_local_op(func) -> bool:
    if func in _LOCAL_OPS:
        return True
    name = func.__name__
    if name.startswith("_foreach_") and func not in _FOREACH_NORM:
        return True
    return torch.Tag.pointwise in func.tags


def dispatch(func, args, kwargs):
    # An op's kind never changes, so it is worked out once per op overload: the optimizer
    # and clipping code that runs on every parameter every step then pays one dict lookup.
    handler = _HANDLERS.get(func)
    if handler is None:
        handler = _HANDLERS[func] = _handler_for(func)
    return handler(func, args, kwargs)


def _handler_for(func):
    if func in _RANDOM_OPS:
        return _random
    if func in _REDUCTIONS:
        return _reduce
    if func in _FOREACH_NORM:
        return lambda func, args, kwargs: _foreach_norm(args, kwargs)
    if func is aten.copy_.default:
        return _copy
    if func in _NEW_OPS:
        # new_* take an explicit size, so the result is an ordinary tensor, not a layout.
        return lambda func, args, kwargs: func(args[0]._local_tensor, *args[1:], **kwargs)
    if func in _BOOL_OPS:
        return _bool_op
    if func in _VIEW_OPS:
        return _view
    if func in _MASKED_PUT:
        return _masked_put
    if func is _AMP_UNSCALE:
        return lambda func, args, kwargs: _amp_unscale(args, kwargs)
    if _is_local_op(func):
        return _local
    return _unsupported


_HANDLERS: dict = {}


def _unsupported(func, args, kwargs):
    raise NotImplementedError(
        f"ragged_fsdp: {func} is not supported on RaggedShard DTensors. Call .full_tensor() "
        "to work on the whole tensor, or .redistribute(mesh, [Replicate()]) / "
        "[Shard(0)] to move to a layout torch's DTensor supports." + _mixed_hint(args, kwargs)
    )


def _copy(func, args, kwargs):
    if not isinstance(args[1], RaggedDTensor):
        return _copy_from_full(args[0], args[1])
    return _local(func, args, kwargs)


def _view(func, args, kwargs):
    if _same_shape(args):
        return _identity_view(func, args[0])
    return _unsupported(func, args, kwargs)


def _mixed_hint(args, kwargs) -> str:
    """A RaggedShard DTensor meeting plain tensors in a compute op is, most often, a
    ``fully_shard`` module's sharded parameter used outside its ``forward``."""
    flat, _ = tree_flatten((args, kwargs))
    if not any(isinstance(x, torch.Tensor) and not isinstance(x, DTensor) for x in flat):
        return ""
    return (" It got RaggedShard DTensors mixed with plain tensors: if a module wrapped by fully_shard "
            "computes outside forward() (a generate() method calling its submodules, say), its parameters are "
            "still sharded there; register that method with ragged_fsdp.register_fsdp_forward_method(module, "
            "'generate') so they are gathered for it.")


def _masked_put(func, args, kwargs):
    """``t[mask] = v`` with a boolean mask of ``t``'s own layout and a one-element ``v``:
    each element is written or kept by its own mask bit, so it is a local op (torch.optim.Rprop
    zeroes its gradient this way). Any other index (integers, another layout) moves elements
    between positions and stays unsupported."""
    x, indices, values = args[0], args[1], args[2]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    mask = indices[0] if len(indices) == 1 else None
    if (isinstance(x, RaggedDTensor) and isinstance(mask, RaggedDTensor) and mask.dtype == torch.bool
            and spec_mismatch(x._spec, mask._spec) is None and isinstance(values, torch.Tensor)
            and values.numel() == 1 and not accumulate):
        local = func(x._local_tensor, [mask._local_tensor], _unwrap_arg(func, values), *args[3:], **kwargs)
        return x if func is aten.index_put_.default else wrap(local, x._spec)
    return _unsupported(func, args, kwargs)


# -- identity views ----------------------------------------------------------------------

def _same_shape(args) -> bool:
    size = args[1] if len(args) > 1 else None
    return isinstance(args[0], RaggedDTensor) and size is not None and tuple(size) == tuple(args[0].shape)


def _identity_view(func, x: RaggedDTensor):
    """A view to the tensor's own shape (``t.view_as(t)``) keeps every element where it
    is, so it is the same view of the local tensor with the same layout.

    One caller means trouble: torch.distributed.pipelining's split backward (zero-bubble
    schedules) takes ``p.view_as(p)`` of every parameter the stage module holds, to find
    the gradient accumulators its weight-gradient pass computes into. A sharded
    ``fully_shard`` parameter there means the module resharded after forward, and the
    autograd graph holds the unsharded parameters instead: the weight gradients would be
    lost (torch's FSDP2 loses them without a word). Raising here would stop this rank in
    the middle of the schedule while its pipeline peers wait for its activations or
    gradients until the process-group timeout, so the parameter is only marked: the
    schedule runs to the end of the step on every rank, and the engine refuses when the
    schedule asks it to reduce (:data:`VIEWED_SHARDED_ATTR`, read by ``fsdp.torch_state``)."""
    if x.requires_grad and x.grad_fn is None and getattr(x, SHARDED_PARAM_ATTR, False):
        setattr(x, VIEWED_SHARDED_ATTR, True)
    local = x._local_tensor
    return wrap(local.view(local.shape), x._spec)


# -- local ops ---------------------------------------------------------------------------

def _unwrap_arg(func, x):
    if isinstance(x, RaggedDTensor):
        return x._local_tensor
    if isinstance(x, DTensor):
        if x.numel() == 1 and all(isinstance(p, Replicate) for p in x.placements):
            return x._local_tensor
        raise ValueError(
            f"ragged_fsdp: {func} mixes a RaggedShard DTensor with a DTensor of placements "
            f"{x.placements}; redistribute one of them so both use the same layout"
        )
    return x


def _check_plain(func, x):
    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.dim() > 0 and x.numel() > 1:
        raise ValueError(
            f"ragged_fsdp: {func} mixes a RaggedShard DTensor with a plain tensor of shape "
            f"{tuple(x.shape)}; only scalars and one-element tensors can join a ragged op. "
            "Wrap it with ragged_fsdp.distribute_tensor(t, mesh, placements) first"
        )


_SCALARS = (float, int, bool, type(None))


class _Nested(Exception):
    """An argument nested deeper than one list: the generic (pytree) path handles it."""


def _note(func, specs: dict, pos: int, spec) -> None:
    """Record the spec at list position ``pos`` (-1: a top-level argument); foreach ops pair
    the i-th tensor of each list, so those must share one layout."""
    first = specs.get(pos)
    if first is None:
        specs[pos] = spec
    elif first is not spec:
        why = spec_mismatch(first, spec)
        if why is not None:
            raise ValueError(
                f"ragged_fsdp: {func} on RaggedShard DTensors whose {why}; redistribute one "
                "so both have the same mesh, shape and RaggedShard layout"
            )


def _leaf(func, x, specs: dict, pos: int):
    if isinstance(x, RaggedDTensor):
        _note(func, specs, pos, x._spec)
        return x._local_tensor
    if isinstance(x, torch.Tensor):
        _check_plain(func, x)
        return _unwrap_arg(func, x)
    if isinstance(x, (list, tuple, dict)):
        raise _Nested
    return x


def _top(func, x, specs: dict):
    if isinstance(x, (list, tuple)):
        return type(x)(_leaf(func, item, specs, i) for i, item in enumerate(x))
    return _leaf(func, x, specs, -1)


def _local(func, args, kwargs):
    """The op on the local tensors. One pass over the arguments (lists one level deep, as
    aten's schemas have them) unwraps, checks layouts and checks plain tensors together."""
    specs: dict = {}
    local_args = []
    try:
        for a in args:
            kind = type(a)
            if kind is RaggedDTensor:  # the common cases first, without the general walk
                if specs.get(-1) is not a._spec:
                    _note(func, specs, -1, a._spec)
                local_args.append(a._local_tensor)
            elif kind in _SCALARS:
                local_args.append(a)
            else:
                local_args.append(_top(func, a, specs))
        local_kwargs = {k: _top(func, v, specs) for k, v in kwargs.items()} if kwargs else {}
    except _Nested:
        return _local_nested(func, args, kwargs)
    out = func(*local_args, **local_kwargs)
    return _rewrap(func, out, args, kwargs, specs)


def _local_nested(func, args, kwargs):
    specs: dict = {}
    flat, _ = tree_flatten((args, kwargs))
    for x in flat:
        if isinstance(x, RaggedDTensor):
            _note(func, specs, -1, x._spec)
        else:
            _check_plain(func, x)
    out = func(*tree_map(lambda x: _unwrap_arg(func, x), args),
               **tree_map(lambda x: _unwrap_arg(func, x), kwargs))
    return _rewrap(func, out, args, kwargs, specs)


# what an op's schema says of its result: "void", "inplace", or "new"
_RETURNS: dict = {}


def _returns(func) -> str:
    kind = _RETURNS.get(func)
    if kind is None:
        schema = func._schema
        alias = schema.returns[0].alias_info if len(schema.returns) == 1 else None
        kind = ("void" if not schema.returns else
                "inplace" if alias is not None and alias.is_write else "new")
        _RETURNS[func] = kind
    return kind


def _rewrap(func, out, args, kwargs, specs):
    kind = _returns(func)
    if kind == "void":  # void in-place ops (_foreach_add_, _fused_adamw_)
        return None
    if kind == "inplace":
        # In-place: hand back the mutated input object, as torch does. (A non-writing
        # alias such as detach must be a new tensor, or detaching would flip the
        # parameter's own requires_grad.) An out= variant writes, and returns, its out.
        if "out" in kwargs:
            return kwargs["out"]
        return args[0] if args else kwargs["self"]
    if isinstance(out, (list, tuple)):
        foreach = func.__name__.startswith("_foreach_")
        return type(out)(
            wrap(o, _spec_at(func, specs, i if foreach else -1)) if isinstance(o, torch.Tensor) else o
            for i, o in enumerate(out)
        )
    if isinstance(out, torch.Tensor):
        return wrap(out, _spec_at(func, specs, -1))
    return out


def _spec_at(func, specs: dict, pos: int):
    spec = specs.get(pos)
    if spec is None:
        raise ValueError(
            f"ragged_fsdp: {func} returns a tensor at a position where no RaggedShard DTensor "
            "went in, so its layout is unknown; pass RaggedShard DTensors at every position"
        )
    return spec


def _bool_op(func, args, kwargs):
    a, b = args[0], args[1]
    if not (isinstance(a, RaggedDTensor) and isinstance(b, RaggedDTensor)):
        raise ValueError(f"ragged_fsdp: {func} needs two RaggedShard DTensors")
    if spec_mismatch(a._spec, b._spec) is not None:
        return False
    if func is aten.is_same_size.default:
        return True
    same = torch.tensor(int(func(a._local_tensor, b._local_tensor)), device=a._local_tensor.device)
    _all_reduce(same, dist.ReduceOp.MIN, _groups(a))
    return bool(same.item())


def _groups(t: RaggedDTensor) -> tuple:
    """The groups a global reduction of ``t`` runs over (RaggedShard and Shard mesh dims)."""
    return tuple(split_groups(t._spec))


def _all_reduce(t: torch.Tensor, op, groups) -> None:
    for g in groups:
        if dist.get_world_size(g) > 1:
            dist.all_reduce(t, op=op, group=g)


# -- GradScaler --------------------------------------------------------------------------

def _amp_unscale(args, kwargs):
    """``GradScaler.unscale_``: unscale every rank's pieces, then MAX-reduce the found-inf
    flag over each group that splits one of the gradients, so an inf on any rank skips the
    step and lowers the scale on every rank (torch's DTensor does this for its own
    placements; Replicate dims hold the same gradient, so they need no reduction)."""
    grads, found_inf, inv_scale = _amp_args(args, kwargs)
    aten._amp_foreach_non_finite_check_and_unscale_(
        [g._local_tensor if isinstance(g, DTensor) else g for g in grads], found_inf, inv_scale)
    groups, seen = [], set()
    for g in grads:
        if not isinstance(g, DTensor):
            continue
        split = _groups(g) if isinstance(g, RaggedDTensor) else tuple(
            g.device_mesh.get_group(i) for i, p in enumerate(g.placements) if not isinstance(p, Replicate))
        for group in split:
            if id(group) not in seen:  # same order on every rank: the gradients' order
                seen.add(id(group))
                groups.append(group)
    _all_reduce(found_inf, dist.ReduceOp.MAX, groups)


def _amp_args(args, kwargs):
    names = ("self", "found_inf", "inv_scale")
    vals = list(args) + [kwargs[n] for n in names[len(args):]]
    if isinstance(vals[1], DTensor) or isinstance(vals[2], DTensor):
        raise ValueError(
            "ragged_fsdp: _amp_foreach_non_finite_check_and_unscale_ takes found_inf and inv_scale "
            "as plain tensors (as torch.amp.GradScaler passes them)"
        )
    return vals


# -- random fills ------------------------------------------------------------------------

def _random(func, args, kwargs):
    """Draw the whole tensor and keep our slice: values do not depend on the world size."""
    self = args[0]
    if not isinstance(self, RaggedDTensor):
        raise ValueError(f"ragged_fsdp: {func} expects a RaggedShard DTensor as its first argument")
    local = self._local_tensor
    full = torch.empty(self.shape, dtype=local.dtype, device=local.device)
    out = func(full, *args[1:], **kwargs)
    piece = my_piece(out, self._spec)
    if func._schema.returns and func._schema.returns[0].alias_info is not None:
        with torch.no_grad():
            local.view(-1).copy_(piece)
        return self
    return wrap(piece.view(local.shape).clone(), self._spec)


# -- copy from a full tensor -------------------------------------------------------------

def _copy_from_full(dst: RaggedDTensor, src):
    if isinstance(src, DTensor):
        return _copy_from_dtensor(dst, src)
    if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(dst.shape):
        shape = tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__
        raise ValueError(
            f"ragged_fsdp: copy_ into a RaggedShard DTensor of shape {tuple(dst.shape)} from "
            f"{shape}; the source must be the full (global) tensor"
        )
    piece = my_piece(src, dst._spec).view(dst._local_tensor.shape)
    dst._local_tensor.copy_(piece)
    return dst


def _copy_from_dtensor(dst: RaggedDTensor, src: DTensor):
    """``copy_`` from one of torch's DTensors on the same mesh (state-dict hooks that build
    a full Replicate tensor, e.g. torchtitan's fused QKV): a Replicate source already holds
    the whole tensor on every rank, so we copy our slice with no communication; any other
    layout is first moved to ours (collective, as copy_ between DTensors is in torch)."""
    if src.device_mesh != dst.device_mesh:
        raise ValueError(
            f"ragged_fsdp: copy_ into a RaggedShard DTensor on {dst.device_mesh} from a DTensor "
            f"on another mesh ({src.device_mesh}); bring the source to the same mesh first"
        )
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(
            f"ragged_fsdp: copy_ into a RaggedShard DTensor of shape {tuple(dst.shape)} from a "
            f"DTensor of shape {tuple(src.shape)}; the global shapes must match"
        )
    if all(isinstance(p, Replicate) for p in src.placements):
        return _copy_from_full(dst, src._local_tensor)
    from .redistribute import redistribute

    moved = redistribute(src.detach(), dst.device_mesh, dst.placements)
    dst._local_tensor.copy_(moved._local_tensor.view(dst._local_tensor.shape))
    return dst


# -- reductions --------------------------------------------------------------------------

def _replicated(value: torch.Tensor, like: RaggedDTensor) -> DTensor:
    mesh = like._spec.mesh
    return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _reduce(func, args, kwargs):
    self = args[0]
    local = self._local_tensor
    if func in (aten.sum.dim_IntList, aten.mean.dim) or func in (aten.amax.default, aten.amin.default):
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        if dims not in (None, [], ()) and sorted(d % self.dim() for d in dims) != list(range(self.dim())):
            raise NotImplementedError(
                f"ragged_fsdp: {func} over dims {dims} of a RaggedShard DTensor; only reductions "
                "over all dims are supported. Use .full_tensor() first"
            )
        if kwargs.get("keepdim") or (len(args) > 2 and args[2]):
            raise NotImplementedError(f"ragged_fsdp: {func} with keepdim=True on a RaggedShard DTensor")
    group = _groups(self)
    name = func.__name__.split(".")[0]
    if name == "linalg_vector_norm":
        ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        dtype = kwargs.get("dtype")
        return _replicated(_norms([local], ord_, group, dtype)[0], self)
    if name in ("any", "all"):
        v = torch.tensor(int(bool(local.any() if name == "any" else local.all())), device=local.device)
        _all_reduce(v, dist.ReduceOp.MAX if name == "any" else dist.ReduceOp.MIN, group)
        return _replicated(v.bool(), self)
    if name in ("max", "min", "amax", "amin"):
        is_max = name in ("max", "amax")
        ident = float("-inf") if is_max else float("inf")
        if local.dtype.is_floating_point:
            v = local.amax() if is_max and local.numel() else local.amin() if local.numel() else torch.tensor(ident, dtype=local.dtype)
        else:
            info = torch.iinfo(local.dtype)
            v = (local.amax() if is_max else local.amin()) if local.numel() else torch.tensor(info.min if is_max else info.max, dtype=local.dtype)
        v = v.clone().to(local.device)
        _all_reduce(v, dist.ReduceOp.MAX if is_max else dist.ReduceOp.MIN, group)
        return _replicated(v, self)
    dtype = kwargs.get("dtype")
    total = local.sum(dtype=dtype) if dtype is not None else local.sum()
    if not total.dtype.is_floating_point and not total.dtype.is_complex:
        total = total.clone()
    acc = total.to(torch.float64) if total.dtype.is_floating_point else total
    _all_reduce(acc, dist.ReduceOp.SUM, group)
    total = acc.to(total.dtype)
    if name == "mean":
        total = total / self.numel()
    return _replicated(total, self)


def _norms(locals_, ord_, group, dtype=None):
    """Global vector norms of several ragged tensors with one all-reduce."""
    ord_ = float(ord_)
    device = locals_[0].device
    out_dtype = dtype or locals_[0].dtype
    if ord_ in (float("inf"), float("-inf")):
        vals = torch.stack([
            (t.abs().amax() if ord_ > 0 else t.abs().amin()).to(torch.float64) if t.numel()
            else torch.tensor(0.0 if ord_ > 0 else float("inf"), dtype=torch.float64, device=device)
            for t in locals_
        ])
        _all_reduce(vals, dist.ReduceOp.MAX if ord_ > 0 else dist.ReduceOp.MIN, group)
        return [v.to(out_dtype) for v in vals]
    if ord_ == 0:
        vals = torch.stack([(t != 0).sum().to(torch.float64) for t in locals_])
    else:
        vals = torch.stack([t.to(torch.float64).abs().pow(ord_).sum() for t in locals_])
    _all_reduce(vals, dist.ReduceOp.SUM, group)
    if ord_ != 0:
        vals = vals.pow(1.0 / ord_)
    return [v.to(out_dtype) for v in vals]


def _foreach_norm(args, kwargs):
    tensors = args[0]
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    ragged = [t for t in tensors if isinstance(t, RaggedDTensor)]
    if len(ragged) != len(tensors):
        raise ValueError("ragged_fsdp: _foreach_norm mixes RaggedShard DTensors with other tensors")
    out = []
    # One all-reduce per (group, dtype) batch.
    by_group: dict = {}
    for i, t in enumerate(tensors):
        by_group.setdefault((tuple(id(g) for g in _groups(t)), t._local_tensor.dtype), []).append(i)
    result = [None] * len(tensors)
    # Tensors on several meshes (TP/EP parameters beside plain ones): a Replicate DTensor per
    # mesh could not be stacked (clip_grad_norm_ does), so hand back plain tensors holding
    # the same global norms on every rank.
    mixed = len({id(t._spec.mesh) for t in ragged}) > 1
    for idx in by_group.values():
        vals = _norms([tensors[i]._local_tensor for i in idx], ord_, _groups(tensors[idx[0]]), dtype)
        for i, v in zip(idx, vals):
            result[i] = v if mixed else _replicated(v, tensors[i])
    out.extend(result)
    return out
