"""What hostile and unlucky clients sent to the newer routes (chat templates, sessions, TRL's routes,
adapters), over a real server socket: template text from a request is never rendered unless the
operator opts in, ``chat_template_kwargs`` carry template variables only, every rendering is bounded
and off the event loop, every rendering failure is a 400 naming what failed and leaves no session
behind; and a property test: any JSON body to the chat routes and ``/tokenize`` answers 2xx or 4xx,
never 5xx, and the server's greedy tokens are the same afterwards."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "hi"}]
INJECTED = "X{{ 6*7 }}"


@pytest.fixture(scope="module")
def srv(compat_srv):
    return compat_srv


ADMIN_KEY = "hostile-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def ctl(compat_model, module_servers):
    """A server with an admin key, a 4-second request timeout, 2-second sessions and at most 3 of them, that
    renders request templates (``--trust-request-chat-template``) within one second."""
    server = module_servers(compat_model, "--dtype", "float32", "--kv-cache-tokens", "4096", "--api-key", KEY,
                            "--admin-api-key", ADMIN_KEY, "--request-timeout-s", "4", "--session-timeout-s", "2",
                            "--max-sessions", "3", "--trust-request-chat-template",
                            "--render-timeout-s", "1")
    with httpx.Client(base_url=server.url, headers=ADMIN, timeout=60) as http:
        yield http


@pytest.fixture(scope="module")
def trusting(ctl):
    """A server whose operator allows request templates, with a one-second rendering limit (``ctl``)."""
    return ctl


def _chat(http, kwargs=None, session=None, **extra):
    body = {"messages": HI, "max_tokens": 3, "temperature": 0, **extra}
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    headers = {"X-Session-ID": session} if session else {}
    return http.post("/v1/chat/completions", json=body, headers=headers)


def _every_chat_route(http, kwargs=None, **extra):
    """The answers of /tokenize, /v1/chat/completions, TRL's /chat/ and a chat-session turn."""
    yield "tokenize", http.post("/tokenize", json={"messages": HI, "chat_template_kwargs": kwargs, **extra})
    yield "chat", _chat(http, kwargs, **extra)
    yield "trl", http.post("/chat/", json={"messages": [HI], "max_tokens": 3, "temperature": 0,
                                           "chat_template_kwargs": kwargs or {}, **extra})
    yield "session", _chat(http, kwargs, session="hostile-session", **extra)


@pytest.mark.parametrize("kwargs, extra, says", [
    ({"chat_template": INJECTED}, {}, "--trust-request-chat-template"),
    (None, {"chat_template": INJECTED}, "chat_template"),
    ({"padding": "max_length", "max_length": 200000}, {}, "max_length"),
    ({"return_tensors": "pt"}, {}, "return_tensors"),
    ({"tokenize": False}, {}, "tokenize"),
    ({"eos_token": "<|im_start|>"}, {}, "eos_token"),
    ({"add_generation_prompt": False}, {}, "add_generation_prompt"),
], ids=["template-in-kwargs", "template-beside", "padding", "return-tensors", "tokenize", "special-token",
        "generation-prompt"])
def test_request_templates_and_tokenizer_controls_are_refused_on_every_chat_route(srv, kwargs, extra, says):
    for route, r in _every_chat_route(srv, kwargs, **extra):
        if route == "trl" and "chat_template" in extra:
            continue  # TRL's body has no such field (ignored, as unknown fields are)
        assert r.status_code == 400, (route, r.status_code, r.text[:300])
        assert says in r.text and "42" not in r.text, (route, r.text[:300])
    # nothing was opened by the refused session turn
    assert srv.post("/finish_session", json={"session_id": "hostile-session"}).json()["success"] is False
    # template variables still reach the template
    assert _chat(srv, {"enable_thinking": False}).status_code == 200


