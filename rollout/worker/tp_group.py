"""Tensor parallelism across processes: one ``TpModelWorker`` per rank, each its own process.

Rank 0 lives in the caller's process next to the scheduler; ``TpWorkerGroup`` spawns ranks
1..N-1 and is, to the scheduler, just another ``BaseTpWorker``. Every step the scheduler's batch
reaches the other ranks over a small typed control channel (one pipe per worker carrying the
frozen dataclasses of ``rollout.worker.messages``; a rank dispatches on the message's type); tensors move
only in the device group (gloo on CPU, NCCL on CUDA), a free-standing group with its own
loopback-only rendezvous on a free port, so two engines on one host never collide and a caller's
own ``torch.distributed`` job is left alone. A weight operation that fails on a rank (bad input)
is answered as a failed ``WeightResult``; the rank keeps serving.

A worker that dies makes the next collective fail (gloo reports the closed peer at once; a hung
peer trips the group timeout), and the group reports which rank died and why. ``shutdown`` stops,
then terminates, then kills, every child and joins it: no orphans. A worker whose parent dies
sees its pipe close and exits.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import traceback
from abc import abstractmethod
from dataclasses import replace
from multiprocessing import connection, reduction
from typing import Optional

import torch
import torch.distributed as dist

from rollout.batch import GenerationBatchResult, ModelWorkerBatch, SamplingInputs
from rollout.config import EngineConfig
from rollout.executor.model_runner import ModelRunner
from rollout.layers.parallel_state import Communicator, TpState
from rollout.outputs import WeightResult
from rollout.weights.safetensors_io import PinnedFolder
from rollout.worker.messages import LOCAL_ONLY, WEIGHT_MESSAGES, ApplyDisk, SampleMsg, StepMsg, StopMsg, reply_timeout_s
from rollout.worker.process_exit import exit_process
from rollout.worker.tp_worker import BaseTpWorker, TpModelWorker
from weight_sync.process_group import listen_socket, new_process_group

logger = logging.getLogger(__name__)

SPAWN_GUARD_HINT = ("TP workers are started with Python's 'spawn' method, which re-imports your main script in "
                    "each worker: put the code that creates the engine under `if __name__ == \"__main__\":`")


class TpWorkerError(RuntimeError):
    """A TP worker process died, hung or failed; the engine cannot continue."""


class MessageHandler:
    """Executes messages on a non-leader rank (spawned worker or external follower)."""

    def __init__(self, worker: TpModelWorker):
        self.worker = worker
        self.pending: Optional[GenerationBatchResult] = None

    def handle(self, msg) -> Optional[WeightResult]:
        """Run one message; a weight message returns its result (the leader collects it)."""
        if isinstance(msg, StepMsg):
            self.pending = self.worker.forward_batch_generation(msg.batch)
        elif isinstance(msg, SampleMsg):
            if self.pending is not None and self.pending.delay_sample_func is not None:
                self.pending.delay_sample_func(msg.sampling)
            self.pending = None
        elif isinstance(msg, WEIGHT_MESSAGES):
            return self.worker.run_weight_op(msg)
        else:
            raise TypeError(f"unexpected control message {type(msg).__name__}")
        return None


def make_device_group(host: str, port: int, rank: int, size: int, device: torch.device, timeout_s: float,
                      listening=None) -> Communicator:
    """The engine's own TP group (not the default group) over a fresh loopback rendezvous."""
    handle = new_process_group(host, port, rank, size, "nccl" if device.type == "cuda" else "gloo", timeout_s,
                               "rollout-tp", listening=listening)
    comm = Communicator(pg=handle.pg)
    comm.store = handle.store  # keep the rendezvous alive as long as the group
    return comm


def worker_device(config: EngineConfig, rank: int) -> EngineConfig:
    """Each rank on its own device: cuda:rank when running on CUDA."""
    device = config.resolve_device()
    if device.type != "cuda":
        return config
    return replace(config, device=f"cuda:{(device.index or 0) + rank}")



def _has_exited(p) -> bool:
    """Whether a rank's process is gone. Its sentinel closes as the kernel tears the process down, a moment
    before it can be reaped, so ``is_alive()`` alone can still say alive just after a peer's sockets reset;
    a closed sentinel counts as exited and the process is reaped briefly for its exit code."""
    if not connection.wait([p.sentinel], timeout=0):
        return False
    p.join(timeout=2.0)
    return True

