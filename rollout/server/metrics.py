"""Prometheus metrics of one server (``prometheus_client``, a registry of its own).

Counted as requests finish: requests and failures per route, prompt and generated tokens,
end-to-end latency; weight updates and their duration. Read from the engine at scrape time: running
and queued sequences, KV-cache usage, prefix-cache hit rate, mean forward and sampling time per
step, and the published weight version.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily

from rollout.outputs import RolloutOutput, WeightResult


class _EngineCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        stats = self.engine.get_stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"rollout_{name}", doc, value=value)

        yield gauge("num_running_seqs", "Sequences in the running batch", stats["num_running"])
        yield gauge("num_queued_seqs", "Sequences waiting to be scheduled", stats["num_waiting"])
        yield gauge("kv_cache_usage", "Fraction of KV blocks in use",
                    1 - stats["num_free_blocks"] / max(1, stats["num_blocks"]))
        yield gauge("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens looked up",
                    stats["prefix_cache_hit_tokens"] / max(1, stats["prefix_cache_queries"]))
        yield gauge("step_forward_seconds", "Mean forward time per step",
                    stats["forward_time_s"] / max(1, stats["num_steps"]))
        yield gauge("step_sample_seconds", "Mean sampling time per sampling step",
                    stats["sample_time_s"] / max(1, stats["num_sample_steps"]))
        yield gauge("num_steps", "Scheduler steps run", stats["num_steps"])
        yield gauge("num_preemptions", "Sequences preempted (their KV dropped, recomputed later)",
                    stats["num_preemptions"])
        yield gauge("num_graph_replays", "Decode steps replayed from a captured CUDA graph", stats["num_graph_replays"])
        yield gauge("num_eager_decode_steps", "Decode steps run eagerly (no captured graph fits them, or none)",
                    stats["num_eager_decode_steps"])
        yield gauge("num_graph_samples", "Sampling steps done by a captured sampler graph", stats["num_graph_samples"])
        if "spec_verify_ct" in stats:  # speculative decoding on (SGLang's counter names)
            yield gauge("spec_verify_ct", "Speculative verify steps run", stats["spec_verify_ct"])
            yield gauge("spec_draft_token_num", "Guessed tokens verified", stats["spec_draft_token_num"])
            yield gauge("spec_accept_token_num", "Guessed tokens accepted", stats["spec_accept_token_num"])
            yield gauge("spec_declined_token_num", "Guessed tokens the cost policy left out (not worth their rows)",
                        stats["spec_declined_token_num"])
        info = InfoMetricFamily("rollout_weight_version", "The published weight version")
        info.add_metric([], {"version": self.engine.get_weight_version()})
        yield info


class ServerMetrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("rollout_requests", "Generation requests received", ["route"], registry=r)
        self.failures = Counter("rollout_request_failures", "Generation requests that failed", ["route"], registry=r)
        self.prompt_tokens = Counter("rollout_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("rollout_generation_tokens", "Tokens generated", registry=r)
        self.latency = Histogram("rollout_request_latency_seconds", "End-to-end request latency", registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.updates = Counter("rollout_weight_updates", "Weight updates", ["success"], registry=r)
        self.update_seconds = Histogram("rollout_weight_update_seconds", "Weight update duration", registry=r,
                                        buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.stream_pending_bytes = Gauge("rollout_stream_pending_bytes", "Bytes of stream events waiting in the "
                                          "server for their readers, all streams", registry=r)
        self.stream_pending_peak = Gauge("rollout_stream_pending_bytes_peak", "The most bytes that waited for one "
                                         "stream's reader", registry=r)
        self.streams_dropped = Counter("rollout_streams_dropped", "Streams whose reader took nothing for "
                                       "--stream-stall-timeout-s (their requests aborted)", registry=r)
        self._peak = 0
        r.register(_EngineCollector(engine))

    def started(self, route: str) -> None:
        self.requests.labels(route).inc()

    def failed(self, route: str) -> None:
        self.failures.labels(route).inc()

    def finished(self, route: str, outs: list[RolloutOutput], seconds: float) -> None:
        prompts = {o.prompt_index: len(o.prompt_token_ids) for o in outs}
        self.prompt_tokens.inc(sum(prompts.values()))
        self.generation_tokens.inc(sum(len(o.output_token_ids) for o in outs))
        self.latency.observe(seconds)

    def weight_update(self, result: WeightResult) -> None:
        self.updates.labels(str(result.success).lower()).inc()
        if result.success:
            self.update_seconds.observe(result.seconds)

    def stream_pending(self, change: int, now: int) -> None:
        self.stream_pending_bytes.inc(change)
        if now > self._peak:
            self._peak = now
            self.stream_pending_peak.set(now)

    def stream_dropped(self) -> None:
        self.streams_dropped.inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), "text/plain; version=0.0.4; charset=utf-8"
