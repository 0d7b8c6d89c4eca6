"""Imports run one way: every `import` in the package (those inside functions included) goes down the layers below,
and no module reaches itself through imports. Read from the source with `ast`; nothing is imported."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("qwen35rl", "hydra_plugins", "bench")

LAYERS: Tuple[Tuple[str, ...], ...] = (
    ("qwen35rl", "qwen35rl.exit_codes", "qwen35rl.names"),  # leaves (the package's own __init__: its version)
    ("qwen35rl.config",),                            # torch-free planning
    ("qwen35rl.models", "qwen35rl.data", "qwen35rl.algo"),
    ("qwen35rl.rewards",),
    ("qwen35rl.engines",),
    ("qwen35rl.runtime",),
    ("hydra_plugins",),                              # the sweep launchers drive the runtime
    ("qwen35rl.cli",),
)
"""Bottom to top: a module may import from its own part and from any lower layer, never from its layer's other
parts nor from above. A module belongs to the most specific part that names it."""


def _modules() -> Dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts)
            out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


MODULES = _modules()


def _targets(module: str, node: ast.AST) -> List[str]:
    """The package modules an import statement names (the closest existing module of each name)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".")
            if MODULES[module].name != "__init__.py":
                parts = parts[:-1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        names = [f"{base}.{a.name}" for a in node.names]
    out = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.append(name)
    return out


def _edges() -> Dict[str, Set[str]]:
    edges: Dict[str, Set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges[module].update(_targets(module, node))
    return edges


EDGES = _edges()


def _part(module: str) -> Tuple[int, str]:
    """(layer index, part) of a module; (-1, '') for modules outside the layers (the benchmarks)."""
    found = [(len(part), i, part) for i, parts in enumerate(LAYERS) for part in parts
             if module == part or module.startswith(part + ".")]
    if found:
        _, i, part = max(found)  # the most specific part
        return i, part
    if module.startswith("qwen35rl."):
        raise AssertionError(f"{module} is in no layer: add its folder or leaf module to LAYERS")
    return -1, ""


def test_every_package_module_has_a_layer():
    for module in MODULES:
        if module.startswith("qwen35rl.") or module.startswith("hydra_plugins"):
            _part(module)


def _upward(edges: Dict[str, Set[str]]) -> List[str]:
    upward = []
    for module, targets in edges.items():
        layer, part = _part(module)
        if layer < 0:
            continue
        for target in targets:
            t_layer, t_part = _part(target)
            if t_layer < 0 or t_layer > layer or (t_layer == layer and t_part != part):
                upward.append(f"{module} -> {target}")
    return sorted(upward)


def test_imports_go_down_the_layers():
    upward = _upward(EDGES)
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_an_import_up_or_sideways_is_found():
    assert _upward({"qwen35rl.config.rules": {"qwen35rl.data.prepare", "qwen35rl.names"},
                    "qwen35rl.data.loader": {"qwen35rl.models.build", "qwen35rl.config.schema"},
                    "qwen35rl.runtime.worker": {"qwen35rl.engines.base", "qwen35rl.algo.core"}}) == \
        ["qwen35rl.config.rules -> qwen35rl.data.prepare", "qwen35rl.data.loader -> qwen35rl.models.build"]


def _cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_module_reaches_itself_through_imports():
    assert _cycles(EDGES) == []


@pytest.mark.parametrize("edges, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set(), "c": {"b"}}, []),
])
def test_the_cycle_finder_finds_cycles(edges, expected):
    assert _cycles(edges) == expected
