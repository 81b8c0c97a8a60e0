"""A tool-using environment for multi-turn RL (``trainer_bridge.multiturn``): small enough for the
embedded tiny model to learn on a CPU in minutes, and played through real chat templates and the
tool-call parser (``examples/grpo_multiturn.py``, the tests).

``LookupEnv``: the user asks for the colour of a fruit; the model must call the ``lookup`` tool with
that fruit as its ``key`` argument, read the tool's answer and reply with it alone; then the user asks
about the next fruit. Two assistant turns per fruit (the call, the answer), each right one earns
``1 / (2 × fruits)``; a reply that is not a parseable ``lookup`` call earns nothing there and the
tool answers with an error (the episode goes on).
"""

from __future__ import annotations

import json
from typing import Optional

from trainer_bridge.multiturn import Environment, EnvStep

LOOKUP_TABLE = {"apple": "red", "lemon": "yellow", "plum": "blue", "pear": "green"}
LOOKUP_TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "The colour of a fruit",
    "parameters": {"type": "object", "properties": {"key": {"type": "string", "description": "the fruit"}},
                   "required": ["key"]}}}
SYSTEM = "Use the lookup tool, then answer with its result only."


def lookup_argument(message: dict) -> Optional[str]:
    """The ``key`` of the first ``lookup`` call in an assistant message (None: no such call)."""
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        if fn.get("name") != "lookup":
            continue
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            return None
        key = args.get("key") if isinstance(args, dict) else None
        return key if isinstance(key, str) else None
    return None


class LookupEnv(Environment):
    tools: Optional[list[dict]] = [LOOKUP_TOOL]

    def __init__(self, keys: tuple[str, ...], table: Optional[dict[str, str]] = None, describe_tools: bool = False):
        """``describe_tools``: for a chat template that renders no tools (SmolLM2's ChatML), the tool and
        the Hermes call format go into the system message instead of ``tools``."""
        self.table = dict(table or LOOKUP_TABLE)
        self.describe_tools = describe_tools
        if describe_tools:
            self.tools = None
        unknown = [k for k in keys if k not in self.table]
        if not keys or unknown:
            raise ValueError(f"LookupEnv keys {list(keys)}: each must be one of {sorted(self.table)}")
        self.keys = tuple(keys)
        self.phase = 0
        self.calls: list[Optional[str]] = []  # the key of each call turn (None: no valid call)

    @property
    def num_turns(self) -> int:
        return 2 * len(self.keys)

    def question(self, i: int) -> str:
        return f"What is the colour of {self.keys[i]}?" if i == 0 else f"And the colour of {self.keys[i]}?"

    def reset(self) -> list[dict]:
        self.phase, self.calls = 0, []
        system = SYSTEM
        if self.describe_tools:
            system += ("\nTool: " + json.dumps(LOOKUP_TOOL["function"]) + '\nCall it as <tool_call>\n{"name": "lookup", '
                       '"arguments": {"key": ...}}\n</tool_call>')
        return [{"role": "system", "content": system}, {"role": "user", "content": self.question(0)}]

    def step(self, message: dict) -> EnvStep:
        if self.phase >= self.num_turns:
            raise RuntimeError("the episode is over")
        phase, self.phase = self.phase, self.phase + 1
        key, share = self.keys[phase // 2], 1.0 / self.num_turns
        if phase % 2 == 0:  # a call to lookup is expected
            arg = lookup_argument(message)
            self.calls.append(arg)
            result = self.table.get(arg, "unknown key") if arg is not None else "error: call lookup with a key"
            return EnvStep([{"role": "tool", "content": result}], share if arg == key else 0.0)
        right = (message.get("content") or "").strip() == self.table[key]
        if phase + 1 == self.num_turns:
            return EnvStep([], share if right else 0.0, done=True)
        return EnvStep([{"role": "user", "content": self.question(phase // 2 + 1)}], share if right else 0.0)

    def reference_replies(self, called: Optional[list[str]] = None, answered: Optional[list[str]] = None) -> list[str]:
        """What a model would write (as text, before the tool-call parser) to call ``called[i]`` and
        answer ``answered[i]`` for each fruit (default: the right ones) — for a supervised warm-up."""
        called = called or list(self.keys)
        answered = answered or [self.table[k] for k in self.keys]
        replies = []
        for c, a in zip(called, answered):
            replies.append('<tool_call>\n' + json.dumps({"name": "lookup", "arguments": {"key": c}}) + '\n</tool_call>')
            replies.append(a)
        return replies
