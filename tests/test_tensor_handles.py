"""The RL frameworks' colocated pushes as they send them: base64 of torch's ``ForkingPickler`` over tensors
of a live trainer process (``tests/handle_sender.py``: CPU shared-memory handles, SGLang's wrapper classes
under their module names), read by ``weight_sync.handles`` — an allowlist that runs nothing — over a real
server socket. veRL's wake-and-sync, slime's colocated bracket and miles' selector form each end with the
pushed weights serving (greedy equal to the model loaded from disk) and the caller's version; every hostile
payload is a 400 that runs nothing (a sentinel file never appears) and leaves the weights as they were."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import torch

from weight_sync.handles import HandleError, named_tensors, read_handles

KEY = "handles-key"
PROMPTS = [[5, 9, 23, 41, 7], [44, 45, 46, 47, 12, 3]]
SENDER = os.path.join(os.path.dirname(__file__), "handle_sender.py")


class Sender:
    """A live trainer process that answers each command with a payload."""

    def __init__(self, model: str):
        self.proc = subprocess.Popen([sys.executable, SENDER, model], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def __call__(self, kind: str, **kw) -> str:
        self.proc.stdin.write(json.dumps({"kind": kind, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the sender ended (code {self.proc.poll()})"
        return json.loads(line)["payload"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"kind": "exit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(30)


@pytest.fixture(scope="module")
def srv(compat_srv):
    return compat_srv


@pytest.fixture(scope="module")
def sender(compat_model_b):
    s = Sender(compat_model_b)
    yield s
    s.close()


def _ok(r):
    assert r.status_code == 200, (r.request.url, r.status_code, r.text[:400])
    return r


def _greedy(http):
    body = {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    return [o["output_ids"] for o in _ok(http.post("/generate", json=body)).json()]


def _model_b_greedy(http, compat_model, compat_model_b):
    """Model B's tokens as a load from disk gives them, the server then back on the base model."""
    _ok(http.post("/update_weights_from_disk", json={"model_path": compat_model_b}))
    want = _greedy(http)
    _ok(http.post("/update_weights_from_disk", json={"model_path": compat_model, "weight_version": "default"}))
    return want


def _push(http, payload, **body):
    return http.post("/update_weights_from_tensor", json={"serialized_named_tensors": [payload], **body})


def test_verl_wake_and_sync(srv, sender, compat_model, compat_model_b):
    """veRL's main loop: release, resume the weights, one /update_weights_from_tensor per bucket of
    ``[(name, LocalSerializedTensor(values=[one nested payload per TP rank]))]`` (load_format null,
    flush_cache true), GET /flush_cache, resume the KV cache."""
    want = _model_b_greedy(srv, compat_model, compat_model_b)
    base = _greedy(srv)
    _ok(srv.post("/release_memory_occupation", json={"tags": ["kv_cache", "weights"]}))
    _ok(srv.post("/resume_memory_occupation", json={"tags": ["weights"]}))
    for i in range(3):
        r = _ok(_push(srv, sender("verl", bucket=i, tp=2), load_format=None, flush_cache=True))
        assert r.json()["success"] is True
    _ok(srv.get("/flush_cache"))
    _ok(srv.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}))
    assert _greedy(srv) == want != base
    _ok(srv.post("/update_weights_from_disk", json={"model_path": compat_model, "weight_version": "default"}))


def test_slime_colocated_bracket_stages_copies(srv, sender, compat_model, compat_model_b):
    """slime: pause {}, GET /flush_cache, per bucket {"serialized_named_tensors": [...], "load_format":
    "flattened_bucket", "flush_cache": false, "weight_version": "3"} — every bucket in the trainer's one reused
    buffer, which it then scribbles over — continue {}: staged copies, published together under "3"."""
    want = _model_b_greedy(srv, compat_model, compat_model_b)
    _ok(srv.post("/pause_generation", json={}))
    _ok(srv.get("/flush_cache"))
    for i in range(3):
        r = _ok(_push(srv, sender("flat", bucket=i), load_format="flattened_bucket", flush_cache=False,
                      weight_version="3"))
        assert r.json()["success"] is True
    sender("scribble")  # the buffer the handles named now holds NaN
    r = _ok(srv.post("/continue_generation", json={}))
    assert r.json()["weight_version"] == "3"
    assert _greedy(srv) == want and srv.get("/get_weight_version").json()["weight_version"] == "3"
    _ok(srv.post("/update_weights_from_disk", json={"model_path": compat_model, "weight_version": "default"}))


def test_miles_selector_form_inside_its_bracket(srv, sender, compat_model, compat_model_b):
    """miles: pause {"mode": "retract"}, /begin_weight_update {"selector": "all"}, bucket calls with
    "selector": "all", /end_weight_update, continue."""
    want = _model_b_greedy(srv, compat_model, compat_model_b)
    _ok(srv.post("/pause_generation", json={"mode": "retract"}))
    _ok(srv.post("/begin_weight_update", json={"selector": "all"}))
    for i in range(3):
        _ok(_push(srv, sender("flat", bucket=i), load_format="flattened_bucket", flush_cache=False, selector="all",
                  weight_version="7"))
    sender("scribble")
    r = _ok(srv.post("/end_weight_update", json={}))
    assert r.json()["success"] is True and r.json()["weight_version"] == "7"
    _ok(srv.post("/continue_generation", json={}))
    assert _greedy(srv) == want
    _ok(srv.post("/update_weights_from_disk", json={"model_path": compat_model, "weight_version": "default"}))


@pytest.mark.parametrize("kind, says", [
    ("os_system", "posix.system"), ("global", "builtins.eval"), ("nested", "posix.system"),
    ("wrong_size", "fewer than"), ("truncated", "malformed"),
])
def test_hostile_payloads_are_refused_and_run_nothing(srv, sender, tmp_path, kind, says):
    sentinel = tmp_path / "ran"
    before = _greedy(srv)
    r = _push(srv, sender(kind, path=str(sentinel)))
    assert r.status_code == 400 and says in r.text, r.text[:400]
    assert not sentinel.exists()
    assert _greedy(srv) == before


def test_a_handle_from_a_process_that_ended_is_refused(srv, compat_model_b):
    gone = Sender(compat_model_b)
    payload = gone("flat", bucket=0)
    name = read_handles(payload)["flattened_tensor"].storage.storage.name.decode()
    gone.close()
    deadline = time.monotonic() + 20
    while os.path.exists("/dev/shm" + name) and time.monotonic() < deadline:
        time.sleep(0.1)
    r = _push(srv, payload)
    assert r.status_code == 400 and "does not exist" in r.text, r.text[:400]


def test_the_reader_admits_only_tensor_rebuilds(sender, tmp_path):
    """Without a server: the specs are inert data; the frameworks' layouts give named tensors viewing the
    sender's memory; a refused payload raises before anything is built."""
    spec = read_handles(sender("flat", bucket=1))
    assert set(spec) == {"flattened_tensor", "metadata"}
    named = named_tensors(sender("verl", bucket=1, tp=2), tp_rank=1)
    assert named and all(t.device.type == "cpu" for _, t in named)
    with pytest.raises(HandleError, match="posix.system"):
        read_handles(sender("os_system", path=str(tmp_path / "x")))
    assert not (tmp_path / "x").exists()
    with pytest.raises(HandleError, match="base64"):
        read_handles("not base64!")
    # a handle naming another socket than torch's shm manager, or memory past its storage: refused unmapped
    from weight_sync.handles import ShmStorage, TensorSpec, TypedStorage, materialize

    other = TensorSpec(TypedStorage(ShmStorage(b"/run/other.sock", b"/torch_1_2_3", 16), torch.float32), 0, (4,), (1,))
    with pytest.raises(HandleError, match="shm manager"):
        materialize(other)
    past = TensorSpec(TypedStorage(ShmStorage(b"/tmp/torch-shm-dir-x/manager.sock", b"/torch_1_2_3", 16),
                                   torch.float32), 2, (4,), (1,))
    with pytest.raises(HandleError, match="reaches past"):
        materialize(past)


def test_the_reader_can_be_turned_off(compat_model, make_server, sender):
    server = make_server(compat_model, "--dtype", "float32", "--kv-cache-tokens", "512", "--no-tensor-handles")
    r = httpx.post(server.url + "/update_weights_from_tensor", timeout=60,
                   json={"serialized_named_tensors": [sender("flat", bucket=0)]})
    assert r.status_code == 400 and "SharedMemoryBucket" in r.text


def test_each_tp_rank_reads_its_own_entry(make_engine, sender, compat_model, compat_model_b):
    """A TP=2 engine given one payload per rank: each rank opens the handle and reads its own entry (a bad
    second entry fails the update on rank 1, all or nothing); good entries on both land model B."""
    from safetensors.torch import load_file

    from weight_sync import checksum_named_tensors
    from weight_sync.handles import handle

    engine = make_engine(compat_model, tp_size=2, kv_cache_tokens=512)
    before = engine.get_weights_checksum()
    good = sender("flat", bucket=0)
    bad = engine.update_weights_from_tensor(handle([good, sender("truncated")]), partial=True)
    assert not bad.success and "TP rank 1" in bad.message and "malformed" in bad.message, bad.message
    assert engine.get_weights_checksum() == before
    for i in range(3):
        payload = sender("verl", bucket=i, tp=2)
        assert engine.update_weights_from_tensor(handle([payload, payload]), partial=True).success
    tensors = [(n, t.float()) for n, t in load_file(f"{compat_model_b}/model.safetensors").items()]
    assert engine.get_weights_checksum() == checksum_named_tensors(tensors, torch.float32)
