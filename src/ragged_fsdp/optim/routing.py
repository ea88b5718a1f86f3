"""Which parameters go to which optimizer, and what each optimizer needs kept whole.

Granularity policies are functions ``fn(name, param) -> spec | None`` that
``ragged_fsdp.fully_shard(module, mesh=..., granularity_fn=fn)`` asks for every parameter;
a spec is a granularity string the planner parses (``"tensor"``, ``"rows:K"``,
``"block:N"``), ``None`` means "no constraint" (element granularity):

* :func:`muon_granularity` (``Muon.granularity``): ``"tensor"`` for a 2-D matrix (Newton-Schulz
  needs the whole matrix; when the planner keeps it on one rank, that rank owns it and no byte
  moves); ``"rows:H"`` for an ``(..., H, I)`` tensor of 3+ dims (fused experts: one block per
  ``(H, I)`` matrix, the unit Muon orthogonalises); ``None`` for 0-D/1-D tensors (Muon does not
  take them). Muon works with any layout (the owner gathers what is split); the granularity
  only removes the communication.
* :func:`adamw8bit_granularity` (``AdamW8bit.granularity``): ``"block:256"`` (the quantisation
  block) for tensors with at least ``min_8bit_size`` (4096) elements, ``None`` for smaller
  ones, which keep fp32 states. AdamW8bit *requires* this: a layout that cuts a block is an error.
* :func:`combined_granularity`: the usual mix in one line — Muon's for the hidden matrices that
  :func:`muon_param_groups` routes to Muon, AdamW8bit's for the rest::

      fully_shard(block, mesh=mesh, granularity_fn=combined_granularity(model))

Routing is never guessed from names: :func:`muon_param_groups` decides by module type and
structure (``nn.Embedding`` weights, the output head and tensors with fewer than two dims go
to AdamW; the other matrices to Muon; :func:`route_params` says why for each parameter), and
the optimizers only follow ``use_muon`` flags.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable

import torch
from torch import nn

__all__ = [
    "muon_granularity", "adamw8bit_granularity", "combined_granularity", "muon_param_groups",
    "split_params", "route_params", "check_finite",
]

_log = logging.getLogger("ragged_fsdp.optim")

GranularityFn = Callable[[str, torch.Tensor], "str | None"]


def check_finite(where: str, **values) -> None:
    """Raise a ValueError naming the first hyperparameter that is not a finite number >= 0
    (coefficients named ``ns_coefficients[i]`` may be negative)."""
    for name, v in values.items():
        try:
            x = float(v.item()) if isinstance(v, torch.Tensor) else float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: {name}={v!r} is not a number; pass a finite float") from None
        if not math.isfinite(x):
            raise ValueError(f"{where}: {name}={v!r} is not finite; pass a finite float "
                             "(check the learning-rate schedule or config that produced it)")
        if x < 0 and not name.startswith("ns_coefficients"):
            raise ValueError(f"{where}: {name}={v!r} must be >= 0")


def check_int(where: str, name: str, value, minimum: int) -> int:
    """``value`` if it is an integer >= ``minimum``; a ValueError naming it otherwise. Bools are
    refused: ``True`` is an ``int`` to Python, but ``block_size=True`` is a mistake, not 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{where}: {name}={value!r} must be an integer >= {minimum}, not a "
                         f"{type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{where}: {name}={value!r} must be an integer >= {minimum}")
    return int(value)


def muon_granularity(name: str, param: torch.Tensor) -> str | None:
    """Muon's block: the whole matrix (``"tensor"``) for 2-D, one ``(H, I)`` matrix
    (``"rows:H"``) for tensors of 3+ dims, ``None`` below 2-D."""
    if param.dim() == 2:
        return "tensor"
    if param.dim() >= 3:
        return f"rows:{int(param.shape[-2])}"
    return None


