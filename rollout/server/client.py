"""``RolloutClient``: the engine's verbs over HTTP, returning the same typed results as the
in-process engine (``RolloutOutput`` lists, ``WeightResult``s)."""

from __future__ import annotations

import base64
import time
from typing import Any, Optional, Union

import httpx
import torch

from rollout.outputs import RolloutOutput, WeightResult
from rollout.sampling_params import SamplingParams
from weight_sync.layout import dtype_from_name


class RolloutServerError(RuntimeError):
    """The server refused or failed a request; ``status`` is its HTTP status."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"HTTP {status}: {detail}")
        self.status, self.detail = status, detail


def _sampling(sp) -> Union[dict, list, None]:
    if sp is None or isinstance(sp, dict):
        return sp
    if isinstance(sp, list):
        return [_sampling(x) for x in sp]
    return {k: v for k, v in vars(sp).items() if v is not None}


def _routed_experts(meta: dict, shape: Optional[list]) -> Optional[torch.Tensor]:
    """``meta_info.routed_experts`` (base64 int32) as [positions, layers, top_k]."""
    data = meta.get("routed_experts")
    if data is None:
        return None
    if not shape:
        raise ValueError("the server returned routed experts without saying their shape (routed_experts_shape)")
    flat = torch.frombuffer(bytearray(base64.b64decode(data)), dtype=torch.int32)
    return flat.reshape(-1, *shape)


def output_from_item(item: dict, prompt_ids: Optional[list[int]] = None,
                     routed_shape: Optional[list] = None) -> RolloutOutput:
    """A ``/generate`` item back into the engine's ``RolloutOutput``."""
    meta = item["meta_info"]
    finish = meta.get("finish_reason") or {}
    input_lp = meta.get("input_token_logprobs") or []
    return RolloutOutput(
        rid=meta["id"], prompt_index=meta.get("prompt_index", 0), sample_index=meta.get("sample_index", 0),
        prompt_token_ids=list(prompt_ids or []), output_token_ids=list(item["output_ids"]),
        output_logprobs=[lp for lp, _, _ in meta.get("output_token_logprobs") or []], text=item.get("text"),
        output_top_logprobs=[[(t, lp) for lp, t, _ in top] for top in meta.get("output_top_logprobs") or []],
        input_logprobs=[lp for lp, _, _ in input_lp],
        input_top_logprobs=[[(t, lp) for lp, t, _ in top] for top in meta.get("input_top_logprobs") or []],
        finish_reason=finish.get("type"), matched_stop=finish.get("matched"),
        logprob_mode=meta.get("logprob_mode", "processed"), weight_version=meta.get("weight_version", "default"),
        output_weight_versions=list(meta.get("output_weight_versions") or []),
        output_token_sampling_mask=list(meta.get("output_token_sampling_mask") or []),
        output_token_sampling_logprobs=list(meta.get("output_token_sampling_logprobs") or []),
        num_cached_tokens=meta.get("cached_tokens", 0), latency_s=meta.get("e2e_latency"),
        lora_name=meta.get("lora_name"), lora_version=meta.get("lora_version"),
        routed_experts=_routed_experts(meta, routed_shape),
        routed_experts_start_len=meta.get("routed_experts_start_len", 0))


