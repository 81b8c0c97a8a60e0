"""``RolloutEngine``: the public entry point.

The engine owns a background loop thread that owns the scheduler (and through it the batch);
``generate``, ``async_generate`` and control calls are its clients, talking to it through a
command queue, so requests (and later weight updates) can arrive while generation runs. Input is
validated in the caller's thread: a bad request raises there and never reaches the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Optional, Union

from rollout.config import EngineConfig
from rollout.engine_weights import EngineWeightsMixin
from rollout.models import ModelConfig
from rollout.outputs import RolloutOutput
from rollout.random import derive_seed
from rollout.request import Request, Sequence
from rollout.sampling_params import SamplingParams
from rollout.scheduler import Scheduler
from rollout.tokenizer import apply_chat_template, eos_token_ids, load_tokenizer, make_detokenizer
from rollout.tp_external import ExternalLeaderWorker, ExternalTp
from rollout.tp_group import TpWorkerError, TpWorkerGroup
from rollout.tp_worker import TpModelWorker

logger = logging.getLogger(__name__)

PromptIds = list[int]


class EngineDeadError(RuntimeError):
    """The engine loop is not running (shut down, or a fatal error)."""


class RolloutEngine(EngineWeightsMixin):
    def __init__(self, model_path: str, tp_size: int = 1, dtype: str = "auto", device: str = "auto",
                 seed: int = 0, **kwargs: Any):
        self.config = EngineConfig.from_kwargs(model_path, tp_size=tp_size, dtype=dtype, device=device,
                                               seed=seed, **kwargs)
        ModelConfig.from_pretrained(model_path).check_tp_size(self.config.tp_size)  # before spawning anything
        self._ext: Optional[ExternalTp] = None
        self._thread: Optional[threading.Thread] = None
        if self.config.tp_size == 1:
            self.worker = TpModelWorker(self.config)
        elif self._use_external_launch():
            self._ext = ExternalTp(self.config)
            self.worker = ExternalLeaderWorker(self._ext) if self._ext.is_leader else self._ext.worker
        else:
            self.worker = TpWorkerGroup(self.config)
        self.model_config = self.worker.model_config
        self.tokenizer = load_tokenizer(self.config.tokenizer_path or model_path)
        self._detokenize = make_detokenizer(self.tokenizer)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.model_config.eos_token_ids)
        self.scheduler = Scheduler(self.config, self.worker, self.eos_token_ids, self._detokenize)
        self._defaults = self.model_config.generation_defaults if self.config.use_generation_config else {}
        self._counter = itertools.count()
        self._commands: queue.Queue = queue.Queue()
        self._alive = True
        self._paused = False
        self._shm = self._ipc = None  # this engine's own buckets for its spawned ranks
        self._fatal: Optional[BaseException] = None
        if self.is_follower:
            return  # an external-launch follower runs the leader's steps inside generate()
        self._thread = threading.Thread(target=self._run_loop, name="rollout-engine-loop", daemon=True)
        self._thread.start()
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

    # ------------------------------------------------------------------ loop

    def _is_quiet(self) -> bool:
        return self._paused or not self.scheduler.has_work()

    def _run_loop(self) -> None:
        sched = self.scheduler
        held: deque = deque()  # a command waiting for a quiet point, and every later one but aborts
        while True:
            try:
                block = (self._paused or not sched.has_work()) and not (held and self._is_quiet())
                while True:
                    try:
                        cmd = self._commands.get(block=block)
                    except queue.Empty:
                        break
                    block = False
                    if cmd[0] == "stop":
                        sched.abort(None)
                        for h in held:
                            self._execute(h)
                        sched.close()
                        return
                    if cmd[0] != "abort" and (held or (cmd[0] == "call" and cmd[4] and not self._is_quiet())):
                        held.append(cmd)
                    else:
                        self._execute(cmd)
                while held and (not held[0][0] == "call" or not held[0][4] or self._is_quiet()):
                    self._execute(held.popleft())
                if sched.has_work() and not self._paused:
                    sched.step()
            except TpWorkerError as exc:  # a rank is gone: fail everything and stop serving
                logger.error("%s", exc)
                self._fatal = exc
                sched.fail_all(exc)
                self._alive = False
                return
            except Exception as exc:  # a failed step fails its requests; the engine keeps serving
                logger.exception("engine step failed")
                sched.fail_all(exc)

    def _execute(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add":
            self.scheduler.add_request(cmd[1])
        elif kind == "abort":
            self.scheduler.abort(cmd[1])
        elif kind == "call":
            fn, box, done = cmd[1], cmd[2], cmd[3]
            try:
                self.scheduler.drain()
                box["result"] = fn()
            except BaseException as exc:
                box["error"] = exc
            done.set()

    def _call(self, fn: Callable[[], Any], timeout: Optional[float] = None, quiet: bool = False) -> Any:
        """Run ``fn`` on the loop thread at a step boundary (``quiet``: once no request runs, or
        generation is paused) and return its result."""
        self._check_alive()
        box: dict = {}
        done = threading.Event()
        self._commands.put(("call", fn, box, done, quiet))
        if not done.wait(timeout):
            raise TimeoutError("the engine loop did not answer in time")
        if "error" in box:
            raise box["error"]
        return box["result"]

    def _check_alive(self) -> None:
        if self._fatal is not None:
            raise EngineDeadError(f"the engine stopped: {self._fatal}")
        if not self._alive or (self._thread is not None and not self._thread.is_alive()):
            raise EngineDeadError("the engine is shut down; create a new RolloutEngine")

    # ------------------------------------------------------------------ requests

    def _normalize_prompts(self, prompts, input_ids) -> list[PromptIds]:
        if (prompts is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompts (strings) or input_ids (token id lists)")
        if prompts is not None:
            if isinstance(prompts, str):
                prompts = [prompts]
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: pass input_ids instead of prompts")
            if not all(isinstance(p, str) for p in prompts):
                raise ValueError("prompts must be a string or a list of strings")
            return [list(self.tokenizer(p)["input_ids"]) for p in prompts]
        if input_ids and all(isinstance(t, int) for t in input_ids):
            input_ids = [input_ids]
        if not isinstance(input_ids, (list, tuple)) or not all(isinstance(p, (list, tuple)) for p in input_ids):
            raise ValueError("input_ids must be a list of token ids or a list of such lists")
        return [list(p) for p in input_ids]

    def _make_requests(self, prompts, input_ids, sampling_params, return_logprob: bool, top_logprobs_num: int,
                       logprob_start_len: int, rid, on_update=None) -> list[Request]:
        self._check_alive()
        self._check_memory_ready()
        ids_list = self._normalize_prompts(prompts, input_ids)
        if not ids_list:
            raise ValueError("no prompts given")
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(ids_list)
        if len(params) != len(ids_list):
            raise ValueError(f"got {len(params)} sampling_params for {len(ids_list)} prompts")
        params = [SamplingParams.from_dict(p) if isinstance(p, dict) else p for p in params]
        if not isinstance(top_logprobs_num, int) or top_logprobs_num < 0:
            raise ValueError("top_logprobs_num must be an integer >= 0")
        if not isinstance(logprob_start_len, int) or logprob_start_len < -1:
            raise ValueError("logprob_start_len must be -1 (no prompt logprobs) or a position >= 0")
        rids = [rid] if isinstance(rid, str) else rid
        if rids is not None and len(rids) != len(ids_list):
            raise ValueError(f"got {len(rids)} rids for {len(ids_list)} prompts")
        vocab = self.model_config.vocab_size
        w = self.worker
        reqs = []
        for i, (ids, sp) in enumerate(zip(ids_list, params)):
            if not isinstance(sp, SamplingParams):
                raise ValueError("sampling_params must be SamplingParams, a dict, or a list of them")
            sp.check_vocab(vocab)
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
            if len(ids) > w.max_req_input_len:
                raise ValueError(f"prompt {i} has {len(ids)} tokens; the limit is {w.max_req_input_len} "
                                 f"(context {w.context_len}, KV pool {w.max_total_num_tokens} tokens): shorten it "
                                 f"or raise max_model_len / kv_cache_tokens")
            if len(ids) + sp.max_new_tokens > w.max_req_len:
                raise ValueError(f"prompt {i}: {len(ids)} prompt tokens + max_new_tokens={sp.max_new_tokens} "
                                 f"exceeds the limit of {w.max_req_len} tokens per sequence; lower max_new_tokens")
            counter = next(self._counter)
            seed = sp.seed if sp.seed is not None else derive_seed(self.config.seed, counter)
            seq_ids = [next(self._counter) for _ in range(sp.n)]
            reqs.append(Request(rids[i] if rids else f"req-{counter}", i, ids, sp.resolved(self._defaults), seed,
                                seq_ids, return_logprob, top_logprobs_num, logprob_start_len, on_update))
        return reqs

    def _to_output(self, req: Request, seq: Sequence) -> RolloutOutput:
        text = seq.text
        if text is None and self._detokenize is not None:
            text = self._detokenize(seq.output_ids, req.params.skip_special_tokens)
        end = req.finish_time if seq.is_finished and req.finish_time else time.perf_counter()
        return RolloutOutput(
            rid=req.rid, prompt_index=req.prompt_index, sample_index=seq.sample_index,
            prompt_token_ids=list(req.prompt_ids), output_token_ids=list(seq.output_ids),
            output_logprobs=list(seq.output_logprobs), text=text,
            output_top_logprobs=list(seq.output_top_logprobs),
            input_logprobs=list(req.input_logprobs), input_top_logprobs=list(req.input_top_logprobs),
            finish_reason=seq.finish_reason, matched_stop=seq.matched_stop, stop_text_offset=seq.stop_text_offset,
            logprob_mode=self.config.logprob_mode,
            weight_version=seq.output_versions[-1] if seq.output_versions else self.scheduler.weight_version,
            output_weight_versions=list(seq.output_versions), num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
            time_to_first_token_s=(seq.first_token_time - req.arrival_time) if seq.first_token_time else None,
            latency_s=end - req.arrival_time,
        )

    def _collect(self, reqs: list[Request]) -> list[RolloutOutput]:
        errors = [r.error for r in reqs if r.error is not None]
        if errors:
            raise RuntimeError(f"generation failed: {errors[0]!r}") from errors[0]
        return [self._to_output(r, s) for r in reqs for s in r.seqs]

    def generate(self, prompts: Union[str, list[str], None] = None,
                 input_ids: Union[PromptIds, list[PromptIds], None] = None,
                 sampling_params: Union[SamplingParams, dict, list, None] = None, return_logprob: bool = True,
                 top_logprobs_num: int = 0, logprob_start_len: int = -1,
                 rid: Union[str, list[str], None] = None) -> list[RolloutOutput]:
        """Generate for every prompt; returns a flat, prompt-major list (prompt 0's n samples first).

        External launch: every rank of the engine calls this with the same arguments."""
        # Validation raises here, alike on every rank of an external launch, before any step runs.
        reqs = self._make_requests(prompts, input_ids, sampling_params, return_logprob, top_logprobs_num,
                                   logprob_start_len, rid)
        if self.is_follower:
            return self._ext.follow()
        if self._ext is None:
            return self._run_requests(reqs)
        try:
            outs = self._run_requests(reqs)
        except BaseException as exc:
            error = repr(exc)
            self._call(lambda: self.worker.send_done(None, error))
            raise
        self._call(lambda: self.worker.send_done(outs))
        return outs

    def _run_requests(self, reqs: list[Request]) -> list[RolloutOutput]:
        for r in reqs:
            self._commands.put(("add", r))
        deadline = None if self.config.request_timeout_s is None else time.monotonic() + self.config.request_timeout_s
        try:
            for r in reqs:
                while not r.done.wait(0.5):
                    if self._fatal is not None:
                        break
                    self._check_alive()
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError(f"request {r.rid} did not finish in {self.config.request_timeout_s}s")
        except BaseException:
            for r in reqs:
                self._commands.put(("abort", r.rid))
            raise
        return self._collect(reqs)

    async def async_generate(self, prompts=None, input_ids=None, sampling_params=None, return_logprob: bool = True,
                             top_logprobs_num: int = 0, logprob_start_len: int = -1, rid=None,
                             stream: bool = False):
        """Awaitable ``generate``. With ``stream=True`` returns an async iterator of partial
        ``RolloutOutput`` snapshots (one per sample and step; the last one has ``finish_reason``)."""
        if self._ext is not None:
            raise ValueError("with external launch every rank calls generate() (SPMD); async_generate is not available")
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()

        def on_update(req: Request, seqs: list[Sequence]) -> None:
            outs = [self._to_output(req, s) for s in seqs] if stream else []
            final = req.done.is_set()  # read here, in order with the updates: the last one is final
            loop.call_soon_threadsafe(updates.put_nowait, (req, outs, final))

        reqs = self._make_requests(prompts, input_ids, sampling_params, return_logprob, top_logprobs_num,
                                   logprob_start_len, rid, on_update)
        for r in reqs:
            self._commands.put(("add", r))

        async def events():
            pending = set(id(r) for r in reqs)
            try:
                while pending:
                    req, outs, final = await updates.get()
                    for o in outs:
                        yield o
                    if final:
                        pending.discard(id(req))
            finally:
                for r in reqs:
                    if not r.done.is_set():
                        self._commands.put(("abort", r.rid))

        if stream:
            return events()
        async for _ in events():  # drain until every request reports its final update
            continue
        return self._collect(reqs)

    # ------------------------------------------------------------------ control

    def abort_request(self, rid: Optional[str] = None, abort_all: bool = False) -> None:
        """Abort one request (its partial outputs are returned with finish_reason "abort") or all."""
        if rid is None and not abort_all:
            raise ValueError("pass rid, or abort_all=True")
        self._commands.put(("abort", None if abort_all else rid))

    def flush_cache(self) -> bool:
        return self._call(lambda: (self.scheduler.block_manager.flush(), True)[1])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> PromptIds:
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt)

    def get_stats(self) -> dict:
        def read():
            s = self.scheduler.stats
            bm = self.scheduler.block_manager
            return {**vars(s), "prefix_cache_queries": bm.stats.num_queries,
                    "prefix_cache_hit_tokens": bm.stats.num_hit_tokens, "num_free_blocks": bm.num_free_blocks,
                    "num_blocks": bm.num_blocks}
        return self._call(read)

    def shutdown(self) -> None:
        """Stop the loop (aborting what runs) and reap every worker process."""
        if getattr(self, "_thread", None) is not None and self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout=30)
        self._alive = False
        worker = getattr(self, "worker", None)
        if worker is not None and hasattr(worker, "shutdown"):
            worker.shutdown()
        for attr in ("_shm", "_ipc"):  # this engine's own buckets for its spawned ranks
            if getattr(self, attr, None) is not None:
                getattr(self, attr).close()
                setattr(self, attr, None)

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter teardown: best effort only
            self.shutdown()
