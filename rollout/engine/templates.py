"""Chat templates rendered under limits, with only template variables from a request.

What a request may send for rendering: its messages (and tools where a route takes them) and
``chat_template_kwargs`` holding **template variables only** (``enable_thinking``...). Never the
tokenizer's own controls (``tokenize``, ``padding``, ``max_length``, ``return_tensors``,
``add_generation_prompt``...: every named parameter of ``apply_chat_template``) nor the special
tokens' names (``eos_token``...: text the template writes as control tokens), and never template
text (``chat_template``, in the kwargs or beside them) unless the operator opted in
(``trust_request_template``: the server's ``--trust-request-chat-template``, vLLM's flag).

Every rendering runs under a ``RenderLimits`` budget: the template's environment (transformers'
sandboxed Jinja environment, compiled once per template) checks the deadline at every call,
attribute and item lookup and counts the characters it joins, and raises past either bound. Any
failure — a template that refuses the conversation (``raise_exception``), a syntax error, a
message it cannot read, a limit — is an ``InputError`` naming the first message that fails when
rendering the conversation up to it isolates one.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from rollout.config import InputError

logger = logging.getLogger(__name__)

# named here as well as read from the installed tokenizer's signature: transformers versions differ
_CONTROLS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs", "sanitize_control_tokens",
    "add_special_tokens", "padding_side", "pad_to_multiple_of", "return_attention_mask", "stride",
})
_SPECIAL_TOKENS = frozenset({"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                             "mask_token", "additional_special_tokens"})
MAX_FAILING_SEARCH = 64  # messages tried one prefix at a time to name the one a template refuses


@dataclass(frozen=True)
class RenderLimits:
    max_seconds: float = 5.0  # one rendering, template work only
    max_chars: int = 8 << 20  # characters the template joins (a prompt past the context is refused later anyway)


class RenderLimitExceeded(InputError):
    """A rendering went past its ``RenderLimits``."""


@dataclass
class _Budget:
    deadline: float
    max_chars: int
    chars: int = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise RenderLimitExceeded("rendering the chat template took longer than its limit: a shorter conversation "
                                      "(or another template) renders")

    def add(self, n: int) -> None:
        self.chars += n
        if self.chars > self.max_chars:
            raise RenderLimitExceeded(f"the chat template's output grew past {self.max_chars} characters")
        self.tick()


_BUDGET: contextvars.ContextVar[Optional[_Budget]] = contextvars.ContextVar("rollout_render_budget", default=None)


def _guard(env) -> None:
    """Make a template environment honour the budget of the rendering running in this thread (if any):
    its call, attribute, item and join hooks — what compiled templates call for every such step — check
    it first. Without a budget they behave as before."""
    if getattr(env, "_rollout_guarded", False):
        return
    call, getattr_, getitem, concat = env.call, env.getattr, env.getitem, env.concat

    def guarded_call(__context, __obj, *args, **kwargs):
        budget = _BUDGET.get()
        if budget is not None:
            budget.tick()
        return call(__context, __obj, *args, **kwargs)

    def guarded_getattr(obj, attribute):
        budget = _BUDGET.get()
        if budget is not None:
            budget.tick()
        return getattr_(obj, attribute)

    def guarded_getitem(obj, argument):
        budget = _BUDGET.get()
        if budget is not None:
            budget.tick()
        return getitem(obj, argument)

    def guarded_concat(pieces):
        budget = _BUDGET.get()
        if budget is None:
            return concat(pieces)
        out = []
        for piece in pieces:
            budget.add(len(piece))
            out.append(piece)
        return concat(out)

    env.call, env.getattr, env.getitem, env.concat = guarded_call, guarded_getattr, guarded_getitem, guarded_concat
    env._rollout_guarded = True


def _guard_template(tokenizer, chat_template: Optional[str], tools) -> None:
    """Guard the environment transformers compiled (and caches) for the template this call renders."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        source = tokenizer.get_chat_template(chat_template, tools)
        _guard(_compile_jinja_template(source).environment)
    except (ImportError, AttributeError, TypeError) as exc:  # another transformers: the caller's thread timeout
        logger.debug("chat template environment not guarded: %s", exc)
    except ValueError as exc:  # no template by that name
        raise InputError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a template that does not compile is the request's
        raise InputError(f"the chat template does not compile: {exc}") from None


