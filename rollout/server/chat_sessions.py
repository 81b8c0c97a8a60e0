"""Chat sessions on ``/v1/chat/completions``: an agent that names its conversation (SkyRL's
``X-Session-ID`` header, or ``session_id`` in the body) gets token-exact turns. The server keeps the
conversation's tokens in an engine session; each request still sends the whole message list, as
OpenAI clients do, and the server takes from it only what is new since the previous turn (after the
assistant reply the client echoes back), appends it rendered by ``rollout.engine.chat.ChatRenderer``
(never re-rendering or re-tokenizing earlier turns) and generates on the session's cached KV.

A request whose earlier messages differ from the session's (an edited history) starts the session
over from its messages (``session_restarted`` in the answer). ``/finish_session`` (SkyRL) closes one.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from rollout.engine.chat import ChatRenderer
from rollout.engine.templates import RenderLimits
from rollout.outputs import RolloutOutput
from rollout.scheduler.sessions import check_session_id

logger = logging.getLogger(__name__)


@dataclass
class ChatSession:
    key: str
    engine_session: str
    renderer: ChatRenderer
    messages: list[dict] = field(default_factory=list)  # what the last turn was prompted with
    completion_ids: list[int] = field(default_factory=list)  # the last turn's sampled tokens (the
    # history's end; the engine session holds the rest)
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class TurnInput:
    token_ids: list[int]  # what this turn appends to the engine session
    restarted: bool
    mode: str  # "first", "template", "per-message"


def _same(a: dict, b: dict) -> bool:
    return a.get("role") == b.get("role") and (a.get("content") or "") == (b.get("content") or "")


class ChatSessions:
    """The server's chat sessions by key; one turn at a time each (the engine refuses a second)."""

    def __init__(self, engine, limits: RenderLimits = RenderLimits()):
        self.engine = engine
        self.limits = limits
        self.sessions: dict[str, ChatSession] = {}
        self._lock = threading.Lock()

    def turn_input(self, key: str, messages: list[dict], template_kwargs: dict, tools: Optional[list]) -> tuple[
            ChatSession, TurnInput]:
        """The tokens this request appends to session ``key`` (opened on its first request)."""
        check_session_id(key)
        with self._lock:
            self._prune()
            return self._turn_input(key, messages, template_kwargs, tools)

    def _prune(self) -> None:
        """Forget sessions idle past the engine's session timeout: the engine closes theirs then too."""
        timeout = self.engine.config.session_timeout_s
        if timeout is None:
            return
        now = time.monotonic()
        for key in [k for k, s in self.sessions.items() if now - s.last_used > timeout]:
            self._close(key)

    def _turn_input(self, key: str, messages: list[dict], template_kwargs: dict, tools: Optional[list]) -> tuple[
            ChatSession, TurnInput]:
        s = self.sessions.get(key)
        existed = s is not None
        if s is not None:
            n = len(s.messages)
            prefix_ok = (len(messages) > n + 1 and all(_same(a, b) for a, b in zip(messages[:n], s.messages))
                         and messages[n].get("role") == "assistant")
            if prefix_ok and s.completion_ids:
                try:
                    held = self.engine.session_info(s.engine_session)["token_ids"]  # timed out: ValueError
                    history = held[:len(held) - len(s.completion_ids)]
                    appended = s.renderer.append(history, s.messages, s.completion_ids, messages[n + 1:])
                    return s, TurnInput(appended.token_ids, False, appended.mode)
                except ValueError as exc:  # RenderError included
                    logger.warning("chat session %s starts over: %s", key, exc)
        # rendered before anything is opened or closed: a conversation the template refuses changes nothing
        renderer = ChatRenderer(self.engine.tokenizer, template_kwargs, tools, list(self.engine.eos_token_ids),
                                self.limits)
        prompt = renderer.prompt(messages)
        self._close(key)
        s = ChatSession(key, self.engine.open_session(), renderer)
        self.sessions[key] = s
        return s, TurnInput(prompt, existed, "first")

    def record(self, s: ChatSession, messages: list[dict], out: RolloutOutput) -> None:
        """After a turn: what the next request's messages continue from."""
        if out.finish_reason not in ("stop", "length"):
            return  # an aborted turn left the session as it was
        s.messages, s.completion_ids = list(messages), list(out.output_token_ids)
        s.last_used = time.monotonic()

    def close(self, key: str) -> bool:
        """Whether session ``key`` was open (its engine session too) and is now closed."""
        with self._lock:
            self._prune()
            return self._close(key)

    def _close(self, key: str) -> bool:
        s = self.sessions.pop(key, None)
        if s is None:
            return False
        try:
            self.engine.close_session(s.engine_session)
        except ValueError:  # closed in the engine already (its idle timeout): nothing was open
            return False
        return True
