"""Append-only chat rendering (``rollout.engine.chat``) with real models' chat templates (SmolLM2's
ChatML, Qwen2.5, Qwen3 with tools and ``<think>``, Llama 3.1; ``rollout/tools/chat_templates``), each with
a tokenizer in which its special tokens are single added tokens: five turns with tool calls, where what
the trainer trains on is exactly the tokens sampled plus the tokens appended, and the re-render and
re-tokenize approach drifts."""

from __future__ import annotations

import functools
import json
import re

import pytest

from rollout.engine.chat import ChatRenderer
from rollout.tools.tiny import CHAT_FORMATS, build_chat_tokenizer

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a key up",
                                           "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                                                          "required": ["key"]}}}]
TEMPLATES = {name: (*fmt, name != "chatml_smollm2") for name, fmt in CHAT_FORMATS.items()}  # + tools rendered


@functools.cache
def template_tokenizer(name: str):
    """A byte-level BPE tokenizer trained locally, the template's special tokens single added tokens."""
    return build_chat_tokenizer(name)


def _sampled(tok, text: str, stop: str) -> list[int]:
    """What a model might sample for ``text``: one token per character (special tokens whole), which the
    tokenizer itself would have merged — the tokens the model really produced, not the canonical ones."""
    ids = []
    for piece in re.split(r"(<[^<>]+>)", text):
        if piece in tok.get_vocab() and piece.startswith("<"):
            ids.append(tok.convert_tokens_to_ids(piece))
        else:
            for ch in piece:
                ids.extend(tok.encode(ch, add_special_tokens=False))
    return ids + [tok.convert_tokens_to_ids(stop)]


def _reply(name: str, k: int) -> str:
    call = {"name": "lookup", "arguments": {"key": f"key{k}"}}
    if name == "chatml_smollm2":
        return f"lookup key{k}"
    if name == "llama3_1":
        return json.dumps({"name": "lookup", "parameters": {"key": f"key{k}"}})
    think = "<think>\nI should look it up.\n</think>\n\n" if name == "qwen3" else ""
    return think + "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"


def _episode(name: str, turns: int = 5):
    """A conversation of ``turns`` assistant turns, each followed by a tool result (or a user message for
    ChatML, whose template has no tool role): (tokens, messages, sampled spans, modes)."""
    specials, stop, _, with_tools = TEMPLATES[name]
    tok = template_tokenizer(name)
    renderer = ChatRenderer(tok, tools=TOOLS if with_tools else None)
    messages = [{"role": "system", "content": "You answer with tools."},
                {"role": "user", "content": "What is the code of key0? Then key1, key2, key3."}]
    tokens = renderer.prompt(messages)
    spans, modes = [], []
    for k in range(turns):
        sampled = _sampled(tok, _reply(name, k), stop)
        spans.append((len(tokens), sampled))
        history = list(tokens)
        tokens += sampled
        new = ([{"role": "tool", "content": f"code-{k}"}] if with_tools and k != 2
               else [{"role": "user", "content": f"the code is code-{k}; go on"}])  # a new user query mid-episode
        appended = renderer.append(history, messages, sampled, new)
        modes.append(appended.mode)
        tokens += appended.token_ids
        messages = messages + [{"role": "assistant", "content": renderer.text(sampled[:-1])}] + new
    return tok, renderer, tokens, messages, spans, modes


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_five_turns_keep_every_sampled_token_and_render_the_rest(name):
    tok, renderer, tokens, messages, spans, modes = _episode(name)
    for start, sampled in spans:  # the trainer's tokens hold each turn exactly as sampled
        assert tokens[start:start + len(sampled)] == sampled
    text = renderer.text(tokens)
    rendered = renderer.render(messages, True)
    if name == "qwen3":  # after a new user query a re-render drops earlier reasoning; the tokens keep it as sampled
        assert modes[:2] == ["template", "template"] and set(modes[2:]) == {"per-message"}, modes
        assert text.count("<think>") == 5 and rendered.count("<think>") < 5
        assert text.endswith("<|im_start|>assistant\n") and "<tool_response>\ncode-4\n</tool_response>" in text
    else:  # an append-only template: the tokens decode to exactly the template's rendering
        assert set(modes) == {"template"}, modes
        assert text == rendered
    # the re-render-and-retokenize approach trains on tokens the model never sampled
    retokenized = renderer.encode(rendered)
    assert retokenized != tokens
    assert any(retokenized[s:s + len(t)] != t for s, t in spans)


