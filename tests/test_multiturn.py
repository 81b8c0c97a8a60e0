"""Multi-turn agentic RL (``trainer_bridge.multiturn``, ``trainer_bridge.grpo_multiturn``,
``examples/grpo_multiturn.py``): trajectories are exactly the tokens the engine sampled plus the tokens
the chat template appended for the environment, on four real templates; sessions prefill only what is
new and survive more sessions than the KV pool holds; a push between turns and one inside a turn are
recorded per token, each token's logprob matching a reference forward under its version's weights;
sessions stay on one replica behind our router and, by routing key, behind the field's; the openai
client's tool-calling flow works; the example learns and its no-push control does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import learns_after_its_control_arm

from rollout import SamplingParams
from rollout.tools.tiny import CHAT_FORMATS, build_chat_tokenizer
from trainer_bridge.envs import LOOKUP_TABLE, LOOKUP_TOOL, LookupEnv
from trainer_bridge.multiturn import Environment, EnvStep, MultiTurnRunner, turn_seed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from lookup_task import lookup_model, lookup_tasks  # noqa: E402

WARMUP = (150, 0.4)  # the example's defaults


@pytest.fixture(scope="module")
def lookup_folder(tmp_path_factory):
    """The example's warmed tiny model: it writes valid tool calls (Hermes, Qwen2.5's template)."""
    return lookup_model("tiny", 0, *WARMUP, root=str(tmp_path_factory.mktemp("lookup")))


@pytest.fixture(scope="module")
def lookup_servers(lookup_folder, module_servers):
    """Two replicas of it (fp32)."""
    return [module_servers(lookup_folder, "--dtype", "float32", "--kv-cache-tokens", "16384") for _ in range(2)]


@pytest.fixture(scope="module")
def lookup_tok(lookup_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(lookup_folder)


def _sp(i: int, temperature: float = 1.0, **kw) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_new_tokens=kw.pop("max_new_tokens", 32), seed=1000 + i, **kw)


def _retokenized(tok, traj, tools) -> list[int]:
    """What a loop that keeps messages, re-renders and re-tokenizes them would train on."""
    text = tok.apply_chat_template(traj.messages, tools=tools, tokenize=False, add_generation_prompt=False)
    return list(tok.encode(text, add_special_tokens=False))


def test_every_template_trains_on_exactly_the_sampled_and_appended_tokens(model_dir, module_engines):
    """Six turns (three lookups) per episode on SmolLM2's ChatML, Qwen2.5's, Qwen3's and Llama 3.1's
    templates: every turn's tokens are what the engine samples after the whole history with that
    turn's seed, the rest is what the template appended, and the re-render approach would drift."""
    drifted = []
    for name in sorted(CHAT_FORMATS):
        tok = build_chat_tokenizer(name)
        path = model_dir(f"chat-{name}", "qwen2", tokenizer=tok, max_position_embeddings=2048, seed=11)
        engine = module_engines(path, kv_cache_tokens=16384)
        runner = MultiTurnRunner(engine, tok, max_turns=6, max_total_tokens=2048)
        envs = [LookupEnv(("apple", "plum", "pear")) for _ in range(3)]
        trajs = runner.run(envs, [_sp(i, max_new_tokens=12, top_k=50) for i in range(3)], return_sampling_mask=True)
        for i, (env, t) in enumerate(zip(envs, trajs)):
            assert len(t.turns) == 6 and t.finish_reason == "done", (name, t.turns, t.finish_reason)
            full = t.prompt_token_ids + t.output_token_ids
            plen = len(t.prompt_token_ids)
            sampled = set(t.sampled_positions)
            assert sampled == {p for a, b in t.turns for p in range(a, b)}  # loss mask: sampled turns only
            assert len(t.output_token_sampling_mask) == len(t.output_token_ids)
            for k, (a, b) in enumerate(t.turns):
                sp = _sp(i, max_new_tokens=12, top_k=50)
                sp.seed, sp.stop_token_ids = turn_seed(sp.seed, k), [tok.eos_token_id]  # the template's end of turn
                ref = engine.generate(input_ids=full[:plen + a], sampling_params=sp)[0]
                assert ref.output_token_ids == t.output_token_ids[a:b], (name, k)
                assert ref.output_logprobs == pytest.approx(t.output_logprobs[a:b], abs=1e-5)
            # between the turns: exactly the template's rendering of the environment's messages
            assert all(t.output_weight_versions[p] is None for p in range(len(t.output_token_ids)) if p not in sampled)
            retok = _retokenized(tok, t, env.tools)
            drifted.append(retok[:len(full)] != full)
        assert t.render_modes and set(t.render_modes) <= {"template", "per-message"}
    assert any(drifted), "re-rendering and re-tokenizing drifted on none of the templates: the test could not fail"


