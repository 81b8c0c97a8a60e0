"""Sessions (multi-turn): the engine keeps a conversation's tokens and KV between turns. Each turn gives
exactly what a request with the whole history would give (greedy and seeded, overlap on and off), its
prefill is only what it appends plus the previous turn's last sampled token, a weight update between
turns recomputes the history under the new weights, memory pressure and aborts lose no history, and the
server speaks SGLang's /open_session, session_params and /close_session."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from helpers import random_prompts

from rollout import SamplingParams

PROMPT = random_prompts(300, [21], seed=41)[0]
APPENDS = random_prompts(300, [5, 9, 3, 12, 7], seed=42)  # what an environment appends each turn


def _turns(engine, sp: SamplingParams, session: str, n: int):
    outs = [engine.generate(input_ids=PROMPT, sampling_params=sp, session_id=session)[0]]
    for extra in APPENDS[:n - 1]:
        outs.append(engine.generate(input_ids=extra, sampling_params=sp, session_id=session)[0])
    return outs


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_turns_equal_full_history_requests_and_prefill_only_what_is_new(module_engines, compat_model, overlap,
                                                                         temperature):
    engine = module_engines(compat_model, kv_cache_tokens=4096, enable_overlap=overlap)
    sp = SamplingParams(max_new_tokens=6, temperature=temperature, top_k=40, seed=3, ignore_eos=True)
    sid = engine.open_session()
    history: list[int] = []
    for k in range(5):
        appended = PROMPT if k == 0 else APPENDS[k - 1]
        before = engine.get_stats()["num_prefill_tokens"]
        turn = engine.generate(input_ids=appended, sampling_params=sp, session_id=sid)[0]
        prefilled = engine.get_stats()["num_prefill_tokens"] - before
        assert turn.prompt_token_ids == history + appended
        ref = engine.generate(input_ids=history + appended, sampling_params=sp)[0]  # the whole history resent
        assert turn.output_token_ids == ref.output_token_ids
        assert turn.output_logprobs == pytest.approx(ref.output_logprobs, abs=1e-5)
        if k:  # only the appended tokens, plus the last sampled token when its KV was never computed
            assert len(appended) <= prefilled <= len(appended) + 1, (k, prefilled)
            assert turn.num_cached_tokens >= len(history) - 1
        history = turn.prompt_token_ids + turn.output_token_ids
    info = engine.session_info(sid)
    assert info["token_ids"] == history and info["num_turns"] == 5
    engine.close_session(sid)
    with pytest.raises(ValueError, match="no open session"):
        engine.generate(input_ids=[1, 2], sampling_params=sp, session_id=sid)


def test_a_weight_update_between_turns_recomputes_the_history(module_engines, compat_model, compat_model_b):
    engine = module_engines(compat_model, kv_cache_tokens=4096)
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    sid = engine.open_session()
    first = engine.generate(input_ids=PROMPT, sampling_params=sp, session_id=sid)[0]
    assert engine.update_weights_from_disk(compat_model_b, weight_version="b").success
    try:
        turn = engine.generate(input_ids=APPENDS[0], sampling_params=sp, session_id=sid)[0]
        history = first.prompt_token_ids + first.output_token_ids + APPENDS[0]
        ref = engine.generate(input_ids=history, sampling_params=sp)[0]
        assert turn.num_cached_tokens == 0  # the KV computed under the old weights is never reused
        assert turn.output_token_ids == ref.output_token_ids and set(turn.output_weight_versions) == {"b"}
        assert first.output_weight_versions == ["default"] * 6
    finally:
        assert engine.update_weights_from_disk(compat_model, weight_version="default").success
        engine.close_session(sid)


def test_memory_pressure_releases_idle_sessions_kv_not_their_history(module_engines, compat_model):
    """A small KV pool: idle sessions' KV is released for new work (before anything is preempted);
    their next turn recomputes and is still exact."""
    engine = module_engines(compat_model, kv_cache_tokens=256, block_size=16)
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    sids = [engine.open_session() for _ in range(4)]
    firsts = [engine.generate(input_ids=p, sampling_params=sp, session_id=s)[0]
              for s, p in zip(sids, random_prompts(300, [40] * 4, seed=43))]
    big = engine.generate(input_ids=random_prompts(300, [180], seed=44)[0], sampling_params=sp)[0]
    assert big.num_preemptions == 0 and len(big.output_token_ids) == 8
    for s, first in zip(sids, firsts):
        turn = engine.generate(input_ids=APPENDS[1], sampling_params=sp, session_id=s)[0]
        ref = engine.generate(input_ids=first.prompt_token_ids + first.output_token_ids + APPENDS[1],
                              sampling_params=sp)[0]
        assert turn.output_token_ids == ref.output_token_ids
        engine.close_session(s)


def test_busy_aborted_and_too_long_turns(module_engines, compat_model):
    engine = module_engines(compat_model, kv_cache_tokens=4096, max_model_len=256)
    sid = engine.open_session()
    long_turn = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("out", engine.generate(
        input_ids=PROMPT, sampling_params=long_turn, session_id=sid, rid="long")[0]))
    t.start()
    while not engine.session_info(sid)["busy"]:
        time.sleep(0.005)
    with pytest.raises(ValueError, match="one turn at a time"):
        engine.generate(input_ids=[1, 2], sampling_params=long_turn, session_id=sid)
    engine.abort_request("long")
    t.join(60)
    assert box["out"].finish_reason == "abort"
    assert engine.session_info(sid)["num_tokens"] == 0  # an aborted turn leaves the history as it was
    sp = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
    engine.generate(input_ids=PROMPT, sampling_params=sp, session_id=sid)
    engine.generate(input_ids=APPENDS[3], sampling_params=sp, session_id=sid)
    with pytest.raises(ValueError, match="context limit"):
        engine.generate(input_ids=[5] * 40, sampling_params=sp, session_id=sid)
    with pytest.raises(ValueError, match="n=1"):
        engine.generate(input_ids=[5], sampling_params=SamplingParams(n=2), session_id=sid)
    engine.close_session(sid)


def test_one_call_takes_a_turn_of_many_sessions(module_engines, compat_model):
    """``session_id`` as a list: one batched call advances each session by a turn, exactly as one call
    per session would; what cannot be a turn is refused naming it."""
    engine = module_engines(compat_model, kv_cache_tokens=4096)
    sp = [SamplingParams(max_new_tokens=5, temperature=1.0, seed=s) for s in (1, 2, 3)]
    batched = [engine.open_session() for _ in range(3)]
    alone = [engine.open_session() for _ in range(3)]
    try:
        for k in range(3):
            ids = [PROMPT] * 3 if k == 0 else [APPENDS[k + i] for i in range(3)]
            outs = engine.generate(input_ids=ids, sampling_params=sp, session_id=batched)
            for i in range(3):
                one = engine.generate(input_ids=ids[i], sampling_params=sp[i], session_id=alone[i])[0]
                assert outs[i].output_token_ids == one.output_token_ids
                assert outs[i].prompt_token_ids == one.prompt_token_ids
        with pytest.raises(ValueError, match="2 session ids for 3 prompts"):
            engine.generate(input_ids=[[1], [2], [3]], sampling_params=sp[0], session_id=batched[:2])
        with pytest.raises(ValueError, match="one turn at a time"):
            engine.generate(input_ids=[[1], [2]], sampling_params=sp[0], session_id=[batched[0], batched[0]])
        with pytest.raises(ValueError, match="samples once"):
            engine.generate(input_ids=[[1], [2]], sampling_params=SamplingParams(n=2), session_id=[None, batched[1]])
        mixed = engine.generate(input_ids=[[7, 8], [9]], sampling_params=sp[0], session_id=[None, batched[2]])
        assert mixed[0].prompt_token_ids == [7, 8] and len(mixed[1].prompt_token_ids) > 3
    finally:
        for sid in batched + alone:
            engine.close_session(sid)


def test_sglang_session_routes(compat_model, make_server):
    """/open_session (a JSON string id), /generate with session_params {"id"} appending input_ids, /session_info,
    /close_session; a later turn's cached_tokens covers the history."""
    server = make_server(compat_model, "--dtype", "float32", "--kv-cache-tokens", "4096")
    with httpx.Client(base_url=server.url, timeout=60) as http:
        sid = http.post("/open_session", json={"capacity_of_str_len": 1000}).json()
        assert isinstance(sid, str) and sid
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 0},
                "session_params": {"id": sid}, "return_logprob": True}
        first = http.post("/generate", json=body).json()
        second = http.post("/generate", json={**body, "input_ids": APPENDS[0]}).json()
        assert second["meta_info"]["prompt_tokens"] == len(PROMPT) + 5 + len(APPENDS[0])
        assert second["meta_info"]["cached_tokens"] >= len(PROMPT) + 4
        info = http.get("/session_info", params={"session_id": sid}).json()
        assert info["token_ids"] == PROMPT + first["output_ids"] + APPENDS[0] + second["output_ids"]
        other = http.post("/open_session", json={}).json()  # SGLang's list form: one entry per prompt
        both = http.post("/generate", json={**body, "input_ids": [APPENDS[1], PROMPT],
                                            "session_params": [{"id": sid}, {"id": other}]}).json()
        assert [b["meta_info"]["prompt_tokens"] for b in both] == [len(info["token_ids"]) + len(APPENDS[1]), len(PROMPT)]
        assert http.post("/close_session", json={"session_id": other}).status_code == 200
        assert http.post("/close_session", json={"session_id": sid}).status_code == 200
        r = http.post("/generate", json=body)
        assert r.status_code == 400 and "no open session" in r.text


