"""The trainer side: a DeepSpeed (ZeRO 0-3) policy pushes its weights into rollout engines, in its
own processes (``ColocatedTarget``) or in others over a weight-update group (``DistributedTarget``),
and routes rollouts over several replicas (``ReplicaRouter``). What serves rollouts is declared once:
``RolloutService`` (``trainer_bridge.serving``), implemented by the engine, ``RolloutClient`` and
the router."""

from trainer_bridge.distributed_target import DistributedTarget
from trainer_bridge.names import to_hf_name
from trainer_bridge.push import PushStats, gathered_buckets, push_weights
from trainer_bridge.replicas import ReplicaError, ReplicaSet
from trainer_bridge.router import ReplicaRouter
from trainer_bridge.serving import RolloutService, WeightReplica
from trainer_bridge.targets import ColocatedTarget, WeightTarget

__all__ = ["to_hf_name", "push_weights", "gathered_buckets", "PushStats", "ColocatedTarget", "WeightTarget",
           "DistributedTarget", "ReplicaRouter", "ReplicaSet", "ReplicaError", "RolloutService", "WeightReplica"]
