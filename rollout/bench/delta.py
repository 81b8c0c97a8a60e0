"""``rollout bench weight-sync --delta``: a delta push against a full push of the same step over the same kind of
weight-update group, side by side in one run.

A ``transformers`` model trains with Adam (``--lrs``, each from the same initial weights; a step is one causal-LM
step on random tokens) — in fp32, or in bf16 as DeepSpeed's bf16 optimizer trains (``--trainer-dtypes``: the
module in bf16, Adam on fp32 master weights, ``MasterAdam``) — and after each step pushes its weights in the
engine's dtype two ways into two engines of the same model, each over its own weight-update group (gloo on CPU,
NCCL on GPU; the trainer is rank 0, the engine's rank 1, the engines in this process): in full (``push_weights``
through a ``DistributedTarget``: bucketed casts broadcast while the next bucket is cast, then one commit) and as
a delta (``push_delta``: each parameter diffed against the trainer's kept bf16 bits — an fp32 one cast as it is
compared —, the changed elements broadcast once, applied all or nothing on the engine against the base it
names). Recorded per step: the changed fraction of the elements, the bytes each push moves, each push's time as
the trainer waits for it (the delta's split into its diff and its wire and apply), and at the end that both
engines hold the same weights (checksums). Adam's first step moves every weight by the learning rate (its update
is lr * sign(grad)), later ones by less: rows say which step it was.
"""

from __future__ import annotations

import time

import torch

from rollout import RolloutEngine
from trainer_bridge.distributed_target import DistributedTarget
from trainer_bridge.push import push_delta, push_weights
from weight_sync.delta import DeltaTracker

TRAINERS = {"float32": "fp32 module, Adam on it", "bfloat16": "bf16 module, Adam on fp32 master weights"}


def _trainer(path: str, seed: int, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


class MasterAdam:
    """bf16 training as DeepSpeed's bf16 optimizer does it: the module's weights in bf16 (what is pushed), fp32
    master copies that Adam steps (the module's gradients taken up in fp32), the module's weights cast from the
    masters after each step."""

    def __init__(self, model: torch.nn.Module, lr: float):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone() for p in self.params]
        self.opt = torch.optim.Adam(self.masters, lr=lr)

    def step(self) -> None:
        for master, p in zip(self.masters, self.params):
            master.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        with torch.no_grad():
            for master, p in zip(self.masters, self.params):
                p.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def _train_step(model, opt, vocab: int, g: torch.Generator, tokens: int) -> None:
    ids = torch.randint(0, vocab, (2, tokens), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _row(step: int, full, delta, t_full: float, t_delta: float) -> dict:
    """One step: the bytes and the times of both pushes as the trainer waits for them (the full push's casts
    into buckets overlap its wire; the delta's diff casts as it compares, never making the cast whole)."""
    full_bytes = full.num_bytes
    return {"step": step, "changed_fraction": delta.phases["changed_fraction"], "delta_bytes": delta.num_bytes,
            "full_bytes": full_bytes, "bytes_ratio": delta.num_bytes / full_bytes, "full_s": t_full, "delta_s": t_delta,
            "time_ratio": t_delta / t_full, "full_cast_s": full.gather_s + full.pack_s,
            "diff_s": delta.phases["diff_s"], "send_and_apply_s": delta.commit_s, "delta_went": bool(delta.phases["delta"])}


def run_name(lr: float, trainer_dtype: str) -> str:
    """A run's key in the results: the learning rate, and the trainer where it is not the fp32 one."""
    return f"{lr:g}" if trainer_dtype == "float32" else f"{lr:g}, {trainer_dtype} trainer"


def delta_pushes(path: str, dtype: torch.dtype, lrs: list[float], steps: int, tokens: int = 64,
                 trainer_dtypes: tuple[str, ...] = ("float32",)) -> dict:
    """Per trainer (``TRAINERS``) and learning rate, each step's delta push against its full push (see the module's
    docstring), keyed by ``run_name``."""
    engine_dtype = str(dtype).replace("torch.", "")
    out: dict = {}
    unknown = sorted(set(trainer_dtypes) - set(TRAINERS))
    if unknown:
        raise ValueError(f"trainer dtypes {unknown}: use {sorted(TRAINERS)}")
    with RolloutEngine(path, dtype=engine_dtype, kv_cache_tokens=256) as by_delta, \
            RolloutEngine(path, dtype=engine_dtype, kv_cache_tokens=256) as in_full:
        full_target, delta_target = DistributedTarget(in_full, timeout_s=120), DistributedTarget(by_delta, timeout_s=120)
        try:
            for trainer_dtype, lr in ((t, lr) for t in trainer_dtypes for lr in lrs):
                model = _trainer(path, 0, getattr(torch, trainer_dtype))
                tied = bool(model.config.tie_word_embeddings)
                opt = torch.optim.Adam(model.parameters(), lr=lr) if trainer_dtype == "float32" else MasterAdam(model, lr)
                g = torch.Generator().manual_seed(1)
                tracker = DeltaTracker()  # the first push: in full on both (the delta's base)
                start = f"{trainer_dtype}-lr{lr}-0"
                assert push_weights(model, full_target, start, tie_word_embeddings=tied).result.success
                assert not push_delta(model, delta_target, start, tracker, tie_word_embeddings=tied).phases["delta"]
                rows = []
                for step in range(1, steps + 1):
                    _train_step(model, opt, int(model.config.vocab_size), g, tokens)
                    version = f"{trainer_dtype}-lr{lr}-{step}"
                    t0 = time.perf_counter()
                    full = push_weights(model, full_target, version, tie_word_embeddings=tied)
                    t1 = time.perf_counter()
                    delta = push_delta(model, delta_target, version, tracker, tie_word_embeddings=tied)
                    t2 = time.perf_counter()
                    if not (full.result.success and delta.result.success):
                        raise RuntimeError(f"a push failed: {full.result.message} / {delta.result.message}")
                    rows.append(_row(step, full, delta, t1 - t0, t2 - t1))
                same = by_delta.get_weights_checksum() == in_full.get_weights_checksum()
                out[run_name(lr, trainer_dtype)] = {"steps": rows, "same_weights": same, "held_bytes": tracker.held_bytes,
                                                    "lr": lr, "trainer": TRAINERS[trainer_dtype]}
        finally:
            full_target.close()
            delta_target.close()
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    models = results["models"]
    bars = max(sum(len(run["steps"]) for run in res["delta"].values()) for res in models)
    fig, axes = plt.subplots(1, len(models), figsize=(max(5.0, 0.6 * bars) * len(models), 3.8), squeeze=False)
    for ax, res in zip(axes[0], models):
        labels, bytes_ratio, time_ratio = [], [], []
        for name, run in res["delta"].items():
            trainer = {v: k for k, v in TRAINERS.items()}.get(run.get("trainer", ""), "float32")  # (older: fp32 only)
            run_label = f"{run['lr']:g}\n{trainer}" if "lr" in run else f"lr {name}"
            for row in run["steps"]:
                labels.append(f"{run_label}\nstep {row['step']}")
                bytes_ratio.append(row["bytes_ratio"])
                time_ratio.append(row["time_ratio"])
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], bytes_ratio, width=0.4, label="bytes / full")
        ax.bar([i + 0.2 for i in x], time_ratio, width=0.4, label="time / full (as the trainer waits)")
        ax.axhline(0.1, ls="--", lw=0.8, color="gray")
        ax.axhline(0.3, ls=":", lw=0.8, color="gray")
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_title(f"{res['model']} ({res['bytes'] / 1e6:.0f} MB {res['dtype']}): delta vs full push over a group",
                     fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
