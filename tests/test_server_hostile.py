"""The server against hostile and careless clients, on a real socket: bodies that hide their size,
clients that leave, bytes no parser should pass on, values JSON cannot carry, fields that were
silently ignored, and routes that answered without the key. Each test names the hole it closes."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import socket
import threading
import time

import httpx
import pytest
from helpers import assert_left_request_was_aborted

GEN_KEY, ADMIN_KEY = "gen-key", "admin-key"
GEN = {"Authorization": f"Bearer {GEN_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def model(model_dir):
    """A tiny model with a long context (a request that cannot finish before its client leaves)."""
    return model_dir("hostile", "llama", seed=21, max_position_embeddings=8192)


@pytest.fixture(scope="module")
def allowed(model, tmp_path_factory):
    """The folder updates may read from, with a copy of the served weights in it."""
    folder = tmp_path_factory.mktemp("allowed")
    shutil.copytree(model, folder / "copy")
    return folder


@pytest.fixture(scope="module")
def served(model, allowed, module_servers):
    server = module_servers(model, "--dtype", "float32", "--kv-cache-tokens", "16384", "--api-key", GEN_KEY,
                            "--admin-api-key", ADMIN_KEY, "--allowed-weight-dirs", str(allowed), "--max-body-mb", "1")
    with server.client(api_key=GEN_KEY, admin_api_key=ADMIN_KEY) as client:
        yield server.url, client


def _strict(text: str):
    """JSON as a strict parser reads it: NaN / Infinity are errors."""
    def refuse(token):
        raise ValueError(f"non-standard JSON number {token}")
    return json.loads(text, parse_constant=refuse)


# ---------------------------------------------------------------------------------------------- bodies


def test_a_chunked_body_past_the_limit_is_refused_as_it_arrives(served):
    """--max-body-mb was read from Content-Length only: a chunked body declares none."""
    url, _ = served

    def chunks(total: int):
        piece = b'{"text": "' + b"x" * (64 << 10)
        yield piece
        sent = len(piece)
        while sent < total:
            yield b"x" * (64 << 10)
            sent += 64 << 10
        yield b'"}'

    r = httpx.post(f"{url}/generate", headers={**GEN, **JSON}, content=chunks(3 << 20), timeout=60)
    assert r.status_code == 413 and "limit" in r.json()["detail"]
    small = httpx.post(f"{url}/generate", headers={**GEN, **JSON}, timeout=60,
                       content=iter([b'{"input_ids": [5, 6, 7], ', b'"sampling_params": {"max_new_tokens": 2}}']))
    assert small.status_code == 200 and len(small.json()["output_ids"]) == 2  # chunked and small: served


def test_a_client_that_leaves_a_whole_request_aborts_it(served):
    """The HTTP middleware hid disconnects from non-streaming requests: they ran to the end."""
    url, client = served
    wanted = 8000
    before = client.get_server_info()["stats"]
    body = json.dumps({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": wanted, "temperature": 0,
                                                                  "ignore_eos": True}}).encode()
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + GEN_KEY.encode() +
                 b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() +
                 b"\r\n\r\n" + body)
    deadline = time.monotonic() + 30
    while client.get_server_info()["stats"]["num_decode_tokens"] < before["num_decode_tokens"] + 50:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)
    sock.close()
    assert_left_request_was_aborted(client, before, wanted)


def test_reads_piling_up_behind_a_waiting_update_leave_control_calls_their_threads(served, allowed):
    """An update waits for a running request to finish (a quiet point); reads of the engine's stats
    queue behind it. Ten /metrics calls with the generation key took every thread asyncio lends
    (6 on 2 cores) and /abort_request, the one call that would end the wait, timed out behind them."""
    url, client = served
    copy = str(allowed / "copy")
    before = client.get_server_info()["stats"]["num_decode_tokens"]
    box: dict = {}
    long = threading.Thread(target=lambda: box.setdefault("long", client.generate(
        input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 8000, "temperature": 0, "ignore_eos": True})))
    long.start()
    while client.get_server_info()["stats"]["num_decode_tokens"] < before + 20:
        time.sleep(0.02)
    update = threading.Thread(target=lambda: box.setdefault("update", client.update_weights_from_disk(
        copy, weight_version="after-abort")))
    update.start()
    time.sleep(0.3)
    reads = [threading.Thread(target=lambda: httpx.get(f"{url}/metrics", headers=GEN, timeout=120)) for _ in range(10)]
    for t in reads:
        t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    r = httpx.post(f"{url}/abort_request", headers=ADMIN, json={"abort_all": True}, timeout=10)
    assert r.status_code == 200 and time.monotonic() - t0 < 2.0
    for t in (long, update, *reads):
        t.join(60)
    assert box["long"][0].finish_reason == "abort" and box["update"].success
    assert client.get_weight_version() == "after-abort"


def test_a_stream_reader_that_stops_reading_is_dropped_at_bounded_memory(model, make_server):
    """Every snapshot of a stream was queued for a reader that never read (228 MiB for one 4 x 2000-token
    request): now only the newest per sample waits, the bytes waiting in the server for the reader stay
    within --stream-max-pending-mb (events go in pieces), and the reader is dropped once it takes nothing
    for --stream-stall-timeout-s, its request aborted and its blocks freed."""
    import psutil

    cap = 24 << 10  # below uvicorn's own high-water mark (64 KiB): the cap is what holds it
    server = make_server(model, "--dtype", "float32", "--kv-cache-tokens", "32768", "--stream-stall-timeout-s", "1",
                         "--stream-max-pending-mb", str(cap / 2**20))
    client = server.client()
    proc = psutil.Process(server.proc.pid)
    client.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 64, "n": 4})  # warm
    rss0 = peak = proc.memory_info().rss
    wanted = 6000
    body = json.dumps({"input_ids": [5, 6, 7], "stream": True, "return_logprob": True, "sampling_params": {
        "n": 4, "max_new_tokens": wanted, "temperature": 0, "ignore_eos": True}}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)  # the kernel soon holds no more for us
    sock.connect((host, int(port)))
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
                 str(len(body)).encode() + b"\r\n\r\n" + body)  # and never read
    t0 = time.monotonic()
    time.sleep(0.5)
    while client.get_server_info()["stats"]["num_running"] and time.monotonic() - t0 < 60:
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.05)
    stats = client.get_server_info()["stats"]
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    assert time.monotonic() - t0 < 30
    assert peak - rss0 < 64 << 20, f"server grew {(peak - rss0) >> 20} MiB for one stalled reader"
    sock.settimeout(30)
    received = b""
    while chunk := sock.recv(1 << 20):  # what the socket's buffers held, then the server's close
        received += chunk
    sock.close()
    assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received  # dropped, not finished
    metrics = {line.split()[0]: float(line.split()[1]) for line in client.metrics().splitlines()
               if line.startswith("rollout_stream")}
    assert 0 < metrics["rollout_stream_pending_bytes_peak"] <= cap, metrics  # it filled up to the cap, not past
    assert metrics["rollout_streams_dropped_total"] == 1 and metrics["rollout_stream_pending_bytes"] == 0
    # a reader that reads gets every event whole, events larger than the cap included (sent in pieces)
    ask = {"input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": 3,
           "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}}
    whole = httpx.post(f"{server.url}/generate", json=ask, timeout=120).json()
    with httpx.stream("POST", f"{server.url}/generate", json={**ask, "stream": True}, timeout=120) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and max(len(e) for e in events) > cap
    last = json.loads(events[-2])
    same = ("output_token_logprobs", "output_top_logprobs", "completion_tokens", "finish_reason")
    assert last["output_ids"] == whole["output_ids"]
    assert all(last["meta_info"][k] == whole["meta_info"][k] for k in same)
    assert client.health()
    client.close()


# ---------------------------------------------------------------------------------------------- 500s


@pytest.mark.parametrize("raw, field", [
    (b'{"text": "\\ud800 hi"}', "text"),
    (b'{"input_ids": [5, 6], "rid": "a\\udfff"}', "rid"),
    (b'{"input_ids": [5, 6], "sampling_params": {"\\ud800": 1}}', "sampling_params"),
    (b'{"input_ids": [5, 6], "return_logprob": true, "top_logprobs_num": NaN}', "top_logprobs_num"),
    (b'{"input_ids": [5, Infinity]}', "input_ids"),
    (b'{"input_ids": [5, 6], "logprob_start_len": -Infinity}', "logprob_start_len"),
])
def test_bytes_no_parser_should_pass_on_are_a_400_naming_the_field(served, raw, field):
    """Lone surrogates and NaN/Infinity were echoed into a 422 that could not be encoded: 500."""
    url, client = served
    r = httpx.post(f"{url}/generate", headers={**GEN, **JSON}, content=raw)
    assert r.status_code == 400 and field in r.json()["detail"], r.text
    assert client.health()


def test_keys_paths_and_content_parts_that_crashed_are_refused(served):
    url, client = served
    r = httpx.get(f"{url}/get_model_info", headers={"Authorization": "Bearer caf\u00e9".encode()})
    assert r.status_code == 401  # a non-ASCII key: compare_digest raised TypeError
    r = httpx.post(f"{url}/update_weights_from_disk", headers=ADMIN, json={"model_path": "/tmp/a\u0000b"})
    assert r.status_code == 400 and "NUL" in r.json()["detail"]  # realpath raised ValueError
    r = httpx.post(f"{url}/v1/chat/completions", headers=GEN, json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}], "max_tokens": 2})
    assert r.status_code == 400 and "messages.0.content" in r.json()["error"]["message"]  # join() raised TypeError
    r = httpx.post(f"{url}/init_weights_update_group", headers={**ADMIN, **JSON}, content=(
        b'{"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 2, "timeout_s": 1e400}'))
    assert r.status_code == 400 and "timeout_s" in r.json()["detail"]
    assert client.health()


def test_masked_logprobs_are_json_the_strictest_client_reads(served):
    """top_k=2 with top_logprobs_num=5: the masked tokens' -inf crashed /generate and /v1/completions
    (500) and streamed as -Infinity. SGLang's routes write null (as SGLang's orjson does), the OpenAI
    routes -9999.0 (as vLLM clamps)."""
    url, _ = served
    sp = {"max_new_tokens": 4, "temperature": 1.0, "top_k": 2, "seed": 3, "ignore_eos": True}
    r = httpx.post(f"{url}/generate", headers=GEN, json={"input_ids": [5, 6, 7], "sampling_params": sp,
                                                         "return_logprob": True, "top_logprobs_num": 5})
    assert r.status_code == 200
    meta = _strict(r.text)["meta_info"]
    for top in meta["output_top_logprobs"]:
        values = [lp for lp, _, _ in top]
        assert len(values) == 5 and values[2:] == [None, None, None] and all(math.isfinite(v) for v in values[:2])
    assert all(math.isfinite(lp) for lp, _, _ in meta["output_token_logprobs"])  # drawn tokens: real numbers
    with httpx.stream("POST", f"{url}/generate", headers=GEN, json={
            "input_ids": [5, 6, 7], "sampling_params": sp, "return_logprob": True, "top_logprobs_num": 5,
            "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    assert events and all(_strict(e) for e in events)
    r = httpx.post(f"{url}/v1/completions", headers=GEN, json={
        "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 1.0, "top_k": 2, "seed": 3, "logprobs": 5})
    assert r.status_code == 200
    tops = _strict(r.text)["choices"][0]["logprobs"]["top_logprobs"]
    assert all(sorted(top.values())[:3] == [-9999.0] * 3 for top in tops)


# ---------------------------------------------------------------------------------------------- silently wrong


def test_echo_and_max_tokens_zero_are_honoured(served):
    """/v1/completions accepted echo and ignored it; chat max_tokens: 0 returned 128 tokens."""
    url, client = served
    r = httpx.post(f"{url}/v1/completions", headers=GEN, json={"prompt": "hello there", "max_tokens": 3,
                                                               "temperature": 0, "echo": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("hello there")
    # the scoring pattern: echo, no new tokens, the prompt's logprobs
    r = httpx.post(f"{url}/v1/completions", headers=GEN, json={"prompt": [5, 6, 7, 8], "max_tokens": 0,
                                                               "echo": True, "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    ref = client.generate(input_ids=[[5, 6, 7, 8]], sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          logprob_start_len=0)[0]
    assert r.status_code == 200 and lp["token_logprobs"][0] is None and len(lp["tokens"]) == 4
    assert lp["token_logprobs"][1:] == pytest.approx(ref.input_logprobs[1:], abs=1e-6)
    assert lp["top_logprobs"][0] is None and all(len(t) >= 1 for t in lp["top_logprobs"][1:])
    r = httpx.post(f"{url}/v1/completions", headers=GEN, json={"prompt": "x", "echo": True, "stream": True})
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]  # refused, not ignored
    r = httpx.post(f"{url}/v1/chat/completions", headers=GEN, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 0


def test_docs_and_unknown_routes_answer_only_behind_the_key(served):
    """/, /docs, /redoc and /openapi.json answered without a key, against the README."""
    url, _ = served
    for path in ("/", "/docs", "/redoc", "/openapi.json", "/no/such/route"):
        assert httpx.get(f"{url}{path}").status_code == 401, path
    assert httpx.get(f"{url}/", headers=GEN).status_code == 200
    assert httpx.get(f"{url}/no/such/route", headers=GEN).status_code == 404
    assert httpx.get(f"{url}/openapi.json", headers=GEN).status_code == 404  # off behind a key
    assert httpx.get(f"{url}/health").status_code == 200  # the one open route


def _pinned_dirs(pid: int) -> set[str]:
    """The folders a process holds open (what /proc says its descriptors are)."""
    import os

    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return out


def test_a_checked_folder_swapped_while_the_update_waits_is_not_what_is_read(model, model_dir, make_server, tmp_path):
    """The path was checked when the request arrived and read when the engine reached a quiet point:
    swapping the checked folder for a symlink to an outside model in between loaded the outside
    weights ("200 loaded 21 tensors"). Now the folder is pinned as a descriptor when the request
    arrives and every TP rank reads through it (TP=2: rank 1 gets the descriptor, not the path)."""
    import os

    other = model_dir("hostile-b", "llama", seed=22, max_position_embeddings=8192)  # same shapes, other weights
    allowed = tmp_path / "allowed"
    shutil.copytree(other, allowed / "ckpt")
    server = make_server(model, "--dtype", "float32", "--kv-cache-tokens", "16384", "--tp-size", "2",
                         "--admin-api-key", ADMIN_KEY, "--allowed-weight-dirs", str(allowed))
    client = server.client(admin_api_key=ADMIN_KEY)
    greedy = {"max_new_tokens": 12, "temperature": 0}

    def outputs():
        return [o.output_token_ids for o in client.generate(input_ids=[[5, 6, 7], [9, 1]], sampling_params=greedy)]

    served_before = outputs()  # the outside model (the one the server started with)
    box: dict = {}
    long = threading.Thread(target=lambda: box.setdefault("long", client.generate(
        input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 8000, "temperature": 0, "ignore_eos": True})))
    long.start()
    while client.get_server_info()["stats"]["num_decode_tokens"] < 20:
        time.sleep(0.02)
    update = threading.Thread(target=lambda: box.setdefault("update", client.update_weights_from_disk(
        str(allowed / "ckpt"), weight_version="pinned")))
    update.start()
    checked = os.path.realpath(allowed / "ckpt")
    deadline = time.monotonic() + 30
    while checked not in _pinned_dirs(server.proc.pid):  # checked and pinned; now it waits for a quiet point
        assert time.monotonic() < deadline and update.is_alive(), box
        time.sleep(0.02)
    assert long.is_alive() and client.get_weight_version() != "pinned"
    os.rename(allowed / "ckpt", allowed / "ckpt-checked")
    os.symlink(model, allowed / "ckpt")  # the checked path now names the outside model
    client.abort_request(abort_all=True)  # the quiet point: the update runs now
    for t in (long, update):
        t.join(120)
    assert box["update"].success and client.get_weight_version() == "pinned"
    raced = outputs()
    assert raced != served_before  # the outside weights would have answered as before
    assert client.update_weights_from_disk(str(allowed / "ckpt-checked"), weight_version="again").success
    assert raced == outputs()  # every rank read the checked folder, nothing of the outside one
    with pytest.raises(Exception, match="allowed-weight-dirs"):  # the path itself: refused as it is now
        client.update_weights_from_disk(str(allowed / "ckpt"))
    client.close()


def test_a_huge_weight_path_does_not_stall_the_event_loop(served):
    """realpath of a 300k-character path ran on the event loop: /health froze for seconds."""
    url, _ = served
    path = "/" + "/".join(["ab"] * 150000)  # many short parts: realpath is quadratic in them
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", httpx.post(
        f"{url}/update_weights_from_disk", headers=ADMIN, json={"model_path": path}, timeout=120)))
    t.start()
    worst = 0.0
    while t.is_alive():
        t0 = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.01)
    t.join()
    assert box["r"].status_code in (400, 403) and worst < 1.0, worst


def test_health_says_503_once_the_engine_is_dead(model, make_server):
    """/health answered 200 whatever the engine's state: a server whose TP rank died looked healthy."""
    import psutil

    server = make_server(model, "--dtype", "float32", "--kv-cache-tokens", "2048", "--tp-size", "2", "--tp-timeout-s", "20")
    client = server.client()
    assert httpx.get(f"{server.url}/health").status_code == 200
    ranks = psutil.Process(server.proc.pid).children(recursive=True)
    rank = next(p for p in ranks if "spawn" in " ".join(p.cmdline()))
    rank.kill()
    with pytest.raises(Exception):  # noqa: B017  the step that finds the rank gone fails its request
        client.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 4})
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/health").status_code != 503:
        assert time.monotonic() < deadline, "/health still says ok with a rank gone"
        time.sleep(0.2)
    assert "not running" in httpx.get(f"{server.url}/health").json()["detail"]
    client.close()


def test_requests_that_never_arrive_whole_are_dropped_and_slow_answers_are_not(model, make_server):
    """A silent socket, half the headers or half the body stayed open for good (no read timeout): now
    closed --request-read-timeout-s after their first byte; a request read whole may take longer
    than that to answer (here: queued behind a pause)."""
    server = make_server(model, "--dtype", "float32", "--kv-cache-tokens", "2048", "--request-read-timeout-s", "2")
    host, port = server.url.removeprefix("http://").split(":")
    opened = []  # the three at once: each is timed from its own first byte
    for payload in (b"", b"POST /generate HTTP/1.1\r\nHost: x\r\n",
                    b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n{\"input_ids\""):
        sock = socket.create_connection((host, int(port)))
        sock.sendall(payload)
        sock.settimeout(20)
        opened.append((payload, sock, time.monotonic()))
    for payload, sock, t0 in opened:
        try:
            while sock.recv(4096):
                pass
        except TimeoutError:
            pytest.fail(f"still open after 20 s: {payload[:40]!r}")
        finally:
            sock.close()
        assert 1.5 < time.monotonic() - t0 < 10, payload[:40]
    with server.client() as client:
        client.pause_generation("abort")
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("out", client.generate(
            input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 3, "ignore_eos": True})))
        t.start()
        time.sleep(3.5)  # past the read deadline, waiting for its answer
        client.continue_generation()
        t.join(30)
        assert len(box["out"][0].output_token_ids) == 3



