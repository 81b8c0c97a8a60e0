"""Push a DeepSpeed policy's weights into a rollout target, in buckets.

ZeRO-3 partitions are gathered a bucket at a time (a collective on every trainer rank) straight
into the bucket's flat buffer in the engine's dtype (``gather_into``; DeepSpeed's
``GatheredParameters`` where that does not apply), and handed to the target; ZeRO 0-2 parameters
are already whole. The per-parameter mode (one gather and one
hand-off per parameter, what most integrations do) is kept as the baseline to measure against.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Optional

import torch

from rollout.outputs import WeightResult
from trainer_bridge.names import to_hf_name
from trainer_bridge.targets import WeightTarget
from weight_sync.bucket import BucketPool, FlattenedTensorBucket
from weight_sync.delta import DeltaTracker, changed_fraction
from weight_sync.layout import layout

SAMPLE_VALUES = 64
# Buckets small enough that the wire of one overlaps the gather of the next and little of the last
# one is exposed (SmolLM2, ZeRO-3 on two ranks, to a server: 64 MiB and 256 MiB buckets take the same
# 0.83 s; 256 MiB leaves 0.25 s after the last gather against 0.13 s), large enough to keep a
# collective's bandwidth.
DEFAULT_PUSH_BUCKET_BYTES = 64 << 20


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
    """A ZeRO-3 partitioned parameter (DeepSpeed's own test: the one place that asks)."""
    from deepspeed.runtime.zero.partition_parameters import is_zero_param

    return bool(is_zero_param(param))


def full_numel(param) -> int:
    """Elements of the whole parameter (a ZeRO-3 partition counts as the parameter it is part of)."""
    return param.ds_numel if _is_zero3(param) else param.numel()


def param_buckets(module: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int,
                  tied: AbstractSet[str] = frozenset()) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """The push's buckets: (hf_name, parameter) in model order, cut at ``bucket_bytes`` of full
    tensors in ``dtype`` (a parameter larger than that is a bucket of its own)."""
    item = torch.empty((), dtype=dtype).element_size()
    buckets: list[list[tuple[str, torch.nn.Parameter]]] = []
    bucket: list[tuple[str, torch.nn.Parameter]] = []
    size = 0
    for name, p in module.named_parameters():
        name = to_hf_name(name)
        if name in tied:
            continue
        n = full_numel(p) * item
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


def _partitioned(bucket: list):
    """The ZeRO-3 process group when every parameter of ``bucket`` is a partition-only ZeRO-3
    parameter of one dtype in one group (what ``gather_into`` handles), else None."""
    params = [p for _, p in bucket]
    if not all(_is_zero3(p) for p in params):
        return None
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    groups = {id(p.ds_process_group) for p in params}
    if len(groups) != 1 or len({p.ds_tensor.dtype for p in params}) != 1 or any(
            p.ds_status != ZeroParamStatus.NOT_AVAILABLE or p.ds_tensor.device != params[0].ds_tensor.device
            for p in params):
        return None
    return params[0].ds_process_group


def gather_into(bucket: list, group, dtype: torch.dtype, alloc, stats: PushStats) -> FlattenedTensorBucket:
    """A bucket of ZeRO-3 parameters gathered straight from the partitions, all in flight at once;
    no full parameters allocated, nothing re-partitioned. Rank r holds elements
    [r * part, (r + 1) * part) of each flattened parameter (padded to ``world * part``), as DeepSpeed
    partitions it, so a gathered region's first ``numel`` elements are the parameter. A parameter
    already in the engine's dtype whose padded size fits its slot in the flat bucket is gathered
    right there (no copy; the padding lands in the slot's alignment gap); any other is gathered
    into a reused buffer and copied (cast) into its slot. ``alloc(key, nbytes, device)`` gives the
    byte buffers: "bucket" for the result, "gather" for the others' all-gather."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    parts = [p.ds_tensor for _, p in bucket]
    src, device = parts[0].dtype, parts[0].device
    t0 = time.perf_counter()
    metas, nbytes = layout((name, dtype, tuple(p.ds_shape)) for name, p in bucket)
    flat = FlattenedTensorBucket(buffer=alloc("bucket", nbytes, device), metadata=metas)
    ends = [m.offset for m in metas[1:]] + [nbytes]
    in_place = [src == dtype and m.offset + world * part.numel() * src.itemsize <= end
                for m, part, end in zip(metas, parts, ends)]
    staged = sum(world * part.numel() for part, here in zip(parts, in_place) if not here)
    scratch = alloc("gather", staged * src.itemsize, device).view(src) if staged else None
    regions, works, at = [], [], 0
    for m, part, here in zip(metas, parts, in_place):
        size = world * part.numel()
        if here:
            region = flat.buffer[m.offset: m.offset + size * src.itemsize].view(src)
        else:
            assert scratch is not None  # sized for every region not gathered in place
            region, at = scratch[at: at + size], at + size
        regions.append(region)
        works.append(dist.all_gather_into_tensor(region, part, group=group, async_op=True))
    for work in works:
        work.wait()
    t1 = time.perf_counter()
    stats.gather_s += t1 - t0
    for (_, dst), region, here in zip(flat.named_tensors(), regions, in_place):
        if not here:
            dst.view(-1).copy_(region[: dst.numel()])
    stats.pack_s += time.perf_counter() - t1
    return flat


def gathered_buckets(module: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int, stats: PushStats,
                     tied: AbstractSet[str] = frozenset(), pool: Optional[BucketPool] = None, direct: bool = True):
    """Yield buckets of (hf_name, full tensor in ``dtype``); every trainer rank must iterate.
    ``direct``: ZeRO-3 buckets gathered straight from their partitions (``gather_into``) rather than
    through DeepSpeed's ``GatheredParameters``."""
    buckets = param_buckets(module, dtype, bucket_bytes, tied)
    params = [entry for bucket in buckets for entry in bucket]
    stats.samples = _sampled(params)
    for bucket in buckets:
        yield gather_bucket(bucket, dtype, stats, pool, direct)


def _sampled(params: list) -> dict:
    """The parameters a push samples the first values of (first, middle, last), for ``verify_pushed``."""
    return {n: None for n, _ in (params[0], params[len(params) // 2], params[-1])}


def gather_bucket(bucket: list, dtype: torch.dtype, stats: PushStats, pool: Optional[BucketPool] = None,
                  direct: bool = True) -> list[tuple[str, torch.Tensor]]:
    """Full copies (in ``dtype``) of a bucket of (hf_name, parameter), packed into one flat buffer
    (``pool``'s buffer for this bucket when given); collective under ZeRO-3."""
    k = stats.num_buckets

    def alloc(key, nbytes: int, device: torch.device) -> torch.Tensor:  # bucket k: buffer k; one all-gather buffer
        if pool is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        return pool.get(k if key == "bucket" else key, nbytes, device)

    group = _partitioned(bucket) if direct else None
    if group is not None:  # straight from the partitions into the flat bucket
        out = gather_into(bucket, group, dtype, alloc, stats).named_tensors()
    else:
        t0 = time.perf_counter()
        with gathered([p for _, p in bucket]):
            t1 = time.perf_counter()
            stats.gather_s += t1 - t0
            # Copy out while gathered (the gathered storage is freed on exit), cast to the engine's
            # dtype and packed in one pass: the bucket is one flat buffer, which a process-group
            # sender broadcasts as it is and an in-process target reads as views.
            out = FlattenedTensorBucket([(name, p.detach()) for name, p in bucket], dtype=dtype,
                                        alloc=lambda nbytes, device: alloc("bucket", nbytes, device)).named_tensors()
            stats.pack_s += time.perf_counter() - t1
    for name, t in out:
        if name in stats.samples:
            stats.samples[name] = t.flatten()[:SAMPLE_VALUES].float().clone()
    stats.num_buckets += 1
    stats.num_bytes += sum(t.numel() * t.element_size() for _, t in out)
    return out


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The policy inside a DeepSpeed engine (which wraps it), or the model itself."""
    from deepspeed import DeepSpeedEngine

    return model.module if isinstance(model, DeepSpeedEngine) else model


def push_weights(model: torch.nn.Module, target: WeightTarget, version: str,
                 bucket_bytes: int = DEFAULT_PUSH_BUCKET_BYTES,
                 per_parameter: bool = False, tie_word_embeddings: bool = False,
                 tracker: Optional[DeltaTracker] = None) -> PushStats:
    """One transaction: gather (bucketed, or one parameter at a time) -> hand to target -> commit.
    ``tracker``: keeps what went out as the base of the next delta push (once committed)."""
    stats = PushStats()
    target.begin(version)
    module = unwrapped(model)
    tied = {"lm_head.weight"} if tie_word_embeddings else set()
    pool = target.buffers
    if tracker is not None:
        tracker.reset()
    # per parameter: the baseline most integrations use, one GatheredParameters + hand-off per parameter
    for bucket in gathered_buckets(module, target.dtype, 1 if per_parameter else bucket_bytes, stats, tied, pool,
                                   direct=not per_parameter):
        t0 = time.perf_counter()
        if tracker is not None:
            tracker.take(bucket)
        target.add(bucket)
        stats.transfer_s += time.perf_counter() - t0
    t0 = time.perf_counter()
    stats.result = target.commit()
    stats.commit_s = time.perf_counter() - t0
    stats.phases = {"gather_s": stats.gather_s, "pack_s": stats.pack_s, "transfer_s": stats.transfer_s,
                    "commit_s": stats.commit_s}
    if tracker is not None:
        if isinstance(stats.result, WeightResult) and stats.result.success:
            tracker.recorded(version)
        else:
            tracker.reset()
    return stats


def _delta_items(module: torch.nn.Module, target: WeightTarget, bucket_bytes: int, stats: PushStats,
                 tied: AbstractSet[str]):
    """(hf_name, full tensor) for a diff: ZeRO-3 partitions gathered a bucket at a time (into the target's pooled
    buffers: the diff keeps no view of them), whole parameters as they are (an fp32 parameter against a bf16
    push is cast as it is compared; any other dtype cast first)."""
    buckets = param_buckets(module, target.dtype, bucket_bytes, tied)
    params = [entry for bucket in buckets for entry in bucket]
    stats.samples = _sampled(params)
    for bucket in buckets:
        if any(_is_zero3(p) for _, p in bucket):
            yield from gather_bucket(bucket, target.dtype, stats, target.buffers)
            continue
        for name, p in bucket:
            t = p.detach()
            fused = t.dtype == target.dtype or (t.dtype == torch.float32 and target.dtype == torch.bfloat16
                                                and t.device.type == "cpu")  # (a GPU's: cast there, half the copy)
            if name in stats.samples:
                stats.samples[name] = t.flatten()[:SAMPLE_VALUES].to(target.dtype).float().clone()
            yield name, t if fused else t.to(target.dtype)


def push_delta(model: torch.nn.Module, target: WeightTarget, version: str, tracker: DeltaTracker,
               bucket_bytes: int = DEFAULT_PUSH_BUCKET_BYTES, tie_word_embeddings: bool = False) -> PushStats:
    """Only what changed since the last push (``weight_sync.delta``): the weights gathered bucket by bucket and
    diffed against ``tracker``'s base as they come (no second gather), sent as one delta that the target
    applies all or nothing. A full push instead (kept as the next base) where the tracker has no base or an
    anchor is due, or where the target refuses the delta's base (an engine that missed a push, a new one).
    ``stats.phases``: ``gather_s`` / ``pack_s`` (gathering ZeRO-3 buckets), ``diff_s``, ``commit_s`` (the
    delta sent and applied), ``delta`` (whether a delta went), ``delta_bytes``, ``changed_fraction``,
    ``held_bytes`` (the base the trainer keeps), ``fell_back`` (a refused base, pushed in full); where other
    engines of the target took the delta, those that refused it get the version in full alone (``caught_up``: the
    refusal, ``catch_up_bytes``, ``catch_up_s``) and the delta stands."""
    if tracker.wants_full():
        stats = push_weights(model, target, version, bucket_bytes, tie_word_embeddings=tie_word_embeddings,
                             tracker=tracker)
        stats.phases.update(delta=False, delta_bytes=0, changed_fraction=1.0, held_bytes=tracker.held_bytes,
                            fell_back=False)
        return stats
    stats = PushStats()
    module = unwrapped(model)
    tied = {"lm_head.weight"} if tie_word_embeddings else set()
    t0 = time.perf_counter()
    delta = tracker.diff(_delta_items(module, target, bucket_bytes, stats, tied), version)
    t1 = time.perf_counter()
    diff_s = t1 - t0 - stats.gather_s - stats.pack_s  # the rest of that loop: the diff against the kept bits
    try:
        stats.result = result = target.push_delta(delta)
    except BaseException:
        tracker.rollback()  # the base is the version the engines hold again
        raise
    stats.commit_s = time.perf_counter() - t1
    sizes = [t.numel() for t in tracker.base.values()]
    if result.success:
        tracker.commit(delta)
    elif result.error_kind == WeightResult.BASE and target.delta_taken_elsewhere():
        # others took it: the delta is the base now, and the engines that refused get this version in full, alone
        tracker.commit(delta)
        full = push_weights(model, target, version, bucket_bytes, tie_word_embeddings=tie_word_embeddings)
        stats.result = full.result  # every engine at this version now, or the catch-up's refusal
        stats.phases.update(caught_up=result.message, catch_up_bytes=full.num_bytes, catch_up_s=full.total_s)
    elif result.error_kind == WeightResult.BASE:  # the engine holds another version: a full push, the new base
        full = push_weights(model, target, version, bucket_bytes, tie_word_embeddings=tie_word_embeddings,
                            tracker=tracker)
        full.phases.update(delta=False, delta_bytes=delta.num_bytes, changed_fraction=changed_fraction(delta, sizes),
                           held_bytes=tracker.held_bytes, fell_back=True, refused=result.message)
        return full
    else:  # refused otherwise (a value lost on the way, a replica down): the base stays the engines' version
        tracker.rollback()
    stats.num_bytes = delta.num_bytes
    stats.phases = {"gather_s": stats.gather_s, "pack_s": stats.pack_s, "diff_s": diff_s, "transfer_s": 0.0,
                    "commit_s": stats.commit_s, "delta": True, "delta_bytes": delta.num_bytes,
                    "changed_fraction": changed_fraction(delta, sizes),
                    "held_bytes": tracker.held_bytes, "fell_back": False, **stats.phases}
    return stats
