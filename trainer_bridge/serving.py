"""What serves rollouts to a trainer, declared once.

``RolloutService`` is everything ``run_grpo`` and the weight targets use of the thing they drive:
``RolloutEngine`` (in this process), ``RolloutClient`` (a server over HTTP) and ``ReplicaRouter``
(several of those) implement it, so the loop never asks what it was given. ``WeightReplica`` adds
the weight-update group's verbs ``DistributedTarget`` drives on each replica (an engine whose ranks
join the group, or a server).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol, Union

import torch

from rollout.outputs import RolloutOutput, WeightResult
from rollout.sampling_params import SamplingParams


class RolloutService(Protocol):
    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype: pushes are cast to it."""
        ...

    @property
    def tp_size(self) -> int:
        """Trainer ranks that call ``generate`` together for one batch (an engine spanning them);
        1 when each trainer rank generates its own share (an engine per rank, a server, a router)."""
        ...

    @property
    def address(self) -> str:
        """How errors name it (a URL, or the in-process engine)."""
        ...

    def generate(self, *, input_ids: list[list[int]], sampling_params: Union[SamplingParams, list[SamplingParams]],
                 return_sampling_mask: Optional[bool] = None,
                 session_id: Union[str, list[Optional[str]], None] = None,
                 lora_path: Optional[str] = None, top_logprobs_num: int = 0,
                 logprob_start_len: int = -1, return_routed_experts: bool = False) -> list[RolloutOutput]:
        """Prompt-major outputs (every sample of a prompt together), with per-token logprobs.
        ``session_id``: per prompt, the session (``open_session``) it is a turn of; ``lora_path``: the
        LoRA adapter every prompt runs on (None: the base weights); ``top_logprobs_num``: the most likely
        ids with their logprobs at every reported position; ``logprob_start_len``: the prompt's tokens from
        there on reported too (``input_logprobs``, ``input_top_logprobs``; -1: none); ``return_routed_experts``:
        each output's ``routed_experts`` (MoE models: an engine or server that records them)."""
        ...

    def open_session(self, session_id: Optional[str] = None, timeout_s: Optional[float] = None) -> str:
        """A multi-turn session whose history and KV stay where it was opened; its id."""
        ...

    def close_session(self, session_id: str) -> None: ...

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]: ...

    def release_memory_occupation(self, tags: Optional[list[str]] = None,
                                  backup_weights: bool = False) -> WeightResult: ...

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> WeightResult: ...

    def serving_replicas(self) -> int:
        """How many replicas serve the current weights behind it (1 for an engine or a server)."""
        ...

    def take_replica_failures(self) -> list[str]:
        """Replica failures since the last call, named (none for an engine or a server)."""
        ...

    def health(self) -> bool: ...


class WeightReplica(RolloutService, Protocol):
    """A replica a ``DistributedTarget`` pushes into over one weight-update group (the verbs under
    SGLang's names; their arguments as ``RolloutEngine`` documents them)."""

    @property
    def group_ranks(self) -> int:
        """The ranks it joins a weight-update group with (its engine's TP size)."""
        ...

    def get_weight_version(self) -> str: ...

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: Optional[str], timeout_s: float) -> WeightResult: ...

    def update_weights_from_distributed(self, *args: Any, **kwargs: Any) -> WeightResult: ...

    def update_weights_from_delta_distributed(self, *args: Any, **kwargs: Any) -> WeightResult: ...

    def destroy_weights_update_group(self, group_name: str) -> WeightResult: ...

    def load_lora_adapter_from_distributed(self, lora_name: str, config_dict: dict, names: list[str],
                                           dtypes: list, shapes: list, group_name: str, *args: Any,
                                           **kwargs: Any) -> WeightResult: ...

    def begin_weight_update(self, weight_version: Optional[str] = None) -> WeightResult: ...

    def commit_weight_update(self, *args: Any, **kwargs: Any) -> WeightResult: ...

    def abort_weight_update(self) -> WeightResult: ...

    def pause_generation(self, mode: str = "abort") -> None: ...

    def continue_generation(self) -> Optional[WeightResult]: ...  # updates staged while paused, published


if TYPE_CHECKING:  # the type checker holds the three implementations to the declarations
    from rollout.engine.engine import RolloutEngine
    from rollout.server.client import RolloutClient
    from trainer_bridge.router import ReplicaRouter

    def _implementations(engine: RolloutEngine, client: RolloutClient, router: ReplicaRouter) -> None:
        services: list[RolloutService] = [engine, client, router]
        replicas: list[WeightReplica] = [engine, client]
        del services, replicas
