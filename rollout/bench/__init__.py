"""``rollout bench``: the rollout benchmark suite (see ``benchmarks/README.md``).

Subcommands, each writing JSON (machine, versions, config, raw numbers) and a PNG:

- ``throughput``: RL-shaped generation (``grpo-short``, ``grpo-long``) and prefill-only scoring
  (``score``) on our engine and on Hugging Face ``transformers`` in one run, with a switch per
  engine feature;
- ``weight-sync``: every weight-update path against its raw transport;
- ``rl-step``: effective samples/s of whole RL steps (rollout, long tail, pause, sync, cache refill);
- ``limits``: this machine's ceilings at the model's decode shapes and the engine's decode step
  against them;
- ``server-load``: the HTTP server against the in-process engine, then while weights refresh;
- ``fidelity``: the throughput cost of sampling masks and of the batch-invariant mode;
- ``acceptance``: how many of the suffix drafter's guesses exact speculation would accept on two epochs
  of real rollouts (replayed from plain decoding's outputs).
- ``speculation``: exact speculation on and off on one engine — two epochs with a training step between
  (long tail, whole rollout, acceptance) and batch-1 decoding of a repeated prompt.

``rollout bench --compare A.json B.json`` prints every number of two results side by side.
"""
