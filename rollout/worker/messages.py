"""What travels between the engine and its TP ranks: one frozen dataclass per message, and one
typed result for every weight operation (``WeightResult``, which lives with the engine's other public
results in ``rollout.outputs`` and is named here too).

A rank dispatches on the message's type (``TpModelWorker.handle``): step messages drive the
forward pass; weight messages go to the rank's ``RankWeights``. Messages to spawned ranks cross
a pipe, so every field is plain data (a shared-memory or CUDA-IPC handle is a JSON-able dict);
``ApplyTensors`` and ``StageTensors`` carry tensors and are only sent to ranks in the caller's
process (TP=1, or every rank of an external launch, where each rank calls the API itself).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from rollout.batch import ModelWorkerBatch, SamplingInputs
from rollout.outputs import REJECTED_ELSEWHERE, WeightResult  # noqa: F401  (the ranks' result, named here too)

if TYPE_CHECKING:
    from rollout.weights.safetensors_io import PinnedFolder

# ---------------------------------------------------------------------------------------------
# generation steps (rank 0 -> the other ranks)


@dataclass(frozen=True)
class StepMsg:
    batch: ModelWorkerBatch


@dataclass(frozen=True)
class SampleMsg:
    """Delayed sampling of the last step."""

    sampling: SamplingInputs


@dataclass(frozen=True)
class StopMsg:
    """Leave the message loop and exit."""


@dataclass(frozen=True)
class DoneMsg:
    """External launch: the leader's outputs of one collective ``generate()`` call."""

    outputs: Optional[list]
    error: Optional[str] = None


# ---------------------------------------------------------------------------------------------
# weight operations (every rank runs the same message; updates are voted on the TP group)


@dataclass(frozen=True)
class ApplyTensors:
    """Full tensors under Hugging Face names, in this process (dtypes must equal the engine's)."""

    named_tensors: tuple  # ((name, tensor), ...)
    check_finite: bool = True
    partial: bool = False


@dataclass(frozen=True)
class ApplyHandle:
    """A shared-memory or CUDA-IPC bucket written by another process (a JSON handle)."""

    handle: dict
    check_finite: bool = True
    partial: bool = False


@dataclass(frozen=True)
class ApplyDisk:
    """A safetensors folder (any floating dtype: cast on copy, like the initial load), pinned by the
    engine when the update was asked for: ranks read through ``folder`` (a directory descriptor),
    the path only names it in messages. On a pipe the message travels without it
    (``on_the_wire``) and the descriptor follows as a passed file handle."""

    model_path: str
    check_finite: bool = True
    recapture_cuda_graph: bool = False
    folder: Optional[PinnedFolder] = field(default=None, compare=False, repr=False)
    # the engine's own start folder only (``reload_weights``): its files may link, as at the first load
    follow_links: bool = False

    def on_the_wire(self) -> ApplyDisk:
        return dataclasses.replace(self, folder=None)


@dataclass(frozen=True)
class ApplyDelta:
    """A delta push (``weight_sync.delta.WeightDelta``): its header (JSON) and its tensors, in this process
    (``named_tensors``) or in another process's bucket (``handle``)."""

    header: dict
    named_tensors: tuple = ()
    handle: Optional[dict] = None


@dataclass(frozen=True)
class ReceiveDelta:
    """A delta push whose tensors rank 0 of a weight-update group broadcasts (``rollout_bucket`` buckets of the
    delta's named tensors); ``refuse``: receive them all the same (the sender is broadcasting) and refuse with
    this reason (the engine does not hold the base)."""

    header: dict
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str
    bucket_bytes: int
    refuse: Optional[str] = None
    reply_timeout_s: float = 120.0


@dataclass(frozen=True)
class ReceiveDistributed:
    """Buckets broadcast by rank 0 of a weight-update group (``weight_sync.WeightUpdateSender``)."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str
    bucket_bytes: int
    load_format: str = "direct"  # or "flattened_bucket" (SGLang's), "packed" (vLLM's), "rollout_bucket" (ours)
    check_finite: bool = True
    partial: bool = False
    reply_timeout_s: float = 120.0
    point_to_point: bool = False  # sent to this engine's ranks alone (a catch-up push), not broadcast


@dataclass(frozen=True)
class ReceiveSparse:
    """vLLM's sparse patches (its ``sparse_nccl`` transfer: per tensor, its int32 flat indices then its values,
    each one broadcast) in checkpoint coordinates (names, full ``shapes``): applied to the weights held (they
    name no base), or staged into the open transaction (``stage``)."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    counts: tuple[int, ...]  # each tensor's patched elements (vLLM's num_updates_list)
    group_name: str
    stage: bool = False
    reply_timeout_s: float = 120.0


@dataclass(frozen=True)
class BeginTransaction:
    """Start staging an update that arrives in several calls; nothing changes until commit."""