def test_a_warmed_model_calls_the_tool_and_turns_prefill_only_what_is_new(lookup_folder, lookup_tok, module_engines):
    engine = module_engines(lookup_folder, kv_cache_tokens=32768)
    runner = MultiTurnRunner(engine, lookup_tok, max_turns=4, max_total_tokens=2048)
    tasks = lookup_tasks(2)
    envs = [LookupEnv(tasks[i % len(tasks)]) for i in range(16)]
    trajs = runner.run(envs, [_sp(i, temperature=0.0) for i in range(16)])
    calls = [c for e in envs for c in e.calls]
    assert sum(c is not None for c in calls) >= 0.8 * len(calls), calls  # parsed from <tool_call> JSON
    assert all(c in LOOKUP_TABLE for c in calls if c is not None)
    for t in trajs:
        assert t.finish_reason == "done" and len(t.turns) == 4
        assert t.messages[2].get("tool_calls") or t.messages[2]["content"]
        for k, (a, _) in enumerate(t.turns[1:], start=1):  # the history's KV was kept: only new tokens computed
            history = len(t.prompt_token_ids) + a
            appended = a - t.turns[k - 1][1]
            assert t.turn_cached_tokens[k] >= history - appended - 1, (k, t.turn_cached_tokens)
    # the same episodes resending the whole history give the same tokens
    resend = MultiTurnRunner(engine, lookup_tok, max_turns=4, max_total_tokens=2048, sessions=False)
    again = resend.run([LookupEnv(e.keys) for e in envs], [_sp(i, temperature=0.0) for i in range(16)])
    assert [t.output_token_ids for t in again] == [t.output_token_ids for t in trajs]


def test_scripted_episodes_score_as_the_environment_says(lookup_tok):
    runner = MultiTurnRunner(None, lookup_tok, max_turns=4)
    env = LookupEnv(("apple", "plum"))
    assert runner.script(env, env.reference_replies()).reward == pytest.approx(1.0)
    env = LookupEnv(("apple", "plum"))
    wrong = runner.script(env, env.reference_replies(["lemon", "plum"], ["yellow", "green"]))
    assert wrong.reward == pytest.approx(0.25) and env.calls == ["lemon", "plum"]  # only the second call right
    with pytest.raises(ValueError, match="no rollout service"):
        runner.run([LookupEnv(("apple",))], [_sp(0)])


def test_more_sessions_than_the_kv_pool_holds_all_take_their_turns(lookup_folder, lookup_tok, make_engine):
    """Sixteen episodes of ~260 tokens against a 2048-token pool: turns waiting behind others give up
    their sessions' KV instead of pinning it (which deadlocked), and the tokens are the same."""
    small = make_engine(lookup_folder, kv_cache_tokens=2048)
    big = make_engine(lookup_folder, kv_cache_tokens=32768)
    tasks = lookup_tasks(2)
    got = []
    for engine in (small, big):
        runner = MultiTurnRunner(engine, lookup_tok, max_turns=4, max_total_tokens=2048)
        got.append(runner.run([LookupEnv(tasks[i % 12]) for i in range(16)], [_sp(i, temperature=0.0) for i in range(16)]))
    assert [t.output_token_ids for t in got[0]] == [t.output_token_ids for t in got[1]]
    assert sum(len(t.prompt_token_ids) + len(t.output_token_ids) for t in got[0]) > 2 * 2048


class _PushBetween(Environment):
    """LookupEnv that pushes new weights into the engine when it answers the first turn (between turns)
    and flags the start of the third turn for a push inside it."""

    def __init__(self, env: LookupEnv, push, third_turn: threading.Event):
        self.env, self.push, self.third = env, push, third_turn
        self.tools = env.tools

    def reset(self):
        return self.env.reset()

    def step(self, message) -> EnvStep:
        out = self.env.step(message)
        if self.env.phase == 1:
            self.push("v1")
        elif self.env.phase == 2:
            self.third.set()
        return out


