"""Multi-turn agentic rollouts for RL, token-exact: an environment interface, a runner that plays
episodes through a rollout service, and the trajectories a trainer trains on.

An episode: the environment's opening messages are rendered by the model's chat template; the model
answers (a turn: tokens sampled by the engine, with logprobs, sampling masks and the weight version
of every token); the reply is parsed into an OpenAI assistant message (content, ``tool_calls``,
``reasoning_content``) and handed to the environment, which answers with new messages (tool
results, a user turn), a reward and whether the episode is over. The new messages are rendered
**append-only** (``rollout.engine.chat.ChatRenderer``): the trajectory is exactly the tokens the
engine sampled plus the tokens appended, never a re-rendered, re-tokenized conversation.

Turns of every live episode run as one batched ``generate`` call per round. With sessions (the
default) each episode is an engine session: a turn sends only the tokens appended since the last
one and the engine keeps the history's KV (pinned to one replica behind a ``ReplicaRouter``);
without, each turn resends the whole history (the prefix cache serves it) with the episode's id
as routing key, as the field's router expects (``X-SMG-Routing-Key``).

A ``Trajectory``'s ``output_token_ids`` are everything after the opening prompt; ``loss_mask`` is 1
on the tokens the model sampled and 0 on the ones the environment appended, so environment tokens
never enter a loss.
"""

from __future__ import annotations

import logging
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from rollout.engine.chat import ChatRenderer
from rollout.engine.tool_calls import has_reasoning, parse_reply, parser_for_template
from rollout.outputs import RolloutOutput
from rollout.sampling_params import SamplingParams
from trainer_bridge.serving import RolloutService

logger = logging.getLogger(__name__)

@dataclass
class EnvStep:
    """What an environment answers to one assistant message."""

    messages: list[dict] = field(default_factory=list)  # tool results, a user turn (ignored when done)
    reward: float = 0.0  # added to the episode's reward
    done: bool = False


class Environment(ABC):
    """One episode's world. ``reset`` opens it; ``step`` takes the model's message as OpenAI shapes
    it (``{"role": "assistant", "content", "tool_calls"?, "reasoning_content"?}``, tool calls already
    parsed) and answers. ``tools``: OpenAI tool schemas the chat template renders into the prompt."""

    tools: Optional[list[dict]] = None

    @abstractmethod
    def reset(self) -> list[dict]:
        """The opening messages (system, user)."""

    @abstractmethod
    def step(self, message: dict) -> EnvStep: ...


@dataclass
class Trajectory:
    """One episode as a trainer sees it (field names as ``RolloutOutput``'s where they mean the same)."""

    prompt_token_ids: list[int]  # the opening messages, rendered with the generation prompt
    output_token_ids: list[int]  # every token after it: the turns as sampled and what was appended
    loss_mask: list[int]  # per output token: 1 sampled by the model, 0 appended for the environment
    output_logprobs: list[float]  # per output token: the engine's (0.0 on environment tokens)
    output_weight_versions: list[Optional[str]]  # per output token (None on environment tokens)
    output_token_sampling_mask: list[Optional[list[int]]]  # with masks: per sampled token (None elsewhere)
    turns: list[tuple[int, int]]  # each turn's [start, end) in output_token_ids
    reward: float = 0.0
    finish_reason: str = "done"  # done (the environment ended it), max_turns, context_length
    messages: list[dict] = field(default_factory=list)  # the conversation, for logs and agents
    render_modes: list[str] = field(default_factory=list)  # per appended block: template or per-message
    turn_cached_tokens: list[int] = field(default_factory=list)  # per turn: history tokens served from cache
    turn_finish_reasons: list[str] = field(default_factory=list)  # per turn: the engine's (stop, length)
    # with return_routed_experts (a mixture of experts): the experts the engine routed every position to but the
    # last, [len(prompt + output) - 1, layers, top_k] — the environment's tokens those of the turn that prefilled them
    routed_experts: Optional[torch.Tensor] = None

    @property
    def sampled_positions(self) -> list[int]:
        return [i for i, m in enumerate(self.loss_mask) if m]

    @property
    def sampled_weight_versions(self) -> list[str]:
        return [v for v, m in zip(self.output_weight_versions, self.loss_mask) if m and v is not None]


@dataclass
class _Episode:
    env: Environment
    renderer: ChatRenderer
    sampling: SamplingParams
    messages: list[dict]
    traj: Trajectory
    pending: list[int]  # what the next turn sends: the tokens appended since the last (with sessions)
    key: str = ""  # the episode's name: its session id, or its routing key
    session: Optional[str] = None
    finished: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.traj.prompt_token_ids + self.traj.output_token_ids


def turn_seed(seed: int, turn: int) -> int:
    """Each turn its own stream of randomness (a turn's draws would otherwise repeat the last one's:
    the engine draws by seed, sample and position within the request)."""
    return (seed * 1_000_003 + turn * 7_919 + 17) % (2**63 - 1)


