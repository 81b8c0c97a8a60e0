"""``RolloutEngine``: the public entry point.

The engine owns a background loop (``EngineLoop``) that owns the scheduler; ``generate``,
``async_generate`` and every control call are its clients. Input is validated in the caller's
thread (``Admission``): a bad request raises there and never reaches the batch. Weight operations
(SGLang's names) build a typed message (``rollout.worker.messages``) and hand it to ``EngineWeights``,
which runs it on every TP rank at the right point of the loop and publishes what committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Optional, Union

import torch

from rollout.config import EngineConfig, InputError
from rollout.engine.admission import Admission, PromptIds
from rollout.engine.lifecycle import Opener, Transaction, WeightUpdateLifecycle
from rollout.engine.loop import EngineDeadError, EngineLoop
from rollout.engine.lora import EngineLora
from rollout.engine.tokenizer import apply_chat_template, eos_token_ids, load_tokenizer, make_detokenizer
from rollout.engine.weights import EngineWeights, check_memory_tags, read_patch
from rollout.models import ModelConfig
from rollout.outputs import RolloutOutput, WeightResult
from rollout.sampling_params import SamplingParams
from rollout.scheduler.request import Request, Sequence
from rollout.scheduler.scheduler import Scheduler
from rollout.weights.loader import WeightLoadError
from rollout.weights.safetensors_io import PinnedFolder
from rollout.worker.messages import (
    ApplyDisk,
    ApplyHandle,
    AwaitUpdateGroup,
    BarrierUpdateGroup,
    CommitTransaction,
    DestroyUpdateGroup,
    InitUpdateGroup,
    ProbeUpdateGroup,
    ReadWeight,
    ReceiveDistributed,
    ReceiveSparse,
    ResumeMemory,
    StageDistributed,
    StageHandle,
    WeightsChecksum,
)
from rollout.worker.tp_external import ExternalLeaderWorker, ExternalTp
from rollout.worker.tp_group import TpWorkerGroup
from rollout.worker.tp_worker import TpModelWorker
from weight_sync.bucket import FlattenedTensorBucket
from weight_sync.delta import WeightDelta
from weight_sync.distributed import (
    DEFAULT_BUCKET_BYTES,
    DIRECT,
    LOAD_FORMATS,
    PACKED,
    ROLLOUT_BUCKET,
    VLLM_PACKED_BUFFER_BYTES,
)

logger = logging.getLogger(__name__)

__all__ = ["RolloutEngine", "EngineDeadError"]

PAUSE_MODES = ("abort", "retract", "in_place")


def run_on_own_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a thread that ends when it returns (its exception re-raised here).

    On CPU every thread that runs parallel torch ops owns an OpenMP thread team, and while a
    process holds more OpenMP threads than CPUs, libgomp stops spinning between parallel regions:
    each region then waits for a futex wake-up (measured here: a SmolLM2 decode step 30 -> 50 ms at
    batch 1, 165 -> 260 ms at batch 64). The engine computes on its loop thread; building its
    weights on a thread that ends (its team goes with it) keeps the caller's thread from holding a
    second team — as long as the caller itself runs no parallel torch work (see benchmarks/NOTES.md)."""
    out: dict[str, Any] = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as exc:  # re-raised in the caller
            out["error"] = exc

    t = threading.Thread(target=target, name="rollout-engine-build")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


class CallSpecs:
    """A distributed call's names, dtypes and shapes as the ranks take them: tuples of ``str``, ``str``
    and tuples of ``int``. A trainer sends the same lists every step, so the last lists given and what
    they became are kept, and lists equal to them (compared element by element: a few microseconds for an
    adapter's 420 tensors, where converting them again takes ~0.14 ms of a ~5 ms push) give the very
    same tuples, which the ranks then recognise too (``RankWeights._specs``)."""

    _KINDS = (list, tuple)

    def __init__(self):
        self._last: Optional[tuple] = None  # (copies of the lists given, the tuples made of them)

    def __call__(self, names, dtypes, shapes) -> tuple[tuple, tuple, tuple]:
        last = self._last
        if last is not None and self._same(last[0], (names, dtypes, shapes)):
            return last[1]
        try:
            made = (tuple(map(str, names)), tuple(map(str, dtypes)), tuple(tuple(map(int, s)) for s in shapes))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"names, dtypes and shapes must be lists (shapes: lists of ints): {exc}") from None
        if type(names) in self._KINDS and type(dtypes) in self._KINDS and type(shapes) in self._KINDS:
            # copies: a caller may change its lists in place before the next call
            kept = (list(names), list(dtypes), [list(s) if type(s) is list else s for s in shapes])
            if all(type(x) is str for x in kept[0]) and all(type(s) in (list, tuple, torch.Size) for s in kept[2]):
                self._last = (kept, made)
        return made

    @classmethod
    def _same(cls, kept: tuple, given: tuple) -> bool:
        if any(type(g) not in cls._KINDS or len(g) != len(k) for k, g in zip(kept, given)):
            return False
        try:  # list == list: element by element, equal objects first compared by identity
            return all(list(g) == k if type(g) is tuple else g == k for k, g in zip(kept, given))
        except (TypeError, ValueError):  # elements that do not compare to a bool (arrays): not the same
            return False