def test_pushes_between_and_inside_turns_are_recorded_per_token(lookup_folder, lookup_tok, make_engine):
    from transformers import AutoModelForCausalLM

    engine = make_engine(lookup_folder, kv_cache_tokens=32768)
    hf = AutoModelForCausalLM.from_pretrained(lookup_folder, dtype=torch.float32).eval()
    base = {n: p.detach().clone() for n, p in hf.named_parameters()}
    g = torch.Generator().manual_seed(0)
    versions = {"default": base}
    for v in ("v1", "v2"):
        versions[v] = {n: p + 0.02 * torch.randn(p.shape, generator=g) for n, p in base.items()}

    def push(v: str) -> None:
        assert engine.update_weights_from_tensor(list(versions[v].items()), weight_version=v).success

    third = threading.Event()
    pushed_inside = threading.Event()

    def inside() -> None:  # once the third turn has decoded a few tokens: pause in place, push v2, go on
        third.wait(60)
        start = engine.get_stats()["num_decode_tokens"]
        while engine.get_stats()["num_decode_tokens"] < start + 8:
            time.sleep(0.001)
        engine.pause_generation("in_place")  # an update waits for a quiet point: this is one, mid-turn
        push("v2")
        engine.continue_generation()
        pushed_inside.set()

    watcher = threading.Thread(target=inside)
    watcher.start()
    runner = MultiTurnRunner(engine, lookup_tok, max_turns=4, max_total_tokens=2048)
    env = _PushBetween(LookupEnv(("apple", "plum")), push, third)
    sp = SamplingParams(temperature=1.0, max_new_tokens=150, ignore_eos=True, seed=7)
    t = runner.run([env], [sp])[0]
    watcher.join(60)
    assert pushed_inside.is_set()
    per_turn = [t.output_weight_versions[a:b] for a, b in t.turns]
    assert set(per_turn[0]) == {"default"} and set(per_turn[1]) == {"v1"}  # the push between turns 1 and 2
    assert per_turn[2][0] == "v1" and per_turn[2][-1] == "v2"  # the push inside turn 3, token by token
    assert set(per_turn[3]) == {"v2"}
    # each token against a reference forward under the weights of its version (turns whose history was
    # recomputed under one version: the engine drops a session's KV computed under other weights)
    full = torch.tensor([t.prompt_token_ids + t.output_token_ids])
    plen = len(t.prompt_token_ids)
    for k in (0, 1, 3):
        v = per_turn[k][0]
        hf.load_state_dict(versions[v], strict=False)
        with torch.no_grad():
            logp = torch.log_softmax(hf(input_ids=full).logits[0].float(), -1)
        a, b = t.turns[k]
        ref = [float(logp[plen + p - 1, t.output_token_ids[p]]) for p in range(a, b)]
        assert max(abs(x - y) for x, y in zip(ref, t.output_logprobs[a:b])) < 1e-4, (k, v)


