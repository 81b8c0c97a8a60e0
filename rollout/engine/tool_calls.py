"""Tool calls and reasoning parsed out of a completion's text, into OpenAI's message fields.

- ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
  number, anywhere in the text.
- ``llama3_json`` (Llama 3.x): the whole reply (after an optional ``<|python_tag|>``) is one JSON object
  ``{"name": ..., "parameters": {...}}`` (``arguments`` accepted too).
- reasoning (``<think>...</think>``, Qwen3 and DeepSeek-R1 style): the text before ``</think>`` is
  ``reasoning_content``; a reply that opens no ``<think>`` (the prompt did) is handled too.

``parser_for_template`` picks the parser a chat template implies. Parsing never changes the tokens:
the trainer trains on the tokens sampled; these fields are for the agent.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Optional

PARSERS = ("hermes", "llama3_json")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ParsedReply:
    content: Optional[str]
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI's: {"id", "type": "function", "function"}
    reasoning_content: Optional[str] = None


def parser_for_template(template: Optional[str]) -> Optional[str]:
    """The tool-call format a chat template teaches its model, or None."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or '"parameters"' in template:
        return "llama3_json"
    return None


def has_reasoning(template: Optional[str]) -> bool:
    return bool(template) and "<think>" in template


def _call(name, arguments) -> Optional[dict]:
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def split_reasoning(text: str) -> tuple[Optional[str], str]:
    """(reasoning, the rest) at ``</think>``; no ``</think>``: no reasoning."""
    if "</think>" not in text:
        return None, text
    head, rest = text.split("</think>", 1)
    head = head.split("<think>", 1)[-1]
    return head.strip("\n"), rest.lstrip("\n")


def parse_reply(text: str, parser: Optional[str], reasoning: bool = False) -> ParsedReply:
    """The reply's content, tool calls (a call whose JSON does not parse stays in the content) and
    reasoning."""
    thought = None
    if reasoning:
        thought, text = split_reasoning(text)
    if parser is None:
        return ParsedReply(text, [], thought)
    if parser not in PARSERS:
        raise ValueError(f"tool-call parser {parser!r}: use one of {PARSERS}")
    calls: list[dict] = []
    if parser == "hermes":
        def take(m: re.Match) -> str:
            try:
                obj = json.loads(m.group(1))
            except ValueError:
                return m.group(0)
            call = _call(obj.get("name"), obj.get("arguments", obj.get("parameters"))) if isinstance(obj, dict) \
                else None
            if call is None:
                return m.group(0)
            calls.append(call)
            return ""
        content = _HERMES.sub(take, text).strip()
    else:
        body = text.split("<|python_tag|>", 1)[-1].strip()
        content = text
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            call = _call(obj.get("name"), obj.get("parameters", obj.get("arguments")))
            if call is not None:
                calls.append(call)
                content = ""
    return ParsedReply(content or (None if calls else ""), calls, thought)
