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
    from rollout.bench.throughput import main

    common = ["--model", "tiny", "--num-prompts", "3", "--n", "2", "--max-new-tokens", "8", "--dtype", "float32",
              "--out-dir", str(tmp_path), "--workdir", str(tmp_path / "models")]
    res = main(common + ["--ignore-eos"])
    assert res["engine"]["tokens"] == res["hf"]["tokens"] == 3 * 2 * 8  # ignore_eos: every token counts
    assert res["ratio"] > 0 and res["engine"]["decode_step_ms"] > 0 and res["config"]["features"]["prefix"]
    assert "torch" in res["machine"]["versions"] and res["machine"]["cpu_count"] >= 1
    score = main(common + ["--workload", "score", "--prefix", "off"])
    assert score["engine"]["tokens"] == score["hf"]["tokens"] == 3 * 2 * 8
    agentic = main(["--model", "tiny", "--num-prompts", "2", "--max-new-tokens", "4", "--dtype", "float32",
                    "--out-dir", str(tmp_path), "--workdir", str(tmp_path / "models"), "--workload", "agentic"])
    e = agentic["engine"]
    assert e["same_tokens"] is True and e["tokens"] == 2 * 6 * 4  # sessions give what resending gives
    assert e["sessions"]["prefill_tokens"] < e["resend"]["prefill_tokens"]  # only what each turn appends
    files = sorted(os.listdir(tmp_path))
    assert sum(f.endswith(".json") for f in files) == 3 and sum(f.endswith(".png") for f in files) == 3


def test_limits_and_rl_step_benchmarks_and_compare(tmp_path):
    """``rollout bench limits`` and ``rl-step`` through the command's dispatch (in this process: the command
line itself is ``--compare``'s and the other tests'), then ``--compare``."""
    from rollout.cli import main as cli_main

    common = ["--model", "tiny", "--dtype", "float32", "--out-dir", str(tmp_path), "--workdir", str(tmp_path / "m")]
    assert cli_main(["bench", "limits", *common, "--batches", "1,4", "--steps", "3", "--repeats", "1"]) == 0
    res = json.load(open(tmp_path / "limits_tiny_float32_tp1.json"))
    for b in ("1", "4"):
        e = res["engine"][b]
        assert e["num_steps"] >= 2 and e["mean_batch"] == int(b) and e["step_s"] >= e["forward_s"] > 0
        assert res["gemm"][b]["gemm_step_s"] > 0 and res["ratios"][b]["step_over_gemm_step"] > 0
    assert res["memory"]["read_gb_s"] > 0 and res["weight_read_s"] > 0
    assert cli_main(["bench", "rl-step", *common, "--steps", "2", "--num-prompts", "2", "--n", "2",
                     "--max-new-tokens", "4"]) == 0
    rl = json.load(open(tmp_path / "rl_step_grpo-short_tiny_float32_tp1_overlap-off.json"))
    assert len(rl["steps"]) == 2 and all(s["samples"] == 4 and s["sync_s"] > 0 for s in rl["steps"])
    assert os.path.isfile(tmp_path / "rl_step_grpo-short_tiny_float32_tp1_overlap-off.png")
    assert cli_main(["bench", "rl-step", *common, "--steps", "2", "--num-prompts", "2", "--n", "2",
                     "--max-new-tokens", "8", "--speculative", "on"]) == 0
    spec = json.load(open(tmp_path / "rl_step_grpo-short_tiny_float32_tp1_overlap-off_spec-on.json"))
    assert spec["config"]["features"]["speculative"] and all("tokens_per_verify" in s for s in spec["steps"])
    a = tmp_path / "limits_tiny_float32_tp1.json"
    b = tmp_path / "b.json"
    changed = json.load(open(a))
    changed["gemm"]["1"]["gemm_step_s"] *= 2
    json.dump(changed, open(b, "w"))
    out = run_cli("bench", "--compare", str(a), str(b))
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("gemm.1.gemm_step_s"))
    assert line.split()[-1] == "2.000"


def test_fidelity_and_server_load_benchmarks_through_the_cli(tmp_path):
    """``rollout bench fidelity`` and ``server-load`` (once scripts under ``benchmarks/``) at a tiny size;
    fidelity in this process through the command's dispatch, server-load through the command line."""
    from rollout.cli import main as cli_main

    common = ["--model", "tiny", "--dtype", "float32", "--out-dir", str(tmp_path), "--workdir", str(tmp_path / "m")]
    assert cli_main(["bench", "fidelity", *common, "--num-prompts", "1", "--mode-max-new-tokens", "2", "--rounds", "1",
                     "--prompts", "1", "--n", "1", "--max-new-tokens", "3"]) == 0
    fid = json.load(open(tmp_path / "fidelity_tiny_float32.json"))
    assert fid["masks"]["masks_on"] > 0 and fid["masks"]["masks_mean_size"] >= 1
    assert fid["throughput_fraction"] > 0 and fid["workload"]["name"] == "grpo-short" and fid["machine"]["cpu"]
    assert fid["deterministic"]["tokens"] > 0 and os.path.isfile(tmp_path / "fidelity_tiny_float32.png")
    out = run_cli("bench", "server-load", *common, "--requests", "4", "--max-new-tokens", "4",
                  "--refresh-every-s", "0.5", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    load = json.load(open(tmp_path / "server_load_tiny_float32.json"))
    assert load["server"]["tokens_per_s"] > 0 and load["in_process"]["tokens_per_s"] > 0
    assert load["server_with_refreshes"]["errors"] == [] and os.path.isfile(tmp_path / "server_load_tiny_float32.png")
    assert load["router"]["kind"] == "sglang-router" and load["router"]["tokens_per_s"] > 0  # the test extra has it
    assert load["router_fraction_of_server_tokens_per_s"] > 0 and load["machine"]["cpu"]


def test_the_trainer_side_benchmarks_through_the_cli(tmp_path):
    """``rollout bench push-floor`` (it starts its own trainer ranks) at a tiny size: it writes its JSON and PNG,
    the pushes verified against what the engines hold. (``rl-modes``: test_disaggregated's asynchronous run.)"""
    out = run_cli("bench", "push-floor", "--model", "tiny", "--trainer-ranks", "1", "--repeats", "1", "--bucket-mb", "1",
                  "--out-dir", str(tmp_path), timeout=400)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    res = json.load(open(tmp_path / "push_floor_tiny_1mb.json"))
    assert set(res["push"]) == {"colocated", "disaggregated"} and res["config"]["world_size"] == 1
    assert all(r["num_buckets"] >= 1 and r["total_s"] > 0 for runs in res["push"].values() for r in runs)
    assert res["summary"]["bare_bucketed_s"] > 0 and os.path.isfile(tmp_path / "push_floor_tiny_1mb.png")


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
