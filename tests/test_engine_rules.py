"""Two claims docs/architecture.md makes about the engine (``src/ragged_fsdp/fsdp/``), kept by
reading its source (``ast``; no process group, a second or two):

* **Private torch behind one seam.** No engine module but ``fsdp/torch_private.py`` imports a
  private torch module or reaches a private name by a dotted torch path (``torch._C``,
  ``torch.utils._pytree``, ``Variable._execution_engine``); the seam re-exports what the
  engine needs. The private *attributes* of torch objects the engine reads or writes
  (a DTensor's ``_local_tensor``, ...) are listed below: a new one fails until it is listed
  here and in the seam's docstring, or moved into the seam.
* **One writer per field.** A field of an engine class (an attribute its methods assign on
  ``self``, or a declared class field) is assigned only in the module that defines the class;
  other modules call that class's methods. Attribute names that torch's ``Tensor`` and
  ``nn.Module`` also have (``grad``, ``data``, ...) are left out: the source does not say
  whose they are.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

ENGINE = Path(__file__).resolve().parents[1] / "src" / "ragged_fsdp" / "fsdp"
SEAM = "torch_private.py"

# Private attributes of torch objects the engine uses outside the seam, and why each is kept.
ALLOWED_PRIVATE_ATTRS = {
    "_local_tensor": "a DTensor's local tensor, re-pointed at a DBuffer view (to_local() makes a new view)",
    "_spec": "a DTensor's spec, compared and rebuilt with the sharded parameter",
    "_version": "read before a collective writes a saved tensor (set back by the seam's set_version_counter)",
    "_apply": "nn.Module._apply, which .to()/.cuda() call: overridden to re-point sharded parameters",
    "_register_load_state_dict_pre_hook": "the residual state and re-pointing at load",
    "_get_root_mesh": "a sub-mesh's root, to build HSDP's dims from the user's mesh",
}

# (module under fsdp/, attribute) assigned outside its class's module; remove an entry when it goes.
KNOWN_SECOND_WRITERS = {
    ("core/reduction.py", "done"),  # Fold.done (core/global_order.py): global_order's fold is being reworked
}


def _private(parts) -> bool:
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts)


def private_torch_paths(source: str) -> set[str]:
    """Dotted torch paths with a private part that ``source`` imports or reaches."""
    tree = ast.parse(source)
    aliases, out = {}, set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split(".")[0] == "torch":
                    aliases[a.asname or "torch"] = a.name if a.asname else "torch"
                    if _private(a.name.split(".")):
                        out.add(a.name)
        elif isinstance(n, ast.ImportFrom) and n.module and not n.level and n.module.split(".")[0] == "torch":
            for a in n.names:
                full = f"{n.module}.{a.name}"
                aliases[a.asname or a.name] = full
                if _private(full.split(".")):
                    out.add(full)
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute):
            chain, x = [], n
            while isinstance(x, ast.Attribute):
                chain.append(x.attr)
                x = x.value
            if isinstance(x, ast.Name) and x.id in aliases and _private(chain):
                out.add(".".join([aliases[x.id], *reversed(chain)]))
    return out


def _torch_private_attrs() -> set[str]:
    names = set()
    for cls in (torch.Tensor, DTensor, nn.Module, nn.Parameter, DeviceMesh, torch.UntypedStorage,
                torch.autograd.Function, dist.ProcessGroup, torch.optim.Optimizer):
        names |= {n for n in dir(cls) if n.startswith("_") and not n.startswith("__")}
    return names


def _engine_sources() -> dict[str, str]:
    return {str(p.relative_to(ENGINE)): p.read_text() for p in sorted(ENGINE.rglob("*.py"))}


def test_private_torch_paths_only_in_the_seam():
    found = {m: sorted(private_torch_paths(src)) for m, src in _engine_sources().items() if m != SEAM}
    bad = {m: v for m, v in found.items() if v}
    assert not bad, f"private torch module paths outside fsdp/{SEAM} (add a function there): {bad}"
    assert private_torch_paths(_engine_sources()[SEAM]), "the seam's own private calls are seen"


def test_private_torch_attributes_are_the_listed_ones():
    torch_private = _torch_private_attrs()
    used = defaultdict(set)
    for m, src in _engine_sources().items():
        if m == SEAM:
            continue
        for n in ast.walk(ast.parse(src)):
            if isinstance(n, ast.Attribute) and n.attr in torch_private:
                used[n.attr].add(m)
    new = {a: sorted(ms) for a, ms in used.items() if a not in ALLOWED_PRIVATE_ATTRS}
    assert not new, f"private attributes of torch objects used by the engine, not listed (move them into the seam, or list them with the reason): {new}"
    gone = sorted(set(ALLOWED_PRIVATE_ATTRS) - set(used))
    assert not gone, f"listed but no longer used (remove from ALLOWED_PRIVATE_ATTRS): {gone}"


def test_the_private_torch_rule_can_fail():
    src = ("import torch\nfrom torch.utils._pytree import tree_map\nfrom torch.autograd import Variable\n"
           "def f():\n    torch._C._current_graph_task_id()\n    torch.distributed.all_reduce\n")
    assert private_torch_paths(src) == {"torch.utils._pytree.tree_map", "torch._C", "torch._C._current_graph_task_id"}


def _assigned(node) -> list[ast.Attribute]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
        node, (ast.AugAssign, ast.AnnAssign)) else []
    out = []
    for t in targets:
        out += [x for x in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(x, ast.Attribute)]
    return out


def second_writers(sources: dict[str, str], shared: set[str]) -> set[tuple[str, str]]:
    """(module, attribute) pairs where a module assigns a field of a class defined elsewhere."""
    owners = defaultdict(set)
    trees = {m: ast.parse(src) for m, src in sources.items()}
    for m, tree in trees.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for n in cls.body:
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                    owners[n.target.id].add(m)
            for n in ast.walk(cls):
                for x in _assigned(n):
                    if isinstance(x.value, ast.Name) and x.value.id == "self":
                        owners[x.attr].add(m)
    out = set()
    for m, tree in trees.items():
        for n in ast.walk(tree):
            for x in _assigned(n):
                if isinstance(x.value, ast.Name) and x.value.id in ("self", "cls"):
                    continue
                if x.attr in owners and m not in owners[x.attr] and x.attr not in shared:
                    out.add((m, x.attr))
    return out


SHARED = set(dir(torch.Tensor)) | set(dir(nn.Module))


def test_one_writer_per_field():
    found = second_writers(_engine_sources(), SHARED)
    new = sorted(found - KNOWN_SECOND_WRITERS)
    assert not new, f"fields of an engine class assigned outside its module (give the class a method): {new}"
    gone = sorted(KNOWN_SECOND_WRITERS - found)
    assert not gone, f"no longer a second writer (remove from KNOWN_SECOND_WRITERS): {gone}"


def test_the_writer_rule_can_fail():
    sources = {"a.py": "class Fold:\n    done: int = 0\n    def step(self):\n        self.done += 1\n",
               "b.py": "def f(fold, t):\n    fold.done += 1\n    t.grad = None\n    fold.step()\n"}
    assert second_writers(sources, SHARED) == {("b.py", "done")}


def _members(cls) -> set[str]:
    """A class's attributes and the fields its ``__init__`` assigns on ``self``."""
    import inspect
    import textwrap

    names = {n for k in cls.__mro__ for n in vars(k)}
    for k in cls.__mro__:
        init = vars(k).get("__init__")
        if init is not None and hasattr(init, "__code__"):
            for n in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(init)))):
                for x in _assigned(n):
                    if isinstance(x.value, ast.Name) and x.value.id == "self":
                        names.add(x.attr)
    return names


def test_both_unit_stores_satisfy_the_protocol():
    """The engine reads a unit's ``buf`` through ragged_fsdp.dbuffer.UnitStore: DBuffer and the
    subclass store both have every member it names."""
    from ragged_fsdp.dbuffer import DBuffer, UnitStore
    from ragged_fsdp.fsdp.core.subclass_unit import SubclassStore

    wanted = {n for k in UnitStore.__mro__ if k not in (object,) and k.__module__ == UnitStore.__module__
              for n in list(vars(k)) + list(getattr(k, "__annotations__", {})) if not n.startswith("_")}
    assert {"layout", "alloc_grad", "segment", "rebuild"} <= wanted
    for cls in (DBuffer, SubclassStore):
        missing = sorted(wanted - _members(cls))
        assert not missing, f"{cls.__name__} lacks {missing} of UnitStore"
