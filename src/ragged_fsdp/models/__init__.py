"""Reference models (trainable, small) and public model shapes (for planning at full scale).

Names load on first use (PEP 562): the shapes catalog is pure Python, and ``plan`` and
``simulate`` (and their ``--help``) read it without importing torch, which the trainable
models need."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for type checkers and the API reference (mkdocstrings reads these statically)
    from .catalog import Group, ModelShapes, Tensor, get_model, group_specs, list_models, model_specs
    from .expert_parallel import apply_expert_parallel
    from .llama import Llama, LlamaConfig
    from .moe import FusedExperts, MoE, MoEConfig, MoELayer
    from .stages import LlamaStage

_PUBLIC = {
    "Llama": ".llama", "LlamaConfig": ".llama",
    "MoE": ".moe", "MoEConfig": ".moe", "MoELayer": ".moe", "FusedExperts": ".moe",
    "apply_expert_parallel": ".expert_parallel", "LlamaStage": ".stages",
    **{n: ".catalog" for n in ("Group", "ModelShapes", "Tensor", "get_model", "group_specs", "list_models",
                               "model_specs")},
}
__all__ = [
    "Llama", "LlamaConfig", "MoE", "MoEConfig", "MoELayer", "FusedExperts",
    "apply_expert_parallel", "LlamaStage",
    "Group", "ModelShapes", "Tensor", "get_model", "group_specs", "list_models", "model_specs",
]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'ragged_fsdp.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