def test_a_trusted_request_template_renders_within_its_limits(trusting):
    r = trusting.post("/tokenize", json={"messages": HI, "chat_template_kwargs": {"chat_template": INJECTED},
                                         "add_generation_prompt": False})
    assert r.status_code == 200
    assert r.json()["tokens"] == trusting.post("/tokenize", json={"prompt": "X42", "add_special_tokens": False}).json()[
        "tokens"]
    bad = trusting.post("/tokenize", json={"messages": HI, "chat_template": "{{ x"})
    assert bad.status_code == 400 and "does not compile" in bad.text
    # a template that would run for minutes: refused within its limit, /health answering meanwhile
    slow = ("{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}"
            "{% endfor %}{% endfor %}{% endfor %}")
    huge = "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}"
    for template, says in ((slow, "longer than"), (huge, "characters")):
        box: dict = {}
        t = threading.Thread(target=lambda t=template: box.setdefault("r", trusting.post(
            "/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "chat_template": t})))
        t0 = time.monotonic()
        t.start()
        health = []
        while t.is_alive():
            h0 = time.monotonic()
            assert trusting.get("/health").status_code == 200
            health.append(time.monotonic() - h0)
            time.sleep(0.05)
        t.join()
        assert box["r"].status_code == 400 and says in box["r"].text, box["r"].text[:300]
        assert time.monotonic() - t0 < 10 and max(health) < 1.0


def test_a_template_that_refuses_a_conversation_is_a_400_naming_the_message(model_dir, make_server):
    """Llama 3.1's template raises on two tool calls in one message: 400 on both chat paths naming the
    message, no session left; a tool call whose function is not an object: 400."""
    from rollout.tools.tiny import build_chat_tokenizer

    path = model_dir("llama31-chat", "llama", tokenizer=build_chat_tokenizer("llama3_1"), seed=3)
    server = make_server(path, "--dtype", "float32", "--kv-cache-tokens", "1024")
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call, call]},
                {"role": "user", "content": "and?"}]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for headers in ({}, {"X-Session-ID": "s1"}):
            r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, headers=headers)
            assert r.status_code == 400, r.text[:300]
            assert "message 1" in r.text and "assistant" in r.text, r.text[:300]
        assert http.post("/finish_session", json={"session_id": "s1"}).json()["success"] is False
        odd = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "",
                                                   "tool_calls": [{"type": "function", "function": 5}]},
               {"role": "user", "content": "x"}]
        for headers in ({}, {"X-Session-ID": "s2"}):
            r = http.post("/v1/chat/completions", json={"messages": odd, "max_tokens": 2}, headers=headers)
            assert r.status_code == 400 and "function" in r.text, r.text[:300]
        assert http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2}).status_code == 200


# ------------------------------------------------------------------ any JSON body: 2xx or 4xx

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False, width=32),
                     st.text(max_size=12))
_json = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                     max_leaves=12)
_keys = st.sampled_from(["chat_template", "tokenize", "padding", "max_length", "return_tensors", "enable_thinking",
                         "add_generation_prompt", "continue_final_message", "eos_token", "tools", "documents",
                         "return_dict", "x"])
_message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool"]), _json)},
                                 optional={"content": st.one_of(st.text(max_size=20), _json),
                                           "tool_calls": _json, "name": _json, "tool_call_id": _json})
_body = st.fixed_dictionaries({}, optional={
    "messages": st.one_of(st.lists(_message, max_size=4), _json),
    "chat_template_kwargs": st.one_of(st.dictionaries(_keys, _json, max_size=3), _json),
    "chat_template": st.one_of(st.sampled_from([INJECTED, "{{ x", "{% for %}"]), _json),
    "tools": _json, "max_tokens": st.one_of(st.integers(0, 4), _json), "n": _json, "temperature": _json,
    "add_generation_prompt": _json, "prompt": _json, "logprobs": _json,
})
_ROUTES = st.sampled_from(["/tokenize", "/v1/chat/completions", "/chat/", "session"])


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=_ROUTES, body=_body)
def test_any_json_body_to_the_chat_routes_is_answered_2xx_or_4xx(srv, route, body):
    if route == "/chat/" and isinstance(body.get("messages"), list):
        body = {**body, "messages": [body["messages"]]}
    headers = {"X-Session-ID": "fuzz"} if route == "session" else {}
    path = "/v1/chat/completions" if route == "session" else route
    if isinstance(body.get("max_tokens"), int) or "max_tokens" not in body:
        body = {**body, "max_tokens": min(body.get("max_tokens", 2), 2)}
    r = srv.post(path, content=json.dumps(body), headers={**headers, "Content-Type": "application/json"})
    assert r.status_code < 500, (path, body, r.status_code, r.text[:300])
    assert "X42" not in r.text


