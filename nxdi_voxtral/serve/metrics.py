"""Prometheus metrics of one server process (own registry: several apps in one process do not collide)."""
from __future__ import annotations

import statistics
import threading
from collections import deque

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
        self.running = Gauge("voxtral_running", "sequences in the device batch now (at most --max-batch)", registry=r)
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


OCCUPANCY_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60)


class BatchMetrics:
    """What continuous batching does, as Prometheus series on the server's registry and a summary for /health:
    sequences per step, the wait from admission to prefill, generated tokens per second of device time."""
    RECENT_WAITS = 1000  # requests whose queue waits /health summarises (last, p50, max)
    RECENT_CALLS = 200   # prefills and steps the tokens/s figure covers: recent, yet more than one call's noise

    def __init__(self, registry, max_batch: int):
        Gauge("voxtral_max_batch", "most sequences stepped at once (--max-batch)", registry=registry).set(max_batch)
        self.occupancy = Histogram("voxtral_batch_occupancy", "active sequences per decode step",
                                   buckets=OCCUPANCY_BUCKETS, registry=registry)
        self.queue_wait = Histogram("voxtral_queue_wait_seconds", "seconds from admission to the start of prefill",
                                    buckets=WAIT_BUCKETS, registry=registry)
        self.tokens_per_s = Gauge("voxtral_generated_tokens_per_second", "tokens generated (all sequences) per "
                                  "second of device time, over the last prefills and steps", registry=registry)
        self.lock = threading.Lock()  # /health reads the windows from another thread
        self.waits: deque[float] = deque(maxlen=self.RECENT_WAITS)
        self.recent: deque[tuple[int, float]] = deque(maxlen=self.RECENT_CALLS)  # (tokens, seconds) per call
        self.rate = 0.0  # tokens per second over `recent`
        self.steps = self.sequences_stepped = 0

    def waited(self, seconds: float) -> None:
        self.queue_wait.observe(seconds)
        with self.lock:
            self.waits.append(seconds)

    def prefilled(self, seconds: float) -> None:
        self._generated(1, seconds)

    def stepped(self, sequences: int, tokens: int, seconds: float) -> None:
        self.occupancy.observe(sequences)
        self.steps += 1
        self.sequences_stepped += sequences
        self._generated(tokens, seconds)

    def _generated(self, tokens: int, seconds: float) -> None:
        with self.lock:
            self.recent.append((tokens, seconds))
            busy = sum(s for _, s in self.recent)
            self.rate = sum(t for t, _ in self.recent) / busy if busy > 0 else 0.0
        self.tokens_per_s.set(self.rate)

    def summary(self) -> dict:
        with self.lock:
            waits = list(self.waits)
        return {"occupancy_mean": round(self.sequences_stepped / self.steps, 3) if self.steps else 0.0,
                "tokens_per_s": round(self.rate, 1),
                "queue_wait_s": {"last": round(waits[-1], 6), "p50": round(statistics.median(waits), 6),
                                 "max": round(max(waits), 6)} if waits else None}