def _worker_main(config: EngineConfig, rank: int, host: str, port: int, conn, num_threads: int) -> None:
    torch.set_num_threads(num_threads)
    try:
        conn.send(("joining", os.getpid()))
        config = worker_device(config, rank)
        comm = make_device_group(host, port, rank, config.tp_size, config.resolve_device(), config.tp_timeout_s)
        worker = TpModelWorker(config, tp_state=TpState(rank, config.tp_size, comm))
        conn.send(("ready", os.getpid()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    handler = MessageHandler(worker)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if isinstance(msg, StopMsg):  # an orderly stop: leave without the interpreter's teardown
            exit_process(0)
        try:
            if isinstance(msg, ApplyDisk):  # the pinned folder's descriptor follows the message
                with PinnedFolder(reduction.recv_handle(conn), msg.model_path) as folder:
                    reply = handler.handle(replace(msg, folder=folder))
            else:
                reply = handler.handle(msg)
            if reply is not None:
                conn.send(("result", reply))
        except BaseException:  # a failed step or collective: this rank cannot go on
            conn.send(("error", traceback.format_exc()))
            return


class LeaderWorker(BaseTpWorker):
    """Rank 0's own ``TpModelWorker`` plus a channel to the other ranks: every step (and its
    delayed sampling) is sent before rank 0 runs it. Subclasses give the transport (``_send_all``)
    and may guard execution (``_run``); everything else delegates to rank 0's worker."""

    worker: TpModelWorker

    @abstractmethod
    def _send_all(self, msg) -> None:
        """Deliver a control message to every other rank, in order."""

    def _run(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)

    @property
    def model_runner(self) -> ModelRunner:
        return self.worker.model_runner

    def run_weight_op(self, msg) -> WeightResult:
        """External launch: every rank calls the weight API itself (SPMD), so this rank runs its own part."""
        return self.worker.run_weight_op(msg)

    # The limits are rank 0's (every rank computes the same), read through, never copied.
    model_config = property(lambda self: self.worker.model_config)
    context_len = property(lambda self: self.worker.context_len)
    max_total_num_tokens = property(lambda self: self.worker.max_total_num_tokens)
    max_req_len = property(lambda self: self.worker.max_req_len)
    max_req_input_len = property(lambda self: self.worker.max_req_input_len)

    def forward_batch_generation(self, batch: ModelWorkerBatch) -> GenerationBatchResult:
        self._send_all(StepMsg(batch))
        result = self._run(self.worker.forward_batch_generation, batch)
        if result.delay_sample_func is not None:
            inner = result.delay_sample_func

            def sample_everywhere(sampling: SamplingInputs) -> GenerationBatchResult:
                self._send_all(SampleMsg(sampling))
                return self._run(inner, sampling)

            result.delay_sample_func = sample_everywhere
        return result


class TpWorkerGroup(LeaderWorker):
    """Rank 0's worker plus the spawned workers of ranks 1..N-1, driven as one."""

    def __init__(self, config: EngineConfig):
        self.config = config
        n = config.tp_size
        host = "127.0.0.1"
        listening = listen_socket(host)  # bound before the children start: no port race, loopback only
        port = listening.getsockname()[1]
        ctx = mp.get_context("spawn")
        threads = max(1, torch.get_num_threads() // n)
        self.procs: list[mp.Process] = []
        self.conns = []
        for rank in range(1, n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(config, rank, host, port, child, threads),
                            name=f"rollout-tp{rank}", daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._dead: Optional[str] = None
        try:
            self._wait_for("joining")  # a child that cannot even start fails here, not at the rendezvous
            comm = make_device_group(host, port, 0, n, config.resolve_device(), config.tp_timeout_s, listening)
            self.worker = TpModelWorker(config, tp_state=TpState(0, n, comm))
            self._wait_for("ready")
        except BaseException as exc:
            listening.close()  # a no-op once the rendezvous took it over
            errors = self._collect_errors()
            self.shutdown()
            if errors:
                raise TpWorkerError(f"TP workers failed to start: {errors}") from exc
            raise

    def _wait_for(self, expected: str) -> None:
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            if not conn.poll(self.config.tp_timeout_s):
                state = "alive" if p.is_alive() else f"exited with code {p.exitcode}"
                raise TpWorkerError(f"TP worker rank {rank} did not report {expected!r} within "
                                    f"{self.config.tp_timeout_s}s ({state}). {SPAWN_GUARD_HINT}")
            try:
                kind, payload = conn.recv()
            except EOFError:
                raise TpWorkerError(f"TP worker rank {rank} exited with code {p.exitcode} before "
                                    f"{expected!r}. {SPAWN_GUARD_HINT}") from None
            if kind != expected:
                raise TpWorkerError(f"TP worker rank {rank} failed to start:\n{payload}")

    # ------------------------------------------------------------------ control channel

    def _send_all(self, msg) -> None:
        """Each rank's pipe carries the message; a disk update's pinned folder goes as a passed
        descriptor right behind it (``send_handle``: the rank reads the very folder rank 0 does)."""
        self._check_alive()
        folder = msg.folder if isinstance(msg, ApplyDisk) else None
        if isinstance(msg, ApplyDisk) and folder is None:
            raise ValueError("a disk update is sent to the ranks with its folder pinned (PinnedFolder)")
        wire = msg.on_the_wire() if isinstance(msg, ApplyDisk) else msg
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            try:
                conn.send(wire)
                if folder is not None:
                    reduction.send_handle(conn, folder.fd, p.pid)
            except (BrokenPipeError, OSError) as exc:
                self._fail(f"TP worker rank {rank} is unreachable ({exc})")

    def _collect_errors(self) -> list[str]:
        errors = []
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            try:
                while conn.poll(0):
                    kind, payload = conn.recv()
                    if kind == "error":
                        errors.append(f"rank {rank}: {payload.strip().splitlines()[-1]}")
            except (EOFError, OSError):
                pass  # a dead pipe says nothing more; the exit code below does
            if _has_exited(p):
                code = "" if p.exitcode is None else f" with code {p.exitcode}"
                errors.append(f"rank {rank} (pid {p.pid}) exited{code}")
        return errors

    def _check_alive(self) -> None:
        if self._dead:
            raise TpWorkerError(self._dead)
        errors = self._collect_errors()
        if errors:
            self._fail("; ".join(errors))

    def _fail(self, why: str) -> None:
        self._dead = f"TP worker failure: {why}. The engine must be shut down and recreated."
        raise TpWorkerError(self._dead)

    def _run(self, fn, *args, **kwargs):
        """Run on rank 0; a failed collective is reported as the worker failure that caused it."""
        try:
            return fn(*args, **kwargs)
        except TpWorkerError:
            raise
        except Exception as exc:
            # a peer that died closed its sockets before it could be reaped: give it a moment to be
            # seen dead, so that the failure names the rank rather than only the collective (a killed
            # process takes seconds to be torn down on a loaded machine; a live one costs this wait once)
            connection.wait([p.sentinel for p in self.procs], timeout=10.0)
            errors = self._collect_errors()
            if errors or isinstance(exc, (RuntimeError, dist.DistBackendError)):
                self._fail("; ".join(errors) or f"collective failed: {exc}")
            raise

    # ------------------------------------------------------------------ BaseTpWorker

    def run_weight_op(self, msg) -> WeightResult:
        """Run a weight message on every rank; one result (rank 0's, or the first failure)."""
        assert not isinstance(msg, LOCAL_ONLY), "tensors reach spawned ranks through a bucket handle"
        self._send_all(msg)
        results = [self._run(self.worker.run_weight_op, msg)]
        wait_s = max(self.config.tp_timeout_s, reply_timeout_s(msg) or 0)
        for rank, conn in enumerate(self.conns, start=1):
            if not conn.poll(wait_s):
                self._fail(f"rank {rank} did not answer {type(msg).__name__} within {wait_s}s")
            kind, payload = conn.recv()
            if kind == "error":
                self._fail(f"rank {rank} failed in {type(msg).__name__}: {payload.strip().splitlines()[-1]}")
            results.append(payload)
        return WeightResult.merge(results)

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send(StopMsg())
            except (BrokenPipeError, OSError):
                pass  # already gone: joined (or killed) below
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