def test_the_server_serves_the_same_tokens_after_the_fuzzing(srv, compat_model):
    from helpers import hf_greedy

    prompt = [5, 9, 23, 41, 7]
    out = srv.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 6,
                                                                                "temperature": 0}}).json()
    assert out["output_ids"] == hf_greedy(compat_model, prompt, 6)[0]


@pytest.mark.parametrize("sig, tp", [("SIGTERM", 2), ("SIGINT", 1)])
def test_rollout_serve_shuts_its_engine_down_on_sigterm_and_sigint(compat_model, make_server, sig, tp):
    """uvicorn re-raises the signal after its graceful shutdown; the engine's orderly stop still runs (its
    TP rank reaped) and the process exits 0."""
    import signal

    import psutil

    server = make_server(compat_model, "--dtype", "float32", "--kv-cache-tokens", "512", "--tp-size", str(tp),
                         log_level="INFO")
    children = psutil.Process(server.proc.pid).children(recursive=True)
    server.proc.send_signal(getattr(signal, sig))
    assert server.proc.wait(60) == 0, server.log_tail()
    assert f"stopped by {sig}: the engine is shut down" in server.log_tail()
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, alive


# ------------------------------------------------------------------ control states, tables, input errors


def _long_generation(http, box, key="gen"):
    """A 1000-token generation in a thread, returned once the engine runs it (so what follows meets it in
    flight on any machine)."""
    body = {"input_ids": [5, 9, 23], "sampling_params": {"max_new_tokens": 1000, "temperature": 1.0,
                                                          "ignore_eos": True}}
    t = threading.Thread(target=lambda: box.setdefault(key, http.post("/generate", json=body)))
    t.start()
    deadline = time.monotonic() + 10
    while http.get("/v1/loads").json()["loads"][0]["num_running_reqs"] == 0:
        assert time.monotonic() < deadline and t.is_alive(), "the generation never ran"
        time.sleep(0.005)
    return t


def test_control_transitions_validate_before_they_act(ctl):
    """/sleep with a bad tag: 400 and nothing paused or aborted. /pause?mode=keep then /pause?mode=wait: 409 at
    once (what is kept would never finish), and after /resume the kept request finishes."""
    box: dict = {}
    t = _long_generation(ctl, box)
    r = ctl.post("/sleep?level=1&tags=evil")
    assert r.status_code == 400 and "evil" in r.text
    assert ctl.get("/is_paused").json()["is_paused"] is False
    t.join()
    assert box["gen"].status_code == 200 and box["gen"].json()["meta_info"]["finish_reason"]["type"] == "length"
    t = _long_generation(ctl, box, "kept")
    assert ctl.post("/pause?mode=keep").status_code == 200
    t0 = time.monotonic()
    r = ctl.post("/pause?mode=wait")
    assert r.status_code == 409 and "resume" in r.text and time.monotonic() - t0 < 5
    assert ctl.post("/resume").status_code == 200
    t.join()
    assert box["kept"].status_code == 200


def test_a_request_waiting_at_a_closed_door_honours_its_timeout(ctl):
    """While /pause?mode=wait lets a long request finish, a new /generate waits at the door: it is answered 504
    at the server's request timeout instead of waiting forever."""
    box: dict = {}
    t = _long_generation(ctl, box)
    waiting = threading.Thread(target=lambda: box.setdefault("pause", ctl.post("/pause?mode=wait")))
    waiting.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    r = ctl.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 504 and time.monotonic() - t0 < 15, r.text
    t.join()
    waiting.join()
    assert ctl.post("/resume").status_code == 200


def test_a_group_setup_obeys_its_timeout_end_to_end(ctl):
    """AReaL's /areal_init_weights_update_group towards a port nobody listens on: 400 within its timeout (and
    a body without one gets the documented 60 s; not waited for here)."""
    from weight_sync.process_group import free_port

    body = {"master_address": "127.0.0.1", "master_port": str(free_port()), "rank_offset": 1, "world_size": 2,
            "backend": "gloo", "group_name": "areal-dead", "timeout_s": 2}
    t0 = time.monotonic()
    r = ctl.post("/areal_init_weights_update_group", json=body)
    assert r.status_code == 400 and time.monotonic() - t0 < 6, (r.text, time.monotonic() - t0)


