"""``RankWeights``: every weight operation on one TP rank, owned by that rank's ``TpModelWorker``.

``handle(message)`` dispatches on the message's type (``rollout.worker.messages``) and returns one
``WeightResult``. Every update is all-or-nothing across the TP group: each rank validates its part
(names, shapes, dtypes, finiteness, coverage) without touching the model, then all ranks vote (a
sum all-reduce of failures on the TP group); only a unanimous vote changes the weights (an
in-place copy, or the shadow the update was written into becomes live), after which the runner
checks whether storage moved (``ModelRunner.after_weights_changed``). A rejected update leaves
every rank's weights exactly as they were.

Memory per path: in-process tensors, shared-memory and CUDA-IPC buckets are validated where they
lie and copied once; safetensors files are checked from their headers, then streamed a tensor at
a time; the distributed path writes each bucket into a shadow of this rank's weights (one copy of
its shard, kept between updates) plus two bucket-sized receive buffers, because a sender can die
midway; a multi-call transaction holds what it staged until commit.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from rollout.executor.model_runner import ModelRunner
from rollout.layers.linear import copy_slices
from rollout.layers.parallel_state import TpState
from rollout.outputs import REJECTED_ELSEWHERE, WeightResult
from rollout.weights import lora
from rollout.weights.loader import (
    WeightLoadError,
    apply_load,
    canonical_names,
    nonfinite_names,
    plan_load,
    rejection_message,
)
from rollout.weights.safetensors_io import SafetensorsFolder
from rollout.worker.messages import (
    AbortTransaction,
    ApplyDelta,
    ApplyDisk,
    ApplyHandle,
    ApplyTensors,
    AwaitUpdateGroup,
    BarrierUpdateGroup,
    BeginTransaction,
    CommitTransaction,
    DestroyUpdateGroup,
    InitUpdateGroup,
    LoadLora,
    ProbeUpdateGroup,
    ReadWeight,
    ReceiveDelta,
    ReceiveDistributed,
    ReceiveLora,
    ReceiveSparse,
    ReleaseMemory,
    ResumeMemory,
    StageDistributed,
    StageHandle,
    StageTensors,
    UnloadLora,
    WeightsChecksum,
)
from rollout.worker.rank_delta import DeltaState, merged, sparse_entry
from weight_sync.checksum import checksum_named_tensors
from weight_sync.delta import INDEX_SUFFIX, VALUE_SUFFIX, DeltaEntry, WeightDelta
from weight_sync.distributed import (
    DIRECT,
    ROLLOUT_BUCKET,
    WeightGroup,
    WeightGroupError,
    WeightSizeMismatch,
    broadcast,
    make_group,
    one_cpu_thread,
    receive_buckets,
    receive_exact,
)
from weight_sync.layout import SpecTuple, contiguous_run, dtype_from_name
from weight_sync.shm import open_bucket

MAX_UPDATE_GROUPS = 8  # weight update groups a rank keeps at once (each holds sockets and a store)
ANNOUNCE_SLACK_BYTES = 256 << 20  # a call may announce 4x the model's bytes and this much more (adapters, odd dtypes)
# Errors of the input (not of the rank): answered as a failed result, the rank keeps serving.
INPUT_ERRORS = (WeightLoadError, ValueError, KeyError, TypeError, OSError)


@dataclass
class Transaction:
    """A multi-call update being staged: (name, tensor) pairs given in process, names received into
    the shadow weights, and the first error seen."""

    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    # received over a weight-update group straight into the shadow weights: name -> (dtype, shape)
    in_shadow: dict[str, tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)
    # vLLM's sparse patches (``ReceiveSparse``): name -> (its entry, the checkpoint shape the patch named)
    sparse: dict[str, tuple[DeltaEntry, tuple[int, ...]]] = field(default_factory=dict)
    error: Optional[str] = None


@functools.lru_cache(maxsize=8)
def _parse_specs(names: tuple, dtypes: tuple, shapes: tuple) -> tuple:
    """((name, dtype, shape), ...) of a distributed call (kept: a trainer sends the same lists every step)."""
    return SpecTuple((n, dtype_from_name(d) if isinstance(d, str) else d, tuple(int(x) for x in s))
                     for n, d, s in zip(names, dtypes, shapes))


# an adapter's receives posted ahead, in bytes (at least two buckets): the sender never waits for a buffer
# (a rank-16 SmolLM2 adapter, 20 MB: all of it)
LORA_RECEIVE_BYTES = 32 << 20


@dataclass
class _JoiningGroup:
    """A weight update group being joined on a thread of its own (``RankWeights._init_group``)."""

    done: str  # the message once joined
    thread: threading.Thread = field(default=None)  # type: ignore[assignment]
    group: Optional[WeightGroup] = None
    error: Optional[str] = None


# messages after which the live weights may differ from what the delta fingerprints describe
_CHANGES_WEIGHTS = (ApplyTensors, ApplyHandle, ApplyDisk, ReceiveDistributed, CommitTransaction)


def _changes_weights(msg) -> bool:
    """Whether the live weights may differ from what the delta fingerprints describe after ``msg`` (releasing
    or resuming the KV cache alone does not touch them: a colocated trainer does it every step)."""
    return isinstance(msg, _CHANGES_WEIGHTS) or (isinstance(msg, (ReleaseMemory, ResumeMemory))
                                                 and "weights" in msg.tags) or (isinstance(msg, ReceiveSparse)
                                                                                and not msg.stage)


class RankWeights:
    def __init__(self, runner: ModelRunner, tp_state: TpState, device: torch.device):
        self.runner = runner
        self.tp_state = tp_state
        self.device = device
        self.update_groups: dict[str, WeightGroup] = {}
        self.joining_groups: dict[str, _JoiningGroup] = {}  # groups whose join runs on a thread of its own
        self.receive_pool: list[torch.Tensor] = []  # the distributed path's two receive buffers
        self.transaction: Optional[Transaction] = None
        self.probe_buffer: Optional[torch.Tensor] = None
        self.lora_plans: dict[int, lora.AdapterPlan] = {}  # slot -> its adapter (views of one buffer)
        # (slot, plan) of a collected adapter during the load that collected it: its memory lent to that load,
        # its entries still in the linears, so that a load into the same slot over the same views (every push
        # of a training run) has nothing to install
        self.lora_collected: Optional[tuple[int, lora.AdapterPlan]] = None
        self.last_specs: Optional[tuple] = None  # (names, dtypes, shapes, specs) of the last distributed call
        self.lora_pool: list[torch.Tensor] = []  # adapters' two receive buffers (their copy programs view them)
        # this rank's part of each tensor's fingerprint, for delta pushes (forgotten by any other weight change)
        self.delta = DeltaState(runner.name_map, tp_state, device)

    def handle(self, msg) -> WeightResult:
        """Run one weight message on this rank (every rank of the engine runs the same one)."""
        if _changes_weights(msg):  # (a failed one may have changed nothing: forgetting costs a pass)
            self.delta.forget()
        return self._handle(msg)

    def _handle(self, msg) -> WeightResult:
        match msg:
            case ApplyTensors():
                return self._apply(msg.named_tensors, strict_dtype=True, check_finite=msg.check_finite,
                                   partial=msg.partial)
            case ApplyHandle():
                return self._with_bucket(msg.handle, lambda named: self._apply(
                    named, strict_dtype=True, check_finite=msg.check_finite, partial=msg.partial), vote=True)
            case ApplyDisk():
                return self._apply_disk(msg)
            case ApplyDelta():
                if msg.handle is not None:
                    return self._with_bucket(msg.handle, lambda named: self._apply_delta(msg.header, named), vote=False)
                return self._apply_delta(msg.header, msg.named_tensors)
            case ReceiveDistributed():
                return self._receive(msg)
            case ReceiveDelta():
                return self._receive_delta(msg)
            case ReceiveSparse():
                return self._receive_sparse(msg)
            case BeginTransaction():
                self.transaction = Transaction()
                return WeightResult.ok("transaction started")
            case StageTensors():
                return self._stage(msg.named_tensors, copy=False)
            case StageHandle():  # the sender reuses its buffer for the next bucket: stage a copy
                return self._with_bucket(msg.handle, lambda named: self._stage(named, copy=True), vote=False)
            case StageDistributed():
                return self._stage_distributed(msg)
            case CommitTransaction():
                return self._commit_transaction(msg)
            case AbortTransaction():
                self.transaction = None
                return WeightResult.ok("transaction discarded")
            case InitUpdateGroup():
                return self._init_group(msg)
            case AwaitUpdateGroup():
                return self._await_group(msg.group_name)
            case DestroyUpdateGroup():
                joining = self.joining_groups.pop(msg.group_name, None)  # its thread ends by its deadline; dropped
                if self.update_groups.pop(msg.group_name, None) is None and joining is None:
                    return WeightResult.fail(f"no weight update group {msg.group_name!r}")
                return WeightResult.ok(f"destroyed weight update group {msg.group_name!r}")
            case ProbeUpdateGroup():
                return self._probe(msg)
            case BarrierUpdateGroup():
                return self._barrier(msg.group_name)
            case ReleaseMemory():
                if "weights" in msg.tags:
                    self.receive_pool = []  # the distributed path's receive buffers go with the weights
                    self._shadow_taken("releasing the weights")  # the shadow goes with them
                freed = self.runner.release_memory(msg.tags, msg.backup_weights)
                return WeightResult.ok(f"released {', '.join(msg.tags)}", freed_bytes=freed)
            case ResumeMemory():
                moved = self.runner.resume_memory(msg.tags)
                return WeightResult.ok(f"resumed {', '.join(msg.tags)}", recaptured=bool(moved), moved=moved[:5])
            case ReadWeight():
                return self._read(msg)
            case WeightsChecksum():
                return self._checksum()
            case LoadLora():
                with self._collecting(msg.collect):
                    if msg.handle is not None:
                        return self._with_bucket(msg.handle, lambda named: self._load_lora(msg, named), vote=True)
                    return self._load_lora(msg, msg.named_tensors)
            case ReceiveLora():
                with self._collecting(msg.load.collect):
                    return self._receive_lora(msg)
            case UnloadLora():
                plan = self.lora_plans.pop(msg.slot, None)
                lora.remove(self.runner.model, msg.slot, plan)
                return WeightResult.ok(f"adapter slot {msg.slot} emptied", freed_bytes=0 if plan is None else plan.nbytes())
        raise TypeError(f"not a weight message: {type(msg).__name__}")

    def _barrier(self, group_name: str) -> WeightResult:
        group = self.update_groups.get(group_name)
        if group is None:
            return WeightResult.fail(f"no weight update group {group_name!r}", kind=WeightResult.GROUP)
        try:
            group.wait(group.pg.barrier())
        except Exception as exc:  # noqa: BLE001 - the group is broken
            return WeightResult.fail(self._group_failed(group_name, WeightGroupError(
                f"weight update group {group_name!r}: barrier failed: {exc}")), kind=WeightResult.GROUP)
        return WeightResult.ok("barrier passed")

    @contextlib.contextmanager
    def _collecting(self, slots: tuple[int, ...]):
        """Around a load: empty ``slots`` (retired versions the engine collected with it) first, the last
        one's memory lent to the load (``lora_collected``) with its entries left in the linears; once the
        load is settled, whatever entries are left of it go."""
        for i, slot in enumerate(slots):
            plan = self.lora_plans.pop(slot, None)
            if i == len(slots) - 1 and plan is not None:
                self.lora_collected = (slot, plan)
            else:
                lora.remove(self.runner.model, slot, plan)
        try:
            yield
        finally:
            self._drop_collected()

    def _drop_collected(self) -> None:
        if self.lora_collected is not None:
            slot, plan = self.lora_collected
            self.lora_collected = None
            lora.remove(self.runner.model, slot, plan)

    def _spare(self) -> Optional[lora.AdapterPlan]:
        """The memory a load may reuse: the collected adapter's (None outside a load that collected one)."""
        return None if self.lora_collected is None else self.lora_collected[1]

    def _load_lora(self, msg: LoadLora, named) -> WeightResult:
        """Plan the whole adapter on this rank (names, shapes, finiteness, rank), vote, then install:
        every rank holds it, or none does. Base weights and their CPU copies are untouched."""
        spare = self._spare()
        error, plan = None, None
        try:
            plan = lora.plan_adapter(self.runner.model, self.runner.name_map, lora.AdapterConfig.from_peft(msg.config),
                                     named, msg.max_rank, self.device, msg.max_bytes, spare)
        except INPUT_ERRORS as exc:
            error = f"adapter {msg.name!r}: {exc}"
        return self._install_lora(msg, plan, error)

    def _install_lora(self, msg: LoadLora, plan: Optional[lora.AdapterPlan], error: Optional[str],
                      **detail) -> WeightResult:
        if not self._vote(error is None):
            return WeightResult.fail(error or REJECTED_ELSEWHERE, **detail)
        assert plan is not None
        collected = self.lora_collected
        if collected is not None and collected[0] == msg.slot and collected[1].items is plan.items:
            self.lora_collected = None  # its entries in this slot are these very views, now holding this version
        else:
            self._drop_collected()
            lora.install(self.runner.model, msg.slot, plan, self.lora_plans.get(msg.slot))
        self.lora_plans[msg.slot] = plan
        return WeightResult.ok(f"adapter {msg.name!r} loaded into slot {msg.slot} ({len(plan.modules)} modules, "
                               f"rank <= {plan.max_rank})", num_bytes=plan.nbytes(), modules=plan.modules,
                               max_rank=plan.max_rank, **detail)

    def _receive_lora(self, msg: ReceiveLora) -> WeightResult:
        """Check the adapter from its names and shapes and lay out its buffer while the first bytes
        travel, then put each bucket in place as it lands (while the next is on the wire), check
        finiteness, vote and install. Whatever is wrong, every broadcast is drained so the sender completes."""
        error, specs = self._specs(msg)
        drain_only = msg.load.slot < 0  # refused by the engine already (no vote then)
        if error is not None:  # nothing can be received without the group and specs
            if not drain_only:
                self._vote(False)
            return WeightResult.fail(error, kind=self._group_kind(msg.group_name))
        layout = None
        spare = self._spare()

        def lay_out() -> None:  # runs while the first buckets are on the wire (or before, see below)
            nonlocal layout, error
            if drain_only:
                return
            try:
                layout = lora.AdapterLayout(self.runner.model, self.runner.name_map,
                                            lora.AdapterConfig.from_peft(msg.load.config), specs, msg.load.max_rank,
                                            self.device, msg.load.max_bytes, spare)
            except INPUT_ERRORS as exc:
                error = f"adapter {msg.load.name!r}: {exc}"

        def write(named) -> None:
            if layout is not None:
                with one_cpu_thread(self.device):  # the transfer's own threads keep the cores busy
                    layout.write(named)

        def write_bucket(i: int, slot: torch.Tensor, metas, more: bool) -> None:
            if layout is not None:  # the last bucket: nothing travels any more, every core copies
                with one_cpu_thread(self.device) if more else contextlib.nullcontext():
                    layout.write_bucket((msg.bucket_bytes, i, slot.data_ptr(), slot.numel()), slot, metas)

        in_place = 0

        def place(metas, total: int) -> Optional[torch.Tensor]:
            nonlocal in_place
            where = None if layout is None else layout.place(metas, total)
            in_place += 0 if where is None else total
            return where

        try:
            if msg.load_format == ROLLOUT_BUCKET:
                # a push that follows a collected version (every push of a training run after the first) has
                # its layout ready at once (the spare's): made before the receives are posted, so the buckets
                # of ``A`` tensors land in their places; otherwise it is made while the first bytes travel
                early = spare is not None
                if early:
                    lay_out()
                receive_buckets(self.update_groups[msg.group_name], specs, msg.bucket_bytes, self.device,
                                msg.group_name, pool=self.lora_pool, posted_first=None if early else lay_out,
                                on_raw=write_bucket, place=place if early else None,
                                window=max(2, LORA_RECEIVE_BYTES // max(1, msg.bucket_bytes)))
            else:
                receive_exact(self.update_groups[msg.group_name], specs, self.device, msg.group_name, write,
                              load_format=msg.load_format, pool=self.receive_pool, chunk_bytes=msg.bucket_bytes,
                              posted_first=lay_out)
        except WeightSizeMismatch as exc:  # the group still stands: only this adapter failed
            error = f"adapter {msg.load.name!r}: {exc}; nothing was loaded"
        except WeightGroupError as exc:
            if not drain_only:
                self._vote(False)
            return WeightResult.fail(self._group_failed(msg.group_name, exc), kind=WeightResult.GROUP)
        if drain_only:
            return WeightResult.fail(f"adapter {msg.load.name!r}: received and dropped")
        plan = None
        if error is None:
            assert layout is not None
            try:
                plan = layout.finish()
            except INPUT_ERRORS as exc:
                error = f"adapter {msg.load.name!r}: {exc}"
        return self._install_lora(msg.load, plan, error, received_in_place_bytes=in_place)

    # ------------------------------------------------------------------ voting, applying

    def _vote(self, ok: bool) -> bool:
        """True only if every TP rank is ok (every rank must call this, in the same order)."""
        if self.tp_state.tp_size == 1:
            return ok
        failures = torch.tensor([0.0 if ok else 1.0], device=self.device)
        self.tp_state.comm.all_reduce(failures)
        return float(failures.item()) == 0.0

    def _released_error(self) -> Optional[str]:
        if self.runner.params.released:
            return "the weights are released: call resume_memory_occupation(['weights']) first"
        return None

    def _apply(self, named_tensors: Iterable, *, strict_dtype: bool, check_finite: bool, partial: bool,
               recapture: bool = False) -> WeightResult:
        error = self._released_error()
        plan = None
        if error is None:
            try:
                plan = plan_load(self.runner.name_map, named_tensors, strict_dtype=strict_dtype,
                                 check_finite=check_finite, require_complete=not partial)
            except (WeightLoadError, OSError, RuntimeError, ValueError) as exc:
                error = str(exc)
        if not self._vote(error is None):
            return WeightResult.fail(error or REJECTED_ELSEWHERE)
        report = apply_load(plan)
        self.runner.after_weights_changed(complete=not partial, force_recapture=recapture,
                                          names=[name for name, _, _ in plan.items])
        return WeightResult.ok(f"loaded {report.num_tensors} tensors", num_bytes=report.num_bytes)

    def _apply_delta(self, header: dict, named) -> WeightResult:
        """A delta push (``rank_delta.DeltaState.apply``): all or nothing on every rank; the weight copies
        kernels keep follow the tensors it changed."""
        error, delta = self._released_error(), None
        if error is None:
            try:
                delta = WeightDelta.from_parts(header, named)
            except ValueError as exc:
                error = str(exc)
        if delta is None:
            self.delta.vote(False)  # the first collective of DeltaState.apply, which the other ranks run
            return WeightResult.fail(error or "no delta")
        result = self.delta.apply(delta)
        if result.success and delta.entries:
            self.runner.after_weights_changed(complete=False, names=sorted(delta.entries))
        return result

    def _receive_delta(self, msg: ReceiveDelta) -> WeightResult:
        """A delta's tensors from the weight-update group (every bucket received, whatever is refused: the
        sender broadcasts them all), then applied as an in-process delta is."""
        error, specs = self._specs(msg)
        if error is not None:  # (no collective ran: every rank sees the same group table and specs)
            return WeightResult.fail(error, kind=self._group_kind(msg.group_name))
        try:
            named = receive_buckets(self.update_groups[msg.group_name], specs, msg.bucket_bytes, self.device,
                                    msg.group_name)
        except WeightSizeMismatch as exc:  # the group still stands: only this delta failed
            self.delta.vote(False)
            return WeightResult.fail(f"{exc}; nothing was written")
        except WeightGroupError as exc:
            self.delta.vote(False)  # the first collective of DeltaState.apply, which the other ranks may run
            return WeightResult.fail(self._group_failed(msg.group_name, exc), kind=WeightResult.GROUP)
        if msg.refuse is not None:
            self.delta.vote(False)
            return WeightResult.fail(msg.refuse, kind=WeightResult.BASE)
        return self._apply_delta(msg.header, named)

    def _receive_sparse(self, msg: ReceiveSparse) -> WeightResult:
        """vLLM's sparse patches off the weight-update group: every transfer received whatever is refused (the
        sender is broadcasting), then written all or nothing (``DeltaState.patch``), or staged into the open
        transaction. A call announcing more than any update of this model could be is refused unreceived."""
        names, counts = tuple(msg.names), tuple(int(k) for k in msg.counts)
        if not (len(counts) == len(names) == len(msg.shapes) == len(msg.dtypes)) or min(counts, default=0) < 0 \
                or len(set(names)) != len(names):
            error, specs = "names, dtype_names, shapes and num_updates_list: as long, names distinct, counts >= 0", []
        else:  # the group's presence and the call's size, checked as a whole push's
            error, specs = self._specs(ReceiveDistributed(
                tuple(f"{n}{s}" for n in names for s in (INDEX_SUFFIX, VALUE_SUFFIX)),
                tuple(x for d in msg.dtypes for x in ("int32", d)), tuple((k,) for k in counts for _ in (0, 1)),
                msg.group_name, 0))
        if error is None:
            got: dict[str, torch.Tensor] = {}
            try:
                receive_exact(self.update_groups[msg.group_name], specs, self.device, msg.group_name,
                              lambda named: got.update((n, v.clone()) for n, v in named), load_format=DIRECT,
                              pool=self.receive_pool)
            except WeightSizeMismatch as exc:  # the group still stands
                error = f"{exc}; nothing was written"
            except WeightGroupError as exc:
                if not msg.stage:
                    self.delta.vote(False)
                return WeightResult.fail(self._group_failed(msg.group_name, exc), kind=WeightResult.GROUP)
        patches = {} if error else {n: (sparse_entry(got[n + INDEX_SUFFIX], got[n + VALUE_SUFFIX]), tuple(shape))
                                    for n, shape in zip(names, msg.shapes)}
        if not msg.stage:
            return self._patch(patches, error or "")
        txn = self.transaction
        error = error or ("" if txn is not None else "no open transaction: call begin_weight_update first")
        error = error or self.delta.refusal({n: e for n, (e, _) in patches.items()},
                                            {n: s for n, (_, s) in patches.items()}) or ""
        if error:
            if txn is not None:
                txn.error = txn.error or error
            return WeightResult.fail(error, kind=self._group_kind(msg.group_name))
        for name, (entry, shape) in patches.items():  # a tensor patched again: in order, the later value wins
            txn.sparse[name] = (merged(txn.sparse[name][0], entry), shape) if name in txn.sparse else (entry, shape)
        return WeightResult.ok(f"received patches of {len(patches)} tensors ({len(txn.sparse)} in the update)")

    def _patch(self, patches: dict[str, tuple[DeltaEntry, tuple[int, ...]]], error: str) -> WeightResult:
        """Write vLLM's sparse patches on every rank or none (``error``: refuse them, voting no)."""
        if error or self._released_error():
            self.delta.vote(False)  # the first collective of DeltaState.patch, which the other ranks may run
            return WeightResult.fail(error or str(self._released_error()))
        result = self.delta.patch({n: e for n, (e, _) in patches.items()}, {n: s for n, (_, s) in patches.items()})
        if result.success:
            self.runner.after_weights_changed(complete=False, names=sorted(patches))
        return result

    def _apply_disk(self, msg: ApplyDisk) -> WeightResult:
        """Read through the folder the engine pinned (``msg.folder``; a spawned rank received the
        descriptor itself), never through the path, which may name another folder by now."""
        if msg.folder is None:
            self._vote(False)
            return WeightResult.fail("a disk update reached this rank without its pinned folder")
        with SafetensorsFolder(msg.folder, follow_links=msg.follow_links) as files:
            try:
                named = list(files.tensors())
            except INPUT_ERRORS as exc:
                self._vote(False)  # the other ranks still vote: they must learn this rank failed
                return WeightResult.fail(str(exc))
            # Checkpoints may be saved in another precision: cast on copy, like the initial load.
            return self._apply(named, strict_dtype=False, check_finite=msg.check_finite, partial=False,
                               recapture=msg.recapture_cuda_graph)

    def _with_bucket(self, handle: dict, use, vote: bool) -> WeightResult:
        """Open a sender's bucket (shared memory or CUDA IPC), hand its (name, view) pairs to
        ``use``, wait for the copies out of it (the sender reuses the buffer), close it. A handle
        that cannot be opened fails here (after voting no, when the operation votes)."""
        try:
            if not isinstance(handle, dict):
                raise TypeError(f"a bucket handle is a dict, got {type(handle).__name__}")
            opened = open_bucket(handle, self.tp_state.tp_rank)
        except (ValueError, KeyError, TypeError, OSError, RuntimeError) as exc:
            kind = handle.get("kind", "shared_memory") if isinstance(handle, dict) else "bucket"
            message = f"cannot read the {kind} bucket: {exc}"
            if vote:
                self._vote(False)
            elif self.transaction is not None:
                self.transaction.error = self.transaction.error or message
            return WeightResult.fail(message)
        try:
            out = use(opened.named_tensors)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return out
        finally:
            opened.close()

    # ------------------------------------------------------------------ multi-call transactions

    def _stage(self, named_tensors, copy: bool) -> WeightResult:
        txn = self.transaction
        if txn is None:
            return WeightResult.fail("no open transaction: call begin_weight_update first")
        named = list(named_tensors)
        try:  # names, shapes and dtypes fail early; finiteness and coverage are checked at commit
            self._check_new(txn, named)
        except (WeightLoadError, ValueError) as exc:
            txn.error = txn.error or str(exc)
            return WeightResult.fail(str(exc))
        for name, t in named:
            txn.staged[name] = t.to(self.device, copy=True) if copy else t
        return WeightResult.ok(f"staged {len(named)} tensors ({len(txn.staged) + len(txn.in_shadow)} in the transaction)")

    def _check_new(self, txn: Transaction, named: list) -> None:
        """Names, shapes and dtypes of tensors joining ``txn``, none of them given before."""
        plan_load(self.runner.name_map, named, strict_dtype=True, require_complete=False)
        dup = sorted(set(n for n, _ in named) & (set(txn.staged) | set(txn.in_shadow)))
        if dup:
            raise WeightLoadError(f"weights given twice in one transaction: {', '.join(dup[:8])}")

    def _shadow_taken(self, by: str) -> None:
        """Something else writes or frees the shadow: an open transaction that received into it is void."""
        txn = self.transaction
        if txn is not None and txn.in_shadow and txn.error is None:
            txn.error = f"{by} during the open transaction replaced what it had received; begin it again"

    def _commit_transaction(self, msg: CommitTransaction) -> WeightResult:
        txn, self.transaction = self.transaction, None
        if txn is None or txn.error is not None:
            self._vote(False)
            why = "no open transaction: call begin_weight_update first" if txn is None else txn.error
            return WeightResult.fail(f"transaction discarded: {why}")
        if txn.sparse:
            return self._patch(txn.sparse, "" if not (txn.staged or txn.in_shadow) else
                               "a transaction takes whole tensors or vLLM's sparse patches, not both")
        if not txn.in_shadow:
            return self._apply(list(txn.staged.items()), strict_dtype=True, check_finite=msg.check_finite,
                               partial=msg.partial)
        return self._commit_shadow_transaction(txn, msg)

    def _commit_shadow_transaction(self, txn: Transaction, msg: CommitTransaction) -> WeightResult:
        """Buckets received into the shadow (checked for NaN/Inf as they arrived) plus anything staged
        in process: a complete update makes the shadow live (on CPU the buffers trade memory: no
        copy); a partial one copies just its tensors out of the shadow."""
        runner, name_map = self.runner, self.runner.name_map
        error = self._released_error()
        if error is None:
            try:
                received = [(n, torch.empty(shape, dtype=d, device="meta")) for n, (d, shape) in txn.in_shadow.items()]
                plan_load(name_map, received + list(txn.staged.items()), strict_dtype=True,
                          require_complete=not msg.partial)
                bad = nonfinite_names(txn.staged.items()) if msg.check_finite else []
                if bad:
                    raise WeightLoadError(rejection_message([f"{n}: contains NaN or Inf values" for n in bad]))
            except (WeightLoadError, ValueError) as exc:
                error = str(exc)
        if not self._vote(error is None):
            return WeightResult.fail(error or REJECTED_ELSEWHERE)
        where = None if msg.partial else runner.params.shadow_view
        copy_slices([(t, name_map[n].slice) for n, t in txn.staged.items()], where=where)
        if msg.partial:
            for name in txn.in_shadow:
                dst = name_map[name].slice.dst
                dst.copy_(runner.params.shadow_view(dst))
        else:
            runner.params.commit_shadow()
        runner.after_weights_changed(complete=not msg.partial, names=[*txn.staged, *txn.in_shadow])
        nbytes = sum(d.itemsize * math.prod(shape) for d, shape in txn.in_shadow.values()) + sum(
            t.numel() * t.element_size() for t in txn.staged.values())
        return WeightResult.ok(f"loaded {len(txn.in_shadow) + len(txn.staged)} tensors", num_bytes=nbytes)

    # ------------------------------------------------------------------ weight-update groups

    def _init_group(self, msg: InitUpdateGroup) -> WeightResult:
        """Start joining the group on a thread of its own (the rendezvous waits for the trainer for up to
        the group's timeout; the rank keeps serving steps meanwhile); ``AwaitUpdateGroup`` collects it."""
        if msg.group_name in self.update_groups or msg.group_name in self.joining_groups:
            return WeightResult.fail(f"weight update group {msg.group_name!r} already exists; destroy it first")
        if len(self.update_groups) + len(self.joining_groups) >= MAX_UPDATE_GROUPS:
            return WeightResult.fail(f"{len(self.update_groups) + len(self.joining_groups)} weight update groups are "
                                     f"open (at most {MAX_UPDATE_GROUPS}): destroy one first")
        backend = msg.backend or ("nccl" if self.device.type == "cuda" else "gloo")
        rank = msg.rank_offset + self.tp_state.tp_rank
        joining = _JoiningGroup(f"joined weight update group {msg.group_name!r} as rank {rank}/{msg.world_size}")

        def join() -> None:
            try:
                joining.group = make_group(msg.master_address, msg.master_port, rank, msg.world_size, backend,
                                           msg.timeout_s, msg.group_name, msg.trainer_rank)
            except WeightGroupError as exc:
                joining.error = str(exc)

        joining.thread = threading.Thread(target=join, name=f"join-{msg.group_name}", daemon=True)
        joining.thread.start()
        self.joining_groups[msg.group_name] = joining
        return WeightResult.ok(f"joining weight update group {msg.group_name!r}", pending=True)

    def _await_group(self, group_name: str) -> WeightResult:
        joining = self.joining_groups.get(group_name)
        if joining is None:
            if group_name in self.update_groups:
                return WeightResult.ok(f"weight update group {group_name!r} stands")
            return WeightResult.fail(f"no weight update group {group_name!r} is being joined")
        if joining.thread.is_alive():
            return WeightResult.ok(f"joining weight update group {group_name!r}", pending=True)
        del self.joining_groups[group_name]
        if joining.group is None:
            return WeightResult.fail(joining.error or f"weight update group {group_name!r}: the join failed")
        self.update_groups[group_name] = joining.group
        return WeightResult.ok(joining.done)

    def _specs(self, msg) -> tuple[Optional[str], list]:
        """(error, [(name, dtype, shape)]) of a distributed message."""
        if msg.group_name not in self.update_groups:
            return f"no weight update group {msg.group_name!r}: call init_weights_update_group first", []
        if not (len(msg.names) == len(msg.dtypes) == len(msg.shapes)):
            return "names, dtypes and shapes must have the same length", []
        last = self.last_specs  # the same call as the last one (a trainer's every step): its very tuples, or
        # equal ones from another process (compared element by element: microseconds, not a parse)
        if last is not None and msg.names == last[0] and msg.dtypes == last[1] and msg.shapes == last[2]:
            return None, last[3]
        try:
            specs = _parse_specs(tuple(msg.names), tuple(msg.dtypes), tuple(tuple(s) for s in msg.shapes))
        except (ValueError, TypeError) as exc:
            return str(exc), []
        announced = sum(d.itemsize * math.prod(shape) for _, d, shape in specs)
        limit = 4 * self.runner.params.nbytes() * self.tp_state.tp_size + ANNOUNCE_SLACK_BYTES
        if announced > limit:
            # a refused call is drained, and draining posts buffers of what was announced: this much could
            # not be, so the group cannot be kept in step with the sender
            self.update_groups.pop(msg.group_name, None)
            return (f"the call announces {announced} bytes, more than any update of this model ({limit} bytes at "
                    f"most): refused without receiving; group {msg.group_name!r} was torn down (its sender's "
                    "broadcasts fail), re-initialise it"), []
        if type(msg.names) is tuple and type(msg.dtypes) is tuple and type(msg.shapes) is tuple and \
                all(type(s) is tuple for s in msg.shapes):  # immutable: safe to compare against later
            self.last_specs = (msg.names, msg.dtypes, msg.shapes, specs)
        return None, specs

    def _group_kind(self, group_name: str) -> Optional[str]:
        """``WeightResult.GROUP`` when this rank has no such group (never joined, or torn down after a
        failure): the sender must rebuild it, not fix its request."""
        return None if group_name in self.update_groups else WeightResult.GROUP

    def _group_failed(self, group_name: str, exc: WeightGroupError) -> str:
        self.update_groups.pop(group_name, None)  # tear down only this group; re-initialising it works
        return f"{exc}; the group was torn down, re-initialise it"

    def _stage_distributed(self, msg: StageDistributed) -> WeightResult:
        """A bucket call of a multi-call transaction: receive its buckets straight into the shadow
        weights (checked for NaN/Inf while the sender gathers the next); a refused call still
        drains what the sender broadcasts, so the group keeps working."""
        error, specs = self._specs(msg)
        txn = self.transaction
        if error is not None:  # nothing can be received without the group and specs
            if txn is not None:
                txn.error = txn.error or error
            return WeightResult.fail(error, kind=self._group_kind(msg.group_name))
        rejected = self._released_error()
        if txn is None:
            rejected = "no open transaction: call begin_weight_update first"
        elif rejected is None:
            try:
                self._check_new(txn, [(n, torch.empty(shape, dtype=d, device="meta")) for n, d, shape in specs])
            except (WeightLoadError, ValueError) as exc:
                rejected = str(exc)
        rejected, _, kind = self._receive_into_shadow(msg, specs, rejected, check_finite=True)
        if rejected is not None:
            if txn is not None:
                txn.error = txn.error or rejected
            return WeightResult.fail(rejected, kind=kind)
        txn.in_shadow.update((n, (d, tuple(shape))) for n, d, shape in specs)
        return WeightResult.ok(f"received {len(specs)} tensors ({len(txn.staged) + len(txn.in_shadow)} in the "
                               "transaction)")

    def _receive(self, msg: ReceiveDistributed) -> WeightResult:
        """Receive the sender's buckets (a sender can die midway, so nothing live is touched until
        every rank has everything): names, shapes, dtypes and coverage are validated before the
        first byte; each bucket is written into the shadow weights as it lands, while the next is
        on the wire; a unanimous vote makes the shadow live."""
        t_start = time.perf_counter()
        error, specs = self._specs(msg)
        placed_bytes, kind = 0, self._group_kind(msg.group_name)
        if error is None:
            rejected = self._released_error()
            if rejected is None:
                try:
                    plan_load(self.runner.name_map, [(n, torch.empty(s, dtype=d, device="meta")) for n, d, s in specs],
                              strict_dtype=True, require_complete=not msg.partial)
                except WeightLoadError as exc:
                    rejected = str(exc)
            if rejected is None:
                self._shadow_taken("an update outside it")
                if msg.partial:
                    self.runner.params.prepare_shadow()
            error, placed_bytes, kind = self._receive_into_shadow(msg, specs, rejected, msg.check_finite)
        t_received = time.perf_counter()
        if not self._vote(error is None):
            return WeightResult.fail(error or REJECTED_ELSEWHERE, kind=kind)
        self.runner.params.commit_shadow()
        self.runner.after_weights_changed(complete=not msg.partial, names=[n for n, _, _ in specs])
        nbytes = sum(d.itemsize * math.prod(s) for _, d, s in specs)
        return WeightResult.ok(f"loaded {len(specs)} tensors", num_bytes=nbytes, receive_s=t_received - t_start,
                               commit_s=time.perf_counter() - t_received, received_in_place_bytes=placed_bytes)

    def _receive_into_shadow(self, msg, specs: list, rejected: Optional[str],
                             check_finite: bool) -> tuple[Optional[str], int, Optional[str]]:
        """Receive every bucket; write it into the shadow weights unless the update is already
        ``rejected`` (then it is only drained, so the sender still completes).
        Returns (error, bytes received in place, the failure's kind: ``WeightResult.GROUP`` when the
        group itself broke, else None)."""
        runner = self.runner
        name_map = runner.name_map
        nonfinite: list[str] = []
        placed_bytes = 0

        def place(metas, total):
            """The shadow's bytes for this bucket when its tensors lie there exactly as the bucket
            lays them out (whole tensors of one dtype, no TP slicing): received in place."""
            if rejected is not None:
                return None
            slices = [name_map[m.name].slice for m in metas]
            if any(sl.dim is not None or sl.zero_tail is not None for sl in slices):
                return None
            if contiguous_run([sl.dst for sl in slices], metas, total, tail_padding_ok=False) is None:
                return None
            return runner.params.shadow_bytes(slices[0].dst, total)

        def write_bucket(named, placed: bool):
            nonlocal placed_bytes
            if rejected is not None:
                return
            if check_finite:
                nonfinite.extend(nonfinite_names(named))
            if placed:
                placed_bytes += sum(v.numel() * v.element_size() for _, v in named)
                return
            with one_cpu_thread(self.device):  # the transfer's own threads keep the cores busy
                copy_slices([(view, name_map[name].slice) for name, view in named], where=runner.params.shadow_view)

        try:
            if msg.load_format == ROLLOUT_BUCKET:
                receive_buckets(self.update_groups[msg.group_name], specs, msg.bucket_bytes, self.device,
                                msg.group_name, write_bucket, pool=self.receive_pool, place=place,
                                point_to_point=msg.point_to_point)
            else:  # SGLang's layouts: per tensor, or flattened in the call's order
                receive_exact(self.update_groups[msg.group_name], specs, self.device, msg.group_name,
                              lambda named: write_bucket(named, False), load_format=msg.load_format,
                              pool=self.receive_pool, chunk_bytes=msg.bucket_bytes)
        except WeightSizeMismatch as exc:  # the group still stands: only this update failed
            return f"{exc}; nothing was loaded", 0, None
        except WeightGroupError as exc:
            return self._group_failed(msg.group_name, exc), 0, WeightResult.GROUP
        if rejected is None and nonfinite:
            rejected = rejection_message([f"{n}: contains NaN or Inf values" for n in nonfinite])
        return rejected, placed_bytes, None

    def _probe(self, msg: ProbeUpdateGroup) -> WeightResult:
        group = self.update_groups.get(msg.group_name)
        if group is None:
            return WeightResult.fail(f"no weight update group {msg.group_name!r}")
        need = max(msg.nbytes, sum(msg.sizes))
        if self.probe_buffer is None or self.probe_buffer.numel() < need:  # reused, like receive buffers (a
            # smaller probe between two large ones — a benchmark's start signal — takes its first bytes)
            self.probe_buffer = torch.empty(need, dtype=torch.uint8, device=self.device)
        buffer = self.probe_buffer[:need]
        t0 = time.perf_counter()
        if msg.sizes:  # one bare broadcast per tensor, all posted at once
            opts = dist.BroadcastOptions()
            opts.rootRank = group.src
            offsets = [0, *itertools.accumulate(msg.sizes)]
            works = [group.pg.broadcast([buffer[a:b]], opts) for a, b in zip(offsets, offsets[1:])]
            for work in works:
                group.wait(work)
        else:
            broadcast(group, buffer, group.src)
        return WeightResult.ok("probe received", num_bytes=msg.nbytes, value=time.perf_counter() - t0)

    # ------------------------------------------------------------------ reading weights back

    def full_weight(self, name: str, clone: bool = True) -> torch.Tensor:
        """The full Hugging Face tensor ``name`` (collective over the TP group); ``clone=False`` may
        return a view of the live parameter (for a read that copies only what it keeps)."""
        target = self.runner.name_map[name]
        param = target.param
        local = param.local_part(param, target.shard_id) if hasattr(param, "local_part") else param.data
        if self.tp_state.tp_size == 1:
            parts = [local]
        else:
            parts = self.tp_state.comm.all_gather(local.contiguous(), self.tp_state.tp_size)
        full = param.full_from_parts(parts, target.shard_id) if hasattr(param, "full_from_parts") else parts[0]
        return full.detach().clone() if clone else full.detach()

    def _read(self, msg: ReadWeight) -> WeightResult:
        # every rank sees the same name and state, so every rank refuses alike (no collective runs)
        error = self._released_error()
        if error is None and msg.name not in self.runner.name_map:
            error = f"unknown weight name {msg.name!r}"
        if error is not None:
            return WeightResult.fail(error)
        values = self.full_weight(msg.name, clone=False).flatten()[: msg.truncate_size].float().cpu().tolist()
        return WeightResult.ok(f"read {msg.name}", value=values)

    def _checksum(self) -> WeightResult:
        error = self._released_error()
        if error is not None:
            return WeightResult.fail(error)
        names = canonical_names(self.runner.name_map)
        return WeightResult.ok("checksum", value=checksum_named_tensors((n, self.full_weight(n)) for n in names))
