"""Prometheus metrics for one gateway app, in a registry of its own.

Each ``GatewayMetrics`` owns its ``CollectorRegistry``: two apps in one process
(tests, or a gateway and an encoder server side by side) never collide on the
global registry. Labels are bounded on purpose: the policy's rule name, never
the model string a client sent, which could be anything.

Encoder figures the adapters already count (queue depth, cache hits) are read
at scrape time by a collector, so the encode path pays nothing for them; batch
size and forward-pass latency come from the batcher's ``on_batch`` hook.

Under several worker processes (``modalgate serve --workers N``) the values live
in Prometheus's multiprocess files (``PROMETHEUS_MULTIPROC_DIR``, set before the
workers import prometheus_client), and a scrape of any worker sums them all; the
encoder figures read at scrape time are then the answering worker's own.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from modalgate.gateway.gate.outcome import GateOutcome

# Validation is tens of microseconds for a text request, seconds for a remote fetch.
VALIDATION_BUCKETS = (
    *(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01),
    *(0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
BODY_BUCKETS = tuple(float(1024 * 4**i) for i in range(10))  # 1 KiB .. 256 MiB
# Time to response headers: a busy LLM server queues before it answers.
UPSTREAM_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STREAM_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
BATCH_SIZE_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
BATCH_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
MULTIPROC_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_dir() -> str | None:
    """Where the workers' metric files are, when this process is one of several."""
    return os.environ.get(MULTIPROC_DIR_VARIABLE) or None


class GatewayMetrics:
    """Every metric of one app; the methods are the observer callbacks the app plugs in."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.multiprocess_dir = multiprocess_dir()
        r = self.registry
        self.requests = Counter(
            "modalgate_requests",
            "Chat requests the gate decided, by policy rule, mode, outcome and error code.",
            ["model", "mode", "outcome", "code"],
            registry=r,
        )
        self.validation_seconds = Histogram(
            "modalgate_validation_seconds",
            "Reading, validating and fetching media for one request, until forward or refusal.",
            buckets=VALIDATION_BUCKETS,
            registry=r,
        )
        self.body_bytes = Histogram(
            "modalgate_request_body_bytes",
            "Size of the chat request bodies the gate read.",
            buckets=BODY_BUCKETS,
            registry=r,
        )
        self.upstream_seconds = Histogram(
            "modalgate_upstream_seconds",
            "Time until the upstream's response headers (or its failure).",
            ["route", "status_class"],
            buckets=UPSTREAM_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "modalgate_upstream_errors",
            "Upstream failures, by error code (upstream_unavailable, upstream_timeout, ...).",
            ["route", "code"],
            registry=r,
        )
        self.upstream_response_seconds = Histogram(
            "modalgate_upstream_response_seconds",
            "Time until the last byte of the upstream's response (whole streams).",
            ["route"],
            buckets=STREAM_BUCKETS,
            registry=r,
        )
        self.policy_reloads = Counter(
            "modalgate_policy_reloads",
            "Policy reloads, by outcome.",
            ["outcome"],
            registry=r,
        )
        for outcome in ("ok", "error"):  # both series exist from the start, at zero
            self.policy_reloads.labels(outcome)
        self.policy_last_reload = Gauge(
            "modalgate_policy_last_reload_timestamp_seconds",
            "Unix time of the last successful policy reload.",
            registry=r,
            multiprocess_mode="max",  # the latest reload among the workers
        )
        self.shadow_refusals = Counter(
            "modalgate_shadow_refusals",
            "Requests shadow mode forwarded that the policy refuses, by rule and the code"
            " enforcing would have answered.",
            ["model", "code"],
            registry=r,
        )
        self.fallback_routes = Counter(
            "modalgate_fallback_routes",
            "Requests routed from one policy rule's model to another.",
            ["from_model", "to_model"],
            registry=r,
        )
        self.encoder_batch_size = Histogram(
            "modalgate_encoder_batch_size",
            "Images per encoder forward pass.",
            ["encoder"],
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )
        self.encoder_batch_seconds = Histogram(
            "modalgate_encoder_batch_seconds",
            "Duration of one encoder forward pass (preprocessing included).",
            ["encoder"],
            buckets=BATCH_SECONDS_BUCKETS,
            registry=r,
        )
        self.verdict_cache_lookups = Counter(
            "modalgate_verdict_cache_lookups",
            "Media parts looked up among those judged before, by their bytes (a hit is"
            " not walked again), by result.",
            ["result"],
            registry=r,
        )
        self._cache_results = {
            True: self.verdict_cache_lookups.labels("hit"),
            False: self.verdict_cache_lookups.labels("miss"),
        }
        self._encoders = _EncoderCollector()
        r.register(self._encoders)
        # Each series once: ``labels()`` checks, locks and builds a key on every call,
        # and these are called on every request. Their labels are bounded (rules,
        # routes, codes), so are these.
        self._requests: dict[tuple[str, str, str, str], Any] = {}
        self._upstream: dict[tuple[str, str], Any] = {}
        self._stream_ends: dict[str, Any] = {}

    def observe_outcome(self, outcome: GateOutcome) -> None:
        """An ``OutcomeObserver``: one count and two observations per decided request."""
        rule = outcome.rule or "unknown"
        verb = "shadowed" if outcome.shadowed else "accepted" if outcome.accepted else "rejected"
        key = (rule, outcome.mode or "", verb, outcome.code or "")
        series = self._requests.get(key)
        if series is None:
            series = self._requests[key] = self.requests.labels(*key)
        series.inc()
        if outcome.shadowed:
            self.shadow_refusals.labels(rule, outcome.code or "").inc()
        self.validation_seconds.observe(outcome.seconds)
        self.body_bytes.observe(outcome.body_bytes)
        if outcome.routed_from is not None and outcome.accepted:
            self.routed(outcome.routed_from, outcome.rule or "unknown")

    def observe_upstream(
        self, seconds: float, status: int | None, error_code: str | None, route: str = "default"
    ) -> None:
        """No response at all (refused, timed out) is ``status=None``: ``status_class="error"``."""
        key = (route, f"{status // 100}xx" if status is not None else "error")
        series = self._upstream.get(key)
        if series is None:
            series = self._upstream[key] = self.upstream_seconds.labels(*key)
        series.observe(seconds)
        if error_code:
            self.upstream_errors.labels(route, error_code).inc()

    def observe_stream_end(self, seconds: float, route: str = "default") -> None:
        series = self._stream_ends.get(route)
        if series is None:
            series = self._stream_ends[route] = self.upstream_response_seconds.labels(route)
        series.observe(seconds)

    def policy_reload(self, ok: bool) -> None:
        self.policy_reloads.labels("ok" if ok else "error").inc()
        if ok:
            self.policy_last_reload.set(time.time())

    def routed(self, from_rule: str, to_rule: str) -> None:
        self.fallback_routes.labels(from_rule, to_rule).inc()

    def verdict_cache_lookup(self, hit: bool) -> None:
        self._cache_results[hit].inc()

    def watch_encoder(self, adapter: object, name: str) -> None:
        """Export what ``adapter`` counts, and hook its batcher; attributes it lacks are skipped.

        Watching another adapter under the same ``name`` replaces the first.
        """
        self._encoders.watch(name, adapter)
        batcher = getattr(adapter, "batcher", None)
        if batcher is not None and hasattr(batcher, "on_batch"):
            size = self.encoder_batch_size.labels(name)
            seconds = self.encoder_batch_seconds.labels(name)

            def on_batch(items: int, elapsed: float) -> None:
                size.observe(items)
                seconds.observe(elapsed)

            batcher.on_batch = on_batch

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition (body, content type); OpenMetrics when ``accept`` asks for it."""
        encoder, content_type = choose_encoder(accept or "")
        if self.multiprocess_dir is None:
            return encoder(self.registry), content_type
        registry = CollectorRegistry()  # every worker's files, read afresh for each scrape
        MultiProcessCollector(registry, self.multiprocess_dir)
        registry.register(self._encoders)
        return encoder(registry), content_type

    def worker_exited(self) -> None:
        """Let the files of this worker's live series go (a worker's last act)."""
        if self.multiprocess_dir is not None:
            mark_process_dead(os.getpid(), self.multiprocess_dir)


