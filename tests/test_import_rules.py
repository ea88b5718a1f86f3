"""The package's import graph: no cycles, and the pure layers stay pure.

Read from the source (``ast``), so function-level imports count as much as top-level ones,
and importing a module counts as importing its parent packages' ``__init__`` (Python runs
them first), except the root ``ragged_fsdp/__init__.py``, which loads everything.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Import cycles accepted between ragged_fsdp modules (each as the set of its modules). There are
# none; a new cycle fails the test, and so does a listed one that is gone (remove it here).
KNOWN_CYCLES: set[frozenset[str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "ragged_fsdp").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imports(name: str) -> tuple[set[str], set[str]]:
    """(ragged_fsdp modules, other top-level imports as dotted names) of one module."""
    path = MODULES[name]
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    ours, other = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for t in targets:
            if not t.startswith("ragged_fsdp"):
                other.add(t)
                continue
            while t not in MODULES and "." in t:
                t = t.rpartition(".")[0]
            if t != name:
                ours.add(t)
    return ours, other


GRAPH = {m: _imports(m) for m in MODULES}


def _loads(name: str) -> set[str]:
    """Every ragged_fsdp module importing ``name`` runs (itself included)."""
    seen, todo = set(), [name]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parent = m.rpartition(".")[0]
        if parent and parent != "ragged_fsdp":
            todo.append(parent)
        todo.extend(GRAPH[m][0])
    return seen


def _cycles() -> set[frozenset[str]]:
    index, low, stack, on, out = {}, {}, [], set(), set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v][0]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.add(frozenset(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_no_new_import_cycles():
    found = _cycles()
    assert found <= KNOWN_CYCLES, f"new import cycles: {[sorted(c) for c in found - KNOWN_CYCLES]}"
    assert KNOWN_CYCLES <= found, f"gone (remove from KNOWN_CYCLES): {[sorted(c) for c in KNOWN_CYCLES - found]}"


PURE = ["ragged_fsdp.planner." + p.stem for p in (SRC / "ragged_fsdp" / "planner").glob("*.py") if p.stem != "__init__"]
PURE += ["ragged_fsdp.planner", "ragged_fsdp.dbuffer.layout", "ragged_fsdp.ragged_units", "ragged_fsdp.run_counts", "ragged_fsdp.shapes"]
FORBIDDEN = ("ragged_fsdp.placement", "ragged_fsdp.comm", "ragged_fsdp.fsdp")


def test_pure_layers_import_no_distributed_code():
    assert len(PURE) > 10
    for name in PURE:
        loads = _loads(name)
        bad = sorted(m for m in loads if m.startswith(FORBIDDEN))
        assert not bad, f"{name} loads {bad}"
        dist = sorted((m, t) for m in loads for t in GRAPH[m][1] if t.startswith("torch.distributed"))
        assert not dist, f"{name} loads torch.distributed via {dist}"


def test_the_rules_can_fail():
    """The checks see a violation where there is one (the engine imports the placement)."""
    assert any(m.startswith("ragged_fsdp.placement") for m in _loads("ragged_fsdp.fsdp.core.build"))
    assert any(t.startswith("torch.distributed") for t in GRAPH["ragged_fsdp.comm"][1])


# -- layers: imports point down (the order is declared once, in tests/_layers.py) ---------------

from _layers import ALLOWED_UPWARD, FSDP_LAYERS, LAYERS, describe, layer_of, order  # noqa: E402


def _upward(graph) -> list[tuple[str, str]]:
    """Every (importer, imported) pair of ``graph`` whose import points to a higher layer."""
    out = []
    for m, (ours, _) in graph.items():
        for t in ours:
            (a, a_sub), (b, b_sub) = layer_of(m), layer_of(t)
            if a < b or (a == b and a_sub is not None and b_sub is not None and a_sub < b_sub):
                out.append((m, t))
    return sorted(out)


def test_every_module_has_a_declared_layer():
    missing = sorted(m for m in MODULES if None in layer_of(m)[: 2 if m.startswith("ragged_fsdp.fsdp") else 1])
    assert not missing, f"modules in no layer of tests/_layers.py (add their package there): {missing}"


def test_imports_point_down_the_declared_layers():
    bad = [(m, t) for m, t in _upward(GRAPH) if (m, t) not in ALLOWED_UPWARD]
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(
        f"  {m} ({describe(m)}) imports {t} ({describe(t)})" for m, t in bad) + f"\ndeclared order, lowest first: {order()}"
    gone = sorted(ALLOWED_UPWARD - set(_upward(GRAPH)))
    assert not gone, f"no longer imported (remove from ALLOWED_UPWARD in tests/_layers.py): {gone}"


def test_the_layer_rule_can_fail():
    """A core module imported from comms, the trace imported from the private-torch seam, and
    the engine imported from the planner, are caught (function-level imports are in GRAPH like
    the others: ast sees every import statement)."""
    fake = {"ragged_fsdp.fsdp.comms.device": ({"ragged_fsdp.fsdp.core.unit"}, set()),
            "ragged_fsdp.fsdp.torch_private": ({"ragged_fsdp.fsdp.tracing"}, set()),
            "ragged_fsdp.planner.plan": ({"ragged_fsdp.fsdp.api"}, set()),
            "ragged_fsdp.fsdp.core.unit": ({"ragged_fsdp.fsdp.comms.device", "ragged_fsdp.fsdp.torch_private",
                                            "ragged_fsdp.placement"}, set())}
    assert _upward(fake) == [("ragged_fsdp.fsdp.comms.device", "ragged_fsdp.fsdp.core.unit"),
                             ("ragged_fsdp.fsdp.torch_private", "ragged_fsdp.fsdp.tracing"),
                             ("ragged_fsdp.planner.plan", "ragged_fsdp.fsdp.api")]
    assert [n for n, _ in FSDP_LAYERS][:3] == ["private", "tracing", "comms"] and LAYERS[0][0] == "pure"


# -- the engine's front door: outside fsdp/, only ``ragged_fsdp.fsdp`` itself is imported -------

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
FRONT = "ragged_fsdp.fsdp"


def _past_the_door(importer: str, targets) -> list[tuple[str, str]]:
    return sorted((importer, t) for t in targets if t.startswith(FRONT + "."))


def _benchmark_imports(source: str) -> set[str]:
    """The ragged_fsdp modules a script imports (absolute imports: benchmarks are scripts)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                    for a in node.names}
    return {t for t in out if t.startswith("ragged_fsdp")}


