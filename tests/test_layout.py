"""The package's layout holds: subsystem folders that say what they hold, short functions, and the
old flat module paths still importing (with a warning naming the new one)."""

import ast
import importlib
import os
import re
import warnings

import pytest

import rollout
from rollout import _moved

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_at_most_nine_top_level_modules_and_every_folder_says_what_it_holds_and_may_import():
    top = sorted(f for f in os.listdir(os.path.join(ROOT, "rollout")) if f.endswith(".py"))
    assert len(top) <= 9, top
    for name in ("engine", "scheduler", "worker", "executor", "weights", "speculative", "layers", "kernels"):
        doc = importlib.import_module(f"rollout.{name}").__doc__ or ""
        assert doc.startswith(f"{name}/:") and "May import" in doc, name


# The documented order (docs/architecture.md), bottom first: a module may import its own group and the
# groups below it, never one above. A group is a folder of rollout/ or a top-level module; "rollout" is
# the package's own __init__ (the public names), above the engine that it exports.
LEVELS = (
    {"kernels", "outputs", "random", "sampling_params", "openmp", "_moved"},
    {"config"},
    {"layers"},
    {"models", "batch"},
    {"weights", "speculative"},
    {"executor"},
    {"worker"},
    {"scheduler"},
    {"engine"},
    {"rollout"},
    {"server", "tools"},
    {"bench"},
    {"cli"},
)


def _module_name(path: str) -> str:
    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return name[:-len(".__init__")] if name.endswith(".__init__") else name


def _imports(path: str) -> set[str]:
    """The rollout modules ``path`` imports, at run time (a ``TYPE_CHECKING`` block is not), anywhere in
    the file (a function's own import included)."""
    tree = ast.parse(open(path).read())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "rollout"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "rollout":
            for a in node.names:  # a submodule imported by name, else the module itself
                sub = f"{node.module}.{a.name}"
                is_module = any(os.path.exists(os.path.join(ROOT, *sub.split("."), *tail))
                                for tail in (("__init__.py",), ())) or os.path.exists(
                    os.path.join(ROOT, *sub.split(".")) + ".py")
                found.add(sub if is_module else node.module)
    return found


def _import_graph() -> dict[str, set[str]]:
    graph = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, "rollout")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                graph[_module_name(path)] = _imports(path)
    return graph


def _group(module: str) -> str:
    parts = module.split(".")
    return "rollout" if len(parts) == 1 else parts[1]


def test_every_import_runs_down_the_documented_order():
    level = {g: i for i, groups in enumerate(LEVELS) for g in groups}
    graph = _import_graph()
    assert {_group(m) for m in graph} <= set(level), {_group(m) for m in graph} - set(level)
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                    if _group(t) != _group(m) and level[_group(t)] > level[_group(m)])
    assert upward == []


def test_no_import_circle():
    """No module reaches itself through imports (run-time ones; typing-only imports may)."""
    graph = _import_graph()
    seen, done, circles = set(), set(), []

    def visit(m, path):
        seen.add(m)
        for t in sorted(graph.get(m, ())):
            if t in path:
                circles.append(path[path.index(t):] + [t])
            elif t not in seen:
                visit(t, path + [t])
        done.add(m)

    for m in sorted(graph):
        if m not in seen:
            visit(m, [m])
    assert circles == []


def test_the_kernels_live_in_their_wing_as_real_source():
    """``layers/`` holds the TP building blocks (at most 10 files); no C++ is left in a Python string (the
    build writes only the units' glue: which files an ISA's unit includes, and the bindings' lines)."""
    assert len([f for f in os.listdir(os.path.join(ROOT, "rollout", "layers")) if f.endswith(".py")]) <= 10
    code = re.compile(r"#include <|namespace \{|\)\s*(const\s*)?\{\s*\n|;\s*\n\s*\}")
    found = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "rollout")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                found += [f"{os.path.relpath(path, ROOT)}:{node.lineno}" for node in ast.walk(ast.parse(open(path).read()))
                          if isinstance(node, ast.Constant) and isinstance(node.value, str) and code.search(node.value)]
    assert found == []
    assert os.path.exists(os.path.join(ROOT, "rollout", "kernels", "cpu", "csrc", "vec.h"))


def _long_functions(folder: str, limit: int = 80) -> list[str]:
    found = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                for node in ast.walk(ast.parse(open(path).read())):
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        lines = node.end_lineno - node.lineno + 1
                        if lines > limit:
                            found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return found


@pytest.mark.parametrize("folder", ["rollout", "trainer_bridge"])
def test_no_function_is_longer_than_eighty_lines(folder):
    assert _long_functions(folder) == []


def test_the_trainer_side_probes_no_attributes():
    """The seam is declared (trainer_bridge/serving.py): nothing in trainer_bridge/ asks an object what
    it has."""
    found = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "trainer_bridge")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                for i, line in enumerate(open(path), 1):
                    if "hasattr(" in line or "getattr(" in line:
                        found.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
    assert found == []


@pytest.mark.parametrize("old, new", sorted(_moved.MOVED.items()))
def test_an_old_module_path_is_the_new_module_with_a_deprecation_warning(old, new):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught)


def test_the_old_names_of_engine_and_scheduler_modules_forward_with_a_warning():
    from rollout.engine.engine import run_on_own_thread
    from rollout.scheduler.scheduler import Scheduler

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert rollout.engine.run_on_own_thread is run_on_own_thread
        assert rollout.scheduler.Scheduler is Scheduler
    assert sum(issubclass(w.category, DeprecationWarning) for w in caught) == 2
    with pytest.raises(AttributeError):
        rollout.scheduler.NoSuchName  # noqa: B018
    assert rollout.engine.RolloutEngine is rollout.RolloutEngine  # the package's own export: no warning