class MultiTurnRunner:
    """Plays episodes through ``service`` (an engine, a server client, a ``ReplicaRouter``).

    ``tokenizer``: the model's, with its chat template; ``max_turns``: assistant turns per episode;
    ``max_total_tokens``: an episode's token limit (prompt and everything after it) — an episode that
    reaches it ends with ``finish_reason == "context_length"``; set it no higher than the engine's
    context (``max_model_len``), past which the engine refuses a session's turn and the round fails;
    ``sessions``: engine sessions (the history's KV kept) or whole-history resends; ``routing_keys``:
    send each episode's id as its routing key (a server client behind the field's router);
    ``tool_call_parser`` / ``reasoning_parser``: "auto" (what the template implies), a name, or None.
    ``service`` None: a runner that only builds scripted episodes (``script``)."""

    def __init__(self, service: Optional[RolloutService], tokenizer: Any, max_turns: int = 8, max_total_tokens: int = 4096,
                 sessions: bool = True, routing_keys: bool = False, template_kwargs: Optional[dict] = None,
                 tool_call_parser: Optional[str] = "auto", reasoning_parser: Optional[str] = "auto"):
        if max_turns < 1 or max_total_tokens < 2:
            raise ValueError("max_turns must be >= 1 and max_total_tokens >= 2")
        self.service, self.tokenizer = service, tokenizer
        self.max_turns, self.max_total_tokens = max_turns, max_total_tokens
        self.sessions, self.routing_keys = sessions, routing_keys
        self.template_kwargs = template_kwargs
        template = tokenizer.chat_template  # a Hugging Face tokenizer always has it (None: no template)
        self.parser = parser_for_template(template) if tool_call_parser == "auto" else tool_call_parser
        self.reasoning = has_reasoning(template) if reasoning_parser == "auto" else bool(reasoning_parser)

    def run(self, envs: list[Environment], sampling: list[SamplingParams], return_sampling_mask: bool = False,
            session_prefix: Optional[str] = None, return_routed_experts: bool = False) -> list[Trajectory]:
        """Play one episode per environment (``sampling[i]`` for episode i; its seed is the episode's,
        each turn drawing from its own stream); returns their trajectories in order. ``return_routed_experts``
        (a mixture of experts, for routing replay): each trajectory's ``routed_experts``, its turns' in turn."""
        if self.service is None:
            raise ValueError("this runner has no rollout service: it only builds scripted episodes")
        if len(envs) != len(sampling):
            raise ValueError(f"{len(envs)} environments and {len(sampling)} sampling params: one per episode")
        for sp in sampling:
            if sp.n != 1:
                raise ValueError("an episode samples one reply per turn (n=1): run n episodes for a group")
            if sp.seed is None:
                raise ValueError("each episode's SamplingParams needs a seed (its turns derive theirs from it)")
        prefix = session_prefix or uuid.uuid4().hex[:12]
        episodes = [self._open(env, sp) for env, sp in zip(envs, sampling)]
        for i, ep in enumerate(episodes):
            ep.key = f"{prefix}-{i}"
        try:
            if self.sessions:
                for ep in episodes:
                    ep.session = self.service.open_session(ep.key)
            for turn in range(self.max_turns):
                live = [ep for ep in episodes if not ep.finished]
                if not live:
                    break
                self._round(live, turn, return_sampling_mask, return_routed_experts)
            for ep in episodes:
                if not ep.finished:
                    ep.traj.finish_reason, ep.finished = "max_turns", True
        finally:
            for ep in episodes:
                if ep.session is not None:
                    try:
                        self.service.close_session(ep.session)
                    except Exception as exc:  # noqa: BLE001 - closing is best effort; the engine times it out
                        logger.warning("closing session %s: %s", ep.session, exc)
                    ep.session = None
        return [ep.traj for ep in episodes]

    def _open(self, env: Environment, sp: SamplingParams) -> _Episode:
        renderer = ChatRenderer(self.tokenizer, template_kwargs=self.template_kwargs, tools=env.tools)
        messages = list(env.reset())
        prompt = renderer.prompt(messages)
        if len(prompt) >= self.max_total_tokens:
            raise ValueError(f"the opening prompt has {len(prompt)} tokens; max_total_tokens is "
                             f"{self.max_total_tokens}")
        stops = sorted(set(sp.stop_token_ids or []) | renderer.stop_token_ids)
        traj = Trajectory(prompt, [], [], [], [], [], [], messages=list(messages))
        return _Episode(env, renderer, replace(sp, stop_token_ids=stops), messages, traj, pending=list(prompt))

    def _round(self, live: list[_Episode], turn: int, masks: bool, routed: bool = False) -> None:
        """One turn of every live episode, batched into one generate call."""
        assert self.service is not None  # run() checked
        params = []
        for ep in live:
            room = self.max_total_tokens - len(ep.tokens)
            params.append(replace(ep.sampling, seed=turn_seed(int(ep.sampling.seed or 0), turn),
                                  max_new_tokens=min(ep.sampling.max_new_tokens, room)))
        kwargs: dict[str, Any] = {"return_routed_experts": True} if routed else {}
        if self.sessions:
            kwargs["session_id"] = [ep.session for ep in live]
        if self.routing_keys:
            kwargs["routing_key"] = [ep.key for ep in live]
        inputs = [ep.pending if self.sessions else ep.tokens for ep in live]
        outs = self.service.generate(input_ids=inputs, sampling_params=params, return_sampling_mask=masks, **kwargs)
        if len(outs) != len(live):
            raise RuntimeError(f"{len(live)} turns asked, {len(outs)} answered")
        for ep, out in zip(live, outs):
            if out.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"a turn ended with finish reason {out.finish_reason!r}: the episode cannot go on")
            if routed:
                _take_experts(ep.traj, out)
            self._take_turn(ep, out, turn)

    def script(self, env: Environment, replies: list[str]) -> Trajectory:
        """An episode whose assistant turns are ``replies`` (texts, each tokenized as the tokenizer
        would and closed with the template's stop token) instead of samples: demonstrations for a
        supervised warm-up, built through the same rendering as sampled episodes."""
        ep = self._open(env, SamplingParams(seed=0))
        for turn, reply in enumerate(replies):
            if ep.finished:
                break
            ids = ep.renderer.encode(reply) + [ep.renderer.tokenizer.eos_token_id]
            out = RolloutOutput(rid="scripted", prompt_index=0, sample_index=0, prompt_token_ids=ep.tokens,
                                output_token_ids=ids, output_logprobs=[0.0] * len(ids), finish_reason="stop",
                                output_weight_versions=["scripted"] * len(ids))
            self._take_turn(ep, out, turn)
        return ep.traj

    def _take_turn(self, ep: _Episode, out: RolloutOutput, turn: int) -> None:
        traj, sampled = ep.traj, list(out.output_token_ids)
        history = ep.tokens
        start = len(traj.output_token_ids)
        traj.output_token_ids += sampled
        traj.loss_mask += [1] * len(sampled)
        traj.output_logprobs += list(out.output_logprobs)
        traj.output_weight_versions += list(out.output_weight_versions)
        traj.output_token_sampling_mask += (list(out.output_token_sampling_mask) if out.output_token_sampling_mask
                                            else [None] * len(sampled))
        traj.turns.append((start, start + len(sampled)))
        traj.turn_cached_tokens.append(out.num_cached_tokens)
        traj.turn_finish_reasons.append(str(out.finish_reason))
        stopped = bool(sampled) and sampled[-1] in ep.renderer.stop_token_ids
        body = sampled[:-1] if stopped else sampled
        parsed = parse_reply(ep.renderer.text(body), self.parser, self.reasoning)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        if parsed.reasoning_content is not None:
            message["reasoning_content"] = parsed.reasoning_content
        traj.messages.append(message)
        result = ep.env.step(message)
        traj.reward += float(result.reward)
        if result.done:
            ep.finished = True
            return
        if len(ep.tokens) >= self.max_total_tokens:
            traj.finish_reason, ep.finished = "context_length", True
            return
        if turn + 1 >= self.max_turns:
            traj.finish_reason, ep.finished = "max_turns", True
            return
        appended = ep.renderer.append(history, ep.messages, sampled, result.messages)
        if len(ep.tokens) + len(appended.token_ids) + 1 > self.max_total_tokens:  # no room for a reply
            traj.finish_reason, ep.finished = "context_length", True
            return
        traj.output_token_ids += appended.token_ids
        n = len(appended.token_ids)
        traj.loss_mask += [0] * n
        traj.output_logprobs += [0.0] * n
        traj.output_weight_versions += [None] * n
        traj.output_token_sampling_mask += [None] * n
        traj.render_modes.append(appended.mode)
        ep.messages = ep.messages + [{"role": "assistant", "content": ep.renderer.text(body)}] + list(result.messages)
        traj.messages.extend(result.messages)
        ep.pending = list(appended.token_ids)


def _take_experts(traj: Trajectory, out: RolloutOutput) -> None:
    """A turn's routed experts onto its trajectory's: the positions not yet covered (the last turn's final
    token, the environment's tokens, this turn's; the history before them as earlier turns recorded it)."""
    if out.routed_experts is None:
        raise RuntimeError("return_routed_experts: the rollout service returned no routed experts (serve a mixture "
                           "of experts with enable_return_routed_experts)")
    have = 0 if traj.routed_experts is None else traj.routed_experts.shape[0]
    if out.routed_experts_start_len > have or out.routed_experts_start_len + out.routed_experts.shape[0] < have:
        raise RuntimeError(f"a turn's routed experts cover positions [{out.routed_experts_start_len}, "
                           f"{out.routed_experts_start_len + out.routed_experts.shape[0]}); the trajectory has {have}")
    new = out.routed_experts[have - out.routed_experts_start_len:]
    traj.routed_experts = new if traj.routed_experts is None else torch.cat([traj.routed_experts, new])
