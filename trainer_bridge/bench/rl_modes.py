"""Time per RL step and trainer idle time: colocated vs disaggregated (synchronous) vs asynchronous
(staleness 1), the same GRPO task, model, trainer ranks and steps, run one after the other.

    rollout bench rl-modes                               # the demo's tiny model, 12 steps
    rollout bench rl-modes --model smollm2 --steps 4 --max-new-tokens 16

Trainer idle = the time a step's trainer waits for its rollouts (``trainer_wait_s``) plus the push
(``sync_s``); colocated, the trainer also waits while its own engine generates. Means over the steps
after the first (which warms groups and buffers). Writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from trainer_bridge.bench import examples_dir

MODES = {
    "colocated": ("grpo_colocated.py", []),
    "disaggregated": ("grpo_disaggregated.py", []),
    "async1": ("grpo_disaggregated.py", ["--max-staleness", "1"]),
}


def run_mode(mode: str, args, out_dir: str) -> list[dict]:
    from weight_sync.process_group import free_port

    script, extra = MODES[mode]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.trainer_ranks), "--master_port",
           str(free_port()), os.path.join(examples_dir(), script), "--model", args.model, "--steps", str(args.steps),
           "--max-new-tokens", str(args.max_new_tokens), "--prompts-per-step", str(args.prompts_per_step),
           "--dtype", args.dtype, "--out-dir", out_dir, "--no-wandb", *extra]
    if script == "grpo_disaggregated.py":
        cmd += ["--replicas", str(args.replicas)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "WANDB_MODE": "offline"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.load(open(os.path.join(out_dir, "steps.json")))


def summarize(steps: list[dict]) -> dict:
    kept = steps[1:] or steps
    mean = lambda key: statistics.fmean(x[key] for x in kept)  # noqa: E731
    return {"step_s": mean("step_s"), "trainer_idle_s": statistics.fmean(x["trainer_wait_s"] + x["sync_s"] for x in kept),
            "trainer_wait_s": mean("trainer_wait_s"), "rollout_s": mean("rollout_s"), "train_s": mean("train_s"),
            "sync_s": mean("sync_s"), "reward_first": steps[0]["reward"],
            "reward_last5": statistics.fmean(x["reward"] for x in steps[-5:]),
            "mismatch_max": max(x["mismatch_max"] for x in steps),
            "max_sample_staleness": max(x["max_sample_staleness"] for x in steps)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="rollout bench rl-modes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=6)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--trainer-ranks", type=int, default=2, help="trainer ranks (colocated: each also hosts an engine rank)")
    ap.add_argument("--replicas", type=int, default=2, help="rollout servers (disaggregated modes)")
    ap.add_argument("--modes", default="colocated,disaggregated,async1")
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args(argv)
    out = os.path.join(os.path.abspath(args.out_dir), f"rl_modes_{os.path.basename(args.model)}.json")
    from tqdm import tqdm

    results = {"config": vars(args), "modes": {}}
    for mode in tqdm(args.modes.split(","), desc="RL modes"):
        steps = run_mode(mode, args, tempfile.mkdtemp(prefix=f"rl_modes_{mode}_"))
        results["modes"][mode] = {"summary": summarize(steps), "steps": steps}
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, out.rsplit(".", 1)[0] + ".png")
    print(json.dumps({m: r["summary"] for m, r in results["modes"].items()}, indent=1))
    return results


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results["modes"])
    summ = [results["modes"][m]["summary"] for m in modes]
    fig, ax = plt.subplots(figsize=(5.5, 3))
    x = range(len(modes))
    ax.bar([i - 0.2 for i in x], [s["step_s"] for s in summ], width=0.4, label="time per step")
    ax.bar([i + 0.2 for i in x], [s["trainer_idle_s"] for s in summ], width=0.4, label="trainer idle")
    ax.set_xticks(list(x), modes)
    ax.set_ylabel("seconds (mean)")
    ax.set_title(f"GRPO step, {results['config']['model']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
