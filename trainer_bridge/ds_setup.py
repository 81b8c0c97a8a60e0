"""DeepSpeed set-up that works on CPU (accelerator ``cpu``, gloo) as well as on GPUs."""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from typing import Any

import torch


def setup_deepspeed_env(skip_shm_build: bool = True) -> None:
    """Before ``import deepspeed``: pick the accelerator; on CPU skip the JIT-built shared-memory op
    (about 40 s per fresh machine; gloo does the collectives)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("WANDB_MODE", "offline" if not os.environ.get("WANDB_API_KEY") else "online")
    importlib.import_module("torch._dynamo")  # deepspeed.zero.Init needs it imported first
    # DeepSpeed 0.19 calls torch.distributed functions torch has deprecated: a FutureWarning on every
    # call (four lines per RL step) that says nothing to a user of this loop. Only those are hidden, by
    # their message: torch attributes them to its own logging wrapper (c10d_logger), not to DeepSpeed.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.[\w.]+` (is|will be) deprecated",
                            category=FutureWarning)

    if skip_shm_build and not torch.cuda.is_available():
        importlib.import_module("deepspeed.comm.torch")
        # sys.modules, not attribute access: ``deepspeed.comm.torch`` as an attribute is the real torch
        setattr(sys.modules["deepspeed.comm.torch"], "build_shm_op", lambda: None)  # noqa: B010
    for key, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, default)
    if "MASTER_PORT" not in os.environ:
        from weight_sync.process_group import free_port

        os.environ["MASTER_PORT"] = str(free_port())


def ds_config(zero_stage: int, lr: float, bf16: bool, world_size: int) -> dict:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "zero_optimization": {"stage": zero_stage},
        "gradient_clipping": 1.0,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if zero_stage == 3:
        cfg["zero_optimization"].update({"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0})
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg
