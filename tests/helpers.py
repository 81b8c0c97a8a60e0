"""Reference computations with Hugging Face ``transformers`` (fp32, one unpadded prompt at a time), and
what server tests check after a client left."""

from __future__ import annotations

import functools
import random
import socket

import torch

MIN_MARGIN = 0.01  # a greedy step whose top-1/top-2 logit gap is below this is decided by rounding


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    """Raw logits [len(ids), vocab] of one unpadded sequence."""
    return hf_model(path)(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(path: str, prompt: list[int], max_new_tokens: int, processor=None) -> tuple[list[int], float]:
    """Greedy tokens by full forwards (no cache), and the smallest top-1/top-2 margin seen.

    processor(logits [V], generated ids) -> processed logits, applied before the argmax.
    """
    ids = list(prompt)
    margin = float("inf")
    for _ in range(max_new_tokens):
        logits = hf_logits(path, ids)[-1]
        if processor is not None:
            logits = processor(logits, ids)
        top2 = logits.topk(2).values
        margin = min(margin, float(top2[0] - top2[1]))
        ids.append(int(logits.argmax()))
    return ids[len(prompt):], margin


def output_ref_logprobs(path: str, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    logits = hf_logits(path, prompt + output)
    lp = torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(output)] / temperature, dim=-1)
    return [float(lp[i, t]) for i, t in enumerate(output)]


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0, low: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab_size, (n,), generator=g).tolist() for n in lengths]


def assert_left_request_was_aborted(client, before: dict, wanted: int, timeout_s: float = 20.0) -> None:
    """After a client left a request for ``wanted`` tokens: the server runs nothing within ``timeout_s``,
    every block is free, and it decoded far fewer tokens than asked (so it did not just finish).
    ``before``: the server's stats from before the request."""
    import time

    deadline = time.monotonic() + timeout_s
    while client.get_server_info()["stats"]["num_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = client.get_server_info()["stats"]
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    decoded = stats["num_decode_tokens"] - before["num_decode_tokens"]
    assert decoded < wanted // 2, f"{decoded} of {wanted} tokens decoded: the disconnect aborted nothing"



def warning_lines(text: str) -> list[str]:
    """The lines of a run's output that Python's warnings module printed (``...Warning: ...``)."""
    import re

    return [line for line in text.splitlines() if re.search(r"\b[A-Z]\w*Warning: ", line)]


def env_showing_warnings(**extra: str) -> dict:
    """This process's environment with Python's default warning filters (no ``PYTHONWARNINGS``)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    return {**env, **extra}


@functools.lru_cache(maxsize=8)
def hf_lora_model(path: str, adapter: str):
    """``transformers`` + ``peft``: the base model at ``path`` with the adapter folder ``adapter`` (fp32)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rollout.weights.lora import peft_quietly

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with peft_quietly():
        return PeftModel.from_pretrained(base, adapter).eval()


@torch.no_grad()
def hf_lora_greedy(path: str, adapter: str, prompt: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    """``hf_greedy`` through ``peft`` with ``adapter``: greedy tokens and the smallest top-1/top-2 margin."""
    model = hf_lora_model(path, adapter)
    ids = list(prompt)
    margin = float("inf")
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        top2 = logits.topk(2).values
        margin = min(margin, float(top2[0] - top2[1]))
        ids.append(int(logits.argmax()))
    return ids[len(prompt):], margin


@torch.no_grad()
def hf_lora_logprobs(path: str, adapter: str, prompt: list[int], output: list[int]) -> list[float]:
    logits = hf_lora_model(path, adapter)(input_ids=torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(output)], dim=-1)
    return [float(lp[i, t]) for i, t in enumerate(output)]


def restartable_port(avoid=()) -> int:
    """A free loopback port outside the kernel's ephemeral range, for a server a test kills and starts
    again at the same address: in between, an outgoing connection (a weight group's rendezvous) may be
    given any free ephemeral port as its own, and a server restarted there fails with EADDRINUSE."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, max(10001, low))
        if port in avoid:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port below the ephemeral range")


def wildcard_listeners() -> list[str]:
    """Every TCP socket this process or any process it started listens on at a wildcard address
    (0.0.0.0 or ::), as "pid name address:port". Nothing of ours ever should."""
    import ipaddress

    import psutil

    me = psutil.Process()
    found = []
    for proc in [me] + me.children(recursive=True):
        try:
            conns = proc.net_connections(kind="tcp")
            name = proc.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN and c.laddr and ipaddress.ip_address(c.laddr.ip).is_unspecified:
                found.append(f"{proc.pid} {name} {c.laddr.ip}:{c.laddr.port}")
    return found


def learns_after_its_control_arm(logs: list[dict], control_steps: int, spread: float = 0.2,
                                 rise: float = 0.3) -> tuple[list[dict], list[dict]]:
    """A run whose first ``control_steps`` rollouts ran on the initial weights (``--control-steps``): their
    rewards flat (within ``spread``), each step's samples one version older, nothing pushed before the arm's
    last step; then a rise of ``rise`` over the arm's mean by the mean of the last five steps. Returns the
    arm's logs and the pushed steps' logs."""
    control, pushed = logs[:control_steps], logs[control_steps:]
    flat = [x["reward"] for x in control]
    rewards = [x["reward"] for x in pushed]
    assert max(flat) - min(flat) < spread, flat
    assert sum(rewards[-5:]) / 5 >= sum(flat) / control_steps + rise, (flat, rewards)
    assert [x["max_sample_staleness"] for x in control] == list(range(control_steps))
    assert all(x["sync_phases"] == {} for x in control[:-1])
    assert all(x["max_sample_staleness"] == 0 for x in pushed)
    return control, pushed


def near_tied_moe(path: str, eps: float = 1e-6, seed: int = 3, tokenizer=None) -> str:
    """A tiny Qwen3-MoE (8 experts, top-3, distinct experts) whose router rows come in pairs equal to within
    ``eps`` (relative): where a token's k-th choice falls in a pair, fp32's rounding decides it, so two correct
    implementations route it differently (~5% of token-layers at 1e-6) — what routing replay is for.
    ``tokenizer``: one to ship (a chat template's, ``build_chat_tokenizer``) instead of the embedded one."""
    import os

    from safetensors.torch import load_file, save_file

    from rollout.tools.tiny import make_tiny_model

    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    make_tiny_model(path, "qwen3_moe", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=2, seed=seed, embed_std=0.05, head_std=0.05, num_experts=8, num_experts_per_tok=3,
                    moe_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                    expert_std=0.3, tokenizer=tokenizer)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, w in tensors.items():
        if name.endswith("mlp.gate.weight"):
            w[1::2] = w[0::2] * (1 + eps * torch.randn(w[0::2].shape, generator=g))
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path