class RolloutClient:
    """``RolloutClient("http://127.0.0.1:30000", api_key=...)``: one HTTP connection pool; the admin
    key (if the server has one) goes to the weight and control routes."""

    def __init__(self, base_url: str, api_key: Optional[str] = None, admin_api_key: Optional[str] = None,
                 timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.api_key, self.admin_api_key = api_key, admin_api_key
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout_s)
        self._server_info: Optional[dict] = None  # dtype and TP size, asked once

    def _headers(self, admin: bool) -> dict:
        key = (self.admin_api_key or self.api_key) if admin else (self.api_key or self.admin_api_key)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _post(self, path: str, body: Optional[dict] = None, admin: bool = False) -> httpx.Response:
        return self.http.post(path, json=body or {}, headers=self._headers(admin))

    def _check(self, r: httpx.Response) -> httpx.Response:
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise RolloutServerError(r.status_code, str(detail))
        return r

    def _json(self, r: httpx.Response) -> Any:
        return self._check(r).json()

    def _weight(self, path: str, body: Optional[dict] = None) -> WeightResult:
        r = self._post(path, body, admin=True)
        data = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        if "success" not in data:
            self._json(r)  # an auth or body error: raise it
        return WeightResult(bool(data["success"]), str(data.get("message", "")), data.get("weight_version"),
                            float(data.get("seconds", 0.0)), int(data.get("num_bytes", 0)), data.get("detail") or {},
                            error_kind=data.get("error_kind"))

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: Union[str, list[str], None] = None, input_ids=None,
                 sampling_params: Union[SamplingParams, dict, list, None] = None, return_logprob: bool = True,
                 top_logprobs_num: int = 0, logprob_start_len: int = -1, rid=None,
                 return_sampling_mask: Optional[bool] = None,
                 session_id: Union[str, list[Optional[str]], None] = None,
                 routing_key: Union[str, list[str], None] = None,
                 lora_path: Union[str, list[Optional[str]], None] = None,
                 return_routed_experts: bool = False) -> list[RolloutOutput]:
        """Like ``RolloutEngine.generate``: a flat, prompt-major list of ``RolloutOutput``. A session
        turn's ``prompt_token_ids`` are the tokens it appended (``session_info`` has the history).

        ``routing_key``: sent as the ``X-SMG-Routing-Key`` header, by which the field's router
        (``sglang-router`` / SMG with ``--policy manual`` or ``consistent_hashing``) sends every request
        with one key to one worker, as slime does per multi-turn session. A list (one key per prompt):
        each prompt goes as a request of its own with its key, all at once. ``lora_path``: a loaded LoRA
        adapter's name, or one per prompt (None: the base weights). ``return_routed_experts``: each output's
        ``routed_experts`` (a server started with ``--enable-return-routed-experts``)."""
        if input_ids is not None and input_ids and isinstance(input_ids[0], int):
            input_ids = [input_ids]
        if isinstance(prompts, str):
            prompts = [prompts]
        if isinstance(routing_key, list):
            return self._generate_keyed(prompts, input_ids, sampling_params, return_logprob, top_logprobs_num,
                                        logprob_start_len, rid, return_sampling_mask, session_id, routing_key,
                                        lora_path, return_routed_experts)
        sessions = session_id if isinstance(session_id, list) else None
        body = {"text": prompts, "input_ids": input_ids, "sampling_params": _sampling(sampling_params) or {},
                "return_logprob": return_logprob, "top_logprobs_num": top_logprobs_num,
                "logprob_start_len": logprob_start_len, "rid": rid, "return_sampling_mask": return_sampling_mask,
                "session_params": ([{"id": s} if s is not None else None for s in sessions] if sessions is not None
                                   else {"id": session_id} if session_id is not None else None),
                "lora_path": lora_path, "return_routed_experts": return_routed_experts or None}
        headers = self._headers(False)
        if routing_key is not None:
            headers["X-SMG-Routing-Key"] = routing_key
        r = self.http.post("/generate", json={k: v for k, v in body.items() if v is not None}, headers=headers)
        items = self._json(r)
        items = items if isinstance(items, list) else [items]
        shape = self._info().get("routed_experts_shape") if return_routed_experts else None
        return [output_from_item(it, input_ids[it["meta_info"].get("prompt_index", 0)] if input_ids else None, shape)
                for it in items]

    def _generate_keyed(self, prompts, input_ids, sampling_params, return_logprob, top_logprobs_num,
                        logprob_start_len, rid, return_sampling_mask, session_id, routing_keys: list[str],
                        lora_path=None, return_routed_experts: bool = False):
        """One request per prompt, each with its own routing key, concurrently; prompt-major outputs."""
        from concurrent.futures import ThreadPoolExecutor

        count = len(input_ids if input_ids is not None else prompts or [])
        if len(routing_keys) != count:
            raise ValueError(f"{len(routing_keys)} routing keys for {count} prompts: pass one per prompt")

        def nth(value, i):
            return value[i] if isinstance(value, list) else value

        def one(i: int) -> list[RolloutOutput]:
            outs = self.generate(prompts=[prompts[i]] if prompts is not None else None,
                                 input_ids=[input_ids[i]] if input_ids is not None else None,
                                 sampling_params=nth(sampling_params, i), return_logprob=return_logprob,
                                 top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len,
                                 rid=nth(rid, i), return_sampling_mask=return_sampling_mask,
                                 session_id=nth(session_id, i), routing_key=routing_keys[i],
                                 lora_path=nth(lora_path, i), return_routed_experts=return_routed_experts)
            for o in outs:
                o.prompt_index = i
            return outs

        with ThreadPoolExecutor(min(count, 32)) as pool:
            return [o for outs in pool.map(one, range(count)) for o in outs]

    # ------------------------------------------------------------------ sessions

    def open_session(self, session_id: Optional[str] = None, timeout_s: Optional[float] = None) -> str:
        body = {k: v for k, v in {"session_id": session_id, "timeout_s": timeout_s}.items() if v is not None}
        return self._json(self._post("/open_session", body))

    def close_session(self, session_id: str) -> None:
        self._check(self._post("/close_session", {"session_id": session_id}))

    def session_info(self, session_id: str) -> dict:
        return self._json(self.http.get("/session_info", params={"session_id": session_id},
                                        headers=self._headers(False)))

    # ------------------------------------------------------------------ weights

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> WeightResult:
        """SGLang's ``/load_lora_adapter``: a PEFT folder on the server's host (under its allowed dirs)."""
        return self._weight("/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path, "pinned": pinned})

    def load_lora_adapter_from_tensors(self, lora_name: str, handle: dict, config_dict: dict,
                                       pinned: bool = False) -> WeightResult:
        """``handle``: a same-host bucket (``weight_sync.SharedMemoryBucket().write(named)``) of peft's tensors."""
        return self._weight("/load_lora_adapter_from_tensors", {"lora_name": lora_name, "config_dict": config_dict,
                                                                "serialized_tensors": handle, "pinned": pinned})

    def load_lora_adapter_from_distributed(self, lora_name: str, config_dict: dict, names: list[str],
                                           dtypes: list[str], shapes: list[list[int]], group_name: str,
                                           load_format: Optional[str] = None, bucket_bytes: Optional[int] = None,
                                           pinned: bool = False, weight_version: Optional[str] = None
                                           ) -> WeightResult:
        """miles' ``/load_lora_adapter_from_distributed``: the tensors follow as broadcasts over the group
        (run beside the broadcasts: the server answers once they have arrived)."""
        return self._weight("/load_lora_adapter_from_distributed", {
            "lora_name": lora_name, "config_dict": config_dict, "names": names, "dtypes": dtypes, "shapes": shapes,
            "group_name": group_name, "load_format": load_format, "bucket_bytes": bucket_bytes, "pinned": pinned,
            "weight_version": weight_version})

    def unload_lora_adapter(self, lora_name: str) -> WeightResult:
        return self._weight("/unload_lora_adapter", {"lora_name": lora_name})

    def update_weights_from_disk(self, model_path: str, **kw) -> WeightResult:
        return self._weight("/update_weights_from_disk", {"model_path": model_path, **kw})

    def update_weights_from_delta_distributed(self, header: dict, names: list[str], dtypes: list[str],
                                              shapes: list, group_name: str, **kw) -> WeightResult:
        """A delta whose tensors the trainer broadcasts over the weight-update group (``weight_sync.delta``)."""
        return self._weight("/update_weights_from_delta_distributed",
                            {"header": header, "names": names, "dtypes": dtypes, "shapes": [list(s) for s in shapes],
                             "group_name": group_name, **kw})

    def update_weights_from_delta(self, path: str, **kw) -> WeightResult:
        """A delta patch folder on the server's filesystem (``weight_sync.delta.save_patch``)."""
        return self._weight("/update_weights_from_delta", {"path": path, **kw})

    def update_weights_from_tensor(self, handle: dict, **kw) -> WeightResult:
        """A same-host bucket handle (``SharedMemoryBucket.write`` / ``CudaIpcBucket.write``)."""
        return self._weight("/update_weights_from_tensor", {"serialized_named_tensors": handle, **kw})

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: Optional[str] = None,
                                  timeout_s: float = 60.0) -> WeightResult:
        return self._weight("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend, "timeout_s": timeout_s})

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", **kw) -> WeightResult:
        return self._weight("/update_weights_from_distributed", {"names": names, "dtypes": dtypes, "shapes": shapes,
                                                                 "group_name": group_name, **kw})

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> WeightResult:
        return self._weight("/destroy_weights_update_group", {"group_name": group_name})

    def begin_weight_update(self, weight_version: Optional[str] = None) -> WeightResult:
        return self._weight("/begin_weight_update", {"weight_version": weight_version})

    def commit_weight_update(self, **kw) -> WeightResult:
        return self._weight("/commit_weight_update", kw)

    def abort_weight_update(self) -> WeightResult:
        return self._weight("/abort_weight_update")

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        return self._json(self._post("/get_weights_by_name", {"name": name, "truncate_size": truncate_size},
                                     admin=True))

    def get_weight_version(self) -> str:
        return self._json(self.http.get("/get_weight_version", headers=self._headers(False)))["weight_version"]

    def update_weight_version(self, weight_version: str) -> None:
        self._json(self._post("/update_weight_version", {"new_version": weight_version}, admin=True))

    # ------------------------------------------------------------------ control

    def flush_cache(self) -> bool:
        """True once flushed; False while requests run or wait (the server's 400, as SGLang's)."""
        r = self._post("/flush_cache", admin=True)
        if r.status_code == 400:
            return False
        self._check(r)
        return True

    def pause_generation(self, mode: str = "abort") -> None:
        self._json(self._post("/pause_generation", {"mode": mode}, admin=True))

    def continue_generation(self) -> None:
        self._json(self._post("/continue_generation", admin=True))

    def abort_request(self, rid: Optional[str] = None, abort_all: bool = False, prefix: bool = False) -> None:
        self._check(self._post("/abort_request", {"rid": rid, "abort_all": abort_all, "prefix": prefix}, admin=True))

    def release_memory_occupation(self, tags: Optional[list[str]] = None, backup_weights: bool = False) -> WeightResult:
        return self._weight("/release_memory_occupation", {"tags": tags, "backup_weights": backup_weights})

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> WeightResult:
        return self._weight("/resume_memory_occupation", {"tags": tags})

    # ------------------------------------------------------------------ ops

    @property
    def dtype(self) -> torch.dtype:
        """The server's weights' dtype (asked once)."""
        return dtype_from_name(self._info()["dtype"])

    @property
    def tp_size(self) -> int:
        """1: each trainer rank drives a server on its own, whatever the server's TP size
        (``group_ranks`` is that)."""
        return 1

    @property
    def group_ranks(self) -> int:
        """The server's ranks that join a weight-update group (its engine's TP size)."""
        return int(self._info()["tp_size"])

    @property
    def address(self) -> str:
        return self.base_url

    def _info(self) -> dict:
        if self._server_info is None:
            self._server_info = self.get_server_info()
        return self._server_info

    def serving_replicas(self) -> int:
        return 1

    def take_replica_failures(self) -> list[str]:
        return []

    def health(self) -> bool:
        try:
            return self.http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.health():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no healthy server at {self.base_url} within {timeout_s}s")
            time.sleep(0.2)

    def get_server_info(self) -> dict:
        return self._json(self.http.get("/get_server_info", headers=self._headers(False)))

    def get_model_info(self) -> dict:
        return self._json(self.http.get("/get_model_info", headers=self._headers(False)))

    def metrics(self) -> str:
        r = self.http.get("/metrics", headers=self._headers(False))
        if r.status_code >= 400:
            self._json(r)
        return r.text

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
