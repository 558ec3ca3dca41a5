"""The package's shape: imports flow one way (no circle), and no module grows past a screenful
of screens. Read from the source, so an import inside a function counts as much as one at the top.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mptrain"
MAX_MODULE_LINES = 400
MAX_TRAINER_LINES = 250


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path) -> set[str]:
    """The mptrain modules `path` imports, anywhere in it: `from mptrain import x` names module
    `mptrain.x` when there is one, else the package itself (which `import mptrain` names too);
    a string that is exactly a module's name is a lazy import (the package's `__getattr__`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and node.value in MODULES:
            found.add(node.value)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "mptrain"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "mptrain":
                continue
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in MODULES else node.module)
    return found


def import_graph() -> dict[str, set[str]]:
    return {name: _imports(path) - {name} for name, path in MODULES.items()}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports (`[a, b, ..., a]`), or None when the graph has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (circle := visit(nxt, [*path, nxt])):
                return circle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (circle := visit(start, [start])):
            return circle
    return None


def test_find_circle_finds_one():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_imports_flow_one_way():
    graph = import_graph()
    assert graph["mptrain"], "the package's own imports were not found"
    assert find_circle(graph) is None, " -> ".join(find_circle(graph))


@pytest.mark.parametrize("name", list(MODULES))
def test_no_module_over_400_lines(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{MODULES[name]}: {lines} lines"


def test_the_trainer_class_fits_in_250_lines():
    tree = ast.parse(MODULES["mptrain.train.trainer"].read_text())
    (trainer,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer"]
    lines = trainer.end_lineno - trainer.lineno + 1
    assert lines <= MAX_TRAINER_LINES, f"class Trainer: {lines} lines"
