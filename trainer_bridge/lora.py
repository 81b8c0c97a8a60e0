"""LoRA on the trainer side: a ``peft`` adapter trained under DeepSpeed (any ZeRO stage), and only its
tensors pushed to the rollout engine; the base weights never move.

``wrap_lora`` puts a fresh adapter on the trainer's model (``lora_B = 0``: at step 0 the policy is the
base model) with dropout 0, so the trainer's recompute is the function the engine serves.
``adapter_tensors`` gathers the adapter's parameters (ZeRO-3 partitions all-gathered, a few
megabytes) under the names ``peft`` gives them, in fp32, every ``A`` before every ``B``
(``rollout.weights.lora.wire_order``); ``adapter_config`` is its config as a JSON
object. ``push_adapter`` hands both to a weight target (a colocated engine, or servers over the
weight-update group) as a new version of one adapter name.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Union

import torch
from torch import nn

from rollout.outputs import WeightResult
from rollout.weights.lora import peft_quietly, wire_order
from trainer_bridge.push import gathered, unwrapped
from trainer_bridge.routing_replay import routers
from trainer_bridge.targets import WeightTarget
from weight_sync.bucket import FlattenedTensorBucket

ADAPTER = "default"  # peft's name for the one adapter it trains here


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: int
    target_modules: Union[str, list[str]] = "all-linear"
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")


def wrap_lora(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """The model with a trainable ``peft`` LoRA adapter; everything else frozen. On a mixture of experts
    "all-linear" means the linears (attention, any shared expert), never the fused experts' parameters or the
    router that ``peft`` would add as ``target_parameters`` (the engine serves LoRA on linears only)."""
    import peft

    targets = spec.target_modules
    if targets == "all-linear" and routers(model):
        targets = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                          if isinstance(m, nn.Linear) and ".layers." in name and not name.endswith("_gate")})
    config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=targets,
                             use_rslora=spec.use_rslora, lora_dropout=0.0)
    with peft_quietly():
        return peft.get_peft_model(model, config)


def adapter_config(model) -> dict:
    """The adapter's ``peft`` config as JSON types (what ``adapter_config.json`` would hold)."""
    from peft import PeftModel

    peft_model = unwrapped(model)
    if not isinstance(peft_model, PeftModel):
        raise ValueError("the trainer's model is not a peft model: build it with --lora")
    cfg = peft_model.peft_config[ADAPTER].to_dict()
    return {k: (sorted(v) if isinstance(v, (set, frozenset)) else v.value if isinstance(v, enum.Enum) else v)
            for k, v in cfg.items()}


def adapter_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """Every LoRA matrix, whole (ZeRO-3: all-gathered; a collective, every rank calls it), in fp32: views
    of one buffer in bucket layout, so a broadcast sends it with no further copy."""
    named = [(n, p) for n, p in unwrapped(model).named_parameters() if ".lora_" in n]
    if not named:
        raise ValueError("the trainer's model has no LoRA parameters: build it with --lora")
    named = [named[i] for i in wire_order([n for n, _ in named])]  # the A buckets land in place in the engine
    with gathered([p for _, p in named]):
        return FlattenedTensorBucket([(n, p.detach()) for n, p in named], dtype=torch.float32).named_tensors()


@dataclass
class AdapterPush:
    result: WeightResult
    num_bytes: int
    gather_s: float
    load_s: float


def push_adapter(model, target: WeightTarget, name: str, version: str) -> AdapterPush:
    """The adapter's current tensors into ``target``'s engines as a new version of ``name`` whose
    tokens carry ``version``: a colocated engine loads them from memory, servers receive them over
    the weight-update group. A collective: every trainer rank calls it."""
    t0 = time.perf_counter()
    tensors = adapter_tensors(model)
    config = adapter_config(model)
    t1 = time.perf_counter()
    result = target.push_adapter(name, config, tensors, version)
    return AdapterPush(result, sum(t.numel() * t.element_size() for _, t in tensors), t1 - t0,
                       time.perf_counter() - t1)