def adamw8bit_granularity(block_size: int = 256, min_8bit_size: int = 4096) -> GranularityFn:
    """A policy for AdamW8bit with these settings: ``"block:<block_size>"`` for tensors of at
    least ``min_8bit_size`` elements (global size), ``None`` otherwise."""
    check_int("adamw8bit_granularity", "block_size", block_size, 1)
    check_int("adamw8bit_granularity", "min_8bit_size", min_8bit_size, 0)

    def granularity(name: str, param: torch.Tensor) -> str | None:
        return f"block:{block_size}" if param.numel() >= min_8bit_size else None

    granularity.__name__ = f"adamw8bit_granularity_{block_size}_{min_8bit_size}"
    granularity.__doc__ = (f"AdamW8bit(block_size={block_size}, min_8bit_size={min_8bit_size}) "
                           "granularity: whole quantisation blocks for 8-bit tensors")
    return granularity


def _head_params(model: nn.Module, head) -> tuple[dict[int, str], str]:
    """``({id(param): why}, how)`` for the output-head parameters (see :func:`route_params`)."""
    out: dict[int, str] = {}
    if head is not None:
        items = head if isinstance(head, (list, tuple, set)) else [head]
        mine = {id(p) for p in model.parameters()}
        for h in items:
            if isinstance(h, nn.Module):
                params = list(h.parameters())
            elif isinstance(h, torch.Tensor):
                params = [h]
            else:
                raise TypeError(f"head: expected modules or parameters, got {type(h).__name__}")
            if not params or any(id(p) not in mine for p in params):
                what = (f"a {type(h).__name__} module" if isinstance(h, nn.Module)
                        else f"a parameter of shape {tuple(h.shape)}")
                why = "has no parameters" if not params else f"is not part of this {type(model).__name__}"
                raise ValueError(
                    f"head: {what} {why} (its parameters are not among the model's), so it would route "
                    "nothing; pass this model's own output module(s), e.g. head=model.lm_head (build the "
                    "param groups from the same model object you train)")
            out.update((id(p), "head (explicit)") for p in params)
        return out, "explicit"
    embeds = [m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    emb_weights = {id(m.weight) for m in embeds}
    for m in model.modules():  # tied to an embedding: its weight is the embedding's
        if isinstance(m, nn.Linear) and id(m.weight) in emb_weights:
            out.update((id(p), "head (tied to an embedding)") for p in m.parameters())
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):  # transformers' models name their output layer
        try:
            o = get()
        except Exception:  # a model class without an output layer may raise: no head from it
            o = None
        if isinstance(o, nn.Module):
            out.update((id(p), "head (get_output_embeddings())") for p in o.parameters())
            return out, "get_output_embeddings"
    # The output layer: the last Linear outside repeated blocks (ModuleList/ModuleDict) whose
    # outputs are the vocabulary (an Embedding's size). A Linear of the same width inside a
    # block is a hidden matrix, not the head.
    inside: set[int] = set()
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            inside.update(id(sub) for sub in m.modules())
    vocab = {m.num_embeddings for m in embeds}
    candidates = [(n, m) for n, m in model.named_modules()
                  if isinstance(m, nn.Linear) and id(m) not in inside and m.out_features in vocab
                  and id(m.weight) not in out]  # a head tied to an embedding is found above
    if len(candidates) > 1:
        # Which one is the head depends on registration order, which says nothing: refuse
        # rather than send an output layer to Muon.
        listing = ", ".join(f"{n or '<root>'} ({m.in_features} -> {m.out_features})" for n, m in candidates)
        raise ValueError(
            f"muon routing: {len(candidates)} Linears outside the repeated blocks have a vocabulary-sized output "
            f"({listing}), so the output head is ambiguous; name it: head=model.{candidates[0][0] or '...'} (or "
            "head=[...] for several heads that all go to AdamW). route_params(model, head=...) shows the result")
    if candidates:
        out.update((id(p), "head (the last Linear outside repeated blocks with an Embedding's vocabulary "
                           "size as outputs)") for p in candidates[0][1].parameters())
    return out, "structure"


