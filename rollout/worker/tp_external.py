"""External launch: the caller already runs a ``torch.distributed`` job (``torchrun``,
DeepSpeed ranks) and each rank hosts one TP worker of the engine in-process.

The engine never calls ``init_process_group``: it creates its subgroups collectively on all ranks
(consecutive blocks of ``tp_size`` ranks form one engine; ``world_size / tp_size`` engines in
all), a device group for the TP collectives and a gloo group for control. Every rank calls
``generate`` with the same arguments (SPMD): the group's first rank (the leader) runs the
scheduler and broadcasts each step to the others, which execute it and finally receive the
leader's outputs, so every rank returns the same list.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any, Optional

import torch.distributed as dist

from rollout.config import EngineConfig
from rollout.layers.parallel_state import Communicator, TpState
from rollout.worker.messages import DoneMsg
from rollout.worker.tp_group import LeaderWorker, MessageHandler
from rollout.worker.tp_worker import TpModelWorker


class ExternalTp:
    """This rank's place in the caller's job: its TP group, control group and worker."""

    def __init__(self, config: EngineConfig):
        if not dist.is_initialized():
            raise ValueError("launch='external' needs an initialised torch.distributed job (torchrun, deepspeed)")
        world, rank, tp = dist.get_world_size(), dist.get_rank(), config.tp_size
        if world % tp != 0:
            raise ValueError(f"world size {world} is not a multiple of tp_size {tp}")
        timeout = datetime.timedelta(seconds=config.tp_timeout_s)
        device = config.resolve_device()
        backend = "nccl" if device.type == "cuda" else "gloo"
        mine = rank // tp
        self.device_group: Optional[dist.ProcessGroup] = None
        self.control_group: Optional[dist.ProcessGroup] = None
        for g in range(world // tp):  # new_group is collective: every rank creates every group, in order
            ranks = list(range(g * tp, (g + 1) * tp))
            dev = dist.new_group(ranks, backend=backend, timeout=timeout)
            ctrl = dist.new_group(ranks, backend="gloo", timeout=timeout)
            if g == mine:
                self.device_group, self.control_group, self.ranks = dev, ctrl, ranks
        self.tp_rank = rank % tp
        self.leader = self.ranks[0]
        self.is_leader = self.tp_rank == 0
        self.worker = TpModelWorker(config, tp_state=TpState(self.tp_rank, tp, Communicator(group=self.device_group)))

    def close(self) -> None:
        """Destroy the two groups this engine created, on every rank alike (each rank's engine shuts down
        after the same last call), and drop every reference to them, so that their gloo threads are joined
        now. Left to interpreter teardown, a gloo thread still releasing a collective's tensors wants the GIL
        there and the process aborts ("terminate called without an active exception")."""
        for group in (self.device_group, self.control_group):
            if group is None:
                continue
            with contextlib.suppress(ValueError):  # the caller destroyed every group already
                dist.destroy_process_group(group)
        comm = self.worker.tp_state.comm
        if comm is not None:
            comm.close()
        self.device_group = self.control_group = None

    def broadcast(self, obj: Any = None) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self.leader, group=self.control_group)
        return box[0]

    def follow(self) -> list:
        """Non-leader ranks: execute the leader's steps until it broadcasts its outputs."""
        handler = MessageHandler(self.worker)
        while True:
            msg = self.broadcast()
            if isinstance(msg, DoneMsg):
                if msg.error is not None:
                    raise RuntimeError(f"generation failed on the TP leader (rank {self.leader}): {msg.error}")
                return msg.outputs
            handler.handle(msg)


class ExternalLeaderWorker(LeaderWorker):
    """The leader's worker: broadcasts every step (and delayed sampling) before running it. Weight
    operations are not broadcast: under external launch every rank calls them itself (SPMD)."""

    def __init__(self, ext: ExternalTp):
        self.ext = ext
        self.worker = ext.worker

    def _send_all(self, msg) -> None:
        self.ext.broadcast(msg)

    def send_done(self, outputs: list | None, error: str | None = None) -> None:
        self.ext.broadcast(DoneMsg(outputs, error))