def metrics_endpoint(metrics: GatewayMetrics) -> Callable[[Request], Awaitable[Response]]:
    """A Starlette endpoint for ``Route("/metrics", ..., methods=["GET"])``."""

    async def endpoint(request: Request) -> Response:
        body, content_type = metrics.render(request.headers.get("accept"))
        return Response(body, headers={"content-type": content_type})

    return endpoint


# (metric suffix, adapter part, its attribute, is a counter, help)
_ENCODER_FIGURES = (
    ("queue_depth", "batcher", "queue_depth", False, "Images waiting for the model thread."),
    ("batches", "batcher", "batches", True, "Encoder forward passes."),
    ("images", "batcher", "items", True, "Images through the encoder's forward passes."),
    ("cache_hits", "cache", "hits", True, "Embedding cache hits."),
    ("cache_misses", "cache", "misses", True, "Embedding cache misses."),
    ("cache_bytes", "cache", "size_bytes", False, "Bytes of embeddings held in the cache."),
)


class _EncoderCollector(Collector):
    """Reads the adapters' own counters at scrape time (the scrape runs on the event loop
    or a thread; plain int reads are safe either way)."""

    def __init__(self) -> None:
        self._adapters: dict[str, object] = {}
        self._lock = threading.Lock()

    def watch(self, name: str, adapter: object) -> None:
        with self._lock:
            self._adapters[name] = adapter

    def describe(self) -> list[Metric]:
        return []  # the series depend on the adapters watched: nothing to check at register

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            adapters = list(self._adapters.items())
        for suffix, part, attribute, counter, help_text in _ENCODER_FIGURES:
            name = f"modalgate_encoder_{suffix}"
            family = (
                CounterMetricFamily(name, help_text, labels=["encoder"])
                if counter
                else GaugeMetricFamily(name, help_text, labels=["encoder"])
            )
            for encoder, adapter in adapters:
                value = getattr(getattr(adapter, part, None), attribute, None)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    family.add_metric([encoder], value)
            if family.samples:
                yield family
