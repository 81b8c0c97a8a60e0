"""Tokenizer helpers: loading (optional: the engine works on token ids alone), chat templates,
and decoding for stop strings and output text. Outputs are never re-tokenized."""

from __future__ import annotations

import os
from typing import Optional

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str):
    """The folder's Hugging Face tokenizer, or None when it ships none."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        **template_kwargs) -> list[int]:
    """The conversation rendered by the model's chat template and tokenized; ``template_kwargs``
    reach the template (e.g. ``enable_thinking``, the ``chat_template_kwargs`` of vLLM and SGLang)."""
    if tokenizer is None:
        raise ValueError("this model folder has no tokenizer: pass input_ids instead of chat messages")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; tokenize the conversation yourself")
    reserved = {"tokenize", "add_generation_prompt", "conversation", "messages", "return_dict"} & set(template_kwargs)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {sorted(reserved)}")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        **template_kwargs)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def make_detokenizer(tokenizer):
    """A ``(ids, skip_special_tokens) -> str`` function, or None without a tokenizer."""
    if tokenizer is None:
        return None

    def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    return decode


def eos_token_ids(tokenizer, config_eos: tuple[int, ...]) -> tuple[int, ...]:
    ids = list(config_eos)
    tok_eos: Optional[int] = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if tok_eos is not None and tok_eos not in ids:
        ids.append(tok_eos)
    return tuple(ids)
