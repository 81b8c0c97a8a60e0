"""``rollout bench throughput``: RL-shaped rollout throughput, our engine against Hugging Face
``transformers`` on the same model, dtype, prompts and sampling, in one run.

Workloads (fixed and named, so results can be cited; ``--num-prompts`` etc. override them):

- ``grpo-short``: 64 chat prompts x n=8 samples, up to 256 new tokens, temperature 1, top-k and
  top-p off, EOS allowed;
- ``grpo-long``: 16 chat prompts x n=8, up to 1024 new tokens, otherwise the same;
- ``score``: prefill-only logprobs of given sequences (64 prompts x 8 completions of 256 tokens,
  the scoring pass of an RL step): the engine's ``score`` against a ``transformers`` forward +
  log-softmax in micro-batches of ``--hf-batch`` sequences;
- ``nano-vllm``: the recipe vLLM-class engines publish (nano-vllm's bench): 256 sequences of random
  token ids, input and output lengths each uniform in [100, 1024], ``ignore_eos``; engine only by default
  (``--baselines`` adds them), a figure to set beside vLLM's published ones;
- ``grpo``: 64 chat prompts x n=8, up to 1024 new tokens, temperature 1, EOS on (a model whose answers
  end: ``smollm2``), against ``generate`` and ``transformers``' continuous batching (``generate_batch``,
  what TRL's GRPO trainer uses now) in the same run;
- ``agentic``: 16 episodes x 6 turns, each turn appending a 48-token tool result and sampling 32
  tokens: sessions against resending the whole history each turn with the prefix cache on, in one
  engine (``rollout.bench.agentic``; no ``transformers`` side).

Generation on the ``transformers`` side (``generate``) is one call over all prompts (``n`` as
``num_return_sequences``; left padding), so padding and finished rows it keeps computing are
counted as they cost; ``generate_batch`` gets every sample as its own prompt (one generation config: the
longest output where lengths vary). Useful tokens are the tokens up to and including EOS (or a
sequence's own length) on every side.

Engine feature switches, each recorded in the result: ``--overlap``, ``--prefix`` (off: no prefix
cache and every sample submitted as its own prompt, no shared prefill), ``--tp-size``, ``--graphs``
(CUDA graphs; CPU runs eager either way).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, replace

import torch

from rollout.bench.common import (
    DEFAULT_WORKDIR,
    add_engine_arg_flag,
    add_model_flags,
    build_model,
    machine,
    model_label,
    parse_engine_args,
    save_figure,
    write_result,
)
from rollout.config import auto_device

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain gravity to a child.",
    "List three prime numbers.", "What is 17 times 3?", "Name a color of the rainbow.",
    "Give me a synonym for happy.", "Why is the sky blue?", "Translate 'good morning' to Spanish.",
    "What do bees make?", "Describe a cat in one sentence.", "What is the boiling point of water?",
    "Tell me a fun fact about octopuses.", "How many legs does a spider have?", "What is 2 + 2?",
    "Suggest a name for a pet robot.",
]


@dataclass(frozen=True)
class Workload:
    name: str
    num_prompts: int
    n: int
    max_new_tokens: int
    ignore_eos: bool = False
    score: bool = False  # prefill-only logprobs of prompt + max_new_tokens given tokens
    turns: int = 0  # agentic: turns per episode
    tool_len: int = 0  # agentic: tokens each tool result appends
    lengths: tuple[int, int] = (0, 0)  # random prompts: input and output lengths uniform in this range
    baselines: tuple[str, ...] = ("generate",)  # the transformers sides run beside the engine


WORKLOADS = {
    "grpo-short": Workload("grpo-short", 64, 8, 256),
    "grpo-long": Workload("grpo-long", 16, 8, 1024),
    "score": Workload("score", 64, 8, 256, score=True),
    "agentic": Workload("agentic", 16, 1, 32, ignore_eos=True, turns=6, tool_len=48, baselines=()),
    "nano-vllm": Workload("nano-vllm", 256, 1, 1024, ignore_eos=True, lengths=(100, 1024), baselines=()),
    "grpo": Workload("grpo", 64, 8, 1024, baselines=("generate", "generate_batch")),
}
BASELINES = ("generate", "generate_batch")


@dataclass(frozen=True)
class Features:
    overlap: bool = False
    prefix: bool = True
    tp_size: int = 1
    graphs: bool = True
    speculative: bool = False  # exact speculation from past rollouts (SPEC_DRAFT_TOKENS guesses a step)


SPEC_DRAFT_TOKENS = 4


def spec_stats(before: dict, after: dict) -> dict:
    """What speculation did between two ``get_stats``: verify steps, guesses verified, accepted, guesses the
    cost policy left out, tokens per verify."""
    if "spec_verify_ct" not in after:
        return {}
    d = {k: after[k] - before.get(k, 0) for k in ("spec_verify_ct", "spec_draft_token_num", "spec_accept_token_num",
                                                  "spec_declined_token_num")}
    d["acceptance"] = d["spec_accept_token_num"] / max(1, d["spec_draft_token_num"])
    d["tokens_per_verify"] = (d["spec_verify_ct"] + d["spec_accept_token_num"]) / max(1, d["spec_verify_ct"])
    return d


def make_prompts(tokenizer, num_prompts: int) -> list[list[int]]:
    prompts = []
    for i in range(num_prompts):
        q = QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (variant {i // len(QUESTIONS)})")
        msgs = [{"role": "user", "content": q}]
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(q)["input_ids"]
        prompts.append(list(ids))
    return prompts


def random_requests(w: Workload, vocab: int) -> tuple[list[list[int]], list[int]]:
    """The ``lengths`` workloads' prompts (random ids) and each one's number of new tokens, from a fixed seed."""
    gen = torch.Generator().manual_seed(0)
    lo, hi = w.lengths
    ins = torch.randint(lo, hi + 1, (w.num_prompts,), generator=gen).tolist()
    outs = torch.randint(lo, min(hi, w.max_new_tokens) + 1, (w.num_prompts,), generator=gen).tolist()
    return [torch.randint(10, min(vocab, 10000), (n,), generator=gen).tolist() for n in ins], outs


def completions(prompts: list[list[int]], n: int, length: int, vocab: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, completion) pairs to score: ``n`` random completions of ``length`` tokens per prompt."""
    gen = torch.Generator().manual_seed(0)
    return [(p, torch.randint(10, vocab, (length,), generator=gen).tolist()) for p in prompts for _ in range(n)]


