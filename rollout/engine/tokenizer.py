"""Tokenizer helpers: loading (optional: the engine works on token ids alone), chat templates,
and decoding for stop strings and output text. Outputs are never re-tokenized."""

from __future__ import annotations

import os
from typing import Optional

from rollout.engine.templates import render, template_variables

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str):
    """The folder's Hugging Face tokenizer, or None when it ships none."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        **template_kwargs) -> list[int]:
    """The conversation rendered by the model's chat template and tokenized; ``template_kwargs`` are
    template variables (e.g. ``enable_thinking``, the ``chat_template_kwargs`` of vLLM and SGLang), a
    ``chat_template`` text among them used instead of the model's (the caller's own, trusted).
    Rendered under ``rollout.engine.templates``' limits; bad input raises ``InputError``."""
    variables, template = template_variables(tokenizer, template_kwargs, trust_request_template=True)
    return render(tokenizer, messages, add_generation_prompt=add_generation_prompt, variables=variables,
                  chat_template=template)


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