def route_params(model: nn.Module, head=None) -> list[tuple[str, str, str]]:
    """Where each trainable parameter goes and why: ``(name, "muon" | "adamw", reason)`` in
    ``named_parameters`` order (shared parameters once).

    AdamW: embedding weights, tensors with fewer than 2 dims, and the output head: ``head``
    (modules or parameters) when given; else a Linear tied to an Embedding's weight, plus the
    model's ``get_output_embeddings()`` when it has one (transformers), else the one
    ``nn.Linear`` outside ``ModuleList``/``ModuleDict`` blocks whose ``out_features`` is an
    Embedding's ``num_embeddings`` (two or more such Linears are ambiguous: a ValueError lists
    them; pass ``head=``). Muon: every other matrix (2-D, and stacked 3-D+ experts). Names
    never decide. ``head=`` must name modules or parameters of ``model`` (a ValueError
    otherwise: another model's module would route nothing)."""
    embeds: set[int] = set()
    for m in model.modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            embeds.update(id(p) for p in m.parameters())
    heads, _ = _head_params(model, head)
    out = []
    for name, p in model.named_parameters():  # de-duplicates shared parameters
        if not p.requires_grad:
            continue
        if id(p) in heads:
            out.append((name, "adamw", heads[id(p)]))
        elif id(p) in embeds:
            out.append((name, "adamw", "embedding"))
        elif p.dim() < 2:
            out.append((name, "adamw", f"{p.dim()}-D"))
        else:
            out.append((name, "muon", f"{p.dim()}-D matrix" if p.dim() == 2 else f"{p.dim()}-D stacked matrices"))
    return out


def split_params(model: nn.Module, head=None) -> tuple[list, list]:
    """``(muon, adamw)``: lists of ``(name, param)`` as :func:`route_params` routes them."""
    params = dict(model.named_parameters())
    muon, other = [], []
    for name, where, _ in route_params(model, head):
        (muon if where == "muon" else other).append((name, params[name]))
    return muon, other


def muon_param_groups(model: nn.Module, *, head=None, muon: dict | None = None,
                      adamw: dict | None = None) -> list[dict]:
    """The usual Muon split as param groups (named, so errors name parameters)::

        opt = Muon(muon_param_groups(model, muon={"lr": 0.02}, adamw={"lr": 3e-4}))

    ``head``: the output module(s) or parameter(s) to keep on AdamW; by default found from
    the module's structure (:func:`route_params`, which also says why each parameter went
    where). The split is logged at INFO on the ``ragged_fsdp.optim`` logger: every AdamW
    parameter with its reason, and the Muon count."""
    routes = route_params(model, head)
    m, a = split_params(model, head)
    if _log.isEnabledFor(logging.INFO):
        to_adamw = ", ".join(f"{n} ({why})" for n, where, why in routes if where == "adamw")
        _log.info("muon_param_groups: %d parameters to Muon, %d to AdamW: %s", len(m), len(a), to_adamw or "none")
    groups = []
    if m:
        groups.append({"params": m, "use_muon": True, **(muon or {})})
    if a:
        groups.append({"params": a, "use_muon": False, **(adamw or {})})
    return groups


def combined_granularity(model: nn.Module | None = None, *, head=None,
                         muon: GranularityFn = muon_granularity,
                         other: GranularityFn | None = None) -> GranularityFn:
    """One policy for a Muon + 8-bit AdamW setup: ``muon`` for the parameters that
    :func:`split_params` sends to Muon, ``other`` (default ``AdamW8bit.granularity``) for the
    rest. Build it from the unwrapped model, before the first ``fully_shard`` (parameters are
    matched by identity). Without a model (or for parameters it does not know), tensors with
    2+ dims get ``muon`` and the rest ``other``."""
    if other is None:
        other = adamw8bit_granularity()
    to_muon: set[int] = set()
    to_other: set[int] = set()
    if model is not None:
        m, a = split_params(model, head)
        to_muon = {id(p) for _, p in m}
        to_other = {id(p) for _, p in a}

    def granularity(name: str, param: torch.Tensor):
        if id(param) in to_muon:
            return muon(name, param)
        if id(param) in to_other:
            return other(name, param)
        return muon(name, param) if param.dim() >= 2 else other(name, param)

    return granularity

