"""The project's imports point down: every module imports only from its own layer or the layers below (`LAYERS`), no
cycle between modules, and the library imports neither Ray nor the pipelines when it is imported."""

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


# Lowest first. A module belongs to the layer of the longest prefix that names it; it may import from its own layer
# and the layers below, never above.
LAYERS: tuple[tuple[str, ...], ...] = (
    # rules every module shares: value checks, candidates and B*, files, the home folder, option fields
    ("blockpilot.checks", "blockpilot.blocks", "blockpilot.files", "blockpilot.home", "blockpilot.options"),
    # data and models: label schema and sources, MLflow calls, the cost curve and the load curve, the models, the policy
    # contract, the draft tree's shape (pure: the tables build trees as the engine does)
    (
        "blockpilot.data",
        "blockpilot.tracking",
        "blockpilot.cost",
        "blockpilot.load_curve",
        "blockpilot.models",
        "blockpilot.policies",
        "blockpilot.tree",
    ),
    # acceptance tables and what is learned and measured on them
    ("blockpilot.table", "blockpilot.walks", "blockpilot.scoring", "blockpilot.predictor"),
    # the policy families and their resolver
    tuple(f"blockpilot.policies.{family}" for family in ("fixed", "learned", "step", "confidence", "trim", "resolve")),
    # the engine and what drives it
    ("blockpilot.decoding", "blockpilot.sweep"),
    # jobs over the engine
    ("blockpilot.labeling", "blockpilot.serving", "blockpilot.zoo"),
    ("pipelines",),
    ("blockpilot.cli", "blockpilot.__main__"),
)
ROOT_PACKAGE = "blockpilot"  # its __init__ holds the version only: below everything


def layer_of(module: str) -> int:
    if module == ROOT_PACKAGE:
        return 0
    matches = [
        (len(prefix), index)
        for index, layer in enumerate(LAYERS)
        for prefix in layer
        if module == prefix or module.startswith(prefix + ".")
    ]
    if not matches:
        raise AssertionError(f"{module} is in no layer of tests/test_layout.py: place it")
    return max(matches)[1]


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} -> {target}"
        for module, targets in edges.items()
        for target in targets
        if layer_of(target) > layer_of(module)
    )


def test_every_import_points_down_the_layers():
    edges, _ = import_graph()
    assert upward_imports(edges) == []


def test_an_upward_import_is_found():
    edges = {"blockpilot.table": {"blockpilot.decoding.engine"}, "blockpilot.decoding.engine": {"blockpilot.table"}}
    assert upward_imports(edges) == ["blockpilot.table -> blockpilot.decoding.engine"]
    assert layer_of("blockpilot.policies.base") < layer_of("blockpilot.policies.step") < layer_of("blockpilot.decoding")


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
