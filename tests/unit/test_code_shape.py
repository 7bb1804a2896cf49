"""The package's shape, checked: imports only point down the layers, no import
cycles, and no function in kiln/ (kernels aside) over ~60 lines.

Layers, bottom to top (a module may import its own layer and those below):

    0  kiln.version, kiln.config
    1  kiln.forward_context, kiln.progress, kiln.quick_exit
    2  kiln.attention.op                      (the op model code calls)
    3  kiln.checkpoint, kiln.models           (models read checkpoints, never the reverse)
    4  kiln.compiler, kiln.graphs, kiln.attention, kiln.cache
    5  kiln.engine
    6  kiln.entrypoints, kiln (the public face), kiln.__main__
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KILN = Path(__file__).resolve().parents[2] / "kiln"

LAYERS: list[tuple[str, int]] = [  # most specific prefix first
    ("kiln.version", 0), ("kiln.config", 0),
    ("kiln.forward_context", 1), ("kiln.progress", 1), ("kiln.quick_exit", 1), ("kiln.native", 1),
    ("kiln.attention.op", 2),
    ("kiln.checkpoint", 3), ("kiln.models", 3),
    ("kiln.compiler", 4), ("kiln.graphs", 4), ("kiln.attention", 4), ("kiln.cache", 4),
    ("kiln.engine", 5),
    ("kiln.entrypoints", 6), ("kiln.__main__", 6), ("kiln", 6),
]
# same-layer imports that are not allowed
FORBIDDEN = [("kiln.checkpoint", "kiln.models")]
MAX_FUNCTION_LINES = 60
LONG_FUNCTIONS_ALLOWED = ("kiln/attention/triton_kernels.py",)  # Triton kernels read best whole


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(KILN.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> int:
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def _kiln_imports(tree: ast.AST, module: str, top_level_only: bool) -> set[str]:
    """Names of kiln modules imported (``from kiln.x import y`` counts kiln.x.y
    when that is a module, else kiln.x)."""
    nodes = tree.body if top_level_only else list(ast.walk(tree))  # type: ignore[attr-defined]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "kiln")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kiln":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    found.discard(module)
    return found


MODULES = {_module_name(p): p for p in KILN.rglob("*.py")}
TREES = {m: ast.parse(p.read_text()) for m, p in MODULES.items()}


def test_every_import_points_down_the_layers() -> None:
    bad = []
    for module, tree in TREES.items():
        for target in _kiln_imports(tree, module, top_level_only=False):
            if _layer(target) > _layer(module):
                bad.append(f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})")
            for low, high in FORBIDDEN:
                if module.startswith(low) and target.startswith(high):
                    bad.append(f"{module} imports {target}: {low} must not import {high}")
    assert not bad, "\n".join(sorted(bad))


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _package(module: str) -> str:
    return "kiln.attention.op" if module.startswith("kiln.attention.op") else ".".join(module.split(".")[:2])


def test_no_import_cycles() -> None:
    modules = {m: _kiln_imports(t, m, top_level_only=True) for m, t in TREES.items()}
    # ``kiln`` itself re-exports from below; a submodule importing ``kiln`` would loop
    assert _cycle(modules) is None, f"module import cycle: {' -> '.join(_cycle(modules) or [])}"
    packages: dict[str, set[str]] = {}
    for module, tree in TREES.items():
        for target in _kiln_imports(tree, module, top_level_only=False):
            if _package(target) != _package(module) and _package(module) != "kiln":
                packages.setdefault(_package(module), set()).add(_package(target))
    assert _cycle(packages) is None, f"package cycle: {' -> '.join(_cycle(packages) or [])}"


def test_layer_check_can_fail() -> None:
    """The checker itself: an upward import is reported."""
    tree = ast.parse("from kiln.engine.core import Engine\n")
    assert "kiln.engine.core" in _kiln_imports(tree, "kiln.models.decoder", top_level_only=False)
    assert _layer("kiln.engine.core") > _layer("kiln.models.decoder")
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


@pytest.mark.parametrize(
    "module", [m for m, p in sorted(MODULES.items()) if p.relative_to(KILN.parent).as_posix() not in LONG_FUNCTIONS_ALLOWED]
)
def test_functions_are_short(module: str) -> None:
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
        for node in ast.walk(TREES[module])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES  # type: ignore[operator]
    ]
    assert not long, f"{module}: {', '.join(long)}"