def test_past_max_queued_requests_a_request_is_refused_503_at_once(model, make_server):
    """The waiting queue had no bound: a flood queued without limit. Now past --max-queued-requests a
    request is answered 503 at once (streamed: an error event), and the server serves on."""
    server = make_server(model, "--dtype", "float32", "--kv-cache-tokens", "16384", "--max-num-seqs", "1",
                         "--max-queued-requests", "1")
    url = server.url
    with server.client() as client:
        long = {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}
        threads = [threading.Thread(target=lambda: httpx.post(f"{url}/generate", json={
            "input_ids": [5, 6, 7], "sampling_params": long}, timeout=120)) for _ in range(2)]
        threads[0].start()  # runs (max_num_seqs=1)
        while client.get_server_info()["stats"]["num_running"] < 1:
            time.sleep(0.02)
        threads[1].start()  # waits
        while client.get_server_info()["stats"]["num_waiting"] < 1:
            time.sleep(0.02)
        t0 = time.monotonic()
        r = httpx.post(f"{url}/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 503 and "max_queued_requests=1" in r.json()["detail"]
        assert time.monotonic() - t0 < 2
        with httpx.stream("POST", f"{url}/generate", json={"input_ids": [5, 6], "stream": True,
                                                           "sampling_params": {"max_new_tokens": 2}}) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert any("waiting queue is full" in e for e in events) and events[-1] == "data: [DONE]"
        client.abort_request(abort_all=True)
        for t in threads:
            t.join(60)
        assert len(client.generate(input_ids=[[5, 6]], sampling_params={"max_new_tokens": 2})[0].output_token_ids) == 2


def test_an_incremental_stream_sends_each_token_once_and_adds_up_to_the_whole_answer(model, make_server):
    """--incremental-streaming-output (SGLang's flag): every event carries only the new ids, text and
    per-token logprobs, which concatenate to the whole answer; without it, every event is the whole
    output so far (SGLang's default, which slime parses)."""
    server = make_server(model, "--dtype", "float32", "--kv-cache-tokens", "4096", "--incremental-streaming-output")
    body = {"input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"n": 2, "max_new_tokens": 40, "temperature": 1.0, "seed": 9, "ignore_eos": True}}
    whole = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert len(events) > 2
    for sample in whole:
        mine = [e for e in events if e["meta_info"]["sample_index"] == sample["meta_info"]["sample_index"]]
        assert sum((e["output_ids"] for e in mine), []) == sample["output_ids"]
        assert "".join(e["text"] for e in mine) == sample["text"]
        lps = sum((e["meta_info"]["output_token_logprobs"] for e in mine), [])
        assert [t for _, t, _ in lps] == sample["output_ids"]
        assert [lp for lp, _, _ in lps] == pytest.approx([lp for lp, _, _ in sample["meta_info"]["output_token_logprobs"]])
        assert len(sum((e["meta_info"]["output_top_logprobs"] for e in mine), [])) == 40
        assert mine[-1]["meta_info"]["completion_tokens"] == 40  # counts stay totals


def test_a_short_soak_leaves_the_server_as_it_found_it(tmp_path):
    """``rollout bench soak`` for 5 s (the committed benchmark runs 5 minutes): generations, streams
    read fast, slowly and abandoned, clients leaving whole requests, aborts and weight flips at once;
    /health and /abort_request under a second throughout, memory and descriptors back to the warmed
    baseline, the same greedy outputs after as before."""
    from rollout.bench.soak import run

    result = run("tiny", seconds=5, workdir=str(tmp_path))
    assert result["passed"], result
    for kind in ("generate", "stream_read", "disconnect", "weight_flip", "abort_all", "health"):
        assert result["counts"].get(kind, {}).get("ok", 0) > 0, (kind, result["counts"])
    assert result["counts"]["weight_flip"]["failed"] == 0