def test_session_tables_are_bounded_and_expire_with_the_engine_s(ctl):
    big = "s" * 900_000
    r = ctl.post("/open_session", json={"session_id": big})
    assert r.status_code == 400 and "printable characters" in r.text
    r = _chat(ctl, session="x" * 300)
    assert r.status_code == 400 and "session id" in r.text
    opened = [ctl.post("/open_session", json={}).json() for _ in range(3)]
    r = ctl.post("/open_session", json={})
    assert r.status_code == 400 and "max_sessions" in r.text
    for sid in opened:
        assert ctl.post("/close_session", json={"session_id": sid}).status_code == 200
    assert _chat(ctl, session="short-lived").status_code == 200
    time.sleep(3.5)  # past the engine's session timeout: the chat session goes with its engine session
    assert ctl.post("/finish_session", json={"session_id": "short-lived"}).json()["success"] is False
    assert _chat(ctl, session="live").status_code == 200
    assert ctl.post("/finish_session", json={"session_id": "live"}).json()["success"] is True


def test_a_large_answer_is_shaped_off_the_event_loop(ctl):
    """TRL's /get_sequence_logprobs/ in JSON, 1000 positions x top 1000 (a 5 KB request): /health answers
    quickly all the while."""
    seq = [(i * 7) % 300 + 3 for i in range(1001)]
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("r", ctl.post("/get_sequence_logprobs/", json={
        "sequences": [seq], "prompt_lengths": [1], "top_logprobs": 1000, "response_format": "json"})))
    t.start()
    slowest = 0.0
    while t.is_alive():
        h0 = time.monotonic()
        assert ctl.get("/health").status_code == 200
        slowest = max(slowest, time.monotonic() - h0)
        time.sleep(0.05)
    t.join()
    assert box["r"].status_code == 200 and len(box["r"].json()["logprobs"][0]) == 1000
    assert slowest < 1.0, slowest


def test_input_errors_answer_400_in_every_route_family_after_the_key(ctl):
    bad = [("/collective_rpc", {"method": "skyrl_start_weight_update", "kwargs": {"is_checkpoint_format": [1]}}),
           ("/collective_rpc", {"method": "skyrl_finish_weight_update", "kwargs": {"weight_version": 5}}),
           ("/areal_update_weights_lora_xccl", {"names": ["x"]})]
    for path, body in bad:
        r = ctl.post(path, json=body)
        assert r.status_code == 400, (path, r.status_code, r.text[:200])
    deep = '{"x": ' * 950 + '{"a": 1}' + "}" * 950  # tools nested 950 deep (json.dumps itself would recurse)
    r = ctl.post("/v1/chat/completions", content=f'{{"messages": {json.dumps(HI)}, "tools": [{deep}], "max_tokens": 2}}',
                 headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "deeper than" in r.text
    # a body that does not parse, to an admin route, without the key: the key is what is refused
    for headers in ({}, {"Authorization": f"Bearer {KEY}"}):
        r = httpx.post(str(ctl.base_url) + "/update_weights_from_disk", content=b"{bad", timeout=30,
                       headers={"Content-Type": "application/json", **headers})
        assert r.status_code in (401, 403), (headers, r.status_code, r.text[:200])


def test_the_listener_check_sees_a_wildcard_listener_of_a_child():
    """The check run after every test (conftest: nothing of ours listens on every interface) is not
    vacuous: a child bound to 0.0.0.0 is found, and gone once the child is."""
    import subprocess
    import sys

    from helpers import wildcard_listeners

    code = ("import socket, sys, time; s = socket.socket(); s.bind(('0.0.0.0', 0)); s.listen(); "
            "print(s.getsockname()[1], flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = child.stdout.readline().strip()
        assert any(w.endswith(f"0.0.0.0:{port}") for w in wildcard_listeners()), wildcard_listeners()
    finally:
        child.kill()
        child.wait(10)
    assert not wildcard_listeners()


def test_a_pause_wait_whose_caller_leaves_is_withdrawn(ctl):
    """/pause?mode=wait awaits the engine's quiet point as an event; a caller that leaves before it (a client
    timeout) withdraws it: the generation in flight finishes and the engine is not paused afterwards."""
    box: dict = {}
    t = _long_generation(ctl, box)
    with pytest.raises(httpx.TimeoutException):
        ctl.post("/pause?mode=wait", timeout=0.3)
    t.join()
    assert box["gen"].status_code == 200 and box["gen"].json()["meta_info"]["finish_reason"]["type"] == "length"
    assert ctl.get("/is_paused").json()["is_paused"] is False
    r = ctl.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200  # the door is open again
