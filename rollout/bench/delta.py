"""``rollout bench weight-sync --delta``: a delta push against a full push of the same step, in one run.

A ``transformers`` model trains in fp32 with Adam (``--lrs``, each from the same initial weights; a step is
one causal-LM step on random tokens) and after each step pushes its weights cast to the engine's dtype two
ways into two engines of the same model: in full (``update_weights_from_tensor``) and as a delta against the
last push (``weight_sync.delta``: the diff against the trainer's kept bits, then ``update_weights_from_delta``,
checked before and after). Recorded per step: the changed fraction of the elements, the bytes each push moves,
their times (the delta's split into diff and apply), and that both engines then hold the same weights
(checksums). In process, colocated; the process-group transport is measured once it exists.
"""

from __future__ import annotations

import time

import torch

from rollout import RolloutEngine
from weight_sync.delta import DeltaTracker, changed_fraction


def _trainer(path: str, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _train_step(model, opt, vocab: int, g: torch.Generator, tokens: int) -> None:
    ids = torch.randint(0, vocab, (2, tokens), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _pushed(model, dtype: torch.dtype, tied: bool) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach().to(dtype)) for n, p in model.named_parameters() if not (tied and n == "lm_head.weight")]


def delta_pushes(path: str, dtype: torch.dtype, lrs: list[float], steps: int, tokens: int = 64) -> dict:
    """Per learning rate, each step's delta push against its full push (see the module's docstring)."""
    engine_dtype = str(dtype).replace("torch.", "")
    out: dict = {}
    with RolloutEngine(path, dtype=engine_dtype, kv_cache_tokens=256) as by_delta, \
            RolloutEngine(path, dtype=engine_dtype, kv_cache_tokens=256) as in_full:
        for lr in lrs:
            model = _trainer(path, 0)
            tied = bool(model.config.tie_word_embeddings)
            opt = torch.optim.Adam(model.parameters(), lr=lr)
            g = torch.Generator().manual_seed(1)
            initial = _pushed(model, dtype, tied)
            for engine in (by_delta, in_full):  # both from the checkpoint's bits, under one version
                assert engine.update_weights_from_tensor(initial, weight_version=f"lr{lr}-0").success
            tracker = DeltaTracker()
            tracker.record(initial, f"lr{lr}-0")
            full_bytes = sum(t.numel() * t.element_size() for _, t in initial)
            rows = []
            for step in range(1, steps + 1):
                _train_step(model, opt, int(model.config.vocab_size), g, tokens)
                named = _pushed(model, dtype, tied)
                version = f"lr{lr}-{step}"
                t0 = time.perf_counter()
                full = in_full.update_weights_from_tensor(named, weight_version=version)
                t1 = time.perf_counter()
                delta = tracker.diff(named, version)
                t2 = time.perf_counter()
                applied = by_delta.update_weights_from_delta(delta)
                t3 = time.perf_counter()
                if not (full.success and applied.success):
                    raise RuntimeError(f"a push failed: {full.message} / {applied.message}")
                tracker.commit(delta)
                rows.append({"step": step, "changed_fraction": changed_fraction(delta, [t.numel() for _, t in named]),
                             "delta_bytes": delta.num_bytes, "full_bytes": full_bytes,
                             "bytes_ratio": delta.num_bytes / full_bytes, "full_s": t1 - t0, "diff_s": t2 - t1,
                             "apply_s": t3 - t2, "time_ratio": (t3 - t1) / (t1 - t0),
                             "dense_tensors": sum(e.dense is not None for e in delta.entries.values()),
                             "changed_tensors": len(delta.entries)})
            same = by_delta.get_weights_checksum() == in_full.get_weights_checksum()
            out[f"{lr:g}"] = {"steps": rows, "same_weights": same, "held_bytes": tracker.held_bytes}
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    models = results["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.5), squeeze=False)
    for ax, res in zip(axes[0], models):
        labels, bytes_ratio, time_ratio = [], [], []
        for lr, run in res["delta"].items():
            for row in run["steps"]:
                labels.append(f"lr {lr}\nstep {row['step']}")
                bytes_ratio.append(row["bytes_ratio"])
                time_ratio.append(row["time_ratio"])
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], bytes_ratio, width=0.4, label="bytes / full")
        ax.bar([i + 0.2 for i in x], time_ratio, width=0.4, label="time / full")
        ax.axhline(0.1, ls="--", lw=0.8, color="gray")
        ax.axhline(0.3, ls=":", lw=0.8, color="gray")
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_title(f"{res['model']} ({res['bytes'] / 1e6:.0f} MB {res['dtype']}): delta vs full push", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
