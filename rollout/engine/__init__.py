"""engine/: what a caller's request goes through before the scheduler.

- ``engine.py``: ``RolloutEngine``, the public API (generate, control calls, the weight verbs);
- ``loop.py``: ``EngineLoop``, the one thread that owns the scheduler (typed commands, quiet points);
- ``admission.py``: prompts + sampling parameters -> validated requests; sequences -> outputs;
- ``weights.py``: ``EngineWeights``, when a weight message runs and publishing what committed;
- ``tokenizer.py``: tokenizer loading, chat template, detokenization.

May import: the top-level modules (``config``, ``sampling_params``, ``outputs``, ``random``),
``scheduler/``, ``worker/``, ``weights/``, ``models/`` (configs) and ``kernels/`` (CPU capability).
Nothing below it imports this package.
"""

from rollout._moved import forward_old_names
from rollout.engine.engine import PAUSE_MODES, EngineDeadError, RolloutEngine

__all__ = ["RolloutEngine", "EngineDeadError", "PAUSE_MODES"]
__getattr__ = forward_old_names(__name__, "rollout.engine.engine")  # the names of the old rollout/engine.py