def test_template_kwargs_reach_the_template():
    tok = template_tokenizer("qwen3")
    plain = ChatRenderer(tok).prompt([{"role": "user", "content": "hi"}])
    no_think = ChatRenderer(tok, template_kwargs={"enable_thinking": False}).prompt([{"role": "user", "content": "hi"}])
    assert renderer_text(tok, no_think).endswith("<think>\n\n</think>\n\n") and no_think[:len(plain)] == plain


def renderer_text(tok, ids):
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_a_turn_cut_at_the_length_limit_is_closed_by_the_template():
    """A turn that ended without its stop token (max tokens): the appended tokens close it first."""
    tok, _, stop, _ = template_tokenizer("qwen2_5"), None, "<|im_end|>", None
    renderer = ChatRenderer(tok, tools=TOOLS)
    messages = [{"role": "user", "content": "go"}]
    prompt = renderer.prompt(messages)
    cut = _sampled(tok, "partial answer", stop)[:-1]
    appended = renderer.append(prompt, messages, cut, [{"role": "user", "content": "continue"}])
    assert appended.mode == "template" and appended.text.startswith("<|im_end|>\n<|im_start|>user\ncontinue")


def test_tool_calls_and_reasoning_are_parsed_into_openai_fields():
    import json as js

    from rollout.engine.tool_calls import parse_reply, parser_for_template

    text = ('<think>\nneed the code\n</think>\n\nLet me check.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "lookup", "arguments": {"key": "b"}}\n</tool_call>')
    parsed = parse_reply(text, "hermes", reasoning=True)
    assert parsed.reasoning_content == "need the code" and parsed.content == "Let me check."
    assert [js.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [{"key": "a"}, {"key": "b"}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in parsed.tool_calls)
    broken = parse_reply('<tool_call>\n{"name": "lookup", "arguments": {"key": \n</tool_call>', "hermes")
    assert broken.tool_calls == [] and "<tool_call>" in broken.content  # what does not parse stays in the content
    llama = parse_reply('<|python_tag|>{"name": "lookup", "parameters": {"key": "c"}}', "llama3_json")
    assert llama.content is None and js.loads(llama.tool_calls[0]["function"]["arguments"]) == {"key": "c"}
    assert parse_reply("just words", "llama3_json").tool_calls == []
    for name, want in (("qwen2_5", "hermes"), ("qwen3", "hermes"), ("llama3_1", "llama3_json"),
                       ("chatml_smollm2", None)):
        assert parser_for_template(template_tokenizer(name).chat_template) == want


@pytest.mark.parametrize("parser, text, content, keys", [
    ("hermes", 'Let me check. <tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call>',
     "Let me check.", ["a"]),
    ("hermes", "a <tool in prose, then <b>", "a <tool in prose, then <b>", []),
    ("hermes", '<tool_call>\n{"name": "lookup", "arguments": {"key": \n</tool_call>',
     '<tool_call>\n{"name": "lookup", "arguments": {"key": \n</tool_call>', []),  # broken: content after all
    ("llama3_json", '<|python_tag|>{"name": "lookup", "parameters": {"key": "c"}}', "", ["c"]),
    ("llama3_json", "plain words", "plain words", []),
])
def test_a_streamed_reply_holds_tool_calls_back_and_never_takes_text_back(parser, text, content, keys):
    """Fed a character at a time (as a stream grows): the content sent never contains a call's markup,
    nothing sent is taken back, and the end gives the calls the whole-answer parser gives."""
    import json as js

    from rollout.engine.tool_calls import StreamedReply

    reply, sent, calls = StreamedReply(parser), "", []
    for k in range(1, len(text) + 1):
        piece, calls = reply.feed(text[:k], final=k == len(text))
        sent += piece
        if k < len(text):
            assert "<tool_call>" not in sent and "python_tag" not in sent and not calls
    assert sent.strip() == content.strip()
    assert [js.loads(c["function"]["arguments"])["key"] for c in calls] == keys