@functools.lru_cache(maxsize=8)
def _parameters(cls: type) -> frozenset:
    try:
        return frozenset(p for p in inspect.signature(cls.apply_chat_template).parameters if p != "self")
    except (TypeError, ValueError):
        return frozenset()


def template_variables(tokenizer, kwargs: Optional[dict], trust_request_template: bool = False,
                       chat_template: Optional[str] = None) -> tuple[dict[str, Any], Optional[str]]:
    """(the template variables of a request's ``chat_template_kwargs``, the template text it sent or
    None). ``InputError`` for a tokenizer control or special token's name among the kwargs, or for
    template text without ``trust_request_template``."""
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise InputError("chat_template_kwargs must be an object of template variables")
    variables = dict(kwargs)
    sent = variables.pop("chat_template", None)
    if sent is not None and chat_template is not None and sent != chat_template:
        raise InputError("chat_template is given twice with different texts")
    sent = sent if sent is not None else chat_template
    if sent is not None:
        if not trust_request_template:
            raise InputError("this server does not render chat templates sent in requests (chat_template); the "
                             "model's own template renders. Its operator may allow them with "
                             "--trust-request-chat-template")
        if not isinstance(sent, str) or not sent:
            raise InputError("chat_template must be the template's text")
    special = set(_SPECIAL_TOKENS) | set(getattr(tokenizer, "special_tokens_map", {}) or {})
    refused = sorted(k for k in variables if k in _CONTROLS or k in special
                     or k in _parameters(type(tokenizer)))
    if refused:
        raise InputError(f"chat_template_kwargs may carry template variables only, not {refused} (the tokenizer's "
                         "own controls and special tokens are set by the server)")
    return variables, sent


def _rendering(limits: RenderLimits, fn: Callable[[], Any]) -> Any:
    budget = _Budget(time.monotonic() + limits.max_seconds, limits.max_chars)
    token = _BUDGET.set(budget)
    try:
        return fn()
    finally:
        _BUDGET.reset(token)


def _failing_message(try_render: Callable[[list[dict]], Any], messages: list[dict]) -> Optional[int]:
    """The index of the first message whose addition makes rendering fail, if rendering the
    conversation up to it succeeds (so that message is the one refused)."""
    for i in range(1, min(len(messages), MAX_FAILING_SEARCH) + 1):
        try:
            try_render(messages[:i])
        except RenderLimitExceeded:
            return None
        except Exception:  # noqa: BLE001 - any failure marks the message
            return i - 1
    return None


def render(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True, tokenize: bool = True,
           tools: Optional[list] = None, variables: Optional[dict] = None, chat_template: Optional[str] = None,
           limits: RenderLimits = RenderLimits()) -> Any:
    """The conversation rendered by the model's chat template (or ``chat_template``): token ids, or the
    text with ``tokenize=False``. ``variables`` are template variables as ``template_variables``
    returns them. Every failure is an ``InputError``."""
    if tokenizer is None:
        raise InputError("this model folder has no tokenizer: pass input_ids instead of chat messages")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InputError("the tokenizer has no chat template; tokenize the conversation yourself")
    variables = variables or {}
    _guard_template(tokenizer, chat_template, tools)

    def once(msgs: list[dict]) -> Any:
        kw: dict[str, Any] = dict(tools=tools, add_generation_prompt=add_generation_prompt, tokenize=tokenize,
                                  **variables)
        if chat_template is not None:
            kw["chat_template"] = chat_template
        out = tokenizer.apply_chat_template(msgs, **kw)
        if tokenize:
            if isinstance(out, dict) or hasattr(out, "keys"):
                out = out["input_ids"]
            return list(out)
        return out

    try:
        return _rendering(limits, lambda: once(messages))
    except RenderLimitExceeded:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a request's conversation makes the template raise
        reason = str(exc) or type(exc).__name__
        at = _rendering(limits, lambda: _failing_message(once, messages)) if len(messages) > 1 else None
        where = "" if at is None else f" (message {at}, role {messages[at].get('role')!r})"
        raise InputError(f"the chat template cannot render this conversation{where}: {reason}") from None
