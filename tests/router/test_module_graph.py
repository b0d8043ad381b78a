"""The router's modules import each other without cycles: each part can be read, and tested,
without the ones that use it (the cluster's parts used to import back from ``cluster.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROUTER = Path(__file__).resolve().parents[2] / "router"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROUTER.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _router_imports(path: Path, known: set[str]) -> set[str]:
    """The router modules ``path`` imports, in the module body or in functions, but not under
    ``if TYPE_CHECKING:`` (those never run)."""
    imported: set[str] = set()
    tree = ast.parse(path.read_text())
    checking_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test).endswith("TYPE_CHECKING")
        for statement in block.body
        for node in ast.walk(statement)
    }
    for node in ast.walk(tree):
        if id(node) in checking_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        imported.update(name for name in names if name in known)
    return imported


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path of modules, or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return stack[stack.index(target) :] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[module] = "done"
        stack.pop()
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_router_modules_import_each_other_without_cycles() -> None:
    paths = {_module_name(path): path for path in ROUTER.rglob("*.py")}
    known = set(paths)
    graph = {
        module: _router_imports(path, known) - {module} - _packages_of(module)
        for module, path in paths.items()
    }
    assert len(graph) > 40
    assert "router.placements" in graph["router.cluster"]  # (the graph is read at all)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def _packages_of(module: str) -> set[str]:
    """A module's enclosing packages: importing a submodule runs them, no cycle of its own."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_a_cycle_is_found() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
