"""The layers of ``ragged_fsdp``, lowest first: declared once, here.

A module may import modules of its own layer and of the layers below it, never of a layer
above (``tests/test_import_rules.py`` checks every import, function-level ones included, and
``tests/test_docs_pages.py`` checks that ``docs/architecture.md`` names every module in its
layer). Each layer is ``(name, members)``; a member is the first path component under its
package (a module ``x.py`` or a sub-package ``x/``; ``__init__`` is the package's own
``__init__.py``).
"""

from __future__ import annotations

PACKAGE = "ragged_fsdp"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("pure", ("shapes", "run_counts", "ragged_units")),  # integers and shapes, no torch.distributed
    ("planner", ("planner",)),
    ("dbuffer", ("dbuffer",)),
    ("comm", ("comm", "agreement")),  # collectives, and the one "every rank agrees, or every rank raises" protocol
    ("placement", ("placement",)),
    ("quant", ("quant",)),
    ("fsdp", ("fsdp",)),  # its own order: FSDP_LAYERS
    ("package", ("exit", "__init__")),  # the public names of ``import ragged_fsdp`` and the exit hook
    ("optim", ("optim",)),
    ("checkpoint", ("checkpoint",)),
    ("models", ("data", "models", "train")),
    ("integrations", ("integrations",)),
    ("bench", ("bench",)),
    ("sim", ("sim",)),
    ("cli", ("cli", "__main__")),
]

# Inside ragged_fsdp/fsdp/, lowest first.
FSDP_LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("private", ("torch_private",)),  # every private torch call of the engine, one function each
    ("tracing", ("tracing",)),  # the public record of a step: every layer above records into it
    ("comms", ("comms",)),  # the device seam, the collectives and the user's comm-hook records
    ("compat", ("compat",)),  # torch FSDP2's contracts, typed by protocols: nothing of core imported
    ("core", ("core",)),  # the life of one fully_shard call: groups, units, backward, reductions
    ("offload", ("offload",)),  # host memory: handed to units, and the whole-model phase switch
    ("api", ("api", "deterministic", "micro_rng", "__init__")),  # what users call
]

# Imports against the order that exist today, each (importer, imported). Remove an entry when
# its import goes: the test fails on a listed edge that no longer exists.
ALLOWED_UPWARD: set[tuple[str, str]] = set()


def _index(layers, member: str) -> int | None:
    for i, (_, members) in enumerate(layers):
        if member in members:
            return i
    return None


def layer_of(module: str) -> tuple[int | None, int | None]:
    """(index in LAYERS, index in FSDP_LAYERS or None) of a dotted module name; an index is
    None when the module's member is not declared."""
    parts = module.split(".")[1:] or ["__init__"]
    top = _index(LAYERS, parts[0])
    if parts[0] != "fsdp":
        return top, None
    return top, _index(FSDP_LAYERS, parts[1] if len(parts) > 1 else "__init__")


def describe(module: str) -> str:
    top, sub = layer_of(module)
    name = LAYERS[top][0] if top is not None else "?"
    return f"{name}/{FSDP_LAYERS[sub][0]}" if sub is not None else name


def order() -> str:
    return (" < ".join(n for n, _ in LAYERS) + "; inside fsdp: " + " < ".join(n for n, _ in FSDP_LAYERS))
