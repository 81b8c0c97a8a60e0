"""The command line, the throughput benchmark at a tiny size, and async streaming."""

import asyncio
import json
import os
import subprocess
import sys

from helpers import random_prompts

from rollout import RolloutEngine, SamplingParams


def run_cli(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "rollout.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_documents_flags():
    out = run_cli("generate", "--help")
    assert out.returncode == 0
    for flag in ("--model-path", "--temperature", "--top-p", "--top-k", "--min-p", "--n", "--stop",
                 "--logprob-mode", "--kv-cache-tokens", "--ignore-eos"):
        assert flag in out.stdout


def test_cli_generate_prints_logprobs(llama_path):
    out = run_cli("generate", "--model-path", llama_path, "--prompt", "Hello, world!", "--temperature", "0",
                  "--max-new-tokens", "5", "--ignore-eos", "--json", "--dtype", "float32", "--kv-cache-tokens", "256")
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(rec["output_token_ids"]) == 5 and len(rec["output_logprobs"]) == 5
    with RolloutEngine(llama_path, dtype="float32", kv_cache_tokens=256) as e:
        ref = e.generate(prompts="Hello, world!", sampling_params=SamplingParams(max_new_tokens=5, temperature=0,
                                                                                  ignore_eos=True))[0]
    assert rec["output_token_ids"] == ref.output_token_ids


def test_cli_rejects_bad_value(llama_path):
    out = run_cli("generate", "--model-path", llama_path, "--prompt", "x", "--top-p", "1.5")
    assert out.returncode != 0 and "SamplingParams.top_p" in out.stderr


def test_throughput_benchmark_writes_json_and_png(tmp_path):
    from rollout.tools.bench_throughput import main

    res = main(["--model", "tiny", "--num-prompts", "3", "--n", "2", "--max-new-tokens", "8", "--dtype", "float32",
                "--out-dir", str(tmp_path), "--workdir", str(tmp_path / "models")])
    for variant in ("eos", "ignore_eos"):
        v = res["variants"][variant]
        assert v["engine"]["tokens_per_s"] > 0 and v["hf_generate"]["tokens_per_s"] > 0
        assert v["ratio"] > 0 and v["engine"]["sampler_ms_per_step"] >= 0
    assert v["engine"]["tokens"] == v["hf_generate"]["tokens"] == 3 * 2 * 8  # ignore_eos: every token counts
    files = sorted(os.listdir(tmp_path))
    assert any(f.endswith(".json") for f in files) and any(f.endswith(".png") for f in files)


def test_async_generate_streams(llama_path):
    prompts = random_prompts(300, [6, 9], seed=20)
    sp = SamplingParams(max_new_tokens=6, temperature=0.8, seed=4, ignore_eos=True, n=2)

    async def run(engine):
        seen = {}
        async for o in await engine.async_generate(input_ids=prompts, sampling_params=sp, stream=True):
            key = (o.prompt_index, o.sample_index)
            assert len(o.output_token_ids) >= len(seen.get(key, []))
            seen[key] = o.output_token_ids
        final = await engine.async_generate(input_ids=prompts, sampling_params=sp)
        return seen, final

    with RolloutEngine(llama_path, dtype="float32", kv_cache_tokens=512) as engine:
        seen, final = asyncio.run(run(engine))
        blocking = engine.generate(input_ids=prompts, sampling_params=sp)
    assert len(seen) == 4
    assert [o.output_token_ids for o in final] == [o.output_token_ids for o in blocking]
    assert {k: v for k, v in seen.items()} == {(o.prompt_index, o.sample_index): o.output_token_ids for o in final}
