"""The package's layout holds: subsystem folders that say what they hold, short functions, and the
old flat module paths still importing (with a warning naming the new one)."""

import ast
import importlib
import os
import warnings

import pytest

import rollout
from rollout import _moved

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_at_most_eight_top_level_modules_and_every_folder_says_what_it_holds_and_may_import():
    top = sorted(f for f in os.listdir(os.path.join(ROOT, "rollout")) if f.endswith(".py"))
    assert len(top) <= 8, top
    for name in ("engine", "scheduler", "worker", "executor", "weights", "speculative"):
        doc = importlib.import_module(f"rollout.{name}").__doc__ or ""
        assert doc.startswith(f"{name}/:") and "May import" in doc, name


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
