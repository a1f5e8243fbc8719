"""Prometheus metrics of one server process (own registry: several apps in one process do not collide)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("voxtral_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.latency = Histogram("voxtral_request_duration_seconds", "request latency by endpoint and status",
                                 ["endpoint", "status"], buckets=LATENCY_BUCKETS, registry=r)
        self.rejected = Counter("voxtral_rejected", "requests refused with 503 by reason", ["reason"], registry=r)
        self.queue_depth = Gauge("voxtral_queue_depth", "requests waiting for the device", registry=r)
        self.running = Gauge("voxtral_running", "requests running on the device (0 or 1)", registry=r)
        self.cancelled = Counter("voxtral_cancelled", "generations stopped because the client left", registry=r)
        self.tokens = Counter("voxtral_tokens_generated", "tokens generated", registry=r)
        self.audio_seconds = Counter("voxtral_audio_seconds", "seconds of audio transcribed", registry=r)
        self.tau = Histogram("voxtral_spec_tau", "mean accepted tokens per verify pass, per request",
                             buckets=(1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12, 16), registry=r)
        self.passes_per_token = Histogram("voxtral_target_passes_per_token", "target passes / generated tokens",
                                          buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.01), registry=r)
        self.ready = Gauge("voxtral_ready", "1 when the server takes traffic", registry=r)
        self.version = Info("voxtral_artifact", "the live model version", registry=r)
        self.swaps = Counter("voxtral_swaps", "hot swap attempts by result", ["result"], registry=r)
        self.restarts = Counter("voxtral_worker_restarts", "model reopened after a rank worker died", registry=r)

    def set_version(self, version) -> None:
        self.version.info({"version": version.id, "path": version.path, "source": version.kind})
