"""Push a DeepSpeed policy's weights into a rollout target, in buckets.

ZeRO-3 partitions are gathered with ``deepspeed.zero.GatheredParameters`` a bucket at a time (a
collective on every trainer rank), copied out in the engine's dtype while gathered, and handed to
the target; ZeRO 0-2 parameters are already whole. The per-parameter mode (one gather and one
hand-off per parameter, what most integrations do) is kept as the baseline to measure against.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from trainer_bridge.names import to_hf_name
from trainer_bridge.targets import WeightTarget
from weight_sync.bucket import BucketPool, FlattenedTensorBucket

SAMPLE_VALUES = 64


@dataclass
class PushStats:
    gather_s: float = 0.0
    pack_s: float = 0.0
    transfer_s: float = 0.0  # handing buckets to the target
    commit_s: float = 0.0
    num_buckets: int = 0
    num_bytes: int = 0
    result: object = None
    phases: dict = field(default_factory=dict)
    # the first values of a few parameters (first, middle, last) as pushed, taken while they were
    # gathered anyway: ``verify_pushed`` reads them back from the engine without gathering again
    samples: dict = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return self.gather_s + self.pack_s + self.transfer_s + self.commit_s


def _is_zero3(param) -> bool:
    return hasattr(param, "ds_id") and hasattr(param, "ds_status")


def _full_numel(param) -> int:
    return param.ds_numel if _is_zero3(param) else param.numel()


def param_buckets(module: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int,
                  tied: set[str] = frozenset()) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """The push's buckets: (hf_name, parameter) in model order, cut at ``bucket_bytes`` of full
    tensors in ``dtype`` (a parameter larger than that is a bucket of its own)."""
    item = torch.empty((), dtype=dtype).element_size()
    buckets, bucket, size = [], [], 0
    for name, p in module.named_parameters():
        name = to_hf_name(name)
        if name in tied:
            continue
        n = _full_numel(p) * item
        if bucket and size + n > bucket_bytes:
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.append((name, p))
        size += n
    return buckets + [bucket] if bucket else buckets


def gathered(params: list):
    """A context in which ``params`` are whole: ZeRO-3 partitions gathered (a collective on every
    trainer rank; freed on exit), anything else as it is."""
    zero3 = [p for p in params if _is_zero3(p)]
    if not zero3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(zero3, modifier_rank=None)


def gathered_buckets(module: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int, stats: PushStats,
                     tied: set[str] = frozenset(), pool: Optional[BucketPool] = None):
    """Yield buckets of (hf_name, full tensor in ``dtype``); every trainer rank must iterate."""
    buckets = param_buckets(module, dtype, bucket_bytes, tied)
    params = [entry for bucket in buckets for entry in bucket]
    stats.samples = {n: None for n, _ in (params[0], params[len(params) // 2], params[-1])}
    for bucket in buckets:
        yield gather_bucket(bucket, dtype, stats, pool)


def gather_bucket(bucket: list, dtype: torch.dtype, stats: PushStats,
                  pool: Optional[BucketPool] = None) -> list[tuple[str, torch.Tensor]]:
    """Full copies (in ``dtype``) of a bucket of (hf_name, parameter), packed into one flat buffer
    (``pool``'s buffer for this bucket when given); collective under ZeRO-3."""
    t0 = time.perf_counter()
    with gathered([p for _, p in bucket]):
        t1 = time.perf_counter()
        stats.gather_s += t1 - t0
        # Copy out while gathered (the gathered storage is freed on exit), cast to the engine's
        # dtype and packed in one pass: the bucket is one flat buffer, which a process-group
        # sender broadcasts as it is and an in-process target reads as views.
        k = stats.num_buckets
        alloc = (lambda nbytes, device: pool.get(k, nbytes, device)) if pool is not None else None
        out = FlattenedTensorBucket([(name, p.detach()) for name, p in bucket], dtype=dtype,
                                    alloc=alloc).named_tensors()
        for name, t in out:
            if name in stats.samples:
                stats.samples[name] = t.flatten()[:SAMPLE_VALUES].float().clone()
        stats.pack_s += time.perf_counter() - t1
    stats.num_buckets += 1
    stats.num_bytes += sum(t.numel() * t.element_size() for _, t in out)
    return out


def push_weights(model: torch.nn.Module, target: WeightTarget, version: str, bucket_bytes: int = 256 << 20,
                 per_parameter: bool = False, tie_word_embeddings: bool = False) -> PushStats:
    """One transaction: gather (bucketed, or one parameter at a time) -> hand to target -> commit."""
    stats = PushStats()
    target.begin(version)
    module = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    tied = {"lm_head.weight"} if tie_word_embeddings else set()
    pool = getattr(target, "buffers", None)
    for bucket in gathered_buckets(module, target.dtype, 1 if per_parameter else bucket_bytes, stats, tied, pool):
        t0 = time.perf_counter()
        target.add(bucket)
        stats.transfer_s += time.perf_counter() - t0
    t0 = time.perf_counter()
    stats.result = target.commit()
    stats.commit_s = time.perf_counter() - t0
    stats.phases = {"gather_s": stats.gather_s, "pack_s": stats.pack_s, "transfer_s": stats.transfer_s,
                    "commit_s": stats.commit_s}
    return stats
