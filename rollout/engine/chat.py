"""Multi-turn chat without retokenization drift: each turn's tokens are the earlier turns' tokens as
they were sampled, plus what the environment appends, rendered by the model's own chat template.

The drift this avoids: a loop that keeps messages, re-renders the whole conversation each turn and
tokenizes it again trains on tokens the model never sampled — the tokenizer merges what the model
sampled as separate tokens, a template trims whitespace or drops earlier turns' ``<think>`` blocks
(Qwen3), so logprobs no longer belong to the tokens they are trained with.

``ChatRenderer.append`` gives the tokens to append after an assistant turn (as sampled, ending in the
stop token or not) so that the conversation continues with ``new_messages`` and a generation prompt:

- **template** mode: the template renders the conversation with the assistant's text and the new
  messages; when that rendering starts with the text of the tokens so far (what the model saw and
  sampled, decoded), the rest of it is the delta (the closing of the assistant turn the model did
  not sample, the new messages, the generation prompt), tokenized alone.
- **per-message** mode: when the template renders earlier turns differently once more messages follow
  (Qwen3 drops their reasoning; Llama 3 trims), the new messages are rendered after a fixed stand-in
  conversation instead, and the assistant turn is closed the way the template closes one. The first
  such turn is logged once per renderer; ``mode`` says which was used.

Either way the returned tokens are appended to the sampled ones, never re-tokenized with them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from rollout.config import InputError
from rollout.engine.templates import RenderLimits, render, template_variables

logger = logging.getLogger(__name__)

_SENTINEL = "\u2063rollout-assistant-sentinel\u2063"  # a stand-in assistant reply no model writes


class RenderError(InputError):
    """The template cannot continue this conversation append-only."""


@dataclass
class Appended:
    token_ids: list[int]
    text: str
    mode: str  # "template" or "per-message"


class ChatRenderer:
    """The model's chat template, used so that a conversation only ever grows at its end.

    ``template_kwargs`` are template variables (``enable_thinking``...; ``InputError`` for anything
    else, ``rollout.engine.templates``), ``tools`` its tool list; every rendering runs under ``limits``."""

    def __init__(self, tokenizer, template_kwargs: Optional[dict] = None, tools: Optional[list] = None,
                 stop_token_ids: Optional[list[int]] = None, limits: RenderLimits = RenderLimits()):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise InputError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.variables, _ = template_variables(tokenizer, template_kwargs)
        self.tools = tools or None
        self.limits = limits
        stops = set(stop_token_ids or [])
        if tokenizer.eos_token_id is not None:
            stops.add(tokenizer.eos_token_id)
        self.stop_token_ids = stops
        self._warned = False

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return render(self.tokenizer, messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                      tools=self.tools, variables=self.variables, limits=self.limits)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, messages: list[dict]) -> list[int]:
        """The first turn's prompt: the conversation so far and the generation prompt."""
        return self.encode(self.render(messages, True))

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def append(self, history_ids: list[int], messages: list[dict], completion_ids: list[int],
               new_messages: list[dict]) -> Appended:
        """The tokens to append after ``completion_ids`` — the assistant turn as sampled after
        ``history_ids`` (the conversation ``messages`` as the model saw it) — for the conversation to
        continue with ``new_messages`` and a generation prompt."""
        if not new_messages:
            raise RenderError("no messages to append")
        stopped = bool(completion_ids) and completion_ids[-1] in self.stop_token_ids
        body = completion_ids[:-1] if stopped else completion_ids
        content = self.text(body)
        stop_text = self.text(completion_ids[-1:]) if stopped else ""
        said = self.text(list(history_ids) + list(body))  # what the model saw and sampled, exactly
        full = self.render(messages + [{"role": "assistant", "content": content}] + new_messages, True)
        # the model stopped with the token the template closes a reply with; or with another stop token
        # (kept as sampled), after which the template's own closing follows
        seen = said + stop_text if full.startswith(said + stop_text) else said
        if full.startswith(seen):
            delta = full[len(seen):]
            return Appended(self.encode(delta), delta, "template")
        delta = self._after_stand_in(new_messages, stop_text)
        if not self._warned:
            self._warned = True
            logger.warning("this chat template renders earlier turns differently once more messages follow; new "
                           "messages are rendered on their own (append-only, per message)")
        return Appended(self.encode(delta), delta, "per-message")

    def _after_stand_in(self, new_messages: list[dict], stop_text: str) -> str:
        """The template's text after a stand-in assistant reply followed by ``new_messages`` (the
        reply's closing, the new messages, the generation prompt), less the stop token the model
        already sampled when the template closes with that token."""
        stand_in = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}]
        rendered = self.render(stand_in + new_messages, True)
        at = rendered.find(_SENTINEL)
        if at < 0 or rendered.count(_SENTINEL) != 1:
            raise RenderError("the template does not render an assistant reply verbatim")
        after = rendered[at + len(_SENTINEL):]
        if stop_text and after.startswith(stop_text):  # the model sampled the template's own closing token
            after = after[len(stop_text):]
        return after
