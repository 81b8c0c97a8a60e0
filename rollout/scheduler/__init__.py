"""scheduler/: continuous batching, on the engine loop's thread.

- ``scheduler.py``: ``Scheduler`` (queues, token budget, chunked prefill, forking ``n`` samples,
  preemption, stop checks, publishing weights) and ``SchedulerStats``;
- ``block_manager.py``: KV block accounting (ref counts, sharing, the version-keyed prefix cache);
- ``request.py``: ``Request`` (one prompt, ``n`` samples) and ``Sequence`` (one sample);
- ``batch.py``: what crosses scheduler -> worker (``ModelWorkerBatch``, ``SamplingInputs``, results).

May import: the top-level modules and ``worker/``'s ``BaseTpWorker`` interface (the worker it drives);
``batch.py`` and ``request.py`` import nothing of the engine's but ``random`` and ``sampling_params``.
"""

from rollout._moved import forward_old_names

__getattr__ = forward_old_names(__name__, "rollout.scheduler.scheduler")  # the names of the old rollout/scheduler.py
