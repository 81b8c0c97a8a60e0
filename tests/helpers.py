"""Reference computations with Hugging Face ``transformers`` (fp32, one unpadded prompt at a time)."""

from __future__ import annotations

import functools

import torch

MIN_MARGIN = 0.01  # a greedy step whose top-1/top-2 logit gap is below this is decided by rounding


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    """Raw logits [len(ids), vocab] of one unpadded sequence."""
    return hf_model(path)(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(path: str, prompt: list[int], max_new_tokens: int, processor=None) -> tuple[list[int], float]:
    """Greedy tokens by full forwards (no cache), and the smallest top-1/top-2 margin seen.

    processor(logits [V], generated ids) -> processed logits, applied before the argmax.
    """
    ids = list(prompt)
    margin = float("inf")
    for _ in range(max_new_tokens):
        logits = hf_logits(path, ids)[-1]
        if processor is not None:
            logits = processor(logits, ids)
        top2 = logits.topk(2).values
        margin = min(margin, float(top2[0] - top2[1]))
        ids.append(int(logits.argmax()))
    return ids[len(prompt):], margin


def output_ref_logprobs(path: str, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    logits = hf_logits(path, prompt + output)
    lp = torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(output)] / temperature, dim=-1)
    return [float(lp[i, t]) for i, t in enumerate(output)]


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0, low: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab_size, (n,), generator=g).tolist() for n in lengths]