class _LatestUpdates:
    """A stream's updates, coalesced on the caller's event loop: per sample only the newest snapshot
    waits (each holds the whole output so far), so a reader that falls behind skips snapshots instead
    of piling them up, and memory stays one snapshot per sample however slow it reads. The final
    snapshot (``finish_reason`` set) is never skipped: nothing newer can replace it."""

    def __init__(self):
        self._latest: dict = {}  # (id(request), sample index) -> newest snapshot, in first-seen order
        self._finals: list[int] = []
        self._ready = asyncio.Event()

    def put(self, req, outs: list, final: bool) -> None:
        for o in outs:
            self._latest[(id(req), o.sample_index)] = o
        if final:
            self._finals.append(id(req))
        self._ready.set()

    async def take(self) -> tuple[list, list[int]]:
        """(the snapshots waiting, the requests whose final update is among them), once there are any."""
        await self._ready.wait()
        self._ready.clear()
        outs, finals = list(self._latest.values()), self._finals
        self._latest, self._finals = {}, []
        return outs, finals


class RolloutEngine:
    def __init__(self, model_path: str, tp_size: int = 1, dtype: str = "auto", device: str = "auto",
                 seed: int = 0, **kwargs: Any):
        self.config = EngineConfig.from_kwargs(model_path, tp_size=tp_size, dtype=dtype, device=device,
                                               seed=seed, **kwargs)
        model_config = ModelConfig.from_pretrained(model_path)
        model_config.check_tp_size(self.config.tp_size)  # before spawning anything
        if self.config.outputs.return_routed_experts and not model_config.num_experts:
            raise ValueError(f"enable_return_routed_experts: {model_path} has no mixture-of-experts layers, so no "
                             f"experts are routed")
        self._ext: Optional[ExternalTp] = None
        self._loop: Optional[EngineLoop] = None
        self._weights: Optional[EngineWeights] = None
        if self._use_external_launch() and self.config.tp_size > 1:
            self._ext = ExternalTp(self.config)  # SPMD: this rank computes on its caller's thread
            self.worker = ExternalLeaderWorker(self._ext) if self._ext.is_leader else self._ext.worker
        else:
            build = TpModelWorker if self.config.tp_size == 1 else TpWorkerGroup
            on_cpu = self.config.resolve_device().type == "cpu"
            self.worker = run_on_own_thread(lambda: build(self.config)) if on_cpu else build(self.config)
        self.model_config = self.worker.model_config
        self.tokenizer = load_tokenizer(self.config.tokenizer_path or model_path)
        self._detokenize = make_detokenizer(self.tokenizer)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.model_config.eos_token_ids)
        self.scheduler = Scheduler(self.config, self.worker, self.eos_token_ids, self._detokenize)
        defaults = self.model_config.generation_defaults if self.config.use_generation_config else {}
        self._admission = Admission(self.config, self.model_config, self.worker, self.tokenizer, self._detokenize,
                                    defaults, self.eos_token_ids)
        # an external-launch follower runs the leader's steps inside generate(): no loop thread
        self._loop = EngineLoop(self.scheduler, self.worker.model_runner.memory_error, start=not self.is_follower)
        self._weights = EngineWeights(self.worker, self.scheduler, self._loop,
                                      ranks_in_other_processes=isinstance(self.worker, TpWorkerGroup),
                                      stage_paused_updates=self.config.stage_paused_updates,
                                      transaction_timeout_s=self.config.weight_update_timeout_s)
        self._call_specs = CallSpecs()
        self._lora = EngineLora(self.worker, self.scheduler, self._loop, self._weights, self.config.lora.max_rank,
                                self.config.lora.max_memory_mb)
        if not self.is_follower:
            logger.info("engine ready: %s", self.worker.model_runner.describe())

    def _use_external_launch(self) -> bool:
        import torch.distributed as dist

        if self.config.launch == "external":
            return True
        return self.config.launch == "auto" and dist.is_available() and dist.is_initialized()

    @property
    def is_follower(self) -> bool:
        """An external-launch rank other than its engine's leader (it runs no scheduler)."""
        return self._ext is not None and not self._ext.is_leader

    # ------------------------------------------------------------------ what callers may read

    @property
    def tp_size(self) -> int:
        return self.config.tp_size

    @property
    def dtype(self) -> torch.dtype:
        return self.worker.model_runner.dtype

    @property
    def device(self) -> torch.device:
        return self.worker.model_runner.device

    @property
    def group_ranks(self) -> int:
        """The ranks this engine joins a weight-update group with (its TP ranks)."""
        return self.config.tp_size

    @property
    def address(self) -> str:
        """How a trainer's errors name this engine."""
        return f"in-process engine {id(self):#x}"

    def serving_replicas(self) -> int:
        """Replicas serving behind this engine: itself (a router over several says how many)."""
        return 1

    def take_replica_failures(self) -> list[str]:
        """Replica failures since the last call: none for one engine (its own errors raise)."""
        return []

    def health(self) -> bool:
        """Whether the engine loop still runs (an in-process engine's ``/health``)."""
        try:
            self._loop.check_alive()
        except EngineDeadError:
            return False
        return True

    def memory_nbytes(self) -> dict[str, int]:
        """Bytes this rank's engine holds as whole buffers: {"weights": ..., "weight_copies": ... (the
        packed / fp32 copies the CPU GEMM kernels read), "kv_cache": ..., "lora_adapters": ...}."""
        runner = self.worker.model_runner
        return {"weights": runner.weights_nbytes(), "weight_copies": runner.weight_copies_nbytes(),
                "kv_cache": runner.kv_nbytes(), "lora_adapters": runner.lora_nbytes()}

    def cpu_kernels(self) -> Optional[dict]:
        """What this CPU has and which kernels the engine runs because of it (None off the CPU)."""
        runner = self.worker.model_runner
        if runner.device.type != "cpu":
            return None
        from rollout.kernels.cpu.capability import cpu_capability

        return {"capability": cpu_capability().as_dict(), "gemm_plans": runner.gemm_plans.describe(),
                "paged_attention": runner.use_paged_kernel}

    def storage_moved(self) -> list[str]:
        """Parameters / KV whose storage moved since CUDA graphs were captured (empty: none, or no graphs)."""
        return self.worker.model_runner.storage_moved()

    def worker_pids(self) -> list[int]:
        """Process ids of the spawned TP ranks (empty for TP=1 and external launch)."""
        return self.worker.worker_pids() if isinstance(self.worker, TpWorkerGroup) else []

    # ------------------------------------------------------------------ generation

    def _check_ready(self) -> None:
        self._loop.check_alive()
        error = self.worker.model_runner.memory_error()
        if error is not None:
            raise RuntimeError(error)

    def generate(self, prompts: Union[str, list[str], None] = None,
                 input_ids: Union[PromptIds, list[PromptIds], None] = None,
                 sampling_params: Union[SamplingParams, dict, list, None] = None, return_logprob: bool = True,
                 top_logprobs_num: int = 0, logprob_start_len: int = -1,
                 rid: Union[str, list[str], None] = None,
                 return_sampling_mask: Optional[bool] = None, cache_salt: Optional[str] = None,
                 session_id: Union[str, list[Optional[str]], None] = None,
                 lora_path: Union[str, list[Optional[str]], None] = None, return_routed_experts: bool = False,
                 routed_experts_start_len: int = 0) -> list[RolloutOutput]:
        """Generate for every prompt; returns a flat, prompt-major list (prompt 0's n samples first).

        ``return_sampling_mask`` (default: the engine's option): every output token also carries the
        sorted ids that survived the processors (``output_token_sampling_mask``) and its logprob
        renormalised over them (``output_token_sampling_logprobs``), for trainer-side replay
        (``trainer_bridge.replay``). ``cache_salt`` (vLLM's): the request reuses and leaves cached KV
        only among requests with the same salt (prefix-cache partitions, e.g. one per policy version).
        ``session_id`` (``open_session``): a turn of that session — the prompt is the tokens it appends
        to the session's history, the engine generates after the whole history (its KV kept between
        turns) and the turn's output reports the history as ``prompt_token_ids``. A list: one entry per
        prompt (None: not a turn), so that one call advances many sessions by a turn each, batched.
        ``lora_path`` (SGLang's name): the name of a loaded LoRA adapter (``load_lora_adapter``) the
        prompts run on, or a list with one entry per prompt (None: the base weights); one batch serves
        any mix. A request runs to its end on the adapter version it started on.
        ``return_routed_experts`` (MoE models, an engine with ``enable_return_routed_experts``; SGLang's names):
        each output's ``routed_experts``, the experts every layer routed positions
        [``routed_experts_start_len``, prompt + outputs - 1) to.
        External launch: every rank of the engine calls this with the same arguments."""
        # Validation raises here, alike on every rank of an external launch, before any step runs.
        self._check_ready()
        reqs = self._admission.make_requests(prompts, input_ids, sampling_params, return_logprob, top_logprobs_num,
                                             logprob_start_len, rid, return_sampling_mask=return_sampling_mask,
                                             cache_salt=cache_salt, session_id=session_id, lora_path=lora_path,
                                             return_routed_experts=return_routed_experts,
                                             routed_experts_start_len=routed_experts_start_len)
        if self.is_follower:
            return self._ext.follow()
        if self._ext is None:
            return self._run_requests(reqs)
        try:
            outs = self._run_requests(reqs)
        except BaseException as exc:
            error = repr(exc)
            self._loop.call(lambda: self.worker.send_done(None, error))
            raise
        self._loop.call(lambda: self.worker.send_done(outs))
        return outs

    def _run_requests(self, reqs: list[Request]) -> list[RolloutOutput]:
        for r in reqs:
            self._loop.submit(r)
        deadline = None if self.config.request_timeout_s is None else time.monotonic() + self.config.request_timeout_s
        try:
            for r in reqs:
                while not r.done.wait(0.5):
                    if self._loop.fatal is not None:
                        break
                    self._loop.check_alive()
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError(f"request {r.rid} did not finish in {self.config.request_timeout_s}s")
        except BaseException:
            for r in reqs:
                self._loop.abort(r.rid)
            raise
        return self._admission.outputs(reqs, self.scheduler.weight_version)

    def score(self, input_ids, output_ids, sampling_params: Union[SamplingParams, dict, list, None] = None,
              return_sampling_mask: bool = True, top_logprobs_num: int = 0,
              rid: Union[str, list[str], None] = None) -> list[RolloutOutput]:
        """Replayed scoring: for each prompt, the given ``output_ids`` scored under ``sampling_params``
        exactly as generation would have reported them — processed logprobs (``output_logprobs``), the
        sampling masks and renormalised logprobs — without sampling (one prefill over prompt + outputs).
        For re-scoring a rollout after the fact, or checking an engine against a trainer."""
        if self._ext is not None:
            raise ValueError("score() is not available under external launch")
        self._check_ready()
        reqs = self._admission.make_score_requests(input_ids, output_ids, sampling_params, return_sampling_mask,
                                                   top_logprobs_num, rid)
        return self._run_requests(reqs)

    async def async_generate(self, prompts=None, input_ids=None, sampling_params=None, return_logprob: bool = True,
                             top_logprobs_num: int = 0, logprob_start_len: int = -1, rid=None,
                             stream: bool = False, return_sampling_mask: Optional[bool] = None,
                             cache_salt: Optional[str] = None,
                             session_id: Union[str, list[Optional[str]], None] = None,
                             lora_path: Union[str, list[Optional[str]], None] = None,
                             return_routed_experts: bool = False, routed_experts_start_len: int = 0):
        """Awaitable ``generate``. With ``stream=True`` returns an async iterator of partial
        ``RolloutOutput`` snapshots (one per sample and step; the last one has ``finish_reason``)."""
        if self._ext is not None:
            raise ValueError("with external launch every rank calls generate() (SPMD); async_generate is not available")
        loop = asyncio.get_running_loop()
        updates = _LatestUpdates()

        def on_update(req: Request, seqs: list[Sequence]) -> None:
            final = req.done.is_set()  # read here, in order with the updates: the last one is final
            if not stream and not final:
                return  # only the end matters: no wake-up of the caller's event loop per step
            outs = [self._admission.to_output(req, s, self.scheduler.weight_version) for s in seqs] if stream else []
            loop.call_soon_threadsafe(updates.put, req, outs, final)

        self._check_ready()
        reqs = self._admission.make_requests(prompts, input_ids, sampling_params, return_logprob, top_logprobs_num,
                                             logprob_start_len, rid, on_update, return_sampling_mask, cache_salt,
                                             session_id, lora_path, return_routed_experts=return_routed_experts,
                                             routed_experts_start_len=routed_experts_start_len)
        for r in reqs:
            self._loop.submit(r)

        async def events():
            by_id = {id(r): r for r in reqs}
            pending = set(by_id)
            try:
                while pending:
                    outs, finals = await updates.take()
                    for o in outs:
                        yield o
                    pending.difference_update(finals)
                    refused = next((by_id[f].error for f in finals if by_id[f].error is not None), None)
                    if stream and refused is not None:  # a stream says why (the whole answer raises it below)
                        raise refused
            finally:
                for r in reqs:
                    if not r.done.is_set():
                        self._loop.abort(r.rid)

        if stream:
            return events()
        async for _ in events():  # drain until every request reports its final update
            continue
        return self._admission.outputs(reqs, self.scheduler.weight_version)

    # ------------------------------------------------------------------ control

    def abort_request(self, rid: Optional[str] = None, abort_all: bool = False, prefix: bool = False) -> None:
        """Abort one request (its partial outputs are returned with finish_reason "abort"), every
        request whose id starts with ``rid`` (``prefix``, miles' multi-LoRA abort), or all."""
        if rid is None and not abort_all:
            raise ValueError("pass rid, or abort_all=True")
        if prefix and not abort_all and not rid:
            raise ValueError("a prefix abort needs a non-empty rid (or abort_all=True)")
        self._loop.abort(None if abort_all else rid, prefix)

    def flush_cache(self, only_when_idle: bool = False) -> bool:
        """Drop the prefix cache (blocks no request holds). ``only_when_idle`` (the HTTP route, as
        SGLang's): refused (False) while requests run, or wait while generation is not paused —
        clients poll it until it succeeds to learn the engine has drained."""
        def flush() -> bool:
            sched = self.scheduler
            if only_when_idle and sched.has_work() and (sched.running or not self._loop.paused):
                return False
            sched.flush_cache()
            return True

        return self._loop.call(flush)

    def pause_generation(self, mode: str = "abort") -> None:
        """abort: abort running requests; retract: send them back to the queue (KV dropped, recomputed
        later); in_place: keep them and their KV. New requests queue until ``continue_generation``."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode={mode!r}: use one of {PAUSE_MODES}")

        def pause():
            if mode == "abort":
                self.scheduler.abort(None)
            elif mode == "retract":
                self.scheduler.retract_all()
            self._loop.paused = True
        self._loop.call(pause)

    def pause_when_idle(self):
        """vLLM's ``pause?mode=wait``: a pause that takes effect once no request runs or waits (the engine
        loop's quiet point; nothing is aborted). Returns at once with the pending call: its ``done`` event is
        set when the engine is paused; ``cancel()`` withdraws it while it waits (True: nothing was paused)."""
        def pause():
            self._loop.paused = True
        return self._loop.post(pause, quiet=True)

    # ------------------------------------------------------------------ sessions (rollout.scheduler.sessions)

    def open_session(self, session_id: Optional[str] = None, timeout_s: Optional[float] = None) -> str:
        """A conversation whose token history and KV the engine keeps between turns (``generate(...,
        session_id=)``); closed by ``close_session`` or after ``timeout_s`` idle (default: the
        engine's ``session_timeout_s``). Returns its id."""
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError("timeout_s must be > 0")
        if self.is_follower:  # external launch: the first rank's scheduler holds sessions; every rank calls alike
            if not session_id:
                raise ValueError("external launch: every rank opens the session under the same explicit session_id")
            return session_id
        return self._loop.call(lambda: self.scheduler.sessions.open(session_id, timeout_s))

    def close_session(self, session_id: str) -> None:
        """Forget the session and free its KV (``SessionError``, a ``ValueError``, if it is not open)."""
        if not self.is_follower:
            self._loop.call(lambda: self.scheduler.sessions.close(session_id))

    def session_info(self, session_id: str) -> dict:
        """The session's history (``token_ids``), turns, and how much of it has KV held."""
        return self._loop.call(lambda: self.scheduler.sessions.info(session_id))

    def is_paused(self) -> bool:
        return self._loop.call(lambda: self._loop.paused)

    def continue_generation(self) -> Optional[WeightResult]:
        """Resume generation. Update calls staged while it was paused are published first, all of them
        on every rank or none (their result is returned; on failure the old weights keep serving)."""
        result = None
        if self._weights.lifecycle.opener() is Opener.PAUSED:
            result = self.commit_weight_update(partial=True, by=Opener.PAUSED)

        def resume():
            self._loop.paused = False
        self._loop.call(resume)
        return result

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **template_kwargs) -> PromptIds:
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt, **template_kwargs)

    @property
    def context_len(self) -> int:
        """The most tokens one sequence may hold (prompt + output)."""
        return self._admission.limits.max_req_len

    def get_stats(self) -> dict:
        return self._loop.call(self.scheduler.get_stats)

    # ------------------------------------------------------------------ weight updates (SGLang names)

    def update_weights_from_tensor(self, named_tensors: Union[list, FlattenedTensorBucket, dict],
                                   load_format: Optional[str] = None, flush_cache: bool = True,
                                   weight_version: Optional[str] = None, abort_all_requests: bool = False,
                                   check_finite: bool = True, partial: bool = False,
                                   transaction: bool = False) -> WeightResult:
        """Load full tensors under Hugging Face names, all-or-nothing.

        named_tensors: a list of (name, tensor) (``load_format`` None or "direct"), a
        ``FlattenedTensorBucket`` ("flattened_bucket"), or a handle from another process on this
        machine: ``weight_sync.SharedMemoryBucket.write`` (CPU) or ``weight_sync.CudaIpcBucket.write``
        (GPU; the sender's buffer is exported once and mapped once, however many updates follow), or the
        RL frameworks' pickled tensor handles as ``weight_sync.handles.handle(payloads)`` (each TP rank
        reads its own entry with an allowlist that runs nothing).
        Dtypes must equal the engine's; every weight must be present unless ``partial``.
        ``transaction=True`` only stages the tensors into the open transaction (``begin_weight_update``).
        """
        if load_format not in (None, "direct", "flattened_bucket"):
            raise ValueError(f"load_format={load_format!r}: use None/'direct', 'flattened_bucket' or pass a "
                             "shared-memory handle")
        if isinstance(named_tensors, FlattenedTensorBucket):
            named_tensors = named_tensors.named_tensors()
        if not isinstance(named_tensors, (dict, list, tuple)):
            raise ValueError(f"named_tensors must be a list of (name, tensor), a FlattenedTensorBucket or a bucket "
                             f"handle (dict), got {type(named_tensors).__name__}")
        transaction = self._stages(transaction, weight_version, abort_all_requests)
        if isinstance(named_tensors, dict):  # another process's bucket: every rank opens it
            msg = (StageHandle(named_tensors) if transaction
                   else ApplyHandle(named_tensors, check_finite, partial))
        else:
            named = list(named_tensors)
            bad = next((i for i, item in enumerate(named) if not (isinstance(item, (tuple, list)) and len(item) == 2
                        and isinstance(item[0], str) and isinstance(item[1], torch.Tensor))), None)
            if bad is not None:
                return WeightResult.fail(f"named_tensors[{bad}] is not a (name, tensor) pair; nothing was loaded")
            msg = self._weights.tensors_message(named, check_finite, partial, stage=transaction)
        if transaction:
            return self._weights.stage(msg)
        return self._weights.update(msg, weight_version, flush_cache, abort_all_requests)

    def update_weights_from_delta(self, delta: Union[WeightDelta, str, os.PathLike, PinnedFolder],
                                  flush_cache: bool = True, abort_all_requests: bool = False) -> WeightResult:
        """A delta push (``weight_sync.delta.WeightDelta``: the changed elements of the changed tensors, against
        a named base), or a patch folder holding one (``weight_sync.delta.save_patch``; pinned and read like a
        checkpoint folder): refused before anything is written where the engine does not hold the base (its
        version, then the fingerprint of its weights; ``error_kind == WeightResult.BASE``: push in full);
        applied on every rank, checked against the trainer's fingerprint of every changed tensor, and published
        as ``delta.version`` only if all match — else every change is undone and the old version keeps serving."""
        if not isinstance(delta, WeightDelta):
            if not isinstance(delta, (str, os.PathLike, PinnedFolder)):
                raise InputError(f"delta must be a weight_sync.delta.WeightDelta or a patch folder, got "
                                 f"{type(delta).__name__}")
            try:
                delta = read_patch(delta)
            except (WeightLoadError, ValueError) as exc:
                return WeightResult.fail(f"the delta patch cannot be read: {exc}")
        return self._weights.update_delta(delta, flush_cache, abort_all_requests)

    def update_weights_from_delta_distributed(self, header: dict, names: list[str], dtypes: list, shapes: list,
                                              group_name: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                                              flush_cache: bool = True, abort_all_requests: bool = False) -> WeightResult:
        """A delta push whose tensors (``WeightDelta.named_tensors()``, described by names, dtypes and shapes) the
        trainer broadcasts over the weight-update group in ``rollout_bucket`` buckets; ``header``: the delta's
        JSON header (``WeightDelta.header()``). Received whole on every rank even where refused (the sender is
        broadcasting), then applied as ``update_weights_from_delta`` applies a delta."""
        if not isinstance(header, dict):
            raise InputError("header must be a delta's JSON header (weight_sync.delta.WeightDelta.header())")
        spec = (*self._call_specs(names, dtypes, shapes), str(group_name), int(bucket_bytes or DEFAULT_BUCKET_BYTES))
        return self._weights.update_delta_distributed(header, spec, flush_cache, abort_all_requests)

    def update_weights_from_disk(self, model_path: Union[str, os.PathLike, PinnedFolder], load_format: str = "auto",
                                 flush_cache: bool = True, weight_version: Optional[str] = None,
                                 recapture_cuda_graph: bool = False, abort_all_requests: bool = False,
                                 check_finite: bool = True) -> WeightResult:
        """Load a Hugging Face safetensors folder (sharded or not), validated from its headers first.

        The folder is pinned now (opened as a directory descriptor; a ``PinnedFolder`` the caller
        opened, e.g. after checking where it lies, is used as it is): the update reads that folder
        when it runs at a quiet point, whatever the path names by then. Its weight files must be
        regular files of the folder itself (a symlink is refused, never followed)."""
        if load_format not in ("auto", "safetensors"):
            raise ValueError(f"load_format={load_format!r}: only safetensors folders are loaded ('auto')")
        if isinstance(model_path, PinnedFolder):
            return self._weights.update(ApplyDisk(model_path.path, check_finite, recapture_cuda_graph, model_path),
                                        weight_version, flush_cache, abort_all_requests)
        try:
            folder = PinnedFolder.open(model_path)
        except WeightLoadError as exc:
            return WeightResult.fail(str(exc))
        with folder:
            return self._weights.update(ApplyDisk(folder.path, check_finite, recapture_cuda_graph, folder),
                                        weight_version, flush_cache, abort_all_requests)

    def reload_weights(self, abort_all_requests: bool = False) -> WeightResult:
        """Back to the weights the engine started from (prime-rl's ``/reload_weights``): its model folder
        pinned and read as at the first load (links followed: a Hugging Face cache snapshot links its
        files), under the engine's starting version label (``EngineConfig.weight_version``); the prefix
        cache reset. Adapters are untouched."""
        try:
            folder = PinnedFolder.open(self.config.model_path)
        except WeightLoadError as exc:
            return WeightResult.fail(str(exc))
        with folder:
            return self._weights.update(ApplyDisk(folder.path, True, False, folder, follow_links=True),
                                        self.config.weight_version, True, abort_all_requests)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: Optional[str] = None,
                                  timeout_s: float = 60.0, trainer_rank: int = 0) -> WeightResult:
        """Join the trainer's weight-update group (engine TP rank r is rank ``rank_offset + r``; the
        trainer, which broadcasts, is ``trainer_rank``: 0 for SGLang's and vLLM's clients, the last
        rank for TRL's). The trainer may build its side with SGLang's recipe or, on gloo, with plain
        ``torch.distributed.init_process_group`` (``weight_sync.process_group``). Fails with a clear
        message (naming the group) if nobody joins within ``timeout_s``."""
        ranks = range(int(rank_offset), int(rank_offset) + self.tp_size)
        if not 0 <= int(trainer_rank) < int(world_size) or int(trainer_rank) in ranks:
            raise ValueError(f"trainer_rank={trainer_rank} must be a rank of the group (world_size={world_size}) "
                             f"other than the engine's ranks {list(ranks)}")
        if not 0 < float(timeout_s) <= 3600:
            raise InputError(f"timeout_s={timeout_s}: seconds in (0, 3600]")
        # each rank joins on a thread of its own (generation goes on); collected here, polled from this thread
        t0 = time.perf_counter()
        result = self._weights.run(InitUpdateGroup(master_address, int(master_port), int(rank_offset), int(world_size),
                                                   group_name, backend, float(timeout_s), int(trainer_rank)))
        while result.success and result.detail.get("pending"):
            time.sleep(0.02)
            result = self._weights.run(AwaitUpdateGroup(group_name))
        if not result.success:  # a rank that did join leaves again: all or none
            self._weights.run(DestroyUpdateGroup(group_name))
        return dataclasses.replace(result, seconds=time.perf_counter() - t0)

    def destroy_weights_update_group(self, group_name: str) -> WeightResult:
        return self._weights.run(DestroyUpdateGroup(group_name))

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list, group_name: str,
                                        flush_cache: bool = True, weight_version: Optional[str] = None,
                                        load_format: Optional[str] = None, bucket_bytes: Optional[int] = None,
                                        abort_all_requests: bool = False, check_finite: bool = True,
                                        partial: bool = False, transaction: bool = False,
                                        point_to_point: bool = False) -> WeightResult:
        """Receive tensors broadcast by the trainer, staged until all arrived, then committed on every
        TP rank or on none. ``point_to_point``: the trainer sends them to this engine's ranks alone
        (``WeightUpdateSender.send(to=...)``: a full push to one replica of a group, which the others do not
        take), in our buckets.

        ``load_format`` says how the broadcasts lay them out: ``None``/``"direct"`` (SGLang's
        default): one broadcast per tensor, in this call's order, of exactly its announced bytes;
        ``"flattened_bucket"`` (SGLang's): one broadcast of every tensor's bytes back to back;
        ``"packed"`` (vLLM's ``update_info.packed``): those bytes in chunks, each closed by the tensor
        that takes it past ``bucket_bytes`` (default vLLM's 1 GiB);
        ``"rollout_bucket"`` (ours, ``weight_sync.WeightUpdateSender.send``'s default): buckets of
        ``bucket_bytes`` in wire order. On gloo a broadcast of another size than announced fails the
        update and says which tensor (``weight_sync.distributed.receive_exact``)."""
        load_format = DIRECT if load_format is None else load_format
        if bucket_bytes is None:
            bucket_bytes = VLLM_PACKED_BUFFER_BYTES if load_format == PACKED else DEFAULT_BUCKET_BYTES
        spec = (*self._call_specs(names, dtypes, shapes), str(group_name), int(bucket_bytes or DEFAULT_BUCKET_BYTES),
                str(load_format))
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={load_format!r}: use None/'direct' (one broadcast per tensor), "
                             "'flattened_bucket' (SGLang's), 'packed' (vLLM's) or 'rollout_bucket' (ours)")
        if point_to_point and load_format != ROLLOUT_BUCKET:
            raise ValueError("point_to_point sends come in our buckets: load_format='rollout_bucket'")
        if self._stages(transaction, weight_version, abort_all_requests):  # receive and stage only
            return self._weights.stage(StageDistributed(*spec, point_to_point=bool(point_to_point)))
        return self._weights.update(ReceiveDistributed(*spec, check_finite, partial,
                                                       point_to_point=bool(point_to_point)),
                                    weight_version, flush_cache, abort_all_requests)

    def update_weights_from_sparse_distributed(self, names: list[str], dtypes: list, shapes: list, counts: list,
                                               group_name: str, flush_cache: bool = True,
                                               weight_version: Optional[str] = None, abort_all_requests: bool = False,
                                               transaction: bool = False) -> WeightResult:
        """vLLM's sparse weight patches (its ``sparse_nccl`` transfer, ``update_info.num_updates_list``): for each
        checkpoint tensor ``names[i]`` (full shape ``shapes[i]``, values of ``dtypes[i]``) the trainer broadcasts
        ``counts[i]`` int32 flat indices, then as many values. They name no base, so they patch the weights held:
        checked before anything is written (names, shapes, each index inside its tensor and there once, values
        finite and of the weights' dtype; unsorted indices are sorted) and written on every TP rank or none, at
        once, or at ``commit_weight_update`` inside a transaction (``transaction``, or generation paused). A
        failed patch leaves the weights as they were — where vLLM's own needs the worker restarted."""
        try:
            counts = tuple(int(k) for k in counts)
        except (TypeError, ValueError):
            raise ValueError("num_updates_list must be a list of integers") from None
        spec = (*self._call_specs(names, dtypes, shapes), counts, str(group_name))
        if self._stages(transaction, weight_version, abort_all_requests):
            return self._weights.stage(ReceiveSparse(*spec, stage=True))
        return self._weights.update(ReceiveSparse(*spec), weight_version, flush_cache, abort_all_requests)

    def weights_update_group_barrier(self, group_name: str) -> WeightResult:
        """A barrier with the trainer on the weight-update group, every engine rank taking part (TRL's
        protocol has one after each parameter's broadcast)."""
        return self._weights.run(BarrierUpdateGroup(group_name))

    def probe_weights_update_group(self, group_name: str, nbytes: int, sizes: Optional[list[int]] = None) -> float:
        """Seconds to receive one bare broadcast of ``nbytes`` on the group (the trainer broadcasts
        as many bytes), or one broadcast per entry of ``sizes``: the raw transport a benchmark
        compares updates against."""
        result = self._weights.run(ProbeUpdateGroup(group_name, int(nbytes), tuple(int(s) for s in sizes or ())))
        if not result.success:
            raise ValueError(result.message)
        return result.value

    # ------------------------------------------------------------------ multi-call transactions

    def _stages(self, transaction: bool, weight_version: Optional[str], abort_all_requests: bool) -> bool:
        """Whether an update call stages into a transaction instead of applying (``WeightUpdateLifecycle.stages``:
        asked for, or generation is paused — slime and AReaL pause, send bucket calls, continue). The call's
        version, if any, becomes the transaction's; ``abort_all_requests`` aborts at once."""
        staged = self._weights.lifecycle.stages(transaction, weight_version)
        if staged and abort_all_requests:
            self._loop.abort(None)
        return staged

    def begin_weight_update(self, weight_version: Optional[str] = None, owner: Opener = Opener.API) -> WeightResult:
        """Open a transaction: the following update calls only stage (the engine keeps serving the old
        weights); ``commit_weight_update`` applies everything on every rank, or nothing. ``owner`` (an
        ``Opener``) names who opens it: a server's route families each open their own. Refused (a failed
        result naming it, nothing aborted) while another transaction is open."""
        if not isinstance(owner, Opener) or owner is Opener.PAUSED:
            raise InputError(f"owner={owner!r}: an Opener (API, SGLANG, VLLM, TRL); a paused engine opens its own")
        return self._weights.lifecycle.begin(owner, weight_version)

    def commit_weight_update(self, flush_cache: bool = True, check_finite: bool = True, partial: bool = False,
                             abort_all_requests: bool = False, weight_version: Optional[str] = None,
                             by: Optional[Opener] = None) -> WeightResult:
        """Publish what the open transaction staged, on every rank or none, under ``weight_version``
        (else the version its calls named, else the next one). ``by``: only a transaction that opener owns
        (refused otherwise, aborting nothing)."""
        def publish(version: Optional[str]) -> WeightResult:
            return self._weights.update(CommitTransaction(check_finite, partial), version, flush_cache,
                                        abort_all_requests)

        return self._weights.lifecycle.commit(publish, by, weight_version)

    def open_weight_update(self) -> Optional[Opener]:
        """Who opened the open transaction (``Opener.PAUSED``: update calls while generation was paused), or None."""
        return self._weights.lifecycle.opener()

    def weight_update_state(self) -> Optional[Transaction]:
        """The open transaction (who opened it, when, its calls, its first failure), or None."""
        return self._weights.lifecycle.current()

    def claim_weight_update(self, by: Opener) -> bool:
        """Whether an update call of route family ``by`` stages into the open transaction (its own); one
        another family left open is aborted (``WeightUpdateLifecycle.claim``)."""
        return self._weights.lifecycle.claim(by)

    @property
    def weight_update_lifecycle(self) -> WeightUpdateLifecycle:
        return self._weights.lifecycle

    def abort_weight_update(self, by: Optional[Opener] = None) -> WeightResult:
        """Discard what the open transaction staged (``by``: only a transaction that opener owns)."""
        return self._weights.lifecycle.abort(by)

    # ------------------------------------------------------------------ LoRA adapters (SGLang's names)

    def load_lora_adapter(self, lora_name: str, lora_path: Union[str, os.PathLike], pinned: bool = False,
                          allowed_dirs=(), weight_version: Optional[str] = None) -> WeightResult:
        """Load a PEFT LoRA adapter folder (``adapter_config.json`` + ``*.safetensors``, checked like a
        checkpoint) under ``lora_name`` into a free slot on every TP rank, all or nothing, while
        generation goes on; requests name it as ``lora_path``. Loading a name again adds a new version:
        requests that started on the earlier one finish on it. The base weights, their CPU copies and
        every other prefix in the cache are untouched. ``pinned`` is recorded (SGLang's flag).
        ``weight_version``: the label the tokens generated on this version carry (a trainer's step;
        default: the base weights' version). External launch: every rank calls this alike."""
        if isinstance(allowed_dirs, (str, bytes, os.PathLike)) or not all(
                isinstance(d, (str, os.PathLike)) for d in allowed_dirs):
            raise InputError(f"allowed_dirs={allowed_dirs!r}: a list of folders (a single path would be read "
                             "character by character)")
        return self._lora.load_from_folder(lora_name, os.fspath(lora_path), pinned, allowed_dirs, weight_version)

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors, config_dict: dict, pinned: bool = False,
                                       weight_version: Optional[str] = None) -> WeightResult:
        """``load_lora_adapter`` from memory: ``tensors`` (a dict or (name, tensor) pairs, peft's names as
        ``get_peft_model_state_dict`` gives them, or as the peft model names its parameters) and
        ``config_dict`` (peft's LoRA config as a dict)."""
        return self._lora.load_from_tensors(lora_name, tensors, config_dict, pinned, weight_version)

    def load_lora_adapter_from_distributed(self, lora_name: str, config_dict: dict, names: list[str], dtypes: list,
                                           shapes: list, group_name: str, load_format: Optional[str] = None,
                                           bucket_bytes: Optional[int] = None, pinned: bool = False,
                                           weight_version: Optional[str] = None) -> WeightResult:
        """``load_lora_adapter`` from a trainer's broadcasts over the weight-update group ``group_name``
        (``init_weights_update_group``): the adapter's tensors ``names`` (peft's names) / ``dtypes`` /
        ``shapes``, laid out as ``update_weights_from_distributed``'s ``load_format`` says (default: one
        broadcast per tensor, as miles sends them). Only adapter tensors travel; the base weights and
        their caches stay. Refused adapters are still received, so the sender's broadcasts complete."""
        load_format = DIRECT if load_format is None else load_format
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={load_format!r}: use one of {list(LOAD_FORMATS)}")
        if bucket_bytes is None:
            bucket_bytes = VLLM_PACKED_BUFFER_BYTES if load_format == PACKED else DEFAULT_BUCKET_BYTES
        spec = (*self._call_specs(names, dtypes, shapes), str(group_name), int(bucket_bytes), str(load_format))
        if not isinstance(config_dict, dict):
            raise ValueError("config_dict must be peft's LoRA config as a JSON object")
        return self._lora.load_from_distributed(lora_name, config_dict, spec, pinned, weight_version)

    def unload_lora_adapter(self, lora_name: str) -> WeightResult:
        """Stop serving ``lora_name`` and free its slots; refused while running requests use it."""
        return self._lora.unload(lora_name)

    def lora_adapter_names(self) -> list[str]:
        """The names requests can run on now (no wait for the loop: for routing a request by name)."""
        return self._lora.names()

    def list_lora_adapters(self) -> list[dict]:
        """The resident adapter versions: name, version, slot, whether new requests get it, requests on it."""
        return self._lora.list()

    # ------------------------------------------------------------------ checks

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first ``truncate_size`` values of the full Hugging Face tensor ``name`` (gathered over TP)."""
        if name not in self.worker.model_runner.name_map:  # checked here, before any rank is asked
            raise ValueError(f"unknown weight name {name!r}")
        result = self._weights.run(ReadWeight(name, int(truncate_size)))
        if not result.success:
            raise ValueError(result.message)
        return result.value

    def get_weights_checksum(self) -> str:
        """sha256 of every weight in Hugging Face form; equals
        ``weight_sync.checksum_named_tensors(state_dict_items, dtype=engine dtype)`` on the trainer."""
        result = self._weights.run(WeightsChecksum())
        if not result.success:
            raise ValueError(result.message)
        return result.value

    def get_weight_version(self) -> str:
        return self.scheduler.weight_version

    def update_weight_version(self, weight_version: str) -> None:
        self._loop.call(lambda: self.scheduler.set_weight_version(weight_version))

    # ------------------------------------------------------------------ memory (colocated training)

    def release_memory_occupation(self, tags: Optional[list[str]] = None, backup_weights: bool = False) -> WeightResult:
        """Free ``tags`` ⊆ {weights, kv_cache, cuda_graph} (None: all) at a quiet point. Released
        KV drops the prefix cache. ``backup_weights`` keeps a host copy that resume restores;
        without it, generation is refused until resume and a full weight update."""
        return self._weights.release(check_memory_tags(tags), backup_weights)

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> WeightResult:
        return self._weights.run(ResumeMemory(check_memory_tags(tags)), quiet=True)

    # ------------------------------------------------------------------ lifetime

    def shutdown(self) -> None:
        """Stop the loop (aborting what runs) and reap every worker process."""
        if self._loop is not None:
            self._loop.stop()
        worker = getattr(self, "worker", None)
        if worker is not None and hasattr(worker, "shutdown"):
            worker.shutdown()
        if self._weights is not None:
            self._weights.close()  # this engine's own buckets for its spawned ranks
        if self._ext is not None:
            self._ext.close()  # the groups this engine created, joined while the interpreter is whole

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter teardown: best effort only
            self.shutdown()
