"""The package's shape: its sub-packages in layers whose imports flow one way (down, never in a
circle), and a flag on a module long enough to hold two ideas. Read from the source, so an
import inside a function counts as much as one at the top.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mptrain"
# A module is as long as its one concept needs: past this many lines it is flagged, and goes on
# only where `LONG` says why it is still one concept (never split to fit a number).
FLAG_LINES = 500
LONG: dict[str, str] = {}
MAX_TRAINER_LINES = 300  # the Trainer's hooks and drivers read as the recipe of a run


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path) -> set[str]:
    """The mptrain modules `path` imports, anywhere in it: `from mptrain import x` names module
    `mptrain.x` when there is one, else the package itself (which `import mptrain` names too);
    a dotted string that is exactly a module's name is a lazy import (the package's
    `__getattr__`); "mptrain" alone is a word (a cache folder's name), not an import."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and node.value in MODULES and "." in node.value:
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


# From the command lines down to the base modules (docs/design.md): a module imports its own
# group (sub-package, or itself at the top), its layer's others, and the layers below it.
LAYERS = (
    (
        "mptrain",
        "mptrain.main",
        "mptrain.export",
        "mptrain.profile",
        "mptrain.plan",
        "mptrain.generate",
    ),
    ("mptrain.train",),
    ("mptrain.record", "mptrain.hf"),
    ("mptrain.inspect",),
    ("mptrain.config", "mptrain.unused"),
    ("mptrain.data",),
    ("mptrain.models",),
    ("mptrain.recipe",),
    ("mptrain.optim",),
    ("mptrain.parallel",),
    ("mptrain.runtime", "mptrain.preemption", "mptrain.target", "mptrain.registry"),
    ("mptrain.mirror",),
    (
        "mptrain.files",
        "mptrain.errors",
        "mptrain.version",
        "mptrain.dtypes",
        "mptrain.hub",
        "mptrain.buckets",
    ),
)
LEVEL = {group: level for level, groups in enumerate(LAYERS) for group in groups}


def group_of(module: str) -> str:
    """`mptrain.train.loop` -> `mptrain.train`; a top-level module is its own group."""
    return ".".join(module.split(".")[:2])


def test_every_module_has_a_layer():
    """A new module at the top, or a new sub-package, takes a place in LAYERS first."""
    assert not sorted({group_of(m) for m in MODULES} - set(LEVEL))


def test_imports_go_down_the_layers():
    graph = import_graph()
    upward = [
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if LEVEL.get(group_of(b), 0) < LEVEL.get(group_of(a), 0)
    ]
    assert not upward, upward
    groups: dict[str, set[str]] = {}
    for a, targets in graph.items():
        groups.setdefault(group_of(a), set()).update(group_of(b) for b in targets)
    groups = {g: targets - {g} for g, targets in groups.items()}
    assert find_circle(groups) is None, " -> ".join(find_circle(groups))


def test_no_package_name_is_also_one_of_its_modules():
    """`mptrain.plan.fit` is a function: a module `plan/fit.py` would replace it on the package
    the moment something imported the module (and `mptrain.run`, the function, rules out a
    package `run/`)."""
    clashes = []
    for name, path in MODULES.items():
        if path.name != "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)}  # fmt: skip
        if name == "mptrain":  # the lazily loaded public names
            defined |= set(ast.literal_eval(_assigned(tree, "_WHERE")))
        clashes += [f"{name}.{m}" for m in defined if f"{name}.{m}" in MODULES]
    assert not clashes


def _assigned(tree: ast.Module, target: str) -> ast.expr:
    return next(
        n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == target
    )


def test_find_circle_finds_one():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_imports_flow_one_way():
    graph = import_graph()
    assert graph["mptrain"], "the package's own imports were not found"
    assert find_circle(graph) is None, " -> ".join(find_circle(graph))


def test_a_module_past_the_flag_says_why_it_is_one_concept():
    long = {
        name: n
        for name, path in MODULES.items()
        if (n := len(path.read_text().splitlines())) > FLAG_LINES
    }
    assert set(long) <= set(LONG), {n: long[n] for n in sorted(set(long) - set(LONG))}
    assert set(LONG) <= set(long), f"no longer past {FLAG_LINES} lines: {set(LONG) - set(long)}"


def test_the_trainer_class_reads_in_one_sitting():
    tree = ast.parse(MODULES["mptrain.train.trainer"].read_text())
    (trainer,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer"]
    lines = trainer.end_lineno - trainer.lineno + 1
    assert lines <= MAX_TRAINER_LINES, f"class Trainer: {lines} lines"


@pytest.mark.parametrize(
    "module", ["mptrain.main", "mptrain.plan", "mptrain.export", "mptrain.profile"]
)
def test_each_command_line_still_runs_from_its_old_name(module):
    """The sub-packages moved the code, not the commands: `python -m X --help` answers for each."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    argv = [sys.executable, "-m", module, "--help"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"usage: python -m {module}" in done.stdout


def test_the_names_outside_code_imports_still_import():
    """`from mptrain import X` for the modules outside code names, and the package's public
    names, from their sub-packages; the old dotted paths of moved modules do not import."""
    import importlib

    import mptrain

    names = ("precision", "loss_scale", "train_state", "step", "optim", "config", "errors")
    for name in (*names, "hf", "export", "plan", "sharding", "audit", "numerics"):
        found: dict = {}
        exec(f"from mptrain import {name}", found)  # as outside code writes it
        assert found[name].__name__.startswith("mptrain.") and found[name].__file__, name
    assert mptrain.precision.__name__ == "mptrain.recipe.precision"
    assert mptrain.Trainer.__module__ == "mptrain.train.trainer"
    assert callable(mptrain.plan.plan) and callable(mptrain.plan.fit)
    for name in mptrain.__all__:
        assert getattr(mptrain, name) is not None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("mptrain.precision")


def test_the_tests_mirror_the_sub_packages():
    """tests/<name>/ holds the tests of mptrain/<name>/ (tests/hf/fixture is the HF test folder);
    the tests of the top-level modules, the configs, docs and scripts sit in tests/ itself. Test
    modules are imported by their file name, so no two may share one."""
    tests = Path(__file__).resolve().parent
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert folders <= packages, sorted(folders - packages)
    names = [p.name for p in tests.rglob("*.py") if "fixture" not in p.parts]
    assert len(names) - names.count("conftest.py") == len(set(names) - {"conftest.py"})
