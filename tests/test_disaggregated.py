"""Disaggregated GRPO: one DeepSpeed trainer process drives two rollout servers (replicas in their
own processes), routing prompts by load and broadcasting each step's weights once over one
weight-update group both replicas join."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import env_showing_warnings, learns_after_its_control_arm, restartable_port, warning_lines

from trainer_bridge.targets import WeightTarget

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(tmp_path, *extra, steps: int, replicas: int = 2, show_warnings: bool = False,
                dist_check: bool = False):
    """The disaggregated example's run; with ``show_warnings`` under Python's default warning filters
    (as the README's command runs it), failing on any warning line in its output; ``dist_check``: with the
    full-distribution check (off where not asserted)."""
    from weight_sync.process_group import free_port

    out = tmp_path / "run"
    env = env_showing_warnings(WANDB_MODE="offline") if show_warnings else \
        {**os.environ, "PYTHONWARNINGS": "ignore", "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
                           str(free_port()), os.path.join(ROOT, "examples", "grpo_disaggregated.py"), "--replicas",
                           str(replicas), "--steps", str(steps), "--out-dir", str(out), "--no-wandb",
                           *(() if dist_check else ("--dist-check-samples", "0")), *extra],
                          capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    if show_warnings:
        assert warning_lines(proc.stdout + proc.stderr) == []
    return json.load(open(out / "steps.json")), proc.stdout


CONTROL = 6  # the control arm of the learning run: steps whose rollouts run on the initial weights
PUSHED = 16  # its pushed steps (last five's mean 0.93 against the arm's 0.51 on an Intel Xeon; 0.3 asserted)


def test_disaggregated_grpo_learns_from_its_pushes_and_both_replicas_serve_each(tmp_path):
    """One run, two arms: the rollouts of the first steps run on the initial weights while the trainer trains
    (the control: nothing pushed, rewards flat, every replica serving the initial weights at every step),
    then each step's weights are broadcast once to both replicas — after the first push only the changed
    elements (``--delta-sync``) —, read back equal, and the run learns (staleness 0); no warning lines. In bf16
    with ``--true-on-policy`` (a delta that left any bit wrong would show): both servers run the batch-invariant
    mode (SGLang's ``--enable-deterministic-inference``) and the trainer recomputes their logprobs bit for bit
    on every token of every pushed step, whichever replica sampled it, and the whole next-token
    distribution at the probed positions too (fp32 runs: the LoRA and asynchronous tests below)."""
    logs, stdout = run_example(tmp_path, "--control-steps", str(CONTROL), "--dtype", "bfloat16", "--true-on-policy",
                               "--delta-sync", steps=CONTROL + PUSHED, show_warnings=True, dist_check=True)
    control, pushed = learns_after_its_control_arm(logs, CONTROL)
    assert all(x["sync_phases"]["delta"] for x in pushed[1:]), [x["sync_phases"].get("delta") for x in pushed]
    assert all(x["push_verified"] is None for x in control[:-1])
    assert all(x["mismatch_max"] == 0.0 and x["ratio_mean"] == 1.0 for x in pushed)
    assert all(x["dist_positions"] > 0 and x["dist_max_abs_diff"] == 0.0 for x in pushed)
    assert all(x["push_verified"] for x in logs[CONTROL - 1:])  # read back from every replica, equal to the trainer's
    assert f"rollout service: ReplicaRouter; replica versions: ['step-{CONTROL + PUSHED}', 'step-{CONTROL + PUSHED}']" \
        in stdout


def test_disaggregated_lora_grpo_on_a_mixture_of_experts_pushes_only_the_adapter_and_replays_routing(tmp_path):
    """``--lora 8 --model tiny-moe --routing-replay``: each step broadcasts the adapter's tensors (the attention's
    linears: "all-linear" on a mixture of experts) once over the weight group both replicas joined
    (``/load_lora_adapter_from_distributed``); both serve each version and return each token's experts over HTTP,
    the trainer replays them on every position, and the fp32 logprobs equal the trainer's on every token of every
    step (a wrong or stale adapter would not). That a LoRA run learns from its pushes is the colocated test's
    (test_trainer_bridge); that replay is what keeps near-tied routers exact, test_moe's."""
    logs, stdout = run_example(tmp_path, "--lora", "8", "--model", "tiny-moe", "--routing-replay", steps=4,
                               show_warnings=True)
    assert all(x["mismatch_max"] < 1e-4 for x in logs)
    # every position but each sequence's last: 8 prompts x 8 samples of (prompt + 6 new tokens - 1)
    assert all(x["replayed_tokens"] >= 64 * 6 for x in logs), [x["replayed_tokens"] for x in logs]
    assert all(0 < x["sync_phases"]["adapter_bytes"] < 4e6 for x in logs)  # the adapter alone, fp32
    assert "rollout service: ReplicaRouter; replica versions: ['step-4', 'step-4']" in stdout


def test_asynchronous_rollouts_with_staleness_one_still_learn_from_one_bare_server(tmp_path):
    """The rollout of step k+1 runs while step k trains: every token is exactly one version behind the
    trainer (never more), and the run still learns. One replica: the loop drives its ``RolloutClient``
    directly (no router), through the same ``RolloutService`` seam. Run through ``rollout bench rl-modes``
    (its ``async1`` mode is this example run), so its JSON and plot are checked by the same run."""
    proc = subprocess.run([sys.executable, "-m", "rollout.cli", "bench", "rl-modes", "--modes", "async1", "--steps", "20",
                           "--trainer-ranks", "1", "--replicas", "1", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    mode = json.load(open(tmp_path / "rl_modes_tiny.json"))["modes"]["async1"]
    logs = mode["steps"]
    assert [x["max_sample_staleness"] for x in logs] == [0] + [1] * 19
    rewards = [x["reward"] for x in logs]
    assert sum(rewards[-5:]) / 5 >= rewards[0] + 0.3, rewards
    assert all(x["push_verified"] for x in logs)
    assert mode["summary"]["step_s"] > 0 and os.path.isfile(tmp_path / "rl_modes_tiny.png")


# ---------------------------------------------------------------------------------------------- failures

@pytest.fixture()
def two_replicas(llama_path, make_server):
    """Two servers on the tiny model (not waited for), and ``serve(i)`` to start replica ``i`` again at its port."""
    ports = [restartable_port()]  # restarted at the same port: outside the ephemeral range
    ports.append(restartable_port(avoid=ports))

    def serve(i: int):  # one thread each: cores are shared (launch_server bounds the OpenMP spin)
        return make_server(llama_path, "--dtype", "float32", "--kv-cache-tokens", "2048", "--no-use-generation-config",
                           port=ports[i], num_threads=1, ready_timeout_s=None)

    return llama_path, ports, [serve(0), serve(1)], serve


class _KillOnBucket(WeightTarget):
    """A target that kills a replica's process after handing over ``after`` buckets (mid-push)."""

    def __init__(self, target, server, after: int):
        self.target, self.server, self.after, self.seen = target, server, after, 0
        self.dtype, self.device, self.buffers = target.dtype, target.device, target.buffers

    def begin(self, version):
        self.target.begin(version)

    def add(self, bucket):
        self.target.add(bucket)
        self.seen += 1
        if self.seen == self.after:
            self.server.kill()

    def commit(self):
        return self.target.commit()

    def push_adapter(self, name, config, named_tensors, version):
        return self.target.push_adapter(name, config, named_tensors, version)


def test_a_replica_killed_mid_push_is_named_the_rest_carry_on_and_it_rejoins(two_replicas):
    """Replica 1 dies in the middle of a push: the push fails within the group's timeout with an error
    naming it; replica 0 keeps its weights and serves; the next push reaches replica 0 alone; once
    replica 1 is back at its URL, ``heal`` takes it into a fresh group and a push brings it the current
    weights, after which both serve them."""
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from trainer_bridge import DistributedTarget, ReplicaError, ReplicaRouter, ReplicaSet, push_weights

    path, ports, servers, serve = two_replicas
    clients = [s.wait_ready(120).client(timeout_s=60) for s in servers]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    replicas = ReplicaSet(clients)
    router = ReplicaRouter(replicas)
    target = DistributedTarget(replicas, timeout_s=8)
    timeout = 8
    t0 = time.monotonic()
    with pytest.raises(ReplicaError) as err:
        push_weights(model, _KillOnBucket(target, servers[1], after=2), version="v1", bucket_bytes=16 << 10)
    assert time.monotonic() - t0 < 3 * timeout + 20
    assert err.value.replicas == [1] and f"127.0.0.1:{ports[1]}" in str(err.value)
    assert replicas.serving() == [0]
    assert clients[0].get_weight_version() == "default"  # nothing half-applied on the survivor
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert len(router.generate([[1, 2, 3]] * 3, sp)) == 3  # the rest keep serving
    fresh = ReplicaRouter(ReplicaSet(clients))  # one that still believes replica 1 is up: mid-rollout failure
    outs = fresh.generate([[1, 2, 3], [4, 5, 6], [7, 8, 9]], {**sp, "n": 2})
    assert [o.prompt_index for o in outs] == [0, 0, 1, 1, 2, 2]  # rerouted, merged in order
    assert fresh.failures[0].replica == 1 and f"127.0.0.1:{ports[1]}" in str(fresh.failures[0])
    assert fresh.replicas.serving() == [0]

    assert target.heal() is True  # the failed push must be redone, in a group without replica 1
    assert target.members == [0]
    result = push_weights(model, target, version="v1", bucket_bytes=16 << 10).result
    assert result.success, result.message
    assert router.get_weight_versions() == ["v1", None]

    servers[1] = serve(1).wait_ready(120)  # restarted at its URL, with the weights it was launched with
    assert target.heal() is True and sorted(target.members) == [0, 1]
    assert replicas.serving() == [0]  # it serves only once it holds the current weights
    result = push_weights(model, target, version="v1", bucket_bytes=16 << 10).result
    assert result.success, result.message
    assert replicas.serving() == [0, 1] and router.get_weight_versions() == ["v1", "v1"]
    want = model.state_dict()["model.layers.0.self_attn.q_proj.weight"].flatten()[:16].tolist()
    assert router.get_weights_by_name("model.layers.0.self_attn.q_proj.weight", 16) == pytest.approx(want)
    assert target.heal() is False  # nothing changed: no push needed
    target.close()
    for c in clients:
        c.close()


def test_an_adapter_push_to_a_dead_replica_is_named_and_the_healed_group_gets_it(two_replicas, tmp_path):
    """LoRA over the weight group with replica 1 dead: the push fails naming it, and replica 0 holds the
    whole adapter (its receive completed) or none, never part of one; after ``heal`` the push reaches
    replica 0 alone, and once replica 1 is back it rejoins and the next push brings it the adapter:
    both then serve it alike."""
    import json as _json

    from safetensors.torch import load_file

    from rollout.tools.tiny import make_tiny_adapter
    from trainer_bridge import DistributedTarget, ReplicaError, ReplicaRouter, ReplicaSet

    path, ports, servers, serve = two_replicas
    clients = [s.wait_ready(120).client(timeout_s=60) for s in servers]
    folder = make_tiny_adapter(path, str(tmp_path / "adapter"), r=4, lora_alpha=8, seed=3)
    tensors = [(n, t.float()) for n, t in load_file(os.path.join(folder, "adapter_model.safetensors")).items()]
    config = _json.load(open(os.path.join(folder, "adapter_config.json")))
    replicas = ReplicaSet(clients)
    router = ReplicaRouter(replicas)
    target = DistributedTarget(replicas, timeout_s=8)
    servers[1].kill()
    with pytest.raises(ReplicaError) as err:
        target.push_adapter("policy", config, tensors, "v1")
    assert 1 in err.value.replicas and f"127.0.0.1:{ports[1]}" in str(err.value)
    held = clients[0].get_server_info()["lora_adapters"]
    assert all(a["modules"] == len(tensors) // 2 for a in held)  # nothing half-loaded on the survivor
    assert target.heal() is True and target.members == [0]
    result = target.push_adapter("policy", config, tensors, "v1")
    assert result.success, result.message
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    alone = clients[0].generate(input_ids=[[1, 2, 3]], sampling_params=sp, lora_path="policy")[0].output_token_ids
    servers[1] = serve(1).wait_ready(120)
    assert target.heal() is True and sorted(target.members) == [0, 1] and replicas.serving() == [0]
    assert target.push_adapter("policy", config, tensors, "v2").success
    assert replicas.serving() == [0, 1]
    outs = [c.generate(input_ids=[[1, 2, 3]], sampling_params=sp, lora_path="policy")[0] for c in clients]
    assert [o.output_token_ids for o in outs] == [alone, alone] and {o.lora_name for o in outs} == {"policy"}
    assert len(router.generate([[1, 2, 3]] * 4, sp, lora_path="policy")) == 4
    target.close()
    for c in clients:
        c.close()


def test_a_replica_killed_mid_run_the_trainer_goes_on_and_it_rejoins(tmp_path, two_replicas):
    """The whole loop against two running servers, pushing deltas (``--delta-sync``: after the first full push
    only the changed elements, over the weight group): replica 1 is killed after step 2 and restarted at once
    (it takes a while to come up); every step still trains on a full batch, the loss of replica 1 is named in
    the step log, it rejoins when it answers again — holding the initial weights, it refuses the next delta by
    its base while replica 0 takes it, and gets that version in full sent to it alone, after which deltas go to
    both again — and the run ends with both replicas serving the last step's weights."""
    path, ports, servers, serve = two_replicas
    from weight_sync.process_group import free_port

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "WANDB_MODE": "offline"}
    urls = [a for p in ports for a in ("--engine-url", f"http://127.0.0.1:{p}")]
    steps = 40
    run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
                            str(free_port()), os.path.join(ROOT, "examples", "grpo_disaggregated.py"), *urls,
                            "--model", path, "--steps", str(steps), "--max-new-tokens", "24", "--out-dir", str(out),
                            "--no-wandb", "--group-timeout", "8", "--delta-sync"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in run.stdout:
        lines.append(line)
        if line.split()[:1] == ["2"] and servers[1].proc.poll() is None:
            servers[1].kill()
            servers[1] = serve(1)
    assert run.wait(300) == 0, "".join(lines)[-4000:]
    logs = json.load(open(out / "steps.json"))
    events = [e for x in logs for e in x["replica_events"]]
    assert any(f"replica 1 (http://127.0.0.1:{ports[1]})" in e for e in events), events
    assert any("rejoined" in e for e in events), events
    assert min(x["num_serving_replicas"] for x in logs) == 1 and logs[-1]["num_serving_replicas"] == 2
    assert all(x["push_verified"] for x in logs) and all(x["mismatch_max"] < 1e-4 for x in logs)
    assert f"replica versions: ['step-{steps}', 'step-{steps}']" in "".join(lines)
    # the rejoin's push: replica 0 takes the delta, replica 1 (on the initial weights) gets the version in full alone
    assert any("a delta was refused" in e and "replica 1" in e and "in full to that replica alone" in e
               for e in events), events
    assert logs[0]["sync_phases"]["delta"] is False and all(x["sync_phases"]["delta"] for x in logs[-5:])


def test_the_process_group_target_reaches_engine_ranks_in_other_processes(llama_path):
    """``DistributedTarget`` over an in-process engine whose TP rank 1 is a spawned process: both ranks
    join the trainer's group, each bucket is one broadcast from a flat buffer, the update lands on
    both ranks as one version, and ``verify_pushed`` reads it back."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout import RolloutEngine
    from trainer_bridge import DistributedTarget, push_weights
    from trainer_bridge.grpo import verify_pushed

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    engine = RolloutEngine(llama_path, dtype="float32", tp_size=2, kv_cache_tokens=1024, use_generation_config=False)
    try:
        assert len(engine.worker_pids()) == 1 and engine.worker_pids()[0] != os.getpid()  # rank 1: its own process
        target = DistributedTarget(engine, timeout_s=30)
        assert target.members == [0]
        for version in ("v1", "v2"):  # the second push reuses the buffers of the first
            stats = push_weights(model, target, version=version, bucket_bytes=16 << 10)
            assert stats.result.success, stats.result.message
            assert stats.num_buckets > 2 and engine.get_weight_version() == version
            assert verify_pushed(stats, engine)
        assert engine.get_weights_checksum() == _checksum(model, engine.dtype)
        target.close()
    finally:
        engine.shutdown()


def _checksum(model, dtype) -> str:
    from weight_sync.checksum import checksum_named_tensors

    tied = model.config.tie_word_embeddings
    return checksum_named_tensors([(n, t) for n, t in model.state_dict().items()
                                   if not (tied and n == "lm_head.weight")], dtype=dtype)
