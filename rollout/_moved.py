"""Old import paths of modules that moved into subsystem folders: they keep working, with a
``DeprecationWarning`` naming the new path (no file is left at the old one)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "rollout.engine_loop": "rollout.engine.loop", "rollout.admission": "rollout.engine.admission",
    "rollout.engine_weights": "rollout.engine.weights", "rollout.tokenizer": "rollout.engine.tokenizer",
    "rollout.block_manager": "rollout.scheduler.block_manager", "rollout.request": "rollout.scheduler.request",
    "rollout.scheduler.batch": "rollout.batch",
    "rollout.tp_worker": "rollout.worker.tp_worker", "rollout.tp_group": "rollout.worker.tp_group",
    "rollout.tp_external": "rollout.worker.tp_external", "rollout.messages": "rollout.worker.messages",
    "rollout.model_runner": "rollout.executor.model_runner",
    "rollout.cuda_graph_runner": "rollout.executor.cuda_graph_runner",
    "rollout.rank_weights": "rollout.worker.rank_weights",
    "rollout.weights.rank_weights": "rollout.worker.rank_weights", "rollout.loader": "rollout.weights.loader",
    "rollout.safetensors_io": "rollout.weights.safetensors_io",
    "rollout.layers.cpu_capability": "rollout.kernels.cpu.capability",
    "rollout.layers.cpu_build": "rollout.kernels.cpu.build",
    "rollout.layers.cpu_plan": "rollout.kernels.cpu.plan", "rollout.layers.cpu_layer": "rollout.kernels.cpu.fused",
    "rollout.layers.paged_decode_triton": "rollout.kernels.triton.paged_decode",
    "rollout.layers.lora_triton": "rollout.kernels.triton.lora",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import rollout.<old>`` -> the module at its new path, under both names."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])  # it runs here, once, under its new name

    def exec_module(self, module) -> None:
        """Bound under the old name too: say where it lives now."""
        old = next(name for name, new in MOVED.items() if new == module.__name__)
        warnings.warn(f"{old} moved to {module.__name__}; import it from there", DeprecationWarning, stacklevel=2)


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())


def forward_old_names(package: str, module: str):
    """A package ``__getattr__`` that serves the names of the module it replaced (``rollout.engine``,
    ``rollout.scheduler`` were modules) from their new module, with a ``DeprecationWarning``."""

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        target = importlib.import_module(module)
        if not hasattr(target, name):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        warnings.warn(f"{package}.{name} moved to {module}.{name}", DeprecationWarning, stacklevel=2)
        return getattr(target, name)

    return __getattr__
