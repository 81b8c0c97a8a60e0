"""scheduler/: continuous batching, on the engine loop's thread.

- ``scheduler.py``: ``Scheduler``, the loop over its collaborators (queues, token budget, chunked prefill,
  forking ``n`` samples, preemption, batch building, publishing weights) and ``SchedulerStats``;
- ``results.py``: ``ResultFolder``, a step's result folded into sequences and requests in one place (tokens,
  logprobs, masks, verified guesses, prompt logprobs, stop checks);
- ``sessions.py``: ``SessionTable`` and ``SessionKv``, the sessions and the KV each holds between turns;
- ``block_manager.py``: KV block accounting (ref counts, sharing, the version-keyed prefix cache);
- ``request.py``: ``Request`` (one prompt, ``n`` samples) and ``Sequence`` (one sample).

What crosses scheduler -> worker (``ModelWorkerBatch``, ``SamplingInputs``, results) is ``rollout/batch.py``,
below both.

May import: the top-level modules (``batch``, ``config``, ``sampling_params``), ``speculative/`` and
``worker/``'s ``BaseTpWorker`` interface (the worker it drives); ``request.py`` imports nothing of the
engine's but ``sampling_params``.
"""

from rollout._moved import forward_old_names

__getattr__ = forward_old_names(__name__, "rollout.scheduler.scheduler")  # the names of the old rollout/scheduler.py
