"""The ``agentic`` workload of ``rollout bench throughput``: multi-turn episodes (each turn appends a
tool result of fixed length and samples a reply), run in one engine two ways — as sessions (the
history's KV kept between turns, ``RolloutEngine.open_session``) and by resending the whole history
as a new request every turn with the prefix cache on — reporting tokens/s, the prompt tokens each
way computed, and whether both gave the same tokens. Draws depend only on seed and position, so they
do bitwise in the batch-invariant mode (``--engine-arg deterministic=true``); otherwise a token's KV
computed in a decode step and recomputed in a prefill chunk can differ in the last bits (GEMM kernels
are chosen by row count), which now and then flips a sampled token and the episode goes another way
(measured on SmolLM2: fp32 and bf16 differ, the batch-invariant mode does not).
All episodes' turn k run concurrently.
"""

from __future__ import annotations

import asyncio
import time

import torch


def _tool_results(num: int, turns: int, length: int, vocab: int) -> list[list[list[int]]]:
    gen = torch.Generator().manual_seed(1)
    return [[torch.randint(10, vocab, (length,), generator=gen).tolist() for _ in range(turns - 1)] for _ in range(num)]


def run_agentic(engine, prompts: list[list[int]], w) -> dict:
    from rollout import SamplingParams

    sp = SamplingParams(max_new_tokens=w.max_new_tokens, temperature=1.0, top_k=-1, top_p=1.0, seed=0,
                        ignore_eos=w.ignore_eos)
    tools = _tool_results(len(prompts), w.turns, w.tool_len, engine.model_config.vocab_size)
    engine.generate(input_ids=prompts[:1], sampling_params=SamplingParams(max_new_tokens=2))  # warm-up

    def stats() -> dict:
        return engine.get_stats()

    # sessions
    sids = [engine.open_session() for _ in prompts]

    async def turn(k: int):
        return await asyncio.gather(*[engine.async_generate(
            input_ids=[prompts[i] if k == 0 else tools[i][k - 1]], sampling_params=sp, session_id=s)
            for i, s in enumerate(sids)])

    base, t0 = stats(), time.perf_counter()
    sampled = 0
    for k in range(w.turns):
        sampled += sum(len(o[0].output_token_ids) for o in asyncio.run(turn(k)))
    sessions_s = time.perf_counter() - t0
    sessions_prefill = stats()["num_prefill_tokens"] - base["num_prefill_tokens"]
    via_sessions = [engine.session_info(s)["token_ids"] for s in sids]
    for s in sids:
        engine.close_session(s)
    engine.flush_cache()
    # the whole history resent every turn (the prefix cache on)
    history = [list(p) for p in prompts]
    base, t0 = stats(), time.perf_counter()
    for k in range(w.turns):
        if k:
            history = [h + tools[i][k - 1] for i, h in enumerate(history)]
        outs = engine.generate(input_ids=history, sampling_params=sp)
        history = [o.prompt_token_ids + o.output_token_ids for o in outs]
    resend_s = time.perf_counter() - t0
    resend_prefill = stats()["num_prefill_tokens"] - base["num_prefill_tokens"]
    return {"sessions": {"seconds": sessions_s, "tokens": sampled, "tokens_per_s": sampled / sessions_s,
                         "prefill_tokens": sessions_prefill},
            "resend": {"seconds": resend_s, "tokens": sampled, "tokens_per_s": sampled / resend_s,
                       "prefill_tokens": resend_prefill},
            "sessions_speedup": resend_s / sessions_s,
            "prefill_tokens_ratio": sessions_prefill / max(resend_prefill, 1),
            "same_tokens": via_sessions == history,
            # what the engine's row reports alongside the other workloads
            "tokens": sampled, "tokens_per_s": sampled / sessions_s}


def plot(result: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    from rollout.bench.common import save_figure

    e, cfg = result["engine"], result["config"]
    ways = [("sessions", "sessions"), ("resend", "whole history\nresent")]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    bars = axes[0].bar([label for _, label in ways], [e[k]["tokens_per_s"] for k, _ in ways], color=["tab:blue",
                                                                                                      "tab:gray"])
    axes[0].bar_label(bars, fmt="%.0f", fontsize=8)
    axes[0].set_ylabel("sampled tokens / s")
    bars = axes[1].bar([label for _, label in ways], [e[k]["prefill_tokens"] for k, _ in ways],
                       color=["tab:blue", "tab:gray"])
    axes[1].bar_label(bars, fmt="%.0f", fontsize=8)
    axes[1].set_ylabel("prompt tokens computed")
    w = cfg["workload"]
    fig.suptitle(f"agentic on {cfg['model']} {cfg['dtype']}: {w['num_prompts']} episodes x {w['turns']} turns, "
                 f"{w['tool_len']}-token tool results, {w['max_new_tokens']} tokens a turn; "
                 f"{e['sessions_speedup']:.2f}x", fontsize=8)
    save_figure(fig, path)
