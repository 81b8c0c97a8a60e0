"""The multi-turn example's task (``examples/grpo_multiturn.py``): ``trainer_bridge.envs.LookupEnv``
episodes, the tiny model it is learned on (a Qwen2-shaped model whose tokenizer has Qwen2.5's special
tokens and chat template) and the supervised warm-up: demonstrations in the task's format (right with
a given probability, random otherwise), played through the same rendering as the sampled episodes."""

from __future__ import annotations

import itertools
import os
import random
import tempfile
from typing import Optional

import torch

from trainer_bridge.envs import LOOKUP_TABLE, LookupEnv


def lookup_tasks(fruits: int) -> list[tuple[str, ...]]:
    """Every ordered choice of ``fruits`` distinct fruits (12 for two)."""
    return list(itertools.permutations(sorted(LOOKUP_TABLE), fruits))


def renders_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def make_lookup_env(tokenizer):
    """task -> a fresh environment; for a template that renders no tools (SmolLM2's ChatML) the tool and
    the Hermes call format are described in the system message instead."""
    describe = not renders_tools(tokenizer)
    return lambda task: LookupEnv(task, describe_tools=describe)


def _tokenizer_corpus() -> str:
    """Conversations of the task, so that the tokenizer's merges cover the template and the replies."""
    from rollout.tools.tiny import build_chat_tokenizer
    from trainer_bridge.multiturn import MultiTurnRunner

    base = build_chat_tokenizer("qwen2_5")
    runner = MultiTurnRunner(None, base, tool_call_parser="hermes")
    lines = []
    for task in lookup_tasks(2):
        env = LookupEnv(task)
        t = runner.script(env, env.reference_replies())
        lines.append(base.decode(t.prompt_token_ids + t.output_token_ids))
    return "\n".join(lines) + "\n" + "\n".join(list(LOOKUP_TABLE) + list(LOOKUP_TABLE.values())) + "\n"


def lookup_model(name: str, seed: int, warmup_steps: int, right: float = 0.0, root: Optional[str] = None) -> str:
    """The model folder the example trains: ``tiny`` or ``tiny-moe`` (built here) or another (``smollm2``, a folder),
    after ``warmup_steps`` of the warm-up (cached under ``root``, default the temp folder; the caller's
    rank 0 builds it, the others wait)."""
    root = root or tempfile.gettempdir()
    if name in ("tiny", "tiny-moe"):
        from rollout.tools.tiny import build_chat_tokenizer, make_tiny_model

        base = os.path.join(root, f"rollout-multiturn-{name}-{seed}")
        # tiny-moe: a Qwen3-MoE of the same size (8 experts, 2 routed per token; for --routing-replay)
        arch = dict(arch="qwen2") if name == "tiny" else dict(
            arch="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[])
        if not os.path.isfile(os.path.join(base, "model.safetensors")):
            tok = build_chat_tokenizer("qwen2_5", extra_corpus=_tokenizer_corpus(), vocab_size=800)
            make_tiny_model(base + ".tmp", hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                            num_kv_heads=2, seed=seed, embed_std=0.05, head_std=0.05, tokenizer=tok,
                            max_position_embeddings=2048, **arch)
            os.replace(base + ".tmp", base) if not os.path.exists(base) else None
    elif name == "smollm2":
        from rollout.tools.smollm2 import smollm2_path

        base = smollm2_path()
    else:
        base = name
    if not warmup_steps:
        return base
    out = os.path.join(root, f"rollout-multiturn-{os.path.basename(base)}-{seed}-w{warmup_steps}-r{right}") \
        if name not in ("tiny", "tiny-moe") else f"{base}-w{warmup_steps}-r{right}"
    if not os.path.isfile(os.path.join(out, "model.safetensors")):
        format_warmup(base, out + ".tmp", warmup_steps, seed, right=right)
        os.replace(out + ".tmp", out) if not os.path.exists(out) else None
    return out


def format_warmup(path: str, out: str, steps: int, seed: int, batch: int = 8, lr: float = 3e-3,
                  right: float = 0.0) -> None:
    """Supervised steps on demonstrations in the task's format: each call names the asked fruit and each
    answer says its colour with probability ``right``, a random one otherwise (``right=0``: the format
    alone); the loss on the assistant tokens alone; the result saved to ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer_bridge.multiturn import MultiTurnRunner

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    runner = MultiTurnRunner(None, tok, max_turns=8, max_total_tokens=2048, tool_call_parser="hermes")
    describe_tools = not renders_tools(tok)
    rng = random.Random(seed)
    tasks = lookup_tasks(2)
    fruits, colours = sorted(LOOKUP_TABLE), sorted(LOOKUP_TABLE.values())

    def demo():
        env = LookupEnv(rng.choice(tasks), describe_tools=describe_tools)
        called = [k if rng.random() < right else rng.choice(fruits) for k in env.keys]
        said = [env.table[c] if rng.random() < right else rng.choice(colours) for c in called]
        replies = env.reference_replies(called, said)
        t = runner.script(env, replies)
        return t.prompt_token_ids + t.output_token_ids, [0] * len(t.prompt_token_ids) + t.loss_mask

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in range(steps):
        seqs = [demo() for _ in range(batch)]
        width = max(len(s) for s, _ in seqs)
        ids = torch.zeros(batch, width, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        attn = torch.zeros(batch, width, dtype=torch.long)
        for i, (s, m) in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            attn[i, :len(s)] = 1
            labels[i, :len(s)] = torch.where(torch.tensor(m) == 1, torch.tensor(s), torch.tensor(-100))
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"format warm-up step {step + 1}/{steps}: loss {loss.item():.3f}", flush=True)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