@dataclass(frozen=True)
class StageTensors:
    named_tensors: tuple  # ((name, tensor), ...), in this process


@dataclass(frozen=True)
class StageHandle:
    handle: dict


@dataclass(frozen=True)
class StageDistributed:
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str
    bucket_bytes: int
    load_format: str = "direct"  # or "flattened_bucket" (SGLang's), "packed" (vLLM's), "rollout_bucket" (ours)
    reply_timeout_s: float = 120.0
    point_to_point: bool = False  # sent to this engine's ranks alone (a catch-up push), not broadcast


@dataclass(frozen=True)
class CommitTransaction:
    check_finite: bool = True
    partial: bool = False


@dataclass(frozen=True)
class AbortTransaction:
    """Drop what the open transaction staged."""


@dataclass(frozen=True)
class InitUpdateGroup:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: Optional[str] = None
    timeout_s: float = 60.0
    trainer_rank: int = 0  # the rank that broadcasts (TRL's client is the group's last rank)

    @property
    def reply_timeout_s(self) -> float:
        return self.timeout_s + 5


@dataclass(frozen=True)
class AwaitUpdateGroup:
    """How the join ``InitUpdateGroup`` started (on a thread of its own: the rank keeps serving) stands:
    joined (the group in place), failed, or still pending (``detail["pending"]``). Never waits."""

    group_name: str


@dataclass(frozen=True)
class DestroyUpdateGroup:
    group_name: str


@dataclass(frozen=True)
class ProbeUpdateGroup:
    """Receive one bare broadcast of ``nbytes``, or one per entry of ``sizes`` (bytes), all posted
    at once (the raw transport a benchmark compares against)."""

    group_name: str
    nbytes: int
    sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class BarrierUpdateGroup:
    """A barrier with the trainer on the group (TRL's protocol: after each parameter's broadcast)."""

    group_name: str


@dataclass(frozen=True)
class ReleaseMemory:
    tags: tuple[str, ...]
    backup_weights: bool = False


@dataclass(frozen=True)
class ResumeMemory:
    tags: tuple[str, ...]


@dataclass(frozen=True)
class ReadWeight:
    """The first ``truncate_size`` values of the full Hugging Face tensor ``name`` (gathered over TP)."""

    name: str
    truncate_size: int = 100


@dataclass(frozen=True)
class WeightsChecksum:
    """sha256 over every weight in Hugging Face form (``weight_sync.checksum_named_tensors``)."""


@dataclass(frozen=True)
class LoadLora:
    """A LoRA adapter (peft's config and tensors) into ``slot`` of every linear it targets, all or
    nothing (``rollout.weights.lora``): the tensors themselves in this process, else a shared-memory
    or CUDA-IPC bucket's handle. The base weights are not touched. ``collect``: slots of retired versions
    the engine collects with this load, emptied first; the last one's memory is lent to it (reused when
    its adapter has the same size: a new version of the same adapter)."""

    slot: int
    name: str
    config: dict  # peft's adapter_config.json, already read by the engine
    named_tensors: tuple = ()  # ((name, tensor), ...), in this process
    handle: Optional[dict] = None
    max_rank: int = 64
    max_bytes: Optional[int] = None  # what the memory budget leaves for it on a rank (None: no budget)
    collect: tuple[int, ...] = ()


@dataclass(frozen=True)
class ReceiveLora:
    """A LoRA adapter broadcast by the trainer over a weight-update group (miles'
    ``load_lora_adapter_from_distributed``): every rank receives the tensors ``names`` /
    ``dtypes`` / ``shapes`` laid out as ``load_format`` says (``ReceiveDistributed``'s formats), then
    loads them as ``load`` says (its tensors empty), all or nothing. A refused adapter is still
    drained, so the group keeps working."""

    load: LoadLora
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str
    bucket_bytes: int
    load_format: str = "direct"
    reply_timeout_s: float = 120.0


@dataclass(frozen=True)
class UnloadLora:
    """Empty an adapter slot (its memory freed)."""

    slot: int


WEIGHT_MESSAGES = (ApplyTensors, ApplyHandle, ApplyDisk, ApplyDelta, ReceiveDelta, ReceiveSparse, ReceiveDistributed,
                   BeginTransaction,
                   StageTensors, StageHandle, StageDistributed, CommitTransaction, AbortTransaction, InitUpdateGroup,
                   AwaitUpdateGroup, DestroyUpdateGroup, ProbeUpdateGroup, BarrierUpdateGroup, ReleaseMemory,
                   ResumeMemory, ReadWeight, WeightsChecksum, LoadLora, ReceiveLora, UnloadLora)
LOCAL_ONLY = (ApplyTensors, StageTensors)  # tensors in this process: never sent over a pipe


def reply_timeout_s(msg) -> Optional[float]:
    """How long rank 0 waits for the other ranks' answer to ``msg`` beyond the TP timeout."""
    return getattr(msg, "reply_timeout_s", None)