def useful_lengths(seqs: torch.Tensor, eos_ids: set[int], ignore_eos: bool) -> list[int]:
    out = []
    for row in seqs.tolist():
        n = len(row)
        if not ignore_eos:
            n = next((i + 1 for i, t in enumerate(row) if t in eos_ids), n)
        out.append(n)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_hf_generate(path, dtype, prompts, w: Workload, eos_ids, hf_batch, out_lens=None) -> dict:
    from transformers import AutoModelForCausalLM

    dev = auto_device()  # where the engine runs: never a GPU engine against a CPU baseline
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else next(iter(eos_ids))
    torch.manual_seed(0)
    total, steps, t0 = 0, 0, time.perf_counter()
    for i in range(0, len(prompts), hf_batch):
        chunk = prompts[i: i + hf_batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=dev)
        kwargs = dict(max_new_tokens=w.max_new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                      num_return_sequences=w.n, pad_token_id=pad)
        if w.ignore_eos:
            kwargs["min_new_tokens"] = w.max_new_tokens
        else:
            kwargs["eos_token_id"] = sorted(eos_ids)
        if out_lens is not None:  # one length for the chunk: its longest; each counts its own
            kwargs["max_new_tokens"] = max(out_lens[i: i + hf_batch])
            if w.ignore_eos:
                kwargs["min_new_tokens"] = kwargs["max_new_tokens"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, **kwargs)
        useful = useful_lengths(out[:, width:], eos_ids, w.ignore_eos)
        if out_lens is not None:
            useful = [min(u, out_lens[i + j // w.n]) for j, u in enumerate(useful)]
        total += sum(useful)
        steps += out.shape[1] - width
    _sync(dev)
    elapsed = time.perf_counter() - t0
    return {"tokens": total, "seconds": elapsed, "tokens_per_s": total / elapsed, "decode_steps": steps,
            "padded_tokens": steps * len(prompts) * w.n, "device": str(dev)}


def run_hf_continuous(path, dtype, prompts, w: Workload, eos_ids, out_lens=None) -> dict:
    """``transformers``' continuous batching (``generate_batch``): every sample its own request, the same
    sampling, one call timed whole — how a trainer calls it each step, its own warm-up (CUDA graph capture)
    inside; ``call_fixed_cost_s`` is a two-request call's time, that cost alone."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    dev = auto_device()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else next(iter(eos_ids))
    longest = max(out_lens) if out_lens is not None else w.max_new_tokens
    config = GenerationConfig(max_new_tokens=longest, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              pad_token_id=pad, eos_token_id=-1 if w.ignore_eos else sorted(eos_ids))
    requests = [p for p in prompts for _ in range(w.n)]
    cb = None
    if dev.type == "cpu":  # its cache is sized from free memory otherwise: seconds to allocate on a CPU
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        page = 32
        need = sum(-(-(len(p) + longest) // page) for p in requests)
        cb = ContinuousBatchingConfig(num_blocks=need, page_size=page)
    torch.manual_seed(0)
    with torch.no_grad():
        t0 = time.perf_counter()  # a call's fixed cost (manager, cache, graph capture), measured alone
        model.generate_batch(requests[:2], generation_config=GenerationConfig(
            max_new_tokens=2, do_sample=True, pad_token_id=pad, eos_token_id=-1), continuous_batching_config=cb)
        _sync(dev)
        warmup_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        outs = model.generate_batch(requests, generation_config=config, continuous_batching_config=cb)
        _sync(dev)
    elapsed = time.perf_counter() - t0
    total = 0
    for i, key in enumerate(sorted(outs, key=lambda k: int(k.rsplit("_", 1)[-1]))):
        toks = list(outs[key].generated_tokens)
        n = len(toks) if w.ignore_eos else next((j + 1 for j, t in enumerate(toks) if t in eos_ids), len(toks))
        total += min(n, out_lens[i // w.n]) if out_lens is not None else n
    return {"tokens": total, "seconds": elapsed, "tokens_per_s": total / elapsed, "requests": len(requests),
            "call_fixed_cost_s": warmup_s, "device": str(dev)}


def run_hf_score(path, dtype, pairs, hf_batch) -> dict:
    """Logprob of every completion token: one forward per micro-batch (right padding), fp32 log-softmax."""
    from transformers import AutoModelForCausalLM

    dev = auto_device()  # where the engine runs: never a GPU engine against a CPU baseline
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
    total, t0 = 0, time.perf_counter()
    for i in range(0, len(pairs), hf_batch):
        chunk = pairs[i: i + hf_batch]
        seqs = [p + c for p, c in chunk]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=dev)
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=dev)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        for j, (p, c) in enumerate(chunk):
            rows = logits[j, len(p) - 1: len(p) - 1 + len(c)].float()
            torch.log_softmax(rows, dim=-1).gather(1, torch.tensor(c, device=dev).unsqueeze(1))
            total += len(c)
    _sync(dev)
    elapsed = time.perf_counter() - t0
    return {"tokens": total, "seconds": elapsed, "tokens_per_s": total / elapsed, "device": str(dev)}


def _engine(path, dtype, features: Features, max_seqs: int, kv_tokens: int, engine_args: dict | None = None):
    from rollout import RolloutEngine

    engine_args = {k: v for k, v in (engine_args or {}).items() if k != "kv_cache_tokens"}
    return RolloutEngine(path, dtype=dtype, tp_size=features.tp_size, enable_overlap=features.overlap,
                         enable_prefix_caching=features.prefix, enable_cuda_graph=features.graphs,
                         kv_cache_tokens=kv_tokens, max_num_seqs=max_seqs, use_generation_config=False,
                         speculative_num_draft_tokens=SPEC_DRAFT_TOKENS if features.speculative else 0,
                         **engine_args)


def run_engine(path, dtype, prompts, w: Workload, features: Features, max_num_seqs: int,
               engine_args: dict | None = None, out_lens=None) -> dict:
    from rollout import SamplingParams

    kv_tokens = min(len(prompts) * w.n, max_num_seqs) * (max(map(len, prompts)) + w.max_new_tokens + 32)
    if engine_args and engine_args.get("kv_cache_tokens"):
        kv_tokens = engine_args["kv_cache_tokens"]
    if w.turns:
        kv_tokens = len(prompts) * (max(map(len, prompts)) + w.turns * (w.max_new_tokens + w.tool_len) + 64)
    with _engine(path, dtype, features, max_num_seqs, kv_tokens, engine_args) as engine:
        if w.turns:
            from rollout.bench.agentic import run_agentic

            return run_agentic(engine, prompts, w)
        if w.score:
            pairs = completions(prompts, w.n, w.max_new_tokens, engine.model_config.vocab_size)
            sp = SamplingParams(temperature=1.0, top_k=-1, top_p=1.0)
            engine.score([p for p, _ in pairs[:2]], [c[:4] for _, c in pairs[:2]], sp,
                         return_sampling_mask=False)  # warm-up
            t0 = time.perf_counter()
            outs = engine.score([p for p, _ in pairs], [c for _, c in pairs], sp, return_sampling_mask=False)
            elapsed = time.perf_counter() - t0
            total = sum(len(o.output_logprobs) for o in outs)
            return {"tokens": total, "seconds": elapsed, "tokens_per_s": total / elapsed}
        n, todo = (w.n, prompts) if features.prefix else (1, [p for p in prompts for _ in range(w.n)])
        sp = SamplingParams(max_new_tokens=w.max_new_tokens, temperature=1.0, top_k=-1, top_p=1.0, n=n, seed=0,
                            ignore_eos=w.ignore_eos)
        if out_lens is not None:  # one request per prompt, each with its own length
            sp = [replace(sp, max_new_tokens=k, seed=i) for i, k in enumerate(out_lens)]
        engine.generate(input_ids=prompts[:1], sampling_params=SamplingParams(max_new_tokens=2))  # warm-up
        base = engine.get_stats()
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=todo, sampling_params=sp)
        elapsed = time.perf_counter() - t0
        stats = engine.get_stats()
    delta = {k: stats[k] - base[k] for k in ("num_sample_steps", "sample_time_s", "forward_time_s", "num_decode_steps",
                                             "decode_step_time_s", "decode_step_batch", "num_preemptions",
                                             "num_graph_replays", "num_eager_decode_steps", "num_graph_samples")}
    steps = max(delta["num_sample_steps"], 1)
    lengths = sorted(len(o.output_token_ids) for o in outs)
    return {"tokens": sum(lengths), "seconds": elapsed, "tokens_per_s": sum(lengths) / elapsed,
            "steps": delta["num_sample_steps"], "forward_ms_per_step": 1e3 * delta["forward_time_s"] / steps,
            "sampler_ms_per_step": 1e3 * delta["sample_time_s"] / steps,
            "decode_step_ms": 1e3 * delta["decode_step_time_s"] / max(delta["num_decode_steps"], 1),
            "decode_steps": delta["num_decode_steps"], "decode_seconds": delta["decode_step_time_s"],
            "mean_decode_batch": delta["decode_step_batch"] / max(delta["num_decode_steps"], 1),
            "preemptions": delta["num_preemptions"], "graph_replays": delta["num_graph_replays"],
            "eager_decode_steps": delta["num_eager_decode_steps"], "graph_samples": delta["num_graph_samples"],
            "output_len_mean": sum(lengths) / len(lengths), "output_len_max": lengths[-1], **spec_stats(base, stats)}


def run(model: str = "smollm2", workload: str = "grpo-short", dtype: str = "bfloat16", features: Features = Features(),
        skip_hf: bool = False, hf_batch: int = 0, max_num_seqs: int = 256, out_dir: str = "benchmarks/results",
        workdir: str = DEFAULT_WORKDIR, overrides: dict | None = None, engine_args: dict | None = None,
        tag: str = "", hf_dtype: str | None = None, baselines: tuple[str, ...] | None = None) -> dict:
    from transformers import AutoTokenizer

    from rollout.models import ModelConfig

    w = replace(WORKLOADS[workload], **{k: v for k, v in (overrides or {}).items() if v is not None})
    baselines = () if skip_hf or w.turns else tuple(w.baselines if baselines is None else baselines)
    if unknown := set(baselines) - set(BASELINES):
        raise ValueError(f"baselines {sorted(unknown)}: choose among {', '.join(BASELINES)}")
    path = build_model(model, workdir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    out_lens = None
    if w.lengths != (0, 0):
        prompts, out_lens = random_requests(w, ModelConfig.from_pretrained(path).vocab_size)
    else:
        prompts = make_prompts(tokenizer, w.num_prompts)
    eos_ids = set(ModelConfig.from_pretrained(path).eos_token_ids) | {tokenizer.eos_token_id}
    label = model_label(model)
    result = {"benchmark": "throughput", "machine": machine(),
              "config": {"model": label, "dtype": dtype, "hf_dtype": hf_dtype or dtype, "workload": asdict(w),
                         "features": asdict(features),
                         "max_num_seqs": max_num_seqs, "hf_batch": hf_batch or (16 if w.score else w.num_prompts),
                         "engine_args": engine_args or {}, "baselines": list(baselines)}}
    from tqdm import tqdm

    hf_type = getattr(torch, hf_dtype or dtype)
    with tqdm(total=1 + len(baselines), desc=f"throughput {w.name} {label}") as bar:
        result["engine"] = run_engine(path, dtype, prompts, w, features, max_num_seqs, engine_args, out_lens)
        bar.update(1)
        hf_b = result["config"]["hf_batch"]
        if "generate" in baselines:  # the score workload's side is a forward + log-softmax
            if w.score:
                vocab = ModelConfig.from_pretrained(path).vocab_size
                result["hf"] = run_hf_score(path, hf_type, completions(prompts, w.n, w.max_new_tokens, vocab), hf_b)
            else:
                result["hf"] = run_hf_generate(path, hf_type, prompts, w, eos_ids, hf_b, out_lens)
            result["ratio"] = result["engine"]["tokens_per_s"] / result["hf"]["tokens_per_s"]
            bar.update(1)
        if "generate_batch" in baselines:
            result["hf_continuous"] = run_hf_continuous(path, hf_type, prompts, w, eos_ids, out_lens)
            result["ratio_continuous"] = result["engine"]["tokens_per_s"] / result["hf_continuous"]["tokens_per_s"]
            bar.update(1)
    f = features
    hf_part = f"_hf-{hf_dtype}" if hf_dtype and hf_dtype != dtype else ""
    stem = (f"throughput_{w.name}_{label}_{dtype}_tp{f.tp_size}_overlap-{'on' if f.overlap else 'off'}"
            f"_prefix-{'on' if f.prefix else 'off'}{'_spec-on' if f.speculative else ''}{hf_part}{tag}")
    if w.turns:
        from rollout.bench.agentic import plot as agentic_plot

        write_result(result, out_dir, stem, agentic_plot)
    else:
        write_result(result, out_dir, stem, plot)
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    systems = [(k, label) for k, label in (("engine", "rollout-worker"), ("hf", "transformers generate"),
                                           ("hf_continuous", "transformers generate_batch")) if k in result]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    vals = [result[k]["tokens_per_s"] for k, _ in systems]
    bars = ax.bar([label for _, label in systems], vals,
                  color=["tab:blue", "tab:gray", "tab:olive"][: len(systems)])
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    cfg, w = result["config"], result["config"]["workload"]
    ratio = f", {result['ratio']:.2f}x" if "ratio" in result else ""
    feats = ", ".join(f"{k}={v}" for k, v in cfg["features"].items())
    ax.set_ylabel("useful tokens / s")
    hf = f" (transformers {cfg['hf_dtype']})" if cfg.get("hf_dtype", cfg["dtype"]) != cfg["dtype"] else ""
    ax.set_title(f"{w['name']} on {cfg['model']} {cfg['dtype']}{hf}{ratio}\n{w['num_prompts']} prompts x n={w['n']}, "
                 f"{w['max_new_tokens']} tokens; {feats}", fontsize=8)
    save_figure(fig, path)


def add_feature_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("engine features (each measured by switching it)")
    g.add_argument("--overlap", choices=["on", "off"], default="off", help="overlap scheduling (delayed sampling)")
    g.add_argument("--prefix", choices=["on", "off"], default="on",
                   help="prefix cache and shared prefill of the n samples (off: each sample its own prompt)")
    g.add_argument("--tp-size", type=int, default=1)
    g.add_argument("--graphs", choices=["on", "off"], default="on", help="CUDA graphs (no effect on CPU)")
    g.add_argument("--speculative", choices=["on", "off"], default="off",
                   help=f"exact speculation from past rollouts, up to {SPEC_DRAFT_TOKENS} guesses a step where the engine's "
                        "cost policy finds they pay (rollout.speculative)")


def features_from(args) -> Features:
    return Features(overlap=args.overlap == "on", prefix=args.prefix == "on", tp_size=args.tp_size,
                    graphs=args.graphs == "on", speculative=args.speculative == "on")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="rollout bench throughput", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(ap)
    ap.add_argument("--workload", default="grpo-short", choices=list(WORKLOADS))
    ap.add_argument("--num-prompts", type=int, default=None, help="override the workload's")
    ap.add_argument("--n", type=int, default=None, help="override the workload's samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="override the workload's")
    ap.add_argument("--ignore-eos", action="store_true", default=None, help="every sample runs to max-new-tokens")
    ap.add_argument("--hf-batch", type=int, default=0,
                    help="prompts per generate call (default all: one call), sequences per scoring forward (16)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--skip-hf", action="store_true", help="measure only our engine")
    ap.add_argument("--baselines", default=None,
                    help=f"comma list among {', '.join(BASELINES)} (default: the workload's; nano-vllm none, grpo both)")
    ap.add_argument("--hf-dtype", default=None, choices=["bfloat16", "float32"],
                    help="transformers' dtype (default: --dtype); e.g. float32 where the CPU has no native bf16, "
                         "its fastest dtype there")
    add_feature_flags(ap)
    add_engine_arg_flag(ap)
    ap.add_argument("--tag", default="", help="appended to the result's file name")
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--workdir", default=DEFAULT_WORKDIR)
    args = ap.parse_args(argv)
    overrides = {"num_prompts": args.num_prompts, "n": args.n, "max_new_tokens": args.max_new_tokens,
                 "ignore_eos": args.ignore_eos}
    res = run(args.model, args.workload, args.dtype, features_from(args), args.skip_hf, args.hf_batch,
              args.max_num_seqs, args.out_dir, args.workdir, overrides, parse_engine_args(args.engine_arg), args.tag,
              args.hf_dtype, None if args.baselines is None else tuple(b for b in args.baselines.split(",") if b))
    e = res["engine"]
    line = f"{args.workload}: engine {e['tokens_per_s']:.0f} tok/s"
    if "sessions" in e:
        line += (f" with sessions, {e['resend']['tokens_per_s']:.0f} resending the history ({e['sessions_speedup']:.2f}x; "
                 f"prefill tokens {e['sessions']['prefill_tokens']} vs {e['resend']['prefill_tokens']}, same tokens: "
                 f"{e['same_tokens']})")
    if "hf" in res:
        line += f", transformers {res['hf']['tokens_per_s']:.0f} tok/s, ratio {res['ratio']:.2f}x"
    if "hf_continuous" in res:
        line += (f", transformers generate_batch {res['hf_continuous']['tokens_per_s']:.0f} tok/s, ratio "
                 f"{res['ratio_continuous']:.2f}x")
    print(line)
    return res


if __name__ == "__main__":
    main()
