"""The demo's RL task: a prompt starts with one of two marker tokens; the reward is the fraction of
completion tokens whose id has the parity that marker asks for. A policy has to read its prompt to
win. Shared by the colocated and the disaggregated GRPO examples."""

from __future__ import annotations

import torch


def parity_task(vocab_size: int, num_prompts: int = 64, seed: int = 1234):
    """(prompts, reward_fn) over the last two ids of the vocabulary as markers."""
    markers = (vocab_size - 2, vocab_size - 1)
    g = torch.Generator().manual_seed(seed)
    prompts = [[markers[i % 2]] + torch.randint(3, vocab_size - 2, (5,), generator=g).tolist()
               for i in range(num_prompts)]

    def reward(prompt: list[int], completion: list[int]) -> float:
        want = 0 if prompt[0] == markers[0] else 1
        return sum(1 for t in completion if t % 2 == want) / max(len(completion), 1)

    return prompts, reward
