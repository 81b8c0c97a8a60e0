"""Run under torchrun: every rank hosts one TP worker of the same engine (external launch)."""

import json
import os
import sys

import torch
import torch.distributed as dist

from rollout import RolloutEngine, SamplingParams


def main(model_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    threads_before = len(os.listdir("/proc/self/task"))
    prompts = json.loads(sys.argv[3])
    with RolloutEngine(model_path, dtype="float32", kv_cache_tokens=512, tp_size=2, tp_timeout_s=60) as engine:
        assert engine.is_follower == (dist.get_rank() == 1)
        greedy = engine.generate(input_ids=prompts, sampling_params=SamplingParams(
            max_new_tokens=8, temperature=0, ignore_eos=True))
        sampled = engine.generate(input_ids=prompts, sampling_params=SamplingParams(
            max_new_tokens=8, temperature=0.8, seed=3, n=2, ignore_eos=True))
        rejected = False
        try:  # a bad request fails on every rank alike, and the engine keeps serving
            engine.generate(input_ids=[[1] * 100000], sampling_params=SamplingParams())
        except ValueError:
            rejected = True
        again = engine.generate(input_ids=prompts[:1], sampling_params=SamplingParams(
            max_new_tokens=4, temperature=0, ignore_eos=True))
        update = {}
        if len(sys.argv) > 4:  # colocated-style updates: every rank passes the tensors it holds
            from safetensors.torch import load_file

            tensors = list(load_file(sys.argv[4] + "/model.safetensors").items())
            ok = engine.update_weights_from_tensor(tensors, weight_version="b")
            checksum = engine.get_weights_checksum()
            if dist.get_rank() == 1:  # only this rank's part is bad: the vote must discard it everywhere
                tensors = [(n, t * float("nan") if n.endswith("q_proj.weight") else t) for n, t in tensors]
            bad = engine.update_weights_from_tensor(tensors, weight_version="bad")
            update = {"ok": ok.success, "bad": bad.success, "bad_message": bad.message,
                      "version": engine.get_weight_version(), "checksum_kept": engine.get_weights_checksum() == checksum,
                      "after": engine.generate(input_ids=prompts, sampling_params=SamplingParams(
                          max_new_tokens=8, temperature=0, ignore_eos=True))[0].output_token_ids}
    # the engine's shutdown joined its groups' threads (not left to interpreter teardown, where they abort)
    threads_after = len(os.listdir("/proc/self/task"))
    record = {"rank": dist.get_rank(), "threads": [threads_before, threads_after],
              "greedy": [o.output_token_ids for o in greedy],
              "sampled": [o.output_token_ids for o in sampled], "logprobs": [o.output_logprobs for o in greedy],
              "again": again[0].output_token_ids, "update": update, "rejected": rejected}
    with open(f"{out_path}.{dist.get_rank()}", "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
