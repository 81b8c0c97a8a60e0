"""rollout-worker: a rollout engine for RL training of language models."""

from rollout import _moved
from rollout import openmp as _openmp

_openmp.apply_defaults()  # before torch loads libgomp, where the caller has not imported torch yet (rollout.openmp)
_moved.install()  # old module paths (rollout.messages, rollout.tp_group, ...) still import, with a warning

from rollout.engine.engine import EngineDeadError, RolloutEngine  # noqa: E402
from rollout.outputs import RolloutOutput, WeightResult  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402
from rollout.weights.loader import WeightLoadError, load_named_tensors  # noqa: E402

__all__ = ["RolloutEngine", "SamplingParams", "RolloutOutput", "WeightResult", "load_named_tensors",
           "WeightLoadError", "EngineDeadError"]
__version__ = "0.1.0"
