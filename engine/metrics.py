"""Prometheus metrics for the engine, in their own registry, served as text on the metrics port."""

from __future__ import annotations

import threading

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)

# The *_created series only double the output; the engine process owns prometheus_client alone.
disable_created_metrics()

# From 0.1 ms: the small demo models answer in well under a millisecond, resnet-mini in a few.
_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "meshcache_engine_requests", "Inference requests received, per model and protocol",
            ["model", "protocol"], registry=self.registry,
        )
        self.failures = Counter(
            "meshcache_engine_request_failures", "Inference requests that failed, per model and reason",
            ["model", "protocol", "reason"], registry=self.registry,
        )
        self.latency = Histogram(
            "meshcache_engine_request_duration_seconds", "Inference request latency inside the engine",
            ["model", "protocol"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.queue_time = Histogram(
            "meshcache_engine_queue_duration_seconds", "Time a request waited in its model's batch queue",
            ["model"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        # Read at scrape time from the queue itself (Triton's nv_inference_pending_request_count).
        self.pending = Gauge(
            "meshcache_engine_pending_requests", "Requests waiting in a model's batch queue", ["model"],
            registry=self.registry,
        )
        # The OpenAI routes' usage, as their answers report it: what a cache in front saves shows
        # here as tokens the engine did not have to read or write.
        self.tokens = Counter(
            "meshcache_engine_tokens", "Tokens of OpenAI-route answers (their usage), per model and kind "
            "(prompt, completion)", ["model", "kind"], registry=self.registry,
        )
        self.batch_size = Histogram(
            "meshcache_engine_batch_size", "Rows per onnxruntime run", ["model"],
            buckets=_BATCH_BUCKETS, registry=self.registry,
        )

    def serve(self, port: int, host: str) -> None:
        """Serve /metrics from a daemon thread (prometheus_client's own small HTTP server)."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._server, self._thread = server, thread

    def stop(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            threading.Thread(target=server.shutdown, daemon=True).start()
