"""Autograd plumbing: the post-backward node on a module's inputs, and small helpers.

A group's gradients are complete when autograd has produced the gradients of the module's
*inputs* (every weight-gradient node of the module runs before that). So each forward call
passes its grad-requiring inputs through :class:`PostBackward`, an identity whose backward
tells the group one of its calls finished. Calls whose inputs need no gradient (token ids
into the root) cannot be seen this way; the root's final callback, queued on the autograd
engine, finishes those groups.
"""

from __future__ import annotations

from typing import Any

import torch

from ..torch_private import tree_flatten, tree_unflatten

__all__ = ["PostBackward", "grad_tensors", "attach_post_backward", "eager"]


def eager(fn):
    """``fn`` never traced by torch.compile (a graph break where it is called)."""
    disable = getattr(getattr(torch, "_dynamo", None), "disable", None)
    return disable(fn, recursive=True) if disable is not None else fn


def grad_tensors(obj: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(obj)
    return [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]


class PostBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, callback, *inputs: torch.Tensor):
        ctx.callback = callback
        if len(inputs) == 1:
            return inputs[0].view_as(inputs[0])
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None,) + grads


def attach_post_backward(callback, args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
    """Route the grad-requiring tensors of ``(args, kwargs)`` through one PostBackward node.
    Returns the new args/kwargs and whether a node was attached."""
    flat, spec = tree_flatten((args, kwargs))
    idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not idx:
        return args, kwargs, False
    outs = PostBackward.apply(callback, *[flat[i] for i in idx])
    if len(idx) == 1:
        outs = (outs,)
    for i, o in zip(idx, outs):
        flat[i] = o
    new_args, new_kwargs = tree_unflatten(flat, spec)
    return new_args, new_kwargs, True
