"""The trainer side's benchmarks (they run DeepSpeed ranks; the ``train`` extra):
``rollout bench push-floor`` (a push against a bare ZeRO-3 all-gather of the same parameters) and
``rollout bench rl-modes`` (colocated vs disaggregated vs asynchronous GRPO). Results go where the
engine's benchmarks write theirs (``--out-dir``, default ``benchmarks/results``)."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def examples_dir() -> str:
    """The source tree's ``examples/`` (the GRPO scripts these benchmarks run)."""
    path = os.path.join(REPO, "examples")
    if not os.path.isfile(os.path.join(path, "grpo_colocated.py")):
        raise SystemExit(f"this benchmark runs the GRPO examples of the source tree; none at {path} "
                         "(install the project from its checkout: pip install -e '.[train]')")
    return path


def relaunch_under_torchrun(module: str, nproc: int, argv: list[str]) -> None:
    """Run ``python -m module argv`` on ``nproc`` ranks (``torch.distributed.run``); exits with the
    launcher's status. The launcher's parser sees ``argv`` too and refuses any flag in it that
    abbreviates one of its own (``--nproc`` would): name the benchmarks' flags apart from them."""
    from weight_sync.process_group import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), "-m", module, *argv]
    raise SystemExit(subprocess.call(cmd))