@pytest.mark.parametrize("kind", ["sglang-router", "smg"])
def test_sessions_stay_on_one_replica_behind_our_router_and_by_routing_key_behind_the_fields(
        kind, lookup_folder, lookup_tok, lookup_servers, module_engines):
    from rollout.server import RolloutClient
    from rollout.server.router import launch_router, router_available
    from trainer_bridge import ReplicaRouter, ReplicaSet

    if not router_available(kind):
        pytest.fail(f"{kind} is in the test extra: pip install -e '.[test]'")
    servers = lookup_servers
    clients = [RolloutClient(s.url) for s in servers]
    # every episode's history its own from the first question on (what one replica caches, another cannot
    # have: only the system prompt is common to all)
    tasks = [("apple", "lemon"), ("lemon", "plum"), ("plum", "pear"), ("pear", "apple")]
    sps = [_sp(i, temperature=0.0) for i in range(len(tasks))]
    want = MultiTurnRunner(module_engines(lookup_folder, kv_cache_tokens=32768), lookup_tok, max_turns=4).run(
        [LookupEnv(k) for k in tasks], sps)
    ours = ReplicaRouter(ReplicaSet(clients))
    got = MultiTurnRunner(ours, lookup_tok, max_turns=4).run([LookupEnv(k) for k in tasks], sps)
    assert [t.output_token_ids for t in got] == [t.output_token_ids for t in want]
    assert not ours.open_sessions  # every session closed at the end of its episode
    router = launch_router([s.url for s in servers], kind=kind, policy="manual")
    try:
        via = MultiTurnRunner(RolloutClient(router.url), lookup_tok, max_turns=4, sessions=False, routing_keys=True)
        routed = via.run([LookupEnv(k) for k in tasks], sps)
    finally:
        router.stop()
        for c in clients:
            c.close()
    assert [t.output_token_ids for t in routed] == [t.output_token_ids for t in want]
    for sessions, trajs in ((True, got), (False, routed)):  # each turn found its history where the last one ran
        for t in trajs:
            for k in range(1, len(t.turns)):
                kept = len(t.prompt_token_ids) + t.turns[k - 1][1]  # the history before what was appended
                if sessions:  # the session's KV: all of it but the last sampled token
                    assert t.turn_cached_tokens[k] >= kept - 1, t.turn_cached_tokens
                elif k >= 2:  # the prefix cache, in whole blocks, past the prompt every replica has seen
                    assert t.turn_cached_tokens[k] >= kept - 2 * 16 > len(t.prompt_token_ids), t.turn_cached_tokens


def test_the_openai_clients_tool_calling_flow(lookup_servers):
    from openai import OpenAI

    server = lookup_servers[0]
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    env = LookupEnv(("apple", "plum"))
    messages = env.reset()
    first = client.chat.completions.create(model="default", messages=messages, tools=[LOOKUP_TOOL], temperature=0,
                                           max_tokens=32)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    key = json.loads(call.function.arguments)["key"]
    assert call.function.name == "lookup" and key in LOOKUP_TABLE
    messages = messages + [choice.message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": LOOKUP_TABLE[key]}]
    second = client.chat.completions.create(model="default", messages=messages, tools=[LOOKUP_TOOL], temperature=0,
                                            max_tokens=32)
    answer = second.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert answer.message.content.strip() in LOOKUP_TABLE.values()
    # streamed: the same call, its markup never in the content deltas
    chunks = list(client.chat.completions.create(model="default", messages=env.reset(), tools=[LOOKUP_TOOL],
                                                 temperature=0, max_tokens=32, stream=True))
    streamed_calls = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or [])]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks).strip() == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(c.index, c.function.name, c.function.arguments) for c in streamed_calls] == \
        [(0, "lookup", call.function.arguments)]


def _run_example(tmp_path, folder, *extra, steps):
    from weight_sync.process_group import free_port

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), os.path.join(ROOT, "examples", "grpo_multiturn.py"), "--model", folder,
                           "--warmup-steps", "0", "--steps", str(steps), "--out-dir", str(out), "--no-wandb", *extra],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Warning" not in proc.stdout
    return json.load(open(out / "steps.json"))


CONTROL = 4  # the control arm of the learning runs: steps whose rollouts run on the initial weights


def test_the_multiturn_example_learns_from_its_pushes_with_masks_replayed_exactly(tmp_path, lookup_folder):
    """One run, two arms: the rollouts of the first steps run on the warmed weights while the trainer trains
    (the control: nothing pushed, rewards flat, each step's samples one version older), then every step
    pushes and the run learns; wherever the engine serves the trainer's weights its fp32 logprobs equal the
    trainer's (masks replayed) and every push reads back equal."""
    logs = _run_example(tmp_path, lookup_folder, "--top-k", "100", "--top-p", "0.98", "--control-steps", str(CONTROL),
                        steps=CONTROL + 12)  # the last five steps' mean: 0.68 against the arm's 0.37 here
    control, pushed = learns_after_its_control_arm(logs, CONTROL, rise=0.2)
    assert all(x["push_verified"] is None for x in control[:-1])
    assert all(x["mismatch_max"] < 1e-4 and x["push_verified"] for x in pushed), [x["mismatch_max"] for x in pushed]
    assert all(x["turns_mean"] == 4 and x["finish_reasons"] == {"done": 64} for x in logs)

