"""GET /metrics: Prometheus text format (prometheus-client), one registry per app, named as vLLM's are.

Counters: requests by path and status, prompt and generated tokens. Gauges read from the scheduler at scrape
time: requests waiting, rows running. The prefix cache (--prefix-cache-bytes), read at scrape time too (absent
while it is off): lookups, hits, tokens reused and evictions, and the bytes it holds. Histograms: time to first
token (request arrival to its first token), inter-token latency (between consecutive tokens of one choice) and
request duration.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_TTFT = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0)


class Metrics:
    """Thread-safe (prometheus-client's metrics are): the scheduler thread reports tokens, the app requests."""

    def __init__(self, app) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("gpt2edge_requests", "HTTP requests by route and status.", ["path", "status"],
                                registry=r)  # fmt: skip
        self.prompt_tokens = Counter("gpt2edge_prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.generation_tokens = Counter("gpt2edge_generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("gpt2edge_time_to_first_token_seconds", "From a request's arrival to its first token.",
                              buckets=_TTFT, registry=r)  # fmt: skip
        self.itl = Histogram("gpt2edge_inter_token_latency_seconds", "Between consecutive tokens of one choice.",
                             buckets=_LATENCY, registry=r)  # fmt: skip
        self.duration = Histogram("gpt2edge_request_duration_seconds", "HTTP request duration (streams: to the end).",
                                  buckets=_TTFT, registry=r)  # fmt: skip
        waiting = Gauge("gpt2edge_requests_waiting", "Requests queued for a cache row.", registry=r)
        running = Gauge("gpt2edge_rows_running", "Rows (choices) decoding now.", registry=r)
        r.register(_PrefixCacheCollector(app))
        waiting.set_function(lambda: _stat(app, "waiting"))
        running.set_function(lambda: _stat(app, "running"))

    def token(self, row) -> None:
        """A row took a token (the scheduler thread)."""
        now = time.monotonic()
        job = row.job
        if job.first_token_at is None:
            job.first_token_at = now
            self.ttft.observe(now - job.created)
        elif row.last_token_at:
            self.itl.observe(now - row.last_token_at)
        row.last_token_at = now
        self.generation_tokens.inc()


def _stat(app, key: str) -> float:
    scheduler = app.state.scheduler
    return 0.0 if scheduler is None else float(scheduler.stats()[key])


class _PrefixCacheCollector:
    """The continuous scheduler's prefix cache (--prefix-cache-bytes): its counters, as vLLM's prefix_cache_*."""

    _COUNTERS = (("lookups", "Prompts looked up in the prefix cache."),
                 ("hits", "Prompts that reused at least one cached block."),
                 ("tokens_reused", "Prompt tokens taken from the prefix cache instead of prefilled."),
                 ("evictions", "Prefix-cache blocks evicted (its byte bound or memory pressure)."))  # fmt: skip

    def __init__(self, app) -> None:
        self.app = app

    def describe(self) -> list:
        return []  # collected at scrape time only (the scheduler may not be loaded at registration)

    def collect(self):
        scheduler = self.app.state.scheduler
        stats = {} if scheduler is None else scheduler.stats()
        if "prefix_lookups" not in stats:
            return
        for key, doc in self._COUNTERS:
            yield CounterMetricFamily(f"gpt2edge_prefix_cache_{key}", doc, value=stats[f"prefix_{key}"])
        yield GaugeMetricFamily("gpt2edge_prefix_cache_bytes", "Bytes the prefix cache holds.",
                                value=stats["prefix_bytes_held"])  # fmt: skip
