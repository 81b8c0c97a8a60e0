"""Tools around the engine, not part of it: tiny local models (tests, demo, benchmarks), the
SmolLM2 fetcher, the throughput benchmark, the rollout demo and reference helpers from
``transformers``. Nothing in the engine imports this package; ``rollout bench`` and ``rollout demo``
(``rollout/cli.py``) do.
"""
