"""rollout-worker: a rollout engine for RL training of language models."""

from rollout.engine import EngineDeadError, RolloutEngine
from rollout.loader import WeightLoadError, load_named_tensors
from rollout.messages import WeightResult
from rollout.outputs import RolloutOutput
from rollout.sampling_params import SamplingParams

__all__ = ["RolloutEngine", "SamplingParams", "RolloutOutput", "WeightResult", "load_named_tensors",
           "WeightLoadError", "EngineDeadError"]
__version__ = "0.1.0"