def test_chat_session_turns_are_token_exact(compat_model, make_server):
    """An agent on /v1/chat/completions naming its conversation (SkyRL's X-Session-ID header) sends the whole
    message list each turn; the server appends only what is new, rendered by the template, after the tokens
    the compat_model sampled: every turn's prompt_token_ids start with the previous prompt and sampled tokens
    exactly, the history's KV is reused, and the last turn equals a plain request on those tokens."""
    server = make_server(compat_model, "--dtype", "float32", "--kv-cache-tokens", "4096")
    headers = {"X-Session-ID": "episode-7"}
    messages = [{"role": "system", "content": "You count."}, {"role": "user", "content": "one two three"}]
    prev = None
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for k in range(5):
            body = {"model": "m", "messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True}
            out = http.post("/v1/chat/completions", json=body, headers=headers).json()
            assert out["session_restarted"] is False
            choice = out["choices"][0]
            if prev is not None:
                kept = prev["prompt_token_ids"] + prev["choices"][0]["token_ids"]
                assert out["prompt_token_ids"][:len(kept)] == kept and out["render_mode"] == "template"
                assert out["cached_tokens"] >= len(kept) - 1
            assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
            prev = out
            messages = messages + [{"role": "assistant", "content": choice["message"]["content"]},
                                   {"role": "user", "content": f"tool says {k}"}]
        plain = http.post("/generate", json={"input_ids": prev["prompt_token_ids"],
                                             "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
        assert plain["output_ids"] == prev["choices"][0]["token_ids"]
        edited = [messages[0], {"role": "user", "content": "four five"}] + messages[2:]
        out = http.post("/v1/chat/completions", json={"messages": edited, "max_tokens": 2}, headers=headers).json()
        assert out["session_restarted"] is True and out["render_mode"] == "first"
        assert http.post("/finish_session", json={"session_id": "episode-7"}).json()["success"] is True


def test_rollout_client_sessions(compat_model, make_server):
    from rollout.server import RolloutClient

    server = make_server(compat_model, "--dtype", "float32", "--kv-cache-tokens", "4096")
    with RolloutClient(server.url) as client:
        sid = client.open_session()
        sp = SamplingParams(max_new_tokens=4, temperature=0.0)
        first = client.generate(input_ids=PROMPT, sampling_params=sp, session_id=sid)[0]
        second = client.generate(input_ids=APPENDS[0], sampling_params=sp, session_id=sid)[0]
        info = client.session_info(sid)
        assert info["token_ids"] == PROMPT + first.output_token_ids + APPENDS[0] + second.output_token_ids
        client.close_session(sid)
        with pytest.raises(Exception, match="no open session"):
            client.session_info(sid)
