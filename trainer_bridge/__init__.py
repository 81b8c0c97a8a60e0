"""The trainer side: a DeepSpeed (ZeRO 0-3) policy pushes its weights into the rollout engine."""

from trainer_bridge.names import to_hf_name
from trainer_bridge.push import PushStats, gathered_buckets, push_weights
from trainer_bridge.targets import ColocatedTarget, WeightTarget

__all__ = ["to_hf_name", "push_weights", "gathered_buckets", "PushStats", "ColocatedTarget", "WeightTarget"]