def _front_door_violations(graph, scripts: dict[str, set[str]]) -> list[tuple[str, str]]:
    bad = []
    for m, (ours, _) in graph.items():
        if m != FRONT and not m.startswith(FRONT + "."):
            bad += _past_the_door(m, ours)
    for name, targets in scripts.items():
        bad += _past_the_door(name, targets)
    return sorted(bad)


def test_outside_the_engine_only_its_front_door_is_imported():
    scripts = {f"benchmarks/{p.name}": _benchmark_imports(p.read_text()) for p in sorted(BENCHMARKS.glob("*.py"))}
    assert len(scripts) > 20
    bad = _front_door_violations(GRAPH, scripts)
    assert not bad, ("imports of the engine's insides from outside fsdp/ (import them from ragged_fsdp.fsdp, "
                     "exporting them there, or use its public probe ragged_fsdp.fsdp.probe):\n"
                     + "\n".join(f"  {m} imports {t}" for m, t in bad))


def test_the_front_door_rule_can_fail():
    fake = {"ragged_fsdp.optim.adamw": ({"ragged_fsdp.fsdp.offload.staging", "ragged_fsdp.fsdp"}, set()),
            "ragged_fsdp.fsdp.api": ({"ragged_fsdp.fsdp.core.init"}, set())}
    scripts = {"benchmarks/x.py": _benchmark_imports("from ragged_fsdp.fsdp.core import reduction\n"
                                                         "from ragged_fsdp.fsdp import probe\n")}
    assert _front_door_violations(fake, scripts) == [("benchmarks/x.py", "ragged_fsdp.fsdp.core.reduction"),
                                                     ("ragged_fsdp.optim.adamw", "ragged_fsdp.fsdp.offload.staging")]

