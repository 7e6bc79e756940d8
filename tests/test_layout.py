"""The project's imports point down: no cycle between its modules; the library imports neither Ray nor the
pipelines when it is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGES = ("blockpilot", "pipelines")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def imported_names(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, bool]]:
    """(imported module, at module level?) for every import in `tree`, relative ones made absolute."""
    top_level = {id(node) for node in getattr(tree, "body", [])}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from package import name` may import the submodule `package.name`.
            found += [(f"{base}.{alias.name}", id(node) in top_level) for alias in node.names]
            found.append((base, id(node) in top_level))
    return found


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(project edges, third-party and pipeline imports made at module level) per project module."""
    modules = project_modules()
    edges: dict[str, set[str]] = {name: set() for name in modules}
    top_level: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for imported, at_top in imported_names(tree, name, path.name == "__init__.py"):
            if at_top:
                top_level[name].add(imported)
            # Importing `a.b.c` first runs the packages `a` and `a.b`: their __init__ imports count too.
            parts = imported.split(".")
            for target in (".".join(parts[:k]) for k in range(1, len(parts) + 1)):
                if target in modules and target != name and not name.startswith(target + "."):
                    edges[name].add(target)
    return edges, top_level


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for successor in sorted(edges[node]):
            if state.get(successor) == "open":
                return stack[stack.index(successor) :] + [successor]
            if successor not in state and (cycle := visit(successor)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_between_project_modules():
    edges, _ = import_graph()
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_library_imports_neither_ray_nor_the_pipelines_at_module_level():
    _, top_level = import_graph()
    offending = {
        module: sorted(i for i in imports if i.split(".")[0] in ("ray", "pipelines"))
        for module, imports in top_level.items()
        if module.startswith("blockpilot")
    }
    assert {module: found for module, found in offending.items() if found} == {}


def test_the_pipelines_never_import_the_command_line():
    edges, _ = import_graph()
    assert {module for module, targets in edges.items() if module.startswith("pipelines") and "blockpilot.cli" in targets} == set()


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import ray\n", {("ray", True)}),
        ("def f():\n    from pipelines import label\n", {("pipelines.label", False), ("pipelines", False)}),
        ("from . import cache\n", {("blockpilot.decoding.cache", True), ("blockpilot.decoding", True)}),
    ],
)
def test_the_reader_sees_imports_where_they_are(source, expected):
    assert set(imported_names(ast.parse(source), "blockpilot.decoding.engine", False)) == expected


def test_a_cycle_is_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
