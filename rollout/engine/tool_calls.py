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


_HERMES_OPEN = "<tool_call>"


class StreamedReply:
    """A reply parsed while it streams: ``feed(text so far, final)`` gives the content to send now and,
    at the end, the parsed tool calls. Content is sent until a tool call may begin (Hermes: a
    ``<tool_call>`` or a partial one at the end; Llama 3 JSON: a reply that opens with ``{`` or
    ``<|python_tag|>``) and held from there; at the end what was held is parsed — calls, or content
    after all. Sent text is never taken back; reasoning is not split out of a stream."""

    def __init__(self, parser: str):
        if parser not in PARSERS:
            raise ValueError(f"tool-call parser {parser!r}: use one of {PARSERS}")
        self.parser = parser
        self.sent = ""

    def _safe(self, text: str) -> str:
        """The part of ``text`` that cannot belong to a tool call."""
        if self.parser == "llama3_json":
            head = text.lstrip()
            if not head or head.startswith("{") or head.startswith("<|python_tag|>") or "<|python_tag|>".startswith(head):
                return ""
            return text
        at = text.find(_HERMES_OPEN)
        if at >= 0:
            return text[:at]
        for k in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):  # a marker still arriving
            if _HERMES_OPEN.startswith(text[-k:]):
                return text[:-k]
        return text

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(content to send now, tool calls — only when ``final``)."""
        if not final:
            safe = self._safe(text.rstrip("\ufffd"))
            if not safe.startswith(self.sent):
                return "", []
            new, self.sent = safe[len(self.sent):], safe
            return new, []
        parsed = parse_reply(text, self.parser)
        if not parsed.tool_calls:  # nothing was a call: the held text is content after all
            new = text[len(self.sent):] if text.startswith(self.sent) else ""
            self.sent = text
            return new, []
        content = parsed.content or ""
        new = content[len(self.sent):] if content.startswith(self.sent) else ""
        return new, parsed.tool_calls
