"""Tiny Llama-family models built locally (no model hub): for the demo, tests and benchmarks.

``make_tiny_model`` writes a Hugging Face folder (config, generation config, safetensors and a
small byte-level BPE tokenizer trained on an embedded corpus). Embedding and head weights are
drawn larger than Hugging Face's default init so greedy top-1 margins sit well above float
rounding; tests still check the margin of every step they compare.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

_CORPUS = """The quick brown fox jumps over the lazy dog. A rollout engine generates completions.
Reinforcement learning from feedback trains a policy with rewards. The reward is one when the answer is right.
Question: what is two plus three? Answer: five. Question: what is four plus four? Answer: eight.
Count with me: one two three four five six seven eight nine ten.
The cat sat on the mat. The dog sat on the log. Tokens, logprobs, weights and caches.
Hello, world! How are you today? I am fine, thank you. Please write a short story about a robot.
def add(a, b): return a + b
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * / = ( ) [ ] { } < > : ; , . ! ?
apple banana cherry grape lemon mango orange peach pear plum red green blue yellow black white
"""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

ARCHITECTURES = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "qwen3_moe": "Qwen3MoeConfig",
    "mixtral": "MixtralConfig",
    "qwen2_moe": "Qwen2MoeConfig",
    "olmoe": "OlmoeConfig",
}


@functools.lru_cache(maxsize=4)
def build_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on the embedded corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


_QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
                  "</tool_response>", "<think>", "</think>"]
# the real models' chat templates shipped in rollout/tools/chat_templates: special tokens, stop token, bos
CHAT_FORMATS = {
    "chatml_smollm2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", None),
    "qwen2_5": (_QWEN_SPECIALS, "<|im_end|>", None),
    "qwen3": (_QWEN_SPECIALS, "<|im_end|>", None),
    "llama3_1": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                  "<|python_tag|>"], "<|eot_id|>", "<|begin_of_text|>"),
}


def chat_template(name: str) -> str:
    """The chat template ``name`` (a key of ``CHAT_FORMATS``) as its model ships it."""
    if name not in CHAT_FORMATS:
        raise ValueError(f"chat template {name!r}: use one of {sorted(CHAT_FORMATS)}")
    with open(os.path.join(os.path.dirname(__file__), "chat_templates", name + ".jinja")) as f:
        return f.read()


def build_chat_tokenizer(name: str, extra_corpus: str = "", vocab_size: int = 400):
    """A byte-level BPE tokenizer trained on the embedded corpus (and ``extra_corpus``) for the chat
    template ``name``, whose special tokens are single added tokens as in the real model; its EOS is
    the template's end-of-turn token (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials, stop, bos = CHAT_FORMATS[name]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((_CORPUS + 'lookup {"name": "key": "arguments" code tool\n' + extra_corpus).splitlines() * 4,
                            trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=stop, bos_token=bos,
                                   pad_token=specials[0] if specials[0] not in (stop, bos) else stop,
                                   additional_special_tokens=[s for s in specials if s not in (stop, bos)])
    fast.chat_template = chat_template(name)
    return fast


def make_tiny_model(path: str, arch: str = "llama", *, hidden_size: int = 64, intermediate_size: int = 128,
                    num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, head_dim: Optional[int] = None,
                    vocab_size: Optional[int] = None, tie_word_embeddings: bool = False, seed: int = 0,
                    embed_std: float = 1.0, head_std: float = 0.5, dtype: torch.dtype = torch.float32,
                    with_tokenizer: bool = True, max_position_embeddings: int = 512, tokenizer=None,
                    router_std: float = 1.0, expert_std: float = 0.08, **config_extra) -> str:
    """Write a random tiny model of ``arch`` (llama, mistral, qwen2, qwen3; mixtures of experts qwen3_moe, qwen2_moe,
    mixtral and olmoe, their routers drawn with ``router_std``, their experts with ``expert_std``) to ``path``; return it.
    ``tokenizer``: one to ship instead of the embedded one (e.g. ``build_chat_tokenizer``)."""
    import transformers

    os.makedirs(path, exist_ok=True)
    if tokenizer is None and with_tokenizer:
        tokenizer = build_tokenizer()
    n_tok = len(tokenizer) if tokenizer is not None else 0
    vocab_size = vocab_size or max(n_tok, 256)
    if vocab_size < n_tok:
        raise ValueError(f"vocab_size {vocab_size} < tokenizer size {n_tok}")
    config_cls = getattr(transformers, ARCHITECTURES[arch])
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    kwargs = dict(hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, vocab_size=vocab_size,
                  tie_word_embeddings=tie_word_embeddings, max_position_embeddings=max_position_embeddings,
                  eos_token_id=eos, bos_token_id=None, pad_token_id=eos)
    kwargs["head_dim"] = head_dim or hidden_size // num_heads
    if arch == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(config_extra)
    config = config_cls(**kwargs)
    config.architectures = [config_cls.__name__.replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.normal_(0, embed_std)
            elif name == "lm_head.weight":
                p.normal_(0, head_std)
            elif name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            elif name.endswith("mlp.gate.weight"):  # a MoE router: wide margins, so no top-k is a near tie
                p.normal_(0, router_std)
            elif ".experts." in name:  # (transformers v5: experts.gate_up_proj / down_proj, every expert's)
                p.normal_(0, expert_std)
            else:
                p.normal_(0, 0.08)
    model.config.dtype = dtype
    model.save_pretrained(path, safe_serialization=True)
    model.generation_config.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def make_tiny_adapter(base_path: str, path: str, *, r: int = 8, lora_alpha: float = 16,
                      target_modules="all-linear", seed: int = 0, std: float = 0.1, use_rslora: bool = False,
                      rank_pattern: Optional[dict] = None, alpha_pattern: Optional[dict] = None, **config_extra) -> str:
    """Write a random PEFT LoRA adapter for the model at ``base_path`` to ``path`` (``peft``'s own
    ``save_pretrained``: ``adapter_config.json`` + ``adapter_model.safetensors``); return it. Both
    matrices are drawn from N(0, ``std``), so the adapter changes what the model says (peft's default
    initialisation, B = 0, would not)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules, use_rslora=use_rslora,
                             rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {}, lora_dropout=0.0,
                             init_lora_weights=False, **config_extra)
    from rollout.weights.lora import peft_quietly

    with peft_quietly():
        model = peft.get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, std)
    model.save_pretrained(path)
    return path
